#!/bin/bash
# The full conformance run on a GPU host (run from a folder holding the stripped binaries:
# cargo build --release -p xtask --features cuda; copy dflash-conformance beside this script).
# Writes $OUT/conf/conformance.{md,json}: the full conformance run (every op, the draft block, CUDA-graph replay).
cd "$(dirname "$0")"
timeout 570 ./dflash-conformance --out $OUT/conf > $OUT/conformance-stdout.md 2> $OUT/run-a.log; echo "conformance rc=$?"
rm -f $OUT/conformance-stdout.md
grep -E "^ *FAIL" $OUT/run-a.log | head -20
grep -E "^- (date|GPU|driver|result)" $OUT/conf/conformance.md
grep -A3 "Verdict" $OUT/conf/conformance.md | head -3
