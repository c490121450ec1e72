#!/bin/sh
# Runs every test suite of `make test` and totals the results.
# Suites print "ok - ...", "FAIL - ...", "skip - ..." lines; the reference
# checker prints PASS/FAIL lines. The last line is the grand total.
B=${B:-build}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0

now() { date +%s.%N; }
suite() { # name, command...
    name=$1; shift
    echo "== $name"
    t0=$(now)
    "$@" >"$log" 2>&1
    rc=$?
    secs=$(echo "$(now) $t0" | awk '{ printf "%.1f", $1 - $2 }')
    echo "$secs $name" >>"$B/times.txt"
    cat "$log"
    echo "($secs s)"
    sed -e 's/^\(.*\)  *PASS  .*/ok - \1/' -e 's/^\(.*\)  *FAIL  .*/FAIL - \1/' \
        -e 's/^\([^ ]*\)  *SKIP  \(.*\)/skip - \1 (\2)/' "$log" |
        grep -E '^(ok|FAIL|skip) - ' | sed "s|^\([a-zA-Z]*\) - |\1 - $name: |" >>"$B/results.txt"
    if [ $rc -ne 0 ]; then
        echo "FAIL - $name: exit status $rc" >>"$B/results.txt"
        status=1
    elif ! grep -qE '^(ok|FAIL|skip) - |  (PASS|FAIL|SKIP)  ' "$log"; then
        echo "ok - $name" >>"$B/results.txt"   # a program judged by its exit status
    fi
}

skip() { echo "skip - $1: $2" | tee -a "$B/results.txt"; }

: >"$B/results.txt"
: >"$B/times.txt"
# the builds users have: -Werror under gcc, clang, g++, clang++, nvcc; -Ofast refused
suite "builds" sh tests/check_builds.sh "$NVCC"
# the README's runnable blocks, as written, in a fresh copy; the docs' links and claims
suite "README commands" sh tests/readme_commands.sh
suite "docs: links, anchors, no issue numbers, no false claims" sh tests/check_docs.sh
suite "reference cases" "$B/moept_check" $CASES
for t in test_grad test_props test_errors test_ckpt; do
    suite "$t" "$B/$t"
done
# parameters from checkpoints written by transformers' save_pretrained
for c in mixtral_e8_t40 qwen2_shared_norm_e8 olmoe_nonorm deepseek_group; do
    suite "--weights $c" "$B/moept_check" --weights tests/checkpoints/$c --layer 1 tests/cases/$c.safetensors
    suite "--weights $c --ep 4" "$B/moept_check" --ep 4 --weights tests/checkpoints/$c --layer 1 tests/cases/$c.safetensors
    suite "--weights $c --hf-config (sizes and routing from config.json)" "$B/moept_check" --weights tests/checkpoints/$c \
        --layer 1 --hf-config tests/cases/$c.safetensors
    suite "--weights $c --hf-config --ep 4" "$B/moept_check" --ep 4 --weights tests/checkpoints/$c --layer 1 \
        --hf-config tests/cases/$c.safetensors
done
# expert parallel over threads: every case whose E splits over the ranks
for n in 2 4 8; do
    suite "reference cases --ep $n (threads)" "$B/moept_check" --ep $n $CASES
done
suite "reference cases --ep 4 --chunks 3 (threads)" "$B/moept_check" --ep 4 --chunks 3 $CASES
suite "reference cases --ep 4, messages (threads, no shared rows)" "$B/moept_check" --ep 4 --no-shm $CASES
# kill -9 during saves: the newest checkpoint loads, verifies, replays (make stress: 50 kills)
for m in one threads; do
    suite "kill -9 loop ($m)" sh tests/crash.sh 5 $m
done
suite "test_ep" "$B/test_ep"
suite "test_calls" "$B/test_calls"
suite "test_overlap" "$B/test_overlap"
suite "test_fsdp" "$B/test_fsdp"
suite "train --ep 4 (threads)" "$B/train" --ep 4 --steps 30 --quiet --csv "$B/train_ep4.csv"
# ... and over MPI processes
if [ -n "$MPIRUN" ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    for n in 2 4; do
        suite "reference cases --ep $n, shared memory (mpirun -np $n)" timeout 300 "$MPIRUN" --oversubscribe -np $n "$B/moept_check_mpi" --ep $n --expect-shm $CASES
    done
    suite "reference cases --ep 4, messages (mpirun -np 4)" timeout 300 "$MPIRUN" --oversubscribe -np 4 "$B/moept_check_mpi" --ep 4 --no-shm $CASES
    suite "--weights mixtral_e8_t40 (mpirun -np 4)" timeout 300 "$MPIRUN" --oversubscribe -np 4 "$B/moept_check_mpi" --ep 4 --weights tests/checkpoints/mixtral_e8_t40 --layer 1 tests/cases/mixtral_e8_t40.safetensors
    suite "reference cases --ep 4, MPI counts chunked (mpirun -np 4)" timeout 300 "$MPIRUN" --oversubscribe -np 4 "$B/moept_check_mpi_chunked" --ep 4 --no-shm $CASES
    for n in 1 2 4; do
        suite "test_overlap (mpirun -np $n)" env OMP_NUM_THREADS=1 timeout 300 "$MPIRUN" --oversubscribe -np $n "$B/test_overlap_mpi"
    done
    for m in mpi mpi-one; do
        suite "kill -9 loop ($m)" env MPIRUN="$MPIRUN" sh tests/crash.sh 5 $m
    done
    suite "test_calls (mpirun -np 2)" timeout 300 "$MPIRUN" --oversubscribe -np 2 "$B/test_calls_mpi"
    suite "train --ep 4 (mpirun -np 4)" env OMP_NUM_THREADS=1 timeout 300 "$MPIRUN" --oversubscribe -np 4 "$B/train_mpi" --ep 4 --steps 30 --quiet --csv "$B/train_mpi.csv"
    suite "train_mpi --ep 2 --dp 2 vs --ep 1" sh tests/epdp.sh "$MPIRUN"
else
    skip "mpi" "Open MPI not found (apt-get install libopenmpi-dev openmpi-bin); the MPI backend was not tested"
fi
# sanitizers: ASan + UBSan over the same suites (1 thread keeps it quick)
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
if [ -x "$B/san/moept_check" ]; then
    suite "asan+ubsan reference cases" env OMP_NUM_THREADS=2 "$B/san/moept_check" $CASES
    for t in test_grad test_props test_errors test_ep test_ckpt test_overlap test_fsdp test_calls; do
        suite "asan+ubsan $t" env OMP_NUM_THREADS=2 "$B/san/$t"
    done
else
    skip "asan+ubsan" "the compiler cannot link -fsanitize=address,undefined (libasan/libubsan missing)"
fi
if [ -x "$B/tsan/test_ep" ]; then
    for t in test_ep test_overlap test_calls test_props test_errors test_ckpt; do # Makefile's TSAN_TESTS
        suite "tsan $t" "$B/tsan/$t"
    done
else
    skip "tsan" "the compiler cannot link -fsanitize=thread (libtsan missing)"
fi
if [ -n "$CBLAS" ]; then
    suite "cblas reference cases" "$B/cblas/moept_check" $CASES
    for t in test_grad test_props test_errors; do
        suite "cblas $t" "$B/cblas/$t"
    done
else
    skip "cblas" "OpenBLAS not found (apt-get install libopenblas-dev); the MOEPT_CBLAS path was not tested"
fi

# The builtin GEMM: its micro-kernels' assembly for every target, then each
# kernel this machine can run over the reference cases and gradient checks
suite "gemm: micro-kernel assembly (gcc, clang; native, x86-64-v3, x86-64-v4, aarch64)" sh tests/check_gemm_asm.sh
suite "gemm portable kernel: reference cases" "$B/gemm-portable/moept_check" $CASES
suite "gemm portable kernel: test_grad" "$B/gemm-portable/test_grad"
suite "gemm portable kernel: test_props (every transpose, edges, beta)" "$B/gemm-portable/test_props"
suite "gemm portable kernel, scalar (activations too): reference cases" "$B/gemm-scalar/moept_check" $CASES
suite "gemm portable kernel, scalar (activations too): test_props" "$B/gemm-scalar/test_props"
if [ -n "$GEMM_V3" ]; then
    suite "gemm -march=x86-64-v3 (AVX2+FMA): reference cases" "$B/gemm-v3/moept_check" $CASES
    suite "gemm -march=x86-64-v3 (AVX2+FMA): test_grad" "$B/gemm-v3/test_grad"
    suite "gemm -march=x86-64-v3 (AVX2+FMA): test_props" "$B/gemm-v3/test_props"
else
    skip "gemm -march=x86-64-v3" "$([ -n "$ARCH_X86" ] && echo "this CPU has no AVX2+FMA" || echo "not x86-64")"
fi
if [ -n "$GEMM_V4" ]; then
    suite "gemm -march=x86-64-v4 (AVX-512): reference cases" "$B/gemm-v4/moept_check" $CASES
    suite "gemm -march=x86-64-v4 (AVX-512): test_grad" "$B/gemm-v4/test_grad"
    suite "gemm -march=x86-64-v4 (AVX-512): test_props" "$B/gemm-v4/test_props"
else
    skip "gemm -march=x86-64-v4" "this CPU has no AVX-512F: that kernel's assembly is checked above, it did not run"
fi
if [ -n "$QEMU_AARCH64" ]; then
    # qemu-user translates each instruction: right answers, meaningless times
    suite "aarch64 under qemu-user (NEON kernel): reference cases" "$QEMU_AARCH64" "$B/aarch64/moept_check" $CASES
    suite "aarch64 under qemu-user: reference cases --ep 4 (threads)" "$QEMU_AARCH64" "$B/aarch64/moept_check" --ep 4 $CASES
    suite "aarch64 under qemu-user: test_grad" "$QEMU_AARCH64" "$B/aarch64/test_grad"
    suite "aarch64 under qemu-user: test_props (every GEMM transpose, edges)" "$QEMU_AARCH64" "$B/aarch64/test_props"
    suite "aarch64 under qemu-user: test_ep" "$QEMU_AARCH64" "$B/aarch64/test_ep"
else
    skip "aarch64" "aarch64-linux-gnu-gcc or qemu-user missing (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)"
fi

if [ -n "$VALGRIND" ]; then
    suite "valgrind reference cases" "$VALGRIND" -q --error-exitcode=9 --leak-check=full "$B/vg/moept_check" $CASES
    for t in test_grad test_props test_errors test_overlap test_fsdp test_calls; do
        suite "valgrind $t" "$VALGRIND" -q --error-exitcode=9 --leak-check=full "$B/vg/$t"
    done
else
    skip "valgrind" "valgrind not installed"
fi

# The CUDA executor on the emulated GPU (tests/emu): moept_kernels.cu run on
# the CPU under memcheck, racecheck, synccheck, initcheck and the stream
# hazard check; emulated cuBLAS and NCCL (ranks as threads, or processes).
# Any checker report fails the program (exit 66); a wait that would last for
# ever on a GPU is a "hang" report after MOEPT_EMU_HANG_S seconds (exit 72).
export MOEPT_EMU_HANG_S=${MOEPT_EMU_HANG_S:-90}
emu_t0=$(now)
if [ -n "$EMU" ]; then
    for n in 1 2 4; do
        suite "emu: reference cases --ep $n (fp32 1e-5, bf16 2^-6 vs bf16 reference)" timeout 300 "$B/emu/moept_check" --ep $n $CASES
        suite "emu: reference cases --ep $n --sync-free" timeout 300 "$B/emu/moept_check" --ep $n --sync-free $CASES
    done
    # chunked overlap: the pipeline (exchanges on the comm stream, per-chunk
    # events into the compute stream) runs only with --ep > 1
    for n in 2 4; do
        suite "emu: reference cases --ep $n --chunks 3" timeout 300 "$B/emu/moept_check" --ep $n --chunks 3 $CASES
    done
    # the expert GEMMs' other cuBLAS forms (moept_cuda_options.gemm_form; auto runs above)
    for f in grouped per-expert strided; do
        suite "emu: reference cases --ep 2 --gemm-form $f" timeout 300 "$B/emu/moept_check" --ep 2 --gemm-form $f $CASES
    done
    for c in mixtral_e8_t40 qwen2_shared_norm_e8 olmoe_nonorm deepseek_group; do
        for ch in 1 3; do
            suite "emu: --weights $c --ep 2 --chunks $ch" timeout 120 "$B/emu/moept_check" --ep 2 --chunks $ch --weights tests/checkpoints/$c --layer 1 tests/cases/$c.safetensors
        done
    done
    suite "emu: test_emu (each checker fires; cuBLAS hand-worked)" "$B/emu/test_emu"
    suite "emu: test_cuda" "$B/emu/test_cuda"
    suite "emu: test_fault (a kernel fault loses the context)" "$B/emu/test_fault"
    suite "emu: train_cuda vs train, fp32" sh tests/curves.sh fp32 "$B/emu/train"
    suite "emu: train_cuda --bf16 vs train" sh tests/curves.sh bf16 "$B/emu/train"
    suite "emu: bench_cuda runs, every GEMM form (tiny shape; its times mean nothing here)" "$B/emu/bench_cuda" --tokens 64 --hidden 32 --ffn 48 --experts 4 --topk 2 --reps 2 --gemm-form all
    for ch in 1 3; do
        suite "emu asan+ubsan: reference cases --ep 2 --chunks $ch" env LSAN_OPTIONS=suppressions=tests/emu/lsan.supp timeout 300 "$B/emu-san/moept_check" --ep 2 --chunks $ch $CASES
    done
    suite "emu asan+ubsan: reference cases --ep 2 --sync-free" env LSAN_OPTIONS=suppressions=tests/emu/lsan.supp timeout 300 "$B/emu-san/moept_check" --ep 2 --sync-free $CASES
    # one process per emulated GPU, as users deploy it (each process one
    # device, NCCL across processes, the ids broadcast over MPI)
    if [ -n "$MPIRUN" ]; then
        for n in 2 4; do
            for m in "" --sync-free "--chunks 3"; do
                suite "emu: reference cases, mpirun -np $n moept_check_mpi --ep $n $m" env MOEPT_EMU_DEVICES=1 \
                    timeout 300 "$MPIRUN" --oversubscribe -np $n "$B/emu/moept_check_mpi" --ep $n $m $CASES
            done
        done
        suite "emu: train_mpi --ep 4 (4 processes) vs train" env MOEPT_EMU_DEVICES=1 sh tests/epdp.sh "$MPIRUN" \
            "$B/emu/train_mpi" 4 1
        suite "emu: train_mpi --ep 2 --dp 2 (4 processes) vs train" env MOEPT_EMU_DEVICES=1 sh tests/epdp.sh \
            "$MPIRUN" "$B/emu/train_mpi" 2 2
        suite "emu: train_mpi --ep 2 --bf16 (2 processes) vs train" env MOEPT_EMU_DEVICES=1 sh tests/epdp.sh \
            "$MPIRUN" "$B/emu/train_mpi" 2 1 bf16
        suite "emu: kill -9 of one GPU process mid-training" env MOEPT_EMU_DEVICES=1 sh tests/crash_gpu.sh \
            "$MPIRUN" "$B/emu/train_mpi" 3
    else
        skip "emu: one process per GPU" "mpirun not installed"
    fi
    echo "== the emulated GPU's suites took $(echo "$(now) $emu_t0" | awk '{ printf "%.0f", $1 - $2 }') s"
else
    skip "emu" "the CUDA, cuBLAS and NCCL headers were not found (CUDA_HOME, NCCL_HOME); the emulated GPU suite did not run"
fi

# CUDA: compiled and linked (nvcc, cuBLAS, NCCL) when found; without a GPU
# every GPU check reports itself skipped
if [ -n "$CUDA" ]; then
    suite "cuda: no kernel spills, static shared memory <= 48 KiB (nvcc -Xptxas -v)" sh tests/check_ptxas.sh "$B/cuda/ptxas.txt"
    suite "cuda reference cases (fp32 1e-5, bf16 2^-6 vs bf16 reference)" "$B/moept_check_cuda" $CASES
    suite "test_cuda" "$B/test_cuda"
    suite "test_fault (a kernel fault loses the context)" "$B/test_fault"
    suite "train_cuda" "$B/train_cuda" --steps 30 --quiet
    if [ -n "$MPIRUN" ]; then # one process per GPU: as many processes as this machine has GPUs (1 here)
        suite "cuda reference cases, mpirun -np 1 moept_check_cuda_mpi" "$MPIRUN" -np 1 "$B/moept_check_cuda_mpi" \
            --ep 1 $CASES
        suite "train_cuda_mpi (mpirun -np 1)" "$MPIRUN" -np 1 "$B/train_cuda_mpi" --steps 30 --quiet
    fi
else
    skip "cuda" "nvcc, cuBLAS or NCCL not found (CUDA_HOME, NCCL_HOME); the CUDA executor was not built"
fi

p=$(grep -c '^ok - ' "$B/results.txt")
f=$(grep -c '^FAIL - ' "$B/results.txt")
s=$(grep -c '^skip - ' "$B/results.txt")
echo
echo "the slowest suites (seconds):"
sort -rn "$B/times.txt" | head -n 5
grep '^FAIL - ' "$B/results.txt"
echo "total: $p passed, $f failed, $s skipped"
[ "$f" -eq 0 ] && [ $status -eq 0 ]
