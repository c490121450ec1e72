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
void moept_emu_launch(const char *name, dim3 g, dim3 b, size_t smem, cudaStream_t s, const void *blob, size_t n,
                      void (*invoke)(void *));
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
        moept_emu_launch(name, g, b, smem, s, &bl, sizeof bl, invoke);
    }
};
template <typename... P>
moept_emu_launcher<P...> moept_emu_kernel(void (*k)(P...), dim3 g, dim3 b, size_t smem, cudaStream_t s,
                                          const char *name) {
    return moept_emu_launcher<P...>{k, g, b, smem, s, name};
}
#define MOEPT__LAUNCH(k, g, b, smem, s) moept_emu_kernel(k, g, b, smem, s, #k)
/* the executor's stage: what is queued next is counted under it (emu.h) */
extern "C" void moept_emu_stage(const char *name);
#define MOEPT__STAGE(name) moept_emu_stage(name)
#endif
#endif
