#!/bin/sh
# Reads nvcc's -Xptxas -v report of moept_kernels.cu: "FAIL" for any spill
# to local memory (stack frames are reported, not failed) and for static
# shared memory over 48 KiB a block (the launch would fail; the emulator
# checks only the dynamic part, this is the compiler's own count); ptxas's performance notes (C75xx:
# wgmma serialized, and why) are listed, not failed.
report=${1:-build/cuda/ptxas.txt}
[ -s "$report" ] || { echo "FAIL - ptxas report $report missing"; exit 1; }
awk '
/Compiling entry function/ { match($0, /\x27[^\x27]*\x27/); name = substr($0, RSTART + 1, RLENGTH - 2); match($0, /for \x27sm_[0-9a-z]*\x27/); arch = substr($0, RSTART + 5, RLENGTH - 6); kname = name; next }
/ bytes smem/ && kname != "" {
    match($0, /[0-9]+ bytes smem/); sm = substr($0, RSTART, RLENGTH) + 0; ns++
    if (sm > maxsm) maxsm = sm
    if (sm > 49152) { printf "FAIL - %s (%s): %d bytes of static shared memory (limit 49152)\n", kname, arch, sm; bad++ }
    kname = ""
}
/\(C75[0-9][0-9]\)/ { match($0, /\(C75[0-9]*\)[^:]*/); perf = perf sprintf("  note - ptxas %s: %s\n", substr($0, RSTART, RLENGTH), $NF) }
/spill stores/ && name != "" {
    split($0, f, ","); st = f[2] + 0; ld = f[3] + 0; sub(/^ */, "", f[1]); fr = f[1] + 0
    n++
    if (st != 0 || ld != 0) { printf "FAIL - %s (%s): %d bytes spill stores, %d bytes spill loads\n", name, arch, st, ld; bad++ }
    else if (fr != 0) frames = frames sprintf("  %s (%s): %d bytes stack frame, no spills\n", name, arch, fr)
    name = ""
}
END {
    if (n == 0) { print "FAIL - no kernels in the ptxas report"; exit 1 }
    if (ns == 0) { print "FAIL - no shared memory figures in the ptxas report"; exit 1 }
    if (!bad) printf "ok - %d kernel builds, no spills to local memory, static shared memory <= %d bytes\n", n, maxsm
    printf "%s%s", frames, perf
    exit bad ? 1 : 0
}' "$report"
