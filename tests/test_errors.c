/* Bad input: every invalid config field is rejected at create with a message
   naming it; non-finite inputs, NULL pointers, oversize batches and bad names
   give errors and leave the layer exactly as it was. */
#include "../moept.c"
#include "testutil.h"

static moept_config good(void) {
    moept_config c = {0};
    c.family = MOEPT_FAMILY_DEEPSEEK_V3;
    c.hidden_size = 8; c.intermediate_size = 6; c.num_experts = 8; c.top_k = 2;
    c.n_group = 4; c.topk_group = 2; c.max_tokens = 16;
    return c;
}

typedef struct mut { const char *field; void (*apply)(moept_config *); } mut;
#define MUT(name, field, body) static void name(moept_config *c) { body; }
MUT(m_family, family, c->family = (moept_family)9)
MUT(m_d0, hidden_size, c->hidden_size = 0)
MUT(m_dneg, hidden_size, c->hidden_size = -5)
MUT(m_f0, intermediate_size, c->intermediate_size = 0)
MUT(m_e0, num_experts, c->num_experts = 0)
MUT(m_ebig, num_experts, c->num_experts = 1 << 20)
MUT(m_k0, top_k, c->top_k = 0)
MUT(m_kbig, top_k, c->top_k = 9)
MUT(m_norm, norm_topk_prob, c->norm_topk_prob = 2)
MUT(m_act, activation, c->activation = (moept_activation)7)
MUT(m_s, shared_intermediate_size, c->shared_intermediate_size = -1)
MUT(m_sg, shared_gate, c->shared_gate = (moept_shared_gate)5)
MUT(m_ng, n_group, c->n_group = 3)
MUT(m_ng2, n_group, c->n_group = 8)  /* one expert per group */
MUT(m_tg, topk_group, c->topk_group = 5)
MUT(m_tgk, top_k, c->topk_group = 1; c->top_k = 3) /* more than one group holds */
MUT(m_ngfam, n_group, c->family = MOEPT_FAMILY_MIXTRAL)
MUT(m_rsf, routed_scaling_factor, c->routed_scaling_factor = -1.0f)
MUT(m_rsfnan, routed_scaling_factor, c->routed_scaling_factor = NAN)
MUT(m_rsffam, routed_scaling_factor, c->family = MOEPT_FAMILY_OLMOE; c->n_group = 1; c->topk_group = 1; c->routed_scaling_factor = 2.0f)
MUT(m_gfill, group_fill, c->group_fill = (moept_group_fill)2)
MUT(m_aux, aux_loss, c->aux_loss = (moept_aux_loss)4)
MUT(m_auxc, aux_loss_coef, c->aux_loss = MOEPT_AUX_HF; c->aux_loss_coef = -0.1f)
MUT(m_auxnone, aux_loss_coef, c->aux_loss_coef = 0.1f)
MUT(m_z, z_loss_coef, c->z_loss_coef = INFINITY)
MUT(m_cap, capacity_factor, c->capacity_factor = -1.0f)
MUT(m_max, max_tokens, c->max_tokens = 0)
MUT(m_seq0, aux_seq_len, c->aux_loss = MOEPT_AUX_SEQ)
MUT(m_seqbig, aux_seq_len, c->aux_loss = MOEPT_AUX_SEQ; c->aux_seq_len = 17)
MUT(m_seqoff, aux_seq_len, c->aux_loss = MOEPT_AUX_MEGATRON; c->aux_seq_len = 4)
MUT(m_inf, inference_only, c->inference_only = 2)
MUT(m_gb, grad_backup, c->grad_backup = -1)

static void test_invalid_config_fields(void) {
    static const mut muts[] = {
        {"config.family", m_family}, {"config.hidden_size", m_d0}, {"config.hidden_size", m_dneg},
        {"config.intermediate_size", m_f0}, {"config.num_experts", m_e0}, {"config.num_experts", m_ebig},
        {"config.top_k", m_k0}, {"config.top_k", m_kbig}, {"config.norm_topk_prob", m_norm},
        {"config.activation", m_act}, {"config.shared_intermediate_size", m_s}, {"config.shared_gate", m_sg},
        {"config.n_group", m_ng}, {"config.n_group", m_ng2}, {"config.topk_group", m_tg}, {"config.top_k", m_tgk},
        {"config.n_group", m_ngfam}, {"config.routed_scaling_factor", m_rsf},
        {"config.routed_scaling_factor", m_rsfnan}, {"config.routed_scaling_factor", m_rsffam},
        {"config.group_fill", m_gfill},
        {"config.aux_loss", m_aux}, {"config.aux_loss_coef", m_auxc}, {"config.aux_loss_coef", m_auxnone},
        {"config.z_loss_coef", m_z}, {"config.capacity_factor", m_cap}, {"config.max_tokens", m_max},
        {"config.aux_seq_len", m_seq0}, {"config.aux_seq_len", m_seqbig}, {"config.aux_seq_len", m_seqoff},
        {"config.inference_only", m_inf}, {"config.grad_backup", m_gb}};
    moept_config c = good();
    moept_layer *L = (moept_layer *)1;
    EXPECT(moept_create(&c, &L) == MOEPT_OK, "the base config must be valid: %s", moept_last_error(NULL));
    moept_destroy(L);
    for (size_t i = 0; i < sizeof muts / sizeof muts[0]; i++) {
        c = good();
        muts[i].apply(&c);
        L = (moept_layer *)1;
        moept_status s = moept_create(&c, &L);
        EXPECT(s == MOEPT_ERR_INVALID_ARGUMENT, "%s: accepted (status %d)", muts[i].field, s);
        EXPECT(L == NULL, "%s: *out not cleared on failure", muts[i].field);
        EXPECT(strstr(moept_last_error(NULL), muts[i].field) != NULL, "%s: message '%s' does not name it",
               muts[i].field, moept_last_error(NULL));
        if (s == MOEPT_OK) moept_destroy(L);
    }
    EXPECT(moept_create(NULL, &L) == MOEPT_ERR_INVALID_ARGUMENT, "NULL config accepted");
    EXPECT(moept_create(&c, NULL) == MOEPT_ERR_INVALID_ARGUMENT, "NULL out accepted");
}

/* a full snapshot of everything the caller can observe */
typedef struct snap { float *params; moept_stats st; float *logits, *w; int32_t *ids; int64_t T; } snap;
static snap take(moept_layer *L) {
    snap s;
    size_t pb = (size_t)(2 * L->par.n_params + L->E) * 4;
    s.params = malloc(pb);
    memcpy(s.params, L->par.params, pb);
    moept_get_stats(L, &s.st, NULL);
    s.T = moept__last(L)->fwd.T;
    s.logits = malloc((size_t)(L->Tmax * L->E) * 4);
    s.w = malloc((size_t)(L->Tmax * L->K) * 4);
    s.ids = malloc((size_t)(L->Tmax * L->K) * 4);
    const int32_t *ids; const float *w, *lg;
    if (moept_routing(L, &ids, &w, &lg) == MOEPT_OK) {
        memcpy(s.logits, lg, (size_t)(moept__last(L)->fwd.T * L->E) * 4);
        memcpy(s.w, w, (size_t)(moept__last(L)->fwd.T * L->K) * 4);
        memcpy(s.ids, ids, (size_t)(moept__last(L)->fwd.T * L->K) * 4);
    }
    return s;
}
static int same(moept_layer *L, snap *a) {
    snap b = take(L);
    int64_t T = a->T > 0 ? a->T : 0;
    int ok = memcmp(a->params, b.params, (size_t)(2 * L->par.n_params + L->E) * 4) == 0 &&
             memcmp(&a->st, &b.st, sizeof a->st) == 0 && a->T == b.T &&
             memcmp(a->logits, b.logits, (size_t)(T * L->E) * 4) == 0 &&
             memcmp(a->w, b.w, (size_t)(T * L->K) * 4) == 0 &&
             memcmp(a->ids, b.ids, (size_t)(T * L->K) * 4) == 0;
    free(b.params); free(b.logits); free(b.w); free(b.ids);
    return ok;
}
static void drop(snap *s) { free(s->params); free(s->logits); free(s->w); free(s->ids); }

static void test_nonfinite_input_leaves_layer_unchanged(void) {
    moept_config c = good();
    c.shared_intermediate_size = 6;
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    moept_init_params(L, 1);
    unsigned long long s = 1;
    float x[16 * 8], y[16 * 8] = {0}, dy[16 * 8], dx1[16 * 8], dx2[16 * 8], y2[16 * 8];
    tu_fill(x, 128, 1.0, &s);
    tu_fill(dy, 128, 1.0, &s);
    EXPECT_OK(moept_forward(L, x, 10, y));
    snap before = take(L);
    /* NaN in x, Inf in x, finite x whose logits overflow */
    float bad[16 * 8];
    for (int kind = 0; kind < 3; kind++) {
        memcpy(bad, x, sizeof bad);
        if (kind == 0) bad[37] = NAN;
        if (kind == 1) bad[5] = -INFINITY;
        if (kind == 2) /* finite x aligned with expert 0's router row: its logit overflows */
            for (int i = 0; i < 128; i++) bad[i] = L->par.w_router[i % 8] >= 0 ? 3e38f : -3e38f;
        memcpy(y2, y, sizeof y);
        moept_status st = moept_forward(L, bad, 12, y2);
        EXPECT(st == MOEPT_ERR_NUMERIC, "non-finite input kind %d: status %d", kind, st);
        EXPECT(strlen(moept_last_error(L)) > 0, "no message");
        EXPECT(same(L, &before), "kind %d: the layer changed on a rejected forward", kind);
        EXPECT(memcmp(y2, y, sizeof y) == 0, "kind %d: y written on a rejected forward", kind);
    }
    /* the earlier forward is still the one backward differentiates */
    EXPECT_OK(moept_backward(L, x, dy, dx1));
    float *g1 = malloc((size_t)L->par.n_params * 4);
    memcpy(g1, L->par.grads, (size_t)L->par.n_params * 4);
    moept_zero_grad(L);
    EXPECT_OK(moept_forward(L, x, 10, y2));
    EXPECT_OK(moept_backward(L, x, dy, dx2));
    EXPECT(memcmp(g1, L->par.grads, (size_t)L->par.n_params * 4) == 0, "gradients after a rejected step differ");
    EXPECT(memcmp(dx1, dx2, (size_t)(10 * 8) * 4) == 0, "dx after a rejected step differs");
    /* a second backward of one forward: rejected (its saved rows are consumed), nothing changes */
    snap s3 = take(L);
    EXPECT(moept_backward(L, x, dy, dx1) == MOEPT_ERR_STATE, "a second backward of one forward accepted");
    EXPECT(same(L, &s3), "layer changed on a rejected second backward");
    /* NaN in dy: rejected, gradients untouched; the step can still be differentiated */
    EXPECT_OK(moept_forward(L, x, 10, y2));
    snap s2 = take(L);
    dy[3] = NAN;
    EXPECT(moept_backward(L, x, dy, dx1) == MOEPT_ERR_NUMERIC, "NaN dy accepted");
    EXPECT(same(L, &s2), "layer changed on a rejected backward");
    dy[3] = 0.5f;
    EXPECT_OK(moept_backward(L, x, dy, dx1));
    free(g1); drop(&before); drop(&s2); drop(&s3);
    moept_destroy(L);
}

/* MOEPT_AUX_SEQ: a batch that is not whole sequences is rejected, the
   layer as it was */
static void test_seq_aux_partial_sequence(void) {
    moept_config c = good();
    c.aux_loss = MOEPT_AUX_SEQ; c.aux_seq_len = 4; c.aux_loss_coef = 0.01f;
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    moept_init_params(L, 1);
    unsigned long long s = 2;
    float x[16 * 8], y[16 * 8];
    tu_fill(x, 128, 1.0, &s);
    EXPECT_OK(moept_forward(L, x, 12, y));
    snap before = take(L);
    EXPECT(moept_forward(L, x, 10, y) == MOEPT_ERR_INVALID_ARGUMENT, "10 tokens in sequences of 4 accepted");
    EXPECT(strstr(moept_last_error(L), "aux_seq_len") != NULL, "message '%s'", moept_last_error(L));
    EXPECT(same(L, &before), "the layer changed on a rejected forward");
    EXPECT_OK(moept_forward(L, x, 0, y));
    drop(&before);
    moept_destroy(L);
}

/* The largest finite capacity_factor: no float -> int64 overflow (UBSan in
   the sanitizer build), capacity capped at T K, the step the dropless one. */
static void test_huge_capacity_factor(void) {
    moept_config c = good();
    moept_layer *A, *B;
    EXPECT_OK(moept_create(&c, &A));
    c.capacity_factor = 3.4e38f;
    EXPECT_OK(moept_create(&c, &B));
    moept_init_params(A, 4);
    moept_init_params(B, 4);
    unsigned long long s = 2;
    float x[16 * 8], ya[16 * 8], yb[16 * 8];
    tu_fill(x, 128, 1.0, &s);
    EXPECT_OK(moept_forward(A, x, 16, ya));
    EXPECT_OK(moept_forward(B, x, 16, yb));
    moept_stats st;
    moept_get_stats(B, &st, NULL);
    EXPECT(st.capacity == 16 * 2 && st.dropped_rows == 0, "capacity %lld, dropped %lld", (long long)st.capacity,
           (long long)st.dropped_rows);
    EXPECT(memcmp(ya, yb, sizeof ya) == 0, "not the dropless step");
    moept_destroy(A);
    moept_destroy(B);
}

/* moept.h's aliasing contract: y over x and dx over dy give the unaliased
   results bitwise; dx over x (which gave wrong weight gradients) is
   rejected, the layer unchanged, the step still differentiable. */
static void test_aliasing(void) {
    moept_config c = good();
    c.shared_intermediate_size = 6;
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    moept_init_params(L, 6);
    enum { T = 12, N = 12 * 8 };
    unsigned long long s = 5;
    float x[N], dy[N], y[N], dx[N], b[N];
    tu_fill(x, N, 1.0, &s);
    tu_fill(dy, N, 1.0, &s);
    EXPECT_OK(moept_forward(L, x, T, y));
    EXPECT_OK(moept_backward(L, x, dy, dx));
    float *g0 = malloc((size_t)L->par.n_params * 4);
    memcpy(g0, L->par.grads, (size_t)L->par.n_params * 4);
    memcpy(b, x, sizeof b);
    moept_zero_grad(L);
    EXPECT_OK(moept_forward(L, b, T, b));
    EXPECT(memcmp(b, y, sizeof b) == 0, "y over x differs");
    EXPECT_OK(moept_forward(L, x, T, y));
    memcpy(b, dy, sizeof b);
    EXPECT_OK(moept_backward(L, x, b, b));
    EXPECT(memcmp(b, dx, sizeof b) == 0 && memcmp(g0, L->par.grads, (size_t)L->par.n_params * 4) == 0, "dx over dy differs");
    moept_zero_grad(L);
    EXPECT_OK(moept_forward(L, x, T, y));
    snap before = take(L);
    float big[N + 8];
    memcpy(big, x, sizeof x);
    moept_status st = moept_backward(L, big, dy, big + 8); /* dx one row into x: overlapping */
    EXPECT(st == MOEPT_ERR_INVALID_ARGUMENT && strstr(moept_last_error(L), "dx overlaps x"), "dx over x: %d (%s)",
           (int)st, moept_last_error(L));
    EXPECT(same(L, &before), "the rejected backward changed the layer");
    EXPECT_OK(moept_backward(L, x, dy, dx));
    EXPECT(memcmp(g0, L->par.grads, (size_t)L->par.n_params * 4) == 0, "gradients after the rejected backward differ");
    drop(&before);
    free(g0);
    moept_destroy(L);
}

/* Backward must get the forward's x: another buffer with other values, x
   changed by one element since, or x overwritten by the forward's own y
   (y over x) is rejected, the layer unchanged; the forward's x (or an
   equal copy) then works. Before, each returned OK with wrong gradients. */
static void test_backward_needs_forwards_x(void) {
    moept_config c = good();
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    moept_init_params(L, 7);
    enum { T = 12, N = 12 * 8 };
    unsigned long long s = 9;
    float x[N], dy[N], y[N], dx[N], b[N];
    tu_fill(x, N, 1.0, &s);
    tu_fill(dy, N, 1.0, &s);
    EXPECT_OK(moept_forward(L, x, T, y));
    snap before = take(L);
    memcpy(b, x, sizeof b);
    b[N - 1] += 1e-3f;
    moept_status st = moept_backward(L, b, dy, dx);
    EXPECT(st == MOEPT_ERR_INVALID_ARGUMENT && strstr(moept_last_error(L), "not the last forward's x"),
           "one element changed: %d (%s)", (int)st, moept_last_error(L));
    EXPECT(same(L, &before), "the rejected backward changed the layer");
    drop(&before);
    memcpy(b, x, sizeof b);
    EXPECT_OK(moept_backward(L, b, dy, dx)); /* an equal copy is the same x */
    memcpy(b, x, sizeof b);
    EXPECT_OK(moept_forward(L, b, T, b));   /* y over x: x is gone */
    st = moept_backward(L, b, dy, dx);
    EXPECT(st == MOEPT_ERR_INVALID_ARGUMENT, "backward after y over x: %d (%s)", (int)st, moept_last_error(L));
    EXPECT_OK(moept_backward(L, x, dy, dx)); /* the original values still differentiate it */
    moept_destroy(L);
}

static void test_null_and_sizes(void) {
    moept_config c = good();
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    float x[17 * 8] = {0}, y[17 * 8];
    snap s = take(L);
    EXPECT(moept_forward(NULL, x, 1, y) == MOEPT_ERR_INVALID_ARGUMENT, "NULL layer");
    EXPECT(moept_forward(L, NULL, 1, y) == MOEPT_ERR_INVALID_ARGUMENT, "NULL x");
    EXPECT(moept_forward(L, x, 1, NULL) == MOEPT_ERR_INVALID_ARGUMENT, "NULL y");
    EXPECT(moept_forward(L, x, 17, y) == MOEPT_ERR_INVALID_ARGUMENT, "more tokens than max_tokens accepted");
    EXPECT(strstr(moept_last_error(L), "max_tokens") != NULL, "message does not say max_tokens: %s", moept_last_error(L));
    EXPECT(moept_forward(L, x, -1, y) == MOEPT_ERR_INVALID_ARGUMENT, "negative tokens accepted");
    EXPECT(moept_backward(L, x, x, y) == MOEPT_ERR_STATE, "backward without forward accepted");
    EXPECT(moept_update_bias(L, 0.1f) == MOEPT_ERR_STATE, "update_bias without forward accepted");
    EXPECT(moept_routing(L, NULL, NULL, NULL) == MOEPT_ERR_STATE, "routing without forward accepted");
    EXPECT(same(L, &s), "layer changed by rejected calls");
    EXPECT_OK(moept_forward(L, x, 4, y));
    EXPECT(moept_backward(L, x, NULL, y) == MOEPT_ERR_INVALID_ARGUMENT, "NULL dy accepted");
    EXPECT(moept_backward(L, NULL, x, y) == MOEPT_ERR_INVALID_ARGUMENT, "NULL x accepted");
    EXPECT(moept_backward(L, x, x, NULL) == MOEPT_ERR_INVALID_ARGUMENT, "NULL dx accepted");
    EXPECT(moept_update_bias(L, NAN) == MOEPT_ERR_INVALID_ARGUMENT, "NaN rate accepted");
    EXPECT(moept_zero_grad(NULL) == MOEPT_ERR_INVALID_ARGUMENT, "zero_grad(NULL)");
    EXPECT(moept_get_stats(L, NULL, NULL) == MOEPT_ERR_INVALID_ARGUMENT, "get_stats(NULL)");
    float *p; int64_t n;
    EXPECT(moept_params(L, NULL, &n) == MOEPT_ERR_INVALID_ARGUMENT && moept_grads(L, &p, NULL) == MOEPT_ERR_INVALID_ARGUMENT, "params/grads NULL");
    moept_param_info pi;
    EXPECT(moept_param_info_at(L, moept_param_count(L), &pi) == MOEPT_ERR_INVALID_ARGUMENT, "index past the end");
    moept_destroy(NULL); /* no-op */
    drop(&s);
    moept_destroy(L);
    /* update_bias on a family without a bias */
    c.family = MOEPT_FAMILY_MIXTRAL; c.n_group = 1; c.topk_group = 1;
    EXPECT_OK(moept_create(&c, &L));
    EXPECT_OK(moept_forward(L, x, 2, y));
    EXPECT(moept_update_bias(L, 0.1f) == MOEPT_ERR_INVALID_ARGUMENT, "mixtral update_bias accepted");
    moept_destroy(L);
}

static void test_param_names(void) {
    moept_config c = good();
    c.shared_intermediate_size = 4;
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    moept_init_params(L, 3);
    snap s = take(L);
    float w[6 * 8] = {0}, nanw[6 * 8] = {0};
    nanw[7] = NAN;
    EXPECT(moept_set_param(L, "experts.8.gate_proj.weight", w, 48) == MOEPT_ERR_NOT_FOUND, "expert 8 of 8 accepted");
    EXPECT(moept_set_param(L, "experts.0.w1.weight", w, 48) == MOEPT_ERR_NOT_FOUND, "mixtral name in deepseek accepted");
    EXPECT(moept_set_param(L, "experts.0.gate_proj.weight", w, 47) == MOEPT_ERR_INVALID_ARGUMENT, "wrong numel accepted");
    EXPECT(moept_set_param(L, "experts.0.gate_proj.weight", nanw, 48) == MOEPT_ERR_NUMERIC, "NaN weights accepted");
    EXPECT(moept_set_param(L, NULL, w, 48) == MOEPT_ERR_INVALID_ARGUMENT, "NULL name accepted");
    EXPECT(moept_set_param(L, "gate.weight", NULL, 64) == MOEPT_ERR_INVALID_ARGUMENT, "NULL data accepted");
    EXPECT(moept_get_grad(L, "gate.e_score_correction_bias", w, 8) == MOEPT_ERR_NOT_FOUND, "bias has no gradient");
    EXPECT(same(L, &s), "rejected set_param changed the layer");
    /* every family's names resolve */
    static const char *names[4][4] = {
        {"gate.weight", "experts.2.w1.weight", "experts.2.w3.weight", "experts.2.w2.weight"},
        {"shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight", "shared_expert_gate.weight"},
        {"gate.weight", "experts.2.gate_proj.weight", "experts.2.up_proj.weight", "experts.2.down_proj.weight"},
        {"gate.e_score_correction_bias", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"}};
    for (int f = 0; f < 4; f++) {
        moept_config d = {0};
        d.family = (moept_family)f; d.hidden_size = 8; d.intermediate_size = 6; d.num_experts = 4; d.top_k = 2;
        d.max_tokens = 4; d.shared_intermediate_size = f == 1 || f == 3 ? 4 : 0;
        moept_layer *M;
        EXPECT_OK(moept_create(&d, &M));
        for (int i = 0; i < 4; i++) {
            const moept__param *p = moept__find(M, names[f][i]);
            EXPECT(p != NULL, "family %d: no parameter '%s'", f, names[f][i]);
        }
        moept_destroy(M);
    }
    drop(&s);
    moept_destroy(L);
}

static void test_bad_files(void) {
    moept_st_file *f = (moept_st_file *)1;
    EXPECT(moept_st_open("/nonexistent/file.safetensors", &f) == MOEPT_ERR_IO && f == NULL, "missing file");
    const char *path = "build/test_errors_tmp.safetensors";
    static const char *headers[] = {
        "{", "[]", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}",
        "{\"a\":{\"dtype\":\"Q9\",\"shape\":[1],\"data_offsets\":[0,4]}}",
        "{\"__metadata__\":{\"k\":1}}"};
    for (size_t i = 0; i < sizeof headers / sizeof headers[0]; i++) {
        FILE *fp = fopen(path, "wb");
        if (!fp) { EXPECT(0, "cannot write %s", path); return; }
        uint64_t n = strlen(headers[i]);
        unsigned char len[8];
        for (int b = 0; b < 8; b++) len[b] = (unsigned char)(n >> (8 * b));
        fwrite(len, 1, 8, fp);
        fwrite(headers[i], 1, n, fp);
        fwrite("\0\0\0\0", 1, 4, fp);
        fclose(fp);
        f = (moept_st_file *)1;
        EXPECT(moept_st_open(path, &f) == MOEPT_ERR_FORMAT && f == NULL, "header '%s' accepted", headers[i]);
    }
    remove(path);
}

/* Special files are refused before they can block, and a symlink loop is an
   error, not "no index": a FIFO as a safetensors file, as a Hugging Face
   index and as a checkpoint's index.json; a self-looping index link. Each
   open(2) of a FIFO would wait forever for a writer: alarm() turns a hang
   into a failure. */
static void test_special_files(void) {
    const char *dir = "build/test_errors_special";
    char p[256];
    mkdir(dir, 0755);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    remove(p);
    moept_config c = good();
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    alarm(20);
    moept_st_file *f = (moept_st_file *)1;
    EXPECT(mkfifo(p, 0644) == 0, "mkfifo %s", p);
    EXPECT(moept_st_open(p, &f) == MOEPT_ERR_IO && f == NULL && strstr(moept_last_error(NULL), "not a regular"),
           "a FIFO opened as a safetensors file: %s", moept_last_error(NULL));
    EXPECT(moept_load_hf(L, dir, 0) == MOEPT_ERR_IO && strstr(moept_last_error(L), "not a regular"),
           "a FIFO as the HF index: %s", moept_last_error(L));
    remove(p);
    EXPECT(symlink("model.safetensors.index.json", p) == 0, "symlink %s", p);
    moept_status st = moept_load_hf(L, dir, 0);
    EXPECT(st == MOEPT_ERR_IO && strstr(moept_last_error(L), "index.json"),
           "a self-looping index link: status %d, %s", (int)st, moept_last_error(L));
    remove(p);
    snprintf(p, sizeof p, "%s/index.json", dir);
    remove(p);
    EXPECT(mkfifo(p, 0644) == 0, "mkfifo %s", p);
    EXPECT(moept_load_checkpoint(L, dir) != MOEPT_OK && strstr(moept_last_error(L), "not a regular"),
           "a FIFO as a checkpoint's index.json: %s", moept_last_error(L));
    remove(p);
    alarm(0);
    rmdir(dir);
    moept_destroy(L);
}

/* One error channel: moept_last_error gives the calling thread's last
   failure whatever call it came from, through any argument (a NULL layer's
   call read through the layer showed the layer's older "y is NULL"; a
   layer's failure read through NULL, moept_create's); another thread's
   failures stay its own. AdamW refuses a rate that trains nothing or is
   not finite (lr 0 was accepted) and leaves the layer as it was. */
static void *fail_elsewhere(void *arg) {
    moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL);
    *(moept_status *)arg = moept_config_from_hf("build/test_errors_other_thread", 0, &c);
    return NULL;
}

static void test_one_error_channel(void) {
    moept_config c = good();
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    if (!L) return;
    float x[2 * 8] = {0}, y[2 * 8], dx[2 * 8];
    EXPECT(moept_forward(L, x, 1, NULL) == MOEPT_ERR_INVALID_ARGUMENT, "NULL y accepted");
    EXPECT(moept_forward(NULL, x, 1, y) == MOEPT_ERR_INVALID_ARGUMENT, "NULL layer accepted");
    EXPECT(strstr(moept_last_error(L), "layer is NULL") && strstr(moept_last_error(NULL), "layer is NULL"),
           "a NULL layer's forward read through the layer: '%s', through NULL: '%s'", moept_last_error(L),
           moept_last_error(NULL));
    EXPECT(moept_forward(L, x, 17, y) == MOEPT_ERR_INVALID_ARGUMENT, "17 tokens accepted");
    EXPECT(strstr(moept_last_error(NULL), "max_tokens") && strstr(moept_last_error(L), "max_tokens"),
           "the layer's failure read through NULL: '%s'", moept_last_error(NULL));
    moept_config h = moept_config_default(MOEPT_FAMILY_MIXTRAL);
    EXPECT(moept_config_from_hf("build/test_errors_no_model", 0, &h) == MOEPT_ERR_IO, "a missing config.json");
    EXPECT(strstr(moept_last_error(L), "test_errors_no_model"), "the config reader's failure read through the "
           "layer: '%s'", moept_last_error(L));
    moept_status other = MOEPT_OK;
    tu_threads(1, fail_elsewhere, &other, sizeof other);
    EXPECT(other == MOEPT_ERR_IO && strstr(moept_last_error(L), "test_errors_no_model"),
           "another thread's failure (%d) shows here: '%s'", (int)other, moept_last_error(L));
    /* AdamW: lr <= 0 or not finite is refused, naming lr; nothing changes */
    moept_init_params(L, 3);
    EXPECT_OK(moept_forward(L, x, 2, y));
    EXPECT_OK(moept_backward(L, x, x, dx));
    snap s = take(L);
    const float lrs[4] = {0.0f, -1e-3f, NAN, INFINITY};
    for (int i = 0; i < 4; i++) {
        moept_adamw o = {lrs[i], 0.9f, 0.999f, 1e-8f, 0.0f};
        moept_status st = moept_adamw_step(L, &o);
        EXPECT(st == MOEPT_ERR_INVALID_ARGUMENT && strstr(moept_last_error(L), "lr"), "lr %g: status %d (%s)",
               (double)lrs[i], (int)st, moept_last_error(L));
    }
    EXPECT(same(L, &s) && L->opt.m == NULL, "a refused AdamW step changed the layer");
    moept_adamw o = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f};
    EXPECT_OK(moept_adamw_step(L, &o));
    EXPECT(!same(L, &s), "lr 1e-3 trained nothing");
    drop(&s);
    moept_destroy(L);
}

/* moept_abi_layout's writer: a line longer than any fixed line buffer is
   written whole, and a buffer too short for it keeps what fits, terminated
   (a copy of snprintf's untruncated length out of a short buffer read past it) */
static void test_abi_long_line(void) {
    char name[400], out[1024];
    memset(name, 'n', sizeof name - 1);
    name[sizeof name - 1] = '\0';
    moept__abi_out o = {out, sizeof out - 1, 0};
    moept__abi_put(&o, "field %s.%s %lld %lld\n", name, "f", 7, 8);
    out[o.n < o.cap ? o.n : o.cap] = '\0';
    char want[1024];
    int wn = snprintf(want, sizeof want, "field %s.f 7 8\n", name);
    EXPECT(o.n == wn && !strcmp(out, want), "a %d-byte line: %lld bytes counted, '%.40s...' written", wn,
           (long long)o.n, out);
    char small[100];
    memset(small, 'x', sizeof small);
    moept__abi_out s = {small, sizeof small - 1, 0};
    moept__abi_put(&s, "field %s.%s %lld %lld\n", name, "f", 7, 8);
    small[s.n < s.cap ? s.n : s.cap] = '\0';
    EXPECT(s.n == wn && strlen(small) == sizeof small - 1 && !strncmp(small, want, sizeof small - 1),
           "a %d-byte line into 100 bytes: %lld counted, %zu kept", wn, (long long)s.n, strlen(small));
}

/* Every AdamW hyperparameter is taken as given: 0 is 0, not a default.
   From fresh moments with betas 0 (m = g, v = g^2, bias corrections 1) and
   no decay, one step is p - lr g / (|g| + eps), worked here in double. eps
   0 is refused (it would divide by zero where g is 0). */
static void test_adamw_zeros_are_zeros(void) {
    moept_config cfg = good();
    moept_layer *L = NULL;
    EXPECT_OK(moept_create(&cfg, &L));
    if (!L) return;
    float x[2 * 8], y[2 * 8], dx[2 * 8];
    for (int i = 0; i < 2 * 8; i++) x[i] = 0.1f * (float)(i % 7) - 0.3f;
    moept_init_params(L, 4);
    EXPECT_OK(moept_forward(L, x, 2, y));
    EXPECT_OK(moept_backward(L, x, x, dx));
    const int64_t n = L->par.n_params;
    double *want = malloc((size_t)n * sizeof(double));
    const double lr = 1e-2, eps = 1e-3;
    for (int64_t i = 0; i < n; i++) {
        double g = L->par.grads[i];
        want[i] = L->par.params[i] - lr * g / (fabs(g) + eps);
    }
    moept_adamw o = {(float)lr, 0.9f, 0.999f, 0.0f, 0.0f};
    moept_status st = moept_adamw_step(L, &o);
    EXPECT(st == MOEPT_ERR_INVALID_ARGUMENT && strstr(moept_last_error(L), "eps"), "eps 0: status %d (%s)",
           (int)st, moept_last_error(L));
    o = (moept_adamw){(float)lr, 0.0f, 0.0f, (float)eps, 0.0f};
    EXPECT_OK(moept_adamw_step(L, &o));
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) worst = fmax(worst, fabs(L->par.params[i] - want[i]));
    EXPECT(worst < 1e-6, "betas 0: the step is off by %g from p - lr g / (|g| + eps)", worst);
    moept_adamw d = moept_adamw_default(3e-4f);
    EXPECT(d.lr == 3e-4f && d.beta1 == 0.9f && d.beta2 == 0.999f && d.eps == 1e-8f && d.weight_decay == 0.01f,
           "moept_adamw_default is not torch.optim.AdamW's defaults");
    free(want);
    moept_destroy(L);
}

int main(void) {
    RUN(test_invalid_config_fields);
    RUN(test_nonfinite_input_leaves_layer_unchanged);
    RUN(test_seq_aux_partial_sequence);
    RUN(test_huge_capacity_factor);
    RUN(test_aliasing);
    RUN(test_backward_needs_forwards_x);
    RUN(test_null_and_sizes);
    RUN(test_param_names);
    RUN(test_bad_files);
    RUN(test_adamw_zeros_are_zeros);
    RUN(test_abi_long_line);
    RUN(test_special_files);
    RUN(test_one_error_channel);
    return tu_done();
}
