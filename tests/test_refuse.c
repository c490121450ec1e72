/* Nothing lost: AdamW never writes a state a save cannot write or a load
   cannot read (a finite gradient too large for fp32's second moment is
   refused on every rank, state unchanged; one just inside fp32 steps); its
   hyperparameters are checked for what they do; a save refuses a
   non-finite state and the previous set stays loadable; a checkpoint
   directory's cleanup never follows a link out of it; a pending forward's
   backward after a call that changed the weights is refused, naming it; a
   group layer's step over unsynced gradients is refused on every rank.
   Built twice, as test_slots: CPU layers over threads, and
   build/emu/test_refuse CUDA layers on the emulated GPU over NCCL ranks. */
#ifdef MOEPT_CUDA
#define MOEPT_INTERNAL
#include "../moept.h"
#else
#include "../moept.c"
#endif
#include "testutil.h"
#include "tu_exec.h"
#include <sys/stat.h>
#include <unistd.h>

/* the AdamW step count is t (a CUDA layer's is opaque here: its parameters tell) */
#if TU_GPU
#define T_IS(L, n) 1
#else
#define T_IS(L, n) ((L)->opt.t == (n))
#endif

#define TOK 8
#define DIM 16
#define NB ((size_t)(TOK * DIM) * sizeof(float))

static int g_P; /* the ranks of the next tu_ranks (which zeroes the jobs) */
typedef struct refuse_job {
    moept_thread_group *g;
    int r;
    int P;
    moept_status st[8];
    char err[8][512];
    int same[8];
} refuse_job;

static moept_config refuse_cfg(int deepseek) {
    moept_config c = {0};
    c.hidden_size = DIM; c.intermediate_size = 12; c.num_experts = 4; c.top_k = 2; c.max_tokens = TOK;
    c.family = MOEPT_FAMILY_MIXTRAL;
    if (deepseek) { c.family = MOEPT_FAMILY_DEEPSEEK_V3; c.n_group = 2; c.topk_group = 1; }
    return c;
}

static const char *tdir(const char *leaf) {
    static _Thread_local char buf[256];
    snprintf(buf, sizeof buf, "/tmp/moept_refuse_%d_%s", (int)getpid(), leaf);
    return buf;
}

/* flat element i of the parameters (b = 0) or the gradients (b = 1) set to
   v where the layer keeps them (a CUDA layer's on the device) */
static void poke(moept_layer *L, int b, int64_t i, float v) {
    float *p = NULL, *g = NULL;
    int64_t n = 0;
#if TU_GPU
    moept_cuda_params(L, &p, &g, &n);
    cudaMemcpy((b ? g : p) + i, &v, sizeof v, cudaMemcpyHostToDevice);
    if (!b) moept_cuda_params_changed(L);
#else
    if (b) moept_grads(L, &g, &n); else moept_params(L, &p, &n);
    (b ? g : p)[i] = v; /* (moept_buf_write refuses it) */
#endif
}

/* a hash of every parameter, as the host reads them */
static uint64_t params_hash(moept_layer *L) {
    int64_t n;
    float *p = tu_buf(L, MOEPT_BUF_PARAMS, &n);
    uint64_t h = p ? tu_hash(p, n) : 0;
    free(p);
    return h;
}

/* forward and backward of one micro-batch (slot 0), dy scaled */
static moept_status fb(moept_layer *L, int r, float *dx_h) {
    float x[TOK * DIM], dy[TOK * DIM];
    unsigned long long s = 11 + (unsigned long long)r;
    tu_fill(x, TOK * DIM, 1.0, &s);
    tu_fill(dy, TOK * DIM, 1.0, &s);
    void *dx = tu_dev(NULL, NB), *y = tu_dev(NULL, NB), *xd = tu_dev(x, NB), *dyd = tu_dev(dy, NB);
    moept_status st = moept_forward(L, xd, TOK, y);
    if (!st) st = moept_backward(L, xd, dyd, dx);
    if (dx_h) tu_to_host(dx_h, dx, NB);
    tu_dev_free(dx); tu_dev_free(y); tu_dev_free(xd); tu_dev_free(dyd);
    return st;
}

static moept_layer *open_layer(refuse_job *j, tu_ep *e, int deepseek) {
    moept_config c = refuse_cfg(deepseek);
    moept_comm *ep = tu_ep_open(e, j->g, j->P, j->r);
    moept_layer *L = NULL;
    if (tu_layer(&c, ep, 0, &L) || moept_init_params(L, 7)) {
        snprintf(j->err[0], sizeof j->err[0], "set-up: %.400s", moept_last_error(NULL));
        j->st[0] = MOEPT_ERR_STATE;
        return NULL;
    }
    return L;
}

/* A rank's part of a test on its layer (open_layer's), which refuse_rank then closes */
typedef void refuse_body(refuse_job *j, moept_layer *L);
static refuse_body *g_body; /* the next refuse_ranks' */
static int g_deepseek;      /* its layers with DeepSeek-V3's routing */
static void *refuse_rank(void *arg) {
    refuse_job *j = arg;
    j->P = g_P;
    tu_ep e;
    moept_layer *L = open_layer(j, &e, g_deepseek);
    if (L) g_body(j, L);
    moept_destroy(L);
    tu_ep_close(&e);
    return NULL;
}
/* body on P rank threads of a new world, a job each (js[P], zeroed first) */
static void refuse_ranks(int P, refuse_body *body, int deepseek, refuse_job *js) {
    g_P = P, g_body = body, g_deepseek = deepseek;
    tu_new_world();
    tu_ranks(P, 20000, refuse_rank, js, sizeof js[0]);
}

/* 0: a gradient of 1e21 on rank P-1 (fp32 v overflows) refused everywhere,
   nothing changed; 1: the save after it succeeds and loads; 2: 5e20 on
   every rank (v = 2.5e38, inside fp32) steps, and the state saves and loads */
static void overflow_body(refuse_job *j, moept_layer *L) {
    const moept_adamw o = moept_adamw_default(1e-3f);
    const char *dir = tdir("overflow");
    moept_status st = fb(L, j->r, NULL);
    if (!st) st = moept_sync_grads(L, 1.0f);
    if (!st) st = moept_adamw_step(L, &o); /* moments to guard */
    if (!st) st = moept_save_checkpoint(L, dir);
    if (!st) st = fb(L, j->r, NULL);
    if (!st) st = moept_sync_grads(L, 1.0f);
    if (st) { j->st[0] = MOEPT_ERR_STATE; snprintf(j->err[0], 512, "set-up: %.400s", moept_last_error(L)); }
    if (st) return;
    const uint64_t h0 = params_hash(L);
    if (j->r == j->P - 1) poke(L, 1, 3, 1e21f);
    j->st[0] = moept_adamw_step(L, &o);
    snprintf(j->err[0], 512, "%s", moept_last_error(L));
    j->same[0] = params_hash(L) == h0 && T_IS(L, 1);
    j->st[1] = moept_save_checkpoint(L, dir);
    if (!j->st[1]) j->st[1] = moept_load_checkpoint(L, dir);
    j->same[1] = params_hash(L) == h0 && T_IS(L, 1);
    poke(L, 1, 3, 5e20f);
    j->st[2] = moept_adamw_step(L, &o); /* bounds fail after the load: the probe passes it */
    snprintf(j->err[2], 512, "%s", moept_last_error(L));
    if (!j->st[2]) j->st[2] = moept_save_checkpoint(L, dir);
    if (!j->st[2]) j->st[2] = moept_load_checkpoint(L, dir);
    j->same[2] = T_IS(L, 2);
}

static void test_overflow_refused(void) {
    for (int P = 1; P <= 2; P++) {
        refuse_job js[2];
        refuse_ranks(P, overflow_body, 0, js);
        for (int r = 0; r < P; r++) {
            refuse_job *j = &js[r];
            const int mine = r == P - 1;
            EXPECT(j->st[0] == (mine ? MOEPT_ERR_NUMERIC : MOEPT_ERR_STATE) &&
                   strstr(j->err[0], mine ? "too large for AdamW's fp32 second moment" : "other rank") &&
                   (!mine || (strstr(j->err[0], "'gate.weight'") && strstr(j->err[0], "clip"))),
                   "P %d rank %d: the overflowing step: %d (%s)", P, r, (int)j->st[0], j->err[0]);
            EXPECT(j->same[0], "P %d rank %d: the refused step changed the parameters or t", P, r);
            EXPECT(j->st[1] == MOEPT_OK && j->same[1], "P %d rank %d: save and load after it: %d", P, r,
                   (int)j->st[1]);
            EXPECT(j->st[2] == MOEPT_OK && j->same[2], "P %d rank %d: a step just inside fp32, saved and "
                   "loaded: %d (%s)", P, r, (int)j->st[2], j->err[2]);
        }
    }
}

/* every hyperparameter out of range refused, naming it, nothing changed */
static void hyper_body(refuse_job *j, moept_layer *L) {
    moept_status st = fb(L, j->r, NULL);
    if (!st) st = moept_sync_grads(L, 1.0f);
    const uint64_t h0 = params_hash(L);
    const float inf = INFINITY;
    const moept_adamw bad[7] = {{1e38f, 0.9f, 0.999f, 1e-8f, 0.0f}, {1e-3f, 0.9f, 0.999f, inf, 0.0f},
                                {1e-3f, 0.9f, 0.999f, NAN, 0.0f},   {1e-3f, 0.9f, 0.999f, 1e-8f, inf},
                                {0.5f, 0.9f, 0.999f, 1e-8f, 3.0f},  {1e-3f, 1.0f, 0.999f, 1e-8f, 0.0f},
                                {1e-3f, 0.9f, -0.5f, 1e-8f, 0.0f}};
    for (int k = 0; k < 7 && !st; k++) {
        j->st[k] = moept_adamw_step(L, &bad[k]);
        snprintf(j->err[k], 512, "%s", moept_last_error(L));
        j->same[k] = params_hash(L) == h0 && T_IS(L, 0);
    }
}

static void test_hyperparameters(void) {
    refuse_job js[1];
    refuse_ranks(1, hyper_body, 0, js);
    const char *want[7] = {"bias-corrected step size", "eps inf", "eps nan", "weight_decay inf",
                           "lr * weight_decay", "beta1 1", "beta2 -0.5"};
    for (int k = 0; k < 7; k++)
        EXPECT(js[0].st[k] == MOEPT_ERR_INVALID_ARGUMENT && strstr(js[0].err[k], want[k]) && js[0].same[k],
               "case %d: %d (%s), unchanged %d", k, (int)js[0].st[k], js[0].err[k], js[0].same[k]);
}

/* a non-finite weight: the save refuses before touching the directory */
static void save_body(refuse_job *j, moept_layer *L) {
    const char *dir = tdir("save");
    char idx[300], before[300] = "", after[300] = "";
    snprintf(idx, sizeof idx, "%s/index.json", dir);
    j->st[1] = moept_save_checkpoint(L, dir);
    FILE *f = fopen(idx, "r");
    if (f) { (void)!fgets(before, sizeof before, f); fclose(f); }
    const uint64_t h0 = params_hash(L);
    poke(L, 0, 5, INFINITY);
    j->st[0] = moept_save_checkpoint(L, dir);
    snprintf(j->err[0], 512, "%s", moept_last_error(L));
    f = fopen(idx, "r");
    if (f) { (void)!fgets(after, sizeof after, f); fclose(f); }
    j->same[0] = before[0] && !strcmp(before, after);
    if (!j->st[1]) j->st[1] = moept_load_checkpoint(L, dir);
    j->same[1] = params_hash(L) == h0;
}

static void test_save_refuses_nonfinite(void) {
    refuse_job js[1];
    refuse_ranks(1, save_body, 0, js);
    EXPECT(js[0].st[0] == MOEPT_ERR_NUMERIC && strstr(js[0].err[0], "'gate.weight' (flat element 5) is not "
           "finite") && js[0].same[0], "the save of an Inf weight: %d (%s), index unchanged %d",
           (int)js[0].st[0], js[0].err[0], js[0].same[0]);
    EXPECT(js[0].st[1] == MOEPT_OK && js[0].same[1], "the previous set loads: %d, the same weights %d",
           (int)js[0].st[1], js[0].same[1]);
}

/* links named like a set and like rank files point out of the directory:
   the saves' cleanup removes neither them nor what they point to */
static void test_links_not_followed(void) {
    char dir[256], victim[300], vfile[400], link[400], flat[400], vflat[400], cmd[1400];
    snprintf(dir, sizeof dir, "%s", tdir("links"));
    snprintf(victim, sizeof victim, "%s_victim", dir);
    snprintf(cmd, sizeof cmd, "rm -rf %s %s && mkdir -p %s %s", dir, victim, dir, victim);
    EXPECT(system(cmd) == 0, "set-up: %.400s", cmd);
    snprintf(vfile, sizeof vfile, "%s/rank-0-of-1.safetensors", victim);
    snprintf(vflat, sizeof vflat, "%s/other", victim);
    FILE *f = fopen(vfile, "w"), *g = fopen(vflat, "w");
    if (f) fclose(f);
    if (g) fclose(g);
    snprintf(link, sizeof link, "%s/save-1-000000000000", dir);
    snprintf(flat, sizeof flat, "%s/rank-0-of-1.safetensors", dir);
    EXPECT(symlink(victim, link) == 0 && symlink(vflat, flat) == 0, "set-up: symlinks");
    moept_config c = refuse_cfg(0);
    moept_layer *L = NULL;
    EXPECT_OK(moept_create(&c, &L));
    EXPECT_OK(moept_init_params(L, 3));
    EXPECT_OK(moept_save_checkpoint(L, dir));
    EXPECT_OK(moept_save_checkpoint(L, dir));
    EXPECT_OK(moept_load_checkpoint(L, dir));
    struct stat sb;
    EXPECT(stat(vfile, &sb) == 0 && stat(vflat, &sb) == 0, "a file outside the directory was removed");
    EXPECT(lstat(link, &sb) == 0 && lstat(flat, &sb) == 0, "a link the library did not make was removed");
    moept_destroy(L);
    snprintf(cmd, sizeof cmd, "rm -rf %s %s", dir, victim);
    EXPECT(system(cmd) == 0, "%s", cmd);
}

/* each call that changes the weights between a forward and its backward
   makes the backward fail naming it (k = 0..3); routing stays readable, and
   update_bias after the step; the correction bias changes no weight (4); a
   forward again differentiates (5) */
static void stale_body(refuse_job *j, moept_layer *L) {
    const char *dir = tdir("stale");
    float w[4 * DIM], x[TOK * DIM], dy[TOK * DIM];
    unsigned long long s = 3;
    tu_fill(w, 4 * DIM, 0.1, &s);
    tu_fill(x, TOK * DIM, 1.0, &s);
    tu_fill(dy, TOK * DIM, 1.0, &s);
    void *xd = tu_dev(x, NB), *dyd = tu_dev(dy, NB), *y = tu_dev(NULL, NB), *dx = tu_dev(NULL, NB);
    const moept_adamw o = moept_adamw_default(1e-3f);
    moept_status st = moept_save_checkpoint(L, dir);
    for (int k = 0; k < 5 && !st; k++) {
        if (k == 3) { /* gradients for the step */
            st = moept_forward(L, xd, TOK, y);
            if (!st) st = moept_backward(L, xd, dyd, dx);
            if (!st) st = moept_sync_grads(L, 1.0f);
        }
        if (!st) st = moept_forward(L, xd, TOK, y);
        if (st) break;
        moept_status c = k == 0 ? moept_set_param(L, "gate.weight", w, 4 * DIM)
                         : k == 1 ? moept_load_checkpoint(L, dir)
                         : k == 2 ? moept_init_params(L, 9)
                         : k == 3 ? moept_adamw_step(L, &o)
                                  : moept_set_param(L, "gate.e_score_correction_bias", w, 4);
        j->st[k] = c ? c : moept_backward(L, xd, dyd, dx);
        snprintf(j->err[k], 512, "%s", c ? "(the call failed)" : moept_last_error(L));
        const int32_t *ids = NULL;
        j->same[k] = moept_routing(L, &ids, NULL, NULL) == MOEPT_OK && ids;
        if (k == 3) j->same[k] = j->same[k] && moept_update_bias(L, 1e-3f) == MOEPT_OK;
        if (k == 4 && !j->st[k]) st = moept_zero_grad(L);
    }
    j->st[5] = st ? st : moept_forward(L, xd, TOK, y);
    if (!j->st[5]) j->st[5] = moept_backward(L, xd, dyd, dx);
    tu_dev_free(xd); tu_dev_free(dyd); tu_dev_free(y); tu_dev_free(dx);
}

static void test_stale_forwards(void) {
    for (int P = 1; P <= 2; P++) {
        refuse_job js[2];
        refuse_ranks(P, stale_body, 1, js);
        const char *call[4] = {"moept_set_param changed", "moept_load_checkpoint changed",
                               "moept_init_params changed", "moept_adamw_step changed"};
        for (int r = 0; r < P; r++) {
            for (int k = 0; k < 4; k++)
                EXPECT(js[r].st[k] == MOEPT_ERR_STATE && strstr(js[r].err[k], call[k]) && js[r].same[k],
                       "P %d rank %d, %s: backward %d (%s), routing/update_bias after %d", P, r, call[k],
                       (int)js[r].st[k], js[r].err[k], js[r].same[k]);
            EXPECT(js[r].st[4] == MOEPT_OK, "P %d rank %d: the bias set: %d (%s)", P, r, (int)js[r].st[4],
                   js[r].err[4]);
            EXPECT(js[r].st[5] == MOEPT_OK, "P %d rank %d: a forward again: %d", P, r, (int)js[r].st[5]);
        }
    }
}

/* EP 2: a step without moept_sync_grads refused on both ranks, naming it;
   moept_grads_synced lets it through; zero_grad clears it */
static void unsynced_body(refuse_job *j, moept_layer *L) {
    const moept_adamw o = moept_adamw_default(1e-3f);
    moept_status st = fb(L, j->r, NULL);
    const uint64_t h0 = params_hash(L);
    j->st[0] = st ? st : moept_adamw_step(L, &o);
    snprintf(j->err[0], 512, "%s", moept_last_error(L));
    j->same[0] = params_hash(L) == h0 && T_IS(L, 0);
    moept_grads_synced(L);
    j->st[1] = moept_adamw_step(L, &o);
    j->st[2] = moept_zero_grad(L);
    if (!j->st[2]) j->st[2] = moept_adamw_step(L, &o);
}

static void test_unsynced_refused(void) {
    refuse_job js[2];
    refuse_ranks(2, unsynced_body, 0, js);
    for (int r = 0; r < 2; r++) {
        EXPECT(js[r].st[0] == MOEPT_ERR_STATE && strstr(js[r].err[0], "call moept_sync_grads") &&
               js[r].same[0],
               "rank %d: the unsynced step: %d (%s)", r, (int)js[r].st[0], js[r].err[0]);
        EXPECT(js[r].st[1] == MOEPT_OK && js[r].st[2] == MOEPT_OK,
               "rank %d: after grads_synced %d, zero_grad %d", r, (int)js[r].st[1], (int)js[r].st[2]);
    }
}

/* max_inflight differing between ranks: refused at create on both, named */
static void *differ_main(void *arg) {
    refuse_job *j = arg;
    j->P = g_P;
    tu_ep e;
    moept_config c = refuse_cfg(0);
    if (j->r == 1) c.max_inflight = 2;
    moept_comm *ep = tu_ep_open(&e, j->g, j->P, j->r);
    moept_layer *L = NULL;
    j->st[0] = tu_layer(&c, ep, 0, &L);
    snprintf(j->err[0], 512, "%s", moept_last_error(NULL));
    moept_destroy(L);
    tu_ep_close(&e);
    return NULL;
}

static void test_config_differs(void) {
    refuse_job js[2];
    g_P = 2;
    tu_new_world();
    tu_ranks(2, 20000, differ_main, js, sizeof js[0]);
    for (int r = 0; r < 2; r++)
        EXPECT(js[r].st[0] == MOEPT_ERR_INVALID_ARGUMENT &&
               strstr(js[r].err[0], "config.max_inflight differs"), "rank %d: %d (%s)", r, (int)js[r].st[0],
               js[r].err[0]);
}

/* a checkpoint of another config names the field and both values; a wrong
   parameter name suggests the nearest; a NaN in dlogits is named */
static void test_names(void) {
    moept_config c = refuse_cfg(0), c1 = c;
    c1.top_k = 1;
    moept_layer *A = NULL, *B = NULL;
    const char *dir = tdir("names");
    EXPECT_OK(moept_create(&c, &A));
    EXPECT_OK(moept_create(&c1, &B));
    if (!A || !B) { moept_destroy(A); moept_destroy(B); return; }
    EXPECT_OK(moept_save_checkpoint(A, dir));
    moept_status st = moept_load_checkpoint(B, dir);
    EXPECT(st == MOEPT_ERR_INVALID_ARGUMENT && strstr(moept_last_error(B), "top_k 2 there, 1 in this layer"),
           "another config: %d (%s)", (int)st, moept_last_error(B));
    moept_destroy(B);
    c1 = c;
    c1.family = MOEPT_FAMILY_QWEN2_MOE;
    EXPECT_OK(moept_create(&c1, &B));
    float w[12 * DIM] = {0};
    st = B ? moept_set_param(B, "experts.3.w3.weight", w, 12 * DIM) : MOEPT_ERR_STATE;
    EXPECT(st == MOEPT_ERR_NOT_FOUND && strstr(moept_last_error(B), "nearest: 'experts.3.up_proj.weight'") &&
           strstr(moept_last_error(B), "model.layers.N.mlp. stripped"),
           "a Mixtral name in a qwen2_moe layer: %d (%s)", (int)st, moept_last_error(B));
    moept_destroy(B);
#if !TU_GPU
    float x[TOK * DIM], y[TOK * DIM], dx[TOK * DIM], dl[TOK * 4] = {0};
    unsigned long long s = 5;
    tu_fill(x, TOK * DIM, 1.0, &s);
    dl[2 * 4 + 1] = NAN;
    moept_backward_opts o = moept_backward_default();
    o.dlogits = dl;
    EXPECT_OK(moept_forward(A, x, TOK, y));
    st = moept_backward_ex(A, x, x, dx, &o);
    EXPECT(st == MOEPT_ERR_NUMERIC && strstr(moept_last_error(A), "opts.dlogits[2][1] is not finite"),
           "a NaN in dlogits: %d (%s)", (int)st, moept_last_error(A));
#endif
    moept_destroy(A);
}

/* EP and DP comms that are no EP x DP grid, refused at create on every rank, named: one comm passed as
   both; CPU layers (4 ranks, EP 2 x DP 2): a DP group of the EP group's own ranks, and one joining
   different EP ranks; the grid itself is accepted */
static moept_thread_group *g_grid[4]; /* EP groups 0, 1, then DP groups 0, 1 */
static int g_grid_mode;               /* 0 the grid, 1 one comm as both, 2 DP = EP's ranks, 3 mixed */
static void *grid_main(void *arg) {
    refuse_job *j = arg;
    j->P = g_P;
    moept_config c = refuse_cfg(0);
    moept_layer *L = NULL;
    moept_comm *ep = NULL, *dp = NULL;
#if TU_GPU
    tu_ep e;
    ep = tu_ep_open(&e, j->g, j->P, j->r);
    dp = ep;
#else
    const int r = j->r, er = r % 2, m = g_grid_mode;
    const int dg = m == 2 ? r / 2 : m == 3 ? (r % 2 != r / 2) : r % 2; /* this rank's DP group */
    moept_comm_threads(g_grid[r / 2], er, &ep);
    if (m == 1) dp = ep;
    else moept_comm_threads(g_grid[2 + dg], m == 2 ? er : r / 2, &dp);
#endif
#if TU_GPU
    moept_cuda_options o = {MOEPT_DTYPE_F32, NULL, 0, 0, MOEPT_GEMM_AUTO};
    j->st[0] = moept_create_cuda(&c, ep, dp, &o, &L);
#else
    j->st[0] = moept_create_parallel(&c, ep, dp, &L);
#endif
    snprintf(j->err[0], 512, "%s", moept_last_error(NULL));
    moept_destroy(L);
#if TU_GPU
    tu_ep_close(&e);
#endif
    return NULL;
}

static void test_grid_slips(void) {
    static const char *const want[4] = {NULL, "one comm passed as both the EP and the DP comm",
                                        "is also EP rank", "a DP group joins the ranks that hold the same"};
    for (int m = TU_GPU ? 1 : 0; m < (TU_GPU ? 2 : 4); m++) {
        refuse_job js[4];
        const int P = TU_GPU ? 2 : 4;
        g_grid_mode = m, g_P = TU_GPU ? 2 : 1;
        for (int k = 0; k < 4 && !TU_GPU; k++) moept_thread_group_create(2, 20000, &g_grid[k]);
        tu_new_world();
        tu_ranks(P, 20000, grid_main, js, sizeof js[0]);
        for (int k = 0; k < 4 && !TU_GPU; k++) moept_thread_group_destroy(g_grid[k]);
        int named = 0; /* the ranks that name the problem (at least one must) */
        for (int r = 0; m && r < P; r++) named += strstr(js[r].err[0], want[m]) != NULL;
        EXPECT(!m || named > 0, "mode %d: no rank named the problem (rank 0: %s)", m, js[0].err[0]);
        for (int r = 0; r < P; r++) {
            if (!m) {
                EXPECT(js[r].st[0] == MOEPT_OK, "the grid, rank %d: %d (%s)", r, (int)js[r].st[0],
                       js[r].err[0]);
                continue;
            }
            EXPECT(js[r].st[0] == MOEPT_ERR_INVALID_ARGUMENT &&
                       (strstr(js[r].err[0], want[m]) || strstr(js[r].err[0], "another rank names")),
                   "mode %d rank %d: %d (%s)", m, r, (int)js[r].st[0], js[r].err[0]);
        }
    }
}

int main(void) {
#if TU_GPU
    if (moept_cuda_device_count() < 2) {
        tu_skip("test_refuse (CUDA layers)", "fewer than 2 CUDA devices");
        return tu_done();
    }
#endif
    RUN(test_overflow_refused);
    RUN(test_hyperparameters);
    RUN(test_save_refuses_nonfinite);
    RUN(test_links_not_followed);
    RUN(test_stale_forwards);
    RUN(test_unsynced_refused);
    RUN(test_config_differs);
    RUN(test_names);
    RUN(test_grid_slips);
    char rm[64]; /* this process's folders (tdir): another test_refuse may run beside it */
    snprintf(rm, sizeof rm, "rm -rf /tmp/moept_refuse_%d_*", (int)getpid());
    (void)!system(rm);
    return tu_done();
}
