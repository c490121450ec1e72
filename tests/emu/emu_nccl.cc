/* emu_nccl.cc - the emulated NCCL. Ranks are threads of one process or
   processes (one emulated GPU each, as users deploy NCCL: the unique id
   travels by MPI or a file), or both; each rank has its own emulated device
   (cudaSetDevice before ncclCommInitRank; two ranks on one fail it, as
   NCCL's duplicate-GPU check does: dup_gpu). Written from NCCL's
   documentation: ncclGetUniqueId/ncclCommInitRank (blocking until every
   rank joined), ncclGroupStart/End (per thread, nested; the group's
   point-to-point calls become one op per stream at the outermost
   ncclGroupEnd), ncclSend/ncclRecv (matched per ordered pair of ranks in
   call order; sizes must agree), ncclAllReduce and ncclAllGather (the i-th
   collective of every rank meet; count and type must agree),
   ncclCommGetAsyncError, ncclCommAbort, ncclCommDestroy, ncclGetLastError.
   Every call is an op on its stream and runs when the stream gets there.

   The data plane is POSIX shared memory named by the unique id, so threads
   and processes take the same path: one ring per ordered pair of ranks,
   each message a header (kind, sequence, bytes) and its bytes, streamed
   through the ring; an op moves all its sends and receives together (as a
   group does), and a send completes when its receiver has taken every
   byte. A collective is every rank's part sent to every other rank, summed
   in rank order (every rank gets the same sum).

   The segment has no name: ncclGetUniqueId makes it, an anonymous memory
   file (memfd_create), and the id holds its maker's pid and descriptor and
   a nonce, as NCCL's id holds its maker's bootstrap address. Another
   process opens it through /proc/<pid>/fd/<fd> while the maker keeps the
   descriptor, which it closes once every rank has joined (an id no rank of
   its process joins keeps it until exit); the memory lives until the last
   unmap. So no kill at any moment (of a rank, of the maker, of the
   survivors by mpirun, before or after the init completes) can leave
   anything in /dev/shm, where a name made at ncclCommInitRank stayed until
   every rank had mapped it. A rank whose id's maker has exited gets
   ncclRemoteError, as NCCL's from an unreachable bootstrap root; an id
   used after its world formed (an id serves one communicator) is a report.

   A peer that does not come is waited for, as real NCCL does: NCCL reports
   no error for a live peer that is merely absent (NCCL User Guide,
   "Fault tolerance" / ncclCommAbort: the application detects the hang and
   aborts the communicator). Only ncclCommAbort on this rank ends a waiting
   op (another rank's abort does not: its kernels wait on, as on a GPU); an
   injected transport failure (moept_emu_nccl_inject_error) gives
   ncclRemoteError, as a network error would. A wait past MOEPT_EMU_HANG_S
   is a "hang" report and ends the process. A communicator used after
   ncclCommAbort or ncclCommDestroy is a report, as is a message whose
   kind, count or type differs from what its receiver posted. */
#include "emu_internal.h"

#include <cerrno>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <map>
#include <sched.h>
#include <ctime>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace emu {

constexpr int MAXRANKS = 8;
constexpr uint64_t RING = (uint64_t)1 << 18; /* bytes a ring holds: a longer message streams through */
constexpr uint64_t MAGIC = 0x6d6f6570746e636cULL;
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the rings' counters must be lock-free across processes");

/* One direction between two ranks: head bytes written, tail bytes taken,
   ever (a single writer and a single reader: the two ranks' op workers) */
struct Ring {
    std::atomic<uint64_t> head, tail;
    char data[RING];
};
/* The shared segment: zero-filled by ftruncate, which is every counter's start */
struct Shm {
    std::atomic<uint64_t> nonce;        /* the id's: a descriptor that leads elsewhere is told apart */
    std::atomic<uint64_t> magic;
    std::atomic<int> n, joined;         /* once every rank joined, every process has it mapped */
    std::atomic<int> aborted[MAXRANKS];  /* its messages may stay unreceived */
    std::atomic<int> pid[MAXRANKS], dev[MAXRANKS]; /* each rank's GPU, set before it joins */
    Ring ring[MAXRANKS * MAXRANKS];     /* [src * MAXRANKS + dst] */
};
/* A message's header in its ring */
struct Hdr {
    uint32_t kind, type; /* P2P or a collective, and its element type */
    uint64_t seq, bytes; /* the collective's number on its comm; payload bytes */
};
enum { P2P = 1, ALLREDUCE = 2, ALLGATHER = 3 };

/* This process's view of a world: the mapping, and its own ranks' newest
   ops (an op waiting for a peer of this process releases the peer's stream,
   which otherwise runs only when its host forces it) */
struct World {
    std::string name;
    Shm *shm = nullptr;
    int n = 0;
    std::mutex m;
    std::vector<std::shared_ptr<Op>> last; /* [rank] newest op enqueued by a rank of this process */
    int live = 0;          /* this process's communicators not yet destroyed (under g_mu) */
    bool aborted = false;  /* one of them was aborted: its ops may still touch the segment */
};
struct Comm {
    World *w;
    int rank, dev;
    uint64_t nextcoll = 0;
    std::atomic<int> async{ncclSuccess};
    std::atomic<bool> dead{false};     /* aborted or destroyed: the handle is gone (the worker polls it) */
    std::atomic<bool> moving{false};   /* an op of this comm moves data now: a ring has one writer */
    char err[256] = "";
};

static std::mutex g_mu;
static std::map<std::string, World *> g_worlds; /* by the id's text */
static std::map<std::string, int> g_made;       /* ids made here: the descriptor, kept until all joined */
/* > 0: a peer absent this long is a transport error (moept_emu_nccl_inject_error) */
static std::atomic<int> g_inject_ms{0};
/* > 0: the n-th point-to-point op from now (an outermost ncclGroupEnd's sends
   and receives) enqueued for device g_fail_p2p_dev fails (moept_emu_nccl_fail_p2p) */
static std::atomic<int> g_fail_p2p{0};
static std::atomic<int> g_fail_p2p_dev{-1};
/* the emulated library's version (ncclGetVersion): the headers', or moept_emu_nccl_version's */
static std::atomic<int> g_version{NCCL_VERSION_CODE};
/* NCCL's last error, one for the process (src/debug.cc: every WARN writes it; ncclGetLastError
   returns it whatever the comm): here what the init failures write, given for a NULL comm */
static char g_last[256];

struct Pending {
    Comm *c;
    cudaStream_t s;
    int send, peer;
    void *buf;
    size_t bytes;
};
static thread_local int t_depth;
static thread_local std::vector<Pending> t_group;

static size_t type_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 4;
    }
}

static bool gone(Comm *c, const char *call) {
    if (!c) return true;
    if (c->dead) {
        report("nccl", "%s on a communicator that ncclCommAbort or ncclCommDestroy already freed", call);
        return true;
    }
    return false;
}

/* An error of the communicator, asynchronous as NCCL's are. A mismatch
   between ranks (sizes, counts, types) is also a report: moept must never
   post one. An aborted op or an injected transport failure is not. */
static void set_error(Comm *c, bool rep, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_error(Comm *c, bool rep, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    c->async = ncclRemoteError;
    if (rep) report("nccl", "rank %d: %s", c->rank, c->err);
}

/* ---- an op's transfers: every send and receive moved together ---------- */
struct Xfer {
    int send, peer;
    char *buf;           /* device bytes (sent from, received into), or host staging of a collective */
    uint64_t bytes, done; /* payload bytes, moved so far */
    Hdr h;
    bool hdr_done = false, active = true;
    uint64_t end = 0;    /* a send: the ring position after its last byte (taken when tail reaches it) */
};

static void ring_put(Ring &r, uint64_t pos, const char *src, uint64_t n) {
    uint64_t at = pos % RING, first = n < RING - at ? n : RING - at;
    memcpy(r.data + at, src, first);
    memcpy(r.data, src + first, n - first);
}
static void ring_get(const Ring &r, uint64_t pos, char *dst, uint64_t n) {
    uint64_t at = pos % RING, first = n < RING - at ? n : RING - at;
    memcpy(dst, r.data + at, first);
    memcpy(dst + first, r.data, n - first);
}

/* moves what fits of x's payload at ring position pos (room bytes free to
   write, or there to read); returns the bytes moved */
static uint64_t move_payload(Ring &r, Xfer &x, uint64_t pos, uint64_t room) {
    uint64_t n = room < x.bytes - x.done ? room : x.bytes - x.done;
    if (n && x.send) ring_put(r, pos, x.buf + x.done, n);
    else if (n) ring_get(r, pos, x.buf + x.done, n);
    x.done += n;
    return n;
}

/* a send's step: its header, what fits of its bytes; complete once the
   receiver has taken them all. Returns whether anything moved. */
static bool send_step(Comm *c, Xfer &x, int *left) {
    Ring &r = c->w->shm->ring[c->rank * MAXRANKS + x.peer];
    uint64_t head = r.head.load(std::memory_order_relaxed), tail = r.tail.load(std::memory_order_acquire);
    const uint64_t h0 = head;
    if (!x.hdr_done) {
        if (RING - (head - tail) < sizeof(Hdr)) return false;
        ring_put(r, head, (const char *)&x.h, sizeof(Hdr));
        head += sizeof(Hdr);
        x.hdr_done = true;
    }
    head += move_payload(r, x, head, RING - (head - tail));
    r.head.store(head, std::memory_order_release);
    if (x.done == x.bytes && !x.end) x.end = head;
    if (x.end && tail >= x.end) {
        x.active = false;
        --*left;
    }
    return head != h0;
}

/* a receive's step: the header (checked against what was posted), what has
   come of its bytes. Returns whether anything moved; a mismatch is the
   comm's error, reported. */
static bool recv_step(Comm *c, Xfer &x, int *left) {
    Ring &r = c->w->shm->ring[x.peer * MAXRANKS + c->rank];
    uint64_t tail = r.tail.load(std::memory_order_relaxed), head = r.head.load(std::memory_order_acquire);
    const uint64_t t0 = tail;
    if (!x.hdr_done) {
        if (head - tail < sizeof(Hdr)) return false;
        Hdr h;
        ring_get(r, tail, (char *)&h, sizeof h);
        if (h.kind != x.h.kind || h.bytes != x.bytes || h.type != x.h.type || h.seq != x.h.seq) {
            set_error(c, true, "a message from rank %d (kind %u, #%llu, %llu bytes, type %u) met a receive "
                      "of kind %u, #%llu, %llu bytes, type %u", x.peer, h.kind, (unsigned long long)h.seq,
                      (unsigned long long)h.bytes, h.type, x.h.kind, (unsigned long long)x.h.seq,
                      (unsigned long long)x.bytes, x.h.type);
            return false;
        }
        tail += sizeof(Hdr);
        x.hdr_done = true;
    }
    tail += move_payload(r, x, tail, head - tail);
    r.tail.store(tail, std::memory_order_release);
    if (x.done == x.bytes) {
        x.active = false;
        --*left;
    }
    return tail != t0;
}

/* one pass over the transfers; true if anything moved. A ring carries one
   message at a time: a transfer moves only when the earlier ones of its
   ring and direction (call order) have moved all their bytes. */
static bool progress(Comm *c, std::vector<Xfer> &xs, int *left) {
    bool moved = false, busy[2][MAXRANKS] = {};
    for (Xfer &x : xs) {
        bool &b = busy[x.send][x.peer];
        if (!x.active || b) continue;
        moved |= x.send ? send_step(c, x, left) : recv_step(c, x, left);
        if (c->async.load() != ncclSuccess) return false;
        b = !x.hdr_done || x.done < x.bytes;
    }
    return moved;
}

/* Runs the transfers to the end: for ever, as NCCL does, unless this rank
   aborts (false, silently) or an injected transport failure comes (false,
   the comm's async error set). While nothing moves, the streams of this
   process's peers are released up to their newest ops. */
static bool transfer(Comm *c, std::vector<Xfer> &xs, const char *what) {
    World *w = c->w;
    int left = (int)xs.size();
    if (c->moving.exchange(true)) { /* NCCL: a communicator's operations are serial; here two rings' writers */
        set_error(c, true, "rank %d: %s while another op of this communicator moves data (two streams use "
                  "one communicator at once)", c->rank, what);
        return false;
    }
    struct Done {
        Comm *c;
        ~Done() { c->moving = false; }
    } done{c};
    double t0 = now(), idle = now();
    while (left > 0) {
        if (c->dead) return false;
        if (progress(c, xs, &left)) {
            idle = now();
            continue;
        }
        if (c->async.load() != ncclSuccess) return false; /* a mismatch, reported */
        std::vector<std::shared_ptr<Op>> last;
        {
            std::lock_guard<std::mutex> lk(w->m);
            last = w->last;
        }
        for (auto &o : last)
            if (o) force(o->s, o->seq);
        const double still = now() - idle;
        if (still > 1e-4) usleep(still > 1e-2 ? 1000 : 50);
        else sched_yield();
        const int inject = g_inject_ms.load();
        if (inject > 0 && now() - t0 > inject * 1e-3) {
            set_error(c, false, "rank %d: %s: injected transport failure (a peer did not come in %d ms)",
                      c->rank, what, inject);
            return false;
        }
        if (now() - t0 > hang_seconds()) {
            char h[300];
            snprintf(h, sizeof h, "NCCL rank %d: %s (a peer never came)", c->rank, what);
            hang(h);
        }
    }
    return true;
}

static void run_p2p(Comm *c, const std::vector<Pending> &ps) {
    std::vector<Xfer> xs;
    for (const Pending &p : ps) {
        if (!touch(p.buf, p.bytes, p.send ? 0 : 1, p.send ? "ncclSend read" : "ncclRecv write")) return;
        Xfer x{};
        x.send = p.send;
        x.peer = p.peer;
        x.buf = (char *)p.buf;
        x.bytes = p.bytes;
        x.h = {P2P, 0, 0, p.bytes};
        xs.push_back(x);
    }
    transfer(c, xs, "ncclGroupEnd's sends and receives");
}

/* allreduce (sum) or allgather: the seq-th collective of every rank */
static void run_coll(Comm *c, uint64_t seq, int gather, const void *sb, void *rb, size_t count, ncclDataType_t t) {
    const int n = c->w->n, me = c->rank;
    const size_t es = type_size(t), bytes = count * es;
    const char *what = gather ? "ncclAllGather" : "ncclAllReduce";
    if (!gather && t != ncclFloat32 && t != ncclFloat64 && t != ncclInt64 && t != ncclInt32) {
        set_error(c, true, "%s: type %d not emulated (%zu elements)", what, (int)t, count);
        return;
    }
    std::vector<char> part((size_t)n * bytes);
    if (!touch(sb, bytes, 0, gather ? "ncclAllGather read" : "ncclAllReduce read")) return;
    memcpy(part.data() + (size_t)me * bytes, sb, bytes);
    std::vector<Xfer> xs;
    for (int q = 0; q < n; q++) {
        if (q == me) continue;
        Hdr h = {(uint32_t)(gather ? ALLGATHER : ALLREDUCE), (uint32_t)t, seq, bytes};
        Xfer s{}, r{};
        s.send = 1; s.peer = q; s.buf = part.data() + (size_t)me * bytes; s.bytes = bytes; s.h = h;
        r.send = 0; r.peer = q; r.buf = part.data() + (size_t)q * bytes; r.bytes = bytes; r.h = h;
        xs.push_back(s);
        xs.push_back(r);
    }
    if (!transfer(c, xs, what)) return;
    std::vector<char> out(gather ? part.size() : bytes);
    if (gather) out = part;
    for (int r = 0; r < n && !gather; r++) { /* rank order: every rank gets the same sum */
        const char *p = part.data() + (size_t)r * bytes;
        for (size_t i = 0; i < count; i++) {
            char *o = out.data() + i * es;
            const char *v = p + i * es;
            if (t == ncclFloat32) { float a, b; memcpy(&a, o, 4); memcpy(&b, v, 4); a = r ? a + b : b; memcpy(o, &a, 4); }
            else if (t == ncclFloat64) { double a, b; memcpy(&a, o, 8); memcpy(&b, v, 8); a = r ? a + b : b; memcpy(o, &a, 8); }
            else if (t == ncclInt64) { int64_t a, b; memcpy(&a, o, 8); memcpy(&b, v, 8); a = r ? a + b : b; memcpy(o, &a, 8); }
            else { int32_t a, b; memcpy(&a, o, 4); memcpy(&b, v, 4); a = r ? a + b : b; memcpy(o, &a, 4); }
        }
    }
    if (touch(rb, out.size(), 1, gather ? "ncclAllGather write" : "ncclAllReduce write"))
        memcpy(rb, out.data(), out.size());
}

static void note_last(Comm *c, const std::shared_ptr<Op> &o) {
    if (getenv("MOEPT_EMU_TRACE")) fprintf(stderr, "moept-emu trace: rank %d enqueues %s\n", c->rank, o->name.c_str());
    std::lock_guard<std::mutex> lk(c->w->m);
    c->w->last[(size_t)c->rank] = o;
}

static ncclResult_t flush_group() {
    std::vector<Pending> ps;
    ps.swap(t_group);
    while (!ps.empty()) { /* one op per (comm, stream) */
        Comm *c = ps[0].c;
        cudaStream_t s = ps[0].s;
        std::vector<Pending> mine, rest;
        for (auto &p : ps) (p.c == c && p.s == s ? mine : rest).push_back(p);
        ps.swap(rest);
        char nm[80];
        snprintf(nm, sizeof nm, "ncclGroupEnd (%zu sends/receives, rank %d)", mine.size(), c->rank);
        Stream *st = stream_of(s);
        t_after = [c](const std::shared_ptr<Op> &o) { note_last(c, o); }; /* a graph's replay too */
        const bool fail = g_fail_p2p.load() > 0 && c->dev == g_fail_p2p_dev && g_fail_p2p.fetch_sub(1) == 1;
        /* a transport failure moves nothing and leaves ncclRemoteError as the comm's asynchronous
           error (NCCL API, "ncclResult_t": ncclRemoteError, "a call failed possibly due to a network
           error or a remote process exiting prematurely"); the peers' ops wait on, as on a GPU */
        enqueue(st, nm, [c, mine, fail](Op &) {
            if (c->dead) return;
            if (fail) set_error(c, false, "rank %d: injected transport failure of a send/receive group", c->rank);
            else run_p2p(c, mine);
        });
    }
    return ncclSuccess;
}

static ncclResult_t p2p(int send, const void *buf, size_t count, ncclDataType_t t, int peer, Comm *c, cudaStream_t s) {
    if (gone(c, send ? "ncclSend" : "ncclRecv")) return ncclInvalidArgument;
    if (peer < 0 || peer >= c->w->n) return ncclInvalidArgument;
    Stream *st = stream_of(s);
    if (sticky(st->dev)) return ncclUnhandledCudaError; /* a lost context (see coll) */
    if (st->dev != c->dev) {
        report("nccl", "rank %d: %s on a stream of device %d; the communicator's device is %d", c->rank,
               send ? "ncclSend" : "ncclRecv", st->dev, c->dev);
        return ncclInvalidUsage;
    }
    t_group.push_back({c, s, send, peer, (void *)buf, count * type_size(t)});
    return t_depth ? ncclSuccess : flush_group();
}

}  // namespace emu

using namespace emu;

int moept_emu_nccl_group_depth(void) { return t_depth; }
extern "C" void moept_emu_nccl_inject_error(int ms) { g_inject_ms = ms > 0 ? ms : 0; }
extern "C" void moept_emu_nccl_version(int code) { g_version = code > 0 ? code : NCCL_VERSION_CODE; }
extern "C" void moept_emu_nccl_fail_p2p(int n) {
    g_fail_p2p_dev = cur_dev;
    g_fail_p2p = n > 0 ? n : 0;
}

extern "C" {

ncclResult_t ncclGetVersion(int *v) {
    if (!v) return ncclInvalidArgument;
    *v = g_version.load();
    return ncclSuccess;
}

/* The id: its maker's pid, the descriptor of the segment it made (an anonymous
   memory file, zero-filled by ftruncate) and the nonce written in it */
ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (!id) return ncclInvalidArgument;
    static std::atomic<uint64_t> counter{0};
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    const uint64_t ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    const uint64_t nonce = (ns * 0x9e3779b97f4a7c15ULL) ^ ((uint64_t)getpid() << 40) ^ ++counter;
    const int fd = memfd_create("moept-emu-nccl", MFD_CLOEXEC);
    if (fd < 0) return ncclSystemError;
    void *p = MAP_FAILED;
    if (ftruncate(fd, sizeof(Shm)) == 0)
        p = mmap(nullptr, sizeof(Shm), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        close(fd);
        return ncclSystemError;
    }
    ((Shm *)p)->nonce.store(nonce);
    munmap(p, sizeof(Shm));
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "moept-emu-nccl.%d.%d.%llx", (int)getpid(), fd,
             (unsigned long long)nonce);
    std::lock_guard<std::mutex> lk(g_mu);
    g_made[id->internal] = fd;
    return ncclSuccess;
}

/* whether process pid runs still (a zombie's descriptors are gone) */
static bool alive(int pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return kill(pid, 0) == 0 || errno == EPERM;
    const size_t k = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[k] = 0;
    const char *s = strrchr(buf, ')'); /* "pid (comm) state ..." */
    return s && s[1] && s[2] != 'Z' && s[2] != 'X';
}

/* maps the id's segment (under g_mu): through the descriptor, if this process
   made the id, else through the maker's in /proc. NULL if it cannot, *err
   saying why: ncclRemoteError when the maker has exited (no report: a peer's
   death), else a report (the id spent, or /proc will not open it) */
static Shm *map_world(const std::string &name, ncclResult_t *err) {
    int pid = 0, fd = -1;
    unsigned long long nonce = 0;
    *err = ncclInvalidArgument;
    if (sscanf(name.c_str(), "moept-emu-nccl.%d.%d.%llx", &pid, &fd, &nonce) != 3) return nullptr;
    auto made = g_made.find(name);
    int f = made != g_made.end() ? made->second : -1, e = ENOENT;
    if (made == g_made.end() && pid != (int)getpid()) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
        f = open(path, O_RDWR | O_CLOEXEC);
        e = errno;
    }
    struct stat st;
    void *p = MAP_FAILED;
    if (f >= 0 && fstat(f, &st) == 0 && st.st_size == (off_t)sizeof(Shm))
        p = mmap(nullptr, sizeof(Shm), PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
    if (f >= 0 && made == g_made.end()) close(f);
    Shm *m = p == MAP_FAILED ? nullptr : (Shm *)p;
    if (m && m->nonce.load() == nonce) return m;
    if (m) munmap(m, sizeof(Shm));
    if (!alive(pid)) {
        fprintf(stderr, "moept-emu: nccl: ncclCommInitRank: the id's maker (pid %d) has exited\n", pid);
        *err = ncclRemoteError;
    } else if (f < 0 && e != ENOENT) {
        report("nccl", "ncclCommInitRank: cannot open the segment of %s through /proc/%d/fd/%d: %s",
               name.c_str(), pid, fd, strerror(e));
        *err = ncclSystemError;
    } else {
        report("nccl", "ncclCommInitRank: the id %s is spent (its world formed; an id serves one "
               "communicator)", name.c_str());
        *err = ncclInvalidUsage;
    }
    return nullptr;
}

/* Two ranks of one communicator on one GPU, checked once every rank joined (NCCL checks after
   its first all-gather of the ranks' peer info, src/init.cc initTransportsRank). An emulated GPU
   is one process's device (each process has its own, as each process of the MPI runs sees one
   GPU), so two ranks share one when their process and device are the same.
   - NCCL before 2.30 (NVIDIA/nccl src/init.cc to v2.29.7-1, e.g. v2.28.9-1 line 904): a rank
     whose GPU (host hash and PCI bus id) another rank i also has, lowest i first, WARNs
     "Duplicate GPU detected : rank <its rank> and rank <i> both on CUDA device <bus id, hex>"
     and ncclCommInitRank gives ncclInvalidUsage, *comm NULL (ncclCommInitRankDev's fail path).
     ncclGetLastError gives the last WARN, whatever the comm (src/debug.cc ncclLastError). Seen
     on every sharing rank: github.com/horovod/horovod/issues/3929, NVIDIA/nccl/issues/1241.
     The emulator prints the device ordinal (it has no bus id). A rank on a GPU of its own
     passes the check and goes on to a bootstrap exchange with peers that have left; here it
     gets ncclRemoteError ("a remote process exiting prematurely", NCCL API ncclResult_t)
     rather than a wait without end.
   - From 2.30 (docs/userguide/source/env.rst: NCCL_MULTI_RANK_GPU_ENABLE, "since 2.30",
     default 0; v2.30.7-1 src/init.cc): every rank of a communicator in which any two share a
     GPU gives ncclInvalidUsage, WARN "Multiple Ranks are using the same GPU/Partition. Set
     NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this configuration.", unless the variable is set
     (nonzero: NCCL_PARAM reads an integer); then the communicator forms. (2.30.3 and 2.30.4
     failed only the host's first rank, src/graph/topo.cc ncclCheckMultiRank; 2.30.7 is
     emulated.) */
static ncclResult_t dup_gpu(Shm *m, int n, int rank, char *msg, size_t len) {
    auto same = [m](int i, int j) {
        return m->pid[i].load() == m->pid[j].load() && m->dev[i].load() == m->dev[j].load();
    };
    int mine = -1, any = 0; /* the lowest other rank on this rank's GPU; whether any two share one */
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            if (i != j && same(i, j)) {
                any = 1;
                if (i == rank && mine < 0) mine = j;
            }
    if (!any) return ncclSuccess;
    if (g_version.load() >= NCCL_VERSION(2, 30, 0)) {
        const char *e = getenv("NCCL_MULTI_RANK_GPU_ENABLE");
        if (e && strtoll(e, nullptr, 0) != 0) return ncclSuccess;
        snprintf(msg, len, "Multiple Ranks are using the same GPU/Partition. Set "
                 "NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this configuration.");
        return ncclInvalidUsage;
    }
    if (mine < 0) {
        snprintf(msg, len, "rank %d: ranks of this communicator that share a GPU left its initialisation",
                 rank);
        return ncclRemoteError;
    }
    snprintf(msg, len, "Duplicate GPU detected : rank %d and rank %d both on CUDA device %x", rank, mine,
             m->dev[rank].load());
    return ncclInvalidUsage;
}

ncclResult_t ncclCommInitRank(ncclComm_t *out, int n, ncclUniqueId id, int rank) {
    if (!out || n < 1 || n > MAXRANKS || rank < 0 || rank >= n) return ncclInvalidArgument;
    char name[sizeof id.internal + 1];
    memcpy(name, id.internal, sizeof id.internal);
    name[sizeof id.internal] = 0;
    if (strncmp(name, "moept-emu-nccl.", 15) != 0) return ncclInvalidArgument;
    if (sticky(cur_dev)) return ncclUnhandledCudaError; /* a lost context (see coll) */
    World *w;
    {
        std::lock_guard<std::mutex> lk(g_mu);
        auto it = g_worlds.find(name);
        if (it == g_worlds.end()) {
            ncclResult_t err;
            Shm *m = map_world(name, &err);
            if (!m) return err;
            w = new World();
            w->name = name;
            w->shm = m;
            w->n = n;
            w->last.resize((size_t)n);
            g_worlds[name] = w;
        } else {
            w = it->second;
        }
    }
    Shm *m = w->shm;
    int zero = 0;
    uint64_t z = 0;
    if (!m->magic.compare_exchange_strong(z, MAGIC) && z != MAGIC) {
        report("nccl", "ncclCommInitRank: the segment of %s is not an emulated NCCL world", name);
        return ncclInvalidArgument;
    }
    if (!m->n.compare_exchange_strong(zero, n) && zero != n) return ncclInvalidArgument;
    {
        std::lock_guard<std::mutex> lk(g_mu);
        w->live++;
    }
    Comm *c = new Comm();
    c->w = w;
    c->rank = rank;
    c->dev = cur_dev;
    m->pid[rank] = (int)getpid();
    m->dev[rank] = cur_dev;
    m->joined.fetch_add(1);
    double t0 = now();
    while (m->joined.load() < n) { /* blocking, as ncclCommInitRank is: for ever */
        usleep(200);
        if (now() - t0 > hang_seconds()) {
            char h[200];
            snprintf(h, sizeof h, "ncclCommInitRank: rank %d waited for %d ranks; %d came", rank, n,
                     m->joined.load());
            hang(h);
        }
    }
    char msg[sizeof g_last];
    const ncclResult_t dup = dup_gpu(m, n, rank, msg, sizeof msg);
    std::lock_guard<std::mutex> lk(g_mu); /* every rank joined, so every process mapped it: the maker's */
    auto made = g_made.find(name);        /* descriptor can go (the memory lives until the last unmap) */
    if (made != g_made.end()) {
        close(made->second);
        g_made.erase(made);
    }
    if (dup != ncclSuccess) { /* no communicator: this rank's part of the world goes */
        fprintf(stderr, "moept-emu: nccl: ncclCommInitRank: %s\n", msg);
        memcpy(g_last, msg, sizeof g_last);
        delete c;
        if (--w->live == 0 && !w->aborted) {
            munmap(w->shm, sizeof(Shm));
            g_worlds.erase(w->name);
            delete w;
        }
        *out = nullptr;
        return dup;
    }
    *out = (ncclComm_t)c;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t h, int *rank) {
    Comm *c = (Comm *)h;
    if (gone(c, "ncclCommUserRank") || !rank) return ncclInvalidArgument;
    *rank = c->rank;
    return ncclSuccess;
}
ncclResult_t ncclCommCount(const ncclComm_t h, int *n) {
    Comm *c = (Comm *)h;
    if (gone(c, "ncclCommCount") || !n) return ncclInvalidArgument;
    *n = c->w->n;
    return ncclSuccess;
}

/* NCCL API, ncclCommCuDevice: the CUDA device the communicator was made on */
ncclResult_t ncclCommCuDevice(const ncclComm_t h, int *device) {
    Comm *c = (Comm *)h;
    if (gone(c, "ncclCommCuDevice") || !device) return ncclInvalidArgument;
    *device = c->dev;
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t h, ncclResult_t *r) {
    Comm *c = (Comm *)h;
    if (gone(c, "ncclCommGetAsyncError") || !r) return ncclInvalidArgument;
    *r = (ncclResult_t)c->async.load();
    return ncclSuccess;
}

const char *ncclGetLastError(ncclComm_t h) {
    Comm *c = (Comm *)h;
    if (c && c->dead) {
        report("nccl", "ncclGetLastError on a communicator that ncclCommAbort or ncclCommDestroy already freed");
        return "";
    }
    return c ? c->err : g_last;
}

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

ncclResult_t ncclCommAbort(ncclComm_t h) {
    Comm *c = (Comm *)h;
    if (!c) return ncclSuccess;
    if (gone(c, "ncclCommAbort")) return ncclInvalidArgument;
    c->dead = true; /* freed, as far as the caller may know; its waiting ops end */
    c->w->shm->aborted[c->rank] = 1;
    std::lock_guard<std::mutex> lk(g_mu);
    c->w->aborted = true; /* its op may still be in the segment: this process keeps the mapping */
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t h) {
    Comm *c = (Comm *)h;
    if (!c) return ncclSuccess;
    if (gone(c, "ncclCommDestroy")) return ncclInvalidArgument;
    std::shared_ptr<Op> last;
    {
        std::lock_guard<std::mutex> lk(c->w->m);
        last = c->w->last[(size_t)c->rank];
    }
    if (last) wait_op(last, 1e9); /* its work completes first */
    for (int p = 0; p < c->w->n; p++) {
        Ring &r = c->w->shm->ring[p * MAXRANKS + c->rank];
        if (r.head.load() != r.tail.load() && !c->w->shm->aborted[p].load())
            report("nccl", "ncclCommDestroy on rank %d: a message from rank %d was never received", c->rank, p);
    }
    c->dead = true;
    std::lock_guard<std::mutex> lk(g_mu); /* the last of this process's comms unmaps the segment */
    World *w = c->w;
    if (--w->live == 0 && !w->aborted) {
        munmap(w->shm, sizeof(Shm));
        g_worlds.erase(w->name);
        delete w;
    }
    return ncclSuccess;
}

ncclResult_t ncclGroupStart(void) {
    t_depth++;
    return ncclSuccess;
}
ncclResult_t ncclGroupEnd(void) {
    if (t_depth <= 0) return ncclInvalidUsage;
    return --t_depth ? ncclSuccess : flush_group();
}

ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
    return p2p(1, buf, count, t, peer, (Comm *)c, s);
}
ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
    return p2p(0, buf, count, t, peer, (Comm *)c, s);
}

static ncclResult_t coll(int gather, const void *sb, void *rb, size_t count, ncclDataType_t t, Comm *c, cudaStream_t s) {
    if (gone(c, gather ? "ncclAllGather" : "ncclAllReduce")) return ncclInvalidArgument;
    if (t_depth) {
        report("nccl", "rank %d: a collective inside ncclGroupStart/End (not emulated)", c->rank);
        return ncclInvalidUsage;
    }
    Stream *st = stream_of(s);
    /* NCCL, ncclResult_t: ncclUnhandledCudaError, a call to a CUDA function
       failed: so every NCCL call on a lost context (emu_rt.cc, lose) */
    if (sticky(st->dev)) return ncclUnhandledCudaError;
    if (st->dev != c->dev) return ncclInvalidUsage;
    uint64_t seq = c->nextcoll++;
    char nm[80];
    snprintf(nm, sizeof nm, "%s #%llu (%zu elements, rank %d)", gather ? "ncclAllGather" : "ncclAllReduce",
             (unsigned long long)seq, count, c->rank);
    /* a graph's replay is the comm's next collective, not this one again */
    t_remake = [c, gather, sb, rb, count, t]() -> std::function<void(Op &)> {
        uint64_t sq = c->nextcoll++;
        return [c, sq, gather, sb, rb, count, t](Op &) {
            if (!c->dead) run_coll(c, sq, gather, sb, rb, count, t);
        };
    };
    t_after = [c](const std::shared_ptr<Op> &o) { note_last(c, o); };
    enqueue(st, nm, [c, seq, gather, sb, rb, count, t](Op &) {
        if (!c->dead) run_coll(c, seq, gather, sb, rb, count, t);
    });
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *sb, void *rb, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c,
                           cudaStream_t s) {
    if (op != ncclSum) return ncclInvalidArgument; /* the only one moept uses */
    return coll(0, sb, rb, count, t, (Comm *)c, s);
}
ncclResult_t ncclAllGather(const void *sb, void *rb, size_t count, ncclDataType_t t, ncclComm_t c, cudaStream_t s) {
    return coll(1, sb, rb, count, t, (Comm *)c, s);
}

}  // extern "C"
