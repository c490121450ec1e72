/* emu_kernel.cc - kernels on the CPU: launches, blocks, fibers, barriers,
   and the per-access checks (memcheck, racecheck, synccheck, hazards).

   A launch is an op on its stream. It runs the grid's blocks one at a time
   (one lock over all devices: __shared__ variables are one static section),
   in a seeded shuffled order; each block's threads are fibers on stacks of
   their own, run in a fresh shuffled order between barriers. The kernels'
   translation unit is compiled with -fsanitize=thread's instrumentation but
   linked without its runtime: every load and store calls the __tsan_*
   functions below, which check it:
     - in a kernel: device memory of the launch's device, inside a live
       allocation (memcheck), ordered after other streams' ops (hazard);
       __shared__ bytes (static storage): no two threads of the block
       touching a byte between barriers with one writing (racecheck), no
       read before the block wrote it (initcheck); constants may be read;
       the thread's own stack; anything else is host memory (memcheck);
     - in host code of moept_kernels.cu: device memory is never read or
       written (memcheck). */
#include "emu_internal.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <sys/mman.h>
#include <ucontext.h>

#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

/* the executable's static storage (.data, .bss): where __shared__ variables
   are; and its read-only part (text, constants) */
extern "C" char __data_start[], _end[], __executable_start[];

namespace emu {

constexpr size_t STACK = FIBER_STACK;
constexpr int MAXTHREADS = 1024;

/* F_WAIT: at a __syncthreads; F_BLOCK: in an emulator wait (kernel_block: an mbarrier, a warpgroup's
   .sync.aligned instruction) until its ready() holds */
enum { F_NEW, F_READY, F_WAIT, F_BLOCK, F_EXIT };

struct Fiber {
#if defined(__x86_64__)
    void *sp;
#else
    ucontext_t uc;
#endif
    char *lo;               /* stack bottom */
    int state, line;
    uint3 tid;
    void *fake;             /* ASan's fake stack while switched out */
    bool (*ready)(void *);  /* F_BLOCK: what it waits for */
    void *warg;
    const char *what;
};

/* one block in flight on this worker */
struct Exec {
    Op *op;
    const char *name;
    const std::vector<char> *blob; /* the kernel and its arguments */
    void (*invoke)(void *);
    uint3 bid;
    dim3 bd, gd;
    Fiber *f;               /* [MAXTHREADS] */
    int cur;                /* running fiber, -1: the scheduler */
#if defined(__x86_64__)
    void *sched_sp;
#else
    ucontext_t sched;
#endif
    const void *sched_lo;
    size_t sched_size;
    void *sched_fake;
    uint32_t epoch;         /* barrier interval, for racecheck */
    uint32_t blk;           /* block serial, for initcheck */
    size_t smem;            /* the launch's dynamic shared memory bytes */
    bool ended;             /* kernel_end_block: the block ends now */
    int arch;               /* the device's compute capability at the launch (10 major + minor) */
};

static thread_local Exec *X;
static Fiber *g_fibers;              /* the stacks (one block runs at a time: one set) */
static std::mutex g_sm;              /* one block at a time, process-wide */
static uint32_t g_epoch;
static uint64_t g_seed;

/* racecheck shadow of the __shared__ section, per byte */
struct SharedShadow {        /* a byte's accesses in the block's barrier interval (epoch: __syncthreads) */
    uint32_t wep, rep, blk;  /* blk: the block that first touched it */
    uint32_t wst, rst[4];    /* the clock (hop_clock) at the write, at each read */
    uint16_t wt, rt[4];      /* the writer, the readers (nr of them; 5: more than 4) */
    uint8_t nr;
    uint32_t many;           /* (nr 5) its entry of g_many + 1, this block's */
};
static uint32_t g_block;
static SharedShadow *g_sh;
/* a byte's readers past the shadow's four in its barrier interval (nr 5): every one of them, with the clock
   at the latest read. A write is ordered after them where a named barrier each passed after that clock
   orders it (hop_ordered: PTX ISA, "bar, barrier"; sound, as an earlier read is ordered by the same
   barrier; stricter only where the reads span a barrier), so a group's word that all its threads read and one rewrites after their bar.sync is clean.
   One entry a byte that had them, reused; the block's alone (cleared as each block starts) */
struct ManyReaders {
    uint32_t ep, st;
    uint64_t t[MAXTHREADS / 64];
};
static std::vector<ManyReaders> g_many;
/* ... byte s's entry, made (or reused) for a fifth reader in epoch ep: the four it had in it */
static ManyReaders *many_start(SharedShadow &s, uint32_t ep) {
    if (!s.many || s.many > g_many.size()) {
        g_many.emplace_back();
        s.many = (uint32_t)g_many.size();
    }
    ManyReaders &m = g_many[s.many - 1];
    m = ManyReaders{ep, 0, {}};
    for (int r = 0; r < 4; r++) m.t[s.rt[r] / 64] |= 1ull << (s.rt[r] % 64);
    return &m;
}
/* ... the first of byte s's readers that no barrier orders before thread t's write (-1: none) */
static int many_unordered(const SharedShadow &s, int t, uint32_t ep) {
    if (!s.many || s.many > g_many.size() || g_many[s.many - 1].ep != ep) return 0; /* (unknown: report) */
    const ManyReaders &m = g_many[s.many - 1];
    for (int w = 0; w < MAXTHREADS / 64; w++)
        for (uint64_t b = m.t[w]; b; b &= b - 1) {
            const int r = 64 * w + __builtin_ctzll(b);
            if (r != t && !hop_ordered(r, m.st, t)) return r;
        }
    return -1;
}

/* the dynamic shared memory (extern __shared__ on a GPU; moept_emu_dyn_smem): static storage, so the
   shared-memory checks above cover it; a launch's bytes are its first smem */
alignas(1024) static char g_dyn[DYN_SMEM_MAX];
char *dyn_smem() { return g_dyn; }

#if defined(__x86_64__)
extern "C" void moept_emu_swap(void **save, void *to);
extern "C" void moept_emu_fiber_start(void);
asm(".text\n"
    ".globl moept_emu_swap\n"
    ".type moept_emu_swap,@function\n"
    "moept_emu_swap:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".globl moept_emu_fiber_start\n"
    ".type moept_emu_fiber_start,@function\n"
    "moept_emu_fiber_start:\n"
    "  call moept_emu_fiber_main\n"
    "  ud2\n");
#endif

static void to_fiber(Fiber *f) {
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_start_switch_fiber(&X->sched_fake, f->lo, STACK);
#endif
#if defined(__x86_64__)
    moept_emu_swap(&X->sched_sp, f->sp);
#else
    swapcontext(&X->sched, &f->uc);
#endif
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(X->sched_fake, nullptr, nullptr);
#endif
}

static void to_sched(Fiber *f, bool exiting) {
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_start_switch_fiber(exiting ? nullptr : &f->fake, X->sched_lo, X->sched_size);
#else
    (void)exiting;
#endif
#if defined(__x86_64__)
    moept_emu_swap(&f->sp, X->sched_sp);
#else
    swapcontext(&f->uc, &X->sched);
#endif
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(f->fake, nullptr, nullptr);
#endif
}

extern "C" void moept_emu_fiber_main(void) {
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(nullptr, &X->sched_lo, &X->sched_size);
#endif
    /* this thread's copy of the parameters, on its own stack (128-byte aligned: a CUtensorMap
       parameter keeps its alignment) */
    size_t n = X->blob->size();
    alignas(128) char args[512];
    char *a = n <= sizeof args ? args : (char *)__builtin_alloca_with_align(n, 1024);
    memcpy(a, X->blob->data(), n);
    X->invoke(a);
    if (hop_on) hop_exit(X->cur);
    Fiber *f = &X->f[X->cur];
    f->state = F_EXIT;
    to_sched(f, true);
    abort(); /* never resumed */
}

static void fiber_init(Fiber *f) {
#ifdef __SANITIZE_ADDRESS__
    __asan_unpoison_memory_region(f->lo, STACK);
#endif
#if defined(__x86_64__)
    uintptr_t top = ((uintptr_t)f->lo + STACK) & ~(uintptr_t)15;
    void **sp = (void **)(top - 80);
    memset(sp, 0, 80);
    uint32_t csr[2];
    asm volatile("stmxcsr %0\n fnstcw %1" : "=m"(csr[0]), "=m"(csr[1]));
    memcpy(sp, csr, 8);           /* mxcsr, x87 control word */
    sp[7] = (void *)moept_emu_fiber_start; /* after 6 registers: the return address */
    f->sp = sp;
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->lo;
    f->uc.uc_stack.ss_size = STACK;
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, moept_emu_fiber_main, 0);
#endif
}

static Fiber *fibers() { /* under g_sm */
    if (!g_fibers) {
        g_fibers = (Fiber *)calloc(MAXTHREADS, sizeof(Fiber));
        char *m = (char *)mmap(nullptr, MAXTHREADS * (STACK + PAGE), PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) { fprintf(stderr, "moept-emu: no memory for fiber stacks\n"); abort(); }
        for (int i = 0; i < MAXTHREADS; i++) {
            mprotect(m + i * (STACK + PAGE), PAGE, PROT_NONE); /* overflow faults */
            g_fibers[i].lo = m + i * (STACK + PAGE) + PAGE;
        }
    }
    return g_fibers;
}

static uint64_t rnd(uint64_t *s) {
    *s += 0x9e3779b97f4a7c15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static void shuffle(std::vector<int> &v, uint64_t *s) {
    for (size_t i = v.size(); i > 1; i--) std::swap(v[i - 1], v[rnd(s) % i]);
}

/* the block cannot go on (a deadlock): what its threads wait in, reported as a GPU's hang */
static void deadlock(Exec *x, int n) {
    int wait = 0, block = 0, exited = 0, line = -1, first = -1;
    const char *what = nullptr;
    for (int i = 0; i < n; i++) {
        const Fiber &fi = x->f[i];
        if (fi.state == F_EXIT) exited++;
        else if (fi.state == F_WAIT) { wait++; if (line < 0) line = fi.line; }
        else if (fi.state == F_BLOCK) { block++; if (first < 0) { first = i; what = fi.what; } }
    }
    char at[64] = "";
    if (wait) snprintf(at, sizeof at, " (line %d)", line);
    /* a warpgroup's .sync.aligned instruction that some of its 128 threads never reach (PTX ISA, wgmma:
       .sync.aligned requires every thread of the warpgroup to execute the same instruction) */
    const bool wg = what && !strncmp(what, "wgmma", 5);
    report(wg ? "wgmma" : "hang", "kernel %s block (%u,%u,%u): %s%s: %d thread(s) wait in %s (first: thread "
           "%d), %d at __syncthreads%s, %d exited: nothing left to run (a GPU would hang)", x->name, x->bid.x,
           x->bid.y, x->bid.z, wg ? "not every thread of a warpgroup executes " : "deadlock", wg ? what : "",
           block, what ? what : "?", first, wait, at, exited);
}

/* one block: phases between barriers, each in a fresh order; within a phase, passes over the
   threads until none can run (a thread blocked in an emulator wait runs again once its ready() holds) */
static void run_block(Exec *x, int n, uint64_t *seed) {
    Fiber *f = x->f;
    for (int i = 0; i < n; i++) {
        f[i].state = F_NEW;
        f[i].tid = make_uint3((unsigned)(i % x->bd.x), (unsigned)(i / x->bd.x % x->bd.y), (unsigned)(i / (x->bd.x * x->bd.y)));
    }
    std::vector<int> order(n);
    for (int i = 0; i < n; i++) order[i] = i;
    for (;;) {
        x->epoch = ++g_epoch;
        shuffle(order, seed);
        for (bool ran = true; ran;) {
            ran = false;
            for (int i : order) {
                if (f[i].state == F_BLOCK && f[i].ready(f[i].warg)) f[i].state = F_READY;
                if (f[i].state == F_NEW) fiber_init(&f[i]);
                if (f[i].state == F_NEW || f[i].state == F_READY) {
                    f[i].state = F_READY;
                    x->cur = i;
                    to_fiber(&f[i]);
                    x->cur = -1;
                    ran = true;
                    if (x->ended) { /* kernel_end_block: its threads are not resumed */
                        for (int j = 0; j < n; j++) f[j].state = F_EXIT;
                        return;
                    }
                }
            }
        }
        int waiting = 0, blocked = 0, exited = 0, line = -1, line2 = -1;
        for (int i = 0; i < n; i++) {
            if (f[i].state == F_EXIT) exited++;
            if (f[i].state == F_BLOCK) blocked++;
            if (f[i].state == F_WAIT) {
                waiting++;
                if (line < 0) line = f[i].line;
                else if (f[i].line != line) line2 = f[i].line;
            }
        }
        if (!waiting && !blocked) return;
        if (blocked) { /* nothing runs and nothing can release them */
            deadlock(x, n);
            for (int i = 0; i < n; i++) f[i].state = F_EXIT;
            return;
        }
        if (exited || line2 >= 0) {
            char other[48] = "";
            if (line2 >= 0) snprintf(other, sizeof other, "; others wait at line %d", line2);
            report("synccheck", "kernel %s block (%u,%u,%u): __syncthreads() at line %d reached by %d of %d threads "
                   "(%d exited%s)", x->name, x->bid.x, x->bid.y, x->bid.z, line, waiting, n, exited, other);
            /* the block cannot go on as CUDA defines it: end it */
            for (int i = 0; i < n; i++) f[i].state = F_EXIT;
            return;
        }
        if (hop_on) hop_barrier();
        for (int i = 0; i < n; i++) f[i].state = F_READY;
    }
}

static void run_kernel(Op &o, const char *name, dim3 g, dim3 b, size_t smem, const std::vector<char> &blob,
                       void (*invoke)(void *), int arch) {
    std::lock_guard<std::mutex> lk(g_sm);
    Exec x;
    memset((void *)&x, 0, sizeof x);
    x.op = &o;
    x.name = name;
    x.blob = &blob;
    x.invoke = invoke;
    x.bd = b;
    x.gd = g;
    x.smem = smem;
    x.arch = arch;
    x.f = fibers();
    x.cur = -1;
    const int n = (int)(b.x * b.y * b.z);
    uint64_t nb = (uint64_t)g.x * g.y * g.z;
    uint64_t seed = g_seed ^ (o.epoch * 0x2545f4914f6cdd1dull) ^ ((uint64_t)o.s->id << 48);
    std::vector<int> border;
    if (nb <= (1u << 22)) {
        border.resize(nb);
        for (uint64_t i = 0; i < nb; i++) border[i] = (int)i;
        shuffle(border, &seed);
    }
    X = &x;
    for (uint64_t k = 0; k < nb; k++) {
        uint64_t i = border.empty() ? k : (uint64_t)border[k];
        x.bid = make_uint3((unsigned)(i % g.x), (unsigned)(i / g.x % g.y), (unsigned)(i / ((uint64_t)g.x * g.y)));
        x.blk = ++g_block; /* shared memory starts undefined */
        g_many.clear();
        hop_block();
        run_block(&x, n, &seed);
        if (x.ended) break; /* kernel_end_block: the launch ends there */
    }
    X = nullptr;
}

/* ---- the per-access check ------------------------------------------------ */
static void shared_access(const char *p, size_t n, int write) {
    Exec *x = X;
    const uint16_t t = (uint16_t)x->cur;
    size_t off = (size_t)(p - __data_start);
    if (p + n > g_dyn && p < g_dyn + DYN_SMEM_MAX) { /* dynamic shared memory: the launch's bytes */
        if (p < g_dyn || p + n > g_dyn + x->smem) {
            const uint3 ti = x->f[t].tid;
            lose(x->op->s->dev, cudaErrorIllegalAddress, x->op->name.c_str(), nullptr);
            report("memcheck", "kernel %s block (%u,%u,%u) thread (%u,%u,%u): %s of %zu bytes at dynamic "
                   "shared memory offset %td: past the launch's %zu bytes", x->name, x->bid.x, x->bid.y,
                   x->bid.z, ti.x, ti.y, ti.z, write ? "write" : "read", n, p - g_dyn, x->smem);
            return;
        }
        hop_shared(t, (size_t)(p - g_dyn), n, write);
    }
    for (size_t i = 0; i < n; i++) {
        SharedShadow &s = g_sh[off + i];
        const char *kind = nullptr;
        int other = -1;
        if (s.blk != x->blk) {
            s.blk = x->blk;
            s.wep = s.rep = 0;
            s.many = 0;
            if (!write) {
                report("initcheck", "kernel %s block (%u,%u,%u) thread %d reads shared memory at %p that no thread "
                       "of the block wrote", x->name, x->bid.x, x->bid.y, x->bid.z, t, (const void *)(p + i));
                return;
            }
        }
        /* (an access the epoch does not order may be ordered by a named barrier both threads passed) */
        if (s.wep == x->epoch && s.wt != t && !hop_ordered(s.wt, s.wst, t)) {
            kind = write ? "write after write" : "read after write";
            other = s.wt;
        }
        for (int q = 0; write && !kind && s.rep == x->epoch && q < s.nr; q++) {
            const int r = q == 4 ? many_unordered(s, t, x->epoch)
                                 : s.rt[q] != t && !hop_ordered(s.rt[q], s.rst[q], t) ? s.rt[q] : -1;
            if (r >= 0) kind = "write after read", other = r;
        }
        if (kind) {
            report("racecheck", "kernel %s block (%u,%u,%u): thread %d %s %zu bytes of shared memory at offset %zu: "
                   "%s with thread %d since the last barrier", x->name, x->bid.x, x->bid.y, x->bid.z, t,
                   write ? "writes" : "reads", n, off, kind, other);
            return;
        }
        if (write) { /* (ordered after every read so far: later accesses are checked against it alone) */
            s.wep = x->epoch; s.wt = t; s.wst = hop_clock();
            s.rep = 0;
            continue;
        }
        if (s.rep != x->epoch) { s.rep = x->epoch; s.nr = 0; }
        int q = 0;
        while (q < s.nr && q < 4 && s.rt[q] != t) q++;
        if (q == 4) { /* (a fifth reader or more: all of them, at the latest read's clock) */
            ManyReaders *m = s.nr == 4 ? many_start(s, x->epoch) : &g_many[s.many - 1];
            m->t[t / 64] |= 1ull << (t % 64);
            m->st = hop_clock();
            s.nr = 5;
        } else {
            s.rt[q] = t;
            s.rst[q] = hop_clock();
            if (q == s.nr) s.nr++;
        }
    }
}

/* the access kernel_access checks (one block runs at a time), described for a report */
static thread_local int g_kwrite;
void kernel_what(char *buf, size_t len) {
    const Exec *x = X;
    const uint3 t = x && x->cur >= 0 ? x->f[x->cur].tid : make_uint3(0, 0, 0);
    const uint3 b = x ? x->bid : make_uint3(0, 0, 0);
    snprintf(buf, len, "%s by block (%u,%u,%u) thread (%u,%u,%u)", g_kwrite ? "write" : "read", b.x, b.y, b.z,
             t.x, t.y, t.z);
}

static bool g_hooks; /* a kernel's access reached these hooks: the kernels' unit is instrumented */
bool kernel_hooks() { return g_hooks; }

static void kernel_access(const char *p, size_t n, int write) {
    Exec *x = X;
    g_hooks = true;
    if (p >= __data_start && p < _end) return shared_access(p, n, write);
    if (!write && p >= __executable_start && p < __data_start) return; /* code and constants */
    if (x->cur >= 0) {
        const char *lo = x->f[x->cur].lo;
        if (p >= lo && p < lo + STACK) { /* the thread's own stack */
            if (hop_on) hop_stack(x->cur, (size_t)(p - lo), n, write);
            return;
        }
    }
    int d;
    Alloc *a = find(p, &d);
    const uint3 t = x->cur >= 0 ? x->f[x->cur].tid : make_uint3(0, 0, 0);
    /* a fault loses the device's context (lose) before the report says why */
    if ((n & (n - 1)) == 0 && n <= 16 && (uintptr_t)p % n) { /* a GPU faults on these */
        lose(x->op->s->dev, cudaErrorMisalignedAddress, x->op->name.c_str(), nullptr);
        report("memcheck", "kernel %s block (%u,%u,%u) thread (%u,%u,%u): misaligned %s of %zu bytes at %p",
               x->name, x->bid.x, x->bid.y, x->bid.z, t.x, t.y, t.z, write ? "write" : "read", n,
               (const void *)p);
        return;
    }
    if (d < 0) {
        lose(x->op->s->dev, cudaErrorIllegalAddress, x->op->name.c_str(), nullptr);
        report("memcheck", "kernel %s block (%u,%u,%u) thread (%u,%u,%u): %s of %zu bytes at %p: host memory",
               x->name, x->bid.x, x->bid.y, x->bid.z, t.x, t.y, t.z, write ? "write" : "read", n, (const void *)p);
        return;
    }
    if (d != x->op->s->dev || !a || !a->live || p + n > a->base + a->size) {
        lose(x->op->s->dev, cudaErrorIllegalAddress, x->op->name.c_str(), nullptr);
        report("memcheck", "kernel %s block (%u,%u,%u) thread (%u,%u,%u): %s of %zu bytes at %p: %s", x->name,
               x->bid.x, x->bid.y, x->bid.z, t.x, t.y, t.z, write ? "write" : "read", n, (const void *)p,
               d != x->op->s->dev ? "another device's memory" : !a ? "outside every allocation"
               : !a->live ? "freed memory" : "past the end of its allocation");
        return;
    }
    g_kwrite = write;
    touch(p, n, write, nullptr);
}

static inline void access(const void *p, size_t n, int write) {
    if (X) return kernel_access((const char *)p, n, write);
    if (cur_op) return;
    int d;
    find(p, &d);
    if (d >= 0)
        report("memcheck", "host code (an instrumented unit) %s %zu bytes of device %d's memory at %p",
               write ? "writes" : "reads", n, d, p);
}

}  // namespace emu

using namespace emu;

/* ---- what the kernels' translation unit calls --------------------------- */
uint3 moept_emu_thread_idx(void) { return X->f[X->cur].tid; }
uint3 moept_emu_block_idx(void) { return X->bid; }
dim3 moept_emu_block_dim(void) { return X->bd; }
dim3 moept_emu_grid_dim(void) { return X->gd; }

void moept_emu_syncthreads(int line) {
    Fiber *f = &X->f[X->cur];
    f->state = F_WAIT;
    f->line = line;
    to_sched(f, false);
}

/* ---- sm_89's FP8 conversions (PTX ISA, "Data Movement and Conversion Instructions: cvt") ----
   "cvt ... .e4m3x2 ... requires sm_89 or higher": ptxas refuses them for sm_80, so a binary nvcc builds
   for an older device has none; the kernels choose their rounding in software there (moept_emu_arch). A
   call on such a device is a report ("arch"): the kernel took a path its binary could not have. */
int moept_emu_arch(void) { return X ? X->arch : emu::compute_capability(); }
static void need_sm89(const char *insn) {
    if (X && X->arch < 89)
        emu::report("arch", "kernel %s block (%u,%u,%u) thread %d: %s needs sm_89 or higher (PTX ISA, cvt, "
                    "\"Target ISA notes\"); this device is sm_%d, whose binary cannot hold it", X->name,
                    X->bid.x, X->bid.y, X->bid.z, X->cur, insn, X->arch);
}
/* one value of cvt.rn.satfinite.e4m3x2.f32: .rn, the nearest E4M3 value, a tie to the even mantissa (the
   even code: a value's successor has the next code); .satfinite, "if the absolute value of input ... is
   greater than MAX_NORM ... the result is sign-preserved MAX_NORM" (448, S.1111.110, infinities too),
   and a NaN "is NaN in the specified destination format": of E4M3's two NaN codes, 0x7f, the one the
   CUDA toolkit's cuda_fp8.hpp writes where it does without the instruction (its host path, which
   canonicalises a NaN first). A value that rounds to zero keeps its sign (IEEE 754's rounding). The
   grid: steps of 2^(e-3) in [2^e, 2^(e+1)) for e >= -6, of 2^-9 below 2^-6 (subnormals); a / step
   is exact in double, nearbyint rounds it to even in the default rounding mode. */
static uint8_t e4m3_of(float x) {
    if (std::isnan(x)) return 0x7f;
    const uint8_t s = std::signbit(x) ? 0x80 : 0;
    const double a = std::fabs((double)x);
    if (a >= 448.0) return s | 0x7e;
    int e;
    std::frexp(a, &e); /* a in [2^(e-1), 2^e) */
    const int lo = std::max(e - 1, -6);
    const double r = std::nearbyint(std::ldexp(a, 3 - lo)); /* a in steps of 2^(lo-3): 0 .. 16 */
    if (r >= 16.0) return s | (uint8_t)((lo + 8) << 3);     /* rounded up into the next binade */
    if (r < 8.0) return s | (uint8_t)r;                       /* (zero, or a subnormal: lo -6) */
    return s | (uint8_t)((lo + 7) << 3 | ((int)r - 8));
}
uint16_t moept_emu_cvt_e4m3x2_f32(float a, float b) {
    need_sm89("cvt.rn.satfinite.e4m3x2.f32");
    return (uint16_t)(e4m3_of(a) << 8 | e4m3_of(b));
}
/* cvt.rn.f16x2.e4m3x2: every E4M3 value is an f16 value (3 of f16's 10 mantissa bits, exponents within
   f16's normal range but subnormals 2^-9 m, f16 subnormals reach 2^-24); a NaN, f16's 0x7fff
   (cuda_fp8.hpp's host path again: "fp16 canonical NaN, discard sign") */
static uint16_t f16_of(uint8_t b) {
    if ((b & 0x7f) == 0x7f) return 0x7fff;
    const float v = std::fabs(emu::e4m3_value(b));
    uint16_t h = 0;
    if (v != 0.0f) {
        int e;
        const float f = std::frexp(v, &e); /* v = f 2^e, f in [0.5, 1): f16 exponent field e + 14 */
        h = e + 14 >= 1 ? (uint16_t)((e + 14) << 10 | ((int)std::ldexp(f, 11) - 1024))
                        : (uint16_t)std::ldexp(v, 24);
    }
    return (uint16_t)((b & 0x80) << 8 | h);
}
uint32_t moept_emu_cvt_f16x2_e4m3x2(uint16_t a) {
    need_sm89("cvt.rn.f16x2.e4m3x2");
    return (uint32_t)f16_of((uint8_t)(a >> 8)) << 16 | f16_of((uint8_t)a);
}
/* cvt.f32.f16 (exact: every f16 value is a float); a NaN, the canonical 0x7fffffff ("Floating Point
   Instructions": NaN results are canonical; cuda_fp8.hpp's host path: the sign discarded, the mantissa
   all ones) */
float moept_emu_cvt_f32_f16(uint16_t h) {
    const int e = h >> 10 & 31, m = h & 1023;
    float v = e == 31 ? (m ? NAN : INFINITY) : e ? std::ldexp(1.0f + (float)m / 1024.0f, e - 15)
                                                 : std::ldexp((float)m, -24);
    if (std::isnan(v)) {
        const uint32_t u = 0x7fffffffu;
        memcpy(&v, &u, 4);
        return v;
    }
    return h & 0x8000 ? -v : v;
}

namespace emu {
bool kblock(KBlock *k) {
    const Exec *x = X;
    if (!x) return false;
    k->name = x->name;
    k->bid = x->bid;
    k->nthreads = (int)(x->bd.x * x->bd.y * x->bd.z);
    k->t = x->cur;
    k->blk = x->blk;
    k->epoch = x->epoch;
    k->smem = x->smem;
    return true;
}
void kernel_block(bool (*ready)(void *), void *arg, const char *what) {
    Fiber *f = &X->f[X->cur];
    while (!ready(arg)) {
        f->state = F_BLOCK;
        f->ready = ready;
        f->warg = arg;
        f->what = what;
        to_sched(f, false);
    }
}
void kernel_end_block() {
    X->ended = true;
    Fiber *f = &X->f[X->cur];
    f->state = F_EXIT;
    to_sched(f, true);
    abort(); /* never resumed */
}
void smem_async_write(const char *p, size_t n) {
    const size_t off = (size_t)(p - __data_start);
    for (size_t i = 0; i < n; i++) {
        SharedShadow &s = g_sh[off + i];
        s.blk = X->blk;
        s.wep = s.rep = 0;
        s.nr = 0;
    }
}
bool is_shared(const void *p) { return (const char *)p >= __data_start && (const char *)p < _end; }
const char *fiber_stack(int t) { return g_fibers[t].lo; }
}  // namespace emu

/* launches queued so far, by kernel (moept_emu_launches) */
static std::mutex g_launch_mu;
static std::map<std::string, long> g_launches;

extern "C" long moept_emu_launches(const char *part) {
    std::lock_guard<std::mutex> lk(g_launch_mu);
    long n = 0;
    for (auto &kv : g_launches)
        if (strstr(kv.first.c_str(), part)) n += kv.second;
    return n;
}

void moept_emu_launch(const char *name, const void *func, dim3 g, dim3 b, size_t smem, cudaStream_t h,
                      const void *blob, size_t nb, void (*invoke)(void *)) {
    static std::once_flag once;
    std::call_once(once, [] {
        g_sh = (SharedShadow *)calloc((size_t)(_end - __data_start) + 1, sizeof(SharedShadow));
        const char *e = getenv("MOEPT_EMU_SEED");
        g_seed = e ? strtoull(e, nullptr, 0) : 0x6d6f657074ull;
    });
    uint64_t threads = (uint64_t)b.x * b.y * b.z;
    if (!g.x || !g.y || !g.z || !threads || threads > 1024 || b.x > 1024 || b.y > 1024 || b.z > 64 ||
        g.x > 2147483647u || g.y > 65535 || g.z > 65535) {
        set_last_error(cudaErrorInvalidConfiguration);
        return;
    }
    Stream *s = stream_of(h);
    /* dynamic shared memory past the kernel's limit (48 KiB until cudaFuncSetAttribute raised it: CUDA
       Runtime API, cudaFuncAttributeMaxDynamicSharedMemorySize, "the requested maximum size" of it): the
       launch is refused with cudaErrorInvalidValue, as the driver answers CUDA_ERROR_INVALID_VALUE
       ("invalid argument") for it (not yet recorded on a GPU in tests/cuda_rules.txt) */
    if (smem > func_max_dyn_smem(s->dev, func)) {
        set_last_error(cudaErrorInvalidValue);
        return;
    }
    if (cudaError_t e = sticky(s->dev)) { /* the context is lost (lose): the launch returns its error */
        set_last_error(e);
        return;
    }
    if (s->dev != cur_dev) {
        set_last_error(cudaErrorInvalidResourceHandle);
        return;
    }
    const bool fault = dev(s->dev)->fault_next.exchange(0) != 0; /* moept_emu_fault_next_kernel */
    {
        std::lock_guard<std::mutex> lk(g_launch_mu);
        g_launches[name]++;
    }
    char nm[160];
    snprintf(nm, sizeof nm, "kernel %s<<<(%u,%u,%u),(%u,%u,%u)>>>", name, g.x, g.y, g.z, b.x, b.y, b.z);
    auto bp = std::make_shared<std::vector<char>>((const char *)blob, (const char *)blob + nb);
    const int arch = compute_capability();
    enqueue(s, nm, [name, g, b, smem, bp, invoke, fault, arch](Op &o) {
        if (fault) lose(o.s->dev, cudaErrorIllegalAddress, o.name.c_str(), "injected");
        else run_kernel(o, name, g, b, smem, *bp, invoke, arch);
    });
}

/* ThreadSanitizer's instrumentation ABI: every access of the kernels'
   translation unit (its runtime is not linked) */
#define EMU_RW(n)                                                                    \
    extern "C" void __tsan_read##n(void *p) { emu::access(p, n, 0); }                \
    extern "C" void __tsan_write##n(void *p) { emu::access(p, n, 1); }               \
    extern "C" void __tsan_unaligned_read##n(void *p) { emu::access(p, n, 0); }      \
    extern "C" void __tsan_unaligned_write##n(void *p) { emu::access(p, n, 1); }
EMU_RW(1)
EMU_RW(2)
EMU_RW(4)
EMU_RW(8)
EMU_RW(16)
extern "C" void __tsan_read_range(void *p, unsigned long n) { emu::access(p, n, 0); }
extern "C" void __tsan_write_range(void *p, unsigned long n) { emu::access(p, n, 1); }
extern "C" void __tsan_init(void) {}
extern "C" void __tsan_func_entry(void *) {}
extern "C" void __tsan_func_exit(void) {}
extern "C" void __tsan_vptr_update(void **, void *) {}
extern "C" void __tsan_vptr_read(void **) {}
/* shared_ptr's reference count (the launch's argument copies) */
extern "C" int __tsan_atomic32_fetch_add(volatile int *p, int v, int mo) {
    (void)mo;
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
