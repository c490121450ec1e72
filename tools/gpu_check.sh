#!/bin/sh
# tools/gpu_check.sh - the real-GPU checks, for a session lent a GPU machine
# (the device tool; docs/PERF.md "The CUDA executor on one H200" records what they gave).
#
#   sh tools/gpu_check.sh [build|prebuilt] [rules] [check] [ep1gpu] [nccl-multirank]
#                         [fp8|fp8_table|fp8_checks] [sanitize]
#                         [bench] [bench_small] [profile] [grouped] [torch] [peers]
#                         (default: build rules check ep1gpu fp8 sanitize bench torch peers)
#
# prebuilt: instead of build, the binaries tools/gpu_prebuild.sh built
#           beforehand and the device tool carried (GPUB, default gpub), cuBLAS,
#           NCCL and the CUDA runtime looked up on the machine; Open MPI from
#           $GPUB/ompi_env.sh where carried (the lent machines have no mpirun).
#           Falls back to build when a library is not found.
# build:    make cuda for the machine's GPU (NCCL from CUDA_HOME, else from the
#           nvidia-nccl Python package), and the CPU example for the curves
# check:    moept_check_cuda on every case (fp32 1e-5 and bf16 2^-6, as the
#           emulated suite), the --weights cases, test_cuda (a captured graph
#           replayed included), test_fault (the lost-context path), the 4-step loss
#           curves against the CPU (fp32, bf16), train_cuda 300 steps, the
#           one-process-per-GPU binaries at EP 1 (mpirun -np 1); with two or
#           more GPUs also --ep 2 as threads (chunked and not) and the
#           multi-process recipe (mpirun -np N, N = 2..GPUs: every case,
#           --sync-free, --chunks 3, the example's curve), each process one GPU
# ep1gpu:   several ranks on the one GPU, as threads: moept_check_cuda --ep 2 and
#           4 over moept_comm_cuda_threads (plain, --sync-free, --chunks 3,
#           --reshard); and over NCCL (--comm nccl-one-gpu,
#           NCCL_MULTI_RANK_GPU_ENABLE=1), recorded but not counted as a
#           failure, since NCCL before 2.30 refuses two ranks on one GPU
# nccl-multirank: the same over NCCL 2.30+, every failure counted: the archive
#           tools/build_nccl.sh put in $GPUB unpacked, its libnccl.so.2 first on
#           LD_LIBRARY_PATH (the version NCCL_DEBUG=VERSION prints must be 2.30+),
#           NCCL_MULTI_RANK_GPU_ENABLE=1; moept_check_cuda --ep 2 and 4 --comm
#           nccl-one-gpu (threads) and mpirun -np 2 and 4 moept_check_cuda_mpi
#           (processes, all on device 0), every case, plain, --sync-free,
#           --chunks 3, --reshard; at 4 ranks NCCL_MAX_CTAS 8 (or the one set).
#           The steps share NCCL_MR_BUDGET seconds (420: the device tool's call
#           is 600 s), each at most STEP_TIMEOUT (120); NCCL_MR_EP (default
#           "2 4") picks the rank counts, for a second call
# sanitize: compute-sanitizer memcheck, racecheck, synccheck, initcheck on
#           moept_check_cuda over three cases
# bench:    bench_cuda at Mixtral-8x7B's layer (D 4096, F 14336, E 8, K 2,
#           every expert on the one GPU) against its GEMM floor, bf16, T 8192
#           (each GEMM form: moept_cuda_options.gemm_form) and 4096; fp32 at
#           T 4096; DeepSeek-V3's experts (D 7168, F 2048, 16 local, K 8) in
#           bf16 at T 8192, each GEMM form
# bench_small: each GEMM form at fewer rows an expert: Mixtral and DeepSeek-V3
#           at T 1024, Qwen3-30B-A3B's (D 2048, F 768, E 128, K 8) and
#           OLMoE's (D 2048, F 1024, E 64, K 8) layers at T 4096, bf16
# grouped:  the grouped kernel (gemm_form kernel, sm_90a): moept_check_cuda --gemm-form kernel
#           over every case (plain, --sync-free), test_cuda (its edge shapes, a captured
#           graph replayed through it), then bench_cuda at Qwen3-30B-A3B's and
#           OLMoE's layers (T 4096), DeepSeek-V3's experts and Mixtral-8x7B (T 8192): the
#           kernel at ring depths 2 to 6 (MOEPT_GK_STAGES: build/st<N>/bench_cuda, made by
#           gpu_prebuild.sh or here) and without its gather (build/stng: MOEPT_GK_GATHER=0, the
#           gate/up GEMM on the dispatch's permuted copy), then every form (the kernel among them)
#           against the GEMM floor, in the sync-free mode too at Qwen3's and DeepSeek-V3's shapes,
#           then the peers
# profile:  where the Mixtral layer's and DeepSeek-V3 experts' step (bf16,
#           T 8192, default form) spend their GPU time beyond the GEMMs:
#           tools/cupti_trace.c's records of bench_cuda, summed per step by
#           tools/cupti_summary.py (where gpu_prebuild.sh built the tracer;
#           else Nsight Systems' summaries where nsys is installed)
# rules:    tests/cuda_rules.cu's answers against tests/cuda_rules.txt
# fp8:      fp8_table, then fp8_checks, their steps sharing FP8_BUDGET seconds (540: a device tool's
#           call is 600 s), each at most STEP_TIMEOUT (180); a step past the budget is not run and
#           fails, so a second call can run either part alone (under the same budget); then (either
#           part too) tools/fp8_table.py's table of what they measured: $OUT/fp8_table.md, and in the
#           summary (tests/gpu_check_emu.sh runs the phase on the emulated GPU)
# fp8_table: the table's runs, first: the kernel form's FP8 (its bf16 pass) on the reference
#           cases, then bf16 against FP8 at Mixtral's, DeepSeek-V3's and Qwen3-30B-A3B's shapes in
#           AUTO's form and the grouped kernel's (bench_cuda --fp8, one run each, the same bf16 GEMM
#           floor; the kernel form also with its weight gradients by cuBLASLt, build/stlt:
#           MOEPT_GK_WGRAD8=0, and with x's and dy's copies down their rows by the column passes,
#           build/stnx: MOEPT_GK_XCOLS=0), the quantizing kernels' share of each step (profile fp8) and each
#           quantizing pass's rate against a copy of its bytes (bench_q8, same shapes); torch's FP8
#           grouped GEMM (torch._scaled_grouped_mm) against its bf16 one (bench/fp8_grouped_peer.py)
# fp8_checks: test_q8 (cvt's E4M3 conversions against moept.c's bytes; the quantizers' bytes; the kernel
#           form's fused ones against the separate passes, the layer's results bitwise; --wide: with 300
#           experts); the kernel form's FP8 sync-free, the FP8 layer (config.fp8) and the device comm's
#           records (EP 2, plain and chunked) on the reference cases; cuBLASLt's block-scaled FP8 GEMMs
#           (tests/lt_rules.cu's answers against tests/lt_rules.txt, their accuracy against the exact
#           product of the dequantized operands, their time against bf16 at Mixtral's and DeepSeek-V3's
#           expert GEMMs); the 4-step loss curve against the CPU's FP8; train_cuda --bf16 300 steps with
#           --dtype fp8 and without, also at --dim 1024 --ffn 512 (full FP8 tiles; tools/curve_diff.py
#           compares each pair)
# torch:    moept_torch.py on this machine's torch and transformers (the first of python3 and
#           /usr/bin/python3 whose torch sees the GPU): tests/test_torch.py with CPU layers (this
#           transformers' blocks) and CUDA layers in fp32 and bf16; tests/test_torch_contract.py's
#           test_compile (CPU layers; torch >= 2.4); examples/hf_swap.py --check for
#           each family with CPU layers, on the GPU in fp32 and bf16 (autocast), and in bf16 at
#           D 1024 with the MoE block timed at 8192 tokens against transformers' (docs/TORCH.md)
# peers:    bench/bench_peers.py: one MoE layer's forward + backward, moept's C API (bench_cuda) and
#           moept_torch beside transformers' block in each experts implementation and a
#           torch._grouped_mm layer, each with bf16 parameters and with fp32 parameters under
#           torch.autocast (bf16), at Mixtral-8x7B (T 8192), DeepSeek-V3's experts (16 local, top-8,
#           T 8192) and Qwen3-30B-A3B (T 4096), bf16 in and out (docs/PERF.md has the table)
#
# Logs go to $OUT (the device tool's output folder; default build/gpu): one
# <phase>.log each and summary.txt, one line per step with its exit status
# and seconds. Exits nonzero if any step failed.
set -u
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
SUM="$OUT/summary.txt"
phases=${*:-build rules check ep1gpu fp8 sanitize bench torch peers}
failed=0

# name, command...: appended to the phase's log; a summary line. Under a phase's budget (END: budget), a
# step with under 15 s left is not run (a FAIL line) and the time left caps its STEP_TIMEOUT
step() {
    name=$1; shift
    to=${STEP_TIMEOUT:-0}
    if [ -n "${END:-}" ]; then
        left=$((END - $(date +%s)))
        if [ $left -lt 15 ]; then
            echo "FAIL - not run, the phase's budget spent: $name" | tee -a "$SUM"
            failed=1
            return
        fi
        if [ "$to" -le 0 ] || [ "$to" -gt $left ]; then to=$left; fi
    fi
    echo "== $name" >>"$LOG"
    t0=$(date +%s)
    if [ "$to" -gt 0 ]; then
        timeout -k 10 "$to" "$@" >>"$LOG" 2>&1 # (-k: killed where TERM does not end it)
    else
        "$@" >>"$LOG" 2>&1
    fi
    rc=$?
    [ $rc -ne 0 ] && failed=1
    line=$(printf '%s rc=%d %4ds  %s' "$(date -u +%H:%M:%S)" $rc $(($(date +%s) - t0)) "$name")
    echo "$line" | tee -a "$SUM"
}

# budget SECONDS [STEP]: the steps from here share SECONDS (a device tool's call is at most 600 s), each
# at most STEP (default 120) where STEP_TIMEOUT is unset; budget alone: the budget off, STEP_TIMEOUT as it was
budget() {
    if [ $# -eq 0 ]; then
        [ -n "${END:-}" ] && STEP_TIMEOUT=${st0:-0}
        END=
        return
    fi
    [ -n "${END:-}" ] || st0=${STEP_TIMEOUT:-0} # (a budget within one: the outer one's STEP_TIMEOUT kept)
    END=$(($(date +%s) + $1))
    [ "$st0" -gt 0 ] || STEP_TIMEOUT=${2:-120}
}

nccl_home() { # where nccl.h and libnccl are: CUDA_HOME, else the Python package
    for d in "${NCCL_HOME:-}" /usr/local/cuda /usr; do
        [ -n "$d" ] && [ -f "$d/include/nccl.h" ] && { echo "$d"; return; }
    done
    p=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null) || return
    mkdir -p build/nccl/lib
    ln -sfn "$p/include" build/nccl/include
    for f in "$p"/lib/libnccl.so*; do ln -sf "$f" build/nccl/lib/libnccl.so; ln -sf "$f" build/nccl/lib/libnccl.so.2; done
    echo "$PWD/build/nccl"
}
# an architecture's gencode name: 90 is sm_90a, whose arch-specific wgmma the grouped kernel needs
sfx() { if [ "$1" = 90 ]; then echo 90a; else echo "$1"; fi; }

gpus() { nvidia-smi -L 2>/dev/null | grep -c '^GPU'; }

build() {
    LOG="$OUT/build.log"
    {
        date -u
        nvidia-smi
        nvcc --version
        uname -r
    } >>"$LOG" 2>&1
    NCCL_HOME=$(nccl_home)
    export NCCL_HOME
    echo "NCCL_HOME=$NCCL_HOME" | tee -a "$SUM"
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d .)
    mpi=$(command -v mpicc >/dev/null && echo build/train_mpi)
    step "make cuda (sm_${cap:-90})" make -j8 cuda build/train build/cuda_rules build/libmoept_cuda.so $mpi \
        CUDA_ARCHS="-gencode arch=compute_$(sfx "${cap:-90}"),code=sm_$(sfx "${cap:-90}")" NCCL_HOME="$NCCL_HOME"
    step "ptxas: no spills" sh tests/check_ptxas.sh
}

prebuilt() {
    LOG="$OUT/build.log"
    { date -u; nvidia-smi; uname -r; lscpu | head -20; } >>"$LOG" 2>&1
    g=${GPUB:-gpub}
    mkdir -p build && cp -a "$g"/. build/ || { build; return; }
    d=$(for n in libcublas.so.13 libcublasLt.so.13 libnccl.so.2 libcudart.so.13; do
        find /usr/local/cuda/ /usr/local/cuda/lib64/ /opt /usr/lib/python3 /usr/local/lib -name "$n" \
            2>/dev/null | head -1
    done | xargs -r -n1 dirname | sort -u | tr '\n' :)
    export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:-}"
    # shellcheck disable=SC1090
    [ -f "$g/ompi_env.sh" ] && . "$g/ompi_env.sh"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" | tee -a "$SUM"
    ldd build/moept_check_cuda build/moept_check_cuda_mpi >>"$LOG" 2>&1
    if ldd build/moept_check_cuda | grep -q 'not found'; then
        echo "prebuilt: a library is missing; building here" | tee -a "$SUM"
        build
    fi
}

check() {
    LOG="$OUT/check.log"
    step "moept_check_cuda: every case, fp32 and bf16" build/moept_check_cuda tests/cases/*.safetensors
    step "moept_check_cuda --sync-free: every case" build/moept_check_cuda --sync-free tests/cases/*.safetensors
    for c in mixtral_e8_t40 qwen2_shared_norm_e8 olmoe_nonorm deepseek_group; do
        step "moept_check_cuda --weights $c" build/moept_check_cuda --weights tests/checkpoints/$c --layer 1 \
            tests/cases/$c.safetensors
    done
    step "test_cuda" build/test_cuda
    step "test_slots_cuda: forward slots (EP 1; EP 2 and 4 where the GPUs are)" build/test_slots_cuda
    step "test_fault: a kernel fault loses the context, moept says so" build/test_fault
    step "curve fp32 vs CPU" sh tests/curves.sh fp32 build/train_cuda
    step "curve bf16 vs CPU" sh tests/curves.sh bf16 build/train_cuda
    step "train_cuda 300 steps" build/train_cuda --steps 300 --csv "$OUT/train_cuda.csv"
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    if command -v mpirun >/dev/null && [ -x build/moept_check_cuda_mpi ]; then
        step "mpirun -np 1 moept_check_cuda_mpi: every case" mpirun -np 1 build/moept_check_cuda_mpi --ep 1 \
            tests/cases/*.safetensors
        step "mpirun -np 1 train_cuda_mpi 30 steps" mpirun -np 1 build/train_cuda_mpi --steps 30 --quiet
    else
        echo "skip - one process per GPU: mpirun or build/moept_check_cuda_mpi missing" | tee -a "$SUM"
    fi
    if [ "$(gpus)" -ge 2 ]; then
        step "moept_check_cuda --ep 2" build/moept_check_cuda --ep 2 tests/cases/*.safetensors
        step "moept_check_cuda --ep 2 --chunks 3" build/moept_check_cuda --ep 2 --chunks 3 tests/cases/*.safetensors
        step "moept_check_cuda --ep 2 --sync-free" build/moept_check_cuda --ep 2 --sync-free tests/cases/*.safetensors
        n=2
        while [ $n -le "$(gpus)" ] && [ $n -le 8 ]; do
            for m in "" --sync-free "--chunks 3"; do
                step "mpirun -np $n moept_check_cuda_mpi --ep $n $m" mpirun -np $n build/moept_check_cuda_mpi \
                    --ep $n $m tests/cases/*.safetensors
            done
            step "mpirun -np $n train_cuda_mpi --ep $n curve vs CPU" sh tests/epdp.sh mpirun build/train_cuda_mpi $n 1
            n=$((n * 2))
        done
    else
        echo "skip - --ep 2, chunks and the multi-process recipe: $(gpus) GPU(s)" | tee -a "$SUM"
    fi
}

ep1gpu() {
    LOG="$OUT/ep1gpu.log"
    for n in 2 4; do
        for m in "" --sync-free "--chunks 3" --reshard; do
            step "moept_check_cuda --ep $n --comm device $m (threads on GPU 0)" build/moept_check_cuda --ep $n \
                --comm device $m tests/cases/*.safetensors
        done
    done
    f=$failed # NCCL's own: informational (2.28 says "Duplicate GPU detected")
    step "moept_check_cuda --ep 2 --comm nccl-one-gpu (NCCL_MULTI_RANK_GPU_ENABLE=1; needs NCCL 2.30+)" \
        env NCCL_MULTI_RANK_GPU_ENABLE=1 build/moept_check_cuda --ep 2 --comm nccl-one-gpu \
        tests/cases/*.safetensors
    failed=$f
}

nccl_multirank() { # several NCCL ranks on GPU 0 (threads, then processes) over NCCL 2.30+
    LOG="$OUT/nccl-multirank.log"
    g=${GPUB:-gpub}
    a=$(ls "$g"/nccl-*.tar.xz 2>/dev/null | sort -V | tail -1)
    n=build/nccl-multirank
    rm -rf "$n"
    mkdir -p "$n"
    # tar's -J needs the xz program, which a bare image may lack; Python's tarfile reads xz itself
    if [ -z "$a" ] || ! { tar -xJf "$a" -C "$n" 2>>"$LOG" || python3 -m tarfile -e "$a" "$n" >>"$LOG" 2>&1; }
    then
        echo "FAIL - nccl-multirank: no NCCL archive in $g (tools/build_nccl.sh makes it)" | tee -a "$SUM"
        failed=1
        return
    fi
    ld=${LD_LIBRARY_PATH:-}
    export LD_LIBRARY_PATH="$PWD/$n/lib${ld:+:$ld}" NCCL_MULTI_RANK_GPU_ENABLE=1
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    ldd build/moept_check_cuda build/moept_check_cuda_mpi 2>&1 | grep -E '^build|libnccl' >>"$LOG"
    # the steps share NCCL_MR_BUDGET seconds, each at most STEP_TIMEOUT (default 120); a step past the
    # budget is not run and fails (NCCL_MR_EP=4: the rest)
    budget "${NCCL_MR_BUDGET:-420}"
    l0=$(wc -l <"$LOG")
    step "NCCL_DEBUG=VERSION moept_check_cuda --ep 2 --comm nccl-one-gpu: which NCCL is loaded" \
        env NCCL_DEBUG=VERSION build/moept_check_cuda --ep 2 --comm nccl-one-gpu \
        tests/cases/mixtral_e8_t40.safetensors
    v=$(tail -n +$((l0 + 1)) "$LOG" | sed -n 's/.*NCCL version \([0-9][0-9.]*\).*/\1/p' | tail -1)
    echo "# NCCL loaded: ${v:-none}" | tee -a "$SUM"
    case $v in
    2.[3-9][0-9].* | [3-9].*) ;;
    *)
        echo "FAIL - nccl-multirank: NCCL ${v:-?} loaded, not the archive's 2.30+; nothing run" |
            tee -a "$SUM"
        failed=1
        v= ;;
    esac
    # NCCL_MULTI_RANK_GPU_ENABLE (2.30, experimental), as NCCL's user guide has it
    # (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html): each rank on a GPU takes its own
    # channels and NCCL hangs when the GPU cannot hold them all; its defaults hold 2 ranks a GPU, and
    # NCCL_MAX_CTAS caps a rank's channels for more
    for p in ${v:+${NCCL_MR_EP:-2 4}}; do
        x=
        [ "$p" -gt 2 ] && x=NCCL_MAX_CTAS=${NCCL_MAX_CTAS:-8}
        for m in "" --sync-free "--chunks 3" --reshard; do
            # shellcheck disable=SC2086
            step "moept_check_cuda --ep $p --comm nccl-one-gpu${m:+ $m}${x:+ ($x)}" env $x \
                build/moept_check_cuda --ep $p --comm nccl-one-gpu $m tests/cases/*.safetensors
        done
        if ! command -v mpirun >/dev/null || [ ! -x build/moept_check_cuda_mpi ]; then
            echo "FAIL - mpirun -np $p on one GPU: mpirun or build/moept_check_cuda_mpi missing" |
                tee -a "$SUM"
            failed=1
            continue
        fi
        for m in "" --sync-free "--chunks 3" --reshard; do # every process on device 0 (local rank % 1)
            # shellcheck disable=SC2086
            step "mpirun -np $p moept_check_cuda_mpi --ep $p${m:+ $m} (one GPU)${x:+ ($x)}" env $x mpirun \
                -np $p build/moept_check_cuda_mpi --ep $p $m tests/cases/*.safetensors
        done
    done
    budget
    if [ -n "$ld" ]; then LD_LIBRARY_PATH=$ld; else unset LD_LIBRARY_PATH; fi
    unset NCCL_MULTI_RANK_GPU_ENABLE
}

rules() { # CUDA's answers to the calls the emulator has rules for, against tests/cuda_rules.txt
    LOG="$OUT/rules.log"
    { build/cuda_rules capture && build/cuda_rules fault; } >"$OUT/cuda_rules.txt" 2>>"$LOG"
    step "cuda_rules: this GPU answers as tests/cuda_rules.txt" sh tests/cuda_rules.sh build/cuda_rules --no-skip
}

# the FP8 layer (the issue's table first: a device call is at most 600 s, and the steps share FP8_BUDGET,
# 540 s, each at most STEP_TIMEOUT, 180; a step past it is not run and fails): fp8_table, then fp8_checks
# (either alone as a phase: the same budget)
fp8() {
    budget "${FP8_BUDGET:-540}" 180
    fp8_table
    fp8_checks
    budget
    fp8_report
}

# the table of what the FP8 steps wrote (tools/fp8_table.py: $OUT/fp8_table.md, and in the summary), made
# outside the budget: a table of the steps run, however many
fp8_report() {
    if python3 tools/fp8_table.py "$OUT" >"$OUT/fp8_table.md" 2>"$OUT/fp8_table.err"; then
        cat "$OUT/fp8_table.md" >>"$SUM"
        rm -f "$OUT/fp8_table.err"
    else # (the lines it reads, for a table by hand)
        printf 'FAIL - tools/fp8_table.py: %s\n' "$(tail -n 1 "$OUT/fp8_table.err")" | tee -a "$SUM"
        grep -hE "^== bench|^RESULT (tokens|q8)|^(Mixtral|DeepSeek|Qwen3)|^largest" "$OUT/fp8.log" >>"$SUM"
        failed=1
    fi
}

fp8_table() { # the kernel's FP8 on the cases, then bf16 against FP8 at three shapes, each form, the
    # quantizing kernels' share and rate, the peer
    LOG="$OUT/fp8.log"
    step "moept_check_cuda --dtype fp8 --dtype bf16 --gemm-form kernel (the kernel's FP8)" \
        build/moept_check_cuda --dtype fp8 --dtype bf16 --gemm-form kernel tests/cases/*.safetensors
    # the layer in FP8 (bf16 rows, FP8 expert GEMMs) against bf16, each form (AUTO's cuBLAS or cuBLASLt,
    # and the grouped kernel), one run each, the same floor (bf16 GEMMs); tools/fp8_table.py reads the
    # steps' names as "bench_cuda SHAPE T=N VARIANT"
    for sh in mixtral:8192 deepseek:8192 qwen3:4096; do
        for f in auto kernel; do
            step "bench_cuda ${sh%:*} T=${sh#*:} bf16, $f" build/bench_cuda --shape "${sh%:*}" \
                --tokens "${sh#*:}" --bf16 --gemm-form $f
            step "bench_cuda ${sh%:*} T=${sh#*:} FP8, $f" build/bench_cuda --shape "${sh%:*}" \
                --tokens "${sh#*:}" --bf16 --fp8 --gemm-form $f
        done
    done
    # the kernel form with its FP8 weight gradients by cuBLASLt, a matmul an expert, not the kernel's
    [ -x build/stlt/bench_cuda ] || step "make build/stlt/bench_cuda (-DMOEPT_GK_WGRAD8=0)" make -j8 \
        B=build/stlt CUDA_ARCHS="-gencode arch=compute_90a,code=sm_90a" NVCC_DEFS=-DMOEPT_GK_WGRAD8=0 \
        NCCL_HOME="$(nccl_home)" build/stlt/bench_cuda
    for sh in mixtral:8192 deepseek:8192 qwen3:4096; do
        step "bench_cuda ${sh%:*} T=${sh#*:} FP8, kernel, wgrads by cuBLASLt" build/stlt/bench_cuda \
            --shape "${sh%:*}" --tokens "${sh#*:}" --bf16 --fp8 --gemm-form kernel
    done
    # ... with x's and dy's copies down their rows by the column passes, not the kernels that load them
    [ -x build/stnx/bench_cuda ] || step "make build/stnx/bench_cuda (-DMOEPT_GK_XCOLS=0)" make -j8 \
        B=build/stnx CUDA_ARCHS="-gencode arch=compute_90a,code=sm_90a" NVCC_DEFS=-DMOEPT_GK_XCOLS=0 \
        NCCL_HOME="$(nccl_home)" build/stnx/bench_cuda
    for sh in mixtral:8192 deepseek:8192 qwen3:4096; do
        step "bench_cuda ${sh%:*} T=${sh#*:} FP8, kernel, x's and dy's copies by passes" \
            build/stnx/bench_cuda --shape "${sh%:*}" --tokens "${sh#*:}" --bf16 --fp8 --gemm-form kernel
    done
    profile fp8 # the quantizing kernels' share of the FP8 step (moept__k_q8_*; moept__k_combine_bwd8 is
    # combine' with dy's records), per kernel, each form
    LOG="$OUT/fp8.log"
    for sh in mixtral:8192 deepseek:8192 qwen3:4096; do # each quantizing pass's TB/s against a copy's
        step "bench_q8 ${sh%:*} T=${sh#*:}: the quantizing passes" build/bench_q8_cuda --shape "${sh%:*}" \
            --tokens "${sh#*:}"
    done
    P=$(torch_py)
    if [ -n "$P" ]; then
        step "fp8_grouped_peer: torch._scaled_grouped_mm against torch._grouped_mm" $P \
            bench/fp8_grouped_peer.py
    else
        echo "skip - fp8_grouped_peer: no python with torch (seeing a GPU) and transformers" | tee -a "$SUM"
    fi
}

fp8_checks() { # cuBLASLt's rules, the fused quantizers' bytes, the cases in every form, the loss curves
    LOG="$OUT/fp8.log"
    step "test_q8: cvt's E4M3 bytes; the quantizers'; the fused ones' layer bitwise the separate passes'" \
        build/test_q8_cuda
    step "test_q8 --wide: the same with 300 experts" build/test_q8_cuda --wide
    step "moept_check_cuda --dtype fp8 --dtype bf16 --gemm-form kernel --sync-free (the kernel's FP8)" \
        build/moept_check_cuda --dtype fp8 --dtype bf16 --gemm-form kernel --sync-free \
        tests/cases/*.safetensors
    step "moept_check_cuda --dtype fp8: the reference cases (against the file 2^-2, the CPU's FP8 2^-5)" \
        build/moept_check_cuda --dtype fp8 tests/cases/*.safetensors
    for m in "" "--chunks 3"; do
        step "moept_check_cuda --ep 2 --comm device --dtype fp8 $m: FP8 records between ranks" \
            build/moept_check_cuda --ep 2 --comm device --dtype fp8 $m tests/cases/*.safetensors
    done
    step "lt_rules: block-scaled FP8 matmuls answered as tests/lt_rules.txt" sh tests/cuda_rules.sh \
        build/lt_rules --no-skip
    step "lt_rules accuracy" build/lt_rules accuracy
    step "lt_rules time: bf16 and FP8 GEMMs at Mixtral's and DeepSeek-V3's expert shapes" build/lt_rules time
    step "curve fp8 vs CPU" sh tests/curves.sh fp8 build/train_cuda
    # 300 steps, bf16 against FP8: the example's model, and one whose FP8 tiles are full (hidden 1024,
    # experts 512 wide), each pair's moving averages
    for w in "" _wide; do
        for t in bf16 fp8; do
            q=; [ $t = fp8 ] && q="--dtype fp8"
            d=; [ -n "$w" ] && d="--dim 1024 --ffn 512"
            # shellcheck disable=SC2086
            step "train_cuda --bf16${q:+ $q} 300 steps${d:+ $d}" build/train_cuda --steps 300 --bf16 $q $d \
                --csv "$OUT/train_cuda${w}_$t.csv"
        done
        step "curve_diff: bf16 against FP8$w" python3 tools/curve_diff.py "$OUT/train_cuda${w}_bf16.csv" \
            "$OUT/train_cuda${w}_fp8.csv"
    done
    grep -E "^accuracy|^time" "$LOG" | tee -a "$SUM" >/dev/null
}

sanitize() {
    LOG="$OUT/sanitize.log"
    cases="tests/cases/mixtral_e8_t40.safetensors tests/cases/qwen2_shared_norm_e8.safetensors"
    cases="$cases tests/cases/deepseek_group.safetensors"
    for t in memcheck racecheck synccheck initcheck; do
        # shellcheck disable=SC2086
        step "compute-sanitizer --tool $t" compute-sanitizer --tool $t --error-exitcode 1 \
            build/moept_check_cuda $cases
    done
}

bench() {
    LOG="$OUT/bench.log"
    # BENCH_FORM=auto: the default form alone (a short run)
    step "bench_cuda Mixtral layer bf16 T=8192, GEMM form ${BENCH_FORM:-all}" build/bench_cuda --tokens 8192 \
        --bf16 --gemm-form "${BENCH_FORM:-all}"
    step "bench_cuda DeepSeek-V3 experts bf16 T=8192, GEMM form ${BENCH_FORM:-all}" build/bench_cuda \
        --shape deepseek --tokens 8192 --bf16 --gemm-form "${BENCH_FORM:-all}"
    step "bench_cuda Mixtral layer bf16 T=4096" build/bench_cuda --tokens 4096 --bf16
    step "bench_cuda Mixtral layer fp32 T=4096" build/bench_cuda --tokens 4096 --fp32
    grep RESULT "$LOG" | tee -a "$SUM"
}

bench_small() { # where each GEMM form wins at fewer rows an expert (AUTO's choice)
    LOG="$OUT/bench_small.log"
    step "bench_cuda Mixtral layer bf16 T=1024, every GEMM form" build/bench_cuda --tokens 1024 --bf16 \
        --gemm-form all
    step "bench_cuda DeepSeek-V3 experts bf16 T=1024, every GEMM form" build/bench_cuda --shape deepseek \
        --tokens 1024 --bf16 --gemm-form all
    step "bench_cuda Qwen3-30B-A3B layer bf16 T=4096, every GEMM form" build/bench_cuda --hidden 2048 \
        --ffn 768 --experts 128 --topk 8 --tokens 4096 --bf16 --gemm-form all
    step "bench_cuda OLMoE layer bf16 T=4096, every GEMM form" build/bench_cuda --hidden 2048 --ffn 1024 \
        --experts 64 --topk 8 --tokens 4096 --bf16 --gemm-form all
    grep RESULT "$LOG" | grep -v optimizer | tee -a "$SUM"
}

profile() { # where the layer's step spends its GPU time beyond the GEMMs; "profile fp8": the FP8 layer's,
    # also at Qwen3-30B-A3B's shape and in the grouped kernel's form
    x=${1:+_$1}
    LOG="$OUT/profile$x.log"
    g=${GPUB:-gpub}
    case $g in /*) ;; *) g=$PWD/$g ;; esac
    n=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
    runs="mixtral:8192:auto deepseek:8192:auto"
    [ -n "$x" ] && runs="$runs qwen3:4096:auto mixtral:8192:kernel deepseek:8192:kernel qwen3:4096:kernel"
    for r in $runs; do
        shape=${r%%:*} f=${r##*:} tk=${r#*:}
        tk=${tk%:*}
        a="--shape $shape --tokens $tk --bf16 --gemm-form $f --reps 5${1:+ --$1}"
        [ "$f" = auto ] || shape=${shape}_$f
        t="$OUT/trace_$shape$x.csv"
        if [ -f "$g/cupti_trace.so" ]; then # 2 warm-up steps + 5
            # shellcheck disable=SC2086
            step "CUPTI trace: bench_cuda $a" env CUDA_INJECTION64_PATH="$g/cupti_trace.so" CUPTI_TRACE="$t" \
                build/bench_cuda $a
            [ -f "$t" ] || continue
            step "cupti_summary.py: $shape" sh -c "python3 tools/cupti_summary.py '$t' --skip 2 \
                >'$OUT/profile_$shape$x.txt'"
            cat "$OUT/profile_$shape$x.txt" >>"$SUM"
            gzip -f "$t"
        elif [ -n "$n" ]; then
            # shellcheck disable=SC2086
            step "nsys: bench_cuda $a" "$n" profile -t cuda -o "$OUT/prof_$shape$x" -f true build/bench_cuda $a
            step "nsys stats" "$n" stats -q -r cuda_gpu_kern_sum,cuda_api_sum -f csv -o "$OUT/prof_$shape$x" \
                "$OUT/prof_$shape$x.nsys-rep"
            rm -f "$OUT/prof_$shape$x.nsys-rep" "$OUT/prof_$shape$x.sqlite"
        else
            echo "skip - profile: neither $g/cupti_trace.so nor nsys" | tee -a "$SUM"
        fi
    done
}

torch_py() { # the first python whose torch sees the GPU and which has transformers (or $TORCH_PY)
    [ -n "${TORCH_PY:-}" ] && { echo "$TORCH_PY"; return; }
    for p in python3 /usr/bin/python3; do
        $p -c 'import torch, transformers, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null &&
            { echo "$p"; return; }
    done
}

torch_phase() {
    LOG="$OUT/torch.log"
    P=$(torch_py)
    if [ -z "$P" ] || [ ! -f build/libmoept_cuda.so ]; then
        echo "skip - torch: no python with torch (seeing the GPU) and transformers, or no" \
            "build/libmoept_cuda.so" | tee -a "$SUM"
        return
    fi
    $P -c 'import torch, transformers as t; print("# torch", torch.__version__, "transformers",
        t.__version__)' | tee -a "$SUM" "$LOG"
    L=build/libmoept_cuda.so
    step "test_torch, CPU layers" $P tests/test_torch.py --device cpu --lib $L
    step "test_torch, CUDA layers fp32" $P tests/test_torch.py --device cuda --lib $L
    step "test_torch, CUDA layers bf16" $P tests/test_torch.py --device cuda --dtype bf16 --lib $L
    step "test_torch_contract --only test_compile (torch.compile where torch >= 2.4), CPU layers" $P \
        tests/test_torch_contract.py --only test_compile --lib $L
    for f in mixtral qwen2_moe olmoe; do
        step "hf_swap --check --family $f, CPU layers" $P examples/hf_swap.py --check --family $f --lib $L
    done
    for f in mixtral qwen2_moe; do
        step "hf_swap --check --family $f --device cuda" $P examples/hf_swap.py --check --family $f \
            --device cuda --lib $L
        step "hf_swap --check --family $f --device cuda --dtype bf16" $P examples/hf_swap.py --check \
            --family $f --device cuda --dtype bf16 --lib $L
    done
    step "hf_swap --check --device cuda --dtype bf16, D 1024 F 3584 E 8, block timed at T 8192" \
        $P examples/hf_swap.py --check --device cuda --dtype bf16 --hidden 1024 --ffn 3584 --experts 8 \
        --topk 2 --batch 8 --seq 256 --vocab 512 --init 0.02 --steps 10 --time-tokens 8192 --lib $L
    grep -E "^#|largest|gradient error|loss drift|gradients against|MoE block|FAIL" "$LOG" |
        tee -a "$SUM" >/dev/null
}

grouped() { # the grouped kernel (gemm_form kernel): every case through it, its step against cuBLAS's forms
    LOG="$OUT/grouped.log"
    k="--gemm-form kernel"
    step "moept_check_cuda $k: every case, fp32 (cuBLAS) and bf16 (the kernel)" build/moept_check_cuda $k \
        tests/cases/*.safetensors
    step "moept_check_cuda $k --sync-free: every case" build/moept_check_cuda $k --sync-free \
        tests/cases/*.safetensors
    for s in 2 3 5 6 ng; do # (ng: 4 stages, the gate/up GEMM on the permuted copy, not the gather)
        d=-DMOEPT_GK_STAGES=$s
        [ $s = ng ] && d=-DMOEPT_GK_GATHER=0
        [ -x build/st$s/bench_cuda ] || step "make build/st$s/bench_cuda ($d)" make -j8 \
            B=build/st$s CUDA_ARCHS="-gencode arch=compute_90a,code=sm_90a" NVCC_DEFS=$d \
            NCCL_HOME="$(nccl_home)" build/st$s/bench_cuda
    done
    for sh in "--hidden 2048 --ffn 768 --experts 128 --topk 8 --tokens 4096" \
              "--hidden 2048 --ffn 1024 --experts 64 --topk 8 --tokens 4096" \
              "--shape deepseek --tokens 8192" "--tokens 8192"; do
        for s in 2 3 4 5 6 ng; do
            b=build/st$s/bench_cuda
            [ $s = 4 ] && b=build/bench_cuda
            # shellcheck disable=SC2086
            step "sweep: stages $s, $sh" $b $sh --bf16 --gemm-form kernel --reps 10
        done
    done
    step "bench_cuda Qwen3-30B-A3B bf16 T=4096, every form" build/bench_cuda --hidden 2048 --ffn 768 \
        --experts 128 --topk 8 --tokens 4096 --bf16 --gemm-form all
    step "bench_cuda OLMoE bf16 T=4096, every form" build/bench_cuda --hidden 2048 --ffn 1024 --experts 64 \
        --topk 8 --tokens 4096 --bf16 --gemm-form all
    step "bench_cuda DeepSeek-V3 experts bf16 T=8192, every form" build/bench_cuda --shape deepseek \
        --tokens 8192 --bf16 --gemm-form all
    step "bench_cuda Mixtral-8x7B bf16 T=8192, every form" build/bench_cuda --tokens 8192 --bf16 --gemm-form all
    # the sync-free mode's static blocks (dropless: E/K times the rows): the kernel skips their zero rows
    step "bench_cuda Qwen3-30B-A3B bf16 T=4096 --sync-free, every form" build/bench_cuda --hidden 2048 \
        --ffn 768 --experts 128 --topk 8 --tokens 4096 --bf16 --sync-free --gemm-form all
    step "bench_cuda DeepSeek-V3 experts bf16 T=8192 --sync-free, every form" build/bench_cuda \
        --shape deepseek --tokens 8192 --bf16 --sync-free --gemm-form all
    grep -E "^RESULT|^skip|^== sweep" "$LOG" | grep -v optimizer | tee -a "$SUM" >/dev/null
    peers
}

peers() {
    LOG="$OUT/peers.log"
    P=$(torch_py)
    if [ -z "$P" ] || [ ! -f build/libmoept_cuda.so ]; then
        echo "skip - peers: no python with torch (seeing the GPU), or no build/libmoept_cuda.so" |
            tee -a "$SUM"
        return
    fi
    step "bench_peers: Mixtral-8x7B, DeepSeek-V3 experts T 8192, Qwen3-30B-A3B, OLMoE T 4096, bf16 + amp" \
        timeout 420 $P bench/bench_peers.py --device cuda --lib build/libmoept_cuda.so \
        --bench-cuda build/bench_cuda --peers build/peers
    sed -n '/^$/,$p' "$LOG" >>"$SUM"
}

for p in $phases; do
    case $p in
    build | prebuilt | rules | check | ep1gpu | fp8 | sanitize | bench | bench_small | profile | grouped | \
        peers)
        $p ;;
    fp8_table | fp8_checks)
        budget "${FP8_BUDGET:-540}" 180
        $p
        budget
        fp8_report ;;
    torch) torch_phase ;;
    nccl-multirank) nccl_multirank ;;
    *) echo "usage: $0 [build|prebuilt] [rules] [check] [ep1gpu] [nccl-multirank]" \
            "[fp8|fp8_table|fp8_checks] [sanitize] [bench] [bench_small] [profile] [grouped] [torch]" \
            "[peers]" >&2
       exit 2 ;;
    esac
done
exit $failed
