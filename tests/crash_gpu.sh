#!/bin/sh
# usage: tests/crash_gpu.sh MPIRUN BIN [KILLS [NP [ARG...]]]
# kill -9 of one process of a running one-process-per-GPU job (BIN:
# build/emu/train_mpi, or build/train_cuda_mpi on GPUs, with the default ARGs
# --ep NP --steps 1000000 --quiet; or build/emu/moept_check_mpi with its own,
# e.g. --ep 4 and the reference cases a few times over), KILLS times (default
# 3), each at a random moment 1.5-3.5 s into the run, a random rank of NP
# (default 2): the job must end within 60 s with an error (a status other
# than 0) and leave no moept or emulated-NCCL segment in /dev/shm (both are
# anonymous memory files, which no kill can leave behind). Only this run's
# names count: new since its job started and naming one of its processes'
# pids (a name held its maker's), so other jobs on the machine cannot fail it.
# What ends the job is mpirun, which kills the other ranks when one dies;
# moept's own timeout and abort for a peer that never comes run over the
# same emulated NCCL path in test_cuda's absent-peer tests (ranks as threads).
mpirun=$1 bin=$2 kills=${3:-3} np=${4:-2}
shift 2
[ $# -gt 0 ] && shift
[ $# -gt 0 ] && shift
[ $# -gt 0 ] || set -- --ep "$np" --steps 1000000 --quiet
export OMP_NUM_THREADS=1
shm() { ls /dev/shm 2>/dev/null | grep moept; }
# the names in $2 (one a line) not in $1 that have a dot-separated field
# among the pids $3
mine() {
    OLD=$1 PIDS=$3 awk '
        BEGIN { split(ENVIRON["OLD"], o, "\n"); for (i in o) seen[o[i]] = 1
                split(ENVIRON["PIDS"], p, " "); for (i in p) pid[p[i]] = 1 }
        $0 == "" || ($0 in seen) { next }
        { n = split($0, f, "."); for (i = 1; i <= n; i++) if (f[i] in pid) { print; next } }' <<EOF
$2
EOF
}
fail=0
i=0
while [ $i -lt "$kills" ]; do
    i=$((i + 1))
    before=$(shm)
    "$mpirun" --oversubscribe -np "$np" "$bin" "$@" >/dev/null 2>&1 &
    mp=$!
    sleep "$(awk -v s="$i$$" 'BEGIN { srand(s); printf "%.2f", 1.5 + 2 * rand() }')"
    ranks=$(pgrep -P $mp)
    victim=$(echo "$ranks" | awk -v s="$i$$" 'BEGIN { srand(s) } { r[NR] = $1 }
                                             END { print r[1 + int(rand() * NR)] }')
    if [ -z "$victim" ]; then
        echo "FAIL - kill $i: no rank process of $bin was running"
        fail=1
        kill -9 $mp 2>/dev/null
        wait $mp 2>/dev/null
        continue
    fi
    kill -9 "$victim"
    t0=$(date +%s)
    while kill -0 $mp 2>/dev/null && [ $(($(date +%s) - t0)) -lt 60 ]; do sleep 0.2; done
    if kill -0 $mp 2>/dev/null; then
        echo "FAIL - kill $i: the job still runs 60 s after one rank was killed"
        fail=1
        kill -9 $mp $ranks 2>/dev/null
        wait $mp 2>/dev/null
    else
        wait $mp 2>/dev/null
        rc=$?
        if [ $rc -eq 0 ]; then
            echo "FAIL - kill $i: the job ended with status 0 after a rank was killed"
            fail=1
        else
            echo "ok - kill $i: the job ended $(($(date +%s) - t0)) s after a rank was killed, status $rc"
        fi
    fi
    left=$(mine "$before" "$(shm)" "$mp $ranks")
    if [ -n "$left" ]; then
        echo "FAIL - kill $i: $(echo "$left" | wc -l) segment(s) of this job left in /dev/shm:" \
            "$(echo "$left" | tr '\n' ' ')"
        fail=1
    else
        echo "ok - kill $i: nothing left in /dev/shm"
    fi
done
exit $fail
