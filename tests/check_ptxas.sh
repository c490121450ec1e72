#!/bin/sh
# Reads nvcc's -Xptxas -v report of moept_kernels.cu: one "ok" line per
# kernel and architecture without spills, "FAIL" for any spill to local
# memory (stack frames are reported, not failed).
report=${1:-build/cuda/ptxas.txt}
[ -s "$report" ] || { echo "FAIL - ptxas report $report missing"; exit 1; }
awk '
/Compiling entry function/ { match($0, /\x27[^\x27]*\x27/); name = substr($0, RSTART + 1, RLENGTH - 2); match($0, /for \x27sm_[0-9a-z]*\x27/); arch = substr($0, RSTART + 5, RLENGTH - 6); next }
/spill stores/ && name != "" {
    split($0, f, ","); st = f[2] + 0; ld = f[3] + 0; sub(/^ */, "", f[1]); fr = f[1] + 0
    n++
    if (st != 0 || ld != 0) { printf "FAIL - %s (%s): %d bytes spill stores, %d bytes spill loads\n", name, arch, st, ld; bad++ }
    else if (fr != 0) frames = frames sprintf("  %s (%s): %d bytes stack frame, no spills\n", name, arch, fr)
    name = ""
}
END {
    if (n == 0) { print "FAIL - no kernels in the ptxas report"; exit 1 }
    if (!bad) printf "ok - %d kernel builds, no spills to local memory\n", n
    printf "%s", frames
    exit bad ? 1 : 0
}' "$report"
