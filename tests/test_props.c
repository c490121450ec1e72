/* Properties of the layer: plan invariants, capacity, the dense limit,
   ties, determinism, allocation-free steps, the builtin GEMM. Forward
   outputs are also compared with a naive double-precision reference of the
   whole block (every activation, shared experts, capacity). */
#include "../moept.c"
#include "testutil.h"

static moept_layer *make(moept_config c, uint64_t seed) {
    moept_layer *L = NULL;
    if (moept_create(&c, &L) != MOEPT_OK) {
        EXPECT(0, "create: %s", moept_last_error(NULL));
        return NULL;
    }
    moept_init_params(L, seed);
    for (int64_t i = 0; i < L->E * L->D; i++) L->par.w_router[i] *= 3.0f;
    return L;
}

static moept_config cfg0(moept_family f, int64_t D, int64_t F, int64_t E, int64_t K, int64_t T) {
    moept_config c = {0};
    c.family = f; c.hidden_size = D; c.intermediate_size = F; c.num_experts = E; c.top_k = K;
    c.norm_topk_prob = 1; c.max_tokens = T;
    return c;
}

static double act_ref(int kind, double g) {
    switch (kind) {
    case MOEPT_ACT_SILU_GATED: return g / (1.0 + exp(-g));
    case MOEPT_ACT_GELU_GATED: case MOEPT_ACT_GELU: return 0.5 * g * (1.0 + erf(g / sqrt(2.0)));
    default: return g > 0 ? g : 0;
    }
}

/* y = shared(x) + sum_k w * FFN_e(x) over the kept slots, in double. */
static void ref_ffn(const moept_layer *L, const float *x, const float *w13, const float *w2,
                    int64_t H, int64_t F, double *out) {
    const int64_t D = L->D;
    int gated = moept__act_gated(L->act);
    double *a = malloc((size_t)F * sizeof(double));
    for (int64_t j = 0; j < F; j++) {
        double g = 0, u = 0;
        for (int64_t d = 0; d < D; d++) g += (double)w13[j * D + d] * x[d];
        if (gated) for (int64_t d = 0; d < D; d++) u += (double)w13[(F + j) * D + d] * x[d];
        a[j] = act_ref(L->act, g) * (gated ? u : 1.0);
    }
    (void)H;
    for (int64_t d = 0; d < D; d++) {
        double s = 0;
        for (int64_t j = 0; j < F; j++) s += (double)w2[d * F + j] * a[j];
        out[d] = s;
    }
    free(a);
}

static double ref_forward_err(const moept_layer *L, const float *x, int64_t T, const float *y) {
    const int64_t D = L->D, K = L->K;
    const int32_t *ids = moept__last(L)->fwd.ids[moept__last(L)->fwd.cur];
    const float *w = moept__last(L)->fwd.wts[moept__last(L)->fwd.cur];
    double *o = malloc((size_t)D * sizeof(double)), *acc = malloc((size_t)D * sizeof(double));
    int64_t *seen = calloc((size_t)L->E, sizeof(int64_t));
    int64_t cap = L->stats.capacity;
    double num = 0, den = 0;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t d = 0; d < D; d++) acc[d] = 0;
        if (L->S > 0) {
            ref_ffn(L, x + t * D, L->par.ws13, L->par.ws2, L->HS, L->S, o);
            double gs = 1;
            if (L->par.wsg) {
                double z = 0;
                for (int64_t d = 0; d < D; d++) z += (double)L->par.wsg[d] * x[t * D + d];
                gs = 1 / (1 + exp(-z));
            }
            for (int64_t d = 0; d < D; d++) acc[d] += gs * o[d];
        }
        for (int64_t k = 0; k < K; k++) {
            int64_t e = ids[t * K + k];
            if (cap >= 0 && seen[e]++ >= cap) continue; /* dropped by position */
            ref_ffn(L, x + t * D, L->par.w13 + e * L->H * D, L->par.w2 + e * D * L->F, L->H, L->F, o);
            for (int64_t d = 0; d < D; d++) acc[d] += w[t * K + k] * o[d];
        }
        for (int64_t d = 0; d < D; d++) {
            num += (y[t * D + d] - acc[d]) * (y[t * D + d] - acc[d]);
            den += acc[d] * acc[d];
        }
    }
    free(o); free(acc); free(seen);
    return sqrt(num / den);
}

static void test_dropless_plan(void) {
    moept_config c = cfg0(MOEPT_FAMILY_OLMOE, 16, 12, 8, 3, 64);
    moept_layer *L = make(c, 3);
    if (!L) return;
    unsigned long long s = 5;
    float x[64 * 16], y[64 * 16];
    tu_fill(x, 64 * 16, 1.0, &s);
    EXPECT_OK(moept_forward(L, x, 50, y));
    moept_stats st;
    int64_t tpe[8], sum = 0;
    moept_get_stats(L, &st, tpe);
    for (int e = 0; e < 8; e++) sum += tpe[e];
    EXPECT(sum == 50 * 3, "counts sum %lld != T*K", (long long)sum);
    EXPECT(st.routed_rows == 150 && st.dropped_rows == 0, "routed %lld dropped %lld", (long long)st.routed_rows, (long long)st.dropped_rows);
    /* stable: rows of each expert in increasing token order, each row's token routed there */
    for (int e = 0; e < 8; e++)
        for (int64_t r = moept__last(L)->plan.offsets[e]; r < moept__last(L)->plan.offsets[e + 1]; r++) {
            if (r > moept__last(L)->plan.offsets[e]) EXPECT(moept__last(L)->plan.tok_of_row[r] > moept__last(L)->plan.tok_of_row[r - 1], "expert %d rows out of token order", e);
            int64_t t = moept__last(L)->plan.tok_of_row[r], hit = 0;
            for (int k = 0; k < 3; k++) hit |= moept__last(L)->fwd.ids[moept__last(L)->fwd.cur][t * 3 + k] == e && moept__last(L)->plan.row_of[t * 3 + k] == r;
            EXPECT(hit, "row %lld not owned by token %lld", (long long)r, (long long)t);
        }
    double err = ref_forward_err(L, x, 50, y);
    EXPECT(err < 1e-5, "forward vs double reference: %g", err);
    moept_destroy(L);
}

static void test_capacity(void) {
    moept_config c = cfg0(MOEPT_FAMILY_MIXTRAL, 12, 10, 4, 2, 40);
    c.capacity_factor = 0.6f;
    moept_layer *L = make(c, 9);
    if (!L) return;
    /* skew the router so some experts overflow */
    for (int64_t d = 0; d < L->D; d++) L->par.w_router[d] += 0.8f;
    unsigned long long s = 11;
    float x[40 * 12], y[40 * 12];
    tu_fill(x, 40 * 12, 1.0, &s);
    for (int i = 0; i < 40 * 12; i += 12) x[i] = 2.0f;
    EXPECT_OK(moept_forward(L, x, 40, y));
    moept_stats st;
    moept_get_stats(L, &st, NULL);
    int64_t cap = (int64_t)ceil(0.6 * 40 * 2 / 4.0);
    EXPECT(st.capacity == cap, "capacity %lld != %lld", (long long)st.capacity, (long long)cap);
    int64_t kept = 0;
    for (int e = 0; e < 4; e++) {
        EXPECT(moept__last(L)->plan.counts[e] <= cap, "expert %d keeps %lld > capacity %lld", e, (long long)moept__last(L)->plan.counts[e], (long long)cap);
        kept += moept__last(L)->plan.counts[e];
    }
    EXPECT(st.dropped_rows > 0, "the skewed router should overflow an expert");
    EXPECT(st.dropped_rows == 80 - kept, "dropped %lld != T*K - kept", (long long)st.dropped_rows);
    /* drop by position: for each expert, kept tokens precede dropped ones */
    for (int e = 0; e < 4; e++) {
        int64_t last_kept = -1, first_drop = 1 << 30;
        for (int64_t i = 0; i < 80; i++) {
            if (moept__last(L)->fwd.ids[moept__last(L)->fwd.cur][i] != e) continue;
            if (moept__last(L)->plan.row_of[i] >= 0) last_kept = i; else if (i < first_drop) first_drop = i;
        }
        EXPECT(last_kept < first_drop, "expert %d kept a later token than one it dropped", e);
    }
    double err = ref_forward_err(L, x, 40, y);
    EXPECT(err < 1e-5, "capacity forward vs reference: %g", err);
    moept_destroy(L);
}

static void test_activations_and_shared(void) {
    static const moept_activation acts[] = {MOEPT_ACT_SILU_GATED, MOEPT_ACT_GELU_GATED, MOEPT_ACT_GELU, MOEPT_ACT_RELU};
    for (int a = 0; a < 4; a++)
        for (int gate = 0; gate < 2; gate++) {
            moept_config c = cfg0(MOEPT_FAMILY_QWEN2_MOE, 19, 13, 5, 2, 30);
            c.activation = acts[a];
            c.shared_intermediate_size = 11;
            c.shared_gate = gate ? MOEPT_SHARED_GATE_SIGMOID : MOEPT_SHARED_GATE_NONE;
            moept_layer *L = make(c, 21 + a);
            if (!L) return;
            unsigned long long s = 3;
            float x[30 * 19], y[30 * 19];
            tu_fill(x, 30 * 19, 1.0, &s);
            EXPECT_OK(moept_forward(L, x, 30, y));
            double err = ref_forward_err(L, x, 30, y);
            EXPECT(err < 1e-5, "activation %d shared gate %d: forward vs reference %g", a, gate, err);
            moept_destroy(L);
        }
}

static void test_k_equals_e_is_dense(void) {
    moept_config c = cfg0(MOEPT_FAMILY_OLMOE, 10, 8, 5, 5, 12);
    c.norm_topk_prob = MOEPT_NORM_OFF;
    moept_layer *L = make(c, 4);
    if (!L) return;
    unsigned long long s = 8;
    float x[12 * 10], y[12 * 10];
    tu_fill(x, 120, 1.0, &s);
    EXPECT_OK(moept_forward(L, x, 12, y));
    double num = 0, den = 0, o[10];
    for (int t = 0; t < 12; t++) {
        double lg[5], m = -1e300, z = 0, acc[10] = {0};
        for (int e = 0; e < 5; e++) {
            lg[e] = 0;
            for (int d = 0; d < 10; d++) lg[e] += (double)L->par.w_router[e * 10 + d] * x[t * 10 + d];
            m = fmax(m, lg[e]);
        }
        for (int e = 0; e < 5; e++) z += exp(lg[e] - m);
        for (int e = 0; e < 5; e++) {
            ref_ffn(L, x + t * 10, L->par.w13 + e * L->H * 10, L->par.w2 + e * 10 * 8, L->H, 8, o);
            for (int d = 0; d < 10; d++) acc[d] += exp(lg[e] - m) / z * o[d];
        }
        for (int d = 0; d < 10; d++) { num += (y[t * 10 + d] - acc[d]) * (y[t * 10 + d] - acc[d]); den += acc[d] * acc[d]; }
    }
    EXPECT(sqrt(num / den) < 1e-5, "K=E differs from the dense softmax mixture: %g", sqrt(num / den));
    moept_destroy(L);
}

static void test_zero_aux_coef_no_gradient(void) {
    for (int coef = 0; coef < 2; coef++) {
        moept_config c = cfg0(MOEPT_FAMILY_MIXTRAL, 8, 6, 4, 2, 10);
        c.aux_loss = MOEPT_AUX_HF;
        c.aux_loss_coef = coef ? 0.1f : 0.0f;
        moept_layer *L = make(c, 2);
        if (!L) return;
        unsigned long long s = 1;
        float x[80], y[80], dy[80] = {0}, dx[80];
        tu_fill(x, 80, 1.0, &s);
        EXPECT_OK(moept_forward(L, x, 10, y));
        EXPECT_OK(moept_backward(L, x, dy, dx));
        double g = 0;
        for (int64_t i = 0; i < L->par.n_params; i++) g += fabs(L->par.grads[i]);
        for (int i = 0; i < 80; i++) g += fabs(dx[i]);
        if (coef) EXPECT(g > 0, "aux coefficient 0.1 gave no gradient");
        else EXPECT(g == 0, "aux coefficient 0 gave gradient %g", g);
        moept_destroy(L);
    }
}

static void test_megatron_is_hf_over_k(void) {
    float v[2];
    for (int conv = 0; conv < 2; conv++) {
        moept_config c = cfg0(MOEPT_FAMILY_QWEN2_MOE, 8, 6, 6, 3, 20);
        c.aux_loss = conv ? MOEPT_AUX_MEGATRON : MOEPT_AUX_HF;
        moept_layer *L = make(c, 2);
        if (!L) return;
        unsigned long long s = 1;
        float x[160], y[160];
        tu_fill(x, 160, 1.0, &s);
        EXPECT_OK(moept_forward(L, x, 20, y));
        v[conv] = L->stats.aux_loss;
        moept_destroy(L);
    }
    EXPECT(fabs(v[0] / 3.0 - v[1]) < 1e-6 * fabs(v[0]), "megatron %g != hf %g / K", v[1], v[0]);
}

static void test_ties_lower_index(void) {
    static const moept_family fams[] = {MOEPT_FAMILY_MIXTRAL, MOEPT_FAMILY_DEEPSEEK_V3};
    for (int f = 0; f < 2; f++) {
        moept_config c = cfg0(fams[f], 8, 6, 8, 3, 4);
        if (f) { c.n_group = 4; c.topk_group = 2; }
        moept_layer *L = make(c, 2);
        if (!L) return;
        memset(L->par.w_router, 0, (size_t)(8 * 8) * sizeof(float)); /* all logits equal */
        float x[32], y[32];
        unsigned long long s = 1;
        tu_fill(x, 32, 1.0, &s);
        EXPECT_OK(moept_forward(L, x, 4, y));
        for (int t = 0; t < 4; t++)
            for (int k = 0; k < 3; k++)
                EXPECT(moept__last(L)->fwd.ids[moept__last(L)->fwd.cur][t * 3 + k] == k, "family %d token %d slot %d: expert %d, ties must go to the lower index",
                       f, t, k, moept__last(L)->fwd.ids[moept__last(L)->fwd.cur][t * 3 + k]);
        moept_destroy(L);
    }
}

/* moept__topk against a full sort by (score descending, index ascending),
   on scores with many ties (a few distinct values) and masked (-inf)
   experts, for E up to 300 and every K up to E (the selection no longer
   marks picks; it must still pick each expert at most once). */
static int by_score_then_index(const void *a, const void *b, const float *sc) {
    int x = *(const int *)a, y = *(const int *)b;
    if (sc[x] != sc[y]) return sc[x] > sc[y] ? -1 : 1;
    return x - y;
}
static const float *g_sc;
static int cmp_sc(const void *a, const void *b) { return by_score_then_index(a, b, g_sc); }
static void test_topk_is_a_sorted_prefix(void) {
    static float sc[300];
    static int32_t ids[300];
    static int ref[300];
    unsigned long long s = 9;
    int64_t bad = 0, trials = 0;
    for (int E = 1; E <= 300; E += (E < 20 ? 1 : 37)) {
        for (int e = 0; e < E; e++) {
            double u = tu_rand(&s);
            sc[e] = u < -0.8 ? -HUGE_VALF : (float)(int)(u * 4.0); /* -inf, or one of a few values */
            ref[e] = e;
        }
        g_sc = sc;
        qsort(ref, (size_t)E, sizeof ref[0], cmp_sc);
        for (int K = 1; K <= E; K++, trials++) {
            moept__topk(sc, E, K, ids);
            for (int k = 0; k < K; k++) bad += ids[k] != ref[k];
        }
    }
    EXPECT(bad == 0, "%lld picks differ from the sorted order over %lld selections", (long long)bad,
           (long long)trials);
}

static void test_group_limited(void) {
    moept_config c = cfg0(MOEPT_FAMILY_DEEPSEEK_V3, 12, 6, 16, 4, 64);
    c.n_group = 4; c.topk_group = 2; c.routed_scaling_factor = 2.0f;
    moept_layer *L = make(c, 6);
    if (!L) return;
    unsigned long long s = 77;
    for (int e = 0; e < 16; e++) L->par.bias[e] = (float)(0.3 * tu_rand(&s));
    float x[64 * 12], y[64 * 12];
    tu_fill(x, 64 * 12, 1.0, &s);
    EXPECT_OK(moept_forward(L, x, 64, y));
    for (int t = 0; t < 64; t++) {
        double gsc[4];
        for (int g = 0; g < 4; g++) { /* top-2 sum of s + bias in the group */
            double b1 = -1e9, b2 = -1e9;
            for (int e = g * 4; e < g * 4 + 4; e++) {
                double v = 1 / (1 + exp(-(double)moept__last(L)->fwd.logits[moept__last(L)->fwd.cur][t * 16 + e])) + L->par.bias[e];
                if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) b2 = v;
            }
            gsc[g] = b1 + b2;
        }
        double wsum = 0;
        for (int k = 0; k < 4; k++) {
            int e = moept__last(L)->fwd.ids[moept__last(L)->fwd.cur][t * 4 + k], g = e / 4, better = 0;
            for (int h = 0; h < 4; h++) better += gsc[h] > gsc[g];
            EXPECT(better < 2, "token %d: expert %d from a group outside the top 2", t, e);
            wsum += moept__last(L)->fwd.wts[moept__last(L)->fwd.cur][t * 4 + k];
        }
        EXPECT(fabs(wsum - 2.0) < 1e-5, "token %d: weights sum %g, expected the scaling factor 2", t, wsum);
    }
    moept_destroy(L);
}

static void run_step(moept_layer *L, const float *x, int64_t T, const float *dy, float *y, float *dx) {
    moept_zero_grad(L);
    EXPECT_OK(moept_forward(L, x, T, y));
    EXPECT_OK(moept_backward(L, x, dy, dx));
}

static void test_deterministic_across_threads(void) {
    moept_config c = cfg0(MOEPT_FAMILY_DEEPSEEK_V3, 64, 96, 8, 2, 300);
    c.shared_intermediate_size = 40; c.aux_loss = MOEPT_AUX_HF; c.aux_loss_coef = 0.01f; c.z_loss_coef = 0.001f;
    moept_layer *L = make(c, 12);
    if (!L) return;
    int64_t T = 300, n = T * 64;
    float *x = malloc((size_t)n * 4), *dy = malloc((size_t)n * 4), *y[2], *dx[2], *g[2];
    unsigned long long s = 4;
    tu_fill(x, n, 1.0, &s);
    tu_fill(dy, n, 1.0, &s);
    int threads[2] = {1, 2};
    for (int r = 0; r < 2; r++) {
        y[r] = malloc((size_t)n * 4); dx[r] = malloc((size_t)n * 4); g[r] = malloc((size_t)L->par.n_params * 4);
#ifdef _OPENMP
        omp_set_num_threads(threads[r]);
#else
        (void)threads;
#endif
        run_step(L, x, T, dy, y[r], dx[r]);
        memcpy(g[r], L->par.grads, (size_t)L->par.n_params * 4);
    }
#ifdef _OPENMP
    omp_set_num_threads(L->nthreads);
#endif
#ifndef MOEPT_CBLAS /* OpenBLAS may split sums by thread count: only run to run there */
    EXPECT(memcmp(y[0], y[1], (size_t)n * 4) == 0, "y differs between 1 and 2 threads");
    EXPECT(memcmp(dx[0], dx[1], (size_t)n * 4) == 0, "dx differs between 1 and 2 threads");
    EXPECT(memcmp(g[0], g[1], (size_t)L->par.n_params * 4) == 0, "grads differ between 1 and 2 threads");
#endif
    /* run to run with the same threads */
    run_step(L, x, T, dy, y[0], dx[0]);
    EXPECT(memcmp(y[0], y[1], (size_t)n * 4) == 0, "y differs run to run");
    EXPECT(memcmp(L->par.grads, g[1], (size_t)L->par.n_params * 4) == 0, "grads differ run to run");
    for (int r = 0; r < 2; r++) { free(y[r]); free(dx[r]); free(g[r]); }
    free(x); free(dy);
    moept_destroy(L);
}

static void test_no_allocations_in_steady_state(void) {
    moept_config c = cfg0(MOEPT_FAMILY_QWEN2_MOE, 32, 24, 8, 2, 64);
    c.shared_intermediate_size = 16; c.aux_loss = MOEPT_AUX_HF; c.aux_loss_coef = 0.01f;
    moept_layer *L = make(c, 1);
    if (!L) return;
    float x[64 * 32], dy[64 * 32], y[64 * 32], dx[64 * 32];
    unsigned long long s = 2;
    tu_fill(x, 64 * 32, 1.0, &s);
    tu_fill(dy, 64 * 32, 1.0, &s);
    moept_stats a, b;
    run_step(L, x, 64, dy, y, dx); /* warm-up */
    moept_get_stats(L, &a, NULL);
    for (int i = 0; i < 100; i++) run_step(L, x, 1 + (i * 37) % 64, dy, y, dx);
    moept_get_stats(L, &b, NULL);
    EXPECT(b.allocations == a.allocations, "%lld allocations in 100 steps", (long long)(b.allocations - a.allocations));
    EXPECT(b.steps == a.steps + 100, "step counter %lld", (long long)b.steps);
    moept_destroy(L);
}

static void test_zero_tokens(void) {
    moept_config c = cfg0(MOEPT_FAMILY_QWEN2_MOE, 8, 6, 4, 2, 8);
    c.shared_intermediate_size = 4; c.aux_loss = MOEPT_AUX_HF; c.aux_loss_coef = 0.1f; c.z_loss_coef = 0.1f;
    moept_layer *L = make(c, 1);
    if (!L) return;
    EXPECT_OK(moept_forward(L, NULL, 0, NULL));
    EXPECT_OK(moept_backward(L, NULL, NULL, NULL));
    double g = 0;
    for (int64_t i = 0; i < L->par.n_params; i++) g += fabs(L->par.grads[i]);
    EXPECT(g == 0 && L->stats.aux_loss == 0 && L->stats.z_loss == 0, "T=0 must give zero losses and gradients");
    moept_destroy(L);
}

static void test_update_bias(void) {
    moept_config c = cfg0(MOEPT_FAMILY_DEEPSEEK_V3, 8, 6, 4, 1, 16);
    moept_layer *L = make(c, 3);
    if (!L) return;
    for (int d = 0; d < 8; d++) L->par.w_router[d] += 1.0f; /* expert 0 favoured */
    float x[16 * 8], y[16 * 8];
    for (int i = 0; i < 128; i++) x[i] = 1.0f;
    EXPECT_OK(moept_forward(L, x, 16, y));
    float before[4];
    memcpy(before, L->par.bias, sizeof before);
    EXPECT_OK(moept_update_bias(L, 0.01f));
    for (int e = 0; e < 4; e++) {
        double mean = 16.0 / 4, cnt = (double)moept__last(L)->fwd.sel_counts[e];
        double want = before[e] + (cnt < mean ? 0.01 : cnt > mean ? -0.01 : 0.0);
        EXPECT(fabs(L->par.bias[e] - want) < 1e-7, "expert %d count %g: bias %g, want %g", e, cnt, L->par.bias[e], want);
    }
    moept_destroy(L);
}

/* R = op(A) op(B) in fp64 (op(A) [m][k], op(B) [k][n]; ta: A is stored [k][m], tb: B is [n][k]), each
   row of op(A) and op(B)'s transpose made contiguous doubles first and each sum kept in four parts:
   under qemu-user and valgrind the reference dominated the GEMM tests' time */
static void ref_gemm(int ta, int tb, int64_t m, int64_t n, int64_t k, const float *A, int64_t lda,
                     const float *B, int64_t ldb, double *R) {
    double *a = malloc((size_t)k * 8), *bt = malloc((size_t)(n * k) * 8); /* a [k]; bt [n][k] */
    for (int64_t j = 0; j < n; j++)
        for (int64_t p = 0; p < k; p++) bt[j * k + p] = tb ? B[j * ldb + p] : B[p * ldb + j];
    for (int64_t i = 0; i < m; i++) {
        for (int64_t p = 0; p < k; p++) a[p] = ta ? A[p * lda + i] : A[i * lda + p];
        for (int64_t j = 0; j < n; j++) {
            const double *b = bt + j * k;
            double s4[4] = {0, 0, 0, 0};
            int64_t p = 0;
            for (; p + 4 <= k; p += 4)
                for (int q = 0; q < 4; q++) s4[q] += a[p + q] * b[p + q];
            for (; p < k; p++) s4[0] += a[p] * b[p];
            R[i * n + j] = (s4[0] + s4[1]) + (s4[2] + s4[3]);
        }
    }
    free(a);
    free(bt);
}

static void test_gemm_all_transposes(void) {
    moept_config c = cfg0(MOEPT_FAMILY_MIXTRAL, 300, 8, 2, 1, 300);
    moept_layer *L = NULL;
    EXPECT_OK(moept_create(&c, &L));
    if (!L) return;
    /* {50, 2100, 600}: column panels within each of several k blocks (A packed once a k block) */
    static const int64_t shapes[][3] = {{1, 1, 1}, {7, 33, 5}, {97, 35, 257}, {300, 2100, 3}, {13, 17, 600},
                                        {200, 1, 300}, {50, 2100, 600}};
    unsigned long long s = 99;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        /* one product a shape, its fp64 reference made once (under valgrind and qemu it was the test's
           time, made for each of the 8 layouts); each layout stores the same A, B and C */
        const int64_t m = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
        float *Am = malloc((size_t)(m * k) * 4), *Bm = malloc((size_t)(k * n) * 4);
        float *Cm = malloc((size_t)(m * n) * 4);
        double *R = malloc((size_t)(m * n) * 8);
        tu_fill(Am, m * k, 1.0, &s);
        tu_fill(Bm, k * n, 1.0, &s);
        tu_fill(Cm, m * n, 1.0, &s);
        ref_gemm(0, 0, m, n, k, Am, k, Bm, n, R);
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++)
                for (int beta = 0; beta < 2; beta++) {
                    int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 1, ldc = n + 2;
                    float *A = malloc((size_t)((ta ? k : m) * lda) * 4), *B = malloc((size_t)((tb ? n : k) * ldb) * 4);
                    float *C = malloc((size_t)(m * ldc) * 4);
                    tu_fill(A, (ta ? k : m) * lda, 1.0, &s); /* the padding: values the GEMM must not read */
                    tu_fill(B, (tb ? n : k) * ldb, 1.0, &s);
                    for (int64_t i = 0; i < m; i++)
                        for (int64_t p = 0; p < k; p++) A[ta ? p * lda + i : i * lda + p] = Am[i * k + p];
                    for (int64_t p = 0; p < k; p++)
                        for (int64_t j = 0; j < n; j++) B[tb ? j * ldb + p : p * ldb + j] = Bm[p * n + j];
                    for (int64_t i = 0; i < m * ldc; i++) C[i] = NAN; /* beta 0 must not read C */
                    for (int64_t i = 0; beta && i < m; i++)
                        for (int64_t j = 0; j < n; j++) C[i * ldc + j] = Cm[i * n + j];
                    moept__gemm g = moept__gemm_make(ta, tb, m, n, k, A, lda, B, ldb, beta ? 1.0f : 0.0f, C, ldc);
                    moept__gemm_run(&g, 1, &L->ws.gws);
                    double num = 0, den = 0;
                    for (int64_t i = 0; i < m; i++)
                        for (int64_t j = 0; j < n; j++) {
                            const double want = R[i * n + j] + (beta ? (double)Cm[i * n + j] : 0.0);
                            double d = C[i * ldc + j] - want;
                            num += d * d;
                            den += want * want;
                        }
                    EXPECT(sqrt(num / den) < 1e-6, "gemm %lldx%lldx%lld ta %d tb %d beta %d: rel err %g",
                           (long long)m, (long long)n, (long long)k, ta, tb, beta, sqrt(num / den));
                    free(A); free(B); free(C);
                }
        free(Am); free(Bm); free(Cm); free(R);
    }
    moept_destroy(L);
}

/* The builtin GEMM's split over threads (moept__gemm_split): row blocks,
   column chunks of one block, and column chunks of every block where the
   strips do not divide among the threads (m = 204: 17 strips of 12 rows;
   210: 35 of 6, 27 of 8, 53 of 4), over two B panels and two k blocks:
   each thread count gives the double reference's result, and the same
   bits as one thread; so do two descriptors sharing B in one call. A^T
   (the weight gradients' packing, 8 strips at a time) over several k
   blocks: A packed by all threads first (column chunks), a thread's
   stretch of over 8 strips (204 rows on 2 threads), an empty one where
   the threads outnumber the strips (20 rows on 3; under two B panels);
   and row blocks with a short last strip, of over 8 strips where MR is 6
   or 4. */
#ifndef MOEPT_CBLAS
static void test_gemm_thread_splits(void) {
    moept_config c = cfg0(MOEPT_FAMILY_MIXTRAL, 64, 8, 2, 1, 1100);
    moept_layer *L = NULL;
    EXPECT_OK(moept_create(&c, &L));
    if (!L) return;
    /* m, n, k, trans_a, trans_b, beta */
    static const int64_t shapes[][6] = {{1000, 300, 60, 1, 0, 1}, {410, 64, 1100, 1, 0, 0},
                                        {204, 600, 530, 0, 1, 0}, {210, 2100, 90, 1, 0, 1},
                                        {64, 700, 530, 0, 0, 0}, {204, 600, 530, 1, 0, 0},
                                        {20, 2100, 600, 1, 0, 1}};
    /* Without OpenMP (the valgrind, TSan and aarch64 builds) there is one thread and nothing to split:
       the first two shapes only, and one run of each (two and three threads would run the one-thread
       code again; test_gemm_all_transposes checks the kernels' blocks and edges in every build). */
#ifdef _OPENMP
    const int ths = 3;
    const size_t nshapes = sizeof shapes / sizeof shapes[0];
#else
    const int ths = 1;
    const size_t nshapes = 2;
#endif
    unsigned long long s = 41;
    for (size_t si = 0; si < nshapes; si++) {
        int64_t m = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
        int ta = (int)shapes[si][3], tb = (int)shapes[si][4], beta = (int)shapes[si][5];
        int64_t lda = ta ? m : k, ldb = tb ? k : n;
        float *A = malloc((size_t)(m * k) * 4), *B = malloc((size_t)(k * n) * 4); /* op(A) [m][k], op(B) [k][n] */
        float *C0 = malloc((size_t)(m * n) * 4), *C = malloc((size_t)(m * n) * 4), *C1 = malloc((size_t)(m * n) * 4);
        tu_fill(A, m * k, 1.0, &s);
        tu_fill(B, k * n, 1.0, &s);
        tu_fill(C0, m * n, 1.0, &s);
        double num = 0, den = 0, *R = malloc((size_t)(m * n) * 8); /* R [m][n] */
        ref_gemm(ta, tb, m, n, k, A, lda, B, ldb, R);
        for (int64_t i = 0; i < m * n; i++) {
            const double want = R[i] + (beta ? (double)C0[i] : 0.0);
            den += want * want;
            C[i] = (float)want;
        }
        free(R);
        for (int th = 1; th <= ths; th++) {
            float *out = th == 1 ? C1 : C; /* C: the reference until the one-thread run is checked */
            memcpy(out, C0, (size_t)(m * n) * 4);
#ifdef _OPENMP
            omp_set_num_threads(th);
            atomic_store(&moept__team_cap, 0); /* the team as asked, whatever load earlier tests saw */
#endif
            moept__gemm g = moept__gemm_make(ta, tb, m, n, k, A, lda, B, ldb, beta ? 1.0f : 0.0f, out, n);
            moept__gemm_run(&g, 1, &L->ws.gws);
            if (th == 1) {
                for (int64_t i = 0; i < m * n; i++) num += ((double)C1[i] - C[i]) * ((double)C1[i] - C[i]);
                EXPECT(sqrt(num / den) < 1e-6, "gemm %lldx%lldx%lld: rel err %g on 1 thread", (long long)m,
                       (long long)n, (long long)k, sqrt(num / den));
            } else {
                EXPECT(memcmp(C, C1, (size_t)(m * n) * 4) == 0, "gemm %lldx%lldx%lld: %d threads differ from 1",
                       (long long)m, (long long)n, (long long)k, th);
            }
        }
#ifdef _OPENMP
        omp_set_num_threads(L->nthreads);
#endif
        free(A); free(B); free(C0); free(C); free(C1);
    }
    /* descriptors sharing op(B) in one call (the chunked overlap's form) equal one call each, bitwise
       (n: two column panels, each descriptor's A packed again for the second) */
    const int64_t n = 2100, k = 530, ms[2] = {204, 64};
    float *B = malloc((size_t)(n * k) * 4), *A[2], *C[2], *G[2]; /* B [n][k]; A [m][k]; C, G [m][n] */
    tu_fill(B, n * k, 1.0, &s);
    moept__gemm gs[2];
    for (int d = 0; d < 2; d++) {
        A[d] = malloc((size_t)(ms[d] * k) * 4); C[d] = malloc((size_t)(ms[d] * n) * 4);
        G[d] = malloc((size_t)(ms[d] * n) * 4);
        tu_fill(A[d], ms[d] * k, 1.0, &s);
        gs[d] = moept__gemm_make(0, 1, ms[d], n, k, A[d], k, B, k, 0.0f, G[d], n);
    }
    for (int th = 1; th <= ths; th++) {
#ifdef _OPENMP
        omp_set_num_threads(th);
        atomic_store(&moept__team_cap, 0);
#endif
        for (int d = 0; d < 2; d++) {
            moept__gemm one = moept__gemm_make(0, 1, ms[d], n, k, A[d], k, B, k, 0.0f, C[d], n);
            moept__gemm_run(&one, 1, &L->ws.gws);
        }
        moept__gemm_builtin(gs, 2, &L->ws.gws);
        for (int d = 0; d < 2; d++)
            EXPECT(memcmp(C[d], G[d], (size_t)(ms[d] * n) * 4) == 0, "grouped descriptor %d differs on %d threads",
                   d, th);
    }
#ifdef _OPENMP
    omp_set_num_threads(L->nthreads);
#endif
    for (int d = 0; d < 2; d++) { free(A[d]); free(C[d]); free(G[d]); }
    free(B);
    moept_destroy(L);
}
#endif

/* The CUDA plan, run on the CPU: the block-wise count (moept__block_rank,
   blocks of 256 as the kernel), the per-slot scan (moept__plan_scan_slot)
   and placement (moept__plan_place) give the same rows as the CPU's
   counting sort, with and without capacity, including empty experts. */
static void test_gpu_plan_emulated(void) {
    for (int capmode = 0; capmode < 2; capmode++) {
        moept_config c = cfg0(MOEPT_FAMILY_MIXTRAL, 16, 8, 16, 3, 700);
        if (capmode) c.capacity_factor = 0.7f;
        moept_layer *L = make(c, 11);
        if (!L) return;
        const int64_t T = 700, D = L->D, E = L->E, K = L->K, TK = T * K, PB = 256;
        float *x = malloc((size_t)(T * D) * sizeof(float)), *y = malloc((size_t)(T * D) * sizeof(float));
        uint64_t st = 5;
        for (int64_t i = 0; i < T * D; i++) x[i] = (float)((moept__mix(&st) >> 40) * (1.0 / 16777216.0)) + 0.1f;
        for (int64_t d = 0; d < D; d++) L->par.w_router[3 * D + d] = -50.0f; /* x > 0: expert 3 never chosen */
        EXPECT_OK(moept_forward(L, x, T, y));
        const int32_t *ids = moept__last(L)->fwd.ids[moept__last(L)->fwd.cur];
        int64_t nblk = (TK + PB - 1) / PB, cap = L->stats.capacity;
        int64_t *hist = calloc((size_t)(nblk * E), sizeof(int64_t)), *kept = calloc((size_t)E, sizeof(int64_t));
        int64_t *koff = calloc((size_t)E + 1, sizeof(int64_t)), *row_of = calloc((size_t)TK, sizeof(int64_t));
        int64_t *tok = calloc((size_t)TK, sizeof(int64_t));
        int32_t *lrank = calloc((size_t)TK, sizeof(int32_t)), sl[256];
        for (int64_t b = 0; b < nblk; b++) { /* the count kernel, one block at a time */
            int n = (int)(TK - b * PB < PB ? TK - b * PB : PB);
            for (int i = 0; i < PB; i++) sl[i] = i < n ? L->plan.slot_of[ids[b * PB + i]] : -1;
            for (int i = 0; i < n; i++) {
                int last;
                lrank[b * PB + i] = moept__block_rank(sl, PB, i, &last);
                if (last) hist[b * E + sl[i]] = lrank[b * PB + i] + 1;
            }
        }
        for (int64_t e = 0; e < E; e++) kept[e] = moept__plan_scan_slot(hist, nblk, E, e, cap);
        for (int64_t e = 0; e < E; e++) koff[e + 1] = koff[e] + kept[e];
        for (int64_t a = 0; a < TK; a++) {
            int64_t s = L->plan.slot_of[ids[a]];
            moept__plan_place(a, hist[(a / PB) * E + s] + lrank[a], kept[s], koff[s], K, row_of, tok);
        }
        EXPECT(koff[E] == moept__last(L)->plan.N, "kept rows %lld vs %lld", (long long)koff[E], (long long)moept__last(L)->plan.N);
        EXPECT(kept[3] == 0, "expert 3 got rows");
        for (int64_t e = 0; e < E; e++) EXPECT(kept[e] == moept__last(L)->plan.counts[e], "slot %lld: %lld vs %lld", (long long)e, (long long)kept[e], (long long)moept__last(L)->plan.counts[e]);
        for (int64_t a = 0; a < TK; a++) EXPECT(row_of[a] == moept__last(L)->plan.row_of[a], "assignment %lld: row %lld vs %lld", (long long)a, (long long)row_of[a], (long long)moept__last(L)->plan.row_of[a]);
        for (int64_t r = 0; r < moept__last(L)->plan.N; r++)
            EXPECT(tok[r] == moept__last(L)->plan.tok_of_row[r], "row %lld differs", (long long)r);
        free(x); free(y); free(hist); free(kept); free(koff); free(row_of); free(tok); free(lrank);
        moept_destroy(L);
    }
}

/* The host plan both executors call (moept.h's moept__plan_*), against the
   layout walked row by row: the send side slot by slot, then chunk by
   chunk; the expert side expert by expert, then by source rank, then by
   chunk. Random counts (empty pieces included) at P 3, El 2, C 3. */
static void test_host_plan(void) {
    enum { P = 3, El = 2, E = P * El, C = 3, D = 5 };
    int64_t ccnt[C * E], rccnt[P * C * El], counts[E] = {0}, rcounts[P * El] = {0}, offsets[E + 1] = {0};
    int64_t roffsets[El + 1], peer[2 * P], runs[3 * P * El], sent, recv, want_ro[El + 1];
    int64_t sstart[C][E], rstart[C][P * El]; /* each chunk's first row of each piece, walked */
    moept_seg ss[E], rs[E], cs[E], cr[E];
    uint64_t st = 7;
    for (int64_t i = 0; i < C * E; i++) ccnt[i] = (int64_t)(moept__mix(&st) % 4); /* 0..3 */
    for (int64_t i = 0; i < P * C * El; i++) rccnt[i] = (int64_t)(moept__mix(&st) % 4);
    for (int64_t c = 0; c < C; c++)
        for (int64_t e = 0; e < E; e++) counts[e] += ccnt[c * E + e];
    for (int64_t p = 0; p < P; p++)
        for (int64_t c = 0; c < C; c++)
            for (int64_t j = 0; j < El; j++) rcounts[p * El + j] += rccnt[(p * C + c) * El + j];
    for (int64_t e = 0, at = 0; e < E; e++) {
        offsets[e] = at;
        for (int64_t c = 0; c < C; c++) { sstart[c][e] = at; at += ccnt[c * E + e]; }
        offsets[e + 1] = at;
    }
    for (int64_t j = 0, at = 0; j < El; j++) {
        want_ro[j] = at;
        for (int64_t p = 0; p < P; p++)
            for (int64_t c = 0; c < C; c++) { rstart[c][p * El + j] = at; at += rccnt[(p * C + c) * El + j]; }
        want_ro[j + 1] = at;
    }
    moept__plan_roffsets(P, El, rcounts, roffsets);
    moept__plan_segs(P, El, D, offsets, counts, rcounts, roffsets, ss, rs);
    for (int64_t j = 0; j <= El; j++) EXPECT(roffsets[j] == want_ro[j], "roffsets[%lld]", (long long)j);
    for (int64_t e = 0; e < E; e++)
        EXPECT(ss[e].offset == offsets[e] * D && ss[e].count == counts[e] * D && rs[e].offset ==
               rstart[0][e] * D && rs[e].count == rcounts[e] * D, "piece %lld", (long long)e);
    for (int64_t me = 0; me < P; me++) {
        moept__plan_peer_rows(P, El, me, counts, rcounts, El, peer, &sent, &recv);
        int64_t ws = 0, wr = 0;
        for (int64_t q = 0; q < P; q++) {
            int64_t s = 0, r = 0;
            for (int64_t j = 0; j < El; j++) { s += counts[q * El + j]; r += rcounts[q * El + j]; }
            EXPECT(peer[q] == s && peer[P + q] == r, "me %lld: peer %lld rows", (long long)me, (long long)q);
            if (q != me) { ws += s; wr += r; }
        }
        EXPECT(sent == ws && recv == wr, "me %lld: sent %lld received %lld", (long long)me, (long long)sent,
               (long long)recv);
    }
    for (int64_t c = 0; c < C; c++) {
        int64_t w = 0, n = moept__plan_chunk(c, C, P, El, D, offsets, ccnt, rcounts, roffsets, rccnt, cs, cr,
                                             runs);
        for (int64_t e = 0; e < E; e++) { /* piece e: slot e sent, rank e / El's rows for expert e % El */
            int64_t rows = rccnt[(e / El * C + c) * El + e % El];
            EXPECT(cs[e].offset == sstart[c][e] * D && cs[e].count == ccnt[c * E + e] * D &&
                   cr[e].offset == rstart[c][e] * D && cr[e].count == rows * D, "chunk %lld piece %lld",
                   (long long)c, (long long)e);
        }
        for (int64_t j = 0; j < El; j++)
            for (int64_t p = 0; p < P; p++) {
                int64_t rows = rccnt[(p * C + c) * El + j];
                if (!rows) continue;
                EXPECT(w < n && runs[w] == rstart[c][p * El + j] && runs[P * El + w] == rows &&
                       runs[2 * P * El + w] == j, "chunk %lld run %lld", (long long)c, (long long)w);
                w++;
            }
        EXPECT(n == w, "chunk %lld: %lld runs, %lld walked", (long long)c, (long long)n, (long long)w);
    }
}

/* Naive column-major GEMM, as BLAS/cuBLAS define it. */
static void colmajor_ref(const moept__gemm_cm *g) {
    const float *A = g->a, *B = g->b;
    float *C = g->c;
    for (int64_t j = 0; j < g->n; j++)
        for (int64_t i = 0; i < g->m; i++) {
            double s = 0;
            for (int64_t p = 0; p < g->k; p++) {
                double a = g->trans_a ? A[i * g->lda + p] : A[p * g->lda + i];
                double b = g->trans_b ? B[p * g->ldb + j] : B[j * g->ldb + p];
                s += a * b;
            }
            C[j * g->ldc + i] = (float)(g->alpha * s + g->beta * C[j * g->ldc + i]);
        }
}

/* The arguments cuBLAS receives (moept__gemm_colmajor of each descriptor)
   compute what the builtin GEMM computes, for every transpose pair, with
   padded leading dimensions and beta 0 and 1. */
static void test_cublas_arguments(void) {
    uint64_t st = 9;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int bi = 0; bi < 2; bi++) {
                int64_t m = 13, n = 37, k = 21, lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5, ldc = n + 2;
                float *A = malloc((size_t)((ta ? k : m) * lda) * 4), *B = malloc((size_t)((tb ? n : k) * ldb) * 4);
                float *C1 = malloc((size_t)(m * ldc) * 4), *C2 = malloc((size_t)(m * ldc) * 4);
                for (int64_t i = 0; i < (ta ? k : m) * lda; i++) A[i] = (float)((moept__mix(&st) >> 40) * (1.0 / 16777216.0) - 0.5);
                for (int64_t i = 0; i < (tb ? n : k) * ldb; i++) B[i] = (float)((moept__mix(&st) >> 40) * (1.0 / 16777216.0) - 0.5);
                for (int64_t i = 0; i < m * ldc; i++) C1[i] = C2[i] = (float)i * 0.001f;
                moept__gemm g = moept__gemm_make(ta, tb, m, n, k, A, lda, B, ldb, (float)bi, C1, ldc);
                moept__gemm_ws ws = {0};
#ifndef MOEPT_CBLAS
                ws.m_max = 16 * 1024;
                ws.apack = malloc((size_t)(ws.m_max + MOEPT__MR) * MOEPT__KC * 4);
                ws.bpack = malloc((size_t)((MOEPT__NC + MOEPT__NR) * MOEPT__KC) * 4);
#endif
                moept__gemm_run(&g, 1, &ws);
                g.c = C2;
                moept__gemm_cm cm = moept__gemm_colmajor(&g);
                EXPECT(cm.m == n && cm.n == m && cm.k == k && cm.a == B && cm.b == A, "operands not swapped");
                colmajor_ref(&cm);
                double worst = 0;
                for (int64_t i = 0; i < m; i++)
                    for (int64_t j = 0; j < n; j++) {
                        double d = fabs((double)C1[i * ldc + j] - C2[i * ldc + j]);
                        worst = d > worst ? d : worst;
                    }
                EXPECT(worst < 1e-5, "ta %d tb %d beta %d: column-major result differs by %.3g", ta, tb, bi, worst);
                free(A); free(B); free(C1); free(C2); free(ws.apack); free(ws.bpack);
            }
}

/* bf16 rounding (the CUDA executor's conversions): nearest, ties to even,
   NaN stays NaN, infinities and overflow to infinity as IEEE says. */
static void test_bf16_rounding(void) {
    union { float f; uint32_t u; } v;
    v.u = 0x3f800000u; EXPECT(moept__f32_to_bf16(v.f) == 0x3f80, "1.0");
    v.u = 0x3f808000u; EXPECT(moept__f32_to_bf16(v.f) == 0x3f80, "tie rounds to even (down)");
    v.u = 0x3f818000u; EXPECT(moept__f32_to_bf16(v.f) == 0x3f82, "tie rounds to even (up)");
    v.u = 0x3f808001u; EXPECT(moept__f32_to_bf16(v.f) == 0x3f81, "above the tie rounds up");
    v.u = 0x7f7fffffu; EXPECT(moept__f32_to_bf16(v.f) == 0x7f80, "FLT_MAX rounds to inf");
    v.u = 0xff800000u; EXPECT(moept__f32_to_bf16(v.f) == 0xff80, "-inf");
    v.u = 0x7fc00001u; EXPECT((moept__f32_to_bf16(v.f) & 0x7fff) > 0x7f80, "NaN stays NaN");
    v.u = 0x7f800001u; EXPECT((moept__f32_to_bf16(v.f) & 0x7fff) > 0x7f80, "signalling NaN stays NaN");
    uint64_t st = 3;
    for (int i = 0; i < 100000; i++) {
        v.u = (uint32_t)(moept__mix(&st) >> 32);
        if ((v.u & 0x7f800000u) == 0x7f800000u) continue;
        float r = moept__bf16_to_f32(moept__f32_to_bf16(v.f));
        double err = fabs((double)r - v.f), ulp = ldexp(1.0, (int)((v.u >> 23) & 0xff) - 127 - 7);
        if ((v.u & 0x7f800000u) == 0) ulp = ldexp(1.0, -126 - 7);
        if (!isinf(r)) EXPECT(err <= ulp / 2, "0x%08x: error %.3g > half a bf16 ulp", v.u, err);
    }
}

/* The CPU executor's activation rows (eight-wide for gated SiLU) equal
   moept.h's per-element functions bitwise, for every kind, on a row whose
   width leaves a tail: random values, the exp's clamp edges, +-inf, NaN
   (NaN compared as "is NaN"), backward in place as the layer runs it. */
static int same_bits(float a, float b) {
    uint32_t x, y;
    memcpy(&x, &a, 4); memcpy(&y, &b, 4);
    return x == y || (a != a && b != b);
}
static void test_activation_rows(void) {
    enum { F = 8 * 37 + 5 };
    static float h[2 * F], dh[2 * F], a[F], da[F];
    const float edge[] = {-87.3f, -87.31f, 87.3f, 88.7f, 88.71f, -88.7f, 0.0f, -0.0f, 1e-30f, 200.0f, -200.0f,
                          INFINITY, -INFINITY, NAN};
    uint64_t st = 5;
    for (int kind = 0; kind < 4; kind++) {
        for (int j = 0; j < 2 * F; j++) {
            h[j] = ((float)(moept__mix(&st) >> 40) * 0x1p-24f - 0.5f) * 40.0f;
            if (j % 7 == 3) h[j] = edge[(j / 7) % (int)(sizeof edge / sizeof edge[0])];
        }
        for (int j = 0; j < F; j++) da[j] = (float)(moept__mix(&st) >> 40) * 0x1p-24f - 0.5f;
        moept__act_fwd_rowv(kind, h, F, a);
        memcpy(dh, h, sizeof h);
        moept__act_bwd_rowv(kind, dh, da, F, dh);
        int bad = -1;
        for (int j = 0; j < F && bad < 0; j++) {
            int gated = moept__act_gated(kind);
            float dg, du, u = gated ? h[F + j] : 0.0f;
            moept__act_bwd1(kind, h[j], u, da[j], &dg, &du);
            if (!same_bits(a[j], moept__act_fwd1(kind, h[j], u)) || !same_bits(dh[j], dg) ||
                (gated && !same_bits(dh[F + j], du)))
                bad = j;
        }
        double g = bad < 0 ? 0.0 : (double)h[bad], u = bad < 0 ? 0.0 : (double)h[F + bad];
        EXPECT(bad < 0, "activation %d: row differs from the per-element functions at %d (h %g, %g)", kind, bad, g, u);
    }
}

/* moept__chunk_of (the CUDA chunk count's token -> chunk) inverts
   moept__chunk_start (the chunk boundaries both executors use), for every
   token of every T up to 300 and every C up to MOEPT_MAX_CHUNKS, C > T
   (empty chunks) included. */
static void test_chunk_of_token(void) {
    int64_t bad = 0;
    for (int64_t T = 1; T <= 300; T++)
        for (int64_t C = 1; C <= MOEPT_MAX_CHUNKS; C++)
            for (int64_t t = 0; t < T; t++) {
                int64_t c = moept__chunk_of(t, T, C);
                if (c < 0 || c >= C || moept__chunk_start(T, C, c) > t || t >= moept__chunk_start(T, C, c + 1))
                    bad++;
            }
    EXPECT(bad == 0, "%lld tokens in the wrong chunk", (long long)bad);
}

/* a equals b: bitwise with the builtin GEMM (rows independent of the row
   count); OpenBLAS may round a GEMM of other rows apart */
static int same_f(const float *a, const float *b, int64_t n) {
#ifdef MOEPT_CBLAS
    return tu_relerr(a, b, n) <= 1e-6;
#else
    return memcmp(a, b, (size_t)n * sizeof(float)) == 0;
#endif
}

/* Padding: masked tokens are routed nowhere (ids -1, weights 0, no rows),
   their y and dx rows are 0, the stats count them apart; a batch of padding
   only is a step with zero losses. The unmasked tokens' results are those
   of the same tokens without the padding rows (bitwise), with a capacity
   factor too: capacity is that of the unmasked tokens (cf 0.5: 2 an expert
   for the 13 of them, where the 20 rows with padding would give 3); and
   whatever the padded rows of x hold (pad: 1e20 or 3e38 in each), the
   shared expert never reads them. */
static void mask_case(float cf, float pad) {
    moept_config c = moept_config_default(MOEPT_FAMILY_QWEN2_MOE);
    c.hidden_size = 16; c.intermediate_size = 12; c.num_experts = 8; c.top_k = 2; c.max_tokens = 20;
    c.shared_intermediate_size = 8; c.aux_loss = MOEPT_AUX_HF; c.aux_loss_coef = 0.01f; c.z_loss_coef = 0.001f;
    c.capacity_factor = cf;
    moept_layer *L = make(c, 3), *R = make(c, 3);
    if (!L || !R) return;
    const int64_t T = 20, D = 16, K = 2;
    float x[20 * 16], dy[20 * 16], y[20 * 16], dx[20 * 16], xr[20 * 16], dyr[20 * 16], yr[20 * 16], dxr[20 * 16];
    uint8_t m[20];
    unsigned long long s = 5;
    tu_fill(x, T * D, 1.0, &s);
    tu_fill(dy, T * D, 1.0, &s);
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++) {
        m[t] = t % 3 != 1;
        if (m[t]) { memcpy(xr + n * D, x + t * D, D * 4); memcpy(dyr + n * D, dy + t * D, D * 4); n++; }
        else if (pad != 0.0f) for (int64_t d = 0; d < D; d++) x[t * D + d] = pad;
    }
    moept_forward_opts o = {m, 0, NULL, NULL, 0};
    EXPECT_OK(moept_forward_ex(L, x, T, y, &o));
    EXPECT(moept_backward(L, x, dy, dx) == MOEPT_OK, "pad %g: backward: %s", (double)pad, moept_last_error(L));
    EXPECT_OK(moept_forward(R, xr, n, yr));
    EXPECT_OK(moept_backward(R, xr, dyr, dxr));
    const int32_t *ids = NULL; const float *w = NULL;
    moept_routing(L, &ids, &w, NULL);
    moept_stats st, sr;
    moept_get_stats(L, &st, NULL);
    moept_get_stats(R, &sr, NULL);
    EXPECT(st.masked_tokens == T - n && st.routed_rows == sr.routed_rows && st.dropped_rows == sr.dropped_rows &&
           st.capacity == sr.capacity && (cf > 0.0f || st.dropped_rows == 0),
           "cf %g stats: masked %lld routed %lld dropped %lld (unpadded %lld) capacity %lld (unpadded %lld)",
           (double)cf, (long long)st.masked_tokens, (long long)st.routed_rows, (long long)st.dropped_rows,
           (long long)sr.dropped_rows, (long long)st.capacity, (long long)sr.capacity);
    EXPECT(same_f(&st.aux_loss, &sr.aux_loss, 1) && same_f(&st.z_loss, &sr.z_loss, 1), "losses %g %g vs %g %g", st.aux_loss, st.z_loss,
           sr.aux_loss, sr.z_loss);
    for (int64_t t = 0, r = 0; t < T; t++) {
        int zy = 1, zx = 1;
        for (int64_t d = 0; d < D; d++) { zy &= y[t * D + d] == 0.0f; zx &= dx[t * D + d] == 0.0f; }
        if (!m[t]) {
            EXPECT(zy && zx && ids[t * K] == -1 && ids[t * K + 1] == -1 && w[t * K] == 0.0f, "padding token %lld",
                   (long long)t);
            continue;
        }
        EXPECT(same_f(y + t * D, yr + r * D, D) && same_f(dx + t * D, dxr + r * D, D),
               "token %lld differs from the same token without padding", (long long)t);
        r++;
    }
    EXPECT(same_f(L->par.grads, R->par.grads, L->par.n_params), "cf %g pad %g: gradients differ from the unpadded batch's",
           (double)cf, (double)pad);
    if (cf > 0.0f || pad != 0.0f) {
        moept_destroy(L);
        moept_destroy(R);
        return;
    }
    /* all padding: y 0, losses 0, no gradient */
    memset(m, 0, sizeof m);
    EXPECT_OK(moept_zero_grad(L));
    EXPECT_OK(moept_forward_ex(L, x, T, y, &o));
    EXPECT_OK(moept_backward(L, x, dy, dx));
    moept_get_stats(L, &st, NULL);
    double a = 0;
    for (int64_t i = 0; i < T * D; i++) a += fabs(y[i]) + fabs(dx[i]);
    for (int64_t i = 0; i < L->par.n_params; i++) a += fabs(L->par.grads[i]);
    EXPECT(a == 0.0 && st.aux_loss == 0.0f && st.z_loss == 0.0f && st.routed_rows == 0, "all padding: |y|+|dx|+|g| %g",
           a);
    moept_destroy(L);
    moept_destroy(R);
}
static void test_mask(void) {
    mask_case(0.0f, 0.0f);
    mask_case(0.5f, 0.0f);
    mask_case(0.0f, 1e20f);
    mask_case(0.5f, 3e38f);
}

/* An evaluation forward keeps nothing for backward and touches no training
   forward's state: training forward -> evaluation -> backward equals
   forward -> backward bitwise (dx, gradients; the evaluation's y is the
   training y). Before any training forward the backward refuses (the
   evaluation ran in the training slot: nothing waited for a backward), and
   update_bias after the evaluation reads the evaluation (it refuses) */
static void test_eval_between(void) {
    moept_config c = moept_config_default(MOEPT_FAMILY_DEEPSEEK_V3);
    c.hidden_size = 8; c.intermediate_size = 6; c.num_experts = 4; c.top_k = 2; c.max_tokens = 6;
    moept_layer *L = make(c, 2), *R = make(c, 2);
    if (!L || !R) { moept_destroy(L); moept_destroy(R); return; }
    float x[48], y[48], y2[48], y3[48], dx[48], dx2[48], dy[48];
    unsigned long long s = 9;
    tu_fill(x, 48, 1.0, &s);
    tu_fill(dy, 48, 1.0, &s);
    moept_forward_opts o = {NULL, 1, NULL, NULL, 0};
    EXPECT_OK(moept_forward_ex(L, x, 6, y, &o));
    EXPECT(moept_backward(L, x, dy, dx) == MOEPT_ERR_STATE && strstr(moept_last_error(L), "evaluation"),
           "backward after eval alone: %s", moept_last_error(L));
    EXPECT(moept_update_bias(L, 0.1f) == MOEPT_ERR_STATE, "update_bias after eval: %s", moept_last_error(L));
    EXPECT_OK(moept_forward(L, x, 6, y2));
    EXPECT(!memcmp(y, y2, sizeof y), "eval y differs from training y");
    EXPECT_OK(moept_forward_ex(L, x, 6, y3, &o)); /* between the forward and its backward */
    EXPECT(!memcmp(y3, y2, sizeof y), "eval y differs from training y");
    EXPECT_OK(moept_backward(L, x, dy, dx));
    EXPECT_OK(moept_forward(R, x, 6, y3));
    EXPECT_OK(moept_backward(R, x, dy, dx2));
    EXPECT(!memcmp(dx, dx2, sizeof dx), "an evaluation between forward and backward changed dx");
    EXPECT(!memcmp(L->par.grads, R->par.grads, (size_t)L->par.n_params * 4),
           "an evaluation between forward and backward changed the gradients");
    EXPECT(moept_backward(L, x, dy, dx) == MOEPT_ERR_STATE, "a second backward: %s", moept_last_error(L));
    moept_destroy(L);
    moept_destroy(R);
}

/* An inference layer (config.inference_only): the training layer's y and
   routing, bitwise (forward and evaluation forward), in less memory: no
   gradients (n_params floats), no activations apart from h (Rcap F floats),
   no router/gate gradients or shared activations (T (K + E + S + 1)
   floats), each within the workspace's 64-byte alignment */
static void test_inference_layer(void) {
    moept_config c = moept_config_default(MOEPT_FAMILY_QWEN2_MOE);
    c.hidden_size = 24; c.intermediate_size = 20; c.num_experts = 8; c.top_k = 2; c.max_tokens = 40;
    c.shared_intermediate_size = 12; c.aux_loss = MOEPT_AUX_HF; c.aux_loss_coef = 0.01f;
    moept_layer *Lt = make(c, 4);
    c.inference_only = 1;
    moept_layer *Li = make(c, 4);
    if (!Lt || !Li) { moept_destroy(Lt); moept_destroy(Li); return; }
    const int64_t T = 40, D = 24, F = 20, E = 8, K = 2, S = 12;
    float *x = malloc(T * D * 4), *yt = malloc(T * D * 4), *yi = malloc(T * D * 4), *ye = malloc(T * D * 4);
    unsigned long long sd = 3;
    tu_fill(x, T * D, 1.0, &sd);
    moept_forward_opts eo = {NULL, 1, NULL, NULL, 0};
    EXPECT_OK(moept_forward(Lt, x, T, yt));
    EXPECT_OK(moept_forward(Li, x, T, yi));
    EXPECT_OK(moept_forward_ex(Li, x, T, ye, &eo));
    EXPECT(same_f(yt, yi, T * D) && same_f(yt, ye, T * D), "inference y differs from training y");
    const int32_t *it, *ii; const float *wt, *wi, *lt, *li;
    moept_routing(Lt, &it, &wt, &lt);
    moept_routing(Li, &ii, &wi, &li);
    EXPECT(!memcmp(it, ii, T * K * 4) && !memcmp(wt, wi, T * K * 4), "inference routing differs");
    moept_stats st, si;
    moept_get_stats(Lt, &st, NULL);
    moept_get_stats(Li, &si, NULL);
    int64_t dpar = st.param_bytes - si.param_bytes, dws = st.workspace_bytes - si.workspace_bytes;
    int64_t want_ws = (moept__last(Lt)->xch.Rcap * F + T * (K + E + S + 1)) * 4;
    EXPECT(dpar == Lt->par.n_params * 4, "parameter bytes saved %lld, want %lld", (long long)dpar,
           (long long)(Lt->par.n_params * 4));
    EXPECT(moept__last(Li)->xch.Rcap == moept__last(Lt)->xch.Rcap && dws >= want_ws - 5 * 64 && dws <= want_ws + 5 * 64,
           "workspace bytes saved %lld, want %lld (+-320)", (long long)dws, (long long)want_ws);
    printf("# inference layer: %lld of %lld bytes (parameters %lld -> %lld, workspace %lld -> %lld)\n",
           (long long)(si.param_bytes + si.workspace_bytes), (long long)(st.param_bytes + st.workspace_bytes),
           (long long)st.param_bytes, (long long)si.param_bytes, (long long)st.workspace_bytes,
           (long long)si.workspace_bytes);
    free(x); free(yt); free(yi); free(ye);
    moept_destroy(Lt); moept_destroy(Li);
}

/* Router jitter: the factors lie in [1 - eps, 1 + eps] with mean 1; each
   training forward draws anew (AdamW steps and forwards since key it), a
   fresh layer with the same seed draws the same sequence */
static void test_jitter_noise(void) {
    double sum = 0, lo = 2, hi = 0;
    const int64_t n = 200000;
    for (int64_t i = 0; i < n; i++) {
        double u = moept__jitter_u(7, 1, (uint64_t)(i / 64) * 0x9e3779b97f4a7c15ull, i % 64, 0.25f);
        sum += u; lo = u < lo ? u : lo; hi = u > hi ? u : hi;
    }
    /* mean of U(0.75, 1.25): sd 0.144 / sqrt(n) = 3.2e-4 */
    EXPECT(lo >= 0.75 && hi <= 1.25 && fabs(sum / n - 1.0) < 1.5e-3 && hi - lo > 0.499, "range %g..%g mean %g", lo, hi,
           sum / n);
    moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL);
    c.hidden_size = 8; c.intermediate_size = 6; c.num_experts = 4; c.top_k = 2; c.max_tokens = 6;
    c.router_jitter = 0.2f; c.jitter_seed = 11;
    moept_layer *A = make(c, 2), *B = make(c, 2);
    if (!A || !B) return;
    float x[48], y[48], la[2][24];
    unsigned long long s = 9;
    tu_fill(x, 48, 1.0, &s);
    const float *lg = NULL;
    for (int k = 0; k < 2; k++) {
        EXPECT_OK(moept_forward(A, x, 6, y));
        moept_routing(A, NULL, NULL, &lg);
        memcpy(la[k], lg, sizeof la[k]);
        EXPECT_OK(moept_forward(B, x, 6, y));
        moept_routing(B, NULL, NULL, &lg);
        EXPECT(!memcmp(la[k], lg, sizeof la[k]), "forward %d: two layers with one seed drew differently", k);
    }
    EXPECT(memcmp(la[0], la[1], sizeof la[0]) != 0, "two training forwards drew the same noise");
    moept_forward_opts o = {NULL, 1, NULL, NULL, 0};
    EXPECT_OK(moept_forward_ex(A, x, 6, y, &o));
    moept_routing(A, NULL, NULL, &lg);
    float plain[24];
    moept__gemm g = moept__gemm_make(0, 1, 6, 4, 8, x, 8, A->par.w_router, 8, 0.0f, plain, 4);
    moept__gemm_run(&g, 1, &A->ws.gws);
    EXPECT(!memcmp(plain, lg, sizeof plain), "an evaluation forward jittered the router");
    moept_destroy(A);
    moept_destroy(B);
}

int main(void) {
    RUN(test_mask);
    RUN(test_eval_between);
    RUN(test_inference_layer);
    RUN(test_jitter_noise);
    RUN(test_dropless_plan);
    RUN(test_capacity);
    RUN(test_activations_and_shared);
    RUN(test_k_equals_e_is_dense);
    RUN(test_zero_aux_coef_no_gradient);
    RUN(test_megatron_is_hf_over_k);
    RUN(test_ties_lower_index);
    RUN(test_topk_is_a_sorted_prefix);
    RUN(test_group_limited);
    RUN(test_deterministic_across_threads);
    RUN(test_no_allocations_in_steady_state);
    RUN(test_zero_tokens);
    RUN(test_update_bias);
    RUN(test_gemm_all_transposes);
#ifdef MOEPT_CBLAS
    tu_skip("test_gemm_thread_splits", "the builtin GEMM's thread splits; this build's GEMM is OpenBLAS");
#else
    RUN(test_gemm_thread_splits);
#endif
    RUN(test_gpu_plan_emulated);
    RUN(test_host_plan);
    RUN(test_chunk_of_token);
    RUN(test_cublas_arguments);
    RUN(test_bf16_rounding);
    RUN(test_activation_rows);
    return tu_done();
}
