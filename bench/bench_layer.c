/* bench_layer: one MoE layer's forward+backward against its GEMM floor.

   The floor runs exactly the GEMMs the step runs (router, and per expert the
   gate/up and down projections forward and their three products backward,
   with the step's own per-expert row counts) through the same GEMM path,
   on separate buffers: what is left between the two is the cost of
   routing, the plan, the permute, activations and the combine.

   Built with BENCH_CBLAS (the builtin GEMM's build, linked with OpenBLAS),
   the same floor also runs through cblas_sgemm in the same process, and
   again through the builtin GEMM, each after a pause (bench_pause_ms), so
   the two libraries are timed in turn under the same clock and cache
   conditions: RESULT adds cblas_floor_s, paused_floor_s, the median (and
   range) over reps of each rep's rate ratio (rate_vs_openblas: OpenBLAS's
   time over the builtin's) and the kernel OpenBLAS used. Each step is
   bracketed by the floor timed right before it and right after it: ratio
   is the medians' ratio, ratio_paired the median (and range) over reps of
   the step's time over the mean of its two floors, which a drift of the
   machine's speed across the three moves the least. ratio_best (the
   fastest step over the fastest floor) and rate_vs_openblas_best (the
   fastest OpenBLAS floor over the fastest builtin one) take the best of
   each side: another tenant's load only ever slows a rep.

   usage: bench_layer [--tokens T] [--hidden D] [--ffn F] [--experts E]
                      [--topk K] [--reps R] [--threads N]
   Prints one "RESULT key=value ..." line (bench/run_bench_layer.py reads it). */
#include "../moept.c"
#include "peak.h"
#include "bench_shape.h"

#include <time.h>
#if defined(BENCH_CBLAS) && !defined(MOEPT_CBLAS)
#define BENCH_OB 1 /* the builtin build, OpenBLAS beside it */
static void floor_cblas(const moept__gemm *g, int64_t n) {
    for (int64_t i = 0; i < n; i++) bench_cblas(&g[i]);
}
#endif

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* resident set now and its high-water mark, in bytes (Linux) */
static void rss(int64_t *cur, int64_t *peak) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    *cur = *peak = 0;
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        long long kb;
        if (sscanf(line, "VmRSS: %lld", &kb) == 1) *cur = kb * 1024;
        if (sscanf(line, "VmHWM: %lld", &kb) == 1) *peak = kb * 1024;
    }
    fclose(f);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The step's GEMMs (router, then each expert's six products with the
   step's row counts) on buffers of their own, into g[6E + 3]: returns
   their count and adds their flops to *flops. The buffers live until exit. */
static int64_t floor_gemms(const moept_layer *L, const float *x, int64_t T, moept__gemm *g, double *flops) {
    const moept__fplan *pl = &moept__last(L)->plan; /* the step's */
    const int64_t D = L->D, F = L->F, E = L->E, N = pl->N, H = L->H;
    float *bx = calloc((size_t)(N * D), 4), *bh = calloc((size_t)(N * H), 4), *ba = calloc((size_t)(N * F), 4);
    float *by = calloc((size_t)(N * D), 4), *lg = calloc((size_t)(T * E), 4), *dxx = calloc((size_t)(T * D), 4);
    int64_t n = 0;
    g[n++] = moept__gemm_make(0, 1, T, E, D, x, D, L->par.w_router, D, 0.0f, lg, E);
    g[n++] = moept__gemm_make(1, 0, E, D, T, lg, E, x, D, 1.0f, L->par.g_router, D);
    g[n++] = moept__gemm_make(0, 0, T, D, E, lg, E, L->par.w_router, D, 1.0f, dxx, D);
    for (int64_t e = 0; e < E; e++) {
        int64_t r0 = pl->offsets[e], m = pl->counts[e];
        if (!m) continue;
        g[n++] = moept__gemm_make(0, 1, m, H, D, bx + r0 * D, D, L->par.w13 + e * H * D, D, 0.0f, bh + r0 * H, H);
        g[n++] = moept__gemm_make(0, 1, m, D, F, ba + r0 * F, F, L->par.w2 + e * D * F, F, 0.0f, by + r0 * D, D);
        g[n++] = moept__gemm_make(1, 0, D, F, m, by + r0 * D, D, ba + r0 * F, F, 1.0f, L->par.g2 + e * D * F, F);
        g[n++] = moept__gemm_make(0, 0, m, F, D, by + r0 * D, D, L->par.w2 + e * D * F, F, 0.0f, ba + r0 * F, F);
        g[n++] = moept__gemm_make(1, 0, H, D, m, bh + r0 * H, H, bx + r0 * D, D, 1.0f, L->par.g13 + e * H * D, D);
        g[n++] = moept__gemm_make(0, 0, m, D, H, bh + r0 * H, H, L->par.w13 + e * H * D, D, 0.0f, by + r0 * D, D);
    }
    for (int64_t i = 0; i < n; i++) *flops += 2.0 * (double)g[i].m * (double)g[i].n * (double)g[i].k;
    return n;
}

int main(int argc, char **argv) {
    bench_shape sh = {4096, 1024, 3584, 8, 2, 3, 1, NULL};
    if (!bench_shape_args(argc, argv, &sh)) return 2;
    const int64_t T = sh.T, D = sh.D, F = sh.F, E = sh.E, K = sh.K;
    const int reps = sh.reps;
    int64_t rss0, peak0;
    rss(&rss0, &peak0);
    double peak = 0; /* the FMA peak, before any GEMM library's threads exist (and again at the end) */
    moept_config c = {0};
    c.family = MOEPT_FAMILY_MIXTRAL;
    c.hidden_size = D; c.intermediate_size = F; c.num_experts = E; c.top_k = K;
    c.norm_topk_prob = 1; c.max_tokens = T;
    c.aux_loss = MOEPT_AUX_HF; c.aux_loss_coef = 0.01f;
    moept_layer *L;
    if (moept_create(&c, &L) != MOEPT_OK) { fprintf(stderr, "%s\n", moept_last_error(NULL)); return 1; }
    int pth = 1; /* the GEMMs' threads: OpenMP's (OpenBLAS is given the same count) */
#ifdef _OPENMP
    pth = omp_get_max_threads();
#endif
#ifdef BENCH_OB
    openblas_set_num_threads(pth);
    bench_pause_ms(200); /* OpenBLAS's workers, started at load, asleep before the peak is taken */
#endif
    peak = peak_gflops(pth);
    moept_init_params(L, 1);
    float *x = malloc((size_t)(T * D) * 4), *dy = malloc((size_t)(T * D) * 4);
    float *y = malloc((size_t)(T * D) * 4), *dx = malloc((size_t)(T * D) * 4);
    uint64_t s = 5;
    for (int64_t i = 0; i < T * D; i++) {
        x[i] = (float)((double)(moept__mix(&s) >> 11) / 9007199254740992.0 * 2 - 1);
        dy[i] = (float)((double)(moept__mix(&s) >> 11) / 9007199254740992.0 * 2 - 1) * 1e-3f;
    }
    double *tm = malloc((size_t)reps * sizeof(double)), *tf = malloc((size_t)reps * sizeof(double));
    double *tb = malloc((size_t)reps * sizeof(double)); /* the floor right before each step */
    for (int r = -2; r < 0; r++) { /* warm-up */
        moept_forward(L, x, T, y);
        moept_backward(L, x, dy, dx);
    }
    int64_t rss1, peak1;
    rss(&rss1, &peak1);
    moept_stats st;
    moept_get_stats(L, &st, NULL);

    /* the floor: the same GEMMs on separate buffers (allocated after the
       layer's peak was read) */
    moept__gemm *g = malloc((size_t)(6 * E + 3) * sizeof *g);
    double flops = 0;
    int64_t n = floor_gemms(L, x, T, g, &flops);
    moept__gemm_run(g, n, &L->ws.gws); /* warm-up: first touch of the floor's buffers */
#ifdef BENCH_OB
    double *to = malloc((size_t)reps * sizeof(double)); /* OpenBLAS's floor, per rep */
    floor_cblas(g, n);
#endif
    /* the floor, the layer and the floor again, so all three see the same
       cache and clock conditions; with OpenBLAS, its floor first, and a
       pause before it and before the builtin's (tb: the pair's other half) */
    for (int r = 0; r < reps; r++) {
#ifdef BENCH_OB
        bench_pause_ms(200);
        double t2 = now();
        floor_cblas(g, n);
        to[r] = now() - t2;
        bench_pause_ms(200);
#endif
        double t0 = now();
        moept__gemm_run(g, n, &L->ws.gws);
        double t1 = now();
        moept_forward(L, x, T, y);
        moept_backward(L, x, dy, dx);
        double t3 = now();
        moept__gemm_run(g, n, &L->ws.gws);
        tb[r] = t1 - t0;
        tm[r] = t3 - t1;
        tf[r] = now() - t3;
    }
    /* each step over the mean of the floors on either side of it: a drift
       of the machine's speed over the three cancels to first order */
    double *lr = malloc((size_t)reps * sizeof(double));
    for (int r = 0; r < reps; r++) lr[r] = tm[r] / (0.5 * (tb[r] + tf[r]));
    qsort(lr, (size_t)reps, sizeof *lr, cmp_d);
    qsort(tm, (size_t)reps, sizeof *tm, cmp_d);
    qsort(tf, (size_t)reps, sizeof *tf, cmp_d);
    double mt = tm[reps / 2], ft = tf[reps / 2], fbest = tf[0];
    for (int r = 0; r < reps; r++) fbest = tb[r] < fbest ? tb[r] : fbest;
    double again = peak_gflops(pth);
    peak = again > peak ? again : peak;
#ifdef MOEPT_CBLAS
    const char *path = "cblas";
#else
    const char *path = "builtin";
#endif
    printf("RESULT gemm=%s tokens=%lld hidden=%lld ffn=%lld experts=%lld topk=%lld threads=%d reps=%d "
           "moept_s=%.6f floor_s=%.6f ratio=%.4f gflops=%.1f floor_gflops=%.1f peak_bytes=%lld "
           "layer_bytes=%lld routed_rows=%lld peak_gflops=%.1f ratio_paired=%.4f ratio_paired_min=%.4f "
           "ratio_paired_max=%.4f ratio_best=%.4f",
           path, (long long)T, (long long)D, (long long)F, (long long)E, (long long)K, L->nthreads, reps, mt, ft,
           mt / ft, flops / mt * 1e-9, flops / ft * 1e-9, (long long)(peak1 - rss0),
           (long long)(st.param_bytes + st.workspace_bytes), (long long)st.routed_rows, peak, lr[reps / 2],
           lr[0], lr[reps - 1], tm[0] / fbest);
    free(lr);
#ifdef BENCH_OB
    /* each rep's OpenBLAS floor over the builtin one timed right after it: a
       pair shares the machine's state, so their ratio's median is steadier
       than the ratio of the two medians where the clock drifts */
    double *pr = malloc((size_t)reps * sizeof(double));
    for (int r = 0; r < reps; r++) pr[r] = to[r] / tb[r];
    qsort(pr, (size_t)reps, sizeof *pr, cmp_d);
    qsort(to, (size_t)reps, sizeof *to, cmp_d);
    qsort(tb, (size_t)reps, sizeof *tb, cmp_d);
    printf(" cblas_floor_s=%.6f paused_floor_s=%.6f rate_vs_openblas=%.4f rate_vs_openblas_min=%.4f "
           "rate_vs_openblas_max=%.4f rate_vs_openblas_best=%.4f openblas=%s", to[reps / 2], tb[reps / 2],
           pr[reps / 2], pr[0], pr[reps - 1], to[0] / tb[0], openblas_get_corename());
    free(to);
    free(pr);
#endif
    free(tb);
    printf("\n");
    moept_destroy(L);
    return 0;
}
