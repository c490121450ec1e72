/* emu.h - the emulator's test interface (C and C++). Only tests/ use it. */
#ifndef MOEPT_EMU_H
#define MOEPT_EMU_H
#ifdef __cplusplus
extern "C" {
#endif
/* Reports so far (every checker); each is also printed "moept-emu: ..." */
long moept_emu_reports(void);
/* The reports since the last take, and forgets them: a test that broke
   something on purpose takes what it expected; an untaken report makes the
   process exit nonzero at exit. The text of the last one goes to buf. */
long moept_emu_take_reports(char *buf, int len);
/* Fault injection: the n-th cudaMalloc from now (1 = the next) on the
   caller's current device fails with cudaErrorMemoryAllocation (other
   devices, i.e. other ranks, are not counted); 0 disarms. */
void moept_emu_fail_malloc(int n);
/* The emulated NCCL waits for an absent peer for ever, as NCCL does (a
   "hang" report after MOEPT_EMU_HANG_S seconds, default 120, ends the
   process). With ms > 0, a peer absent that long is instead an injected
   transport failure: the op ends and the communicator's asynchronous error
   is ncclRemoteError, as after a network error. 0 turns it off. */
void moept_emu_nccl_inject_error(int ms);
/* Fault injection: the n-th point-to-point op (an outermost ncclGroupEnd's
   sends and receives) enqueued from now for the caller's current device
   fails as after a network error: it moves nothing, and its communicator's
   asynchronous error is ncclRemoteError. 0 disarms. */
void moept_emu_nccl_fail_p2p(int n);
/* The emulated NCCL's version (ncclGetVersion, and the rules that depend on
   it) as if another libnccl were loaded, e.g. 23007 for 2.30.7; 0 restores
   the headers' NCCL_VERSION_CODE. */
void moept_emu_nccl_version(int code);
/* Fault injection: the next kernel launched on device dev (from now) faults
   when it runs, as one that touched an illegal address: a "context" report
   (take it), and the device's context is lost (cudaErrorIllegalAddress).
   A kernel's own out-of-bounds or misaligned access (memcheck) loses it too. */
void moept_emu_fault_next_kernel(int dev);
/* Test only, after a lost context: what ending the process and starting a
   new one would give device dev (no CUDA call recovers a sticky error): a
   new context, its allocations, streams and pinned host blocks gone (every
   handle of the old one is invalid), no error (nor the calling thread's
   last error). Call it once nothing uses the device any more. */
void moept_emu_recover(int dev);
/* 1 when device memory is guarded per thread (x86 protection keys: only a
   worker running one of the device's ops may touch it, so a host read while
   another op of the device runs faults too); 0 when only per process (the
   pages are PROT_NONE while no op of the device runs). */
int moept_emu_per_thread_guard(void);
/* Kernel launches queued so far (every device) whose kernel expression, as
   written at the launch (e.g. "moept__k_cast<moept__bf16>"), contains part. */
long moept_emu_launches(const char *part);
/* ---- counts: what the executor's work costs, per device and stage ----
   The executor names its stage (MOEPT__STAGE in moept_kernels.cu) on the
   calling host thread; every op enqueued after it, and every host wait
   there, is counted under it until the next name (NULL: "other"). An op's
   counts land when it completes: synchronise before reading them. */
typedef struct moept_emu_counts {
    long kernels, blas, comms, copies; /* ops run: kernel launches, cuBLAS calls, NCCL ops, copies, memsets */
    long syncs;                        /* host waits: cudaStream/Device/EventSynchronize, cudaMemcpy, cudaFree */
    /* device bytes read and written, each byte once per op (the traffic of
       an op that caches what it touched; a byte it wrote reads for free) */
    long long kread, kwrite;           /* kernels */
    long long cread, cwrite;           /* copies and memsets (device side only) */
    long long gread, gwrite;           /* cuBLAS calls (C read if beta != 0) */
    long long nread, nwrite;           /* NCCL ops: sent, received */
    long long kaccess;                 /* kernels' bytes accessed, every access counted (issue, not traffic) */
    long long kops;                    /* kernels' device memory accesses (kaccess / kops: bytes per access) */
    long blas_streams;                 /* distinct streams its cuBLAS calls ran on */
} moept_emu_counts;
void moept_emu_stage(const char *name);
/* The sums for device dev under stage (NULL: every stage) since the last reset */
void moept_emu_counts_get(int dev, const char *stage, moept_emu_counts *out);
void moept_emu_counts_reset(void);
/* the bytes kernels whose names have part (NULL: every kernel) stored since the last reset that their
   launch had stored already (on any device; a byte a launch stores twice, which no result shows) */
long long moept_emu_stored_again(const char *part);
/* ---- cuBLAS ----
   Reductions in the output type where the math mode allows them (no
   CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION, computeType
   CUBLAS_COMPUTE_32F, a C type narrower than fp32): k is summed in fp32 in
   chunks of kchunk, each chunk's sum rounded to C's type and the chunks added
   in C's type (a split-K reduction in the output type). 0 (the default) turns
   it off; MOEPT_EMU_BLAS_REDUCED_REDUCTION=kchunk in the environment sets it
   for a whole run. */
void moept_emu_blas_reduced_reduction(int kchunk);
/* Live cuBLAS handles created on device dev; *no_ws (if not NULL): how many
   have no cublasSetWorkspace in effect */
int moept_emu_blas_handles(int dev, int *no_ws);
/* Device memory held now by live cudaMalloc allocations of device dev */
long long moept_emu_device_bytes(int dev);
#ifdef __cplusplus
}
#endif
#endif
