/* The FP8 white boxes as one program: test_q8 (tests/test_q8.cu) and bench_q8 (bench/bench_q8.cu)
   each include the kernels' unit, whose compile is most of theirs (nvcc's and the emulator's); here it
   is compiled once for both. The Makefile links the program under each one's name (ln), and the name
   it runs as picks that one's main (test_q8*, bench_q8*). A file-scope name the two share fails to
   compile here: give it the program's own prefix (q8t_, bq_). */
#include "../moept_kernels.cu"

#define main q8_main_test
#include "test_q8.cu"
#undef main
#define main q8_main_bench
#include "../bench/bench_q8.cu"
#undef main

int main(int argc, char **argv) {
    const char *me = argc > 0 ? strrchr(argv[0], '/') : NULL;
    me = me ? me + 1 : argc > 0 ? argv[0] : "";
    if (!strncmp(me, "test_q8", 7)) return q8_main_test(argc, argv);
    if (!strncmp(me, "bench_q8", 8)) return q8_main_bench(argc, argv);
    fprintf(stderr, "q8: run it as test_q8 or bench_q8 (a link of that name), not as %s\n", me);
    return 2;
}
