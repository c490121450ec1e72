/* emu_rt.cc - the emulated CUDA runtime: devices, memory, streams, events,
   copies, and the checkers that watch them (see docs/CUDA.md, "Verified
   without a GPU").

   Device memory: each device has its own address range (ARENA bytes,
   reserved PROT_NONE). Allocations are never reused, each is followed by a
   guard page and filled with 0xff bytes (NaN as fp32, bf16 and fp64)
   before any op can read it. While no op of the device runs, its range is
   PROT_NONE (mapped and given back in whole huge pages): host code that
   dereferences device memory faults, and the handler says where. Where the
   CPU has protection keys, each device's range also has its own key, which
   only a stream worker enables, and only while it runs one of the device's
   ops: host code faults even while another thread runs an op.

   Streams: a queue and a worker thread each. An op runs only once released
   (a synchronize, a query, an event wait from a released op, a peer's NCCL
   op waiting on it, cudaFree's device synchronisation), so the host runs
   as far ahead as the API allows. Each op gets an epoch in its stream's
   vector clock; event waits and the legacy default stream's implicit
   ordering join clocks; the host thread's clock (what it has synchronised
   with) goes with every op it enqueues. Every byte an op touches is checked
   against the last writer and readers of other streams: an access not
   ordered after them is a hazard, reported with both ops. */
#include "emu_internal.h"

#include <csignal>
#include <execinfo.h>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <set>
#include <sys/mman.h>
#include <unistd.h>

namespace emu {

Device *devices[MAXDEV];
thread_local int cur_dev = 0;
thread_local VC host_vc;
thread_local Op *cur_op = nullptr;
thread_local cudaError_t last_error = cudaSuccess;

static std::mutex g_mu;                    /* devices, streams, pinned, reports */
static std::atomic<long> g_reports{0}, g_taken{0};
static char g_last_report[512];
static std::atomic<int> g_fail_malloc{0};
static std::atomic<int> g_fail_dev{-1}; /* the device whose cudaMalloc counts */
static int g_nstreams = 0;
static std::vector<int> g_free_ids; /* clock entries of destroyed streams */
static std::map<const char *, size_t> g_pinned; /* page-locked ranges: cudaMallocHost, cudaHostRegister */
static std::set<const char *> g_registered;     /* ... of them, the cudaHostRegister ones */
static std::map<const char *, int> g_pinned_dev; /* ... and the device current at the call */
static bool g_protect = true;

double now() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void report(const char *checker, const char *fmt, ...) {
    char msg[480];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    long n = ++g_reports;
    std::lock_guard<std::mutex> lk(g_mu);
    snprintf(g_last_report, sizeof g_last_report, "%s: %s", checker, msg);
    if (n <= 50) fprintf(stderr, "moept-emu: %s: %s\n", checker, msg);
    if (n == 50) fprintf(stderr, "moept-emu: (further reports counted, not printed)\n");
}

uint64_t checksum(const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

void set_last_error(cudaError_t e) {
    if (e != cudaSuccess) last_error = e;
}
static cudaError_t fail(cudaError_t e) {
    set_last_error(e);
    return e;
}

/* ---- a lost context ------------------------------------------------------
   CUDA Runtime API, enum cudaError: cudaErrorIllegalAddress (a load or store
   on an invalid address), cudaErrorMisalignedAddress and the other kernel
   faults leave the process in an inconsistent state; any further CUDA work
   returns the same error, and only a new process can use CUDA again. So
   once an op of device d faults, every call that acts on d (its memory,
   streams, events, copies, launches, synchronisations, captures; the
   emulated cuBLAS and NCCL calls on it: emu_blas.cc, emu_nccl.cc) returns
   the error (and sets the thread's last error again: cudaGetLastError,
   below), and the work queued on d never runs
   (worker). Not refused: cudaGetDeviceCount, cudaSetDevice, cudaGetDevice,
   cudaGetErrorString, cudaPointerGetAttributes (queries of the process).
   moept_emu_recover stands for a new process (test only). */
cudaError_t sticky(int d) {
    Device *v = d >= 0 && d < MAXDEV ? devices[d] : nullptr;
    return v ? (cudaError_t)v->lost.load() : cudaSuccess;
}
void lose(int d, cudaError_t e, const char *op, const char *why) {
    int none = 0;
    if (dev(d)->lost.compare_exchange_strong(none, (int)e))
        report("context", "device %d: %s faulted (%s%s%s): the device's context is lost, every later call "
               "on it fails with that error", d, op,
               e == cudaErrorMisalignedAddress ? "cudaErrorMisalignedAddress" : "cudaErrorIllegalAddress",
               why ? ", " : "", why ? why : "");
}
/* a call on device d: its sticky error, if any (also the thread's last error) */
static cudaError_t lost_call(int d) {
    cudaError_t e = sticky(d);
    return e ? fail(e) : cudaSuccess;
}

/* ---- devices and memory --------------------------------------------- */
static int device_count() {
    const char *e = getenv("MOEPT_EMU_DEVICES");
    int n = e ? atoi(e) : MAXDEV;
    return n < 0 ? 0 : n > MAXDEV ? MAXDEV : n;
}

static void on_segv(int sig, siginfo_t *si, void *);

/* the device's own protection key on its whole range; -1 where the CPU or
   kernel has none (pkey_alloc sets the caller's rights; threads created
   later inherit them, and Linux starts every thread with no access to keys
   other than 0) */
static int alloc_pkey(char *arena) {
    if (getenv("MOEPT_EMU_NO_PKEYS")) return -1;
    int k = pkey_alloc(0, PKEY_DISABLE_ACCESS);
    if (k < 0) return -1;
    if (pkey_mprotect(arena, ARENA, PROT_NONE, k) != 0) {
        pkey_free(k);
        return -1;
    }
    return k;
}
/* this thread's access to the device's memory (a worker, around an op) */
static void pkey_access(const Device *v, bool on) {
    if (v->pkey >= 0) pkey_set(v->pkey, on ? 0 : PKEY_DISABLE_ACCESS);
}

Device *dev(int d) {
    std::lock_guard<std::mutex> lk(g_mu);
    if (!devices[d]) {
        Device *v = new Device();
        v->id = d;
        /* the range starts on a HUGE_PG boundary (reserved HUGE_PG more, the start rounded up) */
        char *raw = (char *)mmap(nullptr, ARENA + HUGE_PG, PROT_NONE,
                                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        v->page_of = (uint32_t *)mmap(nullptr, ARENA / PAGE * 4, PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        v->chunk_live = (uint32_t *)calloc(ARENA / HUGE_PG, sizeof(uint32_t));
        v->allocs.reserve(ARENA / PAGE / 2); /* (the most allocations: a page and a guard page each) */
        if (raw == MAP_FAILED || v->page_of == MAP_FAILED || !v->chunk_live) {
            fprintf(stderr, "moept-emu: cannot reserve device memory\n");
            abort();
        }
        v->arena = raw + (HUGE_PG - (uintptr_t)raw % HUGE_PG) % HUGE_PG;
        /* Transparent huge pages where the kernel offers them (madvise mode):
           each mprotect of the used range (dev_enter, dev_leave) changes one
           entry per 2 MiB instead of one per page; where pages were 4 KiB,
           that was most of an emulated run's time (the reference cases at
           EP 2: 14 s, 5 s with it). So that pages stay huge, every mprotect
           and MADV_DONTNEED covers whole ones (map_used, release): a part of
           one would split it. Protections are unchanged. */
        madvise(v->arena, ARENA, MADV_HUGEPAGE);
        static bool handler;
        if (!handler) {
            handler = true;
#ifdef __SANITIZE_ADDRESS__
            g_protect = false; /* ASan's own handler owns SIGSEGV */
#endif
            if (getenv("MOEPT_EMU_NO_PROTECT")) g_protect = false;
            struct sigaction sa;
            memset(&sa, 0, sizeof sa);
            sa.sa_sigaction = on_segv;
            sa.sa_flags = SA_SIGINFO;
            if (g_protect) sigaction(SIGSEGV, &sa, nullptr);
        }
        if (g_protect) v->pkey = alloc_pkey(v->arena);
        devices[d] = v;
    }
    return devices[d];
}

static int arena_of(const void *p) {
    for (int d = 0; d < MAXDEV; d++) {
        Device *v = devices[d];
        if (v && (const char *)p >= v->arena && (const char *)p < v->arena + ARENA) return d;
    }
    return -1;
}

Alloc *find(const void *p, int *devid) {
    int d = arena_of(p);
    if (devid) *devid = d;
    if (d < 0) return nullptr;
    Device *v = devices[d];
    uint32_t a = v->page_of[((const char *)p - v->arena) / PAGE];
    return a ? v->allocs[a - 1] : nullptr;
}

static void on_segv(int, siginfo_t *si, void *) {
    int d = arena_of(si->si_addr);
    char msg[200];
    int n;
    if (d >= 0 && cur_op)
        n = snprintf(msg, sizeof msg, "moept-emu: memcheck: %s on device %d touched unmapped memory %p of device %d"
                     " (live %d, active %d)\n", cur_op->name.c_str(), cur_op->s->dev, si->si_addr, d,
                     find(si->si_addr, nullptr) ? (int)find(si->si_addr, nullptr)->live : -1, devices[d]->active);
    else if (d >= 0)
        n = snprintf(msg, sizeof msg, "moept-emu: memcheck: host code dereferenced device memory %p (device %d)"
                     " outside any kernel, copy or collective%s\n", si->si_addr, d,
                     si->si_code == SEGV_PKUERR ? " (its protection key; maybe while another thread ran an op)" : "");
    else
        n = snprintf(msg, sizeof msg, "moept-emu: segmentation fault at %p\n", si->si_addr);
    if (n > 0 && write(2, msg, (size_t)n) < 0) _exit(71);
    void *bt[32];
    backtrace_symbols_fd(bt, backtrace(bt, 32), 2); /* where the host code was */
    _exit(d >= 0 ? 70 : 71);
}

/* device memory is mapped while any op of the device runs */
static void protect(void *p, size_t n, int prot) {
    if (mprotect(p, n, prot) != 0) {
        perror("moept-emu: mprotect");
        abort();
    }
}
/* a new allocation's bytes: not zero, so that a read before any write shows up */
static void fill(Device *v, Alloc *a) {
    pkey_access(v, true);
    memset(a->base, 0xff, a->size);
    pkey_access(v, false);
    a->unfilled = false;
}
/* maps the used range read-write, in whole huge pages (v->m held): the bytes past top up to the
   next HUGE_PG boundary too (no allocation's: the checks of every access report them, mapped or not) */
static void map_used(Device *v) {
    const size_t want = (v->top + HUGE_PG - 1) / HUGE_PG * HUGE_PG;
    if (want <= v->mapped) return;
    protect(v->arena + v->mapped, want - v->mapped, PROT_READ | PROT_WRITE);
    v->mapped = want;
}
/* (an allocation made while the device was idle is filled here, under this mapping: the pages are
   mapped and unmapped once a run of ops, not once more an allocation) */
static void dev_enter(Device *v) {
    std::lock_guard<std::mutex> lk(v->m);
    if (v->active++ > 0 || !g_protect) return;
    map_used(v);
    for (Alloc *a : v->unfilled)
        if (a->unfilled && a->live) fill(v, a);
    v->unfilled.clear();
}
static void dev_leave(Device *v) {
    std::lock_guard<std::mutex> lk(v->m);
    if (--v->active == 0 && g_protect && v->mapped) protect(v->arena, v->mapped, PROT_NONE), v->mapped = 0;
}

int is_pinned(const void *p) {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_pinned.upper_bound((const char *)p);
    if (it == g_pinned.begin()) return 0;
    --it;
    return (const char *)p < it->first + it->second;
}

/* ---- the hazard and bounds check of an op's access --------------------- */
static void name_of(int sid, uint32_t ep, char *buf, size_t len);
static Stream *g_streams[MAXSTREAMS];

/* a report's description of the access: what, or a kernel's (kernel_what) */
static const char *what_of(const char *what, char *buf, size_t len) {
    if (!what) kernel_what(buf, len);
    return what ? what : buf;
}

static void hazard(Alloc *a, const char *p, size_t n, int write, const char *what) {
    Op *o = cur_op;
    const int sid = o->s->id;
    size_t g0 = (size_t)(p - a->base) / 2, g1 = ((size_t)(p - a->base) + n + 1) / 2;
    for (size_t i = g0; i < g1; i++) {
        Granule &g = a->shadow[i];
        int other = -1;
        uint32_t oep = 0;
        const char *kind = nullptr;
        if (g.wep && g.ws != sid && o->vc.c[g.ws] < g.wep) { other = g.ws; oep = g.wep; kind = write ? "write after write" : "read after write"; }
        if (write && !kind)
            for (int r = 0; r < 2; r++)
                if (g.rep[r] && g.rs[r] != sid && o->vc.c[g.rs[r]] < g.rep[r]) { other = g.rs[r]; oep = g.rep[r]; kind = "write after read"; }
        if (kind) {
            char prev[160], wb[120];
            name_of(other, oep, prev, sizeof prev);
            report("hazard", "%s (%s of %zu bytes at %p, device %d, stream %d) is not ordered after %s on "
                   "stream %d (%s): no event or synchronisation between them", o->name.c_str(),
                   what_of(what, wb, sizeof wb), n, (const void *)p, a->dev, sid, prev, other, kind);
            return; /* one report per access */
        }
        /* distinct bytes: a granule this op already wrote, or read, is in
           its cache (the traffic of a perfectly cached op) */
        const bool mine_w = g.ws == sid && g.wep == o->epoch;
        const bool mine_r = (g.rs[0] == sid && g.rep[0] == o->epoch) ||
                            (g.rs[1] == sid && g.rep[1] == o->epoch);
        if (write ? !mine_w : !mine_w && !mine_r) o->uq[write != 0] += 2;
        if (write) { /* (the bytes of granule i this access stores: a byte stored again counted) */
            const size_t b0 = 2 * i, at = (size_t)(p - a->base);
            const uint8_t m = (uint8_t)((b0 >= at && b0 < at + n) | (b0 + 1 >= at && b0 + 1 < at + n) << 1);
            o->again += mine_w ? (size_t)((g.wb & m & 1) + (g.wb & m) / 2) : 0;
            g.wb = (uint8_t)(mine_w ? g.wb | m : m);
            g.ws = (uint8_t)sid; g.wep = o->epoch; g.rep[0] = g.rep[1] = 0;
        } else if (g.rs[0] == sid || !g.rep[0]) {
            g.rs[0] = (uint8_t)sid; g.rep[0] = o->epoch;
        } else {
            g.rs[1] = (uint8_t)sid; g.rep[1] = o->epoch;
        }
    }
}

int touch(const void *p, size_t n, int write, const char *what) {
    if (n == 0) return 1;
    Op *o = cur_op;
    int d;
    Alloc *a = find(p, &d);
    if (d < 0) return 1; /* host memory: the caller checked the kind */
    char wb[120];
    if (d != o->s->dev) { /* a device fault: the context is lost (lose), then the report says why */
        lose(o->s->dev, cudaErrorIllegalAddress, o->name.c_str(), "another device's memory");
        report("memcheck", "%s: %s of %zu bytes at %p touches device %d's memory from device %d",
               o->name.c_str(), what_of(what, wb, sizeof wb), n, p, d, o->s->dev);
        return 0;
    }
    if (!a || !a->live || (const char *)p + n > a->base + a->size) {
        lose(o->s->dev, cudaErrorIllegalAddress, o->name.c_str(), "outside every live allocation");
        report("memcheck", "%s: %s of %zu bytes at %p is outside every live allocation of device %d%s", o->name.c_str(),
               what_of(what, wb, sizeof wb), n, p, d, a && !a->live ? " (freed)" : "");
        return 0;
    }
    hazard(a, (const char *)p, n, write, what);
    o->rw[write != 0] += n;
    o->nacc++;
    return 1;
}

/* ---- counts ------------------------------------------------------------- */
static thread_local const char *t_stage;
static std::mutex g_count_mu;
static std::map<std::pair<int, std::string>, moept_emu_counts> g_counts;
static long long g_dev_bytes[MAXDEV];

static std::map<std::pair<int, std::string>, std::set<int>> g_blas_streams; /* g_count_mu */
static std::map<std::string, long long> g_again; /* g_count_mu: bytes stored again, by kernel */

static moept_emu_counts &counts_at(int d, const char *stage) { /* g_count_mu held */
    return g_counts[{d, stage ? stage : "other"}];
}

void count_sync(int d) {
    std::lock_guard<std::mutex> lk(g_count_mu);
    counts_at(d, t_stage).syncs++;
}

/* what an op is, by the name its call gave it */
enum OpKind { OP_OTHER, OP_KERNEL, OP_BLAS, OP_NCCL, OP_COPY, OP_SET };
static OpKind op_kind(const std::string &n) {
    return !n.compare(0, 7, "kernel ")      ? OP_KERNEL
           : !n.compare(0, 6, "cublas")     ? OP_BLAS
           : !n.compare(0, 4, "nccl")       ? OP_NCCL
           : !n.compare(0, 10, "cudaMemcpy") ? OP_COPY
           : !n.compare(0, 10, "cudaMemset") ? OP_SET : OP_OTHER;
}
/* a kernel op's kernel ("kernel NAME<<<...>>>"; NAME in parentheses where it has a template's commas) */
static std::string kernel_of(const std::string &n) {
    std::string k = n.substr(7, n.find("<<<") - 7);
    return k.size() > 1 && k[0] == '(' && k.back() == ')' ? k.substr(1, k.size() - 2) : k;
}

void count_op(const Op &o) {
    long long r = (long long)o.uq[0], w = (long long)o.uq[1];
    const OpKind kind = op_kind(o.name);
    std::lock_guard<std::mutex> lk(g_count_mu);
    moept_emu_counts &c = counts_at(o.s->dev, o.stage);
    if (kind == OP_KERNEL) {
        c.kernels++; c.kread += r; c.kwrite += w;
        c.kaccess += (long long)(o.rw[0] + o.rw[1]);
        c.kops += (long long)o.nacc;
        if (o.again) g_again[kernel_of(o.name)] += (long long)o.again; /* (by kernel) */
    }
    else if (kind == OP_BLAS) {
        c.blas++; c.gread += r; c.gwrite += w;
        g_blas_streams[{o.s->dev, o.stage ? o.stage : "other"}].insert(o.s->id);
    }
    else if (kind == OP_NCCL) { c.comms++; c.nread += r; c.nwrite += w; }
    else if (kind == OP_COPY || kind == OP_SET) { c.copies++; c.cread += r; c.cwrite += w; }
}

/* ---- streams ------------------------------------------------------------ */
static void name_of(int sid, uint32_t ep, char *buf, size_t len) {
    Stream *s = g_streams[sid];
    std::lock_guard<std::mutex> lk(s->m);
    snprintf(buf, len, "%s", ep < s->names.size() ? s->names[ep].c_str() : "?");
}

/* CUPTI's activity trace, stood in for: where CUDA_INJECTION64_PATH names an injection library (on a GPU
   the driver loads it; tools/cupti_trace.c is one) and CUPTI_TRACE a file, each op is written there as
   that library writes a record (kind,name,stream,start_ns,end_ns,bytes; K a kernel, cuBLAS's and NCCL's
   too, C a copy, S a memset; no runtime calls), so tools/cupti_summary.py reads an emulated run. The
   times are the emulator's own and say nothing of a GPU's. */
static FILE *trace_file() {
    static FILE *f = [] {
        const char *p = getenv("CUPTI_TRACE");
        FILE *t = getenv("CUDA_INJECTION64_PATH") && p ? fopen(p, "w") : nullptr;
        if (t) fprintf(t, "kind,name,stream,start_ns,end_ns,bytes\n");
        return t;
    }();
    return f;
}
static void trace_op(const Op &o, double t0, double t1) {
    static std::mutex mu;
    const OpKind k = op_kind(o.name);
    if (k == OP_OTHER) return;
    const char kind = k == OP_COPY ? 'C' : k == OP_SET ? 'S' : 'K';
    /* a kernel by its name, as CUPTI's demangled; the others by their call */
    const std::string nm = k == OP_KERNEL ? kernel_of(o.name) : o.name.substr(0, o.name.find(' '));
    std::lock_guard<std::mutex> lk(mu);
    fprintf(trace_file(), "%c,\"%s\",%d,%.0f,%.0f,%llu\n", kind, nm.c_str(), o.s->id, t0 * 1e9, t1 * 1e9,
            kind == 'K' ? 0ull : (unsigned long long)o.uq[1]);
    fflush(trace_file()); /* (whole records, whatever ends the process) */
}

/* one op on its stream's worker: after its dependencies, with its device's
   memory mapped. `mapped`: the worker holds the mapping from its op before
   (worker); it lets go before waiting on another stream's work. */
static void run_op(Stream *s, Device *v, const std::shared_ptr<Op> &o, bool &mapped) {
    for (auto &d : o->deps) {
        if (mapped) dev_leave(v), mapped = false;
        wait_op(d, 1e9);
        s->vc.join(d->vc);
    }
    s->vc.join(o->host_vc);
    o->epoch = ++s->vc.c[s->id];
    o->vc = s->vc;
    {
        std::lock_guard<std::mutex> nl(s->m);
        if (s->names.size() <= o->epoch) s->names.resize(o->epoch + 1);
        s->names[o->epoch] = o->name;
    }
    if (o->hsrc && checksum(o->hsrc, o->hlen) != o->hsum)
        report("hazard", "%s: its host source buffer %p (%zu bytes) was changed after the call and before the "
               "copy ran (async copies read host memory when they run)", o->name.c_str(), o->hsrc, o->hlen);
    cur_op = o.get();
    if (!mapped) dev_enter(v), mapped = true;
    pkey_access(v, true);
    const double t0 = trace_file() ? now() : 0.0;
    if (o->run) o->run(*o);
    if (t0 > 0.0) trace_op(*o, t0, now());
    pkey_access(v, false);
    cur_op = nullptr;
    count_op(*o);
}

/* A stream's worker runs its released ops in order. Between two ops it runs
   back to back (the next one released and waiting on no other stream) the
   device's memory stays mapped: one mprotect pair a run of ops instead of
   one an op (without protection keys, mprotect over the whole used range was
   most of the emulator's time). The mapping goes before an op is marked done
   unless the next one is already released: a host thread that synchronised
   with its work finds the memory PROT_NONE, as before. */
static void worker(Stream *s) {
    Device *v = dev(s->dev);
    bool mapped = false;
    std::unique_lock<std::mutex> lk(s->m);
    auto ready = [&] { return !s->q.empty() && s->q.front()->seq <= s->released; };
    for (;;) {
        s->cv.wait(lk, [&] { return s->quit || ready(); });
        if (s->q.empty()) {
            if (mapped) lk.unlock(), dev_leave(v);
            return;
        }
        std::shared_ptr<Op> o = s->q.front();
        lk.unlock();
        if (!v->lost.load()) run_op(s, v, o, mapped); /* a lost context's queued work never runs (lose) */
        lk.lock();
        if (mapped && !(s->q.size() > 1 && s->q[1]->seq <= s->released)) { /* before anyone sees it done */
            lk.unlock();
            dev_leave(v), mapped = false;
            lk.lock();
        }
        o->t_done = now();
        o->done = true;
        o->run = nullptr; /* drops what the op held (kernel arguments, staged bytes) */
        s->completed = o->seq;
        s->q.pop_front();
        s->cv.notify_all();
    }
}

static Stream *new_stream(int d, bool legacy, bool blocking) {
    Device *v = dev(d);
    Stream *s = new Stream();
    {
        std::lock_guard<std::mutex> lk(g_mu);
        if (!g_free_ids.empty()) { /* a destroyed stream's clock entry, its epochs continued */
            s->id = g_free_ids.back();
            g_free_ids.pop_back();
            Stream *old = g_streams[s->id];
            std::lock_guard<std::mutex> ol(old->m);
            s->names = old->names;
            s->vc.c[s->id] = old->vc.c[s->id];
        } else if (g_nstreams < MAXSTREAMS) {
            s->id = g_nstreams++;
            s->names.push_back("(nothing)");
        } else {
            delete s;
            return nullptr;
        }
        g_streams[s->id] = s; /* the old Stream stays allocated: finished ops point at it */
    }
    s->dev = d;
    s->legacy = legacy;
    s->blocking = blocking;
    s->worker = std::thread(worker, s);
    std::lock_guard<std::mutex> lk(v->m);
    v->streams.push_back(s);
    if (legacy) v->legacy = s;
    return s;
}

Stream *stream_of(cudaStream_t h) {
    if (h == nullptr || h == cudaStreamLegacy) {
        Device *v = dev(cur_dev);
        if (!v->legacy) new_stream(cur_dev, true, true);
        return v->legacy;
    }
    return (Stream *)h;
}

/* ---- stream capture (cudaStreamBeginCapture .. cudaStreamEndCapture) ------
   A capturing stream records its work instead of running it: each op's run
   function (its arguments as at the call), event records and waits, in call
   order. A wait on an event recorded in the capture joins the waiting
   stream to it (the fork and join of a multi-stream capture). A call CUDA
   refuses during a capture is rejected with CUDA's error, reported
   ("capture"), and invalidates the captures concerned: their
   cudaStreamEndCapture fails (cudaErrorStreamCaptureInvalidated). The
   rules (the first and the last in capture_violation):
   - in every capture mode (CUDA Programming Guide, CUDA Graphs, "Prohibited
     and Unhandled Operations"): a sync or query of a capturing stream, a
     sync of a device one of whose streams captures, a sync of an event
     recorded in a capture (cudaErrorCapturedEvent), and any use of the
     legacy stream while a blocking stream of its device captures
     (cudaErrorStreamCaptureImplicit);
   - in every mode, a capturing stream's wait on an event recorded outside
     the capture (cudaErrorStreamCaptureIsolation);
   - by mode, for potentially unsafe calls (CUDA Runtime API,
     cudaThreadExchangeStreamCaptureMode; cudaStreamBeginCapture): an
     allocation or a free, a sync of a device or an event, and a sync or a
     query of any stream, an idle one too. The docs name cudaMalloc; the
     rest is what an H200 answered (tests/cuda_rules.txt, made by
     tests/cuda_rules.cu; the emulated run must print the same). A
     synchronous copy is not among them: it conflicts only through the
     legacy stream (above). So a host sync of any stream by a thread in
     Global mode counts as an unsafe call for the check at a later
     Global-mode capture's start (below). Each thread has an interaction
     mode, Global until it exchanges it. A thread in Global mode is refused
     them while it began a capture not in Relaxed mode, or while any
     thread's Global-mode capture is in progress, on any device:
     process-wide. In ThreadLocal
     mode only its own non-Relaxed captures refuse them; in Relaxed mode
     nothing does. The refused call invalidates the captures that refused it.
     Whether another thread's call falls inside a Global-mode capture is a
     matter of timing, and the emulator cannot see how threads order
     themselves on the host (a mutex, a join, a collective one waited on).
     As with streams, it takes the timing that shows the bug: a Global-mode
     capture begun while another thread that still runs has made an unsafe
     call in Global mode since this thread began is invalidated and
     reported, as if the call fell inside it (a thread that has ended is
     ordered before).
   A capture not begun in Relaxed mode must end on the thread that began it
   (cudaErrorStreamCaptureWrongThread). cudaGraphLaunch runs the recorded
   sequence again on the same streams (the origin's work on the launch
   stream), after the launch stream's earlier work, before its later work.
   A stream that joined must rejoin: its last work an event record that
   another stream of the capture waits on after it, else
   cudaStreamEndCapture fails with cudaErrorStreamCaptureUnjoined. Not
   emulated: graph editing, child graphs, capture into an existing graph. */
struct Graph {
    enum { OP, RECORD, WAIT };
    struct Item {
        int kind;
        Stream *s;
        std::string name;
        std::function<void(Op &)> run;
        std::function<std::function<void(Op &)>()> remake;
        std::function<void(const std::shared_ptr<Op> &)> after;
        Event *e;
    };
    Stream *origin = nullptr;
    int dev = 0;
    bool invalid = false;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
    std::thread::id owner;         /* the thread that began it */
    std::vector<Item> items;
    std::vector<Stream *> streams;
    std::vector<Event *> events;
};
thread_local std::function<std::function<void(Op &)>()> t_remake;
thread_local std::function<void(const std::shared_ptr<Op> &)> t_after;
static std::mutex g_cap_mu;                /* captures: their items, streams, events, the list below */
static std::vector<Graph *> g_captures;    /* in progress, any thread's */
/* this thread's capture interaction mode (cudaThreadExchangeStreamCaptureMode) */
static thread_local cudaStreamCaptureMode t_cap_mode = cudaStreamCaptureModeGlobal;
/* A thread that calls the capture rules, while it runs: when it began (its
   first such call) and its last potentially unsafe call in global mode,
   as numbers from one sequence (g_cap_seq), for the check at a global
   capture's start. Touch t_thread before taking g_cap_mu (it registers). */
struct CapThread {
    uint64_t first = 0, unsafe = 0;
    const char *call = nullptr;    /* that call, and its device */
    int dev = 0;
    CapThread();
    ~CapThread();
};
static uint64_t g_cap_seq = 0; /* g_cap_mu */
/* never freed: a thread may end after the static destructors ran */
static std::vector<CapThread *> *g_cap_threads = new std::vector<CapThread *>();
CapThread::CapThread() {
    std::lock_guard<std::mutex> lk(g_cap_mu);
    first = ++g_cap_seq;
    g_cap_threads->push_back(this);
}
CapThread::~CapThread() {
    std::lock_guard<std::mutex> lk(g_cap_mu);
    for (size_t i = 0; i < g_cap_threads->size(); i++)
        if ((*g_cap_threads)[i] == this) g_cap_threads->erase(g_cap_threads->begin() + (long)i);
}
static thread_local CapThread t_thread;
/* g_cap_mu, taken after this thread's thread_locals are made: GCC and Clang
   make all of a file's dynamically initialised ones at the first use of any
   (t_remake in capture_item), and t_thread registers under g_cap_mu */
static std::unique_lock<std::mutex> cap_lock() {
    (void)t_thread.first;
    return std::unique_lock<std::mutex>(g_cap_mu);
}
static const cudaError_t UNSUPPORTED = cudaErrorStreamCaptureUnsupported;
static const cudaError_t IMPLICIT = cudaErrorStreamCaptureImplicit;

static void capture_item(Graph *g, int kind, Stream *s, const char *name, std::function<void(Op &)> run,
                         Event *e) {
    std::unique_lock<std::mutex> lk = cap_lock();
    g->items.push_back({kind, s, name, std::move(run), std::move(t_remake), std::move(t_after), e});
    t_remake = nullptr;
    t_after = nullptr;
}

static const char *mode_name(cudaStreamCaptureMode m) {
    if (m == cudaStreamCaptureModeGlobal) return "global";
    return m == cudaStreamCaptureModeThreadLocal ? "thread-local" : "relaxed";
}

/* A call CUDA may refuse during a capture (the rules above). What it
   conflicts with in every mode: s, a sync or query of stream s (of the
   legacy stream: a use of it); else, d >= 0: with e IMPLICIT a use of
   device d's legacy stream (a synchronous copy), otherwise a sync of device
   d; d < 0, nothing. Each is also a potentially unsafe call, refused by
   mode, except a synchronous copy (tests/cuda_rules.txt).
   Refused: e (a mode rule alone: cudaErrorStreamCaptureUnsupported), a
   report, every capture concerned invalidated. */
static cudaError_t capture_violation(int d, Stream *s, const char *call, cudaError_t e) {
    const bool legacy = s ? s->legacy : d >= 0 && e == IMPLICIT, unsafe = s || e != IMPLICIT;
    if (s) d = s->dev;
    const std::thread::id me = std::this_thread::get_id();
    CapThread &self = t_thread;
    char why[200] = "";
    int n = 0;
    bool conflict = false;
    std::unique_lock<std::mutex> lk = cap_lock();
    for (Graph *g : g_captures) {
        bool hit = false; /* Programming Guide, "Prohibited and Unhandled Operations" */
        for (Stream *t : g->streams)
            hit |= s && !legacy ? t == s : d >= 0 && t->dev == d && (t->blocking || !legacy);
        /* Runtime API, cudaThreadExchangeStreamCaptureMode: the thread's mode against the capture's */
        const bool own = g->owner == me && g->mode != cudaStreamCaptureModeRelaxed;
        const bool by_mode = unsafe && t_cap_mode != cudaStreamCaptureModeRelaxed &&
            (own || (t_cap_mode == cudaStreamCaptureModeGlobal && g->mode == cudaStreamCaptureModeGlobal));
        if (!hit && !by_mode) continue;
        if (!n++) {
            if (hit && s && !legacy) snprintf(why, sizeof why, "stream %d captures", s->id);
            else if (hit && legacy)
                snprintf(why, sizeof why, "a blocking stream of device %d captures (the legacy stream would "
                         "depend on it)", d);
            else if (hit) snprintf(why, sizeof why, "a stream of device %d captures", d);
            else if (own) snprintf(why, sizeof why, "this thread captures (%s mode, device %d)",
                                   mode_name(g->mode), g->dev);
            else snprintf(why, sizeof why, "another thread's global-mode capture is in progress (device %d): "
                          "global mode is process-wide", g->dev);
        }
        conflict |= hit;
        g->invalid = true;
    }
    if (!n) {
        if (unsafe && t_cap_mode == cudaStreamCaptureModeGlobal) { /* for later global captures */
            self.unsafe = ++g_cap_seq;
            self.call = call;
            self.dev = cur_dev;
        }
        return cudaSuccess;
    }
    if (!conflict) e = UNSUPPORTED;
    else if (legacy) e = IMPLICIT;
    report("capture", "%s on device %d while %s: rejected (%s), %d capture(s) invalidated", call, cur_dev,
           why, e == UNSUPPORTED ? "cudaErrorStreamCaptureUnsupported" : "cudaErrorStreamCaptureImplicit", n);
    return fail(e);
}
/* a potentially unsafe call that touches no stream (an allocation, a free) */
static cudaError_t unsafe_call(const char *call) { return capture_violation(-1, nullptr, call, UNSUPPORTED); }

std::shared_ptr<Op> enqueue(Stream *s, const char *name, std::function<void(Op &)> run,
                            const std::function<void(Op &)> &prep) {
    if (s->cap) { /* recorded; the caller gets an op that is already done */
        capture_item(s->cap, Graph::OP, s, name, std::move(run), nullptr);
        auto d = std::make_shared<Op>();
        d->name = name;
        d->s = s;
        d->done = true;
        return d;
    }
    auto after = std::move(t_after);
    t_remake = nullptr;
    t_after = nullptr;
    auto o = std::make_shared<Op>();
    o->name = name;
    o->run = std::move(run);
    o->s = s;
    o->stage = t_stage;
    o->host_vc = host_vc;
    if (prep) prep(*o);
    Device *v = dev(s->dev);
    std::vector<Stream *> others;
    {
        std::lock_guard<std::mutex> lk(v->m);
        others = v->streams;
    }
    /* the legacy default stream waits for every blocking stream, and they for it */
    for (Stream *t : others) {
        if (t == s || !t->blocking || !(s->legacy || t->legacy) || !s->blocking) continue;
        std::lock_guard<std::mutex> lk(t->m);
        if (t->last && !t->last->done) o->deps.push_back(t->last);
    }
    {
        std::lock_guard<std::mutex> lk(s->m);
        o->seq = s->next_seq++;
        s->q.push_back(o);
        s->last = o;
    }
    if (after) after(o);
    return o;
}

void force(Stream *s, uint64_t seq) {
    std::lock_guard<std::mutex> lk(s->m);
    if (s->released < seq) {
        s->released = seq;
        s->cv.notify_all();
    }
}
void force_all(Stream *s) {
    std::lock_guard<std::mutex> lk(s->m);
    s->released = s->next_seq - 1;
    s->cv.notify_all();
}

/* How long a host wait or an NCCL op may wait before the emulator calls it
   a hang (what a GPU would do for ever): MOEPT_EMU_HANG_S seconds, 120 by
   default. The hang is a report and the process ends (exit 72). */
double hang_seconds() {
    static double h = [] {
        const char *e = getenv("MOEPT_EMU_HANG_S");
        double v = e ? atof(e) : 0.0;
        return v > 0.0 ? v : 120.0;
    }();
    return h;
}
void hang(const char *what) {
    report("hang", "%s has not completed in %.0f s (what a GPU would wait for ever)", what, hang_seconds());
    fflush(stderr);
    _exit(72);
}

/* waits for o (releasing its stream up to it); a hang is a report */
bool wait_op(const std::shared_ptr<Op> &o, double timeout_s) {
    Stream *s = o->s;
    force(s, o->seq);
    std::unique_lock<std::mutex> lk(s->m);
    double t0 = now();
    while (!o->done) {
        s->cv.wait_for(lk, std::chrono::milliseconds(100));
        if (!o->done && now() - t0 > timeout_s) return false;
        if (!o->done && now() - t0 > hang_seconds()) {
            lk.unlock();
            char what[200];
            snprintf(what, sizeof what, "%s on stream %d of device %d", o->name.c_str(), s->id, s->dev);
            hang(what);
        }
    }
    return true;
}

static void sync_stream(Stream *s) {
    std::shared_ptr<Op> last;
    {
        std::lock_guard<std::mutex> lk(s->m);
        last = s->last;
    }
    if (!last) return;
    wait_op(last, 1e9);
    host_vc.join(last->vc);
}

static void sync_device(int d) {
    Device *v = dev(d);
    std::vector<Stream *> ss;
    {
        std::lock_guard<std::mutex> lk(v->m);
        ss = v->streams;
    }
    for (Stream *s : ss) force_all(s);
    for (Stream *s : ss) sync_stream(s);
}

/* cudaFuncSetAttribute's cudaFuncAttributeMaxDynamicSharedMemorySize, by (device, kernel) */
static std::mutex g_func_mu;
static std::map<std::pair<int, const void *>, size_t> g_func_smem;

size_t func_max_dyn_smem(int d, const void *func) {
    std::lock_guard<std::mutex> lk(g_func_mu);
    auto it = g_func_smem.find({d, func});
    return it == g_func_smem.end() ? DYN_SMEM_DEFAULT : it->second;
}

int compute_capability() {
    const char *e = getenv("MOEPT_EMU_CC");
    return e && atoi(e) > 0 ? atoi(e) : 80;
}
}  // namespace emu

using namespace emu;

/* ---- the test interface ---------------------------------------------------- */
extern "C" long moept_emu_reports(void) { return g_reports.load(); }
extern "C" int moept_emu_per_thread_guard(void) { return dev(cur_dev)->pkey >= 0; }
extern "C" long moept_emu_take_reports(char *buf, int len) {
    long n = g_reports.load() - g_taken.load();
    g_taken += n;
    std::lock_guard<std::mutex> lk(g_mu);
    if (buf && len > 0) snprintf(buf, (size_t)len, "%s", n ? g_last_report : "");
    return n;
}
extern "C" void moept_emu_fail_malloc(int n) {
    g_fail_dev = cur_dev;
    g_fail_malloc = n;
}

extern "C" void moept_emu_fault_next_kernel(int d) {
    if (d >= 0 && d < MAXDEV) dev(d)->fault_next = 1;
}

/* the HUGE_PG chunks an allocation has bytes in */
static size_t chunk0(const Device *v, const Alloc *a) { return (size_t)(a->base - v->arena) / HUGE_PG; }
static size_t chunk1(const Device *v, const Alloc *a) {
    return (size_t)(a->base + a->size - 1 - v->arena) / HUGE_PG;
}

/* an allocation's memory goes back (v->m held), a whole huge page at a time: each page in which no
   live allocation is left and no later one can be made (below top); its addresses are never reused.
   MADV_DONTNEED drops pages whatever their protection: no mprotect. */
static void release(Device *v, Alloc *a) {
    a->live = false;
    a->unfilled = false;
    for (size_t c = chunk0(v, a); c <= chunk1(v, a); c++)
        if (--v->chunk_live[c] == 0 && (c + 1) * HUGE_PG <= v->top)
            madvise(v->arena + c * HUGE_PG, HUGE_PG, MADV_DONTNEED);
    free(a->shadow);
    a->shadow = nullptr;
}

/* a stream's worker ends (its queue run or, on a lost device, dropped) and its clock entry is free */
static void end_worker(Stream *s) {
    {
        std::lock_guard<std::mutex> lk(s->m);
        s->quit = true;
        s->cv.notify_all();
    }
    s->worker.join();
    std::lock_guard<std::mutex> lk(g_mu);
    g_free_ids.push_back(s->id);
}

/* A new process's device d (test only): the old context's streams end (their
   queued work was dropped), its allocations and pinned blocks are freed. */
extern "C" void moept_emu_recover(int d) {
    if (d < 0 || d >= MAXDEV) return;
    Device *v = dev(d);
    std::vector<Stream *> ss;
    {
        std::lock_guard<std::mutex> lk(v->m);
        ss.swap(v->streams);
        v->legacy = nullptr;
    }
    {
        std::unique_lock<std::mutex> lk = cap_lock(); /* its captures end with the context */
        for (size_t i = g_captures.size(); i-- > 0;)
            if (g_captures[i]->dev == d) g_captures.erase(g_captures.begin() + (long)i);
    }
    for (Stream *s : ss) end_worker(s); /* still lost: the worker drops what is queued, then ends */
    {
        std::lock_guard<std::mutex> lk(v->m);
        for (Alloc *a : v->allocs)
            if (a->live) release(v, a);
    }
    {
        std::lock_guard<std::mutex> lk(g_count_mu);
        g_dev_bytes[d] = 0;
    }
    {
        std::lock_guard<std::mutex> lk(g_mu);
        for (auto it = g_pinned_dev.begin(); it != g_pinned_dev.end();) {
            if (it->second != d) { ++it; continue; }
            g_pinned.erase(it->first);
            free((void *)it->first);
            it = g_pinned_dev.erase(it);
        }
    }
    v->fault_next = 0;
    v->lost = 0;
    last_error = cudaSuccess; /* the calling thread's, as in a new process */
}

static void at_exit_check() {
    long n = g_reports.load() - g_taken.load();
    if (n > 0) {
        fprintf(stderr, "moept-emu: %ld checker report(s); failing the run\n", n);
        fflush(stderr);
        _exit(66);
    }
}
static int g_atexit = (atexit(at_exit_check), 0);

/* ---- the runtime API ------------------------------------------------------- */
extern "C" {

cudaError_t cudaGetDeviceCount(int *count) {
    if (!count) return fail(cudaErrorInvalidValue);
    *count = device_count();
    return *count ? cudaSuccess : fail(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int d) {
    if (d < 0 || d >= device_count()) return fail(cudaErrorInvalidDevice);
    cur_dev = d;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *d) {
    if (!d) return fail(cudaErrorInvalidValue);
    *d = cur_dev;
    return cudaSuccess;
}

/* The compute capability only: the emulated device is no real architecture; it
   answers 8.0 (MOEPT_EMU_CC=90 for 9.0), so what a caller sizes by it (e.g.
   the cuBLAS workspace the cuBLAS docs recommend per architecture) stays small.
   A kernel runs as the binary nvcc builds for it would (moept_emu_arch). */
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int d) {
    if (!v || d < 0 || d >= device_count()) return fail(!v ? cudaErrorInvalidValue : cudaErrorInvalidDevice);
    const int cc = emu::compute_capability();
    if (a == cudaDevAttrComputeCapabilityMajor) *v = cc / 10;
    else if (a == cudaDevAttrComputeCapabilityMinor) *v = cc % 10;
    /* shared memory a block: 48 KiB, and sm_90's 227 KiB opt-in (cudaFuncSetAttribute), whatever the
       compute capability answered (the Hopper primitives' rules are sm_90's) */
    else if (a == cudaDevAttrMaxSharedMemoryPerBlock) *v = (int)DYN_SMEM_DEFAULT;
    else if (a == cudaDevAttrMaxSharedMemoryPerBlockOptin) *v = (int)DYN_SMEM_MAX;
    /* multiprocessors: 4 (MOEPT_EMU_SMS to change; an H200 has 132), so a persistent kernel's CTAs each
       take several tiles here, as on a GPU at a large step */
    else if (a == cudaDevAttrMultiProcessorCount) *v = getenv("MOEPT_EMU_SMS") ? atoi(getenv("MOEPT_EMU_SMS")) : 4;
    else {
        report("runtime", "cudaDeviceGetAttribute(%d): not emulated", (int)a);
        return fail(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

/* Runtime API, cudaFuncSetAttribute: cudaFuncAttributeMaxDynamicSharedMemorySize, "the requested maximum
   size in bytes of dynamically-allocated shared memory", which with the kernel's static shared memory
   "cannot exceed the device attribute cudaDevAttrMaxSharedMemoryPerBlockOptin" (sm_90: 232448 bytes);
   an attribute that "cannot be written, or if the value is incorrect": cudaErrorInvalidValue. The
   value is the kernel's on the current device; a launch with more dynamic shared memory than it (48 KiB
   until set) is refused (moept_emu_launch). The emulator does not know a kernel's static __shared__
   bytes (tests/check_ptxas.sh holds them under 48 KiB): the limit is taken whole for dynamic memory.
   cudaFuncAttributePreferredSharedMemoryCarveout is a hint ("the driver can choose a different ratio"):
   taken, ignored. The other attributes are not emulated (a report). */
extern "C" cudaError_t cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr, int value) {
    if (cudaError_t le = lost_call(cur_dev)) return le;
    if (!func) return fail(cudaErrorInvalidDeviceFunction);
    if (attr == cudaFuncAttributePreferredSharedMemoryCarveout)
        return value >= -1 && value <= 100 ? cudaSuccess : fail(cudaErrorInvalidValue);
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) {
        report("runtime", "cudaFuncSetAttribute(%d): not emulated", (int)attr);
        return fail(cudaErrorInvalidValue);
    }
    if (value < 0 || (size_t)value > DYN_SMEM_MAX) return fail(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> lk(g_func_mu);
    g_func_smem[{cur_dev, func}] = (size_t)value;
    return cudaSuccess;
}

/* Runtime API, cudaGetDriverEntryPointByVersion: the driver function for symbol as of cudaVersion
   (1000 major + 10 minor). The emulated driver (CUDA_VERSION of the headers) has one:
   cuTensorMapEncodeTiled (introduced in CUDA 12.0; emu_hopper.cc). "If the specified CUDA version is
   greater than the driver version": cudaErrorInvalidValue. A symbol found but newer than cudaVersion:
   cudaSuccess, funcPtr NULL, cudaDriverEntryPointVersionNotSufficent; not found (here: any other
   symbol, also a "not emulated" report): cudaSuccess, NULL, cudaDriverEntryPointSymbolNotFound. The
   flags: cudaEnableDefault, cudaEnableLegacyStream, cudaEnablePerThreadDefaultStream. */
extern "C" cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **funcPtr,
                                                        unsigned int cudaVersion, unsigned long long flags,
                                                        enum cudaDriverEntryPointQueryResult *driverStatus) {
    if (!symbol || !funcPtr || flags > cudaEnablePerThreadDefaultStream || cudaVersion > CUDART_VERSION)
        return fail(cudaErrorInvalidValue);
    enum cudaDriverEntryPointQueryResult st = cudaDriverEntryPointSymbolNotFound;
    *funcPtr = nullptr;
    if (!strcmp(symbol, "cuTensorMapEncodeTiled")) {
        st = cudaVersion >= 12000 ? cudaDriverEntryPointSuccess : cudaDriverEntryPointVersionNotSufficent;
        if (st == cudaDriverEntryPointSuccess) *funcPtr = tensor_map_encode_tiled();
    } else {
        report("runtime", "cudaGetDriverEntryPointByVersion(\"%s\"): not emulated (answered: not found)",
               symbol);
    }
    if (driverStatus) *driverStatus = st;
    return cudaSuccess;
}

/* The thread's last error (Runtime API, cudaGetLastError: returned and reset
   to cudaSuccess; cudaPeekAtLastError: returned). A lost context does not
   keep it set: every later call that acts on the device fails again and sets
   it again, but the reset holds until then (an H200's answers in
   tests/cuda_rules.txt, "fault"). */
cudaError_t cudaGetLastError(void) {
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return last_error; }

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalAddress: return "illegal memory access";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureIsolation: return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureImplicit:
        return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorCapturedEvent:
        return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorStreamCaptureWrongThread:
        return "attempt to terminate a thread-local capture sequence from another thread";
    case cudaErrorStreamCaptureUnjoined:
        return "capture sequence contains a fork that was not joined to the primary stream";
    default: return "unknown error (emulated)";
    }
}
const char *cudaGetErrorName(cudaError_t e) { return cudaGetErrorString(e); }

cudaError_t cudaMalloc(void **p, size_t bytes) {
    if (!p) return fail(cudaErrorInvalidValue);
    *p = nullptr;
    if (device_count() == 0) return fail(cudaErrorNoDevice);
    if (cudaError_t le = lost_call(cur_dev)) return le;
    if (cudaError_t ce = unsafe_call("cudaMalloc")) return ce;
    int f = g_fail_malloc.load();
    if (f > 0 && cur_dev == g_fail_dev && g_fail_malloc.fetch_sub(1) == 1) return fail(cudaErrorMemoryAllocation);
    if (bytes == 0) return cudaSuccess;
    Device *v = dev(cur_dev);
    size_t pages = (bytes + PAGE - 1) / PAGE;
    Alloc *a = new Alloc();
    {
        std::lock_guard<std::mutex> lk(v->m);
        if (v->top + (pages + 1) * PAGE > ARENA) { delete a; return fail(cudaErrorMemoryAllocation); }
        a->base = v->arena + v->top;
        a->size = bytes;
        a->dev = v->id;
        a->live = true;
        a->shadow = (Granule *)calloc(bytes / 2 + 2, sizeof(Granule));
        v->allocs.push_back(a);
        uint32_t id = (uint32_t)v->allocs.size();
        for (size_t i = 0; i < pages; i++) v->page_of[v->top / PAGE + i] = id;
        v->top += (pages + 1) * PAGE; /* and a guard page */
        for (size_t c = chunk0(v, a); c <= chunk1(v, a); c++) v->chunk_live[c]++;
        if (g_protect && v->active == 0) { /* unmapped until the device's next op: filled then */
            a->unfilled = true;
            v->unfilled.push_back(a);
        } else { /* mapped now (the ops' mapping, or no protection, may end below it) */
            map_used(v);
            fill(v, a);
        }
    }
    {
        std::lock_guard<std::mutex> lk(g_count_mu);
        g_dev_bytes[a->dev] += (long long)bytes;
    }
    *p = a->base;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
    if (!p) return cudaSuccess;
    int d;
    Alloc *a = find(p, &d);
    if (cudaError_t le = lost_call(d)) return le;
    if (!a || a->base != p || !a->live) {
        report("memcheck", "cudaFree(%p): not the start of a live device allocation", p);
        return fail(cudaErrorInvalidValue);
    }
    if (cudaError_t ce = unsafe_call("cudaFree")) return ce;
    sync_device(d); /* cudaFree waits for the device */
    count_sync(d);
    if (cudaError_t le = lost_call(d)) return le;
    {
        std::lock_guard<std::mutex> lk(g_count_mu);
        g_dev_bytes[d] -= (long long)a->size;
    }
    Device *v = dev(d);
    std::lock_guard<std::mutex> lk(v->m);
    release(v, a);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t bytes) {
    if (!p) return fail(cudaErrorInvalidValue);
    if (cudaError_t le = lost_call(cur_dev)) return le;
    if (cudaError_t ce = unsafe_call("cudaMallocHost")) return ce;
    *p = aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
    if (!*p) return fail(cudaErrorMemoryAllocation);
    std::lock_guard<std::mutex> lk(g_mu);
    g_pinned[(const char *)*p] = bytes;
    g_pinned_dev[(const char *)*p] = cur_dev;
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned int flags) {
    (void)flags; /* portable, mapped, write-combined: all page-locked, which is what the copies see */
    return cudaMallocHost(p, bytes);
}

cudaError_t cudaFreeHost(void *p) {
    if (!p) return cudaSuccess;
    if (cudaError_t le = lost_call(cur_dev)) return le;
    if (cudaError_t ce = unsafe_call("cudaFreeHost")) return ce;
    for (int d = 0; d < MAXDEV; d++)
        if (devices[d]) sync_device(d);
    if (cudaError_t le = lost_call(cur_dev)) return le;
    std::lock_guard<std::mutex> lk(g_mu);
    if (g_registered.count((const char *)p) || !g_pinned.erase((const char *)p)) return fail(cudaErrorInvalidValue);
    g_pinned_dev.erase((const char *)p);
    free(p);
    return cudaSuccess;
}

/* cudaHostRegister page-locks a caller's range: copies to and from it are
   then asynchronous as for cudaMallocHost (CUDA Runtime API, cudaHostRegister) */
cudaError_t cudaHostRegister(void *p, size_t bytes, unsigned int flags) {
    (void)flags;
    if (!p || !bytes) return fail(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> lk(g_mu);
    if (g_pinned.count((const char *)p)) return fail(cudaErrorHostMemoryAlreadyRegistered);
    g_pinned[(const char *)p] = bytes;
    g_registered.insert((const char *)p);
    return cudaSuccess;
}
cudaError_t cudaHostUnregister(void *p) {
    std::lock_guard<std::mutex> lk(g_mu);
    if (!g_registered.erase((const char *)p)) return fail(cudaErrorHostMemoryNotRegistered);
    g_pinned.erase((const char *)p);
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *at, const void *p) {
    if (!at) return fail(cudaErrorInvalidValue);
    memset(at, 0, sizeof *at);
    int d;
    Alloc *a = find(p, &d);
    if (a && a->live) {
        at->type = cudaMemoryTypeDevice;
        at->device = d;
        at->devicePointer = (void *)p;
    } else if (is_pinned(p)) {
        at->type = cudaMemoryTypeHost;
        at->hostPointer = (void *)p;
        at->device = cur_dev;
    } else {
        at->type = cudaMemoryTypeUnregistered;
        at->device = -2;
    }
    return cudaSuccess;
}

/* ---- streams and events ---------------------------------------------------- */
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
    if (!s) return fail(cudaErrorInvalidValue);
    if (cudaError_t le = lost_call(cur_dev)) return le;
    Stream *t = new_stream(cur_dev, false, !(flags & cudaStreamNonBlocking));
    if (!t) return fail(cudaErrorMemoryAllocation);
    *s = (cudaStream_t)t;
    return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t h) {
    if (!h) return fail(cudaErrorInvalidResourceHandle);
    Stream *s = (Stream *)h;
    if (cudaError_t le = lost_call(s->dev)) return le;
    force_all(s);
    sync_stream(s); /* the stream's work completes; then it is gone */
    if (cudaError_t le = lost_call(s->dev)) return le;
    Device *v = dev(s->dev);
    {
        std::lock_guard<std::mutex> lk(v->m);
        for (size_t i = 0; i < v->streams.size(); i++)
            if (v->streams[i] == s) v->streams.erase(v->streams.begin() + (long)i);
    }
    end_worker(s);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t h) {
    Stream *s = stream_of(h);
    if (cudaError_t le = lost_call(s->dev)) return le;
    if (cudaError_t ce = capture_violation(s->dev, s, "cudaStreamSynchronize", UNSUPPORTED)) return ce;
    if (moept_emu_nccl_group_depth())
        report("nccl", "cudaStreamSynchronize inside ncclGroupStart/ncclGroupEnd: the group's operations are not "
               "issued until ncclGroupEnd (an ncclGroupStart left open?)");
    force_all(s);
    sync_stream(s);
    count_sync(s->dev);
    return lost_call(s->dev); /* the work it waited for faulted */
}

cudaError_t cudaStreamQuery(cudaStream_t h) {
    Stream *s = stream_of(h);
    if (cudaError_t le = lost_call(s->dev)) return le;
    if (cudaError_t ce = capture_violation(s->dev, s, "cudaStreamQuery", UNSUPPORTED)) return ce;
    if (moept_emu_nccl_group_depth())
        report("nccl", "cudaStreamQuery inside ncclGroupStart/ncclGroupEnd (an ncclGroupStart left open?)");
    std::shared_ptr<Op> last;
    {
        std::unique_lock<std::mutex> lk(s->m);
        if (!s->q.empty()) {
            s->released = s->next_seq - 1; /* a poll lets the work run, and says "not yet" */
            s->cv.notify_all();
            /* ... after waiting up to 200 us for it: CUDA Runtime API, cudaStreamQuery, says only
               cudaSuccess once all of the stream's work has completed, else cudaErrorNotReady (how long
               the call takes is no rule); a host thread polling in a loop leaves the CPU to the workers
               instead of spinning beside them */
            const uint64_t had = s->completed;
            s->cv.wait_for(lk, std::chrono::microseconds(200), [&] { return s->completed != had; });
            if (!s->q.empty()) return cudaErrorNotReady;
        }
        last = s->last;
    }
    if (last) host_vc.join(last->vc);
    return lost_call(s->dev);
}

cudaError_t cudaDeviceSynchronize(void) {
    if (cudaError_t le = lost_call(cur_dev)) return le;
    if (cudaError_t ce = capture_violation(cur_dev, nullptr, "cudaDeviceSynchronize", UNSUPPORTED)) return ce;
    sync_device(cur_dev);
    count_sync(cur_dev);
    return lost_call(cur_dev);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    if (!e) return fail(cudaErrorInvalidValue);
    *e = nullptr;
    if (cudaError_t le = lost_call(cur_dev)) return le;
    Event *v = new Event();
    v->dev = cur_dev;
    v->timing = !(flags & cudaEventDisableTiming);
    *e = (cudaEvent_t)v;
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, 0); }

/* the runtime API documentation's cases: either event never recorded or
   created without timing: cudaErrorInvalidResourceHandle; either not yet
   completed: cudaErrorNotReady (this forces nothing to run) */
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    if (!ms) return fail(cudaErrorInvalidValue);
    if (!a || !b) return fail(cudaErrorInvalidResourceHandle);
    Event *x = (Event *)a, *y = (Event *)b;
    if (cudaError_t le = lost_call(x->dev)) return le;
    if (!x->timing || !y->timing || !x->rec || !y->rec) return fail(cudaErrorInvalidResourceHandle);
    double t[2];
    const std::shared_ptr<Op> *r[2] = {&x->rec, &y->rec};
    for (int i = 0; i < 2; i++) {
        std::lock_guard<std::mutex> lk((*r[i])->s->m);
        if (!(*r[i])->done) return fail(cudaErrorNotReady);
        t[i] = (*r[i])->t_done;
    }
    *ms = (float)((t[1] - t[0]) * 1e3);
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
    if (!e) return fail(cudaErrorInvalidResourceHandle);
    if (cudaError_t le = lost_call(((Event *)e)->dev)) return le;
    delete (Event *)e; /* a pending record keeps its op alive */
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t h) {
    if (!e) return fail(cudaErrorInvalidResourceHandle);
    Event *v = (Event *)e;
    Stream *s = stream_of(h);
    if (cudaError_t le = lost_call(s->dev)) return le;
    if (s->dev != v->dev) return fail(cudaErrorInvalidResourceHandle);
    if (s->cap) { /* a node of the capture: a wait on it joins the waiter */
        capture_item(s->cap, Graph::RECORD, s, "cudaEventRecord", nullptr, v);
        std::unique_lock<std::mutex> lk = cap_lock();
        if (v->cap != s->cap) s->cap->events.push_back(v);
        v->cap = s->cap;
        return cudaSuccess;
    }
    v->cap = nullptr;
    v->rec = enqueue(s, "cudaEventRecord", nullptr);
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t h, cudaEvent_t e, unsigned flags) {
    (void)flags;
    if (!e) return fail(cudaErrorInvalidResourceHandle);
    Event *v = (Event *)e;
    Stream *s = stream_of(h);
    if (cudaError_t le = lost_call(s->dev)) return le;
    if (s->cap && !v->cap && v->rec) {
        /* recorded outside the capture: a dependency across its boundary, refused in every mode (Runtime
           API, enum cudaError, cudaErrorStreamCaptureIsolation: only in-stream order may cross it; an
           H200's answer in tests/cuda_rules.txt) */
        std::unique_lock<std::mutex> lk = cap_lock();
        s->cap->invalid = true;
        lk.unlock();
        report("capture", "cudaStreamWaitEvent: capturing stream %d waits on an event recorded outside the "
               "capture: rejected (cudaErrorStreamCaptureIsolation), the capture is invalidated", s->id);
        return fail(cudaErrorStreamCaptureIsolation);
    }
    if (v->cap || s->cap) { /* the waiter joins the capture of the event's record */
        Graph *g = v->cap ? v->cap : s->cap;
        if (!s->cap) {
            std::unique_lock<std::mutex> lk = cap_lock();
            s->cap = g;
            g->streams.push_back(s);
        }
        capture_item(g, Graph::WAIT, s, "cudaStreamWaitEvent", nullptr, v);
        return cudaSuccess;
    }
    if (!v->rec) return cudaSuccess; /* never recorded: nothing to wait for */
    std::shared_ptr<Op> rec = v->rec;
    enqueue(s, "cudaStreamWaitEvent", nullptr, [&](Op &o) { o.deps.push_back(rec); });
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    if (!e) return fail(cudaErrorInvalidResourceHandle);
    Event *v = (Event *)e;
    if (cudaError_t le = lost_call(v->dev)) return le;
    {
        std::unique_lock<std::mutex> lk = cap_lock();
        if (v->cap) { /* recorded in a capture still in progress: refused in every mode (Programming Guide,
                         "Prohibited and Unhandled Operations"; Runtime API, cudaErrorCapturedEvent) */
            v->cap->invalid = true;
            lk.unlock();
            report("capture", "cudaEventSynchronize on an event recorded in a capture: rejected "
                   "(cudaErrorCapturedEvent), the capture is invalidated");
            return fail(cudaErrorCapturedEvent);
        }
    }
    if (cudaError_t ce = unsafe_call("cudaEventSynchronize")) return ce;
    if (v->rec) {
        wait_op(v->rec, 1e9);
        count_sync(v->dev);
        host_vc.join(v->rec->vc);
    }
    return lost_call(v->dev);
}

/* Runtime API, cudaStreamBeginCapture: not on the legacy stream, not on a
   stream already capturing; the mode says which calls the capture refuses
   (capture_violation) */
cudaError_t cudaStreamBeginCapture(cudaStream_t h, enum cudaStreamCaptureMode mode) {
    Stream *s = stream_of(h);
    if (cudaError_t le = lost_call(s->dev)) return le;
    if (s->legacy) return fail(cudaErrorStreamCaptureUnsupported);
    if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal &&
        mode != cudaStreamCaptureModeRelaxed)
        return fail(cudaErrorInvalidValue);
    CapThread &self = t_thread;
    std::unique_lock<std::mutex> lk = cap_lock();
    if (s->cap) return fail(cudaErrorIllegalState);
    Graph *g = new Graph();
    g->origin = s;
    g->dev = s->dev;
    g->mode = mode;
    g->owner = std::this_thread::get_id();
    g->streams.push_back(s);
    s->cap = g;
    g_captures.push_back(g);
    /* Global mode is process-wide. Another thread, still running, made a potentially unsafe call after
       this one began: the emulator sees nothing that orders the two threads (a mutex, a join, a
       collective the host waited on), so that call may as well fall inside this capture, where CUDA
       refuses it and invalidates the capture. As with streams, the emulator takes that timing. */
    for (const CapThread *t : *g_cap_threads)
        if (mode == cudaStreamCaptureModeGlobal && t != &self && t->unsafe > self.first) {
            g->invalid = true;
            report("capture", "cudaStreamBeginCapture (global mode, device %d): another thread, still "
                   "running, called %s (device %d) in global mode, unordered with this capture: global "
                   "mode is process-wide, so that call may fall inside it; the capture is invalidated "
                   "(several threads using CUDA: capture in thread-local mode)", s->dev, t->call, t->dev);
            break;
        }
    return cudaSuccess;
}

/* Runtime API, cudaThreadExchangeStreamCaptureMode: swaps the calling
   thread's interaction mode (capture_violation reads it) */
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
    if (!mode || (*mode != cudaStreamCaptureModeGlobal && *mode != cudaStreamCaptureModeThreadLocal &&
                  *mode != cudaStreamCaptureModeRelaxed))
        return fail(cudaErrorInvalidValue);
    std::swap(*mode, t_cap_mode);
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t h, enum cudaStreamCaptureStatus *st) {
    if (!st) return fail(cudaErrorInvalidValue);
    Stream *s = stream_of(h);
    std::unique_lock<std::mutex> lk = cap_lock();
    *st = !s->cap ? cudaStreamCaptureStatusNone
        : s->cap->invalid ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

/* every stream but the origin ends on a record that another waits on later */
static bool capture_joined(const Graph *g) {
    for (Stream *t : g->streams) {
        if (t == g->origin) continue;
        long last = -1;
        for (size_t i = 0; i < g->items.size(); i++)
            if (g->items[i].s == t) last = (long)i;
        if (last < 0) continue;
        const Graph::Item &r = g->items[(size_t)last];
        bool waited = false;
        for (size_t i = (size_t)last + 1; i < g->items.size() && r.kind == Graph::RECORD; i++)
            waited |= g->items[i].kind == Graph::WAIT && g->items[i].e == r.e && g->items[i].s != t;
        if (!waited) {
            report("capture", "cudaStreamEndCapture: stream %d joined the capture and did not rejoin it (its last "
                   "work is not an event another stream of the capture waits on)", t->id);
            return false;
        }
    }
    return true;
}

cudaError_t cudaStreamEndCapture(cudaStream_t h, cudaGraph_t *out) {
    if (!out) return fail(cudaErrorInvalidValue);
    *out = nullptr;
    Stream *s = stream_of(h);
    if (cudaError_t le = lost_call(s->dev)) return le;
    std::unique_lock<std::mutex> lk = cap_lock();
    Graph *g = s->cap;
    if (!g) return fail(cudaErrorIllegalState);
    if (g->origin != s) return fail(cudaErrorStreamCaptureUnmatched);
    /* Runtime API, cudaStreamEndCapture: not Relaxed, the thread that began it ends it */
    if (g->mode != cudaStreamCaptureModeRelaxed && g->owner != std::this_thread::get_id())
        return fail(cudaErrorStreamCaptureWrongThread);
    for (Stream *t : g->streams) t->cap = nullptr;
    for (size_t i = 0; i < g_captures.size(); i++)
        if (g_captures[i] == g) g_captures.erase(g_captures.begin() + (long)i);
    for (Event *e : g->events)
        if (e->cap == g) e->cap = nullptr;
    if (g->invalid) {
        delete g;
        return fail(cudaErrorStreamCaptureInvalidated);
    }
    if (!capture_joined(g)) {
        delete g;
        return fail(cudaErrorStreamCaptureUnjoined);
    }
    *out = (cudaGraph_t)g;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags) {
    if (!exec || !graph || flags) return fail(cudaErrorInvalidValue);
    std::unique_lock<std::mutex> lk = cap_lock();
    *exec = (cudaGraphExec_t) new Graph(*(Graph *)graph);
    return cudaSuccess;
}

/* the recorded sequence again: the origin's work on s, the rest on their
   own streams, between an event on s and the waits of s on each of them */
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t h) {
    if (!exec) return fail(cudaErrorInvalidValue);
    Graph *g = (Graph *)exec;
    Stream *s = stream_of(h);
    if (cudaError_t le = lost_call(s->dev)) return le;
    if (s->cap || s->dev != g->dev) return fail(cudaErrorInvalidValue);
    auto on = [&](Stream *t) { return t == g->origin ? s : t; };
    cudaEvent_t start;
    cudaEventCreateWithFlags(&start, cudaEventDisableTiming);
    cudaEventRecord(start, (cudaStream_t)s);
    for (Stream *t : g->streams)
        if (on(t) != s) cudaStreamWaitEvent((cudaStream_t)t, start, 0);
    cudaEventDestroy(start);
    for (const Graph::Item &it : g->items) {
        if (it.kind == Graph::RECORD) cudaEventRecord((cudaEvent_t)it.e, (cudaStream_t)on(it.s));
        else if (it.kind == Graph::WAIT) cudaStreamWaitEvent((cudaStream_t)on(it.s), (cudaEvent_t)it.e, 0);
        else {
            t_after = it.after;
            enqueue(on(it.s), it.name.c_str(), it.remake ? it.remake() : it.run);
        }
    }
    for (Stream *t : g->streams) {
        if (on(t) == s) continue;
        cudaEvent_t end;
        cudaEventCreateWithFlags(&end, cudaEventDisableTiming);
        cudaEventRecord(end, (cudaStream_t)t);
        cudaStreamWaitEvent((cudaStream_t)s, end, 0);
        cudaEventDestroy(end);
    }
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    delete (Graph *)exec;
    return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    delete (Graph *)graph;
    return cudaSuccess;
}

/* ---- copies and memsets ------------------------------------------------------ */
static const char *kind_name(cudaMemcpyKind k) {
    switch (k) {
    case cudaMemcpyHostToDevice: return "HostToDevice";
    case cudaMemcpyDeviceToHost: return "DeviceToHost";
    case cudaMemcpyDeviceToDevice: return "DeviceToDevice";
    case cudaMemcpyHostToHost: return "HostToHost";
    default: return "Default";
    }
}

/* the copy's kind against what the pointers are, and the device range */
static cudaError_t check_copy(void *dst, const void *src, size_t n, cudaMemcpyKind k, Stream *s, const char *call) {
    if (cudaError_t le = lost_call(s->dev)) return le;
    int dd, sd;
    find(dst, &dd);
    find(src, &sd);
    bool dev_dst = dd >= 0, dev_src = sd >= 0;
    if (k == cudaMemcpyDefault) return cudaSuccess;
    bool want_dst = k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToDevice;
    bool want_src = k == cudaMemcpyDeviceToHost || k == cudaMemcpyDeviceToDevice;
    if (dev_dst != want_dst || dev_src != want_src) {
        report("memcheck", "%s(%p, %p, %zu, %s): dst is %s memory and src is %s memory", call, dst, src, n, kind_name(k),
               dev_dst ? "device" : "host", dev_src ? "device" : "host");
        return fail(cudaErrorInvalidValue);
    }
    if ((dev_dst && dd != s->dev) || (dev_src && sd != s->dev)) {
        report("memcheck", "%s: a pointer of device %d on a stream of device %d", call, dev_dst && dd != s->dev ? dd : sd,
               s->dev);
        return fail(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

/* A copy to or from pageable host memory, as the CUDA Runtime API's "API
   synchronization behavior" page states it for the asynchronous forms:
   device to pageable host returns only once the copy has completed (so the
   host thread waits for everything the stream must run first, however long);
   pageable host to device may synchronise with the stream and stage the
   bytes (strict reading: it waits for the stream's earlier work, then takes
   the bytes at the call); host to host is fully synchronous. Pinned memory
   (cudaMallocHost, cudaHostAlloc, cudaHostRegister) stays asynchronous. A
   copy that must synchronise cannot be captured (CUDA Programming Guide,
   "CUDA Graphs", "Prohibited and Unhandled Operations": synchronous
   operations on a capturing stream are illegal): rejected with
   cudaErrorStreamCaptureUnsupported, reported, the capture invalidated. */
static cudaError_t pageable_in_capture(Stream *s, const char *call) {
    {
        std::unique_lock<std::mutex> lk = cap_lock();
        s->cap->invalid = true;
    }
    report("capture", "%s with pageable host memory on a capturing stream: rejected "
           "(cudaErrorStreamCaptureUnsupported), the capture is invalidated", call);
    return fail(UNSUPPORTED);
}

static cudaError_t copy_async(void *dst, const void *src, size_t n, cudaMemcpyKind k, Stream *s, const char *call) {
    cudaError_t e = check_copy(dst, src, n, k, s, call);
    if (e != cudaSuccess || n == 0) return e;
    char name[96];
    snprintf(name, sizeof name, "%s %s (%zu bytes)", call, kind_name(k), n);
    const bool ddev = find(dst, nullptr) != nullptr, sdev = find(src, nullptr) != nullptr;
    const bool h2d = !sdev && ddev, d2h = sdev && !ddev;
    const bool pageable = (!sdev && !is_pinned(src)) || (!ddev && !is_pinned(dst));
    if (pageable && s->cap) return pageable_in_capture(s, call);
    if (h2d && pageable) { /* the stream's earlier work first, then the bytes are staged now */
        force_all(s);
        sync_stream(s);
        count_sync(s->dev);
        auto staged = std::make_shared<std::vector<char>>((const char *)src, (const char *)src + n);
        enqueue(s, name, [dst, n, staged](Op &) {
            if (touch(dst, n, 1, "write")) memcpy(dst, staged->data(), n);
        });
        return lost_call(s->dev); /* the context lost while it waited: the sticky error */
    }
    if (d2h && !pageable) { /* undefined until it ran: poison */
        bool pending_src = false; /* unless an earlier copy of this stream still reads it */
        std::lock_guard<std::mutex> lk(s->m);
        for (auto &q : s->q)
            if (q->hsrc && (const char *)q->hsrc < (char *)dst + n && (char *)dst < (const char *)q->hsrc + q->hlen)
                pending_src = true;
        if (!pending_src) memset(dst, 0xa5, n); /* before the op exists: another thread may release it */
    }
    auto o = enqueue(s, name, [dst, src, n](Op &) {
        if (touch(src, n, 0, "read") & touch(dst, n, 1, "write")) memmove(dst, src, n);
    }, [&](Op &o) {
        if (!h2d) return;
        o.hsrc = src; /* note the host bytes now: a change before the copy runs is a report */
        o.hlen = n;
        o.hsum = checksum(src, n);
    });
    if (pageable) { /* to pageable host memory (or host to host): the call returns when it is done */
        wait_op(o, 1e9);
        host_vc.join(o->vc);
        count_sync(s->dev);
        return lost_call(s->dev); /* the copy never ran if the context was lost meanwhile */
    }
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind k, cudaStream_t h) {
    return copy_async(dst, src, n, k, stream_of(h), "cudaMemcpyAsync");
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind k) {
    Stream *s = stream_of(nullptr);
    if (cudaError_t ce = capture_violation(s->dev, nullptr, "cudaMemcpy", cudaErrorStreamCaptureImplicit))
        return ce;
    cudaError_t e = copy_async(dst, src, n, k, s, "cudaMemcpy");
    if (e != cudaSuccess) return e;
    force_all(s);
    sync_stream(s);
    count_sync(s->dev);
    return lost_call(s->dev);
}

static cudaError_t memset_async(void *p, int v, size_t n, Stream *s, const char *call) {
    if (cudaError_t le = lost_call(s->dev)) return le;
    int d;
    find(p, &d);
    if (n && (d < 0 || d != s->dev)) {
        report("memcheck", "%s(%p, %zu bytes): not device memory of device %d", call, p, n, s->dev);
        return fail(cudaErrorInvalidValue);
    }
    if (n == 0) return cudaSuccess;
    char name[80];
    snprintf(name, sizeof name, "%s (%zu bytes)", call, n);
    enqueue(s, name, [p, v, n](Op &) {
        if (touch(p, n, 1, "write")) memset(p, v, n);
    });
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t h) {
    return memset_async(p, v, n, stream_of(h), "cudaMemsetAsync");
}
cudaError_t cudaMemset(void *p, int v, size_t n) { return memset_async(p, v, n, stream_of(nullptr), "cudaMemset"); }

void moept_emu_stage(const char *name) { t_stage = name; }

void moept_emu_counts_get(int d, const char *stage, moept_emu_counts *out) {
    memset(out, 0, sizeof *out);
    std::lock_guard<std::mutex> lk(g_count_mu);
    for (auto &kv : g_counts) {
        if (kv.first.first != d || (stage && kv.first.second != stage)) continue;
        const moept_emu_counts &c = kv.second;
        out->kernels += c.kernels; out->blas += c.blas; out->comms += c.comms; out->copies += c.copies;
        out->syncs += c.syncs; out->kaccess += c.kaccess; out->kops += c.kops;
        out->kread += c.kread; out->kwrite += c.kwrite; out->cread += c.cread; out->cwrite += c.cwrite;
        out->gread += c.gread; out->gwrite += c.gwrite; out->nread += c.nread; out->nwrite += c.nwrite;
    }
    std::set<int> ids;
    for (auto &kv : g_blas_streams)
        if (kv.first.first == d && (!stage || kv.first.second == stage))
            ids.insert(kv.second.begin(), kv.second.end());
    out->blas_streams = (long)ids.size();
}

void moept_emu_counts_reset(void) {
    std::lock_guard<std::mutex> lk(g_count_mu);
    g_counts.clear();
    g_blas_streams.clear();
    g_again.clear();
}

long long moept_emu_stored_again(const char *part) {
    std::lock_guard<std::mutex> lk(g_count_mu);
    long long n = 0;
    for (auto &kv : g_again)
        if (!part || strstr(kv.first.c_str(), part)) n += kv.second;
    return n;
}

long long moept_emu_device_bytes(int d) {
    std::lock_guard<std::mutex> lk(g_count_mu);
    return d >= 0 && d < MAXDEV ? g_dev_bytes[d] : 0;
}

}  // extern "C"
