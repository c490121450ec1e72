/* emu_nccl.cc - the emulated NCCL: ranks are threads of one process, each
   with its own emulated device (cudaSetDevice before ncclCommInitRank).
   Written from NCCL's documentation: ncclGetUniqueId/ncclCommInitRank
   (blocking until every rank joined), ncclGroupStart/End (per thread,
   nested; the group's point-to-point calls become one op per stream at the
   outermost ncclGroupEnd), ncclSend/ncclRecv (matched per ordered pair of
   ranks in call order; sizes must agree), ncclAllReduce and ncclAllGather
   (the i-th collective of every rank meet; count and type must agree),
   ncclCommGetAsyncError, ncclCommAbort, ncclCommDestroy, ncclGetLastError.
   Every call is an op on its stream and runs when the stream gets there.
   A peer that does not come within the timeout gives the communicator an
   asynchronous error (ncclRemoteError) and a report, never a hang. A
   communicator used after ncclCommAbort or ncclCommDestroy is a report. */
#include "emu_internal.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

namespace emu {

struct Msg {
    std::vector<char> bytes;
    bool taken = false;
};
struct Coll {
    int arrived = 0, left = 0;
    std::vector<std::vector<char>> part;
    std::vector<size_t> count;
    std::vector<int> type;
};
struct Comm;
struct World {
    int n = 0, joined = 0;
    std::mutex m;
    std::condition_variable cv;
    std::vector<std::deque<std::shared_ptr<Msg>>> box; /* [src * n + dst] */
    std::map<uint64_t, Coll> coll;
    std::vector<std::shared_ptr<Op>> last;             /* [rank] newest op enqueued */
    bool aborted = false;
};
struct Comm {
    World *w;
    int rank, dev;
    uint64_t nextcoll = 0;
    std::atomic<int> async{ncclSuccess};
    bool dead = false;          /* aborted or destroyed: the handle is gone */
    char err[256] = "";
};

static std::mutex g_mu;
static std::map<int, World *> g_worlds;
static int g_next_world = 1;
static int g_timeout_ms = 20000;

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

static void set_error(Comm *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_error(Comm *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    c->async = ncclRemoteError;
    report("nccl", "rank %d: %s", c->rank, c->err);
}

/* waits (under w->m) until pred holds, letting every peer's stream run; 0 on timeout or abort */
template <typename F>
static bool wait_peers(Comm *c, std::unique_lock<std::mutex> &lk, F pred) {
    World *w = c->w;
    double t0 = now();
    while (!pred()) {
        if (w->aborted || c->dead) return false;
        std::vector<std::shared_ptr<Op>> last = w->last;
        lk.unlock();
        for (auto &o : last)
            if (o) force(o->s, o->seq);
        lk.lock();
        if (pred()) break;
        w->cv.wait_for(lk, std::chrono::milliseconds(2));
        if (now() - t0 > g_timeout_ms * 1e-3) return false;
    }
    return true;
}

static void run_p2p(Comm *c, const std::vector<Pending> &ps) {
    World *w = c->w;
    std::vector<std::shared_ptr<Msg>> sent;
    for (const Pending &p : ps) {
        if (!p.send) continue;
        auto m = std::make_shared<Msg>();
        if (touch(p.buf, p.bytes, 0, "ncclSend read")) m->bytes.assign((char *)p.buf, (char *)p.buf + p.bytes);
        std::lock_guard<std::mutex> lk(w->m);
        w->box[(size_t)(c->rank * w->n + p.peer)].push_back(m);
        sent.push_back(m);
        w->cv.notify_all();
    }
    std::unique_lock<std::mutex> lk(w->m);
    for (const Pending &p : ps) {
        if (p.send) continue;
        auto &q = w->box[(size_t)(p.peer * w->n + c->rank)];
        if (!wait_peers(c, lk, [&] { return !q.empty(); })) {
            set_error(c, "ncclRecv from rank %d (%zu bytes): no matching ncclSend came", p.peer, p.bytes);
            return;
        }
        auto m = q.front();
        q.pop_front();
        m->taken = true;
        w->cv.notify_all();
        if (m->bytes.size() != p.bytes) {
            set_error(c, "ncclRecv from rank %d of %zu bytes met an ncclSend of another size", p.peer, p.bytes);
            continue;
        }
        lk.unlock();
        if (touch(p.buf, p.bytes, 1, "ncclRecv write")) memcpy(p.buf, m->bytes.data(), p.bytes);
        lk.lock();
    }
    for (size_t i = 0; i < sent.size(); i++)
        if (!wait_peers(c, lk, [&] { return sent[i]->taken; })) {
            set_error(c, "ncclSend of message %zu (%zu bytes): no matching ncclRecv came", i,
                      sent[i]->bytes.size());
            return;
        }
}

/* allreduce (sum) or allgather: the seq-th collective of every rank */
static void run_coll(Comm *c, uint64_t seq, int gather, const void *sb, void *rb, size_t count, ncclDataType_t t) {
    World *w = c->w;
    size_t es = type_size(t), bytes = count * es;
    std::vector<char> mine;
    if (touch(sb, bytes, 0, gather ? "ncclAllGather read" : "ncclAllReduce read"))
        mine.assign((const char *)sb, (const char *)sb + bytes);
    mine.resize(bytes);
    std::unique_lock<std::mutex> lk(w->m);
    Coll &k = w->coll[seq];
    if (k.part.empty()) { k.part.resize((size_t)w->n); k.count.resize((size_t)w->n); k.type.resize((size_t)w->n); }
    k.part[(size_t)c->rank] = std::move(mine);
    k.count[(size_t)c->rank] = count;
    k.type[(size_t)c->rank] = (int)t;
    k.arrived++;
    w->cv.notify_all();
    if (!wait_peers(c, lk, [&] { return k.arrived == w->n; })) {
        set_error(c, "%s #%d: not every rank came (%zu elements)", gather ? "ncclAllGather" : "ncclAllReduce", (int)seq, count);
        return;
    }
    for (int r = 0; r < w->n; r++)
        if (k.count[(size_t)r] != count || k.type[(size_t)r] != (int)t) {
            set_error(c, "%s: rank %d's count or type differs (%zu here)", gather ? "ncclAllGather" : "ncclAllReduce", r, count);
            return;
        }
    std::vector<char> out(gather ? bytes * (size_t)w->n : bytes);
    for (int r = 0; r < w->n; r++) {
        const char *p = k.part[(size_t)r].data();
        if (gather) { memcpy(out.data() + (size_t)r * bytes, p, bytes); continue; }
        for (size_t i = 0; i < count; i++) { /* rank order: every rank gets the same sum */
            char *o = out.data() + i * es;
            const char *v = p + i * es;
            if (t == ncclFloat32) { float a, b; memcpy(&a, o, 4); memcpy(&b, v, 4); a = r ? a + b : b; memcpy(o, &a, 4); }
            else if (t == ncclFloat64) { double a, b; memcpy(&a, o, 8); memcpy(&b, v, 8); a = r ? a + b : b; memcpy(o, &a, 8); }
            else if (t == ncclInt64) { int64_t a, b; memcpy(&a, o, 8); memcpy(&b, v, 8); a = r ? a + b : b; memcpy(o, &a, 8); }
            else if (t == ncclInt32) { int32_t a, b; memcpy(&a, o, 4); memcpy(&b, v, 4); a = r ? a + b : b; memcpy(o, &a, 4); }
            else { set_error(c, "ncclAllReduce: type %d not emulated (%zu elements)", (int)t, count); return; }
        }
    }
    if (++k.left == w->n) w->coll.erase(seq);
    lk.unlock();
    if (touch(rb, out.size(), 1, gather ? "ncclAllGather write" : "ncclAllReduce write")) memcpy(rb, out.data(), out.size());
}

static void note_last(Comm *c, const std::shared_ptr<Op> &o) {
    if (getenv("MOEPT_EMU_TRACE")) fprintf(stderr, "moept-emu trace: rank %d enqueues %s\n", c->rank, o->name.c_str());
    std::lock_guard<std::mutex> lk(c->w->m);
    c->w->last[(size_t)c->rank] = o;
    c->w->cv.notify_all();
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
        enqueue(st, nm, [c, mine](Op &) { if (!c->dead) run_p2p(c, mine); });
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
extern "C" void moept_emu_nccl_timeout(int ms) { g_timeout_ms = ms > 0 ? ms : 20000; }

extern "C" {

ncclResult_t ncclGetVersion(int *v) {
    if (!v) return ncclInvalidArgument;
    *v = NCCL_VERSION_CODE;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (!id) return ncclInvalidArgument;
    memset(id, 0, sizeof *id);
    std::lock_guard<std::mutex> lk(g_mu);
    int w = g_next_world++;
    g_worlds[w] = new World();
    memcpy(id->internal, &w, sizeof w);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *out, int n, ncclUniqueId id, int rank) {
    if (!out || n < 1 || rank < 0 || rank >= n) return ncclInvalidArgument;
    if (sticky(cur_dev)) return ncclUnhandledCudaError; /* a lost context (see coll) */
    int wid;
    memcpy(&wid, id.internal, sizeof wid);
    World *w;
    {
        std::lock_guard<std::mutex> lk(g_mu);
        auto it = g_worlds.find(wid);
        if (it == g_worlds.end()) return ncclInvalidArgument;
        w = it->second;
    }
    Comm *c = new Comm();
    c->w = w;
    c->rank = rank;
    c->dev = cur_dev;
    std::unique_lock<std::mutex> lk(w->m);
    if (w->n == 0) {
        w->n = n;
        w->box.resize((size_t)(n * n));
        w->last.resize((size_t)n);
    }
    if (w->n != n) { delete c; return ncclInvalidArgument; }
    w->joined++;
    w->cv.notify_all();
    double t0 = now();
    while (w->joined < n) { /* blocking, as ncclCommInitRank is */
        w->cv.wait_for(lk, std::chrono::milliseconds(10));
        if (now() - t0 > g_timeout_ms * 1e-3) {
            report("nccl", "ncclCommInitRank: rank %d waited for %d ranks; %d came", rank, n, w->joined);
            return ncclSystemError;
        }
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
    return c ? c->err : "";
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
    std::lock_guard<std::mutex> lk(c->w->m);
    c->dead = true; /* freed, as far as the caller may know */
    c->w->aborted = true;
    c->w->cv.notify_all();
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
    std::lock_guard<std::mutex> lk(c->w->m);
    for (int p = 0; p < c->w->n; p++)
        if (!c->w->box[(size_t)(p * c->w->n + c->rank)].empty())
            report("nccl", "ncclCommDestroy on rank %d: a message from rank %d was never received", c->rank, p);
    c->dead = true;
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
