#!/bin/sh
# The builtin GEMM's micro-kernel (moept__kern) read from the assembly of
# each target it claims: the multiply-adds are the ISA's (ymm/zmm FMAs, NEON
# fmla, at least MR x NR / width of them) and nothing between the first and
# the last of them touches the stack (no accumulator spilled or reloaded in
# the inner loop). gcc and clang at -O2, -march=native, x86-64-v3, x86-64-v4
# and aarch64 (cross compilers when installed; skip with the reason if not).
# The unit compiled is moept.c with a main that runs the GEMM driver
# (moept__gemm_run) on inputs the compiler cannot see: the kernel is
# compiled in its library context, and little else is. gcc takes the unit
# as the whole program (-fwhole-program); clang gives each of moept.c's
# functions internal linkage (the system headers come first, outside it),
# so that those nothing reaches are never emitted. moept__kern's assembly
# is the same as in a compile of moept.c alone (each target here, gcc 12
# and clang 14, compared when this was written; the first target's is
# compared on every run), in a seventh of the time.
# MOEPT_NO_IO: the file formats, which the kernel does not touch, are left
# out.
# usage: sh tests/check_gemm_asm.sh
out=${TMPDIR:-/tmp}/moept_asm.$$
mkdir -p "$out"
trap 'rm -rf "$out"' EXIT
have() { command -v "$1" >/dev/null 2>&1; }
cat >"$out/unit.c" <<EOF
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif
#ifdef __clang__
#pragma clang attribute push(__attribute__((internal_linkage)), apply_to = function)
#endif
#include "$PWD/moept.c"
#ifdef __clang__
#pragma clang attribute pop
#endif
int main(int argc, char **argv) {
    moept__gemm *volatile g = (moept__gemm *)argv;
    moept__gemm_ws *volatile ws = (moept__gemm_ws *)argv[0];
    moept__gemm_run(g, argc, ws);
    return 0;
}
EOF
# the function's body: from its label to the end of its cfi block
body() { awk '/^moept__kern:/ {on = 1} on {print} on && /\.cfi_endproc|^\.Lfunc_end/ {exit}' "$1"; }
# its instructions (no directive, label or comment; jump targets unnamed)
insns() { grep -v -E '^[[:space:]]*(\.|#)|^\.L' "$1" | sed -e 's/[[:space:]]#.*//' -e 's/\.L[A-Za-z0-9_]*/L/g'; }
# once, for the first target: the unit's kernel against a compile of moept.c alone
alone=
same_alone() {
    name=$1 alone=1; shift
    if ! "$@" -std=c11 -O2 -g0 -DMOEPT_NO_IO -S moept.c -o "$out/alone.s" >"$out/log" 2>&1; then
        echo "FAIL - $name, moept.c alone: did not compile"; return
    fi
    body "$out/alone.s" >"$out/fa.s"
    if [ -s "$out/fa.s" ] && insns "$out/fa.s" | cmp -s - "$out/f.insns"; then
        echo "ok - $name: moept__kern in the check's unit is moept.c's own, instruction for instruction"
    else
        echo "FAIL - $name: moept__kern in the check's unit differs from moept.c compiled alone"
    fi
}
# name, expected FMA pattern, minimum FMA count, stack pattern, compiler + flags...
check() {
    name=$1 fma=$2 min=$3 stack=$4; shift 4
    case $1 in *gcc) whole=-fwhole-program ;; *) whole= ;; esac
    if ! "$@" $whole -std=c11 -O2 -g0 -DMOEPT_NO_IO -S "$out/unit.c" -o "$out/k.s" >"$out/log" 2>&1; then
        echo "FAIL - $name: did not compile"; sed 's/^/    /' "$out/log" | head -5; return
    fi
    body "$out/k.s" >"$out/f.s"
    insns "$out/f.s" >"$out/f.insns"
    [ -n "$alone" ] || same_alone "$name" "$@"
    first=$(grep -n -E "$fma" "$out/f.s" | head -1 | cut -d: -f1)
    last=$(grep -n -E "$fma" "$out/f.s" | tail -1 | cut -d: -f1)
    if [ -z "$first" ]; then
        echo "FAIL - $name: no multiply-add matching '$fma' in moept__kern"; return
    fi
    n=$(grep -c -E "$fma" "$out/f.s")
    spills=$(sed -n "${first},${last}p" "$out/f.s" | grep -c -E "$stack")
    if [ "$n" -lt "$min" ]; then
        echo "FAIL - $name: $n multiply-adds, fewer than the tile's $min"
    elif [ "$spills" -ne 0 ]; then
        echo "FAIL - $name: $spills stack accesses among the multiply-adds:"
        sed -n "${first},${last}p" "$out/f.s" | grep -E "$stack" | head -5 | sed 's/^/    /'
    else
        echo "ok - $name: $n multiply-adds ($fma), no stack access between them"
    fi
}
X86_STACK='\(%[re]?(sp|bp)\)'
ARM_STACK='\[(sp|x29)[],]'
YMM='vfmadd[0-9]+ps[^%]*%ymm'
ZMM='vfmadd[0-9]+ps[^%]*%zmm'
NEON='fmla[[:space:]]+v[0-9]+\.4s'
case $(uname -m) in
x86_64)
    flags=$(grep -m1 '^flags' /proc/cpuinfo)
    native=""
    case "$flags" in
    *" avx512f"*) native="$ZMM 24" ;;
    *" avx2"*" fma"*|*" fma"*" avx2"*) native="$YMM 12" ;;
    esac
    for cc in gcc clang; do
        if ! have $cc; then echo "skip - $cc: not installed"; continue; fi
        if [ -n "$native" ]; then
            set -- $native
            check "$cc -march=native" "$1" "$2" "$X86_STACK" $cc -march=native
        else
            echo "skip - $cc -march=native: this CPU has neither AVX-512F nor AVX2+FMA (the portable kernel)"
        fi
        check "$cc -march=x86-64-v3 (AVX2+FMA 6x16)" "$YMM" 12 "$X86_STACK" $cc -march=x86-64-v3
        check "$cc -march=x86-64-v4 (AVX-512 12x32)" "$ZMM" 24 "$X86_STACK" $cc -march=x86-64-v4
    done ;;
aarch64)
    for cc in gcc clang; do
        have $cc && check "$cc -march=native (NEON 8x12)" "$NEON" 24 "$ARM_STACK" $cc -march=native
    done ;;
esac
if have aarch64-linux-gnu-gcc; then
    check "aarch64-linux-gnu-gcc (NEON 8x12)" "$NEON" 24 "$ARM_STACK" aarch64-linux-gnu-gcc
else
    echo "skip - aarch64-linux-gnu-gcc: not installed (apt-get install gcc-aarch64-linux-gnu)"
fi
if have clang && [ -d /usr/aarch64-linux-gnu/include ]; then
    check "clang --target=aarch64-linux-gnu (NEON 8x12)" "$NEON" 24 "$ARM_STACK" clang --target=aarch64-linux-gnu
else
    echo "skip - clang --target=aarch64-linux-gnu: clang or the aarch64 headers (libc6-dev-arm64-cross) missing"
fi
