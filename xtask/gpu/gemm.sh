#!/usr/bin/env bash
# The gemm reports: gemm conformance, GEMM and block benches, draft-block conformance,
# engine rounds (each step bounded). Run from a folder holding v/dflash-bench and
# v/dflash-conformance (release builds with --features cuda), COMMIT set, OUT the output folder.
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
step() { local name=$1; shift; local t0=$(date +%s); "$@"; echo "$name rc=$? $(( $(date +%s)-t0 ))s" >> $R/steps.txt; }
step conf_gemm timeout 170 ./v/dflash-conformance --only gemm/ --out $R/conf_gemm > $R/conf_gemm.log 2>&1
step bench_gemm timeout 40 ./v/dflash-bench --only gemm --commit ${COMMIT} --out $R/gemm > $R/gemm.log 2>&1
step bench_block timeout 120 ./v/dflash-bench --only block --commit ${COMMIT} --out $R/block > $R/block.log 2>&1
step conf_block timeout 40 ./v/dflash-conformance --only draft_block --skip-heavy --out $R/conf_block > $R/conf_block.log 2>&1
step engine_round timeout 90 ./v/dflash-bench --engine-round --commit ${COMMIT} --out $R/er > $R/er.log 2>&1
cd $OUT && tar czf r.tgz r
cat $R/steps.txt
grep -E "result" $R/conf_gemm.log $R/conf_block.log; grep -E "FAIL|error" $R/conf_gemm.log $R/conf_block.log | head -5
grep "^| [23]" $R/gemm.log | cut -d'|' -f2-8 | head -60
grep "^\[" $R/block.log | cut -c12-
grep "^| [23]" $R/er.log | cut -d'|' -f2-7
