/* emu_lt.cc - the emulated cuBLASLt: block-scaled FP8 matmuls (E4M3
   operands, fp32 scales per 1 x 128 or 128 x 128 tile), written from
   NVIDIA's cuBLAS documentation, section 3 "Using the cuBLASLt API":
   "cublasLtMatmul()" (its FP8 requirements), 3.1.4 "Narrow Precision Data
   Types Usage" with 3.1.4.5 "128-element 1D and 128x128 2D Block Scaling
   For FP8 Data Types" (the definition, the supported mode pairs, the scale
   tensors' layouts) and the descriptors' attribute tables; and from what an
   H200 answered (tests/lt_rules.cu, tests/lt_rules.txt: the emulator must
   print the same statuses).

   What it emulates: D = alpha * sum over K blocks of 128 of
   scaleA(i, b) scaleB(j, b) sum_{l in b} A(i, l) B(l, j) + beta * C, each
   block's sum in fp32 in k order, for the two modes and TN layout Hopper
   runs; C and D bf16 or fp32 (alike). Whatever else the documentation
   allows (tensor-wide scaling, E5M2, fp16, epilogues, batches) is answered
   CUBLAS_STATUS_NOT_SUPPORTED with a report "documented but not emulated";
   what it forbids, CUBLAS_STATUS_NOT_SUPPORTED (or INVALID_VALUE where the
   documentation says so) with a report, as in emu_blas.cc: a caller that
   follows the documentation never sees one. The heuristic checks the
   problem; the matmul checks it again and the pointers (the H200 passed
   misaligned scale pointers at the heuristic and refused them at the
   matmul). Each matmul is an op on its stream over checked device ranges. */
#include "emu_internal.h"

#include <cublasLt.h>

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace emu {

struct LtHandle {
    int dev;
};
struct LtDesc {
    cublasComputeType_t comp;
    cudaDataType_t scale;
    int32_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
    int32_t amode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, bmode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    const float *ascale = nullptr, *bscale = nullptr;
    bool other = false; /* an attribute the emulator does not run was set */
    char other_name[48] = "";
};
struct LtLayout {
    cudaDataType_t type;
    uint64_t rows, cols;
    int64_t ld;
    bool other = false;
};
struct LtPref {
    uint64_t ws = 0;
};
constexpr uint64_t ALGO_MAGIC = 0x6d6f6570744c7431ull; /* the one algo the heuristic returns */

static const int VEC = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
                 BLK = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;

static cublasStatus_t refuse(const char *call, cublasStatus_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static cublasStatus_t refuse(const char *call, cublasStatus_t st, const char *fmt, ...) {
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    report("cublasLt", "%s: %s (%s)", call, why,
           st == CUBLAS_STATUS_NOT_SUPPORTED ? "CUBLAS_STATUS_NOT_SUPPORTED" : "CUBLAS_STATUS_INVALID_VALUE");
    return st;
}

static size_t esz(cudaDataType_t t) {
    return t == CUDA_R_32F ? 4 : t == CUDA_R_16BF || t == CUDA_R_16F ? 2 : 1;
}
static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
/* floats of a scale tensor for an operand whose op() is r x k ("Scaling factors layouts") */
static int64_t scale_floats(int mode, int64_t r, int64_t k) {
    int64_t L = ceil_div(k, 128);
    return mode == VEC ? r * L : (L + 3) / 4 * 4 * ceil_div(r, 128);
}

struct Problem {
    int64_t m, n, k;
};

/* The documented conditions of a block-scaled FP8 matmul, heuristic and matmul alike; SUCCESS and the
   problem's sizes, or the answer (with its report) */
static cublasStatus_t check(const char *call, const LtDesc *d, const LtLayout *a, const LtLayout *b,
                            const LtLayout *c, const LtLayout *dd, Problem *p) {
    const cublasStatus_t NS = CUBLAS_STATUS_NOT_SUPPORTED;
    if (d->other)
        return refuse(call, NS, "the descriptor's %s is documented but not emulated", d->other_name);
    if (a->other || b->other || c->other || dd->other)
        return refuse(call, NS, "a layout's order or batch is documented but not emulated");
    /* "cublasLtMatmul()": FP8 kernels need CUBLAS_COMPUTE_32F and scale type CUDA_R_32F */
    if (d->comp != CUBLAS_COMPUTE_32F || d->scale != CUDA_R_32F)
        return refuse(call, NS, "FP8 needs computeType CUBLAS_COMPUTE_32F and scaleType CUDA_R_32F");
    if (a->type == CUDA_R_8F_E5M2 || b->type == CUDA_R_8F_E5M2)
        return refuse(call, NS, "E5M2 operands are documented but not emulated");
    if (a->type != CUDA_R_8F_E4M3 || b->type != CUDA_R_8F_E4M3)
        return refuse(call, NS,
                      "only E4M3 operands are emulated (fp32 and bf16 matmuls go through cublasGemmEx)");
    /* 3.1.4.5: A and B each VEC128 or BLK128x128, not both BLK128x128; tensor-wide scaling (the default
       mode) and the others are documented for other cases, not emulated here */
    if ((d->amode != VEC && d->amode != BLK) || (d->bmode != VEC && d->bmode != BLK))
        return refuse(call, NS, "scale modes other than VEC128_32F and BLK128x128_32F are not emulated");
    if (d->amode == BLK && d->bmode == BLK)
        return refuse(call, NS, "BLK128x128_32F on both A and B is not a supported combination");
    /* "cublasLtMatmul()": "TN" (A transposed, B not) on compute capability 9.0 */
    if (d->ta != CUBLAS_OP_T || d->tb != CUBLAS_OP_N)
        return refuse(call, NS, "FP8 on sm_90 takes A transposed and B not (TN)");
    /* 3.1.4.5: D bf16, fp16 or fp32 (no FP8 D with these modes); the FP8 table: C's type is D's */
    if (dd->type == CUDA_R_16F) return refuse(call, NS, "an fp16 D is documented but not emulated");
    if (dd->type != CUDA_R_16BF && dd->type != CUDA_R_32F)
        return refuse(call, NS, "D must be CUDA_R_16BF, CUDA_R_16F or CUDA_R_32F with block scaling");
    if (c->type != dd->type) return refuse(call, NS, "C's type must be D's");
    p->k = (int64_t)a->rows, p->m = (int64_t)a->cols, p->n = (int64_t)b->cols;
    if ((int64_t)b->rows != p->k || (int64_t)dd->rows != p->m || (int64_t)dd->cols != p->n ||
        c->rows != dd->rows || c->cols != dd->cols)
        return refuse(call, CUBLAS_STATUS_INVALID_VALUE, "the layouts' sizes do not agree");
    if (a->ld < p->k || b->ld < p->k || dd->ld < p->m || c->ld < p->m)
        return refuse(call, CUBLAS_STATUS_INVALID_VALUE, "a leading dimension under its rows");
    /* 3.1.4.5.1: M and N multiples of 4; "cublasLtMatmul()": every dimension 16-byte aligned */
    if (p->m % 4 || p->n % 4)
        return refuse(call, NS, "M and N must be multiples of 4 (M %lld, N %lld)", (long long)p->m,
                      (long long)p->n);
    if (p->k % 16 || a->ld % 16 || b->ld % 16)
        return refuse(call, NS, "K and the leading dimensions of A and B must be 16-byte multiples");
    if ((dd->ld * (int64_t)esz(dd->type)) % 16 || (c->ld * (int64_t)esz(c->type)) % 16)
        return refuse(call, NS, "the leading dimensions of C and D must be 16-byte multiples");
    return CUBLAS_STATUS_SUCCESS;
}

struct Run {
    Problem p;
    int amode, bmode;
    float alpha, beta;
    const uint8_t *A, *B;
    const float *sa, *sb;
    const void *C;
    void *D;
    int64_t lda, ldb, ldc, ldd;
    cudaDataType_t ct, dt;
};

static float scale_of(const float *s, int mode, int64_t r, int64_t k, int64_t i, int64_t b) {
    int64_t L = ceil_div(k, 128);
    return mode == VEC ? s[i + b * r] : s[b + (i / 128) * ((L + 3) / 4 * 4)];
}

static void run(const Run &g) {
    const Problem &p = g.p;
    if (p.m == 0 || p.n == 0) return;
    int ok = 1;
    if (p.k > 0) {
        ok &= touch(g.A, (size_t)(g.lda * (p.m - 1) + p.k), 0, "cuBLASLt read of A");
        ok &= touch(g.B, (size_t)(g.ldb * (p.n - 1) + p.k), 0, "cuBLASLt read of B");
        ok &= touch(g.sa, (size_t)scale_floats(g.amode, p.m, p.k) * 4, 0, "cuBLASLt read of A's scales");
        ok &= touch(g.sb, (size_t)scale_floats(g.bmode, p.n, p.k) * 4, 0, "cuBLASLt read of B's scales");
    }
    size_t cb = (size_t)(g.ldd * (p.n - 1) + p.m) * esz(g.dt);
    if (g.beta != 0.0f)
        ok &= touch(g.C, (size_t)(g.ldc * (p.n - 1) + p.m) * esz(g.ct), 0, "cuBLASLt read of C");
    ok &= touch(g.D, cb, 1, "cuBLASLt write of D");
    if (!ok) return;
    for (int64_t j = 0; j < p.n; j++)
        for (int64_t i = 0; i < p.m; i++) {
            float acc = 0.0f;
            for (int64_t b = 0; b * 128 < p.k; b++) {
                float part = 0.0f; /* the block's products, in fp32, k in order */
                for (int64_t l = b * 128; l < p.k && l < b * 128 + 128; l++)
                    part += e4m3_value(g.A[l + i * g.lda]) * e4m3_value(g.B[l + j * g.ldb]);
                acc +=
                    scale_of(g.sa, g.amode, p.m, p.k, i, b) * scale_of(g.sb, g.bmode, p.n, p.k, j, b) * part;
            }
            float v = g.alpha * acc;
            if (g.beta != 0.0f) v += g.beta * ld_elem(g.C, g.ct, i + j * g.ldc);
            st_elem(g.D, g.dt, i + j * g.ldd, v);
        }
}

} // namespace emu

using namespace emu;

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
    if (!h) return CUBLAS_STATUS_INVALID_VALUE;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        cudaGetLastError();
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    LtHandle *l = new LtHandle();
    l->dev = cur_dev;
    *h = (cublasLtHandle_t)l;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete (LtHandle *)h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t comp,
                                        cudaDataType_t scale) {
    if (!d) return CUBLAS_STATUS_INVALID_VALUE;
    LtDesc *x = new LtDesc();
    x->comp = comp, x->scale = scale;
    *d = (cublasLtMatmulDesc_t)x;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
    delete (LtDesc *)d;
    return CUBLAS_STATUS_SUCCESS;
}

/* "cublasLtMatmulDescAttributes_t": the attribute's documented type and size, else INVALID_VALUE */
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t n) {
    LtDesc *x = (LtDesc *)d;
    if (!x || !buf) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB:
    case CUBLASLT_MATMUL_DESC_A_SCALE_MODE:
    case CUBLASLT_MATMUL_DESC_B_SCALE_MODE: {
        if (n != sizeof(int32_t))
            return refuse("cublasLtMatmulDescSetAttribute", CUBLAS_STATUS_INVALID_VALUE,
                          "an int32_t attribute given %zu bytes", n);
        int32_t v;
        memcpy(&v, buf, 4);
        int32_t *f = attr == CUBLASLT_MATMUL_DESC_TRANSA         ? &x->ta
                     : attr == CUBLASLT_MATMUL_DESC_TRANSB       ? &x->tb
                     : attr == CUBLASLT_MATMUL_DESC_A_SCALE_MODE ? &x->amode
                                                                 : &x->bmode;
        *f = v;
        return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER: {
        if (n != sizeof(void *))
            return refuse("cublasLtMatmulDescSetAttribute", CUBLAS_STATUS_INVALID_VALUE,
                          "a pointer attribute given %zu bytes", n);
        const float *p;
        memcpy(&p, buf, sizeof p);
        (attr == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER ? x->ascale : x->bscale) = p;
        return CUBLAS_STATUS_SUCCESS;
    }
    default:
        x->other = true;
        snprintf(x->other_name, sizeof x->other_name, "attribute %d", (int)attr);
        return CUBLAS_STATUS_SUCCESS;
    }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType t, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
    if (!l) return CUBLAS_STATUS_INVALID_VALUE;
    LtLayout *x = new LtLayout();
    x->type = t, x->rows = rows, x->cols = cols, x->ld = ld;
    *l = (cublasLtMatrixLayout_t)x;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
    delete (LtLayout *)l;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                cublasLtMatrixLayoutAttribute_t attr, const void *buf,
                                                size_t n) {
    if (!l || !buf || !n) return CUBLAS_STATUS_INVALID_VALUE;
    (void)attr;
    ((LtLayout *)l)->other = true; /* order, batches: not emulated (the matmul says so) */
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
    if (!p) return CUBLAS_STATUS_INVALID_VALUE;
    *p = (cublasLtMatmulPreference_t) new LtPref();
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
    delete (LtPref *)p;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void *buf, size_t n) {
    if (!p || !buf) return CUBLAS_STATUS_INVALID_VALUE;
    if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES && n == sizeof(uint64_t))
        memcpy(&((LtPref *)p)->ws, buf, 8);
    return CUBLAS_STATUS_SUCCESS; /* the others are hints to the search */
}

/* one algo, needing no workspace, where check() passes; else its answer and no results */
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t op,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t res[], int *count) {
    const char *call = "cublasLtMatmulAlgoGetHeuristic";
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!op || !a || !b || !c || !d || !pref || requested < 1 || !res || !count)
        return refuse(call, CUBLAS_STATUS_INVALID_VALUE, "a NULL argument or requestedAlgoCount < 1");
    *count = 0;
    Problem p;
    cublasStatus_t st =
        check(call, (LtDesc *)op, (LtLayout *)a, (LtLayout *)b, (LtLayout *)c, (LtLayout *)d, &p);
    if (st) return st;
    memset(&res[0], 0, sizeof res[0]);
    res[0].algo.data[0] = ALGO_MAGIC;
    res[0].workspaceSize = 0;
    res[0].state = CUBLAS_STATUS_SUCCESS;
    res[0].wavesCount = 1.0f;
    *count = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t ad, const void *B, cublasLtMatrixLayout_t bd,
                              const void *beta, const void *C, cublasLtMatrixLayout_t cd, void *D,
                              cublasLtMatrixLayout_t dd, const cublasLtMatmulAlgo_t *algo, void *ws,
                              size_t wsb, cudaStream_t stream) {
    const char *call = "cublasLtMatmul";
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    LtHandle *lh = (LtHandle *)h;
    if (sticky(lh->dev) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
    if (!op || !alpha || !beta || !ad || !bd || !cd || !dd)
        return refuse(call, CUBLAS_STATUS_INVALID_VALUE, "a NULL descriptor, alpha or beta");
    const LtDesc *x = (const LtDesc *)op;
    Problem p;
    cublasStatus_t st = check(call, x, (LtLayout *)ad, (LtLayout *)bd, (LtLayout *)cd, (LtLayout *)dd, &p);
    if (st) return st;
    if (algo && algo->data[0] != ALGO_MAGIC)
        return refuse(call, CUBLAS_STATUS_INVALID_VALUE, "an algo no heuristic of this handle returned");
    /* "cublasLtMatmul()": the workspace 256-byte aligned; 3.1.4.5.1: scales 16-byte aligned (the H200
       refused a misaligned one with NOT_SUPPORTED); "Tensor Core Usage": 16-byte aligned matrices */
    if ((uintptr_t)ws % 256)
        return refuse(call, CUBLAS_STATUS_INVALID_VALUE, "the workspace is not 256-byte aligned");
    if (!x->ascale || !x->bscale)
        return refuse(call, CUBLAS_STATUS_INVALID_VALUE, "a block mode without its scales");
    if ((uintptr_t)x->ascale % 16 || (uintptr_t)x->bscale % 16)
        return refuse(call, CUBLAS_STATUS_NOT_SUPPORTED, "scale pointers must be 16-byte aligned");
    if ((uintptr_t)A % 16 || (uintptr_t)B % 16 || (uintptr_t)C % 16 || (uintptr_t)D % 16)
        return refuse(call, CUBLAS_STATUS_NOT_SUPPORTED, "A, B, C and D must be 16-byte aligned");
    int dev_of;
    find(alpha, &dev_of);
    if (dev_of >= 0) {
        report("cublasLt", "%s: device alpha or beta (CUBLASLT_POINTER_MODE_DEVICE) is not emulated", call);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    Stream *s = stream_of(stream);
    if (s->dev != lh->dev)
        return refuse(call, CUBLAS_STATUS_INVALID_VALUE, "the stream belongs to another device");
    const LtLayout *a = (const LtLayout *)ad, *b = (const LtLayout *)bd, *c = (const LtLayout *)cd,
                   *d = (const LtLayout *)dd;
    Run g = {p,
             x->amode,
             x->bmode,
             *(const float *)alpha,
             *(const float *)beta,
             (const uint8_t *)A,
             (const uint8_t *)B,
             x->ascale,
             x->bscale,
             C,
             D,
             a->ld,
             b->ld,
             c->ld,
             d->ld,
             c->type,
             d->type};
    (void)wsb;
    char nm[96];
    snprintf(nm, sizeof nm, "cublasLtMatmul (m %lld n %lld k %lld)", (long long)p.m, (long long)p.n,
             (long long)p.k);
    enqueue(s, nm, [g](Op &) { run(g); });
    return CUBLAS_STATUS_SUCCESS;
}

} // extern "C"
