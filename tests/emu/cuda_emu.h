/* cuda_emu.h - force-included (g++ -include) into moept_kernels.cu for the
   emulated build: the CUDA device language on the host compiler.

   Kernels run on the CPU, one block at a time, each CUDA thread a fiber;
   __syncthreads() is a real barrier of the block's fibers. __shared__
   variables are static storage (one block runs at a time); the emulator
   takes a kernel's accesses to static storage as shared memory and checks
   them for races and for reads before a write in the block. Launches go through
   MOEPT__LAUNCH, the one emulator hook in moept_kernels.cu. */
#ifndef MOEPT_CUDA_EMU_KERNELS_H
#define MOEPT_CUDA_EMU_KERNELS_H
#ifdef __cplusplus
#define __shared__ static
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <tuple>
#include <utility>

uint3 moept_emu_thread_idx(void);
uint3 moept_emu_block_idx(void);
dim3 moept_emu_block_dim(void);
dim3 moept_emu_grid_dim(void);
void moept_emu_syncthreads(int line);

#define threadIdx (moept_emu_thread_idx())
#define blockIdx (moept_emu_block_idx())
#define blockDim (moept_emu_block_dim())
#define gridDim (moept_emu_grid_dim())
#define __syncthreads() moept_emu_syncthreads(__LINE__)

/* atomics: the blocks of a launch run one at a time and a block's threads
   switch only at barriers, so a read-modify-write is atomic as written.
   Each returns the old value and stores the new one (CUDA C++ Programming
   Guide, "Atomic Functions": atomicMin, atomicMax, atomicAdd) */
static inline unsigned long long atomicMin(unsigned long long *p, unsigned long long v) {
    unsigned long long o = *p;
    if (v < o) *p = v;
    return o;
}
static inline unsigned long long atomicMax(unsigned long long *p, unsigned long long v) {
    unsigned long long o = *p;
    if (v > o) *p = v;
    return o;
}
static inline int atomicAdd(int *p, int v) { int o = *p; *p = o + v; return o; }
static inline float atomicAdd(float *p, float v) { float o = *p; *p = o + v; return o; }
static inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    unsigned long long o = *p;
    *p = o + v;
    return o;
}

/* The launch: the arguments are converted to the kernel's parameter types
   now (as <<<>>> does) and copied with the kernel's address into a blob the
   op keeps; each thread gets its own copy of the blob on its stack (kernel
   parameters are trivially copyable), so reading them is a stack access. */
void moept_emu_launch(const char *name, const void *func, dim3 g, dim3 b, size_t smem, cudaStream_t s,
                      const void *blob, size_t n, void (*invoke)(void *));
template <typename... P>
struct moept_emu_launcher {
    void (*k)(P...);
    dim3 g, b;
    size_t smem;
    cudaStream_t s;
    const char *name;
    struct blob {
        void (*k)(P...);
        std::tuple<P...> a;
    };
    static void invoke(void *p) { std::apply(((blob *)p)->k, ((blob *)p)->a); }
    void operator()(P... a) const { /* by the kernel's own parameter types, as a call */
        blob bl{k, std::tuple<P...>(a...)};
        moept_emu_launch(name, reinterpret_cast<const void *>(k), g, b, smem, s, &bl, sizeof bl, invoke);
    }
};
template <typename... P>
moept_emu_launcher<P...> moept_emu_kernel(void (*k)(P...), dim3 g, dim3 b, size_t smem, cudaStream_t s,
                                          const char *name) {
    return moept_emu_launcher<P...>{k, g, b, smem, s, name};
}
#define MOEPT__LAUNCH(k, g, b, smem, s) moept_emu_kernel(k, g, b, smem, s, #k)
/* ---- sm_89's FP8 conversions (PTX ISA, cvt): tests/emu/emu_kernel.cc ----
   the compute capability the launch's device answered (10 major + minor): the binary nvcc would run */
int moept_emu_arch(void);
uint16_t moept_emu_cvt_e4m3x2_f32(float a, float b); /* cvt.rn.satfinite.e4m3x2.f32 d, a, b: a's byte high */
uint32_t moept_emu_cvt_f16x2_e4m3x2(uint16_t a);     /* cvt.rn.f16x2.e4m3x2 d, a: a's high byte's f16 high */
float moept_emu_cvt_f32_f16(uint16_t h);             /* cvt.f32.f16 */
/* ---- Hopper (sm_90) primitives: tests/emu/emu_hopper.cc, docs/CUDA_INTERNALS.md "Verified without a GPU"
   Each stands for one PTX instruction (or, mbar_wait, a try_wait loop) and is called by every thread
   that executes it, as the PTX would be. The .sync.aligned ones (wgmma_*) are warpgroup-wide: the
   calling thread waits there until the 128 threads of its warpgroup (4 consecutive warps, the first
   warp's index a multiple of 4) all reach it. */
/* this block's dynamic shared memory (extern __shared__), 1024-byte aligned: the launch's smem bytes */
void *moept_emu_dyn_smem(void);
/* mbarrier (PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier"): a 64-bit
   object in shared memory */
void moept_emu_mbar_init(uint64_t *bar, unsigned count);             /* mbarrier.init.shared::cta.b64 */
void moept_emu_fence_mbar_init(void);                                /* fence.mbarrier_init.release.cluster */
/* mbarrier.arrive.release.cta.shared::cta.b64 */
void moept_emu_mbar_arrive(uint64_t *bar);
/* mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 */
void moept_emu_mbar_arrive_expect_tx(uint64_t *bar, unsigned bytes);
/* mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [bar], bytes (the expect-tx operation, no arrival) */
void moept_emu_mbar_expect_tx(uint64_t *bar, unsigned bytes);
/* mbarrier.try_wait.parity.shared::cta.b64 until it returns true (the thread yields meanwhile) */
void moept_emu_mbar_wait(uint64_t *bar, unsigned parity);
/* cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [map, {c0, c1}], [bar];
   map: a CUtensorMap made by cuTensorMapEncodeTiled (through cudaGetDriverEntryPointByVersion) */
void moept_emu_tma_load_2d(void *smem_dst, const void *tensor_map, int c0, int c1, uint64_t *bar);
void moept_emu_fence_proxy_async(void);                              /* fence.proxy.async.shared::cta */
void moept_emu_bar_sync(unsigned id, unsigned count);                /* bar.sync id, count */
/* wgmma (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions") */
void moept_emu_wgmma_fence(void);                                    /* wgmma.fence.sync.aligned */
/* wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {d}, desc_a, desc_b, scale_d, 1, 1, trans_a,
   trans_b: A and B in shared memory, K-major (trans 0) or MN-major (1); d: this thread's n/2 fp32
   accumulators (the D fragment of .m64nNk16) */
void moept_emu_wgmma_bf16(float *d, int n, uint64_t desc_a, uint64_t desc_b, int scale_d, int trans_a,
                          int trans_b);
/* wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {d}, desc_a, desc_b, scale_d, 1, 1: A and B E4M3
   in shared memory, K-major (FP8 has no transpose); d as above */
void moept_emu_wgmma_e4m3(float *d, int n, uint64_t desc_a, uint64_t desc_b, int scale_d);
void moept_emu_wgmma_commit(void);                                   /* wgmma.commit_group.sync.aligned */
void moept_emu_wgmma_wait(int n);                                    /* wgmma.wait_group.sync.aligned n */
/* the shared-window address of p (what a matrix descriptor's start address encodes): its offset in the
   dynamic shared memory (the only shared memory with an address in the emulator) */
unsigned moept_emu_smem_addr(const void *p);
/* cuda_runtime.h's C++ overload (nvcc's only): a kernel itself, as under nvcc */
template <class T>
static inline cudaError_t cudaFuncSetAttribute(T *func, enum cudaFuncAttribute attr, int value) {
    return ::cudaFuncSetAttribute(reinterpret_cast<const void *>(func), attr, value);
}
/* CUDA C++ Programming Guide, "Address Space Conversion Functions" (device code; nvcc's headers only) */
static inline size_t __cvta_generic_to_shared(const void *p) { return moept_emu_smem_addr(p); }

/* the executor's stage: what is queued next is counted under it (emu.h) */
extern "C" void moept_emu_stage(const char *name);
#define MOEPT__STAGE(name) moept_emu_stage(name)
#endif
#endif
