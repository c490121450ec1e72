#!/bin/sh
# `make stress`: the kill -9 loop (tests/crash.sh) with $KILLS kills in each
# mode, MPI modes when Open MPI is there, and 10 kills of one of 4 emulated-GPU
# processes (tests/crash_gpu.sh) where $EMU is set; then the emulated GPU's
# runs kept out of make test for its time (where $EMU is set: the per-expert
# (cuBLASLt) FP8 form's reference cases at EP 1, 2 and 4, sync-free and
# chunked, each bitwise EP 1's; tools/gpu_check.sh fp8 through tests/gpu_check_emu.sh, test_q8 --wide
# among its steps (the kernel form's FP8 layer with 300 experts, two launches a grouped GEMM); the
# emulator and the kernels under ASan + UBSan
# where $SAN is too: the reference cases at EP 2 with three chunks and one,
# sync-free and FP8, and test_range); the last line is the total.
B=${B:-build}
KILLS=${KILLS:-50}
export B MPIRUN OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
modes="one threads"
if [ -n "$MPIRUN" ]; then modes="$modes mpi mpi-one"; else echo "skip - MPI modes: Open MPI not found"; fi
failed=0
for m in $modes; do
    t0=$(date +%s)
    sh tests/crash.sh "$KILLS" "$m" || failed=$((failed + 1))
    echo "   ($m: $(($(date +%s) - t0)) s)"
done
n=$(echo $modes | wc -w)
if [ -n "$MPIRUN" ] && [ -n "$EMU" ]; then # one of 4 emulated-GPU processes killed mid-step, 10 times
    t0=$(date +%s)
    c=$(ls tests/cases/*.safetensors)
    cases="$c $c $c $c $c $c" # six times over: one pass can end before the kill, 1.5-3.5 s in
    MOEPT_EMU_DEVICES=1 sh tests/crash_gpu.sh "$MPIRUN" "$B/emu/moept_check_mpi" 10 4 --ep 4 \
        $cases || failed=$((failed + 1))
    echo "   (emu moept_check_mpi -np 4: $(($(date +%s) - t0)) s)"
    n=$((n + 1))
else
    echo "skip - emulated GPU processes: Open MPI or the CUDA headers not found"
fi
if [ -n "$EMU" ]; then
    c=$(echo tests/cases/*.safetensors)
    for m in --sync-free "--chunks 3"; do # (make test runs the plain one, and the grouped kernel's three)
        # shellcheck disable=SC2086
        if sh tests/ep_bitwise.sh "2 4" "$B/emu/moept_check" --dtype fp8 $m -- $c >"$B/stress.log" 2>&1; then
            k=$(grep -c '^ok' "$B/stress.log")
            echo "ok - emu/moept_check --dtype fp8 $m at EP 1, 2, 4: $k bitwise EP 1's"
        else
            echo "FAIL - emu/moept_check --dtype fp8 $m:"; tail -n 20 "$B/stress.log"; failed=$((failed + 1))
        fi
        n=$((n + 1))
    done
    # tools/gpu_check.sh's whole FP8 phase, its test_q8 --wide among the steps (make test runs the table's)
    if sh tests/gpu_check_emu.sh fp8 >"$B/stress.log" 2>&1; then
        echo "ok - tests/gpu_check_emu.sh fp8: $(grep -c '^ok' "$B/stress.log") steps and rows"
    else
        echo "FAIL - tests/gpu_check_emu.sh fp8:"; grep -v '^ok' "$B/stress.log" | tail -n 20
        failed=$((failed + 1))
    fi
    n=$((n + 1))
    runs= # (the emulator and the kernels under ASan + UBSan)
    [ -n "$SAN" ] && runs="emu-san/moept_check --ep 2 --chunks 3|emu-san/moept_check --ep 2"
    [ -n "$SAN" ] && runs="$runs|emu-san/moept_check --ep 2 --sync-free"
    [ -n "$SAN" ] && runs="$runs|emu-san/moept_check --ep 2 --dtype fp8"
    IFS='|'
    for r in $runs; do
        IFS=' '
        set -- $r
        p=$1; shift
        if LSAN_OPTIONS=suppressions=tests/emu/lsan.supp "$B/$p" "$@" $c >"$B/stress.log" 2>&1; then
            echo "ok - $p $*: $(tail -n 1 "$B/stress.log")"
        else
            echo "FAIL - $p $*:"; tail -n 20 "$B/stress.log"; failed=$((failed + 1))
        fi
        n=$((n + 1))
        IFS='|'
    done
    IFS=' '
    if [ -n "$SAN" ]; then
        if LSAN_OPTIONS=suppressions=tests/emu/lsan.supp "$B/emu-san/test_range" >"$B/stress.log" 2>&1; then
            echo "ok - emu-san/test_range: $(tail -n 1 "$B/stress.log")"
        else
            echo "FAIL - emu-san/test_range:"; tail -n 20 "$B/stress.log"; failed=$((failed + 1))
        fi
        n=$((n + 1))
    fi
fi
echo "stress: $failed of $n modes failed"
[ $failed -eq 0 ]
