#!/bin/sh
# Lines of at most 110 columns (a tab to the next multiple of 8, a UTF-8
# character one column) in the files given: one "ok" line, or a "FAIL" line
# with each longer line as FILE:LINE: COLUMNS.
# usage: sh tests/check_style.sh FILE...
max=110
[ $# -gt 0 ] || { echo "FAIL - check_style: no files given"; exit 1; }
long=$(LC_ALL=C awk -v max=$max '
    {
        s = $0; gsub(/[\200-\277]/, "", s)      # UTF-8 continuation bytes take no column
        w = length(s)
        if (index(s, "\t")) {
            w = 0
            for (i = 1; i <= length(s); i++) w = substr(s, i, 1) == "\t" ? w + 8 - w % 8 : w + 1
        }
        if (w > max) print FILENAME ":" FNR ": " w " columns"
    }' "$@") || { echo "FAIL - check_style: cannot read $*"; exit 1; }
if [ -n "$long" ]; then
    echo "FAIL - lines of at most $max columns in $# files: $(echo "$long" | wc -l) longer"
    echo "$long" | sed 's/^/    /'
    exit 1
fi
echo "ok - lines of at most $max columns in $# files"
