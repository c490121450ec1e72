/* emu_internal.h - the emulator's own declarations (tests/emu only).

   The emulated CUDA runtime, cuBLAS and NCCL are built from the real
   headers (cuda_runtime.h, cublas_v2.h, nccl.h): each emulated function is
   defined against NVIDIA's declaration, so a prototype that differs does
   not compile. Objects behind the opaque handles are ours:
     cudaStream_t -> emu::Stream, cudaEvent_t -> emu::Event,
     cublasHandle_t -> emu::Blas, ncclComm_t -> emu::Comm. */
#pragma once
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <nccl.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "emu.h"

namespace emu {

constexpr int MAXDEV = 8;          /* emulated devices (ranks) */
constexpr int MAXSTREAMS = 64;     /* streams over all devices: the vector-clock width */
constexpr size_t ARENA = (size_t)1 << 32; /* device address space per device */
constexpr size_t PAGE = 4096;
constexpr size_t HUGE_PG = (size_t)2 << 20; /* a transparent huge page: mapping and release go by these */

/* A vector clock over streams: op o happens before op p iff p's clock has
   o's stream entry >= o's epoch. */
struct VC {
    uint32_t c[MAXSTREAMS] = {0};
    void join(const VC &o) {
        for (int i = 0; i < MAXSTREAMS; i++)
            if (o.c[i] > c[i]) c[i] = o.c[i];
    }
};

/* Per 2-byte granule of device memory: the last writer and up to two
   readers since, as (stream, epoch). */
struct Granule {
    uint32_t wep, rep[2];
    uint8_t ws, rs[2], wb; /* wb: which of its 2 bytes the writer's op stored (bits 0, 1) */
};

/* element i of a cuBLAS(Lt) matrix of type t (CUDA_R_32F, else bf16), read and written (bf16: rounded
   to nearest even, a NaN kept quiet) */
inline float ld_elem(const void *p, cudaDataType_t t, int64_t i) {
    if (t == CUDA_R_32F) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline uint16_t to_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline void st_elem(void *p, cudaDataType_t t, int64_t i, float v) {
    if (t == CUDA_R_32F) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = to_bf16(v);
}

struct Alloc {
    char *base;
    size_t size;                   /* bytes asked for */
    int dev;
    bool live;
    bool unfilled = false;         /* its 0xff fill waits for the device's next mapping (dev_enter) */
    Granule *shadow;               /* [size/2 + 1] */
};

struct Stream;

/* An op on a stream: a kernel, copy, memset, cuBLAS call, NCCL op, event
   record or wait. It runs on the stream's worker once released. */
struct Op {
    std::string name;
    std::function<void(Op &)> run;
    std::vector<std::shared_ptr<Op>> deps; /* ops that must complete first (event waits, legacy stream) */
    VC host_vc;                    /* what the enqueuing host thread had synchronised with */
    VC vc;                         /* the stream's clock when it ran (event records pass it on) */
    Stream *s = nullptr;
    uint64_t seq = 0;
    uint32_t epoch = 0;
    bool done = false;
    double t_done = 0.0;           /* when it completed (cudaEventElapsedTime) */
    /* host buffer of an async H2D copy: its bytes when enqueued */
    const void *hsrc = nullptr;
    size_t hlen = 0;
    uint64_t hsum = 0;
    const char *stage = nullptr;   /* the host thread's stage when enqueued (moept_emu_stage) */
    uint64_t rw[2] = {0, 0};       /* device bytes it read, wrote (touch), every access */
    uint64_t nacc = 0;             /* device accesses (touch) */
    uint64_t uq[2] = {0, 0};       /* ... distinct bytes (2-byte granules): its traffic */
    uint64_t again = 0;            /* bytes it stored that it had stored already */
};

struct Graph;

struct Stream {
    Graph *cap = nullptr;          /* the capture its work goes into (cudaStreamBeginCapture), or none */
    int id = 0, dev = 0;
    bool legacy = false, blocking = true;
    std::mutex m;
    std::condition_variable cv;
    std::deque<std::shared_ptr<Op>> q;
    uint64_t next_seq = 1, released = 0, completed = 0;
    std::shared_ptr<Op> last;      /* the newest op enqueued */
    VC vc;
    std::vector<std::string> names; /* [epoch] what each op was (for reports) */
    std::thread worker;
    bool quit = false;
};

struct Event {
    Graph *cap = nullptr;          /* recorded inside this capture (a wait on it joins the capture) */
    int dev;
    bool timing = true;            /* not created with cudaEventDisableTiming */
    std::shared_ptr<Op> rec;       /* the last record, null before any */
};

struct Device {
    int id;
    char *arena = nullptr;
    size_t top = 0;                /* bump pointer: addresses are never reused */
    std::vector<Alloc *> allocs;   /* every allocation, index = id; its storage reserved whole at the
                                      device's creation and never moved: find() reads it without m while
                                      another thread (a rank on the same device) allocates */
    uint32_t *page_of = nullptr;   /* [ARENA/PAGE] allocation id + 1, 0 = none */
    std::mutex m;
    int active = 0;                /* device ops running: memory is mapped RW */
    size_t mapped = 0;             /* [arena, arena + mapped) is RW: top rounded up to HUGE_PG, or 0 */
    uint32_t *chunk_live = nullptr; /* [ARENA/HUGE_PG] live allocations with bytes in each HUGE_PG chunk */
    std::vector<Alloc *> unfilled; /* allocations made while it was unmapped, not filled yet */
    int pkey = -1;                 /* its protection key (-1: none): only a worker running one
                                      of the device's ops has access, other threads fault */
    Stream *legacy = nullptr;
    std::vector<Stream *> streams;
    std::atomic<int> lost{0};      /* a sticky error (cudaError_t): the context is lost (lose) */
    std::atomic<int> fault_next{0}; /* moept_emu_fault_next_kernel: the next kernel launched faults */
};

extern Device *devices[MAXDEV];
extern thread_local int cur_dev;
extern thread_local VC host_vc;
extern thread_local Op *cur_op;    /* set on a worker while its op runs */

void report(const char *checker, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* the emulated devices' compute capability, 10 major + minor (MOEPT_EMU_CC; 80) */
int compute_capability();
/* an E4M3 byte's value (PTX ISA, "Alternate Floating-Point Data Formats", OCP FP8's E4M3: 1 sign bit, 4
   exponent bits biased by 7, 3 mantissa bits; exponent 0 subnormal, m 2^-9; no infinities, S.1111.111
   NaN), from a table made once: wgmma's and cuBLASLt's FP8 operands, cvt's conversions */
inline float e4m3_value(uint8_t b) {
    static const struct T {
        float v[256];
        T() {
            for (int i = 0; i < 256; i++) {
                const int e = i >> 3 & 15, m = i & 7;
                const float x = e == 15 && m == 7 ? NAN : e ? ldexpf(1.0f + (float)m / 8.0f, e - 7)
                                                            : ldexpf((float)m / 8.0f, -6);
                v[i] = i & 0x80 ? -x : x;
            }
        }
    } t;
    return t.v[b];
}
Device *dev(int d);
Stream *stream_of(cudaStream_t s);
/* enqueue: op runs on s after its deps and s's earlier ops; returns it.
   prep fills the op's fields first: once queued, any thread's synchronize
   may release it, so nothing about it may be set after the call. */
std::shared_ptr<Op> enqueue(Stream *s, const char *name, std::function<void(Op &)> run,
                            const std::function<void(Op &)> &prep = nullptr);
/* For a graph's replay: set before an enqueue whose op cannot simply run
   again (an NCCL collective takes the next sequence number), t_remake makes
   its run function anew; t_after sees each enqueued op (capture or not).
   enqueue consumes both. */
extern thread_local std::function<std::function<void(Op &)>()> t_remake;
extern thread_local std::function<void(const std::shared_ptr<Op> &)> t_after;
void force(Stream *s, uint64_t seq);
void force_all(Stream *s);
bool wait_op(const std::shared_ptr<Op> &o, double timeout_s);
/* the hang limit (MOEPT_EMU_HANG_S, default 120 s); hang() reports and ends the process */
double hang_seconds();
[[noreturn]] void hang(const char *what);
Alloc *find(const void *p, int *devid);
int is_pinned(const void *p);
/* in an op: n bytes at p are read or written (memcheck on the device,
   the stream hazard check); returns 0 after a report */
int touch(const void *p, size_t n, int write, const char *what);
/* what == nullptr: a kernel's access, described (block, thread) only when a report needs it: one
   snprintf an access was most of an emulated kernel's time */
void kernel_what(char *buf, size_t len);
uint64_t checksum(const void *p, size_t n);
/* counts (moept_emu_counts): a host wait on device d, a completed op */
void count_sync(int d);
void count_op(const Op &o);
double now();
void set_last_error(cudaError_t e);
/* The device's sticky error (cudaSuccess while its context is fine). CUDA
   Runtime API, enum cudaError (cudaErrorIllegalAddress, ...): a kernel's
   fault leaves the process in an inconsistent state, any further CUDA work
   returns the same error, and only a new process can use CUDA again. */
cudaError_t sticky(int d);
/* op (a kernel, cuBLAS call, NCCL op, copy) on device d faulted with e: the
   context is lost (the first time: a "context" report). Its queued work
   never runs; every later call on d returns e (moept_emu_recover ends it). */
void lose(int d, cudaError_t e, const char *op, const char *why);

/* ---- the block in flight (emu_kernel.cc) and the Hopper primitives (emu_hopper.cc) ----
   One block runs at a time, process-wide; these are called from a kernel's thread (a fiber). */
#ifdef __SANITIZE_ADDRESS__
constexpr size_t FIBER_STACK = 256 * 1024;
#else
constexpr size_t FIBER_STACK = 64 * 1024;
#endif
/* the opt-in dynamic shared memory of a block on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin, 227 KiB),
   and what a kernel gets without cudaFuncSetAttribute (48 KiB) */
constexpr size_t DYN_SMEM_MAX = 232448;
constexpr size_t DYN_SMEM_DEFAULT = 48 * 1024;
/* the dynamic shared memory: DYN_SMEM_MAX bytes of static storage, 1024-byte aligned (one block at a time);
   its shared-window address is the offset from dyn_smem() */
char *dyn_smem();
struct KBlock {
    const char *name;              /* the kernel */
    uint3 bid;
    int nthreads;
    int t;                         /* the calling thread (linear index), -1: none */
    uint32_t blk;                  /* block serial (shared memory's lifetime) */
    uint32_t epoch;                /* barrier interval (racecheck) */
    size_t smem;                   /* the launch's dynamic shared bytes */
};
/* the block this thread runs (false: not in a kernel) */
bool kblock(KBlock *k);
/* the calling thread blocks until ready(arg) holds (checked between the block's runs of its threads);
   a block in which nothing can run any more is a deadlock report and ends there (never returns then) */
void kernel_block(bool (*ready)(void *), void *arg, const char *what);
/* ends the block now (after a report that leaves it nothing defined to do); never returns */
[[noreturn]] void kernel_end_block();
/* n bytes of shared memory at p written by the async proxy (a TMA load): written for initcheck, no
   generic writer for racecheck */
void smem_async_write(const char *p, size_t n);
/* the kernels' loads and stores reach the checks (their unit has the instrumentation: not under ASan) */
bool kernel_hooks();
/* p is shared memory (static __shared__ storage or the dynamic shared memory) */
bool is_shared(const void *p);
/* a thread's stack (its FIBER_STACK bytes) */
const char *fiber_stack(int t);
/* the kernel's dynamic shared memory limit for device dev (cudaFuncSetAttribute,
   cudaFuncAttributeMaxDynamicSharedMemorySize; DYN_SMEM_DEFAULT until raised) */
size_t func_max_dyn_smem(int dev, const void *func);
/* emu_hopper.cc's hooks: on while the block has used a wgmma primitive (the stack hook's cost) */
extern bool hop_on;
void hop_block();                                        /* a new block begins */
void hop_shared(int t, size_t off, size_t n, int write); /* a generic access of dynamic shared memory */
void hop_stack(int t, size_t off, size_t n, int write);  /* an access of thread t's own stack (hop_on) */
void hop_barrier();                                      /* a __syncthreads released the block */
uint32_t hop_clock();                                    /* the clock now (a shared access's stamp) */
bool hop_ordered(int w, uint32_t stamp, int r);          /* w's access at stamp before r's, by a bar.sync */
void hop_exit(int t);                                    /* thread t returned from the kernel */
/* the emulated driver's cuTensorMapEncodeTiled (cudaGetDriverEntryPointByVersion) */
void *tensor_map_encode_tiled();

}  // namespace emu

int moept_emu_nccl_group_depth(void);
