#!/bin/sh
# usage: tests/epdp.sh MPIRUN
# The example's EP x DP recipe: mpirun -np 4 train_mpi --ep 2 --dp 2 (two
# replicas of the experts, each split over 2 ranks; MPI_Comm_split makes the
# groups) against train --ep 1 for 4 steps: loss and aux loss within 1e-5
# relative (the dense gradients are summed over 4 ranks instead of 1, so
# equal to rounding; measured: the printed 6 digits are identical). Built
# wrong (the layers given no DP group) the loss is 5.6e-5 off at step 2.
B=${B:-build}
mpirun=$1
rm -f "$B/epdp_1.csv" "$B/epdp_4.csv"
"$B/train" --steps 4 --quiet --csv "$B/epdp_1.csv" > /dev/null
[ $? -le 1 ] || exit 1
OMP_NUM_THREADS=1 timeout 300 "$mpirun" --oversubscribe -np 4 "$B/train_mpi" --ep 2 --dp 2 --steps 4 --quiet \
    --csv "$B/epdp_4.csv" > /dev/null 2>&1
[ -s "$B/epdp_4.csv" ] || { echo "FAIL - EP 2 x DP 2: no log written"; exit 1; }
awk -F, '
    NR == FNR { if (FNR > 1) { l[$1] = $2; a[$1] = $4 } next }
    FNR > 1 {
        n++
        d = $2 - l[$1]; if (d < 0) d = -d
        if (d > 1e-5 * $2) { bad = 1; print "step " $1 ": loss " $2 " vs EP 1 " l[$1] }
        d = $4 - a[$1]; if (d < 0) d = -d
        if (d > 1e-5 * $4) { bad = 1; print "step " $1 ": aux " $4 " vs EP 1 " a[$1] }
    }
    END {
        if (n != 4) bad = 1
        printf "%s - train_mpi --ep 2 --dp 2 (mpirun -np 4) loss curve vs --ep 1 (1e-5 relative; %d steps)\n",
               bad ? "FAIL" : "ok", n
        exit bad
    }' "$B/epdp_1.csv" "$B/epdp_4.csv"
