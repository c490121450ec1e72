#!/bin/sh
# `make stress`: the kill -9 loop (tests/crash.sh) with $KILLS kills in each
# mode, MPI modes when Open MPI is there; the last line is the total.
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
echo "stress: $failed of $(echo $modes | wc -w) modes failed"
[ $failed -eq 0 ]
