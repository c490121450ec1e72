#!/bin/sh
# Runs a test program as two processes at once, each every other of its
# tests (TU_PART, tests/testutil.h), and prints the first's output, then the
# second's: the lines of one run, in less time where the program keeps one
# core busy (the emulated GPU's tests: a stream's worker at a time). A
# failing part says so with its exit status; rerun it alone with its TU_PART.
# usage: sh tests/halves.sh PROGRAM [ARGS...]
d=$(mktemp -d)
p0=
trap 'rm -rf "$d"' EXIT
trap '[ -n "$p0" ] && kill "$p0" 2>/dev/null; exit 130' INT TERM
TU_PART=0/2 "$@" >"$d/0" 2>&1 &
p0=$!
TU_PART=1/2 "$@" >"$d/1" 2>&1
r1=$?
wait "$p0"
r0=$?
p0=
cat "$d/0" "$d/1"
[ $r0 -eq 0 ] || echo "TU_PART=0/2 $*: exit status $r0"
[ $r1 -eq 0 ] || echo "TU_PART=1/2 $*: exit status $r1"
[ $r0 -eq 0 ] && [ $r1 -eq 0 ]
