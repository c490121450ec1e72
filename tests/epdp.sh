#!/bin/sh
# usage: tests/epdp.sh MPIRUN [TRAIN_MPI [EP DP [BF16]]]
# The example's EP x DP recipe: mpirun -np EP*DP TRAIN_MPI --ep EP --dp DP
# (DP replicas of the experts, each split over EP ranks; MPI_Comm_split
# makes the groups; default build/train_mpi --ep 2 --dp 2) against the CPU
# train --ep 1 for 4 steps: loss and aux loss within 1e-5 relative (the
# dense gradients are summed over EP*DP ranks instead of 1, so equal to
# rounding; measured: the printed 6 digits are identical). Built wrong (the
# layers given no DP group) the loss is 5.6e-5 off at step 2.
# TRAIN_MPI may be build/emu/train_mpi (one process per emulated GPU, NCCL
# across processes) or build/train_cuda_mpi (GPUs); with BF16 set it runs
# --bf16 against the same CPU curve with tests/curves.sh's bf16 bounds.
B=${B:-build}
mpirun=$1 bin=${2:-$B/train_mpi} ep=${3:-2} dp=${4:-2} bf16=$5
np=$((ep * dp))
tag=$(echo "$bin" | tr / _)_${ep}x${dp}${bf16:+_bf16} # (its folder too: build/ and build/emu/ both have train_mpi)
if [ -n "$bf16" ]; then tl=0.00048828125; ta=0.0009765625; else tl=1e-5; ta=1e-5; fi
rm -f "$B/epdp_1_$tag.csv" "$B/epdp_$tag.csv" # (the CPU curve its own: suites run side by side)
"$B/train" --steps 4 --quiet --csv "$B/epdp_1_$tag.csv" > /dev/null || exit 1
OMP_NUM_THREADS=1 timeout 300 "$mpirun" --oversubscribe -np $np "$bin" --ep $ep --dp $dp --steps 4 --quiet \
    ${bf16:+--bf16} --csv "$B/epdp_$tag.csv" > "$B/epdp_$tag.log" 2>&1
rc=$?
if grep -q "^skip - " "$B/epdp_$tag.log"; then grep -m1 "^skip - " "$B/epdp_$tag.log"; exit 0; fi
[ $rc -eq 0 ] && [ -s "$B/epdp_$tag.csv" ] || { cat "$B/epdp_$tag.log"; echo "FAIL - $bin EP $ep x DP $dp: exit status $rc or no log written"; exit 1; }
awk -F, -v tl=$tl -v ta=$ta -v what="$bin --ep $ep --dp $dp${bf16:+ --bf16} (mpirun -np $np)" '
    NR == FNR { if (FNR > 1) { l[$1] = $2; a[$1] = $4 } next }
    FNR > 1 {
        n++
        d = $2 - l[$1]; if (d < 0) d = -d
        if (d > tl * $2) { bad = 1; print "step " $1 ": loss " $2 " vs EP 1 " l[$1] }
        d = $4 - a[$1]; if (d < 0) d = -d
        if (d > ta * $4) { bad = 1; print "step " $1 ": aux " $4 " vs EP 1 " a[$1] }
    }
    END {
        if (n != 4) bad = 1
        printf "%s - %s loss curve vs the CPU --ep 1 (loss %g, aux %g relative; %d steps)\n",
               bad ? "FAIL" : "ok", what, tl, ta, n
        exit bad
    }' "$B/epdp_1_$tag.csv" "$B/epdp_$tag.csv"
