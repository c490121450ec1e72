#!/bin/sh
# tools/build_nccl.sh - NCCL 2.30 or later from NVIDIA's source, for one GPU architecture, for
# tools/gpu_check.sh's nccl-multirank phase: the lent GPU machines' NCCL (torch's 2.28) refuses two
# ranks on one GPU, which 2.30 allows under NCCL_MULTI_RANK_GPU_ENABLE=1.
#
#   sh tools/build_nccl.sh [SRC]      build (once; cached), then the archive
#   sh tools/build_nccl.sh --cached   the archive from the cache alone, if built (gpu_prebuild.sh)
#
# SRC (or NCCL_SRC): a git directory holding the tag NCCL_TAG (default v2.30.7-1): a clone, or the
# bare mirror the fetch tool makes (/work/.mirror/NVIDIA+nccl/repo); else a shallow clone of
# https://github.com/NVIDIA/nccl at the tag. CUDA_ARCH: default 90 (H100, H200). The build (src.lib:
# the shared library alone, no tests or packages) runs in $CACHE.work, kept on failure so that a rerun
# resumes; $CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/moept/nccl-VERSION-smARCH-moept, outside
# the repository) keeps lib/libnccl.so* and include/nccl.h. The archive: $GPUB/nccl-VERSION.tar.xz (GPUB
# default gpub, kept out of git as tools/gpu_prebuild.sh does), the stripped lib/libnccl.so.2 and
# include/nccl.h, which the device tool carries with gpub. docs/PERF.md has its time and sizes.
set -eu
T=${NCCL_TAG:-v2.30.7-1}
A=${CUDA_ARCH:-90}
G=${GPUB:-gpub}
V=$(echo "$T" | sed 's/^v//; s/-[0-9]*$//')
# NCCL_FUNCS: the collectives built (NCCL's ONLY_FUNCS): by default those moept_kernels.cu calls
# (send/recv, all-gather, all-reduce sums of f32, f64, bf16 and int64, whose signed sums run as
# unsigned): a sixth of the archive that "all" (every one) makes, which would not fit the device
# tool's carry beside gpub. NCCL runs a function left out as a no-op: a new NCCL call in moept
# needs its pattern here
F=${NCCL_FUNCS:-moept}
case $F in
moept) O='SendRecv|AllGather * *|AllReduce Sum (f32|f64|bf16|i64|u64) * *' K=-moept ;;
all) O='' K='' ;;
*) O=$F K=-$(echo "$F" | cksum | cut -d' ' -f1) ;;
esac
C=${NCCL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/moept/nccl-$V-sm$A$K}
cached=0
[ "${1:-}" = --cached ] && { cached=1; shift; }
S=${1:-${NCCL_SRC:-}}

if [ ! -f "$C/lib/libnccl.so.2" ] || [ ! -f "$C/include/nccl.h" ]; then
    if [ $cached = 1 ]; then
        echo "build_nccl: no NCCL $V in $C (sh tools/build_nccl.sh builds it); no archive" >&2
        exit 0
    fi
    W=$C.work
    if [ ! -f "$W/Makefile" ]; then
        rm -rf "$W"
        if [ -n "$S" ]; then
            git -C "$S" rev-parse -q --verify "$T^{commit}" >/dev/null ||
                { echo "build_nccl: no $T in $S" >&2; exit 1; }
            mkdir -p "$W"
            git -C "$S" archive "$T" | tar -x -C "$W"
        else
            git clone -q --depth 1 --branch "$T" https://github.com/NVIDIA/nccl "$W"
        fi
    fi
    H=${CUDA_HOME:-/usr/local/cuda}
    I=$H/include
    if [ -e "$I/nccl.h" ]; then
        # a toolkit carrying NCCL's headers (CUDA 13.0's: 2.28's) shadows the build's own where its
        # flags put the toolkit's include directory first (src/device): its headers without NCCL's
        I=$W/cuda-include
        rm -rf "$I"
        mkdir -p "$I"
        for f in "$H"/include/*; do case ${f##*/} in nccl*) ;; *) ln -s "$f" "$I/" ;; esac; done
    fi
    # the GPU code for one architecture: most of NCCL's build time and its library's size
    nice -n 19 make -C "$W" -j"${JOBS:-$(nproc)}" src.lib ONLY_FUNCS="$O" \
        NVCC_GENCODE="-gencode=arch=compute_$A,code=sm_$A" CUDA_HOME="$H" CUDA_INC="$I"
    rm -rf "$C.new"
    mkdir -p "$C.new/lib" "$C.new/include"
    cp -a "$W"/build/lib/libnccl.so* "$C.new/lib/"
    cp "$W/build/include/nccl.h" "$C.new/include/"
    rm -rf "$C"
    mv "$C.new" "$C"
    [ -n "${NCCL_KEEP_WORK:-}" ] || rm -rf "$W"
fi

# the archive: the library stripped (its symbols and debug lines are most of its size)
mkdir -p "$G"
x=$(git rev-parse --git-path info/exclude 2>/dev/null) && { grep -qx "/$G/" "$x" 2>/dev/null ||
    { mkdir -p "$(dirname "$x")" && echo "/$G/" >>"$x"; }; }
P=$(mktemp -d "${TMPDIR:-/tmp}/nccl_pack.XXXXXX")
trap 'rm -rf "$P"' EXIT
mkdir -p "$P/lib" "$P/include"
cp -L "$C/lib/libnccl.so.2" "$P/lib/libnccl.so.2"
strip --strip-unneeded "$P/lib/libnccl.so.2"
cp "$C/include/nccl.h" "$P/include/"
rm -f "$G"/nccl-*.tar.xz
tar -C "$P" -cf - lib/libnccl.so.2 include/nccl.h | xz -9 -T1 >"$G/nccl-$V.tar.xz"
u=$(wc -c <"$C/lib/libnccl.so.2")
s=$(wc -c <"$P/lib/libnccl.so.2")
z=$(wc -c <"$G/nccl-$V.tar.xz")
echo "build_nccl: NCCL $V (sm_$A, functions: $F) in $C: libnccl.so.2 $u bytes, stripped $s;" \
    "$G/nccl-$V.tar.xz $z bytes"
