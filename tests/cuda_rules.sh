#!/bin/sh
# usage: tests/cuda_rules.sh CUDA_RULES [--no-skip]
# CUDA_RULES (build/emu/cuda_rules: the emulated GPU; build/cuda_rules: a
# real one) must answer the capture and fault calls as the real GPU of
# tests/cuda_rules.txt did, line for line: the emulator's rules for them are
# that GPU's answers, not a reading of the docs alone. --no-skip: no device
# is a failure (the emulated GPU always has one).
bin=$1
noskip=
[ "${2:-}" = --no-skip ] && noskip=1
out=${TMPDIR:-/tmp}/cuda_rules.$$
trap 'rm -f "$out" "$out.err"' EXIT
if ! { "$bin" capture && "$bin" fault; } >"$out" 2>"$out.err"; then
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
if grep -v '^#' tests/cuda_rules.txt | diff - "$out"; then
    echo "ok - $bin: $n answers (stream capture by mode and thread, after a fault) as tests/cuda_rules.txt"
else
    echo "FAIL - $bin answers differently from tests/cuda_rules.txt (diff above: < recorded, > this run):"
    echo "  on the emulator, a rule of tests/emu/emu_rt.cc differs from the recorded GPU; on another GPU or"
    echo "  CUDA version than the file's, CUDA itself may answer differently: record it and check the rules"
    exit 1
fi
