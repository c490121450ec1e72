/* test_router_io: the router's losses under a caller's scale and its logits
   in and out (moept_backward_opts, moept_forward_opts.logits_out). Built
   twice: build/test_router_io runs CPU layers over the threads backend,
   build/emu/test_router_io CUDA layers on the emulated GPU over NCCL ranks
   (device pointers). Checked:
   - scale identity: a backward of (s dy, router_loss_scale s) equals s
     times the backward of (dy, 1): dx and every gradient, s = 0.5, 1/8,
     1024, with the aux and z losses on (HF, Megatron on DeepSeek-V3, the
     sequence-wise one), EP 1 and 2 (GPU: sync-free too); without the scale
     the router's gradient is off by the losses' whole weight;
   - ranks that pass different scales fail every rank;
   - a NaN in dlogits fails the step naming opts.dlogits[t][e] (CUDA: the
     device's check, read by grad_norm, default and sync-free; a padded
     row's is not read), a scale of Inf names router_loss_scale;
   - transformers' cross-layer aux loss (load_balancing_loss_func over two
     layers' logits concatenated) through logits_out and dlogits, its
     gradient computed here from the formula, equals transformers'
     gradients (tests/cases_hf_aux, tools/make_hf_aux_case.py). */
#define MOEPT_INTERNAL
#include "../moept.h"
#include "testutil.h"
#include "tu_exec.h"

#include <math.h>
#define GPU TU_GPU

#define MAXP 2
#define TR 16 /* tokens a rank */

static moept_status make_layer(const moept_config *c, moept_comm *ep, int sync_free, moept_layer **L) {
    moept_status st = tu_layer(c, ep, sync_free, L);
    if (!st) st = moept_init_params(*L, 11);
    return st;
}

/* ---- scale identity --------------------------------------------------- */
typedef struct sjob {
    moept_thread_group *g; int r;
    const moept_config *c;
    int P, sync_free;
    float s, pass_s;           /* dy's factor, and the scale passed with it */
    float bad_rank_s;          /* != 0: rank 1 passes this scale instead */
    double err_g, err_router, err_dx; /* largest over the ranks: |b - s a| / |s a| */
    moept_status st;
    char why[512];
} sjob;

/* one forward and backward_ex of x (rank's rows) with dy * s and scale ls:
   dx and the gradients (host) out */
static moept_status fwd_bwd(moept_layer *L, const float *x, const float *dy, float s, float ls, float *dx,
                            float *g, int64_t ng, int64_t D) {
    float *dys = malloc(TR * D * 4);
    for (int64_t i = 0; i < TR * D; i++) dys[i] = s * dy[i];
    void *xd = tu_dev(x, TR * D * 4), *yd = tu_dev(NULL, TR * D * 4), *dyd = tu_dev(dys, TR * D * 4);
    void *dxd = tu_dev(NULL, TR * D * 4);
    moept_backward_opts bo = moept_backward_default();
    bo.router_loss_scale = ls;
    moept_status st = moept_zero_grad(L);
    if (!st) st = moept_forward(L, xd, TR, yd);
    if (!st) st = moept_backward_ex(L, xd, dyd, dxd, &bo);
    if (!st) st = moept_grad_norm(L, &(double){0}); /* sync-free: the device's checks */
    if (!st && ng == moept_param_numel(L)) st = moept_buf_read(L, MOEPT_BUF_GRADS, 0, ng, g);
    if (!st) tu_to_host(dx, dxd, TR * D * 4);
    tu_dev_free(xd); tu_dev_free(yd); tu_dev_free(dyd); tu_dev_free(dxd);
    free(dys);
    return st;
}

static double rel(const float *b, const float *a, float s, int64_t n) {
    float *sa = malloc((size_t)n * 4 + 4);
    for (int64_t i = 0; i < n; i++) sa[i] = s * a[i];
    double e = tu_relerr(b, sa, n);
    free(sa);
    return e;
}

static void *scale_rank(void *arg) {
    sjob *j = arg;
    const moept_config *c = j->c;
    const int64_t D = c->hidden_size, E = c->num_experts;
    tu_ep e;
    moept_comm *ep = tu_ep_open(&e, j->g, j->P, j->r);
    moept_layer *L = NULL;
    j->st = make_layer(c, ep, j->sync_free, &L);
    unsigned long long seed = 77 + (unsigned long long)j->r;
    float *x = malloc(TR * D * 4), *dy = malloc(TR * D * 4);
    tu_fill(x, TR * D, 1.0, &seed);
    tu_fill(dy, TR * D, 1.0, &seed);
    int64_t ng = moept_param_numel(L);
    float *g1 = calloc((size_t)ng + 1, 4), *gs = calloc((size_t)ng + 1, 4);
    float *dx1 = malloc(TR * D * 4), *dxs = malloc(TR * D * 4);
    float ls = j->bad_rank_s != 0.0f && j->r == 1 ? j->bad_rank_s : j->pass_s;
    if (!j->st) j->st = fwd_bwd(L, x, dy, 1.0f, 1.0f, dx1, g1, ng, D);
    if (!j->st) j->st = fwd_bwd(L, x, dy, j->s, ls, dxs, gs, ng, D);
    if (j->st) snprintf(j->why, sizeof j->why, "%s", moept_last_error(L));
    else {
        j->err_g = rel(gs, g1, j->s, ng);
        j->err_router = rel(gs, g1, j->s, E * D); /* the router's weight leads the buffer */
        j->err_dx = rel(dxs, dx1, j->s, TR * D);
    }
    free(g1); free(gs); free(dx1); free(dxs); free(x); free(dy);
    moept_destroy(L);
    tu_ep_close(&e);
    return NULL;
}

/* the identity's errors over P ranks (max), or a failure */
static moept_status scale_world(const moept_config *c, int P, int sync_free, float s, float pass_s,
                                float bad_rank_s, double err[3], char *why) {
    sjob jobs[MAXP];
    sjob proto = {.c = c, .P = P, .sync_free = sync_free, .s = s, .pass_s = pass_s, .bad_rank_s = bad_rank_s};
    tu_world_ranks(P, scale_rank, jobs, sizeof jobs[0], &proto);
    moept_status st = MOEPT_OK;
    err[0] = err[1] = err[2] = 0;
    for (int r = 0; r < P; r++) {
        if (jobs[r].st && !st) { st = jobs[r].st; snprintf(why, 512, "rank %d: %.480s", r, jobs[r].why); }
        err[0] = fmax(err[0], jobs[r].err_g);
        err[1] = fmax(err[1], jobs[r].err_router);
        err[2] = fmax(err[2], jobs[r].err_dx);
    }
    return st;
}

static moept_config cfg_of(int which) {
    const moept_family fam = which == 1 ? MOEPT_FAMILY_DEEPSEEK_V3 : MOEPT_FAMILY_MIXTRAL;
    moept_config c = moept_config_default(fam);
    c.hidden_size = 16; c.intermediate_size = 12; c.num_experts = 8; c.top_k = 2; c.max_tokens = TR;
    c.aux_loss = MOEPT_AUX_HF; c.aux_loss_coef = 0.05f; c.z_loss_coef = 0.01f; c.global_balance = 1;
    if (which == 1) {
        c.n_group = 4; c.topk_group = 2; c.routed_scaling_factor = 2.5f; c.aux_loss = MOEPT_AUX_MEGATRON;
        c.shared_intermediate_size = 12;
    }
    if (which == 2) { c.aux_loss = MOEPT_AUX_SEQ; c.aux_seq_len = 4; }
    return c;
}

static void test_scale_identity(void) {
    static const float scales[3] = {0.5f, 0.125f, 1024.0f};
    static const char *names[3] = {"mixtral HF aux + z", "deepseek Megatron aux + z", "mixtral seq aux + z"};
    double worst = 0, off = 1e30;
    char why[512];
    for (int which = 0; which < 3; which++)
        for (int P = 1; P <= MAXP; P++)
            for (int sf = 0; sf <= GPU; sf++)
                for (int i = 0; i < 3; i++) {
                    moept_config c = cfg_of(which);
                    double e[3], w[3];
                    moept_status st = scale_world(&c, P, sf, scales[i], scales[i], 0.0f, e, why);
                    EXPECT(!st, "%s EP %d%s s %g: %s", names[which], P, sf ? " sync-free" : "", scales[i],
                           why);
                    if (st) return;
                    for (int k = 0; k < 3; k++) worst = fmax(worst, e[k]);
                    EXPECT(e[0] <= 1e-6 && e[2] <= 1e-6, "%s EP %d%s s %g: gradients %.3g dx %.3g off",
                           names[which], P, sf ? " sync-free" : "", scales[i], e[0], e[2]);
                    /* the check fires: the same dy without the scale */
                    st = scale_world(&c, P, sf, scales[i], 1.0f, 0.0f, w, why);
                    EXPECT(!st, "%s: %s", names[which], why);
                    off = fmin(off, w[1]);
                    EXPECT(w[1] > 1e-2, "%s EP %d s %g: without the scale the router's gradient is "
                           "only %.3g off", names[which], P, scales[i], w[1]);
                }
    printf("# scale identity: largest relative error %.3g; without the scale the router's gradient "
           "is at least %.3g off\n", worst, off);
}

/* ranks passing different scales: every rank fails (an unchecked
   sync-free backward does not agree: not tested there) */
static void test_scale_must_match(void) {
    moept_config c = cfg_of(0);
    double e[3];
    char why[512] = "";
    moept_status st = scale_world(&c, 2, 0, 0.5f, 0.5f, 0.25f, e, why);
    EXPECT(st == MOEPT_ERR_INVALID_ARGUMENT && strstr(why, "router_loss_scale"),
           "different scales: %s (%s)", moept_status_string(st), why);
    st = scale_world(&c, 1, 0, 1.0f, NAN, 0.0f, e, why);
    EXPECT(st == MOEPT_ERR_INVALID_ARGUMENT && strstr(why, "not finite"), "NaN scale: %s (%s)",
           moept_status_string(st), why);
}

/* ---- a non-finite dlogits or router_loss_scale is named --------------- */
typedef struct njob {
    moept_thread_group *g; int r;
    int P, sync_free, pad; /* pad: the NaN in a padded token's row (never read) */
    float ls;              /* every rank's router_loss_scale */
    moept_status st;
    char why[512];
} njob;

/* rank 0's dlogits[2][1] NaN: the step's first failure (the backward's, or
   grad_norm's where the device checked it: a CUDA layer) */
static void *nonfinite_rank(void *arg) {
    njob *j = arg;
    const moept_config c = cfg_of(0);
    const int64_t D = c.hidden_size, E = c.num_experts;
    tu_ep e;
    moept_comm *ep = tu_ep_open(&e, j->g, j->P, j->r);
    moept_layer *L = NULL;
    j->st = make_layer(&c, ep, j->sync_free, &L);
    unsigned long long seed = 5 + (unsigned long long)j->r;
    float x[TR * 16], dl[TR * 8] = {0}; /* cfg_of(0): D 16, E 8 */
    uint8_t mask[TR];
    memset(mask, 1, sizeof mask);
    if (j->pad) mask[2] = 0;
    tu_fill(x, TR * D, 1.0, &seed);
    if (j->r == 0) dl[2 * E + 1] = NAN;
    void *xd = tu_dev(x, sizeof x), *yd = tu_dev(NULL, sizeof x), *dxd = tu_dev(NULL, sizeof x);
    void *dld = tu_dev(dl, sizeof dl), *md = tu_dev(mask, sizeof mask);
    moept_forward_opts fo = {.mask = md};
    moept_backward_opts bo = moept_backward_default();
    bo.dlogits = dld;
    bo.router_loss_scale = j->ls;
    double norm = 0;
    if (!j->st) j->st = moept_forward_ex(L, xd, TR, yd, &fo);
    if (!j->st) j->st = moept_backward_ex(L, xd, xd, dxd, &bo);
    if (!j->st) j->st = moept_grad_norm(L, &norm);
    if (j->st) snprintf(j->why, sizeof j->why, "%s", moept_last_error(L));
    else if (!isfinite(norm)) {
        j->st = MOEPT_ERR_STATE;
        snprintf(j->why, sizeof j->why, "the gradients' norm is %g", norm);
    }
    tu_dev_free(xd); tu_dev_free(yd); tu_dev_free(dxd); tu_dev_free(dld); tu_dev_free(md);
    moept_destroy(L);
    tu_ep_close(&e);
    return NULL;
}

/* the failure names what was not finite on the rank that passed it (CPU:
   at the backward; CUDA: the device's check, read by grad_norm, default and
   sync-free); the same NaN in a padded row is not read; a scale of Inf is
   refused at the call, on every rank */
static void test_nonfinite_named(void) {
    for (int P = 1; P <= MAXP; P++)
        for (int sf = 0; sf <= GPU; sf++)
            for (int which = 0; which < 3; which++) {
                njob jobs[MAXP];
                njob proto = {.P = P, .sync_free = sf, .pad = which == 1, .ls = which == 2 ? INFINITY : 1.0f};
                tu_world_ranks(P, nonfinite_rank, jobs, sizeof jobs[0], &proto);
                const char *name = which == 2 ? "opts.router_loss_scale is not finite" : "opts.dlogits[2][1]";
                for (int r = 0; r < P; r++) {
                    const njob *j = &jobs[r];
                    const moept_status want = which == 2 ? MOEPT_ERR_INVALID_ARGUMENT : MOEPT_ERR_NUMERIC;
                    if (which == 1)
                        EXPECT(!j->st, "EP %d%s rank %d: a NaN in a padded row refused: %s", P,
                               sf ? " sync-free" : "", r, j->why);
                    else if (r == 0 || which == 2)
                        EXPECT(j->st == want && strstr(j->why, name) && strstr(j->why, "not finite"),
                               "EP %d%s rank %d: %s (%s), not naming %s", P, sf ? " sync-free" : "", r,
                               moept_status_string(j->st), j->why, name);
                    else
                        EXPECT(j->st, "EP %d%s rank %d: the peer's NaN dlogits not refused", P,
                               sf ? " sync-free" : "", r);
                    if (which == 0 && r == 0) printf("# EP %d%s: %s\n", P, sf ? " sync-free" : "", j->why);
                }
            }
}

/* ---- HF's cross-layer aux loss through logits_out / dlogits ----------- */
#define NL 2
static moept_st_file *g_case;
static int64_t meta_i(const char *k) {
    const char *v = moept_st_meta(g_case, k);
    return v ? atoll(v) : -1;
}
static float *read_t(const char *name, int64_t n) {
    const moept_st_tensor *t = moept_st_find(g_case, name);
    if (!t || t->numel != n) return NULL;
    float *v = malloc((size_t)n * 4 + 4);
    if (moept_st_read_f32(g_case, t, v, n)) { free(v); return NULL; }
    return v;
}

/* d(coef * load_balancing_loss_func(all layers' logits))/d logits, written
   from transformers' formula: p = softmax(logits) per row; counts_e = top-K
   selections of p over every layer's rows (ties to the lower index), N the
   rows of all layers; loss = E sum_e (counts_e / N) (sum_rows p_e / N).
   counts are piecewise constant, so dL/dp_{t,e} = coef E counts_e / N^2,
   through the softmax. lg, dl [NL][T][E]; the loss into *loss. */
static void hf_aux_grad(const float *lg, int64_t T, int64_t E, int64_t K, double coef, float *dl,
                        double *loss) {
    const int64_t N = NL * T;
    double *p = malloc((size_t)(N * E) * 8), cnt[64] = {0}, psum[64] = {0};
    for (int64_t t = 0; t < N; t++) {
        double m = lg[t * E], z = 0;
        for (int64_t e = 1; e < E; e++) m = fmax(m, lg[t * E + e]);
        for (int64_t e = 0; e < E; e++) z += p[t * E + e] = exp((double)lg[t * E + e] - m);
        for (int64_t e = 0; e < E; e++) { p[t * E + e] /= z; psum[e] += p[t * E + e]; }
        int taken[64] = {0};
        for (int64_t k = 0; k < K; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || p[t * E + e] > p[t * E + best])) best = e;
            taken[best] = 1;
            cnt[best] += 1;
        }
    }
    *loss = 0;
    for (int64_t e = 0; e < E; e++) *loss += (cnt[e] / N) * (psum[e] / N) * (double)E;
    for (int64_t t = 0; t < N; t++) {
        double g[64], dot = 0;
        for (int64_t e = 0; e < E; e++) {
            g[e] = coef * (double)E * cnt[e] / ((double)N * N);
            dot += p[t * E + e] * g[e];
        }
        for (int64_t e = 0; e < E; e++) dl[t * E + e] = (float)(p[t * E + e] * (g[e] - dot));
    }
    free(p);
}

/* the largest relative error of the two layers' dx and gradients against
   the case (with dlogits, or without: the check must then fire), the
   output and logits'; NULL-safe on a malformed case (err 1) */
static double hf_case_err(int use_dl, double *y_err, double *loss_err) {
    const int64_t T = meta_i("tokens"), D = meta_i("hidden_size"), F = meta_i("intermediate_size");
    const int64_t E = meta_i("num_experts"), K = meta_i("top_k");
    const double coef = atof(moept_st_meta(g_case, "aux_loss_coef"));
    moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL);
    c.hidden_size = D; c.intermediate_size = F; c.num_experts = E; c.top_k = K; c.max_tokens = T;
    c.aux_loss = MOEPT_AUX_NONE; c.z_loss_coef = 0.0f;
    moept_layer *L[NL] = {NULL, NULL};
    void *xd[NL], *yd[NL], *dyd[NL], *dxd[NL];
    float *lg = malloc((size_t)(NL * T * E) * 4), *dl = malloc((size_t)(NL * T * E) * 4);
    void *lgd = tu_dev(NULL, (size_t)(NL * T * E) * 4);
    double err = 0, yerr = 0;
    char name[128];
    moept_status st = MOEPT_OK;
    for (int l = 0; l < NL && !st; l++) {
        st = make_layer(&c, NULL, 0, &L[l]);
        for (int64_t i = 0; i < moept_param_count(L[l]) && !st; i++) {
            moept_param_info pi;
            st = moept_param_info_at(L[l], i, &pi);
            snprintf(name, sizeof name, "layer%d.%s", l, pi.name);
            float *v = st ? NULL : read_t(name, pi.rows * pi.cols);
            st = v ? moept_set_param(L[l], pi.name, v, pi.rows * pi.cols) : MOEPT_ERR_FORMAT;
            free(v);
        }
        snprintf(name, sizeof name, "layer%d.input", l);
        float *x = read_t(name, T * D);
        snprintf(name, sizeof name, "layer%d.grad_output", l);
        float *dy = read_t(name, T * D);
        if (!x || !dy) st = MOEPT_ERR_FORMAT;
        xd[l] = tu_dev(x, T * D * 4); dyd[l] = tu_dev(dy, T * D * 4);
        yd[l] = tu_dev(NULL, T * D * 4); dxd[l] = tu_dev(NULL, T * D * 4);
        free(x); free(dy);
        moept_forward_opts fo = {NULL, 0, NULL, (float *)lgd + l * T * E, 0};
        if (!st) st = moept_forward_ex(L[l], xd[l], T, yd[l], &fo);
    }
    tu_to_host(lg, lgd, (size_t)(NL * T * E) * 4);
    double loss = 0;
    hf_aux_grad(lg, T, E, K, coef, dl, &loss);
    void *dld = tu_dev(dl, (size_t)(NL * T * E) * 4);
    float *aux = read_t("expected.aux_loss", 1);
    *loss_err = aux ? fabs(loss - aux[0]) / fabs(aux[0]) : 1;
    free(aux);
    for (int l = 0; l < NL && !st; l++) {
        moept_backward_opts bo = moept_backward_default();
        bo.dlogits = use_dl ? (const float *)dld + l * T * E : NULL;
        st = moept_backward_ex(L[l], xd[l], dyd[l], dxd[l], &bo);
        float *got = malloc((size_t)(T * D > E * T ? T * D : E * T) * 4 + 4);
        snprintf(name, sizeof name, "layer%d.expected.router_logits", l);
        float *want = read_t(name, T * E);
        yerr = want ? fmax(yerr, tu_relerr(lg + l * T * E, want, T * E)) : 1;
        free(want);
        snprintf(name, sizeof name, "layer%d.expected.output", l);
        want = read_t(name, T * D);
        tu_to_host(got, yd[l], T * D * 4);
        yerr = want ? fmax(yerr, tu_relerr(got, want, T * D)) : 1;
        free(want);
        snprintf(name, sizeof name, "layer%d.expected.grad.input", l);
        want = read_t(name, T * D);
        tu_to_host(got, dxd[l], T * D * 4);
        err = want ? fmax(err, tu_relerr(got, want, T * D)) : 1;
        free(want);
        free(got);
        for (int64_t i = 0; i < moept_param_count(L[l]) && !st; i++) {
            moept_param_info pi;
            st = moept_param_info_at(L[l], i, &pi);
            const int64_t n = pi.rows * pi.cols;
            snprintf(name, sizeof name, "layer%d.expected.grad.%s", l, pi.name);
            float *g = malloc((size_t)n * 4 + 4);
            want = read_t(name, n);
            if (!st) st = moept_get_grad(L[l], pi.name, g, n);
            err = want && !st ? fmax(err, tu_relerr(g, want, n)) : 1;
            free(want); free(g);
        }
    }
    EXPECT(!st, "hf case: %s", moept_last_error(NULL));
    for (int l = 0; l < NL; l++) {
        moept_destroy(L[l]);
        tu_dev_free(xd[l]); tu_dev_free(yd[l]); tu_dev_free(dyd[l]); tu_dev_free(dxd[l]);
    }
    tu_dev_free(lgd); tu_dev_free(dld);
    free(lg); free(dl);
    *y_err = yerr;
    return st ? 1 : err;
}

static void test_hf_cross_layer(void) {
    const char *path = "tests/cases_hf_aux/mixtral_2layers.safetensors";
    EXPECT_OK(moept_st_open(path, &g_case));
    if (!g_case) return;
    double yerr, lerr, yerr2, lerr2;
    double err = hf_case_err(1, &yerr, &lerr), without = hf_case_err(0, &yerr2, &lerr2);
    const double tol = 1e-6;
    EXPECT(err <= tol, "gradients %.3g off transformers' (tolerance %.1g)", err, tol);
    EXPECT(yerr <= tol && lerr <= tol, "outputs and logits %.3g, aux loss %.3g off", yerr, lerr);
    EXPECT(without > 1e-4, "without dlogits the gradients are only %.3g off: the check cannot fire", without);
    printf("# HF cross-layer aux: gradients %.3g, outputs/logits %.3g, loss %.3g off transformers'; "
           "without dlogits %.3g\n", err, yerr, lerr, without);
    moept_st_close(g_case);
    g_case = NULL;
}

int main(void) {
#ifdef MOEPT_CUDA
    if (moept_cuda_device_count() < MAXP) {
        tu_skip("router io (GPU)", "fewer than 2 CUDA devices");
        return tu_done();
    }
#endif
    tu_run(GPU ? "router io (GPU): backward(s dy, scale s) = s backward(dy, 1) (EP 1, 2; sync-free)"
               : "router io: backward(s dy, scale s) = s backward(dy, 1) (EP 1, 2)",
           test_scale_identity);
    tu_run(GPU ? "router io (GPU): ranks with different scales, or a NaN scale, fail every rank"
               : "router io: ranks with different scales, or a NaN scale, fail every rank",
           test_scale_must_match);
    tu_run(GPU ? "router io (GPU): a non-finite dlogits or router_loss_scale is named (EP 1, 2; sync-free)"
               : "router io: a non-finite dlogits or router_loss_scale is named (EP 1, 2)",
           test_nonfinite_named);
    tu_run(GPU ? "router io (GPU): HF's cross-layer aux loss via logits_out and dlogits = transformers'"
               : "router io: HF's cross-layer aux loss via logits_out and dlogits = transformers'",
           test_hf_cross_layer);
    return tu_done();
}
