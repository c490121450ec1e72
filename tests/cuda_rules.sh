#!/bin/sh
# usage: tests/cuda_rules.sh PROGRAM [--no-skip]
# PROGRAM (its emulated build under build/emu/, or a real GPU's under build/)
# must answer as the real GPU recorded in its file did, line for line: the
# emulator's rules for these calls are that GPU's answers, not a reading of
# the docs alone. --no-skip: no device is a failure (the emulated GPU always
# has one).
#   cuda_rules: the runtime's stream-capture and lost-context answers,
#               tests/cuda_rules.txt
#   lt_rules:   cuBLASLt's block-scaled FP8 matmuls, tests/lt_rules.txt (each
#               case's heuristic and matmul statuses; its D column is a
#               reading of the GPU's accuracy, not a rule: left out)
bin=$1
noskip=
[ "${2:-}" = --no-skip ] && noskip=1
case $(basename "$bin") in
lt_rules) rec=tests/lt_rules.txt modes=rules strip='s/ D=[a-z-]*$//'
          what="block-scaled FP8 matmuls (cuBLASLt)" ;;
*) rec=tests/cuda_rules.txt modes="capture fault" strip=
   what="answers (stream capture by mode and thread, after a fault)" ;;
esac
out=${TMPDIR:-/tmp}/cuda_rules.$$
trap 'rm -f "$out" "$out.err" "$out.s"' EXIT
for m in $modes; do
    if ! "$bin" "$m" >>"$out" 2>>"$out.err"; then
        cat "$out.err"
        echo "FAIL - $bin exited non-zero"
        exit 1
    fi
done
if grep -q '^skip' "$out"; then
    [ -n "$noskip" ] && { echo "FAIL - $bin found no device"; exit 1; }
    echo "skip - $bin: no device"
    exit 0
fi
n=$(grep -c . "$out")
sed "$strip" "$out" >"$out.s"
if grep -v '^#' "$rec" | sed "$strip" | diff - "$out.s"; then
    echo "ok - $bin: $n $what as $rec"
else
    echo "FAIL - $bin answers differently from $rec (diff above: < recorded, > this run):"
    echo "  on the emulator, a rule of tests/emu differs from the recorded GPU; on another GPU or"
    echo "  CUDA version than the file's, CUDA itself may answer differently: record it and check the rules"
    exit 1
fi
