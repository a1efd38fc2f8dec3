#!/usr/bin/env bash
# Issue 11: the attention ops' cluster merge, xtask/gpu/cluster-merge.patch: where the sm_90a
# warpgroup pairs run 2 to 16 splits (B = 1, K = 15), a row block's splits are one
# thread-block cluster (16 blocks: a non-portable size) that merges their partials through
# distributed shared memory and writes the output: no FP32 partials in global memory and no
# merge kernel. Compile-checked only (NVRTC 12.9, sm_90a: `_d128_ks2_cm` 159 / 162
# registers, no spills, no ptxas warning; every other entry as without the patch); never run
# on a GPU. The patch adds conformance cases that reach clusters of 2, 4 and 8 (16: the
# existing f1000 / window 2048 cases and the benchmark shapes) on a 132-SM device; the cluster
# form is taken only where cuOccupancyMaxActiveClusters places every cluster of the call at
# once, so the last lines say whether the `_cm` kernels ran at B=1 K=15 4096 at all (if not,
# the A/B compares the same kernels).
# Build: `git apply xtask/gpu/cluster-merge.patch`, `cargo build --release -p xtask --features
# cuda`; put the stripped dflash-bench and dflash-conformance in v/, main's dflash-bench as
# v/dflash-bench-a, and ncu_agg.py beside this script; OUT the output folder. One device call,
# in order of priority (a step that could run past LIM seconds, default 585, is skipped):
# both attention ops' conformance (heavy cases included; the sm_90a, now the cluster merge
# where it applies, and the portable variants), attention A/B twice (B first: the A binary
# compiles its kernels on its first run), the draft block's conformance, Nsight Compute of
# the attention kernels at B=1 K=15 4096 (B, then A), and rounds A/B (quick).
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader > $R/gpu.txt
T0=$(date +%s); LIM=${LIM:-585}
step() {  # step NAME SECONDS CMD...: run under `timeout SECONDS`, skipped if it could pass LIM
  local name=$1 need=$2; shift 2
  if [ $(( $(date +%s) - T0 + need )) -gt $LIM ]; then echo "$name skipped" >> $R/steps.txt; return; fi
  local t0=$(date +%s); timeout $need "$@"; echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> $R/steps.txt
}
bench() { case $1 in a*) echo ./v/dflash-bench-a;; *) echo ./v/dflash-bench;; esac; }
att() { step att$1 $2 $(bench $1) --only attention --out $R/att$1 > $R/att$1.log 2>&1; }
step conf 210 ./v/dflash-conformance --only softmax_attention/,sliding_window_attention/ --out $R/conf > $R/conf.log 2>&1
att b 90; att a 160; att b2 40; att a2 40
step confb 120 ./v/dflash-conformance --only draft_block --skip-heavy --out $R/confb > $R/confb.log 2>&1
for v in b a; do
  step ncu$v 90 ncu --clock-control none --kernel-name regex:attention --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv $(bench $v) --only attention --shape 1,15,4096 > $R/ncu$v.csv 2> $R/ncu$v.err
  python3 ncu_agg.py $R/ncu$v.csv > $R/agg$v.txt 2>&1
done
step rounda 60 $(bench a) --only round --quick --commit before --out $R/rounda > $R/rounda.log 2>&1
step roundb 60 $(bench b) --only round --quick --commit after --out $R/roundb > $R/roundb.log 2>&1
cd $OUT && tar czf r.tgz r
cat $R/steps.txt $R/gpu.txt
for f in conf confb; do [ -f $R/$f.log ] && { echo "$f: $(grep -E "result:" $R/$f.log)"; grep -E "FAIL|panic" $R/$f.log | head -8; }; done
for v in b a b2 a2; do echo "== att$v"; grep -E "^\| (sliding|softmax)" $R/att$v.log | cut -d'|' -f2-8 | tr -s ' '; done
grep -hE "attention" $R/aggb.txt $R/agga.txt | cut -c1-150
for v in b a; do echo "ncu$v: $(grep -c '_cm"' $R/ncu$v.csv 2>/dev/null) rows of _cm kernels"; done
echo "== rounds"; grep -hE "^\| (round|cublas_chain)" $R/rounda.log $R/roundb.log | cut -d'|' -f2-8 | tr -s ' '
