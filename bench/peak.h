/* peak.h: the machine's measured FMA peak, for benchmarks to divide by.

   A loop of independent fused multiply-adds held in registers (no loads or
   stores), at the vector width of the builtin GEMM's kernel: enough chains
   to cover latency x pipes on current cores (12 on AVX2's 16 registers, 24
   where there are 32). Run on `threads` OpenMP threads at once, so turbo
   and shared-core effects are those the GEMM sees. The ISA is read from
   the target macros as the builtin kernel's is, whichever GEMM the
   including program uses. */
#ifndef MOEPT_BENCH_PEAK_H
#define MOEPT_BENCH_PEAK_H
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#if defined(__AVX512F__)
#define PEAK_W 16
#define PEAK_N 24
typedef __m512 peak_v;
#define PEAK_SET(x) _mm512_set1_ps(x)
#define PEAK_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define PEAK_SUM(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__) && defined(__FMA__)
#define PEAK_W 8
#define PEAK_N 12
typedef __m256 peak_v;
#define PEAK_SET(x) _mm256_set1_ps(x)
#define PEAK_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static float peak_sum8(__m256 v) { float f[8]; _mm256_storeu_ps(f, v); return f[0] + f[7]; }
#define PEAK_SUM(v) peak_sum8(v)
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define PEAK_W 4
#define PEAK_N 24
typedef float32x4_t peak_v;
#define PEAK_SET(x) vdupq_n_f32(x)
#define PEAK_FMA(a, b, c) vfmaq_f32(c, a, b)
#define PEAK_SUM(v) vaddvq_f32(v)
#else /* scalar multiply then add, counted as 2 flops */
#define PEAK_W 1
#define PEAK_N 12
typedef float peak_v;
#define PEAK_SET(x) (x)
#define PEAK_FMA(a, b, c) ((a) * (b) + (c))
#define PEAK_SUM(v) (v)
#endif

static double peak_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* one thread's chains: c = c * a + b, PEAK_N at once, distinct starts (the
   compiler may not merge them) */
static float peak_chains(long iters, float seed) {
    peak_v c[PEAK_N], a = PEAK_SET(0.999999f), b = PEAK_SET(1e-7f);
    for (int i = 0; i < PEAK_N; i++) c[i] = PEAK_SET(seed + (float)i);
    for (long it = 0; it < iters; it++)
#pragma GCC unroll 24
        for (int i = 0; i < PEAK_N; i++) c[i] = PEAK_FMA(c[i], a, b);
    float s = 0;
    for (int i = 0; i < PEAK_N; i++) s += PEAK_SUM(c[i]);
    return s;
}

/* GFLOP/s of `threads` threads together (best of 5 runs of about 0.05 s:
   a shared machine can only make a run slower) */
static double peak_gflops(int threads) {
    long iters = 20000000;
    double best = 0;
    volatile float sink = 0;
    for (int r = 0; r < 5; r++) {
        double t = peak_now();
        float s = 0;
#pragma omp parallel num_threads(threads) reduction(+ : s)
        s += peak_chains(iters, (float)r);
        t = peak_now() - t;
        sink += s;
        double g = 2.0 * PEAK_W * PEAK_N * (double)iters * threads / t * 1e-9;
        best = g > best ? g : best;
    }
    (void)sink;
    return best;
}
#endif
