#!/bin/sh
# Hashes of every result of every reference case (moept_check --digest) on
# the CPU at EP 1, 2, 4, chunked and over messages, and on the emulated GPU
# (when it builds) at EP 1, 2, 4, sync-free and chunked. A change meant to
# leave every result bitwise unchanged (a refactor) must leave this output
# unchanged:  sh tools/digest.sh > before.txt; ...; sh tools/digest.sh | diff before.txt -
B=${B:-build}
CASES=$(ls tests/cases/*.safetensors)
make -s "$B/moept_check" >/dev/null || exit 1
emu=; make -s "$B/emu/moept_check" >/dev/null 2>&1 && emu=$B/emu/moept_check
run() { # label, binary, options...
    label=$1; shift
    "$@" --digest $CASES | sed -n "s|^\([^ ]*\) .*PASS .* digest \(.*\)|$label \1 \2|p"
}
for o in "--ep 1" "--ep 2" "--ep 4" "--ep 4 --chunks 3" "--ep 4 --no-shm"; do
    run "cpu $o" "$B/moept_check" $o
done
# the loss table: 30 steps of build/train (its CSV without the speed column)
csv=$(mktemp); trap 'rm -f "$csv"' EXIT
table() { # label, binary, options...
    label=$1; shift
    : >"$csv"; "$@" --steps 30 --quiet --csv "$csv" >/dev/null 2>&1 || echo "$label: exit status $?"
    cut -d, -f1-5,7- "$csv" | cksum | sed "s|^|$label loss table |"
}
make -s "$B/train" >/dev/null && for o in "--ep 1" "--ep 2"; do table "cpu train $o" "$B/train" $o; done
[ -n "$emu" ] || { echo "emu: not built (skipped)"; exit 0; }
for o in "--ep 1" "--ep 2" "--ep 4" "--ep 2 --sync-free" "--ep 2 --chunks 3"; do
    run "emu $o" "$emu" $o
done
if make -s "$B/emu/train" >/dev/null 2>&1; then
    table "emu train --ep 1" "$B/emu/train" --ep 1
    table "emu train --bf16" "$B/emu/train" --bf16
fi
