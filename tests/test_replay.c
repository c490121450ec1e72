/* test_replay: routing replay (moept_forward_opts.replay_ids). Built twice:
   build/test_replay runs CPU layers over the threads backend (EP 1, 2, 4),
   build/emu/test_replay CUDA layers on the emulated GPU over NCCL ranks
   (EP 1, 2, 4; fp32 and bf16; the default, sync-free and chunked modes),
   and compares them with the CPU layer, the spec. Checked: replaying a
   forward's own ids equals that forward bitwise (y, dx, every gradient, the
   losses, the routing); an EP 4 rollout replayed at EP 2 equals the EP 4
   forward; another choice than the router's gives the weights computed here
   by hand (and on the GPU the CPU layer's values); a padded token's row is
   not read; rows out of range or repeating an expert fail every rank, with
   the layer as it was. */
#define MOEPT_INTERNAL /* bf16 conversions (GPU build) */
#include "../moept.h"
#include "testutil.h"
#include "tu_exec.h"

#include <math.h>
#ifdef MOEPT_CUDA
#include <cuda_runtime.h>
#ifdef MOEPT_EMU
#include "emu/emu.h" /* (the emulated GPU's launch counts) */
#endif
#define GPU 1
#else
#define GPU 0
#endif

#define MAXP 4 /* world ranks */

/* one rank's step: its inputs (host) and results */
typedef struct outs {
    float *y, *dx, *g;      /* [T][D], [T][D], [n_params] after sync_grads */
    int32_t *ids;           /* [T][K] moept_routing's */
    float *wts;             /* [T][K] */
    int64_t ng;
    moept_stats st;
    int64_t tpe[64];        /* tokens per expert */
} outs;

/* fp8: config.fp8 (1; on the GPU 2: in the grouped kernel, MOEPT_GEMM_KERNEL) */
typedef struct mode { int gpu, bf16, sync_free, chunks, fp8; } mode;

/* A world of P ranks (threads; NCCL ranks on the GPU), each with T[r]
   tokens of the batch x, dy [sum T][D]; per rank a list of steps, each with
   its replay [T][K] (NULL: the router's) and an outs */
typedef struct world {
    moept_config cfg;
    mode m;
    int P;
    int64_t T[MAXP], D, K;
    const float *x, *dy;
    const uint8_t *mask;            /* [sum T] or NULL */
    int DP;                         /* CPU: data-parallel replicas (world P * DP ranks; 0 = 1) */
    float drift;                    /* added to the router's weights (a router trained on since) */
    int nsteps;
    const int32_t *replay[4];       /* per step: [sum T][K] or NULL */
    int replay_prev[4];             /* per step: replay the rank's ids of the step before */
    int corrupt[4];                 /* per step: 1 its replay's row 3 has k 1 out of range, 2 a repeat */
    int bad_rank[4];                /* ... on this world rank only (-1: on every rank) */
    outs o[4][MAXP];                /* [step][world rank] */
    moept_status st[4][MAXP];
    char err[4][MAXP][512];
    int kept[4][MAXP];              /* after a rejected step: routing and statistics as before */
#ifdef MOEPT_CUDA
    ncclUniqueId id;
#endif
} world;

typedef struct job { world *w; int r; } job;

/* the world rank r's first token: DP replicas see the same batch (EP rank r % P's tokens) */
static int64_t off_of(const world *w, int r) {
    int64_t o = 0;
    for (int i = 0; i < r % w->P; i++) o += w->T[i];
    return o;
}

#ifdef MOEPT_CUDA
static void *dev_copy(const void *h, size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes + 4) == cudaSuccess && h) cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    return d;
}
static void *dev_rows(const float *h, int64_t n, int bf16) {
    if (!bf16) return dev_copy(h, (size_t)n * 4);
    uint16_t *s = malloc((size_t)(n + 1) * 2);
    for (int64_t i = 0; i < n; i++) s[i] = moept__f32_to_bf16(h[i]);
    void *d = dev_copy(s, (size_t)n * 2);
    free(s);
    return d;
}
static void host_rows(float *h, const void *d, int64_t n, int bf16) {
    if (!bf16) { cudaMemcpy(h, d, (size_t)n * 4, cudaMemcpyDeviceToHost); return; }
    uint16_t *s = malloc((size_t)(n + 1) * 2);
    cudaMemcpy(s, d, (size_t)n * 2, cudaMemcpyDeviceToHost);
    for (int64_t i = 0; i < n; i++) h[i] = moept__bf16_to_f32(s[i]);
    free(s);
}
#endif

/* the last step before s that succeeded on rank r (0: the first) */
static int last_ok(const world *w, int r, int s) {
    int src = s - 1;
    while (src > 0 && w->st[src][r]) src--;
    return src;
}

/* forward (replay or NULL), backward, sync_grads; results into o (the
   routing, gradients and statistics read back). A GPU layer's inputs go to
   the device first (replay too) and its y and dx come back. */
static moept_status step(moept_layer *L, const world *w, int64_t T, const float *x, const float *dy,
                         const int32_t *replay, const uint8_t *mask, outs *o) {
    const int64_t K = w->K;
    moept_status st = moept_zero_grad(L);
    if (st) return st;
    if (!w->m.gpu) {
        moept_forward_opts fo = {mask, 0, replay, NULL, 0};
        st = moept_forward_ex(L, x, T, o->y, &fo);
        if (!st) st = moept_backward(L, x, dy, o->dx);
    }
#ifdef MOEPT_CUDA
    if (w->m.gpu) {
        const int64_t D = w->D;
        void *xd = dev_rows(x, T * D, w->m.bf16), *dyd = dev_rows(dy, T * D, w->m.bf16);
        void *yd = dev_rows(o->y, T * D, w->m.bf16), *dxd = dev_rows(o->dx, T * D, w->m.bf16);
        int32_t *rd = replay ? dev_copy(replay, (size_t)(T * K) * 4) : NULL;
        uint8_t *md = mask ? dev_copy(mask, (size_t)T) : NULL; /* device memory, as x */
        moept_forward_opts fo = {md, 0, rd, NULL, 0};
        st = moept_forward_ex(L, xd, T, yd, &fo);
        if (!st) st = moept_backward(L, xd, dyd, dxd);
        if (!st) { host_rows(o->y, yd, T * D, w->m.bf16); host_rows(o->dx, dxd, T * D, w->m.bf16); }
        cudaFree(xd); cudaFree(dyd); cudaFree(yd); cudaFree(dxd); cudaFree(rd); cudaFree(md);
    }
#endif
    if (!st) st = moept_sync_grads(L, 1.0f);
    if (!st) st = moept_grad_norm(L, &(double){0}); /* sync-free: reads the device's checks */
    const int32_t *ids;
    const float *wts;
    if (!st) st = moept_routing(L, &ids, &wts, NULL);
    if (!st) { memcpy(o->ids, ids, (size_t)(T * K) * 4); memcpy(o->wts, wts, (size_t)(T * K) * 4); }
    if (!st && !(o->g = tu_buf(L, MOEPT_BUF_GRADS, &o->ng))) st = MOEPT_ERR_STATE;
    if (!st) st = moept_get_stats(L, &o->st, o->tpe);
    return st;
}

static moept_status make_layer(world *w, moept_comm *ep, moept_comm *dp, moept_layer **L) {
    moept_config c = w->cfg;
    c.overlap_chunks = w->m.chunks;
    c.fp8 = w->m.fp8 ? MOEPT_FP8_BLOCKWISE : MOEPT_FP8_OFF;
    moept_status st = MOEPT_ERR_UNSUPPORTED;
    if (!w->m.gpu) st = moept_create_parallel(&c, ep, dp, L);
#ifdef MOEPT_CUDA
    moept_cuda_options o = {w->m.bf16 ? MOEPT_DTYPE_BF16 : MOEPT_DTYPE_F32, NULL, 0, w->m.sync_free,
                            w->m.fp8 == 2 ? MOEPT_GEMM_KERNEL : MOEPT_GEMM_AUTO};
    if (w->m.gpu) st = moept_create_cuda(&c, ep, dp, &o, L);
#endif
    if (!st) st = moept_init_params(*L, 7);
    const int64_t nr = c.num_experts * c.hidden_size;
    float *wr = malloc((size_t)nr * 4);
    if (!st && w->drift != 0.0f && !(st = moept_get_param(*L, "gate.weight", wr, nr))) {
        for (int64_t i = 0; i < nr; i++) wr[i] += w->drift * (float)((i * 7) % 11 - 5);
        st = moept_set_param(*L, "gate.weight", wr, nr);
    }
    free(wr);
    if (!st && c.family == MOEPT_FAMILY_DEEPSEEK_V3) {
        float b[64];
        for (int64_t e = 0; e < c.num_experts; e++) b[e] = 0.02f * (float)(e % 3);
        st = moept_set_param(*L, "gate.e_score_correction_bias", b, c.num_experts);
    }
    return st;
}

/* after a rejected step s: the last committed step is still the layer's
   (its routing and statistics) */
static int still_committed(moept_layer *L, const world *w, int r, int s) {
    const outs *p = &w->o[last_ok(w, r, s)][r];
    const int64_t T = w->T[r % w->P], K = w->K;
    const int32_t *ids;
    const float *wts;
    moept_stats st;
    if (moept_routing(L, &ids, &wts, NULL) || memcmp(ids, p->ids, (size_t)(T * K) * 4) ||
        memcmp(wts, p->wts, (size_t)(T * K) * 4))
        return 0;
    if (moept_get_stats(L, &st, NULL) || st.steps != p->st.steps || st.aux_loss != p->st.aux_loss ||
        st.z_loss != p->st.z_loss || st.routed_rows != p->st.routed_rows)
        return 0;
    return 1;
}

static moept_thread_group *g_ep[MAXP], *g_dp[MAXP];

/* the ids of the last good step before s, as step s replays them: a padded
   token's row holds what no check would pass (it is not read); corrupted:
   row 3's k = 1 out of range, or repeating k = 0 */
static int32_t *prev_ids(const world *w, int r, int s) {
    const int64_t T = w->T[r % w->P], K = w->K;
    int32_t *rec = malloc((size_t)(T * K + 1) * 4);
    memcpy(rec, w->o[last_ok(w, r, s)][r].ids, (size_t)(T * K) * 4);
    for (int64_t t = 0; w->mask && t < T; t++)
        if (!w->mask[off_of(w, r) + t]) { rec[t * K] = -7; rec[t * K + 1] = t % 2 ? 99 : -7; }
    if (w->corrupt[s] && (w->bad_rank[s] < 0 || w->bad_rank[s] == r))
        rec[3 * K + 1] = w->corrupt[s] == 1 ? (int32_t)w->cfg.num_experts : rec[3 * K];
    return rec;
}

static void *rank_main(void *arg) {
    job *j = arg;
    world *w = j->w;
    const int r = j->r;
    moept_comm *ep = NULL, *dp = NULL;
#ifdef MOEPT_CUDA
    cudaStream_t s = NULL;
    ncclComm_t nc = NULL;
    if (w->m.gpu) {
        cudaSetDevice(r);
        if (w->P > 1) {
            cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
            ncclCommInitRank(&nc, w->P, w->id, r);
            moept_comm_nccl(nc, s, 20000, &ep);
        }
    }
#endif
    if (!w->m.gpu && w->P > 1) moept_comm_threads(g_ep[r / w->P], r % w->P, &ep);
    if (!w->m.gpu && w->DP > 1) moept_comm_threads(g_dp[r % w->P], r / w->P, &dp);
    moept_layer *L = NULL;
    moept_status st = make_layer(w, ep, dp, &L);
    if (st) snprintf(w->err[0][r], 512, "create: %s", moept_last_error(NULL));
    const int64_t o = off_of(w, r), D = w->D, K = w->K, T = w->T[r % w->P];
    for (int s_ = 0; s_ < w->nsteps && !st; s_++) {
        const int32_t *rp = w->replay[s_];
        int32_t *own = w->replay_prev[s_] ? prev_ids(w, r, s_) : NULL;
        w->st[s_][r] = step(L, w, T, w->x + o * D, w->dy + o * D, own ? own : rp ? rp + o * K : NULL,
                            w->mask ? w->mask + o : NULL, &w->o[s_][r]);
        free(own);
        if (w->st[s_][r]) snprintf(w->err[s_][r], 512, "%s", moept_last_error(L));
        if (w->st[s_][r] && !w->corrupt[s_]) break;
        if (w->corrupt[s_]) w->kept[s_][r] = still_committed(L, w, r, s_);
    }
    moept_destroy(L);
    moept_comm_destroy(ep);
    moept_comm_destroy(dp);
#ifdef MOEPT_CUDA
    if (nc) { ncclCommDestroy(nc); cudaStreamDestroy(s); }
#endif
    return NULL;
}

static void run_world(world *w) {
    job jobs[MAXP];
    if (w->DP < 1) w->DP = 1;
    const int n = w->P * w->DP;
    for (int s = 0; s < w->nsteps; s++)
        for (int r = 0; r < n; r++) {
            outs *o = &w->o[s][r];
            const int64_t T = w->T[r % w->P];
            o->y = calloc((size_t)(T * w->D + 1), 4);
            o->dx = calloc((size_t)(T * w->D + 1), 4);
            o->ids = calloc((size_t)(T * w->K + 1), 4);
            o->wts = calloc((size_t)(T * w->K + 1), 4);
        }
#ifdef MOEPT_CUDA
    if (w->m.gpu) ncclGetUniqueId(&w->id);
#endif
    for (int d = 0; d < w->DP && w->P > 1 && !w->m.gpu; d++) moept_thread_group_create(w->P, 20000, &g_ep[d]);
    for (int e = 0; e < w->P && w->DP > 1; e++) moept_thread_group_create(w->DP, 20000, &g_dp[e]);
    for (int r = 0; r < n; r++) jobs[r] = (job){w, r};
    tu_threads(n, rank_main, jobs, sizeof jobs[0]);
    for (int d = 0; d < w->DP && w->P > 1 && !w->m.gpu; d++) moept_thread_group_destroy(g_ep[d]);
    for (int e = 0; e < w->P && w->DP > 1; e++) moept_thread_group_destroy(g_dp[e]);
}

static void free_world(world *w) {
    for (int s = 0; s < 4; s++)
        for (int r = 0; r < MAXP; r++) {
            outs *o = &w->o[s][r];
            free(o->y); free(o->dx); free(o->g); free(o->ids); free(o->wts);
        }
    memset(w->o, 0, sizeof w->o);
}

static moept_config cfg_of(int fam) {
    moept_config c = moept_config_default((moept_family)fam);
    c.hidden_size = 24; c.intermediate_size = 20; c.num_experts = 8; c.top_k = 2; c.max_tokens = 40;
    c.aux_loss = MOEPT_AUX_HF; c.aux_loss_coef = 0.01f; c.z_loss_coef = 0.001f; c.global_balance = 1;
    if (fam == MOEPT_FAMILY_QWEN2_MOE || fam == MOEPT_FAMILY_DEEPSEEK_V3) c.shared_intermediate_size = 16;
    if (fam == MOEPT_FAMILY_DEEPSEEK_V3) {
        c.n_group = 4; c.topk_group = 2; c.routed_scaling_factor = 2.5f; c.aux_loss = MOEPT_AUX_MEGATRON;
    }
    if (fam == MOEPT_FAMILY_OLMOE) c.capacity_factor = 0.75f; /* drops: replay keeps them too */
    return c;
}

/* values of a and b that differ bitwise, over n */
static int64_t ndiff(const void *a, const void *b, int64_t n, size_t es) {
    int64_t d = 0;
    for (int64_t i = 0; i < n; i++) d += memcmp((const char *)a + i * es, (const char *)b + i * es, es) != 0;
    return d;
}

/* step a's results against step b's, every rank: differing values of y, dx,
   gradients, routing; the statistics */
static int64_t world_diffs(const world *w, int a, int b) {
    int64_t d = 0;
    for (int r = 0; r < w->P * w->DP; r++) {
        const outs *p = &w->o[a][r], *q = &w->o[b][r];
        const int64_t T = w->T[r % w->P];
        d += ndiff(p->y, q->y, T * w->D, 4) + ndiff(p->dx, q->dx, T * w->D, 4) + ndiff(p->g, q->g, p->ng, 4);
        d += ndiff(p->ids, q->ids, T * w->K, 4) + ndiff(p->wts, q->wts, T * w->K, 4);
        d += ndiff(p->tpe, q->tpe, w->cfg.num_experts, 8);
        d += p->st.aux_loss != q->st.aux_loss || p->st.z_loss != q->st.z_loss ||
             p->st.routed_rows != q->st.routed_rows || p->st.dropped_rows != q->st.dropped_rows;
    }
    return d;
}

/* the batch's ids of step s, all ranks in order */
static int32_t *gather_ids(const world *w, int s, int64_t Ttot) {
    int32_t *ids = malloc((size_t)(Ttot * w->K + 1) * 4);
    for (int r = 0; r < w->P; r++)
        memcpy(ids + off_of(w, r) * w->K, w->o[s][r].ids, (size_t)(w->T[r] * w->K) * 4);
    return ids;
}

static float *batch(int64_t n, unsigned long long seed) {
    float *v = malloc((size_t)(n + 1) * 4);
    unsigned long long s = seed;
    tu_fill(v, n, 1.0, &s);
    return v;
}

static void check_ok(const world *w, const char *what) {
    for (int s = 0; s < w->nsteps; s++)
        for (int r = 0; r < w->P * w->DP; r++)
            EXPECT(!w->st[s][r] && !w->err[s][r][0], "%s: step %d rank %d: %s", what, s, r, w->err[s][r]);
}

/* Replay of a forward's own ids (moept_routing's, all ranks) equals the
   forward bitwise: y, dx, gradients, routing, losses, counts */
static void own_ids(int fam, int P, mode m, const uint8_t *mask, const char *what) {
    world w;
    memset(&w, 0, sizeof w);
    w.cfg = cfg_of(fam); w.m = m; w.P = P; w.D = w.cfg.hidden_size; w.K = w.cfg.top_k; w.mask = mask;
    if (m.sync_free) w.cfg.capacity_factor = 0.0f; /* static blocks: the sync-free mode is dropless */
    int64_t Ttot = 0;
    for (int r = 0; r < P; r++) Ttot += w.T[r] = 32 / P + (r == 1 ? 3 : 0);
    float *x = batch(Ttot * w.D, 11), *dy = batch(Ttot * w.D, 12);
    w.x = x; w.dy = dy;
    w.nsteps = 2; w.replay_prev[1] = 1; /* the router's step, then its ids replayed */
    run_world(&w);
    check_ok(&w, what);
    int64_t d = tu_bad ? 0 : world_diffs(&w, 0, 1);
    EXPECT(d == 0, "%s: the replay of the own ids differs in %lld values", what, (long long)d);
    free_world(&w);
    free(x); free(dy);
}


/* Rejected rows: step 0 the router's; step 1 its ids replayed with row 3's
   k = 1 out of range on every rank; step 2 a repeat on one rank only; step 3
   the router's again. Each rejected step fails every rank (a bad rank:
   INVALID_ARGUMENT naming [3][1]; the others, when theirs were good,
   ERR_STATE "other rank(s) rejected") and leaves the layer as it was: its
   routing and statistics are step 0's, and step 3 equals step 0 bitwise.
   Sync-free: the forward cannot fail (no host sync); the next
   moept_grad_norm fails on every rank instead. */
static void rejected(int P, int DP, mode m, const char *what) {
    world w;
    memset(&w, 0, sizeof w);
    w.cfg = cfg_of(MOEPT_FAMILY_MIXTRAL); w.m = m; w.P = P; w.DP = DP; w.D = w.cfg.hidden_size;
    w.K = w.cfg.top_k;
    int64_t Ttot = 0;
    for (int r = 0; r < P; r++) Ttot += w.T[r] = 12;
    float *x = batch(Ttot * w.D, 21), *dy = batch(Ttot * w.D, 22);
    w.x = x; w.dy = dy;
    const int n = P * (DP > 1 ? DP : 1);
    w.nsteps = 4;
    w.replay_prev[1] = w.replay_prev[2] = 1;
    w.corrupt[1] = 1; w.bad_rank[1] = -1;
    w.corrupt[2] = 2; w.bad_rank[2] = n - 1;
    run_world(&w);
    static const char *bad_msg[3] = {
        "", "moept_forward: opts.replay_ids[3][1] is not an expert index (0..num_experts-1)",
        "moept_forward: opts.replay_ids[3][1] repeats an expert of its row"};
    for (int s = 1; s <= 2; s++)
        for (int r = 0; r < n; r++) {
            int bad = w.bad_rank[s] < 0 || w.bad_rank[s] == r;
            const char *want = !bad ? "other rank(s) rejected"
                             : m.sync_free ? "opts.replay_ids held a row that is not K distinct experts"
                             : bad_msg[s];
            moept_status want_st = bad ? MOEPT_ERR_INVALID_ARGUMENT : MOEPT_ERR_STATE;
            if (m.sync_free && !bad) want = "another rank's step failed its checks";
            EXPECT(w.st[s][r] == want_st && strstr(w.err[s][r], want), "%s: step %d rank %d: status %d, %s",
                   what, s, r, (int)w.st[s][r], w.err[s][r]);
            if (!m.sync_free) EXPECT(w.kept[s][r], "%s: step %d rank %d: the layer changed", what, s, r);
        }
    for (int r = 0; r < n; r++)
        EXPECT(!w.st[0][r] && !w.st[3][r], "%s: rank %d: %s %s", what, r, w.err[0][r], w.err[3][r]);
    if (!tu_bad && !m.sync_free) {
        int64_t d = world_diffs(&w, 0, 3);
        EXPECT(d == 0, "%s: the step after the rejected ones differs from the first in %lld values", what,
               (long long)d);
    }
    free_world(&w);
    free(x); free(dy);
}

/* the gradient of expert e's w13 ([H][D]) or w2 ([D][F]) in a rank's buffer at EP P */
static const float *expert_grad(const outs *o, const moept_config *c, int P, int64_t e, int w2) {
    const int64_t D = c->hidden_size, F = c->intermediate_size, H = 2 * F, El = c->num_experts / P;
    const int64_t nr = c->num_experts * D, j = e % El;
    return o->g + nr + (w2 ? El * H * D + j * D * F : j * H * D);
}

/* A rollout recorded at EP 4 (moept_routing's ids: global expert indices),
   replayed by a router trained on since (drift: its own choice differs) at
   EP 4 and at EP 2 on the same batch, each EP 2 rank holding two EP 4
   ranks' tokens: both route as recorded, and the EP 2 replay equals the EP
   4 one bitwise in y, dx, the routing, the losses and the experts'
   gradients; the router's and shared expert's gradients (sums of 4 ranks'
   parts, not 2) to rounding. */
static void rollout(int fam, mode m, const char *what) {
    world a, a2, b;
    memset(&a, 0, sizeof a);
    a.cfg = cfg_of(fam); a.cfg.capacity_factor = 0.0f; /* capacity is per rank: dropless */
    a.m = m; a.P = 4; a.D = a.cfg.hidden_size; a.K = a.cfg.top_k;
    const int64_t T4[4] = {9, 7, 8, 8}, Ttot = 32, D = a.D, K = a.K;
    memcpy(a.T, T4, sizeof T4);
    float *x = batch(Ttot * D, 31), *dy = batch(Ttot * D, 32);
    a.x = x; a.dy = dy; a.nsteps = 1;
    run_world(&a); /* the rollout */
    check_ok(&a, what);
    int32_t *rec = gather_ids(&a, 0, Ttot);
    a2 = a; /* then its ids replayed, then the drifted router's own choice */
    memset(a2.o, 0, sizeof a2.o);
    a2.drift = 0.05f; a2.replay[0] = rec; a2.nsteps = 2;
    b = a2;
    b.P = 2; b.T[0] = 16; b.T[1] = 16; b.T[2] = b.T[3] = 0; b.nsteps = 1;
    run_world(&a2);
    run_world(&b);
    check_ok(&a2, what);
    check_ok(&b, what);
    if (tu_bad) { free_world(&a); free_world(&a2); free_world(&b); free(rec); free(x); free(dy); return; }
    int64_t d = 0, mine = 0, own = 0;
    for (int r = 0; r < 4; r++) { /* EP 4 rank r's tokens: EP 2 rank r / 2's, from row T4[r - 1] if odd */
        const outs *p = &a2.o[0][r], *q = &b.o[0][r / 2];
        const int64_t o = r % 2 ? T4[r - 1] : 0, T = T4[r];
        d += ndiff(p->y, q->y + o * D, T * D, 4) + ndiff(p->dx, q->dx + o * D, T * D, 4);
        d += ndiff(p->ids, q->ids + o * K, T * K, 4) + ndiff(p->wts, q->wts + o * K, T * K, 4);
        mine += ndiff(p->ids, rec + off_of(&a2, r) * K, T * K, 4);
        for (int64_t t = 0; t < T; t++) own += memcmp(a2.o[1][r].ids + t * K, a.o[0][r].ids + t * K, 8) != 0;
    }
    const moept_stats *sa = &a2.o[0][0].st, *sb = &b.o[0][0].st;
    d += sa->aux_loss != sb->aux_loss || sa->z_loss != sb->z_loss;
    d += ndiff(a2.o[0][0].tpe, b.o[0][0].tpe, a.cfg.num_experts, 8);
    int64_t dg = 0;
    const int64_t F = a.cfg.intermediate_size;
    for (int64_t e = 0; e < a.cfg.num_experts; e++)
        for (int w2 = 0; w2 < 2; w2++)
            dg += ndiff(expert_grad(&a2.o[0][e / 2], &a.cfg, 4, e, w2),
                        expert_grad(&b.o[0][e / 4], &b.cfg, 2, e, w2), 2 * F * D / (w2 + 1), 4);
    const int64_t nr = a.cfg.num_experts * D, ns = a2.o[0][0].ng - nr - a.cfg.num_experts / 4 * 3 * F * D;
    const float *ga = a2.o[0][0].g, *gb = b.o[0][0].g;
    double er = tu_relerr(ga, gb, nr);
    double es = ns ? tu_relerr(ga + a2.o[0][0].ng - ns, gb + b.o[0][0].ng - ns, ns) : 0.0;
    EXPECT(own > 0, "%s: the drifted router chooses as the rollout did: the replay is not tested", what);
    EXPECT(mine == 0, "%s: %lld ids of the EP 4 replay are not the rollout's", what, (long long)mine);
    EXPECT(d == 0, "%s: EP 2's replay differs from EP 4's in %lld values (y, dx, routing, losses)", what,
           (long long)d);
    EXPECT(dg == 0, "%s: %lld expert gradient values differ", what, (long long)dg);
    EXPECT(er <= 1e-6 && es <= 1e-6, "%s: router gradient rel err %g, shared %g", what, er, es);
    free_world(&a); free_world(&a2); free_world(&b);
    free(rec); free(x); free(dy);
}

/* a choice the router would not make: token t's experts (3t + 1) % E and
   (5t + 2) % E (the next one if equal), and with swap the row reversed */
static void other_ids(int64_t T, int64_t E, int swap, int32_t *ids) {
    for (int64_t t = 0; t < T; t++) {
        int32_t a = (int32_t)((3 * t + 1) % E), b = (int32_t)((5 * t + 2) % E);
        if (b == a) b = (int32_t)((a + 1) % E);
        ids[2 * t] = swap ? b : a;
        ids[2 * t + 1] = swap ? a : b;
    }
}

#ifndef MOEPT_CUDA /* the CPU build's: the CPU layer against values computed here */
/* The weights of given ids computed here from the logits, in double: the
   family's scores (softmax, or sigmoid), renormalised where norm is on
   (+ 1e-20 for sigmoid), times the scaling (sigmoid); the aux loss (HF:
   E sum_e count_e / T mean_t p; Megatron: E sum_e count_e / (T K) mean_t
   s / sum s) over the given ids. Returns the worst relative error of w. */
static double hand_weights(const moept_config *c, const float *logits, const int32_t *ids, const float *w,
                           int64_t T, double *aux) {
    const int64_t E = c->num_experts, K = c->top_k;
    const int sig = c->family == MOEPT_FAMILY_DEEPSEEK_V3;
    double worst = 0.0, cnt[64] = {0}, ps[64] = {0};
    for (int64_t t = 0; t < T; t++) {
        double p[64], m = -1e300, z = 0.0, sum = 0.0;
        for (int64_t e = 0; e < E; e++) m = fmax(m, logits[t * E + e]);
        for (int64_t e = 0; e < E; e++) {
            p[e] = sig ? 1.0 / (1.0 + exp(-(double)logits[t * E + e])) : exp(logits[t * E + e] - m);
            z += p[e];
        }
        for (int64_t e = 0; e < E; e++) {
            ps[e] += p[e] / z; /* softmax p, or s normalised over the experts */
            if (!sig) p[e] /= z;
        }
        for (int64_t k = 0; k < K; k++) { sum += p[ids[t * K + k]]; cnt[ids[t * K + k]] += 1.0; }
        for (int64_t k = 0; k < K; k++) {
            double v = p[ids[t * K + k]];
            if (c->norm_topk_prob == MOEPT_NORM_ON) v /= sig ? sum + 1e-20 : sum;
            if (sig) v *= c->routed_scaling_factor;
            worst = fmax(worst, fabs(v - w[t * K + k]) / fabs(v));
        }
    }
    double a = 0.0, cn = c->aux_loss == MOEPT_AUX_HF ? (double)T : (double)(T * K);
    for (int64_t e = 0; e < E; e++) a += cnt[e] / cn * (ps[e] / (double)T);
    *aux = a * (double)E;
    return worst;
}

/* y of a Mixtral layer (no shared expert) from its parameters, in double:
   sum_k w_k W2 (silu(W1 x) * W3 x) over the given ids and weights */
static double hand_y(moept_layer *L, const moept_config *c, const float *x, const int32_t *ids,
                     const float *w, int64_t T, const float *y) {
    const int64_t D = c->hidden_size, F = c->intermediate_size, K = c->top_k;
    float *w1 = malloc((size_t)(F * D) * 4), *w3 = malloc((size_t)(F * D) * 4);
    float *w2 = malloc((size_t)(D * F) * 4);
    double *a = malloc((size_t)F * 8), *ref = calloc((size_t)(T * D), 8), num = 0.0, den = 0.0;
    char n[64];
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            int64_t e = ids[t * K + k];
            snprintf(n, sizeof n, "experts.%lld.w1.weight", (long long)e);
            moept_get_param(L, n, w1, F * D);
            snprintf(n, sizeof n, "experts.%lld.w3.weight", (long long)e);
            moept_get_param(L, n, w3, F * D);
            snprintf(n, sizeof n, "experts.%lld.w2.weight", (long long)e);
            moept_get_param(L, n, w2, D * F);
            for (int64_t f = 0; f < F; f++) {
                double g = 0.0, u = 0.0;
                for (int64_t d = 0; d < D; d++) {
                    g += (double)w1[f * D + d] * x[t * D + d];
                    u += (double)w3[f * D + d] * x[t * D + d];
                }
                a[f] = g / (1.0 + exp(-g)) * u;
            }
            for (int64_t d = 0; d < D; d++) {
                double v = 0.0;
                for (int64_t f = 0; f < F; f++) v += (double)w2[d * F + f] * a[f];
                ref[t * D + d] += (double)w[t * K + k] * v;
            }
        }
    for (int64_t i = 0; i < T * D; i++) { num += (ref[i] - y[i]) * (ref[i] - y[i]); den += ref[i] * ref[i]; }
    free(w1); free(w3); free(w2); free(a); free(ref);
    return sqrt(num / den);
}

/* Another choice than the router's, on one CPU layer per family: the ids as
   given, the weights and the aux loss as computed by hand from the logits,
   the z loss the router's forward's (it reads only the logits), Mixtral's y
   by hand; the row reversed gives the same experts with their weights, and
   y bitwise without a shared expert (K = 2: a sum of two terms does not
   depend on the order), to rounding with one */
static void test_other_choice_cpu(void) {
    for (int fam = 0; fam < 4; fam++) {
        moept_config c = cfg_of(fam);
        c.capacity_factor = 0.0f;
        moept_layer *L = NULL;
        EXPECT_OK(moept_create(&c, &L));
        if (!L) return;
        moept_get_config(L, &c); /* resolved: norm_topk_prob, scaling */
        moept_init_params(L, 7);
        const int64_t T = 30, D = c.hidden_size, K = c.top_k, E = c.num_experts;
        float *x = batch(T * D, 41), *y0 = malloc((size_t)(T * D) * 4), *y1 = malloc((size_t)(T * D) * 4);
        float *y2 = malloc((size_t)(T * D) * 4), w1[60], w2[60];
        int32_t given[60], swapped[60], router[60];
        other_ids(T, E, 0, given);
        other_ids(T, E, 1, swapped);
        const int32_t *ids;
        const float *wts, *lg;
        moept_stats s0, s1;
        EXPECT_OK(moept_forward(L, x, T, y0));
        moept_routing(L, &ids, NULL, NULL);
        memcpy(router, ids, sizeof router);
        moept_get_stats(L, &s0, NULL);
        moept_forward_opts fo = {NULL, 0, given, NULL, 0};
        EXPECT_OK(moept_forward_ex(L, x, T, y1, &fo));
        moept_routing(L, &ids, &wts, &lg);
        moept_get_stats(L, &s1, NULL);
        int64_t differ = 0;
        for (int64_t t = 0; t < T; t++) differ += memcmp(router + t * K, given + t * K, 8) != 0;
        EXPECT(differ >= T / 2, "family %d: only %lld of %lld rows differ from the router's", fam,
               (long long)differ, (long long)T);
        EXPECT(!memcmp(ids, given, sizeof given), "family %d: ids are not the given ones", fam);
        double aux = 0.0, ew = hand_weights(&c, lg, given, wts, T, &aux);
        EXPECT(ew <= 1e-6, "family %d: weights rel err %g against the hand computation", fam, ew);
        EXPECT(fabs(aux - s1.aux_loss) <= 1e-5 * aux, "family %d: aux loss %.9g, by hand %.9g", fam,
               (double)s1.aux_loss, aux);
        EXPECT(s1.z_loss == s0.z_loss, "family %d: z loss %.9g, the router's forward's %.9g", fam,
               (double)s1.z_loss, (double)s0.z_loss);
        if (fam == MOEPT_FAMILY_MIXTRAL) {
            double ey = hand_y(L, &c, x, given, wts, T, y1);
            EXPECT(ey <= 1e-6, "y rel err %g against the hand computation", ey);
        }
        memcpy(w1, wts, sizeof w1);
        fo.replay_ids = swapped;
        EXPECT_OK(moept_forward_ex(L, x, T, y2, &fo));
        moept_routing(L, &ids, &wts, NULL);
        memcpy(w2, wts, sizeof w2);
        /* with a shared expert y sums three terms, (s + a) + b or (s + b) + a: to rounding */
        int64_t d = ndiff(ids, swapped, T * K, 4);
        if (!c.shared_intermediate_size) d += ndiff(y1, y2, T * D, 4);
        for (int64_t t = 0; t < T; t++)
            d += ndiff(&w1[t * K], &w2[t * K + 1], 1, 4) + ndiff(&w1[t * K + 1], &w2[t * K], 1, 4);
        double e2 = tu_relerr(y1, y2, T * D);
        EXPECT(d == 0 && e2 <= 1e-6, "family %d: the reversed rows differ in %lld values, y rel err %g", fam,
               (long long)d, e2);
        moept_destroy(L);
        free(x); free(y0); free(y1); free(y2);
    }
}

/* the objective of a replayed forward: sum(y dy) + aux_coef aux + z_coef z */
static double objective(moept_layer *L, const moept_config *c, const float *x, const float *dy, int64_t T,
                        const int32_t *given, float *y) {
    moept_forward_opts fo = {NULL, 0, given, NULL, 0};
    moept_stats st;
    if (moept_forward_ex(L, x, T, y, &fo) || moept_get_stats(L, &st, NULL)) return NAN;
    double v = 0.0;
    for (int64_t i = 0; i < T * c->hidden_size; i++) v += (double)y[i] * dy[i];
    return v + c->aux_loss_coef * (double)st.aux_loss + c->z_loss_coef * (double)st.z_loss;
}

/* The backward of a replayed forward differentiates the replayed weights:
   the router's gradient against central differences of the objective (with
   the choice fixed the objective is smooth in the router's weights) */
static void test_router_grad_cpu(void) {
    for (int fam = 0; fam < 4; fam += 3) {
        moept_config c = cfg_of(fam);
        c.capacity_factor = 0.0f;
        c.aux_loss_coef = 0.5f; c.z_loss_coef = 0.1f; /* their terms weigh in */
        moept_layer *L = NULL;
        EXPECT_OK(moept_create(&c, &L));
        if (!L) return;
        moept_init_params(L, 7);
        const int64_t T = 30, D = c.hidden_size, E = c.num_experts;
        float *x = batch(T * D, 51), *dy = batch(T * D, 52), *y = malloc((size_t)(T * D) * 4);
        float *dx = malloc((size_t)(T * D) * 4), *wr = malloc((size_t)(E * D) * 4);
        float *g = malloc((size_t)(E * D) * 4);
        int32_t given[60];
        other_ids(T, E, 0, given);
        moept_zero_grad(L);
        objective(L, &c, x, dy, T, given, y);
        EXPECT_OK(moept_backward(L, x, dy, dx));
        moept_get_grad(L, "gate.weight", g, E * D);
        moept_get_param(L, "gate.weight", wr, E * D);
        double worst = 0.0, gmax = 0.0;
        for (int64_t i = 0; i < E * D; i++) gmax = fmax(gmax, fabs(g[i]));
        for (int64_t i = 5; i < E * D; i += 37) {
            const float h = 1e-2f, v = wr[i];
            wr[i] = v + h; moept_set_param(L, "gate.weight", wr, E * D);
            double up = objective(L, &c, x, dy, T, given, y);
            wr[i] = v - h; moept_set_param(L, "gate.weight", wr, E * D);
            double dn = objective(L, &c, x, dy, T, given, y);
            wr[i] = v; moept_set_param(L, "gate.weight", wr, E * D);
            worst = fmax(worst, fabs((up - dn) / (2.0 * h) - g[i]));
        }
        EXPECT(worst <= 2e-3 * gmax, "family %d: router gradient off central differences by %g (largest %g)",
               fam, worst, gmax);
        moept_destroy(L);
        free(x); free(dy); free(y); free(dx); free(wr); free(g);
    }
}
#endif

/* a padded token's replay row is not read (it holds -7, 99: out of range);
   on the GPU in fp32 and bf16, and sync-free */
static void test_masked_rows(void) {
    uint8_t mask[40];
    for (int t = 0; t < 40; t++) mask[t] = t % 5 != 2;
#ifdef MOEPT_CUDA
    const int gpu = 1, nm = 3;
#else
    const int gpu = 0, nm = 1;
#endif
    static const char *what[3][2] = {{"mask EP 1", "mask EP 2"}, {"mask EP 1 bf16", "mask EP 2 bf16"},
                                     {"mask EP 1 sync-free", "mask EP 2 sync-free"}};
    for (int i = 0; i < nm; i++) {
        const mode m = {gpu, i == 1, i == 2, 1, 0};
        own_ids(MOEPT_FAMILY_QWEN2_MOE, 1, m, mask, what[i][0]);
        own_ids(MOEPT_FAMILY_DEEPSEEK_V3, 2, m, mask, what[i][1]);
    }
}

#ifndef MOEPT_CUDA
static void test_own_ids_cpu(void) {
    char what[128];
    for (int fam = 0; fam < 4; fam++)
        for (int P = 1; P <= 4; P *= 2) {
            snprintf(what, sizeof what, "family %d EP %d", fam, P);
            own_ids(fam, P, (mode){0, 0, 0, 1, 0}, NULL, what);
            if (P == 2) {
                snprintf(what, sizeof what, "family %d EP %d chunks 3", fam, P);
                own_ids(fam, P, (mode){0, 0, 0, 3, 0}, NULL, what);
            }
        }
}

static void test_rollout_cpu(void) {
    char what[64];
    for (int fam = 0; fam < 4; fam++) {
        snprintf(what, sizeof what, "family %d", fam);
        rollout(fam, (mode){0, 0, 0, 1, 0}, what);
    }
}

static void test_rejected_cpu(void) {
    rejected(1, 1, (mode){0, 0, 0, 1, 0}, "EP 1");
    rejected(2, 1, (mode){0, 0, 0, 1, 0}, "EP 2");
    rejected(4, 1, (mode){0, 0, 0, 3, 0}, "EP 4 chunks 3");
    rejected(2, 2, (mode){0, 0, 0, 1, 0}, "EP 2 x DP 2");
}
#else
/* the GPU world's values against the CPU world's (the spec): fp32 to 1e-5,
   bf16 to 2e-2 (relative, per rank); the routing's ids exactly */
static void gpu_vs_cpu(const world *g, const world *c, const char *what) {
    const double tol = g->m.bf16 ? 2e-2 : 1e-5;
    for (int r = 0; r < g->P; r++) {
        const outs *p = &g->o[0][r], *q = &c->o[0][r];
        const int64_t T = g->T[r];
        double e[4] = {tu_relerr(p->y, q->y, T * g->D), tu_relerr(p->dx, q->dx, T * g->D),
                       tu_relerr(p->g, q->g, p->ng), tu_relerr(p->wts, q->wts, T * g->K)};
        EXPECT(e[0] <= tol && e[1] <= tol && e[2] <= tol && e[3] <= tol,
               "%s rank %d: rel err y %g dx %g grads %g weights %g", what, r, e[0], e[1], e[2], e[3]);
        EXPECT(!ndiff(p->ids, q->ids, T * g->K, 4), "%s rank %d: the ids differ", what, r);
        EXPECT(fabs(p->st.aux_loss - q->st.aux_loss) <= tol * q->st.aux_loss &&
               fabs(p->st.z_loss - q->st.z_loss) <= tol * q->st.z_loss, "%s rank %d: losses %g %g, CPU %g %g",
               what, r, (double)p->st.aux_loss, (double)p->st.z_loss, (double)q->st.aux_loss,
               (double)q->st.z_loss);
    }
}

/* Another choice than the router's on the GPU (EP 1, 2) equals the CPU
   layer's replay of it (whose weights test_replay's CPU build checks by hand) */
static void test_other_choice_gpu(void) {
    char what[96];
    for (int fam = 0; fam < 4; fam += 3)
        for (int P = 1; P <= 2; P++)
            for (int bf16 = 0; bf16 < 2; bf16++) {
                world g, c;
                memset(&g, 0, sizeof g);
                g.cfg = cfg_of(fam); g.P = P; g.D = g.cfg.hidden_size; g.K = g.cfg.top_k;
                g.m = (mode){1, bf16, 0, 1, 0};
                int64_t Ttot = 0;
                for (int r = 0; r < P; r++) Ttot += g.T[r] = 30 / P;
                float *x = batch(Ttot * g.D, 61), *dy = batch(Ttot * g.D, 62);
                int32_t *given = malloc((size_t)(Ttot * g.K) * 4);
                other_ids(Ttot, g.cfg.num_experts, 0, given);
                g.x = x; g.dy = dy; g.nsteps = 1; g.replay[0] = given;
                c = g;
                c.m = (mode){0, 0, 0, 1, 0};
                run_world(&g);
                run_world(&c);
                snprintf(what, sizeof what, "family %d EP %d %s", fam, P, bf16 ? "bf16" : "fp32");
                check_ok(&g, what);
                check_ok(&c, what);
                if (!tu_bad) gpu_vs_cpu(&g, &c, what);
                free_world(&g); free_world(&c);
                free(given); free(x); free(dy);
            }
}

static void test_rollout_gpu(void) {
    rollout(MOEPT_FAMILY_MIXTRAL, (mode){1, 0, 0, 1, 0}, "mixtral fp32");
    rollout(MOEPT_FAMILY_DEEPSEEK_V3, (mode){1, 1, 0, 1, 0}, "deepseek_v3 bf16");
}

static void test_rejected_gpu(void) {
    rejected(1, 1, (mode){1, 0, 0, 1, 0}, "EP 1");
    rejected(2, 1, (mode){1, 0, 0, 1, 0}, "EP 2");
    rejected(2, 1, (mode){1, 1, 0, 3, 0}, "EP 2 bf16 chunks 3");
    rejected(2, 1, (mode){1, 0, 1, 1, 0}, "EP 2 sync-free");
}

static void test_own_ids_gpu(void) {
    char what[128];
    static const mode ms[] = {{1, 0, 0, 1, 0}, {1, 1, 0, 1, 0}, {1, 0, 1, 1, 0}, {1, 1, 1, 1, 0},
                              {1, 0, 0, 3, 0}, {1, 1, 0, 3, 0}};
    for (int fam = 0; fam < 4; fam += 3)
        for (int P = 1; P <= 2; P++)
            for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
                if (ms[i].chunks > 1 && P == 1) continue; /* the executor chunks only at EP > 1 */
                snprintf(what, sizeof what, "family %d EP %d %s%s%s", fam, P, ms[i].bf16 ? "bf16" : "fp32",
                         ms[i].sync_free ? " sync-free" : "", ms[i].chunks > 1 ? " chunks 3" : "");
                own_ids(fam, P, ms[i], NULL, what);
            }
}
#endif


/* config.fp8: own ids replayed equal the forward bitwise, and a padded token's replay row is not read:
   the CPU layer (4 families, EP 1, 2, chunks 3), or on the GPU (bf16 rows) cuBLASLt's form (AUTO's) and
   the grouped kernel's, plain, sync-free and chunked (Mixtral; DeepSeek-V3's, with its shared expert
   and group routing, at EP 2), each a world of its own (the emulated kernel form's CTAs are slow) */
static void test_fp8(void) {
    uint8_t mask[40];
    for (int t = 0; t < 40; t++) mask[t] = t % 5 != 2;
    typedef struct { int fam, P, masked; mode m; } fp8_case;
#ifdef MOEPT_CUDA /* (the kernel form and FP8: compute capability 9.0, which the emulator answers so) */
    static const fp8_case cs[] = {{0, 1, 0, {1, 1, 0, 1, 1}}, {3, 2, 1, {1, 1, 0, 1, 1}},
                                  {0, 1, 1, {1, 1, 0, 1, 2}}, {3, 2, 0, {1, 1, 0, 1, 2}},
                                  {3, 2, 1, {1, 1, 1, 1, 2}}, {0, 2, 0, {1, 1, 0, 3, 2}}};
#else
    static const fp8_case cs[] = {{0, 1, 0, {0, 0, 0, 1, 1}}, {1, 1, 1, {0, 0, 0, 1, 1}},
                                  {2, 2, 0, {0, 0, 0, 1, 1}}, {3, 2, 1, {0, 0, 0, 1, 1}},
                                  {1, 2, 0, {0, 0, 0, 3, 1}}, {3, 2, 0, {0, 0, 0, 3, 1}}};
#endif
    char what[128];
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        const mode m = cs[i].m;
        snprintf(what, sizeof what, "FP8%s family %d EP %d%s%s%s", m.fp8 == 2 ? " kernel" : "", cs[i].fam,
                 cs[i].P, m.sync_free ? " sync-free" : "", m.chunks > 1 ? " chunks 3" : "",
                 cs[i].masked ? " mask" : "");
#ifdef MOEPT_EMU /* (FP8 ran: the grouped kernel's E4M3 gate/up form, or cuBLASLt's form's row pass) */
        const char *kn = m.fp8 == 2 ? "GK_GATE8" : "moept__k_q8_rows";
        const long k0 = moept_emu_launches(kn);
#endif
        own_ids(cs[i].fam, cs[i].P, m, cs[i].masked ? mask : NULL, what);
#ifdef MOEPT_EMU
        const long k = moept_emu_launches(kn) - k0;
        EXPECT(k > 0, "%s: no FP8 kernel launched (%ld)", what, k);
#endif
    }
}

int main(void) {
#ifdef MOEPT_CUDA
    if (moept_cuda_device_count() < 4) {
        tu_skip("replay (GPU)", "fewer than 4 CUDA devices");
        return tu_done();
    }
    tu_run("replay (GPU): own ids equal the forward bitwise (EP 1, 2; fp32, bf16; sync-free, chunks 3)",
           test_own_ids_gpu);
    tu_run("replay (GPU): a rollout recorded at EP 4 replayed at EP 2 equals it (fp32, bf16)",
           test_rollout_gpu);
    tu_run("replay (GPU): a padded token's row is not read (EP 1, 2; fp32, bf16, sync-free)",
           test_masked_rows);
    tu_run("replay (GPU): rejected rows fail every rank (EP 1, 2; chunks 3; sync-free: at grad_norm)",
           test_rejected_gpu);
    tu_run("replay (GPU): another choice than the router's equals the CPU layer's (EP 1, 2; fp32, bf16)",
           test_other_choice_gpu);
    tu_cc cc; /* (the emulated GPU: compute capability 9.0 for these) */
    if (!tu_fp8_kernel(&cc)) tu_skip("replay (GPU), FP8", cc.why);
    else
        tu_run("replay (GPU), FP8: own ids equal the forward bitwise, a padded token's row is not read "
               "(EP 1, 2; cuBLASLt's form, the grouped kernel's: sync-free, chunks 3)", test_fp8);
    tu_cc_restore(&cc);
#else
    tu_run("replay: own ids equal the forward bitwise (4 families, EP 1, 2, 4; chunks 3)", test_own_ids_cpu);
    tu_run("replay: a rollout recorded at EP 4 replayed at EP 2 equals it (4 families)", test_rollout_cpu);
    tu_run("replay: rejected rows fail every rank (EP 1, 2, 4, EP 2 x DP 2), the layer as it was",
           test_rejected_cpu);
    tu_run("replay: a padded token's row is not read (EP 1, 2)", test_masked_rows);
    tu_run("replay: another choice than the router's: weights, aux loss and y as computed by hand; any order",
           test_other_choice_cpu);
    tu_run("replay: the router's gradient under another choice equals central differences",
           test_router_grad_cpu);
    tu_run("replay, FP8: own ids equal the forward bitwise, a padded token's row is not read (4 families, EP "
           "1, 2; chunks 3)", test_fp8);
#endif
    return tu_done();
}
