#!/bin/sh
# The builds users have: moept.c with -Wall -Wextra -Wpedantic -Werror under
# gcc and clang, with and without OpenMP; moept.h alone under gcc, g++,
# clang++ and nvcc (a .cu including it) with -Werror; -Ofast refused with a
# message (it would give wrong answers), and moept.c given to g++/clang++
# refused with "compile moept.c as C11"; MOEPT_NO_IO: the file formats out,
# a training step still links and runs. One "ok/FAIL/skip" line each.
# usage: sh tests/check_builds.sh [NVCC]
out=${TMPDIR:-/tmp}/moept_builds.$$
mkdir -p "$out"
trap 'rm -rf "$out"' EXIT
# the initialiser C and C++ both accept (C++ refuses `= {0}` for this struct)
printf '#include "moept.h"\nint main(void) {\n    moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL);\n    return (int)c.top_k;\n}\n' >"$out/h.c"
cp "$out/h.c" "$out/h.cc"
cp "$out/h.c" "$out/h.cu"
have() { command -v "$1" >/dev/null 2>&1; }
try() { # name, command...
    name=$1; shift
    if "$@" >"$out/log" 2>&1; then echo "ok - $name"; else echo "FAIL - $name"; sed 's/^/    /' "$out/log" | head -20; fi
}
for cc in gcc clang; do
    if ! have $cc; then echo "skip - $cc: not installed"; continue; fi
    for omp in "" -fopenmp; do
        try "$cc -Wall -Wextra -Wpedantic -Werror $omp moept.c" \
            $cc -std=c11 -O2 -Wall -Wextra -Wpedantic -Werror $omp -c moept.c -o "$out/m.o"
    done
    try "$cc -Wpedantic -Werror moept.h" $cc -std=c11 -Wall -Wextra -Wpedantic -Werror -I. -c "$out/h.c" -o "$out/h.o"
done
for cxx in g++ clang++; do
    if ! have $cxx; then echo "skip - $cxx: not installed"; continue; fi
    try "$cxx -Wall -Wextra -Wpedantic -Werror moept.h" \
        $cxx -std=c++11 -Wall -Wextra -Wpedantic -Werror -I. -c "$out/h.cc" -o "$out/h.o"
done
if [ -n "$1" ] && have "$1"; then
    try "nvcc -Werror: a .cu including moept.h" "$1" -std=c++17 -Xcompiler -Wall,-Wextra,-Werror -I. -c "$out/h.cu" -o "$out/hcu.o"
else
    echo "skip - nvcc: not found (a .cu including moept.h was not compiled)"
fi
# MOEPT_NO_IO: the file formats compile out (no warning, nothing else calls them) and a training
# step links without them
cat >"$out/noio.c" <<'EOT'
#include "moept.h"
#include <stdio.h>
int main(void) {
    moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL);
    c.hidden_size = 8; c.intermediate_size = 4; c.num_experts = 4; c.top_k = 2; c.max_tokens = 4;
    moept_layer *L = NULL;
    float x[32], y[32], dx[32];
    for (int i = 0; i < 32; i++) x[i] = 0.1f * (float)(i % 5);
    moept_adamw o = moept_adamw_default(1e-3f);
    int bad = moept_create(&c, &L) || moept_init_params(L, 1) || moept_forward(L, x, 4, y) ||
              moept_backward(L, x, x, dx) || moept_adamw_step(L, &o);
    if (bad) printf("%s\n", moept_last_error(L));
    moept_destroy(L);
    return bad;
}
EOT
for cc in gcc clang; do
    have $cc || continue
    if ! $cc -std=c11 -O1 -Wall -Wextra -Wpedantic -Werror -DMOEPT_NO_IO -c moept.c -o "$out/noio.o" \
         >"$out/log" 2>&1; then
        echo "FAIL - $cc -DMOEPT_NO_IO -Werror moept.c"; head -5 "$out/log"
    elif nm "$out/noio.o" | grep -qE ' T moept_(save_checkpoint|load_hf|st_open)$'; then
        echo "FAIL - $cc -DMOEPT_NO_IO: the file formats are still in moept.o"
    elif $cc -std=c11 -I. "$out/noio.c" "$out/noio.o" -o "$out/noio" -lm -pthread >"$out/log" 2>&1 &&
         "$out/noio" >"$out/log" 2>&1; then
        echo "ok - $cc -DMOEPT_NO_IO: the file formats out, a training step links and runs"
    else
        echo "FAIL - $cc -DMOEPT_NO_IO: a training step did not link or run"; head -5 "$out/log"
    fi
done
# a C++ compiler given moept.c stops at the first line with the reason, not 138 errors
for cxx in g++ clang++; do
    have $cxx || continue
    if $cxx -x c++ -c moept.c -o "$out/cxx.o" >"$out/log" 2>&1; then
        echo "FAIL - $cxx moept.c: built as C++ (it must refuse, naming C11)"
    elif grep -q "compile moept.c as C11" "$out/log" && [ "$(grep -c ': error' "$out/log")" -eq 1 ]; then
        echo "ok - $cxx moept.c refused with the reason (compile as C11)"
    else
        echo "FAIL - $cxx moept.c failed without the reason:"; head -5 "$out/log"
    fi
done
if gcc -Ofast -c moept.c -o "$out/fast.o" >"$out/log" 2>&1; then
    echo "FAIL - -Ofast: moept.c built (it gives wrong answers; it must refuse)"
elif grep -q "must not be built with -ffast-math" "$out/log"; then
    echo "ok - -Ofast refused with the reason"
else
    echo "FAIL - -Ofast failed without the reason:"; head -5 "$out/log"
fi
