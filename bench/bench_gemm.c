/* bench_gemm: the builtin GEMM against the machine's FMA peak and against
   OpenBLAS, on the GEMMs of bench_layer's Mixtral-shaped step.

   For T tokens routed top-K over E experts (T*K/E rows an expert), one
   expert's six products: forward gate|up (rows x 2F x D) and down (rows x D
   x F), backward dA = dY W2, dW2 += dY^T A, dX = dH W13, dW13 += dH^T X,
   in the orientations and transposes the layer uses. Each is timed (median
   of reps) through the builtin GEMM and, built with BENCH_CBLAS, through
   cblas_sgemm on the same buffers, one after the other in this run; the
   peak is bench/peak.h's register-only FMA loop on the same threads.

   usage: bench_gemm [--tokens T] [--hidden D] [--ffn F] [--experts E]
                     [--topk K] [--reps R] [--threads N]
          BENCH_GEMM_ALTERNATE=1 with --threads 1: the two in turn, each rep
   Prints a markdown table and one "RESULT ..." line per product. */
#include "../moept.c"
#include "peak.h"
#include "bench_shape.h"
#ifdef BENCH_CBLAS
#define BENCH_HAS_CBLAS 1
#else
#define BENCH_HAS_CBLAS 0
#endif

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* seconds of one run of a descriptor through the builtin GEMM or OpenBLAS */
static double time_once(const moept__gemm *g, moept__gemm_ws *ws, int cblas) {
    double t0 = peak_now();
#ifdef BENCH_CBLAS
    if (cblas) bench_cblas(g);
    else
#endif
    {
        (void)cblas;
        moept__gemm_run(g, 1, ws);
    }
    return peak_now() - t0;
}

/* median seconds of `reps` runs of one descriptor (after one warm-up) */
static double time_gemm(const moept__gemm *g, moept__gemm_ws *ws, int cblas, int reps) {
    double t[64];
    for (int r = -1; r < reps; r++) {
        double dt = time_once(g, ws, cblas);
        if (r >= 0) t[r] = dt;
    }
    qsort(t, (size_t)reps, sizeof t[0], cmp_d);
    return t[reps / 2];
}

int main(int argc, char **argv) {
    bench_shape sh = {4096, 1024, 3584, 8, 2, 5, 1, NULL};
    if (!bench_shape_args(argc, argv, &sh)) return 2;
    const int64_t T = sh.T, D = sh.D, F = sh.F, E = sh.E, K = sh.K;
    const int reps = sh.reps, threads = sh.threads;
    int64_t m = T * K / E, H = 2 * F;
    float *x = calloc((size_t)(m * D), 4), *h = calloc((size_t)(m * H), 4), *a = calloc((size_t)(m * F), 4);
    float *dy = calloc((size_t)(m * D), 4), *w13 = calloc((size_t)(H * D), 4), *w2 = calloc((size_t)(D * F), 4);
    float *g13 = calloc((size_t)(H * D), 4), *g2 = calloc((size_t)(D * F), 4);
    uint64_t s = 3;
    for (int64_t i = 0; i < m * D; i++) x[i] = dy[i] = (float)(moept__mix(&s) >> 40) * 0x1p-24f - 0.5f;
    for (int64_t i = 0; i < H * D; i++) w13[i] = (float)(moept__mix(&s) >> 40) * 0x1p-30f;
    for (int64_t i = 0; i < D * F; i++) w2[i] = (float)(moept__mix(&s) >> 40) * 0x1p-30f;
    for (int64_t i = 0; i < m * H; i++) h[i] = (float)(moept__mix(&s) >> 40) * 0x1p-24f;
    for (int64_t i = 0; i < m * F; i++) a[i] = (float)(moept__mix(&s) >> 40) * 0x1p-24f;
    struct { const char *name; moept__gemm g; } p[6] = {
        {"fwd gate-up h = x W13^T", moept__gemm_make(0, 1, m, H, D, x, D, w13, D, 0.0f, h, H)},
        {"fwd down y = a W2^T", moept__gemm_make(0, 1, m, D, F, a, F, w2, F, 0.0f, dy, D)},
        {"bwd dA = dy W2", moept__gemm_make(0, 0, m, F, D, dy, D, w2, F, 0.0f, a, F)},
        {"bwd dW2 += dy^T a", moept__gemm_make(1, 0, D, F, m, dy, D, a, F, 1.0f, g2, F)},
        {"bwd dX = dh W13", moept__gemm_make(0, 0, m, D, H, h, H, w13, D, 0.0f, x, D)},
        {"bwd dW13 += dh^T x", moept__gemm_make(1, 0, H, D, m, h, H, x, D, 1.0f, g13, D)},
    };
    moept__gemm_ws ws;
    ws.m_max = ((H > m ? H : m) + MOEPT__MR - 1) / MOEPT__MR * MOEPT__MR;
    ws.apack = malloc((size_t)(ws.m_max * MOEPT__KC) * 4);
    ws.bpack = malloc((size_t)((MOEPT__NC + MOEPT__NR) * MOEPT__KC) * 4);
    double peak = peak_gflops(threads), peak1 = peak_gflops(1);
    double gbs[6], gcs[6];
    /* BENCH_GEMM_ALTERNATE=1 on one thread: each rep runs the builtin GEMM, then
       OpenBLAS, and each library's best rep counts (a slow phase of a shared
       machine then hits both); with more threads, each library's idle threads
       would spin through the other's runs */
    int alternate = getenv("BENCH_GEMM_ALTERNATE") && threads == 1;
    const char *obk = "not built (no OpenBLAS)";
#ifdef BENCH_CBLAS
    openblas_set_num_threads(threads);
    obk = openblas_get_corename();
#endif
    double fl = 0, tb = 0, tc = 0;
    for (int i = 0; i < 6; i++) {
        const moept__gemm *g = &p[i].g;
        double f = 2.0 * (double)g->m * (double)g->n * (double)g->k;
        double sb, sc = 0;
        if (alternate) { /* one thread: the two libraries in turn, the best of each */
            sb = sc = 1e30;
            for (int r = -1; r < reps; r++) {
                double b1 = time_once(g, &ws, 0), c1 = BENCH_HAS_CBLAS ? time_once(g, &ws, 1) : 0;
                if (r >= 0 && b1 < sb) sb = b1;
                if (r >= 0 && c1 < sc) sc = c1;
            }
        } else {
            sb = time_gemm(g, &ws, 0, reps);
#ifdef BENCH_CBLAS
            bench_pause_ms(200);
            sc = time_gemm(g, &ws, 1, reps);
            bench_pause_ms(200);
#endif
        }
        fl += f; tb += sb; tc += sc;
        gbs[i] = f / sb * 1e-9;
        gcs[i] = sc > 0 ? f / sc * 1e-9 : 0;
    }
    double again = peak_gflops(threads); /* the peak before and after: the better of the two */
    peak = again > peak ? again : peak;
    printf("builtin GEMM kernel: %s; OpenBLAS kernel: %s; %d threads\n", moept_gemm_kernel(), obk, threads);
    printf("measured FMA peak: %.1f GFLOP/s on %d threads (%.1f on one)\n", peak, threads, peak1);
    printf("T=%lld D=%lld F=%lld E=%lld K=%lld: %lld rows an expert; %s of %d runs each\n\n", (long long)T,
           (long long)D, (long long)F, (long long)E, (long long)K, (long long)m,
           alternate ? "the two in turn, best" : "median", reps);
    printf("| product | m x n x k | builtin GFLOP/s | of peak | OpenBLAS GFLOP/s | of peak | builtin / OpenBLAS |\n");
    printf("|---|---|---|---|---|---|---|\n");
    double gb = fl / tb * 1e-9, gc = tc > 0 ? fl / tc * 1e-9 : 0;
    for (int i = 0; i <= 6; i++) {
        const moept__gemm *g = &p[i < 6 ? i : 0].g;
        double b = i < 6 ? gbs[i] : gb, c = i < 6 ? gcs[i] : gc;
        if (i < 6)
            printf("| %s | %lld x %lld x %lld | ", p[i].name, (long long)g->m, (long long)g->n, (long long)g->k);
        else
            printf("| all six | | ");
        printf("%.1f | %.0f%% | ", b, 100 * b / peak);
        if (c > 0) printf("%.1f | %.0f%% | %.2f |\n", c, 100 * c / peak, b / c);
        else printf("- | - | - |\n");
    }
    printf("RESULT tokens=%lld threads=%d kernel=\"%s\" openblas=\"%s\" peak_gflops=%.1f builtin_gflops=%.1f "
           "openblas_gflops=%.1f builtin_of_peak=%.3f openblas_of_peak=%.3f builtin_vs_openblas=%.3f\n",
           (long long)T, threads, moept_gemm_kernel(), obk, peak, gb, gc, gb / peak, gc / peak,
           gc > 0 ? gb / gc : 0);
    free(x); free(h); free(a); free(dy); free(w13); free(w2); free(g13); free(g2);
    free(ws.apack); free(ws.bpack);
    return 0;
}
