#!/bin/sh
# make bench-busy: the example's 200 steps alone, then beside one CPU-bound
# process per core (as on a shared box or CI runner), in one run; prints
# both times and busy/quiet. A fair share of the machine is 2x.
#   sh bench/busy.sh [train binary] [steps]
TRAIN=${1:-build/train}
STEPS=${2:-200}
n=$(nproc 2>/dev/null || echo 2)
run() { # seconds for one run of the example
    t0=$(date +%s.%N)
    "$TRAIN" --steps "$STEPS" --quiet >/dev/null || { echo "bench-busy: $TRAIN failed" >&2; exit 1; }
    echo "$(date +%s.%N) $t0" | awk '{ printf "%.2f", $1 - $2 }'
}
quiet=$(run)
pids=
i=0
while [ $i -lt "$n" ]; do
    sh -c 'while :; do :; done' &
    pids="$pids $!"
    i=$((i + 1))
done
busy=$(run)
kill $pids 2>/dev/null
wait 2>/dev/null
echo "$quiet $busy $n" | awk '{ printf "%s --steps %d: quiet %.2f s, beside %d busy processes %.2f s: busy/quiet %.2fx (fair share 2x)\n",
    "'"$TRAIN"'", '"$STEPS"', $1, $3, $2, $2 / $1 }'
