/* bench_cuda: one CUDA MoE layer's forward+backward on one GPU (every expert
   local) against its GEMM floor, timed with CUDA events on the layer's
   stream.

   The floor runs the GEMMs the step runs, with the step's own per-expert row
   counts (read back from its routing): per expert gate/up and down forward,
   and backward dW2, da, dW13, dxs (weight gradients into fp32, as the
   layer), plus the fp32 router GEMMs; each through cublasGemmEx in the
   layer's dtype with fp32 compute (cublasGemmEx_64, one call per GEMM), on
   separate buffers of random values (as the layer's: a GPU runs a GEMM on
   zeros faster), one call after another. What is left between the two is
   routing, the plan, the permutes, activations, combine and the host
   synchronisation(s), less what the layer's GEMMs gain over the floor's
   by running side by side on its side streams (tools/gpu_check.sh's
   profile phase times each part).

   usage: bench_cuda [--shape mixtral|deepseek|qwen3] [--tokens T] [--hidden D]
                     [--ffn F] [--experts E] [--topk K] [--reps R] [--bf16|--fp32]
                     [--gemm-form auto|grouped|per-expert|strided|kernel|all] [--fp8] [--sync-free]
   --sync-free: moept_cuda_options.sync_free (static blocks of max_tokens rows an expert, dropless: the
   cuBLAS forms multiply their zero rows, the kernel form skips them by the counts on the device).
   --fp8: the layer's expert GEMMs in FP8 (config.fp8: cuBLASLt, E4M3 in
   DeepSeek-V3's tiles), its rows in the dtype; the floor stays the dtype's
   cuBLAS GEMMs, so step_over_floor compares the FP8 layer with that floor.
   Defaults: Mixtral-8x7B's layer (--shape mixtral) at T 8192 in bf16;
   --shape deepseek, qwen3: bench_shape.h's. The options after --shape
   override it.
   --gemm-form times the layer with that moept_cuda_options.gemm_form (all:
   each in turn, one layer at a time); the floor is the same for all.
   Prints one "RESULT key=value ..." line per form, then the optimizer's.
   Under the emulated GPU (build/emu/bench_cuda) it checks that the bench
   runs; its times mean nothing there. */
#define MOEPT_INTERNAL /* moept__gemm_make, moept__gemm_colmajor */
#include "../moept.h"

#include "bench_shape.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(call)                                                                        \
    do {                                                                                \
        int e_ = (int)(call);                                                           \
        if (e_ != 0) {                                                                  \
            fprintf(stderr, "bench_cuda: %s failed (%d), line %d\n", #call, e_, __LINE__); \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

typedef struct shape { int64_t T, D, F, E, K, reps; int bf16, form, fp8, sync_free; } shape; /* form -1: all */

static const char *form_names[5] = {"auto", "grouped", "per-expert", "strided", "kernel"};

/* zeroed device memory. cudaMemset is asynchronous for device memory and
   runs on the legacy stream, which does not order the layer's non-blocking
   one: synchronised here (the emulator reported the race) */
static void *dalloc(size_t bytes) {
    void *p = NULL;
    CK(cudaMalloc(&p, bytes ? bytes : 1));
    CK(cudaMemset(p, 0, bytes ? bytes : 1));
    CK(cudaDeviceSynchronize());
    return p;
}

/* one row-major descriptor through cublasGemmEx (ta: A and B's type, tc: C's) */
static void gemm(cublasHandle_t h, moept__gemm g, cudaDataType_t ta, cudaDataType_t tc) {
    if (g.m <= 0 || g.n <= 0 || g.k <= 0) return;
    moept__gemm_cm c = moept__gemm_colmajor(&g);
    cublasOperation_t oa = c.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, ob = c.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    CK(cublasGemmEx_64(h, oa, ob, c.m, c.n, c.k, &c.alpha, c.a, ta, c.lda, c.b, ta, c.ldb, &c.beta, c.c, tc,
                       c.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* The floor's buffers: rows [R] of every expert, weights [E], fp32 router. */
typedef struct floor_bufs {
    char *x, *h, *a, *da, *y, *w13, *w2; /* [R][D], [R][2F], [R][F], [R][F], [R][D], [E][2F][D], [E][D][F] */
    float *g13, *g2;                  /* [E][2F][D], [E][D][F] */
    float *xf, *wr, *lg, *gr, *dxf;   /* [T][D], [E][D], [T][E], [E][D], [T][D] */
} floor_bufs;

/* every GEMM of one step, expert e over rows [off[e], off[e+1]) */
static double floor_step(cublasHandle_t hb, const shape *s, const int64_t *off, const floor_bufs *b) {
    const int64_t D = s->D, F = s->F, H = 2 * F, T = s->T, E = s->E, es = s->bf16 ? 2 : 4;
    const cudaDataType_t dt = s->bf16 ? CUDA_R_16BF : CUDA_R_32F;
#define AT(p, row, w) ((float *)((p) + (row) * (w) * es))
    double flops = 0.0;
    gemm(hb, moept__gemm_make(0, 1, T, E, D, b->xf, D, b->wr, D, 0.0f, b->lg, E), CUDA_R_32F, CUDA_R_32F);
    for (int64_t e = 0; e < E; e++) {
        int64_t r0 = off[e], r = off[e + 1] - off[e];
        const float *w13 = AT(b->w13, e * H, D), *w2 = AT(b->w2, e * D, F);
        float *x = AT(b->x, r0, D), *h = AT(b->h, r0, H), *a = AT(b->a, r0, F), *y = AT(b->y, r0, D);
        float *da = AT(b->da, r0, F); /* its own: into a, each rep would multiply a by W2^T W2 */
        float *g2 = b->g2 + e * D * F, *g13 = b->g13 + e * H * D;
        gemm(hb, moept__gemm_make(0, 1, r, H, D, x, D, w13, D, 0.0f, h, H), dt, dt);   /* h = x W13^T */
        gemm(hb, moept__gemm_make(0, 1, r, D, F, a, F, w2, F, 0.0f, y, D), dt, dt);    /* y = a W2^T */
        gemm(hb, moept__gemm_make(1, 0, D, F, r, y, D, a, F, 1.0f, g2, F), dt, CUDA_R_32F); /* g2 += dy^T a */
        gemm(hb, moept__gemm_make(0, 0, r, F, D, y, D, w2, F, 0.0f, da, F), dt, dt);   /* da = dy W2 */
        gemm(hb, moept__gemm_make(1, 0, H, D, r, h, H, x, D, 1.0f, g13, D), dt, CUDA_R_32F); /* g13 += dhT x */
        gemm(hb, moept__gemm_make(0, 0, r, D, H, h, H, w13, D, 0.0f, y, D), dt, dt);   /* dx = dh W13 */
        flops += 2.0 * (double)r * (3.0 * H * D + 3.0 * D * F);
    }
    gemm(hb, moept__gemm_make(1, 0, E, D, T, b->lg, E, b->xf, D, 1.0f, b->gr, D), CUDA_R_32F, CUDA_R_32F);
    gemm(hb, moept__gemm_make(0, 0, T, D, E, b->lg, E, b->wr, D, 1.0f, b->dxf, D), CUDA_R_32F, CUDA_R_32F);
#undef AT
    return flops + 6.0 * (double)T * E * D;
}

/* n values in the layer's dtype (bf16) or fp32 on the device, uniform in [-scale, scale): drawn 4M at a
   time into a host block, each block copied to its place. A GPU's power, and with it its clock, depends
   on the data it multiplies (the H200 ran the floor's GEMMs on zeros in 2-12% less time): the floor's
   operands are random as the layer's are. */
static void *dev_random(int64_t n, int bf16, uint64_t seed, float scale) {
    const size_t es = bf16 ? 2 : 4;
    const int64_t nb = n < ((int64_t)1 << 22) ? n : ((int64_t)1 << 22);
    char *h = malloc((size_t)nb * es + 4);
    void *d = dalloc((size_t)n * es);
    for (int64_t o = 0; o < n; o += nb) {
        const int64_t c = n - o < nb ? n - o : nb;
        for (int64_t i = 0; i < c; i++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            float v = ((float)((double)(seed >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f) * scale;
            if (bf16) ((uint16_t *)h)[i] = moept__f32_to_bf16(v);
            else ((float *)h)[i] = v;
        }
        /* pageable: the call returns once h is staged, so the next block may overwrite it */
        CK(cudaMemcpy((char *)d + o * (int64_t)es, h, (size_t)(c * (int64_t)es), cudaMemcpyHostToDevice));
    }
    CK(cudaDeviceSynchronize()); /* a pageable H2D copy may return before its DMA ends */
    free(h);
    return d;
}

/* the floor's operands: what a GEMM reads before any writes it random, activations in [-1, 1),
   weights in [-0.02, 0.02); outputs, da and the gradients (zero as after zero_grad) zeroed */
static floor_bufs floor_alloc(const shape *s, int64_t R) {
    const int64_t D = s->D, F = s->F, E = s->E, T = s->T, es = s->bf16 ? 2 : 4;
    const int bf = s->bf16;
    floor_bufs b;
    b.x = dev_random(R * D, bf, 3, 1.0f); b.a = dev_random(R * F, bf, 5, 1.0f);
    b.h = dalloc((size_t)(R * 2 * F * es)); b.y = dalloc((size_t)(R * D * es));
    b.da = dalloc((size_t)(R * F * es));
    b.w13 = dev_random(E * 2 * F * D, bf, 7, 0.02f); b.w2 = dev_random(E * D * F, bf, 8, 0.02f);
    b.g13 = dalloc((size_t)(E * 2 * F * D) * 4); b.g2 = dalloc((size_t)(E * D * F) * 4);
    b.xf = dev_random(T * D, 0, 9, 1.0f); b.wr = dev_random(E * D, 0, 10, 0.02f);
    b.lg = dalloc((size_t)(T * E) * 4);
    b.gr = dalloc((size_t)(E * D) * 4); b.dxf = dalloc((size_t)(T * D) * 4);
    return b;
}
static void floor_free(floor_bufs *b) {
    void *p[] = {b->x, b->h, b->a, b->da, b->y, b->w13, b->w2, b->g13, b->g2, b->xf, b->wr, b->lg, b->gr,
                 b->dxf};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) cudaFree(p[i]);
}

static float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
    float ms = 0.0f;
    CK(cudaEventSynchronize(b));
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms;
}

static void usage(void) {
    fprintf(stderr, "usage: bench_cuda [--shape mixtral|deepseek|qwen3] [--tokens T] [--hidden D] [--ffn F] "
                    "[--experts E] [--topk K] [--reps R] [--bf16|--fp32] "
                    "[--gemm-form auto|grouped|per-expert|strided|kernel|all] [--fp8] [--sync-free]\n");
    exit(2);
}

static void parse(int argc, char **argv, shape *s) {
    *s = (shape){8192, 4096, 14336, 8, 2, 5, 1, MOEPT_GEMM_AUTO, 0, 0};
    for (int i = 1; i < argc; i++) {
        int64_t *v = !strcmp(argv[i], "--tokens") ? &s->T : !strcmp(argv[i], "--hidden") ? &s->D
                     : !strcmp(argv[i], "--ffn") ? &s->F : !strcmp(argv[i], "--experts") ? &s->E
                     : !strcmp(argv[i], "--topk") ? &s->K : !strcmp(argv[i], "--reps") ? &s->reps : NULL;
        if (v && i + 1 < argc) *v = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--bf16")) s->bf16 = 1;
        else if (!strcmp(argv[i], "--fp32")) s->bf16 = 0;
        else if (!strcmp(argv[i], "--fp8")) s->fp8 = 1;
        else if (!strcmp(argv[i], "--sync-free")) s->sync_free = 1;
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
            if (!bench_shape_of(argv[++i], &s->D, &s->F, &s->E, &s->K)) usage();
        } else if (!strcmp(argv[i], "--gemm-form") && i + 1 < argc) {
            const char *n = argv[++i];
            s->form = -2;
            for (int f = 0; f < 5; f++)
                if (!strcmp(n, form_names[f])) s->form = f;
            if (!strcmp(n, "all")) s->form = -1;
            if (s->form == -2) usage();
        } else usage();
    }
}

/* moept_grad_norm + moept_adamw_step on the device against a device copy
   that moves the same bytes (the norm reads the n gradients; AdamW reads p,
   g, m, v and writes p, m, v and, bf16, the expert weights' copy, FP8 their
   two E4M3 copies), timed in the same run. A RESULT line; nonzero on
   failure. */
static int optimizer_bench(moept_layer *L, cudaStream_t st, const shape *s, cudaEvent_t e0, cudaEvent_t e1) {
    float *p, *g;
    int64_t n;
    const moept_adamw opt = {1e-6f, 0.9f, 0.999f, 1e-8f, 0.0f};
    double norm;
    if (moept_cuda_params(L, &p, &g, &n)) return fprintf(stderr, "bench_cuda: %s\n", moept_last_error(L)), 1;
    const double ne = (double)(n - s->E * s->D); /* (the expert weights: Mixtral's family, no shared expert) */
    const double bytes = 32.0 * (double)n + (s->bf16 ? 2.0 * ne : 0.0) + (s->fp8 ? 2.0 * ne : 0.0);
    for (int64_t r = -1; r < s->reps; r++) {
        if (r == 0) CK(cudaEventRecord(e0, st));
        if (moept_grad_norm(L, &norm) || moept_adamw_step(L, &opt))
            return fprintf(stderr, "bench_cuda: %s\n", moept_last_error(L)), 1;
    }
    CK(cudaEventRecord(e1, st));
    const double opt_ms = elapsed_ms(e0, e1) / (double)s->reps;
    const size_t half = (size_t)(bytes / 2) / 16 * 16; /* a copy reads and writes: half the bytes each */
    void *a = dalloc(half), *b = dalloc(half);
    for (int64_t r = -1; r < s->reps; r++) {
        if (r == 0) CK(cudaEventRecord(e0, st));
        CK(cudaMemcpyAsync(b, a, half, cudaMemcpyDeviceToDevice, st));
    }
    CK(cudaEventRecord(e1, st));
    const double copy_ms = elapsed_ms(e0, e1) / (double)s->reps;
    printf("RESULT optimizer params=%lld bytes=%.0f opt_ms=%.3f copy_ms=%.3f opt_over_copy=%.3f copy_gbs=%.0f\n",
           (long long)n, bytes, opt_ms, copy_ms, opt_ms / copy_ms, 2.0 * (double)half / (copy_ms * 1e-3) * 1e-9);
    cudaFree(a);
    cudaFree(b);
    return 0;
}

/* One layer of gemm form f: two warm-up steps, then reps timed; its mean step in ms. The first form's
   layer also gives the routing (off, per expert) and runs the optimizer bench. 0 on failure. */
static double step_bench(const shape *s, int f, cudaStream_t st, int64_t *off, int first) {
    const int64_t T = s->T, D = s->D, E = s->E, K = s->K;
    moept_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.family = MOEPT_FAMILY_MIXTRAL;
    cfg.hidden_size = D; cfg.intermediate_size = s->F; cfg.num_experts = E; cfg.top_k = K;
    cfg.norm_topk_prob = 1; cfg.aux_loss = MOEPT_AUX_HF; cfg.aux_loss_coef = 0.01f; cfg.max_tokens = T;
    cfg.fp8 = s->fp8 ? MOEPT_FP8_BLOCKWISE : MOEPT_FP8_OFF;
    /* unchecked_backward: the step's one host sync, as a trainer that checks dy itself would run */
    moept_cuda_options o = {s->bf16 ? MOEPT_DTYPE_BF16 : MOEPT_DTYPE_F32, st, 1, s->sync_free, (moept_gemm_form)f};
    moept_layer *L = NULL;
    moept_status cst = moept_create_cuda(&cfg, NULL, NULL, &o, &L);
    if (cst == MOEPT_ERR_UNSUPPORTED && f == MOEPT_GEMM_KERNEL) { /* not this GPU or build: said, skipped */
        printf("skip - gemm_form=kernel: %s\n", moept_last_error(NULL));
        return -1.0;
    }
    if (cst) {
        fprintf(stderr, "bench_cuda: %s\n", moept_last_error(NULL));
        return 0.0;
    }
    moept_init_params(L, 1);
    void *x = dev_random(T * D, s->bf16, 1, 1.0f), *dy = dev_random(T * D, s->bf16, 2, 1.0f);
    void *y = dalloc((size_t)(T * D) * (s->bf16 ? 2 : 4)), *dx = dalloc((size_t)(T * D) * (s->bf16 ? 2 : 4));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double ms = 0.0;
    for (int64_t r = -2; r < s->reps; r++) { /* two warm-up steps */
        if (r == 0) CK(cudaEventRecord(e0, st));
        if (moept_forward(L, x, T, y) || moept_backward(L, x, dy, dx)) {
            fprintf(stderr, "bench_cuda: %s\n", moept_last_error(L));
            goto out;
        }
    }
    CK(cudaEventRecord(e1, st));
    ms = elapsed_ms(e0, e1) / (double)s->reps;
    if (first) { /* the floor's rows per expert, from the step's own routing; the optimizer */
        const int32_t *ids;
        const float *wts;
        CK(moept_routing(L, &ids, &wts, NULL));
        for (int64_t i = 0; i < T * K; i++) off[ids[i] + 1]++;
        for (int64_t e = 0; e < E; e++) off[e + 1] += off[e];
        if (optimizer_bench(L, st, s, e0, e1)) ms = 0.0;
    }
out:
    cudaFree(x); cudaFree(dy); cudaFree(y); cudaFree(dx);
    cudaEventDestroy(e0); cudaEventDestroy(e1);
    moept_destroy(L);
    return ms;
}

int main(int argc, char **argv) {
    shape s;
    parse(argc, argv, &s);
    if (moept_cuda_device_count() < 1) { printf("skip - bench_cuda: no CUDA device\n"); return 0; }
    const int64_t T = s.T, E = s.E, K = s.K;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int forms[5], nf = 0;
    for (int f = 0; f < 5; f++)
        if (s.form == -1 || s.form == f) forms[nf++] = f;
    double step_ms[5];
    int64_t *off = calloc((size_t)E + 1, sizeof(int64_t));
    for (int i = 0; i < nf; i++) /* one layer at a time: the Mixtral and DeepSeek shapes each fill a GPU */
        if ((step_ms[i] = step_bench(&s, forms[i], st, off, i == 0)) == 0.0) return 1;
    /* the floor, at the step's own rows per expert (every form routes alike) */
    floor_bufs b = floor_alloc(&s, off[E]);
    cublasHandle_t hb;
    CK(cublasCreate(&hb));
    CK(cublasSetStream(hb, st));
    /* the layer's math mode: no TF32, no reduction in a bf16 output type */
    CK(cublasSetMathMode(hb,
                         (cublasMath_t)(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double flops = 0.0;
    for (int64_t r = -1; r < s.reps; r++) {
        if (r == 0) CK(cudaEventRecord(e0, st));
        flops = floor_step(hb, &s, off, &b);
    }
    CK(cudaEventRecord(e1, st));
    double floor_ms = elapsed_ms(e0, e1) / (double)s.reps;
    for (int i = 0; i < nf; i++) {
        if (step_ms[i] <= 0.0) continue; /* (skipped) */
        printf("RESULT tokens=%lld hidden=%lld ffn=%lld experts=%lld topk=%lld dtype=%s%s reps=%lld "
               "step_ms=%.3f "
               "floor_ms=%.3f step_over_floor=%.3f floor_tflops=%.1f gemm_form=%s sync_free=%d\n",
               (long long)T, (long long)s.D, (long long)s.F, (long long)E, (long long)K, s.bf16 ? "bf16" : "fp32",
               s.fp8 ? "+fp8" : "",
               (long long)s.reps, step_ms[i], floor_ms, step_ms[i] / floor_ms, flops / (floor_ms * 1e-3) * 1e-12,
               form_names[forms[i]], s.sync_free);
    }
    cublasDestroy(hb);
    floor_free(&b);
    free(off);
    cudaEventDestroy(e0); cudaEventDestroy(e1);
    cudaStreamDestroy(st);
    return 0;
}
