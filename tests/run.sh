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
    sed -e 's/^\(.*\)  *PASS  .*/ok - \1/' -e 's/^\(.*\)  *FAIL  .*/FAIL - \1/' "$log" |
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
# sanitizers: ASan + UBSan over the same suites (1 thread keeps it quick)
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
suite "asan+ubsan reference cases" env OMP_NUM_THREADS=2 "$B/san/moept_check" $CASES
for t in test_grad test_props test_errors; do
    suite "asan+ubsan $t" env OMP_NUM_THREADS=2 "$B/san/$t"
done
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
