/* Expert parallel over the threads backend: EP = N against EP = 1 on random
   configs and skewed routing, zero-token ranks, mismatched configs (no hang),
   a rank's bad input (every rank fails, nothing changes), allocation-free
   steady state, world = EP x DP gradient sync, the global gradient norm. */
#include "../moept.c"
#include "testutil.h"

#define MAXR 8

typedef struct world {
    moept_config cfg;
    int P, DP;                 /* EP size, DP size: world = P * DP */
    int64_t T[MAXR * 2];       /* tokens per world rank */
    int64_t Ttot, D;
    float *x, *dy;             /* [Ttot][D] the whole batch, rank slices in order */
    float skew;                /* added to expert `hot`'s router row */
    int hot;
    int steps;                 /* forward+backward steps per rank */
    int eval;                  /* 1: an evaluation forward between each step's forward and
                                  backward: its y must be the training forward's, bitwise */
    int eval_differs[MAXR * 2];
    int infer;                 /* 1: inference-only layers (forwards only; every training call
                                  must refuse with MOEPT_ERR_STATE on every rank) */
    int custom;                /* 1: the EP comm is moept_comm_custom over ops that call the
                                  threads comm in its plain forms; 2: its alltoallv fails */
    moept_thread_group *ep[MAXR], *dp[MAXR];
    /* results */
    float *y, *dx;             /* [Ttot][D] */
    float *grads[MAXR * 2];    /* per world rank: its gradient buffer after sync */
    int64_t ngrads[MAXR * 2];  /* ... its length */
    int64_t allocs[MAXR * 2];  /* allocations during steps 2..steps */
    moept_stats stats[MAXR * 2]; /* each rank's after the steps */
    moept_status st[MAXR * 2];
    double norm[MAXR * 2];
    char err[MAXR * 2][MOEPT__ERRLEN];
} world;

typedef struct job { world *w; int r; } job;

static int64_t off_of(const world *w, int r) {
    int64_t o = 0;
    for (int i = 0; i < r; i++) o += w->T[i];
    return o;
}

static void setup_params(moept_layer *L, const world *w) {
    moept_init_params(L, 5); /* by name: the same values on every layout */
    for (int64_t d = 0; d < L->D; d++) L->par.w_router[(int64_t)w->hot * L->D + d] += w->skew;
    if (L->cfg.family == MOEPT_FAMILY_DEEPSEEK_V3)
        for (int64_t e = 0; e < L->E; e++) L->par.bias[e] = 0.01f * (float)(e % 3);
}

/* An inference layer's training calls: each refuses (MOEPT_ERR_STATE,
   naming inference_only) without a collective, so no rank waits */
static moept_status infer_refusals(moept_layer *L, const float *x, const float *dy, float *dx) {
    float *g;
    int64_t n;
    double nrm;
    moept_adamw o = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f};
    moept_status st[6] = {moept_backward(L, x, dy, dx), moept_sync_grads(L, 1.0f), moept_grad_norm(L, &nrm),
                          moept_adamw_step(L, &o), moept_zero_grad(L), moept_grads(L, &g, &n)};
    for (int i = 0; i < 6; i++)
        if (st[i] != MOEPT_ERR_STATE) return MOEPT_ERR_INVALID_ARGUMENT;
    return strstr(moept_last_error(L), "inference_only") ? MOEPT_OK : MOEPT_ERR_INVALID_ARGUMENT;
}

/* moept_comm_custom's ops over a threads comm: what a framework's transport
   does (packed all-to-all-v by bytes, sums, gathers, p2p), and a failing one */
typedef struct plain { moept_comm *t; int fail; } plain;

static int plain_alltoallv(void *ctx, const void *send, const int64_t *sb, void *recv, const int64_t *rb) {
    plain *u = ctx;
    moept_seg ss[MAXR], rv[MAXR];
    int64_t a = 0, b = 0;
    for (int q = 0; q < u->t->size; q++) { /* in 2-byte elements: every moept row is */
        ss[q] = (moept_seg){a / 2, sb[q] / 2};
        rv[q] = (moept_seg){b / 2, rb[q] / 2};
        a += sb[q]; b += rb[q];
    }
    return u->fail ? 7 : (int)u->t->alltoallv(u->t, send, ss, recv, rv, 1, 2);
}
static int plain_allreduce(void *ctx, void *buf, int64_t n, moept_dtype t) {
    plain *u = ctx;
    return (int)u->t->allreduce(u->t, buf, n, t);
}
static int plain_allgather(void *ctx, const void *send, void *recv, int64_t bytes) {
    plain *u = ctx;
    return (int)u->t->allgather(u->t, send, recv, bytes);
}
static int plain_p2p(void *ctx, const moept_p2p *s, int ns, const moept_p2p *r, int nr) {
    plain *u = ctx;
    return (int)u->t->p2p(u->t, s, ns, r, nr);
}

static void *rank_main(void *arg) {
    job *j = arg;
    world *w = j->w;
    int r = j->r, er = r % w->P, dr = r / w->P;
    tu_rank_thread();
    moept_comm *ep = NULL, *dp = NULL, *custom = NULL;
    if (w->P > 1) moept_comm_threads(w->ep[dr], er, &ep);
    if (w->DP > 1) moept_comm_threads(w->dp[er], dr, &dp);
    plain u = {ep, w->custom == 2};
    moept_comm_ops ops = {plain_alltoallv, plain_allreduce, plain_allgather, plain_p2p, NULL};
    if (ep && w->custom) {
        EXPECT_OK(moept_comm_custom(&ops, &u, er, w->P, &custom));
        ep = custom;
    }
    moept_layer *L = NULL;
    moept_config c = w->cfg;
    int64_t mx = 1;
    for (int i = 0; i < w->P * w->DP; i++) mx = w->T[i] > mx ? w->T[i] : mx;
    c.max_tokens = mx;
    c.inference_only = w->infer;
    w->st[r] = moept_create_parallel(&c, ep, dp, &L);
    if (w->st[r]) { snprintf(w->err[r], sizeof w->err[r], "%s", moept_last_error(NULL)); return NULL; }
    setup_params(L, w);
    int64_t o = off_of(w, r);
    moept_stats s0, s1;
    for (int s = 0; s < w->steps && !w->st[r] && w->infer; s++) {
        if (s == 1) moept_get_stats(L, &s0, NULL);
        w->st[r] = moept_forward(L, w->x + o * w->D, w->T[r], w->y + o * w->D);
        if (!w->st[r]) w->st[r] = infer_refusals(L, w->x + o * w->D, w->dy + o * w->D, w->dx + o * w->D);
    }
    for (int s = 0; s < w->steps && !w->st[r] && !w->infer; s++) {
        if (s == 1) moept_get_stats(L, &s0, NULL);
        moept_zero_grad(L);
        float *ye = w->eval ? malloc((size_t)(w->T[r] * w->D + 1) * 4) : NULL;
        moept_forward_opts eo = {NULL, 1, NULL, NULL, 0};
        if (!w->st[r]) w->st[r] = moept_forward(L, w->x + o * w->D, w->T[r], w->y + o * w->D);
        /* an evaluation between the forward and its backward changes nothing */
        if (ye && !w->st[r]) w->st[r] = moept_forward_ex(L, w->x + o * w->D, w->T[r], ye, &eo);
        if (ye) w->eval_differs[r] |= memcmp(ye, w->y + o * w->D, (size_t)(w->T[r] * w->D) * 4) != 0;
        free(ye);
        if (!w->st[r]) w->st[r] = moept_backward(L, w->x + o * w->D, w->dy + o * w->D, w->dx + o * w->D);
        if (!w->st[r]) w->st[r] = moept_sync_grads(L, 1.0f);
    }
    if (!w->st[r] && !w->infer) w->st[r] = moept_grad_norm(L, &w->norm[r]);
    moept_get_stats(L, &s1, NULL);
    w->stats[r] = s1;
    w->allocs[r] = w->steps > 1 ? s1.allocations - s0.allocations : 0;
    if (w->st[r]) snprintf(w->err[r], sizeof w->err[r], "%s", moept_last_error(L));
    w->grads[r] = calloc((size_t)L->par.n_params, 4);
    w->ngrads[r] = L->par.n_params;
    if (L->par.grads) memcpy(w->grads[r], L->par.grads, (size_t)L->par.n_params * 4);
    moept_destroy(L);
    moept_comm_destroy(custom);
    return NULL;
}

static void run_world(world *w) {
    int n = w->P * w->DP;
    for (int d = 0; d < w->DP; d++) moept_thread_group_create(w->P, 20000, &w->ep[d]);
    for (int e = 0; e < w->P; e++) moept_thread_group_create(w->DP, 20000, &w->dp[e]);
    job jobs[MAXR * 2];
    for (int r = 0; r < n; r++) jobs[r] = (job){w, r};
    tu_threads(n, rank_main, jobs, sizeof jobs[0]);
    for (int d = 0; d < w->DP; d++) moept_thread_group_destroy(w->ep[d]);
    for (int e = 0; e < w->P; e++) moept_thread_group_destroy(w->dp[e]);
}

static world *new_world(moept_config cfg, int P, int DP, const int64_t *T, uint64_t seed) {
    world *w = calloc(1, sizeof *w);
    w->cfg = cfg; w->P = P; w->DP = DP; w->D = cfg.hidden_size; w->steps = 1; w->hot = 0;
    for (int r = 0; r < P * DP; r++) { w->T[r] = T[r]; w->Ttot += T[r]; }
    w->x = malloc((size_t)(w->Ttot * w->D + 1) * 4);
    w->dy = malloc((size_t)(w->Ttot * w->D + 1) * 4);
    w->y = calloc((size_t)(w->Ttot * w->D + 1), 4);
    w->dx = calloc((size_t)(w->Ttot * w->D + 1), 4);
    unsigned long long s = seed;
    tu_fill(w->x, w->Ttot * w->D, 1.0, &s);
    tu_fill(w->dy, w->Ttot * w->D, 1.0, &s);
    return w;
}

static void free_world(world *w) {
    for (int r = 0; r < w->P * w->DP; r++) free(w->grads[r]);
    free(w->x); free(w->dy); free(w->y); free(w->dx); free(w);
}

/* the whole batch on one rank */
static world *reference(const world *w) {
    int64_t T[1] = {w->Ttot};
    world *one = new_world(w->cfg, 1, 1, T, 1);
    memcpy(one->x, w->x, (size_t)(w->Ttot * w->D) * 4);
    memcpy(one->dy, w->dy, (size_t)(w->Ttot * w->D) * 4);
    one->skew = w->skew; one->hot = w->hot; one->steps = w->steps; /* no evaluations */
    run_world(one);
    return one;
}

/* compares w (EP = P, DP) with the one-rank run of the same batch: outputs and expert gradients to tol,
   the router's (summed over ranks in another order) to rtol, the shared expert's and the norm to stol */
static void compare_world_r(world *w, const char *what, double tol, double rtol, double stol) {
    for (int r = 0; r < w->P * w->DP; r++)
        EXPECT(w->st[r] == MOEPT_OK, "%s: rank %d: %s", what, r, w->err[r]);
    if (tu_bad) return;
    world *one = reference(w);
    EXPECT(one->st[0] == MOEPT_OK, "%s: one rank: %s", what, one->err[0]);
    double ey = tu_relerr(w->y, one->y, w->Ttot * w->D), edx = tu_relerr(w->dx, one->dx, w->Ttot * w->D);
    EXPECT(ey <= tol, "%s: output rel err %g", what, ey);
    EXPECT(edx <= tol, "%s: dx rel err %g", what, edx);
    /* gradient layout: router | experts (local) | shared */
    moept_layer *L1;
    moept_config c = w->cfg;
    c.max_tokens = 1;
    moept_create(&c, &L1);
    int64_t nr = L1->E * L1->D, El = L1->E / w->P, per = (L1->H + L1->F) * L1->D;
    int64_t nexp = El * per, nsh = L1->par.n_params - nr - L1->E * per;
    for (int r = 0; r < w->P * w->DP; r++) {
        int er = r % w->P;
        const float *g = w->grads[r], *g1 = one->grads[0];
        double e1 = tu_relerr(g, g1, nr);
        double e3 = tu_relerr(g + nr + nexp, g1 + nr + L1->E * per, nsh);
        /* local experts: w13 block then w2 block, each El experts long */
        double e2a = tu_relerr(g + nr, g1 + nr + (int64_t)er * El * L1->H * L1->D, El * L1->H * L1->D);
        double e2b = tu_relerr(g + nr + El * L1->H * L1->D,
                               g1 + nr + L1->E * L1->H * L1->D + (int64_t)er * El * L1->D * L1->F, El * L1->D * L1->F);
        EXPECT(e1 <= rtol, "%s: rank %d router grad rel err %g", what, r, e1);
        EXPECT(e2a <= tol && e2b <= tol, "%s: rank %d expert grads rel err %g %g", what, r, e2a, e2b);
        if (nsh) EXPECT(e3 <= stol, "%s: rank %d shared grads rel err %g", what, r, e3);
        EXPECT(fabs(w->norm[r] - one->norm[0]) <= stol * one->norm[0], "%s: rank %d grad norm %.9g vs %.9g", what,
               r, w->norm[r], one->norm[0]);
    }
    moept_destroy(L1);
    free_world(one);
}
static void compare_world(world *w, const char *what, double tol) { compare_world_r(w, what, tol, tol, tol); }

static moept_config cfg_of(moept_family f) {
    moept_config c = {0};
    c.family = f; c.hidden_size = 40; c.intermediate_size = 36; c.num_experts = 8; c.top_k = 2;
    c.norm_topk_prob = 1; c.aux_loss = MOEPT_AUX_HF; c.aux_loss_coef = 0.01f; c.z_loss_coef = 0.001f;
    c.global_balance = 1;
    if (f == MOEPT_FAMILY_QWEN2_MOE || f == MOEPT_FAMILY_DEEPSEEK_V3) c.shared_intermediate_size = 24;
    if (f == MOEPT_FAMILY_DEEPSEEK_V3) { c.n_group = 4; c.topk_group = 2; c.routed_scaling_factor = 2.5f; }
    return c;
}

static void test_ep_matches_one_rank(void) {
    static const moept_family fams[] = {MOEPT_FAMILY_MIXTRAL, MOEPT_FAMILY_QWEN2_MOE, MOEPT_FAMILY_OLMOE, MOEPT_FAMILY_DEEPSEEK_V3};
    static const int Ps[] = {2, 4, 8};
    for (int f = 0; f < 4; f++)
        for (int pi = 0; pi < 3; pi++) {
            int64_t T[MAXR] = {37, 20, 51, 8, 29, 13, 40, 22};
            moept_config c = cfg_of(fams[f]);
            if (f == 2) c.aux_loss = MOEPT_AUX_MEGATRON;
            world *w = new_world(c, Ps[pi], 1, T, 100 + (uint64_t)f);
            run_world(w);
            char what[64];
            snprintf(what, sizeof what, "family %d EP=%d", f, Ps[pi]);
            compare_world(w, what, 1e-6);
            free_world(w);
        }
}

/* moept_comm_custom over the caller's plain collectives: EP 2 and 4 as one
   rank (chunked overlap too: its pieces staged per peer), and a failing op
   fails the forward on every rank, naming the op */
static void test_ep_custom_comm(void) {
    for (int f = 0; f < 2; f++)
        for (int P = 2; P <= 4; P += 2) {
            int64_t T[MAXR] = {37, 20, 51, 8};
            moept_config c = cfg_of(f ? MOEPT_FAMILY_DEEPSEEK_V3 : MOEPT_FAMILY_MIXTRAL);
            c.overlap_chunks = f ? 2 : 1;
            world *w = new_world(c, P, 1, T, 300 + (uint64_t)f);
            w->custom = 1;
            run_world(w);
            char what[64];
            snprintf(what, sizeof what, "moept_comm_custom, family %d EP=%d", f, P);
            compare_world(w, what, 1e-6);
            free_world(w);
        }
    int64_t T[MAXR] = {16, 16};
    world *w = new_world(cfg_of(MOEPT_FAMILY_MIXTRAL), 2, 1, T, 9);
    w->custom = 2;
    run_world(w);
    for (int r = 0; r < 2; r++)
        EXPECT(w->st[r] == MOEPT_ERR_COMM && strstr(w->err[r], "alltoallv returned 7"),
                     "rank %d: a failing alltoallv op: status %d, '%s'", r, w->st[r], w->err[r]);
    free_world(w);
}

/* config.fp8: EP 2 and 4 equal one rank bitwise (y, dx, the routed experts'
   gradients: each expert's rows, and so its tiles, are the same rows in the
   same order wherever it lives), but for the router's gradient, which fp32
   sums over ranks in another order (1e-6, as above), and the shared
   expert's: its wgrad's tiles run down each rank's own tokens (as data
   parallelism's would), so it differs by FP8's precision (2^-2) */
static void test_ep_fp8(void) {
    static const moept_family fams[] = {MOEPT_FAMILY_MIXTRAL, MOEPT_FAMILY_DEEPSEEK_V3};
    for (int f = 0; f < 2; f++)
        for (int P = 2; P <= 4; P += 2) {
            int64_t T[MAXR] = {37, 20, 51, 8};
            moept_config c = cfg_of(fams[f]);
            c.fp8 = MOEPT_FP8_BLOCKWISE;
            world *w = new_world(c, P, 1, T, 300 + (uint64_t)f);
            run_world(w);
            char what[64];
            snprintf(what, sizeof what, "fp8 family %d EP=%d", f, P);
            compare_world_r(w, what, 0.0, 1e-6, 0.25);
            free_world(w);
        }
}

/* config.fp8 over messages (moept_comm_custom: no shared rows; or chunked) sends the routed rows as
   FP8 records, where the direct path (threads, unchunked) writes them as floats: the same results
   bitwise (y, dx, every gradient), and each rank's bytes less by its rows times (4 D - the record's) each
   way in each of the two dispatches (the forward's x, the backward's dy; the combines send floats) */
static void test_ep_fp8_records(void) {
    int64_t T[MAXR] = {37, 20, 51, 8};
    moept_config c = cfg_of(MOEPT_FAMILY_DEEPSEEK_V3);
    c.fp8 = MOEPT_FP8_BLOCKWISE;
    world *w[3];
    for (int m = 0; m < 3; m++) { /* direct, custom, chunked */
        c.overlap_chunks = m == 2 ? 2 : 1;
        w[m] = new_world(c, 4, 1, T, 31);
        w[m]->custom = m == 1;
        run_world(w[m]);
    }
    const int64_t D = c.hidden_size, less = 2 * (4 * D - moept__q8_recw(D)), n = w[0]->Ttot * D;
    for (int m = 1; m < 3; m++) {
        int64_t bad = 0;
        for (int r = 0; r < 4; r++) {
            const moept_stats *a = &w[0]->stats[r], *b = &w[m]->stats[r];
            bad += b->bytes_sent != a->bytes_sent - a->rows_sent * less ||
                   b->bytes_received != a->bytes_received - a->rows_received * less || a->rows_sent == 0 ||
                   w[m]->st[r] != MOEPT_OK;
        }
        EXPECT(less > 0 && bad == 0, "%s: %lld ranks' bytes not the direct path's less their rows times %lld",
               m == 1 ? "custom comm" : "chunked", (long long)bad, (long long)less);
        int gsame = 1;
        for (int r = 0; r < 4; r++)
            gsame &= w[0]->ngrads[r] == w[m]->ngrads[r] &&
                     !memcmp(w[0]->grads[r], w[m]->grads[r], (size_t)w[0]->ngrads[r] * 4);
        EXPECT(!memcmp(w[0]->y, w[m]->y, (size_t)n * 4) && !memcmp(w[0]->dx, w[m]->dx, (size_t)n * 4) && gsame,
               "%s: y, dx or the gradients differ from the direct path's", m == 1 ? "custom comm" : "chunked");
    }
    for (int m = 0; m < 3; m++) free_world(w[m]);
}

/* Router jitter keyed by the tokens' values: EP = 4 equals the whole batch
   on one rank without evaluations; an evaluation forward between each
   forward and its backward (no jitter, nothing kept) gives the jitter-free
   y, here different from the training forward's, and changes nothing */
static void test_ep_jitter_and_eval(void) {
    static const moept_family fams[] = {MOEPT_FAMILY_MIXTRAL, MOEPT_FAMILY_DEEPSEEK_V3};
    for (int f = 0; f < 2; f++) {
        int64_t T[4] = {37, 20, 0, 29};
        moept_config c = cfg_of(fams[f]);
        c.router_jitter = 0.5f;
        c.jitter_seed = 3;
        world *w = new_world(c, 4, 1, T, 40 + (uint64_t)f);
        w->steps = 2;
        w->eval = 1;
        run_world(w);
        compare_world(w, fams[f] ? "deepseek jitter EP=4" : "mixtral jitter EP=4", 1e-6);
        for (int r = 0; r < 4; r++)
            EXPECT(w->eval_differs[r] == (T[r] > 0), "rank %d: the jitter %s y", r,
                   T[r] ? "did not change" : "changed an empty");
        free_world(w);
        /* without jitter the evaluation's y is the training forward's, bitwise */
        c.router_jitter = 0.0f;
        w = new_world(c, 4, 1, T, 40 + (uint64_t)f);
        w->eval = 1;
        run_world(w);
        compare_world(w, "eval EP=4", 1e-6);
        for (int r = 0; r < 4; r++) EXPECT(!w->eval_differs[r], "rank %d: eval y differs from training y", r);
        free_world(w);
    }
}

/* Inference layers (config.inference_only) over EP = 4, one of them with
   no tokens, chunked or not: y equals the training layer's on the whole
   batch, and on one rank bitwise; training calls refuse on every rank */
static void test_ep_inference(void) {
    static const moept_family fams[] = {MOEPT_FAMILY_MIXTRAL, MOEPT_FAMILY_DEEPSEEK_V3};
    for (int f = 0; f < 2; f++) {
        int64_t T[4] = {37, 20, 0, 29};
        moept_config c = cfg_of(fams[f]);
        c.overlap_chunks = f ? 3 : 0;
        c.activation = f ? MOEPT_ACT_GELU : MOEPT_ACT_SILU_GATED;
        world *w = new_world(c, 4, 1, T, 60 + (uint64_t)f);
        w->infer = 1;
        w->steps = 2;
        run_world(w);
        for (int r = 0; r < 4; r++) EXPECT(w->st[r] == MOEPT_OK, "inference EP=4, rank %d: %s", r, w->err[r]);
        world *one = reference(w); /* training, on one rank */
        int64_t T1[1] = {w->Ttot};
        world *inf1 = new_world(c, 1, 1, T1, 1);
        memcpy(inf1->x, w->x, (size_t)(w->Ttot * w->D) * 4);
        inf1->infer = 1;
        run_world(inf1);
        EXPECT(one->st[0] == MOEPT_OK && inf1->st[0] == MOEPT_OK, "one rank: %s | %s", one->err[0], inf1->err[0]);
        double e = tu_relerr(w->y, one->y, w->Ttot * w->D);
        EXPECT(e <= 1e-6, "inference EP=4 y vs training EP=1: rel err %g", e);
        EXPECT(memcmp(inf1->y, one->y, (size_t)(w->Ttot * w->D) * 4) == 0, "inference y is not training y, bitwise");
        free_world(w); free_world(one); free_world(inf1);
    }
}

static void test_skew_and_empty(void) {
    /* every token of every rank routed to expert 5 (top-1), a rank with no
       tokens, experts nobody uses */
    int64_t T[4] = {30, 0, 25, 17};
    moept_config c = cfg_of(MOEPT_FAMILY_MIXTRAL);
    world *w = new_world(c, 4, 1, T, 7);
    w->skew = 50.0f; w->hot = 5;
    run_world(w);
    compare_world(w, "all to expert 5, rank 1 empty", 1e-6);
    free_world(w);
    /* T = 0 on every rank but one */
    int64_t T2[4] = {0, 0, 9, 0};
    w = new_world(cfg_of(MOEPT_FAMILY_DEEPSEEK_V3), 4, 1, T2, 8);
    run_world(w);
    compare_world(w, "one rank with tokens", 1e-6);
    free_world(w);
}

static void test_capacity_ep(void) {
    int64_t T[2] = {40, 33};
    moept_config c = cfg_of(MOEPT_FAMILY_QWEN2_MOE);
    c.capacity_factor = 0.75f;
    c.global_balance = 0; /* capacity is per rank, from its own T: compare rank by rank */
    world *w = new_world(c, 2, 1, T, 9);
    w->skew = 0.7f; w->hot = 2;
    run_world(w);
    for (int r = 0; r < 2; r++) EXPECT(w->st[r] == MOEPT_OK, "rank %d: %s", r, w->err[r]);
    /* each rank's output equals a one-rank layer run on its own slice */
    for (int r = 0; r < 2 && !tu_bad; r++) {
        int64_t Tr[1] = {T[r]};
        world *one = new_world(c, 1, 1, Tr, 1);
        memcpy(one->x, w->x + off_of(w, r) * w->D, (size_t)(T[r] * w->D) * 4);
        memcpy(one->dy, w->dy + off_of(w, r) * w->D, (size_t)(T[r] * w->D) * 4);
        one->skew = w->skew; one->hot = w->hot;
        run_world(one);
        double e = tu_relerr(w->y + off_of(w, r) * w->D, one->y, T[r] * w->D);
        EXPECT(e <= 1e-6, "capacity at EP=2, rank %d: output rel err %g", r, e);
        free_world(one);
    }
    free_world(w);
}

static void test_world_ep_by_dp(void) {
    int64_t T[4] = {21, 34, 15, 28};
    moept_config c = cfg_of(MOEPT_FAMILY_QWEN2_MOE);
    world *w = new_world(c, 2, 2, T, 11);
    run_world(w);
    compare_world(w, "world=4 EP=2 DP=2", 1e-6);
    free_world(w);
}

static void test_steady_state_allocations(void) {
    int64_t T[4] = {32, 32, 32, 32};
    world *w = new_world(cfg_of(MOEPT_FAMILY_DEEPSEEK_V3), 4, 1, T, 12);
    w->steps = 101; /* one warm-up, then 100 */
    run_world(w);
    for (int r = 0; r < 4; r++) {
        EXPECT(w->st[r] == MOEPT_OK, "rank %d: %s", r, w->err[r]);
        EXPECT(w->allocs[r] == 0, "rank %d made %lld allocations in 100 steps", r, (long long)w->allocs[r]);
    }
    free_world(w);
}

/* ranks whose configs differ (tweak changes rank r's of P): every rank gets an error and returns */
typedef struct mm {
    moept_thread_group *g; int r;
    moept_family fam;
    void (*tweak)(moept_config *c, int r, int P);
    moept_status st;
    char err[MOEPT__ERRLEN];
} mm;
static void *mismatch_main(void *arg) {
    mm *m = arg;
    moept_comm *c;
    moept_comm_threads(m->g, m->r, &c);
    moept_config cfg = cfg_of(m->fam);
    cfg.max_tokens = 8;
    m->tweak(&cfg, m->r, m->g->size);
    moept_layer *L = NULL;
    m->st = moept_create_parallel(&cfg, c, NULL, &L);
    snprintf(m->err, sizeof m->err, "%s", moept_last_error(NULL));
    moept_destroy(L);
    return NULL;
}

static void other_ffn_size(moept_config *c, int r, int P) {
    if (r == 2) c->intermediate_size = 37;
    if (r == 3 && P == 5) c->num_experts = 7; /* fails its own checks too */
}
static void test_mismatched_config(void) {
    for (int size = 4; size <= 5; size++) {
        mm ms[5], proto = {.fam = MOEPT_FAMILY_MIXTRAL, .tweak = other_ffn_size};
        tu_ranks_from(size, 10000, mismatch_main, ms, sizeof ms[0], &proto);
        for (int r = 0; r < size; r++) {
            EXPECT(ms[r].st == MOEPT_ERR_INVALID_ARGUMENT, "size %d rank %d: status %d", size, r, ms[r].st);
            if (size == 4)
                EXPECT(strstr(ms[r].err, "intermediate_size") != NULL, "rank %d: message '%s' does not name the field", r, ms[r].err);
        }
    }
}

/* ranks that differ only in group_fill: every rank's create fails, naming it */
static void other_group_fill(moept_config *c, int r, int P) {
    (void)P;
    if (r == 1) c->group_fill = MOEPT_GROUP_FILL_ZERO;
}
static void test_mismatched_group_fill(void) {
    mm ms[2], proto = {.fam = MOEPT_FAMILY_DEEPSEEK_V3, .tweak = other_group_fill};
    tu_ranks_from(2, 10000, mismatch_main, ms, sizeof ms[0], &proto);
    for (int r = 0; r < 2; r++)
        EXPECT(ms[r].st == MOEPT_ERR_INVALID_ARGUMENT && strstr(ms[r].err, "group_fill"),
               "rank %d: status %d, message '%s'", r, ms[r].st, ms[r].err);
}

/* one rank's NaN: every rank fails the step, and the next step works */
typedef struct nn {
    moept_thread_group *g;
    int r;
    moept_status st1, st2;
    char err[MOEPT__ERRLEN];
    float y0, y1;
    const char *stat_changed; /* a step statistic the rejected step changed (moept.h: it must not) */
} nn;

/* the statistics a rejected call leaves alone (moept.h; memory and time
   counters count what happened) */
static const char *step_stats_differ(const moept_stats *a, const moept_stats *b) {
    if (a->steps != b->steps) return "steps";
    if (a->tokens != b->tokens) return "tokens";
    if (a->routed_rows != b->routed_rows || a->dropped_rows != b->dropped_rows) return "routed/dropped rows";
    if (a->capacity != b->capacity) return "capacity";
    if (a->aux_loss != b->aux_loss || a->z_loss != b->z_loss) return "losses";
    if (a->rows_sent != b->rows_sent || a->rows_received != b->rows_received) return "rows sent/received";
    if (a->bytes_sent != b->bytes_sent || a->bytes_received != b->bytes_received) return "bytes sent/received";
    if (a->checkpoint_bytes_read != b->checkpoint_bytes_read) return "checkpoint_bytes_read";
    return NULL;
}
static void *nan_main(void *arg) {
    nn *m = arg;
    moept_comm *c;
    moept_comm_threads(m->g, m->r, &c);
    moept_config cfg = cfg_of(MOEPT_FAMILY_OLMOE);
    cfg.max_tokens = 8;
    moept_layer *L = NULL;
    if (moept_create_parallel(&cfg, c, NULL, &L)) { m->st1 = MOEPT_ERR_STATE; return NULL; }
    moept_init_params(L, 1);
    float x[8 * 40], y[8 * 40];
    unsigned long long s = 3 + (unsigned long long)m->r;
    tu_fill(x, 8 * 40, 1.0, &s);
    moept_forward(L, x, 8, y);
    m->y0 = y[7];
    float bad = x[11];
    if (m->r == 1) x[11] = NAN;
    moept_stats s0, s1;
    moept_get_stats(L, &s0, NULL);
    m->st1 = moept_forward(L, x, 8, y);
    moept_get_stats(L, &s1, NULL);
    m->stat_changed = step_stats_differ(&s0, &s1);
    snprintf(m->err, sizeof m->err, "%s", moept_last_error(L));
    x[11] = bad;
    m->st2 = moept_forward(L, x, 8, y);
    m->y1 = y[7];
    moept_destroy(L);
    return NULL;
}

static void test_one_rank_bad_input(void) {
    nn ms[4];
    tu_ranks(4, 10000, nan_main, ms, sizeof ms[0]);
    for (int r = 0; r < 4; r++) {
        EXPECT(ms[r].st1 == (r == 1 ? MOEPT_ERR_NUMERIC : MOEPT_ERR_STATE), "rank %d: status %d (%s)", r, ms[r].st1, ms[r].err);
        EXPECT(ms[r].st2 == MOEPT_OK, "rank %d: the next step failed", r);
        EXPECT(!ms[r].stat_changed, "rank %d: the rejected step changed %s", r, ms[r].stat_changed);
        EXPECT(ms[r].y0 == ms[r].y1, "rank %d: the same input gave a different output after the rejected step", r);
    }
}

static void test_threads_comm_timeout(void) {
    /* a rank that never arrives: the others fail after the timeout */
    moept_thread_group *g;
    moept_thread_group_create(2, 200, &g);
    moept_comm *c;
    moept_comm_threads(g, 0, &c);
    int64_t v = 1;
    moept_status st = c->allreduce(c, &v, 1, MOEPT_DTYPE_I64);
    EXPECT(st == MOEPT_ERR_COMM, "allreduce without the peer returned %d", st);
    EXPECT(strstr(c->err, "did not arrive") != NULL, "message: %s", c->err);
    moept_thread_group_destroy(g);
}

/* update_bias under EP without global balancing: every rank ends with the
   bias a single rank computes from the whole batch */
typedef struct bj { moept_thread_group *g; int r, P; float bias[8]; moept_status st; } bj;
static void *bias_main(void *arg) {
    bj *j = arg;
    moept_comm *c = NULL;
    if (j->P > 1) moept_comm_threads(j->g, j->r, &c);
    moept_config cfg = cfg_of(MOEPT_FAMILY_DEEPSEEK_V3);
    cfg.global_balance = 0; cfg.max_tokens = 64;
    moept_layer *L = NULL;
    if ((j->st = moept_create_parallel(&cfg, c, NULL, &L))) return NULL;
    moept_init_params(L, 4);
    float x[64 * 40], y[64 * 40];
    int64_t per = 64 / j->P;
    for (int r = 0; r < j->P; r++) if (r == j->r) {
        unsigned long long s = 77;
        float all[64 * 40];
        tu_fill(all, 64 * 40, 1.0, &s);
        memcpy(x, all + (int64_t)r * per * 40, (size_t)(per * 40) * 4);
    }
    for (int it = 0; it < 3 && !j->st; it++) {
        j->st = moept_forward(L, x, per, y);
        if (!j->st) j->st = moept_update_bias(L, 0.01f);
        if (!j->st && it == 2) j->st = moept_update_bias(L, 0.01f); /* twice after one forward */
    }
    memcpy(j->bias, L->par.bias, sizeof j->bias);
    moept_destroy(L);
    return NULL;
}

static void test_update_bias_ep(void) {
    bj one = {NULL, 0, 1, {0}, MOEPT_OK};
    bias_main(&one);
    bj js[4], proto = {.P = 4};
    tu_ranks_from(4, 20000, bias_main, js, sizeof js[0], &proto);
    EXPECT(one.st == MOEPT_OK, "one rank failed");
    for (int r = 0; r < 4; r++) {
        EXPECT(js[r].st == MOEPT_OK, "rank %d failed", r);
        EXPECT(memcmp(js[r].bias, one.bias, sizeof one.bias) == 0, "rank %d's bias differs from the one-rank bias", r);
    }
}

/* One rank's bad argument to sync_grads, grad_norm or update_bias, or a NaN
   in its own gradients at adamw_step, fails every rank (the bad one with its
   reason, the others with "rejected"), nobody hangs, and the gradients, bias,
   parameters and optimizer step are as before; then the good calls run. */
/* A thread rank's comm and layer (8 tokens) of cfg; NULL if create failed */
static moept_layer *rank_layer(const void *rank_job, moept_config cfg, moept_comm **c) {
    const tu_rank *j = rank_job;
    moept_layer *L = NULL;
    *c = NULL;
    moept_comm_threads(j->g, j->r, c);
    cfg.max_tokens = 8;
    return moept_create_parallel(&cfg, *c, NULL, &L) ? NULL : L;
}

typedef struct aj {
    moept_thread_group *g;
    int r;
    moept_status st[4], ok[4];
    char err[4][MOEPT__ERRLEN];
    int same, params_same;
} aj;
static void *agree_main(void *arg) {
    aj *j = arg;
    moept_comm *c;
    moept_layer *L = rank_layer(j, cfg_of(MOEPT_FAMILY_DEEPSEEK_V3), &c);
    if (!L) { j->st[0] = MOEPT_ERR_STATE; return NULL; }
    moept_init_params(L, 2);
    float x[8 * 40], y[8 * 40], dx[8 * 40];
    unsigned long long s = 5 + (unsigned long long)j->r;
    tu_fill(x, 8 * 40, 1.0, &s);
    moept_forward(L, x, 8, y);
    moept_backward(L, x, y, dx);
    float *g = NULL, *g0;
    int64_t n = 0;
    moept_grads(L, &g, &n);
    g0 = malloc((size_t)n * sizeof(float));
    memcpy(g0, g, (size_t)n * sizeof(float));
    float b0[8];
    memcpy(b0, L->par.bias, sizeof b0);
    double norm;
    int bad = j->r == 1;
    j->st[0] = moept_sync_grads(L, bad ? NAN : 1.0f);
    snprintf(j->err[0], MOEPT__ERRLEN, "%s", moept_last_error(L));
    j->st[1] = moept_grad_norm(L, bad ? NULL : &norm);
    snprintf(j->err[1], MOEPT__ERRLEN, "%s", moept_last_error(L));
    j->st[2] = moept_update_bias(L, bad ? -1.0f : 0.01f);
    snprintf(j->err[2], MOEPT__ERRLEN, "%s", moept_last_error(L));
    moept_grads(L, &g, &n);
    j->same = memcmp(g, g0, (size_t)n * sizeof(float)) == 0 && memcmp(L->par.bias, b0, sizeof b0) == 0;
    float *p0 = malloc((size_t)n * sizeof(float));
    memcpy(p0, L->par.params, (size_t)n * sizeof(float));
    moept_adamw opt = {1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f};
    moept_grads_synced(L); /* (the step's own refusal is what is tested here) */
    if (bad) g[n - 1] = NAN; /* this rank's own: the others' gradients are fine */
    j->st[3] = moept_adamw_step(L, &opt);
    snprintf(j->err[3], MOEPT__ERRLEN, "%s", moept_last_error(L));
    g[n - 1] = g0[n - 1];
    j->params_same = memcmp(L->par.params, p0, (size_t)n * sizeof(float)) == 0 && L->opt.t == 0;
    j->ok[3] = moept_adamw_step(L, &opt);
    free(p0);
    j->ok[0] = moept_sync_grads(L, 1.0f);
    j->ok[1] = moept_grad_norm(L, &norm);
    j->ok[2] = moept_update_bias(L, 0.01f);
    free(g0);
    moept_destroy(L);
    moept_comm_destroy(c);
    return NULL;
}

static void test_group_calls_agree(void) {
    aj js[2];
    tu_ranks(2, 10000, agree_main, js, sizeof js[0]);
    const char *call[4] = {"sync_grads", "grad_norm", "update_bias", "adamw_step"};
    for (int r = 0; r < 2; r++) {
        for (int k = 0; k < 4; k++) {
            moept_status bad_st = k == 3 ? MOEPT_ERR_NUMERIC : MOEPT_ERR_INVALID_ARGUMENT;
            moept_status want = r == 1 ? bad_st : MOEPT_ERR_STATE;
            EXPECT(js[r].st[k] == want, "rank %d, bad %s elsewhere: status %d (%s)", r, call[k], js[r].st[k], js[r].err[k]);
            EXPECT(r == 1 || strstr(js[r].err[k], "other rank(s) rejected"), "rank %d: message '%s'", r, js[r].err[k]);
            EXPECT(js[r].ok[k] == MOEPT_OK, "rank %d: the good %s after failed", r, call[k]);
        }
        EXPECT(js[r].same, "rank %d: a rejected call changed the gradients or the bias", r);
        EXPECT(js[r].params_same, "rank %d: a rejected adamw_step changed the parameters or the step", r);
    }
}

/* Ranks whose group calls differ (rank 0 sync_grads, rank 1 grad_norm;
   then rank 0 forward, rank 1 backward): the call's tag in the agreement
   tells them apart, so both fail with the reason and nobody runs into the
   other's collective; the next matching calls work. Before, both
   agreements matched and each rank went on into a different collective
   (forward against backward: the count exchange against an all-reduce,
   until the threads timeout; over MPI, forever). */
typedef struct oj { moept_thread_group *g; int r; moept_status st[2], next; char err[2][MOEPT__ERRLEN]; } oj;
static void *ep_order_main(void *arg) {
    oj *j = arg;
    moept_comm *c;
    moept_layer *L = rank_layer(j, cfg_of(MOEPT_FAMILY_MIXTRAL), &c);
    if (!L) { j->st[0] = j->st[1] = MOEPT_ERR_STATE; return NULL; }
    double norm;
    j->st[0] = j->r == 0 ? moept_sync_grads(L, 1.0f) : moept_grad_norm(L, &norm);
    snprintf(j->err[0], sizeof j->err[0], "%s", moept_last_error(L));
    j->next = moept_sync_grads(L, 1.0f);
    if (!j->next) j->next = moept_grad_norm(L, &norm);
    float x[8 * 40], y[8 * 40], dx[8 * 40];
    for (int i = 0; i < 8 * 40; i++) x[i] = 0.01f * (float)((i * 7 + j->r) % 13);
    if (!j->next) j->next = moept_forward(L, x, 8, y);
    j->st[1] = j->r == 0 ? moept_forward(L, x, 8, y) : moept_backward(L, x, x, dx);
    snprintf(j->err[1], sizeof j->err[1], "%s", moept_last_error(L));
    if (!j->next) j->next = moept_backward(L, x, x, dx);
    moept_destroy(L);
    moept_comm_destroy(c);
    return NULL;
}
static void test_call_order_mismatch(void) {
    oj js[2];
    tu_ranks(2, 10000, ep_order_main, js, sizeof js[0]);
    for (int r = 0; r < 2; r++) {
        for (int k = 0; k < 2; k++)
            EXPECT(js[r].st[k] == MOEPT_ERR_STATE && strstr(js[r].err[k], "call sequences differ"),
                   "rank %d, %s: status %d (%s)", r, k ? "forward/backward" : "sync_grads/grad_norm",
                   (int)js[r].st[k], js[r].err[k]);
        EXPECT(js[r].next == MOEPT_OK, "rank %d: the matching calls after failed", r);
    }
}

/* Finite inputs, non-finite output: rank 1's x is +-1e30 (the
   router's logits stay finite, the experts overflow). Every rank fails the
   step with MOEPT_ERR_NUMERIC, the statistics stay as they were, backward
   is refused, and the next good step works. Likewise a backward whose dx
   overflows on rank 1 (x 1e4 times larger, dy 3e38) fails on both ranks,
   statistics unchanged: gradients that were zero are zero again, and
   accumulated ones are refused by adamw_step and grad_norm until zero_grad.
   Before, the forward returned OK with Inf in y and one AdamW step spread
   it to every parameter. */
typedef struct nfj {
    moept_thread_group *g;
    int r, stats_same;
    int bstats_same, grads_zero;
    moept_status st, bwd, bst, bst2, step0, step1, norm1, next;
    char err[MOEPT__ERRLEN], berr[MOEPT__ERRLEN], serr[MOEPT__ERRLEN];
} nfj;
static void *nonfinite_main(void *arg) {
    nfj *j = arg;
    moept_config cfg = cfg_of(MOEPT_FAMILY_QWEN2_MOE);
    cfg.z_loss_coef = 0.0f; /* lse^2 overflows too: not part of the loss without it */
    moept_comm *c;
    moept_layer *L = rank_layer(j, cfg, &c);
    if (!L) { j->st = MOEPT_ERR_STATE; return NULL; }
    moept_init_params(L, 5);
    float x[8 * 40], y[8 * 40], dx[8 * 40];
    for (int i = 0; i < 8 * 40; i++) x[i] = 0.01f * (float)((i * 7 + j->r) % 13);
    moept_forward(L, x, 8, y);
    moept_stats s0, s1;
    moept_get_stats(L, &s0, NULL);
    float huge[8 * 40];
    for (int i = 0; i < 8 * 40; i++) huge[i] = j->r == 1 ? 1e30f * (i % 2 ? 1.0f : -1.0f) : x[i];
    j->st = moept_forward(L, huge, 8, y);
    snprintf(j->err, sizeof j->err, "%s", moept_last_error(L));
    moept_get_stats(L, &s1, NULL);
    j->stats_same = s0.steps == s1.steps && s0.routed_rows == s1.routed_rows && s0.aux_loss == s1.aux_loss &&
                    s0.rows_sent == s1.rows_sent && s0.bytes_received == s1.bytes_received;
    j->bwd = moept_backward(L, huge, x, dx);
    j->next = moept_forward(L, x, 8, y);
    /* the backward's output: rank 1's finite x * 1e4 and dy 3e38 overflow dx */
    float big[8 * 40], xb[8 * 40];
    for (int i = 0; i < 8 * 40; i++) {
        big[i] = j->r == 1 ? 3e38f : x[i];
        xb[i] = j->r == 1 ? 1e4f * x[i] : x[i];
    }
    if (!j->next) j->next = moept_forward(L, xb, 8, y);
    moept_get_stats(L, &s0, NULL);
    if (!j->next) j->bst = moept_backward(L, xb, big, dx);
    snprintf(j->berr, sizeof j->berr, "%s", moept_last_error(L));
    moept_get_stats(L, &s1, NULL);
    j->bstats_same = !memcmp(&s0, &s1, sizeof s0);
    float *g;
    int64_t ng;
    moept_grads(L, &g, &ng);
    j->grads_zero = 1; /* they were zero before the failed backward: zero again, bitwise */
    for (int64_t i = 0; i < ng; i++) j->grads_zero &= ((const uint32_t *)(const void *)g)[i] == 0;
    moept_adamw opt = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f};
    double norm;
    j->step0 = moept_adamw_step(L, &opt);
    /* accumulating: a good micro-batch, then the overflow; its partial sums are refused */
    if (!j->next) j->next = moept_forward(L, x, 8, y);
    if (!j->next) j->next = moept_backward(L, x, x, dx);
    if (!j->next) j->next = moept_forward(L, xb, 8, y);
    if (!j->next) j->bst2 = moept_backward(L, xb, big, dx);
    j->step1 = moept_adamw_step(L, &opt);
    snprintf(j->serr, sizeof j->serr, "%s", moept_last_error(L));
    j->norm1 = moept_grad_norm(L, &norm);
    moept_zero_grad(L);
    if (!j->next) j->next = moept_forward(L, x, 8, y);
    if (!j->next) j->next = moept_backward(L, x, x, dx);
    if (!j->next) j->next = moept_sync_grads(L, 1.0f);
    if (!j->next) j->next = moept_adamw_step(L, &opt);
    moept_destroy(L);
    moept_comm_destroy(c);
    return NULL;
}
static void test_nonfinite_output_fails_every_rank(void) {
    nfj js[2];
    tu_ranks(2, 10000, nonfinite_main, js, sizeof js[0]);
    for (int r = 0; r < 2; r++) {
        EXPECT(js[r].st == MOEPT_ERR_NUMERIC && strstr(js[r].err, r ? "from finite inputs" : "other rank"),
               "rank %d: status %d (%s)", r, (int)js[r].st, js[r].err);
        EXPECT(js[r].stats_same, "rank %d: the rejected step changed the statistics", r);
        EXPECT(js[r].bwd == MOEPT_ERR_STATE, "rank %d: backward of the rejected step: status %d", r, (int)js[r].bwd);
        EXPECT(js[r].bst == MOEPT_ERR_NUMERIC && strstr(js[r].berr, r ? "from finite inputs" : "other rank"),
               "rank %d: backward with dx overflowing on rank 1: status %d (%s)", r, (int)js[r].bst, js[r].berr);
        EXPECT(js[r].bstats_same && js[r].grads_zero && js[r].step0 == MOEPT_OK,
               "rank %d: the failed backward left stats %d, zero gradients %d, adamw_step %d", r,
               js[r].bstats_same, js[r].grads_zero, (int)js[r].step0);
        EXPECT(js[r].bst2 == MOEPT_ERR_NUMERIC && js[r].step1 == MOEPT_ERR_NUMERIC &&
               js[r].norm1 == MOEPT_ERR_NUMERIC && strstr(js[r].serr, "non-finite dx"),
               "rank %d: accumulated gradients of a failed backward: backward %d, adamw_step %d (%s), grad_norm %d",
               r, (int)js[r].bst2, (int)js[r].step1, js[r].serr, (int)js[r].norm1);
        EXPECT(js[r].next == MOEPT_OK, "rank %d: the good step after failed", r);
    }
}

/* config.grad_backup: the same overflowing backward (rank 1's dx) after a
   good micro-batch fails on both ranks and leaves the accumulated gradients
   as the good one left them, bitwise, so grad_norm and adamw_step take them
   (without the copy they are refused: the test above). */
typedef struct gbj {
    moept_thread_group *g;
    int r, same;
    moept_status setup, bst, norm, step;
    char berr[MOEPT__ERRLEN];
} gbj;
static void *grad_backup_main(void *arg) {
    gbj *j = arg;
    moept_config cfg = cfg_of(MOEPT_FAMILY_QWEN2_MOE);
    cfg.z_loss_coef = 0.0f;
    cfg.grad_backup = 1;
    moept_comm *c;
    moept_layer *L = rank_layer(j, cfg, &c);
    if (!L) { j->setup = MOEPT_ERR_STATE; return NULL; }
    moept_init_params(L, 5);
    float x[8 * 40], y[8 * 40], dx[8 * 40], big[8 * 40], xb[8 * 40];
    for (int i = 0; i < 8 * 40; i++) {
        x[i] = 0.01f * (float)((i * 7 + j->r) % 13);
        big[i] = j->r == 1 ? 3e38f : x[i];
        xb[i] = j->r == 1 ? 1e4f * x[i] : x[i];
    }
    float *g, *g0 = NULL;
    int64_t ng = 0;
    j->setup = moept_forward(L, x, 8, y);
    if (!j->setup) j->setup = moept_backward(L, x, x, dx);
    if (!j->setup) j->setup = moept_grads(L, &g, &ng);
    if (!j->setup && (g0 = malloc((size_t)ng * sizeof(float)))) memcpy(g0, g, (size_t)ng * sizeof(float));
    if (!j->setup) j->setup = moept_forward(L, xb, 8, y);
    if (!j->setup) j->bst = moept_backward(L, xb, big, dx);
    snprintf(j->berr, sizeof j->berr, "%s", moept_last_error(L));
    j->same = g0 && moept_grads(L, &g, &ng) == MOEPT_OK && !memcmp(g, g0, (size_t)ng * sizeof(float));
    double norm;
    moept_adamw opt = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f};
    j->norm = moept_grad_norm(L, &norm);
    moept_grads_synced(L); /* (the restored gradients are what is tested here) */
    j->step = moept_adamw_step(L, &opt);
    free(g0);
    moept_destroy(L);
    moept_comm_destroy(c);
    return NULL;
}
static void test_grad_backup_restores(void) {
    gbj js[2];
    tu_ranks(2, 10000, grad_backup_main, js, sizeof js[0]);
    for (int r = 0; r < 2; r++) {
        EXPECT(js[r].setup == MOEPT_OK, "rank %d: setup %d", r, (int)js[r].setup);
        EXPECT(js[r].bst == MOEPT_ERR_NUMERIC && strstr(js[r].berr, "grad_backup"),
               "rank %d: the overflowing backward: %d (%s)", r, (int)js[r].bst, js[r].berr);
        EXPECT(js[r].same, "rank %d: the gradients differ from the good micro-batch's", r);
        EXPECT(js[r].norm == MOEPT_OK && js[r].step == MOEPT_OK, "rank %d: grad_norm %d, adamw_step %d", r,
               (int)js[r].norm, (int)js[r].step);
    }
}

/* ---- resharding a running group to a new placement ---- */
#define RS_E 8
typedef struct rsj {
    moept_thread_group *g; int r, P;
    float *before;   /* [E][part]: every expert's parameters before (shared, each rank fills its own) */
    float *mbefore;  /* [E][part]: AdamW m before */
    float y0[16 * 40], y1[16 * 40];
    moept_reshard_report rep, rep2;
    int32_t placement[RS_E];
    int ok_after2;
    float y2[16 * 40];
    moept_status st, bad_st, mismatch_st;
    int ok_after;
    char err[512];
} rsj;

static void expert_copy(moept_layer *L, const float *base, int64_t j, float *dst) {
    int64_t h = L->H * L->D;
    memcpy(dst, base + (L->par.w13 - L->par.params) + j * h, (size_t)h * 4);
    memcpy(dst + h, base + (L->par.w2 - L->par.params) + j * L->D * L->F, (size_t)(L->D * L->F) * 4);
}

static void *ep_reshard_main(void *arg) {
    rsj *j = arg;
    moept_comm *c;
    moept_comm_threads(j->g, j->r, &c);
    tu_rank_thread();
    moept_config cfg = cfg_of(MOEPT_FAMILY_DEEPSEEK_V3);
    cfg.max_tokens = 16;
    moept_layer *L = NULL;
    if ((j->st = moept_create_parallel(&cfg, c, NULL, &L))) return NULL;
    moept_init_params(L, 8);
    float x[16 * 40], dy[16 * 40], dx[16 * 40];
    unsigned long long s = 5 + (unsigned long long)j->r;
    tu_fill(x, 16 * 40, 1.0, &s);
    tu_fill(dy, 16 * 40, 1.0, &s);
    moept_adamw opt = {1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f};
    for (int it = 0; it < 2 && !j->st; it++) { /* optimizer state worth moving */
        moept_zero_grad(L);
        j->st = moept_forward(L, x, 16, j->y0);
        if (!j->st) j->st = moept_backward(L, x, dy, dx);
        if (!j->st) j->st = moept_sync_grads(L, 1.0f);
        if (!j->st) j->st = moept_adamw_step(L, &opt);
    }
    if (!j->st) j->st = moept_forward(L, x, 16, j->y0);
    int64_t part = L->H * L->D + L->D * L->F;
    for (int64_t k = 0; k < L->El; k++) {
        int64_t e = L->plan.expert_at[j->r * L->El + k];
        expert_copy(L, L->par.params, k, j->before + e * part);
        expert_copy(L, L->opt.m, k, j->mbefore + e * part);
    }
    /* an unbalanced placement and one that differs between ranks: refused everywhere, nothing moves */
    int32_t bad[RS_E] = {0, 0, 0, 1, 1, 2, 2, 3};
    j->bad_st = moept_reshard(L, bad, NULL);
    int32_t mine[RS_E];
    for (int e = 0; e < RS_E; e++) mine[e] = (int32_t)((RS_E - 1 - e) / 2);
    if (j->r == 2) { int32_t tmp = mine[0]; mine[0] = mine[7]; mine[7] = tmp; }
    j->mismatch_st = moept_reshard(L, mine, NULL);
    /* the permutation: expert e to rank (E-1-e)/2 */
    for (int e = 0; e < RS_E; e++) mine[e] = (int32_t)((RS_E - 1 - e) / 2);
    if (!j->st) j->st = moept_reshard(L, mine, &j->rep);
    if (!j->st) j->st = moept_forward(L, x, 16, j->y1);
    moept_get_placement(L, j->placement);
    /* every expert this rank now holds has its old parameters and AdamW state */
    j->ok_after = !j->st;
    float *tmp = malloc((size_t)part * 4);
    for (int64_t k = 0; k < L->El && j->ok_after; k++) {
        int64_t e = L->plan.expert_at[j->r * L->El + k];
        expert_copy(L, L->par.params, k, tmp);
        j->ok_after &= memcmp(tmp, j->before + e * part, (size_t)part * 4) == 0;
        expert_copy(L, L->opt.m, k, tmp);
        j->ok_after &= memcmp(tmp, j->mbefore + e * part, (size_t)part * 4) == 0;
        char name[64];
        snprintf(name, sizeof name, "experts.%lld.gate_proj.weight", (long long)e);
        j->ok_after &= moept__find(L, name) != NULL;
    }
    /* a second move where most experts stay (untouched) and two swap ranks */
    static const int32_t second[RS_E] = {3, 3, 2, 2, 0, 1, 1, 0};
    if (!j->st) j->st = moept_reshard(L, second, &j->rep2);
    if (!j->st) j->st = moept_forward(L, x, 16, j->y2);
    j->ok_after2 = !j->st;
    for (int64_t k = 0; k < L->El && j->ok_after2; k++) {
        int64_t e = L->plan.expert_at[j->r * L->El + k];
        j->ok_after2 &= second[e] == j->r;
        expert_copy(L, L->par.params, k, tmp);
        j->ok_after2 &= memcmp(tmp, j->before + e * part, (size_t)part * 4) == 0;
        expert_copy(L, L->opt.v, k, tmp);
        j->ok_after2 &= isfinite(tmp[0]);
    }
    free(tmp);
    if (j->st) snprintf(j->err, sizeof j->err, "%s", moept_last_error(L));
    moept_destroy(L);
    return NULL;
}

static void test_reshard_permutation(void) {
    const int P = 4;
    moept_config cfg = cfg_of(MOEPT_FAMILY_DEEPSEEK_V3);
    int64_t H = 2 * cfg.intermediate_size, part = H * cfg.hidden_size + cfg.hidden_size * cfg.intermediate_size;
    float *before = calloc((size_t)(RS_E * part), 4), *mbefore = calloc((size_t)(RS_E * part), 4);
    rsj js[4], proto = {.P = P, .before = before, .mbefore = mbefore};
    tu_ranks_from(P, 20000, ep_reshard_main, js, sizeof js[0], &proto);
    int64_t sent = 0, recvd = 0;
    for (int r = 0; r < P; r++) {
        EXPECT(js[r].st == MOEPT_OK, "rank %d: %s", r, js[r].err);
        EXPECT(js[r].bad_st == MOEPT_ERR_INVALID_ARGUMENT, "rank %d: an unbalanced placement gave %d", r, js[r].bad_st);
        EXPECT(js[r].mismatch_st != MOEPT_OK, "rank %d: placements that differ between ranks were accepted", r);
        EXPECT(js[r].ok_after, "rank %d: an expert's parameters or AdamW state changed in the move", r);
        EXPECT(memcmp(js[r].y0, js[r].y1, sizeof js[r].y0) == 0, "rank %d: the next step's output differs after resharding", r);
        for (int e = 0; e < RS_E; e++)
            EXPECT(js[r].placement[e] == (RS_E - 1 - e) / 2, "rank %d: expert %d on rank %d", r, e, js[r].placement[e]);
        sent += js[r].rep.bytes_sent;
        recvd += js[r].rep.bytes_received;
        EXPECT(js[r].rep.extra_bytes == part * 4, "staging memory %lld, one expert is %lld", (long long)js[r].rep.extra_bytes, (long long)(part * 4));
    }
    /* identity [0,0,1,1,2,2,3,3] -> [3,3,2,2,1,1,0,0]: every expert moves once,
       with its parameters and both AdamW moments */
    EXPECT(js[0].rep.experts_moved == RS_E, "%lld experts moved, expected %d", (long long)js[0].rep.experts_moved, RS_E);
    EXPECT(sent == RS_E * part * 4 * 3 && recvd == sent, "bytes moved %lld/%lld, expected %lld", (long long)sent, (long long)recvd,
           (long long)(RS_E * part * 4 * 3));
    sent = 0;
    for (int r = 0; r < P; r++) {
        EXPECT(js[r].ok_after2, "rank %d: wrong experts or data after the second move", r);
        EXPECT(memcmp(js[r].y0, js[r].y2, sizeof js[r].y0) == 0, "rank %d: output differs after the second move", r);
        sent += js[r].rep2.bytes_sent;
    }
    EXPECT(js[0].rep2.experts_moved == 2 && sent == 2 * part * 4 * 3, "second move: %lld experts, %lld bytes; expected 2 and %lld",
           (long long)js[0].rep2.experts_moved, (long long)sent, (long long)(2 * part * 4 * 3));
    free(before); free(mbefore);
}

/* Resharding from any placement to any other: 40 random balanced
   placements of 12 experts over 4 ranks, one after another. Every round
   must meet on every rank (the schedule pairs each rank's sends and
   receives round by round), each rank then holds exactly its experts with
   their parameters, and the report counts the moves: the rounds are the
   most experts one rank sends, the bytes each moved expert's. */
#define RA_E 12
typedef struct raj {
    moept_thread_group *g; int r;
    float *before;   /* [E][part]: every expert's parameters at the start */
    int bad;         /* reshards that failed or left wrong data */
    int64_t moved, rounds_bad, bytes_bad;
    char err[512];
} raj;
static void ra_placement(int i, int32_t *pl) {
    unsigned long long s = 99 + (unsigned long long)i;
    for (int e = 0; e < RA_E; e++) pl[e] = e / 3;
    for (int e = RA_E - 1; e > 0; e--) { /* Fisher-Yates, the same on every rank */
        int j = (int)(tu_rand(&s) * 0.5 * (e + 1) + 0.5 * (e + 1)) % (e + 1), t = pl[e];
        pl[e] = pl[j]; pl[j] = t;
    }
}
static void *reshard_any_main(void *arg) {
    raj *j = arg;
    moept_comm *c;
    moept_comm_threads(j->g, j->r, &c);
    moept_config cfg = cfg_of(MOEPT_FAMILY_MIXTRAL);
    cfg.num_experts = RA_E;
    cfg.max_tokens = 8;
    moept_layer *L = NULL;
    if (moept_create_parallel(&cfg, c, NULL, &L)) {
        snprintf(j->err, sizeof j->err, "create: %.400s", moept_last_error(NULL));
        j->bad = -1;
        return NULL;
    }
    moept_init_params(L, 4);
    const int64_t part = L->H * L->D + L->D * L->F;
    for (int64_t k = 0; k < L->El; k++) expert_copy(L, L->par.params, k, j->before + L->plan.expert_at[j->r * L->El + k] * part);
    float *tmp = malloc((size_t)part * 4);
    int32_t pl[RA_E], old[RA_E];
    for (int i = 0; i < 40; i++) {
        ra_placement(i, pl);
        moept_get_placement(L, old);
        int64_t out[4] = {0}, most = 0, moved = 0;
        for (int e = 0; e < RA_E; e++)
            if (pl[e] != old[e]) { out[old[e]]++; moved++; }
        for (int q = 0; q < 4; q++) most = out[q] > most ? out[q] : most;
        moept_reshard_report rep;
        if (moept_reshard(L, pl, &rep)) {
            if (!j->bad++) snprintf(j->err, sizeof j->err, "placement %d: %.400s", i, moept_last_error(L));
            break;
        }
        j->moved += rep.experts_moved;
        j->rounds_bad += rep.rounds != most || rep.experts_moved != moved;
        j->bytes_bad += rep.bytes_sent != out[j->r] * part * 4 || rep.bytes_received != rep.bytes_sent;
        for (int64_t k = 0; k < L->El; k++) {
            int64_t e = L->plan.expert_at[j->r * L->El + k];
            expert_copy(L, L->par.params, k, tmp);
            if (pl[e] != j->r || memcmp(tmp, j->before + e * part, (size_t)part * 4) != 0) {
                if (!j->bad++) snprintf(j->err, sizeof j->err, "placement %d: expert %lld wrong", i, (long long)e);
            }
        }
    }
    free(tmp);
    moept_destroy(L);
    return NULL;
}
static void test_reshard_any_placement(void) {
    moept_config cfg = cfg_of(MOEPT_FAMILY_MIXTRAL);
    int64_t part = 2 * cfg.intermediate_size * cfg.hidden_size + cfg.hidden_size * cfg.intermediate_size;
    float *before = calloc((size_t)(RA_E * part), 4);
    raj js[4], proto = {.before = before};
    tu_ranks_from(4, 20000, reshard_any_main, js, sizeof js[0], &proto);
    for (int r = 0; r < 4; r++) {
        EXPECT(js[r].bad == 0, "rank %d: %d failures (%s)", r, js[r].bad, js[r].err);
        EXPECT(!js[r].rounds_bad && !js[r].bytes_bad, "rank %d: %lld reports with other rounds or moves, %lld "
               "with other bytes", r, (long long)js[r].rounds_bad, (long long)js[r].bytes_bad);
    }
    EXPECT(js[0].moved > 200, "only %lld experts moved in 40 placements", (long long)js[0].moved);
    free(before);
}

int main(void) {
    RUN(test_ep_matches_one_rank);
    RUN(test_ep_fp8);
    RUN(test_ep_fp8_records);
    RUN(test_ep_custom_comm);
    RUN(test_skew_and_empty);
    RUN(test_ep_jitter_and_eval);
    RUN(test_ep_inference);
    RUN(test_capacity_ep);
    RUN(test_world_ep_by_dp);
    RUN(test_steady_state_allocations);
    RUN(test_mismatched_config);
    RUN(test_mismatched_group_fill);
    RUN(test_one_rank_bad_input);
    RUN(test_threads_comm_timeout);
    RUN(test_update_bias_ep);
    RUN(test_group_calls_agree);
    RUN(test_call_order_mismatch);
    RUN(test_nonfinite_output_fails_every_rank);
    RUN(test_grad_backup_restores);
    RUN(test_reshard_permutation);
    RUN(test_reshard_any_placement);
    return tu_done();
}
