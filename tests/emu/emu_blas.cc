/* emu_blas.cc - the emulated cuBLAS: what moept_kernels.cu calls, written
   from NVIDIA's cuBLAS documentation (cublasGemmEx,
   cublasGemmStridedBatchedEx, cublasGemmGroupedBatchedEx, cublas<t>scal,
   the handle, stream, math mode and workspace functions), not from moept's
   descriptors.

   Matrices are column-major; op(X) is X or X^T; C = alpha op(A) op(B) +
   beta C, with C not read when beta == 0 ("C need not be a valid input").
   The product sums in fp32 (CUBLAS_COMPUTE_32F), k in order; a bf16 result
   is rounded to nearest even. Where the math mode allows reductions in the
   output type, a test can ask for them (moept_emu_blas_reduced_reduction).
   Arguments are validated where the documentation says
   CUBLAS_STATUS_INVALID_VALUE, NOT_SUPPORTED or ALLOC_FAILED, and each such
   answer is reported too: a caller that follows the documentation never
   gets one, and one that probes for a status is told so. Each call is an op
   on the handle's stream; every matrix and the workspace are checked
   device ranges; the batched forms' pointers must meet the documented
   alignment. */
#include "emu_internal.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

namespace emu {

struct Blas {
    int dev;
    cudaStream_t stream = nullptr;
    cublasMath_t math = CUBLAS_DEFAULT_MATH;
    cublasPointerMode_t pmode = CUBLAS_POINTER_MODE_HOST;
    /* cublasSetWorkspace's buffer, in effect until the next cublasSetStream (cuBLAS Library,
       "cublasSetStream()": it resets the workspace to the default pool) */
    bool ws_set = false;
    void *ws = nullptr;
    size_t ws_bytes = 0;
};

static std::mutex g_blas_mu;
static std::set<Blas *> g_handles; /* g_blas_mu */

/* moept_emu_blas_reduced_reduction: k chunk of the output-type reduction, 0 off, -1 not read yet */
static std::atomic<int> g_reduced{-1};
static int reduced_chunk() {
    int r = g_reduced.load();
    if (r < 0) {
        const char *e = getenv("MOEPT_EMU_BLAS_REDUCED_REDUCTION");
        int v = e ? atoi(e) : 0;
        g_reduced.compare_exchange_strong(r, v > 0 ? v : 0);
        r = g_reduced.load();
    }
    return r;
}

static size_t esize(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }
static float in_type(cudaDataType_t t, float v) { /* v rounded to t and back */
    if (t == CUDA_R_32F) return v;
    uint32_t u = (uint32_t)to_bf16(v) << 16;
    memcpy(&v, &u, 4);
    return v;
}

/* one product, as the documentation defines it */
struct Gemm {
    cublasOperation_t ta, tb;
    int64_t m, n, k, lda, ldb, ldc;
    float alpha, beta;
    const void *A, *B;
    void *C;
    cudaDataType_t at, bt, ct;
    int red; /* > 0: k summed in chunks of red, the chunks reduced in C's type */
};

/* elements a column-major operand spans: rows r, cols c, leading dim ld */
static int64_t span(int64_t r, int64_t c, int64_t ld) { return r == 0 || c == 0 ? 0 : ld * (c - 1) + r; }

/* The reduced-precision form: k in chunks of g.red, each chunk's sum and the running sum held in
   C's type (moept_emu_blas_reduced_reduction) */
static void gemm_reduced(const Gemm &g) {
    for (int64_t j = 0; j < g.n; j++)
        for (int64_t i = 0; i < g.m; i++) {
            float acc = 0.0f;
            if (g.alpha != 0.0f)
                for (int64_t l0 = 0; l0 < g.k; l0 += g.red) {
                    float part = 0.0f;
                    for (int64_t l = l0; l < g.k && l < l0 + g.red; l++) {
                        float a = ld_elem(g.A, g.at, g.ta == CUBLAS_OP_N ? i + l * g.lda : l + i * g.lda);
                        float b = ld_elem(g.B, g.bt, g.tb == CUBLAS_OP_N ? l + j * g.ldb : j + l * g.ldb);
                        part += a * b;
                    }
                    acc = in_type(g.ct, acc + in_type(g.ct, part));
                }
            float v = g.alpha * acc;
            if (g.beta != 0.0f) v += g.beta * ld_elem(g.C, g.ct, i + j * g.ldc);
            st_elem(g.C, g.ct, i + j * g.ldc, v);
        }
}

/* c[i] += a[i] * b, i < m: four lanes at a time (each lane's product and sum rounded as alone) */
static void axpy(float *__restrict c, const float *__restrict a, float b, int64_t m) {
    typedef float f4 __attribute__((vector_size(16)));
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
        f4 cv, av;
        memcpy(&cv, c + i, sizeof cv);
        memcpy(&av, a + i, sizeof av);
        cv += av * b;
        memcpy(c + i, &cv, sizeof cv);
    }
    for (; i < m; i++) c[i] += a[i] * b;
}

/* The fp32 form: each element of C is the sum of its k products in fp32, k in order, then
   alpha * sum (+ beta * C). op(A) is unpacked once, k-major, so that a column of C is k axpys: its
   m sums advance side by side, each adding the same products in the same order as it would alone. */
static void gemm_fp32(const Gemm &g) {
    const bool prod = g.alpha != 0.0f; /* alpha 0: op(A) op(B) is not read (not even a NaN) */
    std::vector<float> ap(prod ? (size_t)(g.k * g.m) : 0); /* op(A) [k][m] */
    std::vector<float> col((size_t)g.m);                     /* C's column j [m] */
    for (int64_t l = 0; prod && l < g.k; l++)
        for (int64_t i = 0; i < g.m; i++)
            ap[(size_t)(l * g.m + i)] =
                ld_elem(g.A, g.at, g.ta == CUBLAS_OP_N ? i + l * g.lda : l + i * g.lda);
    for (int64_t j = 0; j < g.n; j++) {
        float *__restrict c = col.data();
        for (int64_t i = 0; i < g.m; i++) c[i] = 0.0f;
        for (int64_t l = 0; prod && l < g.k; l++) {
            const float b = ld_elem(g.B, g.bt, g.tb == CUBLAS_OP_N ? l + j * g.ldb : j + l * g.ldb);
            axpy(c, ap.data() + l * g.m, b, g.m);
        }
        for (int64_t i = 0; i < g.m; i++) {
            float v = g.alpha * (0.0f + c[i]);
            if (g.beta != 0.0f) v += g.beta * ld_elem(g.C, g.ct, i + j * g.ldc);
            st_elem(g.C, g.ct, i + j * g.ldc, v);
        }
    }
}

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
    if (g.red > 0) gemm_reduced(g);
    else gemm_fp32(g);
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

/* ---- the type tables ----
   Each call's documented combinations of computeType, Atype = Btype and
   Ctype (the scale type follows the compute type), real types only (moept
   has no complex data). Anything else is CUBLAS_STATUS_NOT_SUPPORTED ("the
   combination of the parameters Atype, Btype and Ctype ... is not
   supported"). The emulator computes the COMPUTE_32F(_PEDANTIC) rows of
   fp32 and bf16; the other rows are documented but not emulated. */
struct TypeRow {
    cublasComputeType_t comp;
    cudaDataType_t ab, c;
};
#define MOEPT__ROWS_32F(ct)                                                                                   \
    {ct, CUDA_R_16BF, CUDA_R_16BF}, {ct, CUDA_R_16F, CUDA_R_16F}, {ct, CUDA_R_8I, CUDA_R_32F},               \
        {ct, CUDA_R_16BF, CUDA_R_32F}, {ct, CUDA_R_16F, CUDA_R_32F}, {ct, CUDA_R_32F, CUDA_R_32F}
/* cuBLAS Library, "cublasGemmEx()", its table of supported types; "cublasGemmBatchedEx()" and
   "cublasGemmStridedBatchedEx()" list the same combinations */
static const TypeRow k_gemm_ex[] = {
    {CUBLAS_COMPUTE_16F, CUDA_R_16F, CUDA_R_16F},
    {CUBLAS_COMPUTE_16F_PEDANTIC, CUDA_R_16F, CUDA_R_16F},
    MOEPT__ROWS_32F(CUBLAS_COMPUTE_32F),
    MOEPT__ROWS_32F(CUBLAS_COMPUTE_32F_PEDANTIC),
    {CUBLAS_COMPUTE_32F_FAST_16F, CUDA_R_32F, CUDA_R_32F},
    {CUBLAS_COMPUTE_32F_FAST_16BF, CUDA_R_32F, CUDA_R_32F},
    {CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F, CUDA_R_32F},
    {CUBLAS_COMPUTE_32I, CUDA_R_8I, CUDA_R_32I},
    {CUBLAS_COMPUTE_32I_PEDANTIC, CUDA_R_8I, CUDA_R_32I},
    {CUBLAS_COMPUTE_64F, CUDA_R_64F, CUDA_R_64F},
    {CUBLAS_COMPUTE_64F_PEDANTIC, CUDA_R_64F, CUDA_R_64F},
};
#undef MOEPT__ROWS_32F
/* cuBLAS Library, "cublasGemmGroupedBatchedEx()", its table: the output type is the input type
   (no bf16 or fp16 inputs with fp32 C) */
static const TypeRow k_grouped[] = {
    {CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_16BF},
    {CUBLAS_COMPUTE_32F, CUDA_R_16F, CUDA_R_16F},
    {CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_32F},
    {CUBLAS_COMPUTE_32F_PEDANTIC, CUDA_R_32F, CUDA_R_32F},
    {CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F, CUDA_R_32F},
    {CUBLAS_COMPUTE_64F, CUDA_R_64F, CUDA_R_64F},
    {CUBLAS_COMPUTE_64F_PEDANTIC, CUDA_R_64F, CUDA_R_64F},
};

static const char *type_name(cudaDataType_t t) {
    switch (t) {
    case CUDA_R_32F: return "CUDA_R_32F";
    case CUDA_R_16BF: return "CUDA_R_16BF";
    case CUDA_R_16F: return "CUDA_R_16F";
    case CUDA_R_64F: return "CUDA_R_64F";
    case CUDA_R_8I: return "CUDA_R_8I";
    case CUDA_R_32I: return "CUDA_R_32I";
    default: return "(another cudaDataType)";
    }
}
static const char *comp_name(cublasComputeType_t c) {
    switch (c) {
    case CUBLAS_COMPUTE_32F: return "CUBLAS_COMPUTE_32F";
    case CUBLAS_COMPUTE_32F_PEDANTIC: return "CUBLAS_COMPUTE_32F_PEDANTIC";
    case CUBLAS_COMPUTE_32F_FAST_TF32: return "CUBLAS_COMPUTE_32F_FAST_TF32";
    case CUBLAS_COMPUTE_64F: return "CUBLAS_COMPUTE_64F";
    case CUBLAS_COMPUTE_64F_PEDANTIC: return "CUBLAS_COMPUTE_64F_PEDANTIC";
    default: return "(another computeType)";
    }
}

template <size_t N>
static cublasStatus_t check_types(const char *call, const TypeRow (&table)[N], cudaDataType_t at,
                                  cudaDataType_t bt, cudaDataType_t ct, cublasComputeType_t comp) {
    bool listed = false;
    for (const TypeRow &r : table) listed |= at == bt && r.comp == comp && r.ab == at && r.c == ct;
    if (!listed) {
        report("cublas", "%s: Atype %s, Btype %s, Ctype %s with %s is not in its documented type table "
               "(CUBLAS_STATUS_NOT_SUPPORTED)", call, type_name(at), type_name(bt), type_name(ct),
               comp_name(comp));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    bool emulated = (comp == CUBLAS_COMPUTE_32F || comp == CUBLAS_COMPUTE_32F_PEDANTIC) &&
                    (at == CUDA_R_32F || at == CUDA_R_16BF) && (ct == CUDA_R_32F || ct == CUDA_R_16BF);
    if (!emulated) {
        report("cublas", "%s: Atype %s, Ctype %s with %s is documented but not emulated", call, type_name(at),
               type_name(ct), comp_name(comp));
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

/* The math mode's fast modes (cuBLAS Library, "cublasMath_t"): TF32 or the deprecated
   CUBLAS_TENSOR_OP_MATH may round fp32 inputs, which the emulator does not do (so it declines them). */
static bool fast_math(cublasMath_t m) {
    int base = (int)m & 0xf;
    return base == CUBLAS_TENSOR_OP_MATH || base == CUBLAS_TF32_TENSOR_OP_MATH;
}

/* Reductions in the output type: allowed unless the math mode carries
   CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION (cuBLAS Library, "cublasMath_t": that flag forces
   reductions to use the compute type, not an output type of lower precision) or the compute type is
   pedantic. Done here only when a test asks (moept_emu_blas_reduced_reduction). */
static int reduced(const Blas *b, cudaDataType_t ct, cublasComputeType_t comp) {
    if (((int)b->math & CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION) || comp != CUBLAS_COMPUTE_32F ||
        esize(ct) >= 4)
        return 0;
    return reduced_chunk();
}

/* The grouped call reads its matrix pointers on the device, so the pointers
   themselves must be aligned (cuBLAS Library, "cublasGemmGroupedBatchedEx()":
   with Atype CUDA_R_16F or CUDA_R_16BF, or a FAST compute type, the pointers
   (not the pointer arrays) must be aligned to avoid misaligned memory
   accesses: to 16 bytes when k * sizeof(Atype) is a multiple of 16, else to
   4 bytes when it is a multiple of 4; a requirement there, where
   "cublasGemmBatchedEx()" only recommends alignment). The bytes a problem
   needs, 1 for none. cublasGemmEx and cublasGemmStridedBatchedEx see their
   pointers on the host; for them the documentation's alignment advice
   ("Tensor Core Usage") is about speed, not correctness, and is not
   checked. */
static int align_need(const Blas *b, cudaDataType_t at, cublasComputeType_t comp, int64_t k) {
    (void)b; /* the math mode does not enter the grouped call's rule */
    bool rule = at == CUDA_R_16F || at == CUDA_R_16BF || comp == CUBLAS_COMPUTE_32F_FAST_16F ||
                comp == CUBLAS_COMPUTE_32F_FAST_16BF || comp == CUBLAS_COMPUTE_32F_FAST_TF32;
    if (!rule) return 1;
    int64_t kb = k * (int64_t)esize(at);
    return kb % 16 == 0 ? 16 : kb % 4 == 0 ? 4 : 1;
}

/* The workspace a call uses: cuBLAS Library, "cublasSetWorkspace()": "too small workspaceSizeInBytes
   may cause some routines to fail with CUBLAS_STATUS_ALLOC_FAILED"; 16 KiB or more prevents it. The
   emulator takes the documented worst case (every call on a smaller user workspace fails) and, running,
   writes the first 16 KiB, so two streams using one workspace at once are a hazard. */
constexpr size_t WS_MIN = 16384;

static cublasStatus_t ws_check(const Blas *b, const char *call) {
    if (b->ws_set && b->ws_bytes < WS_MIN) {
        report("cublas", "%s: the handle's workspace is %zu bytes, under the 16 KiB that cublasSetWorkspace() "
               "documents as enough (CUBLAS_STATUS_ALLOC_FAILED)", call, b->ws_bytes);
        return CUBLAS_STATUS_ALLOC_FAILED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

/* in an op: the workspace's use, its bytes left out of the call's traffic counts (they are cuBLAS's own) */
static bool ws_use(void *ws, size_t bytes) {
    if (!ws || !bytes) return true;
    Op *o = cur_op;
    uint64_t rw[2] = {o->rw[0], o->rw[1]}, uq[2] = {o->uq[0], o->uq[1]}, nacc = o->nacc;
    int ok = touch(ws, bytes < WS_MIN ? bytes : WS_MIN, 1, "cuBLAS workspace");
    o->rw[0] = rw[0]; o->rw[1] = rw[1]; o->uq[0] = uq[0]; o->uq[1] = uq[1]; o->nacc = nacc;
    return ok;
}

/* cuBLAS Library, "CUDA Graphs Support": captured cuBLAS routines may add memory nodes
   (cudaMallocAsync, cudaFreeAsync) for their workspace, which child graphs and device-launched graphs
   cannot hold; the documented remedy is a user workspace (cublasSetWorkspace). A library's calls may
   end up in either kind of graph, so a capture on a handle without one is reported. */
static void capture_check(const Blas *b, const Stream *s, const char *call) {
    if (s->cap && !b->ws_set)
        report("cublas", "%s captured in a CUDA graph on a handle with no cublasSetWorkspace in effect: cuBLAS "
               "may add memory nodes, which child graphs and device-launched graphs cannot hold", call);
}

/* What every GEMM checks before it queues, in the documented order of its
   answers; SUCCESS or the answer. */
template <size_t N>
static cublasStatus_t gemm_prologue(const char *call, Blas *b, const TypeRow (&table)[N], const void *alpha,
                                    const void *beta, cudaDataType_t at, cudaDataType_t bt, cudaDataType_t ct,
                                    cublasComputeType_t comp, Stream **s) {
    if (!alpha || !beta) return invalid(call, "alpha or beta is NULL");
    cublasStatus_t r = check_types(call, table, at, bt, ct, comp);
    if (r) return r;
    if (fast_math(b->math)) {
        report("cublas", "%s: a fast math mode (TF32) is documented but not emulated", call);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (b->pmode != CUBLAS_POINTER_MODE_HOST) {
        report("cublas", "%s: CUBLAS_POINTER_MODE_DEVICE is not emulated", call);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (is_device(alpha) || is_device(beta))
        return invalid(call, "host pointer mode, but alpha or beta is device memory");
    if ((r = ws_check(b, call))) return r;
    *s = stream_of(b->stream);
    if ((*s)->dev != b->dev) return invalid(call, "the handle's stream belongs to another device");
    capture_check(b, *s, call);
    return CUBLAS_STATUS_SUCCESS;
}

}  // namespace emu

using namespace emu;

extern "C" {

void moept_emu_blas_reduced_reduction(int kchunk) { g_reduced.store(kchunk > 0 ? kchunk : 0); }

int moept_emu_blas_handles(int dev, int *no_ws) {
    std::lock_guard<std::mutex> lk(g_blas_mu);
    int n = 0, bare = 0;
    for (Blas *b : g_handles)
        if (b->dev == dev) {
            n++;
            bare += !b->ws_set;
        }
    if (no_ws) *no_ws = bare;
    return n;
}

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
    {
        std::lock_guard<std::mutex> lk(g_blas_mu);
        g_handles.insert(b);
    }
    *h = (cublasHandle_t)b;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    Blas *b = (Blas *)h;
    cudaStreamSynchronize(b->stream); /* cublasDestroy synchronises (documented: it implicitly calls cudaDeviceSynchronize) */
    {
        std::lock_guard<std::mutex> lk(g_blas_mu);
        g_handles.erase(b);
    }
    delete b;
    return CUBLAS_STATUS_SUCCESS;
}

/* cuBLAS Library, "cublasSetStream()": the stream of every later call; it also resets the workspace
   to the default pool, so a user workspace is set after it */
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    Blas *b = (Blas *)h;
    b->stream = s;
    b->ws_set = false;
    b->ws = nullptr;
    b->ws_bytes = 0;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream_v2(cublasHandle_t h, cudaStream_t *s) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!s) return CUBLAS_STATUS_INVALID_VALUE;
    *s = ((Blas *)h)->stream;
    return CUBLAS_STATUS_SUCCESS;
}

/* cuBLAS Library, "cublasSetWorkspace()": a user-owned device buffer for every later call on the
   handle's stream; the pointer must be 256-byte aligned (else CUBLAS_STATUS_INVALID_VALUE); a size of
   0 too keeps cuBLAS off its default pool */
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t h, void *ws, size_t bytes) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    Blas *b = (Blas *)h;
    if ((uintptr_t)ws % 256) return invalid("cublasSetWorkspace", "the workspace is not 256-byte aligned");
    if (bytes) { /* device memory of the handle's device: a GPU would fault on anything else */
        int d;
        Alloc *a = find(ws, &d);
        if (!a || !a->live || d != b->dev || (const char *)ws + bytes > a->base + a->size)
            report("memcheck", "cublasSetWorkspace: %zu bytes at %p are not inside one live allocation of the "
                   "handle's device %d", bytes, ws, b->dev);
    }
    b->ws_set = true;
    b->ws = ws;
    b->ws_bytes = bytes;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    ((Blas *)h)->math = m;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetMathMode(cublasHandle_t h, cublasMath_t *m) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!m) return CUBLAS_STATUS_INVALID_VALUE;
    *m = ((Blas *)h)->math;
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
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    default: return "CUBLAS_STATUS_UNKNOWN (emulated)";
    }
}

cublasStatus_t cublasGemmEx_64(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n,
                               int64_t k, const void *alpha, const void *A, cudaDataType at, int64_t lda, const void *B,
                               cudaDataType bt, int64_t ldb, const void *beta, void *C, cudaDataType ct, int64_t ldc,
                               cublasComputeType_t comp, cublasGemmAlgo_t algo) {
    const char *call = "cublasGemmEx";
    (void)algo;
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    Blas *b = (Blas *)h;
    if (ctx_lost(b)) return CUBLAS_STATUS_EXECUTION_FAILED;
    if (bad_dims(ta, tb, m, n, k, lda, ldb, ldc)) return invalid(call, "sizes, transposes or leading dimensions");
    Stream *s;
    if (cublasStatus_t r = gemm_prologue(call, b, k_gemm_ex, alpha, beta, at, bt, ct, comp, &s)) return r;
    Gemm g = {ta, tb, m, n, k, lda, ldb, ldc, *(const float *)alpha, *(const float *)beta, A, B, C, at, bt, ct,
              reduced(b, ct, comp)};
    char nm[96];
    snprintf(nm, sizeof nm, "cublasGemmEx_64 (m %lld n %lld k %lld)", (long long)m, (long long)n, (long long)k);
    void *ws = b->ws;
    size_t wsb = b->ws_bytes;
    enqueue(s, nm, [g, ws, wsb](Op &) {
        if (ws_use(ws, wsb)) gemm_run(g);
    });
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
    Stream *s;
    if (cublasStatus_t r = gemm_prologue(call, b, k_gemm_ex, alpha, beta, at, bt, ct, comp, &s)) return r;
    const size_t ea = esize(at), ec = esize(ct);
    Gemm g = {ta, tb, m, n, k, lda, ldb, ldc, *(const float *)alpha, *(const float *)beta, A, B, C, at, bt, ct,
              reduced(b, ct, comp)};
    char nm[112];
    snprintf(nm, sizeof nm, "cublasGemmStridedBatchedEx_64 (%lld x m %lld n %lld k %lld)", (long long)batch,
             (long long)m, (long long)n, (long long)k);
    void *ws = b->ws;
    size_t wsb = b->ws_bytes;
    enqueue(s, nm, [g, sa, sb, sc, batch, ea, ec, ws, wsb](Op &) {
        if (!ws_use(ws, wsb)) return;
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
    Stream *s;
    if (cublasStatus_t r = gemm_prologue(call, b, k_grouped, alpha, beta, at, bt, ct, comp, &s)) return r;
    auto gs = std::make_shared<std::vector<Gemm>>();
    auto need = std::make_shared<std::vector<int>>(); /* each problem's pointer alignment */
    int64_t total = 0;
    const int red = reduced(b, ct, comp);
    for (int64_t i = 0; i < groups; i++) {
        if (gsize[i] < 0) return invalid(call, "group_size < 0");
        if (bad_dims(ta[i], tb[i], m[i], n[i], k[i], lda[i], ldb[i], ldc[i]))
            return invalid(call, "sizes, transposes or leading dimensions of a group");
        for (int64_t j = 0; j < gsize[i]; j++) {
            gs->push_back({ta[i], tb[i], m[i], n[i], k[i], lda[i], ldb[i], ldc[i], ((const float *)alpha)[i],
                           ((const float *)beta)[i], nullptr, nullptr, nullptr, at, bt, ct, red});
            need->push_back(align_need(b, at, comp, k[i]));
        }
        total += gsize[i];
    }
    char nm[96];
    snprintf(nm, sizeof nm, "cublasGemmGroupedBatchedEx_64 (%lld problems)", (long long)total);
    void *ws = b->ws;
    size_t wsb = b->ws_bytes;
    /* the pointer arrays are device memory: read when the op runs */
    enqueue(s, nm, [gs, need, A, B, C, total, ws, wsb](Op &o) {
        size_t pb = (size_t)total * sizeof(void *);
        if (!(touch(A, pb, 0, "cuBLAS read of Aarray") & touch(B, pb, 0, "cuBLAS read of Barray") &
              touch(C, pb, 0, "cuBLAS read of Carray")) || !ws_use(ws, wsb))
            return;
        for (int64_t i = 0; i < total; i++) {
            Gemm g = (*gs)[(size_t)i];
            g.A = A[i]; g.B = B[i]; g.C = C[i];
            const int a = (*need)[(size_t)i];
            const void *ptr[3] = {g.A, g.B, g.C};
            bool aligned = true;
            for (int j = 0; j < 3 && aligned; j++)
                if ((uintptr_t)ptr[j] % (uintptr_t)a) { /* a GPU would fault here; a report fails the run */
                    report("memcheck", "%s: problem %lld (k %lld): %c pointer %p is not %d-byte aligned, as "
                           "cublasGemmGroupedBatchedEx() requires for these types and k (misaligned access)",
                           o.name.c_str(), (long long)i, (long long)g.k, "ABC"[j], ptr[j], a);
                    aligned = false;
                }
            if (aligned) gemm_run(g);
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
    if (b->pmode != CUBLAS_POINTER_MODE_HOST) {
        report("cublas", "cublasSscal: CUBLAS_POINTER_MODE_DEVICE is not emulated");
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    float a = *alpha;
    Stream *s = stream_of(b->stream);
    capture_check(b, s, "cublasSscal");
    enqueue(s, "cublasSscal_64", [a, x, n, incx](Op &) {
        if (!touch(x, (size_t)((n - 1) * incx + 1) * 4, 1, "cuBLAS read/write of x")) return;
        for (int64_t i = 0; i < n; i++) x[i * incx] *= a;
    });
    return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
