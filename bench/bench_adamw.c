/* moept_adamw_step's time on one CPU layer of 25M parameters (Mixtral
   shape, D 1024, F 2048, E 4), the best of 7 steps: the ordinary step, whose
   overflow check is bounds from one max pass over the gradients; with a
   checkpoint directory as argument, each step right after a load (the
   moments' bounds unknown: the step is first computed without writing).
   usage: build/bench_adamw [CHECKPOINT_DIR] */
#include "../moept.h"
#include <stdio.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
int main(int argc, char **argv) {
    moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL);
    c.hidden_size = 1024; c.intermediate_size = 2048; c.num_experts = 4; c.top_k = 2; c.max_tokens = 8;
    moept_layer *L;
    if (moept_create(&c, &L)) return 1;
    moept_init_params(L, 1);
    float *g; /* [n] the gradients: fixed values in [-0.5, 0.5) */
    int64_t n;
    moept_grads(L, &g, &n);
    for (int64_t i = 0; i < n; i++) g[i] = 1e-3f * (float)((i * 7919) % 1000 - 500);
    moept_adamw o = moept_adamw_default(1e-4f);
    double best = 1e9;
    const char *dir = argc > 1 ? argv[1] : NULL;
    for (int r = 0; r < 7; r++) {
        if (dir && r == 0 && moept_save_checkpoint(L, dir)) { printf("%s\n", moept_last_error(L)); return 1; }
        if (dir && moept_load_checkpoint(L, dir)) { printf("%s\n", moept_last_error(L)); return 1; }
        double t0 = now();
        if (moept_adamw_step(L, &o)) { printf("%s\n", moept_last_error(L)); return 1; }
        double t = now() - t0;
        if (t < best) best = t;
    }
    printf("n_params %lld: best adamw_step %.1f ms\n", (long long)n, best * 1e3);
    moept_destroy(L);
    return 0;
}
