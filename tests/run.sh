#!/bin/sh
# Runs the test suites that tests/suites names and totals the results.
# Suites print "ok - ...", "FAIL - ...", "skip - ..." lines; the reference
# checker prints PASS/FAIL lines. Each suite's time (seconds of wall clock,
# then of CPU: user + system) goes to $B/times.txt and the slowest five are
# listed at the end; the last line is the grand total. Suites marked "par"
# (independent of every other suite, each keeping about one core busy) run
# two at a time: one in the background while the next suites run, the others
# queued for the first free slot, each one's output printed once it is done
# (a group's time counts from its first suite to the next group's, what ran
# beside it included; what is still queued then runs at the end, two at a
# time, timed as a group of its own).
# usage: sh tests/run.sh            every suite (make test)
#        sh tests/run.sh --check    the suites marked "check" (make check)
#        SERIAL=1 sh tests/run.sh   every suite one at a time ("par" ignored)
#        sh tests/run.sh --bins [--check] [--stage N] [GROUP]
#            prints, one a line, the build outputs those suites use (of the
#            groups whose name starts with GROUP; --stage N: of the suites
#            before tests/suites' N-th "later" line) and runs nothing: the
#            Makefile builds these
#        sh tests/run.sh --list [--check] [GROUP]
#            prints every suite's group and label, whatever this machine has
#        sh tests/run.sh [--check] GROUP
#            runs the groups whose name starts with GROUP (after make test-build)
# LATE_BUILD=F, LATE_BUILD_PID=P (make test): the programs of the suites
# after tests/suites' first "later" line are being built meanwhile, by
# process P, a stage a "later" line: the programs up to the next one (the
# rest at the last), its output in F.N.log, then its exit status in F.N.rc;
# the N-th "later" line waits for F.N.rc (or P's end without it: a FAIL).
# What this machine has comes from the Makefile, in the environment: CASES,
# MPIRUN, SAN, TSAN, CBLAS, VALGRIND, GEMM_V3, GEMM_V4, GEMM_PLAIN, ARCH_X86,
# QEMU_AARCH64, EMU, CUDA, NVCC, TORCH (empty: not found; the group says "skip"); EMU_INC (the
# emulator's -I flags: the CUDA, cuBLAS and NCCL headers).
B=${B:-build}
mode=run only= want= stage= nlater=0
while [ $# -gt 0 ]; do
    case $1 in
        --bins) mode=bins ;;
        --stage) stage=$2; shift ;;
        --list) mode=list ;;
        --check) only=check ;;
        *) want=$1 ;;
    esac
    shift
done
status=0
late=$LATE_BUILD late_pid=$LATE_BUILD_PID
unset LATE_BUILD LATE_BUILD_PID # (not the suites': a run.sh of theirs waits for nothing)

# the unit table: "unit PROGRAM VARIANT..." lines; `units V` lists the programs run in variant V
table=
unit() { table="$table$*
"; }
units() { printf '%s' "$table" | awk -v v="$1" '{ for (i = 2; i <= NF; i++) if ($i == v) { print $1; next } }
                                             v == "" { print $1 }'; }
checked() { units check | grep -qx "$1" && echo check; }

on=1 gname= gt0= ran= marked= needed= beside= bgpid= bgdir=
now() { date +%s.%N; }
# cpus: the CPU seconds (user + system) of this shell's finished children
# (times in this shell: in a $(...) it would count the subshell's)
cpu() {
    times >"$cpuf"
    cpus=$(awk 'NR == 2 { split($1, u, /[ms]/); split($2, s, /[ms]/)
                          printf "%.2f", u[1] * 60 + u[2] + s[1] * 60 + s[2] }' "$cpuf")
}
group_end() { # the time a group took, beside its suites'
    [ "$mode" = run ] && [ -n "$gt0" ] && [ -n "$ran" ] || return 0
    secs=$(echo "$(now) $gt0" | awk '{ printf "%.0f", $1 - $2 }')
    echo "== the group \"$gname\" took $secs s"
    echo "$secs $gname" >>"$B/group_times.txt"
    gt0=
}
group() { # name, condition (empty: the group does not run), why (empty: no skip line)
    group_end
    gname=$1 on=$2 needed=
    [ "$mode" = list ] && on=1
    picked=1
    case $1 in "$want"*) ;; *) on= picked= ;; esac
    if [ "$mode" != run ] || [ -z "$picked" ]; then :
    elif [ -z "$on" ]; then
        [ -z "$3" ] || [ -n "$only" ] || skip "$1" "$3"
    else
        gt0=$(now) ran=
    fi
}
needs() { needed="$needed $*"; }
# a line between the suites whose programs make test has built and the later ones, whose programs
# it builds beside the runs before this line: here the run waits for that build, running the
# queued "par" suites meanwhile
alive() { # process $1 runs (not gone, not a zombie: its parent, make's shell, reaps it at the end)
    if [ -r "/proc/$1/stat" ]; then ! grep -q '^[0-9]* (.*) Z' "/proc/$1/stat"
    else kill -0 "$1" 2>/dev/null; fi
}
later() {
    nlater=$((nlater + 1))
    [ "$mode" = run ] && [ -n "$late" ] || return 0
    group_end
    f=$late.$nlater
    gname="waiting for the build of the later suites' programs ($nlater)" gt0=$(now) ran=1
    while [ ! -f "$f.rc" ]; do # the queued suites meanwhile, in both slots (as drain)
        if [ -n "$late_pid" ] && ! alive "$late_pid" && [ ! -f "$f.rc" ]; then
            echo 1 >"$f.rc" # it ended without its exit status
            break
        fi
        next_par
        if [ -n "$bgpid" ] && pop; then eval "run_suite $next"; else sleep 1; fi
    done
    group_end
    echo "== the build of the later suites' programs ($nlater)"
    cat "$f.log" 2>/dev/null
    if [ "$(cat "$f.rc")" != 0 ]; then
        echo "FAIL - the build of the later suites' programs ($nlater): exit status $(cat "$f.rc")" |
            tee -a "$res"
        status=1
    fi
}
check() { marked=1; "$@"; }
par() { beside=1; "$@"; }
suite() { # label, command...
    sel=$on
    [ -z "$only" ] || [ -n "$marked" ] || sel=
    [ -z "$stage" ] || [ "$nlater" -lt "$stage" ] || sel=
    bg=$beside
    marked= beside=
    if [ -z "$sel" ]; then :
    elif [ "$mode" = list ]; then echo "$gname: $1"
    elif [ "$mode" = bins ]; then outputs "$@"
    elif [ -n "$bg" ] && [ -z "$SERIAL" ]; then par_suite "$@"
    else run_suite "$@"
    fi
    needed=
    next_par
    return 0
}
# A "par" suite starts in the background if none runs there, else waits in
# $queue (one shell-quoted command a line) for the first free slot: the
# background's, checked after each suite, or at the end the foreground's
# too (drain). So two run at a time, never more, whatever the order.
par_suite() {
    if [ -z "$bgpid" ]; then bg_suite "$@"; return; fi
    for a in "$@"; do printf "'%s' " "$(printf '%s' "$a" | sed "s/'/'\\\\''/g")"; done >>"$queue"
    echo >>"$queue"
}
pop() { # the first queued suite into $next, off the queue; false when none
    [ "$mode" = run ] && [ -s "$queue" ] || return 1
    next=$(head -n 1 "$queue")
    tail -n +2 "$queue" >"$queue.rest" && mv "$queue.rest" "$queue"
    [ -n "$next" ]
}
next_par() { # a finished background suite's output, and the next queued one in its place
    [ "$mode" = run ] || return 0
    [ -n "$bgdir" ] && [ -f "$bgdir/done" ] && bg_wait
    if [ -z "$bgpid" ] && pop; then eval "bg_suite $next"; fi
}
drain() {
    while next_par; [ -s "$queue" ]; do
        pop && eval "run_suite $next"
    done
    bg_wait
}
# a "par" suite in the background: run_suite in a subshell, its output and
# results kept until bg_wait
bg_suite() {
    bgdir=$(mktemp -d)
    ran=1
    (log=$bgdir/log res=$bgdir/res cpuf=$bgdir/cpu status=0; : >"$res"
     run_suite "$@" >"$bgdir/out" 2>&1; : >"$bgdir/done"; exit $status) &
    bgpid=$!
}
bg_wait() {
    [ -n "$bgpid" ] || return 0
    wait "$bgpid" || status=1
    cat "$bgdir/out"
    cat "$bgdir/res" >>"$B/results.txt"
    rm -rf "$bgdir"
    bgpid= bgdir=
}
outputs() { # the $B/ paths of a suite's command, less options' values; its needs
    shift
    prev=
    for a in "$@" $needed; do
        case $prev in --*) prev=$a; continue ;; esac
        case $a in "$B"/*) echo "$a" ;; esac
        prev=$a
    done
}
run_suite() {
    name=$1 ran=1; shift
    echo "== $name"
    t0=$(now)
    # in a subshell of its own, whose children are the suite's alone (a "par"
    # suite reaped meanwhile counts in this shell's); its Open MPI session
    # directories in a directory of its own: two mpiruns of two suites that
    # start at once race to make a shared one ("File exists": orte_init fails)
    ompi=
    [ -n "$MPIRUN" ] && ompi=$(mktemp -d)
    (if [ -n "$ompi" ]; then export OMPI_MCA_orte_tmpdir_base="$ompi"; fi
     "$@" >"$log" 2>&1; echo $? >"$log.rc"; cpu; echo "$cpus" >"$log.rc.cpu")
    [ -n "$ompi" ] && rm -rf "$ompi"
    rc=$(cat "$log.rc") csecs=$(awk '{ printf "%.1f", $1 }' "$log.rc.cpu")
    rm -f "$log.rc" "$log.rc.cpu"
    secs=$(echo "$(now) $t0" | awk '{ printf "%.1f", $1 - $2 }')
    echo "$secs $csecs $name" >>"$B/times.txt"
    # a suite's own "N passed, N failed" line is reworded: CI reads such a line alone as the
    # run's closing line, and the grand total below must be the only one
    sed -E 's/^([0-9]+) passed, ([0-9]+) failed(, ([0-9]+) skipped)?$/(this suite: \1 ok, \2 failed\3)/' \
        "$log"
    echo "($secs s, $csecs s of CPU)"
    sed -e 's/^\(.*\)  *PASS  .*/ok - \1/' -e 's/^\(.*\)  *FAIL  .*/FAIL - \1/' \
        -e 's/^\([^ ]*\)  *SKIP  \(.*\)/skip - \1 (\2)/' "$log" |
        grep -E '^(ok|FAIL|skip) - ' | sed "s|^\([a-zA-Z]*\) - |\1 - $name: |" >>"$res"
    if [ $rc -ne 0 ]; then
        echo "FAIL - $name: exit status $rc" >>"$res"
        status=1
    elif ! grep -qE '^(ok|FAIL|skip) - |  (PASS|FAIL|SKIP)  ' "$log"; then
        echo "ok - $name" >>"$res"   # a program judged by its exit status
    fi
}
skip() { echo "skip - $1: $2" | tee -a "$B/results.txt"; }

if [ "$mode" != run ]; then
    . tests/suites
    exit 0
fi

log=$(mktemp) cpuf=$(mktemp) queue=$(mktemp) res=$B/results.txt
trap 'rm -f "$log" "$cpuf" "$queue" "$queue.rest"' EXIT
mkdir -p "$B"
: >"$B/results.txt"
: >"$B/times.txt"
: >"$B/group_times.txt"
if [ -n "$MPIRUN" ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
fi
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
export MOEPT_EMU_HANG_S=${MOEPT_EMU_HANG_S:-90}
cpu
t_all=$(now) c_all=$cpus
. tests/suites
group_end
gname="the par suites still queued" gt0=$(now) ran= # (their groups' times leave them out)
drain
group_end

p=$(grep -c '^ok - ' "$B/results.txt")
f=$(grep -c '^FAIL - ' "$B/results.txt")
s=$(grep -c '^skip - ' "$B/results.txt")
echo
cpu
echo "the slowest suites (seconds of wall clock, of CPU):"
sort -rn "$B/times.txt" | head -n 5
echo "the groups: $(awk '{ t = $1; sub(/^[^ ]* /, ""); printf "%s%s %s s", n++ ? ", " : "", $0, t }' \
    "$B/group_times.txt"); $(echo "$(now) $t_all" | awk '{ printf "%.0f", $1 - $2 }') s in all, \
$(echo "$cpus $c_all" | awk '{ printf "%.0f", $1 - $2 }') s of CPU"
grep '^FAIL - ' "$B/results.txt"
echo "total: $p passed, $f failed, $s skipped"
[ "$f" -eq 0 ] && [ $status -eq 0 ]
