#!/bin/sh
# The README's runnable commands, run as written in a fresh copy of the repository.
#
# Marker: a fenced block whose opening line is ```sh, on the line right after
#     <!-- runnable -->                  always run
#     <!-- runnable: needs WORD... -->   run where every WORD is found, else "skip":
#                                        a command (mpirun), or a link flag (-lopenblas)
# Unmarked blocks (make test, GPU launches) are not run. The blocks run in the
# order they appear, each by `sh -e` in one temporary copy of the tracked files
# (as a reader pasting them one after another: a later block may use what an
# earlier one built), so a failed block is one whose command fails as written.
# As root, Open MPI's two OMPI_ALLOW_RUN_AS_ROOT variables are set (the README
# says a root user needs them). One "ok/FAIL/skip" line a block; a failure
# prints the block and its output.
# usage: sh tests/readme_commands.sh [README]
readme=${1:-README.md}
[ -f "$readme" ] || { echo "FAIL - $readme not found"; exit 1; }
case $readme in /*) ;; *) readme=$PWD/$readme ;; esac
tmp=$(mktemp -d "${TMPDIR:-/tmp}/moept_readme.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# the tracked files as they are in the working tree (edits included, build/ not)
if git ls-files >"$tmp/files" 2>/dev/null && [ -s "$tmp/files" ]; then
    mkdir "$tmp/repo" && tar -cf - -T "$tmp/files" 2>/dev/null | tar -xf - -C "$tmp/repo"
else
    mkdir "$tmp/repo" && tar -cf - --exclude=./build . | tar -xf - -C "$tmp/repo"
fi
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

# blocks into $tmp/block.N, their "needs" into $tmp/needs.N, the README line into $tmp/line.N
awk -v dir="$tmp" '
    /^<!-- runnable(: needs [^>]*)? -->$/ {
        want = NR; needs = $0
        sub(/^<!-- runnable(: needs)? ?/, "", needs); sub(/ ?-->$/, "", needs)
        next
    }
    want && NR == want + 1 {
        if ($0 != "```sh") {
            print "marker at line " want " is not followed by ```sh" > "/dev/stderr"; exit 3
        }
        n++; inblock = 1; want = 0
        print needs > (dir "/needs." n); print NR + 1 > (dir "/line." n)
        printf "" > (dir "/block." n)
        next
    }
    inblock && /^```$/ { inblock = 0; next }
    inblock { print > (dir "/block." n) }
    END {
        if (inblock) { print "block " n " has no closing ```" > "/dev/stderr"; exit 3 }
        print n + 0 > (dir "/count")
    }
' "$readme" || { echo "FAIL - $readme: a malformed runnable marker"; exit 1; }
count=$(cat "$tmp/count")
[ "$count" -gt 0 ] || { echo "FAIL - $readme has no runnable blocks"; exit 1; }

found() { # a command, or a link flag: linked into an empty program
    case $1 in
        -l*) printf 'int main(void){return 0;}' | ${CC:-cc} -x c - "$1" -o "$tmp/linktest" >/dev/null 2>&1 ;;
        *) command -v "$1" >/dev/null 2>&1 ;;
    esac
}
status=0
i=1
while [ $i -le "$count" ]; do
    line=$(cat "$tmp/line.$i")
    first=$(grep -v '^ *#' "$tmp/block.$i" | grep -m1 . | sed 's/  *# .*//' | cut -c1-60)
    name="README block at line $line ($first)"
    missing=
    for w in $(cat "$tmp/needs.$i"); do found "$w" || missing="$missing $w"; done
    if [ -n "$missing" ]; then
        printf 'skip - %s: not found:%s\n' "$name" "$missing"
    elif (cd "$tmp/repo" && timeout 300 sh -e -x "$tmp/block.$i") >"$tmp/out.$i" 2>&1; then
        printf 'ok - %s\n' "$name"
    else
        printf 'FAIL - %s: exit status %s\n' "$name" $?
        sed 's/^/    | /' "$tmp/block.$i"
        echo "    output:"
        tail -n 40 "$tmp/out.$i" | sed 's/^/    /'
        status=1
    fi
    i=$((i + 1))
done
exit $status
