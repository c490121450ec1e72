/* Helpers of the tests built for both executors (test_slots, test_router_io):
   include after testutil.h. */
#ifndef MOEPT_TU_EXEC_H
#define MOEPT_TU_EXEC_H
/* Tests built for both executors: CPU layers over the threads backend, and
   (built with MOEPT_CUDA) CUDA layers on the emulated GPU, rank r on device
   r over NCCL. The buffers a layer reads and writes live on its side. */
#ifdef MOEPT_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#define TU_GPU 1
static inline ncclUniqueId *tu_nccl_id(void) { static ncclUniqueId id; return &id; }
#else
#define TU_GPU 0
#endif
/* a new NCCL world for the next tu_ranks (CPU: nothing to make) */
static inline void tu_new_world(void) {
#ifdef MOEPT_CUDA
    ncclGetUniqueId(tu_nccl_id());
#endif
}
/* fn on P ranks in a new world (tu_ranks_from: each job a copy of *proto, or
   zeroed where proto is NULL; a thread group at P > 1, which CUDA layers do
   not use: they meet over NCCL) */
static inline void tu_world_ranks(int P, void *(*fn)(void *), void *jobs, size_t job_size,
                                  const void *proto) {
    tu_new_world();
    tu_ranks_from(P, 20000, fn, jobs, job_size, proto);
}
typedef struct tu_ep { moept_comm *c; void *nc, *stream; } tu_ep;
/* rank r's EP comm of P ranks (NULL at P = 1), and its device */
static inline moept_comm *tu_ep_open(tu_ep *e, moept_thread_group *g, int P, int r) {
    memset(e, 0, sizeof *e);
#ifdef MOEPT_CUDA
    (void)g;
    cudaSetDevice(r);
    if (P > 1) {
        cudaStream_t s;
        ncclComm_t nc;
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        ncclCommInitRank(&nc, P, *tu_nccl_id(), r);
        e->stream = s; e->nc = nc;
        moept_comm_nccl(nc, s, 20000, &e->c);
    }
#else
    if (P > 1) moept_comm_threads(g, r, &e->c);
#endif
    return e->c;
}
static inline void tu_ep_close(tu_ep *e) {
    moept_comm_destroy(e->c);
#ifdef MOEPT_CUDA
    if (e->nc) { ncclCommDestroy((ncclComm_t)e->nc); cudaStreamDestroy((cudaStream_t)e->stream); }
#endif
}
#ifdef MOEPT_CUDA
/* An FP8 layer in the kernel GEMM form (bf16 rows), as a test makes one: *why this GPU refuses it at
   create (compute capability 9.0, cuBLAS 12.9 and sm_90a code), or "" where it runs; the emulated GPU
   answers 9.0 until tu_cc_restore (MOEPT_EMU_CC; a value set before kept in was) */
typedef struct tu_cc { char was[16], why[300]; } tu_cc;
static inline int tu_fp8_kernel(tu_cc *k) {
    const char *v = getenv("MOEPT_EMU_CC");
    snprintf(k->was, sizeof k->was, "%s", v ? v : "");
    setenv("MOEPT_EMU_CC", "90", 1);
    moept_config c;
    memset(&c, 0, sizeof c);
    c.family = MOEPT_FAMILY_MIXTRAL; c.hidden_size = 16; c.intermediate_size = 128; c.num_experts = 4;
    c.top_k = 2; c.max_tokens = 8; c.fp8 = MOEPT_FP8_BLOCKWISE;
    const moept_cuda_options o = {MOEPT_DTYPE_BF16, NULL, 0, 0, MOEPT_GEMM_KERNEL};
    moept_layer *L = NULL;
    const moept_status st = moept_create_cuda(&c, NULL, NULL, &o, &L);
    snprintf(k->why, sizeof k->why, "%s", st == MOEPT_ERR_UNSUPPORTED ? moept_last_error(NULL) : "");
    moept_destroy(L);
    return k->why[0] == 0;
}
static inline void tu_cc_restore(const tu_cc *k) {
    if (k->was[0]) setenv("MOEPT_EMU_CC", k->was, 1);
    else unsetenv("MOEPT_EMU_CC");
}
#endif
/* a layer of this build's executor (GPU: fp32, or sync-free) */
static inline moept_status tu_layer(const moept_config *c, moept_comm *ep, int sync_free, moept_layer **L) {
#ifdef MOEPT_CUDA
    moept_cuda_options o = {MOEPT_DTYPE_F32, NULL, 0, sync_free, MOEPT_GEMM_AUTO};
    return moept_create_cuda(c, ep, NULL, &o, L);
#else
    (void)sync_free;
    return moept_create_parallel(c, ep, NULL, L);
#endif
}
/* a copy of h (NULL: zeros) where the layer reads it; back; freed */
static inline void *tu_dev(const void *h, size_t bytes) {
#ifdef MOEPT_CUDA
    void *d = NULL;
    if (cudaMalloc(&d, bytes + 4) != cudaSuccess) return NULL;
    if (h) cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    else cudaMemset(d, 0, bytes + 4);
    return d;
#else
    void *d = calloc(1, bytes + 4);
    if (h && d) memcpy(d, h, bytes);
    return d;
#endif
}
static inline void tu_to_dev(void *d, const void *h, size_t bytes) {
#ifdef MOEPT_CUDA
    cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
#else
    memcpy(d, h, bytes);
#endif
}
static inline void tu_to_host(void *h, const void *d, size_t bytes) {
#ifdef MOEPT_CUDA
    cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost);
#else
    memcpy(h, d, bytes);
#endif
}
static inline void tu_dev_free(void *d) {
#ifdef MOEPT_CUDA
    cudaFree(d);
#else
    free(d);
#endif
}
#endif
