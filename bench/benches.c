/* The benchmarks that make test runs (at tiny shapes: that they run) as one
   program: each includes moept.c to time its internals, and here moept.c is
   compiled once for all of them. The Makefile links the program under each
   benchmark's name (ln), and the name it runs as picks that benchmark's
   main; built alone, each file is its own program still (make bench's
   variants). A file-scope name two benchmarks share fails to compile here:
   give it the benchmark's own name. */
#include "../moept.c"

#define BENCHES(X) X(bench_layer) X(bench_a2a) X(bench_load) X(bench_reshard) X(bench_scenario)

#define main bn_main_bench_layer
#include "bench_layer.c"
#undef main
#define main bn_main_bench_a2a
#include "bench_a2a.c"
#undef main
#define main bn_main_bench_load
#include "bench_load.c"
#undef main
#define main bn_main_bench_reshard
#include "bench_reshard.c"
#undef main
#define main bn_main_bench_scenario
#include "bench_scenario.c"
#undef main

int main(int argc, char **argv) {
    const char *me = argc > 0 ? strrchr(argv[0], '/') : NULL;
    me = me ? me + 1 : argc > 0 ? argv[0] : "";
#define BN_RUN(b) if (strcmp(me, #b) == 0) return bn_main_##b(argc, argv);
    BENCHES(BN_RUN)
    fprintf(stderr, "benches: run it as one of its benchmarks (a link named bench_layer, ...), not as %s\n",
            me);
    return 2;
}
