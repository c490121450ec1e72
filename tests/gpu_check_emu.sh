#!/bin/sh
# usage: tests/gpu_check_emu.sh [PHASE...]     (default fp8_table; make stress: fp8)
# tools/gpu_check.sh's FP8 phases run as a lent GPU runs them, on the emulated GPU, so that the one call
# a lent GPU gets does not fail on a command, an option or a log the table tool cannot read. In a scratch
# folder ($B/gpu_check_emu) linking the repository's sources, each program the script calls by its path
# (build/bench_cuda, build/stlt/bench_cuda, ...) is a stand-in that runs the emulated build ($B/emu) at
# compute capability 9.0: the timed ones at a tiny shape (its options appended: the last of each wins),
# the reference-case runs on one case, the 300-step curves in 60 short steps; the profile's trace is the
# emulator's (CUDA_INJECTION64_PATH and CUPTI_TRACE: docs/CUDA.md). Checked: every step exits 0 and
# tools/fp8_table.py's table has each row filled, its goals listed. The emulator's times say nothing of a
# GPU's; the variants' builds (build/stlt, build/stnx) are the default one here; `lt_rules time` is a
# skip line (the emulated cuBLASLt has no bf16 matmul to time FP8's against), and the torch peer runs
# only where a python's torch sees a GPU (a skip line too).
B=${B:-build}
R=$(pwd)
case $B in /*) A=$B ;; *) A=$R/$B ;; esac
S="$A/gpu_check_emu"
E="$A/emu"
phases=${*:-fp8_table}
rm -rf "$S" && mkdir -p "$S/build/stlt" "$S/build/stnx" "$S/gpub" || exit 1
for d in tests tools bench examples; do ln -s "$R/$d" "$S/$d"; done
ln -s "$A/train" "$S/build/train" # (tests/curves.sh's CPU curve)
: >"$S/gpub/cupti_trace.so"          # (profile fp8 traces where the injection library is)

# compute capability 9.0 (the kernel form); no hang report for a long emulated wait (lt_rules time)
EMU_ENV="MOEPT_EMU_CC=90 MOEPT_EMU_HANG_S=1200"
# stand-in NAME PROGRAM [OPTIONS...]: build/NAME runs $E/PROGRAM with its arguments, then OPTIONS
stand_in() {
    n=$1 p=$2
    shift 2
    printf '#!/bin/sh\nexec env %s "%s" "$@" %s\n' "$EMU_ENV" "$E/$p" "$*" >"$S/build/$n"
    chmod +x "$S/build/$n"
}
tiny="--tokens 16 --hidden 128 --ffn 32 --experts 2 --topk 1 --reps 2"
for n in bench_cuda stlt/bench_cuda stnx/bench_cuda; do stand_in $n bench_cuda "$tiny"; done
stand_in bench_q8_cuda bench_q8 "$tiny"
stand_in test_q8_cuda test_q8
# the reference cases: the first named
cat >"$S/build/moept_check_cuda" <<EOF
#!/bin/sh
for a; do shift; case \$a in *.safetensors) [ -n "\$c" ] && continue; c=1 ;; esac; set -- "\$@" "\$a"; done
exec env $EMU_ENV "$E/moept_check" "\$@"
EOF
# the 300-step curves (not tests/curves.sh's 4) in 60 steps of smaller models (the wide one's tiles full)
cat >"$S/build/train_cuda" <<EOF
#!/bin/sh
case " \$* " in *" --steps 300 "*) set -- "\$@" --steps 60 --batch 16 --dim 32 --ffn 32 ;; esac
case " \$* " in *" --dim 1024 "*) set -- "\$@" --dim 128 --ffn 128 ;; esac
exec env $EMU_ENV "$E/train" "\$@"
EOF
# lt_rules, but its time: bf16 against FP8 through cuBLASLt, whose bf16 matmuls the emulator refuses
# (moept's go through cublasGemmEx), at the experts' shapes
cat >"$S/build/lt_rules" <<EOF
#!/bin/sh
[ "\$1" = time ] && { echo "skip - lt_rules time: the emulated cuBLASLt has FP8 matmuls only"; exit 0; }
exec env $EMU_ENV "$E/lt_rules" "\$@"
EOF
chmod +x "$S/build/moept_check_cuda" "$S/build/train_cuda" "$S/build/lt_rules"

# (the emulated steps are slower than a GPU's: a budget and a step's limit of their own)
# shellcheck disable=SC2086
(cd "$S" && B=build OUT=out GPUB=gpub FP8_BUDGET=${FP8_BUDGET:-3600} STEP_TIMEOUT=${STEP_TIMEOUT:-1200} \
    sh tools/gpu_check.sh $phases) >"$S/run.log" 2>&1
rc=$?
sed -nE 's/^[0-9:]+ rc=0 +[0-9]+s  (.*)/ok - gpu_check.sh step: \1/p; /^skip - /p' "$S/out/summary.txt"
grep -h '^skip - ' "$S"/out/*.log # (a stand-in's)
sed -nE 's/^[0-9:]+ rc=([1-9][0-9]*) +[0-9]+s  (.*)/FAIL - gpu_check.sh step (exit status \1): \2/p;
    t; /^FAIL - /p' "$S/out/summary.txt"
[ $rc -eq 0 ] || { echo "FAIL - gpu_check.sh $phases: exit status $rc"; tail -n 10 "$S/out/fp8.log"; }

# the table: each row a value in every shape's column; the goals: one row per value judged
T="$S/out/fp8_table.md"
row() { # PATTERN COUNT WHAT: COUNT rows of the table match PATTERN, none with a "-" cell
    n=$(grep -c "^| $1" "$T")
    if [ "$n" -eq "$2" ] && ! grep "^| $1" "$T" | grep -q '| - |'; then
        echo "ok - fp8_table.py: $3 ($n rows, each filled)"
    else
        echo "FAIL - fp8_table.py: $3: $n rows of \"$1\" (want $2, none empty)"
        rc=1
    fi
}
case " $phases " in *" fp8 "* | *" fp8_table "*)
    row "step, " 6 "bf16 and FP8 steps, AUTO's form and the kernel's, its two variants"
    row "quantizing kernels' share of" 2 "the quantizing kernels' share, each form"
    row "slowest quantizing pass" 3 "the quantizing passes' slowest rate, each bench_q8 form"
    row "bf16 / FP8 step >= " 6 "goals: bf16 / FP8, 2 FP8 forms at 3 shapes"
    row "quantizing kernels' share <= " 6 "goals: the share, 2 forms at 3 shapes"
    row "every quantizing pass >= " 9 "goals: the passes' rate, 3 bench_q8 forms at 3 shapes"
    # a GPU's trace names kernels mangled, and a bare machine may have no c++filt: Mixtral's trace so
    # renamed (_Z, the name's length, the name, its template's arguments), summed without c++filt, must
    # give the table the same share
    py=$(python3 -c 'import sys; print(sys.executable)') # (the interpreter itself, no PATH needed)
    mkdir -p "$S/mangled"
    gzip -dc "$S/out/trace_mixtral_fp8.csv.gz" | "$py" -c 'import csv, re, sys
w = csv.writer(sys.stdout, lineterminator="\n")
for r in csv.reader(sys.stdin):
    b = re.split("[<(]", r[1])[0]
    k = r[0] == "K" and b.startswith("moept__")
    w.writerow(r[:1] + [f"_Z{len(b)}{b}ILi1EEvPKT_" if k else r[1]] + r[2:])
' >"$S/mangled/trace.csv"
    (cd "$S" && PATH=/nonexistent "$py" tools/cupti_summary.py mangled/trace.csv --skip 2 \
        >mangled/profile_mixtral_fp8.txt && "$py" tools/fp8_table.py mangled >mangled/table.md)
    a=$(grep "^| quantizing kernels' share of the FP8 step, auto" "$T" | cut -d'|' -f3)
    b=$(grep "^| quantizing kernels' share of the FP8 step, auto" "$S/mangled/table.md" | cut -d'|' -f3)
    if [ -n "$a" ] && [ "$a" = "$b" ] && grep -q '^K,_Z[0-9]*moept__k_q8' "$S/mangled/trace.csv"; then
        echo "ok - fp8_table.py: Mixtral's share from mangled names without c++filt as from plain ones:$a"
    else
        echo "FAIL - fp8_table.py: Mixtral's share from mangled names without c++filt: '$b', plain: '$a'"
        rc=1
    fi ;;
esac
case " $phases " in *" fp8 "* | *" fp8_checks "*)
    row "loss's moving average" 2 "goals: the loss, the example's model and the wide one" ;;
esac
[ $rc -eq 0 ]
