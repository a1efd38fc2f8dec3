#!/usr/bin/env bash
# Issue 11's head report in one device call: the head ops' conformance (quick cases first, so a
# wrong kernel stops the run early), the head bench with Nsight Compute per kernel at B=8 K=15,
# then the full bench (docs/performance.{md,json}) and the head ops' and draft block's
# conformance with the heavy head cases. Run from a folder holding v/dflash-bench and
# v/dflash-conformance (release builds with --features cuda), COMMIT set, OUT the output folder.
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
step() { local name=$1; shift; local t0=$(date +%s); "$@"; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s" >> $R/steps.txt; return $rc; }
step confq timeout 150 ./v/dflash-conformance --only unary_topk,proposal_argmax --skip-heavy --out $R/confq > $R/confq.log 2>&1
if ! grep -qE "^ *FAIL" $R/confq.log; then
  step head timeout 60 ./v/dflash-bench --only head --out $R/head > $R/head.log 2>&1
  step ncuh timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum,smsp__inst_executed.sum --kernel-name regex:"unary_topk|proposal_argmax" --launch-count 16 --csv ./v/dflash-bench --only head --shape 8,15,4096 > $R/ncu-head.csv 2>> $R/ncu.log
  step bench timeout 200 ./v/dflash-bench --commit ${COMMIT} --out $R/perf > $R/bench.log 2>&1
  # The heavy 120- and 64-column cases (the widest column tiles on the official head and
  # shortlist);
  # their rows are in the log as they pass (the runner's closing checks may outlast the limit).
  step conf timeout ${HEAVY_S:-45} ./v/dflash-conformance --only unary_topk/full_official_h2048_n120,unary_topk/indexed_official_shortlist_h2048_n64 --out $R/conf > $R/conf.log 2>&1
fi
cd $OUT && tar czf r.tgz r
cat $R/steps.txt
grep -hE "^- result" $R/confq.log $R/conf.log; grep -hE "^ *(ok|FAIL)" $R/conf.log; grep -hE "FAIL" $R/confq.log | head -8
python3 - $R/ncu-head.csv <<'PY'
import csv, sys
hdr = None
for r in csv.reader(open(sys.argv[1])):
    if r and r[0] == 'ID': hdr = r; continue
    if hdr and len(r) == len(hdr):
        d = dict(zip(hdr, r)); print(d['Kernel Name'][:28], d['Grid Size'], d['Metric Name'][:22], d['Metric Value'])
PY
grep "^\[" $R/bench.log | grep -v "gemm " | cut -c12- | grep -E "topk|argmax|block|round B|attention.*B=1 K=15"
