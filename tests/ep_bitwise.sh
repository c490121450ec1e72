#!/bin/sh
# EP N equals EP 1 bitwise: runs the reference checker with the options given at --ep 1 and at each
# --ep N, and compares each case's --ep-digest (a hash of every token's output, input gradient and
# routing and every expert's gradients: the results no rank split may change; the losses and the
# gradients summed over the ranks are left out). Prints an ok or FAIL line a case and --ep, and the
# checker's own output where a run failed.
# usage: sh tests/ep_bitwise.sh "N..." CHECKER [OPTIONS...] -- CASE...
eps=$1
shift
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
status=0
run() { # ep, out: "label digest" a passed case
    "$@" >"$d/log" 2>&1
    r=$?
    sed -n 's/^\(.*[^ ]\) *PASS .* ep-digest \([0-9a-f]*\)$/\1|\2/p' "$d/log" | sort
    [ $r -eq 0 ] || { cat "$d/log" >&2; echo "FAIL - $*: exit status $r" >&2; }
    return $r
}
bin=$1
shift
opts=
while [ $# -gt 0 ] && [ "$1" != -- ]; do opts="$opts $1"; shift; done
[ $# -gt 0 ] && shift
run "$bin" --ep 1 $opts --ep-digest "$@" >"$d/1" || status=1
[ -s "$d/1" ] || { echo "FAIL - no case passed at --ep 1"; exit 1; }
for n in $eps; do
    run "$bin" --ep "$n" $opts --ep-digest "$@" >"$d/$n" || status=1
    [ -s "$d/$n" ] || { echo "FAIL - no case passed at --ep $n"; status=1; continue; }
    while IFS='|' read -r label dig; do
        one=$(awk -F'|' -v l="$label" '$1 == l { print $2; exit }' "$d/1")
        if [ -z "$one" ]; then echo "FAIL - $label --ep $n: no EP 1 result"; status=1
        elif [ "$one" = "$dig" ]; then echo "ok - $label --ep $n$opts bitwise EP 1's"
        else echo "FAIL - $label --ep $n$opts: ep-digest $dig, EP 1's $one"; status=1
        fi
    done <"$d/$n"
done
exit $status
