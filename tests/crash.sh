#!/bin/sh
# The kill -9 loop: a worker (tests/crash_save.c) trains and saves after
# every step, resuming from the checkpoint it finds; it is killed at a random
# moment, then the newest checkpoint must load, verify and equal a replay
# from scratch, bit for bit, and the next round resumes from it.
#   sh tests/crash.sh KILLS MODE
#   MODE  one      1 rank
#         threads  2 thread ranks of one process
#         mpi      2 MPI ranks, both killed
#         mpi-one  2 MPI ranks, rank 1 alone killed (mpirun ends rank 0)
# Prints one "ok - ..." line with how many kills left a killed save's
# leftovers (the kill landed inside a save), or "FAIL - ..." lines: a lost
# checkpoint, a wrong one, a hang (a round not over 30 s after its kill), or
# a shared-memory segment of moept's left in /dev/shm after a kill (the MPI
# ranks' blocks are anonymous memory files: none may ever be there).
B=${B:-build}
kills=$1 mode=$2
dir=$B/crash_$mode
rm -rf "$dir" "$dir.log" "$dir".pid*
mkdir -p "$dir"
case $mode in
one) P=1 ;;
*) P=2 ;;
esac

start() { # steps (empty: until killed); sets pid
    case $mode in
    mpi*) "$MPIRUN" --oversubscribe -np $P "$B/crash_save_mpi" train "$dir" $P $1 >"$dir.out" 2>&1 & ;;
    *) "$B/crash_save" train "$dir" $P $1 >"$dir.out" 2>&1 & ;;
    esac
    pid=$!
}

# waits for the round's process; 1 if it was still there after 30 s
finish() {
    n=0
    while kill -0 "$pid" 2>/dev/null; do
        n=$((n + 1))
        if [ $n -gt 300 ]; then
            kill -9 "$pid" $(cat "$dir".pid* 2>/dev/null) 2>/dev/null
            wait "$pid" 2>/dev/null
            return 1
        fi
        sleep 0.1
    done
    wait "$pid" 2>/dev/null
    return 0
}

rnd_ms() { od -An -N2 -tu2 /dev/urandom | awk -v lo="$1" -v hi="$2" '{ printf "%.3f", (lo + $1 % (hi - lo)) / 1000 }'; }

start 3
if ! finish || ! "$B/crash_save" verify "$dir" >/dev/null; then
    echo "FAIL - kill -9 during saves ($mode): the first 3 steps did not train and save"
    cat "$dir.out"
    exit 1
fi
shm() { ls /dev/shm 2>/dev/null | grep -c '^moept\.'; }
shm0=$(shm)
fails=0 torn=0 hangs=0 i=0
while [ $i -lt "$kills" ]; do
    i=$((i + 1))
    rm -f "$dir".pid*
    start
    case $mode in
    mpi*) # the ranks' pids, once both ran far enough to write them
        n=0
        while [ $n -lt 100 ] && ! { [ -s "$dir.pid0" ] && [ -s "$dir.pid1" ]; }; do sleep 0.05; n=$((n + 1)); done ;;
    esac
    sleep "$(rnd_ms 20 400)"
    case $mode in
    mpi) kill -9 $(cat "$dir.pid0" "$dir.pid1" 2>/dev/null) 2>/dev/null ;;
    mpi-one) kill -9 $(cat "$dir.pid1" 2>/dev/null) 2>/dev/null ;;
    *) kill -9 "$pid" 2>/dev/null ;;
    esac
    if ! finish; then
        hangs=$((hangs + 1))
        echo "FAIL - kill -9 during saves ($mode): round $i did not end 30 s after the kill"
    fi
    if [ "$(shm)" -gt "$shm0" ]; then
        fails=$((fails + 1))
        echo "FAIL - kill -9 during saves ($mode): round $i left $(($(shm) - shm0)) segment(s) in /dev/shm"
        shm0=$(shm)
    fi
    out=$("$B/crash_save" verify "$dir")
    case $out in
    ok*) case $out in *"leftovers 0") ;; *) torn=$((torn + 1)) ;; esac ;;
    *) fails=$((fails + 1)); echo "FAIL - kill -9 during saves ($mode): round $i: $out" ;;
    esac
done
last=$("$B/crash_save" verify "$dir")
if [ $fails -eq 0 ] && [ $hangs -eq 0 ]; then
    echo "ok - kill -9 during saves ($mode): $kills kills, 0 lost, 0 hangs, $torn left a killed save's files; now ${last#ok }"
else
    exit 1
fi
