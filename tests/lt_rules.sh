#!/bin/sh
# usage: tests/lt_rules.sh LT_RULES [--no-skip]
# LT_RULES (build/lt_rules: a real GPU; build/emu/lt_rules: the emulated one) must answer
# the block-scaled FP8 cublasLtMatmul cases as the real GPU of
# tests/lt_rules.txt did: each case's heuristic and matmul statuses, line for
# line (its D column is a reading of the GPU's accuracy, not a rule: left out).
# --no-skip: no device is a failure.
bin=$1
noskip=
[ "${2:-}" = --no-skip ] && noskip=1
out=${TMPDIR:-/tmp}/lt_rules.$$
trap 'rm -f "$out" "$out.err" "$out.s"' EXIT
if ! "$bin" rules >"$out" 2>"$out.err"; then
    cat "$out.err"
    echo "FAIL - $bin exited non-zero"
    exit 1
fi
if grep -q '^skip' "$out"; then
    [ -n "$noskip" ] && { echo "FAIL - $bin found no device"; exit 1; }
    echo "skip - $bin: no device"
    exit 0
fi
n=$(grep -c . "$out")
sed 's/ D=[a-z-]*$//' "$out" >"$out.s"
if grep -v '^#' tests/lt_rules.txt | sed 's/ D=[a-z-]*$//' | diff - "$out.s"; then
    echo "ok - $bin: $n block-scaled FP8 matmuls answered as tests/lt_rules.txt"
else
    echo "FAIL - $bin answers differently from tests/lt_rules.txt (diff above: < recorded, > this run)"
    exit 1
fi
