#!/bin/sh
# docs/CUDA.md's lines for a program of one's own on the emulated GPU, run as written: the ```sh
# block right after its "<!-- emu-link -->" line, by sh -e, in a scratch directory that holds the
# repository's tracked files (links to them) and a build/ whose emu/ is the repository's $B/emu (so
# make emu-lib finds what make test built and the run's own files stay in the scratch directory).
# The block builds the CUDA example as a user's program and runs it on the emulated GPU; it must
# run its steps there (no "skip", the closing "train: loss" line). One "ok/FAIL" line; a failure
# prints the block and its output.
# CUDA_HOME, when unset: where the Makefile found the headers (EMU_INC, its -I flags; make test
# passes it), whose directories also go into CPATH (NCCL's headers may lie apart from CUDA's).
# usage: sh tests/emu_link.sh [DOC]
B=${B:-build}
doc=${1:-docs/CUDA.md}
root=$PWD
case $B in /*) emu=$B/emu ;; *) emu=$root/$B/emu ;; esac
tmp=$(mktemp -d "${TMPDIR:-/tmp}/moept_emu_link.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
awk '/^<!-- emu-link -->$/ { at = NR; next }
     at && NR == at + 1 { if ($0 != "```sh") exit 3; on = 1; next }
     on && /^```$/ { exit }
     on { print }' "$doc" >"$tmp/block"
if [ $? -ne 0 ] || [ ! -s "$tmp/block" ]; then
    echo "FAIL - $doc: no \`\`\`sh block right after a <!-- emu-link --> line"
    exit 1
fi
mkdir "$tmp/repo" "$tmp/repo/build"
# links to the tracked top-level entries only: a link to an untracked moept.o would let the block's
# compile write through it into the repository
{ git ls-files 2>/dev/null || ls; } | sed 's|/.*||' | sort -u | while read -r f; do
    case $f in build|*.o) ;; *) ln -s "$root/$f" "$tmp/repo/$f" ;; esac
done
mkdir -p "$emu" && ln -s "$emu" "$tmp/repo/build/emu"
inc=$(printf '%s\n' $EMU_INC | sed -n 's/^-I//p' | awk '!seen[$0]++')
if [ -z "$CUDA_HOME" ]; then
    for d in $inc /usr/local/cuda/include /usr/include; do
        [ -f "$d/cuda_runtime.h" ] && CUDA_HOME=${d%/include} && break
    done
fi
CPATH=$(echo $inc | tr ' ' ':')${CPATH:+:$CPATH}
export CUDA_HOME CPATH
# a reader's shell: no make test's jobserver or level
(cd "$tmp/repo" && unset MAKEFLAGS MFLAGS MAKELEVEL && sh -e "$tmp/block") >"$tmp/out" 2>&1
rc=$?
if [ $rc -eq 0 ] && ! grep -q '^skip - ' "$tmp/out" &&
    grep -q '^train: loss .* in [0-9]* steps' "$tmp/out"; then
    echo "ok - $doc's emulator link lines build the CUDA example and run it on the emulated GPU"
    exit 0
fi
echo "FAIL - $doc's emulator link lines (exit status $rc; the block, then its output):"
sed 's/^/    /' "$tmp/block"
sed 's/^/    | /' "$tmp/out" | tail -n 40
exit 1
