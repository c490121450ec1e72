/* bench_shape.h: the layer's options, shared by bench_layer, bench_gemm and
   bench_q8: --shape mixtral|deepseek|qwen3 --tokens T --hidden D --ffn F
   --experts E --topk K --reps R --threads N (default: OpenMP's count); the
   named shapes bench_cuda's too. */
#ifndef BENCH_SHAPE_H
#define BENCH_SHAPE_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Sleeps ms milliseconds: between one GEMM library's runs and the other's,
   so the first's idle threads stop spinning before the second is timed
   (OpenBLAS 0.3's workers spin for 2^28 time-stamp ticks, about 0.1 s, after
   each call; libgomp's for a few hundred microseconds). */
static inline void bench_pause_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

#ifdef BENCH_CBLAS /* the builtin GEMM's benchmarks, linked with OpenBLAS too */
#include <cblas.h>
char *openblas_get_corename(void); /* OpenBLAS's own, which other cblas.h files do not declare */
void openblas_set_num_threads(int num_threads);

/* one descriptor (moept.c's, included before) through OpenBLAS, as moept__gemm_run would call it */
static inline void bench_cblas(const moept__gemm *g) {
    if (g->m > 0 && g->n > 0)
        cblas_sgemm(CblasRowMajor, g->trans_a ? CblasTrans : CblasNoTrans,
                    g->trans_b ? CblasTrans : CblasNoTrans, (int)g->m, (int)g->n, (int)g->k, g->alpha,
                    g->a, (int)g->lda, g->b, (int)g->ldb, g->beta, g->c, (int)g->ldc);
}
#endif

typedef struct bench_shape {
    int64_t T, D, F, E, K;
    int reps, threads;
    const char *shape; /* --shape's name (or the caller's default); NULL: none */
} bench_shape;

/* the named layers (--shape): Mixtral-8x7B's; DeepSeek-V3's experts, 16 local (its 256 over 16 EP
   ranks), top-8: about T / 2 rows an expert, as a rank of that EP group receives; Qwen3-30B-A3B's.
   0: an unknown name */
static inline int bench_shape_of(const char *name, int64_t *D, int64_t *F, int64_t *E, int64_t *K) {
    if (!strcmp(name, "mixtral")) *D = 4096, *F = 14336, *E = 8, *K = 2;
    else if (!strcmp(name, "deepseek")) *D = 7168, *F = 2048, *E = 16, *K = 8;
    else if (!strcmp(name, "qwen3")) *D = 2048, *F = 768, *E = 128, *K = 8;
    else return 0;
    return 1;
}
/* fills *s from argv over its defaults (the shape named by --shape, or s->shape, first; the other
   options over it) and applies the thread count; 0 (with a message) on an unknown option, shape or a
   bad value */
static inline int bench_shape_args(int argc, char **argv, bench_shape *s) {
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--shape")) s->shape = argv[i + 1];
    if (s->shape && !bench_shape_of(s->shape, &s->D, &s->F, &s->E, &s->K)) {
        fprintf(stderr, "unknown shape %s\n", s->shape);
        return 0;
    }
#ifdef _OPENMP
    s->threads = omp_get_max_threads();
#else
    s->threads = 1;
#endif
    for (int i = 1; i + 1 < argc; i += 2) {
        long long v = atoll(argv[i + 1]);
        if (!strcmp(argv[i], "--tokens")) s->T = v;
        else if (!strcmp(argv[i], "--hidden")) s->D = v;
        else if (!strcmp(argv[i], "--ffn")) s->F = v;
        else if (!strcmp(argv[i], "--experts")) s->E = v;
        else if (!strcmp(argv[i], "--topk")) s->K = v;
        else if (!strcmp(argv[i], "--reps")) s->reps = (int)v;
        else if (!strcmp(argv[i], "--threads")) s->threads = (int)v;
        else if (!strcmp(argv[i], "--shape")) continue;
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 0; }
    }
    if (s->reps < 1 || s->reps > 64 || s->threads < 1 || s->K < 1 || s->E < s->K || s->T * s->K < s->E) {
        fprintf(stderr, "bad arguments\n");
        return 0;
    }
#ifdef _OPENMP
    omp_set_num_threads(s->threads);
#endif
    return 1;
}
#endif
