#!/usr/bin/env bash
# The wide GEMM kernel (sm_90a) in one device call: the GEMM bench with it on for every
# product of up to 128 rows the skinny kernel does not take (the same run's cuBLAS beside it),
# Nsight Compute on one wide GEMM (the 35B-A3B's q at 16 rows), the rounds with it off (the
# default), on up to 16 rows and on up to 128, and the gemm (heavy cases included) and
# draft-block conformance. Run from a folder holding v/dflash-bench and v/dflash-conformance
# (release builds with --features cuda), COMMIT set, OUT the output folder. About 6 minutes
# (the first runs compile the kernel modules).
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
step() { local name=$1; shift; local t0=$(date +%s); "$@"; echo "$name rc=$? $(( $(date +%s)-t0 ))s" >> $R/steps.txt; }
step conf timeout 200 ./v/dflash-conformance --only gemm/,draft_block --out $R/conf > $R/conf.log 2>&1
step gemm timeout 60 ./v/dflash-bench --only gemm --gemm-rule 16,2048,16,8,1,128 --commit ${COMMIT} --out $R/gemm > $R/gemm.log 2>&1
step ncu timeout 60 ncu --clock-control none -k regex:gemm_wide_nt2_bf16 --launch-count 1 --section LaunchStats --section Occupancy --section SpeedOfLight ./v/dflash-bench --only gemm --gemm-rule 16,2048,16,8,1,128 > $R/ncu.txt 2>&1
step round timeout 90 ./v/dflash-bench --only round --quick --commit ${COMMIT} --out $R/round > $R/round.log 2>&1
for w in 16 128; do
  step round_wide$w timeout 60 ./v/dflash-bench --only round --quick --gemm-rule 16,2048,16,8,1,$w --out $R/round_wide$w > $R/round_wide$w.log 2>&1
done
cd $OUT && tar czf r.tgz r
cat $R/steps.txt; cat $R/gpu.txt
grep -E "result" $R/conf.log; grep -E "FAIL|rror|panic" $R/conf.log | head -8
grep -E "Duration|DRAM Throughput|Max Active Clusters|Cluster Size|Grid Size|Achieved Occupancy" $R/ncu.txt
grep "^| 35B\|^| 27B" $R/gemm.log | cut -d'|' -f2-7
grep -E "^\| (round|cublas_chain) " $R/round*.log | cut -d'|' -f1-8
