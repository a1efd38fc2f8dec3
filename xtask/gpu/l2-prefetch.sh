#!/usr/bin/env bash
# The L2 prefetch chain and the elementwise dependent launches in one device call (issue 14;
# docs/performance-l2-prefetch-h100.md): the touched ops' conformance, the round of a build
# without the elementwise dependent launches (v/dflash-bench-a, 1e6390c) and of this one at budgets
# 0, 16 and 40 MiB, and Nsight Compute per-kernel times of one 35B-A3B block at 0 and 16 MiB. Run
# from a folder holding v/dflash-bench, v/dflash-bench-a, v/dflash-conformance (release builds with
# --features cuda) and ncu_agg.py, COMMIT set, OUT the output folder. About 3.5 minutes on an H100.
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader > $R/gpu.txt
step() { local name=$1; shift; local t0=$(date +%s); "$@"; echo "$name rc=$? $(( $(date +%s)-t0 ))s" >> $R/steps.txt; }
step conf timeout 100 ./v/dflash-conformance --only l2_prefetch/,draft_block,gemm/,rms_norm/,head_norm_rope/,swiglu/,dynamic_grouped_conv/ --skip-heavy --out $R/conf > $R/conf.log 2>&1
step base timeout 100 ./v/dflash-bench-a --only round --quick --l2-prefetch 0 --commit 1e6390c --out $R/base > $R/base.log 2>&1
step sweep timeout 160 ./v/dflash-bench --only round --quick --l2-prefetch 0,16,40 --commit $COMMIT --out $R/sweep > $R/sweep.log 2>&1
for b in 0 16; do
  step ncu$b timeout 40 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv ./v/dflash-bench --profile dflash --shape 1,15,2048 --l2-prefetch $b > $R/ncu$b.csv 2> $R/ncu$b.err
  python3 ncu_agg.py $R/ncu$b.csv 2 > $R/agg$b.txt 2>&1
done
cd $OUT && tar czf r.tgz r
cat $R/steps.txt; cat $R/gpu.txt
echo "conf: $(grep -cE "^ +ok " $R/conf.log) ok, $(grep -cE "^ *FAIL " $R/conf.log) FAIL cases, $(grep -c "| pass |" $R/conf.log) pass rows, $(grep -c "| FAIL |" $R/conf.log) FAIL rows"; grep -E "FAIL|error in|panic" $R/conf.log | head -6
echo "== agg0"; head -16 $R/agg0.txt; echo "== agg16"; head -16 $R/agg16.txt
echo "== base"; grep -E "^\| (round|cublas_chain)" $R/base.log | cut -d'|' -f2-8
echo "== sweep"; grep -E "^\| (round|cublas_chain)" $R/sweep.log | cut -d'|' -f2-8
