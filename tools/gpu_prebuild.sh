#!/bin/sh
# tools/gpu_prebuild.sh - builds here, before a lent GPU machine is started,
# what `tools/gpu_check.sh prebuilt` runs there: $GPUB (default gpub/, kept
# out of git by .git/info/exclude), the CUDA programs for one architecture
# (CUDA_ARCH, default 90: H100 and H200) and, where Open MPI is installed
# from Debian's packages, its files with $GPUB/ompi_env.sh to run them from
# there (the lent machines have no mpirun). Needs the CUDA toolkit of the GPU
# machine's major version (13 on the lent ones); with it the shared library moept_torch.py loads
# (libmoept_cuda.so). Then, with the device tool (about 8 minutes: checks, then the peers):
#   run: sh tools/gpu_check.sh prebuilt rules check torch peers, carry ["gpub"]
# (sanitize and bench: a second call; nccl-multirank, after tools/build_nccl.sh: a call of its own)
set -eu
G=${GPUB:-gpub}
A=${CUDA_ARCH:-90}
AF=$A; [ "$A" = 90 ] && AF=90a # sm_90a: the grouped kernel's arch-specific wgmma
X=$(git rev-parse --git-path info/exclude) # a worktree's is its main repository's
mkdir -p "$(dirname "$X")"
grep -qx "/$G/" "$X" 2>/dev/null || echo "/$G/" >>"$X"
mpi=
command -v mpicc >/dev/null && mpi="$G/moept_check_cuda_mpi $G/train_cuda_mpi"
# shellcheck disable=SC2086
make -j"$(nproc)" B="$G" ARCH=-march=x86-64-v2 CUDA_ARCHS="-gencode arch=compute_$AF,code=sm_$AF" \
    "$G/moept_check_cuda" "$G/test_cuda" "$G/test_slots_cuda" "$G/test_fault" "$G/train_cuda" \
    "$G/bench_cuda" "$G/train" "$G/cuda_rules" "$G/lt_rules" "$G/test_q8_cuda" "$G/bench_q8_cuda" \
    "$G/libmoept_cuda.so" $mpi
# the grouped kernel's other ring depths, and its gate/up GEMM on the permuted copy in place of the
# gather (ng), for the grouped phase's sweep (4 stages with the gather, the defaults, are bench_cuda's);
# lt: its FP8 weight gradients by cuBLASLt; nx: x's and dy's FP8 copies down their rows by the column
# passes, not the kernels (the fp8 phase's comparisons)
if [ "$A" = 90 ]; then
    for s in 2 3 5 6 ng lt nx; do
        d=-DMOEPT_GK_STAGES=$s
        [ $s = ng ] && d=-DMOEPT_GK_GATHER=0
        [ $s = lt ] && d=-DMOEPT_GK_WGRAD8=0
        [ $s = nx ] && d=-DMOEPT_GK_XCOLS=0
        make -j"$(nproc)" B="$G/st$s" ARCH=-march=x86-64-v2 NVCC_DEFS=$d \
            CUDA_ARCHS="-gencode arch=compute_90a,code=sm_90a" "$G/st$s/bench_cuda"
        find "$G/st$s" -mindepth 1 ! -name bench_cuda -exec rm -rf {} + 2>/dev/null || true
    done
fi
# ScatterMoE (Triton) for the peers' rows: its package from $SCATTERMOE (a clone of
# github.com/shawntan/scattermoe, or its git directory) into $G/peers, carried with gpub, never committed
S=${SCATTERMOE:-}
if [ -n "$S" ]; then
    rm -rf "$G/peers" && mkdir -p "$G/peers"
    if [ -d "$S/scattermoe" ]; then cp -r "$S/scattermoe" "$G/peers/"
    else git --git-dir="$S" archive HEAD scattermoe | tar -x -C "$G/peers"; fi
fi
# the CUPTI tracer for the profile phase, with CUPTI's library beside it, where its headers are
# (CUPTI: the toolkit's extras/CUPTI, else the nvidia-cuda-cupti wheel's nvidia/cu13); optional. A wheel
# of the toolkit's own version (pip install --target /opt/cupti 'nvidia-cuda-cupti==13.0.*', then
# CUPTI=/opt/cupti/nvidia/cu13): a newer one's headers name runtime types the toolkit lacks
C=${CUPTI:-}
[ -z "$C" ] && [ -f /usr/local/cuda/extras/CUPTI/include/cupti.h ] && C=/usr/local/cuda/extras/CUPTI
if [ -z "$C" ]; then
    C=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' \
        2>/dev/null) || C=
fi
l=
[ -n "$C" ] && [ -f "$C/include/cupti.h" ] && l=$(ls "$C"/lib*/libcupti.so.1[0-9]* 2>/dev/null | head -1)
if [ -n "$l" ] && cp -L "$l" "$G/" && cc -O2 -Wall -Wextra -shared -fPIC -I"$C/include" \
    -I/usr/local/cuda/include tools/cupti_trace.c "$G/$(basename "$l")" -Wl,-rpath,'$ORIGIN' \
    -o "$G/cupti_trace.so"; then
    :
else
    echo "gpu_prebuild: no CUPTI headers and library (set CUPTI); no tracer for the profile phase" >&2
fi
# NCCL 2.30+ for the nccl-multirank phase, packed where tools/build_nccl.sh built it (not built here)
sh tools/build_nccl.sh --cached || echo "gpu_prebuild: no NCCL archive for the nccl-multirank phase" >&2
[ -n "$mpi" ] && command -v dpkg >/dev/null || exit 0
# Open MPI 4 and what its launcher and plugins load that a CUDA image may lack
rm -rf "$G/ompi"
mkdir -p "$G/ompi"
for p in libopenmpi3 openmpi-bin openmpi-common libpmix2 libhwloc15 libevent-core-2.1-7 \
    libevent-pthreads-2.1-7 libfabric1 libibverbs1 ibverbs-providers libmunge2 libnl-3-200 \
    libnl-route-3-200 libnuma1 libpsm-infinipath1 libpsm2-2 librdmacm1 libucx0 libatomic1; do
    dpkg -L "$p" 2>/dev/null | while read -r f; do
        case $f in /usr/share/doc/* | /usr/share/man/* | /usr/share/lintian/*) continue ;; esac
        if [ -f "$f" ] || [ -L "$f" ]; then cp -a --parents "$f" "$G/ompi/" 2>/dev/null || true; fi
    done
done
if [ ! -x "$G/ompi/usr/bin/orterun" ]; then
    echo "gpu_prebuild: no orterun copied; no Open MPI carried" >&2
    exit 0
fi
ln -sf orterun "$G/ompi/usr/bin/mpirun"
cat >"$G/ompi_env.sh" <<EOF
# sourced from the repository root: the carried Open MPI, relocated (OPAL_PREFIX)
R=\$PWD/$G/ompi
export OPAL_PREFIX=\$R/usr PMIX_INSTALL_PREFIX=\$R/usr/lib/x86_64-linux-gnu/pmix2
export PMIX_MCA_mca_base_component_path=\$R/usr/lib/x86_64-linux-gnu/pmix2/lib/pmix
export PATH=\$R/usr/bin:\$PATH
L=\$R/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=\$L:\$R/lib/x86_64-linux-gnu:\$L/openmpi/lib:\${LD_LIBRARY_PATH:-}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
EOF
du -sh "$G"
