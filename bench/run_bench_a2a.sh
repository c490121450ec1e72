#!/bin/sh
# bench_a2a over threads and over MPI, 4 ranks (oversubscribed on 2 cores)
# and 2 ranks (one per core). Prints the RESULT lines and a markdown table.
# 25 steps a run: a step's barriers wait for the slower rank's experts, and
# on a shared 2-core VM that straggle moves a 9-step median by ±20%.
B=${B:-build}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for n in 4 2; do
    "$B/bench_a2a" --ranks $n --reps 25 | tee -a "$out"
    if [ -x "$B/bench_a2a_mpi" ] && command -v mpirun >/dev/null; then
        mpirun --oversubscribe --mca mpi_yield_when_idle 1 -np $n "$B/bench_a2a_mpi" --reps 25 | tee -a "$out"
    fi
done
echo
echo "| backend | ranks | moept dispatch+combine, fwd+bwd (ms) | of which in comm calls (ms) | raw all-to-all-v x4 (ms) | ratio | algbw moept / raw (GB/s) | busbw moept / raw (GB/s) | slowest rank | bytes per exchange | bytes = routed rows x D x 4 |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
sed -n 's/^RESULT //p' "$out" | while read -r line; do
    eval "$(echo "$line" | tr ' ' '\n' | sed 's/^\([a-z_]*\)=\(.*\)$/\1="\2"/')"
    echo "| $backend | $ranks | $moept_ms | $comm_calls_ms | $raw_ms | $ratio | $algbw_moept / $algbw_raw | $busbw_moept / $busbw_raw | $slowest_rank | $bytes_per_exchange | $bytes_exact |"
done
