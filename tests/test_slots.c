/* Forward slots (config.max_inflight, opts.slot): pipeline orders (1F1B,
   all forwards first) equal sequential forward/backward bitwise in y, dx and
   every gradient, at EP = 1 and EP = 4 (threads: the shared-memory path, the
   chunked exchange, FSDP); a forward again into the same slot (activation
   recomputation) equals one forward; an evaluation between a forward and
   its backward changes nothing; routing and statistics read the last
   forward's; slots that differ between ranks, out of
   range, empty or already differentiated fail every rank and change
   nothing; each slot's memory, counted exactly. */
#include "../moept.c"
#include "testutil.h"

#define NMB 4  /* micro-batches */
#define TOK 12 /* tokens a rank's micro-batch holds at most */
#define DIM 16

typedef struct sj {
    moept_thread_group *g;
    int r;
    moept_config cfg;
    int P;
    const int *order;  /* m + 1: forward of micro-batch m; -(m + 1): its backward */
    int nslots;        /* 0: every micro-batch in slot 0 (the plain calls); else slot m % nslots */
    int eval;          /* an evaluation forward after each training forward */
    int direct, C;     /* the layer's exchange: the shared-memory path; chunks */
    moept_status st;
    char err[MOEPT__ERRLEN];
    float y[NMB][TOK * DIM], dx[NMB][TOK * DIM];
    float *grads;
    int64_t n;
} sj;

static const int seq_order[2 * NMB] = {1, -1, 2, -2, 3, -3, 4, -4};
static const int f1b1_order[2 * NMB] = {1, 2, -1, 3, -2, 4, -3, -4};
static const int gpipe_order[2 * NMB] = {1, 2, 3, 4, -1, -2, -3, -4};

static int64_t tokens_of(int r) { return TOK - 2 * r; } /* ranks hold different counts */

static void mb_data(int r, int m, float *x, float *dy, uint8_t *mask) {
    unsigned long long s = 1000 + 17 * (unsigned long long)r + (unsigned long long)m;
    tu_fill(x, TOK * DIM, 1.0, &s);
    tu_fill(dy, TOK * DIM, 1.0, &s);
    for (int t = 0; t < TOK; t++) mask[t] = (t + m + r) % 5 != 0;
}

static moept_layer *slot_layer(const sj *j, moept_comm **c, int max_inflight) {
    moept_config cfg = j->cfg;
    cfg.max_inflight = max_inflight;
    moept_layer *L = NULL;
    *c = NULL;
    if (j->P > 1) moept_comm_threads(j->g, j->r, c);
    if (moept_create_parallel(&cfg, *c, NULL, &L)) return NULL;
    moept_init_params(L, 7);
    return L;
}

static sj order_proto; /* the run's settings (tu_ranks zeroes the jobs) */

static void *order_main(void *arg) {
    sj *j = arg;
    j->cfg = order_proto.cfg; j->P = order_proto.P; j->order = order_proto.order;
    j->nslots = order_proto.nslots; j->eval = order_proto.eval;
    moept_comm *c;
    moept_layer *L = slot_layer(j, &c, j->nslots);
    if (!L) {
        j->st = MOEPT_ERR_STATE;
        snprintf(j->err, sizeof j->err, "%s", moept_last_error(NULL));
        return NULL;
    }
    static float x[16][NMB][TOK * DIM], dy[16][NMB][TOK * DIM]; /* [rank][mb] */
    uint8_t mask[NMB][TOK];
    const int64_t T = tokens_of(j->r);
    const int masked = L->S > 0;
    j->direct = L->xch.direct; j->C = (int)L->C;
    for (int m = 0; m < NMB; m++) mb_data(j->r, m, x[j->r][m], dy[j->r][m], mask[m]);
    float ye[TOK * DIM];
    for (int i = 0; i < 2 * NMB && !j->st; i++) {
        int m = (j->order[i] > 0 ? j->order[i] : -j->order[i]) - 1, slot = j->nslots ? m % j->nslots : 0;
        if (j->order[i] > 0) {
            moept_forward_opts o = {masked ? mask[m] : NULL, 0, NULL, NULL, slot};
            j->st = moept_forward_ex(L, x[j->r][m], T, j->y[m], &o);
            o.eval = 1;
            if (!j->st && j->eval) j->st = moept_forward_ex(L, x[j->r][m], T, ye, &o);
        } else {
            moept_backward_opts o = moept_backward_default();
            o.slot = slot;
            j->st = moept_backward_ex(L, x[j->r][m], dy[j->r][m], j->dx[m], &o);
        }
    }
    snprintf(j->err, sizeof j->err, "%s", moept_last_error(L));
    float *g;
    moept_grads(L, &g, &j->n);
    j->grads = malloc((size_t)j->n * 4);
    memcpy(j->grads, g, (size_t)j->n * 4);
    moept_destroy(L);
    moept_comm_destroy(c);
    return NULL;
}

static void run_order(sj *js, int P, const moept_config *cfg, const int *order, int nslots, int eval) {
    order_proto.cfg = *cfg; order_proto.P = P; order_proto.order = order;
    order_proto.nslots = nslots; order_proto.eval = eval;
    tu_ranks(P, 20000, order_main, js, sizeof *js);
}

static moept_config slot_cfg(int kind) {
    moept_config c = {0};
    c.hidden_size = DIM; c.intermediate_size = 12; c.num_experts = 8; c.top_k = 2; c.max_tokens = TOK;
    c.aux_loss = MOEPT_AUX_HF; c.aux_loss_coef = 0.01f; c.z_loss_coef = 0.001f; c.global_balance = 1;
    if (kind == 0) { c.family = MOEPT_FAMILY_MIXTRAL; c.router_jitter = 0.3f; c.jitter_seed = 4; }
    if (kind == 1) { /* shared expert, padding, drops, chunked exchange */
        c.family = MOEPT_FAMILY_DEEPSEEK_V3; c.shared_intermediate_size = 8; c.n_group = 4; c.topk_group = 2;
        c.capacity_factor = 1.0f; c.overlap_chunks = 2;
    }
    if (kind == 2) { c.family = MOEPT_FAMILY_OLMOE; c.aux_loss = MOEPT_AUX_SEQ; c.aux_seq_len = 2; }
    if (kind == 3) { c.family = MOEPT_FAMILY_QWEN2_MOE; c.expert_sharding = MOEPT_SHARD_FSDP; }
    return c;
}

static const char *sj_differs(const sj *a, const sj *b, int P) {
    for (int r = 0; r < P; r++) {
        if (a[r].st || b[r].st) return a[r].st ? a[r].err : b[r].err;
        if (memcmp(a[r].y, b[r].y, sizeof a[r].y)) return "y";
        if (memcmp(a[r].dx, b[r].dx, sizeof a[r].dx)) return "dx";
        if (a[r].n != b[r].n || memcmp(a[r].grads, b[r].grads, (size_t)a[r].n * 4)) return "gradients";
    }
    return NULL;
}

static void sj_free(sj *a, int P) {
    for (int r = 0; r < P; r++) free(a[r].grads);
}

/* 1F1B and all-forwards-first over 4 micro-batches, with an evaluation
   after each forward or not, equal the sequential order bitwise */
static void test_pipeline_orders(void) {
    static sj seq[4], pipe[4];
    const int Ps[2] = {1, 4};
    for (int kind = 0; kind < 4; kind++)
        for (int pi = 0; pi < 2; pi++) {
            const int P = Ps[pi];
            moept_config c = slot_cfg(kind);
            run_order(seq, P, &c, seq_order, 0, 0);
            EXPECT(P == 1 || (seq[0].direct == (kind == 0 || kind == 2) && seq[0].C == (kind == 1 ? 2 : 1)),
                   "kind %d EP %d: not the exchange meant (direct %d, C %d)", kind, P, seq[0].direct,
                   seq[0].C);
            for (int v = 0; v < 3; v++) {
                run_order(pipe, P, &c, v == 2 ? gpipe_order : f1b1_order, v == 0 ? 2 : 4, v == 1);
                const char *d = sj_differs(pipe, seq, P);
                EXPECT(!d, "kind %d EP %d %s: differs from sequential: %s", kind, P,
                       v == 2 ? "all forwards first" : v ? "1F1B, evaluations" : "1F1B", d);
                sj_free(pipe, P);
            }
            sj_free(seq, P);
        }
}

/* two layers of c with the same parameters (1: made; 0: the failure noted, none left) */
static int make_pair(const moept_config *c, moept_layer **A, moept_layer **B) {
    *A = *B = NULL;
    if (moept_create(c, A) || moept_create(c, B)) {
        EXPECT(0, "create: %s", moept_last_error(NULL));
        moept_destroy(*A);
        moept_destroy(*B);
        return 0;
    }
    moept_init_params(*A, 3);
    moept_init_params(*B, 3);
    return 1;
}

/* Activation recomputation: forward, the same forward again into the same
   slot, backward equals forward, backward bitwise. With jitter, the second
   forward draws new noise (the count of training forwards keys it): the
   backward is then the second forward's, as after a forward into another
   slot first */
static void test_recompute(void) {
    for (int jit = 0; jit < 2; jit++) {
        moept_config c = slot_cfg(1);
        c.overlap_chunks = 0;
        c.router_jitter = jit ? 0.3f : 0.0f;
        c.max_inflight = 2;
        moept_layer *A, *B;
        if (!make_pair(&c, &A, &B)) return;
        static float x[TOK * DIM], dy[TOK * DIM], y1[TOK * DIM], y2[TOK * DIM];
        static float dxa[TOK * DIM], dxb[TOK * DIM];
        uint8_t mask[TOK];
        mb_data(0, 0, x, dy, mask);
        moept_forward_opts o1 = {NULL, 0, NULL, NULL, 1};
        EXPECT_OK(moept_forward(A, x, TOK, y1));
        EXPECT_OK(moept_forward(A, x, TOK, y2));
        EXPECT(!memcmp(y1, y2, sizeof y1) == !jit, "jitter %d: the second forward's y %s", jit,
               jit ? "drew the same noise" : "differs");
        EXPECT_OK(moept_backward(A, x, dy, dxa));
        if (jit) EXPECT_OK(moept_forward_ex(B, x, TOK, y1, &o1));
        EXPECT_OK(moept_forward(B, x, TOK, y1));
        EXPECT_OK(moept_backward(B, x, dy, dxb));
        EXPECT(!memcmp(y1, y2, sizeof y1), "jitter %d: recomputed y differs", jit);
        EXPECT(!memcmp(dxa, dxb, sizeof dxa), "jitter %d: recomputed dx differs", jit);
        EXPECT(!memcmp(A->par.grads, B->par.grads, (size_t)A->par.n_params * 4),
               "jitter %d: gradients differ", jit);
        moept_destroy(A);
        moept_destroy(B);
    }
}

/* What moept_routing, moept_get_stats and moept_routing_grads read with
   two forwards in flight: the last forward's routing, whatever backward ran
   since; its routing gradient only after its own backward, then bitwise the
   sequential run's */
static void test_routing_reads(void) {
    moept_config c = slot_cfg(2);
    c.max_inflight = 2;
    moept_layer *A, *B;
    if (!make_pair(&c, &A, &B)) return;
    static float x[2][TOK * DIM], dy[2][TOK * DIM], y[TOK * DIM], dx[TOK * DIM];
    uint8_t mask[TOK];
    mb_data(0, 0, x[0], dy[0], mask);
    mb_data(0, 1, x[1], dy[1], mask);
    int32_t ids1[TOK * 2];
    const int32_t *ids;
    const float *dw, *dwb;
    moept_forward_opts o1 = {NULL, 0, NULL, NULL, 1};
    moept_backward_opts b1 = moept_backward_default();
    b1.slot = 1;
    moept_stats s1, s;
    EXPECT_OK(moept_forward(A, x[0], TOK, y));
    EXPECT_OK(moept_forward_ex(A, x[1], TOK, y, &o1));
    EXPECT_OK(moept_routing(A, &ids, NULL, NULL));
    memcpy(ids1, ids, sizeof ids1);
    moept_get_stats(A, &s1, NULL);
    EXPECT_OK(moept_backward(A, x[0], dy[0], dx));
    EXPECT_OK(moept_routing(A, &ids, NULL, NULL));
    moept_get_stats(A, &s, NULL);
    EXPECT(!memcmp(ids, ids1, sizeof ids1) && s.aux_loss == s1.aux_loss,
           "after slot 0's backward the routing or stats are not the last forward's");
    EXPECT(moept_routing_grads(A, &dw) == MOEPT_ERR_STATE,
           "routing_grads before the last forward's backward");
    EXPECT_OK(moept_backward_ex(A, x[1], dy[1], dx, &b1));
    EXPECT_OK(moept_routing_grads(A, &dw));
    EXPECT_OK(moept_forward(B, x[0], TOK, y));
    EXPECT_OK(moept_backward(B, x[0], dy[0], dx));
    EXPECT_OK(moept_forward(B, x[1], TOK, y));
    EXPECT_OK(moept_backward(B, x[1], dy[1], dx));
    EXPECT_OK(moept_routing_grads(B, &dwb));
    EXPECT(dw && dwb && !memcmp(dw, dwb, TOK * 2 * sizeof(float)), "routing_grads differ from sequential");
    /* the last forward's backward first, then the other's: still the last forward's */
    EXPECT_OK(moept_forward(A, x[0], TOK, y));
    EXPECT_OK(moept_forward_ex(A, x[1], TOK, y, &o1));
    EXPECT_OK(moept_backward_ex(A, x[1], dy[1], dx, &b1));
    EXPECT_OK(moept_backward(A, x[0], dy[0], dx));
    EXPECT_OK(moept_routing_grads(A, &dw));
    EXPECT(dw && !memcmp(dw, dwb, TOK * 2 * sizeof(float)), "routing_grads after B1 B0 are not B1's");
    moept_destroy(A);
    moept_destroy(B);
}

/* Wrong slots at EP = 2: a slot that differs between ranks, one out of
   range on one rank, an empty slot, a slot differentiated twice: every
   rank fails (MOEPT_ERR_INVALID_ARGUMENT where the arguments differ or are
   bad, MOEPT_ERR_STATE for the peers and for a slot with nothing to
   differentiate) and nothing changes: the good calls after them give what
   a clean run gives, bitwise */
typedef struct nj {
    moept_thread_group *g;
    int r;
    moept_status st[7];
    char err[7][MOEPT__ERRLEN];
    int same;
} nj;

static moept_status nj_fwd(moept_layer *L, const float *x, float *y, int slot) {
    moept_forward_opts o = {NULL, 0, NULL, NULL, slot};
    return moept_forward_ex(L, x, 6, y, &o);
}
static moept_status nj_bwd(moept_layer *L, const float *x, const float *dy, float *dx, int slot) {
    moept_backward_opts o = moept_backward_default();
    o.slot = slot;
    return moept_backward_ex(L, x, dy, dx, &o);
}

static void *wrong_main(void *arg) {
    nj *j = arg;
    sj base;
    memset(&base, 0, sizeof base);
    base.cfg = slot_cfg(0);
    base.cfg.router_jitter = 0.0f;
    base.P = 2; base.g = j->g; base.r = j->r;
    moept_comm *c;
    moept_layer *L = slot_layer(&base, &c, 2), *K = NULL;
    if (!L) { j->st[0] = MOEPT_ERR_STATE; return NULL; }
    float x0[TOK * DIM], x1[TOK * DIM], dy[TOK * DIM], y[TOK * DIM];
    float dx[TOK * DIM] = {0}, dxk[TOK * DIM] = {0}; /* rows past the 6 tokens: compared, never written */
    uint8_t mask[TOK];
    mb_data(j->r, 0, x0, dy, mask);
    mb_data(j->r, 1, x1, dy, mask);
    const int r = j->r;
    j->st[0] = nj_bwd(L, x0, dy, dx, 1);             /* nothing saved in slot 1 */
    j->st[1] = nj_fwd(L, x0, y, r);                  /* slots 0 and 1 */
    j->st[2] = nj_fwd(L, x0, y, r ? 2 : 0);          /* 2 is out of range */
    moept_status ok = nj_fwd(L, x0, y, 0);
    if (!ok) ok = nj_fwd(L, x1, y, 1);
    j->st[3] = nj_bwd(L, r ? x1 : x0, dy, dx, r);    /* the backward's slots differ */
    j->st[4] = nj_bwd(L, r ? x0 : x1, dy, dx, r ? -1 : 1); /* -1 is out of range */
    if (!ok) ok = nj_bwd(L, x1, dy, dx, 1);
    j->st[5] = nj_bwd(L, x1, dy, dx, 1);             /* differentiated already */
    if (!ok) ok = nj_bwd(L, x0, dy, dx, 0);
    j->st[6] = ok;
    for (int i = 0; i < 6; i++) snprintf(j->err[i], MOEPT__ERRLEN, "%s", moept_last_error(L));
    /* the clean run of the good calls, a layer on the same comm */
    moept_config kc = base.cfg;
    kc.max_inflight = 2;
    if (moept_create_parallel(&kc, c, NULL, &K)) { j->st[6] = MOEPT_ERR_STATE; return NULL; }
    moept_init_params(K, 7);
    nj_fwd(K, x0, y, 0); nj_fwd(K, x1, y, 1); nj_bwd(K, x1, dy, dxk, 1); nj_bwd(K, x0, dy, dxk, 0);
    j->same = !memcmp(dx, dxk, sizeof dx) && !memcmp(L->par.grads, K->par.grads, (size_t)L->par.n_params * 4);
    moept_destroy(L);
    moept_destroy(K);
    moept_comm_destroy(c);
    return NULL;
}

static void test_wrong_slots(void) {
    nj js[2];
    tu_ranks(2, 20000, wrong_main, js, sizeof js[0]);
    const char *what[6] = {"empty slot", "slots differ (forward)", "out of range (forward)",
                           "slots differ (backward)", "out of range (backward)", "second backward"};
    for (int r = 0; r < 2; r++) {
        moept_status want[6] = {MOEPT_ERR_STATE, MOEPT_ERR_INVALID_ARGUMENT,
                                r ? MOEPT_ERR_INVALID_ARGUMENT : MOEPT_ERR_STATE, MOEPT_ERR_INVALID_ARGUMENT,
                                r ? MOEPT_ERR_INVALID_ARGUMENT : MOEPT_ERR_STATE, MOEPT_ERR_STATE};
        for (int i = 0; i < 6; i++)
            EXPECT(js[r].st[i] == want[i], "rank %d, %s: status %d, want %d", r, what[i], js[r].st[i],
                   want[i]);
        EXPECT(js[r].st[6] == MOEPT_OK, "rank %d: the good calls after the wrong ones failed", r);
        EXPECT(js[r].same, "rank %d: the wrong calls changed dx or the gradients", r);
    }
}

/* Each slot used holds as much workspace as the layer at create (one rank:
   the receive rows never grow): moept_stats.workspace_bytes counts them, and
   a training layer's evaluation forward uses one more; the config's range */
static void test_slot_memory(void) {
    moept_config c = slot_cfg(1);
    c.max_inflight = 4;
    moept_layer *L;
    if (moept_create(&c, &L)) { EXPECT(0, "create: %s", moept_last_error(NULL)); return; }
    moept_init_params(L, 3);
    moept_stats s0, s;
    moept_get_stats(L, &s0, NULL);
    static float x[TOK * DIM], dy[TOK * DIM], y[TOK * DIM];
    uint8_t mask[TOK];
    mb_data(0, 0, x, dy, mask);
    for (int k = 0; k < 4; k++) {
        moept_forward_opts o = {mask, 0, NULL, NULL, k};
        EXPECT_OK(moept_forward_ex(L, x, TOK, y, &o));
        moept_get_stats(L, &s, NULL);
        EXPECT(s.workspace_bytes == (k + 1) * s0.workspace_bytes, "%d slots: workspace %lld, want %d x %lld",
               k + 1, (long long)s.workspace_bytes, k + 1, (long long)s0.workspace_bytes);
    }
    moept_forward_opts eo = {NULL, 1, NULL, NULL, 0};
    EXPECT_OK(moept_forward_ex(L, x, TOK, y, &eo));
    moept_get_stats(L, &s, NULL);
    EXPECT(s.workspace_bytes == 5 * s0.workspace_bytes, "evaluation: workspace %lld, want 5 x %lld",
           (long long)s.workspace_bytes, (long long)s0.workspace_bytes);
    moept_destroy(L);
    c.max_inflight = 0; /* one slot, as before: the same workspace */
    if (!moept_create(&c, &L)) {
        moept_get_stats(L, &s, NULL);
        EXPECT(s.workspace_bytes == s0.workspace_bytes, "max_inflight 0: workspace %lld",
               (long long)s.workspace_bytes);
        moept_forward_opts o = {NULL, 0, NULL, NULL, 1};
        EXPECT(moept_forward_ex(L, x, TOK, y, &o) == MOEPT_ERR_INVALID_ARGUMENT, "slot 1 of one: accepted");
        /* a training loop's evaluation, its forward differentiated, evaluates in the training slot;
           one between a forward and its backward takes a second workspace */
        static float dx[TOK * DIM];
        EXPECT_OK(moept_forward(L, x, TOK, y));
        EXPECT_OK(moept_backward(L, x, dy, dx));
        EXPECT_OK(moept_forward_ex(L, x, TOK, y, &eo));
        moept_get_stats(L, &s, NULL);
        EXPECT(s.workspace_bytes == s0.workspace_bytes, "an evaluation after the backward: workspace %lld",
               (long long)s.workspace_bytes);
        EXPECT_OK(moept_forward(L, x, TOK, y));
        EXPECT_OK(moept_forward_ex(L, x, TOK, y, &eo));
        moept_get_stats(L, &s, NULL);
        EXPECT(s.workspace_bytes == 2 * s0.workspace_bytes,
               "an evaluation before the backward: workspace %lld", (long long)s.workspace_bytes);
        EXPECT_OK(moept_backward(L, x, dy, dx));
        moept_destroy(L);
    }
    for (int bad = 0; bad < 2; bad++) {
        c.max_inflight = bad ? MOEPT_MAX_INFLIGHT + 1 : -1;
        EXPECT(moept_create(&c, &L) == MOEPT_ERR_INVALID_ARGUMENT, "max_inflight %lld accepted",
               (long long)c.max_inflight);
    }
}

int main(void) {
    RUN(test_pipeline_orders);
    RUN(test_recompute);
    RUN(test_routing_reads);
    RUN(test_wrong_slots);
    RUN(test_slot_memory);
    return tu_done();
}
