/* lt_rules: what cuBLASLt answers to block-scaled FP8 matmuls (E4M3 operands,
   fp32 scales per 1x128 or 128x128 tile: CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
   ..._BLK128x128_32F), one line a case, so that a real GPU's answers and the
   emulated GPU's can be compared line by line, as tests/cuda_rules.cu does
   for the runtime. The cases follow the cuBLAS documentation, "cublasLtMatmul()"
   (the FP8 requirements: TN on sm_90, CUBLAS_COMPUTE_32F, CUDA_R_32F scale
   type, 16-byte alignment) and "128-element 1D and 128x128 2D Block Scaling
   For FP8 Data Types" (the supported mode pairs, M and N multiples of 4, the
   scale tensors' layouts, 16-byte aligned scales).

   rules:    each case's heuristic count, cublasLtMatmul's status and whether
             D equals the product of the dequantized operands (fp64 on the
             host; with beta 1, plus D's values before the call, C = D) to
             2^-10 of the sum of the products' magnitudes: a wrong
             reading of a scale layout is off by far more. The statuses are
             the rules; D is a reading (the H200's FP8 accumulation comes
             near 2^-10, and a bf16 D's rounding adds to it)
   accuracy: the worst error of fp32 D against that product, in units of the
             sum of |products| (log2), at K 128..8192: the GPU's accumulation
   time:     bf16 against block-scaled FP8 GEMMs at the expert shapes of
             Mixtral-8x7B and DeepSeek-V3 (ms, TFLOP/s)

   usage: lt_rules rules | accuracy | time      (no device: prints "skip") */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef MOEPT_EMU
#include "emu/emu.h"
#endif

enum { VEC = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, BLK = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F };

static double e4m3_value(uint8_t v) { /* OCP FP8 E4M3: bias 7, no infinities, S.1111.111 NaN */
    int s = v >> 7, e = (v >> 3) & 15, m = v & 7;
    double x = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    return s ? -x : x;
}

static double bf16_value(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t rng = 12345;
static uint32_t next(void) { rng = rng * 1664525u + 1013904223u; return rng >> 8; }

/* a case: op(A) m x k, op(B) k x n, D m x n (column-major, as cuBLAS) */
typedef struct lcase {
    const char *name;
    int m, n, k, ta, tb; /* ta/tb: CUBLAS_OP_T or N */
    int amode, bmode;     /* scale modes */
    cudaDataType_t dtype; /* D's (and C's) type */
    int lda_pad, ldb_pad, scale_off; /* extra leading dimension; scale pointer offset in floats */
    float beta;
} lcase;

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

/* scales of an operand whose op() is r x k (r: M for A, N for B), by mode (the documented layouts) */
static size_t scale_count(int mode, int r, int k) {
    int L = ceil_div(k, 128);
    return mode == VEC ? (size_t)r * L : (size_t)((L + 3) / 4 * 4) * ceil_div(r, 128);
}
static float scale_at(const float *s, int mode, int r, int k, int i, int b) {
    int L = ceil_div(k, 128);
    return mode == VEC ? s[i + (size_t)b * r] : s[b + (size_t)(i / 128) * ((L + 3) / 4 * 4)];
}

typedef struct run_out {
    int heur;
    cublasStatus_t hst, st;
    double err; /* worst |D - ref| / sum|products| */
} run_out;

static run_out run_case(cublasLtHandle_t h, const lcase *c, void *ws, size_t wss) {
    run_out o = {0, CUBLAS_STATUS_SUCCESS, CUBLAS_STATUS_SUCCESS, -1};
    double e4m3[256];
    for (int v = 0; v < 256; v++) e4m3[v] = e4m3_value((uint8_t)v);
    int m = c->m, n = c->n, k = c->k;
    /* storage: A is k x m when transposed (lda >= k), else m x k; likewise B */
    int arows = c->ta == CUBLAS_OP_T ? k : m, acols = c->ta == CUBLAS_OP_T ? m : k;
    int brows = c->tb == CUBLAS_OP_T ? n : k, bcols = c->tb == CUBLAS_OP_T ? k : n;
    int lda = arows + c->lda_pad, ldb = brows + c->ldb_pad;
    size_t na = (size_t)lda * acols, nb = (size_t)ldb * bcols, nd = (size_t)m * n;
    size_t nsa = scale_count(c->amode, m, k), nsb = scale_count(c->bmode, n, k);
    uint8_t *ha = (uint8_t *)malloc(na), *hb = (uint8_t *)malloc(nb);
    float *hsa = (float *)malloc(nsa * 4), *hsb = (float *)malloc(nsb * 4);
    for (size_t i = 0; i < na; i++) { uint8_t v = next() & 0xff; ha[i] = (v & 0x7f) == 0x7f ? 0x3f : v; }
    for (size_t i = 0; i < nb; i++) { uint8_t v = next() & 0xff; hb[i] = (v & 0x7f) == 0x7f ? 0x3f : v; }
    for (size_t i = 0; i < nsa; i++) hsa[i] = ldexp(1.0 + (next() % 64) / 64.0, (int)(next() % 9) - 12);
    for (size_t i = 0; i < nsb; i++) hsb[i] = ldexp(1.0 + (next() % 64) / 64.0, (int)(next() % 9) - 12);
    uint8_t *da, *db;
    float *dsa, *dsb;
    void *dd;
    size_t esz = c->dtype == CUDA_R_32F ? 4 : 2;
    cudaMalloc(&da, na); cudaMalloc(&db, nb);
    cudaMalloc(&dsa, nsa * 4 + 64); cudaMalloc(&dsb, nsb * 4 + 64);
    cudaMalloc(&dd, nd * esz);
    cudaMemcpy(da, ha, na, cudaMemcpyHostToDevice);
    cudaMemcpy(db, hb, nb, cudaMemcpyHostToDevice);
    cudaMemcpy(dsa + c->scale_off, hsa, nsa * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dsb + c->scale_off, hsb, nsb * 4, cudaMemcpyHostToDevice);
    /* D = C before the call: zeros, or (beta 1, an fp32 D) values the sum must add in place, larger than
       the products' magnitudes (a C left out is then off by most of the sum), drawn apart from next() */
    float *hc = (float *)calloc(nd, 4);
    if (c->beta != 0.0f && esz == 4)
        for (size_t i = 0; i < nd; i++) hc[i] = (i & 1 ? -1.0f : 1.0f) * (float)(1 + i % 7) * 8192.0f;
    if (esz == 4) cudaMemcpy(dd, hc, nd * 4, cudaMemcpyHostToDevice);
    else cudaMemset(dd, 0, nd * esz);
    cublasLtMatmulDesc_t op;
    cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    int32_t ta = c->ta, tb = c->tb, am = c->amode, bm = c->bmode;
    const float *pa = dsa + c->scale_off, *pb = dsb + c->scale_off;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof pa);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof pb);
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, arows, acols, lda);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, brows, bcols, ldb);
    cublasLtMatrixLayoutCreate(&ld, c->dtype, m, n, m);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    uint64_t w = wss;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, sizeof w);
    cublasLtMatmulHeuristicResult_t res;
    memset(&res, 0, sizeof res);
    o.hst = cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 1, &res, &o.heur);
    float alpha = 1.0f, beta = c->beta;
    o.st = cublasLtMatmul(h, op, &alpha, da, la, db, lb, &beta, dd, ld, dd, ld, o.heur ? &res.algo : NULL, ws,
                          wss, 0);
    cudaError_t ce = cudaDeviceSynchronize();
    if (o.st == CUBLAS_STATUS_SUCCESS && ce == cudaSuccess) {
        char *hd = (char *)malloc(nd * esz);
        cudaMemcpy(hd, dd, nd * esz, cudaMemcpyDeviceToHost);
        o.err = 0;
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                double ref = 0, mag = 0;
                for (int b = 0; b < ceil_div(k, 128); b++) {
                    double s = (double)scale_at(hsa, c->amode, m, k, i, b) *
                               scale_at(hsb, c->bmode, n, k, j, b);
                    for (int l = b * 128; l < k && l < b * 128 + 128; l++) {
                        size_t ai = c->ta == CUBLAS_OP_T ? l + (size_t)i * lda : i + (size_t)l * lda;
                        size_t bi = c->tb == CUBLAS_OP_T ? j + (size_t)l * ldb : l + (size_t)j * ldb;
                        double p = s * e4m3[ha[ai]] * e4m3[hb[bi]];
                        ref += p, mag += fabs(p);
                    }
                }
                size_t at = i + (size_t)j * m;
                ref += (double)c->beta * hc[at];
                mag += fabs((double)c->beta * hc[at]);
                double d = esz == 4 ? ((float *)hd)[at] : bf16_value(((uint16_t *)hd)[at]);
                double e = mag > 0 ? fabs(d - ref) / mag : fabs(d);
                if (e > o.err || e != e) o.err = e != e ? INFINITY : e;
            }
        free(hd);
    }
    cudaGetLastError();
#ifdef MOEPT_EMU
    char buf[256];
    moept_emu_take_reports(buf, sizeof buf); /* a refused call is reported: expected here */
#endif
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(op);
    cudaFree(da); cudaFree(db); cudaFree(dsa); cudaFree(dsb); cudaFree(dd);
    free(ha); free(hb); free(hsa); free(hsb); free(hc);
    return o;
}

static const char *mname(int m) { return m == VEC ? "VEC128" : m == BLK ? "BLK128" : "SCALAR"; }

static void rules(cublasLtHandle_t h, void *ws, size_t wss) {
    const int T = CUBLAS_OP_T, N = CUBLAS_OP_N;
    const cudaDataType_t BF = CUDA_R_16BF, F = CUDA_R_32F;
    const lcase cs[] = {
        /* name                                  m    n    k   ta tb amode bmode D  pads    beta */
        {"forward: W BLK x rows VEC, bf16 D", 256, 64, 384, T, N, BLK, VEC, BF, 0, 0, 0, 0},
        {"forward, fp32 D", 256, 64, 384, T, N, BLK, VEC, F, 0, 0, 0, 0},
        {"wgrad: VEC x VEC, fp32 D", 128, 96, 256, T, N, VEC, VEC, F, 0, 0, 0, 0},
        {"wgrad, fp32 D, beta 1", 128, 96, 256, T, N, VEC, VEC, F, 0, 0, 0, 1},
        {"VEC x BLK", 128, 256, 256, T, N, VEC, BLK, F, 0, 0, 0, 0},
        {"BLK x BLK", 256, 256, 256, T, N, BLK, BLK, F, 0, 0, 0, 0},
        {"NN", 256, 64, 384, N, N, BLK, VEC, F, 0, 0, 0, 0},
        {"NT", 256, 64, 384, N, T, BLK, VEC, F, 0, 0, 0, 0},
        {"TT", 256, 64, 384, T, T, BLK, VEC, F, 0, 0, 0, 0},
        {"k 64 (one partial block)", 256, 64, 64, T, N, BLK, VEC, F, 0, 0, 0, 0},
        {"k 208 (partial second block)", 256, 64, 208, T, N, BLK, VEC, F, 0, 0, 0, 0},
        {"k 200 (not a multiple of 16)", 256, 64, 200, T, N, BLK, VEC, F, 0, 0, 0, 0},
        {"k 520 (L 5: BLK stride 8)", 256, 64, 520 + 8, T, N, BLK, VEC, F, 0, 0, 0, 0},
        {"m 132 (partial row block)", 132, 64, 256, T, N, BLK, VEC, F, 0, 0, 0, 0},
        {"m 130 (not a multiple of 4)", 130, 64, 256, T, N, BLK, VEC, F, 0, 0, 0, 0},
        {"n 60", 256, 60, 256, T, N, BLK, VEC, F, 0, 0, 0, 0},
        {"n 62 (not a multiple of 4)", 256, 62, 256, T, N, BLK, VEC, F, 0, 0, 0, 0},
        {"n 8", 256, 8, 256, T, N, BLK, VEC, F, 0, 0, 0, 0},
        {"n 4", 256, 4, 256, T, N, BLK, VEC, F, 0, 0, 0, 0},
        {"lda k + 16", 256, 64, 256, T, N, BLK, VEC, F, 16, 0, 0, 0},
        {"ldb k + 8 (not 16 bytes)", 256, 64, 256, T, N, BLK, VEC, F, 0, 8, 0, 0},
        {"scales 4 bytes off 16", 256, 64, 256, T, N, BLK, VEC, F, 0, 0, 1, 0},
        {"scales 8 bytes off 16", 256, 64, 256, T, N, BLK, VEC, F, 0, 0, 2, 0},
        {"k 48 (wgrad, few rows)", 512, 128, 48, T, N, VEC, VEC, F, 0, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        const lcase *c = &cs[i];
        run_out o = run_case(h, c, ws, wss);
        const char *v = o.err < 0 ? "-" : o.err <= ldexp(1, -10) ? "product" : "differ";
        printf("%-38s %s %s x %s %s D=%s  heuristic=%d/%d matmul=%d D=%s\n", c->name, c->ta == T ? "T" : "N",
               mname(c->amode), c->tb == T ? "T" : "N", mname(c->bmode), c->dtype == F ? "f32" : "bf16",
               (int)o.hst, o.heur, (int)o.st, v);
    }
}

static void accuracy(cublasLtHandle_t h, void *ws, size_t wss) {
    for (int k = 128; k <= 8192; k *= 4)
        for (int w = 0; w < 2; w++) {
            lcase c = {"", 256, 128, k, CUBLAS_OP_T, CUBLAS_OP_N, w ? VEC : BLK, VEC, CUDA_R_32F, 0, 0, 0, 0};
            run_out o = run_case(h, &c, ws, wss);
            printf("accuracy k %5d %s x VEC128 fp32 D: status %d, worst |D - exact| / sum|products| = %.3g "
                   "(2^%.1f)\n", k, mname(c.amode), (int)o.st, o.err, o.err > 0 ? log2(o.err) : -99.0);
        }
}

/* one GEMM timed: bf16 (no scales) or FP8 with the given modes, D bf16 */
static double time_gemm(cublasLtHandle_t h, int m, int n, int k, int fp8, int amode, int bmode, void *ws,
                        size_t wss) {
    size_t es = fp8 ? 1 : 2;
    void *a, *b, *d;
    float *sa, *sb;
    cudaMalloc(&a, (size_t)m * k * es); cudaMalloc(&b, (size_t)n * k * es); cudaMalloc(&d, (size_t)m * n * 2);
    cudaMemset(a, 0x30, (size_t)m * k * es); cudaMemset(b, 0x31, (size_t)n * k * es);
    size_t nsa = scale_count(amode, m, k), nsb = scale_count(bmode, n, k);
    cudaMalloc(&sa, nsa * 4); cudaMalloc(&sb, nsb * 4);
    cudaMemset(sa, 0, nsa * 4); cudaMemset(sb, 0, nsb * 4);
    cublasLtMatmulDesc_t op;
    cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    int32_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn);
    if (fp8) {
        int32_t am = amode, bm = bmode;
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am);
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm);
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa);
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb);
    }
    cudaDataType_t ty = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatrixLayoutCreate(&la, ty, k, m, k);
    cublasLtMatrixLayoutCreate(&lb, ty, k, n, k);
    cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, m, n, m);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    uint64_t w = wss;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, sizeof w);
    cublasLtMatmulHeuristicResult_t res;
    int nres = 0;
    double ms = -1;
    if (cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 1, &res, &nres) == 0 && nres) {
        float al = 1, be = 0;
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0); cudaEventCreate(&e1);
        int ok = 1;
        for (int r = 0; r < 23 && ok; r++) {
            if (r == 3) cudaEventRecord(e0, 0);
            ok = cublasLtMatmul(h, op, &al, a, la, b, lb, &be, d, ld, d, ld, &res.algo, ws, wss, 0) == 0;
        }
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        float t_ms = 0;
        cudaEventElapsedTime(&t_ms, e0, e1);
        if (ok) ms = t_ms / 20;
        cudaEventDestroy(e0); cudaEventDestroy(e1);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(op);
    cudaFree(a); cudaFree(b); cudaFree(d); cudaFree(sa); cudaFree(sb);
    return ms;
}

static void timing(cublasLtHandle_t h, void *ws, size_t wss) {
    /* per expert: forward gate+up (2F x R x D), down and dgrad (D x R x F), wgrad (D x F x R) */
    const struct { const char *name; int m, n, k, am, bm; } s[] = {
        {"Mixtral gate_up fwd 2F x R x D", 28672, 2048, 4096, BLK, VEC},
        {"Mixtral down fwd D x R x F", 4096, 2048, 14336, BLK, VEC},
        {"Mixtral wgrad D x F x R", 4096, 14336, 2048, VEC, VEC},
        {"DeepSeek gate_up fwd 2F x R x D", 4096, 4096, 7168, BLK, VEC},
        {"DeepSeek down fwd D x R x F", 7168, 4096, 2048, BLK, VEC},
        {"DeepSeek wgrad D x F x R", 7168, 2048, 4096, VEC, VEC},
    };
    for (size_t i = 0; i < sizeof s / sizeof s[0]; i++) {
        double tb = time_gemm(h, s[i].m, s[i].n, s[i].k, 0, 0, 0, ws, wss);
        double tf = time_gemm(h, s[i].m, s[i].n, s[i].k, 1, s[i].am, s[i].bm, ws, wss);
        double fl = 2.0 * s[i].m * s[i].n * s[i].k;
        printf("time %-34s m %5d n %5d k %5d: bf16 %.3f ms (%.0f TFLOP/s), "
               "fp8 %s x %s %.3f ms (%.0f TFLOP/s), bf16/fp8 %.2f\n", s[i].name, s[i].m, s[i].n, s[i].k, tb,
               fl / tb / 1e9, mname(s[i].am), mname(s[i].bm), tf, fl / tf / 1e9, tb / tf);
    }
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "rules";
    int nd = 0;
    if (cudaGetDeviceCount(&nd) != cudaSuccess || nd == 0) {
        printf("skip - no device\n");
        return 0;
    }
    cublasLtHandle_t h;
    if (cublasLtCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "lt_rules: cublasLtCreate failed\n");
        return 1;
    }
    size_t wss = 32u << 20;
    void *ws;
    cudaMalloc(&ws, wss);
    if (!strcmp(mode, "rules")) rules(h, ws, wss);
    else if (!strcmp(mode, "accuracy")) accuracy(h, ws, wss);
    else if (!strcmp(mode, "time")) timing(h, ws, wss);
    else {
        fprintf(stderr, "usage: lt_rules rules | accuracy | time\n");
        return 2;
    }
    cudaFree(ws);
    cublasLtDestroy(h);
    return 0;
}
