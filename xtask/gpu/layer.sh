#!/usr/bin/env bash
# The fused-layer reports (docs/performance.{md,json} with the round rows, performance-gemm,
# performance-engine_round, conformance-layer_ops): the full bench (attention, heads, GEMMs,
# blocks, rounds + cuBLAS chains), the conformance of the layer ops + the draft block + the
# graph / host / round checks, engine rounds, and the 35B block's per-kernel times under
# Nsight Compute. Run from a folder holding v/dflash-bench and v/dflash-conformance (release
# builds with --features cuda) and ncu_agg.py, COMMIT set, OUT the output folder. About 190 s
# on a fresh H200 machine.
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
step() { local name=$1; shift; local t0=$(date +%s); "$@"; echo "$name rc=$? $(( $(date +%s)-t0 ))s" >> $R/steps.txt; }
step bench timeout 320 ./v/dflash-bench --commit ${COMMIT} --out $R/perf > $R/bench.log 2>&1
step conf timeout 120 ./v/dflash-conformance --only rms_norm/,head_norm_rope/,swiglu/,residual_add/,dynamic_grouped_conv/,feature_projection/,context_kv_materialize/,candidate_selector/,draft_block --skip-heavy --out $R/conf > $R/conf.log 2>&1
step er timeout 40 ./v/dflash-bench --engine-round --commit ${COMMIT} --out $R/er > $R/er.log 2>&1
step ncu timeout 30 ncu --clock-control none --metrics gpu__time_duration.sum --csv ./v/dflash-bench --profile dflash --shape 1,15,2048 > $R/ncu-dflash.csv 2>> $R/ncu.log
python3 ncu_agg.py $R/ncu-dflash.csv 2 > $R/agg-dflash.txt
cd $OUT && tar czf r.tgz r
cat $R/steps.txt
grep -E "result" $R/conf.log; grep -E "FAIL|rror" $R/conf.log | head -5
head -24 $R/agg-dflash.txt | cut -c1-40,91-125
grep "^\[" $R/bench.log | grep -v "gemm " | cut -c12-
grep "^| [23]" $R/er.log | cut -d'|' -f2-7
