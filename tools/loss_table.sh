#!/bin/sh
# usage: tools/loss_table.sh   (from the repository root, after make)
# The example's loss table (docs/PERF.md, "The example's loss curve at EP 1 and EP 4"): build/train at
# EP=1, EP=4 over threads and EP=4 over MPI (when build/train_mpi and mpirun
# exist), make run's settings, on the shipped text; prints the markdown table
# and the largest difference from EP=1. Logs go to build/ep1.csv, build/ep4.csv, build/ep4_mpi.csv
# (tools/plot.py draws docs/train.png from the first two).
B=${B:-build}
set -e
"$B/train" --quiet --csv "$B/ep1.csv" > /dev/null || exit 1
"$B/train" --quiet --ep 4 --csv "$B/ep4.csv" > /dev/null || exit 1
mpi="$B/ep4_mpi.csv"
rm -f "$mpi"
if [ -x "$B/train_mpi" ] && command -v mpirun > /dev/null; then
    OMP_NUM_THREADS=1 mpirun --oversubscribe --allow-run-as-root -np 4 "$B/train_mpi" --quiet --ep 4 \
        --csv "$mpi" > /dev/null || exit 1
fi
[ -s "$mpi" ] || mpi="$B/ep4.csv" # no MPI: its columns repeat the threads run, said below
awk -F, -v nompi="$([ "$mpi" = "$B/ep4.csv" ] && echo 1)" '
    FNR == 1 { f++; next }
    { loss[f, $1] = $2; val[f, $1] = $3; if ($1 > last) last = $1 }
    END {
        print "| step | EP=1 loss | EP=4 threads | EP=4 MPI | EP=1 held-out | EP=4 threads held-out | EP=4 MPI held-out |"
        print "|---|---|---|---|---|---|---|"
        for (s = 1; s <= last; s++) {
            for (k = 2; k <= 3; k++) { d = loss[k, s] - loss[1, s]; d = d < 0 ? -d : d; if (d > big[k]) big[k] = d }
            if (s != 1 && s % 100) continue
            v1 = val[1, s] == "nan" ? "-" : val[1, s]; v2 = val[2, s] == "nan" ? "-" : val[2, s]
            v3 = val[3, s] == "nan" ? "-" : val[3, s]
            printf "| %d | %s | %s | %s | %s | %s | %s |\n", s, loss[1, s], loss[2, s], loss[3, s], v1, v2, v3
        }
        printf "\nlargest difference from EP=1 over all %d steps: threads %.3f, MPI %.3f%s\n", last, big[2], big[3],
               nompi ? " (no MPI here: the threads run repeated)" : ""
    }' "$B/ep1.csv" "$B/ep4.csv" "$mpi"
