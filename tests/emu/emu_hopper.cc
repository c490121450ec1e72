/* emu_hopper.cc - the Hopper (sm_90) primitives of the emulated kernels (cuda_emu.h): mbarriers, TMA
   2D tensor loads and the tensor maps they read (cuTensorMapEncodeTiled), fence.proxy.async, and
   wgmma.mma_async (bf16 or e4m3 in shared memory, fp32 accumulators) with its fence, commit and wait.

   Each is called by every thread that executes the instruction (a fiber of emu_kernel.cc). The rules
   are the PTX ISA's and the CUDA Driver API's, each cited beside the code that holds it; a broken one
   is a report (checkers "mbarrier", "tma", "proxy", "wgmma", "tensormap", "hang"), each shown firing by
   tests/emu/test_emu.cc. What is emulated, and how:
     - an mbarrier is the PTX object's state (pending arrivals, tx-count, phase) kept beside its
       address; a thread waiting on a phase that has not completed blocks (kernel_block) and the
       block's other threads run; a block in which no thread can run any more is a deadlock report;
     - a TMA load copies the box at once, swizzled, zeros outside the tensor, and completes its bytes
       on the mbarrier (complete_tx) at the call: the bytes are written (initcheck) but a generic
       access of them by a thread that has not waited on the phase the copy completes is a report;
     - wgmma.* are warpgroup-wide (.sync.aligned): each thread waits at the instruction until the 128
       threads of its warpgroup have reached it, and they must all execute the same one (same
       descriptors, shape, scale). An mma_async is computed when wgmma.wait_group retires its group;
       between issue and retirement its accumulators (the thread's d array, on the fiber's stack: the
       instrumented loads and stores reach hop_stack) and its shared-memory operands must not be
       touched.
   Generic-proxy stores, fences and accumulator accesses are ordered by one clock (g_hclock): a fence
   takes the next value, an access is stamped with the current one, so "accessed after the fence" is
   stamp >= fence. */
#include "emu_internal.h"

#include <cuda.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <sys/mman.h>
#include <unordered_map>
#include <vector>

namespace emu {

bool hop_on;

namespace {

constexpr int WG = 128; /* threads in a warpgroup */
uint32_t g_hclock = 1;

/* ---- the block's state (one block runs at a time; reset when a new block first uses it) ---- */

/* PTX ISA, mbarrier, "Contents of the mbarrier object": the current phase, its pending arrival count,
   the expected arrival count (mbarrier.init's count) and the tx-count. A phase completes when the
   pending count and the tx-count are both zero; the next phase then starts with the pending count
   reset to the expected count ("Phase Completion of the mbarrier object"). */
struct Mbar {
    const void *addr;
    int64_t count, pending, tx;
    int64_t ph;                    /* phases completed: the current phase's parity is ph & 1 */
    int init_t;                    /* the thread that initialised it, in barrier interval init_epoch */
    uint32_t init_epoch;
    bool told;                     /* its init-visibility report was made */
    std::vector<int64_t> obs;      /* per thread: the last completed phase it knows of (waits, barriers) */
    std::vector<int64_t> own;      /* per thread: the phase its own last wait observed (-2: none) */
    std::vector<std::array<int64_t, 2>> arr; /* per thread: the phases of its last two arrivals, newest */
    std::vector<std::array<uint32_t, 2>> arrf; /* ... and the clock of its last fence.proxy.async before
                                                  each (0: none) */
};

struct Args {                      /* a thread's .sync.aligned instruction */
    int kind, n, scale, trans;     /* trans: imm-trans-a (bit 0) and imm-trans-b (bit 1) */
    uint64_t da, db;
    float *d;
    int es;                        /* an mma's operand element: 2 bytes (bf16, k16) or 1 (e4m3, k32) */
};
enum { K_FENCE, K_MMA, K_COMMIT, K_WAIT };
const char *const KNAME[] = {"wgmma.fence.sync.aligned", "wgmma.mma_async.sync.aligned",
                             "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned"};

struct WgOp {                      /* one wgmma.mma_async of a warpgroup */
    uint64_t da, db;
    int n, scale, trans, wg, es;
    float *d[WG];
    std::vector<uint32_t> offa, offb; /* each element's shared offset: A [64][K], B [n][K] (K 32 / es) */
    std::vector<uint32_t> bytes;   /* the operand bytes, once each */
    bool told;                     /* its accumulator-access report was made */
    bool lost;                     /* ... its report of a thread returning with it in flight */
};

struct Wg {
    int arrived = 0;               /* at the .sync.aligned instruction in progress */
    uint64_t gen = 0;              /* instructions completed */
    Args args[WG];
    std::vector<WgOp *> open;      /* issued, not committed to a group */
    std::deque<std::vector<WgOp *>> groups; /* committed wgmma-groups, oldest first */
};

struct WaitRec {                   /* what a blocked thread waits for (kernel_block's argument) */
    Wg *wg;
    uint64_t gen;
    int bar;
    unsigned parity;
};

struct Range {
    size_t lo, hi;
    WgOp *op;
};

struct BarSeen {                   /* a barrier a thread passed: its completion's clock, and the clock of
                                      the thread's last fence.proxy.async before it */
    uint32_t at = 0, fence = 0;
};
constexpr int NSEEN = 4;           /* the barriers kept a thread (the newest) */

struct NamedBar {                  /* bar.sync a, b in progress */
    int count = 0;                 /* b of its first arrival */
    uint64_t gen = 0;              /* completions */
    std::vector<int> in;           /* the threads arrived */
};

struct Block {
    uint32_t blk = 0;
    int n = 0;
    std::unordered_map<const void *, int> ix; /* mbarrier address -> mbars[] */
    std::vector<Mbar> mbars;
    std::vector<Wg> wgs;
    std::vector<uint32_t> pfence;  /* per thread: the clock at its last fence.proxy.async (0: none) */
    std::vector<std::array<BarSeen, NSEEN>> seen; /* per thread: the last barriers it passed (bar.sync,
                                                     __syncthreads), newest first */
    std::vector<std::array<BarSeen, 16>> byid; /* ... and the last of each barrier 0-15 (a common one
                                                  NSEEN newer ones of other barriers hide: a warpgroup's
                                                  own barrier every k-step, then one of the CTA's) */
    NamedBar nbar[16];             /* bar.sync's barriers 0-15 (0: __syncthreads' own) */
    std::vector<uint32_t> wfence;  /* ... at its last wgmma.fence (0: none) */
    std::vector<std::vector<Range>> acc; /* per thread: its accumulators in flight (stack offsets) */
    std::vector<WaitRec> wait;
    std::vector<std::unique_ptr<WgOp>> ops;
};
Block B;

/* per byte of the dynamic shared memory, for the block blk */
struct HopByte {
    uint32_t blk;
    uint32_t gw_stamp;             /* the clock at its last generic store (gw) */
    int32_t tma_ph;                /* the phase (of mbarrier tma_bar - 1) completing the TMA that wrote it */
    uint16_t tma_bar;              /* 0: no TMA load wrote it since its last generic store */
    uint16_t gw_t;                 /* the thread of that store */
    uint16_t inflight;             /* wgmma.mma_async in flight that read it */
    uint8_t gw;                    /* a generic store wrote it (and no TMA since) */
};
HopByte *g_hb;
uint32_t *g_stamp;                 /* per 4 bytes of each fiber's stack: the clock at its last access */

HopByte &hb(size_t off, uint32_t blk) {
    if (!g_hb) g_hb = (HopByte *)calloc(DYN_SMEM_MAX, sizeof(HopByte));
    HopByte &h = g_hb[off];
    if (h.blk != blk) {
        memset(&h, 0, sizeof h);
        h.blk = blk;
    }
    return h;
}

/* the block this thread runs, its state current */
bool cur(KBlock *k) {
    if (!kblock(k)) return false;
    if (B.blk != k->blk) {
        B.blk = k->blk;
        B.n = k->nthreads;
        B.ix.clear();
        B.mbars.clear();
        B.wgs.assign((size_t)(B.n + WG - 1) / WG, Wg());
        B.pfence.assign((size_t)B.n, 0);
        B.seen.assign((size_t)B.n, std::array<BarSeen, NSEEN>());
        B.byid.assign((size_t)B.n, std::array<BarSeen, 16>());
        for (NamedBar &nb : B.nbar) nb = NamedBar();
        B.wfence.assign((size_t)B.n, 0);
        B.acc.assign((size_t)B.n, {});
        B.wait.assign((size_t)B.n, WaitRec());
        B.ops.clear();
    }
    return true;
}

bool need(KBlock *k, const char *what) {
    if (cur(k)) {
        hop_on = true;
        return true;
    }
    report("runtime", "%s called outside a kernel", what);
    return false;
}

#define WHERE "kernel %s block (%u,%u,%u) thread %d"
#define AT(k) (k).name, (k).bid.x, (k).bid.y, (k).bid.z, (k).t

size_t dyn_off(const void *p) { return (size_t)((const char *)p - dyn_smem()); }
bool in_dyn(const void *p) { return (const char *)p >= dyn_smem() && dyn_off(p) < DYN_SMEM_MAX; }

/* ---- mbarrier ---- */

/* (an undefined operation ends the block: kernel_end_block) */
Mbar *mbar_of(const KBlock &k, const void *bar, const char *op, int *idx) {
    auto it = B.ix.find(bar);
    if (it == B.ix.end()) { /* PTX ISA, mbarrier: every other operation requires an initialised object */
        report("mbarrier", WHERE ": %s on an uninitialised mbarrier at %p (no mbarrier.init of it in this "
               "block)", AT(k), op, bar);
        kernel_end_block();
    }
    Mbar &m = B.mbars[(size_t)it->second];
    if (idx) *idx = it->second;
    /* mbarrier.init is a store to shared memory: another thread may use the object only once ordered
       after it (a __syncthreads; fence.mbarrier_init for the cluster's other blocks) */
    if (m.init_t != k.t && m.init_epoch == k.epoch && !m.told) {
        m.told = true;
        report("mbarrier", WHERE ": %s on the mbarrier at %p that thread %d initialised with no "
               "__syncthreads between (the init is not visible to it)", AT(k), op, bar, m.init_t);
    }
    return &m;
}

/* PTX ISA, "Phase Completion of the mbarrier object" */
void complete_if_done(Mbar &m) {
    if (m.pending == 0 && m.tx == 0) {
        m.ph++;
        m.pending = m.count;
    }
}

/* the arrive-on operation: the pending count decrements; a phase with none pending left waits only
   for its tx-count, and one more arrival than its expected count is no defined state */
void arrive(const KBlock &k, Mbar &m, const char *op) {
    if (m.pending <= 0) {
        report("mbarrier", WHERE ": %s on the mbarrier at %p whose current phase has no pending arrival left "
               "(expected count %lld): more arrivals than mbarrier.init's count", AT(k), op, m.addr,
               (long long)m.count);
        return;
    }
    const size_t t = (size_t)k.t;
    m.arr[t][1] = m.arr[t][0];
    m.arrf[t][1] = m.arrf[t][0];
    m.arr[t][0] = m.ph; /* (the phase it arrives in: ph counts those completed) */
    m.arrf[t][0] = B.pfence[t];
    m.pending--;
    complete_if_done(m);
}

/* the tx-count's range: [-(2^20 - 1), 2^20 - 1] ("Contents of the mbarrier object") */
constexpr int64_t TX_MAX = (1 << 20) - 1;

/* complete-tx (a TMA load's bytes arriving). The emulator completes a load when it is issued, so a
   tx-count below zero means the load was issued before arrive.expect_tx announced its bytes: the ISA's
   range allows it, but its phase could then complete before the bytes it waits for were expected
   (each CUTLASS-style producer expects first, then copies): reported, stricter than the ISA. */
void complete_tx(const KBlock &k, Mbar &m, int64_t bytes) {
    m.tx -= bytes;
    if (m.tx < 0)
        report("mbarrier", WHERE ": a TMA load completes %lld bytes on the mbarrier at %p and its tx-count "
               "goes negative (%lld): the bytes were not expected (mbarrier.arrive.expect_tx) before the "
               "copy",
               AT(k), (long long)bytes, m.addr, (long long)m.tx);
    complete_if_done(m);
}

bool mbar_ready(void *p) {
    const WaitRec *w = (const WaitRec *)p;
    return (B.mbars[(size_t)w->bar].ph & 1) != w->parity;
}

/* ---- swizzle (shared between the TMA and the wgmma operand reads) ----
   The 16-byte chunk index within each S-byte span (S = 32, 64, 128) is XORed with the 128-byte row
   index within the pattern's repeat of 8 rows, as bits of the shared-memory address: 128B swizzle:
   address bits [4:6] ^= bits [7:9]; 64B: bits [4:5] ^= bits [7:8]; 32B: bit 4 ^= bit 7 (the pattern
   repeats every 1024, 512, 256 bytes). CUDA Driver API, CUtensorMapSwizzle ("Swizzle 16B chunks within
   32B/64B/128B span"); PTX ISA, wgmma "Shared Memory Matrix Layout" (the same patterns). */
size_t swz(size_t addr, int span) {
    return span ? addr ^ (((addr >> 7) & (size_t)(span / 16 - 1)) << 4) : addr;
}

/* ---- the tensor map (CUDA Driver API, cuTensorMapEncodeTiled) ----
   The 128-byte opaque CUtensorMap holds, here: */
constexpr uint64_t TM_MAGIC = 0x414d54544550454dull; /* "MEPTTMA" and a version byte */
struct TMap {
    uint64_t magic;
    uint64_t addr;
    uint64_t dim[5];
    uint64_t stride[4];            /* bytes: dimension i + 1 */
    uint8_t dtype, rank, interleave, swizzle, oob, l2, esize, pad;
    uint16_t box[5];
    uint8_t estride[5];
};
static_assert(sizeof(TMap) <= sizeof(CUtensorMap), "the emulated tensor map fits CUtensorMap");

int esize_of(int t) {
    switch (t) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: return 1;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16: case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: return 2;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32: case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ: case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ: return 4;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64: case CU_TENSOR_MAP_DATA_TYPE_INT64:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT64:
        return 8;
    default: return 0;             /* the packed 4- and 6-bit types */
    }
}
bool is_float(int t) {
    return t == CU_TENSOR_MAP_DATA_TYPE_FLOAT16 || t == CU_TENSOR_MAP_DATA_TYPE_FLOAT32 ||
           t == CU_TENSOR_MAP_DATA_TYPE_FLOAT64 || t == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ||
           t == CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ || t == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32 ||
           t == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ;
}

CUresult refuse(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
CUresult refuse(const char *fmt, ...) {
    char why[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    report("tensormap", "cuTensorMapEncodeTiled: %s: CUDA_ERROR_INVALID_VALUE", why);
    return CUDA_ERROR_INVALID_VALUE;
}

}  // namespace

/* ---- emu_kernel.cc's hooks ---- */

void hop_block() { hop_on = false; }

/* a generic (ld/st.shared) access of dynamic shared memory by thread t */
void hop_shared(int t, size_t off, size_t n, int write) {
    KBlock k;
    if (!cur(&k)) return;
    for (size_t i = off; i < off + n; i++) {
        HopByte &h = hb(i, k.blk);
        if (h.tma_bar) {
            /* the TMA's writes are visible to the thread once it observed the mbarrier phase its
               complete-tx finished (PTX ISA, "Memory Consistency Model": the async proxy's writes,
               released by complete-tx, acquired by the phase's wait) */
            const Mbar &m = B.mbars[(size_t)h.tma_bar - 1];
            if (m.obs[(size_t)t] < h.tma_ph) {
                report("tma", WHERE ": %s shared memory at dynamic offset %zu that a TMA load writes, before "
                       "it waited on the mbarrier phase that completes the load (mbarrier %p, phase %d)",
                       AT(k), write ? "writes" : "reads", i, m.addr, h.tma_ph);
                return;
            }
        }
        if (!write) continue;
        if (h.inflight) { /* PTX ISA, wgmma.mma_async: the operands must not change until it completes */
            report("wgmma", WHERE ": writes shared memory at dynamic offset %zu that a wgmma.mma_async in "
                   "flight reads (issued, not yet retired by wgmma.wait_group)", AT(k), i);
            return;
        }
        h.gw = 1;
        h.gw_t = (uint16_t)t;
        h.gw_stamp = g_hclock;
        h.tma_bar = 0;
    }
}

uint32_t hop_clock() { return g_hclock; }

/* whether threads w and r both passed a barrier whose BarSeen b has b.*after > stamp (at: the completion;
   fence: w's fence before it), among each's last NSEEN or the last of each barrier id */
static bool both_passed(int w, uint32_t stamp, int r, uint32_t BarSeen::*after) {
    for (const BarSeen &b : B.seen[(size_t)w]) {
        if (!b.at || b.*after <= stamp) continue;
        for (const BarSeen &c : B.seen[(size_t)r])
            if (c.at == b.at) return true;
    }
    for (int id = 0; id < 16; id++) {
        const BarSeen &b = B.byid[(size_t)w][(size_t)id];
        if (b.at && b.*after > stamp && B.byid[(size_t)r][(size_t)id].at == b.at) return true;
    }
    return false;
}
/* whether thread w's shared-memory access at clock stamp is ordered before thread r's: by a barrier both
   passed after it, among each's last NSEEN or the last of each barrier id (PTX ISA, "bar, barrier": once
   a barrier completes, the memory accesses its threads requested before it are performed relative to
   all the threads that take part in it; so a named barrier of part of the block orders the accesses of
   its threads) */
bool hop_ordered(int w, uint32_t stamp, int r) {
    KBlock k;
    if (!cur(&k) || B.seen.size() <= (size_t)std::max(w, r)) return false;
    return both_passed(w, stamp, r, &BarSeen::at);
}

/* an access of thread t's own stack while the block uses the primitives: a wgmma's accumulators */
void hop_stack(int t, size_t off, size_t n, int write) {
    if (B.acc.size() <= (size_t)t) return;
    for (Range &r : B.acc[(size_t)t])
        if (off < r.hi && off + n > r.lo && !r.op->told) {
            /* PTX ISA, wgmma.mma_async: accessing the accumulator registers before the wgmma.wait_group
               that retires it is undefined */
            r.op->told = true;
            KBlock k;
            kblock(&k);
            report("wgmma", WHERE ": %s its accumulator d[%zu] while the wgmma.mma_async that writes it is "
                   "in flight (no wgmma.wait_group has retired it)", AT(k), write ? "writes" : "reads",
                   (off - r.lo) / 4);
            break;
        }
    if (!g_stamp) {
        g_stamp = (uint32_t *)mmap(nullptr, 1024 * FIBER_STACK, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (g_stamp == MAP_FAILED) {
            fprintf(stderr, "moept-emu: no memory for the stack stamps\n");
            abort();
        }
    }
    uint32_t *s = g_stamp + (size_t)t * (FIBER_STACK / 4);
    for (size_t w = off / 4; w < (off + n + 3) / 4 && w < FIBER_STACK / 4; w++) s[w] = g_hclock;
    (void)write;
}

/* a __syncthreads orders every thread after what each had observed: a phase one thread saw complete
   is complete for all of them (bar.sync is a CTA-wide fence) */
/* thread t passed barrier id (0: __syncthreads') completing at clock now */
void passed(int t, uint32_t now, unsigned id) {
    std::array<BarSeen, NSEEN> &v = B.seen[(size_t)t];
    for (int i = NSEEN - 1; i > 0; i--) v[(size_t)i] = v[(size_t)i - 1];
    v[0].at = now;
    v[0].fence = B.pfence[(size_t)t];
    B.byid[(size_t)t][id % 16] = v[0];
}

/* whether thread w's store of clock stamp, fenced (fence.proxy.async) by w, is ordered before thread
   r's next async-proxy read ("Memory Consistency Model": w's release, r's acquire): by a barrier that w
   passed after its fence and r passed too (among each thread's last NSEEN), or by an mbarrier phase
   that w arrived on after its fence (mbarrier.arrive is a release; among its last two arrivals on that
   mbarrier) and r observed completed (a wait's acquire, or a barrier after another thread's) */
template <class Obs> /* ... the mbarrier route, obs(m) the completed phase of mbarrier m the reader saw */
bool by_mbar(int w, uint32_t stamp, Obs obs) {
    for (size_t m = 0; m < B.mbars.size(); m++)
        for (int i = 0; i < 2; i++)
            if (B.mbars[m].arr[(size_t)w][i] >= 0 && B.mbars[m].arrf[(size_t)w][i] > stamp &&
                obs(m) >= B.mbars[m].arr[(size_t)w][i])
                return true;
    return false;
}
bool ordered(int w, uint32_t stamp, int r) {
    if (both_passed(w, stamp, r, &BarSeen::fence)) return true;
    return by_mbar(w, stamp, [r](size_t m) { return B.mbars[m].obs[(size_t)r]; });
}
/* ordered() for every thread of a warpgroup at once by the mbarrier route (obs: each mbarrier's least
   completed phase its threads observed), a fast path: false sends the caller to ordered() a thread */
bool ordered_wg(int w, uint32_t stamp, const std::vector<int64_t> &obs) {
    return by_mbar(w, stamp, [&obs](size_t m) { return obs[m]; });
}

void hop_barrier() {
    const uint32_t now = ++g_hclock;
    for (int t = 0; t < B.n && (size_t)t < B.seen.size(); t++) passed(t, now, 0);
    for (Mbar &m : B.mbars) {
        int64_t mx = -1;
        for (int64_t v : m.obs) mx = std::max(mx, v);
        std::fill(m.obs.begin(), m.obs.end(), mx);
    }
}

void hop_exit(int t) {
    if (B.acc.size() <= (size_t)t || B.acc[(size_t)t].empty()) return;
    WgOp *op = B.acc[(size_t)t][0].op;
    if (op->lost) return;
    op->lost = true;
    KBlock k;
    kblock(&k);
    report("wgmma", WHERE ": returns from the kernel with %zu wgmma.mma_async in flight (no wgmma.wait_group "
           "retired them: their results are lost)", AT(k), B.acc[(size_t)t].size());
}

}  // namespace emu

using namespace emu;

/* ---- the primitives (cuda_emu.h) ---- */

void *moept_emu_dyn_smem(void) {
    KBlock k;
    if (!need(&k, "moept_emu_dyn_smem")) return nullptr;
    return dyn_smem();
}

unsigned moept_emu_smem_addr(const void *p) {
    KBlock k;
    if (!need(&k, "__cvta_generic_to_shared")) return 0;
    if (in_dyn(p)) return (unsigned)dyn_off(p);
    report(is_shared(p) ? "runtime" : "memcheck", WHERE ": the shared address of %p: %s", AT(k), p,
           is_shared(p) ? "not emulated for static __shared__ storage (only dynamic shared memory has one)"
                        : "not shared memory");
    return 0;
}

/* PTX ISA, mbarrier.init: "count" in [1, 2^20 - 1]; the object is 8 bytes, 8-byte aligned, in shared
   memory; init sets the current phase to 0, its pending and expected counts to count, tx-count 0 */
void moept_emu_mbar_init(uint64_t *bar, unsigned count) {
    KBlock k;
    if (!need(&k, "mbarrier.init")) return;
    if (!is_shared(bar) || (uintptr_t)bar % 8) {
        report("mbarrier", WHERE ": mbarrier.init at %p: %s", AT(k), (void *)bar,
               !is_shared(bar) ? "not shared memory" : "not 8-byte aligned");
        kernel_end_block();
    }
    if (count < 1 || count > TX_MAX) {
        report("mbarrier", WHERE ": mbarrier.init count %u outside [1, 2^20 - 1]", AT(k), count);
        kernel_end_block();
    }
    auto it = B.ix.find(bar);
    int i = it == B.ix.end() ? (int)B.mbars.size() : it->second;
    if (it == B.ix.end()) {
        B.ix[bar] = i;
        B.mbars.emplace_back();
    }
    Mbar &m = B.mbars[(size_t)i];
    m.addr = bar;
    m.count = m.pending = count;
    m.tx = 0;
    m.ph = 0;
    m.init_t = k.t;
    m.init_epoch = k.epoch;
    m.told = false;
    m.obs.assign((size_t)B.n, -1);
    m.own.assign((size_t)B.n, -2);
    m.arr.assign((size_t)B.n, {-1, -1});
    m.arrf.assign((size_t)B.n, {0, 0});
}

/* PTX ISA, fence.mbarrier_init.release.cluster: orders prior mbarrier.init for the cluster (a block's
   other threads still need their barrier, which the init-visibility check holds). A no-op here. */
void moept_emu_fence_mbar_init(void) {
    KBlock k;
    need(&k, "fence.mbarrier_init");
}

void moept_emu_mbar_arrive(uint64_t *bar) {
    KBlock k;
    if (!need(&k, "mbarrier.arrive")) return;
    arrive(k, *mbar_of(k, bar, "mbarrier.arrive", nullptr), "mbarrier.arrive");
}

/* PTX ISA, "expect-tx operation": tx-count += bytes, within its range; false (reported) past it */
namespace emu {
namespace {
bool expect_tx(const KBlock &k, Mbar *m, unsigned bytes, const char *op) {
    if ((int64_t)bytes > TX_MAX || m->tx + (int64_t)bytes > TX_MAX) {
        report("mbarrier", WHERE ": %s of %u bytes takes the tx-count of the mbarrier at %p past 2^20 - 1",
               AT(k), op, bytes, m->addr);
        return false;
    }
    m->tx += bytes;
    return true;
}
}  // namespace
}  // namespace emu

/* PTX ISA, mbarrier.arrive.expect_tx: the expect-tx operation, then arrive-on */
void moept_emu_mbar_arrive_expect_tx(uint64_t *bar, unsigned bytes) {
    KBlock k;
    if (!need(&k, "mbarrier.arrive.expect_tx")) return;
    Mbar *m = mbar_of(k, bar, "mbarrier.arrive.expect_tx", nullptr);
    if (expect_tx(k, m, bytes, "mbarrier.arrive.expect_tx")) arrive(k, *m, "mbarrier.arrive.expect_tx");
}

/* PTX ISA, mbarrier.expect_tx: the expect-tx operation alone (no arrival; relaxed: no ordering) */
void moept_emu_mbar_expect_tx(uint64_t *bar, unsigned bytes) {
    KBlock k;
    if (!need(&k, "mbarrier.expect_tx")) return;
    expect_tx(k, mbar_of(k, bar, "mbarrier.expect_tx", nullptr), bytes, "mbarrier.expect_tx");
}

/* PTX ISA, mbarrier.test_wait/try_wait: .parity waits for "the completion of the phase indicated by
   the operand phaseParity", i.e. returns true once the current phase's parity differs from it. The
   thread blocks (the block's other threads run) until then. Its acquire makes what the phase released
   (the arrivals' stores, a TMA's bytes) visible to it. */
void moept_emu_mbar_wait(uint64_t *bar, unsigned parity) {
    KBlock k;
    if (!need(&k, "mbarrier.try_wait")) return;
    int i = 0;
    mbar_of(k, bar, "mbarrier.try_wait.parity", &i);
    WaitRec &w = B.wait[(size_t)k.t];
    w.bar = i;
    w.parity = parity & 1;
    kernel_block(mbar_ready, &w, "an mbarrier wait (mbarrier.try_wait.parity)");
    Mbar &m = B.mbars[(size_t)i];
    const int64_t seen = m.ph - 1; /* the last completed phase: its parity is the one waited for */
    if (m.own[(size_t)k.t] == seen)
        report("mbarrier", WHERE ": waits on the mbarrier at %p for parity %u a second time in the same "
               "phase (phase %lld completed before its previous wait returned): a pipeline's phase bit that "
               "did not flip, or a stage index that wrapped wrongly", AT(k), (void *)bar, parity & 1,
               (long long)seen);
    m.own[(size_t)k.t] = seen;
    m.obs[(size_t)k.t] = std::max(m.obs[(size_t)k.t], seen);
}

/* PTX ISA, membar/fence: fence.proxy.async orders this thread's generic-proxy accesses of shared memory
   with the async proxy's ("Memory Consistency Model", proxies): stores a wgmma reads need it between */
void moept_emu_fence_proxy_async(void) {
    KBlock k;
    if (!need(&k, "fence.proxy.async")) return;
    B.pfence[(size_t)k.t] = ++g_hclock;
}

namespace emu {
namespace {
bool nbar_done(void *p) {
    const WaitRec *w = (const WaitRec *)p;
    return B.nbar[w->bar].gen != w->gen;
}
}  // namespace
}  // namespace emu

/* PTX ISA, bar / barrier: bar.sync a, b: barrier a (0-15) completes when b threads (a multiple of the
   warp size, at most the block's) arrived; every arrival at one barrier gives the same b. Barrier 0 is
   __syncthreads' own, not emulated here. */
void moept_emu_bar_sync(unsigned id, unsigned count) {
    KBlock k;
    if (!need(&k, "bar.sync")) return;
    if (id > 15 || count == 0 || count % 32 || (int)count > k.nthreads) {
        report("synccheck", WHERE ": bar.sync %u, %u: the barrier must be 0-15 and the count a multiple of "
               "32 up to the block's %d threads", AT(k), id, count, k.nthreads);
        kernel_end_block();
    }
    if (id == 0) { /* __syncthreads' barrier: with another count, or beside it, not emulated */
        report("runtime", WHERE ": bar.sync 0, %u: barrier 0 (__syncthreads') is not emulated", AT(k), count);
        kernel_end_block();
    }
    NamedBar &nb = B.nbar[id];
    if (nb.in.empty()) nb.count = (int)count;
    if (nb.count != (int)count) {
        report("synccheck", WHERE ": bar.sync %u, %u while %zu thread(s) wait there with the count %d", AT(k),
               id, count, nb.in.size(), nb.count);
        kernel_end_block();
    }
    nb.in.push_back(k.t);
    if ((int)nb.in.size() < nb.count) {
        WaitRec &w = B.wait[(size_t)k.t];
        w.bar = (int)id;
        w.gen = nb.gen;
        kernel_block(nbar_done, &w, "bar.sync");
        return;
    }
    const uint32_t now = ++g_hclock;
    for (int t : nb.in) passed(t, now, id);
    nb.in.clear();
    nb.gen++;
}

/* CUDA Driver API, cuTensorMapEncodeTiled: each requirement of its documentation, in its order */
extern "C" CUresult cuTensorMapEncodeTiled(CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType,
                                           cuuint32_t tensorRank, void *globalAddress,
                                           const cuuint64_t *globalDim, const cuuint64_t *globalStrides,
                                           const cuuint32_t *boxDim, const cuuint32_t *elementStrides,
                                           CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                           CUtensorMapL2promotion l2Promotion,
                                           CUtensorMapFloatOOBfill oobFill) {
    if (!tensorMap || (uintptr_t)tensorMap % 64) return refuse("tensorMap address not aligned to 64 bytes");
    const int dt = (int)tensorDataType, es = esize_of(dt);
    if (dt < 0 || dt > CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B)
        return refuse("tensorDataType %d not a type", dt);
    if (!es || dt == CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ || dt == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32 ||
        dt == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ)
        return refuse("tensorDataType %d: not emulated (the byte-sized integer and float types are)", dt);
    if (tensorRank < 1 || tensorRank > 5) return refuse("tensorRank %u not in 1..5", tensorRank);
    if ((int)interleave < 0 || (int)interleave > CU_TENSOR_MAP_INTERLEAVE_32B)
        return refuse("interleave %d not a CUtensorMapInterleave", (int)interleave);
    if (interleave != CU_TENSOR_MAP_INTERLEAVE_NONE && tensorRank < 3)
        return refuse("tensorRank %u with interleave: must be >= 3", tensorRank);
    const uintptr_t ga = (uintptr_t)globalAddress;
    if (ga % 16 || (interleave == CU_TENSOR_MAP_INTERLEAVE_32B && ga % 32))
        return refuse("globalAddress %p not aligned to %d bytes", globalAddress,
                      interleave == CU_TENSOR_MAP_INTERLEAVE_32B ? 32 : 16);
    if (!globalDim || !boxDim || !elementStrides || (tensorRank > 1 && !globalStrides))
        return refuse("a NULL array");
    for (cuuint32_t i = 0; i < tensorRank; i++)
        if (globalDim[i] == 0 || globalDim[i] > ((cuuint64_t)1 << 32))
            return refuse("globalDim[%u] = %llu not in 1..2^32", i, (unsigned long long)globalDim[i]);
    for (cuuint32_t i = 0; i + 1 < tensorRank; i++) {
        const cuuint64_t s = globalStrides[i];
        const unsigned m = interleave == CU_TENSOR_MAP_INTERLEAVE_32B ? 32 : 16;
        if (s % m || s >= ((cuuint64_t)1 << 40))
            return refuse("globalStrides[%u] = %llu not a multiple of %u below 2^40", i,
                          (unsigned long long)s, m);
        /* the documentation's layout: each stride is the previous one times its dimension plus padding */
        const cuuint64_t below = i == 0 ? globalDim[0] * (cuuint64_t)es : globalStrides[i - 1] * globalDim[i];
        if (s < below)
            return refuse("globalStrides[%u] = %llu below the %llu bytes of the dimensions inside it", i,
                          (unsigned long long)s, (unsigned long long)below);
    }
    for (cuuint32_t i = 0; i < tensorRank; i++)
        if (boxDim[i] == 0 || boxDim[i] > 256) return refuse("boxDim[%u] = %u not in 1..256", i, boxDim[i]);
    if (interleave == CU_TENSOR_MAP_INTERLEAVE_NONE && boxDim[0] * (cuuint32_t)es % 16)
        return refuse("boxDim[0] * element size = %u bytes, not a multiple of 16",
                      boxDim[0] * (cuuint32_t)es);
    for (cuuint32_t i = 0; i < tensorRank; i++)
        if (elementStrides[i] == 0 || elementStrides[i] > 8)
            return refuse("elementStrides[%u] = %u not in 1..8", i, elementStrides[i]);
    const int sw = (int)swizzle;
    if (sw < 0 || sw > CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B)
        return refuse("swizzle %d not a CUtensorMapSwizzle", sw);
    if (sw > CU_TENSOR_MAP_SWIZZLE_128B)
        return refuse("swizzle %d (the 128B atom modes, compute capability 10): not emulated", sw);
    if (interleave == CU_TENSOR_MAP_INTERLEAVE_32B && swizzle != CU_TENSOR_MAP_SWIZZLE_32B)
        return refuse("interleave 32B needs swizzle 32B");
    const cuuint32_t span = swizzle == CU_TENSOR_MAP_SWIZZLE_32B    ? 32
                            : swizzle == CU_TENSOR_MAP_SWIZZLE_64B  ? 64
                            : swizzle == CU_TENSOR_MAP_SWIZZLE_128B ? 128 : 0;
    if (interleave == CU_TENSOR_MAP_INTERLEAVE_NONE && span && boxDim[0] * (cuuint32_t)es > span)
        return refuse("the box's inner dimension, %u bytes, exceeds the %u-byte swizzle span",
                      boxDim[0] * (cuuint32_t)es, span);
    if ((int)l2Promotion < 0 || (int)l2Promotion > CU_TENSOR_MAP_L2_PROMOTION_L2_256B)
        return refuse("l2Promotion %d not a CUtensorMapL2promotion", (int)l2Promotion);
    if ((int)oobFill < 0 || (int)oobFill > CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA)
        return refuse("oobFill %d not a CUtensorMapFloatOOBfill", (int)oobFill);
    if (oobFill == CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA && !is_float(dt))
        return refuse("the NaN out-of-bounds fill needs a floating-point type");
    TMap m;
    memset(&m, 0, sizeof m);
    m.magic = TM_MAGIC;
    m.addr = (uint64_t)ga;
    for (cuuint32_t i = 0; i < tensorRank; i++) {
        m.dim[i] = globalDim[i];
        m.box[i] = (uint16_t)boxDim[i];
        m.estride[i] = (uint8_t)elementStrides[i];
        if (i + 1 < tensorRank) m.stride[i] = globalStrides[i];
    }
    m.dtype = (uint8_t)dt;
    m.rank = (uint8_t)tensorRank;
    m.interleave = (uint8_t)interleave;
    m.swizzle = (uint8_t)span;
    m.oob = (uint8_t)oobFill;
    m.l2 = (uint8_t)l2Promotion;
    m.esize = (uint8_t)es;
    memset(tensorMap, 0, sizeof *tensorMap);
    memcpy(tensorMap, &m, sizeof m);
    return CUDA_SUCCESS;
}

void *emu::tensor_map_encode_tiled() { return (void *)&cuTensorMapEncodeTiled; }

/* PTX ISA, cp.async.bulk.tensor (.2d, .shared::cluster.global, .mbarrier::complete_tx::bytes,
   .tile): copies the box at tensor coordinates {c0 (innermost), c1} into shared memory at dst (128-byte
   aligned), in the map's swizzle layout; elements outside the tensor (a coordinate negative or past
   globalDim) are filled with zeros (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) and count toward the bytes; the
   copy's completion is a complete-tx of the box's bytes on the mbarrier. elementStrides[1] > 1 loads
   ceil(boxDim[1] / elementStrides[1]) rows, every elementStrides[1]-th ("cuTensorMapEncodeTiled":
   elementStrides[0] is ignored without interleave). */
void moept_emu_tma_load_2d(void *smem_dst, const void *tensor_map, int c0, int c1, uint64_t *bar) {
    KBlock k;
    if (!need(&k, "cp.async.bulk.tensor")) return;
    TMap m;
    /* an invalid copy ends the block (a GPU faults on most of these; nothing defined follows) */
    if ((uintptr_t)tensor_map % 64) {
        report("tma", WHERE ": cp.async.bulk.tensor: the tensor map at %p is not 64-byte aligned", AT(k),
               tensor_map);
        kernel_end_block();
    }
    memcpy(&m, tensor_map, sizeof m);
    if (m.magic != TM_MAGIC || m.rank != 2 || m.interleave != CU_TENSOR_MAP_INTERLEAVE_NONE) {
        report("tma", WHERE ": cp.async.bulk.tensor.2d with %s", AT(k),
               m.magic != TM_MAGIC ? "no tensor map made by cuTensorMapEncodeTiled"
               : m.rank != 2          ? "a tensor map whose rank is not 2"
                                      : "an interleaved tensor map (not emulated)");
        kernel_end_block();
    }
    /* the destination: 128-byte aligned (PTX ISA, cp.async.bulk.tensor); with a swizzle the emulator also
       wants the pattern's repeat (1024, 512, 256 bytes), where a wgmma descriptor with base offset 0
       expects the pattern to start (the swizzle is a function of the address bits: docs above) */
    const size_t align = m.swizzle ? (size_t)m.swizzle * 8 : 128;
    const size_t n0 = m.box[0], n1 = (m.box[1] + (size_t)m.estride[1] - 1) / m.estride[1], es = m.esize;
    const size_t row = n0 * es, total = row * n1;
    if (!in_dyn(smem_dst) || dyn_off(smem_dst) % align || dyn_off(smem_dst) + total > k.smem) {
        report("tma", WHERE ": cp.async.bulk.tensor destination %p: %s", AT(k), smem_dst,
               !in_dyn(smem_dst) ? "not in the dynamic shared memory"
               : dyn_off(smem_dst) % align
                   ? (m.swizzle ? "not aligned to the swizzle pattern's repeat (8 x span)"
                                : "not 128-byte aligned")
               : "the box runs past the launch's dynamic shared memory");
        kernel_end_block();
    }
    int bi = 0;
    Mbar *mb = mbar_of(k, bar, "cp.async.bulk.tensor's complete_tx", &bi);
    std::vector<char> buf(total, 0);
    bool oob = false;
    char what[160];
    snprintf(what, sizeof what, "a TMA load (cp.async.bulk.tensor) by " WHERE, AT(k));
    for (size_t j = 0; j < n1; j++) {
        const int64_t g1 = (int64_t)c1 + (int64_t)(j * m.estride[1]);
        const int64_t i0 = std::max<int64_t>(0, -(int64_t)c0);
        const int64_t i1 = std::min<int64_t>((int64_t)n0, (int64_t)m.dim[0] - c0);
        if (g1 < 0 || g1 >= (int64_t)m.dim[1] || i1 <= i0) {
            oob = true;
            continue;
        }
        if (i0 > 0 || i1 < (int64_t)n0) oob = true;
        const char *src = (const char *)m.addr + (uint64_t)g1 * m.stride[0] + (uint64_t)(c0 + i0) * es;
        const size_t len = (size_t)(i1 - i0) * es;
        int d = -1;
        find(src, &d);
        if (d < 0) {
            lose(cur_op->s->dev, cudaErrorIllegalAddress, cur_op->name.c_str(), nullptr);
            report("memcheck", "%s: reads %zu bytes at %p: host memory", what, len, (const void *)src);
            kernel_end_block();
        }
        if (!touch(src, len, 0, what)) kernel_end_block(); /* memcheck: reported, the context lost */
        memcpy(buf.data() + j * row + (size_t)i0 * es, src, len);
    }
    if (oob && m.oob == CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA)
        report("tma", WHERE ": cp.async.bulk.tensor with the NaN out-of-bounds fill: not emulated (zeros)",
               AT(k));
    const size_t base = dyn_off(smem_dst);
    for (size_t c = 0; c < total; c += 16)
        if (swz(base + c, m.swizzle) + 16 > k.smem) {
            report("tma", WHERE ": cp.async.bulk.tensor: the swizzled box runs past the launch's dynamic "
                   "shared memory", AT(k));
            kernel_end_block();
        }
    bool told = false;
    for (size_t c = 0; c < total; c += 16) {
        const size_t phys = swz(base + c, m.swizzle);
        memcpy(dyn_smem() + phys, buf.data() + c, 16);
        smem_async_write(dyn_smem() + phys, 16);
        for (size_t b = phys; b < phys + 16; b++) {
            HopByte &h = hb(b, k.blk);
            if (h.inflight && !told) {
                told = true;
                report("wgmma", WHERE ": a TMA load writes shared memory at dynamic offset %zu that a "
                       "wgmma.mma_async in flight reads (issued, not yet retired by wgmma.wait_group)", AT(k),
                       b);
            }
            h.gw = 0;
            h.tma_bar = (uint16_t)(bi + 1);
            h.tma_ph = (int32_t)mb->ph;
        }
    }
    complete_tx(k, *mb, (int64_t)total);
}

/* ---- wgmma ---- */
namespace {

/* a matrix descriptor (PTX ISA, wgmma, "Matrix Descriptor Format"): bits 0-13 the start address >> 4,
   16-29 the leading dimension byte offset (LBO) >> 4, 32-45 the stride dimension byte offset (SBO) >> 4,
   49-51 the base offset, 62-63 the swizzle (0 none, 1 128B, 2 64B, 3 32B). The operand has rows rows
   (A's M, B's N) and 32 bytes of K (16 bf16, or 32 e4m3: es bytes an element), laid out as the canonical
   layouts of "Shared Memory Matrix Layout", "Canonical Layouts" (T = 16 bytes, 8 bf16 or 16 e4m3; the
   instruction's imm-trans immediate picks the major-ness, for bf16 alone: FP8 operands are K-major).
   Below for bf16 (es 2); with e4m3 each k's 2 becomes 1 and its 8 (in T) 16:
     K-major (trans 0), no swizzle: ((8,m),(T,2k)):((1T,SBO),(1,LBO)), so element (r, k) at
                 start + (r / 8) SBO + (k / 8) LBO + (r % 8) 16 + (k % 8) 2;
     K-major, S-byte swizzle: ((8,m),(T,2k)):((S/2,SBO),(1,T)): rows of S bytes, 8 to a pattern; (r, k)
                 at swz(start + (r / 8) SBO + (r % 8) S + 2 k), the LBO unused ("assumed 1");
     MN-major (trans 1), no swizzle: ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)): (r, k) at
                 start + (r / 8) SBO + (k / 8) LBO + (k % 8) 16 + (r % 8) 2;
     MN-major, S-byte swizzle: ((T,S/16,m),(8,k)):((1,T,LBO),(S/2,SBO)): lines of S bytes along MN, one
                 a k; (r, k) at swz(start + (r / (S/2)) LBO + (k / 8) SBO + (k % 8) S + 2 (r % (S/2))).
   The base offset is 0 when the pattern starts on its repeat (1024/512/256 bytes); the emulator
   holds that (its start address's row within the repeat must be 0) and does not emulate a non-zero
   base offset, nor an MN-major start inside a line. Each element's shared offset goes to off; false
   (why) when it is invalid. */
bool decode(const KBlock &k, uint64_t desc, int rows, bool mn, int es, std::vector<uint32_t> &off,
            char *why, size_t len) {
    const size_t start = (size_t)(desc & 0x3fff) << 4, lbo = (size_t)((desc >> 16) & 0x3fff) << 4;
    const size_t sbo = (size_t)((desc >> 32) & 0x3fff) << 4;
    const int base = (int)((desc >> 49) & 7), mode = (int)(desc >> 62);
    const int span = mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 0;
    if (start >= k.smem) {
        snprintf(why, len, "start address 0x%zx outside the block's %zu bytes of dynamic shared memory",
                 start, k.smem);
        return false;
    }
    if (span) {
        const size_t rep = (size_t)span * 8;
        if (base) {
            snprintf(why, len, "base offset %d: not emulated", base);
            return false;
        }
        if ((start % rep) >> 7) {
            snprintf(why, len, "start address 0x%zx is row %zu of the %d-byte swizzle's %zu-byte pattern, "
                     "but the base offset is 0 (the pattern starting on its repeat)", start,
                     (start % rep) >> 7, span, rep);
            return false;
        }
        if (mn && start % (size_t)span) {
            snprintf(why, len, "start address 0x%zx inside an MN-major %d-byte line: not emulated", start,
                     span);
            return false;
        }
        if (!mn && start % (size_t)span + 32 > (size_t)span) {
            snprintf(why, len, "start address 0x%zx: the K slice (32 bytes) crosses its %d-byte swizzle "
                     "row", start, span);
            return false;
        }
    }
    const int K = 32 / es;
    const size_t e = (size_t)es, te = 16 / e; /* bytes an element, elements a T */
    off.resize((size_t)rows * (size_t)K);
    const size_t at = (size_t)(span ? span / 2 : 8); /* elements of a line (MN-major, bf16) */
    for (int r = 0; r < rows; r++)
        for (int kk = 0; kk < K; kk++) {
            const size_t rr = (size_t)r, k8 = (size_t)kk;
            size_t lin;
            if (!mn)
                lin = span ? start + rr / 8 * sbo + rr % 8 * (size_t)span + e * k8
                           : start + rr / 8 * sbo + k8 / te * lbo + rr % 8 * 16 + k8 % te * e;
            else
                lin = span ? start + rr / at * lbo + k8 / 8 * sbo + k8 % 8 * (size_t)span + 2 * (rr % at)
                           : start + rr / 8 * sbo + k8 / 8 * lbo + k8 % 8 * 16 + rr % 8 * 2;
            const size_t p = swz(lin, span);
            if (p + e > k.smem) {
                snprintf(why, len, "element (%d, %d) at shared address 0x%zx is outside the block's %zu "
                         "bytes of dynamic shared memory", r, kk, p, k.smem);
                return false;
            }
            off[(size_t)r * (size_t)K + (size_t)kk] = (uint32_t)p;
        }
    return true;
}

float bf16(const char *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* D = A B (+ D): each product of two bf16 (or e4m3) values is exact in fp32 (8-bit significands, or
   4-bit; barring underflow), and the K (16, or 32) are added to the accumulator in k order, each
   addition rounded to nearest even in fp32 (a plain fp32 loop over k gives the same bits); the tensor
   cores' own order and precision are not emulated (their FP8 sums keep fewer bits: the kernels promote
   them into fp32 every 128 of K). The D fragment of .m64nNk16 and .m64nNk32 with fp32
   accumulators (PTX ISA, wgmma, "Matrix Fragments for wgmma.mma_async.m64nNk16", accumulator D; the
   k32 shapes' D is the same):
   thread lane l of the warpgroup
   (warp w = l / 32, g = (l % 32) / 4, q = l % 4) holds in register i (0 <= i < N/2)
     row = 16 w + g + 8 ((i >> 1) & 1),  col = 8 (i >> 2) + 2 q + (i & 1). */
void compute(const WgOp &op) {
    const char *s = dyn_smem();
    const size_t K = (size_t)(32 / op.es), n = (size_t)op.n;
    auto val = [&](uint32_t o) { return op.es == 2 ? bf16(s + o) : e4m3_value((uint8_t)s[o]); };
    auto at = [n](int l, int i) { /* thread l's register i: its element of D [64][n] */
        const int w = l / 32, g = (l % 32) / 4, q = l % 4;
        return (size_t)(16 * w + g + 8 * ((i >> 1) & 1)) * n + (size_t)(8 * (i >> 2) + 2 * q + (i & 1));
    };
    std::vector<float> a(64 * K), bt(K * n), dm(64 * n); /* A [64][K], B by k then column, D */
    for (size_t i = 0; i < a.size(); i++) a[i] = val(op.offa[i]);
    for (size_t i = 0; i < bt.size(); i++) bt[i % K * n + i / K] = val(op.offb[i]);
    for (int l = 0; l < WG; l++)
        for (int i = 0; i < op.n / 2; i++) dm[at(l, i)] = op.scale ? op.d[l][i] : 0.0f;
    typedef float f8 __attribute__((vector_size(32))); /* (8 columns at once, each as the scalar sum: the
                                                           emulator's time is mostly this loop; N % 8 0) */
    for (size_t r = 0; r < 64; r++) /* (each element's sum in k order: the columns side by side) */
        for (size_t kk = 0; kk < K; kk++) {
            const float av = a[r * K + kk];
            for (size_t c = 0; c < n; c += 8) {
                f8 dv, bv;
                memcpy(&dv, &dm[r * n + c], sizeof dv);
                memcpy(&bv, &bt[kk * n + c], sizeof bv);
                dv += av * bv;
                memcpy(&dm[r * n + c], &dv, sizeof dv);
            }
        }
    for (int l = 0; l < WG; l++)
        for (int i = 0; i < op.n / 2; i++) op.d[l][i] = dm[at(l, i)];
}

void retire(WgOp *op) {
    for (uint32_t o : op->bytes) {
        HopByte &h = hb(o, B.blk);
        if (h.inflight) h.inflight--;
    }
    for (int l = 0; l < WG; l++) {
        std::vector<Range> &v = B.acc[(size_t)(op->wg * WG + l)];
        v.erase(std::remove_if(v.begin(), v.end(), [op](const Range &r) { return r.op == op; }), v.end());
    }
    compute(*op);
}

/* wgmma.mma_async issued by warpgroup wg (its 128 threads' arguments in g.args) */
void issue(const KBlock &k, int wg, Wg &g) {
    const Args &a0 = g.args[0];
    char why[300];
    /* PTX ISA, wgmma.mma_async, "Matrix Shape": .m64nNk16 with bf16, .m64nNk32 with e4m3, N a multiple
       of 8 in 8..256 */
    if (a0.n < 8 || a0.n > 256 || a0.n % 8) {
        report("wgmma", WHERE ": wgmma.mma_async.m64n%dk%d: N must be a multiple of 8 in 8..256", AT(k),
               a0.n, 32 / a0.es);
        kernel_end_block();
    }
    std::unique_ptr<WgOp> op(new WgOp());
    op->da = a0.da;
    op->db = a0.db;
    op->n = a0.n;
    op->scale = a0.scale;
    op->trans = a0.trans;
    op->es = a0.es;
    op->wg = wg;
    op->told = op->lost = false;
    const bool bad_a = !decode(k, a0.da, 64, a0.trans & 1, a0.es, op->offa, why, sizeof why);
    if (bad_a || !decode(k, a0.db, a0.n, (a0.trans & 2) != 0, a0.es, op->offb, why, sizeof why)) {
        const bool ne = strstr(why, "not emulated") != nullptr;
        report(ne ? "runtime" : "wgmma", WHERE ": wgmma.mma_async %s descriptor 0x%016llx: %s", AT(k),
               bad_a ? "A" : "B", (unsigned long long)(bad_a ? a0.da : a0.db), why);
        kernel_end_block();
    }
    const char *stk[WG];
    for (int l = 0; l < WG; l++) {
        const int t = wg * WG + l;
        op->d[l] = g.args[l].d;
        stk[l] = fiber_stack(t);
        if ((const char *)op->d[l] < stk[l] || (const char *)(op->d[l] + a0.n / 2) > stk[l] + FIBER_STACK) {
            report("runtime", WHERE ": wgmma.mma_async accumulators at %p: not in thread %d's registers (its "
                   "stack, in the emulator): not emulated", AT(k), (void *)op->d[l], t);
            kernel_end_block();
        }
    }
    /* PTX ISA, wgmma.fence: required before the first wgmma.mma_async of a warpgroup, and between any
       other access of its registers (accumulator or A fragment) and a wgmma.mma_async that accesses
       them (accumulating across wgmma.mma_async of one shape excepted) */
    for (int l = 0; l < WG; l++) {
        const int t = wg * WG + l;
        const uint32_t f = B.wfence[(size_t)t];
        const size_t lo = (size_t)((const char *)op->d[l] - stk[l]) / 4;
        bool hit = f == 0;
        for (size_t w = lo; !hit && g_stamp && w < lo + (size_t)a0.n / 2; w++)
            hit = g_stamp[(size_t)t * (FIBER_STACK / 4) + w] >= f;
        if (hit) {
            report("wgmma", WHERE ": wgmma.mma_async, but thread %d %s", AT(k), t,
                   f == 0 ? "executed no wgmma.fence in this block before it"
                          : "accessed its accumulators since its last wgmma.fence (wgmma.fence is required "
                            "between another access of the registers and the wgmma.mma_async)");
            break;
        }
    }
    /* the operands: defined, visible to the async proxy, complete; their bytes once each (g_mark: the
       issue that last took a byte) */
    static std::vector<uint64_t> g_mark(DYN_SMEM_MAX, 0);
    static uint64_t g_issue = 0;
    g_issue++;
    std::vector<uint32_t> bytes;
    bytes.reserve((op->offa.size() + op->offb.size()) * (size_t)a0.es);
    for (int ab = 0; ab < 2; ab++)
        for (uint32_t o : ab ? op->offb : op->offa)
            for (uint32_t b = o; b < o + (uint32_t)a0.es; b++)
                if (g_mark[b] != g_issue) {
                    g_mark[b] = g_issue;
                    bytes.push_back(b);
                }
    std::vector<int64_t> robs(B.mbars.size(), INT64_MAX); /* the warpgroup's least observed phases */
    for (size_t m = 0; m < B.mbars.size(); m++)
        for (int l = 0; l < WG; l++) robs[m] = std::min(robs[m], B.mbars[m].obs[(size_t)(wg * WG + l)]);
    bool told = false;
    std::vector<uint32_t> okst((size_t)B.n, 0); /* per storing thread: a stamp of its found ordered */
    for (uint32_t o : bytes) {
        HopByte &h = hb(o, k.blk);
        /* (written in this block: by a generic store, which hop_shared records where the kernels' unit is
           instrumented, or by a TMA load; the one check of its byte's shadow, not the racecheck's too) */
        if (!told && kernel_hooks() && !h.gw && !h.tma_bar) {
            told = true;
            report("initcheck", WHERE ": wgmma.mma_async reads shared memory at dynamic offset %u that no "
                   "thread or TMA load of the block wrote", AT(k), o);
        }
        /* PTX ISA, "Memory Consistency Model", proxies: a generic-proxy store read by the async proxy
           (wgmma's shared-memory operands) needs a fence.proxy.async between them by the storing thread */
        if (!told && h.gw && B.pfence[h.gw_t] <= h.gw_stamp) {
            told = true;
            report("proxy", WHERE ": wgmma.mma_async reads shared memory at dynamic offset %u that thread %d "
                   "stored with no fence.proxy.async since", AT(k), o, h.gw_t);
        }
        /* ... and the store, fenced, must happen before the issue: a barrier (bar.sync, __syncthreads) or
           an mbarrier phase after the storing thread's fence, ordering it before every thread of the
           warpgroup ("Memory Consistency Model", causality order: ordered()) */
        const bool again = h.gw && (okst[h.gw_t] == h.gw_stamp + 1 || /* (a store's bytes: once) */
                                    ordered_wg(h.gw_t, h.gw_stamp, robs));
        for (int l = 0; !told && h.gw && !again && l < WG; l++)
            if (!ordered(h.gw_t, h.gw_stamp, wg * WG + l)) {
                told = true;
                report("proxy", WHERE ": wgmma.mma_async reads shared memory at dynamic offset %u that "
                       "thread %d stored, but no barrier that it passed after a fence.proxy.async and "
                       "thread %d passed too, nor an mbarrier phase it arrived on after one and thread %d "
                       "saw complete, ordered that before the wgmma", AT(k), o, h.gw_t, wg * WG + l,
                       wg * WG + l);
            }
        if (h.gw && !told) okst[h.gw_t] = h.gw_stamp + 1;
        if (!told && h.tma_bar && robs[(size_t)h.tma_bar - 1] < h.tma_ph) { /* (robs: which thread, if one
                                                                             did not wait) */
            const Mbar &m = B.mbars[(size_t)h.tma_bar - 1];
            for (int l = 0; l < WG && !told; l++)
                if (m.obs[(size_t)(wg * WG + l)] < h.tma_ph) {
                    told = true;
                    report("tma", WHERE ": wgmma.mma_async reads shared memory at dynamic offset %u that a "
                           "TMA load writes, but thread %d did not wait on the mbarrier phase that completes "
                           "it (mbarrier %p, phase %d)", AT(k), o, wg * WG + l, m.addr, h.tma_ph);
                }
        }
        h.inflight++;
    }
    op->bytes.swap(bytes);
    for (int l = 0; l < WG; l++) {
        const size_t lo = (size_t)((const char *)op->d[l] - stk[l]);
        B.acc[(size_t)(wg * WG + l)].push_back(Range{lo, lo + (size_t)a0.n / 2 * 4, op.get()});
    }
    g.open.push_back(op.get());
    B.ops.push_back(std::move(op));
}

bool wg_released(void *p) {
    const WaitRec *w = (const WaitRec *)p;
    return w->wg->gen != w->gen;
}

/* a .sync.aligned instruction: every thread of the warpgroup executes the same one (PTX ISA, wgmma:
   ".sync ... the executing thread waits until all threads in the warp(group) execute the same
   instruction"; ".aligned ... all threads in the warpgroup must execute the same instruction") */
void collective(Args a) {
    KBlock k;
    if (!need(&k, KNAME[a.kind])) return;
    const int wg = k.t / WG;
    if ((wg + 1) * WG > k.nthreads) {
        report("wgmma", WHERE ": %s, but its warpgroup %d has %d of the 128 threads (4 whole warps) it needs",
               AT(k), KNAME[a.kind], wg, k.nthreads - wg * WG);
        kernel_end_block();
    }
    Wg &g = B.wgs[(size_t)wg];
    g.args[k.t % WG] = a;
    if (++g.arrived < WG) {
        WaitRec &w = B.wait[(size_t)k.t];
        w.wg = &g;
        w.gen = g.gen;
        kernel_block(wg_released, &w, KNAME[a.kind]);
        return;
    }
    for (int l = 1; l < WG; l++) {
        const Args &x = g.args[l], &y = g.args[0];
        if (x.kind != y.kind || x.n != y.n || x.scale != y.scale || x.trans != y.trans || x.da != y.da ||
            x.db != y.db || x.es != y.es) {
            report("wgmma", WHERE ": warpgroup %d: thread %d executes %s (n %d, scale-d %d, descriptors "
                   "0x%llx 0x%llx) where thread %d executes %s (n %d, scale-d %d, 0x%llx 0x%llx): the 128 "
                   "threads must execute the same .sync.aligned instruction", AT(k), wg, wg * WG + l,
                   KNAME[x.kind], x.n, x.scale, (unsigned long long)x.da, (unsigned long long)x.db, wg * WG,
                   KNAME[y.kind], y.n, y.scale, (unsigned long long)y.da, (unsigned long long)y.db);
            kernel_end_block();
        }
    }
    switch (a.kind) {
    case K_FENCE: {
        const uint32_t f = ++g_hclock;
        for (int l = 0; l < WG; l++) B.wfence[(size_t)(wg * WG + l)] = f;
        break;
    }
    case K_MMA: issue(k, wg, g); break;
    case K_COMMIT: /* PTX ISA, wgmma.commit_group: the uncommitted wgmma.mma_async (maybe none) form a
                      group */
        g.groups.push_back(g.open);
        g.open.clear();
        break;
    case K_WAIT: /* wgmma.wait_group N: until at most N of the newest groups are pending, all older
                    complete */
        while (g.groups.size() > (size_t)(a.n < 0 ? 0 : a.n)) {
            for (WgOp *op : g.groups.front()) retire(op);
            g.groups.pop_front();
        }
        break;
    }
    g.arrived = 0;
    g.gen++;
}

}  // namespace

void moept_emu_wgmma_fence(void) { collective(Args{K_FENCE, 0, 0, 0, 0, 0, nullptr, 2}); }
void moept_emu_wgmma_bf16(float *d, int n, uint64_t desc_a, uint64_t desc_b, int scale_d, int trans_a,
                          int trans_b) {
    /* PTX ISA, wgmma.mma_async: imm-trans-a and imm-trans-b are 0 or 1 (transpose only for .f16/.bf16) */
    collective(Args{K_MMA, n, scale_d != 0, (trans_a != 0) | (trans_b != 0) << 1, desc_a, desc_b, d, 2});
}
/* the FP8 variant: no transpose immediates (K-major A and B) */
void moept_emu_wgmma_e4m3(float *d, int n, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    collective(Args{K_MMA, n, scale_d != 0, 0, desc_a, desc_b, d, 1});
}
void moept_emu_wgmma_commit(void) { collective(Args{K_COMMIT, 0, 0, 0, 0, 0, nullptr, 2}); }
void moept_emu_wgmma_wait(int n) { collective(Args{K_WAIT, n, 0, 0, 0, 0, nullptr, 2}); }
