#!/bin/sh
# Functions of at most 80 lines, signature to closing brace, in the files
# given (C and CUDA in this project's layout: a definition starts at
# column 0 and ends with a "}" line at column 0); the argued exceptions are
# named in docs/DESIGN.md's "Argued exceptions" and passed as -x NAME.
# usage: sh tests/check_funcs.sh [-x NAME]... FILE...
max=80
skip=" "
while [ "$1" = "-x" ]; do skip="$skip$2 "; shift 2; done
[ $# -gt 0 ] || { echo "FAIL - check_funcs: no files given"; exit 1; }
long=$(awk -v max=$max -v skip="$skip" '
    FNR == 1 { start = 0 }
    /^[A-Za-z_].*\(/ && !/;[ \t]*(\/\*.*)?$/ && !/^#/ && !start { start = FNR; sig = $0 }
    /^}[ \t]*$/ && start {
        n = FNR - start + 1
        name = sig; sub(/\(.*/, "", name); sub(/.*[ *]/, "", name)
        if (n > max && index(skip, " " name " ") == 0) print FILENAME ":" start ": " name " " n " lines"
        start = 0
    }
    /^};?[ \t]*$|^} [A-Za-z_0-9]*;/ && !/^}[ \t]*$/ { start = 0 }' "$@") ||
    { echo "FAIL - check_funcs: cannot read $*"; exit 1; }
if [ -n "$long" ]; then
    echo "FAIL - functions of at most $max lines in $# files: $(echo "$long" | wc -l) longer"
    echo "$long" | sed 's/^/    /'
    exit 1
fi
echo "ok - functions of at most $max lines in $# files"
