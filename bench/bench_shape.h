/* bench_shape.h: the Mixtral-shaped layer's options, shared by bench_layer
   and bench_gemm: --tokens T --hidden D --ffn F --experts E --topk K
   --reps R --threads N (default: OpenMP's count). */
#ifndef BENCH_SHAPE_H
#define BENCH_SHAPE_H
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
} bench_shape;

/* fills *s from argv over its defaults and applies the thread count;
   0 (with a message) on an unknown option or a bad value */
static int bench_shape_args(int argc, char **argv, bench_shape *s) {
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
