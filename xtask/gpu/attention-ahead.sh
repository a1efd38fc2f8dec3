#!/usr/bin/env bash
# Issue 11: the warpgroup-pair attention split (`_d128_ks2`, B = 1 K = 15) as a software
# pipeline, xtask/gpu/attention-ahead.patch: S of tile t + 1 issued before the softmax of tile
# t, P V of tile t in flight through the next step's softmax, one wgmma wait a step, 6 stages.
# Compile-checked only (NVRTC 12.9, sm_90a: 182 / 184 registers, no spills, no ptxas
# serialization note; every other attention entry, sm_80 / sm_90 / sm_90a, has the registers
# and spills it has without the patch); never run on a GPU. The patch also carries its docs (ARCHITECTURE, the
# op's contract doc, the launcher's stage count and its test).
# Build: `git apply xtask/gpu/attention-ahead.patch`, `cargo build --release -p xtask
# --features cuda`; put the stripped dflash-bench and dflash-conformance in v/, the same
# binaries of the commit before the patch as v/dflash-bench-a, and ncu_agg.py beside this
# script; OUT the output folder. One device call, in order of priority (BUDGET: the seconds
# after which the remaining steps are skipped, default 400): both attention ops'
# conformance (heavy cases included; the sm_90a and the portable variants), attention A/B,
# the draft block's conformance, Nsight Compute of the attention kernels at B=1 K=15 4096,
# rounds A/B (quick), a second attention A/B, and a 27B B=8 per-kernel profile of the
# elementwise kernels (DRAM bytes, occupancy: the B=8 scaling item).
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader > $R/gpu.txt
T0=$(date +%s)
step() {
  local name=$1; shift
  if [ $(( $(date +%s) - T0 )) -gt ${BUDGET:-400} ]; then echo "$name skipped" >> $R/steps.txt; return; fi
  local t0=$(date +%s); "$@"; echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> $R/steps.txt
}
att() { local bin=./v/dflash-bench; case $1 in a*) bin=./v/dflash-bench-a;; esac
  step att$1 timeout 90 $bin --only attention --out $R/att$1 > $R/att$1.log 2>&1; }
step conf timeout 200 ./v/dflash-conformance --only softmax_attention/,sliding_window_attention/ --out $R/conf > $R/conf.log 2>&1
att a; att b
step confb timeout 150 ./v/dflash-conformance --only draft_block --skip-heavy --out $R/confb > $R/confb.log 2>&1
for v in a b; do
  bin=./v/dflash-bench; [ $v = a ] && bin=./v/dflash-bench-a
  step ncu$v timeout 90 ncu --clock-control none --kernel-name regex:attention --metrics gpu__time_duration.sum,smsp__inst_executed.sum --csv $bin --only attention --shape 1,15,4096 > $R/ncu$v.csv 2> $R/ncu$v.err
  python3 ncu_agg.py $R/ncu$v.csv > $R/agg$v.txt 2>&1
done
step rounda timeout 100 ./v/dflash-bench-a --only round --quick --commit before --out $R/rounda > $R/rounda.log 2>&1
step roundb timeout 100 ./v/dflash-bench --only round --quick --commit after --out $R/roundb > $R/roundb.log 2>&1
att a2; att b2
step ncu27 timeout 90 ncu --clock-control none --kernel-name regex:"swiglu|dynamic_grouped_conv|head_norm_rope|rms_norm_residual|attention" --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,launch__grid_size --csv ./v/dflash-bench --profile dflash2 --shape 8,15,4096 > $R/ncu27.csv 2> $R/ncu27.err
python3 ncu_agg.py $R/ncu27.csv 2 > $R/agg27.txt 2>&1
cd $OUT && tar czf r.tgz r
cat $R/steps.txt; cat $R/gpu.txt
for f in conf confb; do echo "$f: $(grep -cE "^ +ok " $R/$f.log) ok, $(grep -cE "^ *FAIL " $R/$f.log) FAIL; $(grep -E "result:" $R/$f.log)"; grep -E "FAIL|error|panic" $R/$f.log | head -8; done
for v in a b a2 b2; do echo "== att$v"; grep -E "^\| (sliding|softmax)" $R/att$v.log | cut -d'|' -f2-8 | tr -s ' '; done
grep -E "attention" $R/agga.txt $R/aggb.txt | cut -c1-150
echo "== rounds"; grep -E "^\| (round|cublas_chain)" $R/rounda.log $R/roundb.log | cut -d'|' -f1-8 | tr -s ' '
head -14 $R/agg27.txt | cut -c1-150
