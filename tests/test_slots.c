/* Forward slots (config.max_inflight, opts.slot): pipeline orders (1F1B,
   all forwards first) equal sequential forward/backward bitwise in y, dx and
   every gradient, at EP = 1 and EP = 4; a forward again into the same slot
   (activation recomputation) equals one forward; an evaluation between a
   forward and its backward changes nothing; routing and statistics read the
   last forward's; slots that differ between ranks, out of range, empty or
   already differentiated fail every rank and change nothing; each slot's
   memory, counted exactly. Built twice: build/test_slots runs CPU layers
   over threads (the shared-memory path, the chunked exchange, FSDP),
   build/emu/test_slots CUDA layers on the emulated GPU over NCCL ranks
   (default, chunked and sync-free; FP8 in the kernel form, whose gate/up
   kernel keeps a's copy for the backward of the last forward alone; the
   buffers in device memory). */
#ifdef MOEPT_CUDA
#define MOEPT_INTERNAL
#include "../moept.h"
#else
#include "../moept.c"
#endif
#include "testutil.h"
#include "tu_exec.h"
#ifdef MOEPT_EMU
#include "emu/emu.h" /* (the emulated device's bytes held, and written) */
#endif

#define NMB 4  /* micro-batches */
#define TOK 12 /* tokens a rank's micro-batch holds at most */
#define DIM 16
#define NB ((size_t)(TOK * DIM) * sizeof(float)) /* bytes of one micro-batch's x, y, dy or dx */

typedef struct sj {
    moept_thread_group *g;
    int r;
    moept_config cfg;
    int P, sync_free;
    const int *order;  /* m + 1: forward of micro-batch m; -(m + 1): its backward; 0 ends it */
    int nslots;        /* 0: every micro-batch in slot 0 (the plain calls); else slot m % nslots */
    int eval;          /* an evaluation forward after each training forward */
    int direct, C;     /* the CPU layer's exchange: the shared-memory path; chunks */
    moept_status st;
    char err[512];
    float y[NMB][TOK * DIM], dx[NMB][TOK * DIM];
    float *grads;
    int64_t n;
    long long fwd_bytes, bwd_bytes; /* the emulated GPU at EP 1: what its training forwards' and its
                                       backwards' kernels wrote */
} sj;

static const int seq_order[] = {1, -1, 2, -2, 3, -3, 4, -4, 0};
static const int f1b1_order[] = {1, 2, -1, 3, -2, 4, -3, -4, 0};
static const int gpipe_order[] = {1, 2, 3, 4, -1, -2, -3, -4, 0};
/* 1F1B, each forward again before its backward */
static const int recompute_order[] = {1, 2, 1, -1, 3, 2, -2, 4, 3, -3, 4, -4, 0};
/* two forwards, each again, then their backwards (the first one's backward not after its forward) */
static const int twice_order[] = {1, 2, 1, 2, -1, -2, 3, 4, 3, 4, -3, -4, 0};

static int64_t tokens_of(int r) { return TOK - 2 * r; } /* ranks hold different counts */

#ifdef MOEPT_EMU
#define MOEPT_EMU_ON 1
#else
#define MOEPT_EMU_ON 0
#endif

/* micro-batch m of rank r (bf16: x and dy as bf16 values in their first halves) */
static void mb_data(int r, int m, float *x, float *dy, uint8_t *mask, int bf16) {
    unsigned long long s = 1000 + 17 * (unsigned long long)r + (unsigned long long)m;
    tu_fill(x, TOK * DIM, 1.0, &s);
    tu_fill(dy, TOK * DIM, 1.0, &s);
    uint16_t hx[TOK * DIM], hd[TOK * DIM];
    for (int i = 0; i < TOK * DIM && bf16; i++)
        hx[i] = moept__f32_to_bf16(x[i]), hd[i] = moept__f32_to_bf16(dy[i]);
    if (bf16) memcpy(x, hx, sizeof hx), memcpy(dy, hd, sizeof hd);
    for (int t = 0; t < TOK; t++) mask[t] = (t + m + r) % 5 != 0;
}

/* whether cfg's layers are bf16 in the kernel GEMM form: FP8 on a GPU (the emulated one's grouped
   kernel) */
static int bf16_kernel(const moept_config *cfg) { return TU_GPU && cfg->fp8; }

/* rank r's micro-batches where the layer reads them (x, dy, mask), and
   room for y and dx */
typedef struct mbs { void *x[NMB], *dy[NMB], *mask[NMB], *y[NMB], *dx[NMB]; } mbs;
static void mbs_open(mbs *b, int r, int bf16) {
    float x[TOK * DIM], dy[TOK * DIM];
    uint8_t mask[TOK];
    for (int m = 0; m < NMB; m++) {
        mb_data(r, m, x, dy, mask, bf16);
        b->x[m] = tu_dev(x, NB); b->dy[m] = tu_dev(dy, NB); b->mask[m] = tu_dev(mask, TOK);
        b->y[m] = tu_dev(NULL, NB); b->dx[m] = tu_dev(NULL, NB);
    }
}
static void mbs_close(mbs *b) {
    for (int m = 0; m < NMB; m++) {
        tu_dev_free(b->x[m]); tu_dev_free(b->dy[m]); tu_dev_free(b->mask[m]);
        tu_dev_free(b->y[m]); tu_dev_free(b->dx[m]);
    }
}

/* a layer of cfg with max_inflight slots, its parameters seeded (NULL: failed, noted) */
static moept_layer *slot_layer(const moept_config *cfg, moept_comm *c, int max_inflight, int sync_free) {
    moept_config k = *cfg;
    k.max_inflight = max_inflight;
    moept_layer *L = NULL;
#ifdef MOEPT_CUDA
    moept_cuda_options o = {MOEPT_DTYPE_BF16, NULL, 0, sync_free, MOEPT_GEMM_KERNEL};
    if (bf16_kernel(cfg) ? moept_create_cuda(&k, c, NULL, &o, &L) : tu_layer(&k, c, sync_free, &L))
        return NULL;
#else
    if (tu_layer(&k, c, sync_free, &L)) return NULL;
#endif
    moept_init_params(L, 7);
    return L;
}

/* the layer's gradients, copied out (NULL: none) */
static float *grads_of(moept_layer *L, int64_t *n) {
    return tu_buf(L, MOEPT_BUF_GRADS, n);
}

/* the bytes the emulated GPU's kernels wrote so far, once those queued are done (one rank: its device's;
   else 0) */
static long long kernel_bytes(const sj *j) {
#ifdef MOEPT_EMU
    moept_emu_counts n;
    if (j->P > 1) return 0;
    cudaDeviceSynchronize();
    moept_emu_counts_get(0, NULL, &n);
    return n.kwrite;
#else
    (void)j;
    return 0;
#endif
}

/* the order's calls on one rank; the first failure stops it */
static void order_calls(sj *j, moept_layer *L, const mbs *b, void *ye) {
    const int64_t T = tokens_of(j->r);
    const int masked = j->cfg.shared_intermediate_size > 0;
    for (int i = 0; j->order[i] && !j->st; i++) {
        int m = (j->order[i] > 0 ? j->order[i] : -j->order[i]) - 1, slot = j->nslots ? m % j->nslots : 0;
        if (j->order[i] > 0) {
            moept_forward_opts o = {masked ? b->mask[m] : NULL, 0, NULL, NULL, slot};
            j->fwd_bytes -= kernel_bytes(j);
            j->st = moept_forward_ex(L, b->x[m], T, b->y[m], &o);
            j->fwd_bytes += kernel_bytes(j);
            o.eval = 1;
            if (!j->st && j->eval) j->st = moept_forward_ex(L, b->x[m], T, ye, &o);
        } else {
            moept_backward_opts o = moept_backward_default();
            o.slot = slot;
            j->bwd_bytes -= kernel_bytes(j);
            j->st = moept_backward_ex(L, b->x[m], b->dy[m], b->dx[m], &o);
            j->bwd_bytes += kernel_bytes(j);
        }
    }
}

static sj order_proto; /* the run's settings, each job's start */

static void *slots_order_main(void *arg) {
    sj *j = arg;
    tu_ep e;
    moept_layer *L = slot_layer(&j->cfg, tu_ep_open(&e, j->g, j->P, j->r), j->nslots, j->sync_free);
    if (!L) {
        j->st = MOEPT_ERR_STATE;
        snprintf(j->err, sizeof j->err, "%s", moept_last_error(NULL));
        tu_ep_close(&e);
        return NULL;
    }
#if !TU_GPU
    j->direct = L->xch.direct; j->C = (int)L->C;
#endif
    mbs b;
    mbs_open(&b, j->r, bf16_kernel(&j->cfg));
    void *ye = tu_dev(NULL, NB);
    order_calls(j, L, &b, ye);
    snprintf(j->err, sizeof j->err, "%s", moept_last_error(L));
    for (int m = 0; m < NMB; m++) {
        tu_to_host(j->y[m], b.y[m], NB);
        tu_to_host(j->dx[m], b.dx[m], NB);
    }
    j->grads = grads_of(L, &j->n);
    tu_dev_free(ye);
    mbs_close(&b);
    moept_destroy(L);
    tu_ep_close(&e);
    return NULL;
}

static void run_order(sj *js, int P, const moept_config *cfg, const int *order, int nslots, int eval,
                      int sync_free) {
    order_proto.cfg = *cfg; order_proto.P = P; order_proto.order = order;
    order_proto.nslots = nslots; order_proto.eval = eval; order_proto.sync_free = sync_free;
    tu_world_ranks(P, slots_order_main, js, sizeof *js, &order_proto);
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
    if (kind == 4) { /* kind 1 unchunked: a masked shared expert in the sync-free mode too */
        c = slot_cfg(1);
        c.overlap_chunks = 0;
    }
    if (kind == 5) { /* kind 1 in FP8: x's and dy's records through each slot's exchange buffers */
        c = slot_cfg(1);
        c.fp8 = MOEPT_FP8_BLOCKWISE;
    }
    if (kind == 6) { /* FP8, F 128 (a GPU's: the kernel form, each forward's a down its rows by the
                        gate/up kernel, kept for the backward while no other forward writes over it) */
        c.family = MOEPT_FAMILY_MIXTRAL; c.intermediate_size = 128; c.fp8 = MOEPT_FP8_BLOCKWISE;
    }
    return c;
}

/* P ranks need P devices on a GPU machine (the emulator has them) */
static int too_few_devices(int P) {
#if TU_GPU
    if (moept_cuda_device_count() >= P) return 0;
    char why[80];
    snprintf(why, sizeof why, "EP %d needs %d devices, this machine has %d", P, P, moept_cuda_device_count());
    tu_skip("forward slots over EP ranks", why);
    return 1;
#else
    (void)P;
    return 0;
#endif
}

static const char *sj_differs(const sj *a, const sj *b, int P) {
    for (int r = 0; r < P; r++) {
        if (a[r].st || b[r].st) return a[r].st ? a[r].err : b[r].err;
        if (memcmp(a[r].y, b[r].y, sizeof a[r].y)) return "y";
        if (memcmp(a[r].dx, b[r].dx, sizeof a[r].dx)) return "dx";
        if (!a[r].grads || a[r].n != b[r].n || memcmp(a[r].grads, b[r].grads, (size_t)a[r].n * 4))
            return "gradients";
    }
    return NULL;
}

static void sj_free(sj *a, int P) {
    for (int r = 0; r < P; r++) free(a[r].grads);
}

/* 1F1B and all-forwards-first over 4 micro-batches, with an evaluation
   after each forward or not, 1F1B with each forward recomputed before its
   backward (no jitter: a recomputed forward draws new noise, as
   test_recompute shows), and one slot with an evaluation between each
   forward and its backward equal the sequential order bitwise (CUDA
   layers: no fsdp, which is a CPU layer's baseline; the masked shared
   expert unchunked, kind 4, in the sync-free mode; FP8, kind 5, on the
   CPU alone, kind 6, bf16 in the kernel form, on the GPU alone, at EP 1:
   the emulated kernels are slow, and its slots' state is each rank's) */
static void test_pipeline_orders(void) {
    static sj seq[4], pipe[4];
    const int Ps[2] = {1, 4};
    for (int kind = 0; kind < 7; kind++) {
#ifdef MOEPT_CUDA
        tu_cc cc; /* (kind 6: compute capability 9.0; restored after it) */
        if (kind == 6 && !tu_fp8_kernel(&cc)) tu_skip("forward slots in FP8's kernel form", cc.why);
        const int go = kind != 6 || !cc.why[0];
#else
        const int go = kind != 6;
#endif
        for (int pi = 0; pi < 2 - (kind == 6) && go && !(TU_GPU && (kind == 3 || kind == 5)); pi++)
            for (int sf = TU_GPU && kind == 4; sf <= (TU_GPU && kind == 4); sf++) { /* 4: sync-free (GPU) */
                const int P = Ps[pi];
                if ((kind == 4 && P == 1) || too_few_devices(P)) continue; /* at EP 1, 4 is 1 */
                moept_config c = slot_cfg(kind);
                run_order(seq, P, &c, seq_order, 0, 0, sf);
                EXPECT(TU_GPU || P == 1 || kind == 4 || (seq[0].direct == (kind == 0 || kind == 2) &&
                                            seq[0].C == (kind == 1 || kind == 5 ? 2 : 1)),
                       "kind %d EP %d: not the exchange meant (direct %d, C %d)", kind, P, seq[0].direct,
                       seq[0].C);
                const char *name[6] = {"1F1B", "1F1B, evaluations", "all forwards first",
                                       "one slot, evaluations", "1F1B, recomputed", "two recomputed"};
                const int *ord[6] = {f1b1_order, f1b1_order, gpipe_order, seq_order, recompute_order,
                                     twice_order};
                const int ns[6] = {2, 4, 4, 0, 3, 2};
                for (int v = 0; v < (kind == 6 ? 6 : 5 - (c.router_jitter > 0.0f)); v++) {
                    run_order(pipe, P, &c, ord[v], ns[v], v == 1 || v == 3, sf);
                    const char *d = sj_differs(pipe, seq, P);
                    EXPECT(!d, "kind %d EP %d%s %s: differs from sequential: %s", kind, P,
                           sf ? " sync-free" : "", name[v], d);
                    /* (kind 6: a's copy written where each backward comes after its forward, one slot
                       or recomputed, and read there; none written by a first forward into a slot of
                       several (the same forwards as the sequential ones' less the copies: v < 3); the
                       pass made again where another forward came between) */
                    const long long more = pipe[0].bwd_bytes - seq[0].bwd_bytes;
                    const long long fless = seq[0].fwd_bytes - pipe[0].fwd_bytes;
                    EXPECT(kind != 6 || !MOEPT_EMU_ON || ((v == 3 || v == 4 ? more == 0 : more > 0) &&
                                                          (v < 3 ? fless > 0 : v > 3 || fless == 0)),
                           "kind 6 %s: its forwards, backwards wrote %lld, %lld bytes, the sequential ones' "
                           "%lld, %lld", name[v], pipe[0].fwd_bytes, pipe[0].bwd_bytes, seq[0].fwd_bytes,
                           seq[0].bwd_bytes);
                    sj_free(pipe, P);
                }
                sj_free(seq, P);
            }
#ifdef MOEPT_CUDA
        if (kind == 6) tu_cc_restore(&cc);
#endif
    }
}

/* two layers of c with the same parameters (1: made; 0: the failure noted, none left) */
static int make_pair(const moept_config *c, moept_layer **A, moept_layer **B) {
    *A = slot_layer(c, NULL, (int)c->max_inflight, 0);
    *B = slot_layer(c, NULL, (int)c->max_inflight, 0);
    if (*A && *B) return 1;
    EXPECT(0, "create: %s", moept_last_error(NULL));
    moept_destroy(*A);
    moept_destroy(*B);
    return 0;
}

/* One rank's buffers for the single-layer tests: two micro-batches' x and
   dy, and y, y2, dx, dx2 (on the layer's side), and their host copies */
typedef struct one { void *x[2], *dy[2], *y, *y2, *dx, *dx2; float h[4][TOK * DIM]; } one;
static void one_open(one *o) {
    float x[TOK * DIM], dy[TOK * DIM];
    uint8_t mask[TOK];
    for (int m = 0; m < 2; m++) {
        mb_data(0, m, x, dy, mask, 0);
        o->x[m] = tu_dev(x, NB);
        o->dy[m] = tu_dev(dy, NB);
    }
    o->y = tu_dev(NULL, NB); o->y2 = tu_dev(NULL, NB); o->dx = tu_dev(NULL, NB); o->dx2 = tu_dev(NULL, NB);
}
/* y, y2, dx, dx2 into h[0..3] */
static void one_host(one *o) {
    void *d[4] = {o->y, o->y2, o->dx, o->dx2};
    for (int i = 0; i < 4; i++) tu_to_host(o->h[i], d[i], NB);
}
static void one_close(one *o) {
    void *d[8] = {o->x[0], o->x[1], o->dy[0], o->dy[1], o->y, o->y2, o->dx, o->dx2};
    for (int i = 0; i < 8; i++) tu_dev_free(d[i]);
}

static int same_grads(moept_layer *A, moept_layer *B) {
    int64_t na, nb;
    float *a = grads_of(A, &na), *b = grads_of(B, &nb);
    int same = a && b && na == nb && !memcmp(a, b, (size_t)na * 4);
    free(a);
    free(b);
    return same;
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
        one o;
        one_open(&o);
        moept_forward_opts o1 = {NULL, 0, NULL, NULL, 1};
        EXPECT_OK(moept_forward(A, o.x[0], TOK, o.y));
        EXPECT_OK(moept_forward(A, o.x[0], TOK, o.y2));
        EXPECT_OK(moept_backward(A, o.x[0], o.dy[0], o.dx));
        one_host(&o);
        EXPECT(!memcmp(o.h[0], o.h[1], NB) == !jit, "jitter %d: the second forward's y %s", jit,
               jit ? "drew the same noise" : "differs");
        if (jit) EXPECT_OK(moept_forward_ex(B, o.x[0], TOK, o.y, &o1));
        EXPECT_OK(moept_forward(B, o.x[0], TOK, o.y));
        EXPECT_OK(moept_backward(B, o.x[0], o.dy[0], o.dx2));
        one_host(&o);
        EXPECT(!memcmp(o.h[0], o.h[1], NB), "jitter %d: recomputed y differs", jit);
        EXPECT(!memcmp(o.h[2], o.h[3], NB), "jitter %d: recomputed dx differs", jit);
        EXPECT(same_grads(A, B), "jitter %d: gradients differ", jit);
        one_close(&o);
        moept_destroy(A);
        moept_destroy(B);
    }
}

/* What moept_routing, moept_get_stats and moept_routing_grads read with
   two forwards in flight: the last forward's routing, whatever backward or
   rejected forward ran since; its routing gradient only after its own
   backward, then bitwise the sequential run's */
static void test_routing_reads(void) {
    moept_config c = slot_cfg(2);
    c.max_inflight = 2;
    moept_layer *A, *B;
    if (!make_pair(&c, &A, &B)) return;
    one o;
    one_open(&o);
    void **x = o.x, **dy = o.dy, *y = o.y, *dx = o.dx;
    int32_t ids1[TOK * 2];
    float dwb[TOK * 2];
    const int32_t *ids;
    const float *dw;
    moept_forward_opts o1 = {NULL, 0, NULL, NULL, 1};
    moept_backward_opts b1 = moept_backward_default();
    b1.slot = 1;
    moept_stats s1, s;
    EXPECT_OK(moept_forward(A, x[0], TOK, y));
    EXPECT_OK(moept_forward_ex(A, x[1], TOK, y, &o1));
    EXPECT_OK(moept_routing(A, &ids, NULL, NULL));
    memcpy(ids1, ids, sizeof ids1);
    moept_get_stats(A, &s1, NULL);
    /* a forward into slot 0 that is rejected leaves the reads at the last forward's */
    EXPECT(moept_forward(A, x[0], TOK + 1, y) == MOEPT_ERR_INVALID_ARGUMENT, "%d tokens accepted", TOK + 1);
    EXPECT_OK(moept_routing(A, &ids, NULL, NULL));
    EXPECT(!memcmp(ids, ids1, sizeof ids1),
           "after a rejected forward into slot 0 the routing is not the last forward's");
    EXPECT_OK(moept_backward(A, x[0], dy[0], dx));
    EXPECT_OK(moept_routing(A, &ids, NULL, NULL));
    moept_get_stats(A, &s, NULL);
    EXPECT(!memcmp(ids, ids1, sizeof ids1) && s.aux_loss == s1.aux_loss,
           "after slot 0's backward the routing or stats are not the last forward's");
    EXPECT(moept_routing_grads(A, &dw) == MOEPT_ERR_STATE,
           "routing_grads before the last forward's backward");
    EXPECT_OK(moept_forward(B, x[0], TOK, y));
    EXPECT_OK(moept_backward(B, x[0], dy[0], dx));
    EXPECT_OK(moept_forward(B, x[1], TOK, y));
    EXPECT_OK(moept_backward(B, x[1], dy[1], dx));
    if (moept_routing_grads(B, &dw) == MOEPT_OK) memcpy(dwb, dw, sizeof dwb);
    else EXPECT(0, "routing_grads of B: %s", moept_last_error(B));
    EXPECT_OK(moept_backward_ex(A, x[1], dy[1], dx, &b1));
    EXPECT_OK(moept_routing_grads(A, &dw));
    EXPECT(dw && !memcmp(dw, dwb, sizeof dwb), "routing_grads differ from sequential");
    /* the last forward's backward first, then the other's: still the last forward's */
    EXPECT_OK(moept_forward(A, x[0], TOK, y));
    EXPECT_OK(moept_forward_ex(A, x[1], TOK, y, &o1));
    EXPECT_OK(moept_backward_ex(A, x[1], dy[1], dx, &b1));
    EXPECT_OK(moept_backward(A, x[0], dy[0], dx));
    EXPECT_OK(moept_routing_grads(A, &dw));
    EXPECT(dw && !memcmp(dw, dwb, sizeof dwb), "routing_grads after B1 B0 are not B1's");
    one_close(&o);
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
    char err[7][512];
    int same;
} nj;

static moept_status nj_fwd(moept_layer *L, void *x, void *y, int slot) {
    moept_forward_opts o = {NULL, 0, NULL, NULL, slot};
    return moept_forward_ex(L, x, 6, y, &o);
}
static moept_status nj_bwd(moept_layer *L, void *x, void *dy, void *dx, int slot) {
    moept_backward_opts o = moept_backward_default();
    o.slot = slot;
    return moept_backward_ex(L, x, dy, dx, &o);
}

/* the wrong calls and the good ones between them; status i into st[i] */
static void wrong_calls(nj *j, moept_layer *L, void *x0, void *x1, void *dy, void *y, void *dx) {
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
    for (int i = 0; i < 6; i++) snprintf(j->err[i], sizeof j->err[i], "%s", moept_last_error(L));
}

static void *wrong_main(void *arg) {
    nj *j = arg;
    moept_config cfg = slot_cfg(0);
    cfg.router_jitter = 0.0f;
    tu_ep e;
    moept_comm *c = tu_ep_open(&e, j->g, 2, j->r);
    moept_layer *L = slot_layer(&cfg, c, 2, 0), *K = slot_layer(&cfg, c, 2, 0);
    if (!L || !K) {
        j->st[6] = MOEPT_ERR_STATE;
    } else {
        float x[TOK * DIM], dy[TOK * DIM], dxh[2][TOK * DIM];
        uint8_t mask[TOK];
        mb_data(j->r, 1, x, dy, mask, 0);
        void *x1 = tu_dev(x, NB);
        mb_data(j->r, 0, x, dy, mask, 0);
        void *x0 = tu_dev(x, NB), *dyd = tu_dev(dy, NB), *y = tu_dev(NULL, NB);
        /* dx's rows past the 6 tokens: compared, never written */
        void *dx = tu_dev(NULL, NB), *dxk = tu_dev(NULL, NB);
        wrong_calls(j, L, x0, x1, dyd, y, dx);
        /* the clean run of the good calls, a layer on the same comm */
        nj_fwd(K, x0, y, 0); nj_fwd(K, x1, y, 1); nj_bwd(K, x1, dyd, dxk, 1); nj_bwd(K, x0, dyd, dxk, 0);
        tu_to_host(dxh[0], dx, NB);
        tu_to_host(dxh[1], dxk, NB);
        j->same = !memcmp(dxh[0], dxh[1], NB) && same_grads(L, K);
        void *d[6] = {x0, x1, dyd, y, dx, dxk};
        for (int i = 0; i < 6; i++) tu_dev_free(d[i]);
    }
    moept_destroy(L);
    moept_destroy(K);
    tu_ep_close(&e);
    return NULL;
}

static void test_wrong_slots(void) {
    nj js[2];
    if (too_few_devices(2)) return;
    tu_world_ranks(2, wrong_main, js, sizeof js[0], NULL);
    const char *what[6] = {"empty slot", "slots differ (forward)", "out of range (forward)",
                           "slots differ (backward)", "out of range (backward)", "second backward"};
    for (int r = 0; r < 2; r++) {
        moept_status want[6] = {MOEPT_ERR_STATE, MOEPT_ERR_INVALID_ARGUMENT,
                                r ? MOEPT_ERR_INVALID_ARGUMENT : MOEPT_ERR_STATE, MOEPT_ERR_INVALID_ARGUMENT,
                                r ? MOEPT_ERR_INVALID_ARGUMENT : MOEPT_ERR_STATE, MOEPT_ERR_STATE};
        for (int i = 0; i < 6; i++)
            EXPECT(js[r].st[i] == want[i], "rank %d, %s: status %d, want %d (%s)", r, what[i], js[r].st[i],
                   want[i], js[r].err[i]);
        EXPECT(js[r].st[6] == MOEPT_OK, "rank %d: the good calls after the wrong ones failed", r);
        EXPECT(js[r].same, "rank %d: the wrong calls changed dx or the gradients", r);
    }
}

/* A slot whose receive rows must grow while another slot holds a forward
   (EP 2: every row of the second micro-batch replayed to rank 0's
   experts): each slot keeps its own rows; F0 F1 B0 B1 equals sequential */
typedef struct gj {
    moept_thread_group *g;
    int r;
    moept_status st;
    char err[512];
    int64_t cap[2]; /* rank's receive capacity after F0, after F1 */
    int same;
} gj;

static moept_status g_fwd(moept_layer *L, void *x, void *y, int slot, const int32_t *replay) {
    moept_forward_opts o = {NULL, 0, replay, NULL, slot};
    return moept_forward_ex(L, x, TOK, y, &o);
}

/* F0 (the router's choice), F1 (replayed), their backwards, slots as given;
   y and dx of each into h[0..3] */
static moept_status grow_calls(moept_layer *L, void **x, void **dy, const int32_t *rep, const int *slots,
                               int bwd_first, void *y, void *dx, float (*h)[TOK * DIM], int64_t *cap) {
    moept_status st = MOEPT_OK;
    for (int i = 0; i < 4 && !st; i++) {
        const int m = bwd_first ? i / 2 : i % 2, fwd = bwd_first ? i % 2 == 0 : i < 2;
        moept_backward_opts bo = moept_backward_default();
        bo.slot = slots[m];
        st = fwd ? g_fwd(L, x[m], y, slots[m], m ? rep : NULL) : moept_backward_ex(L, x[m], dy[m], dx, &bo);
        tu_to_host(h[2 * m + !fwd], fwd ? y : dx, NB);
        moept_stats s;
        if (fwd && cap && !moept_get_stats(L, &s, NULL)) cap[m] = s.recv_capacity;
    }
    return st;
}

static void *grow_main(void *arg) {
    gj *j = arg;
    moept_config cfg = slot_cfg(0);
    cfg.router_jitter = 0.0f;
    tu_ep e;
    moept_comm *c = tu_ep_open(&e, j->g, 2, j->r);
    moept_layer *A = slot_layer(&cfg, c, 2, 0), *B = slot_layer(&cfg, c, 0, 0);
    if (A && B) {
        float x[TOK * DIM], dy[TOK * DIM], h[2][4][TOK * DIM];
        uint8_t mask[TOK];
        int32_t ids[TOK * 2];
        for (int t = 0; t < TOK; t++) { ids[2 * t] = 0; ids[2 * t + 1] = 1; } /* rank 0's experts */
        void *rep = tu_dev(ids, sizeof ids), *xs[2], *dys[2], *y = tu_dev(NULL, NB), *dx = tu_dev(NULL, NB);
        for (int m = 0; m < 2; m++) {
            mb_data(j->r, m, x, dy, mask, 0);
            xs[m] = tu_dev(x, NB); dys[m] = tu_dev(dy, NB);
        }
        const int two[2] = {0, 1}, one_slot[2] = {0, 0};
        j->st = grow_calls(A, xs, dys, rep, two, 0, y, dx, h[0], j->cap);
        if (!j->st) j->st = grow_calls(B, xs, dys, rep, one_slot, 1, y, dx, h[1], NULL);
        snprintf(j->err, sizeof j->err, "%s", moept_last_error(NULL));
        j->same = !j->st && !memcmp(h[0], h[1], sizeof h[0]) && same_grads(A, B);
        void *d[7] = {rep, xs[0], xs[1], dys[0], dys[1], y, dx};
        for (int i = 0; i < 7; i++) tu_dev_free(d[i]);
    } else {
        j->st = MOEPT_ERR_STATE;
    }
    moept_destroy(A);
    moept_destroy(B);
    tu_ep_close(&e);
    return NULL;
}

static void test_grow_other_slot(void) {
    gj js[2];
    if (too_few_devices(2)) return;
    tu_world_ranks(2, grow_main, js, sizeof js[0], NULL);
    for (int r = 0; r < 2; r++)
        EXPECT(!js[r].st && js[r].same, "rank %d: %d (%s), or F0 F1 B0 B1 differs from sequential", r,
               js[r].st, js[r].err);
    EXPECT(js[0].cap[1] > js[0].cap[0], "rank 0's slot 1 did not grow (%lld, then %lld rows)",
           (long long)js[0].cap[0], (long long)js[0].cap[1]);
}

/* moept_reshard with two slots and an evaluation in flight (EP 2): both
   slots' forwards are dropped (their backwards refuse on every rank), and
   a forward and backward after it run */
typedef struct slots_rj { moept_thread_group *g; int r; moept_status st[4]; char err[4][512]; } slots_rj;

static void *slots_reshard_main(void *arg) {
    slots_rj *j = arg;
    moept_config cfg = slot_cfg(0);
    cfg.router_jitter = 0.0f;
    tu_ep e;
    moept_layer *L = slot_layer(&cfg, tu_ep_open(&e, j->g, 2, j->r), 2, 0);
    if (L) {
        float x[TOK * DIM], dy[TOK * DIM];
        uint8_t mask[TOK];
        mb_data(j->r, 0, x, dy, mask, 0);
        void *x0 = tu_dev(x, NB), *dyd = tu_dev(dy, NB), *y = tu_dev(NULL, NB), *dx = tu_dev(NULL, NB);
        moept_forward_opts f0 = {NULL, 0, NULL, NULL, 0}, f1 = {NULL, 0, NULL, NULL, 1};
        moept_forward_opts ev = {NULL, 1, NULL, NULL, 0};
        moept_backward_opts b0 = moept_backward_default(), b1 = moept_backward_default();
        b1.slot = 1;
        const int32_t swap[8] = {1, 1, 1, 1, 0, 0, 0, 0};
        if (!moept_forward_ex(L, x0, TOK, y, &f0) && !moept_forward_ex(L, x0, TOK, y, &f1) &&
            !moept_forward_ex(L, x0, TOK, y, &ev)) {
            j->st[0] = moept_reshard(L, swap, NULL);
            j->st[1] = moept_backward_ex(L, x0, dyd, dx, &b0);
            j->st[2] = moept_backward_ex(L, x0, dyd, dx, &b1);
            j->st[3] = moept_forward_ex(L, x0, TOK, y, &f1);
            if (!j->st[3]) j->st[3] = moept_backward_ex(L, x0, dyd, dx, &b1);
        } else {
            j->st[0] = MOEPT_ERR_STATE;
        }
        snprintf(j->err[0], sizeof j->err[0], "%s", moept_last_error(L));
        void *d[4] = {x0, dyd, y, dx};
        for (int i = 0; i < 4; i++) tu_dev_free(d[i]);
    } else {
        j->st[0] = MOEPT_ERR_STATE;
    }
    moept_destroy(L);
    tu_ep_close(&e);
    return NULL;
}

static void test_reshard_slots(void) {
    slots_rj js[2];
    if (too_few_devices(2)) return;
    tu_world_ranks(2, slots_reshard_main, js, sizeof js[0], NULL);
    for (int r = 0; r < 2; r++)
        EXPECT(!js[r].st[0] && js[r].st[1] == MOEPT_ERR_STATE && js[r].st[2] == MOEPT_ERR_STATE &&
               !js[r].st[3], "rank %d: reshard %d, backward of slot 0 %d and of slot 1 %d after it "
               "(want %d), then a step %d (%s)", r, js[r].st[0], js[r].st[1], js[r].st[2], MOEPT_ERR_STATE,
               js[r].st[3], js[r].err[0]);
}

/* the workspace the layer counts: host (CPU layers) or device (CUDA layers,
   checked against the emulated device's own count of what it holds) */
static int64_t workspace(const moept_layer *L) {
    moept_stats s;
    moept_get_stats(L, &s, NULL);
#ifdef MOEPT_EMU
    static const moept_layer *last;
    static long long held0, w0;
    if (L != last) { last = L; held0 = moept_emu_device_bytes(0); w0 = s.device_workspace_bytes; }
    EXPECT(moept_emu_device_bytes(0) - held0 == s.device_workspace_bytes - w0, "the device holds %lld bytes "
           "more, device_workspace_bytes says %lld", moept_emu_device_bytes(0) - held0,
           (long long)(s.device_workspace_bytes - w0));
#endif
    return TU_GPU ? s.device_workspace_bytes : s.workspace_bytes;
}

/* Each slot used adds one slot's memory (one rank: the receive rows never
   grow), counted in moept_stats.workspace_bytes, and a training layer's
   evaluation forward, where it needs its own slot, one more: a slot is its
   forward state only (the layer's scratch is shared: less than the
   create's workspace), on both executors. The config's range. */
static void test_slot_memory(void) {
    moept_config c = slot_cfg(1);
    c.max_inflight = 4;
    c.overlap_chunks = 0;
    moept_layer *L = slot_layer(&c, NULL, 4, 0);
    if (!L) { EXPECT(0, "create: %s", moept_last_error(NULL)); return; }
    one o;
    one_open(&o);
    uint8_t mh[TOK];
    memset(mh, 1, sizeof mh);
    mh[3] = 0;
    void *mask = tu_dev(mh, TOK);
    const int64_t wc = workspace(L);
    int64_t unit = wc, base = 0; /* k slots used: base + k unit (measured at k = 2) */
    for (int k = 0; k < 4; k++) {
        moept_forward_opts f = {mask, 0, NULL, NULL, k};
        EXPECT_OK(moept_forward_ex(L, o.x[0], TOK, o.y, &f));
        const int64_t w = workspace(L);
        if (k == 0) base = w - unit; /* (the first masked forward: room to pack the shared rows) */
        if (k == 1) {
            unit = w - (base + unit);
            base = w - 2 * unit;
            EXPECT(unit > 0 && unit < wc, "a slot: %lld bytes of %lld", (long long)unit, (long long)wc);
        }
        EXPECT(w == base + (k + 1) * unit, "%d slots: workspace %lld, want %lld", k + 1, (long long)w,
               (long long)(base + (k + 1) * unit));
    }
    moept_forward_opts eo = {NULL, 1, NULL, NULL, 0};
    EXPECT_OK(moept_forward_ex(L, o.x[0], TOK, o.y, &eo));
    EXPECT(workspace(L) == base + 5 * unit, "evaluation: workspace %lld, want %lld", (long long)workspace(L),
           (long long)(base + 5 * unit));
    moept_destroy(L);
    /* one slot, as before: the same workspace */
    if ((L = slot_layer(&c, NULL, 0, 0))) {
        EXPECT(workspace(L) == wc, "max_inflight 0: workspace %lld", (long long)workspace(L));
        moept_forward_opts f = {NULL, 0, NULL, NULL, 1};
        EXPECT(moept_forward_ex(L, o.x[0], TOK, o.y, &f) == MOEPT_ERR_INVALID_ARGUMENT,
               "slot 1 of one: accepted");
        /* a training loop's evaluation, its forward differentiated, evaluates in the training slot;
           one between a forward and its backward takes a second slot */
        EXPECT_OK(moept_forward(L, o.x[0], TOK, o.y));
        EXPECT_OK(moept_backward(L, o.x[0], o.dy[0], o.dx));
        EXPECT_OK(moept_forward_ex(L, o.x[0], TOK, o.y, &eo));
        EXPECT(workspace(L) == wc, "an evaluation after the backward: workspace %lld",
               (long long)workspace(L));
        EXPECT_OK(moept_forward(L, o.x[0], TOK, o.y));
        EXPECT_OK(moept_forward_ex(L, o.x[0], TOK, o.y, &eo));
        EXPECT(workspace(L) == wc + unit, "an evaluation before the backward: workspace %lld",
               (long long)workspace(L));
        EXPECT_OK(moept_backward(L, o.x[0], o.dy[0], o.dx));
        moept_destroy(L);
    }
    for (int bad = 0; bad < 2; bad++) {
        c.max_inflight = bad ? MOEPT_MAX_INFLIGHT + 1 : -1;
        EXPECT(tu_layer(&c, NULL, 0, &L) == MOEPT_ERR_INVALID_ARGUMENT, "max_inflight %lld accepted",
               (long long)c.max_inflight);
    }
    tu_dev_free(mask);
    one_close(&o);
}

#if TU_GPU
/* CUDA graphs and slots: a captured step's forward into a slot never used
   is refused (it would allocate: MOEPT_ERR_STATE) and the capture stays
   valid; with every slot used once, F0 F1 B0 B1 (sync-free, a masked
   shared expert) captured and replayed equals the same calls run eagerly */
static moept_layer *sf_layer(moept_config cfg, cudaStream_t s) {
    moept_cuda_options o = {MOEPT_DTYPE_F32, s, 0, 1, MOEPT_GEMM_AUTO};
    moept_layer *L = NULL;
    cfg.max_inflight = 2;
    if (moept_create_cuda(&cfg, NULL, NULL, &o, &L)) EXPECT(0, "create: %s", moept_last_error(NULL));
    else moept_init_params(L, 7);
    return L;
}
static int two_slots(moept_layer *L, one *o, void *mask, void *y1, void *dx1) {
    moept_forward_opts f0 = {mask, 0, NULL, NULL, 0}, f1 = {mask, 0, NULL, NULL, 1};
    moept_backward_opts b0 = moept_backward_default(), b1 = moept_backward_default();
    b1.slot = 1;
    return moept_forward_ex(L, o->x[0], TOK, o->y, &f0) || moept_forward_ex(L, o->x[1], TOK, y1, &f1) ||
           moept_backward_ex(L, o->x[0], o->dy[0], o->dx, &b0) ||
           moept_backward_ex(L, o->x[1], o->dy[1], dx1, &b1);
}
static void test_capture(void) {
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    moept_layer *L[2] = {sf_layer(slot_cfg(4), s), sf_layer(slot_cfg(4), s)};
    one o;
    one_open(&o);
    uint8_t mh[TOK];
    for (int t = 0; t < TOK; t++) mh[t] = t % 4 != 1;
    void *mask = tu_dev(mh, TOK), *y1 = tu_dev(NULL, NB), *dx1 = tu_dev(NULL, NB);
    cudaDeviceSynchronize(); /* tu_dev's cudaMemset ran on the legacy stream, which s does not wait for */
    cudaGraph_t g = NULL;
    cudaGraphExec_t gx = NULL;
    float *p, *gr, h[2][4][TOK * DIM];
    int64_t n;
    if (!L[0] || !L[1]) goto out;
    moept_forward_opts f1 = {mask, 0, NULL, NULL, 1};
    EXPECT_OK(moept_cuda_params(L[0], &p, &gr, &n));
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    moept_status st = moept_forward_ex(L[0], o.x[0], TOK, o.y, &f1);
    EXPECT(st == MOEPT_ERR_STATE && strstr(moept_last_error(L[0]), "capture"), "a new slot under a capture: "
           "%d (%s)", st, moept_last_error(L[0]));
    EXPECT(cudaStreamEndCapture(s, &g) == cudaSuccess, "the capture was invalidated");
    if (g) cudaGraphDestroy(g);
    g = NULL;
    EXPECT(!two_slots(L[0], &o, mask, y1, dx1), "eager, slots made: %s", moept_last_error(L[0]));
    EXPECT_OK(moept_cuda_params(L[0], &p, &gr, &n));
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    int bad = two_slots(L[0], &o, mask, y1, dx1);
    cudaError_t ended = cudaStreamEndCapture(s, &g); /* always: a stream left capturing breaks what follows */
    EXPECT(!bad && ended == cudaSuccess &&
           cudaGraphInstantiate(&gx, g, 0) == cudaSuccess,
           "capture of F0 F1 B0 B1: %s", moept_last_error(L[0]));
    for (int v = 0; v < 2 && gx; v++) {
        moept_zero_grad(L[v]);
        if (v) EXPECT(!two_slots(L[1], &o, mask, y1, dx1), "eager: %s", moept_last_error(L[1]));
        else if (cudaGraphLaunch(gx, s) == cudaSuccess) moept_cuda_params_changed(L[0]);
        cudaStreamSynchronize(s);
        void *d[4] = {o.y, y1, o.dx, dx1};
        for (int i = 0; i < 4; i++) tu_to_host(h[v][i], d[i], NB);
    }
    EXPECT(gx && !memcmp(h[0], h[1], sizeof h[0]) && same_grads(L[0], L[1]),
           "the replayed F0 F1 B0 B1 differs from the eager one");
out:
    if (gx) cudaGraphExecDestroy(gx);
    if (g) cudaGraphDestroy(g);
    tu_dev_free(mask); tu_dev_free(y1); tu_dev_free(dx1);
    one_close(&o);
    moept_destroy(L[0]);
    moept_destroy(L[1]);
    cudaStreamDestroy(s);
}

/* Sync-free (EP 2): forwards naming different slots return (the mode
   agrees on the device), and the next moept_grad_norm fails on both ranks
   with MOEPT_ERR_INVALID_ARGUMENT naming opts.slot */
typedef struct fj { moept_thread_group *g; int r; moept_status st[2]; char err[512]; } fj;
static void *sf_wrong_main(void *arg) {
    fj *j = arg;
    tu_ep e;
    moept_config cfg = slot_cfg(0);
    moept_layer *L = slot_layer(&cfg, tu_ep_open(&e, j->g, 2, j->r), 2, 1);
    float x[TOK * DIM], dy[TOK * DIM];
    uint8_t mask[TOK];
    mb_data(j->r, 0, x, dy, mask, 0);
    void *xd = tu_dev(x, NB), *y = tu_dev(NULL, NB);
    moept_forward_opts f = {NULL, 0, NULL, NULL, j->r};
    double norm;
    j->st[0] = L ? moept_forward_ex(L, xd, TOK, y, &f) : MOEPT_ERR_STATE;
    j->st[1] = L ? moept_grad_norm(L, &norm) : MOEPT_ERR_STATE;
    snprintf(j->err, sizeof j->err, "%s", moept_last_error(L));
    tu_dev_free(xd);
    tu_dev_free(y);
    moept_destroy(L);
    tu_ep_close(&e);
    return NULL;
}
static void test_sync_free_slots(void) {
    fj js[2];
    if (too_few_devices(2)) return;
    tu_world_ranks(2, sf_wrong_main, js, sizeof js[0], NULL);
    for (int r = 0; r < 2; r++)
        EXPECT(!js[r].st[0] && js[r].st[1] == MOEPT_ERR_INVALID_ARGUMENT && strstr(js[r].err, "opts.slot"),
               "rank %d: forward %d, grad_norm %d (%s)", r, js[r].st[0], js[r].st[1], js[r].err);
}

/* bf16 slots: F0 F1, a forward of a non-finite x rejected into each slot
   (it wrote the slot's fp32 router input), B0 B1 equals sequential bitwise;
   kind 4, and kind 6 in FP8's kernel form (a's copy kept by F1 alone) */
static void bf16_slots(int kind) {
    moept_config cfg = slot_cfg(kind);
    cfg.max_inflight = 2;
    moept_cuda_options co = {MOEPT_DTYPE_BF16, NULL, 0, 0, kind == 6 ? MOEPT_GEMM_KERNEL : MOEPT_GEMM_AUTO};
    moept_layer *L[2] = {NULL, NULL};
    for (int v = 0; v < 2; v++)
        if (!moept_create_cuda(&cfg, NULL, NULL, &co, &L[v])) moept_init_params(L[v], 7);
    const size_t nb = (size_t)(TOK * DIM) * 2;
    uint16_t hx[3][TOK * DIM], hdy[2][TOK * DIM], out[2][4][TOK * DIM];
    float x[TOK * DIM], dy[TOK * DIM];
    uint8_t mask[TOK];
    for (int m = 0; m < 2; m++) {
        mb_data(0, m, x, dy, mask, 1);
        memcpy(hx[m], x, nb), memcpy(hdy[m], dy, nb);
    }
    memcpy(hx[2], hx[1], nb);
    hx[2][5] = 0x7fc0; /* NaN */
    void *xd[3], *dyd[2], *y = tu_dev(NULL, nb), *dx = tu_dev(NULL, nb);
    for (int m = 0; m < 3; m++) xd[m] = tu_dev(hx[m], nb);
    for (int m = 0; m < 2; m++) dyd[m] = tu_dev(hdy[m], nb);
    moept_forward_opts fo[2] = {{NULL, 0, NULL, NULL, 0}, {NULL, 0, NULL, NULL, 1}};
    moept_backward_opts bo[2] = {moept_backward_default(), moept_backward_default()};
    bo[1].slot = 1;
    for (int v = 0; v < 2 && L[0] && L[1]; v++) /* v 0: slots 0 and 1; v 1: slot 0, in sequence */
        for (int m = 0; m < 2; m++) {
            EXPECT_OK(moept_forward_ex(L[v], xd[m], TOK, y, &fo[v ? 0 : m]));
            tu_to_host(out[v][m], y, nb);
            if (v) EXPECT_OK(moept_backward_ex(L[1], xd[m], dyd[m], dx, &bo[0]));
            if (v) tu_to_host(out[1][2 + m], dx, nb);
        }
    for (int m = 0; m < 2 && L[0]; m++)
        EXPECT(moept_forward_ex(L[0], xd[2], TOK, y, &fo[m]) == MOEPT_ERR_NUMERIC, "a NaN x accepted");
    for (int m = 0; m < 2 && L[0]; m++) {
        EXPECT_OK(moept_backward_ex(L[0], xd[m], dyd[m], dx, &bo[m]));
        tu_to_host(out[0][2 + m], dx, nb);
    }
    EXPECT(L[0] && L[1] && !memcmp(out[0], out[1], sizeof out[0]) && same_grads(L[0], L[1]),
           "bf16, kind %d: F0 F1 (rejected forwards) B0 B1 differs from sequential", kind);
    for (int m = 0; m < 3; m++) tu_dev_free(xd[m]);
    tu_dev_free(dyd[0]); tu_dev_free(dyd[1]); tu_dev_free(y); tu_dev_free(dx);
    moept_destroy(L[0]);
    moept_destroy(L[1]);
}
static void test_bf16_slots(void) {
    bf16_slots(4);
    tu_cc cc;
    if (tu_fp8_kernel(&cc)) bf16_slots(6);
    else tu_skip("bf16 slots in FP8's kernel form", cc.why);
    tu_cc_restore(&cc);
}
#endif

#ifdef MOEPT_EMU
/* Out of device memory at a slot's first use on one rank (EP 2; the
   first or second allocation fails): that rank fails with
   MOEPT_ERR_OUT_OF_MEMORY, its peer with MOEPT_ERR_STATE; the slot holds
   nothing; the device holds what device_workspace_bytes says; the calls
   after it equal a clean run's bitwise */
typedef struct oj {
    moept_thread_group *g;
    int r, nth;
    moept_status st[4];
    char err[512];
    int same;
    long long held, counted;
} oj;
static int oom_nth;

static void oom_calls(oj *j, moept_layer *L, moept_layer *K, void **x, void *dyd, void *mk) {
    void *y = tu_dev(NULL, NB), *dx = tu_dev(NULL, NB), *dxk = tu_dev(NULL, NB);
    moept_forward_opts f[2] = {{mk, 0, NULL, NULL, 0}, {mk, 0, NULL, NULL, 1}};
    moept_backward_opts b[2] = {moept_backward_default(), moept_backward_default()};
    b[1].slot = 1;
    moept_stats s;
    j->st[0] = moept_forward_ex(L, x[0], 6, y, &f[0]);
    moept_get_stats(L, &s, NULL);
    const long long held = moept_emu_device_bytes(j->r), counted = s.device_workspace_bytes;
    if (j->r == 1) moept_emu_fail_malloc(oom_nth);
    j->st[1] = moept_forward_ex(L, x[1], 6, y, &f[1]);
    snprintf(j->err, sizeof j->err, "%s", moept_last_error(L));
    if (j->r == 1) moept_emu_fail_malloc(0);
    moept_get_stats(L, &s, NULL);
    j->held = moept_emu_device_bytes(j->r) - held;
    j->counted = s.device_workspace_bytes - counted;
    j->st[2] = moept_backward_ex(L, x[1], dyd, dx, &b[1]); /* nothing in slot 1 */
    j->st[3] = moept_forward_ex(L, x[1], 6, y, &f[1]);
    if (!j->st[3]) j->st[3] = moept_backward_ex(L, x[1], dyd, dx, &b[1]);
    if (!j->st[3]) j->st[3] = moept_backward_ex(L, x[0], dyd, dx, &b[0]);
    moept_forward_ex(K, x[0], 6, y, &f[0]); moept_forward_ex(K, x[1], 6, y, &f[1]);
    moept_backward_ex(K, x[1], dyd, dxk, &b[1]); moept_backward_ex(K, x[0], dyd, dxk, &b[0]);
    float h[2][TOK * DIM];
    tu_to_host(h[0], dx, NB);
    tu_to_host(h[1], dxk, NB);
    j->same = !memcmp(h[0], h[1], NB) && same_grads(L, K);
    tu_dev_free(y); tu_dev_free(dx); tu_dev_free(dxk);
}

static void *oom_main(void *arg) {
    oj *j = arg;
    moept_config cfg = slot_cfg(4);
    tu_ep e;
    moept_comm *c = tu_ep_open(&e, j->g, 2, j->r);
    moept_layer *L = slot_layer(&cfg, c, 2, 0), *K = slot_layer(&cfg, c, 2, 0);
    if (L && K) {
        float x[TOK * DIM], dy[TOK * DIM];
        uint8_t mask[TOK];
        mb_data(j->r, 1, x, dy, mask, 0);
        void *xs[2], *mk = tu_dev(mask, TOK);
        xs[1] = tu_dev(x, NB);
        mb_data(j->r, 0, x, dy, mask, 0);
        xs[0] = tu_dev(x, NB);
        void *dyd = tu_dev(dy, NB);
        oom_calls(j, L, K, xs, dyd, mk);
        tu_dev_free(xs[0]); tu_dev_free(xs[1]); tu_dev_free(dyd); tu_dev_free(mk);
    } else {
        j->st[0] = MOEPT_ERR_STATE;
    }
    moept_destroy(L);
    moept_destroy(K);
    tu_ep_close(&e);
    return NULL;
}

static void test_slot_oom(void) {
    for (oom_nth = 1; oom_nth <= 2; oom_nth++) { /* the slot's block, then its receive rows */
        oj js[2];
        tu_world_ranks(2, oom_main, js, sizeof js[0], NULL);
        for (int r = 0; r < 2; r++) {
            const oj *j = &js[r];
            EXPECT(!j->st[0] && j->st[1] == (r ? MOEPT_ERR_OUT_OF_MEMORY : MOEPT_ERR_STATE) &&
                   j->st[2] == MOEPT_ERR_STATE && !j->st[3] && j->same,
                   "allocation %d, rank %d: forward %d, out of memory %d (%s), backward of the empty slot "
                   "%d, after %d, as a clean run %d", oom_nth, r, j->st[0], j->st[1], j->err, j->st[2],
                   j->st[3], j->same);
            EXPECT(j->held == j->counted, "allocation %d, rank %d: the device holds %lld bytes more, "
                   "device_workspace_bytes says %lld", oom_nth, r, j->held, j->counted);
        }
    }
}

/* More groups than one k_ptrs launch carries (96 local experts): the
   grouped GEMM form equals the per-expert one to fp32 rounding */
static void test_many_groups(void) {
    moept_config cfg = {0};
    cfg.family = MOEPT_FAMILY_MIXTRAL;
    cfg.hidden_size = 8; cfg.intermediate_size = 8; cfg.num_experts = 96; cfg.top_k = 4; cfg.max_tokens = 64;
    const size_t nb = 64 * 8 * sizeof(float);
    float x[64 * 8], dy[64 * 8], h[4][64 * 8];
    unsigned long long sd = 5;
    tu_fill(x, 64 * 8, 1.0, &sd);
    tu_fill(dy, 64 * 8, 1.0, &sd);
    void *xd = tu_dev(x, nb), *dyd = tu_dev(dy, nb), *y = tu_dev(NULL, nb), *dx = tu_dev(NULL, nb);
    moept_layer *L[2] = {NULL, NULL};
    long launches = 0;
    for (int v = 0; v < 2; v++) {
        moept_cuda_options o = {MOEPT_DTYPE_F32, NULL, 0, 0, v ? MOEPT_GEMM_PER_EXPERT : MOEPT_GEMM_GROUPED};
        if (moept_create_cuda(&cfg, NULL, NULL, &o, &L[v])) break;
        moept_init_params(L[v], 3);
        const long k0 = moept_emu_launches("k_ptrs");
        EXPECT_OK(moept_forward(L[v], xd, 64, y));
        EXPECT_OK(moept_backward(L[v], xd, dyd, dx));
        const int32_t *ids;
        if (!v && !moept_routing(L[0], &ids, NULL, NULL)) { /* a launch per 40 experts with rows */
            int used[96] = {0}, n = 0;
            for (int i = 0; i < 64 * 4; i++) n += !used[ids[i]]++;
            launches = moept_emu_launches("k_ptrs") - k0 - 6 * ((n + 39) / 40);
        }
        tu_to_host(h[2 * v], y, nb);
        tu_to_host(h[2 * v + 1], dx, nb);
    }
    EXPECT(launches == 0, "96 groups: %ld k_ptrs launches more than one per 40 experts with rows, in each of "
           "the step's 6 grouped GEMMs", launches);
    EXPECT(L[0] && L[1] && tu_maxrelerr(h[0], h[2], 2 * 64 * 8) < 1e-5, "grouped against per-expert: %g",
           tu_maxrelerr(h[0], h[2], 2 * 64 * 8));
    void *d[4] = {xd, dyd, y, dx};
    for (int i = 0; i < 4; i++) tu_dev_free(d[i]);
    moept_destroy(L[0]);
    moept_destroy(L[1]);
}
#endif

/* An inference layer's forward is an evaluation: it reads no opts.slot */
static void test_inference_slot(void) {
    moept_config c = slot_cfg(0);
    c.inference_only = 1;
    c.router_jitter = 0.0f;
    moept_layer *L = slot_layer(&c, NULL, 0, 0);
    if (!L) { EXPECT(0, "create: %s", moept_last_error(NULL)); return; }
    one o;
    one_open(&o);
    moept_forward_opts f = {NULL, 0, NULL, NULL, 5};
    EXPECT_OK(moept_forward(L, o.x[0], TOK, o.y));
    EXPECT_OK(moept_forward_ex(L, o.x[0], TOK, o.y2, &f));
    one_host(&o);
    EXPECT(!memcmp(o.h[0], o.h[1], NB), "opts.slot 5 changed an inference layer's y");
    one_close(&o);
    moept_destroy(L);
}

int main(void) {
#if TU_GPU
    if (moept_cuda_device_count() < 1) {
        tu_skip("test_slots (CUDA layers)", "no CUDA device");
        return tu_done();
    }
#endif
    RUN(test_pipeline_orders);
    RUN(test_recompute);
    RUN(test_routing_reads);
    RUN(test_wrong_slots);
    RUN(test_grow_other_slot);
    RUN(test_reshard_slots);
    RUN(test_slot_memory);
    RUN(test_inference_slot);
#if TU_GPU
    RUN(test_capture);
    RUN(test_sync_free_slots);
    RUN(test_bf16_slots);
#endif
#ifdef MOEPT_EMU
    RUN(test_slot_oom);
    RUN(test_many_groups);
#endif
    return tu_done();
}
