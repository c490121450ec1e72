/* emu_blas.cc - the emulated cuBLAS: what moept_kernels.cu calls, written
   from NVIDIA's cuBLAS documentation (cublasGemmEx, cublasGemmGroupedBatchedEx,
   cublas<t>scal, the handle and stream functions), not from moept's
   descriptors.

   Matrices are column-major; op(X) is X or X^T; C = alpha op(A) op(B) +
   beta C, with C not read when beta == 0 ("C need not be a valid input").
   The product sums in fp32 (CUBLAS_COMPUTE_32F), k in order; a bf16 result
   is rounded to nearest even. Arguments are validated where the
   documentation says CUBLAS_STATUS_INVALID_VALUE or NOT_SUPPORTED; the
   grouped call's parameter arrays must be host memory and its pointer
   arrays device memory (the other side is reported and rejected). Each call
   is an op on the handle's stream; every matrix is a checked device range. */
#include "emu_internal.h"

#include <cstdio>
#include <cstring>

namespace emu {

struct Blas {
    int dev;
    cudaStream_t stream = nullptr;
    cublasMath_t math = CUBLAS_DEFAULT_MATH;
    cublasPointerMode_t pmode = CUBLAS_POINTER_MODE_HOST;
};

static float ld_elem(const void *p, cudaDataType_t t, int64_t i) {
    if (t == CUDA_R_32F) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static void st_elem(void *p, cudaDataType_t t, int64_t i, float v) {
    if (t == CUDA_R_32F) { ((float *)p)[i] = v; return; }
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) ((uint16_t *)p)[i] = (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    else ((uint16_t *)p)[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static size_t esize(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

/* one product, as the documentation defines it */
struct Gemm {
    cublasOperation_t ta, tb;
    int64_t m, n, k, lda, ldb, ldc;
    float alpha, beta;
    const void *A, *B;
    void *C;
    cudaDataType_t at, bt, ct;
};

/* elements a column-major operand spans: rows r, cols c, leading dim ld */
static int64_t span(int64_t r, int64_t c, int64_t ld) { return r == 0 || c == 0 ? 0 : ld * (c - 1) + r; }

static void gemm_run(const Gemm &g) {
    int64_t ar = g.ta == CUBLAS_OP_N ? g.m : g.k, ac = g.ta == CUBLAS_OP_N ? g.k : g.m;
    int64_t br = g.tb == CUBLAS_OP_N ? g.k : g.n, bc = g.tb == CUBLAS_OP_N ? g.n : g.k;
    if (g.m == 0 || g.n == 0) return;
    int ok = 1;
    if (g.k > 0 && g.alpha != 0.0f) {
        ok &= touch(g.A, (size_t)span(ar, ac, g.lda) * esize(g.at), 0, "cuBLAS read of A");
        ok &= touch(g.B, (size_t)span(br, bc, g.ldb) * esize(g.bt), 0, "cuBLAS read of B");
    }
    if (g.beta != 0.0f) ok &= touch(g.C, (size_t)span(g.m, g.n, g.ldc) * esize(g.ct), 0, "cuBLAS read of C");
    ok &= touch(g.C, (size_t)span(g.m, g.n, g.ldc) * esize(g.ct), 1, "cuBLAS write of C");
    if (!ok) return;
    for (int64_t j = 0; j < g.n; j++)
        for (int64_t i = 0; i < g.m; i++) {
            float acc = 0.0f;
            if (g.alpha != 0.0f)
                for (int64_t l = 0; l < g.k; l++) {
                    float a = ld_elem(g.A, g.at, g.ta == CUBLAS_OP_N ? i + l * g.lda : l + i * g.lda);
                    float b = ld_elem(g.B, g.bt, g.tb == CUBLAS_OP_N ? l + j * g.ldb : j + l * g.ldb);
                    acc += a * b;
                }
            float v = g.alpha * acc;
            if (g.beta != 0.0f) v += g.beta * ld_elem(g.C, g.ct, i + j * g.ldc);
            st_elem(g.C, g.ct, i + j * g.ldc, v);
        }
}

static bool bad_op(cublasOperation_t t) { return t != CUBLAS_OP_N && t != CUBLAS_OP_T && t != CUBLAS_OP_C; }

/* the documented INVALID_VALUE conditions on sizes and leading dimensions */
static bool bad_dims(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, int64_t lda,
                     int64_t ldb, int64_t ldc) {
    auto mx = [](int64_t a) { return a > 1 ? a : 1; };
    if (m < 0 || n < 0 || k < 0 || bad_op(ta) || bad_op(tb)) return true;
    if (lda < (ta == CUBLAS_OP_N ? mx(m) : mx(k))) return true;
    if (ldb < (tb == CUBLAS_OP_N ? mx(k) : mx(n))) return true;
    return ldc < mx(m);
}

static bool is_device(const void *p) {
    int d;
    find(p, &d);
    return d >= 0;
}

/* cuBLAS Library, cublasStatus_t and each function's return table: a call
   that cannot run its kernel is CUBLAS_STATUS_EXECUTION_FAILED ("the
   function failed to launch on the GPU"); on a lost context (emu_rt.cc,
   lose) every call that queues work is */
static bool ctx_lost(const Blas *b) { return sticky(b->dev) != cudaSuccess; }

static cublasStatus_t invalid(const char *call, const char *why) {
    report("cublas", "%s: %s (CUBLAS_STATUS_INVALID_VALUE)", call, why);
    return CUBLAS_STATUS_INVALID_VALUE;
}

}  // namespace emu

using namespace emu;

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t *h) {
    if (!h) return CUBLAS_STATUS_INVALID_VALUE;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        cudaGetLastError();
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    if (sticky(cur_dev)) return CUBLAS_STATUS_NOT_INITIALIZED; /* cublasCreate: the CUDA Runtime failed */
    Blas *b = new Blas();
    b->dev = cur_dev;
    *h = (cublasHandle_t)b;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    Blas *b = (Blas *)h;
    cudaStreamSynchronize(b->stream); /* cublasDestroy synchronises (documented: it implicitly calls cudaDeviceSynchronize) */
    delete b;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    ((Blas *)h)->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream_v2(cublasHandle_t h, cudaStream_t *s) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!s) return CUBLAS_STATUS_INVALID_VALUE;
    *s = ((Blas *)h)->stream;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    ((Blas *)h)->math = m;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t h, cublasPointerMode_t m) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    ((Blas *)h)->pmode = m;
    return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    default: return "CUBLAS_STATUS_UNKNOWN (emulated)";
    }
}

/* the types cublasGemmEx (and its batched forms) take here, fp32 compute:
   32F x 32F -> 32F, 16BF x 16BF -> 16BF or 32F */
static bool gemm_ex_types(cudaDataType at, cudaDataType bt, cudaDataType ct, cublasComputeType_t comp) {
    return comp == CUBLAS_COMPUTE_32F && at == bt &&
           ((at == CUDA_R_32F && ct == CUDA_R_32F) || (at == CUDA_R_16BF && (ct == CUDA_R_16BF || ct == CUDA_R_32F)));
}

cublasStatus_t cublasGemmEx_64(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n,
                               int64_t k, const void *alpha, const void *A, cudaDataType at, int64_t lda, const void *B,
                               cudaDataType bt, int64_t ldb, const void *beta, void *C, cudaDataType ct, int64_t ldc,
                               cublasComputeType_t comp, cublasGemmAlgo_t algo) {
    (void)algo;
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    Blas *b = (Blas *)h;
    if (ctx_lost(b)) return CUBLAS_STATUS_EXECUTION_FAILED;
    if (bad_dims(ta, tb, m, n, k, lda, ldb, ldc)) return invalid("cublasGemmEx", "sizes, transposes or leading dimensions");
    if (!alpha || !beta) return invalid("cublasGemmEx", "alpha or beta is NULL");
    if (!gemm_ex_types(at, bt, ct, comp)) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (b->pmode != CUBLAS_POINTER_MODE_HOST) return CUBLAS_STATUS_NOT_SUPPORTED; /* not emulated */
    if (is_device(alpha) || is_device(beta)) return invalid("cublasGemmEx", "host pointer mode, but alpha or beta is device memory");
    Gemm g = {ta, tb, m, n, k, lda, ldb, ldc, *(const float *)alpha, *(const float *)beta, A, B, C, at, bt, ct};
    Stream *s = stream_of(b->stream);
    if (s->dev != b->dev) return invalid("cublasGemmEx", "the handle's stream belongs to another device");
    char nm[96];
    snprintf(nm, sizeof nm, "cublasGemmEx_64 (m %lld n %lld k %lld)", (long long)m, (long long)n, (long long)k);
    enqueue(s, nm, [g](Op &) { gemm_run(g); });
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmStridedBatchedEx_64(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                                             int64_t n, int64_t k, const void *alpha, const void *A, cudaDataType at,
                                             int64_t lda, long long sa, const void *B, cudaDataType bt, int64_t ldb,
                                             long long sb, const void *beta, void *C, cudaDataType ct, int64_t ldc,
                                             long long sc, int64_t batch, cublasComputeType_t comp,
                                             cublasGemmAlgo_t algo) {
    const char *call = "cublasGemmStridedBatchedEx";
    (void)algo;
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    Blas *b = (Blas *)h;
    if (ctx_lost(b)) return CUBLAS_STATUS_EXECUTION_FAILED;
    if (batch < 0) return invalid(call, "batchCount < 0");
    if (bad_dims(ta, tb, m, n, k, lda, ldb, ldc)) return invalid(call, "sizes, transposes or leading dimensions");
    if (!alpha || !beta) return invalid(call, "alpha or beta is NULL");
    if (!gemm_ex_types(at, bt, ct, comp)) return CUBLAS_STATUS_NOT_SUPPORTED; /* its batched forms' too */
    if (b->pmode != CUBLAS_POINTER_MODE_HOST) return CUBLAS_STATUS_NOT_SUPPORTED; /* not emulated */
    if (is_device(alpha) || is_device(beta)) return invalid(call, "host pointer mode, but alpha or beta is device memory");
    Stream *s = stream_of(b->stream);
    if (s->dev != b->dev) return invalid(call, "the handle's stream belongs to another device");
    const size_t ea = at == CUDA_R_16BF ? 2 : 4, ec = ct == CUDA_R_16BF ? 2 : 4;
    Gemm g = {ta, tb, m, n, k, lda, ldb, ldc, *(const float *)alpha, *(const float *)beta, A, B, C, at, bt, ct};
    char nm[112];
    snprintf(nm, sizeof nm, "cublasGemmStridedBatchedEx_64 (%lld x m %lld n %lld k %lld)", (long long)batch,
             (long long)m, (long long)n, (long long)k);
    enqueue(s, nm, [g, sa, sb, sc, batch, ea, ec](Op &) {
        for (int64_t i = 0; i < batch; i++) {
            Gemm gi = g;
            gi.A = (const char *)g.A + (ptrdiff_t)(i * sa) * (ptrdiff_t)ea;
            gi.B = (const char *)g.B + (ptrdiff_t)(i * sb) * (ptrdiff_t)ea;
            gi.C = (char *)g.C + (ptrdiff_t)(i * sc) * (ptrdiff_t)ec;
            gemm_run(gi);
        }
    });
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmGroupedBatchedEx_64(cublasHandle_t h, const cublasOperation_t ta[], const cublasOperation_t tb[],
                                             const int64_t m[], const int64_t n[], const int64_t k[], const void *alpha,
                                             const void *const A[], cudaDataType_t at, const int64_t lda[],
                                             const void *const B[], cudaDataType_t bt, const int64_t ldb[],
                                             const void *beta, void *const C[], cudaDataType_t ct, const int64_t ldc[],
                                             int64_t groups, const int64_t gsize[], cublasComputeType_t comp) {
    const char *call = "cublasGemmGroupedBatchedEx";
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    Blas *b = (Blas *)h;
    if (ctx_lost(b)) return CUBLAS_STATUS_EXECUTION_FAILED;
    if (groups < 0) return invalid(call, "group_count < 0");
    if (!ta || !tb || !m || !n || !k || !alpha || !A || !lda || !B || !ldb || !beta || !C || !ldc || !gsize)
        return invalid(call, "an array is NULL");
    const void *host[] = {ta, tb, m, n, k, alpha, lda, ldb, beta, ldc, gsize};
    for (const void *p : host)
        if (is_device(p)) return invalid(call, "a parameter array (transa .. group_size) is device memory; they are host arrays");
    if (!is_device(A) || !is_device(B) || !is_device(C)) return invalid(call, "Aarray, Barray and Carray must be device memory");
    if (b->pmode != CUBLAS_POINTER_MODE_HOST) return CUBLAS_STATUS_NOT_SUPPORTED;
    bool types = comp == CUBLAS_COMPUTE_32F && at == bt && at == ct && (at == CUDA_R_32F || at == CUDA_R_16BF);
    if (!types) return CUBLAS_STATUS_NOT_SUPPORTED;
    auto gs = std::make_shared<std::vector<Gemm>>();
    int64_t total = 0;
    for (int64_t i = 0; i < groups; i++) {
        if (gsize[i] < 0) return invalid(call, "group_size < 0");
        if (bad_dims(ta[i], tb[i], m[i], n[i], k[i], lda[i], ldb[i], ldc[i]))
            return invalid(call, "sizes, transposes or leading dimensions of a group");
        for (int64_t j = 0; j < gsize[i]; j++)
            gs->push_back({ta[i], tb[i], m[i], n[i], k[i], lda[i], ldb[i], ldc[i], ((const float *)alpha)[i],
                           ((const float *)beta)[i], nullptr, nullptr, nullptr, at, bt, ct});
        total += gsize[i];
    }
    Stream *s = stream_of(b->stream);
    if (s->dev != b->dev) return invalid(call, "the handle's stream belongs to another device");
    char nm[96];
    snprintf(nm, sizeof nm, "cublasGemmGroupedBatchedEx_64 (%lld problems)", (long long)total);
    /* the pointer arrays are device memory: read when the op runs */
    enqueue(s, nm, [gs, A, B, C, total](Op &) {
        size_t pb = (size_t)total * sizeof(void *);
        if (!(touch(A, pb, 0, "cuBLAS read of Aarray") & touch(B, pb, 0, "cuBLAS read of Barray") &
              touch(C, pb, 0, "cuBLAS read of Carray")))
            return;
        for (int64_t i = 0; i < total; i++) {
            Gemm g = (*gs)[(size_t)i];
            g.A = A[i]; g.B = B[i]; g.C = C[i];
            gemm_run(g);
        }
    });
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSscal_v2_64(cublasHandle_t h, int64_t n, const float *alpha, float *x, int64_t incx) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    Blas *b = (Blas *)h;
    if (ctx_lost(b)) return CUBLAS_STATUS_EXECUTION_FAILED;
    if (!alpha || !x) return invalid("cublasSscal", "alpha or x is NULL");
    if (n <= 0 || incx <= 0) return CUBLAS_STATUS_SUCCESS; /* the reference BLAS returns at once */
    if (b->pmode != CUBLAS_POINTER_MODE_HOST) return CUBLAS_STATUS_NOT_SUPPORTED;
    float a = *alpha;
    enqueue(stream_of(b->stream), "cublasSscal_64", [a, x, n, incx](Op &) {
        if (!touch(x, (size_t)((n - 1) * incx + 1) * 4, 1, "cuBLAS read/write of x")) return;
        for (int64_t i = 0; i < n; i++) x[i * incx] *= a;
    });
    return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
