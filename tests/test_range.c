/* No argument used before it is checked: every public call that takes an
   index, a length, a pointer or an enum gets each out-of-range class (-1,
   the bound itself, 2^30, INT_MIN or INT64_MIN, NULL) and must return its
   documented status with the layer as it was: parameters, gradients,
   statistics, routing and both pending forwards (each then differentiates,
   its dx bitwise the one it gave before the probes). Run under ASan+UBSan
   in make test, where a read before the check is a report, not luck. Built
   for both executors (tu_exec.h): CPU layers, and (MOEPT_CUDA) CUDA layers
   on the emulated GPU. */
#include "../moept.h"
#include "testutil.h"
#include "tu_exec.h"
#include <limits.h>
#include <stdint.h>

#define TOK 8
#define DIM 16
#define NE 4
#define TOPK 2
#define SLOTS 2
#define NB ((size_t)(TOK * DIM) * sizeof(float))

/* the int classes of an index whose valid range is 0..bound-1 */
#define INT_CLASSES(bound) {-1, (bound), 1 << 30, INT_MIN}
#define I64_CLASSES(bound) {-1, (bound), (int64_t)1 << 30, INT64_MIN}

typedef struct state {
    uint64_t params, grads;
    int64_t steps, tokens, routed, masked, tpe[NE];
    float aux;
    int32_t ids[TOK * TOPK], place[NE];
} state;

/* what a refused call must leave as it was (the host's copies of a CUDA layer's) */
static void state_of(moept_layer *L, state *s) {
    memset(s, 0, sizeof *s);
    int64_t n = 0;
    float *p = tu_buf(L, MOEPT_BUF_PARAMS, &n), *g = tu_buf(L, MOEPT_BUF_GRADS, &n);
    if (p) s->params = tu_hash(p, n);
    if (g) s->grads = tu_hash(g, n);
    free(p);
    free(g);
    moept_stats st;
    if (!moept_get_stats(L, &st, s->tpe)) {
        s->steps = st.steps, s->tokens = st.tokens, s->routed = st.routed_rows;
        s->masked = st.masked_tokens, s->aux = st.aux_loss;
    }
    const int32_t *ids = NULL;
    if (!moept_routing(L, &ids, NULL, NULL) && ids) memcpy(s->ids, ids, sizeof s->ids);
    moept_get_placement(L, s->place);
}

static moept_config range_cfg(void) {
    moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL);
    c.hidden_size = DIM; c.intermediate_size = 12; c.num_experts = NE; c.top_k = TOPK;
    c.max_tokens = TOK; c.max_inflight = SLOTS;
    return c;
}

/* the test's buffers where the layer reads them */
typedef struct bufs { float *x, *y, *dy, *dx; int32_t *rep; } bufs;
static bufs g_b;
static moept_layer *g_L;
static state g_before;
static float g_dx0[SLOTS][TOK * DIM];

/* one probe: a call with one argument out of range, its documented status */
typedef moept_status probe_fn(moept_layer *L, int64_t v);
static void probe(const char *what, probe_fn *fn, const int64_t *vals, int nv, moept_status want) {
    for (int i = 0; i < nv; i++) {
        moept_status st = fn(g_L, vals[i]);
        EXPECT(st == want, "%s = %lld: status %d, documented %d (%s)", what, (long long)vals[i], (int)st,
               (int)want, moept_last_error(g_L));
        EXPECT(st == MOEPT_OK || moept_last_error(g_L)[0], "%s = %lld: refused with no message", what,
               (long long)vals[i]);
        state now;
        state_of(g_L, &now);
        EXPECT(memcmp(&now, &g_before, sizeof now) == 0, "%s = %lld: the layer changed", what,
               (long long)vals[i]);
    }
}
#define PROBE(fn, vals, want) probe(#fn, fn, vals, (int)(sizeof vals / sizeof vals[0]), want)
static const int64_t k_null[] = {0};

/* ---- the probes: v is the out-of-range value (NULL probes ignore it) ---- */
static moept_status fwd_slot(moept_layer *L, int64_t v) {
    moept_forward_opts o = {0};
    o.slot = (int)v;
    return moept_forward_ex(L, g_b.x, TOK, g_b.y, &o);
}
static moept_status fwd_tokens(moept_layer *L, int64_t v) { return moept_forward(L, g_b.x, v, g_b.y); }
static moept_status fwd_x_null(moept_layer *L, int64_t v) {
    (void)v;
    return moept_forward(L, NULL, TOK, g_b.y);
}
static moept_status fwd_y_null(moept_layer *L, int64_t v) {
    (void)v;
    return moept_forward(L, g_b.x, TOK, NULL);
}
/* token 3's second expert */
static moept_status fwd_replay_id(moept_layer *L, int64_t v) {
    int32_t rep[TOK * TOPK];
    for (int i = 0; i < TOK * TOPK; i++) rep[i] = i % TOPK;
    rep[3 * TOPK + 1] = (int32_t)v;
    tu_to_dev(g_b.rep, rep, sizeof rep);
    moept_forward_opts o = {0};
    o.replay_ids = g_b.rep;
    return moept_forward_ex(L, g_b.x, TOK, g_b.y, &o);
}
static moept_status bwd_slot(moept_layer *L, int64_t v) {
    moept_backward_opts o = moept_backward_default();
    o.slot = (int)v;
    return moept_backward_ex(L, g_b.x, g_b.dy, g_b.dx, &o);
}
static moept_status bwd_x_null(moept_layer *L, int64_t v) {
    (void)v;
    return moept_backward(L, NULL, g_b.dy, g_b.dx);
}
static moept_status bwd_dy_null(moept_layer *L, int64_t v) {
    (void)v;
    return moept_backward(L, g_b.x, NULL, g_b.dx);
}
static moept_status bwd_dx_null(moept_layer *L, int64_t v) {
    (void)v;
    return moept_backward(L, g_b.x, g_b.dy, NULL);
}
static moept_status info_at(moept_layer *L, int64_t v) {
    moept_param_info in;
    return moept_param_info_at(L, v, &in);
}
static moept_status info_null(moept_layer *L, int64_t v) { (void)v; return moept_param_info_at(L, 0, NULL); }
static float g_w[NE * DIM + 1];
static moept_status set_numel(moept_layer *L, int64_t v) { return moept_set_param(L, "gate.weight", g_w, v); }
static moept_status get_numel(moept_layer *L, int64_t v) { return moept_get_param(L, "gate.weight", g_w, v); }
static moept_status grad_numel(moept_layer *L, int64_t v) { return moept_get_grad(L, "gate.weight", g_w, v); }
static moept_status set_null(moept_layer *L, int64_t v) {
    (void)v;
    return moept_set_param(L, "gate.weight", NULL, NE * DIM);
}
static moept_status get_null(moept_layer *L, int64_t v) {
    (void)v;
    return moept_get_param(L, "gate.weight", NULL, NE * DIM);
}
static moept_status name_null(moept_layer *L, int64_t v) {
    (void)v;
    return moept_set_param(L, NULL, g_w, NE * DIM);
}
/* experts.<v>.w1.weight: an expert index in a name */
static moept_status name_expert(moept_layer *L, int64_t v) {
    char name[64];
    snprintf(name, sizeof name, "experts.%lld.w1.weight", (long long)v);
    return moept_get_param(L, name, g_w, 12 * DIM);
}
static moept_status reshard_rank(moept_layer *L, int64_t v) {
    int32_t nr[NE] = {0, 0, 0, 0};
    nr[2] = (int32_t)v;
    return moept_reshard(L, nr, NULL);
}
static moept_status reshard_null(moept_layer *L, int64_t v) { (void)v; return moept_reshard(L, NULL, NULL); }
static moept_status placement_null(moept_layer *L, int64_t v) {
    (void)v;
    return moept_get_placement(L, NULL);
}
static moept_status stats_null(moept_layer *L, int64_t v) { (void)v; return moept_get_stats(L, NULL, NULL); }
static moept_status rgrads_null(moept_layer *L, int64_t v) { (void)v; return moept_routing_grads(L, NULL); }
static moept_status params_null(moept_layer *L, int64_t v) {
    int64_t n;
    (void)v;
    return moept_params(L, NULL, &n);
}
static moept_status grads_null(moept_layer *L, int64_t v) {
    int64_t n;
    (void)v;
    return moept_grads(L, NULL, &n);
}
static moept_status norm_null(moept_layer *L, int64_t v) { (void)v; return moept_grad_norm(L, NULL); }
static moept_status fsdp_null(moept_layer *L, int64_t v) {
    int64_t a, b;
    (void)v;
    return moept_fsdp_shard(L, &a, &b, NULL);
}
static moept_status save_hf_null(moept_layer *L, int64_t v) { (void)v; return moept_save_hf(L, NULL, 1, 1); }
static moept_status adamw_null(moept_layer *L, int64_t v) { (void)v; return moept_adamw_step(L, NULL); }
static moept_status config_null(moept_layer *L, int64_t v) { (void)v; return moept_get_config(L, NULL); }
static moept_status load_hf_index(moept_layer *L, int64_t v) {
    return moept_load_hf(L, "tests/checkpoints/mixtral_e8_t40", v);
}
static moept_status load_hf_null(moept_layer *L, int64_t v) { (void)v; return moept_load_hf(L, NULL, 1); }
static moept_status save_hf_dtype(moept_layer *L, int64_t v) {
    return moept_save_hf_as(L, "/tmp/moept_range_never.safetensors", 1, 1, (moept_dtype)v);
}
static moept_status save_hf_index(moept_layer *L, int64_t v) {
    return moept_save_hf(L, "/tmp/moept_range_never.safetensors", v, 1);
}
static moept_status save_ckpt_null(moept_layer *L, int64_t v) {
    (void)v;
    return moept_save_checkpoint(L, NULL);
}
static moept_status load_ckpt_null(moept_layer *L, int64_t v) {
    (void)v;
    return moept_load_checkpoint(L, NULL);
}

/* the layer's calls, each class; then both pending forwards differentiate as before */
static void test_layer_calls(void) {
    static const int64_t slot[] = INT_CLASSES(SLOTS), tok[] = I64_CLASSES(TOK + 1);
    static const int64_t ids[] = INT_CLASSES(NE), ranks[] = INT_CLASSES(1);
    const int64_t idx[] = I64_CLASSES(moept_param_count(g_L));
    static const int64_t numel[] = {-1, NE * DIM + 1, (int64_t)1 << 30, INT64_MIN};
    static const int64_t expert[] = I64_CLASSES(NE), layer[] = {-1, INT64_MIN};
    static const int64_t dtype[] = {-1, MOEPT_DTYPE_BOOL + 1, 1 << 30, INT_MIN};
    PROBE(fwd_slot, slot, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(fwd_tokens, tok, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(fwd_x_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(fwd_y_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(fwd_replay_id, ids, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(bwd_slot, slot, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(bwd_x_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(bwd_dy_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(bwd_dx_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(info_at, idx, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(info_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(set_numel, numel, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(get_numel, numel, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(grad_numel, numel, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(set_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(get_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(name_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(name_expert, expert, MOEPT_ERR_NOT_FOUND);
    PROBE(reshard_rank, ranks, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(reshard_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(placement_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(stats_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(rgrads_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(params_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(adamw_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(grads_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(norm_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(fsdp_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(save_hf_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(config_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(load_hf_index, layer, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(load_hf_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(save_hf_dtype, dtype, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(save_hf_index, layer, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(save_ckpt_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    PROBE(load_ckpt_null, k_null, MOEPT_ERR_INVALID_ARGUMENT);
    for (int s = SLOTS - 1; s >= 0; s--) { /* the pending forwards, as they were */
        moept_backward_opts o = moept_backward_default();
        o.slot = s;
        float dx[TOK * DIM];
        EXPECT_OK(moept_backward_ex(g_L, g_b.x, g_b.dy, g_b.dx, &o));
        tu_to_host(dx, g_b.dx, NB);
        EXPECT(memcmp(dx, g_dx0[s], NB) == 0, "slot %d: dx after the probes differs from before", s);
    }
}

/* calls without a layer: create's config enums and sizes, the groups, the files */
typedef struct cfg_probe { const char *field; void (*set)(moept_config *, int64_t); } cfg_probe;
#define SETTER(f, type)                                                                                    \
    static void set_##f(moept_config *c, int64_t v) { c->f = (type)v; }
SETTER(family, moept_family) SETTER(activation, moept_activation) SETTER(aux_loss, moept_aux_loss)
SETTER(fp8, moept_fp8) SETTER(expert_sharding, moept_sharding) SETTER(shared_gate, moept_shared_gate)
SETTER(group_fill, moept_group_fill)
SETTER(norm_topk_prob, int) SETTER(hidden_size, int64_t) SETTER(num_experts, int64_t)
SETTER(top_k, int64_t) SETTER(max_tokens, int64_t) SETTER(max_inflight, int64_t)
SETTER(overlap_chunks, int64_t) SETTER(n_group, int64_t) SETTER(intermediate_size, int64_t)

static moept_status create(const moept_config *c, moept_layer **out) { return tu_layer(c, NULL, 0, out); }

static void test_create(void) {
    static const cfg_probe enums[] = {{"family", set_family}, {"activation", set_activation},
        {"aux_loss", set_aux_loss}, {"fp8", set_fp8}, {"expert_sharding", set_expert_sharding},
        {"group_fill", set_group_fill}, {"norm_topk_prob", set_norm_topk_prob},
        {"shared_gate", set_shared_gate}};
    static const cfg_probe sizes[] = {{"hidden_size", set_hidden_size}, {"num_experts", set_num_experts},
        {"top_k", set_top_k}, {"max_tokens", set_max_tokens}, {"max_inflight", set_max_inflight},
        {"overlap_chunks", set_overlap_chunks}, {"n_group", set_n_group},
        {"intermediate_size", set_intermediate_size}};
    /* (norm_topk_prob: -2, as -1 is MOEPT_NORM_OFF) */
    const int64_t ev[] = {-1, 1 << 30, INT_MIN}, sv[] = {-1, (int64_t)1 << 40, INT64_MIN};
    for (size_t f = 0; f < sizeof enums / sizeof enums[0] + sizeof sizes / sizeof sizes[0]; f++) {
        const int isenum = f < sizeof enums / sizeof enums[0];
        const cfg_probe *p = isenum ? &enums[f] : &sizes[f - sizeof enums / sizeof enums[0]];
        for (int i = 0; i < 3; i++) {
            moept_config c = range_cfg();
            const int64_t v = isenum && i == 0 && p->set == set_norm_topk_prob ? -2 : isenum ? ev[i] : sv[i];
            p->set(&c, v);
            moept_layer *L = (moept_layer *)&c; /* written NULL by a refusal */
            moept_status st = create(&c, &L);
            EXPECT(st == MOEPT_ERR_INVALID_ARGUMENT && !L && strstr(moept_last_error(NULL), p->field),
                   "config.%s = %lld: status %d (%s)", p->field, (long long)v, (int)st,
                   moept_last_error(NULL));
            if (!st) moept_destroy(L);
        }
    }
    moept_layer *L = NULL;
    EXPECT(create(NULL, &L) == MOEPT_ERR_INVALID_ARGUMENT && !L, "cfg NULL: accepted");
    moept_config c = range_cfg();
    EXPECT(create(&c, NULL) == MOEPT_ERR_INVALID_ARGUMENT, "out NULL: accepted");
#if TU_GPU
    static const int64_t bad[] = {-1, 5, 1 << 30, INT_MIN};
    for (int i = 0; i < 4; i++) {
        moept_cuda_options o = {MOEPT_DTYPE_F32, NULL, 0, 0, (moept_gemm_form)bad[i]};
        L = NULL;
        EXPECT(moept_create_cuda(&c, NULL, NULL, &o, &L) == MOEPT_ERR_INVALID_ARGUMENT && !L,
               "options.gemm_form = %lld: accepted", (long long)bad[i]);
        moept_cuda_options d = {(moept_dtype)bad[i], NULL, 0, 0, MOEPT_GEMM_AUTO};
        EXPECT(moept_create_cuda(&c, NULL, NULL, &d, &L) == MOEPT_ERR_INVALID_ARGUMENT && !L,
               "options.dtype = %lld: accepted", (long long)bad[i]);
    }
#endif
}

static void test_groups_and_files(void) {
    moept_thread_group *g = NULL;
    static const int sizes[] = {-1, 0, 4097, INT_MIN};
    for (int i = 0; i < 4; i++)
        EXPECT(moept_thread_group_create(sizes[i], 1000, &g) == MOEPT_ERR_INVALID_ARGUMENT && !g,
               "thread group of %d: accepted", sizes[i]);
    EXPECT(moept_thread_group_create(2, -1, &g) == MOEPT_ERR_INVALID_ARGUMENT, "timeout -1: accepted");
    EXPECT(moept_thread_group_create(2, 1000, NULL) == MOEPT_ERR_INVALID_ARGUMENT, "out NULL: accepted");
    EXPECT_OK(moept_thread_group_create(2, 1000, &g));
    static const int ranks[] = INT_CLASSES(2);
    for (int i = 0; g && i < 4; i++) {
        moept_comm *c = (moept_comm *)g;
        EXPECT(moept_comm_threads(g, ranks[i], &c) == MOEPT_ERR_INVALID_ARGUMENT, "rank %d of 2: accepted",
               ranks[i]);
    }
    EXPECT(moept_comm_threads(g, 0, NULL) == MOEPT_ERR_INVALID_ARGUMENT, "comm out NULL: accepted");
#if TU_GPU
    for (int i = 0; g && i < 5; i++) { /* every rank class, then a timeout of -1 */
        moept_comm *dc = (moept_comm *)g;
        EXPECT(moept_comm_cuda_threads(g, i < 4 ? ranks[i] : 0, NULL, i < 4 ? 1000 : -1, &dc) ==
                   MOEPT_ERR_INVALID_ARGUMENT && !dc, "cuda_threads rank %d timeout %d: accepted",
               i < 4 ? ranks[i] : 0, i < 4 ? 1000 : -1);
    }
    moept_comm *dc = NULL;
    EXPECT(moept_comm_cuda_threads(NULL, 0, NULL, 1000, &dc) == MOEPT_ERR_INVALID_ARGUMENT,
           "cuda_threads g NULL");
    EXPECT(moept_comm_nccl(NULL, NULL, 1000, &dc) == MOEPT_ERR_INVALID_ARGUMENT && !dc, "nccl comm NULL");
#endif
    moept_thread_group_destroy(g);
    /* config.json's layer index, the bound being num_hidden_layers */
    static const int64_t layers[] = {-1, 1 << 30, INT64_MIN};
    for (int i = 0; i < 3; i++) {
        moept_config c = range_cfg(), was = c;
        EXPECT(moept_config_from_hf("tests/checkpoints/mixtral_e8_t40", layers[i], &c) ==
                   MOEPT_ERR_INVALID_ARGUMENT && memcmp(&c, &was, sizeof c) == 0,
               "config_from_hf layer %lld: accepted, or cfg changed (%s)", (long long)layers[i],
               moept_last_error(NULL));
    }
    moept_config c = range_cfg();
    EXPECT(moept_config_from_hf(NULL, 1, &c) == MOEPT_ERR_INVALID_ARGUMENT, "config_from_hf path NULL");
    EXPECT(moept_config_from_hf("tests/checkpoints/mixtral_e8_t40", 1, NULL) == MOEPT_ERR_INVALID_ARGUMENT,
           "config_from_hf cfg NULL");
    /* the safetensors writer's dtype, ndim and shape; the reader's count */
    moept_st_writer *w = NULL;
    EXPECT_OK(moept_st_writer_create(&w));
    const float v[4] = {1, 2, 3, 4};
    const int64_t shape[2] = {2, 2}, neg[2] = {2, -1}, huge[2] = {INT64_MAX, 2};
    static const int64_t dtypes[] = {-1, MOEPT_DTYPE_BOOL + 1, 1 << 30, INT_MIN};
    static const int ndims[] = {-1, 9, 1 << 30, INT_MIN};
    for (int i = 0; w && i < 4; i++) {
        EXPECT(moept_st_add(w, "t", (moept_dtype)dtypes[i], 2, shape, v) == MOEPT_ERR_INVALID_ARGUMENT,
               "st_add dtype %lld: accepted", (long long)dtypes[i]);
        EXPECT(moept_st_add(w, "t", MOEPT_DTYPE_F32, ndims[i], shape, v) == MOEPT_ERR_INVALID_ARGUMENT,
               "st_add ndim %d: accepted", ndims[i]);
    }
    EXPECT(w && moept_st_add(w, "t", MOEPT_DTYPE_F32, 2, neg, v) == MOEPT_ERR_INVALID_ARGUMENT, "shape -1");
    EXPECT(w && moept_st_add(w, "t", MOEPT_DTYPE_F32, 2, huge, v) == MOEPT_ERR_INVALID_ARGUMENT,
           "shape INT64_MAX x 2");
    const moept_status bad = MOEPT_ERR_INVALID_ARGUMENT;
    EXPECT(w && moept_st_add(w, "t", MOEPT_DTYPE_F32, 2, NULL, v) == bad, "shape NULL");
    EXPECT(w && moept_st_add(w, NULL, MOEPT_DTYPE_F32, 2, shape, v) == bad, "name NULL");
    EXPECT(w && moept_st_add(w, "t", MOEPT_DTYPE_F32, 2, shape, NULL) == MOEPT_ERR_INVALID_ARGUMENT,
           "data NULL");
    moept_st_writer_destroy(w);
    moept_st_file *f = NULL;
    EXPECT(moept_st_open(NULL, &f) == MOEPT_ERR_INVALID_ARGUMENT && !f, "st_open NULL path");
    EXPECT(moept_st_open("tests/cases/mixtral_e8_t40.safetensors", NULL) == MOEPT_ERR_INVALID_ARGUMENT,
           "st_open out NULL");
    char abi[8] = "unset";
    const int64_t len = moept_abi_layout(NULL, 0);
    EXPECT(len > 0 && moept_abi_layout(abi, -1) == len && moept_abi_layout(abi, INT64_MIN) == len &&
               strcmp(abi, "unset") == 0, "abi_layout with cap <= 0 wrote or answered another length");
    if (moept_st_open("tests/cases/mixtral_e8_t40.safetensors", &f) == MOEPT_OK) {
        const moept_st_tensor *t = moept_st_at(f, 0);
        static const int64_t counts[] = {-1, (int64_t)1 << 30, INT64_MIN};
        float one;
        int64_t onei;
        for (int i = 0; t && i < 3; i++)
            EXPECT(moept_st_read_f32(f, t, &one, counts[i]) == MOEPT_ERR_INVALID_ARGUMENT &&
                       moept_st_read_i64(f, t, &onei, counts[i]) == MOEPT_ERR_INVALID_ARGUMENT,
                   "st_read count %lld: accepted", (long long)counts[i]);
        EXPECT(!moept_st_find(f, NULL) && !moept_st_meta(f, NULL) && !moept_st_find(NULL, "x"),
               "st_find or st_meta of NULL: an answer");
        EXPECT(!moept_st_at(f, -1) && !moept_st_at(f, moept_st_count(f)) && !moept_st_at(f, INT64_MIN),
               "st_tensor_at out of range: a tensor");
        moept_st_close(f);
    } else {
        tu_note(__FILE__, __LINE__, "open the case file: %s", moept_last_error(NULL));
    }
}

/* Padded rows are not read (opts.mask): NaN, Inf and 3e38 in the padded rows of x, dy and dlogits give
   the zero-padded call's y, dx, logits, losses and gradients bitwise (the shared expert and its gate;
   the router with jitter) */
static void padded_run(const moept_config *c, float junk, float *out) {
    enum { TD = TOK * DIM, TE = TOK * NE };
    static const uint8_t mask[TOK] = {1, 1, 0, 1, 0, 1, 1, 0};
    const float bad[3] = {NAN, INFINITY, 3e38f};
    float x[TD], dy[TD], dl[TE];
    unsigned long long s = 9;
    tu_fill(x, TD, 1.0, &s);
    tu_fill(dy, TD, 1.0, &s);
    tu_fill(dl, TE, 0.1, &s);
    for (int t = 0; t < TOK; t++)
        for (int d = 0; !mask[t] && d < DIM; d++) {
            x[t * DIM + d] = dy[t * DIM + d] = junk ? bad[(t + d) % 3] : 0.0f;
            if (d < NE) dl[t * NE + d] = junk ? bad[(t + d + 1) % 3] : 0.0f;
        }
    float *xd = tu_dev(x, NB), *dyd = tu_dev(dy, NB), *y = tu_dev(NULL, NB), *dx = tu_dev(NULL, NB);
    float *dld = tu_dev(dl, sizeof dl), *lo = tu_dev(NULL, sizeof dl);
    uint8_t *md = tu_dev(mask, sizeof mask);
    moept_layer *L = NULL;
    moept_forward_opts fo = {0};
    fo.mask = md, fo.logits_out = lo;
    moept_backward_opts bo = moept_backward_default();
    bo.dlogits = dld;
    EXPECT_OK(create(c, &L));
    if (L) {
        EXPECT_OK(moept_init_params(L, 4));
        EXPECT_OK(moept_forward_ex(L, xd, TOK, y, &fo));
        EXPECT_OK(moept_backward_ex(L, xd, dyd, dx, &bo));
        moept_stats st;
        int64_t n = 0;
        EXPECT_OK(moept_get_stats(L, &st, NULL));
        float *g = tu_buf(L, MOEPT_BUF_GRADS, &n);
        EXPECT(g != NULL, "the gradients: %s", moept_last_error(L));
        tu_to_host(out, y, NB);
        tu_to_host(out + TD, dx, NB);
        tu_to_host(out + 2 * TD, lo, sizeof dl);
        out[2 * TD + TE] = st.aux_loss, out[2 * TD + TE + 1] = st.z_loss;
        if (g) memcpy(out + 2 * TD + TE + 2, g, (size_t)n * sizeof(float));
        free(g);
    }
    moept_destroy(L);
    tu_dev_free(xd); tu_dev_free(dyd); tu_dev_free(y); tu_dev_free(dx); tu_dev_free(dld); tu_dev_free(lo);
    tu_dev_free(md);
}

static void test_padded_rows_unread(void) {
    enum { NOUT = 2 * TOK * DIM + TOK * NE + 2 + 4096 };
    static float zero[NOUT], junk[NOUT];
    for (int v = 0; v < 2; v++) {
        moept_config c = range_cfg();
        c.z_loss_coef = 1e-3f;
        if (v == 0) {
            c.family = MOEPT_FAMILY_QWEN2_MOE, c.shared_intermediate_size = 8; /* and its sigmoid gate */
        } else {
            c.router_jitter = 0.1f;
        }
        memset(zero, 0, sizeof zero), memset(junk, 0, sizeof junk);
        padded_run(&c, 0.0f, zero);
        padded_run(&c, 1.0f, junk);
        static const char *const part[] = {"y", "dx", "logits", "losses", "gradients"};
        const int at[] = {0, TOK * DIM, 2 * TOK * DIM, 2 * TOK * DIM + TOK * NE, 2 * TOK * DIM + TOK * NE + 2,
                          NOUT};
        for (int k = 0; k < 5; k++)
            EXPECT(memcmp(zero + at[k], junk + at[k], (size_t)(at[k + 1] - at[k]) * sizeof(float)) == 0,
                   "%s: NaN, Inf and 3e38 in padded rows changed the %s", v ? "mixtral, jitter" :
                   "qwen2_moe, shared expert", part[k]);
    }
}

/* element i of parameter *in made NaN where the layer keeps it (a CUDA layer: its device) */
static void put_nan(moept_layer *L, const moept_param_info *in, int64_t i) {
    const float nan = NAN;
#if TU_GPU
    float *p, *g;
    int64_t n;
    if (moept_cuda_params(L, &p, &g, &n) == MOEPT_OK && in->offset >= 0)
        cudaMemcpy(p + in->offset + i, &nan, sizeof nan, cudaMemcpyHostToDevice);
#else
    (void)L;
    in->data[i] = nan;
#endif
}

/* A NaN parameter (written where the layer keeps it: moept_buf_write refuses it) named as the cause when
   the forward's output or router logits are not finite, which tensor and element, not blamed on an
   overflow (a CUDA layer's forward does not read y back: its backward reports y, naming the
   parameter) */
static void nonfinite_param(const char *name, int64_t i, const char *want) {
    moept_config c = range_cfg();
    moept_layer *L = NULL;
    float x[TOK * DIM];
    unsigned long long s = 3;
    tu_fill(x, TOK * DIM, 1.0, &s);
    float *xd = tu_dev(x, NB), *y = tu_dev(NULL, NB), *dx = tu_dev(NULL, NB);
    moept_param_info in;
    EXPECT_OK(create(&c, &L));
    EXPECT_OK(L ? moept_init_params(L, 1) : MOEPT_ERR_STATE);
    for (int64_t k = 0; L && k < moept_param_count(L); k++) /* (every expert's, every rank's copy) */
        if (!moept_param_info_at(L, k, &in) && strstr(in.name, name)) put_nan(L, &in, i);
    moept_status st = L ? moept_forward(L, xd, TOK, y) : MOEPT_ERR_STATE;
    if (TU_GPU && !st) st = moept_backward(L, xd, xd, dx); /* (y is checked there) */
    EXPECT(st == MOEPT_ERR_NUMERIC && strstr(moept_last_error(L), want), "a NaN in %s: %d (%s)", name,
           (int)st, moept_last_error(L));
    moept_destroy(L);
    tu_dev_free(xd); tu_dev_free(y); tu_dev_free(dx);
}

static void test_nonfinite_param_named(void) {
    nonfinite_param(".w2.weight", 5 * 12 + 7, "parameter 'experts.0.w2.weight' element [5][7] is nan");
    nonfinite_param("gate.weight", 2 * DIM + 3, "parameter 'gate.weight' element [2][3] is nan");
}

/* the layer of test_layer_calls: two training forwards pending (slots 0, 1), each one's dx recorded by a
   twin layer's differentiation of the same forward */
static int setup(void) {
    moept_config c = range_cfg();
    float x[TOK * DIM], dy[TOK * DIM];
    unsigned long long s = 5;
    tu_fill(x, TOK * DIM, 1.0, &s);
    tu_fill(dy, TOK * DIM, 1.0, &s);
    g_b.x = tu_dev(x, NB), g_b.y = tu_dev(NULL, NB), g_b.dy = tu_dev(dy, NB), g_b.dx = tu_dev(NULL, NB);
    g_b.rep = tu_dev(NULL, sizeof(int32_t) * TOK * TOPK);
    moept_layer *twin = NULL;
    if (create(&c, &g_L) || create(&c, &twin) || moept_init_params(g_L, 3) || moept_init_params(twin, 3))
        return 0;
    for (int s2 = 0; s2 < SLOTS; s2++) {
        moept_forward_opts o = {0};
        o.slot = s2;
        moept_backward_opts b = moept_backward_default();
        b.slot = s2;
        if (moept_forward_ex(g_L, g_b.x, TOK, g_b.y, &o) || moept_forward_ex(twin, g_b.x, TOK, g_b.y, &o) ||
            moept_backward_ex(twin, g_b.x, g_b.dy, g_b.dx, &b))
            return 0;
        tu_to_host(g_dx0[s2], g_b.dx, NB);
    }
    moept_destroy(twin);
    state_of(g_L, &g_before);
    return 1;
}

int main(void) {
#if TU_GPU
    if (moept_cuda_device_count() < 1) {
        tu_skip("test_range (CUDA layers)", "no CUDA device");
        return tu_done();
    }
#endif
    if (!setup()) {
        printf("FAIL - test_range: set-up: %s\n", moept_last_error(NULL));
        return 1;
    }
    RUN(test_layer_calls);
    moept_destroy(g_L);
    tu_dev_free(g_b.x); tu_dev_free(g_b.y); tu_dev_free(g_b.dy); tu_dev_free(g_b.dx); tu_dev_free(g_b.rep);
    RUN(test_create);
    RUN(test_groups_and_files);
    RUN(test_padded_rows_unread);
    RUN(test_nonfinite_param_named);
    return tu_done();
}
