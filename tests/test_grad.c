/* Finite-difference gradient checks: for every parameter group, each router
   family, each activation, the aux loss (every convention) and the z loss,
   the analytic directional derivative <grad, v> must match the central
   difference of the objective L = sum(y * gy) + ca*aux + cz*z, accumulated
   in double. Perturbations are measured as actually stored in fp32. */
#include "../moept.c"
#include "testutil.h"

typedef struct gcase {
    const char *name;
    moept_config cfg;
    int64_t T;
    int zero_dy;   /* 1: only the losses drive the gradient */
    int mask;      /* 1: tokens 0, 5 and 6 are padding */
} gcase;

static const uint8_t *g_mask; /* the case's padding mask [T], or NULL */

static double objective(moept_layer *L, const float *x, int64_t T, const float *gy,
                        float *y, int32_t *ids) {
    moept_forward_opts fo = {g_mask, 0, NULL, NULL, 0};
    if (moept_forward_ex(L, x, T, y, &fo) != MOEPT_OK) return NAN;
    double o = 0.0;
    for (int64_t i = 0; i < T * L->D; i++) o += (double)y[i] * gy[i];
    o += (double)L->cfg.aux_loss_coef * moept__last(L)->fwd.aux_value + (double)L->cfg.z_loss_coef * moept__last(L)->fwd.z_value;
    memcpy(ids, moept__last(L)->fwd.ids[moept__last(L)->fwd.cur], (size_t)(T * L->K) * sizeof(int32_t));
    return o;
}

/* One directional check over the floats p[0..n) (a parameter group or x)
   whose analytic gradient is g. Returns the relative error. */
static double dircheck(moept_layer *L, float *x, int64_t T, const float *gy, float **ptrs,
                       int64_t *lens, int nptr, float **grads, unsigned long long *seed,
                       const int32_t *ids0) {
    int64_t total = 0;
    for (int i = 0; i < nptr; i++) total += lens[i];
    float *y = malloc((size_t)(T * L->D) * sizeof(float));
    int32_t *ids = malloc((size_t)(T * L->K) * sizeof(int32_t));
    float *orig = malloc((size_t)total * sizeof(float));
    float *v = malloc((size_t)total * sizeof(float));
    for (int64_t i = 0; i < total; i++) v[i] = (float)tu_rand(seed);
    int64_t o = 0;
    for (int i = 0; i < nptr; i++) { memcpy(orig + o, ptrs[i], (size_t)lens[i] * sizeof(float)); o += lens[i]; }
    double rel = INFINITY;
    /* the best of a few step sizes: a step that crosses a routing decision
       or a ReLU kink is not a gradient error; a wrong gradient fails at all */
    for (double h = 1.2e-2; h > 1e-5 && !(rel < 1e-4); h *= 0.25) {
        double lp, lm, dot = 0.0;
        int same = 1;
        /* + */
        o = 0;
        for (int i = 0; i < nptr; i++)
            for (int64_t j = 0; j < lens[i]; j++, o++) ptrs[i][j] = orig[o] + (float)h * v[o];
        lp = objective(L, x, T, gy, y, ids);
        same &= memcmp(ids, ids0, (size_t)(T * L->K) * sizeof(int32_t)) == 0;
        o = 0;
        for (int i = 0; i < nptr; i++)
            for (int64_t j = 0; j < lens[i]; j++, o++) dot += (double)grads[i][j] * ((double)ptrs[i][j] - orig[o]);
        /* - */
        o = 0;
        for (int i = 0; i < nptr; i++)
            for (int64_t j = 0; j < lens[i]; j++, o++) ptrs[i][j] = orig[o] - (float)h * v[o];
        lm = objective(L, x, T, gy, y, ids);
        same &= memcmp(ids, ids0, (size_t)(T * L->K) * sizeof(int32_t)) == 0;
        o = 0;
        for (int i = 0; i < nptr; i++)
            for (int64_t j = 0; j < lens[i]; j++, o++) dot -= (double)grads[i][j] * ((double)ptrs[i][j] - orig[o]);
        if (!same) continue; /* a routing decision flipped: smaller step */
        double fd = lp - lm;
        rel = fmin(rel, fabs(fd - dot) / fmax(fabs(dot), 1e-12));
    }
    o = 0;
    for (int i = 0; i < nptr; i++) { memcpy(ptrs[i], orig + o, (size_t)lens[i] * sizeof(float)); o += lens[i]; }
    free(y); free(ids); free(orig); free(v);
    return rel;
}

static int groups_of_type(moept_layer *L, moept__ptype t, float **p, float **g, int64_t *n) {
    int k = 0;
    for (int64_t i = 0; i < L->par.n_table; i++)
        if (L->par.table[i].type == t && k < 64) {
            p[k] = L->par.table[i].data;
            g[k] = L->par.table[i].grad;
            n[k] = L->par.table[i].rows * L->par.table[i].cols;
            k++;
        }
    return k;
}

static void run_gcase(const gcase *gc) {
    moept_layer *L;
    if (moept_create(&gc->cfg, &L) != MOEPT_OK) {
        EXPECT(0, "%s: create: %s", gc->name, moept_last_error(NULL));
        return;
    }
    unsigned long long seed = 1234;
    moept_init_params(L, 7);
    /* a sharper router so routing is decisive, experts strong enough to matter */
    for (int64_t i = 0; i < L->E * L->D; i++) L->par.w_router[i] *= 3.0f;
    if (L->cfg.family == MOEPT_FAMILY_DEEPSEEK_V3)
        for (int64_t e = 0; e < L->E; e++) L->par.bias[e] = 0.05f * (float)tu_rand(&seed);
    const int64_t T = gc->T, D = L->D;
    float *x = malloc((size_t)(T * D) * sizeof(float)), *gy = calloc((size_t)(T * D), sizeof(float));
    float *y = malloc((size_t)(T * D) * sizeof(float)), *dx = malloc((size_t)(T * D) * sizeof(float));
    int32_t *ids0 = malloc((size_t)(T * L->K) * sizeof(int32_t));
    tu_fill(x, T * D, 1.0, &seed);
    if (!gc->zero_dy) tu_fill(gy, T * D, 1.0, &seed);
    uint8_t mask[64];
    for (int64_t t = 0; t < T && t < 64; t++) mask[t] = !(t == 0 || t == 5 || t == 6);
    g_mask = gc->mask ? mask : NULL;
    moept_zero_grad(L);
    double base = objective(L, x, T, gy, y, ids0);
    EXPECT(isfinite(base), "%s: forward failed: %s", gc->name, moept_last_error(L));
    EXPECT_OK(moept_backward(L, x, gy, dx));
    /* freeze the analytic gradients before the perturbed forwards */
    L->jitter_frozen = 1; /* router jitter: every perturbed forward draws this step's noise */
    float *gcopy = malloc((size_t)L->par.n_params * sizeof(float));
    memcpy(gcopy, L->par.grads, (size_t)L->par.n_params * sizeof(float));
    static const moept__ptype types[] = {MOEPT__P_ROUTER, MOEPT__P_GATE, MOEPT__P_UP, MOEPT__P_DOWN,
                                         MOEPT__P_SGATE_PROJ, MOEPT__P_SUP, MOEPT__P_SDOWN, MOEPT__P_SGATE};
    static const char *tnames[] = {"router", "experts.gate", "experts.up", "experts.down",
                                   "shared.gate", "shared.up", "shared.down", "shared_expert_gate"};
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        float *p[64], *g[64];
        int64_t n[64];
        int k = groups_of_type(L, types[ti], p, g, n);
        if (k == 0) continue;
        for (int i = 0; i < k; i++) g[i] = gcopy + (g[i] - L->par.grads);
        double rel = dircheck(L, x, T, gy, p, n, k, g, &seed, ids0);
        int expect_zero = gc->zero_dy && types[ti] != MOEPT__P_ROUTER;
        if (expect_zero) {
            /* losses only: no gradient may reach the experts */
            double s = 0;
            for (int i = 0; i < k; i++) for (int64_t j = 0; j < n[i]; j++) s += fabs(g[i][j]);
            EXPECT(s == 0.0, "%s: %s gradient should be 0 with dy = 0, |g| = %g", gc->name, tnames[ti], s);
        } else {
            EXPECT(rel < 2e-3, "%s: %s directional derivative rel err %.3g", gc->name, tnames[ti], rel);
        }
    }
    /* the input */
    float *px[1] = {x}, *gx[1] = {dx};
    int64_t nx[1] = {T * D};
    double rel = dircheck(L, x, T, gy, px, nx, 1, gx, &seed, ids0);
    EXPECT(rel < 2e-3, "%s: input directional derivative rel err %.3g", gc->name, rel);
    if (gc->mask) /* padding rows: no gradient */
        for (int64_t i = 0; i < D; i++)
            EXPECT(dx[i] == 0.0f && dx[5 * D + i] == 0.0f && dx[6 * D + i] == 0.0f, "%s: a padding dx row is not 0",
                   gc->name);
    g_mask = NULL;
    free(x); free(gy); free(y); free(dx); free(ids0); free(gcopy);
    moept_destroy(L);
}

static moept_config base_cfg(moept_family f) {
    moept_config c = {0};
    c.family = f;
    c.hidden_size = 9; c.intermediate_size = 7; c.num_experts = 6; c.top_k = 2;
    c.norm_topk_prob = 1; c.max_tokens = 16;
    return c;
}

static void test_families(void) {
    gcase cs[8];
    int n = 0;
    cs[n] = (gcase){"mixtral", base_cfg(MOEPT_FAMILY_MIXTRAL), 11, 0, 0};
    cs[n].cfg.aux_loss = MOEPT_AUX_HF; cs[n].cfg.aux_loss_coef = 0.1f; cs[n].cfg.z_loss_coef = 0.01f; n++;
    cs[n] = (gcase){"qwen2 shared, no norm", base_cfg(MOEPT_FAMILY_QWEN2_MOE), 10, 0, 0};
    cs[n].cfg.norm_topk_prob = MOEPT_NORM_OFF; cs[n].cfg.shared_intermediate_size = 5;
    cs[n].cfg.aux_loss = MOEPT_AUX_MEGATRON; cs[n].cfg.aux_loss_coef = 0.1f; n++;
    cs[n] = (gcase){"olmoe k=3", base_cfg(MOEPT_FAMILY_OLMOE), 12, 0, 0};
    cs[n].cfg.top_k = 3; cs[n].cfg.norm_topk_prob = MOEPT_NORM_OFF; cs[n].cfg.z_loss_coef = 0.05f; n++;
    cs[n] = (gcase){"deepseek grouped", base_cfg(MOEPT_FAMILY_DEEPSEEK_V3), 12, 0, 0};
    cs[n].cfg.num_experts = 8; cs[n].cfg.n_group = 4; cs[n].cfg.topk_group = 2;
    cs[n].cfg.routed_scaling_factor = 2.5f; cs[n].cfg.shared_intermediate_size = 6;
    cs[n].cfg.aux_loss = MOEPT_AUX_HF; cs[n].cfg.aux_loss_coef = 0.1f; cs[n].cfg.z_loss_coef = 0.01f; n++;
    cs[n] = (gcase){"deepseek no norm, gated shared", base_cfg(MOEPT_FAMILY_DEEPSEEK_V3), 9, 0, 0};
    cs[n].cfg.norm_topk_prob = MOEPT_NORM_OFF; cs[n].cfg.shared_intermediate_size = 4;
    cs[n].cfg.shared_gate = MOEPT_SHARED_GATE_SIGMOID; n++;
    cs[n] = (gcase){"capacity 0.75", base_cfg(MOEPT_FAMILY_MIXTRAL), 12, 0, 0};
    cs[n].cfg.capacity_factor = 0.75f; n++;
    for (int i = 0; i < n; i++) run_gcase(&cs[i]);
}

static void test_activations(void) {
    static const moept_activation acts[] = {MOEPT_ACT_SILU_GATED, MOEPT_ACT_GELU_GATED, MOEPT_ACT_GELU, MOEPT_ACT_RELU};
    static const char *names[] = {"silu gated", "gelu gated", "gelu", "relu"};
    for (int i = 0; i < 4; i++) {
        gcase c = {names[i], base_cfg(MOEPT_FAMILY_QWEN2_MOE), 10, 0, 0};
        c.cfg.activation = acts[i];
        c.cfg.shared_intermediate_size = 5;
        run_gcase(&c);
    }
}

static void test_aux_loss_only(void) {
    static const moept_family fams[] = {MOEPT_FAMILY_MIXTRAL, MOEPT_FAMILY_DEEPSEEK_V3};
    static const moept_aux_loss kinds[] = {MOEPT_AUX_HF, MOEPT_AUX_MEGATRON};
    for (int f = 0; f < 2; f++)
        for (int k = 0; k < 2; k++) {
            gcase c = {"aux only", base_cfg(fams[f]), 12, 1, 0};
            c.cfg.aux_loss = kinds[k];
            c.cfg.aux_loss_coef = 1.0f;
            run_gcase(&c);
        }
}

static void test_z_loss_only(void) {
    static const moept_family fams[] = {MOEPT_FAMILY_OLMOE, MOEPT_FAMILY_DEEPSEEK_V3};
    for (int f = 0; f < 2; f++) {
        gcase c = {"z only", base_cfg(fams[f]), 12, 1, 0};
        c.cfg.z_loss_coef = 1.0f;
        run_gcase(&c);
    }
}

/* Router jitter: the router sees x * u (u held fixed); its gradient reaches
   x and gate.weight through u */
static void test_jitter(void) {
    static const moept_family fams[] = {MOEPT_FAMILY_MIXTRAL, MOEPT_FAMILY_DEEPSEEK_V3};
    for (int f = 0; f < 2; f++) {
        gcase c = {"jitter", base_cfg(fams[f]), 12, 0, 0};
        c.cfg.router_jitter = 0.3f;
        c.cfg.jitter_seed = 99;
        c.cfg.aux_loss = MOEPT_AUX_HF; c.cfg.aux_loss_coef = 0.1f; c.cfg.z_loss_coef = 0.01f;
        if (f) c.cfg.shared_intermediate_size = 5;
        run_gcase(&c);
    }
}

/* Padding: the gradients of the masked objective (their tokens in no loss,
   their y rows 0) */
static void test_mask_gradients(void) {
    static const moept_family fams[] = {MOEPT_FAMILY_QWEN2_MOE, MOEPT_FAMILY_DEEPSEEK_V3};
    for (int f = 0; f < 2; f++) {
        gcase c = {"mask", base_cfg(fams[f]), 12, 0, 0};
        c.cfg.shared_intermediate_size = 5;
        c.cfg.aux_loss = MOEPT_AUX_HF; c.cfg.aux_loss_coef = 0.1f; c.cfg.z_loss_coef = 0.01f;
        c.mask = 1;
        run_gcase(&c);
    }
}

/* The sequence-wise aux loss (MOEPT_AUX_SEQ): losses only, and with y and
   padding; S = 1 under the mask leaves whole sequences of padding */
static void test_seq_aux(void) {
    static const struct { moept_family fam; int64_t S; int zero_dy, mask; } v[] = {
        {MOEPT_FAMILY_MIXTRAL, 4, 1, 0}, {MOEPT_FAMILY_DEEPSEEK_V3, 3, 1, 0},
        {MOEPT_FAMILY_QWEN2_MOE, 4, 0, 1}, {MOEPT_FAMILY_DEEPSEEK_V3, 1, 1, 1}};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        gcase c = {"seq aux", base_cfg(v[i].fam), 12, v[i].zero_dy, v[i].mask};
        c.cfg.aux_loss = MOEPT_AUX_SEQ; c.cfg.aux_seq_len = v[i].S;
        c.cfg.aux_loss_coef = v[i].zero_dy ? 1.0f : 0.1f;
        if (v[i].fam == MOEPT_FAMILY_DEEPSEEK_V3) { c.cfg.num_experts = 8; c.cfg.n_group = 4; c.cfg.topk_group = 2; }
        if (!v[i].zero_dy) c.cfg.shared_intermediate_size = 5;
        run_gcase(&c);
    }
}

int main(void) {
    RUN(test_families);
    RUN(test_activations);
    RUN(test_aux_loss_only);
    RUN(test_z_loss_only);
    RUN(test_jitter);
    RUN(test_mask_gradients);
    RUN(test_seq_aux);
    return tu_done();
}
