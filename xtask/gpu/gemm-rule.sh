#!/usr/bin/env bash
# The skinny GEMM's default rule with and without its dependent launch (DEP=0): the GEMM bench
# and the rounds (with their cuBLAS chains) of both in one call, then the gemm and draft-block
# conformance. Run from a folder holding v/dflash-bench and v/dflash-conformance (release
# builds with --features cuda), COMMIT set, OUT the output folder. About 3 minutes.
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
step() { local name=$1; shift; local t0=$(date +%s); "$@"; echo "$name rc=$? $(( $(date +%s)-t0 ))s" >> $R/steps.txt; }
step gemm timeout 30 ./v/dflash-bench --only gemm --commit ${COMMIT} --out $R/gemm > $R/gemm.log 2>&1
step gemm_nodep timeout 30 ./v/dflash-bench --only gemm --gemm-rule 16,2048,16,8,0 --out $R/gemm_nodep > $R/gemm_nodep.log 2>&1
step round timeout 80 ./v/dflash-bench --only round --quick --commit ${COMMIT} --out $R/round > $R/round.log 2>&1
step round_nodep timeout 80 ./v/dflash-bench --only round --quick --gemm-rule 16,2048,16,8,0 --out $R/round_nodep > $R/round_nodep.log 2>&1
step conf timeout 45 ./v/dflash-conformance --only gemm/,draft_block --skip-heavy --out $R/conf > $R/conf.log 2>&1
cd $OUT && tar czf r.tgz r
cat $R/steps.txt; cat $R/gpu.txt
grep -E "result" $R/conf.log; grep -E "FAIL|rror" $R/conf.log | head -5
paste <(grep "^| 35B\|^| 27B" $R/gemm.log | cut -d'|' -f2-6) <(grep "^| 35B\|^| 27B" $R/gemm_nodep.log | cut -d'|' -f5) | grep -v " 64 \| 128 \| 32 "
grep -E "^\| (round|cublas_chain) " $R/round.log $R/round_nodep.log | cut -d'|' -f1-8
