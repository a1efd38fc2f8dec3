#!/bin/bash
# The performance report (usage: performance.sh COMMIT, with dflash-bench, dflash-kernels and
# ncu_agg.py beside it; writes $OUT/performance.{md,json} and $OUT/agg-*.txt): the performance report, per-kernel Nsight Compute times of both blocks, and
# every kernel module compiled through NVRTC on the device.
cd "$(dirname "$0")"
COMMIT=$1
{ ./dflash-kernels --arch sm_80,sm_90,sm_100,sm_120 | tail -3; } > $OUT/run-b.log 2>&1; echo "kernels rc=$?"
timeout 240 ./dflash-bench --commit $COMMIT --out $OUT >> $OUT/run-b.log 2>&1; echo "bench rc=$?"
for d in dflash dflash2; do
  timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv ./dflash-bench --profile $d > /tmp/ncu-$d.csv 2>> $OUT/run-b.log
  python3 ncu_agg.py /tmp/ncu-$d.csv 2 > $OUT/agg-$d.txt; head -12 $OUT/agg-$d.txt
done
grep -E "^\| " $OUT/performance.md | awk -F'|' '{printf "%-26s %-15s %2s %3s %7s %9s %8s %6s %s\n", $2,$3,$4,$5,$6,$7,$8,$9,$11}'
