#!/usr/bin/env bash
# The DFlash2 selector walk over edge tables and the vectorized convolution apply kernel (issue
# 14; docs/performance-selector-h100.md), as two device calls ran them. Run from a folder holding
# v/dflash-bench, v/dflash-bench-a (the build before, 1c3550e), v/dflash-conformance (release
# builds with --features cuda) and ncu_agg.py, OUT the output folder.
#   call 1 (STAGE=1): the op's conformance (heavy official cases included), the draft block's and
#     the convolution's (light), Nsight Compute per-kernel times of one 27B DFlash2 block before
#     and after, and the round (quick) of both builds;
#   call 2 (STAGE=2): the same for the touch version of the walk, plus the walk alone under
#     --cache-control none.
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader > $R/gpu.txt
step() { local name=$1; shift; local t0=$(date +%s); "$@"; echo "$name rc=$? $(( $(date +%s)-t0 ))s" >> $R/steps.txt; }
step conf timeout 150 ./v/dflash-conformance --only candidate_selector/ --out $R/conf > $R/conf.log 2>&1
echo "conf: $(grep -cE "^ +ok " $R/conf.log) ok, $(grep -cE "^ *FAIL " $R/conf.log) FAIL; $(grep -E "result:" $R/conf.log)"
if [ "${STAGE:-1}" = 1 ]; then
  step confb timeout 120 ./v/dflash-conformance --only draft_block,dynamic_grouped_conv/ --skip-heavy --out $R/confb > $R/confb.log 2>&1
  echo "confb: $(grep -cE "^ +ok " $R/confb.log) ok, $(grep -cE "^ *FAIL " $R/confb.log) FAIL; $(grep -E "result:" $R/confb.log)"
  bins="a b"
else
  bins="b"
fi
for v in $bins; do
  bin=./v/dflash-bench; [ $v = a ] && bin=./v/dflash-bench-a
  step ncu$v timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum --csv $bin --profile dflash2 --shape 1,15,2048 > $R/ncu$v.csv 2> $R/ncu$v.err
  python3 ncu_agg.py $R/ncu$v.csv 2 > $R/agg$v.txt 2>&1
  head -1 $R/agg$v.txt; grep -E "candidate_selector|dynamic_grouped" $R/agg$v.txt | cut -c1-150
done
if [ "${STAGE:-1}" = 2 ]; then
  step ncuw timeout 30 ncu --clock-control none --cache-control none --kernel-name candidate_selector_walk --metrics gpu__time_duration.sum,dram__bytes_read.sum,smsp__inst_executed.sum --csv ./v/dflash-bench --profile dflash2 --shape 1,15,2048 > $R/ncuw.csv 2> $R/ncuw.err
  grep -E "candidate" $R/ncuw.csv | cut -d, -f12- | head -8
else
  step base timeout 110 ./v/dflash-bench-a --only round --quick --commit 1c3550e --out $R/base > $R/base.log 2>&1
  echo "== base"; grep -E "^\| (round|cublas_chain)" $R/base.log | cut -d'|' -f2-8
fi
step new timeout 110 ./v/dflash-bench --only round --quick --commit new --out $R/new > $R/new.log 2>&1
cd $OUT && tar czf r.tgz r
cat $R/steps.txt; cat $R/gpu.txt
echo "== new"; grep -E "^\| (round|cublas_chain)" $R/new.log | cut -d'|' -f2-8
