#!/bin/sh
# Runs every test suite of `make test` and totals the results.
# Suites print "ok - ...", "FAIL - ...", "skip - ..." lines; the reference
# checker prints PASS/FAIL lines. The last line is the grand total.
B=${B:-build}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0

suite() { # name, command...
    name=$1; shift
    echo "== $name"
    "$@" >"$log" 2>&1
    rc=$?
    cat "$log"
    sed -e 's/^\(.*\)  *PASS  .*/ok - \1/' -e 's/^\(.*\)  *FAIL  .*/FAIL - \1/' \
        -e 's/^\([^ ]*\)  *SKIP  \(.*\)/skip - \1 (\2)/' "$log" |
        grep -E '^(ok|FAIL|skip) - ' | sed "s|^\([a-zA-Z]*\) - |\1 - $name: |" >>"$B/results.txt"
    if [ $rc -ne 0 ]; then
        echo "FAIL - $name: exit status $rc" >>"$B/results.txt"
        status=1
    fi
}

skip() { echo "skip - $1: $2" | tee -a "$B/results.txt"; }

: >"$B/results.txt"
suite "reference cases" "$B/moept_check" $CASES
for t in test_grad test_props test_errors; do
    suite "$t" "$B/$t"
done
# expert parallel over threads: every case whose E splits over the ranks
for n in 2 4 8; do
    suite "reference cases --ep $n (threads)" "$B/moept_check" --ep $n $CASES
done
suite "test_ep" "$B/test_ep"
# ... and over MPI processes
if [ -n "$MPIRUN" ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    for n in 2 4; do
        suite "reference cases --ep $n (mpirun -np $n)" timeout 300 "$MPIRUN" --oversubscribe -np $n "$B/moept_check_mpi" --ep $n $CASES
    done
else
    skip "mpi" "Open MPI not found (apt-get install libopenmpi-dev openmpi-bin); the MPI backend was not tested"
fi
# sanitizers: ASan + UBSan over the same suites (1 thread keeps it quick)
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
suite "asan+ubsan reference cases" env OMP_NUM_THREADS=2 "$B/san/moept_check" $CASES
for t in test_grad test_props test_errors test_ep; do
    suite "asan+ubsan $t" env OMP_NUM_THREADS=2 "$B/san/$t"
done
suite "tsan test_ep" "$B/tsan/test_ep"
if [ -n "$CBLAS" ]; then
    suite "cblas reference cases" "$B/cblas/moept_check" $CASES
    for t in test_grad test_props test_errors; do
        suite "cblas $t" "$B/cblas/$t"
    done
else
    skip "cblas" "OpenBLAS not found (apt-get install libopenblas-dev); the MOEPT_CBLAS path was not tested"
fi

if [ -n "$VALGRIND" ]; then
    suite "valgrind reference cases" "$VALGRIND" -q --error-exitcode=9 --leak-check=full "$B/vg/moept_check" $CASES
    for t in test_grad test_props test_errors; do
        suite "valgrind $t" "$VALGRIND" -q --error-exitcode=9 --leak-check=full "$B/vg/$t"
    done
else
    skip "valgrind" "valgrind not installed"
fi

p=$(grep -c '^ok - ' "$B/results.txt")
f=$(grep -c '^FAIL - ' "$B/results.txt")
s=$(grep -c '^skip - ' "$B/results.txt")
echo
grep '^FAIL - ' "$B/results.txt"
echo "total: $p passed, $f failed, $s skipped"
[ "$f" -eq 0 ] && [ $status -eq 0 ]
