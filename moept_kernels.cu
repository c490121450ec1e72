/* moept_kernels.cu - the CUDA executor and the NCCL backend of moept.
   MIT licensed (see LICENSE).

   Build: nvcc -O3 --fmad=false -c moept_kernels.cu (see docs/CUDA.md for the
   -gencode list; moept.c must be beside it: its shared math is included
   here) and link with moept.c compiled with -DMOEPT_CUDA, plus -lcudart
   -lcublas -lcublasLt -lnccl -lstdc++. The executor's table and moept_create_cuda
   are at the end of this file.

   The stage map: each stage has one name and one meaning in both
   executors; the CUDA function (here) beside the moept.c one it mirrors.
       stage           moept_kernels.cu            moept.c
     forward (moept__forward, both):
       checks          moept__fwd_checks           moept__fwd_checks
       route           moept__fwd_route            moept__fwd_route (the
                       loss statistics here, on the device; moept.c's in losses)
       count           moept__fwd_count            moept__fwd_count
       exchange_counts moept__fwd_exchange_counts  moept__fwd_exchange_counts
                       (the forward's one host sync)
       agree_growth    moept__fwd_agree_growth     moept__fwd_agree_growth
       commit          moept__fwd_commit           moept__fwd_commit
       losses          moept__fwd_losses           moept__fwd_losses
       plan            moept__fwd_plan             moept__fwd_plan
       dispatch        moept__fwd_dispatch         moept__fwd_dispatch
       experts         moept__fwd_experts          moept__ffn_forward
       combine         moept__fwd_combine          moept__fwd_combine
       chunked (overlap_chunks > 1, EP > 1): dispatch on, moept__pipeline
                       (moept.c: moept__forward_chunked, moept__pipeline):
                       chunk c+1's rows travel while the experts compute chunk c
       sync-free: exchange_counts, agree_growth and commit on the device
                       (moept__sf_commit), the losses read when asked for
     backward (moept__backward, both):
       agree           moept__bwd_agree            moept__bwd_agree
       combine'        moept__bwd_combine          moept__bwd_combine
       experts'        moept__bwd_experts          moept__bwd_experts
                       chunked: moept__pipeline (moept.c: moept__backward_chunked,
                       moept__pipeline)
       router'         moept__bwd_router           moept__bwd_router
       dx              moept__bwd_dx               moept__bwd_dx
   MOEPT__STAGE names the forward's stages as above, the backward's
   "bwd.agree" .. "bwd.dx" ("pipeline", "bwd.pipeline" chunked).
   The host plan (row offsets, exchange pieces, rows per peer, each chunk's
   pieces and runs) is moept.c's moept__plan_*, one implementation both
   executors call.
   Every per-element computation is a MOEPT_HD function of moept.c's first
   section (this file includes it, MOEPT__KERNELS) that the
   CPU executor calls too (routing, losses, plan placement, activations and
   their derivatives, combine terms, bf16 rounding); --fmad=false keeps nvcc
   from contracting them into fma, so both executors round alike. GEMMs are
   built as moept__gemm descriptors, the ones the CPU executes, and handed to
   cuBLAS through moept__gemm_colmajor.

   Element types: T is float (dtype F32) or moept__bf16 (dtype BF16, stored
   as its bits). Router, logits, losses, dL/dw, dx accumulation, master
   weights and gradients are fp32 in both. */
#define MOEPT_INTERNAL
#ifndef MOEPT_CUDA
#define MOEPT_CUDA
#endif
#define MOEPT__KERNELS /* moept.c's first section alone: the shared per-element math */
#include "moept.c"

#include <cuda.h> /* CUtensorMap and cuTensorMapEncodeTiled's types (the function through the runtime) */
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cublasLt.h>
#include <nccl.h>

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sched.h>
#include <string.h>
#include <time.h>

typedef uint16_t moept__bf16;

/* ------------------------------------------------------------------------
   The executor's core, as the executor table (at the end of this file)
   calls it: a layer's device state (moept__cuda), what it is told of the
   layer at create, and its steps, each reporting in a moept__dev_step
   (moept.h) what the layer keeps.
   ------------------------------------------------------------------------ */
typedef struct moept__cuda moept__cuda;
/* What the executor knows of a layer: moept.c's view of it as create saw it (the shape, the resolved
   config through cfg, the comms; not the host buffers, which move: each call reads its own view),
   and what the view cannot know, the CUDA options. One description, not a copy refilled from it. */
struct moept__cuda_spec : moept__view {
    int dtype;                  /* MOEPT_DTYPE_F32 or _BF16 */
    int unchecked_backward;
    int sync_free;              /* static shapes, device-side checks reported later */
    int gemm_form;              /* moept_gemm_form */
    int64_t block_tokens;       /* sync-free: the EP group's largest max_tokens (sizes the blocks) */
    void *stream;
};
/* What it derives from the config: the expert GEMMs in E4M3 (moept__q8_*); the aux and z losses
   over the groups' tokens (where there are groups); MOEPT_AUX_SEQ's tokens per sequence (else 0) */
static inline int moept__fp8_on(const moept__cuda_spec *p) { return p->cfg->fp8 != MOEPT_FP8_OFF; }
static inline int moept__global_balance(const moept__cuda_spec *p) {
    return p->cfg->global_balance && (p->ep || p->dp);
}
static inline int64_t moept__seq_len(const moept__cuda_spec *p) {
    return p->cfg->aux_loss == MOEPT_AUX_SEQ ? p->cfg->aux_seq_len : 0;
}
static moept_status moept__cuda_create(const moept__cuda_spec *spec, moept__cuda **out, char *err);
static void moept__cuda_destroy(moept__cuda *c);
/* The layer's buffers are the device's (the host keeps no copy): io copies
   elements [off, off + n) of one (moept_buf, MOEPT__BUF_M/V) to or from
   host memory h; tables copies the host's correction bias [E] and
   placement slot_of [E], their one home. */
static moept_status moept__cuda_io(moept__cuda *c, int which, int64_t off, int64_t n, float *h, int write,
                                   char *err);
static moept_status moept__cuda_tables(moept__cuda *c, const float *bias, const int32_t *slot_of, char *err);
/* The device parameters changed (a write, the caller's optimizer): the bf16
   copy is recast at the next forward (sync-free: now). */
static void moept__cuda_params_changed(moept__cuda *c);
/* The committed step's router state: ids, wts [T][K], logits [T][E], and
   after a backward dwts [T][K] (NULL: skip). */
static moept_status moept__cuda_download_routing(moept__cuda *c, int32_t *ids, float *wts, float *logits,
                                                 float *dwts, char *err);
static moept_status moept__cuda_zero_grad(moept__cuda *c, char *err);
/* What the executor holds: its allocations and their bytes since create; now, its device bytes by
   moept_mem_kind (every slot's among them) and its own host blocks' bytes */
static void moept__cuda_sizes(const moept__cuda *c, int64_t *allocations, int64_t *allocated_bytes,
                              int64_t device[MOEPT_MEM_NKINDS], int64_t *host);
/* first_bad: the first non-finite dx element of the backwards since
   zero_grad, -1 if none (a host sync), dl_bad opts.dlogits' ([T][E]);
   sync-free mode: the first failed device check since, its status in
   why_st (OK: none) and text in why */
static moept_status moept__cuda_dx_check(moept__cuda *c, int64_t *first_bad, int64_t *dl_bad,
                                         moept_status *why_st, char *why, char *err);
/* lstat [3E + 4] receives the step's loss statistics (moept__lso: selection
   counts, aux counts, score sums, T, sum lse^2, the sequences' aux sum and
   count; global when global_balance);
   peer_rows [2][P] rows sent to / received from each peer. */
static moept_status moept__cuda_forward(moept__cuda *c, const void *x, int64_t T, void *y,
                                        double *lstat, int64_t *peer_rows, moept__dev_step *out, char *err);
static moept_status moept__cuda_backward(moept__cuda *c, const void *x, const void *dy, void *dx,
                                         moept__dev_step *out, char *err);
/* Sync-free mode: the last forward's deferred statistics (a host sync). */
static moept_status moept__cuda_step_stats(moept__cuda *c, double *lstat, int64_t *peer_rows,
                                           moept__dev_step *out, char *err);
static moept_status moept__cuda_sync_grads(moept__cuda *c, float scale, char *err);
/* The optimizer on the device. grad_scan: sums [2] of the squared
   replicated and expert gradients (deterministic), the first non-finite
   element or -1 (a host sync). opt_ready: the moments allocated (zeros)
   before the step's agreement; adamw: one step, queued. */
static moept_status moept__cuda_grad_scan(moept__cuda *c, double *sums, int64_t *first_bad, char *err);
static moept_status moept__opt_ready(moept__cuda *c, char *err);
static moept_status moept__cuda_adamw(moept__cuda *c, const moept__adamw_k *k, char *err);
/* adamw_probe: the step computed, nothing written (moept.c's adamw_probe,
   a host sync); stale_forwards: every slot's pending backward refused,
   naming call (a string that outlives the layer) */
static moept_status moept__cuda_adamw_probe(moept__cuda *c, const moept__adamw_k *k, int64_t *bad,
                                            double *mmax, double *vmax, char *err);
static void moept__cuda_stale_forwards(moept__cuda *c, const char *call);
static void moept__cuda_pointers(moept__cuda *c, float **params, float **grads);
/* moept_reshard's moves on the device, this rank's part of moept.c's plan:
   its move i, in round round[i] of `rounds`, sends local slot slot[i]'s
   expert to rank to[i] and receives one from rank from[i] into that slot
   (i < n). In a round without a move of its own a rank still takes part. */
typedef struct moept__cuda_moves {
    int64_t n, rounds;
    const int32_t *to, *from;  /* [n] */
    const int64_t *slot;       /* [n] */
    const int64_t *round;      /* [n] ascending */
} moept__cuda_moves;
/* prep, before the agreement: the staging of one expert;
   *nbuf: the expert-shaped buffers that move (1, or 3 with the moments:
   where `moments`, agreed state, says a step made them on every rank).
   move: the leaving experts' bytes into backup [n][nbuf][H*D + D*F] (host;
   *backed = 1 once they are), then the rounds; bytes moved add to *sent
   and *recvd. undo: the backup
   back into its slots. commit: the new placement slot_of [E], zero
   gradients. After a move, moept__cuda_params_changed. end: the staging
   freed. */
static moept_status moept__cuda_reshard_prep(moept__cuda *c, int moments, int *nbuf, char *err);
static moept_status moept__cuda_reshard_move(moept__cuda *c, const moept__cuda_moves *mv, float *backup,
                                             int *backed, int64_t *sent, int64_t *recvd, char *err);
static moept_status moept__cuda_reshard_undo(moept__cuda *c, const moept__cuda_moves *mv, const float *backup,
                                             char *err);
static moept_status moept__cuda_reshard_commit(moept__cuda *c, const int32_t *slot_of, char *err);
static void moept__cuda_reshard_end(moept__cuda *c);

#define MOEPT__TB 256           /* threads per block of the elementwise kernels */
#define MOEPT__PB 256           /* assignments per block of the count (moept__k_count) */
#define MOEPT__MAX_GRID 65535
#define MOEPT__SIDE 4           /* side streams for GEMMs cuBLAS cannot group (as Transformer Engine's 4) */
#define MOEPT__NPART 1024       /* most blocks of the gradient scan (moept__k_sumsq) */

/* ------------------------------------------------------------------------
   Errors: every CUDA, cuBLAS and NCCL call is checked; the message names the
   call and the line.

   A kernel's fault (an illegal or misaligned address, a trap, a timeout) is
   sticky: CUDA Runtime API, enum cudaError, cudaErrorIllegalAddress and the
   others below: it leaves the process in an inconsistent state, any further
   CUDA work returns the same error, and only a new process can use CUDA
   again. So every failure is checked for one (moept__lost_note): the call
   then fails with MOEPT_ERR_DEVICE and a message that says the context is
   lost, whatever failed first (a CUDA call, cuBLAS, NCCL, an agreement), and
   so does every later call on the device (moept__on_device).
   ------------------------------------------------------------------------ */
/* the calling layer's or comm's probe: an empty stream of its device, set by moept__on_device */
static thread_local cudaStream_t moept__t_probe;
static cudaError_t moept__lost(void) {
    /* a call bound to the device answers for its context; the thread's last error would also carry
       another device's (a thread that drives several) */
    cudaError_t e;
    if (moept__t_probe) {
        /* a query is a potentially unsafe call: during a capture this thread began (not relaxed) it
           would be refused and break the capture (tests/cuda_rules.txt), so it is asked in relaxed
           mode (CUDA Runtime API, cudaThreadExchangeStreamCaptureMode) */
        cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed;
        const bool swapped = cudaThreadExchangeStreamCaptureMode(&m) == cudaSuccess;
        e = cudaStreamQuery(moept__t_probe);
        if (swapped) (void)cudaThreadExchangeStreamCaptureMode(&m); /* the caller's mode back */
    } else {
        e = cudaPeekAtLastError();
    }
    switch (e) {
    case cudaErrorIllegalAddress: case cudaErrorLaunchTimeout: case cudaErrorAssert:
    case cudaErrorHardwareStackError: case cudaErrorIllegalInstruction: case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace: case cudaErrorInvalidPc: case cudaErrorLaunchFailure:
        return e;
    default:
        return cudaSuccess;
    }
}
/* s (a failure), or MOEPT_ERR_DEVICE when the current device's context is
   lost: then msg (len bytes) says so first */
static moept_status moept__lost_note(char *msg, size_t len, moept_status s) {
    cudaError_t e = s != MOEPT_OK ? moept__lost() : cudaSuccess;
    if (e == cudaSuccess) return s;
    if (msg && !strstr(msg, "CUDA context of device")) {
        int d = -1;
        char was[MOEPT__ERRLEN];
        (void)cudaGetDevice(&d);
        snprintf(was, sizeof was, "%s", msg);
        snprintf(msg, len, "the CUDA context of device %d is lost (%s, a sticky error): every later call "
                 "on it fails; destroy the layer and its comms, only a new process can use the device again "
                 "[%.160s]", d, cudaGetErrorString(e), was);
    }
    return MOEPT_ERR_DEVICE;
}
static moept_status moept__kfail(char *err, moept_status s, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, MOEPT__ERRLEN, fmt, ap);
        va_end(ap);
    }
    return moept__lost_note(err, MOEPT__ERRLEN, s);
}

/* A layer, and an NCCL comm, keep the device they were made on (the current
   one at moept_create_cuda; the communicator's, ncclCommCuDevice): the
   current device is a host thread's (CUDA Runtime API, cudaSetDevice), and
   memory, streams, events and handles belong to one device, so each call
   makes its device current and gives the caller's back on return. A lost
   context (above) fails the call at once. */
struct moept__on_device {
    int prev, dev;
    cudaStream_t prev_probe;
    cudaError_t e;
    moept__on_device(int d, cudaStream_t probe)
        : prev(-1), dev(d), prev_probe(moept__t_probe), e(cudaSuccess) {
        if (d < 0) return;
        moept__t_probe = probe;
        if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
        if (prev != d) e = cudaSetDevice(d);
        if (e == cudaSuccess) e = moept__lost();
    }
    ~moept__on_device() {
        if (dev < 0) return;
        moept__t_probe = prev_probe;
        if (prev >= 0 && prev != dev) (void)cudaSetDevice(prev);
    }
};
/* the first line of every extern "C" entry of a layer c (with its err) */
#define MOEPT__ENTER(c)                                                                                   \
    moept__on_device moept__dev_((c)->dev, (c)->probe);                                                   \
    if (moept__dev_.e != cudaSuccess)                                                                     \
    return moept__kfail(err, MOEPT_ERR_DEVICE, "device %d at the call's start: %s", (c)->dev,            \
                        cudaGetErrorString(moept__dev_.e))
#define MOEPT__CU(call)                                                                        \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess)                                                                 \
            return moept__kfail(err, MOEPT_ERR_DEVICE, "%s: %s (moept_kernels.cu:%d)", #call,  \
                                cudaGetErrorString(e_), __LINE__);                             \
    } while (0)
#define MOEPT__CB(call)                                                                        \
    do {                                                                                       \
        cublasStatus_t e_ = (call);                                                            \
        if (e_ != CUBLAS_STATUS_SUCCESS)                                                       \
            return moept__kfail(err, MOEPT_ERR_DEVICE, "%s: %s (moept_kernels.cu:%d)", #call,  \
                                cublasGetStatusString(e_), __LINE__);                          \
    } while (0)
#define MOEPT__LAUNCHED() MOEPT__CU(cudaGetLastError())
/* Every launch is MOEPT__LAUNCH(kernel, grid, block, smem, stream)(args...):
   <<<>>> under nvcc; tests/emu defines it as a call to run the kernels on
   the CPU under its checkers. */
#ifndef MOEPT__LAUNCH
#define MOEPT__LAUNCH(k, g, b, smem, s) k<<<g, b, smem, s>>>
#endif
/* A kernel's dynamic shared memory, 1024-byte aligned (the 128-byte swizzle's repeat) */
#ifdef MOEPT_CUDA_EMU_KERNELS_H
#define MOEPT__DYN_SMEM(p) uint8_t *p = (uint8_t *)moept_emu_dyn_smem()
#else
#define MOEPT__DYN_SMEM(p)                                 \
    extern __shared__ __align__(1024) uint8_t moept__dsm[]; \
    uint8_t *p = moept__dsm
#endif
/* The pipeline stage the work queued next belongs to: tests/emu counts
   launches, bytes and host syncs per stage (docs/CUDA.md); nothing here. */
#ifndef MOEPT__STAGE
#define MOEPT__STAGE(name) ((void)0)
#endif
#define MOEPT__TRY(expr)                     \
    do {                                     \
        moept_status s_ = (expr);            \
        if (s_ != MOEPT_OK) return s_;       \
    } while (0)

/* ------------------------------------------------------------------------
   Element access
   ------------------------------------------------------------------------ */
__device__ __forceinline__ float moept__ld(const float *p, int64_t i) { return p[i]; }
__device__ __forceinline__ float moept__ld(const moept__bf16 *p, int64_t i) {
    return moept__bf16_to_f32(p[i]);
}
/* stores v in p's type; returns the value as stored (bf16: rounded) */
__device__ __forceinline__ float moept__st(float *p, int64_t i, float v) { return p[i] = v; }
__device__ __forceinline__ float moept__st(moept__bf16 *p, int64_t i, float v) {
    moept__bf16 b = moept__f32_to_bf16(v);
    p[i] = b;
    return moept__bf16_to_f32(b);
}

/* 16-byte vectors: a thread moves V elements at once, V = 16 / sizeof(T)
   (4 fp32, 8 bf16) where its rows and pointers are 16-byte aligned (checked
   at each launch: moept__vec), else V = 1 (one element: the same kernel).
   moept__ldv reads V elements as floats; moept__stv stores V floats in T and
   leaves in v the values as stored (bf16: rounded) for the checks that read
   them; moept__cpv copies V elements as they are. No conversion differs
   from moept__ld / moept__st. */
#define MOEPT__VEC(T) ((int)(16 / sizeof(T)))
__device__ __forceinline__ float moept__lane(const uint32_t *w, int i, const float *) {
    float f;
    memcpy(&f, &w[i], 4);
    return f;
}
__device__ __forceinline__ float moept__lane(const uint32_t *w, int i, const moept__bf16 *) {
    return moept__bf16_to_f32((moept__bf16)(w[i >> 1] >> (16 * (i & 1))));
}
__device__ __forceinline__ void moept__pack(uint32_t *w, int i, float *v, const float *) {
    memcpy(&w[i], v, 4);
}
__device__ __forceinline__ void moept__pack(uint32_t *w, int i, float *v, const moept__bf16 *) {
    moept__bf16 b = moept__f32_to_bf16(*v);
    w[i >> 1] |= (uint32_t)b << (16 * (i & 1));
    *v = moept__bf16_to_f32(b);
}
/* one 16-byte store: written as a uint4 store, nvcc's optimiser splits it
   into four 4-byte stores when the words came from floats */
__device__ __forceinline__ void moept__st128(void *p, uint4 u) {
#ifdef __CUDA_ARCH__
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(u.x), "r"(u.y), "r"(u.z), "r"(u.w)
                 : "memory");
#else
    *(uint4 *)p = u;
#endif
}
template <int V, typename T>
__device__ __forceinline__ void moept__ldv(const T *p, float *v) {
    const int L = MOEPT__VEC(T);
    if constexpr (V == 1) {
        v[0] = moept__ld(p, 0);
    } else {
        for (int c = 0; c < V / L; c++) {
            uint4 u = ((const uint4 *)p)[c];
            uint32_t w[4] = {u.x, u.y, u.z, u.w};
            for (int i = 0; i < L; i++) v[c * L + i] = moept__lane(w, i, p);
        }
    }
}
template <int V, typename T>
__device__ __forceinline__ void moept__stv(T *p, float *v) {
    const int L = MOEPT__VEC(T);
    if constexpr (V == 1) {
        v[0] = moept__st(p, 0, v[0]);
    } else {
        for (int c = 0; c < V / L; c++) {
            uint32_t w[4] = {0, 0, 0, 0};
            for (int i = 0; i < L; i++) moept__pack(w, i, &v[c * L + i], p);
            moept__st128((uint4 *)p + c, make_uint4(w[0], w[1], w[2], w[3]));
        }
    }
}
template <int V, typename T>
__device__ __forceinline__ void moept__cpv(T *dst, const T *src) {
    if constexpr (V == 1) dst[0] = src[0];
    else for (int c = 0; c < V / MOEPT__VEC(T); c++) ((uint4 *)dst)[c] = ((const uint4 *)src)[c];
}

/* Rows of n elements in V-vectors: blocks of blockDim.y rows (striding over
   the rows), blockDim.x threads along a row; in-row indexes are 32-bit
   (D, H < 2^30: moept__cuda_create), so no per-element 64-bit arithmetic. */
#define MOEPT__ROWS(r, n)                                                                   \
    for (int64_t r = blockIdx.x * (int64_t)blockDim.y + threadIdx.y; r < (n);              \
         r += (int64_t)gridDim.x * blockDim.y)
#define MOEPT__LANES(j, n, V) for (int j = (int)threadIdx.x * (V); j < (n); j += (int)blockDim.x * (V))

static int moept__grid(int64_t n) {
    int64_t b = (n + MOEPT__TB - 1) / MOEPT__TB;
    if (b < 1) b = 1;
    return (int)(b > 8 * MOEPT__MAX_GRID ? 8 * MOEPT__MAX_GRID : b);
}
#define MOEPT__FOR(i, n)                                                        \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); \
         i += (int64_t)gridDim.x * blockDim.x)

/* launch shape for rows of `lanes` vectors: blockDim.x a power of two from
   32 to MOEPT__TB, no wider than a row needs; MOEPT__TB threads a block */
typedef struct { dim3 g, b; } moept__shape;
static moept__shape moept__rows_shape(int64_t rows, int64_t lanes) {
    unsigned bx = 32;
    while (bx < MOEPT__TB && bx < lanes) bx *= 2;
    const unsigned by = MOEPT__TB / bx;
    int64_t nb = (rows + by - 1) / by;
    nb = nb < 1 ? 1 : nb > 8 * MOEPT__MAX_GRID ? 8 * MOEPT__MAX_GRID : nb;
    moept__shape s = {dim3((unsigned)nb), dim3(bx, by)};
    return s;
}
/* whether rows of n elements of T at these pointers (NULL: none) take 16-byte vectors */
template <typename T>
static int moept__vec(int64_t n, const void *a, const void *b = NULL, const void *c = NULL) {
    const void *ps[3] = {a, b, c};
    if (n % MOEPT__VEC(T)) return 0;
    for (int i = 0; i < 3; i++)
        if ((uintptr_t)ps[i] % 16) return 0;
    return 1;
}
/* launches kernel k<T, V>: V = MOEPT__VEC(T) where vec, else 1 */
#define MOEPT__LAUNCH_V(vec, k, T, g, b, s, ...)                                       \
    do {                                                                               \
        if (vec) MOEPT__LAUNCH((k<T, MOEPT__VEC(T)>), g, b, 0, s)(__VA_ARGS__);        \
        else MOEPT__LAUNCH((k<T, 1>), g, b, 0, s)(__VA_ARGS__);                        \
    } while (0)

/* a loss value that is finite once rounded to float (moept.c's test): the
   plan's local z check, the sync-free agreement and the host's */
__host__ __device__ static inline int moept__finite_as_float(double v) {
    return fabs(v) <= 3.4028234663852886e38;
}

/* Sum of one double per thread over a block of MOEPT__TB threads, in a fixed
   tree order (deterministic). The result is valid in thread 0. */
__device__ __forceinline__ double moept__block_sum(double v, double *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int w = MOEPT__TB / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    return sh[0];
}

/* ------------------------------------------------------------------------
   Kernels. Launch shapes are in docs/CUDA.md.
   ------------------------------------------------------------------------ */

/* Flat kernels over n elements: item i of nv + n % V (nv = n / V) is the
   V-vector at element i V, or in the tail the one element after them.
   moept__flat gives the item's first element and its width; moept__ldf /
   moept__stf move that many, as moept__ldv / moept__stv and moept__ld /
   moept__st do. */
#define MOEPT__FLAT_FOR(i, n, V) MOEPT__FOR(i, (n) / (V) + (n) % (V))
template <int V>
__device__ __forceinline__ int64_t moept__flat(int64_t i, int64_t n, int *w) {
    const int64_t nv = n / V;
    *w = i < nv ? V : 1;
    return i < nv ? i * V : nv * V + (i - nv);
}
template <int V, typename T>
__device__ __forceinline__ void moept__ldf(const T *p, int w, float *v) {
    if (w == V) moept__ldv<V>(p, v);
    else v[0] = moept__ld(p, 0);
}
template <int V, typename T>
__device__ __forceinline__ void moept__stf(T *p, int w, float *v) {
    if (w == V) moept__stv<V>(p, v);
    else v[0] = moept__st(p, 0, v[0]);
}

/* The padded rows [T][D] of a check (mask[t] 0, or with no mask ids[t][0]
   -1): not checked; zero: their copy zero (else copied as they are). D 0:
   none */
typedef struct moept__pad { const uint8_t *mask; const int32_t *ids; int64_t D; int K, zero; } moept__pad;
__device__ __forceinline__ int moept__padded(const moept__pad &p, int64_t e) {
    const int64_t t = p.D ? e / p.D : 0;
    return p.D && (p.mask ? !p.mask[t] : p.ids[t * p.K] < 0);
}
/* x [n] -> finiteness (first bad index, atomicMin: the same index whatever
   the order) and, when xf is given, its fp32 copy (the router's input);
   padded rows are not checked */
template <typename T, int V>
__global__ void moept__k_check(const T *x, int64_t n, float *xf, unsigned long long *first_bad,
                               moept__pad pd) {
    MOEPT__FLAT_FOR(i, n, V) {
        int w, seen = 0;
        const int64_t e = moept__flat<V>(i, n, &w);
        float v[V];
        moept__ldf<V>(x + e, w, v);
        for (int l = 0; l < w; l++)
            if (moept__padded(pd, e + l)) v[l] = pd.zero ? 0.0f : v[l];
            else if (!seen && !moept__finite(v[l]))
                atomicMin(first_bad, (unsigned long long)(e + l)), seen = 1;
        if (xf) moept__stf<V>(xf + e, w, v);
    }
}

/* Router jitter (moept.h's noise, the CPU's): rows NULL is off */
typedef struct moept__jit { const uint64_t *rows; uint64_t seed, key; float eps; } moept__jit;
/* rows [T]: the hash of each token's fp32 row of xf [T][D] */
__global__ void moept__k_jitter_rows(const float *xf, int64_t T, int64_t D, uint64_t *rows) {
    MOEPT__FOR(t, T) rows[t] = moept__jitter_row(xf + t * D, D);
}
/* xj [n = T D] = xf * u, the router's input under jitter */
__global__ void moept__k_jitter(const float *xf, int64_t n, int64_t D, moept__jit j, float *xj) {
    MOEPT__FOR(i, n) xj[i] = xf[i] * moept__jitter_u(j.seed, j.key, j.rows[i / D], i % D, j.eps);
}

/* fp32 -> T (the weights for the expert GEMMs) */
template <typename T, int V>
__global__ void moept__k_cast(const float *src, int64_t n, T *dst) {
    MOEPT__FLAT_FOR(i, n, V) {
        int w;
        const int64_t e = moept__flat<V>(i, n, &w);
        float v[V];
        moept__ldf<V>(src + e, w, v);
        moept__stf<V>(dst + e, w, v);
    }
}

/* g [n] -> part [gridDim.x][2]: each block's sums of g^2 in double (exact
   squares, so non-finite iff some g is) over the replicated elements and the
   experts' [e0, e1), grid-stride then a fixed tree: with a grid fixed by n
   alone (moept__cuda_grad_scan) the sum is the same on every run and GPU. */
template <typename T, int V>
__global__ void moept__k_sumsq(const T *g, int64_t n, int64_t e0, int64_t e1, double *part) {
    __shared__ double sh[MOEPT__TB];
    double s[2] = {0.0, 0.0};
    MOEPT__FLAT_FOR(i, n, V) {
        int w;
        const int64_t e = moept__flat<V>(i, n, &w);
        float v[V];
        moept__ldf<V>(g + e, w, v);
        for (int l = 0; l < w; l++) { /* not s[in range]: an indexed array would live in local memory */
            const double sq = (double)v[l] * v[l];
            if (e + l >= e0 && e + l < e1) s[1] += sq;
            else s[0] += sq;
        }
    }
    for (int b = 0; b < 2; b++) {
        const double t = moept__block_sum(s[b], sh);
        if (threadIdx.x == 0) part[2 * blockIdx.x + b] = t;
        __syncthreads(); /* sh[0] read by all before the next sum writes it */
    }
}

/* AdamW on n <= 4 adjacent elements (moept__adamw1, the host's element): p, m, v in place from g, one
   4-vector each where V is 4 and n 4 (the caller's alignment), else element by element, and (low not
   NULL) p's bf16 copy (8 bytes where a 4-vector); the new values into pv [4] (past n: untouched) */
template <int V>
__device__ __forceinline__ void moept__adamw_n(float *p, const float *g, float *m, float *v, int n,
                                               moept__adamw_k k, moept__bf16 *low, float *pv) {
    float gv[4] = {0.0f, 0.0f, 0.0f, 0.0f}, mv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float vv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int vec = V == 4 && n == 4;
    if (vec) {
        moept__ldv<4>(p, pv); moept__ldv<4>(g, gv); moept__ldv<4>(m, mv); moept__ldv<4>(v, vv);
    } else {
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (u < n) pv[u] = p[u], gv[u] = g[u], mv[u] = m[u], vv[u] = v[u];
    }
#pragma unroll
    for (int u = 0; u < 4; u++)
        if (u < n) pv[u] = moept__adamw1(pv[u], gv[u], &mv[u], &vv[u], k);
    if (vec) {
        moept__stv<4>(p, pv); moept__stv<4>(m, mv); moept__stv<4>(v, vv);
    } else {
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (u < n) p[u] = pv[u], m[u] = mv[u], v[u] = vv[u];
    }
    if (low && vec) {
        const uint32_t lo = moept__f32_to_bf16(pv[0]) | (uint32_t)moept__f32_to_bf16(pv[1]) << 16;
        const uint32_t hi = moept__f32_to_bf16(pv[2]) | (uint32_t)moept__f32_to_bf16(pv[3]) << 16;
        *(uint2 *)low = make_uint2(lo, hi);
    } else if (low) {
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (u < n) low[u] = moept__f32_to_bf16(pv[u]);
    }
}
/* One AdamW step over [n] (moept__adamw_n): bf16 layers also write p's bf16 copy of elements [e0, n) into
   low (the expert GEMMs' weights: no separate cast reads p again); V = 4 stores 8 bytes there (e0 % 4 ==
   0, checked at the launch: moept__adamw_v4) */
template <typename T, int V>
__global__ void moept__k_adamw(T *p, const T *g, T *m, T *v, int64_t n, moept__adamw_k k, int64_t e0,
                               moept__bf16 *low) {
    static_assert(sizeof(T) == 4 && V <= 4, "moept__k_adamw: fp32 parameters, 4-vectors at most");
    MOEPT__FLAT_FOR(i, n, V) {
        int w;
        const int64_t e = moept__flat<V>(i, n, &w);
        float pv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        moept__adamw_n<V>(p + e, g + e, m + e, v + e, w, k, low && e >= e0 ? low + (e - e0) : NULL, pv);
    }
}

/* The step of moept__k_adamw computed, nothing written (moept.c's
   moept__adamw_guard, when bounds cannot settle it): out[0] the lowest
   element * 4 + 1, 2, 3 whose m, v or p would not be finite (atomicMin:
   the same whatever the schedule); out[1], out[2] the bits of the new max
   |m| and max v (non-negative floats order as their bits) */
template <typename T, int V>
__global__ void moept__k_adamw_probe(const T *p, const T *g, const T *m, const T *v, int64_t n,
                                     moept__adamw_k k, unsigned long long *out) {
    float mx[2] = {0.0f, 0.0f};
    MOEPT__FLAT_FOR(i, n, V) {
        int w;
        const int64_t e = moept__flat<V>(i, n, &w);
        float pv[V], gv[V], mv[V], vv[V];
        moept__ldf<V>(p + e, w, pv); moept__ldf<V>(g + e, w, gv);
        moept__ldf<V>(m + e, w, mv); moept__ldf<V>(v + e, w, vv);
        for (int l = 0; l < w; l++) {
            const float q = moept__adamw1(pv[l], gv[l], &mv[l], &vv[l], k);
            const int code = !moept__finite(vv[l])   ? 2
                             : !moept__finite(mv[l]) ? 1
                             : !moept__finite(q)     ? 3
                                                     : 0;
            if (code) atomicMin(&out[0], (unsigned long long)(4 * (e + l) + code));
            else { mx[0] = fmaxf(mx[0], fabsf(mv[l])); mx[1] = fmaxf(mx[1], vv[l]); }
        }
    }
    for (int b = 0; b < 2; b++) {
        uint32_t u;
        memcpy(&u, &mx[b], 4);
        atomicMax(&out[1 + b], (unsigned long long)u);
    }
}

/* The loss statistics on the device: moept.h's layout (moept__lso), then
   the step's failure flag at [n] */
#define MOEPT__NLSTAT(E) (moept__lstat_of(E).n + 1)

/* The aux loss's value from the loss statistics (moept__lso), as moept.c's
   moept__fwd_losses: the mean of the sequences' (MOEPT_AUX_SEQ), else the
   batch's, with its per-expert factors into aux_g [E] */
MOEPT_HD static double moept__aux_value(const double *ls, int64_t E, int64_t K, int aux, float coef,
                                        float *aux_g) {
    const moept__lso o = moept__lstat_of(E);
    if (aux == MOEPT_AUX_SEQ) return ls[o.nseq] > 0.0 ? ls[o.seqaux] / ls[o.nseq] : 0.0;
    const double T = ls[o.T] > 0.0 ? ls[o.T] : 1.0;
    return moept__aux_finalize(ls + o.auxc, ls + o.psum, E, K, aux, T, coef, aux_g);
}

/* One thread per token: routing, logsumexp and the aux loss's per-token
   scores and counted ids. scratch [T][2E]: the router's choice buffer, then
   the token's aux scores. A token with non-finite logits is recorded and
   given harmless ids (its step is rejected everywhere); a padded one (mask
   [T] 0) is routed nowhere (ids -1, weights 0) and in no loss or count. */
__global__ void moept__k_route(int fam, int aux, const float *logits, const float *bias, int E, int K,
                               int norm, int ng, int tg, int gfill, float scale, int64_t T, float *probs,
                               float *scratch, int32_t *ids, float *wts, float *lse, int32_t *cids,
                               unsigned long long *bad_token, const uint8_t *mask) {
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float *lg = logits + t * E;
    float *sc = scratch + t * 2 * E;
    if (mask && !mask[t]) {
        for (int k = 0; k < K; k++) { ids[t * K + k] = -1; wts[t * K + k] = 0.0f; cids[t * K + k] = -1; }
        for (int e = 0; e < E; e++) sc[e] = 0.0f;
        lse[t] = 0.0f;
        return;
    }
    if (moept__route_token(fam, lg, bias, E, K, norm, ng, tg, gfill, scale, probs + t * E, sc, ids + t * K,
                           wts + t * K) != 0) {
        atomicMin(bad_token, (unsigned long long)t);
        for (int k = 0; k < K; k++) { ids[t * K + k] = k; wts[t * K + k] = 0.0f; cids[t * K + k] = k; }
        for (int e = 0; e < E; e++) sc[e] = 0.0f;
        lse[t] = 0.0f;
        return;
    }
    lse[t] = moept__lse(lg, E);
    if (aux != MOEPT_AUX_NONE)
        moept__aux_token(fam, aux, lg, probs + t * E, ids + t * K, E, K, sc, cids + t * K);
}

/* Routing replay (opts.replay_ids), after moept__k_route: a routed token
   (ids >= 0; padding has -1) takes the experts of its given row [K],
   weighted from its scores as the family weighs its own choice, and the aux
   loss's counted ids and scores again. A row that is not K distinct
   experts keeps the router's choice and fails the step: bad_token (the
   route's first failed token, shared with non-finite logits, which sort
   first) takes MOEPT__REPLAY_BAD | (t K + k) << 1 | repeat. */
#define MOEPT__REPLAY_BAD (1ull << 62)
__global__ void moept__k_replay(int fam, int aux, const float *logits, const int32_t *given, int E, int K,
                                int norm, float scale, int64_t T, float *probs, float *scratch, int32_t *ids,
                                float *wts, int32_t *cids, unsigned long long *bad_token) {
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (t >= T || ids[t * K] < 0) return;
    const float *lg = logits + t * E;
    int code = moept__replay_bad(given + t * K, E, K);
    if (code >= 0) {
        atomicMin(bad_token, MOEPT__REPLAY_BAD | ((unsigned long long)(t * K + code / 2) << 1) | (code & 1));
        return;
    }
    if (moept__replay_token(fam, lg, given + t * K, E, K, norm, scale, probs + t * E, ids + t * K,
                            wts + t * K) != 0)
        return; /* non-finite logits: moept__k_route flagged the token */
    if (aux != MOEPT_AUX_NONE)
        moept__aux_token(fam, aux, lg, probs + t * E, ids + t * K, E, K, scratch + t * 2 * E, cids + t * K);
}

/* Loss statistics, one block per expert column (block E: sum of lse^2 and
   the unmasked tokens): lstat = [selections E | aux counts E | aux score
   sums E | T | sum lse^2 | sequences' aux sum | sequences] (moept__lso; the
   last two: moept__k_seq_close), T the unmasked tokens (a padded one's ids
   are -1).
   Each block sums its column over tokens in a fixed order (deterministic). */
__global__ void moept__k_loss_stats(const int32_t *ids, const int32_t *cids, const float *scratch,
                                    const float *lse, int64_t T, int E, int K, int aux, double *lstat) {
    __shared__ double sh[MOEPT__TB];
    const int e = blockIdx.x;
    double sel = 0.0, cnt = 0.0, ps = 0.0;
    for (int64_t t = threadIdx.x; t < T; t += MOEPT__TB) {
        if (e < E) {
            for (int k = 0; k < K; k++) {
                sel += ids[t * K + k] == e;
                if (aux != MOEPT_AUX_NONE) cnt += cids[t * K + k] == e;
            }
            if (aux != MOEPT_AUX_NONE) ps += scratch[t * 2 * E + e];
        } else {
            double l = lse[t];
            sel += l * l;
            cnt += ids[t * K] >= 0;
        }
    }
    sel = moept__block_sum(sel, sh);
    __syncthreads();
    cnt = moept__block_sum(cnt, sh);
    __syncthreads();
    ps = moept__block_sum(ps, sh);
    if (threadIdx.x == 0) {
        if (e < E) { lstat[e] = sel; lstat[E + e] = cnt; lstat[2 * E + e] = ps; }
        else { lstat[3 * E] = cnt; lstat[3 * E + 1] = sel; lstat[3 * E + 2] = lstat[3 * E + 3] = 0.0; }
    }
}

/* MOEPT_AUX_SEQ, one thread per sequence q and expert e: over the
   sequence's slen tokens in order, as moept.c, st [nseq][2E + 2] = its
   counted selections [E], score sums [E], unmasked tokens (a padded
   token's ids are -1) */
__global__ void moept__k_seq_stats(const int32_t *ids, const int32_t *cids, const float *scratch,
                                   int64_t nseq, int64_t slen, int E, int K, double *st) {
    MOEPT__FOR(i, nseq * E) {
        const int64_t q = i / E;
        const int e = (int)(i % E);
        double cnt = 0.0, ps = 0.0, n = 0.0;
        for (int64_t t = q * slen; t < (q + 1) * slen; t++) {
            if (ids[t * K] < 0) continue;
            for (int k = 0; k < K; k++) cnt += cids[t * K + k] == e;
            ps += scratch[t * 2 * E + e];
            n += 1.0;
        }
        double *s = st + q * (2 * E + 2);
        s[e] = cnt;
        s[E + e] = ps;
        if (e == 0) s[2 * E] = n;
    }
}
/* ... then (one block) each sequence's aux loss (moept__aux_finalize: its
   value into st's last column, its gradient's row into g [nseq][E] before
   the mean's 1/nseq; an all-padding sequence counts for nothing, its row
   0), and their sum and count in sequence order into lstat (moept__lso) */
__global__ void moept__k_seq_close(double *st, int64_t nseq, int E, int K, float coef, float *g,
                                   double *lstat) {
    for (int64_t q = threadIdx.x; q < nseq; q += blockDim.x) {
        double *s = st + q * (2 * E + 2);
        float *gq = g + q * E;
        if (s[2 * E] > 0.0)
            s[2 * E + 1] = moept__aux_finalize(s, s + E, E, K, MOEPT_AUX_SEQ, s[2 * E], coef, gq);
        else for (int e = 0; e < E; e++) gq[e] = 0.0f;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    double sum = 0.0, n = 0.0;
    for (int64_t q = 0; q < nseq; q++) {
        const double *s = st + q * (2 * E + 2);
        if (s[2 * E] > 0.0) { sum += s[2 * E + 1]; n += 1.0; }
    }
    const moept__lso o = moept__lstat_of(E);
    lstat[o.seqaux] = sum;
    lstat[o.nseq] = n;
}
/* ... and after the commit the mean over the sequences: each row of g [n]
   times 1/nseq, the sequences of every rank when global (lstat's) */
__global__ void moept__k_seq_scale(float *g, int64_t n, const double *lstat, int64_t at) {
    const double ns = lstat[at];
    const float inv = ns > 0.0 ? (float)(1.0 / ns) : 0.0f;
    MOEPT__FOR(i, n) g[i] *= inv;
}

/* Count (stage 3), per block: blocks of MOEPT__PB assignments; each assignment's rank
   among the same slot's earlier assignments in its block, and per block and
   slot the count (hist [nblk][E], zeroed before). Stable by construction. */
__global__ void moept__k_count(const int32_t *ids, const int32_t *slot_of, int64_t TK, int E,
                               int32_t *lrank, int64_t *hist) {
    __shared__ int32_t sl[MOEPT__PB];
    int64_t a = blockIdx.x * (int64_t)MOEPT__PB + threadIdx.x;
    int s = a < TK && ids[a] >= 0 ? slot_of[ids[a]] : -1; /* -1: padding, or past the end */
    sl[threadIdx.x] = s;
    __syncthreads();
    if (s < 0) return;
    int last;
    int r = moept__block_rank(sl, MOEPT__PB, (int)threadIdx.x, &last);
    lrank[a] = r;
    if (last) hist[blockIdx.x * (int64_t)E + s] = r + 1;
}

/* Global balance: the loss statistics [n] of every EP rank (in the count
   messages, [P][M] from off) summed in rank order, as the threads and MPI
   all-reduces sum: the same bits on every rank */
__global__ void moept__k_lstat_sum(const int64_t *msg_all, int64_t P, int64_t M, int64_t off, int64_t n,
                                   double *lstat) {
    MOEPT__FOR(i, n) {
        double s = 0.0;
        for (int64_t q = 0; q < P; q++) {
            int64_t bits = msg_all[q * M + off + i];
            double v;
            memcpy(&v, &bits, 8);
            s += v;
        }
        lstat[i] = s;
    }
}

/* Count, scan pass (one block): per slot, hist becomes each block's first
   position; kept = min(count, capacity), the capacity of the unmasked
   tokens (lstat[3E], the loss statistics' count); koff = exclusive scan of
   kept; msg = [kept E | failed | call tag | receive capacity] and at
   msg[vslot] the unmasked tokens, for the count exchange. check_z: a local z
   loss that is not finite as a float fails the step (the host's test in
   moept__fwd_loss_check, the same arithmetic). */
__global__ void moept__k_count_scan(int64_t *hist, int64_t nblk, int E, int K, double cf, int64_t *kept,
                                    int64_t *koff, int64_t *msg, const unsigned long long *bad,
                                    int host_bad, int64_t vslot, int64_t tag, int check_z, int64_t rcap,
                                    int64_t block, double *lstat) {
    const int64_t valid = (int64_t)lstat[3 * E], cap = moept__capacity(cf, valid, K, E);
    for (int e = threadIdx.x; e < E; e += blockDim.x) kept[e] = moept__plan_scan_slot(hist, nblk, E, e, cap);
    __syncthreads();
    if (threadIdx.x == 0) {
        int64_t o = 0; /* sync-free (block > 0): slot e's rows start at e block */
        for (int e = 0; e < E; e++) { koff[e] = block ? e * block : o; o += kept[e]; msg[e] = kept[e]; }
        koff[E] = o;
        int64_t failed = host_bad || bad[0] != ULLONG_MAX || bad[1] != ULLONG_MAX;
        double z = lstat[3 * E + 1] / (double)(valid > 0 ? valid : 1);
        if (check_z && !moept__finite_as_float(z)) failed = 1;
        msg[E] = failed;
        msg[E + 1] = tag;
        msg[E + 2] = rcap;
        msg[vslot] = valid;
        lstat[moept__lstat_of(E).n] = (double)failed;
    }
}

/* Chunked overlap, count: sel [C][E] (zeroed before) += assignments of
   chunk c routed to slot e (integer atomics: the same sums in any order;
   padding counts nowhere). */
__global__ void moept__k_chunk_count(const int32_t *ids, const int32_t *slot_of, int64_t T, int64_t K,
                                     int64_t C, int E, unsigned long long *sel) {
    MOEPT__FOR(a, T * K) {
        int64_t ch = moept__chunk_of(a / K, T, C);
        if (ids[a] >= 0) atomicAdd(&sel[ch * E + slot_of[ids[a]]], 1ULL);
    }
}

/* ... and its scan: the kept rows of each chunk and slot (capacity keeps a
   slot's earliest, chunk by chunk; that of the unmasked tokens, *valid, as
   the count's) into the count message's tail [C][E]. */
__global__ void moept__k_chunk_scan(const unsigned long long *sel, int64_t C, int E, int K, double cf,
                                    const int64_t *valid, int64_t *msg) {
    const int64_t cap = moept__capacity(cf, *valid, K, E);
    MOEPT__FOR(e, E) {
        int64_t before = 0;
        for (int64_t ch = 0; ch < C; ch++) {
            int64_t s = (int64_t)sel[ch * E + e], room = cap < 0 ? s : cap - before > 0 ? cap - before : 0;
            msg[ch * E + e] = s < room ? s : room;
            before += s;
        }
    }
}

/* Plan (stage 8), placement: each assignment's row through
   moept__plan_place, from the count's block ranks and offsets. */
__global__ void moept__k_plan_place(const int32_t *ids, const int32_t *slot_of, const int32_t *lrank,
                                    const int64_t *hist, const int64_t *kept, const int64_t *koff,
                                    int64_t TK, int64_t K, int E, int64_t *row_of, int64_t *tok_of_row) {
    int64_t a = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (a >= TK) return;
    if (ids[a] < 0) { row_of[a] = -1; return; } /* padding */
    int s = slot_of[ids[a]];
    int64_t pos = hist[(a / MOEPT__PB) * E + s] + lrank[a];
    moept__plan_place(a, pos, kept[s], koff[s], K, row_of, tok_of_row);
}

/* Permute: row r of xs is token tok_of_row[r] of x [N rows of D]; zeros
   where it is -1 (a sync-free block's unused rows) */
template <typename T, int V>
__global__ void moept__k_gather(const T *x, const int64_t *tok_of_row, int64_t N, int D, T *xs) {
    MOEPT__ROWS(r, N) {
        const int64_t tk = tok_of_row[r];
        float z[V];
        for (int l = 0; l < V; l++) z[l] = 0.0f;
        MOEPT__LANES(d, D, V) {
            if (tk >= 0) moept__cpv<V>(xs + r * D + d, x + tk * D + d);
            else moept__stv<V>(xs + r * D + d, z);
        }
    }
}

/* A masked step's shared-expert input: xsh row t is x's, zeros where the
   token is padding (ids [T][K] -1), so the shared expert never reads a
   padded row and its zero rows give zero outputs and add nothing to its
   gradients (its FFN has no biases, act(0) = 0) */
template <typename T, int V>
__global__ void moept__k_unpadded(const T *x, const int32_t *ids, int64_t n, int D, int K, T *xsh) {
    MOEPT__ROWS(t, n) {
        const int pad = ids[t * K] < 0;
        float z[V];
        for (int l = 0; l < V; l++) z[l] = 0.0f;
        MOEPT__LANES(d, D, V) {
            if (!pad) moept__cpv<V>(xsh + t * D + d, x + t * D + d);
            else moept__stv<V>(xsh + t * D + d, z);
        }
    }
}

/* a = act(h): h [R][H] (gate | up), a [R][lda] (F, or H where a is h: an
   inference layer's, each lane writing the gate elements it alone read).
   The kind is a template argument inside (the kernel switches once), so a
   lane's math is straight code, as moept.h's row loops are on the CPU. */
template <int KIND, typename T, int V>
__device__ __forceinline__ void moept__act_fwd_rows(const T *h, int64_t R, int F, int H, T *a, int lda) {
    const int gated = moept__act_gated(KIND);
    MOEPT__ROWS(r, R) {
        const T *hr = h + r * H;
        T *ar = a + r * lda;
        MOEPT__LANES(j, F, V) {
            float g[V], u[V];
            moept__ldv<V>(hr + j, g);
            if (gated) moept__ldv<V>(hr + F + j, u);
            for (int l = 0; l < V; l++) g[l] = moept__act_fwd1(KIND, g[l], gated ? u[l] : 0.0f);
            moept__stv<V>(ar + j, g);
        }
    }
}
template <typename T, int V>
__global__ void moept__k_act_fwd(int kind, const T *h, int64_t R, int F, int H, T *a, int lda) {
    switch (kind) {
    case MOEPT_ACT_SILU_GATED: moept__act_fwd_rows<MOEPT_ACT_SILU_GATED, T, V>(h, R, F, H, a, lda); break;
    case MOEPT_ACT_GELU_GATED: moept__act_fwd_rows<MOEPT_ACT_GELU_GATED, T, V>(h, R, F, H, a, lda); break;
    case MOEPT_ACT_GELU: moept__act_fwd_rows<MOEPT_ACT_GELU, T, V>(h, R, F, H, a, lda); break;
    default: moept__act_fwd_rows<MOEPT_ACT_RELU, T, V>(h, R, F, H, a, lda); break;
    }
}

/* dh over h from da [R][F] */
template <int KIND, typename T, int V>
__device__ __forceinline__ void moept__act_bwd_rows(T *h, const T *da, int64_t R, int F, int H) {
    const int gated = moept__act_gated(KIND);
    MOEPT__ROWS(r, R) {
        T *hr = h + r * H;
        MOEPT__LANES(j, F, V) {
            float g[V], u[V], d[V];
            moept__ldv<V>(hr + j, g);
            if (gated) moept__ldv<V>(hr + F + j, u);
            moept__ldv<V>(da + r * F + j, d);
            for (int l = 0; l < V; l++) moept__act_bwd1(KIND, g[l], gated ? u[l] : 0.0f, d[l], &g[l], &u[l]);
            moept__stv<V>(hr + j, g);
            if (gated) moept__stv<V>(hr + F + j, u);
        }
    }
}
template <typename T, int V>
__global__ void moept__k_act_bwd(int kind, T *h, const T *da, int64_t R, int F, int H) {
    switch (kind) {
    case MOEPT_ACT_SILU_GATED: moept__act_bwd_rows<MOEPT_ACT_SILU_GATED, T, V>(h, da, R, F, H); break;
    case MOEPT_ACT_GELU_GATED: moept__act_bwd_rows<MOEPT_ACT_GELU_GATED, T, V>(h, da, R, F, H); break;
    case MOEPT_ACT_GELU: moept__act_bwd_rows<MOEPT_ACT_GELU, T, V>(h, da, R, F, H); break;
    default: moept__act_bwd_rows<MOEPT_ACT_RELU, T, V>(h, da, R, F, H); break;
    }
}

/* y[t] = g_t * yss[t] + sum_k w_tk * ys[row_of[t,k]], k in slot order, for
   n tokens; y's finiteness checked as stored (bf16 rounding can overflow),
   so y is not read again */
template <typename T, int V>
__global__ void moept__k_combine(const T *ys, const int64_t *row_of, const float *wts, const T *yss,
                                 const float *sg, int64_t n, int D, int K, T *y, int64_t bad_base,
                                 unsigned long long *first_bad) {
    MOEPT__ROWS(t, n) {
        const float gs = sg ? sg[t] : 1.0f;
        MOEPT__LANES(d, D, V) {
            float acc[V], v[V];
            if (yss) moept__ldv<V>(yss + t * D + d, v);
            for (int l = 0; l < V; l++) acc[l] = yss ? moept__scale(gs, v[l]) : 0.0f;
            for (int k = 0; k < K; k++) {
                const int64_t r = row_of[t * K + k];
                if (r < 0) continue;
                const float w = wts[t * K + k];
                moept__ldv<V>(ys + r * D + d, v);
                for (int l = 0; l < V; l++) acc[l] = moept__combine_step(acc[l], w, v[l]);
            }
            moept__stv<V>(y + t * D + d, acc);
            for (int l = 0; l < V; l++)
                if (!moept__finite(acc[l])) {
                    atomicMin(first_bad, (unsigned long long)(bad_base + t * D + d + l));
                    break;
                }
        }
    }
}

/* <u, dy> over a row (double, per thread in order, then a fixed tree) while
   u's row becomes s * dy: the combine backward's and the shared expert's */
template <typename T, int V>
__device__ __forceinline__ double moept__dot_scale(T *u, const T *dy, int D, float s, double *sh) {
    double acc = 0.0;
    for (int d = (int)threadIdx.x * V; d < D; d += MOEPT__TB * V) {
        float g[V], v[V];
        moept__ldv<V>(dy + d, g);
        moept__ldv<V>(u + d, v);
        for (int l = 0; l < V; l++) {
            acc += (double)v[l] * (double)g[l];
            g[l] = moept__scale(s, g[l]);
        }
        moept__stv<V>(u + d, g);
    }
    return moept__block_sum(acc, sh);
}

/* Combine backward, one block per assignment i = (t, k): dwts[i] =
   <ys[row], dy[t]>, then ys[row] = w * dy[t] (config.fp8: moept__k_combine_bwd8) */
template <typename T, int V>
__global__ void moept__k_combine_bwd(T *ys, const int64_t *row_of, const float *wts, const T *dy,
                                     int D, int K, float *dwts) {
    __shared__ double sh[MOEPT__TB];
    const int64_t i = blockIdx.x, t = i / K, r = row_of[i];
    if (r < 0) {
        if (threadIdx.x == 0) dwts[i] = 0.0f;
        return;
    }
    double acc = moept__dot_scale<T, V>(ys + r * D, dy + t * D, D, wts[i], sh);
    if (threadIdx.x == 0) dwts[i] = (float)acc;
}

/* Shared expert's combine backward, one block per token: the gate's
   gradient (when gated) and yss[t] = g_t * dy[t]; a padded token's (ids
   [T][K] given: a masked step) 0, as its y row was */
template <typename T, int V>
__global__ void moept__k_shared_bwd(T *yss, const float *sg, const T *dy, int D, float *dsg,
                                    const int32_t *ids, int K) {
    __shared__ double sh[MOEPT__TB];
    const int64_t t = blockIdx.x;
    if (ids && ids[t * K] < 0) {
        float z[V];
        for (int l = 0; l < V; l++) z[l] = 0.0f;
        for (int d = (int)threadIdx.x * V; d < D; d += MOEPT__TB * V) moept__stv<V>(yss + t * D + d, z);
        if (threadIdx.x == 0 && sg) dsg[t] = 0.0f;
        return;
    }
    const float gs = sg ? sg[t] : 1.0f;
    double acc = moept__dot_scale<T, V>(yss + t * D, dy + t * D, D, gs, sh);
    if (threadIdx.x == 0 && sg) dsg[t] = moept__gate_bwd(acc, gs);
}

/* dx[t] = sum_k dxs[row_of[t,k]] (slot order) + the shared expert's dxs +
   dsg[t] wsg + sum_e dlogits[t,e] Wr[e], moept.c's terms in its order,
   written once in T (no fp32 pass) and checked as stored (first_bad: read
   by adamw_step and grad_norm), for n tokens */
template <typename T, int V>
__global__ void moept__k_dx(const T *ys, const int64_t *row_of, const T *yss, const float *dsg,
                            const float *wsg, const float *dlogits, const float *wr, int64_t n, int D, int K,
                            int E, moept__jit jit, T *dx, unsigned long long *first_bad) {
    MOEPT__ROWS(t, n) {
        MOEPT__LANES(d, D, V) {
            float acc[V], rt[V], v[V];
            for (int l = 0; l < V; l++) acc[l] = rt[l] = 0.0f;
            for (int k = 0; k < K; k++) {
                const int64_t r = row_of[t * K + k];
                if (r < 0) continue;
                moept__ldv<V>(ys + r * D + d, v);
                for (int l = 0; l < V; l++) acc[l] = moept__combine_step(acc[l], 1.0f, v[l]);
            }
            if (yss) {
                moept__ldv<V>(yss + t * D + d, v);
                for (int l = 0; l < V; l++) acc[l] = moept__combine_step(acc[l], 1.0f, v[l]);
            }
            if (dsg)
                for (int l = 0; l < V; l++) acc[l] += dsg[t] * wsg[d + l];
            for (int e = 0; e < E; e++) {
                const float g = dlogits[t * E + e];
                moept__ldv<V>(wr + (int64_t)e * D + d, v);
                for (int l = 0; l < V; l++) rt[l] += g * v[l];
            }
            if (jit.rows) /* the router saw x * u: its term times u */
                for (int l = 0; l < V; l++)
                    rt[l] *= moept__jitter_u(jit.seed, jit.key, jit.rows[t], d + l, jit.eps);
            for (int l = 0; l < V; l++) acc[l] += rt[l];
            moept__stv<V>(dx + t * D + d, acc);
            for (int l = 0; l < V; l++)
                if (!moept__finite(acc[l])) {
                    atomicMin(first_bad, (unsigned long long)(t * D + d + l));
                    break;
                }
        }
    }
}

/* sg[t] = sigmoid(sg[t]) (the shared-expert gate) */
/* The grouped GEMM's pointer arrays, carried by value in the launch's
   parameters (copied at the launch: no host buffer outlives the call, so
   nothing orders the host's next write after this copy; a captured graph
   keeps the values): n groups' A, B and C pointers, a group's three
   together (n <= 40: 120 pointers, under the 4 KB kernel parameter limit,
   CUDA C++ Programming Guide, "Function Parameters"), into dst's A, B and
   C arrays (G apart). */
#define MOEPT__NPTR 40
typedef struct moept__ptrs { const void *p[3 * MOEPT__NPTR]; } moept__ptrs;
__global__ void moept__k_ptrs(moept__ptrs v, int n, int64_t G, const void **dst) {
    int i = threadIdx.x;
    if (i < 3 * n) dst[i % 3 * G + i / 3] = v.p[i];
}

__global__ void moept__k_sigmoid(float *v, int64_t n) {
    MOEPT__FOR(i, n) v[i] = moept__sigmoid(v[i]);
}

/* opts.logits_out [T][E]: the router's logits, a padded token's (ids -1) 0 */
__global__ void moept__k_logits_out(const float *logits, const int32_t *ids, int64_t T, int E, int K,
                                    float *out) {
    MOEPT__FOR(i, T * E) out[i] = ids[i / E * K] < 0 ? 0.0f : logits[i];
}

/* Router backward, one thread per token. scratch [T][2E]; ls the router
   losses' scale, dlx [T][E] the caller's dL/dlogits or NULL, its first
   non-finite element the token reads into dl_bad (moept.c refuses it at
   the call; here it is read by adamw_step and grad_norm, as dx's check) */
__global__ void moept__k_router_bwd(int fam, int aux, const float *logits, const float *probs,
                                    const int32_t *ids, const float *dwts, const float *aux_g, int64_t slen,
                                    float zc, const float *lse, float Tl, const double *Tdev, int E, int K,
                                    int norm, float scale, float ls, const float *dlx, int64_t T,
                                    float *scratch, float *dlogits, unsigned long long *dl_bad) {
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (t >= T) return;
    if (ids[t * K] < 0) { /* padding: routed nowhere, in no loss (its dlx row not read, as moept.c's) */
        for (int e = 0; e < E; e++) dlogits[t * E + e] = 0.0f;
        return;
    }
    if (Tdev) Tl = (float)(Tdev[0] > 0.0 ? Tdev[0] : 1.0); /* sync-free: the host has not seen it */
    float zg = moept__zgrad(zc, lse[t], Tl);
    const float *ag = aux_g && slen ? aux_g + t / slen * E : aux_g; /* MOEPT_AUX_SEQ: its sequence's row */
    moept__router_token_bwd(fam, aux, logits + t * E, probs + t * E, ids + t * K, dwts + t * K, ag, zg,
                            E, K, norm, scale, ls, dlx ? dlx + t * E : NULL, scratch + t * 2 * E,
                            dlogits + t * E);
    for (int e = 0; dlx && e < E; e++)
        if (!moept__finite(dlx[t * E + e])) {
            atomicMin(dl_bad, (unsigned long long)(t * E + e));
            break;
        }
}

/* Sync-free mode: why a step failed its device checks, reported by the next
   moept_adamw_step or moept_grad_norm (bad[6]: the smallest code since
   zero_grad; moept__sf_why says it) */
enum {
    MOEPT__SF_INPUT = 1, MOEPT__SF_LOSS, MOEPT__SF_ARGS, MOEPT__SF_PEER, MOEPT__SF_CALLS, MOEPT__SF_Y,
    MOEPT__SF_DY, MOEPT__SF_REPLAY, MOEPT__SF_SLOT, MOEPT__SF_DLOGITS /* (the host's, from bad[4]) */
};
__device__ __forceinline__ unsigned long long moept__sf_min(unsigned long long a, int b) {
    return a < (unsigned long long)b ? a : (unsigned long long)b;
}

/* The forward's agreement on the device, one thread: every rank's call tag
   against this one's, the failure flags (this rank's x, logits and local z
   loss; a peer's), the global losses' finiteness; and the aux loss's
   per-expert factors for the backward (the host's arithmetic, moept.h) */
__global__ void moept__k_sf_agree(const int64_t *msg_all, int64_t P, int64_t M, int E, int K, int aux,
                                  int64_t tag, int global, float z_coef, float aux_coef, const double *lstat,
                                  float *aux_g, unsigned long long *bad, int64_t me, int host_bad) {
    unsigned long long code = ULLONG_MAX;
    for (int64_t q = 0; q < P; q++) {
        const int64_t t = msg_all[q * M + E + 1]; /* low half: the call; high half: the slot */
        if ((t ^ tag) & 0xffffffff) code = moept__sf_min(code, MOEPT__SF_CALLS);
        else if (t != tag) code = moept__sf_min(code, MOEPT__SF_SLOT);
        if (msg_all[q * M + E] != 0) code = moept__sf_min(code, MOEPT__SF_PEER);
    }
    if (msg_all[me * M + E] != 0) /* this rank's own: its arguments, inputs, or its local z loss */
        code = host_bad ? MOEPT__SF_ARGS
             : bad[0] == ULLONG_MAX && bad[1] != ULLONG_MAX && (bad[1] & MOEPT__REPLAY_BAD) ? MOEPT__SF_REPLAY
             : bad[0] != ULLONG_MAX || bad[1] != ULLONG_MAX ? MOEPT__SF_INPUT : MOEPT__SF_LOSS;
    if (host_bad) { /* this call fails here: the committed step's aux factors stay */
        atomicMin(&bad[6], code);
        return;
    }
    const double Tl = lstat[3 * E] > 0.0 ? lstat[3 * E] : 1.0;
    double av = 0.0;
    if (aux != MOEPT_AUX_NONE) av = moept__aux_value(lstat, E, K, aux, aux_coef, aux_g);
    if (global && ((z_coef > 0.0f && !moept__finite_as_float(lstat[3 * E + 1] / Tl)) ||
                   (aux_coef > 0.0f && !moept__finite_as_float(av))))
        code = moept__sf_min(code, MOEPT__SF_LOSS);
    if (code != ULLONG_MAX) atomicMin(&bad[6], code);
}

/* ... and the backward's: the forward's y and this dy, as stored */
__global__ void moept__k_sf_note(unsigned long long *bad, const unsigned long long *ybad) {
    if (*ybad != ULLONG_MAX) atomicMin(&bad[6], (unsigned long long)MOEPT__SF_Y);
    if (bad[2] != ULLONG_MAX) atomicMin(&bad[6], (unsigned long long)MOEPT__SF_DY);
}

static const char *moept__sf_why(unsigned long long code) {
    switch (code) {
    case MOEPT__SF_INPUT: return "x or the router logits were not finite";
    case MOEPT__SF_LOSS: return "a loss was not finite from finite inputs";
    case MOEPT__SF_ARGS: return "this rank's forward rejected its arguments";
    case MOEPT__SF_PEER: return "another rank's step failed its checks";
    case MOEPT__SF_CALLS: return "the ranks' call sequences differed";
    case MOEPT__SF_Y: return "the forward's y was not finite from finite inputs";
    case MOEPT__SF_REPLAY: return "opts.replay_ids held a row that is not K distinct experts of 0..E-1";
    case MOEPT__SF_SLOT: return "the ranks passed different opts.slot or opts.eval";
    default: return "dy was not finite";
    }
}

/* ------------------------------------------------------------------------
   NCCL backend
   ------------------------------------------------------------------------ */
#define MOEPT__NRETIRED 40
typedef struct moept__nccl {
    ncclComm_t comm;
    cudaStream_t stream;
    cudaStream_t probe;     /* empty, of the comm's device: asks whether its context is lost */
    int timeout_ms;
    /* Host buffers (set-up and agreement traffic) cross through pinned
       memory: a copy into or out of pageable memory waits for the stream's
       earlier work (the CUDA Runtime API's "API synchronization behavior"),
       which here is an NCCL op that may wait on a peer for ever; a pinned
       copy is asynchronous and the host polls with the timeout instead. */
    void *stage;            /* [stage_bytes] device staging */
    void *host;             /* [host_bytes] pinned host staging */
    size_t stage_bytes, host_bytes;
    /* outgrown staging, freed at destroy: cudaFree waits for the whole
       device, which may wait on a peer (no free on a call's path) */
    void *retired[MOEPT__NRETIRED];
    int nretired, retired_host[MOEPT__NRETIRED];
    int aborted;            /* 1: moept called ncclCommAbort; the handle is freed, never touched again */
    char abort_why[200];
    int dev;                /* the communicator's device (ncclCommCuDevice): current in every call */
} moept__nccl;

/* a comm call's failure, its message in c->err (NCCL and the threads-on-one-device comm) */
static moept_status moept__cfail(moept_comm *c, moept_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    return moept__lost_note(c->err, sizeof c->err, s); /* a lost context: MOEPT_ERR_DEVICE */
}
/* the first line of every call of an NCCL comm c (moept__on_device) */
#define MOEPT__NENTER(c)                                                                                  \
    moept__on_device moept__dev_(((moept__nccl *)(c)->ctx)->dev, ((moept__nccl *)(c)->ctx)->probe);       \
    if (moept__dev_.e != cudaSuccess)                                                                     \
    return moept__cfail((c), MOEPT_ERR_DEVICE, "device %d at the call's start: %s",                  \
                            ((moept__nccl *)(c)->ctx)->dev, cudaGetErrorString(moept__dev_.e))

static double moept__clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
/* between two polls of a host wait: the core goes to whatever else runs */
static void moept__pause(void) { sched_yield(); }

/* Aborts the communicator (the one way to free a stream stuck in an NCCL
   kernel): NCCL's last error is read first, as the handle is freed by the
   abort. From then on every call on c fails without touching the handle, and
   moept_comm_nccl_aborted tells its owner not to destroy it. */
static moept_status moept__nccl_abort(moept_comm *c, const char *what) {
    moept__nccl *n = (moept__nccl *)c->ctx;
    const char *last = ncclGetLastError(n->comm);
    snprintf(n->abort_why, sizeof n->abort_why, "%s%s%s%s", what, last && last[0] ? " (" : "",
             last ? last : "", last && last[0] ? ")" : "");
    ncclCommAbort(n->comm);
    n->aborted = 1;
    return moept__cfail(c, MOEPT_ERR_COMM, "%s; the NCCL communicator was aborted (ncclCommAbort "
                            "freed it: do not destroy it; make a new one)", n->abort_why);
}
/* Every call on an aborted communicator fails at once. */
static moept_status moept__nccl_dead(moept_comm *c) {
    moept__nccl *n = (moept__nccl *)c->ctx;
    if (!n->aborted) return MOEPT_OK;
    return moept__cfail(c, MOEPT_ERR_COMM, "the NCCL communicator was aborted after an earlier error: %s",
                            n->abort_why);
}

/* A call's result, as NCCL's guide says: ncclInProgress (non-blocking
   communicators) is polled through ncclCommGetAsyncError until it settles or
   the timeout passes, and then the communicator is aborted. */
static moept_status moept__nccl_check(moept_comm *c, ncclResult_t r, const char *call, int line) {
    moept__nccl *n = (moept__nccl *)c->ctx;
    double t0 = moept__clock();
    while (r == ncclInProgress) {
        if (moept__clock() - t0 > n->timeout_ms * 1e-3) {
            char what[160];
            snprintf(what, sizeof what, "%s: timed out after %d ms (moept_kernels.cu:%d)", call,
                     n->timeout_ms, line);
            return moept__nccl_abort(c, what);
        }
        if (ncclCommGetAsyncError(n->comm, &r) != ncclSuccess) break;
        moept__pause();
    }
    if (r != ncclSuccess)
        return moept__cfail(c, MOEPT_ERR_COMM, "%s: %s (%s) (moept_kernels.cu:%d)", call,
                                ncclGetErrorString(r), ncclGetLastError(n->comm), line);
    return MOEPT_OK;
}
#define MOEPT__NC(c, call)                                                      \
    do {                                                                        \
        moept_status s_ = moept__nccl_check((c), (call), #call, __LINE__);      \
        if (s_ != MOEPT_OK) return s_;                                          \
    } while (0)
#define MOEPT__CCU(c, call)                                                                     \
    do {                                                                                        \
        cudaError_t e_ = (call);                                                                \
        if (e_ != cudaSuccess)                                                                  \
            return moept__cfail((c), MOEPT_ERR_DEVICE, "%s: %s (moept_kernels.cu:%d)", #call, \
                                    cudaGetErrorString(e_), __LINE__);                          \
    } while (0)

/* Waits for the comm's stream, watching for asynchronous NCCL errors and the
   timeout (a peer that never arrives is an error, not a hang). */
static moept_status moept__nccl_wait(moept_comm *c) {
    moept__nccl *n = (moept__nccl *)c->ctx;
    MOEPT__TRY(moept__nccl_dead(c));
    double t0 = moept__clock();
    for (;;) {
        cudaError_t q = cudaStreamQuery(n->stream);
        if (q != cudaSuccess && q != cudaErrorNotReady)
            return moept__cfail(c, MOEPT_ERR_DEVICE, "cudaStreamQuery: %s", cudaGetErrorString(q));
        ncclResult_t r = ncclSuccess; /* checked after the stream is done too: an op may end in error */
        if (ncclCommGetAsyncError(n->comm, &r) == ncclSuccess && r != ncclSuccess && r != ncclInProgress) {
            char what[160];
            snprintf(what, sizeof what, "nccl: %s", ncclGetErrorString(r));
            return moept__nccl_abort(c, what);
        }
        if (q == cudaSuccess) return MOEPT_OK;
        if (moept__clock() - t0 > n->timeout_ms * 1e-3) {
            char what[160];
            snprintf(what, sizeof what, "nccl: no progress in %d ms", n->timeout_ms);
            return moept__nccl_abort(c, what);
        }
        moept__pause();
    }
}

static int moept__is_host(const void *p) {
    cudaPointerAttributes a;
    if (!p) return 0;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) { cudaGetLastError(); return 1; }
    return a.type == cudaMemoryTypeHost || a.type == cudaMemoryTypeUnregistered;
}

/* Device and pinned host staging of at least dev and host bytes: grown to
   twice what it was at least (so the retired blocks sum to less than the
   live ones), the old blocks kept until destroy. */
static moept_status moept__nccl_stage(moept_comm *c, size_t dev, size_t host) {
    moept__nccl *n = (moept__nccl *)c->ctx;
    for (int h = 0; h < 2; h++) {
        void **p = h ? &n->host : &n->stage;
        size_t *have = h ? &n->host_bytes : &n->stage_bytes, want = h ? host : dev;
        if (want <= *have) continue;
        if (want < 2 * *have) want = 2 * *have;
        if (want < 4096) want = 4096;
        if (*p && n->nretired == MOEPT__NRETIRED)
            return moept__cfail(c, MOEPT_ERR_OUT_OF_MEMORY, "nccl: staging grown too often");
        void *q = NULL;
        cudaError_t e = h ? cudaMallocHost(&q, want) : cudaMalloc(&q, want);
        if (e != cudaSuccess)
            return moept__cfail(c, MOEPT_ERR_OUT_OF_MEMORY, "nccl: %zu bytes of %s staging: %s", want,
                                    h ? "pinned host" : "device", cudaGetErrorString(e));
        if (*p) {
            n->retired_host[n->nretired] = h;
            n->retired[n->nretired++] = *p;
        }
        *p = q;
        *have = want;
    }
    return MOEPT_OK;
}

static int64_t moept__seg_end(const moept_seg *s, int n) {
    int64_t m = 0;
    for (int i = 0; i < n; i++)
        if (s[i].count > 0 && s[i].offset + s[i].count > m) m = s[i].offset + s[i].count;
    return m;
}

/* All-to-all-v in pieces: grouped ncclSend/ncclRecv after the caller's count
   exchange; counts in elements, moved as bytes. */
static moept_status moept__nccl_a2a_dev(moept_comm *c, const void *send, const moept_seg *ss, void *recv,
                                        const moept_seg *rs, int nseg, int es) {
    moept__nccl *n = (moept__nccl *)c->ctx;
    MOEPT__NC(c, ncclGroupStart());
    ncclResult_t r = ncclSuccess; /* the group is closed whatever happens inside it */
    for (int q = 0; q < c->size && r == ncclSuccess; q++)
        for (int s = 0; s < nseg && r == ncclSuccess; s++) {
            const moept_seg *a = &ss[q * nseg + s], *b = &rs[q * nseg + s];
            if (a->count > 0)
                r = ncclSend((const char *)send + a->offset * es, (size_t)(a->count * es),
                    ncclUint8, q, n->comm, n->stream);
            if (r == ncclSuccess && b->count > 0)
                r = ncclRecv((char *)recv + b->offset * es, (size_t)(b->count * es),
                    ncclUint8, q, n->comm, n->stream);
        }
    ncclResult_t e = ncclGroupEnd();
    MOEPT__NC(c, r != ncclSuccess ? r : e);
    return MOEPT_OK;
}

/* Host buffers (set-up and agreement traffic) cross through the staging:
   in, n bytes of src into the pinned staging and on to the device staging
   (both first grown to total bytes); out, the device staging's [off, off +
   n) back into the pinned one, polled (moept__nccl_wait), so the caller
   reads the pinned bytes only when the result arrived */
static moept_status moept__nccl_in(moept_comm *c, size_t total, const void *src, size_t n) {
    moept__nccl *k = (moept__nccl *)c->ctx;
    MOEPT__TRY(moept__nccl_stage(c, total, total));
    if (!n) return MOEPT_OK;
    memcpy(k->host, src, n);
    MOEPT__CCU(c, cudaMemcpyAsync(k->stage, k->host, n, cudaMemcpyHostToDevice, k->stream));
    return MOEPT_OK;
}
static moept_status moept__nccl_out(moept_comm *c, size_t off, size_t n) {
    moept__nccl *k = (moept__nccl *)c->ctx;
    if (n)
        MOEPT__CCU(c, cudaMemcpyAsync((char *)k->host + off, (char *)k->stage + off, n,
                                      cudaMemcpyDeviceToHost, k->stream));
    return moept__nccl_wait(c);
}
/* both buffers host memory (1: staged) or both device memory (0); one of
   each is refused (-1, the comm's error set). call: the backend and call */
static int moept__on_host(moept_comm *c, const void *a, const void *b, const char *call) {
    const int ha = moept__is_host(a), hb = moept__is_host(b);
    if (ha == hb) return ha;
    moept__cfail(c, MOEPT_ERR_INVALID_ARGUMENT, "%s: one buffer is host memory, the other device memory "
                 "(both one or the other)", call);
    return -1;
}

static moept_status moept__nccl_alltoallv(moept_comm *c, const void *send, const moept_seg *ss, void *recv,
                                          const moept_seg *rs, int nseg, int es) {
    MOEPT__NENTER(c);
    MOEPT__TRY(moept__nccl_dead(c));
    if (es != 2 && es != 4 && es != 8)
        return moept__cfail(c, MOEPT_ERR_INVALID_ARGUMENT, "nccl alltoallv: elem_size %d", es);
    const int host = moept__on_host(c, send, recv, "nccl alltoallv");
    if (host < 0) return MOEPT_ERR_INVALID_ARGUMENT;
    if (!host) return moept__nccl_a2a_dev(c, send, ss, recv, rs, nseg, es);
    moept__nccl *n = (moept__nccl *)c->ctx;
    const int64_t sb = moept__seg_end(ss, c->size * nseg) * es, rb = moept__seg_end(rs, c->size * nseg) * es;
    MOEPT__TRY(moept__nccl_in(c, (size_t)(sb + rb + 64), send, (size_t)sb));
    MOEPT__TRY(moept__nccl_a2a_dev(c, n->stage, ss, (char *)n->stage + sb, rs, nseg, es));
    MOEPT__TRY(moept__nccl_out(c, (size_t)sb, (size_t)rb));
    const char *hr = (const char *)n->host + sb;
    for (int i = 0; i < c->size * nseg; i++) /* the pieces only: recv's bytes between them stay */
        if (rs[i].count > 0)
            memcpy((char *)recv + rs[i].offset * es, hr + rs[i].offset * es, (size_t)(rs[i].count * es));
    return MOEPT_OK;
}

static ncclDataType_t moept__nccl_type(moept_dtype t, size_t *es) {
    switch (t) {
    case MOEPT_DTYPE_F64: *es = 8; return ncclFloat64;
    case MOEPT_DTYPE_I64: *es = 8; return ncclInt64;
    case MOEPT_DTYPE_BF16: *es = 2; return ncclBfloat16;
    default: *es = 4; return ncclFloat32;
    }
}

static moept_status moept__nccl_allreduce(moept_comm *c, void *buf, int64_t count, moept_dtype t) {
    MOEPT__NENTER(c);
    moept__nccl *n = (moept__nccl *)c->ctx;
    size_t es;
    ncclDataType_t nt = moept__nccl_type(t, &es);
    MOEPT__TRY(moept__nccl_dead(c));
    if (count <= 0) return MOEPT_OK;
    if (!moept__is_host(buf)) {
        MOEPT__NC(c, ncclAllReduce(buf, buf, (size_t)count, nt, ncclSum, n->comm, n->stream));
        return MOEPT_OK;
    }
    const size_t bytes = (size_t)count * es;
    MOEPT__TRY(moept__nccl_in(c, bytes, buf, bytes));
    MOEPT__NC(c, ncclAllReduce(n->stage, n->stage, (size_t)count, nt, ncclSum, n->comm, n->stream));
    MOEPT__TRY(moept__nccl_out(c, 0, bytes)); /* buf keeps its bytes unless the sum arrived */
    memcpy(buf, n->host, bytes);
    return MOEPT_OK;
}

static moept_status moept__nccl_allgather(moept_comm *c, const void *send, void *recv, int64_t bytes) {
    MOEPT__NENTER(c);
    moept__nccl *n = (moept__nccl *)c->ctx;
    MOEPT__TRY(moept__nccl_dead(c));
    if (bytes <= 0) return MOEPT_OK;
    const int host = moept__on_host(c, send, recv, "nccl allgather");
    if (host < 0) return MOEPT_ERR_INVALID_ARGUMENT;
    if (!host) {
        MOEPT__NC(c, ncclAllGather(send, recv, (size_t)bytes, ncclUint8, n->comm, n->stream));
        return MOEPT_OK;
    }
    const size_t all = (size_t)bytes * (size_t)c->size;
    MOEPT__TRY(moept__nccl_in(c, (size_t)bytes + all, send, (size_t)bytes));
    MOEPT__NC(c, ncclAllGather(n->stage, (char *)n->stage + bytes, (size_t)bytes, ncclUint8, n->comm,
                               n->stream));
    MOEPT__TRY(moept__nccl_out(c, (size_t)bytes, all));
    memcpy(recv, (char *)n->host + bytes, all);
    return MOEPT_OK;
}

/* Point-to-point (resharding): device buffers only. */
static moept_status moept__nccl_p2p(moept_comm *c, const moept_p2p *sends, int nsend, const moept_p2p *recvs,
                                    int nrecv) {
    MOEPT__NENTER(c);
    moept__nccl *n = (moept__nccl *)c->ctx;
    MOEPT__TRY(moept__nccl_dead(c));
    for (int i = 0; i < nsend; i++)
        if (moept__is_host(sends[i].buf))
            return moept__cfail(c, MOEPT_ERR_INVALID_ARGUMENT, "nccl p2p: send %d is host memory", i);
    for (int i = 0; i < nrecv; i++)
        if (moept__is_host(recvs[i].buf))
            return moept__cfail(c, MOEPT_ERR_INVALID_ARGUMENT, "nccl p2p: receive %d is host memory", i);
    MOEPT__NC(c, ncclGroupStart());
    ncclResult_t r = ncclSuccess; /* the group is closed whatever happens inside it */
    for (int i = 0; i < nsend && r == ncclSuccess; i++)
        r = ncclSend(sends[i].buf, (size_t)sends[i].bytes, ncclUint8, sends[i].peer, n->comm, n->stream);
    for (int i = 0; i < nrecv && r == ncclSuccess; i++)
        r = ncclRecv(recvs[i].buf, (size_t)recvs[i].bytes, ncclUint8, recvs[i].peer, n->comm, n->stream);
    ncclResult_t e = ncclGroupEnd();
    MOEPT__NC(c, r != ncclSuccess ? r : e);
    return moept__nccl_wait(c);
}

/* The frees wait for the device: first the comm's own work is polled, up to
   the timeout; work still pending then (a peer that never came, on a comm
   its owner did not abort) keeps the staging allocated rather than hang. */
static void moept__nccl_destroy(moept_comm *c) {
    moept__nccl *n = (moept__nccl *)c->ctx;
    moept__on_device on(n ? n->dev : -1, n ? n->probe : NULL);
    if (n) {
        const double t0 = moept__clock();
        cudaError_t q;
        while ((q = cudaStreamQuery(n->stream)) == cudaErrorNotReady &&
               moept__clock() - t0 < n->timeout_ms * 1e-3)
            moept__pause();
        if (q == cudaErrorNotReady) n->nretired = 0, n->stage = n->host = NULL;
        for (int i = 0; i < n->nretired; i++)
            (void)(n->retired_host[i] ? cudaFreeHost(n->retired[i]) : cudaFree(n->retired[i]));
        if (n->stage) cudaFree(n->stage);
        if (n->host) cudaFreeHost(n->host);
        if (n->probe) cudaStreamDestroy(n->probe);
        free(n);
    }
    free(c);
}

extern "C" moept_status moept_comm_nccl(ncclComm_t comm, void *stream, int timeout_ms, moept_comm **out) {
    if (!out) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_comm_nccl: out is NULL");
    *out = NULL;
    int rank = 0, size = 0, dev = 0;
    if (timeout_ms < 0)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_comm_nccl: timeout_ms %d < 0",
                                  timeout_ms);
    if (!comm || ncclCommUserRank(comm, &rank) != ncclSuccess || ncclCommCount(comm, &size) != ncclSuccess ||
        ncclCommCuDevice(comm, &dev) != ncclSuccess)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_comm_nccl: the NCCL comm is NULL or "
                                  "does not answer its rank, size and device");
    moept_comm *c = (moept_comm *)calloc(1, sizeof *c);
    moept__nccl *n = (moept__nccl *)calloc(1, sizeof *n);
    if (!c || !n) { free(c); free(n); return MOEPT_ERR_OUT_OF_MEMORY; }
    {
        moept__on_device on(dev, NULL);
        if (on.e != cudaSuccess ||
            cudaStreamCreateWithFlags(&n->probe, cudaStreamNonBlocking) != cudaSuccess) {
            free(c);
            free(n);
            return MOEPT_ERR_DEVICE;
        }
    }
    n->comm = comm;
    n->stream = (cudaStream_t)stream;
    n->timeout_ms = timeout_ms > 0 ? timeout_ms : 600000;
    n->dev = dev;
    c->rank = rank;
    c->size = size;
    c->ctx = n;
    c->alltoallv = moept__nccl_alltoallv;
    c->allreduce = moept__nccl_allreduce;
    c->allgather = moept__nccl_allgather;
    c->p2p = moept__nccl_p2p;
    c->destroy = moept__nccl_destroy;
    *out = c;
    return MOEPT_OK;
}

static int moept__is_nccl(const moept_comm *c) { return c && c->destroy == moept__nccl_destroy; }
extern "C" int moept_comm_nccl_aborted(const moept_comm *c) {
    return moept__is_nccl(c) && ((const moept__nccl *)c->ctx)->aborted;
}

/* ------------------------------------------------------------------------
   Ranks as threads on one device (moept_comm_cuda_threads)
   ------------------------------------------------------------------------
   No NCCL: each rank's thread enqueues, on its own stream, the copies that
   bring its peers' bytes to it (a pull), after the peers' inputs are ready.
   A device-buffer call is three steps around two rendezvous of the thread
   group (host all-gathers, which order the events' records before the
   waits on them, as cudaStreamWaitEvent waits for the record made before
   the wait was enqueued: CUDA Runtime API, cudaStreamWaitEvent):
     post    record `ready` on the stream; all-gather each rank's post (its
             buffers, events, status and the call's shape);
     pull    wait for every peer's `ready`; copy (or sum) from the peers'
             buffers; record `done`; all-gather the statuses;
     finish  wait for every peer's `done`: no rank's stream goes on to
             rewrite a buffer a peer still reads.
   The post also says whether the rank's buffers are host memory: then,
   every rank's being so, its stream drained, the call goes through the
   thread group instead (ranks of both kinds: every rank refuses, so none
   pairs a pull's rendezvous with a host collective's).
   A `ready` is recorded again only after the peers waited on it (they did
   before the second rendezvous), a `done` only after the next post's.
   Each call is asynchronous on the stream as NCCL's are (p2p waits, as
   the NCCL backend's does); host buffers go through the thread group after
   the stream has drained. One rank's refusal is every rank's: it is in
   its post or its status. */
typedef struct moept__tverdict {
    int64_t status;             /* MOEPT_OK, or the rank's refusal */
    char err[256];              /* its message (a copy: the rank may write its comm's next) */
} moept__tverdict;
typedef struct moept__tpost {
    moept__tverdict v;
    int64_t dev;
    int64_t host;               /* 1: its buffers are host memory (the call goes through the thread group) */
    int64_t shape[3];           /* the call and its sizes: the same on every rank */
    cudaEvent_t ready, done;
    const void *send;           /* alltoallv, allgather: its send buffer; allreduce: its staged input */
    const moept_seg *ss;        /* alltoallv: its pieces [P][nseg] */
    const moept_p2p *sends;     /* p2p: its sends [nsend] */
    int64_t nsend;
} moept__tpost;

typedef struct moept__tdev {
    moept_comm *host;           /* the thread group's comm of this rank: host buffers, rendezvous */
    moept_thread_group *group;  /* its group, once this comm holds its rank's claim (moept__thr_claim) */
    cudaStream_t stream;
    cudaStream_t probe;         /* empty, of the comm's device (moept__on_device) */
    int dev, timeout_ms;
    cudaEvent_t ready, done;
    moept__tpost *posts;        /* [P] every rank's post of the call in progress */
    moept__tverdict *status;    /* [P] every rank's verdict after its pull */
    void *stage;                /* [stage_bytes] allreduce: its input as the peers read it */
    size_t stage_bytes;
    void *retired[MOEPT__NRETIRED]; /* outgrown stages, freed at destroy (a peer may still read one) */
    int nretired;
} moept__tdev;

#define MOEPT__TD(c) ((moept__tdev *)(c)->ctx)
#define MOEPT__TENTER(c)                                                                                  \
    moept__on_device moept__dev_(MOEPT__TD(c)->dev, MOEPT__TD(c)->probe);                                 \
    if (moept__dev_.e != cudaSuccess)                                                                     \
    return moept__cfail((c), MOEPT_ERR_DEVICE, "device %d at the call's start: %s", MOEPT__TD(c)->dev,   \
                        cudaGetErrorString(moept__dev_.e))

/* Waits for the stream (the timeout: its work cannot wait on a peer, but a
   stalled device is an error, not a hang) */
static moept_status moept__td_drain(moept_comm *c) {
    moept__tdev *t = MOEPT__TD(c);
    const double t0 = moept__clock();
    for (;;) {
        cudaError_t q = cudaStreamQuery(t->stream);
        if (q == cudaSuccess) return MOEPT_OK;
        if (q != cudaErrorNotReady)
            return moept__cfail(c, MOEPT_ERR_DEVICE, "cudaStreamQuery: %s", cudaGetErrorString(q));
        if (moept__clock() - t0 > t->timeout_ms * 1e-3)
            return moept__cfail(c, MOEPT_ERR_COMM, "cuda threads comm: the stream did not drain in %d ms",
                                t->timeout_ms);
        moept__pause();
    }
}

/* The post: st is this rank's verdict so far; every rank returns the same */
static moept_status moept__td_post(moept_comm *c, moept__tpost *mine, moept_status st) {
    moept__tdev *t = MOEPT__TD(c);
    mine->dev = t->dev;
    mine->ready = t->ready;
    mine->done = t->done;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (!st && cudaStreamIsCapturing(t->stream, &cap) == cudaSuccess && cap != cudaStreamCaptureStatusNone)
        st = moept__cfail(c, MOEPT_ERR_UNSUPPORTED, "cuda threads comm: not in a CUDA graph capture (a "
                          "replay would skip the ranks' rendezvous; NCCL comms can be captured)");
    if (!st && mine->host) st = moept__td_drain(c); /* the host copies come after the stream's work */
    cudaError_t e = st || mine->host ? cudaSuccess : cudaEventRecord(t->ready, t->stream);
    if (e != cudaSuccess)
        st = moept__cfail(c, MOEPT_ERR_DEVICE, "cudaEventRecord: %s", cudaGetErrorString(e));
    mine->v.status = st;
    snprintf(mine->v.err, sizeof mine->v.err, "%s", st ? c->err : "");
    moept_status h = t->host->allgather(t->host, mine, t->posts, (int64_t)sizeof *mine);
    if (h) return moept__cfail(c, h, "cuda threads comm: %s", t->host->err);
    for (int r = 0; r < c->size; r++) {
        const moept__tpost *p = &t->posts[r];
        if (p->v.status && r == c->rank) return (moept_status)p->v.status;
        if (p->v.status)
            return moept__cfail(c, (moept_status)p->v.status, "cuda threads comm: rank %d: %s", r, p->v.err);
        if (p->host != t->posts[0].host) /* (against rank 0's: the same message on every rank) */
            return moept__cfail(c, MOEPT_ERR_INVALID_ARGUMENT, "cuda threads comm: rank %d passed %s "
                                "buffers, rank 0 %s buffers (every rank passes one kind to a call)", r,
                                p->host ? "host" : "device", t->posts[0].host ? "host" : "device");
        if (memcmp(p->shape, mine->shape, sizeof mine->shape) != 0)
            return moept__cfail(c, MOEPT_ERR_COMM, "cuda threads comm: ranks %d and %d made different calls "
                                "(or with other sizes)", c->rank, r);
        if (p->dev != t->dev)
            return moept__cfail(c, MOEPT_ERR_INVALID_ARGUMENT, "cuda threads comm: rank %d is on device "
                                "%lld, rank %d on %d (one device: NCCL across devices)", r,
                                (long long)p->dev, c->rank, t->dev);
    }
    return MOEPT_OK;
}

/* The pull's start: the stream waits for every peer's inputs */
static cudaError_t moept__td_after_peers(moept__tdev *t, int me, int P) {
    cudaError_t e = cudaSuccess;
    for (int r = 0; r < P && e == cudaSuccess; r++)
        if (r != me) e = cudaStreamWaitEvent(t->stream, t->posts[r].ready, 0);
    return e;
}

/* The finish: st this rank's pull; every rank returns the same */
static moept_status moept__td_finish(moept_comm *c, moept_status st) {
    moept__tdev *t = MOEPT__TD(c);
    cudaError_t e = cudaEventRecord(t->done, t->stream);
    if (!st && e != cudaSuccess)
        st = moept__cfail(c, MOEPT_ERR_DEVICE, "cudaEventRecord: %s", cudaGetErrorString(e));
    moept__tverdict mine = {st, ""};
    snprintf(mine.err, sizeof mine.err, "%s", st ? c->err : "");
    moept_status h = t->host->allgather(t->host, &mine, t->status, (int64_t)sizeof mine);
    if (h) return moept__cfail(c, h, "cuda threads comm: %s", t->host->err);
    for (int r = 0; r < c->size; r++) /* (a done never recorded: the wait is a no-op) */
        if (r != c->rank && (e = cudaStreamWaitEvent(t->stream, t->posts[r].done, 0)) != cudaSuccess && !st)
            st = moept__cfail(c, MOEPT_ERR_DEVICE, "cudaStreamWaitEvent: %s", cudaGetErrorString(e));
    for (int r = 0; r < c->size && !st; r++)
        if (t->status[r].status)
            st = moept__cfail(c, (moept_status)t->status[r].status, "cuda threads comm: rank %d: %s", r,
                              t->status[r].err);
    return st;
}

/* Copies coalesced: a piece that continues the last on both sides extends it */
typedef struct moept__tcopy {
    char *dst;
    const char *src;
    size_t n;
    cudaStream_t s;
    cudaError_t e;
} moept__tcopy;
static void moept__td_flush(moept__tcopy *k) {
    if (k->n && k->e == cudaSuccess)
        k->e = cudaMemcpyAsync(k->dst, k->src, k->n, cudaMemcpyDeviceToDevice, k->s);
    k->n = 0;
}
static void moept__td_copy(moept__tcopy *k, void *dst, const void *src, size_t n) {
    if (!n) return;
    if (k->n && (char *)dst == k->dst + k->n && (const char *)src == k->src + k->n) {
        k->n += n;
        return;
    }
    moept__td_flush(k);
    k->dst = (char *)dst;
    k->src = (const char *)src;
    k->n = n;
}

/* host buffers on every rank (the post agreed, and drained the stream): through the thread group */
#define MOEPT__TD_HOST(c, call)                                                                       \
    do {                                                                                              \
        moept_comm *h_ = MOEPT__TD(c)->host;                                                          \
        moept_status s_ = (call);                                                                     \
        return s_ ? moept__cfail((c), s_, "%s", h_->err) : MOEPT_OK;                                  \
    } while (0)

static moept_status moept__td_alltoallv(moept_comm *c, const void *send, const moept_seg *ss, void *recv,
                                        const moept_seg *rs, int nseg, int es) {
    MOEPT__TENTER(c);
    moept__tdev *t = MOEPT__TD(c);
    const int host = moept__on_host(c, send, recv, "cuda threads alltoallv");
    moept__tpost mine = {};
    mine.shape[0] = 1, mine.shape[1] = nseg, mine.shape[2] = es;
    mine.host = host == 1;
    mine.send = send;
    mine.ss = ss;
    moept_status st = host < 0 ? MOEPT_ERR_INVALID_ARGUMENT : MOEPT_OK;
    if (!st && es != 2 && es != 4 && es != 8)
        st = moept__cfail(c, MOEPT_ERR_INVALID_ARGUMENT, "cuda threads alltoallv: elem_size %d", es);
    MOEPT__TRY(moept__td_post(c, &mine, st));
    if (mine.host) MOEPT__TD_HOST(c, h_->alltoallv(h_, send, ss, recv, rs, nseg, es));
    moept__tcopy k = {NULL, NULL, 0, t->stream, moept__td_after_peers(t, c->rank, c->size)};
    int bad = -1;
    for (int p = 0; p < c->size; p++)
        for (int s = 0; s < nseg; s++) {
            const moept_seg *a = &t->posts[p].ss[c->rank * nseg + s], *b = &rs[p * nseg + s];
            if (a->count != b->count) bad = p;
            else if (b->count > 0)
                moept__td_copy(&k, (char *)recv + b->offset * es,
                               (const char *)t->posts[p].send + a->offset * es, (size_t)(b->count * es));
        }
    moept__td_flush(&k);
    if (bad >= 0)
        st = moept__cfail(c, MOEPT_ERR_COMM, "cuda threads alltoallv: rank %d sends other counts than "
                          "rank %d expects", bad, c->rank);
    else if (k.e != cudaSuccess)
        st = moept__cfail(c, MOEPT_ERR_DEVICE, "cudaMemcpyAsync: %s", cudaGetErrorString(k.e));
    return moept__td_finish(c, st);
}

static moept_status moept__td_allgather(moept_comm *c, const void *send, void *recv, int64_t bytes) {
    MOEPT__TENTER(c);
    moept__tdev *t = MOEPT__TD(c);
    const int host = moept__on_host(c, send, recv, "cuda threads allgather");
    moept__tpost mine = {};
    mine.shape[0] = 2, mine.shape[1] = bytes;
    mine.host = host == 1;
    mine.send = send;
    MOEPT__TRY(moept__td_post(c, &mine, host < 0 ? MOEPT_ERR_INVALID_ARGUMENT : MOEPT_OK));
    if (mine.host) MOEPT__TD_HOST(c, h_->allgather(h_, send, recv, bytes));
    moept__tcopy k = {NULL, NULL, 0, t->stream, moept__td_after_peers(t, c->rank, c->size)};
    for (int p = 0; p < c->size; p++)
        moept__td_copy(&k, (char *)recv + p * bytes, t->posts[p].send, (size_t)bytes);
    moept__td_flush(&k);
    moept_status st = MOEPT_OK;
    if (k.e != cudaSuccess)
        st = moept__cfail(c, MOEPT_ERR_DEVICE, "cudaMemcpyAsync: %s", cudaGetErrorString(k.e));
    return moept__td_finish(c, st);
}

/* out = in (first) or out += in: the ranks' inputs summed in rank order, one
   launch a rank, so every rank gets the same bits (as the threads and MPI
   backends sum) */
template <typename V>
__global__ void moept__k_td_sum(V *out, const V *in, int64_t n, int first) {
    MOEPT__FOR(i, n) out[i] = first ? in[i] : out[i] + in[i];
}
template <typename V>
static cudaError_t moept__td_sum(moept__tdev *t, void *buf, int64_t n, int P) {
    for (int r = 0; r < P; r++) {
        MOEPT__LAUNCH(moept__k_td_sum<V>, moept__grid(n), MOEPT__TB, 0, t->stream)(
                (V *)buf, (const V *)t->posts[r].send, n, r == 0);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

/* this rank's input copied where the peers read it (a peer's sum must not
   see this rank's buffer half overwritten by its own) */
static moept_status moept__td_stage(moept_comm *c, const void *buf, size_t bytes) {
    moept__tdev *t = MOEPT__TD(c);
    if (bytes > t->stage_bytes) {
        if (t->stage && t->nretired == MOEPT__NRETIRED)
            return moept__cfail(c, MOEPT_ERR_OUT_OF_MEMORY, "cuda threads comm: staging grown too often");
        size_t want = bytes < 2 * t->stage_bytes ? 2 * t->stage_bytes : bytes;
        void *q = NULL;
        cudaError_t e = cudaMalloc(&q, want < 4096 ? 4096 : want);
        if (e != cudaSuccess)
            return moept__cfail(c, MOEPT_ERR_OUT_OF_MEMORY, "cuda threads comm: %zu bytes of staging: %s",
                                want, cudaGetErrorString(e));
        if (t->stage) t->retired[t->nretired++] = t->stage;
        t->stage = q;
        t->stage_bytes = want < 4096 ? 4096 : want;
    }
    if (bytes) MOEPT__CCU(c, cudaMemcpyAsync(t->stage, buf, bytes, cudaMemcpyDeviceToDevice, t->stream));
    return MOEPT_OK;
}

static moept_status moept__td_allreduce(moept_comm *c, void *buf, int64_t count, moept_dtype dt) {
    MOEPT__TENTER(c);
    moept__tdev *t = MOEPT__TD(c);
    const size_t es = dt == MOEPT_DTYPE_F32 ? 4 : 8;
    moept__tpost mine = {};
    mine.shape[0] = 3, mine.shape[1] = count, mine.shape[2] = dt;
    mine.host = moept__is_host(buf);
    moept_status st = MOEPT_OK;
    if (dt != MOEPT_DTYPE_F32 && dt != MOEPT_DTYPE_F64 && dt != MOEPT_DTYPE_I64)
        st = moept__cfail(c, MOEPT_ERR_INVALID_ARGUMENT, "cuda threads allreduce: dtype %d (F32, F64 or I64)",
                          (int)dt);
    if (!st && !mine.host) st = moept__td_stage(c, buf, (size_t)count * es);
    mine.send = t->stage;
    MOEPT__TRY(moept__td_post(c, &mine, st));
    if (mine.host) MOEPT__TD_HOST(c, h_->allreduce(h_, buf, count, dt));
    cudaError_t e = moept__td_after_peers(t, c->rank, c->size);
    if (e == cudaSuccess && count > 0)
        e = dt == MOEPT_DTYPE_F32   ? moept__td_sum<float>(t, buf, count, c->size)
            : dt == MOEPT_DTYPE_F64 ? moept__td_sum<double>(t, buf, count, c->size)
                                    : moept__td_sum<int64_t>(t, buf, count, c->size);
    if (e != cudaSuccess)
        st = moept__cfail(c, MOEPT_ERR_DEVICE, "cuda threads allreduce: %s", cudaGetErrorString(e));
    return moept__td_finish(c, st);
}

/* Messages between two ranks match in list order; the call waits for its
   copies, as the NCCL backend's does */
static moept_status moept__td_p2p(moept_comm *c, const moept_p2p *sends, int nsend, const moept_p2p *recvs,
                                  int nrecv) {
    MOEPT__TENTER(c);
    moept__tdev *t = MOEPT__TD(c);
    moept_status st = MOEPT_OK;
    for (int i = 0; i < nsend + nrecv && !st; i++) {
        const moept_p2p *m = i < nsend ? &sends[i] : &recvs[i - nsend];
        if (m->bytes > 0 && moept__is_host(m->buf))
            st = moept__cfail(c, MOEPT_ERR_INVALID_ARGUMENT, "cuda threads p2p: %s %d is host memory",
                              i < nsend ? "send" : "receive", i < nsend ? i : i - nsend);
    }
    moept__tpost mine = {};
    mine.shape[0] = 4;
    mine.sends = sends;
    mine.nsend = nsend;
    MOEPT__TRY(moept__td_post(c, &mine, st));
    moept__tcopy k = {NULL, NULL, 0, t->stream, moept__td_after_peers(t, c->rank, c->size)};
    int bad = -1;
    for (int i = 0; i < nrecv; i++) {
        const int p = recvs[i].peer;
        int nth = 0;
        for (int j = 0; j < i; j++) nth += recvs[j].peer == p;
        const moept_p2p *m = NULL;
        for (int64_t j = 0; p >= 0 && p < c->size && j < t->posts[p].nsend && !m; j++)
            if (t->posts[p].sends[j].peer == c->rank && nth-- == 0) m = &t->posts[p].sends[j];
        if (!m || m->bytes != recvs[i].bytes) bad = i;
        else moept__td_copy(&k, recvs[i].buf, m->buf, (size_t)m->bytes);
    }
    moept__td_flush(&k);
    if (bad >= 0)
        st = moept__cfail(c, MOEPT_ERR_COMM, "cuda threads p2p: rank %d's receive %d matches no send of "
                          "that size", c->rank, bad);
    else if (k.e != cudaSuccess)
        st = moept__cfail(c, MOEPT_ERR_DEVICE, "cudaMemcpyAsync: %s", cudaGetErrorString(k.e));
    MOEPT__TRY(moept__td_finish(c, st));
    return moept__td_drain(c);
}

/* Collective (every rank's thread calls it): a peer may still be about to
   wait on this rank's events after the last call's rendezvous, so they go
   only after a barrier of the group; a group that fails it (a rank that
   never comes, a peer in a call: that call fails too) leaves them allocated
   rather than freed under a peer. The frees wait for the device: the
   stream is drained first, up to the timeout (a stage a peer may still
   read is kept rather than freed early). */
static void moept__td_destroy(moept_comm *c) {
    moept__tdev *t = MOEPT__TD(c);
    if (t) {
        moept__on_device on(t->dev, t->probe);
        const int met = !t->host || moept__thr_destroy_barrier(t->host) == 0;
        if (met && moept__td_drain(c) == MOEPT_OK) {
            for (int i = 0; i < t->nretired; i++) cudaFree(t->retired[i]);
            if (t->stage) cudaFree(t->stage);
        }
        if (t->ready && met) cudaEventDestroy(t->ready);
        if (t->done && met) cudaEventDestroy(t->done);
        if (t->probe) cudaStreamDestroy(t->probe);
        if (t->group) moept__thr_release(t->group, c->rank);
        free(t->posts);
        free(t->status);
        free(t);
    }
    free(c);
}

static int moept__is_tdev(const moept_comm *c) { return c && c->destroy == moept__td_destroy; }

extern "C" moept_status moept_comm_cuda_threads(moept_thread_group *g, int rank, void *stream, int timeout_ms,
                                                moept_comm **out) {
    if (!out) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_comm_cuda_threads: out is NULL");
    *out = NULL;
    if (timeout_ms < 0)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_comm_cuda_threads: timeout_ms %d < 0",
                                  timeout_ms);
    moept_comm *host = NULL;
    moept_status st = moept_comm_threads(g, rank, &host);
    if (st) return st;
    moept_comm *c = (moept_comm *)calloc(1, sizeof *c);
    moept__tdev *t = (moept__tdev *)calloc(1, sizeof *t);
    moept__tpost *posts = (moept__tpost *)calloc((size_t)host->size, sizeof *posts);
    moept__tverdict *status = (moept__tverdict *)calloc((size_t)host->size, sizeof *status);
    if (!c || !t || !posts || !status) {
        free(c), free(t), free(posts), free(status);
        return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "moept_comm_cuda_threads: out of memory");
    }
    if ((st = moept__thr_claim(g, rank))) { /* a rank two threads claim: refused, and the group broken */
        free(c), free(t), free(posts), free(status);
        return st;
    }
    t->host = host, t->group = g, t->posts = posts, t->status = status;
    c->rank = rank;
    t->stream = (cudaStream_t)stream;
    t->timeout_ms = timeout_ms > 0 ? timeout_ms : 600000;
    c->ctx = t;
    c->destroy = moept__td_destroy;
    if (cudaGetDevice(&t->dev) != cudaSuccess ||
        cudaStreamCreateWithFlags(&t->probe, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&t->ready, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&t->done, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        t->host = NULL; /* (no barrier: the peers' comms are not this one's concern yet) */
        moept__td_destroy(c);
        return moept__thread_fail(MOEPT_ERR_DEVICE, "moept_comm_cuda_threads: no device, stream or events");
    }
    c->size = host->size;
    c->alltoallv = moept__td_alltoallv;
    c->allreduce = moept__td_allreduce;
    c->allgather = moept__td_allgather;
    c->p2p = moept__td_p2p;
    *out = c;
    return MOEPT_OK;
}

/* The comms a CUDA layer takes: NCCL's and the threads-on-one-device one */
static int moept__is_dcomm(const moept_comm *c) { return moept__is_nccl(c) || moept__is_tdev(c); }
static const char *const moept__dcomm_only = "the EP and DP comms of a CUDA layer must be NCCL comms "
    "(moept_comm_nccl) or, for ranks on one device, moept_comm_cuda_threads";
static cudaStream_t moept__stream_of(const moept_comm *m) {
    return moept__is_tdev(m) ? ((moept__tdev *)m->ctx)->stream : ((moept__nccl *)m->ctx)->stream;
}
/* a host wait for the comm's stream, with its timeout (NCCL: and its async errors) */
static moept_status moept__dcomm_wait(moept_comm *m) {
    return moept__is_tdev(m) ? moept__td_drain(m) : moept__nccl_wait(m);
}
static int moept__dev_of(const moept_comm *m) {
    return moept__is_tdev(m) ? ((moept__tdev *)m->ctx)->dev : ((moept__nccl *)m->ctx)->dev;
}

/* ------------------------------------------------------------------------
   The executor
   ------------------------------------------------------------------------ */
/* A forward slot's state: what a forward writes and its backward reads
   (the committed step's double buffers among them), one per forward slot */
typedef struct moept__cslot {
    /* device: its block (moept__slot_layout), fwork_bytes long */
    void *fwork;
    int64_t fwork_bytes;
    float *xf;                  /* [Tmax][D] fp32 router input (BF16; F32 uses x) */
    int xf_committed;           /* xf holds the committed step's x (bf16: a rejected forward wrote it) */
    uint64_t *jrow[2];          /* [Tmax] its tokens' hashes (the noise's keys), as logits */
    float *logits[2];           /* [Tmax][E] double-buffered: a rejected step keeps the last */
    float *probs[2];            /* [Tmax][E] */
    int32_t *ids[2];            /* [Tmax][K] */
    float *wts[2];              /* [Tmax][K] */
    float *lse[2];              /* [Tmax] */
    float *seqg[2];             /* MOEPT_AUX_SEQ: [Tmax / slen][E] each sequence's aux gradient */
    unsigned long long *ybad;   /* [1] the committed forward's first non-finite y index */
    int64_t *row_of;            /* [Tmax*K] permuted row of each assignment, -1 dropped */
    int64_t *tok_of_row;        /* [Tmax*K] each row's token (sync-free: -1 a block's unused row) */
    void *xs, *ys;              /* [Tmax*K][D] send/receive side of the token rows (P > 1; xs: x's rows
                                   moept__xrow bytes each, config.fp8's records) */
    void *hs, *as, *yss;        /* [Tmax][HS], [Tmax][lda_as], [Tmax][D] shared expert (T); an inference
                                   layer's as is hs (lda_as = HS: the activations over the gate half) */
    float *sg;                  /* [Tmax] shared gate */
    float *dwts;                /* [Tmax][K] (an inference layer: none) */
    float *aux_g;               /* [E] */
    int64_t *cmsg;              /* sync-free: the committed step's msg_all [P][M] and lstat [3E + 5] */
    double *clstat;             /* (a call rejected here after it ran the statistics kernels keeps them) */
    /* device: the receive block (grows geometrically, never shrinks) */
    void *rblock;
    void *xr, *yr, *h, *a;      /* [Rcap][D] (rows moept__xrow bytes), [Rcap][D], [Rcap][H], [Rcap][lda_a]
                                   (T); an inference
                                   layer's a is h (lda_a = H: the activations over the gate half) */
    void *dar, *dxr;            /* [Rcap][F], [Rcap][D] chunked backward: da, dxs (a, dys live on) */
    void *yq;                   /* [Rcap][moept__q8_recw(D)] config.fp8's training: the backward's dys as
                                   the experts take them, FP8 records */
    int64_t Rcap, rblock_bytes;
    /* host: its plan arrays (moept__slot_host_layout), fhost_bytes long */
    void *fhost;
    int64_t fhost_bytes;
    int64_t *counts, *offsets;  /* [E], [E+1] rows kept per expert slot and their first row */
    int64_t *rcounts, *roffsets;/* [P][El], [El+1] */
    moept_seg *send_segs, *recv_segs; /* [P][El] */
    int64_t *ccnt, *rccnt;      /* chunked: [C][E] kept rows per chunk and expert slot, [P][C][El]
                                   rows from peer p in chunk c for local expert j */
    int cur, fwd_valid, bwd_done, fwd_eval; /* the committed step's buffers; it was an evaluation */
    int again;                  /* the committed forward ran again into the slot, its last training
                                   forward's backward still to come (activation recomputation) */
    const char *fwd_stale;      /* the call that changed the weights since its forward (NULL: none) */
    int jit;                    /* the committed step's router saw xf * u, drawn under jkey */
    uint64_t jkey;
    int masked;                 /* the committed step had a padding mask */
    int64_t T, N, R;
    double loss_T;              /* tokens the committed step's losses average over */
} moept__cslot;

/* One weight set's E4M3 copies (the routed experts', the shared expert's): W13 [n][Hp][Dp] and W2
   [n][Dp][Fp] for the forward (A: the weight, TN), their transposes for the dgrads, each with its BLK
   scales; made from the fp32 masters once after they change (moept__q8_weights) */
typedef struct moept__q8w {
    int64_t n, H, F, Hp, Fp, off13, off2; /* matrices, widths (padded), their masters' offsets */
    uint8_t *w13, *w13t, *w2, *w2t;
    float *s13, *s13t, *s2, *s2t;
    int64_t ns13, ns13t, ns2, ns2t;       /* scale floats per matrix */
} moept__q8w;

struct moept__cuda {
    moept__cuda_spec sp;
    int dev;                    /* the device current at create: current in every call (moept__on_device) */
    cudaStream_t s;             /* compute */
    cudaStream_t probe;         /* empty, of the layer's device: asks whether its context is lost */
    cudaStream_t cs;            /* the EP comm's stream (s at one rank) */
    cudaEvent_t ev_compute, ev_comm;
    cudaEvent_t ev_out[2], ev_back[2]; /* chunked: a chunk's rows arrived / returned (alternating) */
    cublasHandle_t blas;
    /* expert GEMMs run one cublasGemmEx an expert (bf16 weight gradients: no grouped cuBLAS call takes
       bf16 A and B with fp32 C; bf16 pointers the grouped call's alignment rule refuses; the per-expert
       and strided GEMM forms; AUTO's large GEMMs): over nside side streams where the layer has them
       (bf16, those forms), each with its own handle (a handle's workspace serves one stream at a time),
       forked from s and joined back by events (moept__gemms); else in a loop on s */
    int nside;
    cudaStream_t side[MOEPT__SIDE];
    void *gk_encode;            /* options.gemm_form MOEPT_GEMM_KERNEL: cuTensorMapEncodeTiled; NULL: off */
    int gk_sms;                 /* its CTAs: one a multiprocessor */
    cublasHandle_t side_blas[MOEPT__SIDE];
    cudaEvent_t ev_fork, ev_side[MOEPT__SIDE];
    void *blas_ws;              /* the handles' cuBLAS workspaces, (1 + nside) x blas_ws_each bytes */
    int64_t blas_ws_each;
    int esz;                    /* bytes per data element: 4 (F32) or 2 (BF16) */
    cudaDataType_t dt;          /* CUDA_R_32F or CUDA_R_16BF */
    int64_t nblk_max;           /* plan-count blocks at Tmax */
    int64_t G;                  /* most groups in one grouped GEMM: El (chunked: El * P), at least 1 */
    int64_t C;                  /* overlap chunks (1: off) */
    int64_t M;                  /* count message length: kept [E] | failed | call tag | Rcap | chunked:
                                   [C][E] | global balance over EP: the loss statistics [3E + 5] |
                                   unmasked tokens */
    int64_t moff;               /* where the loss statistics start in it */

    /* the layer's side: what the device checked that the host has not read */
    int routing_on_host;        /* host ids/wts/logits hold the committed step */
    int dx_pending;             /* a backward's dx check on the device not yet read */
    int stats_pending;          /* sync-free: the last forward's device statistics not read yet */
    int last_slot;              /* the last forward's forward slot (an evaluation's: max_inflight) */
    /* moept_reshard, during the call: this rank's moves, their buffers (1, or 3 with the moments) and
       the leaving experts' bytes [n][rs_nbuf][H*D + D*F] (host), for an undo */
    int rs_nbuf;
    int64_t *rs_slot;           /* [n] local slot of each leaving expert, [n] its round; to, from [n] int32 */
    float *rs_backup;

    /* device: parameters */
    float *params, *grads;      /* [n_params] each: router | w13 | w2 | ws13 | ws2 | wsg (16-byte aligned);
                                   an inference layer has no grads (NULL) */
    float *opt_m, *opt_v;       /* [n_params] each: AdamW's moments (the first device step allocates) */
    float *rs_stage;            /* [H*D + D*F] moept_reshard's staging of one expert, during the call */
    int grads_clean;            /* a scan found the gradients finite and no call since changed them */
    double gsum[2];             /* that scan's sums (moept__cuda_grad_scan) */
    float *bias;                /* [E] */
    int32_t *slot_of;           /* [E] */
    void *wlow;                 /* [n_params - E*D] bf16 copy of the non-router weights (BF16) */
    int wlow_stale;             /* the fp32 masters changed since wlow was cast from them */

    /* Forward slots (config.max_inflight): slot s's forward state, what its
       backward reads (moept__cslot, as moept.c's moept__fstate); the rest is
       the layer's: parameters, placement, comms, scratch. */
    int nslots;                 /* max(1, max_inflight) training slots; slot nslots: evaluations' */
    int last;                   /* the slot of the last forward that succeeded */
    moept__cslot *slots;        /* [nslots + 1] */

    /* device: the fixed workspace (one allocation, sized for Tmax) */
    void *work;
    float *xj;                  /* [Tmax][D] the router's input under jitter, xf * u (router_jitter) */
    float *scratch;             /* [Tmax][2E] router scratch, aux scores, router' scratch */
    int32_t *cids;              /* [Tmax][K] aux-counted ids */
    double *lstat;              /* [3E + 5] loss statistics (moept__lso) + failure flag */
    double *seqst;              /* MOEPT_AUX_SEQ: [Tmax / slen][2E + 2] per sequence (moept__k_seq_stats) */
    int64_t *hist;              /* [nblk_max][E] the count's per block, then block offsets */
    int32_t *lrank;             /* [Tmax*K] rank within block and slot */
    int64_t *kept, *koff;       /* [E], [E+1] */
    int64_t *msg, *msg_all;     /* [M], [P][M] the count message */
    unsigned long long *csel;   /* [C][E] chunked: assignments per chunk and slot */
    unsigned long long *bad;    /* [8] first non-finite x index, token with bad logits, dy index, x
                                   again (backward), opts.dlogits index, dx index, sync-free code,
                                   gradient index ([4..6]: since zero_grad) */
    double *gpart;              /* [MOEPT__NPART][2] the gradient scan's block sums */
    float *dsg;                 /* [Tmax] the shared gate's gradient (an inference layer: none) */
    float *dlogits;             /* [Tmax][E] */
    const void **d_ptrs;        /* [3G] the grouped GEMM's pointer arrays (moept__k_ptrs writes them
                                   in stream order, after the last GEMM that read them) */

    int64_t lda_a, lda_as;      /* a's and as's row strides: F and S, or H and HS */
    int64_t B;                  /* sync-free: rows of each (rank, expert) block, Rcap = E B; 0 otherwise */

    /* pinned host */
    void *pinned;
    int64_t *h_msg_all;         /* [P][M] */
    double *h_lstat;            /* [3E + 5] */
    unsigned long long *h_bad;  /* [8] */
    double *h_gpart;            /* [MOEPT__NPART][2] */
    float *h_aux_g;             /* [E] */

    /* host */
    void *hblock;               /* the host plan arrays' block */
    moept_seg *csend, *crecv;   /* [P][El] one chunk's exchange pieces */
    moept_seg *q8segs;          /* [2][P][El] config.fp8: the pieces of an exchange of x's records */
    int64_t *cruns;             /* [3][G] one chunk's row runs: first row, rows, local expert */
    int64_t *grow_ok;           /* [P] */
    moept__gemm *descs;         /* [G] */
    int64_t *garr;              /* [9][G] grouped GEMM sizes */
    cublasOperation_t *gops;    /* [2][G] */
    float *galpha;              /* [2][G] */

    void *xsh;                  /* [Tmax][D] (T) a masked step's x with its padded rows zero
                                   (moept__k_unpadded): the shared expert's input and an F32 layer's
                                   router-gradient input; made at the first masked forward (S > 0 or
                                   F32), again by its backward's combine' */
    /* config.fp8: cuBLASLt, the weights' E4M3 copies (routed, shared) in one block, and the token
       operands' scratch for q8rows padded rows: one group's, or every group's one after another (the
       wgrads' column passes), their scales q8sc floats (moept__q8_room: it grows) */
    cublasLtHandle_t lt;
    moept__q8w q8w[2];
    void *q8wblk;
    int64_t q8w_bytes;
    int q8_stale;               /* the fp32 masters changed since q8w was made from them */
    void *q8blk;
    int64_t q8rows, q8sc, q8_bytes;
    uint8_t *q8a, *q8b;         /* [q8rows][Wp] a matmul's token operands, or each group's [Wp][np]
                                   transposed, one after another (moept__q8_gnext) */
    float *q8sa, *q8sb;         /* their scales */
    uint8_t *q8r;               /* [q8rows][Wp] the grouped kernel's (moept__gk_q8): a backward's dh (the
                                   shared expert's dy) quantized along the rows by its wgrad's column pass
                                   (moept__q8_twin), or the forward's a by the gate/up product */
    float *q8sr;                /* its scales; q8r, q8sr NULL in the per-expert form */
    uint8_t *q8x;               /* [Dp][S] (S <= q8rows) x's records down their rows, the W13 wgrad's I,
                                   where the forward's gate/up kernel keeps it (moept__q8_kept; NULL: a
                                   layer that never does, moept__q8_keeps) */
    float *q8sx;                /* its scales */
    uint8_t *q8y;               /* [Dp][S] dy's records down their rows, the W2 wgrad's O, where the down
                                   dgrad writes them (moept__q8_dyc; NULL without q8x, or with
                                   MOEPT_GK_XCOLS 0) */
    float *q8sy;                /* its scales */
    unsigned long long *q8own;  /* device [1]: the a (its address) whose copy down its rows q8a, q8sa hold,
                                   and its forward's x's q8x, q8sx (moept__q8_kept: a training forward's
                                   gate/up kernel's), 0: none; written in stream order by the launches that
                                   change it (moept__q8_own), so a replayed graph keeps it true */
    float *q8out;               /* [max(q8rows, Wp)][Wp] cuBLASLt's fp32 result (NULL: moept__gk_w8) */
    int64_t allocations, allocated_bytes, growths;
    /* held now (moept__cuda_sizes): the parameter block (gradients among them), the fixed workspace
       block, xsh's; the host's: this struct with its slots, pinned and plan blocks */
    int64_t pblock_bytes, work_bytes, xsh_bytes, host_bytes;
};

static moept_status moept__dmalloc(moept__cuda *c, void **p, size_t bytes, char *err) {
    *p = NULL;
    if (bytes == 0) return MOEPT_OK;
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* not left pending for the next step's first check */
        return moept__kfail(err, MOEPT_ERR_DEVICE, "cudaMalloc(%zu bytes): %s", bytes, cudaGetErrorString(e));
    }
    c->allocations++;
    c->allocated_bytes += (int64_t)bytes;
    return MOEPT_OK;
}



/* A slot's blocks freed, its state zero (a slot never used) */
static void moept__slot_free(moept__cslot *sl) {
    cudaFree(sl->fwork);
    cudaFree(sl->rblock);
    free(sl->fhost);
    memset(sl, 0, sizeof *sl);
}

/* the last successful forward's state: what the host reads back (routing, statistics) */
static moept__cslot *moept__last(const moept__cuda *c) { return &c->slots[c->last]; }

/* The layer's device scratch: what a forward or backward writes and reads
   within the call */
static void moept__layout(moept__cuda *c, moept__carve *cv) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t T = p->Tmax, E = p->E, K = p->K, D = p->D, P = p->P;
    const size_t f = sizeof(float);
    const int jit = p->cfg->router_jitter > 0.0f && !p->cfg->inference_only; /* (inference: no noise) */
    c->xj = (float *)moept__take(cv, jit ? (size_t)(T * D) * f : 0);
    c->scratch = (float *)moept__take(cv, (size_t)(T * 2 * E) * f);
    c->cids = (int32_t *)moept__take(cv, (size_t)(T * K) * 4);
    c->lstat = (double *)moept__take(cv, (size_t)MOEPT__NLSTAT(E) * 8);
    const int64_t slen = moept__seq_len(p), nseq = slen > 0 ? T / slen : 0;
    c->seqst = (double *)moept__take(cv, (size_t)(nseq * (2 * E + 2)) * 8);
    c->hist = (int64_t *)moept__take(cv, (size_t)(c->nblk_max * E) * 8);
    c->lrank = (int32_t *)moept__take(cv, (size_t)(T * K) * 4);
    c->kept = (int64_t *)moept__take(cv, (size_t)E * 8);
    c->koff = (int64_t *)moept__take(cv, (size_t)(E + 1) * 8);
    c->msg = (int64_t *)moept__take(cv, (size_t)c->M * 8);
    c->msg_all = (int64_t *)moept__take(cv, (size_t)(P * c->M) * 8);
    c->csel = (unsigned long long *)moept__take(cv, c->C > 1 ? (size_t)(c->C * E) * 8 : 0);
    c->bad = (unsigned long long *)moept__take(cv, 8 * 8);
    c->q8own = (unsigned long long *)moept__take(cv, 8);
    c->gpart = (double *)moept__take(cv, (size_t)MOEPT__NPART * 2 * 8);
    const size_t train = !p->cfg->inference_only;
    c->dsg = (float *)moept__take(cv, train * (size_t)T * f);
    c->dlogits = (float *)moept__take(cv, train * (size_t)(T * E) * f);
    c->d_ptrs = (const void **)moept__take(cv, (size_t)(3 * c->G) * sizeof(void *));
}

static int64_t moept__xrow(const moept__cuda *c);
/* A forward slot's device block: the routing (double-buffered), the plan,
   the send rows and the shared expert's activations */
static void moept__slot_layout(moept__cuda *c, moept__cslot *sl, moept__carve *cv) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t T = p->Tmax, E = p->E, K = p->K, D = p->D, P = p->P;
    const size_t f = sizeof(float), es = (size_t)c->esz;
    sl->xf = (float *)moept__take(cv, p->dtype == MOEPT_DTYPE_BF16 ? (size_t)(T * D) * f : 0);
    const int jit = p->cfg->router_jitter > 0.0f && !p->cfg->inference_only;
    const int64_t slen = moept__seq_len(p), nseq = slen > 0 ? T / slen : 0;
    for (int b = 0; b < 2; b++) {
        sl->jrow[b] = (uint64_t *)moept__take(cv, jit ? (size_t)T * 8 : 0);
        sl->logits[b] = (float *)moept__take(cv, (size_t)(T * E) * f);
        sl->probs[b] = (float *)moept__take(cv, (size_t)(T * E) * f);
        sl->ids[b] = (int32_t *)moept__take(cv, (size_t)(T * K) * 4);
        sl->wts[b] = (float *)moept__take(cv, (size_t)(T * K) * f);
        sl->lse[b] = (float *)moept__take(cv, (size_t)T * f);
        sl->seqg[b] = (float *)moept__take(cv, (size_t)(nseq * E) * f);
    }
    sl->aux_g = (float *)moept__take(cv, (size_t)E * f);
    sl->clstat = (double *)moept__take(cv, c->B ? (size_t)MOEPT__NLSTAT(E) * 8 : 0);
    sl->cmsg = (int64_t *)moept__take(cv, c->B ? (size_t)(P * c->M) * 8 : 0);
    sl->ybad = (unsigned long long *)moept__take(cv, 8);
    const int64_t rows = T * K > E * c->B ? T * K : E * c->B; /* sync-free: E blocks of B rows */
    sl->row_of = (int64_t *)moept__take(cv, (size_t)(T * K) * 8);
    sl->tok_of_row = (int64_t *)moept__take(cv, (size_t)rows * 8);
    sl->xs = moept__take(cv, P > 1 ? (size_t)(rows * moept__xrow(c)) : 0);
    sl->ys = moept__take(cv, P > 1 ? (size_t)(rows * D) * es : 0);
    /* an inference layer keeps nothing for a backward (as moept.c's moept__layout_acts): the shared
       activations over hs, no gradients of the gate, the weights or the logits */
    const size_t train = !p->cfg->inference_only;
    sl->hs = moept__take(cv, (size_t)(T * p->HS) * es);
    sl->as = train ? moept__take(cv, (size_t)(T * p->S) * es) : sl->hs;
    c->lda_as = train ? p->S : p->HS;
    sl->yss = moept__take(cv, p->S > 0 ? (size_t)(T * D) * es : 0);
    sl->sg = (float *)moept__take(cv, (size_t)T * f);
    sl->dwts = (float *)moept__take(cv, train * (size_t)(T * K) * f);
}

static moept_status moept__q8_room(moept__cuda *c, int64_t rows, char *err);
static moept_status moept__host_wait(moept__cuda *c, char *err);
static int moept__gk_gather(const moept__cuda *c);

/* c->q8own (whose copy of a the FP8 scratch holds: moept__q8_kept) = v: always (MOEPT__OWN_SET), where it
   holds a (_IS), or where it does not (_NOT) */
enum { MOEPT__OWN_SET, MOEPT__OWN_IS, MOEPT__OWN_NOT };
__global__ void moept__k_own(unsigned long long *own, int when, unsigned long long a, unsigned long long v) {
    if (when == MOEPT__OWN_SET || (*own == a) == (when == MOEPT__OWN_IS)) *own = v;
}
static unsigned long long moept__u64(const void *p) { return (unsigned long long)(uintptr_t)p; }

/* Makes the receive block hold `need` rows, keeping the committed step's rows; config.fp8's token
   scratch with it (moept__q8_room), so a failure is the growth's, which the ranks agree on. */
static moept_status moept__grow(moept__cuda *c, moept__cslot *sl, int64_t need, char *err) {
    if (need <= sl->Rcap && sl->rblock) return MOEPT_OK;
    int64_t cap = need > 2 * sl->Rcap ? need : 2 * sl->Rcap;
    if (cap < 1) cap = 1;
    const int64_t D = c->sp.D, H = c->sp.H, F = c->sp.F;
    size_t es = (size_t)c->esz;
    /* an inference layer writes a over h and has no backward (moept.c's moept__recv_widths) */
    const int train = !c->sp.cfg->inference_only, chunked = train && c->C > 1;
    const int64_t Fa = train ? F : 0, xb = moept__gk_gather(c) ? 0 : moept__xrow(c); /* (gathered: no xr) */
    const int64_t yb = train && moept__fp8_on(&c->sp) ? moept__q8_recw(D) : 0;
    size_t bytes = (size_t)cap * ((size_t)(D + H + Fa + (chunked ? D + F : 0)) * es + (size_t)(xb + yb)) +
                   7 * 64;
    void *blk = NULL;
    MOEPT__TRY(moept__dmalloc(c, &blk, bytes, err));
    moept_status qs = moept__q8_room(c, cap > c->sp.Tmax ? cap : c->sp.Tmax, err); /* (the shared expert's) */
    if (qs) {
        cudaFree(blk);
        return qs;
    }
    moept__carve cv = {(char *)blk, 0};
    void *xr = moept__take(&cv, (size_t)(cap * xb)), *yr = moept__take(&cv, (size_t)(cap * D) * es);
    void *h = moept__take(&cv, (size_t)(cap * H) * es), *a = moept__take(&cv, (size_t)(cap * Fa) * es);
    void *dar = moept__take(&cv, chunked ? (size_t)(cap * F) * es : 0);
    void *dxr = moept__take(&cv, chunked ? (size_t)(cap * D) * es : 0);
    void *yq = moept__take(&cv, (size_t)(cap * yb)); /* (a backward's: nothing to keep) */
    int64_t keep = sl->fwd_valid ? sl->R : 0;
    cudaError_t e = cudaSuccess;
    if (sl->rblock && moept__fp8_on(&c->sp)) { /* (a's copy in q8a, moept__q8_kept, if of this a: gone with
                                                     the address, which another slot's a may take) */
        MOEPT__LAUNCH(moept__k_own, 1, 1, 0, c->s)(c->q8own, MOEPT__OWN_IS, moept__u64(sl->a), 0);
        e = cudaGetLastError();
    }
    if (keep > 0 && sl->rblock) {
        const cudaMemcpyKind dd = cudaMemcpyDeviceToDevice;
        if (e == cudaSuccess) e = cudaMemcpyAsync(xr, sl->xr, (size_t)(keep * xb), dd, c->s);
        if (e == cudaSuccess) e = cudaMemcpyAsync(yr, sl->yr, (size_t)(keep * D) * es, dd, c->s);
        if (e == cudaSuccess) e = cudaMemcpyAsync(h, sl->h, (size_t)(keep * H) * es, dd, c->s);
        if (e == cudaSuccess && train) e = cudaMemcpyAsync(a, sl->a, (size_t)(keep * F) * es, dd, c->s);
        if (e == cudaSuccess) e = cudaStreamSynchronize(c->s);
    }
    if (e != cudaSuccess) {
        cudaFree(blk);
        return moept__kfail(err, MOEPT_ERR_DEVICE, "growing the receive block: %s", cudaGetErrorString(e));
    }
    if (sl->rblock) cudaFree(sl->rblock);
    sl->rblock = blk;
    sl->xr = xr; sl->yr = yr; sl->h = h; sl->a = train ? a : h; sl->dar = dar; sl->dxr = dxr; sl->yq = yq;
    c->lda_a = train ? F : H;
    if (sl->Rcap > 0) c->growths++;
    sl->rblock_bytes = (int64_t)bytes;
    sl->Rcap = cap;
    return MOEPT_OK;
}

/* n_params rounded up to 64 floats: the gradients and AdamW's v start 16-byte aligned */
static int64_t moept__npad(const moept__cuda *c) { return (c->sp.n_params + 63) / 64 * 64; }

/* What the layer holds by kind (moept.h, moept_mem_kind): on the device the parameter block less the
   gradients, the gradients, the moments, the bf16 and E4M3 weight copies, and the rest (the workspace
   block, the cuBLAS workspaces, FP8's token scratch, the unpadded rows, every slot's blocks, a reshard's
   staging while it lasts); on the host its own blocks (the slots' plan arrays among them) */
static void moept__cuda_sizes(const moept__cuda *c, int64_t *allocations, int64_t *allocated_bytes,
                              int64_t device[MOEPT_MEM_NKINDS], int64_t *host) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t npad = moept__npad(c);
    *allocations = c->allocations;
    *allocated_bytes = c->allocated_bytes;
    device[MOEPT_MEM_GRADS] = c->grads ? npad * 4 : 0;
    device[MOEPT_MEM_PARAMS] = c->pblock_bytes - device[MOEPT_MEM_GRADS];
    device[MOEPT_MEM_MOMENTS] = c->opt_m ? 2 * npad * 4 : 0;
    device[MOEPT_MEM_CASTS] = (c->wlow ? (p->n_params - p->E * p->D) * 2 : 0) + c->q8w_bytes;
    int64_t w = c->work_bytes + (c->blas_ws ? (1 + c->nside) * c->blas_ws_each : 0) + c->q8_bytes;
    w += c->xsh_bytes;
    w += c->rs_stage ? (p->H * p->D + p->D * p->F) * 4 : 0;
    int64_t h = c->host_bytes;
    for (int s = 0; c->slots && s <= c->nslots; s++) {
        w += c->slots[s].fwork_bytes + c->slots[s].rblock_bytes;
        h += c->slots[s].fhost_bytes;
    }
    device[MOEPT_MEM_WORKSPACE] = w;
    *host = h;
}

static int moept__cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) { cudaGetLastError(); return 0; }
    return n;
}

/* The frees below wait for the device: each comm's work is polled first,
   whatever the other's gave (one that times out is aborted, which ends its
   work), so the device has only this rank's own left. */
static void moept__cuda_destroy(moept__cuda *c) {
    if (!c) return;
    moept__on_device on(c->dev, c->probe); /* a lost context: each call below fails, host memory is freed */
    moept_comm *comms[2] = {c->sp.ep, c->sp.dp};
    for (int i = 0; i < 2 && c->blas; i++)
        if (comms[i] && !moept_comm_nccl_aborted(comms[i])) (void)moept__dcomm_wait(comms[i]);
    if (c->blas) (void)cudaStreamSynchronize(c->s);
    if (c->blas) cublasDestroy(c->blas);
    for (int i = 0; i < MOEPT__SIDE; i++) { /* joined to s by events: s's sync covered them */
        if (c->side_blas[i]) cublasDestroy(c->side_blas[i]);
        if (c->side[i]) cudaStreamDestroy(c->side[i]);
        if (c->ev_side[i]) cudaEventDestroy(c->ev_side[i]);
    }
    if (c->lt) cublasLtDestroy(c->lt);
    cudaFree(c->blas_ws); /* after the handles that used it */
    cudaFree(c->q8wblk);
    cudaFree(c->q8blk);
    if (c->ev_fork) cudaEventDestroy(c->ev_fork);
    if (c->ev_compute) cudaEventDestroy(c->ev_compute);
    if (c->ev_comm) cudaEventDestroy(c->ev_comm);
    for (int i = 0; i < 2; i++) {
        if (c->ev_out[i]) cudaEventDestroy(c->ev_out[i]);
        if (c->ev_back[i]) cudaEventDestroy(c->ev_back[i]);
    }
    cudaFree(c->params);
    cudaFree(c->opt_m);
    cudaFree(c->rs_stage);
    cudaFree(c->wlow);
    cudaFree(c->work);
    for (int s = 0; c->slots && s <= c->nslots; s++) moept__slot_free(&c->slots[s]);
    free(c->slots);
    cudaFree(c->xsh);
    cudaFreeHost(c->pinned);
    if (c->probe) cudaStreamDestroy(c->probe);
    free(c->hblock);
    free(c);
}

static void moept__cuda_pointers(moept__cuda *c, float **params, float **grads) {
    c->grads_clean = 0; /* the caller may write them */
    *params = c->params;
    *grads = c->grads;
}

/* bf16 layers: the expert weights' bf16 copy from the fp32 masters (queued
   on s; stale until it launched) */
static cudaError_t moept__cast_weights(moept__cuda *c) {
    const int64_t ED = c->sp.E * c->sp.D, nw = c->sp.n_params - ED;
    const float *src = c->params + ED;
    MOEPT__LAUNCH_V(moept__vec<moept__bf16>(0, src, c->wlow), moept__k_cast, moept__bf16,
                    moept__grid(nw / MOEPT__VEC(moept__bf16) + 1), MOEPT__TB, c->s, src, nw,
                    (moept__bf16 *)c->wlow);
    cudaError_t e = cudaGetLastError();
    c->wlow_stale = e != cudaSuccess;
    return e;
}

/* the device masters were (or may be about to be) written by the caller;
   sync-free: their bf16 copy now, so no forward casts (a captured step
   would freeze whether it does) */
static cudaError_t moept__q8_weights(moept__cuda *c, const moept__adamw_k *ak = NULL);
static void moept__cuda_params_changed(moept__cuda *c) {
    moept__on_device on(c->dev, c->probe);
    c->wlow_stale = 1;
    c->q8_stale = 1;
    c->grads_clean = 0;
    if (c->B && c->wlow) (void)moept__cast_weights(c); /* a failure leaves it stale: the forward casts */
    if (c->B && moept__fp8_on(&c->sp)) (void)moept__q8_weights(c); /* (FP8's copies alike) */
}

/* Every handle's math mode: fp32 stays fp32 (no TF32), and reductions stay in the fp32 compute type
   (cuBLAS Library, "cublasMath_t": CUBLAS_DEFAULT_MATH alone lets a mixed-precision routine reduce in a
   narrower output type, e.g. a bf16 C's, which the bf16 error bound in docs/CUDA.md does not cover) */
#define MOEPT__MATH ((cublasMath_t)(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION))

/* A handle on stream st with its slice of the workspace block. cublasSetStream resets a handle's
   workspace to cuBLAS's default pool (cuBLAS Library, "cublasSetStream()"), so the workspace comes
   after it; a user workspace keeps cuBLAS from allocating one inside a captured graph (memory nodes,
   which child graphs cannot hold: "CUDA Graphs Support"). */
static moept_status moept__blas_handle(moept__cuda *c, cublasHandle_t *h, cudaStream_t st, int slot,
                                       char *err) {
    MOEPT__CB(cublasCreate(h));
    MOEPT__CB(cublasSetStream(*h, st));
    MOEPT__CB(cublasSetMathMode(*h, MOEPT__MATH));
    MOEPT__CB(cublasSetWorkspace(*h, (char *)c->blas_ws + slot * c->blas_ws_each, (size_t)c->blas_ws_each));
    return MOEPT_OK;
}

/* Whether a call of several expert GEMMs can go per expert: bf16 layers (their weight gradients are
   outside the grouped call's type table, and odd widths break its alignment rule) but in the kernel
   form (one launch each), the per-expert and strided forms, and a cuBLAS without the grouped call */
static int moept__side_wanted(const moept__cuda *c) {
    const int f = c->sp.gemm_form, bf16 = c->sp.dtype == MOEPT_DTYPE_BF16;
    if (bf16 && f == MOEPT_GEMM_KERNEL) return 0;
#if CUBLAS_VERSION < 120500
    return 1;
#else
    return bf16 || f == MOEPT_GEMM_PER_EXPERT || f == MOEPT_GEMM_STRIDED;
#endif
}

/* The handles (the compute stream's and, when several experts' GEMMs may go one an expert, up to 4
   side streams') and their workspaces: one device block, counted in the layer's workspace. Its size
   per handle is what cuBLAS Library, "cublasSetWorkspace()" recommends for the architecture: 32 MiB
   on Hopper and Blackwell (compute capability 9 and up), 4 MiB on the others. */
static moept_status moept__blas_create(moept__cuda *c, char *err) {
    const int64_t G = c->G;
#if CUBLAS_VERSION < 120500
    if (c->sp.gemm_form == MOEPT_GEMM_GROUPED)
        return moept__kfail(err, MOEPT_ERR_UNSUPPORTED, "moept_create_cuda: options.gemm_form "
                            "MOEPT_GEMM_GROUPED needs cublasGemmGroupedBatchedEx (cuBLAS 12.5 or later)");
#endif
    c->nside = G > 1 && moept__side_wanted(c) ? (int)(G < MOEPT__SIDE ? G : MOEPT__SIDE) : 0;
    int major = 0;
    MOEPT__CU(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c->dev));
    c->blas_ws_each = (int64_t)(major >= 9 ? 32 : 4) << 20;
    MOEPT__TRY(moept__dmalloc(c, &c->blas_ws, (size_t)((1 + c->nside) * c->blas_ws_each), err));
    MOEPT__TRY(moept__blas_handle(c, &c->blas, c->s, 0, err));
    if (c->nside) MOEPT__CU(cudaEventCreateWithFlags(&c->ev_fork, cudaEventDisableTiming));
    for (int i = 0; i < c->nside; i++) {
        MOEPT__CU(cudaStreamCreateWithFlags(&c->side[i], cudaStreamNonBlocking));
        MOEPT__CU(cudaEventCreateWithFlags(&c->ev_side[i], cudaEventDisableTiming));
        MOEPT__TRY(moept__blas_handle(c, &c->side_blas[i], c->side[i], 1 + i, err));
    }
    return MOEPT_OK;
}

/* Sync-free: the fixed exchange pieces and expert row groups. Rank s's rows
   for slot e = q El + j are block e of its send buffer ([E][B] rows); rank
   q receives them in block j P + s of its receive buffer, so local expert
   j's rows are blocks [j P, (j + 1) P): one group of P B rows. */
static void moept__sf_layout(moept__cuda *c, moept__cslot *sl) {
    const int64_t D = c->sp.D, El = c->sp.El, P = c->sp.P, B = c->B;
    for (int64_t q = 0; q < P; q++)
        for (int64_t j = 0; j < El; j++) {
            sl->send_segs[q * El + j].offset = (q * El + j) * B * D;
            sl->send_segs[q * El + j].count = B * D;
            sl->recv_segs[q * El + j].offset = (j * P + q) * B * D;
            sl->recv_segs[q * El + j].count = B * D;
        }
    for (int64_t j = 0; j <= El; j++) sl->roffsets[j] = j * P * B;
    sl->N = sl->R = c->sp.E * B;
}

/* The host plan arrays' scratch in one block (hblock); with kv->base NULL
   it only measures, as moept__layout */
static void moept__host_layout(moept__cuda *c, moept__carve *kv) {
    const int64_t P = c->sp.P, El = c->sp.El, G = c->G;
    c->grow_ok = (int64_t *)moept__take(kv, (size_t)P * 8);
    c->garr = (int64_t *)moept__take(kv, (size_t)(9 * G) * 8);
    c->descs = (moept__gemm *)moept__take(kv, (size_t)G * sizeof(moept__gemm));
    c->gops = (cublasOperation_t *)moept__take(kv, (size_t)(2 * G) * sizeof(cublasOperation_t));
    c->galpha = (float *)moept__take(kv, (size_t)(2 * G) * sizeof(float));
    if (c->C > 1) {
        c->cruns = (int64_t *)moept__take(kv, (size_t)(3 * G) * 8);
        c->csend = (moept_seg *)moept__take(kv, (size_t)(P * El) * sizeof(moept_seg));
        c->crecv = (moept_seg *)moept__take(kv, (size_t)(P * El) * sizeof(moept_seg));
    }
    const size_t nq = moept__fp8_on(&c->sp) ? (size_t)(2 * P * El) : 0;
    c->q8segs = (moept_seg *)moept__take(kv, nq * sizeof(moept_seg));
}

/* ... and a forward slot's: its plan (fhost) */
static void moept__slot_host_layout(moept__cuda *c, moept__cslot *sl, moept__carve *kv) {
    const int64_t E = c->sp.E, P = c->sp.P, El = c->sp.El, C = c->C;
    sl->counts = (int64_t *)moept__take(kv, (size_t)E * 8);
    sl->offsets = (int64_t *)moept__take(kv, (size_t)(E + 1) * 8);
    sl->rcounts = (int64_t *)moept__take(kv, (size_t)(P * El) * 8);
    sl->roffsets = (int64_t *)moept__take(kv, (size_t)(El + 1) * 8);
    sl->send_segs = (moept_seg *)moept__take(kv, (size_t)(P * El) * sizeof(moept_seg));
    sl->recv_segs = (moept_seg *)moept__take(kv, (size_t)(P * El) * sizeof(moept_seg));
    sl->ccnt = (int64_t *)moept__take(kv, C > 1 ? (size_t)(C * E) * 8 : 0);
    sl->rccnt = (int64_t *)moept__take(kv, C > 1 ? (size_t)(P * C * El) * 8 : 0);
}

/* A slot's buffers, at its first use (its state zero): its device and host
   blocks and the receive rows a create makes (every rank its own Tmax*K
   rows; sync-free: all its blocks, for good) */
static moept_status moept__slot_alloc(moept__cuda *c, moept__cslot *sl, char *err) {
    moept__carve cv = {NULL, 0}, kv = {NULL, 0};
    moept__slot_layout(c, sl, &cv);
    moept__slot_host_layout(c, sl, &kv);
    void *blk = NULL;
    moept_status st = moept__dmalloc(c, &blk, cv.off, err);
    char *hb = st ? NULL : (char *)calloc(1, kv.off);
    if (!st && !hb) {
        cudaFree(blk);
        return moept__kfail(err, MOEPT_ERR_OUT_OF_MEMORY, "out of host memory");
    }
    if (st) return st;
    sl->fwork = blk;
    sl->fwork_bytes = (int64_t)cv.off;
    sl->fhost = hb;
    sl->fhost_bytes = (int64_t)kv.off;
    cv = {(char *)blk, 0};
    kv = {hb, 0};
    moept__slot_layout(c, sl, &cv);
    moept__slot_host_layout(c, sl, &kv);
    sl->T = -1;
    cudaError_t e = cudaMemsetAsync(blk, 0, cv.off, c->s);
    st = e == cudaSuccess ? moept__grow(c, sl, c->B ? c->sp.E * c->B : c->sp.Tmax * c->sp.K, err)
                          : moept__kfail(err, MOEPT_ERR_DEVICE, "cudaMemsetAsync: %s", cudaGetErrorString(e));
    if (st) {
        moept__slot_free(sl);
        return st;
    }
    if (c->B) moept__sf_layout(c, sl);
    return MOEPT_OK;
}

/* Slot s's state, its buffers made at its first use (a failure changes
   nothing); nothing switches: the caller works on the state it got */
static moept_status moept__slot_get(moept__cuda *c, int s, moept__cslot **out, char *err) {
    moept__cslot *sl = &c->slots[s];
    moept_status st = sl->fwork ? MOEPT_OK : moept__slot_alloc(c, sl, err);
    if (!st) *out = sl;
    return st;
}

/* ---- FP8 (config.fp8): DeepSeek-V3's blockwise E4M3 on cuBLASLt ----------
   The operands of each expert GEMM quantized as moept.c's FP8 section does
   (moept__q8_rows, _cols, _blocks: the same tiles, amax, scale and
   rounding, from the shared math), written as E4M3 bytes with their fp32
   scales in the layouts cuBLASLt's block-scaled matmuls read (cuBLAS
   Library, 3.1.4.5 "128-element 1D and 128x128 2D Block Scaling For FP8
   Data Types"): an operand whose op() is r x k keeps VEC128 scales
   [ceil(k/128)][r] and BLK128x128 scales [ceil(r/128)][L4], L4 the k
   blocks rounded up to 4. Every dimension is padded with zeros to 16 (a
   zero changes no tile's amax): cuBLASLt takes M and N multiples of 4, K
   and the leading dimensions multiples of 16 bytes (tests/lt_rules.txt). */
#define MOEPT__Q8_L4(k) ((MOEPT__Q8_L(k) + 3) / 4 * 4)
/* n rows padded to 128: a group's columns in a column pass's one operand [Cp][S] (moept__q8_rg's S) */
#define MOEPT__Q8_P128(n) (MOEPT__Q8_L(n) * MOEPT__Q8_TILE)
/* the bytes of one of x's rows as the experts receive them: a record (config.fp8), or D of T */
static int64_t moept__xrow(const moept__cuda *c) {
    return moept__fp8_on(&c->sp) ? moept__q8_recw(c->sp.D) : c->sp.D * c->esz;
}

/* E4M3 conversions two values at a time: sm_89's cvt where the binary has it (PTX ISA, "Data Movement
   and Conversion Instructions: cvt", .rn.satfinite: the rounding moept__e4m3_round follows), moept.c's
   rules in software where not (sm_80's binary); the same bytes and values either way (tests/test_q8.cu:
   every E4M3 value, the ties between them, saturation, signed zeros). One instruction converts two
   values where the software spends tens of instructions on one. The emulated device runs the path of
   a binary built for its compute capability (moept_emu_arch; a default build's sm_80 code on 8.9). */
#if !defined(MOEPT_CUDA_EMU_KERNELS_H) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define MOEPT__SM89 1
#else
#define MOEPT__SM89 0
#endif
/* lo's and hi's E4M3 bytes, lo's in bits 0-7 and hi's in 8-15 */
__device__ __forceinline__ uint32_t moept__e4m3x2(float lo, float hi) {
#if MOEPT__SM89
    uint16_t d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
#else
#if defined(MOEPT_CUDA_EMU_KERNELS_H)
    if (moept_emu_arch() >= 89) return moept_emu_cvt_e4m3x2_f32(hi, lo);
#endif
    return (uint32_t)moept__e4m3_byte(moept__e4m3_round(hi)) << 8 | moept__e4m3_byte(moept__e4m3_round(lo));
#endif
}
/* the values of E4M3 bytes b: bits 0-7's in .x, 8-15's in .y (through f16, which holds every E4M3 value) */
__device__ __forceinline__ float2 moept__e4m3x2_f32(uint32_t b) {
#if MOEPT__SM89
    uint32_t h;
    float lo, hi;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((uint16_t)b));
    asm("{.reg .b16 l, u;\n\tmov.b32 {l, u}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, u;}"
        : "=f"(lo), "=f"(hi) : "r"(h));
    return make_float2(lo, hi);
#else
#if defined(MOEPT_CUDA_EMU_KERNELS_H)
    if (moept_emu_arch() >= 89) {
        const uint32_t h = moept_emu_cvt_f16x2_e4m3x2((uint16_t)b);
        return make_float2(moept_emu_cvt_f32_f16((uint16_t)h), moept_emu_cvt_f32_f16((uint16_t)(h >> 16)));
    }
#endif
    return make_float2(moept__e4m3_f32((uint8_t)b), moept__e4m3_f32((uint8_t)(b >> 8)));
#endif
}
/* v0's and v1's E4M3 bytes in a tile of scale sc (v0's low) */
__device__ __forceinline__ uint32_t moept__q8_pair(float v0, float v1, float sc) {
    return moept__e4m3x2(v0 / sc, v1 / sc);
}
/* 0xff in each of a word's 4 bytes whose bit is set in live's bits 0-3 */
__device__ __forceinline__ uint32_t moept__q8_bytes(int live) {
    uint32_t m = 0;
    for (int e = 0; e < 4; e++) m |= (uint32_t)(live >> e & 1) * (0xffu << (8 * e));
    return m;
}

/* v's 4 E4M3 bytes in one word (the first lowest: little-endian), each zero where its live bit is off */
__device__ __forceinline__ uint32_t moept__q8_word(const float *v, int live, float sc) {
    return (moept__q8_pair(v[0], v[1], sc) | moept__q8_pair(v[2], v[3], sc) << 16) & moept__q8_bytes(live);
}
/* ... v's 16 in 16 bytes (live's bits 0-15) */
__device__ __forceinline__ uint4 moept__q8_16(const float *v, int live, float sc) {
    return make_uint4(moept__q8_word(v, live, sc), moept__q8_word(v + 4, live >> 4, sc),
                      moept__q8_word(v + 8, live >> 8, sc), moept__q8_word(v + 12, live >> 12, sc));
}

#define MOEPT__Q8_G 64 /* a quantizing pass's groups (experts) a launch */
/* A quantizing pass's groups (an expert's rows each), one a grid row (blockIdx.y): group g the rows
   [r0[g], r0[g] + n[g]) of the source; its operand the output's padded rows from o[g] (each group's rows
   padded to 16, one group after another), its scales a dense [L][np] from L o[g], or (a column pass's,
   transposed: moept__q8_gnext) [Cp][np] from Cp o[g], scales [ceil(np/128)][Cp] from Cp lb[g], or (S >
   0, the grouped kernel's wgrad, moept__q8_wgrad) every group's columns of one [Cp][S], group g's from
   column o[g], its rows padded to 128; ng 0 (a row pass): one operand, as the kernel's own arguments say */
typedef struct moept__q8_rg {
    int64_t r0[MOEPT__Q8_G], o[MOEPT__Q8_G], lb[MOEPT__Q8_G];
    int32_t n[MOEPT__Q8_G];
    int ng;
    int64_t S;
} moept__q8_rg;
/* groups g0.. of ng (offs [ng + 1]: group g the rows [offs[g], offs[g + 1])), at most MOEPT__Q8_G, into
   *G, their operands from at = {padded rows, 128-row blocks} on (advanced past them); the most rows of
   one */
static int64_t moept__q8_rgroups(const int64_t *offs, int64_t ng, int64_t g0, moept__q8_rg *G,
                                 int64_t at[2]) {
    int64_t most = 0;
    G->ng = (int)(ng - g0 < MOEPT__Q8_G ? ng - g0 : MOEPT__Q8_G);
    for (int i = 0; i < G->ng; i++) {
        const int64_t n = offs[g0 + i + 1] - offs[g0 + i];
        G->r0[i] = offs[g0 + i], G->n[i] = (int32_t)n, G->o[i] = at[0], G->lb[i] = at[1];
        at[0] += G->S ? MOEPT__Q8_P128(n) : MOEPT__Q8_PAD(n);
        at[1] += MOEPT__Q8_L(MOEPT__Q8_PAD(n));
        most = n > most ? n : most;
    }
    return most;
}
/* each launch of a row pass: launch(G, nw, gy) for ng groups of offs (MOEPT__Q8_G a launch, G the
   launch's, nw its most rows padded, gy its groups: the grid's rows), or (offs NULL) once for one
   operand of n rows (G.ng 0; nw n padded unless ss: rows of a larger operand); S: G.S */
template <typename Launch>
static moept_status moept__q8_each(const int64_t *offs, int64_t ng, int64_t n, int64_t ss, char *err,
                                   Launch launch, int64_t S = 0) {
    moept__q8_rg G = {};
    G.S = S;
    int64_t at[2] = {0, 0};
    for (int64_t g0 = 0; g0 < (offs ? ng : 1); g0 += MOEPT__Q8_G) {
        const int64_t nw = offs ? MOEPT__Q8_PAD(moept__q8_rgroups(offs, ng, g0, &G, at))
                                : ss ? n : MOEPT__Q8_PAD(n);
        launch(G, nw, offs ? (unsigned)G.ng : 1u);
        MOEPT__LAUNCHED();
    }
    return MOEPT_OK;
}

/* 16 columns j.. of a row p (NULL: zeros), those under K live: into v (the rest zero), V-vectors where
   the row holds them; the live ones' bits */
template <typename T, int V>
__device__ __forceinline__ int moept__q8_ld16(const T *p, int j, int K, float *v) {
    int live = 0;
    if (V > 1 && p && j + 16 <= K) {
        for (int c = 0; c < 16; c += V) moept__ldv<V>(p + j + c, v + c);
        return 0xffff;
    }
    for (int e = 0; e < 16; e++) {
        const int in = p && j + e < K;
        v[e] = in ? moept__ld(p, (int64_t)j + e) : 0.0f;
        live |= in << e;
    }
    return live;
}
/* the scale of the 1 x 128 tile whose 16 values v are thread l's of 8 adjacent threads (every thread of
   the block calls it): the tile's amax from the 8 partial ones through sh's half h, one barrier a round
   (the next round writes the other half: this one's reads are done by the one after's barrier) */
__device__ __forceinline__ float moept__q8_tile(const float *v, float (*sh)[MOEPT__TB], int h, int l) {
    float amax = 0.0f;
    for (int e = 0; e < 16; e++) amax = moept__q8_amax(amax, v[e]);
    sh[h][threadIdx.x] = amax;
    __syncthreads();
    for (int u = 0; u < 8; u++) amax = moept__q8_amax(amax, sh[h][threadIdx.x - l + u]);
    return moept__q8_scale(amax);
}

/* Rows r < nw of src (row idx[r], -1 zeros; idx NULL: row r; rows from n on zeros), their first K
   columns, lds apart, into 1 x 128 tiles: q [nw][ldq] E4M3 (columns K to Kp zero), tile b's scale at
   s[r srs + b sbs] (srs 1, sbs >= nw: VEC128 of an operand whose op() is sbs x Kp; or an FP8 record's,
   moept__q8_recw, whose bytes from tail to ldq, its padding, are zeroed). A tile
   is 8 threads' 16 adjacent columns each (Kp a multiple of 16: all in or all out), read in V-vectors
   where the row holds them, the tile's amax through shared memory (moept__q8_tile), 16 bytes written a
   thread: a block's round reads MOEPT__TB / 8 tiles. G.ng > 0: group blockIdx.y's rows (idx NULL) into
   its own operand (moept__q8_rg) */
template <typename T, int V>
__global__ void moept__k_q8_rows(const T *src, const int64_t *idx, int64_t n, int K, int64_t lds, int64_t nw,
                                 int Kp, uint8_t *q, int64_t ldq, float *s, int64_t srs, int64_t sbs,
                                 int64_t tail, const moept__q8_rg G) {
    __shared__ float sh[2][MOEPT__TB];
    const int L = MOEPT__Q8_L(Kp), l = (int)threadIdx.x % 8, tb = MOEPT__TB / 8;
    if (G.ng) {
        const int g = (int)blockIdx.y;
        src += G.r0[g] * lds, n = G.n[g], nw = MOEPT__Q8_PAD(n), q += G.o[g] * ldq, s += G.o[g] * L, sbs = nw;
    }
    const int64_t nt = nw * L;
    int h = 0;
    for (int64_t t = (int64_t)blockIdx.x * tb; t < nt; t += (int64_t)gridDim.x * tb, h ^= 1) {
        const int64_t i = t + threadIdx.x / 8, r = i / L;
        const int b = (int)(i % L), j = b * MOEPT__Q8_TILE + 16 * l;
        const int out = i < nt && j < Kp;
        const int64_t sr = !out || r >= n ? -1 : idx ? idx[r] : r; /* the source row (-1: zeros) */
        float v[16];
        const int live = moept__q8_ld16<T, V>(sr >= 0 ? src + sr * lds : NULL, j, K, v);
        const float sc = moept__q8_tile(v, sh, h, l);
        if (out) *(uint4 *)(q + r * ldq + j) = moept__q8_16(v, live, sc);
        if (out && l == 0) s[r * srs + b * sbs] = sc;
        for (int64_t t = tail; out && l == 0 && b == L - 1 && t < ldq; t++) q[r * ldq + t] = 0;
    }
}

/* config.fp8's combine backward, one block per assignment i = (t, k) of TK (K a token): dwts [TK],
   dwts[i] = <ys[row], dy[t]> (ys [rows][D] the outputs, dy [T][D], row = row_of[i], -1: none; double,
   per thread in order, then a fixed tree: moept__k_combine_bwd's way, its own columns a thread), and the
   row's record in rec [rows][moept__q8_recw(D)] of w dy[t], w = wts[i] (moept__k_q8_rows' tiles, bytes
   and padding, of the product as moept__scale rounds it), in one read of dy; block TK + r: row r's zero
   record where no assignment has it (tok_of_row [rows], -1: the sync-free blocks' unused rows) */
template <typename T, int V>
__global__ void moept__k_combine_bwd8(const T *ys, const int64_t *row_of, const float *wts, const T *dy,
                                      int D, int K, int64_t TK, const int64_t *tok_of_row, uint8_t *rec,
                                      float *dwts) {
    __shared__ float sh[2][MOEPT__TB];
    __shared__ double sd[MOEPT__TB];
    const int64_t i = blockIdx.x, r = i < TK ? row_of[i] : tok_of_row[i - TK] < 0 ? i - TK : -1;
    if (r < 0) {
        if (i < TK && threadIdx.x == 0) dwts[i] = 0.0f;
        return;
    }
    const int Dp = MOEPT__Q8_PAD(D), L = MOEPT__Q8_L(D), l = (int)threadIdx.x % 8;
    const T *g = i < TK ? dy + i / K * D : NULL; /* (NULL: zeros) */
    const float w = i < TK ? wts[i] : 0.0f;
    uint8_t *q = rec + r * moept__q8_recw(D);
    double acc = 0.0;
    int h = 0;
    for (int b0 = 0; b0 < L; b0 += MOEPT__TB / 8, h ^= 1) { /* (a round: 32 tiles, 8 threads a tile) */
        const int b = b0 + (int)threadIdx.x / 8, j = b * MOEPT__Q8_TILE + 16 * l, out = b < L && j < Dp;
        float v[16], u[16];
        const int live = moept__q8_ld16<T, V>(out ? g : NULL, j, D, v);
        moept__q8_ld16<T, V>(out && g ? ys + r * D : NULL, j, D, u);
        for (int e = 0; e < 16; e++) {
            acc += (double)u[e] * (double)v[e];
            v[e] = moept__scale(w, v[e]);
        }
        const float sc = moept__q8_tile(v, sh, h, l);
        if (out) *(uint4 *)(q + j) = moept__q8_16(v, live, sc);
        if (out && l == 0) ((float *)(q + Dp))[b] = sc;
    }
    for (int64_t t = Dp + 4 * L + threadIdx.x; t < moept__q8_recw(D); t += MOEPT__TB) q[t] = 0;
    acc = moept__block_sum(acc, sd);
    if (i < TK && threadIdx.x == 0) dwts[i] = (float)acc;
}

/* The wgrad's operands, group blockIdx.y's of G (moept__q8_rg): columns c < C of its n rows of src (lds
   apart), transposed, in 128 x 1 tiles down the rows: q [Cp][np] (column c's values along row c; padding
   zero; G.S: its columns of q [Cp][G.S], padded to 128), s [ceil(np/128)][Cp]. src's values as they are, or
   (T uint8_t, rs) FP8 records' (moept__q8_recw): E4M3 bytes times their row's 1 x 128 scales, rs[r rsr + c
   / 128] (the dequantized rows the experts received, quantized again down the columns, DeepSeek-V3's
   workflow for a wgrad's x). A block (of its group's grid row) a panel of 128 rows x W columns (a row's W
   values 128 bytes): read along the rows in V-vectors where the rows hold them (8 threads a row) into
   shared memory as they are, each row's 32 words rotated by 4 a 16-row chunk (moept__q8_pan); then 8
   threads a column, 16 rows each (a warp 4 columns: the 8 chunks' words fall in distinct banks), its amax
   from their 8 partial ones, each thread's 16 bytes of q stored, a column's 128 contiguous. RW (bf16): also
   the rows' own copy along them from the same read, the dgrad's operand (moept__k_q8_rows' bytes and
   scales: qr [rows][Cp] by src's rows, tile b's scale at sr[r + b srb], the rows past a group's not
   written): a block's panels then the 128 columns of one tile */
template <typename T>
__device__ __forceinline__ int moept__q8_pan(int rr, int c) { /* element (rr, c)'s index in the panel */
    constexpr int S = (int)sizeof(T), PW = 132 / S; /* (a row 33 words apart) */
    const int b = c * S, w = ((b >> 2) + 4 * (rr / 16)) & 31;
    return rr * PW + (4 * w + (b & 3)) / S;
}
/* moept__k_q8_cols' RW: rows y + 32 k of the panels (a 128-column tile from c0), columns 16 x.. of each
   (8 threads a row: x, y the thread's), quantized along the row, the amax through rpart */
template <typename T, int W, int PL>
__device__ __forceinline__ void moept__q8_panrows(const T *pan, float (*rpart)[MOEPT__TB], int64_t r0, int c0,
                                                  int64_t n, int C, int Cp, uint8_t *qr, float *sr,
                                                  int64_t srb) {
    const int x = (int)threadIdx.x % 8, y = (int)threadIdx.x / 8, pc = 16 * x % W, j = c0 + 16 * x;
    const T *pp = pan + 16 * x / W * PL;
    float am[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        am[k] = 0.0f;
        for (int e = 0; e < 16; e++)
            am[k] = moept__q8_amax(am[k], moept__ld(pp, moept__q8_pan<T>(y + 32 * k, pc + e)));
        rpart[k][threadIdx.x] = am[k];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int64_t r = r0 + y + 32 * k;
        for (int u = 0; u < 8; u++) am[k] = moept__q8_amax(am[k], rpart[k][threadIdx.x - x + u]);
        const float sc = moept__q8_scale(am[k]);
        float v[16];
        int live = 0;
        for (int e = 0; e < 16; e++) {
            v[e] = moept__ld(pp, moept__q8_pan<T>(y + 32 * k, pc + e));
            live |= (j + e < C) << e;
        }
        if (r < n && j < Cp) *(uint4 *)(qr + r * Cp + j) = moept__q8_16(v, live, sc);
        if (r < n && j < Cp && x == 0) sr[r + (c0 / MOEPT__Q8_TILE) * srb] = sc;
    }
}
template <typename T, int V, int RW = 0>
__global__ void moept__k_q8_cols(const T *src, const moept__q8_rg G, int C, int64_t lds, int Cp, uint8_t *q,
                                 float *s, const float *rs, int64_t rsr, uint8_t *qr, float *sr, int64_t srb,
                                 const unsigned long long *own, unsigned long long mine) {
    if (own && *own == mine) return; /* (q holds it already: moept__q8_kept) */
    constexpr int W = 128 / (int)sizeof(T), w = W / 8; /* w: a thread's columns of a row, 16 bytes */
    constexpr int NP = RW ? MOEPT__Q8_TILE / W : 1, PL = MOEPT__Q8_TILE * (132 / (int)sizeof(T));
    static_assert(MOEPT__TB == 256, "moept__k_q8_cols: 8 warps of 4 columns x 8 chunks, 8 threads a row");
    static_assert(!RW || sizeof(T) == 2, "moept__k_q8_cols: the rows' copy from bf16 (two panels a tile)");
    __shared__ __align__(16) T pan[NP * PL]; /* NP panels of 128 rows x W columns */
    __shared__ float part[2][MOEPT__TB];
    __shared__ float rsc[MOEPT__Q8_TILE]; /* records: the panel's rows' scales (its 128 columns: one tile) */
    __shared__ float rpart[RW ? 4 : 1][MOEPT__TB]; /* RW: each thread's 4 rows' partial amaxes */
    const int nc = (Cp + NP * W - 1) / (NP * W);
    const int x = (int)threadIdx.x % 8, y = (int)threadIdx.x / 8;
    const int g = (int)blockIdx.y;
    const int64_t n = G.n[g], np = MOEPT__Q8_PAD(n), ldq = G.S ? G.S : np; /* (q's row stride) */
    const int64_t npw = G.S ? MOEPT__Q8_P128(n) : np; /* (its columns written) */
    src += G.r0[g] * lds, q += G.S ? G.o[g] : G.o[g] * Cp, s += G.lb[g] * Cp;
    if (sizeof(T) == 1) rs += G.r0[g] * rsr;
    if constexpr (RW) qr += G.r0[g] * Cp, sr += G.r0[g];
    for (int64_t t = blockIdx.x; t < MOEPT__Q8_L(np) * nc; t += gridDim.x) {
        const int64_t b = t / nc, r0 = b * MOEPT__Q8_TILE;
        const int c0 = (int)(t % nc) * NP * W;
        for (int p = 0; p < NP; p++)
            for (int rr = y; rr < MOEPT__Q8_TILE; rr += MOEPT__TB / 8) {
                const int64_t r = r0 + rr;
                const int c = c0 + p * W + w * x;
                T *pp = pan + p * PL;
                if (sizeof(T) == 1 && x == 0) rsc[rr] = r < n ? rs[r * rsr + c0 / MOEPT__Q8_TILE] : 0.0f;
                if (V > 1 && r < n && c + w <= C) { /* (its 4 words stay together: rotated by 4) */
                    const uint4 u = *(const uint4 *)(src + r * lds + c);
                    const uint32_t uw[4] = {u.x, u.y, u.z, u.w};
                    for (int e = 0; e < 4; e++) ((uint32_t *)(pp + moept__q8_pan<T>(rr, w * x)))[e] = uw[e];
                } else {
                    for (int e = 0; e < w; e++)
                        pp[moept__q8_pan<T>(rr, w * x + e)] =
                            r < n && c + e < C ? src[r * lds + c + e] : (T)0;
                }
            }
        __syncthreads();
        if constexpr (RW)
            moept__q8_panrows<T, W, PL>(pan, rpart, r0, c0, n, C, Cp, qr, sr, srb);
        for (int p = 0; p < NP * W / 32; p++) { /* 32 columns a pass: column y of the pass, its rows 16 x.. */
            const int cc = y + 32 * p, c = c0 + cc;
            const T *pp = pan + cc / W * PL;
            const int64_t r = r0 + 16 * x;
            float v[16], amax = 0.0f;
            int live = 0;
            for (int e = 0; e < 16; e += 2) {
                const int a0 = moept__q8_pan<T>(16 * x + e, cc % W);
                const int a1 = moept__q8_pan<T>(16 * x + e + 1, cc % W);
                if constexpr (sizeof(T) == 1) {
                    const float2 d = moept__e4m3x2_f32(pp[a0] | (uint32_t)pp[a1] << 8);
                    v[e] = d.x * rsc[16 * x + e], v[e + 1] = d.y * rsc[16 * x + e + 1];
                } else {
                    v[e] = moept__ld(pp, a0), v[e + 1] = moept__ld(pp, a1);
                }
            }
            for (int e = 0; e < 16; e++) {
                live |= (c < C && r + e < n) << e;
                amax = moept__q8_amax(amax, v[e]);
            }
            part[p & 1][threadIdx.x] = amax;
            __syncthreads(); /* (the next pass writes the other half: this one's reads are done by its
                                barrier) */
            for (int u = 0; u < 8; u++) amax = moept__q8_amax(amax, part[p & 1][8 * y + u]);
            const float sc = moept__q8_scale(amax);
            if (c < Cp && r < npw) *(uint4 *)(q + (int64_t)c * ldq + r) = moept__q8_16(v, live, sc);
            if (c < Cp && x == 0) s[c + b * Cp] = sc;
        }
        __syncthreads(); /* pan read by all before the next panel */
    }
}

/* Rows r < nw of FP8 records rec (moept__q8_recw(Kp) bytes apart; rows from n on zeros) as a matmul's
   operand along K, their bytes and scales as they are: q [nw][Kp], tile b's scale at s[b sbs + r]
   (moept__k_q8_rows' layout, srs 1); G.ng > 0: group blockIdx.y's (moept__q8_rg) */
__global__ void moept__k_q8_unrec(const uint8_t *rec, int64_t n, int64_t nw, int Kp, uint8_t *q, float *s,
                                  int64_t sbs, const moept__q8_rg G) {
    const int L = MOEPT__Q8_L(Kp), per = Kp / 16 + L; /* a row's 16-byte pieces, then its scales */
    const int64_t W = moept__q8_recw(Kp);
    if (G.ng) {
        const int g = (int)blockIdx.y;
        rec += G.r0[g] * W, n = G.n[g], nw = MOEPT__Q8_PAD(n), q += G.o[g] * Kp, s += G.o[g] * L, sbs = nw;
    }
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nw * per;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / per;
        const int j = (int)(i % per);
        if (j < Kp / 16)
            *(uint4 *)(q + r * Kp + 16 * j) = r < n ? *(const uint4 *)(rec + r * W + 16 * j)
                                                    : make_uint4(0, 0, 0, 0);
        else
            s[(j - Kp / 16) * sbs + r] = r < n ? ((const float *)(rec + r * W + Kp))[j - Kp / 16]
                                               : moept__q8_scale(0.0f);
    }
}

/* One 128 x 128 block (i0, j0) of a weight [M][K] in E4M3, whose copies are q [Mp][Kp] as it is and qt
   [Kp][Mp] transposed (the dgrad's A; both padded to 16 with zero bytes), from its values in the threads'
   registers: v[k][u] the element (i0 + y + 8 k, j0 + 4 x + u), x the thread's lane, y its warp (zero past
   M or K). The block's amax through w->sh (a fixed tree), its bytes along q's rows and, through w->qb,
   along qt's (4 bytes a store), its scale at *s and *st */
#define MOEPT__Q8_WR (MOEPT__Q8_TILE / (MOEPT__TB / 32)) /* a thread's rows of a block (8 warps) */
typedef struct moept__q8_wsh {
    float sh[MOEPT__TB];
    uint8_t qb[MOEPT__Q8_TILE][MOEPT__Q8_TILE + 1]; /* (rows 129 bytes apart: a lane's 4 rows a column,
                                                       the lanes' in distinct banks) */
} moept__q8_wsh;
__device__ __forceinline__ void moept__q8_wblock(const float (*v)[4], int M, int K, int Mp, int Kp, int i0,
                                                 int j0, uint8_t *q, uint8_t *qt, float *s, float *st,
                                                 moept__q8_wsh *w) {
    static_assert(MOEPT__TB == 256, "moept__q8_wblock: 8 warps of 32 lanes, 4 columns a lane");
    const int x = (int)threadIdx.x % 32, y = (int)threadIdx.x / 32;
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < MOEPT__Q8_WR; k++)
#pragma unroll
        for (int u = 0; u < 4; u++) amax = moept__q8_amax(amax, v[k][u]);
    w->sh[threadIdx.x] = amax;
    __syncthreads();
    for (int h = MOEPT__TB / 2; h > 0; h >>= 1) {
        if ((int)threadIdx.x < h)
            w->sh[threadIdx.x] = moept__q8_amax(w->sh[threadIdx.x], w->sh[threadIdx.x + h]);
        __syncthreads();
    }
    const float sc = moept__q8_scale(w->sh[0]);
#pragma unroll
    for (int k = 0; k < MOEPT__Q8_WR; k++) {
        const int r = y + 8 * k, i = i0 + r, j = j0 + 4 * x;
        const int nk = K - j, live = i >= M || nk <= 0 ? 0 : nk >= 4 ? 15 : (1 << nk) - 1;
        const uint32_t word = moept__q8_word(v[k], live, sc); /* (padding: zero bytes, a NaN block's too) */
#pragma unroll
        for (int u = 0; u < 4; u++) w->qb[r][4 * x + u] = (uint8_t)(word >> (8 * u));
        if (i < Mp && j < Kp) *(uint32_t *)(q + (int64_t)i * Kp + j) = word;
    }
    __syncthreads();
    for (int k = 0; k < MOEPT__Q8_WR; k++) { /* qt's row j: the block's column c, 4 of its rows a lane */
        const int c = y + 8 * k, j = j0 + c, i = i0 + 4 * x;
        uint32_t word = 0;
        for (int u = 0; u < 4; u++) word |= (uint32_t)w->qb[4 * x + u][c] << (8 * u);
        if (j < Kp && i < Mp) *(uint32_t *)(qt + (int64_t)j * Mp + i) = word;
    }
    if (threadIdx.x == 0) *s = sc, *st = sc;
    __syncthreads(); /* sh[0] and qb read by all before the next block */
}

/* Weights: nw matrices w [nw][M][K] (fp32 masters) in 128 x 128 blocks, one thread block a block, into
   their E4M3 copies q [nw][Mp][Kp] and qt [nw][Kp][Mp] (moept__q8_wblock), the blocks' scales into s
   [nw][ceil(Mp/128)][L4(Kp)] and st [nw][ceil(Kp/128)][L4(Mp)] (BLK128x128 of each). A (AdamW's own
   pass: moept__cuda_adamw): each element stepped first (moept__adamw1 with g, m, v; low, where not NULL,
   its bf16 copy), the copies made from the new values as they are in registers, so the masters are
   read once; V-vectors (4) where the rows hold them */
typedef struct moept__q8_wargs { /* (A: g, m, v, k, low) */
    float *w;
    const float *g;
    float *m, *v;
    moept__adamw_k k;
    moept__bf16 *low;
} moept__q8_wargs;
template <int V, int A>
__global__ void moept__k_q8_blocks(const moept__q8_wargs a, int64_t nw, int M, int K, int Mp, int Kp,
                                   uint8_t *q, float *s, uint8_t *qt, float *st) {
    __shared__ moept__q8_wsh sh;
    float *w = a.w;
    const int TL = MOEPT__Q8_TILE, x = (int)threadIdx.x % 32, y = (int)threadIdx.x / 32;
    const int bm = (Mp + TL - 1) / TL, bk = (Kp + TL - 1) / TL;
    const int64_t ns = (int64_t)bm * MOEPT__Q8_L4(Kp), nst = (int64_t)bk * MOEPT__Q8_L4(Mp);
    for (int64_t t = blockIdx.x; t < nw * bm * bk; t += gridDim.x) {
        const int64_t e = t / (bm * bk);
        const int i0 = (int)(t % (bm * bk) / bk) * TL, j0 = (int)(t % bk) * TL;
        float vals[MOEPT__Q8_WR][4]; /* (registers: every loop over them unrolled) */
#pragma unroll
        for (int k = 0; k < MOEPT__Q8_WR; k++) {
            const int i = i0 + y + 8 * k, j = j0 + 4 * x;
            const int n = i < M && j < K ? (K - j < 4 ? K - j : 4) : 0; /* (its live columns) */
            const int64_t at = (e * M + i) * K + j;
            float pv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if constexpr (A) moept__adamw_n<V>(w + at, a.g + at, a.m + at, a.v + at, n, a.k,
                                               a.low ? a.low + at : NULL, pv);
#pragma unroll
            for (int u = 0; u < 4; u++) vals[k][u] = u < n ? A ? pv[u] : w[at + u] : 0.0f;
        }
        moept__q8_wblock(vals, M, K, Mp, Kp, i0, j0, q + e * Mp * Kp, qt + e * Kp * Mp,
                         s + e * ns + i0 / TL * MOEPT__Q8_L4(Kp) + j0 / TL,
                         st + e * nst + j0 / TL * MOEPT__Q8_L4(Mp) + i0 / TL, &sh);
    }
}

/* A matmul's fp32 result out [n][ldo] (its first m columns) into rows of T dst [n][ldd], or (acc) added
   to fp32 dst (the weight gradients); V-vectors of T where the rows hold them. G.ng > 0: group
   blockIdx.y's result rows (from o[g], moept__q8_rg) into its rows of dst */
template <typename T, int V>
__global__ void moept__k_q8_out(const float *out, int64_t n, int m, int ldo, T *dst, int64_t ldd, int acc,
                                const moept__q8_rg G) {
    if (G.ng) {
        const int g = (int)blockIdx.y;
        out += G.o[g] * ldo, n = G.n[g], dst += G.r0[g] * ldd;
    }
    MOEPT__ROWS(r, n) MOEPT__LANES(j, m, V) {
        float v[V], g[V];
        moept__ldv<V>(out + r * ldo + j, v);
        if (acc) {
            float *d = (float *)dst + r * ldd + j;
            moept__ldv<V>(d, g);
            for (int l = 0; l < V; l++) g[l] += v[l];
            moept__stv<V>(d, g);
        } else {
            moept__stv<V>(dst + r * ldd + j, v);
        }
    }
}

/* The widest padded operand width, D and the experts' (a weight set's H >= F) */
static int64_t moept__q8_wp(const moept__cuda *c) {
    int64_t w = MOEPT__Q8_PAD(c->sp.D);
    for (int i = 0; i < 2; i++) w = c->q8w[i].Hp > w ? c->q8w[i].Hp : w;
    return w;
}

/* The weight sets' copies in one block (with cv->base NULL: measured) */
static void moept__q8w_layout(moept__cuda *c, moept__carve *cv) {
    const int64_t Dp = MOEPT__Q8_PAD(c->sp.D);
    for (int i = 0; i < 2; i++) {
        moept__q8w *w = &c->q8w[i];
        const size_t n = (size_t)w->n;
        w->w13 = (uint8_t *)moept__take(cv, n * (size_t)(w->Hp * Dp));
        w->w13t = (uint8_t *)moept__take(cv, n * (size_t)(w->Hp * Dp));
        w->w2 = (uint8_t *)moept__take(cv, n * (size_t)(Dp * w->Fp));
        w->w2t = (uint8_t *)moept__take(cv, n * (size_t)(Dp * w->Fp));
        w->s13 = (float *)moept__take(cv, n * (size_t)w->ns13 * 4);
        w->s13t = (float *)moept__take(cv, n * (size_t)w->ns13t * 4);
        w->s2 = (float *)moept__take(cv, n * (size_t)w->ns2 * 4);
        w->s2t = (float *)moept__take(cv, n * (size_t)w->ns2t * 4);
    }
}

/* config.fp8 at create: the cuBLASLt handle and the weight copies (zeroed: the scales' padding too) */
static moept_status moept__q8_create(moept__cuda *c, char *err) {
    const moept__cuda_spec *p = &c->sp;
    if (!moept__fp8_on(p)) return MOEPT_OK;
#if CUBLAS_VERSION < 120900
    return moept__kfail(err, MOEPT_ERR_UNSUPPORTED, "moept_create_cuda: config.fp8 needs cuBLASLt's "
                        "block-scaled FP8 matmuls (cuBLAS 12.9 or later); this build has %d", CUBLAS_VERSION);
#endif
    MOEPT__CB(cublasLtCreate(&c->lt));
    const int64_t Dp = MOEPT__Q8_PAD(p->D), TL = MOEPT__Q8_TILE;
    const int64_t n[2] = {p->El, p->S > 0 ? 1 : 0}, H[2] = {p->H, p->HS}, F[2] = {p->F, p->S};
    const int64_t o13[2] = {p->off13, p->offs13}, o2[2] = {p->off2, p->offs2};
    for (int i = 0; i < 2; i++) {
        moept__q8w *w = &c->q8w[i];
        w->n = n[i]; w->H = H[i]; w->F = F[i]; w->off13 = o13[i]; w->off2 = o2[i];
        w->Hp = MOEPT__Q8_PAD(w->H); w->Fp = MOEPT__Q8_PAD(w->F);
        w->ns13 = (w->Hp + TL - 1) / TL * MOEPT__Q8_L4(Dp);
        w->ns13t = (Dp + TL - 1) / TL * MOEPT__Q8_L4(w->Hp);
        w->ns2 = (Dp + TL - 1) / TL * MOEPT__Q8_L4(w->Fp);
        w->ns2t = (w->Fp + TL - 1) / TL * MOEPT__Q8_L4(Dp);
    }
    moept__carve cv = {NULL, 0};
    moept__q8w_layout(c, &cv);
    MOEPT__TRY(moept__dmalloc(c, &c->q8wblk, cv.off, err));
    MOEPT__CU(cudaMemsetAsync(c->q8wblk, 0, cv.off, c->s));
    c->q8w_bytes = (int64_t)cv.off;
    cv.base = (char *)c->q8wblk;
    cv.off = 0;
    moept__q8w_layout(c, &cv);
    c->q8_stale = 1;
    return MOEPT_OK;
}

/* whether AdamW's 4-vectors of the parameters from a on are aligned: the masters, gradients and moments
   (16 bytes), the bf16 copy from e0 = E D (8) */
static int moept__adamw_v4(const moept__cuda *c, int64_t a) {
    return a % 4 == 0 && c->sp.E * c->sp.D % 4 == 0 && (uintptr_t)c->wlow % 8 == 0 &&
           moept__vec<float>(0, c->params, c->grads) && moept__vec<float>(0, c->opt_m, c->opt_v);
}
/* config.fp8: the weights' E4M3 copies, a launch a matrix (moept__k_q8_blocks), from the fp32 masters once
   after they changed, or (ak) by AdamW's own pass, which steps each block's masters (their bf16 copy too,
   where the layer keeps one) before it quantizes them; queued on s, stale until they launched */
static cudaError_t moept__q8_weights(moept__cuda *c, const moept__adamw_k *ak) {
    const int64_t D = c->sp.D, Dp = MOEPT__Q8_PAD(D), TL = MOEPT__Q8_TILE, e0 = c->sp.E * D;
    moept__bf16 *low = (moept__bf16 *)c->wlow; /* (the bf16 copy of the parameters from e0 on) */
    for (int i = 0; i < 2; i++) {
        const moept__q8w *w = &c->q8w[i];
        if (w->n == 0) continue;
        const int64_t M[2] = {w->H, D}, K[2] = {D, w->F}, Mp[2] = {w->Hp, Dp}, Kp[2] = {Dp, w->Fp};
        for (int m = 0; m < 2; m++) {
            const int64_t nb = w->n * ((Mp[m] + TL - 1) / TL) * ((Kp[m] + TL - 1) / TL);
            const int64_t o = m ? w->off2 : w->off13; /* (the masters' offset) */
            const dim3 grid((unsigned)(nb < 8 * MOEPT__MAX_GRID ? nb : 8 * MOEPT__MAX_GRID));
            uint8_t *q = m ? w->w2 : w->w13, *qt = m ? w->w2t : w->w13t;
            float *s = m ? w->s2 : w->s13, *st = m ? w->s2t : w->s13t;
            moept__q8_wargs a = {c->params + o, NULL, NULL, NULL, {}, NULL};
            if (ak) a.g = c->grads + o, a.m = c->opt_m + o, a.v = c->opt_v + o, a.k = *ak;
            if (ak && low) a.low = low + (o - e0);
            const int v4 = moept__adamw_v4(c, o) && K[m] % 4 == 0; /* (the rows in 4-vectors) */
            const int mm = (int)M[m], kk = (int)K[m], mp = (int)Mp[m], kp = (int)Kp[m];
            if (!ak) MOEPT__LAUNCH((moept__k_q8_blocks<1, 0>), grid, MOEPT__TB, 0, c->s)(
                a, w->n, mm, kk, mp, kp, q, s, qt, st);
            else if (v4) MOEPT__LAUNCH((moept__k_q8_blocks<4, 1>), grid, MOEPT__TB, 0, c->s)(
                a, w->n, mm, kk, mp, kp, q, s, qt, st);
            else MOEPT__LAUNCH((moept__k_q8_blocks<1, 1>), grid, MOEPT__TB, 0, c->s)(
                a, w->n, mm, kk, mp, kp, q, s, qt, st);
        }
    }
    cudaError_t e = cudaGetLastError();
    c->q8_stale = e != cudaSuccess;
    return e;
}

#ifndef MOEPT_GK_XCOLS /* (0: x's and dy's records' copies down their rows by the column passes, not by the
                          kernels that load the records: tools/gpu_check.sh fp8 compares them) */
#define MOEPT_GK_XCOLS 1
#endif
static int moept__gk_q8(const moept__cuda *c);
static int moept__gk_w8(const moept__cuda *c);
static int moept__q8_keeps(const moept__cuda *c);
/* The token operands' scratch for rows in up to El groups, each padded (16 rows a group more: the column
   passes' operands, every group's; the grouped kernel's wgrad, 128: moept__gk_w8): two E4M3 operands
   [rows][Wp] (or the groups' [Wp][np], or [Wp][S]), their scales, cuBLASLt's fp32 result (none where
   the grouped kernel runs every product: moept__gk_w8), and the grouped kernel's q8r, q8sr (and, a
   training layer's with WGRAD8, x's kept copy q8x, q8sx and dy's q8y, q8sy: [Dp][rows] each, Dp = D
   padded); grown geometrically with the receive block (moept__grow), once the compute stream no longer
   reads the old one */
static moept_status moept__q8_room(moept__cuda *c, int64_t rows, char *err) {
    const int64_t need = MOEPT__Q8_PAD(rows + (moept__gk_w8(c) ? MOEPT__Q8_TILE : 16) * c->sp.El);
    if (!moept__fp8_on(&c->sp) || (need <= c->q8rows && c->q8blk)) return MOEPT_OK;
    const int64_t cap = MOEPT__Q8_PAD(need > 2 * c->q8rows ? need : 2 * c->q8rows), W = moept__q8_wp(c);
    const int64_t s1 = MOEPT__Q8_L(W) * cap, s2 = W * (MOEPT__Q8_L(cap) + c->sp.El), sc = s1 > s2 ? s1 : s2;
    const int64_t out = moept__gk_w8(c) ? 0 : (cap > W ? cap : W) * W, nq = moept__gk_q8(c) ? 3 : 2;
    const int64_t xw = moept__q8_keeps(c) ? MOEPT__Q8_PAD(c->sp.D) : 0; /* (q8x's, q8y's columns, scales) */
    const int64_t xs = xw * (MOEPT__Q8_L(cap) + c->sp.El);
    void *blk = NULL;
    const size_t bytes = (size_t)(nq * cap * W + nq * sc * 4 + out * 4 + (1 + MOEPT_GK_XCOLS) * (cap * xw +
                                  xs * 4)) + (2 * nq + 5) * 64;
    MOEPT__TRY(moept__dmalloc(c, &blk, bytes, err));
    moept_status st = moept__host_wait(c, err); /* the old scratch's last reader done */
    const cudaError_t e = st ? cudaSuccess : cudaMemsetAsync(c->q8own, 0, 8, c->s); /* (no copy of a in the
                                                                                      new scratch) */
    if (st || e != cudaSuccess) {
        cudaFree(blk);
        return st ? st : moept__kfail(err, MOEPT_ERR_DEVICE, "cudaMemsetAsync: %s", cudaGetErrorString(e));
    }
    cudaFree(c->q8blk);
    c->q8blk = blk;
    moept__carve cv = {(char *)blk, 0};
    c->q8a = (uint8_t *)moept__take(&cv, (size_t)(cap * W));
    c->q8b = (uint8_t *)moept__take(&cv, (size_t)(cap * W));
    c->q8sa = (float *)moept__take(&cv, (size_t)sc * 4);
    c->q8sb = (float *)moept__take(&cv, (size_t)sc * 4);
    c->q8out = out ? (float *)moept__take(&cv, (size_t)out * 4) : NULL;
    c->q8r = nq > 2 ? (uint8_t *)moept__take(&cv, (size_t)(cap * W)) : NULL;
    c->q8sr = nq > 2 ? (float *)moept__take(&cv, (size_t)sc * 4) : NULL;
    c->q8x = xw ? (uint8_t *)moept__take(&cv, (size_t)(cap * xw)) : NULL;
    c->q8sx = xw ? (float *)moept__take(&cv, (size_t)xs * 4) : NULL;
    c->q8y = xw && MOEPT_GK_XCOLS ? (uint8_t *)moept__take(&cv, (size_t)(cap * xw)) : NULL;
    c->q8sy = xw && MOEPT_GK_XCOLS ? (float *)moept__take(&cv, (size_t)xs * 4) : NULL;
    c->q8rows = cap, c->q8sc = sc;
    c->q8_bytes = (int64_t)bytes;
    return MOEPT_OK;
}

/* a column pass's layout: the operand of a group of n rows after the ones before at (*qo, *so) in q and s,
   its bytes [Cp][np] and scales [ceil(np/128)][Cp] */
static void moept__q8_gnext(int64_t n, int64_t Cp, int64_t *qo, int64_t *so) {
    const int64_t np = MOEPT__Q8_PAD(n);
    *qo += Cp * np;
    *so += MOEPT__Q8_L(np) * Cp;
}
/* R's groups' columns in a column pass's one operand [Cp][S] (moept__q8_rg's S: each padded to 128) */
static int64_t moept__q8_wide(const moept__runs *R) {
    int64_t S = 0;
    for (int64_t i = 0; i < R->n; i++) S += MOEPT__Q8_P128(R->offs[i + 1] - R->offs[i]);
    return S;
}
/* whether each run's padded rows fit the scratch, or (all) every run's operands, one after another, with
   their scales (moept__grow made it for the receive block's); S > 0: as one [Cp][S] */
static moept_status moept__q8_fits(const moept__cuda *c, const moept__runs *R, int all, char *err,
                                   int64_t S = 0) {
    int64_t qo = 0, so = 0;
    if (S > c->q8rows)
        return moept__kfail(err, MOEPT_ERR_STATE, "config.fp8: the experts' %lld columns past the scratch's "
                            "%lld rows (moept_kernels.cu:%d)", (long long)S, (long long)c->q8rows, __LINE__);
    for (int64_t i = 0; i < R->n; i++) {
        int64_t r0, rows, e;
        moept__run_at(R, i, &r0, &rows, &e);
        if (!all) qo = so = 0;
        moept__q8_gnext(rows, moept__q8_wp(c), &qo, &so);
        if (qo > c->q8rows * moept__q8_wp(c) || so > c->q8sc)
            return moept__kfail(err, MOEPT_ERR_STATE, "config.fp8: %s %lld padded rows past the scratch's "
                                "%lld (moept_kernels.cu:%d)", all ? "the experts'" : "one expert's",
                                (long long)(qo / moept__q8_wp(c)), (long long)c->q8rows, __LINE__);
    }
    return MOEPT_OK;
}

/* out [n][ldo] fp32 = sum over k of A(i, l) B(j, l) in 128-blocks, each block's sum times its scales
   (cuBLASLt's TN: A [m][k] and B [n][k] E4M3 rows; scale modes am, bm: VEC128 or BLK128x128), or (acc)
   out += that in place (beta 1: cuBLASLt adds C to the fp32 sum, as moept__k_q8_out would), on the
   compute stream with the cuBLAS handle's workspace (the same stream's). out NULL: cuBLASLt's heuristic
   alone, MOEPT_ERR_UNSUPPORTED where it has no algorithm */
#if CUBLAS_VERSION >= 120900
#define MOEPT__VEC128 CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
#define MOEPT__BLK128 CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
static moept_status moept__q8_gemm(moept__cuda *c, int64_t m, int64_t n, int64_t k, const uint8_t *A,
                                   const float *sa, int32_t am, const uint8_t *B, const float *sb, float *out,
                                   int64_t ldo, int acc, char *err) {
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lo = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t hr;
    int found = 0;
    const int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N, bm = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const uint64_t ws = (uint64_t)c->blas_ws_each;
    const float one = 1.0f, beta = acc ? 1.0f : 0.0f;
    cublasStatus_t r = cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const cublasLtMatmulDescAttributes_t at[6] = {CUBLASLT_MATMUL_DESC_TRANSA, CUBLASLT_MATMUL_DESC_TRANSB,
        CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
        CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER};
    const void *av[6] = {&ta, &tb, &am, &bm, &sa, &sb};
    for (int i = 0; i < 6 && !r; i++)
        r = cublasLtMatmulDescSetAttribute(op, at[i], av[i], i < 4 ? sizeof(int32_t) : sizeof(void *));
    if (!r) r = cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, (uint64_t)k, (uint64_t)m, k);
    if (!r) r = cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, (uint64_t)k, (uint64_t)n, k);
    if (!r) r = cublasLtMatrixLayoutCreate(&lo, CUDA_R_32F, (uint64_t)m, (uint64_t)n, ldo);
    if (!r) r = cublasLtMatmulPreferenceCreate(&pref);
    if (!r)
        r = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                 sizeof ws);
    if (!r) r = cublasLtMatmulAlgoGetHeuristic(c->lt, op, la, lb, lo, lo, pref, 1, &hr, &found);
    if (!r && !found) r = CUBLAS_STATUS_NOT_SUPPORTED;
    const int probe = out == NULL;
    if (!r && !probe)
        r = cublasLtMatmul(c->lt, op, &one, A, la, B, lb, &beta, out, lo, out, lo, &hr.algo, c->blas_ws,
                           (size_t)ws, c->s);
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lo) cublasLtMatrixLayoutDestroy(lo);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    if (r != CUBLAS_STATUS_SUCCESS)
        return moept__kfail(err, probe ? MOEPT_ERR_UNSUPPORTED : MOEPT_ERR_DEVICE, "%s (FP8, m %lld n %lld "
                            "k %lld): %s (moept_kernels.cu:%d)", probe ? "moept_create_cuda: config.fp8: "
                            "cuBLASLt has no block-scaled matmul on this device (compute capability 9.0 runs "
                            "them)" : "cublasLtMatmul", (long long)m, (long long)n, (long long)k,
                            cublasGetStatusString(r), __LINE__);
    return MOEPT_OK;
}
#else /* (moept__q8_create refuses config.fp8 in such a build) */
#define MOEPT__VEC128 0
#define MOEPT__BLK128 0
static moept_status moept__q8_gemm(moept__cuda *, int64_t, int64_t, int64_t, const uint8_t *, const float *,
                                   int32_t, const uint8_t *, const float *, float *, int64_t, int,
                                   char *err) {
    return moept__kfail(err, MOEPT_ERR_UNSUPPORTED, "config.fp8: cuBLAS 12.9 or later");
}
#endif

/* config.fp8 at create: whether cuBLASLt runs the block-scaled matmuls here at all (a GPU under compute
   capability 9.0 has none: cuBLAS Library, 3.1.4.5), by its heuristic for the forward's first shape */
static moept_status moept__q8_probe(moept__cuda *c, char *err) {
    const moept__q8w *w = &c->q8w[0];
    if (!moept__fp8_on(&c->sp)) return MOEPT_OK;
    return moept__q8_gemm(c, w->Hp, 16, MOEPT__Q8_PAD(c->sp.D), w->w13, w->s13, MOEPT__BLK128, w->w13, w->s13,
                          NULL, w->Hp, 0, err);
}

/* n rows of src (K columns, lds apart) as a matmul's B along K: q [np][Kp], scales s; ss > 0: rows of a
   larger operand, its scales ss rows apart (no padding rows written). offs: instead each of ng groups of
   src's rows (offs [ng + 1], n unused) into its own operand, one after another (moept__q8_rg), MOEPT__Q8_G
   groups a launch */
template <typename T>
static moept_status moept__q8_along(moept__cuda *c, const void *src, int64_t n, int64_t K, int64_t lds,
                                    uint8_t *q, float *s, int64_t ss, char *err, const int64_t *offs = NULL,
                                    int64_t ng = 0) {
    const int64_t Kp = MOEPT__Q8_PAD(K);
    return moept__q8_each(offs, ng, n, ss, err, [&](const moept__q8_rg &G, int64_t nw, unsigned gy) {
        const dim3 grid((unsigned)moept__grid(nw * MOEPT__Q8_L(Kp) * 8), gy);
        MOEPT__LAUNCH_V(moept__vec<T>(lds, src), moept__k_q8_rows, T, grid, MOEPT__TB, c->s, (const T *)src,
                        NULL, n, (int)K, lds, nw, (int)Kp, q, Kp, s, 1, ss ? ss : nw, Kp, G);
    });
}
/* the C columns of each of ng groups of src's rows (group g the rows [offs[g], offs[g + 1]), lds apart),
   transposed, down the rows (a wgrad's operand each): into q and s, one group's after another's
   (moept__q8_gnext), MOEPT__Q8_G groups a launch; T uint8_t: FP8 records (C = D), dequantized as read.
   qr (bf16): the same read also quantizes the rows along them (moept__q8_along's bytes) into qr
   [rows][Cp] by src's rows, scales sr (srb rows apart). S > 0: the groups' columns of one q [Cp][S]
   instead, each group's rows padded to 128 (moept__q8_rg). own: nothing where c->q8own holds it (a's
   copy there already, moept__q8_kept) */
template <typename T>
static moept_status moept__q8_down(moept__cuda *c, const void *src, const int64_t *offs, int64_t ng,
                                   int64_t C, int64_t lds, uint8_t *q, float *s, char *err,
                                   uint8_t *qr = NULL, float *sr = NULL, int64_t srb = 0, int64_t S = 0,
                                   const void *own = NULL) {
    const unsigned long long *ow = own ? c->q8own : NULL, mine = moept__u64(own);
    const int64_t Cp = MOEPT__Q8_PAD(C), W = qr ? MOEPT__Q8_TILE : 128 / sizeof(T), nc = (Cp + W - 1) / W;
    const float *rs = sizeof(T) == 1 ? (const float *)((const uint8_t *)src + MOEPT__Q8_PAD(C)) : NULL;
    const int vec = moept__vec<T>(lds, src);
    if (qr && sizeof(T) != 2)
        return moept__kfail(err, MOEPT_ERR_STATE, "the rows' copy from bf16 alone (moept_kernels.cu:%d)",
                            __LINE__);
    return moept__q8_each(offs, ng, 0, 0, err, [&](const moept__q8_rg &G, int64_t nw, unsigned gy) {
        const dim3 grid((unsigned)moept__grid(MOEPT__Q8_L(nw) * nc * MOEPT__TB), gy);
        if constexpr (sizeof(T) == 2) {
            if (qr && vec)
                MOEPT__LAUNCH((moept__k_q8_cols<T, MOEPT__VEC(T), 1>), grid, MOEPT__TB, 0, c->s)(
                    (const T *)src, G, (int)C, lds, (int)Cp, q, s, rs, lds / 4, qr, sr, srb, ow, mine);
            else if (qr)
                MOEPT__LAUNCH((moept__k_q8_cols<T, 1, 1>), grid, MOEPT__TB, 0, c->s)(
                    (const T *)src, G, (int)C, lds, (int)Cp, q, s, rs, lds / 4, qr, sr, srb, ow, mine);
        }
        if (!qr)
            MOEPT__LAUNCH_V(vec, moept__k_q8_cols, T, grid, MOEPT__TB, c->s, (const T *)src, G, (int)C, lds,
                            (int)Cp, q, s, rs, lds / 4, (uint8_t *)NULL, (float *)NULL, (int64_t)0, ow, mine);
    }, S);
}
/* config.fp8's dispatch: rows r < n of the routed tokens, x's row idx[r] each (-1: zeros), as FP8 records
   rec [n][moept__q8_recw(D)] (the 1 x 128 tiles of moept__q8_along, in the records' layout) */
template <typename T>
static moept_status moept__q8_records(moept__cuda *c, const T *x, const int64_t *idx, int64_t n, void *rec,
                                      char *err) {
    const int64_t D = c->sp.D, Dp = MOEPT__Q8_PAD(D), W = moept__q8_recw(D), L = MOEPT__Q8_L(D);
    uint8_t *q = (uint8_t *)rec;
    const moept__q8_rg one = {};
    MOEPT__LAUNCH_V(moept__vec<T>(D, x), moept__k_q8_rows, T, moept__grid(n * MOEPT__Q8_L(Dp) * 8), MOEPT__TB,
                    c->s, x, idx, n, (int)D, D, n, (int)Dp, q, W, (float *)(q + Dp), W / 4, 1, Dp + 4 * L,
                    one);
    MOEPT__LAUNCHED();
    return MOEPT_OK;
}
/* config.fp8's combine' (moept__k_combine_bwd8): over the TK assignments (K a token; row_of [TK], wts
   [TK]), from ys [rows][D] and dy [T][D]: dwts [TK] and the dys as FP8 records rec [rows][moept__q8_recw(D)]
   by ys's rows; tok_of_row [n] (the sync-free blocks'; else NULL, n 0): the rows no assignment has, zero
   records */
template <typename T>
static moept_status moept__q8_combine(moept__cuda *c, const T *ys, const int64_t *row_of, const float *wts,
                                      const T *dy, int64_t TK, int64_t K, const int64_t *tok_of_row,
                                      int64_t n, void *rec, float *dwts, char *err) {
    const int64_t D = c->sp.D;
    if (TK + n == 0) return MOEPT_OK;
    MOEPT__LAUNCH_V(moept__vec<T>(D, ys, dy), moept__k_combine_bwd8, T, (unsigned)(TK + n), MOEPT__TB, c->s,
                    ys, row_of, wts, dy, (int)D, (int)K, TK, tok_of_row, (uint8_t *)rec, dwts);
    MOEPT__LAUNCHED();
    return MOEPT_OK;
}
/* n FP8 records (k columns) as a matmul's operand along k: q [np][kp], scales s (q8_along's layout); ss
   > 0: rows of a larger operand, its scales ss rows apart (no padding rows written); offs: instead each of
   ng groups' records into its own operand (moept__q8_along's) */
static moept_status moept__q8_unrec(moept__cuda *c, const void *rec, int64_t n, int64_t k, uint8_t *q,
                                    float *s, int64_t ss, char *err, const int64_t *offs = NULL,
                                    int64_t ng = 0) {
    const int64_t kp = MOEPT__Q8_PAD(k);
    return moept__q8_each(offs, ng, n, ss, err, [&](const moept__q8_rg &G, int64_t nw, unsigned gy) {
        const dim3 grid((unsigned)moept__grid(nw * (kp / 16 + MOEPT__Q8_L(kp))), gy);
        MOEPT__LAUNCH(moept__k_q8_unrec, grid, MOEPT__TB, 0, c->s)((const uint8_t *)rec, n, nw, (int)kp, q, s,
                                                                  ss ? ss : nw, G);
    });
}
/* the matmul's result [n][ldo] (m columns) into dst [n][ldd]: T rows, or (acc) added to fp32 gradients;
   offs: instead each of ng groups' results (from its row o of the result: moept__q8_rg) into its rows */
template <typename T>
static moept_status moept__q8_result(moept__cuda *c, int64_t n, int64_t m, int64_t ldo, void *dst,
                                     int64_t ldd, int acc, char *err, const int64_t *offs = NULL,
                                     int64_t ng = 0) {
    const int M = (int)m, L = (int)ldo, v = acc ? 4 : MOEPT__VEC(T); /* (v: a vector's elements) */
    const int vec = (acc ? moept__vec<float>(m, dst) : moept__vec<T>(m, dst)) && ldd % v == 0 && ldo % 4 == 0;
    return moept__q8_each(offs, ng, n, 1, err, [&](const moept__q8_rg &G, int64_t rows, unsigned gy) {
        moept__shape sh = moept__rows_shape(rows, vec ? m / v : m); /* (rows: a group's most, padded) */
        sh.g.y = gy;
        if (acc)
            MOEPT__LAUNCH_V(vec, moept__k_q8_out, float, sh.g, sh.b, c->s, c->q8out, n, M, L, (float *)dst,
                            ldd, 1, G);
        else
            MOEPT__LAUNCH_V(vec, moept__k_q8_out, T, sh.g, sh.b, c->s, c->q8out, n, M, L, (T *)dst, ldd, 0,
                            G);
    });
}

static moept_status moept__gk_create(moept__cuda *c, char *err);
static moept_status moept__create(moept__cuda *c, char *err) {
    moept__cuda_spec *p = &c->sp;
    const int64_t E = p->E, P = p->P, C = c->C;
    c->s = (cudaStream_t)p->stream;
    c->cs = c->s;
    if (p->ep) c->cs = moept__stream_of(p->ep);
    MOEPT__CU(cudaStreamCreateWithFlags(&c->probe, cudaStreamNonBlocking));
    MOEPT__CU(cudaEventCreateWithFlags(&c->ev_compute, cudaEventDisableTiming));
    MOEPT__CU(cudaEventCreateWithFlags(&c->ev_comm, cudaEventDisableTiming));
    for (int i = 0; i < 2 && C > 1; i++) {
        MOEPT__CU(cudaEventCreateWithFlags(&c->ev_out[i], cudaEventDisableTiming));
        MOEPT__CU(cudaEventCreateWithFlags(&c->ev_back[i], cudaEventDisableTiming));
    }
    MOEPT__TRY(moept__blas_create(c, err));
    MOEPT__TRY(moept__gk_create(c, err));
    MOEPT__TRY(moept__q8_create(c, err));
    MOEPT__TRY(moept__q8_probe(c, err));
    /* parameters + gradients + bias + placement: one allocation (the gradients 16-byte aligned too);
       an inference layer has no gradients */
    const int64_t npad = moept__npad(c), nmir = p->cfg->inference_only ? 1 : 2;
    size_t pbytes = (size_t)(nmir * npad + E) * 4 + (size_t)E * 4 + 256;
    void *pb = NULL;
    MOEPT__TRY(moept__dmalloc(c, &pb, pbytes, err));
    c->pblock_bytes = (int64_t)pbytes;
    /* on the layer's stream: the legacy stream would not order a non-blocking one */
    MOEPT__CU(cudaMemsetAsync(pb, 0, pbytes, c->s));
    c->params = (float *)pb;
    c->grads = p->cfg->inference_only ? NULL : c->params + npad;
    c->bias = c->params + nmir * npad;
    c->slot_of = (int32_t *)(c->bias + E);
    if (p->dtype == MOEPT_DTYPE_BF16)
        MOEPT__TRY(moept__dmalloc(c, &c->wlow, (size_t)(p->n_params - E * p->D) * 2, err));
    moept__carve cv = {NULL, 0};
    moept__layout(c, &cv);
    MOEPT__TRY(moept__dmalloc(c, &c->work, cv.off, err));
    MOEPT__CU(cudaMemsetAsync(c->work, 0, cv.off, c->s));
    c->work_bytes = (int64_t)cv.off;
    cv.base = (char *)c->work;
    cv.off = 0;
    moept__layout(c, &cv);
    MOEPT__CU(cudaMemsetAsync(&c->bad[4], 0xff, 3 * 8, c->s)); /* no backward's dx yet, no failed step */
    c->nslots = p->nslots > 1 ? p->nslots : 1;
    c->slots = (moept__cslot *)calloc((size_t)c->nslots + 1, sizeof(moept__cslot));
    if (!c->slots)
        return moept__kfail(err, MOEPT_ERR_OUT_OF_MEMORY, "moept_create_cuda: out of host memory");
    c->host_bytes += (int64_t)((size_t)(c->nslots + 1) * sizeof(moept__cslot));
    /* pinned host block */
    size_t hb = (size_t)(P * c->M) * 8 + (size_t)MOEPT__NLSTAT(E) * 8 + 8 * 8 + (size_t)MOEPT__NPART * 2 * 8 +
                (size_t)E * 4 + 6 * 64;
    MOEPT__CU(cudaMallocHost(&c->pinned, hb));
    c->host_bytes += (int64_t)hb;
    moept__carve hv = {(char *)c->pinned, 0};
    c->h_msg_all = (int64_t *)moept__take(&hv, (size_t)(P * c->M) * 8);
    c->h_lstat = (double *)moept__take(&hv, (size_t)MOEPT__NLSTAT(E) * 8);
    c->h_bad = (unsigned long long *)moept__take(&hv, 8 * 8);
    c->h_gpart = (double *)moept__take(&hv, (size_t)MOEPT__NPART * 2 * 8);
    c->h_aux_g = (float *)moept__take(&hv, (size_t)E * 4);
    /* the host plan arrays: one block, measured, then carved */
    moept__carve kv = {NULL, 0};
    moept__host_layout(c, &kv);
    c->hblock = calloc(1, kv.off);
    if (!c->hblock)
        return moept__kfail(err, MOEPT_ERR_OUT_OF_MEMORY, "moept_create_cuda: out of host memory");
    c->host_bytes += (int64_t)kv.off;
    kv.base = (char *)c->hblock;
    kv.off = 0;
    moept__host_layout(c, &kv);
    MOEPT__TRY(moept__slot_alloc(c, &c->slots[0], err));
    MOEPT__CU(cudaStreamSynchronize(c->s));
    return MOEPT_OK;
}

static moept_status moept__cuda_create(const moept__cuda_spec *spec, moept__cuda **out, char *err) {
    *out = NULL;
    if ((spec->ep && !moept__is_dcomm(spec->ep)) || (spec->dp && !moept__is_dcomm(spec->dp)))
        return moept__kfail(err, MOEPT_ERR_INVALID_ARGUMENT, "moept_create_cuda: %s", moept__dcomm_only);
    int dev = 0;
    MOEPT__CU(cudaGetDevice(&dev));
    const moept_comm *cm[2] = {spec->ep, spec->dp};
    for (int i = 0; i < 2; i++) /* their streams and buffers are the layer's device's */
        if (cm[i] && moept__dev_of(cm[i]) != dev)
            return moept__kfail(err, MOEPT_ERR_INVALID_ARGUMENT, "moept_create_cuda: the %s comm is on "
                                "device %d, the layer on device %d (the current one)",
                                i ? "DP" : "EP", moept__dev_of(cm[i]), dev);
    if (spec->E > INT_MAX / 2 || spec->K > INT_MAX)
        return moept__kfail(err, MOEPT_ERR_INVALID_ARGUMENT, "moept_create_cuda: too many experts");
    if (spec->D >= (1 << 30) || spec->H >= (1 << 30) || spec->HS >= (1 << 30))
        return moept__kfail(err, MOEPT_ERR_INVALID_ARGUMENT, "moept_create_cuda: hidden_size and the expert "
                            "widths must be below 2^30 (the kernels index within a row in 32 bits)");
    moept__cuda *c = (moept__cuda *)calloc(1, sizeof *c);
    if (!c) return moept__kfail(err, MOEPT_ERR_OUT_OF_MEMORY, "moept_create_cuda: out of host memory");
    c->sp = *spec;
    c->dev = dev;
    c->host_bytes = (int64_t)sizeof *c;
    c->esz = spec->dtype == MOEPT_DTYPE_BF16 ? 2 : 4;
    c->dt = spec->dtype == MOEPT_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    c->nblk_max = (spec->Tmax * spec->K + MOEPT__PB - 1) / MOEPT__PB;
    if (c->nblk_max < 1) c->nblk_max = 1;
    c->C = spec->P > 1 && spec->C > 1 ? spec->C : 1; /* one EP rank: no exchange to overlap (read c->C,
                                                         not sp.C, the config's) */
    if (spec->sync_free) { /* an expert gets a token once at most: max_tokens rows, or its capacity */
        const int64_t Tb = spec->block_tokens;
        const int64_t cap = moept__capacity(spec->capacity_factor, Tb, spec->K, spec->E);
        c->B = cap >= 0 && cap < Tb ? cap : Tb;
        if (c->B < 1) c->B = 1;
    }
    c->G = spec->El * (c->C > 1 ? spec->P : 1);
    if (c->G < 1) c->G = 1;
    c->moff = spec->E + 3 + (c->C > 1 ? c->C * spec->E : 0);
    /* global balance: the statistics travel with the counts and are summed
       in rank order, so no second collective can meet another call's */
    c->M = c->moff + (moept__global_balance(spec) && spec->ep ? MOEPT__NLSTAT(spec->E) : 0) + 1;
    c->wlow_stale = 1;
    moept_status st = moept__create(c, err);
    if (st) { moept__cuda_destroy(c); return st; }
    *out = c;
    return MOEPT_OK;
}

/* Every host wait on the compute stream: first the EP and DP comms' streams,
   polled with their timeouts and async errors (the compute stream waits on
   them through events, so a peer that never comes would hang a plain
   synchronize); what is left on the compute stream is this rank's own. An
   aborted comm has no work left (the abort ended it): the parameters stay
   readable. It also goes before every copy to or from the
   caller's (pageable) host memory: such a copy waits for the stream's
   earlier work inside the call (the CUDA Runtime API's "API synchronization
   behavior"), so that work must be this rank's own by then. */
static moept_status moept__host_wait(moept__cuda *c, char *err) {
    moept_comm *comms[2] = {c->sp.ep, c->sp.dp};
    for (int i = 0; i < 2; i++)
        if (comms[i] && !moept_comm_nccl_aborted(comms[i])) {
            moept_status st = moept__dcomm_wait(comms[i]);
            if (st) return moept__kfail(err, st, "%s", comms[i]->err);
        }
    MOEPT__CU(cudaStreamSynchronize(c->s));
    return MOEPT_OK;
}

/* ---- host <-> device ---------------------------------------------------- */
static moept_status moept__cuda_io(moept__cuda *c, int which, int64_t off, int64_t n, float *h, int write,
                                   char *err) {
    MOEPT__ENTER(c);
    float *d = which == MOEPT_BUF_PARAMS ? c->params : which == MOEPT_BUF_GRADS ? c->grads
             : which == MOEPT__BUF_M    ? c->opt_m   : c->opt_v;
    if (!d && write)
        return moept__kfail(err, MOEPT_ERR_STATE, "internal: a write to a buffer the layer lacks");
    MOEPT__TRY(moept__host_wait(c, err)); /* pageable copies follow (n 0: the pending errors alone) */
    if (n == 0) return MOEPT_OK;
    if (!d) {
        memset(h, 0, (size_t)n * 4); /* moments before the first step */
        return MOEPT_OK;
    }
    if (write) c->grads_clean = 0;
    if (write && which == MOEPT_BUF_PARAMS) c->wlow_stale = c->q8_stale = 1; /* (recast: params_changed) */
    if (write) MOEPT__CU(cudaMemcpyAsync(d + off, h, (size_t)n * 4, cudaMemcpyHostToDevice, c->s));
    else MOEPT__CU(cudaMemcpyAsync(h, d + off, (size_t)n * 4, cudaMemcpyDeviceToHost, c->s));
    MOEPT__TRY(moept__host_wait(c, err)); /* the host array may change after we return */
    return MOEPT_OK;
}

static moept_status moept__cuda_tables(moept__cuda *c, const float *bias, const int32_t *slot_of, char *err) {
    MOEPT__ENTER(c);
    const int64_t E = c->sp.E;
    MOEPT__TRY(moept__host_wait(c, err)); /* pageable copies follow */
    MOEPT__CU(cudaMemcpyAsync(c->bias, bias, (size_t)E * 4, cudaMemcpyHostToDevice, c->s));
    MOEPT__CU(cudaMemcpyAsync(c->slot_of, slot_of, (size_t)E * 4, cudaMemcpyHostToDevice, c->s));
    MOEPT__TRY(moept__host_wait(c, err));
    return MOEPT_OK;
}

static moept_status moept__cuda_download_routing(moept__cuda *c, int32_t *ids, float *wts, float *logits,
                                                 float *dwts, char *err) {
    MOEPT__ENTER(c);
    const moept__cslot *sl = moept__last(c);
    if (!sl->fwd_valid) return moept__kfail(err, MOEPT_ERR_STATE, "no forward yet");
    const int64_t T = sl->T, K = c->sp.K, E = c->sp.E;
    MOEPT__TRY(moept__host_wait(c, err)); /* pageable copies follow */
    if (ids)
        MOEPT__CU(cudaMemcpyAsync(ids, sl->ids[sl->cur], (size_t)(T * K) * 4, cudaMemcpyDeviceToHost, c->s));
    if (wts)
        MOEPT__CU(cudaMemcpyAsync(wts, sl->wts[sl->cur], (size_t)(T * K) * 4, cudaMemcpyDeviceToHost, c->s));
    if (logits)
        MOEPT__CU(cudaMemcpyAsync(logits, sl->logits[sl->cur], (size_t)(T * E) * 4, cudaMemcpyDeviceToHost,
                                  c->s));
    if (dwts) MOEPT__CU(cudaMemcpyAsync(dwts, sl->dwts, (size_t)(T * K) * 4, cudaMemcpyDeviceToHost, c->s));
    MOEPT__TRY(moept__host_wait(c, err));
    return MOEPT_OK;
}

static moept_status moept__cuda_zero_grad(moept__cuda *c, char *err) {
    MOEPT__ENTER(c);
    c->grads_clean = 0;
    MOEPT__CU(cudaMemsetAsync(c->grads, 0, (size_t)c->sp.n_params * 4, c->s));
    MOEPT__CU(cudaMemsetAsync(&c->bad[4], 0xff, 3 * 8, c->s)); /* dlogits', dx's checks, the sync-free flag */
    return MOEPT_OK;
}

/* The first non-finite dx element of the backwards since zero_grad (-1:
   none), and opts.dlogits': their checks ran on the device; this reads them
   (a host sync). Sync-free mode: why a step since failed its checks, into
   why ("" if none). */
static moept_status moept__cuda_dx_check(moept__cuda *c, int64_t *first_bad, int64_t *dl_bad,
                                         moept_status *why_st, char *why, char *err) {
    MOEPT__ENTER(c);
    MOEPT__STAGE("optimizer"); /* read by grad_norm and adamw_step */
    MOEPT__CU(cudaMemcpyAsync(c->h_bad + 4, &c->bad[4], 3 * 8, cudaMemcpyDeviceToHost, c->s));
    MOEPT__TRY(moept__host_wait(c, err));
    MOEPT__STAGE(NULL);
    *first_bad = c->h_bad[5] == ULLONG_MAX ? -1 : (int64_t)c->h_bad[5];
    *dl_bad = c->h_bad[4] == ULLONG_MAX ? -1 : (int64_t)c->h_bad[4];
    unsigned long long code = c->h_bad[6];
    if (c->sp.sync_free && *dl_bad >= 0 && code > MOEPT__SF_DLOGITS) code = MOEPT__SF_DLOGITS;
    why[0] = 0;
    *why_st = code == ULLONG_MAX ? MOEPT_OK
            : code == MOEPT__SF_ARGS || code == MOEPT__SF_PEER || code == MOEPT__SF_CALLS ? MOEPT_ERR_STATE
            : code == MOEPT__SF_REPLAY || code == MOEPT__SF_SLOT ? MOEPT_ERR_INVALID_ARGUMENT
            : MOEPT_ERR_NUMERIC;
    if (code == MOEPT__SF_DLOGITS)
        snprintf(why, MOEPT__ERRLEN, "opts.dlogits[%lld][%lld] was not finite",
                 (long long)(*dl_bad / c->sp.E), (long long)(*dl_bad % c->sp.E));
    else if (*why_st) snprintf(why, MOEPT__ERRLEN, "%s", moept__sf_why(code));
    return MOEPT_OK;
}

/* Sync-free mode: the last forward's statistics, as moept__fwd_plan and
   moept__fwd_losses give them in the default mode (a host sync) */
static moept_status moept__cuda_step_stats(moept__cuda *c, double *lstat, int64_t *peer_rows,
                                           moept__dev_step *out, char *err) {
    MOEPT__ENTER(c);
    const moept__cslot *sl = moept__last(c);
    const moept__cuda_spec *p = &c->sp;
    const int64_t E = p->E, El = p->El, P = p->P, M = c->M, me = p->rank;
    MOEPT__CU(cudaMemcpyAsync(c->h_msg_all, sl->cmsg, (size_t)(P * M) * 8, cudaMemcpyDeviceToHost, c->s));
    MOEPT__CU(cudaMemcpyAsync(c->h_lstat, sl->clstat, (size_t)MOEPT__NLSTAT(E) * 8, cudaMemcpyDeviceToHost,
                              c->s));
    MOEPT__TRY(moept__host_wait(c, err));
    const double Tl = c->h_lstat[3 * E] > 0 ? c->h_lstat[3 * E] : 1.0;
    out->aux_value = moept__aux_value(c->h_lstat, E, p->K, p->cfg->aux_loss, p->cfg->aux_loss_coef,
                                      c->h_aux_g);
    out->z_value = c->h_lstat[3 * E + 1] / Tl;
    out->loss_T = Tl;
    out->counts_global = moept__global_balance(p) || (!p->ep && !p->dp);
    memcpy(lstat, c->h_lstat, (size_t)moept__lstat_of(E).n * 8);
    /* this rank's counts head its message; rank q's rows for its expert j are at [q][M] + me El + j */
    moept__plan_peer_rows(P, El, me, c->h_msg_all + me * M, c->h_msg_all + me * El, M, peer_rows,
                          &out->rows_sent, &out->rows_received);
    out->N = out->rows_sent + peer_rows[me];
    out->R = out->rows_received + peer_rows[P + me];
    out->valid = c->h_msg_all[me * M + M - 1];
    out->capacity = moept__capacity(p->capacity_factor, out->valid, p->K, E);
    return MOEPT_OK;
}

/* ---- GEMMs -------------------------------------------------------------- */
/* n GEMMs of one shape whose operands sit at constant strides (equal expert
   groups: the sync-free mode's blocks) as one cublasGemmStridedBatchedEx_64,
   whose type table (cuBLAS Library, "cublasGemmStridedBatchedEx()") holds
   every pair used here, bf16 A and B with fp32 C included. Returns 0 when
   they are not of that form (the caller goes on), else 1 with the outcome
   in *st: any status but success is an error. */
static int moept__gemms_strided(moept__cuda *c, const moept__gemm *g, int64_t n, cudaDataType_t ta,
                                cudaDataType_t tc, moept_status *st, char *err) {
    const moept__gemm_cm c0 = moept__gemm_colmajor(&g[0]);
    const int64_t ea = ta == CUDA_R_16BF ? 2 : 4, ec = tc == CUDA_R_16BF ? 2 : 4;
    int64_t s[3] = {0, 0, 0}; /* byte strides of A, B, C */
    for (int64_t i = 1; i < n; i++) {
        const moept__gemm_cm ci = moept__gemm_colmajor(&g[i]);
        const int64_t d[3] = {(const char *)ci.a - (const char *)c0.a,
                              (const char *)ci.b - (const char *)c0.b, (char *)ci.c - (char *)c0.c};
        if (ci.trans_a != c0.trans_a || ci.trans_b != c0.trans_b || ci.m != c0.m || ci.n != c0.n ||
            ci.k != c0.k || ci.lda != c0.lda || ci.ldb != c0.ldb || ci.ldc != c0.ldc ||
            ci.alpha != c0.alpha || ci.beta != c0.beta)
            return 0;
        for (int j = 0; j < 3; j++) {
            if (i == 1) s[j] = d[j];
            if (d[j] != i * s[j]) return 0;
        }
    }
    /* positive, whole elements, and no two C overlap (each problem writes its own) */
    if (s[0] <= 0 || s[1] <= 0 || s[0] % ea || s[1] % ea || s[2] % ec || s[2] < c0.ldc * c0.n * ec) return 0;
    const cublasOperation_t oa = c0.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t ob = c0.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasStatus_t r = cublasGemmStridedBatchedEx_64(
        c->blas, oa, ob, c0.m, c0.n, c0.k, &c0.alpha, c0.a, ta, c0.lda, s[0] / ea, c0.b, ta, c0.ldb,
        s[1] / ea, &c0.beta, c0.c, tc, c0.ldc, s[2] / ec, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    *st = r == CUBLAS_STATUS_SUCCESS ? MOEPT_OK
          : moept__kfail(err, MOEPT_ERR_DEVICE, "cublasGemmStridedBatchedEx_64: %s (moept_kernels.cu:%d)",
                         cublasGetStatusString(r), __LINE__);
    return 1;
}

/* Whether cublasGemmGroupedBatchedEx takes these descriptors, by its
   documentation (cuBLAS Library, "cublasGemmGroupedBatchedEx()"), never by
   trying: its type table has fp32 compute with fp32 or bf16 A and B and C of
   the same type (not bf16 A and B with fp32 C: the bf16 weight gradients);
   and with bf16 A it reads its matrix pointers on the device without
   checking them, so each must be aligned to 16 bytes where k * 2 is a
   multiple of 16, else to 4 where it is a multiple of 4 (rows of an odd
   width put a group's first row at a 2-byte boundary). AUTO also groups
   only a call whose mean m*n*k is at most 1e9: on an H200, the grouped call
   ran large experts' GEMMs at about half the rate of one cublasGemmEx each,
   and small ones faster (docs/CUDA.md, "GEMM forms"). */
#if CUBLAS_VERSION >= 120500
#define MOEPT__GROUPED_MAX_MNK 1e9
static int moept__grouped_ok(const moept__gemm *g, int64_t n, cudaDataType_t ta, cudaDataType_t tc,
                             int form) {
    if (ta != tc) return 0;
    double w = 0;
    for (int64_t i = 0; i < n; i++) {
        const moept__gemm_cm cm = moept__gemm_colmajor(&g[i]);
        w += (double)cm.m * (double)cm.n * (double)cm.k;
        if (ta != CUDA_R_16BF) continue;
        const int64_t kb = cm.k * 2;
        const uintptr_t al = kb % 16 == 0 ? 16 : kb % 4 == 0 ? 4 : 1;
        if ((uintptr_t)cm.a % al || (uintptr_t)cm.b % al || (uintptr_t)cm.c % al) return 0;
    }
    return form == MOEPT_GEMM_GROUPED || w <= MOEPT__GROUPED_MAX_MNK * (double)n;
}
#endif

/* Runs n descriptors: one cublasGemmEx; for several, by the layer's GEMM
   form (moept_cuda_options.gemm_form): one cublasGemmStridedBatchedEx where
   they have one shape at constant strides (auto, strided), else one
   cublasGemmGroupedBatchedEx where its table and alignment allow (grouped;
   auto where the GEMMs are also small; CUDA >= 12.5; each group its own
   expert's matrices, so the weight-gradient groups write disjoint C: no
   races), else one cublasGemmEx
   each: spread over the side streams where the layer has them, else in a
   loop. ta: A and B's type; tc: C's. Compute is fp32. */
static moept_status moept__gemms(moept__cuda *c, const moept__gemm *g, int64_t n, cudaDataType_t ta,
                                 cudaDataType_t tc, char *err) {
    if (n <= 0) return MOEPT_OK;
    const int form = c->sp.gemm_form;
    moept_status st;
    if (n > 1 && (form == MOEPT_GEMM_AUTO || form == MOEPT_GEMM_STRIDED) &&
        moept__gemms_strided(c, g, n, ta, tc, &st, err))
        return st;
#if CUBLAS_VERSION >= 120500
    if (n > 1 && (form == MOEPT_GEMM_AUTO || form == MOEPT_GEMM_GROUPED) &&
        moept__grouped_ok(g, n, ta, tc, form)) {
        const int64_t G = c->G;
        const void **dp = c->d_ptrs;
        moept__ptrs pv = {}; /* MOEPT__NPTR groups' pointers a launch (zeroed: all its bytes are copied) */
        int64_t *m = c->garr, *nn = m + G, *k = nn + G, *lda = k + G, *ldb = lda + G, *ldc = ldb + G;
        int64_t *gs = ldc + G;
        cublasOperation_t *oa = c->gops, *ob = oa + G;
        float *al = c->galpha, *be = al + G;
        for (int64_t i = 0; i < n; i++) {
            moept__gemm_cm cm = moept__gemm_colmajor(&g[i]);
            oa[i] = cm.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
            ob[i] = cm.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
            m[i] = cm.m; nn[i] = cm.n; k[i] = cm.k;
            lda[i] = cm.lda; ldb[i] = cm.ldb; ldc[i] = cm.ldc; gs[i] = 1;
            al[i] = cm.alpha; be[i] = cm.beta;
            const int j = (int)(i % MOEPT__NPTR);
            pv.p[3 * j] = cm.a; pv.p[3 * j + 1] = cm.b; pv.p[3 * j + 2] = cm.c;
            if (j + 1 < MOEPT__NPTR && i + 1 < n) continue; /* a full launch, or the last */
            MOEPT__LAUNCH(moept__k_ptrs, 1, 3 * (j + 1), 0, c->s)(pv, j + 1, G, dp + i - j);
            MOEPT__LAUNCHED();
        }
        cublasStatus_t r = cublasGemmGroupedBatchedEx_64(
            c->blas, oa, ob, m, nn, k, al, dp, ta, lda, dp + G, ta, ldb, be, (void *const *)(dp + 2 * G), tc,
            ldc, n, gs, CUBLAS_COMPUTE_32F);
        if (r != CUBLAS_STATUS_SUCCESS)
            return moept__kfail(err, MOEPT_ERR_DEVICE,
                                "cublasGemmGroupedBatchedEx_64: %s (moept_kernels.cu:%d)",
                                cublasGetStatusString(r), __LINE__);
        return MOEPT_OK;
    }
#endif
    /* one cublasGemmEx each; several spread over the side streams (each writes its own C), which
       fork from s and join back before s goes on: the same order for what comes after */
    const int ns = n > 1 ? (int)(n < c->nside ? n : c->nside) : 0;
    if (ns) MOEPT__CU(cudaEventRecord(c->ev_fork, c->s));
    for (int j = 0; j < ns; j++) MOEPT__CU(cudaStreamWaitEvent(c->side[j], c->ev_fork, 0));
    cublasStatus_t r = CUBLAS_STATUS_SUCCESS;
    for (int64_t i = 0; i < n && r == CUBLAS_STATUS_SUCCESS; i++) {
        moept__gemm_cm cm = moept__gemm_colmajor(&g[i]);
        cublasHandle_t h = ns ? c->side_blas[i % ns] : c->blas;
        r = cublasGemmEx_64(h, cm.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                            cm.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, cm.m, cm.n, cm.k, &cm.alpha, cm.a, ta,
                            cm.lda, cm.b, ta, cm.ldb, &cm.beta, cm.c, tc, cm.ldc, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT);
    }
    for (int j = 0; j < ns; j++) { /* joined even after a failed call */
        MOEPT__CU(cudaEventRecord(c->ev_side[j], c->side[j]));
        MOEPT__CU(cudaStreamWaitEvent(c->s, c->ev_side[j], 0));
    }
    if (r != CUBLAS_STATUS_SUCCESS)
        return moept__kfail(err, MOEPT_ERR_DEVICE, "cublasGemmEx_64: %s (moept_kernels.cu:%d)",
                            cublasGetStatusString(r), __LINE__);
    return MOEPT_OK;
}

/* The weights the expert GEMMs read: fp32 master weights, or their bf16 copy. */
static const float *moept__w(moept__cuda *c, int64_t off) {
    if (!c->wlow) return c->params + off;
    return (const float *)((const moept__bf16 *)c->wlow + (off - c->sp.E * c->sp.D));
}

/* The activation over R rows: a = act(h) [R][lda] from h [R][H] (an
   inference layer's a is h, lda H); bwd: dh over h from da (in a, lda F) */
template <typename T>
static moept_status moept__act(moept__cuda *c, int bwd, void *h, void *a, int64_t R, int64_t F, int64_t H,
                               int64_t lda, char *err) {
    if (R <= 0) return MOEPT_OK;
    const int vec = moept__vec<T>(F, h, a);
    const moept__shape sh = moept__rows_shape(R, vec ? F / MOEPT__VEC(T) : F);
    if (bwd)
        MOEPT__LAUNCH_V(vec, moept__k_act_bwd, T, sh.g, sh.b, c->s, c->sp.act, (T *)h, (const T *)a, R,
                        (int)F, (int)H);
    else
        MOEPT__LAUNCH_V(vec, moept__k_act_fwd, T, sh.g, sh.b, c->s, c->sp.act, (const T *)h, R, (int)F,
                        (int)H, (T *)a, (int)lda);
    MOEPT__LAUNCHED();
    return MOEPT_OK;
}

/* ---- the grouped expert GEMM on Hopper (options.gemm_form MOEPT_GEMM_KERNEL) ----
   One launch computes one of the expert FFN's three products over every run
   i (rows [r0, r0 + rows) of expert e), the form a template argument:
     FWD    out[r][n]  = sum_k A[r][k] B[e][n][k]   (h = x W13^T, y = a W2^T)
     DGRAD  out[r][n]  = sum_k A[r][k] B[e][k][n]   (da = dy W2, dx = dh W13)
     WGRAD  G[e][m][n] += sum_r A[r][m] B[r][n]     (g2 += dy^T a, g13 += dh^T x; r over the run's rows:
                                                     a run an expert)
     GATE   FWD's h = x W13^T with the gated activation in its epilogue: a tile's columns are 64 of the
            gate half and the same 64 of the up half, so a thread holds g and u of its columns and
            writes h and a = act(g, u) (the activation pass fused)
     DACT   DGRAD's da = dy W2 with the activation's backward in its epilogue: each thread reads g and u
            of its columns from h and writes dh = act'(g, u, da) over them (da never stored)
     FWD8   FWD in E4M3 (config.fp8): A the rows quantized 1 x 128, B the weights' E4M3 copy [E][bn][K]
            (a dgrad's: W^T's, the transposed copy)
            with 128 x 128 scales; each 128-wide k-step (four k32 wgmmas) summed apart, then promoted into
            the fp32 accumulators times its row's and block's scales (moept__gk_promote)
     GATE8  GATE in E4M3 (FWD8's operands and promotion; B's gate and up rows of W13's E4M3 copy): a
            tile is two such subtiles, 128 columns of a, one after the other; each stores h and a as
            GATE does and keeps its rows' amax of a, and the tile's end quantizes a's rows along them
            in that 1 x 128 tile (the W2 product's A, moept__k_q8_rows' bytes) from a as stored and,
            with WGRAD8 and F a multiple of 128, down its 128 rows (the W2 wgrad's I, kept for the
            backward: moept__q8_kept), and x's records down their rows from each k-step's A (the W13
            wgrad's I: moept__gk_xcols)
     DACT8  DACT in E4M3 (FWD8's product; A dy's records, or the shared expert's rows): with records
            and F a multiple of 128 the tile's end also quantizes dh as stored along its rows (the W13
            dgrad's A) and, with WGRAD8, down its 128 rows (the W13 wgrad's O: moept__k_q8_cols'
            bytes, the wide [Cp][S]), and its copier dy's records down their rows from each k-step's A
            (the W2 wgrad's O: moept__q8_dyc)
     WGRAD8 WGRAD in E4M3: A and B the wgrad's column copies, K-major along the run's rows (one
            [Mp][S] and one [Np][S], every expert's columns from r0 padded to 128: moept__q8_down's S),
            both with 128 x 1 scales; FWD8's k-steps and promotion, each sum times its row's scale of A
            and its column's of B
   Persistent CTAs walk the (run, m-tile, n-tile) space; a producer loads A
   and B tiles into a ring of stages (mbarriers: full when the bytes landed,
   empty when both consumer warpgroups read it): one thread by TMA, or,
   for an operand whose rows TMA cannot take, the first warpgroup's 128
   threads by their own loads into the same swizzled boxes; two consumer
   warpgroups each multiply 64 rows of the 128-row tile with wgmma (bf16, or E4M3 in FWD8;
   fp32 accumulators) and write their rows (rows past the run or columns
   past N masked; WGRAD adds into the fp32 gradient, each tile by one CTA).
   Every tile is 128-byte swizzled: a row of K (K-major: FWD's operands,
   A of DGRAD) or a line of 64 along M or N (MN-major: DGRAD's B, WGRAD's
   both, wgmma's transpose immediates) is one swizzle span. Each Hopper
   instruction is one small device function below: inline PTX on sm_90a,
   tests/emu's emulation (which checks what the hardware requires) in the
   emulated build. */
#define MOEPT__GK_BM 128      /* rows of a tile: two consumer warpgroups of 64 */
#define MOEPT__GK_BN 128      /* columns: wgmma's n */
#define MOEPT__GK_BK 64       /* reduction step: 128 bytes of bf16, one swizzle span */
#ifndef MOEPT_GK_STAGES /* (tools/gpu_check.sh grouped sweeps 2 to 6: 32 KiB a stage) */
#define MOEPT_GK_STAGES 4
#endif
#define MOEPT__GK_ST MOEPT_GK_STAGES /* stages in the ring */
#ifndef MOEPT_GK_GATHER /* (1: at one rank the gate/up GEMM gathers its rows: moept__gk_gather) */
#define MOEPT_GK_GATHER 1
#endif
#if MOEPT__GK_ST < 2 || MOEPT__GK_ST > 6
#error "MOEPT_GK_STAGES: 2 to 6 (the ring in 227 KiB of shared memory)"
#endif
#define MOEPT__GK_THREADS 384 /* producer warpgroup, then two consumers */
#define MOEPT__GK_RUNS 240    /* runs a launch takes by value (the parameters stay under 4 KB) */
#define MOEPT__GK_TILE_B (MOEPT__GK_BM * MOEPT__GK_BK * 2) /* = the B tile's: BN == BM */
#define MOEPT__GK_HALF (MOEPT__GK_TILE_B / 2)             /* 64 of a tile's 128 rows, or lines */
/* the ring, its barriers, GATE8's row amaxes (a consumer's 64 rows x 4 threads) and the records' column
   partial amaxes (GATE8's consumer's 2 x 128, DACT8's copier's: moept__gk_xcols), the swizzle's
   alignment */
#define MOEPT__GK_SMEM (2 * MOEPT__GK_ST * MOEPT__GK_TILE_B + 2 * MOEPT__GK_ST * 8 + 4 * 64 * 4 * 4 + 1024)
enum { MOEPT__GK_FWD, MOEPT__GK_DGRAD, MOEPT__GK_WGRAD, MOEPT__GK_GATE, MOEPT__GK_DACT, MOEPT__GK_FWD8,
       MOEPT__GK_GATE8, MOEPT__GK_DACT8, MOEPT__GK_WGRAD8, MOEPT__GK_FORMS };
/* whether form F multiplies E4M3 operands with their scales (DACT8: FWD8's product, DACT's epilogue) */
#define MOEPT__GK_Q(F) \
    ((F) == MOEPT__GK_FWD8 || (F) == MOEPT__GK_GATE8 || (F) == MOEPT__GK_DACT8 || (F) == MOEPT__GK_WGRAD8)
/* whether form F is a weight gradient: tiles over an expert's gradient, k-steps over its run's rows */
#define MOEPT__GK_WG(F) ((F) == MOEPT__GK_WGRAD || (F) == MOEPT__GK_WGRAD8)
/* a (sub)tile's columns of N: 128, or (GATE, GATE8) 64 of the gate half and the same 64 of the up half */
#define MOEPT__GK_TN(F) ((F) == MOEPT__GK_GATE || (F) == MOEPT__GK_GATE8 ? MOEPT__GK_BN / 2 : MOEPT__GK_BN)
/* a k-step's elements of the reduction: 128 bytes, 64 bf16 or (E4M3) 128, one scale block */
#define MOEPT__GK_KB(F) (MOEPT__GK_Q(F) ? 2 * MOEPT__GK_BK : MOEPT__GK_BK)

/* an operand whose rows TMA cannot take (a row stride or base not a multiple of 16 bytes): bf16
   [rows][cols], rows ld elements apart, which the producer warpgroup loads itself (moept__gk_box) */
typedef struct moept__gk_src {
    const uint16_t *p;
    int64_t ld;
    int32_t rows, cols;
    const int64_t *idx;       /* [rows]: row r is p's row idx[r] (-1: zeros); NULL: row r */
    int32_t e4m3;             /* E4M3 rows (FP8 records): ld and cols count their bytes in pairs, a box's
                                 columns 128 bytes from byte c0 */
} moept__gk_src;

typedef struct moept__gk_args {
    int32_t r0[MOEPT__GK_RUNS], rows[MOEPT__GK_RUNS], e[MOEPT__GK_RUNS];
    int32_t n;                /* runs */
    int32_t M, N, K;          /* WGRAD: the gradient's rows an expert; its columns, or out's; the reduction
                                 (FWD, DGRAD) */
    int64_t ldo;              /* out's row stride (elements) */
    void *out;                /* bf16 [rows][ldo], or (WGRAD) fp32 [E][M][N] */
    const int64_t *cnt;       /* the sync-free mode's committed counts [P][cstride] (device); NULL: off */
    int64_t cB, cstride, cbase; /* ... a run's blocks of cB rows, rank s's block of expert e holding
                                   cnt[s cstride + cbase + e] real rows, the rest zeros */
    int32_t cP;               /* ... blocks a run */
    int32_t act, hout;        /* GATE: the activation (config.act); whether h is stored (not when a lies
                                 over it) */
    void *a;                  /* GATE: a = act(g, u) bf16 [rows][lda] */
    int64_t lda;
    moept__gk_src src[2];     /* A and B where loaded by the producer warpgroup, not TMA: */
    int32_t lsu;              /* ... bit 0 A, bit 1 B (0: both by TMA, one producer thread) */
    int32_t bn;               /* B's rows an expert (FWD: N; GATE: 2N; FWD8, GATE8: the padded rows) */
    const float *sa, *sb;     /* FWD8: A's 1 x 128 scales, row r's k-block b at sa[r sars + b sabs] (r <
                                 sarows); B's [E][sbe] of 128 x 128 blocks [ceil(bn/128)][sbld] */
    int64_t sarows, sars, sabs, sbe, sbld;
    uint8_t *qa;              /* GATE8: a's rows quantized [rows][ldq] E4M3, tile b's scale at
                                 qs[r + b qsb]; DACT8: dh's, or NULL */
    float *qs;
    int64_t ldq, qsb;
    uint8_t *qc;              /* GATE8, DACT8 (with qa): a's, dh's columns down its rows [ldq][qcS] E4M3,
                                 m-tile mt of the launch's runs (theirs in order) its 128 columns from
                                 o = qc0 + 128 mt (qc0: the runs' before the launch, their rows padded to
                                 128), scales at qcs[c + (o / 128) ldq]; NULL: not written */
    float *qcs;
    int64_t qcS, qc0;
    uint8_t *qx;              /* GATE8, DACT8 (with qc): A's records (x's, dy's) down their rows [K][qcS] as
                                 qc's columns are laid out (scales at qxs[c + (o / 128) K]), its CTAs'
                                 shares of each k-step's A (moept__gk_xcols); NULL: not written */
    float *qxs;
    int64_t qxD;              /* ... their columns (D; K its padded width) */
} moept__gk_args;
/* (a kernel's parameters: 4 KB, the two tensor maps and these) */
static_assert(sizeof(moept__gk_args) + 2 * sizeof(CUtensorMap) <= 4096, "moept__gk_args: too many runs");

#if defined(MOEPT_CUDA_EMU_KERNELS_H)
#define MOEPT__BOUNDS(t)
#else
#define MOEPT__BOUNDS(t) __launch_bounds__(t, 1)
#endif
#if defined(MOEPT_CUDA_EMU_KERNELS_H)
#define MOEPT__SM90 1
#elif defined(__CUDA_ARCH_FEAT_SM90_ALL) /* sm_90a: wgmma is an arch-specific feature (PTX ISA) */
#define MOEPT__SM90 2
#else
#define MOEPT__SM90 0
#endif
__device__ __forceinline__ uint32_t moept__smem_u32(const void *p) {
#if MOEPT__SM90
    return (uint32_t)__cvta_generic_to_shared(p);
#else
    return (uint32_t)(uintptr_t)p;
#endif
}
/* each primitive: the emulator's call in the emulated build, the PTX on sm_90a, nothing elsewhere */
#if MOEPT__SM90 == 1
#define MOEPT__HOPPER(emu, ...) emu
#elif MOEPT__SM90 == 2
#define MOEPT__HOPPER(emu, ...) __VA_ARGS__
#else
#define MOEPT__HOPPER(emu, ...) ((void)0)
#endif
__device__ __forceinline__ void moept__mbar_init(uint64_t *bar, unsigned count) {
    MOEPT__HOPPER(moept_emu_mbar_init(bar, count),
                  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(moept__smem_u32(bar)),
                               "r"(count) : "memory"));
}
__device__ __forceinline__ void moept__fence_mbar_init(void) {
    MOEPT__HOPPER(moept_emu_fence_mbar_init(),
                  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"));
}
__device__ __forceinline__ void moept__mbar_arrive(uint64_t *bar) {
    MOEPT__HOPPER(moept_emu_mbar_arrive(bar),
                  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];"
                               ::"r"(moept__smem_u32(bar)) : "memory"));
}
__device__ __forceinline__ void moept__mbar_expect_tx(uint64_t *bar, unsigned bytes) {
    MOEPT__HOPPER(moept_emu_mbar_arrive_expect_tx(bar, bytes),
                  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;"
                               ::"r"(moept__smem_u32(bar)), "r"(bytes) : "memory"));
}
/* the expect-tx operation alone: TMA loads' bytes announced before they are issued, the arrival later */
__device__ __forceinline__ void moept__mbar_expect(uint64_t *bar, unsigned bytes) {
    MOEPT__HOPPER(moept_emu_mbar_expect_tx(bar, bytes),
                  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;"
                               ::"r"(moept__smem_u32(bar)), "r"(bytes) : "memory"));
}
__device__ __forceinline__ void moept__mbar_wait(uint64_t *bar, unsigned parity) {
    MOEPT__HOPPER(moept_emu_mbar_wait(bar, parity),
                  for (uint32_t ok = 0; !ok;)
                      asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                                   "selp.u32 %0, 1, 0, p;\n}"
                                   : "=r"(ok) : "r"(moept__smem_u32(bar)), "r"(parity) : "memory"));
}
/* the box at (c0, c1) of map's tensor into dst, its bytes completing on bar */
__device__ __forceinline__ void moept__tma_load(void *dst, const CUtensorMap *map, int c0, int c1,
                                                uint64_t *bar) {
    MOEPT__HOPPER(moept_emu_tma_load_2d(dst, map, c0, c1, bar),
                  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                               "[%0], [%1, {%2, %3}], [%4];"
                               ::"r"(moept__smem_u32(dst)), "l"(map), "r"(c0), "r"(c1),
                               "r"(moept__smem_u32(bar)) : "memory"));
}
__device__ __forceinline__ void moept__wgmma_fence(void) {
    MOEPT__HOPPER(moept_emu_wgmma_fence(), asm volatile("wgmma.fence.sync.aligned;" ::: "memory"));
}
__device__ __forceinline__ void moept__wgmma_commit(void) {
    MOEPT__HOPPER(moept_emu_wgmma_commit(), asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"));
}
/* the accumulators d [N] as a compiler fence (no instruction; CUTLASS's warpgroup_fence_operand): the
   compiler keeps every other read and write of them on its side of it, so none moves into a wgmma's
   flight (a read after wgmma.wait_group stays after it) */
template <int N = 64>
__device__ __forceinline__ void moept__acc_fence(float *d) {
#if MOEPT__SM90 == 2
#pragma unroll
    for (int j = 0; j < N; j++) asm volatile("" : "+f"(d[j])::"memory");
#else
    (void)d;
#endif
}
/* v, which every thread of the warp holds alike, as the compiler can see it: lane 0's broadcast (so a
   branch on it is not divergent, and ptxas does not serialize the wgmmas behind it: its C7518) */
__device__ __forceinline__ int moept__warp_uniform(int v) {
#if MOEPT__SM90 == 2
    return __shfl_sync(0xffffffffu, v, 0);
#else
    return v;
#endif
}
/* wgmma.wait_group N: until at most N of this warpgroup's newest groups are pending */
template <int N>
__device__ __forceinline__ void moept__wgmma_wait(void) {
    MOEPT__HOPPER(moept_emu_wgmma_wait(N),
                  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"));
}
/* fence.proxy.async: this thread's shared-memory stores before it, visible to the async proxy (a wgmma's
   operand reads) once a barrier orders them before the wgmma */
__device__ __forceinline__ void moept__fence_proxy_async(void) {
    MOEPT__HOPPER(moept_emu_fence_proxy_async(), asm volatile("fence.proxy.async.shared::cta;" ::: "memory"));
}
/* bar.sync id, n: the named barrier id (1-15) of n threads (the two consumer warpgroups: 256) */
__device__ __forceinline__ void moept__bar_sync(unsigned id, unsigned n) {
    MOEPT__HOPPER(moept_emu_bar_sync(id, n), asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"));
}
/* wgmma's 64 accumulators: the instruction's register list, and the asm's operands (d[0..63]) */
#define MOEPT__WG_DLIST                                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "  \
    "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "  \
    "%62, %63}"
#define MOEPT__WG_D(d)                                                                                  \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),    \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),      \
        "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),    \
        "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),    \
        "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),    \
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),    \
        "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),    \
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),    \
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
/* d [64] (this thread's part of a 64 x 128 fp32 tile) = A B (+ d if acc): A 64 x 16 and B 16 x 128 bf16
   in shared memory through descriptors da, db, 128-byte swizzled, each K-major (TA, TB 0) or MN-major (1:
   the instruction's transpose immediates) */
template <int TA, int TB>
__device__ __forceinline__ void moept__wgmma_128(float *d, uint64_t da, uint64_t db, int acc) {
    MOEPT__HOPPER(moept_emu_wgmma_bf16(d, 128, da, db, acc, TA, TB),
                  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MOEPT__WG_DLIST
                               ", %64, %65, p, 1, 1, %67, %68;\n}\n"
                               : MOEPT__WG_D(d)
                               : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB)));
    (void)d; (void)da; (void)db; (void)acc;
}
/* the same with A 64 x 32 and B 32 x 128 E4M3, K-major (FP8 has no transpose) */
__device__ __forceinline__ void moept__wgmma_e4m3_128(float *d, uint64_t da, uint64_t db, int acc) {
    MOEPT__HOPPER(moept_emu_wgmma_e4m3(d, 128, da, db, acc),
                  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MOEPT__WG_DLIST
                               ", %64, %65, p, 1, 1;\n}\n"
                               : MOEPT__WG_D(d)
                               : "l"(da), "l"(db), "r"(acc)));
    (void)d; (void)da; (void)db; (void)acc;
}
/* ... and with B 32 x 64 (d [32]: a 64 x 64 tile, the fragment's first 32 registers' places) */
#define MOEPT__WG_DLIST32                                                                                    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
__device__ __forceinline__ void moept__wgmma_e4m3_64(float *d, uint64_t da, uint64_t db, int acc) {
    MOEPT__HOPPER(moept_emu_wgmma_e4m3(d, 64, da, db, acc),
                  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                               "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " MOEPT__WG_DLIST32
                               ", %32, %33, p, 1, 1;\n}\n"
                               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                                 "+f"(d[30]), "+f"(d[31])
                               : "l"(da), "l"(db), "r"(acc)));
    (void)d; (void)da; (void)db; (void)acc;
}
/* a 128-byte-swizzled tile's descriptor at p (its pattern 1024-aligned; PTX ISA, wgmma, "Matrix
   Descriptor Format", "Canonical Layouts"): K-major, rows of 128 bytes 8 to a 1024-byte group (the
   stride offset), the leading offset unused (1); MN-major (mn), lines of 64 along M or N, one a k: 8 k
   a 1024-byte group (the stride offset), the next 64 of M or N the leading offset (a half tile) on */
__device__ __forceinline__ uint64_t moept__gk_desc(const void *p, int mn) {
    return (uint64_t)((moept__smem_u32(p) & 0x3FFFF) >> 4) | (uint64_t)(mn ? MOEPT__GK_HALF >> 4 : 1) << 16 |
           (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}
/* register i of thread t's 64 x 128 accumulators: its row and column (PTX ISA, "Matrix fragments for
   wgmma.mma_async .m64nNk16", D) */
__device__ __forceinline__ int moept__gk_row(int i, int t) {
    return 16 * (t / 32) + (t % 32) / 4 + 8 * ((i >> 1) & 1);
}
__device__ __forceinline__ int moept__gk_col(int i, int t) { return 8 * (i >> 2) + 2 * (t % 4) + (i & 1); }

/* run i's m-tiles and k-steps: FWD and DGRAD tile its rows and step through K, WGRAD tiles the
   gradient's M rows and steps through its rows */
template <int F>
MOEPT_HD static inline int moept__gk_mtiles(const moept__gk_args *g, int i) {
    const int m = MOEPT__GK_WG(F) ? (g->rows[i] > 0 ? g->M : 0) : g->rows[i];
    return (m + MOEPT__GK_BM - 1) / MOEPT__GK_BM;
}
/* ... its n-tiles, and the launch's tiles (the host sizes the grid by them, the CTAs walk them) */
template <int F>
MOEPT_HD static inline int moept__gk_ntiles(const moept__gk_args *g) {
    const int tn = F == MOEPT__GK_GATE8 ? MOEPT__GK_BN : MOEPT__GK_TN(F); /* (GATE8: two subtiles a tile) */
    return (g->N + tn - 1) / tn;
}
/* ... tile nt's subtiles: GATE8's second where N reaches it */
template <int F>
__device__ __forceinline__ int moept__gk_subs(const moept__gk_args *g, int nt) {
    return F == MOEPT__GK_GATE8 && g->N - nt * MOEPT__GK_BN > MOEPT__GK_BN / 2 ? 2 : 1;
}
template <int F>
MOEPT_HD static inline int64_t moept__gk_tiles(const moept__gk_args *g) {
    int64_t tiles = 0;
    for (int i = 0; i < g->n; i++) tiles += (int64_t)moept__gk_mtiles<F>(g, i) * moept__gk_ntiles<F>(g);
    return tiles;
}
template <int F>
__device__ __forceinline__ int moept__gk_ksteps(const moept__gk_args *g, int i) {
    return ((MOEPT__GK_WG(F) ? g->rows[i] : g->K) + MOEPT__GK_KB(F) - 1) / MOEPT__GK_KB(F);
}

/* whether rows [r, r + n) of run i hold a real row: always, but in the sync-free mode, whose blocks
   hold their committed count of rows and zeros after (what a tile of zero rows gives is known: zeros,
   or nothing to add; the tile space stays the static one, the same launch in a captured graph) */
__device__ __forceinline__ int moept__gk_live(const moept__gk_args *g, int i, int64_t r, int64_t n) {
    if (!g->cnt) return 1;
    for (int64_t s = r / g->cB; s < g->cP && s * g->cB < r + n; s++) {
        const int64_t lo = s * g->cB, hi = lo + g->cnt[s * g->cstride + g->cbase + g->e[i]];
        if ((r > lo ? r : lo) < (r + n < hi ? r + n : hi)) return 1;
    }
    return 0;
}

/* tile tile of the launch: its run, m-tile and n-tile (the runs' m-tiles in order, n fastest) */
template <int F>
__device__ __forceinline__ int moept__gk_locate(const moept__gk_args *g, int tile, int *mt, int *nt) {
    const int ntn = moept__gk_ntiles<F>(g);
    for (int i = 0; i < g->n; i++) {
        const int n = moept__gk_mtiles<F>(g, i) * ntn;
        if (tile < n) {
            *mt = tile / ntn;
            *nt = tile % ntn;
            return i;
        }
        tile -= n;
    }
    return -1;
}

/* the 8 columns col.. of s's row pr (zeros past its end) in 16-, 8- or 4-byte loads as the address allows */
__device__ __forceinline__ uint4 moept__gk_chunk(const moept__gk_src *s, int64_t pr, int col) {
    if (col >= s->cols) return make_uint4(0, 0, 0, 0);
    const uint16_t *e = s->p + pr * s->ld + col;
    const int al = (int)((uintptr_t)e & 15);
    if (col + 8 > s->cols || al % 4) { /* the row's end, or a 2-byte aligned chunk */
        uint16_t h[8];
#pragma unroll
        for (int u = 0; u < 8; u++) h[u] = col + u < s->cols ? e[u] : 0;
        return make_uint4(h[0] | (uint32_t)h[1] << 16, h[2] | (uint32_t)h[3] << 16,
                          h[4] | (uint32_t)h[5] << 16, h[6] | (uint32_t)h[7] << 16);
    }
    if (al == 0) return *(const uint4 *)e;
    if (al == 8) {
        const uint2 a = ((const uint2 *)e)[0], b = ((const uint2 *)e)[1];
        return make_uint4(a.x, a.y, b.x, b.y);
    }
    const uint32_t *w = (const uint32_t *)e;
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* the producer warpgroup's copy of a box as a TMA load of it writes it (moept__tma_load, its map's
   swizzle): columns c0.. (64; E4M3 rows: bytes c0.., 128) of rows r1.. (n) of s (through s->idx: a
   gather) into dst, 16-byte chunk
   q of box row j at chunk q ^ (j % 8), zeros past the tensor and from box row lim on (the rows: a
   gather's, or not all 16-byte aligned, else TMA loads them). A thread's chunks c = t + 128 i (at most
   8: n <= 128 rows): their rows first (a gather's index), then every load, then the stores, so that its
   loads are in flight together; the caller fences them for the async proxy and arrives on the stage's
   full barrier (its consumers' wait orders them before their wgmmas) */
__device__ __forceinline__ void moept__gk_box(uint8_t *dst, const moept__gk_src *s, int c0, int r1, int n,
                                              int lim) {
    const int t = threadIdx.x % 128;
    if (s->e4m3) c0 /= 2; /* (a box row: 128 bytes either way) */
    int64_t pr[8];
    uint4 v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) { /* (-1: a zero chunk) */
        const int c = t + 128 * i, j = c / 8;
        const int64_t r = (int64_t)r1 + j;
        pr[i] = c < 8 * n && j < lim && r < s->rows ? (s->idx ? s->idx[r] : r) : -1;
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = pr[i] >= 0 ? moept__gk_chunk(s, pr[i], c0 + 8 * (t % 8)) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int c = t + 128 * i, j = c / 8, q = c % 8;
        if (c < 8 * n) *(uint4 *)(dst + ((128 * j + 16 * q) ^ (j % 8) << 4)) = v[i];
    }
}

/* operand o's box at (c0, c1) of n rows into dst: pass 0 the producer warpgroup's own loads (g->lsu's
   operands; rows from lim on zeros), pass 1 the TMA loads (the others; thread 0 issues them, their bytes
   completing on bar) */
__device__ __forceinline__ void moept__gk_fetch(const moept__gk_args *g, const CUtensorMap *map, int o,
                                                int pass, uint8_t *dst, int c0, int c1, int n, int lim,
                                                uint64_t *bar) {
    if (g->lsu >> o & 1) {
        if (pass == 0) moept__gk_box(dst, &g->src[o], c0, c1, n, lim);
    } else if (pass == 1 && threadIdx.x == 0) {
        moept__tma_load(dst, map, c0, c1, bar);
    }
}

/* the producer: k-step kb of run i's tile (mt, nt) into stage (a, b), pass by pass (moept__gk_fetch).
   K-major tiles are one box of 64 x 128, MN-major ones two of 64 x 64 (a line of 64 is the span) */
template <int F>
__device__ __forceinline__ void moept__gk_load(const CUtensorMap *ma, const CUtensorMap *mb,
                                               const moept__gk_args *g, int i, int mt, int nt, int kb,
                                               uint8_t *a, uint8_t *b, uint64_t *bar, int pass) {
    const int k0 = kb * MOEPT__GK_KB(F), n0 = nt * MOEPT__GK_TN(F);
    if (F == MOEPT__GK_WGRAD8) { /* A, B: the run's columns r0 + k0.. of rows mt.., nt.. (TMA alone) */
        moept__gk_fetch(g, ma, 0, pass, a, g->r0[i] + k0, mt * MOEPT__GK_BM, MOEPT__GK_BM, 0, bar);
        moept__gk_fetch(g, mb, 1, pass, b, g->r0[i] + k0, nt * MOEPT__GK_BN, MOEPT__GK_BN, 0, bar);
        return;
    }
    /* the run's rows left in the box (the producer's own loads read no further; B's weights: all) */
    const int v = g->rows[i] - (F == MOEPT__GK_WGRAD ? k0 : mt * MOEPT__GK_BM);
    if (F == MOEPT__GK_WGRAD) /* A: the run's rows k0.. of dy or dh [rows][M] */
        for (int h = 0; h < 2; h++)
            moept__gk_fetch(g, ma, 0, pass, a + h * MOEPT__GK_HALF, mt * MOEPT__GK_BM + 64 * h,
                            g->r0[i] + k0, 64, v, bar);
    else /* A: rows of the run [rows][K] */
        moept__gk_fetch(g, ma, 0, pass, a, k0, g->r0[i] + mt * MOEPT__GK_BM, MOEPT__GK_BM, v, bar);
    const int vb = F == MOEPT__GK_WGRAD ? v : MOEPT__GK_BM;
    if (F == MOEPT__GK_FWD || F == MOEPT__GK_FWD8 || F == MOEPT__GK_DACT8) /* B: expert e's W [N][K] in
                                                                                [E bn][K] */
        moept__gk_fetch(g, mb, 1, pass, b, k0, g->e[i] * g->bn + n0, MOEPT__GK_BN, vb, bar);
    else if (F == MOEPT__GK_GATE || F == MOEPT__GK_GATE8) /* B: rows n0.. of expert e's gate half and of
                                                               its up half, [E bn][K] (bn: 2N, or padded) */
        for (int h = 0; h < 2; h++)
            moept__gk_fetch(g, mb, 1, pass, b + h * MOEPT__GK_HALF, k0, g->e[i] * g->bn + h * g->N + n0, 64,
                            vb, bar);
    else /* B: expert e's W [K][N] in [E K][N], or (WGRAD) the run's rows of x or a [rows][N] */
        for (int h = 0; h < 2; h++)
            moept__gk_fetch(g, mb, 1, pass, b + h * MOEPT__GK_HALF, n0 + 64 * h,
                            F == MOEPT__GK_WGRAD ? g->r0[i] + k0 : g->e[i] * g->K + k0, 64, vb, bar);
}

/* the producer fills stage (a, b). TMA alone: thread 0's arrival announces the loads' bytes, then it
   issues them. Else thread 0 announces the TMA loads' bytes (if any) and issues them first, then every
   producer thread makes its own loads, fences them for the async proxy and arrives */
template <int F>
__device__ __forceinline__ void moept__gk_produce(const CUtensorMap *ma, const CUtensorMap *mb,
                                                  const moept__gk_args *g, int i, int mt, int nt, int kb,
                                                  uint8_t *a, uint8_t *b, uint64_t *bar) {
    const unsigned tx = (g->lsu & 1 ? 0 : MOEPT__GK_TILE_B) + (g->lsu & 2 ? 0 : MOEPT__GK_TILE_B);
    if (!g->lsu) {
        moept__mbar_expect_tx(bar, tx);
        moept__gk_load<F>(ma, mb, g, i, mt, nt, kb, a, b, bar, 1);
        return;
    }
    if (threadIdx.x == 0 && tx) moept__mbar_expect(bar, tx);
    moept__gk_load<F>(ma, mb, g, i, mt, nt, kb, a, b, bar, 1);
    moept__gk_load<F>(ma, mb, g, i, mt, nt, kb, a, b, bar, 0);
    moept__fence_proxy_async();
    moept__mbar_arrive(bar);
}

/* WGRAD's last k-step of a run: its rows from v on are the next run's (or zeros past the tensor), in A
   and B alike. Consumer w zeroes those lines of A's and B's half w that TMA loaded (the producer's own
   loads leave them zeros; lsu: g->lsu) (a line one k; the swizzle moves 16-byte chunks within a line),
   fences them for the async proxy, and both consumers meet at a barrier before either multiplies (B is
   shared). A chunk is always the same thread's */
__device__ __forceinline__ void moept__gk_tail(uint8_t *a, uint8_t *b, int v, int lsu) {
    const int t = threadIdx.x % 128;
    if (lsu == 3) return;
    for (int c = t; c < MOEPT__GK_HALF / 16; c += 128)
        if (c / 8 >= v) {
            if (!(lsu & 1)) *(uint4 *)(a + 16 * c) = make_uint4(0, 0, 0, 0);
            if (!(lsu & 2)) *(uint4 *)(b + 16 * c) = make_uint4(0, 0, 0, 0);
        }
    moept__fence_proxy_async();
    moept__bar_sync(1, 256);
}

/* consumer w's k-step from stage (a, b): d (+)= its 64 rows of A times B, 16 of K a wgmma (E4M3: 32),
   issued as one group (the caller waits for it); GATE8: B's half from b alone, 64 columns into d [32]
   (so its k-step sums take 32 registers, not 64) */
template <int F>
__device__ __forceinline__ void moept__gk_mma(float *d, const uint8_t *a, const uint8_t *b, int w, int acc) {
    constexpr int TA = F == MOEPT__GK_WGRAD, TB = F == MOEPT__GK_DGRAD || F == MOEPT__GK_WGRAD || /* MN- */
                                                  F == MOEPT__GK_DACT;                            /* major */
    const uint64_t da = moept__gk_desc(a + w * MOEPT__GK_HALF, TA), db = moept__gk_desc(b, TB);
    moept__acc_fence<F == MOEPT__GK_GATE8 ? 32 : 64>(d);
    moept__wgmma_fence();
    for (int k = 0; k < 4; k++) { /* 32 bytes of a K-major row a wgmma, or 2 groups of MN lines */
        if (F == MOEPT__GK_GATE8) moept__wgmma_e4m3_64(d, da + 2 * k, db + 2 * k, acc || k > 0);
        else if (MOEPT__GK_Q(F)) moept__wgmma_e4m3_128(d, da + 2 * k, db + 2 * k, acc || k > 0);
        else moept__wgmma_128<TA, TB>(d, da + (TA ? 128 : 2) * k, db + (TB ? 128 : 2) * k, acc || k > 0);
    }
    moept__wgmma_commit();
}

/* FWD8, GATE8: consumer w's scales of k-step kb for its thread's two rows (moept__gk_row): FWD8's s[h]
   the row's 1 x 128 one of A times the tile's 128 x 128 one of B; GATE8's s[h] the row's, s[2] the gate
   rows' block's, s[3] and s[4] the up rows' two (they cross a block where N is not a multiple of 64)
   (loaded before the step's wgmmas are issued) */
template <int F>
__device__ __forceinline__ void moept__gk_scales(const moept__gk_args *g, int i, int mt, int nt, int kb,
                                                 int w, float *s) {
    const int l = threadIdx.x % 128, last = (g->bn + 127) / 128 - 1, bu = (g->N + nt * 64) / 128;
    const float *sb = g->sb + g->e[i] * g->sbe + kb;
    const float sg = sb[(F == MOEPT__GK_GATE8 ? nt / 2 : nt) * g->sbld];
    for (int h = 0; h < 2; h++) { /* (rows past the run's are never stored, and may be a chunk's still
                                     arriving: not read) */
        const int64_t r = (int64_t)g->r0[i] + mt * MOEPT__GK_BM + w * 64 + moept__gk_row(2 * h, l);
        const int in = r < g->sarows && r - g->r0[i] < g->rows[i];
        const float sa = in ? g->sa[r * g->sars + kb * g->sabs] : 0.0f;
        s[h] = F == MOEPT__GK_GATE8 ? sa : sa * sg;
    }
    if constexpr (F == MOEPT__GK_GATE8) {
        s[2] = sg;
        for (int q = 0; q < 2; q++) s[3 + q] = sb[(bu + q < last ? bu + q : last) * g->sbld];
    }
}
/* WGRAD8: consumer w's scales of k-step kb of run i (its columns' 128 x 1 tiles, from column r0): s[h] its
   thread's two rows' of A (past A's rows: 0), and *bv B's of the thread's column of nt's 128 (past bn: 0),
   loaded before the wgmmas are issued (moept__gk_bscales shares them after) */
__device__ __forceinline__ void moept__gk_scales_wg(const moept__gk_args *g, int i, int mt, int nt, int kb,
                                                    int w, float *s, float *bv) {
    const int l = threadIdx.x % 128;
    const int64_t tb = g->r0[i] / MOEPT__GK_KB(MOEPT__GK_WGRAD8) + kb; /* (the k-step's tile row) */
    for (int h = 0; h < 2; h++) {
        const int64_t m = (int64_t)mt * MOEPT__GK_BM + w * 64 + moept__gk_row(2 * h, l);
        s[h] = m < g->sarows ? g->sa[tb * g->sars + m] : 0.0f;
    }
    const int64_t n = (int64_t)nt * MOEPT__GK_BN + l;
    *bv = n < g->bn ? g->sb[tb * g->sbld + n] : 0.0f;
}
/* ... B's 128 column scales of consumer w's k-step, each thread's bv, into bs [128] for all 128 threads
   (the step's half of red's two: the previous step's readers passed the barrier before this one's
   writers, so one barrier a step) */
__device__ __forceinline__ void moept__gk_bscales(float *bs, float bv, int w) {
    bs[threadIdx.x % 128] = bv;
    moept__bar_sync(2 + w, 128);
}
/* ... its sums t into d times those scales, register 4q + u (moept__gk_col: row u / 2, column 8 q + 2 (l
   % 4) + u % 2), B's from bs */
__device__ __forceinline__ void moept__gk_promote_wg(float *d, const float *t, const float *s,
                                                     const float *bs) {
    const int l = threadIdx.x % 128;
#pragma unroll
    for (int q = 0; q < 16; q++) {
        const float2 b = *(const float2 *)(bs + 8 * q + 2 * (l % 4));
        d[4 * q] += t[4 * q] * (s[0] * b.x);
        d[4 * q + 1] += t[4 * q + 1] * (s[0] * b.y);
        d[4 * q + 2] += t[4 * q + 2] * (s[1] * b.x);
        d[4 * q + 3] += t[4 * q + 3] * (s[1] * b.y);
    }
}
/* GATE8: which of thread l's registers j of an up half (bit j) hold a column of the up rows' second block */
__device__ __forceinline__ uint32_t moept__gk_umask(const moept__gk_args *g, int nt) {
    const int l = threadIdx.x % 128, n0 = g->N + nt * 64;
    uint32_t m = 0;
    for (int j = 0; j < 32; j++) m |= (uint32_t)((n0 + moept__gk_col(j, l)) / 128 != n0 / 128) << j;
    return m;
}
/* ... its block sums t into d (zeros where a tile starts) times those scales (the promotion into fp32
   every 128 of K, DeepSeek-V3's: the tensor cores' FP8 sums keep fewer bits); GATE8: half H of d (the
   gate columns, or the up ones) from t [32], each scale the product FWD8's would be */
template <int F, int H = 0>
__device__ __forceinline__ void moept__gk_promote(float *d, const float *t, const float *s, uint32_t um) {
    if constexpr (F == MOEPT__GK_GATE8) {
#pragma unroll
        for (int j = 0; j < 32; j++)
            d[32 * H + j] += t[j] * (s[(j >> 1) & 1] * (H ? s[3 + (um >> j & 1)] : s[2]));
    } else {
#pragma unroll
        for (int j = 0; j < 64; j++) d[j] += t[j] * s[(j >> 1) & 1];
    }
}

/* p[0] = bf16(x), and p[1] = bf16(y) where two: one 4-byte store where p is 4-byte aligned */
__device__ __forceinline__ void moept__st_bf16x2(moept__bf16 *p, float x, float y, int two) {
    if (two && ((uintptr_t)p & 3) == 0) {
        *(uint32_t *)p = (uint32_t)moept__f32_to_bf16(x) | (uint32_t)moept__f32_to_bf16(y) << 16;
    } else {
        p[0] = moept__f32_to_bf16(x);
        if (two) p[1] = moept__f32_to_bf16(y);
    }
}

/* consumer w's rows [64 w, 64 w + 64) of run i's tile (mt, nt) into out, past the run (M) or N masked:
   bf16 stores, or (WGRAD) added to expert e's fp32 gradient (registers j and j + 1, j even, hold
   columns c and c + 1 of one row: stored as a pair) */
template <int F>
__device__ __forceinline__ void moept__gk_store(const moept__gk_args *g, const float *d, int i, int mt,
                                                int nt, int w) {
    const int t = threadIdx.x % 128;
    const int64_t rbase = mt * MOEPT__GK_BM + w * 64, cbase = (int64_t)nt * MOEPT__GK_BN;
    const int64_t rows = MOEPT__GK_WG(F) ? g->M : g->rows[i];
#pragma unroll
    for (int j = 0; j < 64; j += 2) {
        const int64_t r = rbase + moept__gk_row(j, t), col = cbase + moept__gk_col(j, t);
        if (r >= rows || col >= g->N) continue;
        if (MOEPT__GK_WG(F)) {
            float *o = (float *)g->out + ((int64_t)g->e[i] * g->M + r) * g->N + col;
            o[0] += d[j];
            if (col + 1 < g->N) o[1] += d[j + 1];
        } else {
            moept__st_bf16x2((moept__bf16 *)g->out + (g->r0[i] + r) * g->ldo + col, d[j], d[j + 1],
                             col + 1 < g->N);
        }
    }
}

/* GATE's epilogue: consumer w's rows of run i's tile nt, the gate columns n0 + c (c < 64) in registers
   j < 32 and the up columns in j + 32 (the D fragment's column 64 + c): h's two as bf16, then a =
   act(g, u) from those bf16 values, as the activation pass computes it from h; pam[h] (GATE8; else
   NULL) the amax of a as stored in the thread's row h */
__device__ __forceinline__ void moept__gk_store_act(const moept__gk_args *g, const float *d, int i, int mt,
                                                    int nt, int w, float *pam) {
    const int t = threadIdx.x % 128;
    const int64_t rbase = mt * MOEPT__GK_BM + w * 64, cbase = (int64_t)nt * MOEPT__GK_TN(MOEPT__GK_GATE);
    moept__bf16 *h = (moept__bf16 *)g->out, *a = (moept__bf16 *)g->a;
#pragma unroll /* (d stays in registers) */
    for (int j = 0; j < 32; j += 2) { /* (j and j + 1: columns c and c + 1 of one row, stored as pairs) */
        const int64_t r = rbase + moept__gk_row(j, t), col = cbase + moept__gk_col(j, t);
        if (r >= g->rows[i] || col >= g->N) continue;
        const int two = col + 1 < g->N;
        float gv[2], uv[2], av[2];
        for (int q = 0; q < 2; q++) { /* h's bf16 values, and act of them */
            gv[q] = moept__bf16_to_f32(moept__f32_to_bf16(d[j + q]));
            uv[q] = moept__bf16_to_f32(moept__f32_to_bf16(d[j + q + 32]));
            av[q] = moept__act_fwd1(g->act, gv[q], uv[q]);
        }
        const int64_t at = (g->r0[i] + r) * g->ldo + col;
        if (g->hout) {
            moept__st_bf16x2(h + at, gv[0], gv[1], two);
            moept__st_bf16x2(h + at + g->N, uv[0], uv[1], two);
        }
        moept__st_bf16x2(a + (g->r0[i] + r) * g->lda + col, av[0], av[1], two);
        for (int q = 0; pam && q < 1 + two; q++)
            pam[(j >> 1) & 1] =
                moept__q8_amax(pam[(j >> 1) & 1], moept__bf16_to_f32(moept__f32_to_bf16(av[q])));
    }
}

/* GATE8's end of tile nt (DACT8's where it quantizes dh, once a half): consumer w's rows of src [..][lds]
   (GATE8: a; DACT8: dh over h) in the tile's 128 columns from column c0 (DACT8's up half: N), this
   thread's own columns read back (the stores before), quantized along the row into qa's same columns, one
   1 x 128 tile (moept__k_q8_rows' bytes, zeros from N to lim): the row's amax from its 4 threads' (pam)
   through red [64][4], its scale at qs[r + b qsb], b the tile's block of qa's row */
__device__ __forceinline__ void moept__gk_store_q8(const moept__gk_args *g, int i, int mt, int nt, int w,
                                                   const float *pam, float *red, const moept__bf16 *src,
                                                   int64_t lds, int64_t c0, int64_t lim) {
    const int t = threadIdx.x % 128;
    const int64_t rbase = mt * MOEPT__GK_BM + w * 64;
    float sc[2];
    for (int h = 0; h < 2; h++) red[moept__gk_row(2 * h, t) * 4 + t % 4] = pam[h];
    moept__bar_sync(2 + w, 128);
    for (int h = 0; h < 2; h++) {
        float amax = 0.0f;
        for (int u = 0; u < 4; u++) amax = moept__q8_amax(amax, red[moept__gk_row(2 * h, t) * 4 + u]);
        sc[h] = moept__q8_scale(amax);
    }
    moept__bar_sync(2 + w, 128); /* (red read by all before the next tile's writes) */
    for (int j = 0; j < 64; j += 2) { /* (GATE8's j < 32: the first subtile's columns, else the second's) */
        const int64_t r = rbase + moept__gk_row(j, t), col = (int64_t)nt * MOEPT__GK_BN + moept__gk_col(j, t);
        if (r >= g->rows[i] || col >= lim) continue;
        const int64_t row = g->r0[i] + r;
        const moept__bf16 *p = src + row * lds + c0 + col;
        const int64_t live = g->N - col; /* (of the pair: from N on zeros) */
        const float v0 = live > 0 ? moept__bf16_to_f32(p[0]) : 0.0f;
        const float v1 = live > 1 ? moept__bf16_to_f32(p[1]) : 0.0f;
        const int bits = live > 1 ? 3 : live > 0;
        const uint32_t b = moept__q8_pair(v0, v1, sc[(j >> 1) & 1]) & moept__q8_bytes(bits);
        *(uint16_t *)(g->qa + row * g->ldq + c0 + col) = (uint16_t)b;
    }
    for (int h = 0; h < 2 && t % 4 == 0; h++) {
        const int64_t r = rbase + moept__gk_row(2 * h, t);
        if (r < g->rows[i]) g->qs[g->r0[i] + r + (c0 / MOEPT__GK_BN + nt) * g->qsb] = sc[h];
    }
}

/* The end of tile (mt, nt) where GATE8 writes a's column copy, DACT8 dh's (g->qc): the tile's columns as
   stored (GATE8: a's 128 from nt 128; DACT8: dh's gate half's 128 from nt 128 and its up half's from
   N + nt 128; N a multiple of 128), each down the tile's 128 rows of run i in one 128 x 1 tile
   (moept__k_q8_cols' bytes and scale, zeros past the run's rows), into its column of qc from o (the
   tile's m-tile over the launch's runs, tile / its n-tiles: as g->qc says). The two consumers' 256
   threads (both stored their rows first: a barrier of the two), column t % 128 of each half, rows
   64 (t / 128).., each column's amax from its two threads' through red [halves][256] */
template <int F>
__device__ void moept__gk_store_q8c(const moept__gk_args *g, int tile, int i, int mt, int nt, int w,
                                    float *red) {
    constexpr int NH = F == MOEPT__GK_DACT8 ? 2 : 1; /* (the halves) */
    const int t = (int)threadIdx.x % 128 + 128 * w, hr = t / 128;
    const int64_t o = g->qc0 + (int64_t)(tile / moept__gk_ntiles<F>(g)) * MOEPT__GK_BM;
    const int64_t r0 = (int64_t)mt * MOEPT__GK_BM + 64 * hr, v = g->rows[i] - r0; /* (v: rows live) */
    const int64_t ld = F == MOEPT__GK_GATE8 ? g->lda : g->ldo;
    const moept__bf16 *src = (const moept__bf16 *)(F == MOEPT__GK_GATE8 ? g->a : g->out) +
                             (g->r0[i] + r0) * ld;
    float sc[NH];
    moept__bar_sync(1, 256);
    for (int h = 0; h < NH; h++) {
        const int64_t c = h * g->N + (int64_t)nt * MOEPT__GK_BN + t % 128;
        float amax = 0.0f;
        for (int64_t r = 0; r < 64 && r < v; r++)
            amax = moept__q8_amax(amax, moept__bf16_to_f32(src[r * ld + c]));
        red[256 * h + t] = amax;
    }
    moept__bar_sync(1, 256);
    for (int h = 0; h < NH; h++)
        sc[h] = moept__q8_scale(moept__q8_amax(red[256 * h + t % 128], red[256 * h + 128 + t % 128]));
    moept__bar_sync(1, 256); /* (red read by all before the next tile's writes) */
    for (int h = 0; h < NH; h++) {
        const int64_t c = h * g->N + (int64_t)nt * MOEPT__GK_BN + t % 128;
        for (int k = 0; k < 64; k += 16) {
            float x[16];
            int live = 0;
            for (int e = 0; e < 16; e++) {
                const int in = k + e < v;
                x[e] = in ? moept__bf16_to_f32(src[(k + e) * ld + c]) : 0.0f;
                live |= in << e;
            }
            *(uint4 *)(g->qc + c * g->qcS + o + 64 * hr + k) = moept__q8_16(x, live, sc[h]);
        }
        if (hr == 0) g->qcs[c + (o / MOEPT__Q8_TILE) * g->ldq] = sc[h];
    }
}

/* DACT's (DACT8's) epilogue: consumer w's rows of run i's tile (mt, nt) of da, each value rounded to
   bf16 as the dgrad's store would, then dh = act'(g, u, da) from h's g and u, written over them, as the
   activation pass's backward computes it; pam (DACT8's, where it quantizes dh; else NULL): the amax of
   dh as stored in the thread's row h, pam[h] the gate half's, pam[2 + h] the up half's */
__device__ __forceinline__ void moept__gk_store_dact(const moept__gk_args *g, const float *d, int i, int mt,
                                                     int nt, int w, float *pam) {
    const int t = threadIdx.x % 128;
    const int64_t rbase = mt * MOEPT__GK_BM + w * 64, cbase = (int64_t)nt * MOEPT__GK_BN;
    moept__bf16 *h = (moept__bf16 *)g->out;
#pragma unroll /* (d stays in registers) */
    for (int j = 0; j < 64; j++) {
        const int64_t r = rbase + moept__gk_row(j, t), col = cbase + moept__gk_col(j, t);
        if (r >= g->rows[i] || col >= g->N) continue;
        const int64_t at = (g->r0[i] + r) * g->ldo + col;
        float dg, du;
        moept__act_bwd1(g->act, moept__bf16_to_f32(h[at]), moept__bf16_to_f32(h[at + g->N]),
                        moept__bf16_to_f32(moept__f32_to_bf16(d[j])), &dg, &du);
        const moept__bf16 bg = moept__f32_to_bf16(dg), bu = moept__f32_to_bf16(du);
        h[at] = bg;
        h[at + g->N] = bu;
        if (pam) { /* (the gate half's, the up half's) */
            pam[(j >> 1) & 1] = moept__q8_amax(pam[(j >> 1) & 1], moept__bf16_to_f32(bg));
            pam[2 + ((j >> 1) & 1)] = moept__q8_amax(pam[2 + ((j >> 1) & 1)], moept__bf16_to_f32(bu));
        }
    }
}

/* GATE8 or DACT8 with g->qx: this CTA's share of the 128 columns of A's k-step kb in stage a (x's or
   dy's FP8 records as loaded: E4M3 bytes in the 128-byte swizzle, each row's 1 x 128 scale from g->sa)
   dequantized and quantized again down the m-tile's 128 rows of run i into their copy down the rows
   (the W13 wgrad's I, the W2 wgrad's O): column kb 128 + c at
   qx[.. qcS + o], its scale at qxs[.. + (o / 128) K] (moept__k_q8_cols' bytes and scale from records,
   zeros past the run's rows and A's qxD columns, non-finite scales as it meets them; columns past K not
   written). Tile nt of ntn takes the columns [128 nt / ntn, 128 (nt + 1) / ntn): each n-tile's CTA loads
   the same A, so the copy costs no read. A group of nth threads (thread l of it; named barrier bar)
   nth / 16 columns a round, from column first of the round's step columns (GATE8's two consumers share
   a round's 16), 16 threads a column, 8 rows each (rows 8 p.., read in turn from row 8 p + p % 8: the
   16 threads' reads fall in 8 banks, not one), the column's amax from its 16 threads'
   through part [2][128] (the round's half by *par: the round before's readers passed this round's barrier
   first, so one a round); every read of a done at the last round's barrier. The group (MOEPT__GK_COPIER):
   DACT8's copier, the producer warpgroup's warps but its first (idle where TMA loads: the copy runs
   beside the consumers' wgmmas); GATE8's consumer w (between its gate and up halves: with a copier there
   ptxas spilled the consumers' registers) */
#define MOEPT__GK_COPIER(F) ((F) == MOEPT__GK_DACT8)
#define MOEPT__GK_XT 96 /* the copier's threads: warps 1 to 3 */
#define MOEPT__GK_XB 4  /* its named barrier (1: the consumers', 2 + w: consumer w's) */
/* whether this thread is form F's copier (the launch's records' copy by TMA loads: moept__gk refuses the
   producer warpgroup's own loads with it) */
template <int F>
__device__ __forceinline__ int moept__gk_copier(const moept__gk_args *g) {
    return MOEPT__GK_COPIER(F) && g->qx && !g->lsu && threadIdx.x >= 32 && threadIdx.x < 128;
}
template <int F>
__device__ __forceinline__ void moept__gk_xcols(const moept__gk_args *g, int i, int mt, int nt, int kb,
                                                const uint8_t *a, int64_t o, float *part, int *par, int l,
                                                int first, int step, int nth, int bar) {
    const int p = l % 16, ntn = moept__gk_ntiles<F>(g), cf = first + l / 16; /* (its column of a round) */
    const int c0 = 128 * nt / ntn, c1 = 128 * (nt + 1) / ntn, n = g->rows[i] - mt * MOEPT__GK_BM;
    const int64_t r0 = (int64_t)g->r0[i] + mt * MOEPT__GK_BM;
    const int any = cf < c1 - c0; /* (a column of the share in some round: Mixtral's 112 n-tiles share 128
                                      columns, one or two a CTA) */
    float rs[8]; /* (turn e's row 8 p + (e + p) % 8: its scale; past the run's rows 0, not read) */
    for (int e = 0; e < 8; e++) {
        const int r = 8 * p + ((e + p) & 7);
        rs[e] = any && r < n ? g->sa[(r0 + r) * g->sars + kb * g->sabs] : 0.0f;
    }
    for (int cb = c0; cb < c1; cb += step) {
        const int c = cb + cf, in = c < c1 && kb * 128 + c < g->K; /* (c past the share: none) */
        const int64_t gc = (int64_t)kb * 128 + c;
        float v[8], amax = 0.0f;
        for (int e = 0; e < 8; e += 2) { /* (byte c of box row r: its 16-byte chunk at c / 16 ^ r % 8) */
            uint32_t b = 0;
            for (int u = 0; u < 2; u++) {
                const int r = 8 * p + ((e + u + p) & 7);
                const int at = 128 * r + (((c >> 4) ^ (r & 7)) << 4) + (c & 15);
                b |= in && r < n ? (uint32_t)a[at] << (8 * u) : 0u; /* (past the rows: 0, their scale 0) */
            }
            const float2 d = moept__e4m3x2_f32(b);
            v[e] = d.x * rs[e], v[e + 1] = d.y * rs[e + 1];
        }
        for (int e = 0; e < 8; e++) amax = moept__q8_amax(amax, v[e]);
        float *pp = part + (*par & 1) * 128;
        (*par)++;
        pp[l] = amax;
        moept__bar_sync(bar, nth);
        for (int u = 0; u < 16; u++) amax = moept__q8_amax(amax, pp[l - p + u]);
        const float sc = moept__q8_scale(amax);
        uint64_t q = 0; /* (turn e's byte at e, then rotated to (e + p) % 8: rows 8 p.. in order) */
        if (gc < g->qxD) {
            int live = 0;
            for (int e = 0; e < 8; e++) live |= (8 * p + ((e + p) & 7) < n) << e;
            q = (uint64_t)moept__q8_word(v + 4, live >> 4, sc) << 32 | moept__q8_word(v, live, sc);
        }
        const int rot = 8 * (p & 7);
        q = rot ? q << rot | q >> (64 - rot) : q;
        if (in) *(uint2 *)(g->qx + gc * g->qcS + o + 8 * p) = make_uint2((uint32_t)q, (uint32_t)(q >> 32));
        if (in && p == 0) g->qxs[gc + (o / MOEPT__Q8_TILE) * g->K] = sc;
    }
}

/* one (sub)tile's k-steps of run i's tile (mt, nt), the producer's loads (P), or consumer w's products
   into d (WGRAD8: B's column scales through red's [2][2][128], consumer w's two halves a step each in
   turn); xo >= 0 (g->qx): A's records' copy down their rows from each k-step's A, the m-tile's from
   column xo of it (moept__gk_xcols), by GATE8's consumers through red's [2][2][128] after the
   epilogues' own 512 floats, or by DACT8's copier (the producer warpgroup's threads from 32: each stage
   waited for as full, then freed by one more arrival, its own) through its [2][128]; whether none ran */
template <int F, int P>
__device__ __forceinline__ int moept__gk_steps(const CUtensorMap *ma, const CUtensorMap *mb,
                                               const moept__gk_args *g, int w, uint8_t *sa, uint8_t *sb,
                                               uint64_t *full, uint64_t *empty, int i, int mt, int nt,
                                               int *it, float *d, float *t, float *red, int64_t xo,
                                               int *xpar) {
    int first = 1, held = -1; /* held: the stage whose wgmmas may be in flight */
    const int nkb = moept__gk_ksteps<F>(g, i);
    const uint32_t um = F == MOEPT__GK_GATE8 && !P ? moept__gk_umask(g, nt) : 0;
    const int live = MOEPT__GK_WG(F) || moept__gk_live(g, i, (int64_t)mt * MOEPT__GK_BM, MOEPT__GK_BM);
    for (int kb = 0; kb < nkb && live; kb++) {
        if (MOEPT__GK_WG(F) && !moept__gk_live(g, i, (int64_t)kb * MOEPT__GK_KB(F), MOEPT__GK_KB(F)))
            continue; /* (the producer and the consumers skip the same steps) */
        const int s = *it % MOEPT__GK_ST, phase = (*it / MOEPT__GK_ST) & 1;
        (*it)++;
        uint8_t *a = sa + s * MOEPT__GK_TILE_B, *b = sb + s * MOEPT__GK_TILE_B;
        if constexpr (P) {
            if (moept__gk_copier<F>(g)) {
                moept__mbar_wait(&full[s], phase);
                if (xo >= 0)
                    moept__gk_xcols<F>(g, i, mt, nt, kb, a, xo, red + 512, xpar, (int)threadIdx.x - 32, 0,
                                       MOEPT__GK_XT / 16, MOEPT__GK_XT, MOEPT__GK_XB);
                if (threadIdx.x == 32) moept__mbar_arrive(&empty[s]);
            } else {
                moept__mbar_wait(&empty[s], phase ^ 1); /* a fresh ring: free */
                moept__gk_produce<F>(ma, mb, g, i, mt, nt, kb, a, b, &full[s]);
            }
        } else {
            moept__mbar_wait(&full[s], phase);
            const int v = g->rows[i] - kb * MOEPT__GK_BK;
            if (F == MOEPT__GK_WGRAD && v < MOEPT__GK_BK)
                moept__gk_tail(a + w * MOEPT__GK_HALF, b + w * MOEPT__GK_HALF, v, g->lsu);
            if constexpr (F == MOEPT__GK_GATE8) { /* (the gate half, then the up half) */
                float sc[5];
                moept__gk_scales<F>(g, i, mt, nt, kb, w, sc);
                moept__gk_mma<F>(t, a, b, w, 0);
                moept__wgmma_wait<0>();
                moept__acc_fence<32>(t);
                moept__gk_promote<F, 0>(d, t, sc, um);
                if (xo >= 0) /* (t free: no spills, as it would be with the up half's wgmmas in flight) */
                    moept__gk_xcols<F>(g, i, mt, nt / 2, kb, a, xo, red + 512 + 256 * w, xpar,
                                       (int)threadIdx.x % 128, 8 * w, 16, 128, 2 + w);
                moept__gk_mma<F>(t, a, b + MOEPT__GK_HALF, w, 0);
                moept__wgmma_wait<0>();
                moept__acc_fence<32>(t);
                if (threadIdx.x % 128 == 0) moept__mbar_arrive(&empty[s]);
                moept__gk_promote<F, 1>(d, t, sc, um);
            } else if constexpr (MOEPT__GK_Q(F)) { /* (its stage freed at once: t read, promoted) */
                float sc[2], bv = 0.0f; /* (WGRAD8: B's column scale, shared through bs as the wgmmas run) */
                float *bs = red + w * 256 + (*it & 1) * 128;
                if constexpr (F == MOEPT__GK_WGRAD8) moept__gk_scales_wg(g, i, mt, nt, kb, w, sc, &bv);
                else moept__gk_scales<F>(g, i, mt, nt, kb, w, sc);
                moept__gk_mma<F>(t, a, b, w, 0);
                if constexpr (F == MOEPT__GK_WGRAD8) moept__gk_bscales(bs, bv, w);
                moept__wgmma_wait<0>();
                moept__acc_fence(t);
                if (threadIdx.x % 128 == 0) moept__mbar_arrive(&empty[s]);
                if constexpr (F == MOEPT__GK_WGRAD8) moept__gk_promote_wg(d, t, sc, bs);
                else moept__gk_promote<F>(d, t, sc, um);
            } else {
                moept__gk_mma<F>(d, a, b, w, !first);
                moept__wgmma_wait<1>();
                if (held >= 0 && threadIdx.x % 128 == 0) moept__mbar_arrive(&empty[held]);
                held = s;
            }
        }
        first = 0;
    }
    if constexpr (P == 0) { /* (a wait on every path: ptxas injects none before d's reads) */
        moept__wgmma_wait<0>();
        moept__acc_fence(d);
        if (held >= 0 && threadIdx.x % 128 == 0) moept__mbar_arrive(&empty[held]);
    }
    return first;
}

/* this CTA's tiles (GATE8: each its subtiles), k-step by k-step through the ring of stages
   (moept__gk_steps). P 1: the producer (waits for a stage to be empty, loads A's and B's tiles into it:
   moept__gk_produce); P 0: consumer warpgroup w, 0 or 1 (waits for a stage to be full, issues its
   wgmmas, then waits for the step before's and frees that stage, so one step's multiplies run while the
   next is issued; stores each finished tile); DACT8's copier with P (moept__gk_xcols). What keeps
   ptxas from serializing the wgmmas or injecting waits (its C7518, C7517; tests/check_ptxas.sh lists
   them): the role a template argument and warp-uniform (no branch on it between the wgmmas), d zeroed
   where a tile starts (not on a path after the loop), read after a wait every consumer passes */
template <int F, int P>
__device__ void moept__gk_walk(const CUtensorMap *ma, const CUtensorMap *mb, const moept__gk_args *g, int w,
                               uint8_t *sa, uint8_t *sb, uint64_t *full, uint64_t *empty, float *red) {
    const int tiles = (int)moept__gk_tiles<F>(g); /* (under INT_MAX: moept__gk_launch) */
    int it = 0, xpar = 0; /* (xpar: moept__gk_xcols' rounds) */
    float d[64], t[F == MOEPT__GK_GATE8 ? 32 : MOEPT__GK_Q(F) ? 64 : 1]; /* t: the E4M3 forms' k-step sums,
                                                                           promoted into d */
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int mt = 0, nt = 0;
        const int i = moept__gk_locate<F>(g, tile, &mt, &nt);
        float pam[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* GATE8: the amax of a in this thread's two rows (DACT8:
                                                    of dh's gate half, then its up half's) */
        for (int sub = 0; sub < moept__gk_subs<F>(g, nt); sub++) {
            const int st = F == MOEPT__GK_GATE8 ? 2 * nt + sub : nt; /* (the subtile: 64 columns) */
            for (int j = 0; j < 64; j++) d[j] = 0.0f; /* (zero rows in: zeros out) */
            const int x8 = F == MOEPT__GK_GATE8 || F == MOEPT__GK_DACT8;
            /* (the records' copy: the m-tile's, by its copying threads) */
            const int cp = MOEPT__GK_COPIER(F) ? P && moept__gk_copier<F>(g) : !P && g->qx;
            const int64_t xo = x8 && cp && sub == 0
                                   ? g->qc0 + (int64_t)(tile / moept__gk_ntiles<F>(g)) * MOEPT__GK_BM
                                   : -1;
            const int64_t xu = moept__warp_uniform((int)(xo >= 0)) ? xo : -1; /* (no divergent branch) */
            const int first = moept__gk_steps<F, P>(ma, mb, g, w, sa, sb, full, empty, i, mt, st, &it, d, t,
                                                    red, xu, &xpar);
            if (P || (first && MOEPT__GK_WG(F))) continue; /* (nothing to add) */
            if (F == MOEPT__GK_GATE || F == MOEPT__GK_GATE8)
                moept__gk_store_act(g, d, i, mt, st, w, F == MOEPT__GK_GATE8 ? pam : NULL);
            else if (F == MOEPT__GK_DACT || F == MOEPT__GK_DACT8)
                moept__gk_store_dact(g, d, i, mt, nt, w, F == MOEPT__GK_DACT8 && g->qa ? pam : NULL);
            else moept__gk_store<F>(g, d, i, mt, nt, w);
        }
        const moept__bf16 *qsrc = (const moept__bf16 *)(F == MOEPT__GK_GATE8 ? g->a : g->out);
        if constexpr (F == MOEPT__GK_GATE8 && P == 0) {
            moept__gk_store_q8(g, i, mt, nt, w, pam, red + w * 256, qsrc, g->lda, 0, g->ldq);
            if (g->qc) moept__gk_store_q8c<F>(g, tile, i, mt, nt, w, red);
        }
        if constexpr (F == MOEPT__GK_DACT8 && P == 0)
            if (g->qa) { /* (the whole CTA's) the gate half, then the up half */
                moept__gk_store_q8(g, i, mt, nt, w, pam, red + w * 256, qsrc, g->ldo, 0, g->N);
                moept__gk_store_q8(g, i, mt, nt, w, pam + 2, red + w * 256, qsrc, g->ldo, g->N, g->N);
                if (g->qc) moept__gk_store_q8c<F>(g, tile, i, mt, nt, w, red);
            }
    }
}

template <int F>
__global__ void MOEPT__BOUNDS(MOEPT__GK_THREADS) moept__k_gk(const __grid_constant__ CUtensorMap ma,
                                                             const __grid_constant__ CUtensorMap mb,
                                                             const __grid_constant__ moept__gk_args g) {
#if MOEPT__SM90
    MOEPT__DYN_SMEM(smem);
    smem += (1024 - (moept__smem_u32(smem) & 1023)) & 1023; /* the swizzle's repeat, whatever the base */
    uint8_t *sa = smem, *sb = smem + MOEPT__GK_ST * MOEPT__GK_TILE_B;
    uint64_t *full = (uint64_t *)(sb + MOEPT__GK_ST * MOEPT__GK_TILE_B), *empty = full + MOEPT__GK_ST;
    if (threadIdx.x == 0) {
        for (int s = 0; s < MOEPT__GK_ST; s++) {
            moept__mbar_init(&full[s], g.lsu ? 128 : 1); /* the producer threads */
            moept__mbar_init(&empty[s], 2 + (MOEPT__GK_COPIER(F) && g.qx)); /* each consumer warpgroup's
                                               first thread, once its group retired (wgmma.wait_group waits
                                               for the whole warpgroup), and the copier's, once it read */
        }
        moept__fence_mbar_init();
    }
    __syncthreads();
    const int wg = moept__warp_uniform(threadIdx.x / 128); /* the first warpgroup produces (TMA alone: its
                                                               thread 0) */
    float *red = (float *)(empty + MOEPT__GK_ST); /* (GATE8's row amaxes: [2][64][4]; WGRAD8's column
                                                      scales: [2][2][128]; the copier's column amaxes
                                                      [2][128] after 512) */
    if (wg > 0) moept__gk_walk<F, 0>(&ma, &mb, &g, wg - 1, sa, sb, full, empty, red);
    else if (threadIdx.x == 0 || g.lsu || moept__gk_copier<F>(&g))
        moept__gk_walk<F, 1>(&ma, &mb, &g, -1, sa, sb, full, empty, red);
#endif
}

/* whether this build has the kernel's code: sm_90a, or the emulator (a one-thread launch at create) */
__global__ void moept__k_probe_sm90(int *built) { *built = MOEPT__SM90 != 0; }

/* cuTensorMapEncodeTiled (CUDA Driver API), reached through the runtime: no libcuda to link */
typedef CUresult (*moept__encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                     const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                     const cuuint32_t *,
                                     CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                     CUtensorMapFloatOOBfill);

/* at create, options.gemm_form MOEPT_GEMM_KERNEL: a GPU of compute capability 9.0 and a build with the
   kernel's sm_90a code, else refused; the kernel runs where it applies (bf16 operands, config.fp8 off) */
static moept_status moept__gk_create(moept__cuda *c, char *err) {
    if (c->sp.gemm_form != MOEPT_GEMM_KERNEL) return MOEPT_OK;
    int major = 0, minor = 0, sms = 0, built = 0, *d = NULL;
    MOEPT__CU(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c->dev));
    MOEPT__CU(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, c->dev));
    MOEPT__CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c->dev));
    if (major != 9 || minor != 0)
        return moept__kfail(err, MOEPT_ERR_UNSUPPORTED, "moept_create_cuda: options.gemm_form "
                            "MOEPT_GEMM_KERNEL needs compute capability 9.0 (wgmma, TMA); this GPU has %d.%d",
                            major, minor);
    MOEPT__CU(cudaMalloc((void **)&d, sizeof *d));
    MOEPT__LAUNCH(moept__k_probe_sm90, 1, 1, 0, c->s)(d);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaMemcpyAsync(&built, d, sizeof built, cudaMemcpyDeviceToHost, c->s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->s);
    cudaFree(d);
    MOEPT__CU(e);
    if (!built)
        return moept__kfail(err, MOEPT_ERR_UNSUPPORTED, "moept_create_cuda: options.gemm_form "
                            "MOEPT_GEMM_KERNEL: this build has no sm_90a code (nvcc -gencode "
                            "arch=compute_90a,code=sm_90a)");
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050 /* (the unversioned query is deprecated from 12.5) */
    e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
#else
    e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn)
        return moept__kfail(err, MOEPT_ERR_UNSUPPORTED, "moept_create_cuda: options.gemm_form "
                            "MOEPT_GEMM_KERNEL: no cuTensorMapEncodeTiled in the driver (%s, query "
                            "result %d)", cudaGetErrorString(e), (int)q);
    const void *forms[] = {(const void *)moept__k_gk<MOEPT__GK_FWD>,
                            (const void *)moept__k_gk<MOEPT__GK_DGRAD>,
                            (const void *)moept__k_gk<MOEPT__GK_WGRAD>,
                            (const void *)moept__k_gk<MOEPT__GK_GATE>,
                            (const void *)moept__k_gk<MOEPT__GK_DACT>,
                            (const void *)moept__k_gk<MOEPT__GK_FWD8>,
                            (const void *)moept__k_gk<MOEPT__GK_GATE8>,
                            (const void *)moept__k_gk<MOEPT__GK_DACT8>,
                            (const void *)moept__k_gk<MOEPT__GK_WGRAD8>};
    static_assert(sizeof forms / sizeof forms[0] == MOEPT__GK_FORMS, "moept__gk_create: every form");
    for (int i = 0; i < MOEPT__GK_FORMS; i++)
        MOEPT__CU(cudaFuncSetAttribute(forms[i], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       MOEPT__GK_SMEM));
    c->gk_encode = (void *)fn;
    c->gk_sms = sms;
    return MOEPT_OK;
}

/* whether the kernel takes the layer's operands: bf16 (config.fp8 off) */
static int moept__gk_ok(const moept__cuda *c) {
    return c->gk_encode && c->sp.dtype == MOEPT_DTYPE_BF16 && !moept__fp8_on(&c->sp);
}
/* whether the kernel runs config.fp8's forward products and dgrads (FWD8) */
static int moept__gk_q8(const moept__cuda *c) {
    return c->gk_encode && c->sp.dtype == MOEPT_DTYPE_BF16 && moept__fp8_on(&c->sp);
}
#ifndef MOEPT_GK_WGRAD8 /* (0: config.fp8's weight gradients in the kernel form by cuBLASLt, a matmul an
                           expert, as the per-expert form's: tools/gpu_check.sh compares them) */
#define MOEPT_GK_WGRAD8 1
#endif
/* ... and its weight gradients (WGRAD8) */
static int moept__gk_w8(const moept__cuda *c) { return MOEPT_GK_WGRAD8 && moept__gk_q8(c); }
/* whether the routed experts read x's rows through the dispatch's index (the gate/up GEMM's A, the
   W13 gradient's B), no permuted copy made: where the kernel runs every GEMM that reads them and no
   exchange makes the copy anyway (one rank; MOEPT_GK_GATHER 0: the copy, as the other forms) */
static int moept__gk_gather(const moept__cuda *c) {
    return MOEPT_GK_GATHER && moept__gk_ok(c) && c->sp.P == 1 && c->C == 1;
}

/* operand o (0 A, 1 B) of g, a matrix [rows][cols] of bf16 (es 2) or E4M3 (es 1) (rows ld elements
   apart; idx: row r is p's row idx[r]): TMA boxes of 128 bytes x box rows, 128-byte swizzled, where TMA
   takes its rows (16-byte row strides and base, no index, not own), else the producer warpgroup's own
   loads of the same boxes (g->lsu, g->src; bf16) */
static moept_status moept__gk_operand(moept__cuda *c, moept__gk_args *g, CUtensorMap *m, int o, const void *p,
                                      int es, const int64_t *idx, int own, int64_t rows, int64_t cols,
                                      int64_t ld, int box_rows, char *err) {
    memset(m, 0, sizeof *m);
    if (ld * es % 16 || (uintptr_t)p % 16 || idx || own) {
        const int b8 = es == 1; /* (E4M3 rows: their bytes in pairs, as whole rows of records give them) */
        if (es != 2 && !(b8 && !idx && ld % 2 == 0 && cols % 2 == 0))
            return moept__kfail(err, MOEPT_ERR_STATE, "the grouped kernel's own loads: bf16 rows, or E4M3 "
                                "rows of an even width and stride (moept_kernels.cu:%d)", __LINE__);
        g->lsu |= 1 << o;
        g->src[o].p = (const uint16_t *)p; g->src[o].ld = b8 ? ld / 2 : ld; g->src[o].idx = idx;
        g->src[o].rows = (int32_t)rows; g->src[o].cols = (int32_t)(b8 ? cols / 2 : cols);
        g->src[o].e4m3 = b8;
        return MOEPT_OK;
    }
    const cuuint64_t dim[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, stride[1] = {(cuuint64_t)(ld * es)};
    const cuuint32_t box[2] = {(cuuint32_t)(128 / es), (cuuint32_t)box_rows}, ones[2] = {1, 1};
    const CUresult r = ((moept__encode_fn)c->gk_encode)(
        m, es == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)p, dim,
        stride, box, ones,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return moept__kfail(err, MOEPT_ERR_DEVICE, "cuTensorMapEncodeTiled: error %d (moept_kernels.cu:%d)",
                            (int)r, __LINE__);
    return MOEPT_OK;
}

/* one launch over g's runs: a CTA a multiprocessor, or a tile */
template <int F>
static moept_status moept__gk_launch(moept__cuda *c, const CUtensorMap *ma, const CUtensorMap *mb,
                                     const moept__gk_args *g, char *err) {
    const int64_t tiles = moept__gk_tiles<F>(g);
    if (tiles == 0) return MOEPT_OK;
    if (tiles >= INT_MAX)
        return moept__kfail(err, MOEPT_ERR_STATE, "the grouped kernel: %lld tiles past its 32-bit tile index "
                            "(moept_kernels.cu:%d)", (long long)tiles, __LINE__);
    const int grid = (int)(tiles < c->gk_sms ? tiles : c->gk_sms);
    /* each form launched by its own name (the emulator counts launches by name) */
#define MOEPT__GK_GO(X)                                                                                 \
    if (F == MOEPT__GK_##X)                                                                             \
    MOEPT__LAUNCH(moept__k_gk<MOEPT__GK_##X>, grid, MOEPT__GK_THREADS, MOEPT__GK_SMEM, c->s)(*ma, *mb, *g)
    MOEPT__GK_GO(FWD);
    MOEPT__GK_GO(DGRAD);
    MOEPT__GK_GO(WGRAD);
    MOEPT__GK_GO(GATE);
    MOEPT__GK_GO(DACT);
    MOEPT__GK_GO(FWD8);
    MOEPT__GK_GO(GATE8);
    MOEPT__GK_GO(DACT8);
    MOEPT__GK_GO(WGRAD8);
#undef MOEPT__GK_GO
    MOEPT__LAUNCHED();
    return MOEPT_OK;
}

/* One product of the FFN over R's runs by the kernel (the form F, above), up to MOEPT__GK_RUNS runs a
   launch: A [..][lda] bf16 rows (FWD, DGRAD: [..][K]; WGRAD: [..][M]); B the weights, W [E][N][K]
   (FWD) or [E][K][N] (DGRAD), or (WGRAD) rows [..][ldb] of N; out bf16 [..][ldo] of N, or (WGRAD) the
   fp32 gradient [E][M][N] added into (R: whole groups, an expert once); GATE as FWD with W13
   [E][2N][K] (N the gate half's columns), out h [..][ldo] of 2N (if a is not h) and act's a; DACT as
   DGRAD, out h [..][ldo] read and overwritten with dh (ga's act). xi: the rows of x through the
   dispatch's index (FWD's and GATE's A, WGRAD's B: moept__gk_gather), or NULL. cnt: the
   sync-free mode's committed counts (R its groups of P blocks), the tiles of zero rows skipped; NULL:
   every tile run */
typedef struct moept__gk_ext {   /* a form's extras */
    void *a;                    /* GATE, GATE8: a [..][lda] bf16 */
    int64_t lda;
    int act;                    /* GATE, DACT, GATE8: config.act */
    int64_t bn;                 /* FWD8, GATE8: B's rows an expert (the E4M3 copy's padded rows) */
    const float *sa, *sb;       /* FWD8, GATE8: the scales, as moept__gk_args's */
    int64_t sarows, sars, sabs, sbe, sbld;
    uint8_t *qa;                /* GATE8: a quantized, as moept__gk_args's */
    float *qs;
    int64_t ldq, qsb;
    int arec;                   /* the E4M3 forms: A FP8 records, which a chunk's runs load themselves */
    uint8_t *qc;                /* GATE8, DACT8: a's, dh's column copy, as moept__gk_args's (its qc0 the
                                   launches') */
    float *qcs;
    int64_t qcS;
    uint8_t *qx;                /* GATE8, DACT8 (with qc): A's records' copy down their rows, as
                                   moept__gk_args's */
    float *qxs;
    int64_t qxD;
} moept__gk_ext;
/* g's fields of a form's extras (ga; NULL: none) and B's rows an expert */
template <int F>
static void moept__gk_more(moept__gk_args *g, const moept__gk_ext *ga, int64_t bn) {
    g->act = ga ? ga->act : 0; g->a = ga ? ga->a : NULL; g->lda = ga ? ga->lda : 0; g->bn = (int32_t)bn;
    const int q = MOEPT__GK_Q(F), q8a = F == MOEPT__GK_GATE8 || F == MOEPT__GK_DACT8;
    g->sa = q ? ga->sa : NULL; g->sb = q ? ga->sb : NULL;
    g->sarows = q ? ga->sarows : 0; g->sars = q ? ga->sars : 0; g->sabs = q ? ga->sabs : 0;
    g->sbe = q ? ga->sbe : 0; g->sbld = q ? ga->sbld : 0;
    g->qa = q8a ? ga->qa : NULL; g->qs = q8a ? ga->qs : NULL; g->ldq = q8a ? ga->ldq : 0;
    g->qsb = q8a ? ga->qsb : 0;
    g->qc = q8a ? ga->qc : NULL; g->qcs = q8a ? ga->qcs : NULL; g->qcS = q8a ? ga->qcS : 0; g->qc0 = 0;
    g->qx = q8a && g->qc ? ga->qx : NULL; g->qxs = g->qx ? ga->qxs : NULL;
    g->qxD = g->qx ? ga->qxD : 0;
}
/* an epilogue's extras: GATE's a [..][lda], config.act, the rows' E4M3 copy qa [..][ldq] with its scales */
static moept__gk_ext moept__gk_epi(void *a, int64_t lda, int act, uint8_t *qa, float *qs, int64_t ldq) {
    moept__gk_ext e = {};
    e.a = a; e.lda = lda; e.act = act; e.qa = qa; e.qs = qs; e.ldq = ldq;
    return e;
}
template <int F>
static moept_status moept__gk(moept__cuda *c, const moept__runs *R, const void *A, int64_t lda,
                              const void *B, int64_t ldb, const int64_t *xi, int64_t M, int64_t N,
                              int64_t K, void *out, int64_t ldo, const int64_t *cnt, const moept__gk_ext *ga,
                              char *err) {
    const int wg = MOEPT__GK_WG(F), w8 = F == MOEPT__GK_WGRAD8; /* (w8: A, B the column copies) */
    int64_t end = 0, ne = 0, k0 = 0; /* the rows and the experts the runs reach; a run's first column of the
                                        column copies (WGRAD8's operands, DACT8's qc) */
    for (int64_t i = 0; i < R->n; i++) {
        int64_t r0, rows, e;
        moept__run_at(R, i, &r0, &rows, &e);
        if (rows > 0 && r0 + rows > end) end = r0 + rows;
        if (rows > 0 && e + 1 > ne) ne = e + 1;
    }
    if (end == 0) return MOEPT_OK;
    if (wg && !R->offs) /* (each gradient tile one CTA's: an expert once a launch) */
        return moept__kfail(err, MOEPT_ERR_STATE, "the grouped kernel: a weight gradient over a chunk's runs "
                            "(moept_kernels.cu:%d)", __LINE__);
    const int64_t bn = F == MOEPT__GK_FWD    ? N /* B's rows an expert */
                       : F == MOEPT__GK_GATE ? 2 * N
                       : MOEPT__GK_Q(F)      ? ga->bn
                                             : K;
    const int es = MOEPT__GK_Q(F) ? 1 : 2; /* the operands' element bytes */
    if (end >= INT_MAX / 2 || ne * bn >= INT_MAX / 2 || M >= INT_MAX / 2 ||
        N >= INT_MAX / 2 || K >= INT_MAX / 2)
        return moept__kfail(err, MOEPT_ERR_STATE, "the grouped kernel: %lld rows, %lld weight rows, M %lld, "
                            "N %lld or K %lld past TMA's 32-bit coordinates (moept_kernels.cu:%d)",
                            (long long)end, (long long)(ne * bn), (long long)M, (long long)N, (long long)K,
                            __LINE__);
    CUtensorMap ma, mb; /* K-major tiles one box of 128 rows, MN-major ones two of 64 lines */
    moept__gk_args g;
    g.lsu = 0;
    const int64_t *ai = wg ? NULL : xi, *bi = wg ? xi : NULL; /* x's rows: A, or WGRAD's B */
    /* a chunk's runs: A's rows by the producer's own loads, which stop at a run's end (TMA's box would read
       on into rows of a chunk still arriving), bf16 rows or FP8 records (the E4M3 forms' other A: a copy
       made on this stream) */
    const int own = !R->offs && (!MOEPT__GK_Q(F) || ga->arec);
    if (w8) { /* A [sarows][lda], B [bn][ldb]: every run's columns, by TMA */
        MOEPT__TRY(moept__gk_operand(c, &g, &ma, 0, A, 1, NULL, 0, ga->sarows, lda, lda, MOEPT__GK_BM, err));
        MOEPT__TRY(moept__gk_operand(c, &g, &mb, 1, B, 1, NULL, 0, bn, ldb, ldb, MOEPT__GK_BN, err));
    } else {
        MOEPT__TRY(moept__gk_operand(c, &g, &ma, 0, A, es, ai, own, end, wg ? M : K, lda,
                                     wg ? 64 : MOEPT__GK_BM, err));
        if (F == MOEPT__GK_FWD || F == MOEPT__GK_GATE || MOEPT__GK_Q(F))
            MOEPT__TRY(moept__gk_operand(c, &g, &mb, 1, B, es, NULL, 0, ne * bn, K, ldb,
                                         MOEPT__GK_TN(F) == 64 ? 64 : MOEPT__GK_BN, err));
        else MOEPT__TRY(moept__gk_operand(c, &g, &mb, 1, B, es, bi, 0, wg ? end : ne * K, N, ldb, 64, err));
    }
    if (w8 && g.lsu)
        return moept__kfail(err, MOEPT_ERR_STATE, "the grouped kernel's E4M3 weight gradient: operands TMA "
                            "cannot load (moept_kernels.cu:%d)", __LINE__);
    moept__gk_more<F>(&g, ga, bn);
    if (MOEPT__GK_COPIER(F) && g.qx && g.lsu) /* (the copier: the producer warpgroup's warps TMA leaves
                                                    idle) */
        return moept__kfail(err, MOEPT_ERR_STATE, "the grouped kernel: the records' copy down their rows "
                            "with operands TMA cannot load (moept_kernels.cu:%d)", __LINE__);
    g.n = 0; g.M = (int32_t)M; g.N = (int32_t)N; g.K = (int32_t)K; g.ldo = ldo; g.out = out;
    g.cnt = R->offs ? cnt : NULL; g.cB = c->B; g.cstride = c->M; g.cbase = c->sp.rank * c->sp.El;
    g.cP = (int32_t)c->sp.P;
    g.hout = !ga || ga->a != out;
    for (int64_t i = 0; i < R->n; i++) {
        int64_t r0, rows, e;
        moept__run_at(R, i, &r0, &rows, &e);
        const int64_t col = k0;
        k0 += MOEPT__Q8_P128(rows);
        if (rows == 0) continue;
        if (g.n == 0) g.qc0 = col;
        g.r0[g.n] = (int32_t)(w8 ? col : r0);
        g.rows[g.n] = (int32_t)rows; g.e[g.n] = (int32_t)e;
        if (++g.n == MOEPT__GK_RUNS) {
            MOEPT__TRY(moept__gk_launch<F>(c, &ma, &mb, &g, err));
            g.n = 0;
        }
    }
    return moept__gk_launch<F>(c, &ma, &mb, &g, err);
}

/* ---- the expert FFN, written once (moept.c's moept__ffn_*) -------------
   gate/up, the activation, down and their backward over a list of row runs
   (moept__runs: every group, or a chunk's runs), for the routed experts and
   the shared expert alike; config.fp8 is a property of the operands (the
   weights' E4M3 copies, cuBLASLt's block-scaled matmuls), not another copy. */
typedef struct moept__ffn {
    int64_t off13, off2;        /* the weights' masters in params (read as moept__w gives them) */
    const moept__q8w *q8;       /* config.fp8: their E4M3 copies; NULL: off */
    int64_t H, F, lda;          /* h's width (gate|up), a's, a's row stride (an inference layer's a lies
                                   over h: H) */
    const void *x;              /* [rows][D] the inputs (T), or (xi) the tokens' rows */
    const int64_t *xi;          /* [rows] x's row of each (the dispatch's index: -1 zeros) where the grouped
                                   kernel reads them through it (moept__gk_gather); NULL: x is the rows */
    int xq;                     /* x's rows are FP8 records (moept__q8_recw bytes each: config.fp8's routed
                                   experts, as their dispatch quantized them); 0: T */
    int yq;                     /* ... and the backward's dy's in y (combine' quantized them) */
    void *h, *a;                /* [rows][H] gate|up (backward: dh over it), [rows][lda] activations */
    void *y;                    /* [rows][D] the outputs; backward: their gradients in */
    void *da, *dx;              /* [rows][F], [rows][D] backward: da (may be a), dxs (may be y) */
    const int64_t *cnt;         /* the sync-free mode's committed counts (the routed experts'; device):
                                   the grouped kernel skips the blocks' zero rows; NULL: none */
    int ac;                     /* a forward of the routed experts that writes a's copy down its rows into
                                   q8a for its backward (moept__q8_kept) */
} moept__ffn;

/* The backward's dys: where combine' writes them (*out) and where the experts read them (*in), the same
   at one rank: T rows (ys, yr), or config.fp8's FP8 records (xs, which the forward's dispatch is done
   with; yq) */
static void moept__dys(const moept__cuda *c, const moept__cslot *sl, void **out, void **in) {
    const int q8 = moept__fp8_on(&c->sp);
    *in = q8 ? sl->yq : sl->yr;
    *out = c->sp.P == 1 ? *in : q8 ? sl->xs : sl->ys;
}

/* The routed experts' FFN of a slot (one chunk: da over a, dxs over dys); x the step's tokens, read
   through the dispatch's index where moept__gk_gather (else the permuted rows, xr); bwd: dy's rows in
   (config.fp8: their records, yq) */
static moept__ffn moept__ffn_routed(moept__cuda *c, moept__cslot *sl, const void *x, int bwd) {
    const moept__cuda_spec *p = &c->sp;
    const int ch = c->C > 1, gi = moept__gk_gather(c);
    const moept__q8w *q8 = moept__fp8_on(p) ? &c->q8w[0] : NULL;
    void *dout, *dys;
    moept__dys(c, sl, &dout, &dys);
    moept__ffn f = {p->off13, p->off2, q8, p->H, p->F, c->lda_a, gi ? x : sl->xr, gi ? sl->tok_of_row : NULL,
                    q8 != NULL, bwd && q8, sl->h, sl->a, bwd ? dys : sl->yr, ch ? sl->dar : sl->a,
                    ch ? sl->dxr : sl->yr, c->B ? sl->cmsg : NULL, 0};
    /* (the copy is of use where the forward's backward comes next: one training slot, or the forward run
       again into its slot, as activation recomputation does; a layer of several slots' first forward
       into one, as 1F1B's, writes none: another's backward comes first) */
    f.ac = !bwd && !sl->fwd_eval && (c->nslots <= 1 || sl->again);
    return f;
}

/* The shared expert's over x (a masked step's: xsh, its padded rows zero) */
static moept__ffn moept__ffn_shared(moept__cuda *c, moept__cslot *sl, const void *x) {
    const moept__cuda_spec *p = &c->sp;
    const moept__q8w *q8 = moept__fp8_on(p) ? &c->q8w[1] : NULL;
    moept__ffn f = {p->offs13, p->offs2, q8, p->HS, p->S, c->lda_as, x, NULL, 0, 0, sl->hs, sl->as, sl->yss,
                    sl->as, sl->yss, NULL, 0};
    return f;
}

/* The activation over R's rows: a = act(h); bwd: dh = act'(h, da) over h */
template <typename T>
static moept_status moept__ffn_act(moept__cuda *c, const moept__ffn *f, const moept__runs *R, int bwd,
                                   char *err) {
    const int64_t lda = bwd ? f->F : f->lda;
    for (int64_t i = 0; i < moept__spans(R); i++) {
        int64_t r0, rows;
        moept__span_at(R, i, &r0, &rows);
        void *a = (T *)(bwd ? f->da : f->a) + r0 * lda;
        MOEPT__TRY(moept__act<T>(c, bwd, (T *)f->h + r0 * f->H, a, rows, f->F, f->H, lda, err));
    }
    return MOEPT_OK;
}

/* n rows of in (k columns, ld apart) as an FP8 matmul's operand along k, into FP8's token scratch from row
   r0 on (q8b, q8sb, its scales ss rows apart; 0: r0 0 and ss the padded n, as moept__q8_along): quantized,
   or (rec) FP8 records, whose bytes and scales are already the operand's */
template <typename T>
static moept_status moept__q8_operand(moept__cuda *c, const char *in, int rec, int64_t n, int64_t k,
                                      int64_t ld, int64_t r0, int64_t ss, char *err) {
    uint8_t *q = c->q8b + r0 * MOEPT__Q8_PAD(k);
    return rec ? moept__q8_unrec(c, in, n, k, q, c->q8sb + r0, ss, err)
               : moept__q8_along<T>(c, in, n, k, ld, q, c->q8sb + r0, ss, err);
}

/* config.fp8's matmul of one run: out [n][m] = in [n][k] (rows ld apart, quantized along them, or FP8
   records: rec) times the E4M3 matrix wq [mp][kp] (scales sq) transposed, each result row into out (T) */
template <typename T>
static moept_status moept__q8_mm(moept__cuda *c, int64_t n, const char *in, int rec, int64_t k, int64_t ld,
                                 const uint8_t *wq, const float *sq, int64_t m, char *out, char *err) {
    const int64_t mp = MOEPT__Q8_PAD(m), np = MOEPT__Q8_PAD(n), kp = MOEPT__Q8_PAD(k);
    MOEPT__TRY(moept__q8_operand<T>(c, in, rec, n, k, ld, 0, 0, err));
    MOEPT__TRY(moept__q8_gemm(c, mp, np, kp, wq, sq, MOEPT__BLK128, c->q8b, c->q8sb, c->q8out, mp, 0, err));
    return moept__q8_result<T>(c, n, m, mp, out, m, 0, err);
}

/* config.fp8's matmuls of every group of R (whole groups): out's rows = in's (rows ld apart, quantized
   along them, or FP8 records: rec) times their expert's E4M3 matrix wq [E][mp][kp] (scales sq, ns an
   expert) transposed; the groups' operands in one pass, one matmul a group, their results in one pass */
template <typename T>
static moept_status moept__q8_mm_all(moept__cuda *c, const moept__runs *R, const char *in, int rec, int64_t k,
                                     int64_t ld, const uint8_t *wq, const float *sq, int64_t ns, int64_t m,
                                     char *out, char *err) {
    const int64_t mp = MOEPT__Q8_PAD(m), kp = MOEPT__Q8_PAD(k);
    int64_t o = 0; /* (group e's operand and result rows: from o) */
    MOEPT__TRY(moept__q8_fits(c, R, 1, err));
    MOEPT__TRY(rec ? moept__q8_unrec(c, in, 0, k, c->q8b, c->q8sb, 0, err, R->offs, R->n)
                   : moept__q8_along<T>(c, in, 0, k, ld, c->q8b, c->q8sb, 0, err, R->offs, R->n));
    for (int64_t e = 0; e < R->n; e++) {
        const int64_t np = MOEPT__Q8_PAD(R->offs[e + 1] - R->offs[e]);
        if (np > 0)
            MOEPT__TRY(moept__q8_gemm(c, mp, np, kp, wq + e * mp * kp, sq + e * ns, MOEPT__BLK128,
                                      c->q8b + o * kp, c->q8sb + o * MOEPT__Q8_L(kp), c->q8out + o * mp, mp,
                                      0, err));
        o += np;
    }
    return moept__q8_result<T>(c, 0, m, mp, out, m, 0, err, R->offs, R->n);
}

/* the end of R's rows (its last nonempty run's), checked against the FP8 scratch's rows */
static moept_status moept__q8_end(const moept__cuda *c, const moept__runs *R, int64_t *end, char *err) {
    *end = 0;
    for (int64_t i = 0; i < R->n; i++) {
        int64_t r0, rows, e;
        moept__run_at(R, i, &r0, &rows, &e);
        if (rows > 0 && r0 + rows > *end) *end = r0 + rows;
    }
    if (MOEPT__Q8_PAD(*end) > c->q8rows)
        return moept__kfail(err, MOEPT_ERR_STATE, "config.fp8: %lld rows past the scratch's %lld "
                            "(moept_kernels.cu:%d)", (long long)*end, (long long)c->q8rows, __LINE__);
    return MOEPT_OK;
}

/* whether the grouped kernel runs f's activation and its backward in a GEMM's epilogue (a gated one: its
   g and u; the gate/up product's and the down dgrad's): bf16, or (fused8) config.fp8's, whose gate/up
   product also quantizes a for the W2 product (into q8r) */
static int moept__ffn_fused(const moept__cuda *c, const moept__ffn *f) {
    return !f->q8 && moept__act_gated(c->sp.act) && f->H == 2 * f->F && moept__gk_ok(c);
}
static int moept__ffn_fused8(const moept__cuda *c, const moept__ffn *f) {
    return f->q8 && moept__act_gated(c->sp.act) && f->H == 2 * f->F && moept__gk_q8(c) && c->q8r;
}

/* whether the FP8 down dgrad (DACT8) also quantizes dh along its rows, into q8r (the W13 dgrad's A, a
   chunk's too): each of its 128-column tiles is a whole 1 x 128 tile of dh's gate half and one of its up
   half (F a multiple of 128, as in every released model), and its own A is not q8r (dy's records; the
   shared expert's dy rows lie there) */
static int moept__q8_dh8(const moept__cuda *c, const moept__ffn *f) {
    return moept__ffn_fused8(c, f) && f->F % MOEPT__Q8_TILE == 0 && f->yq;
}

/* whether a backward's dh (where not moept__q8_dh8), and dy where its rows are not records (the shared
   expert's), reach the
   grouped kernel's dgrads quantized along their rows by their wgrads' column passes, one read each
   (moept__k_q8_cols' RW: into q8r, q8sr): FP8 in the kernel form, whole groups, unchunked (a chunked
   layer runs the wgrads after every chunk's dgrads) */
static int moept__q8_twin(const moept__cuda *c, const moept__ffn *f, const moept__runs *R) {
    return f->q8 && c->q8r && R->offs && c->C == 1;
}

/* whether the dgrad through W2 (w2; else W13) reads its A quantized already, in q8r: dh as the down
   dgrad's epilogue quantized it (moept__q8_dh8), or dh or (not records) dy as its wgrad's column pass
   did (moept__q8_twin) */
static int moept__q8_pre(const moept__cuda *c, const moept__ffn *f, const moept__runs *R, int w2) {
    return w2 ? !f->yq && moept__q8_twin(c, f, R) : moept__q8_dh8(c, f) || moept__q8_twin(c, f, R);
}

/* whether the down dgrad's epilogue, where it quantizes dh's rows (moept__q8_dh8), also writes dh's copy
   down its rows, the W13 wgrad's O (into q8b, q8sb as moept__q8_down's S lays it out: the grouped wgrad's,
   WGRAD8), so no column pass reads dh: whole groups, unchunked (moept__q8_twin's), each 128-row tile of
   the down dgrad one 128 x 1 tile of the copy */
static int moept__q8_dhc(const moept__cuda *c, const moept__ffn *f, const moept__runs *R) {
    return moept__q8_dh8(c, f) && moept__q8_twin(c, f, R) && moept__gk_w8(c);
}

/* moept__q8_kept's part the layer decides at create (its scratch has q8x for it, and q8y for
   moept__q8_dyc): a training layer's WGRAD8, unchunked, its routed experts' F a multiple of 128 and
   gated (H 2F) */
static int moept__q8_keeps(const moept__cuda *c) {
    return moept__gk_w8(c) && !c->sp.cfg->inference_only && c->C == 1 && c->sp.F % MOEPT__Q8_TILE == 0 &&
           moept__act_gated(c->sp.act) && c->sp.H == 2 * c->sp.F;
}

/* whether the routed experts' gate/up kernel, where it quantizes a along its rows (moept__ffn_fused8),
   may also write a's copy down its rows in its epilogue (f->ac: a training forward whose backward comes
   next), the W2 wgrad's I (into q8a, q8sa as moept__q8_down's S lays it out: WGRAD8's), which stays
   there for the backward, whose pass over a then returns at once; and with it x's records' copy down
   their rows, the W13 wgrad's I, from the A tiles the kernel loads (into q8x, q8sx: moept__gk_xcols),
   whose pass returns at once too: F a multiple of 128, whole groups, unchunked, as moept__q8_dhc (x's
   records: the routed experts). c->q8own says whose copies q8a and q8x hold; another slot's forward
   that writes its own, a pass into q8a, a new scratch or this a moving takes it, and that backward's
   passes run */
static int moept__q8_kept(const moept__cuda *c, const moept__ffn *f, const moept__runs *R) {
    return moept__q8_keeps(c) && f->xq && moept__ffn_fused8(c, f) && moept__q8_twin(c, f, R);
}

/* whether the down dgrad, where it writes dh's copy down its rows (moept__q8_dhc), also writes dy's
   records' copy down their rows, the W2 wgrad's O, from the A tiles it loads (into q8y, q8sy:
   moept__gk_xcols), so no column pass reads dy: a layer that keeps x's copy (moept__q8_keeps, q8y with
   q8x), its W2 wgrad run after the down dgrad (which writes dh over h, not a) */
static int moept__q8_dyc(const moept__cuda *c, const moept__ffn *f, const moept__runs *R) {
    return MOEPT_GK_XCOLS && moept__q8_keeps(c) && moept__q8_dhc(c, f, R);
}

/* moept__k_own on the compute stream, in order with what reads or writes q8a */
static moept_status moept__q8_own(moept__cuda *c, int when, const void *a, const void *v, char *err) {
    MOEPT__LAUNCH(moept__k_own, 1, 1, 0, c->s)(c->q8own, when, moept__u64(a), moept__u64(v));
    MOEPT__LAUNCHED();
    return MOEPT_OK;
}

/* a grouped launch's column copy (GATE8's of a, DACT8's of dh) over R's groups: one [Cp][S] into q, s */
static moept_status moept__gk_cols(moept__cuda *c, const moept__runs *R, moept__gk_ext *ge, uint8_t *q,
                                   float *s, char *err) {
    ge->qcS = moept__q8_wide(R), ge->qc = q, ge->qcs = s;
    return moept__q8_fits(c, R, 1, err, ge->qcS);
}

/* config.fp8's product over R's runs in one launch of the grouped kernel (F: FWD8, GATE8 with its
   extras gx, or DACT8, the down dgrad with the activation's backward: gx's act): A the rows [0, end) of
   in (k columns, ld apart) quantized in 1 x 128 tiles (whole groups: at once; a chunk's runs: each
   run's, as the rows between belong to chunks still arriving), or (rec) in's FP8 records as they are (a
   chunk's runs: the producer warpgroup's own loads, which stop at each run's end, for the same reason),
   or (pre) in's rows quantized already, in q8r (the gate/up product's, the down dgrad's, or the wgrad's:
   moept__q8_twin, moept__q8_dh8); W's E4M3
   copy wq [E][mp][kp] with its 128 x 128 scales sq (ns an expert), out [..][m] bf16 (GATE8: h, of m / 2
   gate columns and their up ones, a quantized into q8r; DACT8: dh [..][2m] over h, da not stored) */
template <typename T, int F = MOEPT__GK_FWD8>
static moept_status moept__gk8(moept__cuda *c, const moept__ffn *f, const moept__runs *R, const char *in,
                               int rec, int64_t k, int64_t ld, const uint8_t *wq, const float *sq, int64_t ns,
                               int64_t m, char *out, int pre, const moept__gk_ext *gx, char *err) {
    int64_t end;
    MOEPT__TRY(moept__q8_end(c, R, &end, err));
    if (end == 0) return MOEPT_OK;
    const int64_t mp = MOEPT__Q8_PAD(m), kp = MOEPT__Q8_PAD(k), np = MOEPT__Q8_PAD(end);
    const int64_t N = F == MOEPT__GK_GATE8 ? m / 2 : m, ldo = F == MOEPT__GK_DACT8 ? 2 * m : m;
    moept__gk_ext ge = gx ? *gx : moept__gk_ext{};
    ge.bn = mp; ge.sb = sq; ge.sbe = ns; ge.sbld = MOEPT__Q8_L4(kp); ge.qsb = np;
    if (rec && !pre) { /* the records as A: their bytes kp wide, ld apart, each row's scales after them (a
                          chunk's runs: loaded by the producer warpgroup, to each run's end) */
        ge.sa = (const float *)(in + kp); ge.sarows = end; ge.sars = ld / 4; ge.sabs = 1; ge.arec = 1;
        return moept__gk<F>(c, R, in, ld, wq, kp, NULL, 0, N, kp, out, ldo, f->cnt, &ge, err);
    }
    if (R->offs && !pre) MOEPT__TRY(moept__q8_operand<T>(c, in, 0, end, k, ld, 0, 0, err));
    for (int64_t i = 0; !R->offs && !pre && i < R->n; i++) {
        int64_t r0, rows, e;
        moept__run_at(R, i, &r0, &rows, &e);
        if (rows > 0) MOEPT__TRY(moept__q8_operand<T>(c, in + r0 * ld * c->esz, 0, rows, k, ld, r0, np, err));
    }
    ge.sa = pre ? c->q8sr : c->q8sb; ge.sarows = np; ge.sars = 1; ge.sabs = np;
    return moept__gk<F>(c, R, pre ? c->q8r : c->q8b, kp, wq, kp, NULL, 0, N, kp, out, ldo, f->cnt, &ge, err);
}

/* One matmul of the FFN over R's rows through weight W [wo][wi] (W13 [H][D],
   W2 [D][F]): forward out [rows][wo] = in [rows][wi] W^T, backward (the
   dgrad) out [rows][wi] = in [rows][wo] W; one cuBLAS GEMM a run (moept__gemms
   spreads them), or config.fp8's against W's (the dgrad: W^T's) E4M3 copy */
template <typename T>
static moept_status moept__ffn_mm(moept__cuda *c, const moept__ffn *f, const moept__runs *R, int w2, int bwd,
                                  const void *in, void *out, char *err) {
    const int64_t wo = w2 ? c->sp.D : f->H, wi = w2 ? f->F : c->sp.D;
    const int rec = (f->xq && in == f->x) || (f->yq && in == f->y); /* (FP8 records: bytes, recw apart) */
    const int64_t k = bwd ? wo : wi, m = bwd ? wi : wo;
    const int64_t ld = rec ? moept__q8_recw(k) : w2 && !bwd ? f->lda : k, es = c->esz;
    const int64_t ies = rec ? 1 : es; /* in's element bytes */
    const char *I = (const char *)in;
    char *O = (char *)out;
    if (f->q8) {
        const moept__q8w *w = f->q8;
        const uint8_t *wq = w2 ? (bwd ? w->w2t : w->w2) : (bwd ? w->w13t : w->w13);
        const float *sq = w2 ? (bwd ? w->s2t : w->s2) : (bwd ? w->s13t : w->s13);
        const int64_t ns = w2 ? (bwd ? w->ns2t : w->ns2) : (bwd ? w->ns13t : w->ns13);
        const int64_t size = MOEPT__Q8_PAD(m) * MOEPT__Q8_PAD(k);
        if (moept__gk_q8(c)) /* (the dgrad: B the transposed copy, K-major as the forward's) */
            return moept__gk8<T>(c, f, R, I, rec, k, ld, wq, sq, ns, m, O,
                                 bwd ? moept__q8_pre(c, f, R, w2) : w2 && moept__ffn_fused8(c, f), NULL, err);
        if (R->offs) return moept__q8_mm_all<T>(c, R, I, rec, k, ld, wq, sq, ns, m, O, err);
        MOEPT__TRY(moept__q8_fits(c, R, 0, err)); /* (a chunk's runs: one after another) */
        for (int64_t i = 0; i < R->n; i++) {
            int64_t r0, rows, e;
            moept__run_at(R, i, &r0, &rows, &e);
            if (rows > 0)
                MOEPT__TRY(moept__q8_mm<T>(c, rows, I + r0 * ld * ies, rec, k, ld, wq + e * size, sq + e * ns,
                                           m, O + r0 * m * es, err));
        }
        return MOEPT_OK;
    }
    const char *W = (const char *)moept__w(c, w2 ? f->off2 : f->off13);
    if (moept__gk_ok(c)) /* W [E][m][k]: the forward's B; the dgrad's [E][K][N] */
        return bwd ? moept__gk<MOEPT__GK_DGRAD>(c, R, I, ld, W, m, NULL, 0, m, k, O, m, f->cnt, NULL, err)
                   : moept__gk<MOEPT__GK_FWD>(c, R, I, ld, W, k, in == f->x ? f->xi : NULL, 0, m, k, O, m,
                                              f->cnt, NULL, err);
    int64_t n;
    MOEPT__PER_RUN(c->descs, n, R,
                   moept__gemm_make(0, !bwd, rows, m, k, (const float *)(I + r0 * ld * ies), ld,
                                    (const float *)(W + e * wo * wi * es), wi, 0.0f,
                                    (float *)(O + r0 * m * es), m));
    return moept__gemms(c, c->descs, n, c->dt, c->dt, err);
}

/* config.fp8's weight gradient g [E][wo][wi] += O^T I (moept__ffn_wgrad's): every expert's two operands
   quantized down the rows, one column pass each (I: x's records, or a; O: dy's records, or dy's rows
   (the shared expert's) or dh, their rows along them too where moept__q8_twin; none for a where the
   forward's gate/up kernel wrote its copy, moept__q8_kept, or for dh and dy where the down dgrad did,
   moept__q8_dhc, moept__q8_dyc), then the products: the
   grouped kernel's, one launch (WGRAD8: moept__gk_w8; the operands [Cp][S], every expert's columns
   padded to 128), or cuBLASLt's, a matmul an expert (into g itself where nothing is padded) */
template <typename T>
static moept_status moept__q8_wgrad(moept__cuda *c, const moept__ffn *f, const moept__runs *R, int w2,
                                    char *err) {
    const int64_t wo = w2 ? c->sp.D : f->H, wi = w2 ? f->F : c->sp.D;
    const char *O = (const char *)(w2 ? f->y : f->h), *I = (const char *)(w2 ? f->a : f->x);
    float *g = c->grads + (w2 ? f->off2 : f->off13);
    const int rec = f->xq && !w2, orec = f->yq && w2; /* (I x's FP8 records, O dy's) */
    const int64_t ldi = rec ? moept__q8_recw(wi) : wi, S = moept__gk_w8(c) ? moept__q8_wide(R) : 0;
    const int64_t wop = MOEPT__Q8_PAD(wo), wip = MOEPT__Q8_PAD(wi);
    const int direct = wi == wip && wo == wop; /* g's own layout (no padding): cuBLASLt adds into it */
    const int twin = moept__q8_pre(c, f, R, w2) && (w2 || !moept__q8_dh8(c, f)); /* (O's rows along them
                                                                                  too, for the dgrad) */
    /* (kept: the routed experts of a layer that keeps a's copy in q8a, c->q8own naming it; ac: a's pass,
       which returns where it is there. The shared expert's passes come after the routed experts' W13
       wgrad zeroed the word) */
    const int kept = moept__q8_kept(c, f, R), ac = w2 && kept;
    const int made = w2 ? moept__q8_dyc(c, f, R) : moept__q8_dhc(c, f, R); /* (O's copy: the down dgrad's) */
    uint8_t *qo = made && w2 ? c->q8y : c->q8b; /* (dy's there, dh's and a pass's in q8b) */
    float *so = made && w2 ? c->q8sy : c->q8sb;
    int64_t end = 0, qa = 0, sa = 0, qb = 0, sb = 0; /* (end: twin's rows; qa..sb: expert e's operands) */
    MOEPT__TRY(moept__q8_fits(c, R, 1, err, S));
    if (twin) MOEPT__TRY(moept__q8_end(c, R, &end, err));
    /* (a's pass into q8a: c->q8own none first unless it is a, whose pass returns; x's into q8x returns
       where it is a too, then none: the shared expert's passes write q8a after) */
    uint8_t *qi = kept && !w2 ? c->q8x : c->q8a; /* (I's copy: x's kept, or a pass's) */
    float *si = kept && !w2 ? c->q8sx : c->q8sa;
    if (ac) MOEPT__TRY(moept__q8_own(c, MOEPT__OWN_NOT, f->a, NULL, err));
    if (rec)
        MOEPT__TRY(moept__q8_down<uint8_t>(c, I, R->offs, R->n, wi, ldi, qi, si, err, NULL, NULL, 0, S,
                                           kept && MOEPT_GK_XCOLS ? f->a : NULL));
    else MOEPT__TRY(moept__q8_down<T>(c, I, R->offs, R->n, wi, wi, qi, si, err, NULL, NULL, 0, S,
                                      ac ? f->a : NULL));
    if (kept && !w2) MOEPT__TRY(moept__q8_own(c, MOEPT__OWN_SET, NULL, NULL, err));
    if (orec && !made)
        MOEPT__TRY(moept__q8_down<uint8_t>(c, O, R->offs, R->n, wo, moept__q8_recw(wo), c->q8b, c->q8sb, err,
                                           NULL, NULL, 0, S));
    else if (!made)
        MOEPT__TRY(moept__q8_down<T>(c, O, R->offs, R->n, wo, wo, c->q8b, c->q8sb, err, twin ? c->q8r : NULL,
                                     twin ? c->q8sr : NULL, MOEPT__Q8_PAD(end), S));
    if (S) { /* A: O's copy [wop][S], B: I's [wip][S], each with a scale a column and 128 of its rows */
        moept__gk_ext ge = {};
        ge.bn = wip; ge.sa = so; ge.sarows = wop; ge.sars = wop; ge.sb = si; ge.sbld = wip;
        return moept__gk<MOEPT__GK_WGRAD8>(c, R, qo, S, qi, S, NULL, wo, wi, 0, g, wi, f->cnt, &ge, err);
    }
    for (int64_t e = 0; e < R->n; e++) {
        const int64_t rows = R->offs[e + 1] - R->offs[e], np = MOEPT__Q8_PAD(rows);
        float *ge = g + e * wo * wi;
        if (rows > 0)
            MOEPT__TRY(moept__q8_gemm(c, wip, wop, np, c->q8a + qa, c->q8sa + sa, MOEPT__VEC128, c->q8b + qb,
                                      c->q8sb + sb, direct ? ge : c->q8out, direct ? wi : wip, direct, err));
        if (rows > 0 && !direct) MOEPT__TRY(moept__q8_result<T>(c, wo, wi, wip, ge, wi, 1, err));
        moept__q8_gnext(rows, wip, &qa, &sa);
        moept__q8_gnext(rows, wop, &qb, &sb);
    }
    return MOEPT_OK;
}

/* A weight's gradient over R's rows (whole groups: the reduction runs over an
   expert's rows), into the fp32 gradients: W2's g2 += dy^T a, W13's
   g13 += dh^T x (config.fp8: moept__q8_wgrad) */
template <typename T>
static moept_status moept__ffn_wgrad(moept__cuda *c, const moept__ffn *f, const moept__runs *R, int w2,
                                     char *err) {
    const int64_t wo = w2 ? c->sp.D : f->H, wi = w2 ? f->F : c->sp.D, es = c->esz;
    const char *O = (const char *)(w2 ? f->y : f->h), *I = (const char *)(w2 ? f->a : f->x);
    float *g = c->grads + (w2 ? f->off2 : f->off13);
    if (f->q8) return moept__q8_wgrad<T>(c, f, R, w2, err);
    if (moept__gk_ok(c)) /* g [E][wo][wi] += O^T I, each expert's rows */
        return moept__gk<MOEPT__GK_WGRAD>(c, R, O, wo, I, wi, w2 ? NULL : f->xi, wo, wi, 0, g, wi, f->cnt,
                                          NULL, err);
    int64_t n;
    MOEPT__PER_RUN(c->descs, n, R,
                   moept__gemm_make(1, 0, wo, wi, rows, (const float *)(O + r0 * wo * es), wo,
                                    (const float *)(I + r0 * wi * es), wi, 1.0f, g + e * wo * wi, wi));
    return moept__gemms(c, c->descs, n, c->dt, CUDA_R_32F, err);
}

/* The forward over R's rows: h = x W13^T, a = act(h), y = a W2^T */
template <typename T>
static moept_status moept__ffn_fwd(moept__cuda *c, const moept__ffn *f, const moept__runs *R, char *err) {
    const int64_t D = c->sp.D, F = f->F;
    const void *W13 = moept__w(c, f->off13);
    if (moept__ffn_fused(c, f)) { /* h and a by the gate/up GEMM */
        const moept__gk_ext ga = moept__gk_epi(f->a, f->lda, c->sp.act, NULL, NULL, 0);
        MOEPT__TRY(moept__gk<MOEPT__GK_GATE>(c, R, f->x, D, W13, D, f->xi, 0, F, D, f->h, f->H, f->cnt, &ga,
                                             err));
    } else if (moept__ffn_fused8(c, f)) { /* h, a and a's E4M3 rows (W2's A) by the gate/up GEMM, and a
                                             and x's records down their rows (the wgrads' I, kept:
                                             moept__q8_kept) */
        moept__gk_ext ga = moept__gk_epi(f->a, f->lda, c->sp.act, c->q8r, c->q8sr, MOEPT__Q8_PAD(F));
        const int64_t ld = f->xq ? moept__q8_recw(D) : D; /* (x's FP8 records, or its rows) */
        const moept__q8w *q = f->q8;
        const int kept = moept__q8_kept(c, f, R), ac = kept && f->ac;
        if (kept) /* (the copy none until whole; without one, none if it was this a's, now rewritten) */
            MOEPT__TRY(moept__q8_own(c, ac ? MOEPT__OWN_SET : MOEPT__OWN_IS, f->a, NULL, err));
        if (ac) MOEPT__TRY(moept__gk_cols(c, R, &ga, c->q8a, c->q8sa, err));
        if (ac && MOEPT_GK_XCOLS) ga.qx = c->q8x, ga.qxs = c->q8sx, ga.qxD = D;
        MOEPT__TRY((moept__gk8<T, MOEPT__GK_GATE8>(c, f, R, (const char *)f->x, f->xq, D, ld, q->w13, q->s13,
                                                   q->ns13, f->H, (char *)f->h, 0, &ga, err)));
        if (ac) MOEPT__TRY(moept__q8_own(c, MOEPT__OWN_SET, NULL, f->a, err));
    } else {
        MOEPT__TRY(moept__ffn_mm<T>(c, f, R, 0, 0, f->x, f->h, err));
        MOEPT__TRY(moept__ffn_act<T>(c, f, R, 0, err));
    }
    return moept__ffn_mm<T>(c, f, R, 1, 0, f->a, f->y, err);
}

/* Its backward over R's rows, dy in y: da = dy W2, dh = act'(h, da) over h,
   dxs = dh W13 (a as the forward left it: a rejected forward or a growth of
   the receive block keeps it). R every group: the weight gradients in
   between, each before its operand is overwritten (W2's after the down
   dgrad where that writes dy's copy down its rows, moept__q8_dyc: it
   writes over h alone); a chunk's runs: the caller runs them once every
   chunk is done (over every group). */
template <typename T>
static moept_status moept__ffn_bwd(moept__cuda *c, const moept__ffn *f, const moept__runs *R, char *err) {
    const int wgrad = R->offs != NULL;
    const int64_t D = c->sp.D, F = f->F;
    const void *W2 = moept__w(c, f->off2);
    const int dyc = moept__q8_dyc(c, f, R); /* (the W2 wgrad after the down dgrad, its O dy's copy there) */
    if (wgrad && !dyc) MOEPT__TRY(moept__ffn_wgrad<T>(c, f, R, 1, err));
    const moept__gk_ext ga = moept__gk_epi(NULL, 0, c->sp.act, NULL, NULL, 0);
    if (moept__ffn_fused(c, f)) { /* dh over h by the down dgrad */
        MOEPT__TRY(moept__gk<MOEPT__GK_DACT>(c, R, f->y, D, W2, F, NULL, 0, F, D, f->h, f->H, f->cnt, &ga,
                                             err));
    } else if (moept__ffn_fused8(c, f)) { /* ... in E4M3: A dy's records (the shared expert's: its rows),
                                             dh quantized along its rows too (moept__q8_dh8), and down
                                             them (moept__q8_dhc), dy's records down theirs
                                             (moept__q8_dyc) */
        const moept__q8w *q = f->q8;
        const int dh8 = moept__q8_dh8(c, f);
        moept__gk_ext g8 = moept__gk_epi(NULL, 0, c->sp.act, dh8 ? c->q8r : NULL, c->q8sr,
                                         MOEPT__Q8_PAD(f->H));
        if (moept__q8_dhc(c, f, R)) MOEPT__TRY(moept__gk_cols(c, R, &g8, c->q8b, c->q8sb, err));
        if (dyc) g8.qx = c->q8y, g8.qxs = c->q8sy, g8.qxD = D;
        MOEPT__TRY((moept__gk8<T, MOEPT__GK_DACT8>(c, f, R, (const char *)f->y, f->yq, D,
                                                   f->yq ? moept__q8_recw(D) : D, q->w2t, q->s2t, q->ns2t, F,
                                                   (char *)f->h, moept__q8_pre(c, f, R, 1), &g8, err)));
    } else {
        MOEPT__TRY(moept__ffn_mm<T>(c, f, R, 1, 1, f->y, f->da, err));
        MOEPT__TRY(moept__ffn_act<T>(c, f, R, 1, err));
    }
    if (dyc) MOEPT__TRY(moept__ffn_wgrad<T>(c, f, R, 1, err));
    if (wgrad) MOEPT__TRY(moept__ffn_wgrad<T>(c, f, R, 0, err));
    return moept__ffn_mm<T>(c, f, R, 0, 1, f->h, f->dx, err);
}

/* ---- communication, joined to the compute stream by events ------------- */
static moept_status moept__to_comm(moept__cuda *c, cudaStream_t cs, char *err) {
    if (cs == c->s) return MOEPT_OK;
    MOEPT__CU(cudaEventRecord(c->ev_compute, c->s));
    MOEPT__CU(cudaStreamWaitEvent(cs, c->ev_compute, 0));
    return MOEPT_OK;
}
static moept_status moept__from_comm(moept__cuda *c, cudaStream_t cs, char *err) {
    if (cs == c->s) return MOEPT_OK;
    MOEPT__CU(cudaEventRecord(c->ev_comm, cs));
    MOEPT__CU(cudaStreamWaitEvent(c->s, c->ev_comm, 0));
    return MOEPT_OK;
}

/* One direction of the expert exchange (as moept.c's moept__exchange):
   pieces ls [P][El] of the token side `local`, rs [P][El] of the expert side
   `remote`. flags: MOEPT__X_OUT (token side -> expert side, else back),
   MOEPT__X_AFTER (after the compute stream's work so far: not needed for a
   later chunk, whose rows were gathered long before), MOEPT__X_JOIN (the
   compute stream waits for it; without, it runs independent work, e.g. the
   shared expert, until moept__from_comm or an event joins the two), MOEPT__X_XQ
   (x's or dy's rows: config.fp8's records, moept__xrow bytes a row, moved as
   4-byte words; the pieces' counts stay D a row). */
enum { MOEPT__X_OUT = 1, MOEPT__X_AFTER = 2, MOEPT__X_JOIN = 4, MOEPT__X_XQ = 8 };
static moept_status moept__exchange(moept__cuda *c, void *local, const moept_seg *ls, void *remote,
                                    const moept_seg *rs, int flags, moept__dev_step *out, char *err) {
    moept_comm *ep = c->sp.ep;
    const int dispatch = flags & MOEPT__X_OUT, xq = (flags & MOEPT__X_XQ) && moept__fp8_on(&c->sp);
    const int64_t D = c->sp.D, n = c->sp.P * c->sp.El, w = xq ? moept__xrow(c) / 4 : D; /* a row's words */
    const int es = xq ? 4 : c->esz;
    const moept_seg *lp = ls, *rp = rs;
    if (xq) { /* the pieces in records' words */
        moept_seg *q = c->q8segs;
        for (int64_t i = 0; i < n; i++) {
            q[i].offset = ls[i].offset / D * w; q[i].count = ls[i].count / D * w;
            q[n + i].offset = rs[i].offset / D * w; q[n + i].count = rs[i].count / D * w;
        }
        lp = q; rp = q + n;
    }
    double t0 = moept__clock();
    if (flags & MOEPT__X_AFTER) MOEPT__TRY(moept__to_comm(c, c->cs, err));
    moept_status st = dispatch ? ep->alltoallv(ep, local, lp, remote, rp, (int)c->sp.El, es)
                               : ep->alltoallv(ep, remote, rp, local, lp, (int)c->sp.El, es);
    if (st)
        return moept__kfail(err, st, "expert exchange (%s): %s", dispatch ? "dispatch" : "combine", ep->err);
    if (flags & MOEPT__X_JOIN) MOEPT__TRY(moept__from_comm(c, c->cs, err));
    const int64_t rb = w * es; /* a row's bytes */
    int64_t sent = 0, recvd = 0;
    for (int64_t i = 0; i < n; i++)
        if (i / c->sp.El != c->sp.rank) { sent += ls[i].count; recvd += rs[i].count; }
    out->bytes_sent += (dispatch ? sent : recvd) / D * rb;
    out->bytes_received += (dispatch ? recvd : sent) / D * rb;
    out->comm_seconds += moept__clock() - t0; /* enqueue time: the wire time overlaps compute */
    return MOEPT_OK;
}


/* ---- forward ------------------------------------------------------------ */
/* A forward's stages share this: until the agreement nothing is committed,
   and before the count exchange an error must not return early (the peers
   would wait in the exchange): it is recorded in `local`, and the exchange
   carries it. */
typedef struct moept__fwd {
    char local[MOEPT__ERRLEN]; /* this rank's failure, "" if none */
    int host_bad;              /* a host-side rejection (arguments, pending error): kernels ran on T = 0 */
    int pre;                   /* a CUDA call failed before the exchange */
    cudaError_t pending;       /* the error an earlier call left pending */
    int nb;                    /* the spare routing buffers this step fills */
    int64_t T, R;              /* tokens (0 if rejected), rows to receive */
    int64_t tag;               /* the call's agreement tag (moept.c's) */
    moept_status reject;       /* moept.c's rejection of the call, agreed as a host one */
    const moept__fstep *a;     /* the call's arguments (mask, replay ids, logits_out, eval, jitter
                                  and its key: moept_forward_ex's, device pointers) */
} moept__fwd;

#define MOEPT__PRE(call)                                                                             \
    do {                                                                                             \
        cudaError_t e_ = (call);                                                                     \
        if (e_ != cudaSuccess && !f->pre) {                                                          \
            f->pre = 1;                                                                              \
            snprintf(f->local, MOEPT__ERRLEN, "%s: %s (moept_kernels.cu:%d)", #call,                 \
                     cudaGetErrorString(e_), __LINE__);                                              \
        }                                                                                            \
    } while (0)

/* A mask is device memory, as x and y are (the route kernel reads it); a
   layer with a shared expert, or an F32 layer (its router's gradient),
   makes the room for x with its padded rows zero (xsh) at its first masked
   forward, as moept.c makes its rows' */
static void moept__fwd_mask_check(moept__cuda *c, moept__fwd *f) {
    const moept__cuda_spec *p = &c->sp;
    char why[MOEPT__ERRLEN] = "";
    if (moept__is_host(f->a->mask)) {
        snprintf(f->local, MOEPT__ERRLEN, "moept_forward: opts.mask is not device memory (a CUDA layer's "
                 "mask is [tokens] bytes on its device, as x and y are)");
    } else if ((p->S > 0 || !c->wlow) && !c->xsh) {
        const size_t bytes = (size_t)(p->Tmax * p->D) * (size_t)c->esz;
        if (moept__dmalloc(c, &c->xsh, bytes, why) == MOEPT_OK) {
            c->xsh_bytes = (int64_t)bytes;
        } else {
            f->reject = MOEPT_ERR_OUT_OF_MEMORY; /* agreed as a host rejection, with this status */
            snprintf(f->local, MOEPT__ERRLEN, "moept_forward: out of device memory for the unpadded rows "
                     "(%.400s)", why);
        }
    }
    if (f->local[0]) f->host_bad = 1;
}

/* 0. slot: a training forward's (opts.slot), an evaluation's by
   moept__eval_slot_of; its buffers made at its first use (a failure is
   agreed as the call's rejection) */
static void moept__fwd_slot(moept__cuda *c, const moept__dev_step *o, moept__fwd *f, moept__cslot **out,
                            char *why) {
    *out = moept__last(c); /* a rejected forward runs in the last one's spare buffers */
    if (f->reject) return; /* (o->slot may be out of range) */
    const moept__cslot *s0 = &c->slots[0];
    const int pending = s0->fwd_valid && !s0->fwd_eval && !s0->bwd_done;
    const int inference = c->sp.cfg->inference_only;
    const int s = !o->f->eval ? o->f->slot : moept__eval_slot_of(c->nslots, inference, pending);
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (!c->slots[s].fwork && cudaStreamIsCapturing(c->s, &cap) == cudaSuccess &&
        cap != cudaStreamCaptureStatusNone) { /* cudaMalloc would invalidate the caller's capture */
        f->reject = MOEPT_ERR_STATE;
        snprintf(why, MOEPT__ERRLEN, "moept_forward: forward slot %d's first use makes its buffers, which a "
                 "CUDA graph capture cannot: run a forward in it (%s) before capturing", s,
                 o->f->eval ? "an evaluation" : "a training forward");
        return;
    }
    char e[MOEPT__ERRLEN];
    if (moept__slot_get(c, s, out, e) == MOEPT_OK) return;
    f->reject = MOEPT_ERR_OUT_OF_MEMORY;
    snprintf(why, MOEPT__ERRLEN, "moept_forward: out of memory for forward slot %d's state (%.400s)", s, e);
}

/* 1. this rank's argument checks; the kernels then run on a valid T only */
static void moept__fwd_checks(moept__cuda *c, moept__cslot *sl, const void *x, int64_t Tn, const void *y,
                              const char *reject,
                              moept__fwd *f) {
    const moept__cuda_spec *p = &c->sp;
    if (f->reject) {
        f->host_bad = 1;
        snprintf(f->local, MOEPT__ERRLEN, "%s", reject);
    } else if (Tn < 0 || Tn > p->Tmax) {
        f->host_bad = 1;
        snprintf(f->local, MOEPT__ERRLEN, "moept_forward: tokens %lld not in 0..max_tokens (%lld)",
                 (long long)Tn, (long long)p->Tmax);
    } else if (Tn > 0 && (!x || !y)) {
        f->host_bad = 1;
        snprintf(f->local, MOEPT__ERRLEN, "moept_forward: %s is NULL", x ? "y" : "x");
    } else if (moept__seq_len(p) > 0 && Tn % moept__seq_len(p) != 0) {
        f->host_bad = 1;
        snprintf(f->local, MOEPT__ERRLEN, "moept_forward: tokens %lld is not a multiple of "
                 "config.aux_seq_len (%lld)", (long long)Tn, (long long)p->cfg->aux_seq_len);
    }
    /* an error left pending by an earlier call (a failed allocation) is this
       step's failure, agreed like the others, not a surprise at the first check */
    f->pending = cudaGetLastError();
    if (!f->host_bad && f->pending != cudaSuccess) {
        f->host_bad = 1;
        snprintf(f->local, MOEPT__ERRLEN, "moept_forward: a CUDA error was pending: %s",
                 cudaGetErrorString(f->pending));
    }
    if (!f->host_bad && f->a->mask && Tn > 0) moept__fwd_mask_check(c, f);
    if (!f->host_bad && f->a->replay && Tn > 0 && moept__is_host(f->a->replay)) { /* k_replay would fault */
        f->host_bad = 1;
        snprintf(f->local, MOEPT__ERRLEN, "moept_forward: opts.replay_ids is not device memory (a CUDA "
                 "layer's replay ids are [tokens][top_k] int32 on its device, as x is)");
    }
    f->T = f->host_bad ? 0 : Tn;
    f->nb = 1 - sl->cur;
}

/* x [n]'s finiteness (the first bad index into bad) and, with xf, its fp32 copy */
template <typename T>
static void moept__check(moept__cuda *c, const T *x, int64_t n, float *xf, unsigned long long *bad,
                         moept__pad pd = moept__pad{NULL, NULL, 0, 0, 0}) {
    const int vec = moept__vec<T>(0, x, xf), V = vec ? MOEPT__VEC(T) : 1;
    MOEPT__LAUNCH_V(vec, moept__k_check, T, moept__grid(n / V + n % V), MOEPT__TB, c->s, x, n, xf, bad, pd);
}
/* a masked step's padded rows (its forward's ids -1), zero in the copy; none unmasked */
static moept__pad moept__pad_of(const moept__cuda *c, const moept__cslot *sl) {
    return moept__pad{NULL, sl->masked ? sl->ids[sl->cur] : NULL, sl->masked ? c->sp.D : 0, (int)c->sp.K, 1};
}

/* MOEPT_AUX_SEQ: each sequence's statistics, aux value and gradient row
   (into the spare seqg), their sum and count into the loss statistics */
static void moept__seq_stats(moept__cuda *c, moept__cslot *sl, moept__fwd *f) {
    const int64_t E = c->sp.E, slen = moept__seq_len(&c->sp), nseq = f->T / slen;
    if (nseq > 0)
        MOEPT__LAUNCH(moept__k_seq_stats, moept__grid(nseq * E), MOEPT__TB, 0, c->s)(
                sl->ids[f->nb], c->cids, c->scratch, nseq, slen, (int)E, (int)c->sp.K, c->seqst);
    MOEPT__LAUNCH(moept__k_seq_close, 1, MOEPT__TB, 0, c->s)(c->seqst, nseq, (int)E, (int)c->sp.K,
                                                          c->sp.cfg->aux_loss_coef, sl->seqg[f->nb],
                                                          c->lstat);
    MOEPT__PRE(cudaGetLastError());
}
/* ... after the commit: the committed rows times 1/nseq (the mean) */
static void moept__seq_mean(moept__cuda *c, moept__cslot *sl) {
    const int64_t n = sl->T / moept__seq_len(&c->sp) * c->sp.E;
    if (n > 0)
        MOEPT__LAUNCH(moept__k_seq_scale, moept__grid(n), MOEPT__TB, 0, c->s)(sl->seqg[sl->cur], n, c->lstat,
                                                                            moept__lstat_of(c->sp.E).nseq);
}

/* The router's input under jitter, xj = xf * u (hash: the rows' hashes
   first, from xf), on the CPU's noise */
static void moept__jitter(moept__cuda *c, const float *xf, int64_t T, uint64_t *rows, uint64_t key,
                          int hash) {
    const int64_t D = c->sp.D;
    if (hash) MOEPT__LAUNCH(moept__k_jitter_rows, moept__grid(T), MOEPT__TB, 0, c->s)(xf, T, D, rows);
    const moept__jit j = {rows, c->sp.cfg->jitter_seed, key, c->sp.cfg->router_jitter};
    MOEPT__LAUNCH(moept__k_jitter, moept__grid(T * D), MOEPT__TB, 0, c->s)(xf, T * D, D, j, c->xj);
}

/* 2. route: the bf16 weights, x's check, the fp32 router (on x * u under
   jitter), top-k, loss statistics */
template <typename T>
static void moept__fwd_route(moept__cuda *c, moept__cslot *sl, const T *x, moept__fwd *f) {
    const moept__cuda_spec *p = &c->sp;
    const moept_config *cf = p->cfg;
    const int64_t D = p->D, E = p->E, K = p->K, T_ = f->T;
    const int nb = f->nb;
    MOEPT__PRE(cudaMemsetAsync(c->bad, 0xff, 4 * 8, c->s));
    if (c->wlow && c->wlow_stale) { /* the bf16 weights, once after the fp32 masters changed */
        MOEPT__STAGE("weights");
        MOEPT__PRE(moept__cast_weights(c));
        MOEPT__STAGE("route");
    }
    if (moept__fp8_on(&c->sp) && c->q8_stale) { /* config.fp8: the weights' E4M3 copies, likewise */
        MOEPT__STAGE("weights");
        MOEPT__PRE(moept__q8_weights(c));
        MOEPT__STAGE("route");
    }
    const float *xf = c->wlow ? sl->xf : (const float *)x;
    if (T_ > 0) { /* (padded rows: unchecked; their logits are computed, as transformers' router does) */
        moept__check<T>(c, x, T_ * D, c->wlow ? sl->xf : NULL, &c->bad[0],
                        moept__pad{f->a->mask, NULL, f->a->mask ? D : 0, (int)K, 0});
        MOEPT__PRE(cudaGetLastError());
        sl->xf_committed = 0; /* until this step commits */
        if (f->a->jitter) moept__jitter(c, xf, T_, sl->jrow[nb], f->a->jkey, 1);
        /* router GEMM in fp32: logits = xf Wr^T */
        moept__gemm g = moept__gemm_make(0, 1, T_, E, D, f->a->jitter ? c->xj : xf, D, c->params, D, 0.0f,
                                         sl->logits[nb], E);
        if (!f->pre && moept__gemms(c, &g, 1, CUDA_R_32F, CUDA_R_32F, f->local)) f->pre = 1;
        const float *bias = cf->family == MOEPT_FAMILY_DEEPSEEK_V3 ? c->bias : NULL;
        MOEPT__LAUNCH(moept__k_route, (unsigned)((T_ + 127) / 128), 128, 0, c->s)(
            cf->family, cf->aux_loss, sl->logits[nb], bias, (int)E, (int)K, cf->norm_topk_prob,
            (int)cf->n_group, (int)cf->topk_group, cf->group_fill, cf->routed_scaling_factor, T_,
            sl->probs[nb], c->scratch, sl->ids[nb], sl->wts[nb], sl->lse[nb], c->cids, &c->bad[1],
            f->a->mask);
        MOEPT__PRE(cudaGetLastError());
        if (f->a->replay) {
            MOEPT__LAUNCH(moept__k_replay, (unsigned)((T_ + 127) / 128), 128, 0, c->s)(
                cf->family, cf->aux_loss, sl->logits[nb], f->a->replay, (int)E, (int)K, cf->norm_topk_prob,
                cf->routed_scaling_factor, T_, sl->probs[nb], c->scratch, sl->ids[nb], sl->wts[nb], c->cids,
                &c->bad[1]);
            MOEPT__PRE(cudaGetLastError());
        }
        if (f->a->logits_out) {
            MOEPT__LAUNCH(moept__k_logits_out, moept__grid(T_ * E), MOEPT__TB, 0, c->s)(
                sl->logits[nb], sl->ids[nb], T_, (int)E, (int)K, f->a->logits_out);
            MOEPT__PRE(cudaGetLastError());
        }
    }
    MOEPT__LAUNCH(moept__k_loss_stats, (unsigned)(E + 1), MOEPT__TB, 0, c->s)(
            sl->ids[nb], c->cids, c->scratch, sl->lse[nb], T_, (int)E, (int)K, cf->aux_loss, c->lstat);
    MOEPT__PRE(cudaGetLastError());
    if (moept__seq_len(p) > 0) moept__seq_stats(c, sl, f);
}

/* 3. count: the kept rows per slot (capacity applied) into the count
   message; chunked, per chunk and slot too */
static void moept__fwd_count(moept__cuda *c, moept__cslot *sl, moept__fwd *f) {
    const int64_t E = c->sp.E, K = c->sp.K, T_ = f->T, C = c->C, nblk = (T_ * K + MOEPT__PB - 1) / MOEPT__PB;
    if (nblk > 0) {
        MOEPT__PRE(cudaMemsetAsync(c->hist, 0, (size_t)(nblk * E) * 8, c->s));
        MOEPT__LAUNCH(moept__k_count, (unsigned)nblk, MOEPT__PB, 0, c->s)(
                sl->ids[f->nb], c->slot_of, T_ * c->sp.K, (int)E, c->lrank, c->hist);
        MOEPT__PRE(cudaGetLastError());
    }
    MOEPT__LAUNCH(moept__k_count_scan, 1, MOEPT__TB, 0, c->s)(
            c->hist, nblk, (int)E, (int)K, c->sp.capacity_factor, c->kept, c->koff, c->msg, c->bad,
            f->host_bad, c->M - 1, f->tag, !moept__global_balance(&c->sp) && c->sp.cfg->z_loss_coef > 0.0f,
            sl->Rcap, c->B, c->lstat);
    MOEPT__PRE(cudaGetLastError());
    if (C > 1) {
        MOEPT__PRE(cudaMemsetAsync(c->csel, 0, (size_t)(C * E) * 8, c->s));
        if (T_ > 0) {
            MOEPT__LAUNCH(moept__k_chunk_count, moept__grid(T_ * K), MOEPT__TB, 0, c->s)(
                    sl->ids[f->nb], c->slot_of, T_, K, C, (int)E, c->csel);
            MOEPT__PRE(cudaGetLastError());
        }
        MOEPT__LAUNCH(moept__k_chunk_scan, moept__grid(E), MOEPT__TB, 0, c->s)(
                c->csel, C, (int)E, (int)K, c->sp.capacity_factor, c->msg + c->M - 1, c->msg + E + 3);
        MOEPT__PRE(cudaGetLastError());
    }
    if (f->pre) { /* the kernels may not have written the message: the host does */
        f->host_bad = 1;
        for (int64_t i = 0; i < c->M; i++)
            c->h_msg_all[i] = i == E ? 1 : i == E + 1 ? f->tag : i == E + 2 ? sl->Rcap : 0;
        cudaMemcpyAsync(c->msg, c->h_msg_all, (size_t)c->M * 8, cudaMemcpyHostToDevice, c->s);
    }
}

/* 4. exchange the counts: every rank's to every rank (all-gather: each rank
   then knows every rank's receive size, so all agree on growth without
   another round); global loss statistics and the failure flag summed on the
   device (moept__fwd_share); then the forward's one host synchronisation */
static moept_status moept__fwd_share(moept__cuda *c, moept__dev_step *out, char *err) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t E = p->E, P = p->P;
    moept_status st;
    const int gb = moept__global_balance(p);
    if (p->ep) {
        if (gb) MOEPT__CU(cudaMemcpyAsync(c->msg + c->moff, c->lstat, (size_t)MOEPT__NLSTAT(E) * 8,
                                          cudaMemcpyDeviceToDevice, c->s));
        MOEPT__TRY(moept__to_comm(c, c->cs, err));
        if ((st = p->ep->allgather(p->ep, c->msg, c->msg_all, c->M * 8)))
            return moept__kfail(err, st, "moept_forward: count exchange failed: %s", p->ep->err);
        out->agreed = 1;
        MOEPT__TRY(moept__from_comm(c, c->cs, err));
        if (gb) {
            MOEPT__LAUNCH(moept__k_lstat_sum, moept__grid(MOEPT__NLSTAT(E)), MOEPT__TB, 0, c->s)(
                    c->msg_all, P, c->M, c->moff, MOEPT__NLSTAT(E), c->lstat);
            MOEPT__LAUNCHED();
        }
    } else {
        out->agreed = 1;
        MOEPT__CU(cudaMemcpyAsync(c->msg_all, c->msg, (size_t)c->M * 8, cudaMemcpyDeviceToDevice, c->s));
    }
    if (gb && p->dp) {
        cudaStream_t ds = moept__stream_of(p->dp);
        MOEPT__TRY(moept__to_comm(c, ds, err));
        if ((st = p->dp->allreduce(p->dp, c->lstat, MOEPT__NLSTAT(E), MOEPT_DTYPE_F64)))
            return moept__kfail(err, st, "moept_forward: all-reduce over DP: %s", p->dp->err);
        MOEPT__TRY(moept__from_comm(c, ds, err));
    }
    return MOEPT_OK;
}
static moept_status moept__fwd_exchange_counts(moept__cuda *c, moept__dev_step *out, char *err) {
    const int64_t E = c->sp.E, P = c->sp.P;
    double t0 = moept__clock();
    MOEPT__TRY(moept__fwd_share(c, out, err));
    MOEPT__CU(cudaMemcpyAsync(c->h_msg_all, c->msg_all, (size_t)(P * c->M) * 8, cudaMemcpyDeviceToHost,
                              c->s));
    MOEPT__CU(cudaMemcpyAsync(c->h_lstat, c->lstat, (size_t)MOEPT__NLSTAT(E) * 8, cudaMemcpyDeviceToHost,
                              c->s));
    MOEPT__CU(cudaMemcpyAsync(c->h_bad, c->bad, 4 * 8, cudaMemcpyDeviceToHost, c->s));
    MOEPT__TRY(moept__host_wait(c, err)); /* <- the forward's host synchronisation */
    out->comm_seconds += moept__clock() - t0;
    return MOEPT_OK;
}


/* Losses (where their coefficient makes them part of the objective) that
   are not finite from finite inputs fail the step, as in moept.c. Local
   losses: the plan kernel's flag told the peers (this is its arithmetic);
   global ones: every rank holds the same sums and decides alike. */
static void moept__fwd_loss_check(moept__cuda *c, moept__fwd *f) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t E = p->E;
    const double Tl = c->h_lstat[3 * E] > 0 ? c->h_lstat[3 * E] : 1.0;
    const moept_config *cf = p->cfg;
    int zbad = cf->z_loss_coef > 0.0f && !moept__finite_as_float(c->h_lstat[3 * E + 1] / Tl), abad = 0;
    if (moept__global_balance(p) && !zbad && cf->aux_loss_coef > 0.0f)
        abad = !moept__finite_as_float(moept__aux_value(c->h_lstat, E, p->K, cf->aux_loss, cf->aux_loss_coef,
                                                        c->h_aux_g));
    if (zbad || abad)
        snprintf(f->local, MOEPT__ERRLEN, "moept_forward: the %s loss is not finite from finite inputs; "
                 "the step is rejected, run forward again", zbad ? "z" : "aux");
}

/* a replayed row that is not K distinct experts (moept__k_replay's flag):
   the same message as moept.c's, and the call's status an argument's */
static void moept__replay_msg(const moept__cuda *c, moept__fwd *f) {
    const unsigned long long v = c->h_bad[1] & ~MOEPT__REPLAY_BAD, a = v >> 1; /* t K + k */
    f->reject = MOEPT_ERR_INVALID_ARGUMENT;
    snprintf(f->local, MOEPT__ERRLEN, MOEPT__REPLAY_FMT, (long long)(a / c->sp.K), (long long)(a % c->sp.K),
             MOEPT__REPLAY_WHY((int)(v & 1)));
}

/* 5. agree_growth: every rank made this call (the tags) and read the same
   flags; then the receive sizes of every rank against the capacity it sent
   (ranks with fewer max_tokens start smaller): growth (rare) is agreed in a
   second round */
static moept_status moept__fwd_agree_growth(moept__cuda *c, moept__cslot *sl, moept__fwd *f, char *err) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t D = p->D, E = p->E, El = p->El, P = p->P, me = p->rank, M = c->M;
    for (int64_t q = 0; q < P; q++) /* the tag's low half: the call; its high half: the slot */
        if ((c->h_msg_all[q * M + E + 1] ^ f->tag) & 0xffffffff)
            return moept__kfail(err, MOEPT_ERR_STATE, "moept_forward: the ranks' call sequences differ "
                                "(another rank made another group call here); nothing changed");
    if (!f->host_bad && c->h_bad[0] != ULLONG_MAX)
        snprintf(f->local, MOEPT__ERRLEN, "moept_forward: x[%lld][%lld] is not finite",
                 (long long)(c->h_bad[0] / D), (long long)(c->h_bad[0] % D));
    else if (!f->host_bad && c->h_bad[1] != ULLONG_MAX && (c->h_bad[1] & MOEPT__REPLAY_BAD))
        moept__replay_msg(c, f);
    else if (!f->host_bad && c->h_bad[1] != ULLONG_MAX)
        snprintf(f->local, MOEPT__ERRLEN, "moept_forward: router logits of token %lld are not finite",
                 (long long)c->h_bad[1]);
    else if (!f->host_bad && !moept__global_balance(p))
        moept__fwd_loss_check(c, f);
    int64_t failed = 0;
    for (int64_t q = 0; q < P; q++) failed += c->h_msg_all[q * M + E] != 0;
    if (moept__global_balance(p) && c->h_lstat[moept__lstat_of(E).n] > 0.0 && failed == 0)
        failed = 1; /* a DP peer */
    if (!f->local[0] && !failed && moept__global_balance(p)) moept__fwd_loss_check(c, f);
    if (f->local[0])
        return moept__kfail(err, f->pre || f->pending != cudaSuccess ? MOEPT_ERR_DEVICE
                                 : f->reject ? f->reject : f->host_bad ? MOEPT_ERR_INVALID_ARGUMENT
                                 : MOEPT_ERR_NUMERIC, "%s", f->local);
    if (failed)
        return moept__kfail(err, MOEPT_ERR_STATE, "moept_forward: %lld other rank(s) rejected the step; "
                            "nothing changed", (long long)failed);
    for (int64_t q = 0; q < P; q++)
        if (c->h_msg_all[q * M + E + 1] != f->tag)
            return moept__kfail(err, MOEPT_ERR_INVALID_ARGUMENT, "moept_forward: the ranks passed different "
                                "opts.slot or opts.eval (every rank must pass the same); nothing changed");
    int64_t anyone_grows = 0;
    for (int64_t q = 0; q < P; q++) {
        int64_t Rq = 0;
        for (int64_t s = 0; s < P; s++)
            for (int64_t j = 0; j < El; j++) Rq += c->h_msg_all[s * M + q * El + j];
        if (q == me) f->R = Rq;
        if (Rq > c->h_msg_all[q * M + E + 2]) anyone_grows = 1;
    }
    if (!anyone_grows) return MOEPT_OK;
    int64_t ok = moept__grow(c, sl, f->R, err) == MOEPT_OK;
    moept_status st;
    if (P > 1) {
        if ((st = p->ep->allgather(p->ep, &ok, c->grow_ok, 8)))
            return moept__kfail(err, st, "moept_forward: growth agreement failed: %s", p->ep->err);
    } else {
        c->grow_ok[0] = ok;
    }
    for (int64_t q = 0; q < P; q++)
        if (!c->grow_ok[q])
            return moept__kfail(err, MOEPT_ERR_OUT_OF_MEMORY, "moept_forward: EP rank %lld cannot grow its "
                                "receive buffers; nothing changed", (long long)q);
    return MOEPT_OK;
}

/* 6. commit: the step's counts, from the agreed message (chunked: per
   chunk too; kept: a rejected step's message must not change them) */
/* the committed forward's slot state, as both commits (the host's, the sync-free one's) leave it */
static void moept__slot_commit(moept__cslot *sl, const moept__fwd *f) {
    sl->again = sl->fwd_valid && !sl->fwd_eval && !sl->bwd_done && !f->a->eval; /* (before they change) */
    sl->cur = f->nb;
    sl->T = f->T;
    sl->masked = f->a->mask != NULL;
    sl->jit = f->a->jitter; sl->jkey = f->a->jkey;
    sl->xf_committed = 1;
    sl->fwd_valid = 1;
    sl->bwd_done = 0;
    sl->fwd_stale = NULL;
    sl->fwd_eval = f->a->eval;
}

static void moept__fwd_commit(moept__cuda *c, moept__cslot *sl, const moept__fwd *f, moept__dev_step *out) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t E = p->E, El = p->El, P = p->P, me = p->rank;
    moept__slot_commit(sl, f);
    sl->R = f->R;
    const int64_t M = c->M, C = c->C, *mine = c->h_msg_all + me * M;
    for (int64_t e = 0; e < E; e++) sl->counts[e] = mine[e];
    for (int64_t s = 0; s < P; s++)
        for (int64_t j = 0; j < El; j++) sl->rcounts[s * El + j] = c->h_msg_all[s * M + me * El + j];
    for (int64_t ch = 0; ch < C && C > 1; ch++) { /* the message's tail: [C][E] per rank */
        for (int64_t e = 0; e < E; e++) sl->ccnt[ch * E + e] = mine[E + 3 + ch * E + e];
        for (int64_t s = 0; s < P; s++)
            for (int64_t j = 0; j < El; j++)
                sl->rccnt[(s * C + ch) * El + j] = c->h_msg_all[s * M + E + 3 + ch * E + me * El + j];
    }
    out->R = f->R;
    out->valid = mine[M - 1];
    out->capacity = moept__capacity(p->capacity_factor, out->valid, p->K, E); /* the device's */
}

/* 7. losses (the same host arithmetic as moept.c); the aux gradient's
   per-expert factors go to the device for the backward */
static moept_status moept__fwd_losses(moept__cuda *c, moept__cslot *sl, double *lstat_out,
                                      moept__dev_step *out, char *err) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t E = p->E;
    const double Tl = c->h_lstat[3 * E] > 0 ? c->h_lstat[3 * E] : 1.0;
    out->aux_value = moept__aux_value(c->h_lstat, E, p->K, p->cfg->aux_loss, p->cfg->aux_loss_coef,
                                      c->h_aux_g);
    out->z_value = c->h_lstat[3 * E + 1] / Tl;
    out->loss_T = Tl;
    sl->loss_T = Tl;
    out->counts_global = moept__global_balance(p) || (!p->ep && !p->dp);
    memcpy(lstat_out, c->h_lstat, (size_t)moept__lstat_of(E).n * 8);
    if (moept__seq_len(p) > 0) moept__seq_mean(c, sl);
    else MOEPT__CU(cudaMemcpyAsync(sl->aux_g, c->h_aux_g, (size_t)E * 4, cudaMemcpyHostToDevice, c->s));
    MOEPT__LAUNCHED();
    return MOEPT_OK;
}

/* 8. plan: each row's place on the device (moept__k_plan_place: row_of,
   tok_of_row, from the count's kept rows per block), and on the host each
   slot's first row, each local expert's, the exchange's pieces and the rows
   per peer (sync-free: the fixed blocks of moept__sf_layout) */
static moept_status moept__fwd_plan(moept__cuda *c, moept__cslot *sl, int64_t *peer_rows,
                                    moept__dev_step *out, char *err) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t D = p->D, E = p->E, El = p->El, P = p->P, K = p->K, T_ = sl->T;
    if (!c->B) {
        sl->offsets[0] = 0;
        for (int64_t e = 0; e < E; e++) sl->offsets[e + 1] = sl->offsets[e] + sl->counts[e];
        sl->N = out->N = sl->offsets[E];
        moept__plan_roffsets(P, El, sl->rcounts, sl->roffsets);
        moept__plan_segs(P, El, D, sl->offsets, sl->counts, sl->rcounts, sl->roffsets, sl->send_segs,
                         sl->recv_segs);
        moept__plan_peer_rows(P, El, p->rank, sl->counts, sl->rcounts, El, peer_rows, &out->rows_sent,
                              &out->rows_received);
    }
    if (c->B) /* the blocks' unused rows */
        MOEPT__CU(cudaMemsetAsync(sl->tok_of_row, 0xff, (size_t)sl->N * 8, c->s));
    if (T_ > 0) {
        MOEPT__LAUNCH(moept__k_plan_place, (unsigned)((T_ * K + 255) / 256), 256, 0, c->s)(
            sl->ids[sl->cur], c->slot_of, c->lrank, c->hist, c->kept, c->koff, T_ * K, K, (int)E, sl->row_of,
            sl->tok_of_row);
        MOEPT__LAUNCHED();
    }
    return MOEPT_OK;
}

/* 9. dispatch: the rows go once: x -> send buffer -> experts (chunked: the
   pipeline sends them chunk by chunk); config.fp8: as FP8 records, quantized as they are gathered */
template <typename T>
static moept_status moept__fwd_dispatch(moept__cuda *c, moept__cslot *sl, const T *x, moept__dev_step *out,
                                        char *err) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t D = p->D;
    void *xs = p->P > 1 ? sl->xs : sl->xr; /* at one rank the permuted rows are the experts' rows */
    if (sl->N > 0 && moept__fp8_on(p)) {
        MOEPT__TRY(moept__q8_records<T>(c, x, sl->tok_of_row, sl->N, xs, err));
    } else if (sl->N > 0 && !moept__gk_gather(c)) { /* (else the experts read x through the index) */
        const int vec = moept__vec<T>(D, x, xs);
        const moept__shape sh = moept__rows_shape(sl->N, vec ? D / MOEPT__VEC(T) : D);
        MOEPT__LAUNCH_V(vec, moept__k_gather, T, sh.g, sh.b, c->s, x, sl->tok_of_row, sl->N, (int)D, (T *)xs);
        MOEPT__LAUNCHED();
    }
    if (p->P > 1 && c->C == 1)
        MOEPT__TRY(moept__exchange(c, xs, sl->send_segs, sl->xr, sl->recv_segs,
                                   MOEPT__X_OUT | MOEPT__X_AFTER | MOEPT__X_JOIN | MOEPT__X_XQ, out, err));
    return MOEPT_OK;
}

/* The shared expert's input: x, or a masked step's x with its padded rows
   zero (xsh: made again by the backward's combine', as forward slots share it) */
template <typename T>
static moept_status moept__shared_in(moept__cuda *c, moept__cslot *sl, const T **x, char *err) {
    const int64_t D = c->sp.D, T_ = sl->T;
    if (!sl->masked) return MOEPT_OK;
    const int vec = moept__vec<T>(D, *x, c->xsh);
    const moept__shape sh = moept__rows_shape(T_, vec ? D / MOEPT__VEC(T) : D);
    MOEPT__LAUNCH_V(vec, moept__k_unpadded, T, sh.g, sh.b, c->s, *x, sl->ids[sl->cur], T_, (int)D,
                    (int)c->sp.K, (T *)c->xsh);
    MOEPT__LAUNCHED();
    *x = (const T *)c->xsh;
    return MOEPT_OK;
}

/* the shared expert and its gate over every token (while routed rows
   travel) */
template <typename T>
static moept_status moept__shared_fwd(moept__cuda *c, moept__cslot *sl, const T *x, char *err) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t D = p->D, T_ = sl->T;
    if (p->S == 0 || T_ == 0) return MOEPT_OK;
    MOEPT__TRY(moept__shared_in<T>(c, sl, &x, err));
    const int64_t off[2] = {0, T_};
    const moept__runs R = moept__runs_groups(off, 1);
    const moept__ffn f = moept__ffn_shared(c, sl, x);
    MOEPT__TRY(moept__ffn_fwd<T>(c, &f, &R, err));
    if (p->offsg < 0) return MOEPT_OK;
    moept__gemm gg =
        moept__gemm_make(0, 1, T_, 1, D, (const float *)x, D, moept__w(c, p->offsg), D, 0.0f, sl->sg, 1);
    MOEPT__TRY(moept__gemms(c, &gg, 1, c->dt, CUDA_R_32F, err));
    MOEPT__LAUNCH(moept__k_sigmoid, moept__grid(T_), MOEPT__TB, 0, c->s)(sl->sg, T_);
    MOEPT__LAUNCHED();
    return MOEPT_OK;
}

/* 10. experts: the routed FFNs, their rows' way back (in flight while the
   shared expert and its gate run) */
template <typename T>
static moept_status moept__fwd_experts(moept__cuda *c, moept__cslot *sl, const T *x, moept__dev_step *out,
                                       char *err) {
    const moept__cuda_spec *p = &c->sp;
    const moept__runs R = moept__runs_groups(sl->roffsets, p->El);
    const moept__ffn f = moept__ffn_routed(c, sl, x, 0);
    MOEPT__TRY(moept__ffn_fwd<T>(c, &f, &R, err));
    if (p->P > 1)
        MOEPT__TRY(moept__exchange(c, sl->ys, sl->send_segs, sl->yr, sl->recv_segs, MOEPT__X_AFTER, out,
                                   err));
    MOEPT__TRY(moept__shared_fwd<T>(c, sl, x, err));
    if (p->P > 1) MOEPT__TRY(moept__from_comm(c, c->cs, err)); /* the experts' outputs are back */
    return MOEPT_OK;
}

/* 11. combine tokens [t0, t1): y = sum_k w_k (expert rows) + the shared
   expert's (gated) */
template <typename T>
static moept_status moept__fwd_combine(moept__cuda *c, moept__cslot *sl, T *y, int64_t t0, int64_t t1,
                                       char *err) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t D = p->D, K = p->K;
    if (t1 <= t0) return MOEPT_OK;
    const void *ys = p->P > 1 ? sl->ys : sl->yr;
    const T *yss = p->S > 0 ? (const T *)sl->yss + t0 * D : NULL;
    const int vec = moept__vec<T>(D, ys, yss, y);
    const moept__shape sh = moept__rows_shape(t1 - t0, vec ? D / MOEPT__VEC(T) : D);
    MOEPT__LAUNCH_V(vec, moept__k_combine, T, sh.g, sh.b, c->s, (const T *)ys, sl->row_of + t0 * K,
                    sl->wts[sl->cur] + t0 * K, yss, p->offsg >= 0 ? sl->sg + t0 : NULL, t1 - t0, (int)D,
                        (int)K,
                    y + t0 * D, t0 * D, sl->ybad);
    MOEPT__LAUNCHED();
    return MOEPT_OK;
}

/* ---- chunked overlap (C > 1, P > 1) -------------------------------------
   As moept.c's: chunk ch is tokens [ch T / C, (ch+1) T / C). The plan is a
   stable sort by slot, so a chunk's rows of a slot follow the earlier
   chunks' in that slot's rows, and on the expert side its rows from peer p
   for local expert j follow the earlier chunks' in (j, p)'s rows: every row
   lands where the one-chunk step puts it, and the per-row math is the same. */

/* Chunk ch's exchange pieces (c->csend, c->crecv) and its row runs on the
   expert side (c->cruns [3][G]); returns the runs (moept.h's
   moept__plan_chunk, as moept.c's moept__chunk_plan). */
static int64_t moept__chunk_plan(moept__cuda *c, moept__cslot *sl, int64_t ch) {
    const moept__cuda_spec *p = &c->sp;
    return moept__plan_chunk(ch, c->C, p->P, p->El, p->D, sl->offsets, sl->ccnt, sl->rcounts, sl->roffsets,
                             sl->rccnt, c->csend, c->crecv, c->cruns);
}

/* the shared expert's backward (dxs over yss), while routed rows travel; a
   masked step's over its forward's input (xsh, padded rows zero) */
template <typename T>
static moept_status moept__shared_bwd(moept__cuda *c, moept__cslot *sl, const T *x, char *err) {
    const moept__cuda_spec *p = &c->sp;
    if (p->S == 0 || sl->T == 0) return MOEPT_OK;
    const int64_t off[2] = {0, sl->T};
    if (sl->masked) x = (const T *)c->xsh; /* (made again by combine') */
    const moept__runs R = moept__runs_groups(off, 1);
    const moept__ffn f = moept__ffn_shared(c, sl, x);
    return moept__ffn_bwd<T>(c, &f, &R, err);
}

/* The chunk pipeline of both passes (moept.c's moept__pipeline): chunk ch+1
   travels out while the experts compute chunk ch, whose results travel back
   while the next computes. Every rank posts the exchanges in the same order
   on its comm stream; the compute stream waits for a chunk's arrival event
   only. forward: xs -> xr, yr -> ys, the shared expert while chunk 0
   travels, chunk ch combined once back. backward (after combine' wrote dys
   into ys; config.fp8: their records into xs): ys -> yr (xs -> yq), dxr ->
   ys, the shared expert's backward while chunk 0 travels, the weight
   gradients while the last chunk's dxs return. */
template <typename T>
static moept_status moept__pipeline(moept__cuda *c, moept__cslot *sl, int bwd, const T *x, T *y,
                                    moept__dev_step *out,
                                    char *err) {
    const int64_t C = c->C, T_ = sl->T;
    void *send = sl->xs, *recv = sl->xr, *res = bwd ? sl->dxr : sl->yr;
    if (bwd) moept__dys(c, sl, &send, &recv);
    const moept__ffn f = moept__ffn_routed(c, sl, x, bwd);
    const int X_OUT = MOEPT__X_OUT | MOEPT__X_XQ; /* (config.fp8: x's and dy's records) */
    moept__chunk_plan(c, sl, 0);
    MOEPT__TRY(moept__exchange(c, send, c->csend, recv, c->crecv, X_OUT | MOEPT__X_AFTER, out, err));
    MOEPT__CU(cudaEventRecord(c->ev_out[0], c->cs));
    MOEPT__TRY(bwd ? moept__shared_bwd<T>(c, sl, x, err) : moept__shared_fwd<T>(c, sl, x, err));
    for (int64_t ch = 0; ch < C; ch++) {
        if (ch + 1 < C) { /* its rows were ready before chunk 0 left: no wait on the compute stream */
            moept__chunk_plan(c, sl, ch + 1);
            MOEPT__TRY(moept__exchange(c, send, c->csend, recv, c->crecv, X_OUT, out, err));
            MOEPT__CU(cudaEventRecord(c->ev_out[(ch + 1) % 2], c->cs));
        }
        const moept__runs R = moept__runs_chunk(c->cruns, moept__chunk_plan(c, sl, ch), c->G);
        MOEPT__CU(cudaStreamWaitEvent(c->s, c->ev_out[ch % 2], 0));
        MOEPT__TRY(bwd ? moept__ffn_bwd<T>(c, &f, &R, err) : moept__ffn_fwd<T>(c, &f, &R, err));
        MOEPT__TRY(moept__exchange(c, sl->ys, c->csend, res, c->crecv, MOEPT__X_AFTER, out, err));
        MOEPT__CU(cudaEventRecord(c->ev_back[ch % 2], c->cs));
        if (ch > 0 && !bwd) {
            MOEPT__CU(cudaStreamWaitEvent(c->s, c->ev_back[(ch - 1) % 2], 0));
            int64_t t0 = moept__chunk_start(T_, C, ch - 1), t1 = moept__chunk_start(T_, C, ch);
            MOEPT__TRY(moept__fwd_combine<T>(c, sl, y, t0, t1, err));
        }
    }
    if (bwd) { /* the weight gradients over every row of each expert, as the one-chunk step */
        const moept__runs R = moept__runs_groups(sl->roffsets, c->sp.El);
        MOEPT__TRY(moept__ffn_wgrad<T>(c, &f, &R, 1, err));
        MOEPT__TRY(moept__ffn_wgrad<T>(c, &f, &R, 0, err));
    }
    /* the last chunk's return is the comm stream's last op: all are back */
    MOEPT__CU(cudaStreamWaitEvent(c->s, c->ev_back[(C - 1) % 2], 0));
    return bwd ? MOEPT_OK : moept__fwd_combine<T>(c, sl, y, moept__chunk_start(T_, C, C - 1), T_, err);
}

/* Sync-free 4-6: the counts and statistics shared on the device, the checks
   agreed there (moept__k_sf_agree: reported later), and the step committed
   to its fixed blocks; a host-detected failure fails this rank's call after
   the collectives (its peers see it in the flags) */
static moept_status moept__sf_commit(moept__cuda *c, moept__cslot *sl, moept__fwd *f, moept__dev_step *out,
                                     char *err) {
    const moept__cuda_spec *p = &c->sp;
    MOEPT__STAGE("exchange_counts");
    MOEPT__TRY(moept__fwd_share(c, out, err));
    MOEPT__STAGE("agree_growth");
    const moept_config *cf = p->cfg;
    MOEPT__LAUNCH(moept__k_sf_agree, 1, 1, 0, c->s)(c->msg_all, p->P, c->M, (int)p->E, (int)p->K,
                                                  cf->aux_loss, f->tag, moept__global_balance(p),
                                                  cf->z_loss_coef, cf->aux_loss_coef, c->lstat, sl->aux_g,
                                                  c->bad, p->rank, f->host_bad);
    MOEPT__LAUNCHED();
    if (f->local[0])
        return moept__kfail(err, f->pre || f->pending != cudaSuccess ? MOEPT_ERR_DEVICE
                                 : f->reject ? f->reject : MOEPT_ERR_INVALID_ARGUMENT, "%s", f->local);
    MOEPT__STAGE("commit");
    const size_t nmsg = (size_t)(p->P * c->M) * 8, nlstat = (size_t)MOEPT__NLSTAT(p->E) * 8;
    MOEPT__CU(cudaMemcpyAsync(sl->cmsg, c->msg_all, nmsg, cudaMemcpyDeviceToDevice, c->s));
    MOEPT__CU(cudaMemcpyAsync(sl->clstat, c->lstat, nlstat, cudaMemcpyDeviceToDevice, c->s));
    moept__slot_commit(sl, f);
    out->deferred = 1;
    if (moept__seq_len(p) > 0) {
        moept__seq_mean(c, sl);
        MOEPT__LAUNCHED();
    }
    return MOEPT_OK;
}

/* The forward, stage by stage as moept.c's (the stage map at the top):
   checks -> route -> count -> exchange_counts -> agree_growth -> commit ->
   losses -> plan -> dispatch -> experts -> combine; chunked, the last three
   as one pipeline; sync-free, 4-6 on the device (moept__sf_commit) and the
   losses read when asked for (moept__cuda_step_stats). */
template <typename T>
static moept_status moept__forward(moept__cuda *c, const void *xv, int64_t Tn, void *yv, double *lstat_out,
                                   int64_t *peer_rows, moept__dev_step *out, char *err) {
    const T *x = (const T *)xv;
    moept__fwd f;
    memset(&f, 0, sizeof f);
    f.tag = out->tag;
    f.reject = out->reject;
    f.a = out->f;
    char why[MOEPT__ERRLEN];
    moept__cslot *sl; /* the forward's slot (nothing switches: the layer's last changes once it is done) */
    moept__fwd_slot(c, out, &f, &sl, why);
    moept__fwd_checks(c, sl, xv, Tn, yv, f.reject == out->reject ? out->reject_msg : why, &f);
    MOEPT__STAGE("route");
    moept__fwd_route<T>(c, sl, x, &f);
    MOEPT__STAGE("count");
    moept__fwd_count(c, sl, &f);
    if (c->B) {
        MOEPT__TRY(moept__sf_commit(c, sl, &f, out, err));
    } else {
        MOEPT__STAGE("exchange_counts");
        MOEPT__TRY(moept__fwd_exchange_counts(c, out, err));
        MOEPT__STAGE("agree_growth");
        MOEPT__TRY(moept__fwd_agree_growth(c, sl, &f, err));
        MOEPT__STAGE("commit");
        moept__fwd_commit(c, sl, &f, out); /* nothing fails from here on but the device */
        MOEPT__STAGE("losses");
        MOEPT__TRY(moept__fwd_losses(c, sl, lstat_out, out, err));
    }
    /* y's finiteness, checked by the combine as it writes y and read by the
       backward's host sync (a sync here would stall the host's run-ahead):
       a committed step's flag, which no rejected forward resets */
    MOEPT__CU(cudaMemsetAsync(sl->ybad, 0xff, 8, c->s));
    MOEPT__STAGE("plan");
    MOEPT__TRY(moept__fwd_plan(c, sl, peer_rows, out, err));
    MOEPT__STAGE("dispatch");
    MOEPT__TRY(moept__fwd_dispatch<T>(c, sl, x, out, err));
    if (c->C > 1) {
        MOEPT__STAGE("pipeline");
        MOEPT__TRY(moept__pipeline<T>(c, sl, 0, x, (T *)yv, out, err));
    } else {
        MOEPT__STAGE("experts");
        MOEPT__TRY(moept__fwd_experts<T>(c, sl, x, out, err));
        MOEPT__STAGE("combine");
        MOEPT__TRY(moept__fwd_combine<T>(c, sl, (T *)yv, 0, sl->T, err));
    }
    c->last = (int)(sl - c->slots); /* what the host reads back from now on */
    return MOEPT_OK;
}

static moept_status moept__cuda_forward(moept__cuda *c, const void *x, int64_t T, void *y, double *lstat,
                                        int64_t *peer_rows, moept__dev_step *out, char *err) {
    MOEPT__ENTER(c);
    moept_status st = c->esz == 2 ? moept__forward<moept__bf16>(c, x, T, y, lstat, peer_rows, out, err)
                                  : moept__forward<float>(c, x, T, y, lstat, peer_rows, out, err);
    MOEPT__STAGE(NULL);
    out->slot = c->last;
    out->recv_capacity = moept__last(c)->Rcap;
    out->recv_growths = c->growths;
    return st;
}

/* ---- backward ----------------------------------------------------------- */
/* 1b. the agreement (unless unchecked_backward): a message the forward's
   count exchange's shape (so a rank in a forward meets it and both see the
   tags differ) with [E] failed, [E + 1] the call tag, [E + 2] this rank's y
   was not finite, [E + 3] opts.router_loss_scale's bits (the same on
   every rank). A step whose y was not finite anywhere is dropped on every
   rank. */
static moept_status moept__bwd_exchange(moept__cuda *c, moept__cslot *sl, int64_t tag, moept_status why,
                                        const char *local,
                                        int ybad, float rscale, char *err) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t E = p->E, M = c->M, P = p->P;
    int64_t *mine = c->h_msg_all + p->rank * M, failed = 0, yfail = 0, sdiff = 0;
    memset(mine, 0, (size_t)M * 8);
    mine[E] = local[0] != 0;
    mine[E + 1] = tag;
    mine[E + 2] = ybad;
    uint32_t sb;
    rscale += 0.0f; /* -0 as +0: the same value */
    memcpy(&sb, &rscale, 4);
    mine[E + 3] = (int64_t)sb | (int64_t)(sl - c->slots) << 32; /* opts.router_loss_scale and opts.slot */
    if (p->ep) {
        moept_status st = p->ep->allgather(p->ep, mine, c->h_msg_all, M * 8); /* host buffers: waits */
        if (st) return moept__kfail(err, st, "moept_backward: failure agreement failed: %s", p->ep->err);
    }
    for (int64_t q = 0; q < P; q++) {
        if (c->h_msg_all[q * M + E + 1] != tag)
            return moept__kfail(err, MOEPT_ERR_STATE, "moept_backward: the ranks' call sequences differ "
                                "(another rank made another group call here); nothing changed");
        failed += c->h_msg_all[q * M + E] != 0;
        yfail += c->h_msg_all[q * M + E + 2] != 0;
        sdiff += c->h_msg_all[q * M + E + 3] != mine[E + 3];
    }
    if (ybad || (yfail && !sdiff)) sl->fwd_valid = 0; /* (peers naming other slots keep theirs) */
    if (local[0]) return moept__kfail(err, why, "%s", local);
    if (failed)
        return moept__kfail(err, MOEPT_ERR_STATE, "moept_backward: %lld other rank(s) rejected the step; %s",
                            (long long)failed,
                            yfail ? "the step is rejected, run forward again" : "nothing changed");
    if (sdiff)
        return moept__kfail(err, MOEPT_ERR_INVALID_ARGUMENT, "moept_backward: the ranks passed different "
                            "router_loss_scale or opts.slot (every rank must pass the same); nothing "
                            "changed");
    return MOEPT_OK;
}

/* 1. checks, dy's finiteness and the forward's y (unless
   unchecked_backward), then the agreement: every rank differentiates, or
   none does */
template <typename T>
static moept_status moept__bwd_agree(moept__cuda *c, moept__cslot *sl, const T *x, const T *dy,
                                     const void *dx, int64_t tag,
                                     moept__dev_step *out, char *err) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t D = p->D, T_ = sl->T;
    char local[MOEPT__ERRLEN] = "";
    moept_status why = MOEPT_OK;
    if (out->reject) {
        why = out->reject;
        snprintf(local, sizeof local, "%s", out->reject_msg);
    } else if (!sl->fwd_valid) {
        why = MOEPT_ERR_STATE;
        snprintf(local, sizeof local, "moept_backward: no forward to differentiate");
    } else if (sl->fwd_eval) {
        why = MOEPT_ERR_STATE;
        snprintf(local, sizeof local, "moept_backward: the last forward was an evaluation (opts.eval): it "
                 "kept nothing to differentiate");
    } else if (sl->bwd_done) { /* ys and h were overwritten in place */
        why = MOEPT_ERR_STATE;
        snprintf(local, sizeof local,
                 "moept_backward: this forward was already differentiated; run forward again");
    } else if (sl->fwd_stale) { /* moept.c's message */
        why = MOEPT_ERR_STATE;
        snprintf(local, sizeof local, "moept_backward: %s changed the weights since this forward; its "
                 "gradients would mix the old activations with the new weights: run the forward again",
                 sl->fwd_stale);
    } else if (T_ > 0 && (!x || !dy || !dx)) {
        why = MOEPT_ERR_INVALID_ARGUMENT;
        snprintf(local, sizeof local, "moept_backward: %s is NULL", !x ? "x" : !dy ? "dy" : "dx");
    } else if (moept__overlaps(dx, x, (size_t)(T_ * D) * c->esz)) { /* as moept.c */
        why = MOEPT_ERR_INVALID_ARGUMENT;
        snprintf(local, sizeof local, "%s", MOEPT__DX_ALIAS);
    }
    if (!local[0] && T_ > 0) {
        MOEPT__CU(cudaMemsetAsync(&c->bad[2], 0xff, 8, c->s));
        moept__check<T>(c, dy, T_ * D, NULL, &c->bad[2], moept__pad_of(c, sl)); /* padded rows: unread */
        MOEPT__LAUNCHED();
    }
    /* unchecked_backward: no host sync and no agreement; a rank's rejection is its own. Sync-free:
       y's and dy's checks are noted for the next adamw_step or grad_norm */
    if (p->sync_free && !local[0]) {
        MOEPT__LAUNCH(moept__k_sf_note, 1, 1, 0, c->s)(c->bad, sl->ybad);
        MOEPT__LAUNCHED();
    }
    if (p->unchecked_backward || p->sync_free)
        return local[0] ? moept__kfail(err, why, "%s", local) : MOEPT_OK;
    /* the step's second host sync */
    MOEPT__CU(cudaMemcpyAsync(c->h_bad + 2, &c->bad[2], 2 * 8, cudaMemcpyDeviceToHost, c->s));
    MOEPT__CU(cudaMemcpyAsync(c->h_bad + 4, sl->ybad, 8, cudaMemcpyDeviceToHost, c->s));
    MOEPT__TRY(moept__host_wait(c, err));
    int ybad = !local[0] && T_ > 0 && c->h_bad[4] != ULLONG_MAX;
    if (ybad) {
        why = MOEPT_ERR_NUMERIC;
        snprintf(local, sizeof local, "moept_backward: the forward's y[%lld][%lld] was not finite from "
                 "finite inputs (an overflow?); the step is rejected, run forward again",
                 (long long)(c->h_bad[4] / D), (long long)(c->h_bad[4] % D));
    } else if (!local[0] && T_ > 0 && c->h_bad[2] != ULLONG_MAX) {
        why = MOEPT_ERR_NUMERIC;
        snprintf(local, sizeof local, "moept_backward: dy[%lld][%lld] is not finite",
                 (long long)(c->h_bad[2] / D), (long long)(c->h_bad[2] % D));
    }
    out->agreed = 1;
    return moept__bwd_exchange(c, sl, tag, why, local, ybad, out->router_loss_scale, err);
}

/* 2. combine': dL/dw and dys in place of the outputs (ys), the shared
   expert's dy (gated) in yss; the router's fp32 input again (bf16: a
   rejected forward may have overwritten xf). config.fp8: the dys as FP8
   records instead (the backward's dispatch quantizes them once, as the
   forward's does x: into xs, which that is done with, or at one rank the
   experts' yq) */
template <typename T>
static moept_status moept__bwd_combine(moept__cuda *c, moept__cslot *sl, const T *x, const T *dy, char *err) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t D = p->D, K = p->K, T_ = sl->T;
    if (T_ == 0) return MOEPT_OK;
    if (c->wlow && (!sl->xf_committed || sl->masked)) { /* a rejected forward converted its x since; a
                                                           masked step's router gradient reads zeros */
        moept__check<T>(c, x, T_ * D, sl->xf, &c->bad[3], moept__pad_of(c, sl));
        MOEPT__LAUNCHED();
        sl->xf_committed = 1;
    }
    if (c->xsh) { /* a masked step's x with its padded rows zero, once for the whole backward */
        const T *xu = x;
        MOEPT__TRY(moept__shared_in<T>(c, sl, &xu, err));
    }
    void *ys = p->P > 1 ? sl->ys : sl->yr, *out, *in;
    const int vec = moept__vec<T>(D, ys, dy, sl->yss);
    moept__dys(c, sl, &out, &in);
    if (moept__fp8_on(p)) {
        MOEPT__TRY(moept__q8_combine<T>(c, (const T *)ys, sl->row_of, sl->wts[sl->cur], dy, T_ * K, K,
                                        c->B ? sl->tok_of_row : NULL, c->B ? sl->N : 0, out, sl->dwts, err));
    } else {
        MOEPT__LAUNCH_V(vec, moept__k_combine_bwd, T, (unsigned)(T_ * K), MOEPT__TB, c->s, (T *)ys,
                        sl->row_of, sl->wts[sl->cur], dy, (int)D, (int)K, sl->dwts);
        MOEPT__LAUNCHED();
    }
    if (p->S > 0) {
        MOEPT__LAUNCH_V(vec, moept__k_shared_bwd, T, (unsigned)T_, MOEPT__TB, c->s, (T *)sl->yss,
                        p->offsg >= 0 ? sl->sg : NULL, dy, (int)D, c->dsg,
                            sl->masked ? sl->ids[sl->cur] : NULL,
                        (int)K);
        MOEPT__LAUNCHED();
    }
    return MOEPT_OK;
}

/* 3. experts: dys out (config.fp8: their records, xs -> yq), the FFNs'
   backward, dxs back (the shared expert's backward while they travel) */
template <typename T>
static moept_status moept__bwd_experts(moept__cuda *c, moept__cslot *sl, const T *x, moept__dev_step *out,
                                       char *err) {
    const moept__cuda_spec *p = &c->sp;
    void *ys = p->P > 1 ? sl->ys : sl->yr, *dout, *dys;
    const int both = MOEPT__X_OUT | MOEPT__X_AFTER | MOEPT__X_JOIN | MOEPT__X_XQ;
    moept__dys(c, sl, &dout, &dys);
    if (p->P > 1) MOEPT__TRY(moept__exchange(c, dout, sl->send_segs, dys, sl->recv_segs, both, out, err));
    const moept__runs R = moept__runs_groups(sl->roffsets, p->El);
    const moept__ffn f = moept__ffn_routed(c, sl, x, 1);
    MOEPT__TRY(moept__ffn_bwd<T>(c, &f, &R, err));
    if (p->P > 1)
        MOEPT__TRY(moept__exchange(c, ys, sl->send_segs, sl->yr, sl->recv_segs, MOEPT__X_AFTER, out, err));
    MOEPT__TRY(moept__shared_bwd<T>(c, sl, x, err));
    if (p->P > 1) MOEPT__TRY(moept__from_comm(c, c->cs, err));
    return MOEPT_OK;
}

/* 4. router': dlogits, then gWr += dlogits^T xin (xin = xf * u under
   jitter: the noise drawn again), and the shared gate's gsg += dsg^T xf */
static moept_status moept__bwd_router(moept__cuda *c, moept__cslot *sl, const float *xf,
                                      const moept__dev_step *o,
                                      char *err) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t D = p->D, E = p->E, K = p->K, T_ = sl->T;
    const int cur = sl->cur;
    const moept_config *cf = p->cfg;
    const int64_t slen = moept__seq_len(p);
    const float *aux_g = cf->aux_loss == MOEPT_AUX_NONE || cf->aux_loss_coef == 0.0f ? NULL
                       : slen > 0 ? sl->seqg[cur] : sl->aux_g; /* [T / slen][E] or [E] */
    MOEPT__LAUNCH(moept__k_router_bwd, (unsigned)((T_ + 127) / 128), 128, 0, c->s)(
        cf->family, cf->aux_loss, sl->logits[cur], sl->probs[cur], sl->ids[cur], sl->dwts, aux_g, slen,
            cf->z_loss_coef,
        sl->lse[cur],
        (float)sl->loss_T, c->B ? sl->clstat + 3 * E : NULL, (int)E, (int)K, cf->norm_topk_prob,
        cf->routed_scaling_factor,
        o->router_loss_scale, o->dlogits, T_, c->scratch, c->dlogits, &c->bad[4]);
    MOEPT__LAUNCHED();
    if (sl->jit) {
        moept__jitter(c, xf, T_, sl->jrow[cur], sl->jkey, 0);
        MOEPT__LAUNCHED();
    }
    const float *xin = sl->jit ? c->xj : xf;
    moept__gemm g = moept__gemm_make(1, 0, E, D, T_, c->dlogits, E, xin, D, 1.0f, c->grads, D);
    MOEPT__TRY(moept__gemms(c, &g, 1, CUDA_R_32F, CUDA_R_32F, err));
    if (p->S == 0 || p->offsg < 0) return MOEPT_OK;
    g = moept__gemm_make(1, 0, 1, D, T_, c->dsg, 1, xf, D, 1.0f, c->grads + p->offsg, D);
    return moept__gemms(c, &g, 1, CUDA_R_32F, CUDA_R_32F, err);
}

/* 5. dx in one pass: the K rows of each token, the shared expert's dxs, the
   shared gate's and the router's terms; a non-finite dx from finite dy is
   flagged for the next adamw_step or grad_norm (no host sync here) */
template <typename T>
static moept_status moept__bwd_dx(moept__cuda *c, moept__cslot *sl, T *dx, char *err) {
    const moept__cuda_spec *p = &c->sp;
    const int64_t D = p->D, T_ = sl->T;
    const void *ys = p->P > 1 ? sl->ys : sl->yr;
    const int gate = p->S > 0 && p->offsg >= 0;
    const T *yss = p->S > 0 ? (const T *)sl->yss : NULL;
    /* the router's weights (fp32 rows of D) are read as vectors of as many lanes */
    const int vec = moept__vec<T>(D, ys, yss, dx) && moept__vec<T>(0, c->params); /* D % V: Wr's rows too */
    const moept__shape sh = moept__rows_shape(T_, vec ? D / MOEPT__VEC(T) : D);
    const moept__jit jit = {sl->jit ? sl->jrow[sl->cur] : NULL, p->cfg->jitter_seed, sl->jkey,
                            p->cfg->router_jitter};
    MOEPT__LAUNCH_V(vec, moept__k_dx, T, sh.g, sh.b, c->s, (const T *)ys, sl->row_of, yss,
                    gate ? c->dsg : NULL, gate ? c->params + p->offsg : NULL, c->dlogits, c->params, T_,
                    (int)D, (int)p->K, (int)p->E, jit, dx, &c->bad[5]);
    MOEPT__LAUNCHED();
    return MOEPT_OK;
}

/* The backward, stage by stage as moept.c's: agree -> combine' -> experts'
   (chunked: the pipeline) -> router' -> dx. */
template <typename T>
static moept_status moept__backward(moept__cuda *c, moept__cslot *sl, const void *xv, const void *dyv,
                                    void *dxv,
                                    moept__dev_step *out, char *err) {
    const T *x = (const T *)xv, *dy = (const T *)dyv;
    MOEPT__STAGE("bwd.agree");
    MOEPT__TRY(moept__bwd_agree<T>(c, sl, x, dy, dxv, out->tag, out, err));
    sl->bwd_done = 1; /* from here on the saved rows change */
    const float *xf = c->wlow ? sl->xf : sl->masked ? (const float *)c->xsh : (const float *)xv;
    MOEPT__STAGE("bwd.combine");
    MOEPT__TRY(moept__bwd_combine<T>(c, sl, x, dy, err));
    MOEPT__STAGE(c->C > 1 ? "bwd.pipeline" : "bwd.experts");
    if (c->C > 1) MOEPT__TRY(moept__pipeline<T>(c, sl, 1, x, NULL, out, err));
    else MOEPT__TRY(moept__bwd_experts<T>(c, sl, x, out, err));
    if (sl->T == 0) return MOEPT_OK;
    MOEPT__STAGE("bwd.router");
    MOEPT__TRY(moept__bwd_router(c, sl, xf, out, err));
    MOEPT__STAGE("bwd.dx");
    return moept__bwd_dx<T>(c, sl, (T *)dxv, err);
}

/* The backward of opts.slot's forward (routing, statistics and growth go
   on reading the last forward's) */
static moept_status moept__cuda_backward(moept__cuda *c, const void *x, const void *dy, void *dx,
                                         moept__dev_step *out, char *err) {
    MOEPT__ENTER(c);
    c->grads_clean = 0;
    char e[MOEPT__ERRLEN];
    /* its forward's state (out->reject: the slot may be out of range; the last one's, refused alike) */
    moept__cslot *sl = out->reject ? moept__last(c) : &c->slots[out->slot];
    if (!out->reject && !sl->fwork) {
        out->reject = MOEPT_ERR_STATE;
        snprintf(e, sizeof e, "moept_backward: slot %d holds no forward to differentiate", out->slot);
        out->reject_msg = e;
        sl = moept__last(c);
    }
    moept_status st = c->esz == 2 ? moept__backward<moept__bf16>(c, sl, x, dy, dx, out, err)
                                  : moept__backward<float>(c, sl, x, dy, dx, out, err);
    MOEPT__STAGE(NULL);
    out->recv_capacity = moept__last(c)->Rcap;
    out->recv_growths = c->growths;
    return st;
}

/* Gradient reduction as moept_sync_grads: router and shared expert over EP,
   then everything over DP, on the comms' streams. */
static moept_status moept__cuda_sync_grads(moept__cuda *c, float scale, char *err) {
    MOEPT__ENTER(c);
    c->grads_clean = 0;
    const moept__cuda_spec *p = &c->sp;
    int64_t n_router = p->E * p->D, n_exp = p->offs13 - p->off13;
    int64_t n_shared = p->n_params - n_router - n_exp;
    moept_status st;
    if (p->ep) {
        MOEPT__TRY(moept__to_comm(c, c->cs, err));
        if ((st = p->ep->allreduce(p->ep, c->grads, n_router, MOEPT_DTYPE_F32)))
            return moept__kfail(err, st, "moept_sync_grads: %s", p->ep->err);
        if (n_shared && (st = p->ep->allreduce(p->ep, c->grads + p->offs13, n_shared, MOEPT_DTYPE_F32)))
            return moept__kfail(err, st, "moept_sync_grads: %s", p->ep->err);
        MOEPT__TRY(moept__from_comm(c, c->cs, err));
    }
    if (p->dp) {
        cudaStream_t ds = moept__stream_of(p->dp);
        MOEPT__TRY(moept__to_comm(c, ds, err));
        if ((st = p->dp->allreduce(p->dp, c->grads, p->n_params, MOEPT_DTYPE_F32)))
            return moept__kfail(err, st, "moept_sync_grads: %s", p->dp->err);
        MOEPT__TRY(moept__from_comm(c, ds, err));
    }
    if (scale != 1.0f) MOEPT__CB(cublasSscal_64(c->blas, p->n_params, &scale, c->grads, 1));
    return MOEPT_OK;
}

/* ---- optimizer: the gradients' scan and AdamW on the device ------------ */
/* sums [2]: the squares of the replicated and of this rank's expert
   gradients, in double; first_bad: the first non-finite gradient element,
   -1 if none. The block sums come back to the host (the one sync) and are
   added there in block order: deterministic. A second pass finds the
   element only when the sum is not finite. After a clean scan of the same
   gradients (grad_norm's, then adamw_step's) the sums it found.
   Every call that changes the device gradients clears grads_clean; a
   sync-free layer's may change in a replayed graph, so it always scans. */
static moept_status moept__cuda_grad_scan(moept__cuda *c, double *sums, int64_t *first_bad, char *err) {
    MOEPT__ENTER(c);
    const moept__cuda_spec *p = &c->sp;
    const int64_t n = p->n_params;
    double s2[2];
    *first_bad = -1;
    sums = sums ? sums : s2;
    if (c->grads_clean && !c->B) {
        sums[0] = c->gsum[0];
        sums[1] = c->gsum[1];
        return MOEPT_OK;
    }
    c->grads_clean = 0;
    const int vec = moept__vec<float>(0, c->grads), V = vec ? MOEPT__VEC(float) : 1;
    int nb = moept__grid(n / V + n % V);
    nb = nb < MOEPT__NPART ? nb : MOEPT__NPART;
    MOEPT__STAGE("optimizer");
    MOEPT__LAUNCH_V(vec, moept__k_sumsq, float, nb, MOEPT__TB, c->s, c->grads, n, p->off13, p->offs13,
                    c->gpart);
    MOEPT__LAUNCHED();
    MOEPT__CU(cudaMemcpyAsync(c->h_gpart, c->gpart, (size_t)nb * 2 * 8, cudaMemcpyDeviceToHost, c->s));
    MOEPT__TRY(moept__host_wait(c, err));
    sums[0] = sums[1] = 0.0;
    for (int b = 0; b < nb; b++) { sums[0] += c->h_gpart[2 * b]; sums[1] += c->h_gpart[2 * b + 1]; }
    c->grads_clean = isfinite(sums[0] + sums[1]);
    c->gsum[0] = sums[0];
    c->gsum[1] = sums[1];
    if (!c->grads_clean) {
        MOEPT__CU(cudaMemsetAsync(&c->bad[7], 0xff, 8, c->s));
        moept__check<float>(c, c->grads, n, NULL, &c->bad[7]);
        MOEPT__LAUNCHED();
        MOEPT__CU(cudaMemcpyAsync(c->h_bad + 7, &c->bad[7], 8, cudaMemcpyDeviceToHost, c->s));
        MOEPT__TRY(moept__host_wait(c, err));
        *first_bad = c->h_bad[7] == ULLONG_MAX ? -1 : (int64_t)c->h_bad[7];
    }
    MOEPT__STAGE(NULL);
    return MOEPT_OK;
}

/* The moments on the device: allocated at the first use (zeros); with
   from_host set from the host's m0, v0 [n_params] (NULL: zeros) */
static moept_status moept__opt_ready(moept__cuda *c, char *err) {
    MOEPT__ENTER(c);
    const int64_t npad = moept__npad(c);
    if (!c->opt_m) {
        void *blk = NULL;
        MOEPT__TRY(moept__dmalloc(c, &blk, (size_t)(2 * npad) * 4, err));
        c->opt_m = (float *)blk;
        c->opt_v = c->opt_m + npad;
        MOEPT__CU(cudaMemsetAsync(blk, 0, (size_t)(2 * npad) * 4, c->s));
    }
    return MOEPT_OK;
}

/* AdamW over the parameters [a, b) (moept__k_adamw), their bf16 copy's too from e0 on; launched alone (the
   caller reads the launch's error) */
static void moept__adamw_flat(moept__cuda *c, const moept__adamw_k *k, int64_t a, int64_t b) {
    const int64_t n = b - a, e0 = c->sp.E * c->sp.D;
    if (n <= 0) return;
    moept__bf16 *low = (moept__bf16 *)c->wlow; /* (element i's copy at low[a + i - e0]) */
    float *p = c->params + a, *g = c->grads + a, *m = c->opt_m + a, *v = c->opt_v + a;
    const int vec = moept__adamw_v4(c, a), V = vec ? MOEPT__VEC(float) : 1;
    MOEPT__LAUNCH_V(vec, moept__k_adamw, float, moept__grid(n / V + n % V), MOEPT__TB, c->s, p, g, m, v, n,
                    *k, e0 - a, low);
}

/* One AdamW step on the device's parameters (queued, no host sync; the
   moments made by moept__opt_ready). bf16 layers get their expert weights'
   bf16 copy from the same pass; config.fp8's expert weights (router | w13 |
   w2 | ws13 | ws2 | wsg: the four between, one run) get their E4M3 copies
   from it too, a 128 x 128 block a thread block (moept__q8_weights). */
static moept_status moept__cuda_adamw(moept__cuda *c, const moept__adamw_k *k, char *err) {
    MOEPT__ENTER(c);
    const moept__cuda_spec *p = &c->sp;
    const int64_t n = p->n_params, D = p->D;
    const moept__q8w *w = c->q8w;
    MOEPT__TRY(moept__opt_ready(c, err));
    int64_t lo = n, hi = n; /* (the E4M3 copies' masters: [lo, hi), each set's W13 then W2) */
    for (int i = 0; i < 2 && moept__fp8_on(p); i++) {
        if (i == 0) lo = hi = w[0].off13;
        if (w[i].n == 0) continue;
        if (w[i].off13 != hi || w[i].off2 != hi + w[i].n * w[i].H * D)
            return moept__kfail(err, MOEPT_ERR_STATE, "moept_adamw_step: the expert weights are not one run "
                                "(moept_kernels.cu:%d)", __LINE__);
        hi = w[i].off2 + w[i].n * D * w[i].F;
    }
    MOEPT__STAGE("optimizer");
    moept__adamw_flat(c, k, 0, lo);
    moept__adamw_flat(c, k, hi, n);
    cudaError_t e = cudaGetLastError(); /* (a launch refused: none after it) */
    if (e == cudaSuccess && lo < hi) e = moept__q8_weights(c, k); /* (stepped as they are quantized) */
    MOEPT__STAGE(NULL);
    if (e != cudaSuccess)
        return moept__kfail(err, MOEPT_ERR_DEVICE, "moept_adamw_step: %s (moept_kernels.cu:%d)",
                            cudaGetErrorString(e), __LINE__);
    c->wlow_stale = 0;
    return MOEPT_OK;
}

/* The step with k computed on the device, nothing written (moept__k_adamw_probe;
   a host sync): bad, the first failing element * 4 + 1, 2, 3 for m, v, p, or -1;
   the new max |m| and max v. */
static moept_status moept__cuda_adamw_probe(moept__cuda *c, const moept__adamw_k *k, int64_t *bad,
                                            double *mmax, double *vmax, char *err) {
    MOEPT__ENTER(c);
    const int64_t n = c->sp.n_params;
    MOEPT__TRY(moept__opt_ready(c, err));
    unsigned long long *out = (unsigned long long *)c->gpart, *h = (unsigned long long *)c->h_gpart; /* [3] */
    const unsigned long long init[3] = {ULLONG_MAX, 0, 0};
    const int vec = moept__vec<float>(0, c->params, c->grads) && moept__vec<float>(0, c->opt_m, c->opt_v);
    const int V = vec ? MOEPT__VEC(float) : 1;
    MOEPT__STAGE("optimizer");
    MOEPT__TRY(moept__host_wait(c, err)); /* a pageable copy follows */
    MOEPT__CU(cudaMemcpyAsync(out, init, sizeof init, cudaMemcpyHostToDevice, c->s));
    MOEPT__LAUNCH_V(vec, moept__k_adamw_probe, float, moept__grid(n / V + n % V), MOEPT__TB, c->s, c->params,
                    c->grads, c->opt_m, c->opt_v, n, *k, out);
    MOEPT__LAUNCHED();
    MOEPT__CU(cudaMemcpyAsync(h, out, 3 * 8, cudaMemcpyDeviceToHost, c->s));
    MOEPT__TRY(moept__host_wait(c, err));
    MOEPT__STAGE(NULL);
    float f[2];
    for (int b = 0; b < 2; b++) {
        const uint32_t u = (uint32_t)h[1 + b];
        memcpy(&f[b], &u, 4);
    }
    *bad = h[0] == ULLONG_MAX ? -1 : (int64_t)h[0];
    *mmax = f[0];
    *vmax = f[1];
    return MOEPT_OK;
}

/* ---- resharding (moept_reshard) ---------------------------------------- */
/* before the agreement: one expert of staging */
static moept_status moept__cuda_reshard_prep(moept__cuda *c, int moments, int *nbuf, char *err) {
    MOEPT__ENTER(c);
    const moept__cuda_spec *p = &c->sp;
    *nbuf = moments && c->opt_m ? 3 : 1;
    if (!c->rs_stage)
        MOEPT__TRY(moept__dmalloc(c, (void **)&c->rs_stage, (size_t)(p->H * p->D + p->D * p->F) * 4, err));
    return MOEPT_OK;
}

/* expert-shaped buffer b (parameters, AdamW m, v) at local slot j: its w13
   [H][D] and w2 [D][F] rows */
static void moept__rs_parts(moept__cuda *c, int b, int64_t j, float **w13, float **w2) {
    const moept__cuda_spec *p = &c->sp;
    float *base = b == 0 ? c->params : b == 1 ? c->opt_m : c->opt_v;
    *w13 = base + p->off13 + j * p->H * p->D;
    *w2 = base + p->off2 + j * p->D * p->F;
}

/* the leaving experts' bytes to (dir 0) or from (dir 1) the host backup */
static moept_status moept__rs_backup(moept__cuda *c, const moept__cuda_moves *mv, float *backup, int dir,
                                     char *err) {
    const int64_t n13 = c->sp.H * c->sp.D, n2 = c->sp.D * c->sp.F;
    const int nb = c->rs_nbuf;
    MOEPT__TRY(moept__host_wait(c, err)); /* pageable copies follow */
    if (c->cs != c->s) { /* after the moves' copies on the comm's stream (an aborted comm's too: ended) */
        MOEPT__CU(cudaEventRecord(c->ev_comm, c->cs));
        MOEPT__CU(cudaStreamWaitEvent(c->s, c->ev_comm, 0));
    }
    for (int64_t k = 0; k < mv->n; k++)
        for (int b = 0; b < nb; b++) {
            float *w13, *w2, *h = backup + (k * nb + b) * (n13 + n2);
            moept__rs_parts(c, b, mv->slot[k], &w13, &w2);
            if (dir) {
                MOEPT__CU(cudaMemcpyAsync(w13, h, (size_t)n13 * 4, cudaMemcpyHostToDevice, c->s));
                MOEPT__CU(cudaMemcpyAsync(w2, h + n13, (size_t)n2 * 4, cudaMemcpyHostToDevice, c->s));
            } else {
                MOEPT__CU(cudaMemcpyAsync(h, w13, (size_t)n13 * 4, cudaMemcpyDeviceToHost, c->s));
                MOEPT__CU(cudaMemcpyAsync(h + n13, w2, (size_t)n2 * 4, cudaMemcpyDeviceToHost, c->s));
            }
        }
    return moept__host_wait(c, err);
}

/* As the CPU's rounds (moept__reshard_rounds): in round k, for each buffer,
   slot[k]'s expert goes to to[k] and from[k]'s arrives through the staging
   into that slot, over the EP comm's point-to-point call (device to device,
   only the moved experts); the copy out of the staging is queued on the
   comm's stream, so the next round's receive follows it. */
static moept_status moept__cuda_reshard_move(moept__cuda *c, const moept__cuda_moves *mv, float *backup,
                                             int *backed, int64_t *sent, int64_t *recvd, char *err) {
    MOEPT__ENTER(c);
    const int64_t n13 = c->sp.H * c->sp.D, n2 = c->sp.D * c->sp.F;
    const int nb = c->rs_nbuf;
    moept_comm *ep = c->sp.ep;
    MOEPT__TRY(moept__rs_backup(c, mv, backup, 0, err));
    *backed = 1;
    for (int64_t k = 0, i = 0; k < mv->rounds; k++) {
        const int idle = i >= mv->n || mv->round[i] != k; /* a call with nothing: a comm whose p2p is a
                                                             rendezvous of the group (threads) needs it */
        for (int b = 0; b < nb; b++) {
            float *w13 = NULL, *w2 = NULL;
            if (!idle) moept__rs_parts(c, b, mv->slot[i], &w13, &w2);
            moept_p2p s[2] = {{idle ? 0 : mv->to[i], w13, n13 * 4}, {idle ? 0 : mv->to[i], w2, n2 * 4}};
            moept_p2p r[2] = {{idle ? 0 : mv->from[i], c->rs_stage, n13 * 4},
                              {idle ? 0 : mv->from[i], c->rs_stage + n13, n2 * 4}};
            moept_status st = ep->p2p(ep, s, idle ? 0 : 2, r, idle ? 0 : 2);
            if (st) return moept__kfail(err, st, "round %lld: %s", (long long)k, ep->err);
            if (idle) continue;
            *sent += (n13 + n2) * 4;
            *recvd += (n13 + n2) * 4;
            const float *st13 = c->rs_stage, *st2 = c->rs_stage + n13;
            MOEPT__CU(cudaMemcpyAsync(w13, st13, (size_t)n13 * 4, cudaMemcpyDeviceToDevice, c->cs));
            MOEPT__CU(cudaMemcpyAsync(w2, st2, (size_t)n2 * 4, cudaMemcpyDeviceToDevice, c->cs));
        }
        i += !idle;
    }
    return moept__host_wait(c, err); /* moept.c then calls moept__cuda_params_changed */
}

static moept_status moept__cuda_reshard_undo(moept__cuda *c, const moept__cuda_moves *mv,
                                             const float *backup, char *err) {
    MOEPT__ENTER(c);
    return moept__rs_backup(c, mv, (float *)backup, 1, err);
}

static moept_status moept__cuda_reshard_commit(moept__cuda *c, const int32_t *slot_of, char *err) {
    MOEPT__ENTER(c);
    MOEPT__TRY(moept__host_wait(c, err)); /* a pageable copy follows */
    MOEPT__CU(cudaMemcpyAsync(c->slot_of, slot_of, (size_t)c->sp.E * 4, cudaMemcpyHostToDevice, c->s));
    if (c->grads) /* (an inference layer has none) */
        MOEPT__CU(cudaMemsetAsync(c->grads, 0, (size_t)c->sp.n_params * 4, c->s)); /* the dx check stays */
    c->grads_clean = 0;
    for (int s = 0; s <= c->nslots; s++) c->slots[s].fwd_valid = 0; /* their plans: the old placement */
    return moept__host_wait(c, err);
}

/* moept.c's moept__stale_forwards: every slot's pending backward refused */
static void moept__cuda_stale_forwards(moept__cuda *c, const char *call) {
    for (int s = 0; s <= c->nslots; s++) c->slots[s].fwd_stale = call;
}

static void moept__cuda_reshard_end(moept__cuda *c) {
    if (!c->rs_stage) return;
    moept__on_device on(c->dev, c->probe);
    (void)cudaFree(c->rs_stage);
    c->allocated_bytes -= (c->sp.H * c->sp.D + c->sp.D * c->sp.F) * 4;
    c->rs_stage = NULL;
}

/* ------------------------------------------------------------------------
   The executor table: the layer (moept.c) calls these. They see the layer
   through moept__view_of and report to it through moept.c's moept__dev_*
   calls (moept.h's internal part), and keep their own state beside it.
   ------------------------------------------------------------------------ */

/* the layer's view and this executor's state (the one CUDA layer struct) */
static moept__cuda *moept__cx(moept_layer *L, moept__view *v) {
    moept__view_of(L, v);
    return (moept__cuda *)*v->xstate;
}

static moept_status moept__cuda_layer_io(moept_layer *L, int which, int64_t off, int64_t n, float *h,
                                         int write) {
    moept__view v;
    return moept__cuda_io(moept__cx(L, &v), which, off, n, h, write, moept__errbuf());
}

static moept_status moept__cuda_layer_tables(moept_layer *L) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    return moept__cuda_tables(c, v.bias, v.slot_of, moept__errbuf());
}

/* what the device executor holds now, into the layer's statistics */
static void moept__cuda_held(moept_layer *L) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    int64_t a = 0, b = 0, dev[MOEPT_MEM_NKINDS], host = 0;
    moept__cuda_sizes(c, &a, &b, dev, &host); /* (host: this state too) */
    moept__dev_held(L, a, b, dev, host);
}

/* sync-free: the last forward's device statistics, read now (a host sync) */
static moept_status moept__cuda_settle(moept_layer *L) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    if (!c->stats_pending) return MOEPT_OK;
    moept__dev_step r;
    memset(&r, 0, sizeof r);
    moept_status st = moept__cuda_step_stats(c, v.lstat, v.peer_rows, &r, moept__errbuf());
    if (st) return st;
    c->stats_pending = 0;
    moept__dev_step_done(L, &r);
    return MOEPT_OK;
}

static moept_status moept__cuda_layer_forward(moept_layer *L, moept__fstep *f) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    moept_status st;
    moept__dev_step r;
    memset(&r, 0, sizeof r);
    /* the slot in the tag's high half (0: an evaluation), agreed with the call (unsigned: an
       out-of-range slot is refused, agreed) */
    r.tag = moept__call_tag(L, MOEPT__CALL_FORWARD) |
            (int64_t)((uint64_t)(f->eval ? 0u : (uint32_t)f->slot + 1u) << 32);
    r.f = f; /* (replay ids, mask: device memory, checked there, agreed with the executor's checks) */
    r.reject = f->reject; /* agreed in the executor's count exchange, as its own checks */
    r.reject_msg = f->reject ? f->reject_why : NULL;
    st = moept__cuda_forward(c, f->x, f->T, f->y, v.lstat, v.peer_rows, &r, moept__errbuf());
    moept__dev_agreed(L, r.agreed);
    moept__cuda_held(L); /* a failed forward's too: a slot it made stays */
    /* sync-free: a rank's own rejection fails its call alone and its peers
       go on, so it counts the forward as they do: the ranks' noise keys stay alike */
    if (st && r.agreed && c->sp.sync_free) moept__dev_count_jitter(L, f->jitter);
    if (st) return st;
    c->routing_on_host = 0;
    c->last_slot = r.slot; /* its backward's gradients are moept_routing_grads' */
    c->stats_pending = r.deferred; /* sync-free: read when asked for (moept__cuda_settle) */
    moept__dev_forward_done(L, &r);
    return MOEPT_OK;
}

static moept_status moept__cuda_layer_backward(moept_layer *L, const float *x, const float *dy, float *dx,
                                           const moept_backward_opts *o) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    moept_status st;
    moept__dev_step r;
    memset(&r, 0, sizeof r);
    r.tag = moept__call_tag(L, MOEPT__CALL_BACKWARD);
    char why[MOEPT__ERRLEN];
    if (o->slot < 0 || o->slot >= v.nslots) { /* (the slot's own state: the executor's checks) */
        snprintf(why, sizeof why, "moept_backward: opts.slot %d is not in 0..max_inflight-1 (%d)", o->slot,
                 v.nslots - 1);
        r.reject = MOEPT_ERR_INVALID_ARGUMENT;
        r.reject_msg = why;
    } else if (!moept__finite(o->router_loss_scale)) {
        r.reject = MOEPT_ERR_INVALID_ARGUMENT;
        r.reject_msg = "moept_backward: opts.router_loss_scale is not finite";
    }
    r.router_loss_scale = o->router_loss_scale;
    r.dlogits = o->dlogits; /* device memory, as x */
    r.slot = o->slot;
    st = moept__cuda_backward(c, x, dy, dx, &r, moept__errbuf());
    moept__dev_agreed(L, r.agreed);
    moept__cuda_held(L);
    if (st) return st;
    moept__dev_backward_done(L, &r, o->slot == c->last_slot); /* the last forward's: its routing grads */
    c->dx_pending = 1;
    return MOEPT_OK;
}

/* router and shared expert over EP, then everything over DP, on the device */
static moept_status moept__cuda_layer_sync_grads(moept_layer *L, float scale) {
    moept__view v;
    return moept__cuda_sync_grads(moept__cx(L, &v), scale, moept__errbuf());
}

/* s NULL: the executor may keep what a scan of the same gradients found */
static moept_status moept__cuda_layer_grad_scan(moept_layer *L, double *s, int64_t *bad) {
    moept__view v;
    return moept__cuda_grad_scan(moept__cx(L, &v), s, bad, moept__errbuf());
}

/* the step on the device (its parameters, moments and bf16 weights), where
   the gradients are; nothing crosses to the host */
static moept_status moept__cuda_layer_adamw(moept_layer *L, moept__adamw_k k) {
    moept__view v;
    return moept__cuda_adamw(moept__cx(L, &v), &k, moept__errbuf());
}

/* before the step's agreement (and a load's): the moments, so a rank out of memory fails every rank */
static moept_status moept__cuda_layer_adamw_ready(moept_layer *L) {
    moept__view v;
    const moept_status st = moept__opt_ready(moept__cx(L, &v), moept__errbuf());
    moept__cuda_held(L); /* (the moments' bytes) */
    return st;
}

static moept_status moept__cuda_layer_adamw_probe(moept_layer *L, moept__adamw_k k, int64_t *bad,
                                                 double *mmax, double *vmax) {
    moept__view v;
    return moept__cuda_adamw_probe(moept__cx(L, &v), &k, bad, mmax, vmax, moept__errbuf());
}

static void moept__cuda_layer_stale(moept_layer *L, const char *call) {
    moept__view v;
    moept__cuda_stale_forwards(moept__cx(L, &v), call);
}

static moept_status moept__cuda_layer_zero_grad(moept_layer *L) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    moept_status st = moept__cuda_zero_grad(c, moept__errbuf()); /* its dx check reset with them */
    if (st) return st;
    c->dx_pending = 0;
    return MOEPT_OK;
}

/* the device's dx check of the backwards since zero_grad (and, sync-free,
   its other checks), read without a sync at the backward */
static moept_status moept__cuda_grads_check(moept_layer *L) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    if (!c->dx_pending && !c->sp.sync_free) return MOEPT_OK;
    int64_t bad = -1, dl_bad = -1;
    char why[MOEPT__ERRLEN];
    moept_status why_st = MOEPT_OK;
    moept_status st = moept__cuda_dx_check(c, &bad, &dl_bad, &why_st, why, moept__errbuf());
    if (st) return st;
    c->dx_pending = 0;
    moept__dev_grads_bad(L, bad, dl_bad, why_st, why);
    return MOEPT_OK;
}

static moept_status moept__cuda_routing(moept_layer *L, int dweights) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    if (dweights) return moept__cuda_download_routing(c, NULL, NULL, NULL, v.dwts, moept__errbuf());
    if (c->routing_on_host) return MOEPT_OK;
    moept_status st = moept__cuda_download_routing(c, v.ids, v.wts, v.logits, NULL, moept__errbuf());
    if (!st) c->routing_on_host = 1;
    return st;
}

static moept_status moept__cuda_device_params(moept_layer *L, float **params, float **grads) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    moept__cuda_pointers(c, params, grads);
    moept__cuda_params_changed(c); /* the caller may write them */
    return MOEPT_OK;
}

static moept_status moept__cuda_layer_params_changed(moept_layer *L) {
    moept__view v;
    moept__cuda_params_changed(moept__cx(L, &v));
    return MOEPT_OK;
}

/* moept_reshard, before the agreement: the deferred statistics read,
   one expert of device staging, and this rank's moves with a host backup
   of the experts it sends */
static moept_status moept__cuda_layer_reshard_ready(moept_layer *L, const moept__moves *mv) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    const int64_t P = v.P, me = v.rank, n = mv->n, part = v.H * v.D + v.D * v.F;
    moept_status st = moept__cuda_settle(L);
    if (!st) st = moept__cuda_reshard_prep(c, v.moments, &c->rs_nbuf, moept__errbuf());
    if (st) return moept__fail(L, st, "moept_reshard: %s", moept__errbuf());
    c->rs_slot = (int64_t *)malloc((size_t)(3 * (n > 0 ? n : 1)) * sizeof(int64_t));
    c->rs_backup = (float *)malloc((size_t)(n * c->rs_nbuf * part > 0 ? n * c->rs_nbuf * part : 1) *
                                   sizeof(float));
    if (!c->rs_slot || !c->rs_backup) return moept__fail(L, MOEPT_ERR_OUT_OF_MEMORY, "moept_reshard: out of "
                                                         "host memory (a backup of the experts it sends)");
    int32_t *to = (int32_t *)(c->rs_slot + 2 * n), *from = to + n;
    for (int64_t k = 0, i = 0; k < mv->rounds; k++) {
        const int32_t go = mv->go[k * P + me], come = mv->come[k * P + me];
        if (go < 0) continue;
        c->rs_slot[n + i] = k;
        c->rs_slot[i] = v.slot_of[go] % v.El;
        to[i] = mv->new_rank[go];
        from[i++] = (int32_t)(v.slot_of[come] / v.El);
    }
    return MOEPT_OK;
}

/* the moves, then every rank's verdict: all keep them (the new placement on
   the device, gradients zeroed), or all put their experts back */
static moept_status moept__cuda_reshard_run(moept_layer *L, const moept__moves *mv, int64_t *sent,
                                        int64_t *recvd) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    const int64_t n = mv->n;
    const int32_t *to = (const int32_t *)(c->rs_slot + 2 * n);
    const moept__cuda_moves cm = {n, mv->rounds, to, to + n, c->rs_slot, c->rs_slot + n};
    int backed = 0;
    moept_status st = moept__cuda_reshard_move(c, &cm, c->rs_backup, &backed, sent, recvd,
                                               moept__errbuf()), ast;
    if (st) moept__fail(L, st, "moept_reshard: %s", moept__errbuf());
    int64_t failed = st != MOEPT_OK;
    moept_comm *bad = NULL;
    ast = moept__sum_ep_dp(v.ep, v.dp, &failed, 1, MOEPT_DTYPE_I64, &bad);
    if (!st && !ast && !failed) {
        st = moept__cuda_reshard_commit(c, mv->nslot, moept__errbuf());
        moept__cuda_params_changed(c);
        return st;
    }
    if (!st && ast) st = moept__fail(L, ast, "moept_reshard: the agreement after the moves failed (every "
                                     "rank's experts put back): %s", bad->err);
    else if (!st) st = moept__fail(L, MOEPT_ERR_STATE, "moept_reshard: %lld other rank(s) failed to move "
                                   "their experts; every rank's experts put back", (long long)failed);
    char keep[MOEPT__ERRLEN];
    memcpy(keep, moept__errbuf(), sizeof keep);
    moept_status ust = backed ? moept__cuda_reshard_undo(c, &cm, c->rs_backup, moept__errbuf()) : MOEPT_OK;
    moept__cuda_params_changed(c);
    if (ust) return moept__fail(L, ust, "moept_reshard: putting this rank's experts back failed: %s",
                                moept__errbuf());
    memcpy(moept__errbuf(), keep, sizeof keep);
    return st;
}

/* moept_reshard after its agreement: the moves (agreed), the resources freed */
static moept_status moept__cuda_layer_reshard(moept_layer *L, const moept__moves *mv, int agreed,
                                          int64_t *sent, int64_t *recvd) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    moept_status st = agreed ? moept__cuda_reshard_run(L, mv, sent, recvd) : MOEPT_OK;
    moept__cuda_reshard_end(c);
    moept__cuda_held(L); /* (the staging's allocation) */
    free(c->rs_slot);
    free(c->rs_backup);
    c->rs_slot = NULL;
    c->rs_backup = NULL;
    return st;
}

static void moept__cuda_layer_destroy(moept_layer *L) {
    moept__view v;
    moept__cuda *c = moept__cx(L, &v);
    if (!c) return;
    moept__cuda_destroy(c); /* (frees c) */
    *v.xstate = NULL;
}

static moept__exec moept__cuda_exec_make(void) {
    moept__exec e;
    memset(&e, 0, sizeof e);
    e.name = "the CUDA executor";
    e.caps = MOEPT__CAN_INFERENCE | MOEPT__CAN_DEVICE | MOEPT__CAN_JITTER | MOEPT__CAN_AUX_SEQ |
             MOEPT__CAN_MASK | MOEPT__CAN_RESHARD | MOEPT__CAN_FP8;
    e.forward = moept__cuda_layer_forward;
    e.backward = moept__cuda_layer_backward;
    e.sync_grads = moept__cuda_layer_sync_grads;
    e.grad_scan = moept__cuda_layer_grad_scan;
    e.adamw = moept__cuda_layer_adamw;
    e.adamw_probe = moept__cuda_layer_adamw_probe;
    e.stale_forwards = moept__cuda_layer_stale;
    e.zero_grad = moept__cuda_layer_zero_grad;
    e.grads_check = moept__cuda_grads_check;
    e.settle = moept__cuda_settle;
    e.routing = moept__cuda_routing;
    e.io = moept__cuda_layer_io;
    e.tables = moept__cuda_layer_tables;
    e.adamw_ready = moept__cuda_layer_adamw_ready;
    e.device_params = moept__cuda_device_params;
    e.params_changed = moept__cuda_layer_params_changed;
    e.reshard_ready = moept__cuda_layer_reshard_ready;
    e.reshard = moept__cuda_layer_reshard;
    e.destroy = moept__cuda_layer_destroy;
    return e;
}
/* the table (C++ has no designated initializers before C++20: filled once, at load) */
static const moept__exec moept__cuda_exec = moept__cuda_exec_make();

/* ------------------------------------------------------------------------
   moept_create_cuda
   ------------------------------------------------------------------------ */
/* create_cuda, 1: this rank's options (the config's features come from the
   executor's capability bits in moept__create) */
static int moept__cuda_options_bad(const moept_config *cfg, moept_comm *ep, moept_comm *dp,
                               const moept_cuda_options *o, char *why, moept_status *why_st) {
    *why_st = MOEPT_ERR_INVALID_ARGUMENT; /* no device: MOEPT_ERR_DEVICE, a caller falls back by it */
    const char *w = NULL;
    static_assert(sizeof o->dtype == sizeof(int) && sizeof o->gemm_form == sizeof(int), "C's enums are ints");
    int dt, gf; /* the ints a C caller stored (in C++ an enum load outside its values is undefined) */
    memcpy(&dt, &o->dtype, sizeof dt);
    memcpy(&gf, &o->gemm_form, sizeof gf);
    if (dt != MOEPT_DTYPE_F32 && dt != MOEPT_DTYPE_BF16)
        w = "options.dtype must be MOEPT_DTYPE_F32 or MOEPT_DTYPE_BF16";
    else if (gf < MOEPT_GEMM_AUTO || gf > MOEPT_GEMM_KERNEL)
        w = "options.gemm_form must be a moept_gemm_form";
    else if (moept_cuda_device_count() < 1) {
        *why_st = MOEPT_ERR_DEVICE;
        w = "no CUDA device";
    } else if (cfg && o->sync_free && cfg->overlap_chunks > 1) {
        *why_st = MOEPT_ERR_UNSUPPORTED;
        w = "options.sync_free with overlap_chunks > 1 is not supported";
    } else if ((ep && !moept__is_dcomm(ep)) || (dp && !moept__is_dcomm(dp))) /* size 1 too */
        w = moept__dcomm_only;
    if (w) snprintf(why, MOEPT__ERRLEN, "moept_create_cuda: %s", w);
    return w != NULL;
}

/* create_cuda, 2: every rank runs the same executor options (a rank that
   skips the backward's agreement would leave the others waiting); sync-free
   blocks are the same size everywhere, from the EP group's largest max_tokens */
static moept_status moept__cuda_options_agree(moept_comm *ep, moept_comm *dp, const moept_cuda_options *o,
                                          const moept_config *cfg, int64_t *block_tokens) {
    int64_t mine[3] = {(int64_t)o->dtype, o->unchecked_backward != 0, o->sync_free != 0};
    int64_t sum[3] = {mine[0], mine[1], mine[2]};
    int64_t ranks = (ep ? ep->size : 1) * (dp ? dp->size : 1);
    moept_comm *bad = NULL;
    moept_status st = moept__sum_ep_dp(ep, dp, sum, 3, MOEPT_DTYPE_I64, &bad);
    if (st) return moept__thread_fail(st, "moept_create_cuda: option agreement failed: %s", bad->err);
    for (int i = 0; i < 3; i++)
        if (sum[i] != mine[i] * ranks)
            return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_create_cuda: options.%s differs "
                                      "between ranks", i == 0 ? "dtype" : i == 1 ? "unchecked_backward"
                                                                                 : "sync_free");
    *block_tokens = cfg ? cfg->max_tokens : 0;
    if (!o->sync_free || !ep || ep->size == 1) return MOEPT_OK;
    if ((st = moept__group_max(ep, *block_tokens, block_tokens)))
        return moept__thread_fail(st, "moept_create_cuda: max_tokens agreement failed: %s", ep->err);
    return MOEPT_OK;
}

/* create_cuda, 3: what the device executor is told of the layer: its view, less the host buffers
   and moments, which move between calls (each call reads them from its own view), and the options */
static void moept__cuda_spec_of(moept_layer *L, const moept_cuda_options *o, int64_t block_tokens,
                            moept__cuda_spec *sp) {
    memset(sp, 0, sizeof *sp);
    moept__view_of(L, sp);
    sp->moments = 0;
    sp->bias = sp->wts = sp->logits = sp->dwts = NULL;
    sp->slot_of = sp->ids = NULL;
    sp->lstat = NULL; sp->peer_rows = NULL;
    sp->dtype = (int)o->dtype; sp->unchecked_backward = o->unchecked_backward != 0;
    sp->sync_free = o->sync_free != 0;
    sp->gemm_form = (int)o->gemm_form; /* a rank's own choice: its GEMMs are local */
    sp->block_tokens = block_tokens;
    sp->stream = o->stream;
}

/* create_cuda, 4: the device executor set up (zero parameters) and the tables copied,
   agreed (a rank whose device failed fails every rank) */
static moept_status moept__cuda_start(moept_layer *L, const moept_cuda_options *o, int64_t block_tokens,
                                  moept_comm *ep, moept_comm *dp) {
    moept__cuda_spec sp;
    moept__cuda_spec_of(L, o, block_tokens, &sp);
    moept__view v;
    moept__view_of(L, &v);
    char err[MOEPT__ERRLEN] = "";
    moept__cuda *c = NULL;
    moept_status st = moept__cuda_create(&sp, &c, err); /* zero parameters, as a CPU layer's */
    *v.xstate = c;
    if (!st && (st = moept__cuda_layer_tables(L))) memcpy(err, moept__errbuf(), sizeof err);
    if (!st) moept__cuda_held(L);
    moept_status ast; /* the agreement's own status: this rank's st is kept */
    int64_t failed = moept__any_failed(ep, dp, st != MOEPT_OK, &ast);
    if (st) return moept__thread_fail(st, "%s", err);
    if (ast) return moept__thread_fail(ast, "moept_create_cuda: failure agreement failed");
    if (failed)
        return moept__thread_fail(MOEPT_ERR_DEVICE,
                                  "moept_create_cuda: another rank failed to set up "
                                  "its device");
    return MOEPT_OK;
}

extern "C" moept_status moept_create_cuda(const moept_config *cfg, moept_comm *ep, moept_comm *dp,
                                          const moept_cuda_options *opt, moept_layer **out) {
    if (!out) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_create_cuda: out is NULL");
    *out = NULL;
    moept_cuda_options o;
    memset(&o, 0, sizeof o);
    if (opt) o = *opt;
    /* this rank's checks, agreed before the collective create */
    char why[MOEPT__ERRLEN] = "";
    moept_status why_st, st;
    int bad = moept__cuda_options_bad(cfg, ep, dp, &o, why, &why_st);
    int64_t failed = moept__any_failed(ep, dp, bad, &st);
    if (st) return moept__thread_fail(st, "moept_create_cuda: failure agreement failed");
    if (bad) return moept__thread_fail(why_st, "%s", why);
    if (failed)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT,
                                  "moept_create_cuda: another rank's options were "
                                  "rejected");
    int64_t block_tokens;
    if ((st = moept__cuda_options_agree(ep, dp, &o, cfg, &block_tokens))) return st;
    moept_layer *L = NULL;
    if ((st = moept__create(cfg, ep, dp, &moept__cuda_exec, "moept_create_cuda", &L))) return st;
    if ((st = moept__cuda_start(L, &o, block_tokens, ep, dp))) {
        char keep[MOEPT__ERRLEN];
        memcpy(keep, moept__errbuf(), sizeof keep);
        moept_destroy(L);
        memcpy(moept__errbuf(), keep, sizeof keep);
        return st;
    }
    *out = L;
    return MOEPT_OK;
}

extern "C" int moept_cuda_device_count(void) { return moept__cuda_device_count(); }
