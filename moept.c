/* moept.c - implementation of moept.h (see the top of moept.h).
   One C11 translation unit. Its sections, in order (the data's: a layer
   is made, its calls agree, its steps run stage by stage, its parameters
   are trained, its state goes to files):

   The MoE core: the math, a layer, its stages, its training
     Shared per-element math        routing, losses, activations, plan, jitter:
                                    host and device (moept_kernels.cu includes
                                    this section alone, MOEPT__KERNELS)
     The team on a busy machine     OpenMP team cap from the scheduler's delay
     Errors and allocation          the one error channel; counted allocations;
                                    the ABI report (moept_abi_layout)
     GEMM descriptor                the builtin GEMM (packed micro-kernels) or CBLAS
     The executor interface         moept__exec, capability bits, the one refusal
     The layer                      its state by concern, config, create, parameters
     Agreement                      call tags and argument fingerprints, agreed
     The steps' parallel loops      MOEPT__PAR
     The experts' FFN               activations and grouped GEMMs, both directions
     The exchange                   all-to-all-v, and the direct (shared-memory) path
     FSDP                           gather the experts, reduce-scatter their gradients
     The shared expert              and the combine
     Chunked overlap                the pipeline of both directions
     Checks and jitter              agreed finite outputs; the router's noise
     Forward                        checks -> route -> count -> exchange_counts ->
                                    agree_growth -> commit -> losses -> plan ->
                                    dispatch -> experts -> combine
     Backward                       agree -> combine' -> experts' -> router' -> dx
     Gradients, statistics          sync_grads, grad_norm, update_bias, routing
     AdamW
     Executor glue                  the CPU executor's table; a device executor's
                                    view of the layer and its reports (the CUDA
                                    executor's table is moept_kernels.cu's)
     Placement and resharding
   The groups' transport
     Communication backends         threads, MPI (NCCL: moept_kernels.cu)
   The file formats (a vendor that reads and writes no files drops them:
   MOEPT_NO_IO compiles them out; nothing above calls them)
     JSON                           strict RFC 8259, one object iterator
     safetensors                    the reader, then the writer
     Hugging Face checkpoints       config.json, weights in and out
     Training checkpoints           the own format: staged, agreed, committed

   The stage map: a stage's function has one name and one meaning in both
   executors, here and in moept_kernels.cu (its own map at its top has the
   CUDA-only details; docs/DESIGN.md the table):
       forward  moept__fwd_checks, _route, _count, _exchange_counts,
                _agree_growth, _commit, _losses, _plan, _dispatch, then the
                experts (moept__ffn_forward; CUDA moept__fwd_experts) and
                moept__fwd_combine; chunked: moept__pipeline in both
       backward moept__bwd_agree, _combine, _experts (chunked: the
                pipeline), _router, _dx; FSDP gathers its experts between
                agree and combine' (moept__bwd_fsdp_gather, CPU only)
   moept__forward and moept__backward are these lists in both files. */
#ifndef MOEPT__C_ONCE /* (the white-box tests' one program, tests/whitebox.c, includes it once for all) */
#define MOEPT__C_ONCE
#if defined(__cplusplus) && !defined(MOEPT__KERNELS)
/* C11 only (_Thread_local, stdatomic.h, void * conversions): the rest of the
   file is skipped, so this is the one error a C++ compiler prints (only
   moept_kernels.cu compiles a part of it as C++: the shared math) */
#error "compile moept.c as C11 (cc -std=c11 -c moept.c); C++ code includes only moept.h and links moept.o"
#else
#if !defined(MOEPT__KERNELS) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
#ifndef MOEPT_INTERNAL
#define MOEPT_INTERNAL
#endif
#include "moept.h"

/* ------------------------------------------------------------------------
   Shared per-element math (host and device). The CPU executor calls exactly
   these functions, and moept_kernels.cu compiles this section alone
   (MOEPT__KERNELS: it includes this file for it), so the reference-case
   checks cover the math the CUDA kernels run. C and C++ alike.
   ------------------------------------------------------------------------ */
/* a few of these only the device calls (and test_props, on the host): no
   warning where the host's C build leaves them unused */
#if defined(__GNUC__) && !defined(__CUDACC__)
#define MOEPT__HOST_UNUSED __attribute__((unused))
#else
#define MOEPT__HOST_UNUSED
#endif

MOEPT_HD static inline int moept__finite(float v) {
    /* not isfinite(): -ffast-math builds must still catch NaN/Inf */
    union { float f; uint32_t u; } b; b.f = v;
    return (b.u & 0x7f800000u) != 0x7f800000u;
}

/* e^x for the whole library (host and device, so both round alike):
   e^x = 2^n e^r with n = round(x / ln 2), |r| <= ln(2)/2, e^r by its degree-7
   Taylor polynomial; error within 2 ulp. Branch-free so loops vectorise.
   Inputs are clamped to [-87.3, 88.7]: results stay normal and finite (a
   saturated e^-100 reads 1.2e-38, not 3.7e-44, which no sum notices). */
/* Its steps after the clamps, for a float or a float vector (the CPU's
   vector rows in moept.c run the same, so they round alike): n, r = x - n
   ln 2 in two parts (n*C exact), then e^r by Horner. */
#define MOEPT__EXP_STEPS(x, xi, zero, n, r, p) do {                     \
        n = (xi * 1.44269504088896341f + 12582912.0f) - 12582912.0f;    \
        r = x - n * 0.693145751953125f;                                 \
        r = r - n * 1.428606765330187045e-06f;                          \
        p = (zero) + 1.9841269841e-4f;                                  \
        p = p * r + 1.3888888889e-3f;                                   \
        p = p * r + 8.3333333333e-3f;                                   \
        p = p * r + 4.1666666667e-2f;                                   \
        p = p * r + 1.6666666667e-1f;                                   \
        p = p * r + 0.5f;                                               \
        p = p * r + 1.0f;                                               \
        p = p * r + 1.0f;                                               \
    } while (0)
MOEPT_HD static inline float moept__exp(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.7f ? 88.7f : x;
    /* n from a number: NaN in stays NaN out (through r), and converting NaN
       to an integer is undefined in C (a sync-free step runs on with it) */
    const float xi = moept__finite(x) ? x : 0.0f;
    float n, r, p;
    MOEPT__EXP_STEPS(x, xi, 0.0f, n, r, p);
    int32_t bits = ((int32_t)n + 127) * (1 << 23);
#ifdef __CUDA_ARCH__
    return p * __int_as_float(bits);
#else
    union { int32_t i; float f; } u;
    u.i = bits;
    return p * u.f;
#endif
}

MOEPT_HD static inline float moept__sigmoid(float v) {
    return 1.0f / (1.0f + moept__exp(-v));
}

/* Activation of one hidden unit (kind: moept_activation). Gated kinds:
   a = act(g) * u with g the gate and u the up projection; plain kinds:
   a = act(g), u unused. Exact-erf GELU, as torch's default. */
MOEPT_HD static inline float moept__act_fwd1(int kind, float g, float u) {
    switch (kind) {
    case MOEPT_ACT_SILU_GATED: return g / (1.0f + moept__exp(-g)) * u;
    case MOEPT_ACT_GELU_GATED: return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f)) * u;
    case MOEPT_ACT_GELU: return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
    default: return g > 0.0f ? g : 0.0f;
    }
}
/* Its backward: da -> dg (and du for gated kinds). */
MOEPT_HD static inline void moept__act_bwd1(int kind, float g, float u, float da,
                                            float *dg, float *du) {
    switch (kind) {
    case MOEPT_ACT_SILU_GATED: {
        float s = 1.0f / (1.0f + moept__exp(-g));
        *dg = da * u * (s * (1.0f + g * (1.0f - s)));
        *du = da * g * s;
        return;
    }
    case MOEPT_ACT_GELU_GATED:
    case MOEPT_ACT_GELU: {
        float cdf = 0.5f * (1.0f + erff(g * 0.70710678118654752f));
        float pdf = 0.39894228040143268f * moept__exp(-0.5f * g * g);
        float gate_grad = cdf + g * pdf;
        if (kind == MOEPT_ACT_GELU_GATED) { *dg = da * u * gate_grad; *du = da * g * cdf; }
        else { *dg = da * gate_grad; *du = 0.0f; }
        return;
    }
    default:
        *dg = g > 0.0f ? da : 0.0f;
        *du = 0.0f;
    }
}
MOEPT_HD static inline int moept__act_gated(int kind) {
    return kind == MOEPT_ACT_SILU_GATED || kind == MOEPT_ACT_GELU_GATED;
}

/* "omp simd" only where OpenMP is on: elsewhere compilers warn about (and
   -Werror builds fail on) a pragma they ignore. */
#ifdef _OPENMP
#define MOEPT__OMP_SIMD _Pragma("omp simd")
#else
#define MOEPT__OMP_SIMD
#endif
/* A row of F hidden units: h is [gate | up] (gated, 2F) or [up] (F).
   The kind is a constant inside each loop, so the loops vectorise. */
#define MOEPT__ACT_ROW_FWD(K)                                                    \
    MOEPT__OMP_SIMD for (int64_t j = 0; j < F; j++)                          \
        a[j] = moept__act_fwd1(K, h[j], moept__act_gated(K) ? h[F + j] : 0.0f)
MOEPT_HD static inline void moept__act_fwd_row(int kind, const float *h, int64_t F, float *a) {
    switch (kind) {
    case MOEPT_ACT_SILU_GATED: MOEPT__ACT_ROW_FWD(MOEPT_ACT_SILU_GATED); break;
    case MOEPT_ACT_GELU_GATED: MOEPT__ACT_ROW_FWD(MOEPT_ACT_GELU_GATED); break;
    case MOEPT_ACT_GELU: MOEPT__ACT_ROW_FWD(MOEPT_ACT_GELU); break;
    default: MOEPT__ACT_ROW_FWD(MOEPT_ACT_RELU); break;
    }
}
/* da[F] -> dh (layout of h; dh may alias h) */
#define MOEPT__ACT_ROW_BWD(K)                                                    \
    MOEPT__OMP_SIMD for (int64_t j = 0; j < F; j++) {                        \
        float dg_, du_;                                                          \
        moept__act_bwd1(K, h[j], moept__act_gated(K) ? h[F + j] : 0.0f, da[j],   \
                        &dg_, &du_);                                             \
        dh[j] = dg_;                                                             \
        if (moept__act_gated(K)) dh[F + j] = du_;                                \
    }
MOEPT_HD static inline void moept__act_bwd_row(int kind, const float *h, const float *da,
                                               int64_t F, float *dh) {
    switch (kind) {
    case MOEPT_ACT_SILU_GATED: MOEPT__ACT_ROW_BWD(MOEPT_ACT_SILU_GATED); break;
    case MOEPT_ACT_GELU_GATED: MOEPT__ACT_ROW_BWD(MOEPT_ACT_GELU_GATED); break;
    case MOEPT_ACT_GELU: MOEPT__ACT_ROW_BWD(MOEPT_ACT_GELU); break;
    default: MOEPT__ACT_ROW_BWD(MOEPT_ACT_RELU); break;
    }
}

/* Top-k of score[0..E); ties to the lower index. Scores must not be NaN
   (the router checks; masked experts are -inf). Writes ids in descending
   score order. Pick k is the best expert after pick k-1 in the strict order
   (score descending, index ascending), so no expert is visited twice per
   pick and nothing is marked: O(K E), no scratch. */
MOEPT_HD static inline void moept__topk(const float *score, int E, int K,
                                        int32_t *ids) {
    int prev = -1;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            if (prev >= 0 && !(score[e] < score[prev] || (score[e] == score[prev] && e > prev)))
                continue; /* picked already: not after pick k-1 */
            if (best < 0 || score[e] > score[best]) best = e;
        }
        ids[k] = prev = best;
    }
}

/* Softmax of one token's logits into p[E]; returns logsumexp. */
MOEPT_HD static inline float moept__softmax(const float *logit, int E, float *p) {
    float m = logit[0];
    for (int e = 1; e < E; e++) m = logit[e] > m ? logit[e] : m;
    float s = 0.0f;
    for (int e = 0; e < E; e++) { p[e] = moept__exp(logit[e] - m); s += p[e]; }
    float inv = 1.0f / s;
    for (int e = 0; e < E; e++) p[e] *= inv;
    return m + logf(s);
}

/* The routing weights w[K] of the experts ids[K] from the router's scores
   probs[E], as the family weighs its choice (softmax: p, or p / sum;
   sigmoid: s / (sum + 1e-20) if norm, times scale); the sum runs in k
   order. The router's own choice and a replayed one alike. */
MOEPT_HD static inline void moept__route_weights(int family, const float *probs, const int32_t *ids,
                                                 int K, int norm, float scale, float *w) {
    float sum = 0.0f;
    for (int k = 0; k < K; k++) sum += probs[ids[k]];
    if (family != MOEPT_FAMILY_DEEPSEEK_V3) {
        for (int k = 0; k < K; k++)
            w[k] = norm ? probs[ids[k]] / sum : probs[ids[k]];
        return;
    }
    float div = norm ? sum + 1e-20f : 1.0f;
    for (int k = 0; k < K; k++) w[k] = probs[ids[k]] / div * scale;
}

/* Route one token. family: moept_family; group_fill: moept_group_fill.
   probs[E] receives the router's scores (softmax p, or sigmoid s);
   choice[2E] is scratch. Returns 0, or -1 if
   a logit is not finite (ids/weights then untouched). */
MOEPT_HD static inline int moept__route_token(
    int family, const float *logit, const float *bias, int E, int K, int norm,
    int n_group, int topk_group, int group_fill, float scale, float *probs, float *choice,
    int32_t *ids, float *w) {
    for (int e = 0; e < E; e++)
        if (!moept__finite(logit[e])) return -1;
    if (family != MOEPT_FAMILY_DEEPSEEK_V3) {
        moept__softmax(logit, E, probs);
        moept__topk(probs, E, K, ids);
        moept__route_weights(family, probs, ids, K, norm, scale, w);
        return 0;
    }
    for (int e = 0; e < E; e++) {
        probs[e] = moept__sigmoid(logit[e]);
        choice[e] = probs[e] + (bias ? bias[e] : 0.0f);
    }
    if (n_group > 1) {
        /* group score: the sum of its two best biased scores; keep the
           topk_group best groups (ties to the lower group); group scores
           live in choice[E..E+n_group), so no per-thread arrays */
        int gs = E / n_group;
        float *gscore = choice + E;
        for (int g = 0; g < n_group; g++) {
            const float *cg = choice + (int64_t)g * gs;
            int b0 = 0;
            for (int e = 1; e < gs; e++) b0 = cg[e] > cg[b0] ? e : b0;
            int b1 = b0 == 0 ? 1 : 0;
            for (int e = 0; e < gs; e++) b1 = (e != b0 && cg[e] > cg[b1]) ? e : b1;
            gscore[g] = cg[b0] + cg[b1];
        }
        for (int g = 0; g < n_group; g++) {
            int better = 0; /* groups ranked before g */
            for (int h = 0; h < n_group; h++)
                better += gscore[h] > gscore[g] || (gscore[h] == gscore[g] && h < g);
            if (better >= topk_group)
                for (int e = g * gs; e < (g + 1) * gs; e++)
                    choice[e] = group_fill == MOEPT_GROUP_FILL_ZERO ? 0.0f : -HUGE_VALF;
        }
    }
    moept__topk(choice, E, K, ids);
    moept__route_weights(family, probs, ids, K, norm, scale, w);
    return 0;
}

/* Routing replay of one token: a row given[K] that is not K distinct
   experts of 0..E-1 gives 2 k + 1 for its first k repeating an earlier
   expert of the row, 2 k for one out of range; -1: a valid row. */
MOEPT_HD static inline int moept__replay_bad(const int32_t *given, int E, int K) {
    for (int k = 0; k < K; k++) {
        if (given[k] < 0 || given[k] >= E) return 2 * k;
        for (int j = 0; j < k; j++)
            if (given[j] == given[k]) return 2 * k + 1;
    }
    return -1;
}
/* both executors' message for a rejected row (code: moept__replay_bad's) */
#define MOEPT__REPLAY_FMT "moept_forward: opts.replay_ids[%lld][%lld] %s"
#define MOEPT__REPLAY_WHY(code) \
    ((code) & 1 ? "repeats an expert of its row" : "is not an expert index (0..num_experts-1)")

/* Routing replay of one (valid) token: the router's scores into probs[E]
   as moept__route_token computes them, ids = given (in the given order),
   their weights as the family weighs its own choice (moept__route_weights;
   no top-k, no groups: the bias only selects). Returns -1, ids and w
   untouched, if a logit is not finite. */
MOEPT_HD static inline int moept__replay_token(int family, const float *logit, const int32_t *given, int E,
                                               int K, int norm, float scale, float *probs, int32_t *ids,
                                               float *w) {
    for (int e = 0; e < E; e++)
        if (!moept__finite(logit[e])) return -1;
    if (family != MOEPT_FAMILY_DEEPSEEK_V3) moept__softmax(logit, E, probs);
    else
        for (int e = 0; e < E; e++) probs[e] = moept__sigmoid(logit[e]);
    for (int k = 0; k < K; k++) ids[k] = given[k];
    moept__route_weights(family, probs, ids, K, norm, scale, w);
    return 0;
}

/* Backward of one token's routing weights. gw[K] = dL/dw; probs[E] the
   router's scores of the forward. Accumulates dL/dscore into dprob[E]
   (which the caller then pushes through softmax or sigmoid). */
MOEPT_HD static inline void moept__route_weights_bwd(
    int family, const float *probs, const int32_t *ids, const float *gw, int K,
    int norm, float scale, float *dprob) {
    if (!norm) {
        for (int k = 0; k < K; k++)
            dprob[ids[k]] += gw[k] * (family == MOEPT_FAMILY_DEEPSEEK_V3 ? scale : 1.0f);
        return;
    }
    float sum = 0.0f;
    for (int k = 0; k < K; k++) sum += probs[ids[k]];
    float den = family == MOEPT_FAMILY_DEEPSEEK_V3 ? sum + 1e-20f : sum;
    float sc = family == MOEPT_FAMILY_DEEPSEEK_V3 ? scale : 1.0f;
    /* w_k = sc * p_k / den: dL/dp_j = sc * (g_j - sum_k g_k p_k / den) / den,
       in this form so that K = 1 cancels exactly (p / p == 1) */
    float dot = 0.0f;
    for (int k = 0; k < K; k++) dot += gw[k] * (probs[ids[k]] / den);
    for (int k = 0; k < K; k++) dprob[ids[k]] += sc * (gw[k] - dot) / den;
}

/* dot(a, b) over n floats in double, as 8 interleaved partial sums added in
   a fixed order: deterministic, and vectorisable (one running sum is a
   latency-bound chain, 4x slower on the combine backward's rows). */
MOEPT_HD static inline double moept__dot(const float *a, const float *b, int64_t n) {
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) s[l] += (double)a[i + l] * (double)b[i + l];
    for (; i < n; i++) s[i & 7] += (double)a[i] * (double)b[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* Softmax backward in place: d[e] <- p[e] * (d[e] - sum_j p[j] d[j]). */
MOEPT_HD static inline void moept__softmax_bwd(const float *p, int E, float *d) {
    float dot = 0.0f;
    for (int e = 0; e < E; e++) dot += p[e] * d[e];
    for (int e = 0; e < E; e++) d[e] = p[e] * (d[e] - dot);
}

/* Scores the aux loss averages for one token, and (HF convention) the experts
   it counts. HF: softmax(logits) and its top-k, as load_balancing_loss_func,
   whatever the router; Megatron: the router's scores (sigmoid scores
   normalised over experts) and its own selection. */
MOEPT_HD static inline void moept__aux_token(int family, int aux,
                                             const float *logit, const float *probs,
                                             const int32_t *ids, int E, int K,
                                             float *score, int32_t *count_ids) {
    int softmax_router = family != MOEPT_FAMILY_DEEPSEEK_V3;
    if (aux == MOEPT_AUX_HF) {
        if (softmax_router) {
            for (int e = 0; e < E; e++) score[e] = probs[e];
            for (int k = 0; k < K; k++) count_ids[k] = ids[k];
        } else {
            moept__softmax(logit, E, score);
            moept__topk(score, E, K, count_ids);
        }
        return;
    }
    if (softmax_router) {
        for (int e = 0; e < E; e++) score[e] = probs[e];
    } else {
        float z = 0.0f;
        for (int e = 0; e < E; e++) z += probs[e];
        z += 1e-20f;
        for (int e = 0; e < E; e++) score[e] = probs[e] / z;
    }
    for (int k = 0; k < K; k++) count_ids[k] = ids[k];
}

/* Router backward of one token: dlogit[E] = dL/dlogits from the routing
   weights' gradient gw[K], the aux loss (aux_g[E] = dL/dscore, NULL for
   none) and the z loss (zgrad = z_coef * 2 * lse / T), those two times ls
   (moept_backward_opts.router_loss_scale), plus the caller's own dL/dlogits
   dlx[E] (NULL: none). scratch[E]. */
MOEPT_HD static inline void moept__router_token_bwd(
    int family, int aux, const float *logit, const float *probs,
    const int32_t *ids, const float *gw, const float *aux_g, float zgrad,
    int E, int K, int norm, float scale, float ls, const float *dlx, float *scratch, float *dlogit) {
    for (int e = 0; e < E; e++) dlogit[e] = 0.0f;
    moept__route_weights_bwd(family, probs, ids, gw, K, norm, scale, dlogit);
    zgrad *= ls;
    if (family != MOEPT_FAMILY_DEEPSEEK_V3) {
        if (aux_g)
            for (int e = 0; e < E; e++) dlogit[e] += ls * aux_g[e];
        moept__softmax_bwd(probs, E, dlogit);
        if (zgrad != 0.0f)
            for (int e = 0; e < E; e++) dlogit[e] += zgrad * probs[e];
    } else {
        for (int e = 0; e < E; e++) dlogit[e] *= probs[e] * (1.0f - probs[e]);
        if (aux_g && (aux == MOEPT_AUX_MEGATRON || aux == MOEPT_AUX_SEQ)) {
            /* q = s / Z, Z = sum s + 1e-20: ds_j = (g_j - sum_e g_e q_e) / Z */
            float z = 0.0f, dot = 0.0f;
            for (int e = 0; e < E; e++) z += probs[e];
            z += 1e-20f;
            for (int e = 0; e < E; e++) dot += ls * aux_g[e] * probs[e] / z;
            for (int e = 0; e < E; e++)
                dlogit[e] += (ls * aux_g[e] - dot) / z * probs[e] * (1.0f - probs[e]);
        }
        if ((aux_g && aux == MOEPT_AUX_HF) || zgrad != 0.0f) {
            moept__softmax(logit, E, scratch);
            float dot = 0.0f;
            if (aux_g && aux == MOEPT_AUX_HF)
                for (int e = 0; e < E; e++) dot += scratch[e] * (ls * aux_g[e]);
            for (int e = 0; e < E; e++) {
                float g = (aux_g && aux == MOEPT_AUX_HF) ? ls * aux_g[e] - dot : 0.0f;
                dlogit[e] += scratch[e] * (g + zgrad);
            }
        }
    }
    if (dlx)
        for (int e = 0; e < E; e++) dlogit[e] += dlx[e];
}

/* logsumexp of one token's logits (the z loss), summed as moept__softmax. */
MOEPT_HD static inline float moept__lse(const float *logit, int64_t E) {
    float m = logit[0];
    for (int64_t e = 1; e < E; e++) m = logit[e] > m ? logit[e] : m;
    float s = 0.0f;
    for (int64_t e = 0; e < E; e++) s += moept__exp(logit[e] - m);
    return m + logf(s);
}

/* d(z_coef * mean_t lse_t^2)/d lse_t */
MOEPT_HD static inline float moept__zgrad(float z_coef, float lse, float T) {
    return z_coef != 0.0f ? z_coef * 2.0f * lse / T : 0.0f;
}

/* The aux loss from its per-expert statistics (auxc: counted selections,
   psum: summed scores, T tokens), and d(coef * aux)/d score_t,e into
   aux_g[E] (the same for every token). Returns the unscaled loss. */
MOEPT_HD static inline double moept__aux_finalize(const double *auxc, const double *psum,
                                                  int64_t E, int64_t K, int aux, double T,
                                                  float coef, float *aux_g) {
    double cnorm = aux == MOEPT_AUX_HF ? T : T * (double)K, v = 0.0;
    for (int64_t e = 0; e < E; e++) {
        v += auxc[e] / cnorm * (psum[e] / T);
        aux_g[e] = (float)((double)coef * (double)E * auxc[e] / (cnorm * T));
    }
    return v * (double)E;
}

/* The plan's placement of assignment i (token i / K, slot i % K) that is the
   pos-th of its expert's assignments in index order (a stable sort by
   expert): row koff + pos if pos < kept (the expert's capacity), else
   dropped (-1). Both executors compute pos their own way (a counting pass;
   a block-wise count on the GPU) and place through this. */
MOEPT_HD static inline void moept__plan_place(int64_t i, int64_t pos, int64_t kept, int64_t koff,
                                              int64_t K, int64_t *row_of, int64_t *tok_of_row) {
    if (pos < kept) {
        int64_t r = koff + pos;
        row_of[i] = r;
        tok_of_row[r] = i / K;
    } else {
        row_of[i] = -1;
    }
}

/* the GPU plan's two helpers below run on the device (and in test_props on the host) */
/* The GPU plan's count pass, per assignment: within its block's slots
   sl[0..n), the number of earlier assignments to the same slot (its rank)
   and whether none later shares it (then rank + 1 is the block's count). */
MOEPT_HD MOEPT__HOST_UNUSED static inline int moept__block_rank(const int32_t *sl, int n, int i, int *last) {
    int r = 0, l = 1;
    for (int j = 0; j < n; j++) {
        int same = sl[j] == sl[i];
        r += (j < i) & same;
        l &= !((j > i) & same);
    }
    *last = l;
    return r;
}

/* The GPU plan's scan pass, per slot e: hist [nblk][E] block counts become
   each block's first position within the slot; returns the rows kept
   (capacity cap, -1 for none). */
MOEPT_HD MOEPT__HOST_UNUSED static inline int64_t moept__plan_scan_slot(int64_t *hist, int64_t nblk,
                                                                         int64_t E, int64_t e, int64_t cap) {
    int64_t run = 0;
    for (int64_t b = 0; b < nblk; b++) {
        int64_t h = hist[b * E + e];
        hist[b * E + e] = run;
        run += h;
    }
    return cap >= 0 && run > cap ? cap : run;
}



/* One term of a token's combine: acc + w * v (k in slot order). Neither
   executor contracts it into an fma (C11 without -ffp-contract=fast;
   nvcc --fmad=false), so both round alike. */
MOEPT_HD static inline float moept__combine_step(float acc, float w, float v) {
    return acc + w * v;
}

/* The other per-element terms of the combine and its backward: a weighted
   row (w * v: the shared expert's gated row, and dys = w * dy) and a sum of
   rows (dx = sum of its k rows, + the shared expert's: combine_step with
   w = 1, exact). */
MOEPT_HD static inline float moept__scale(float w, float v) {
    return w * v;
}

/* Shared-expert sigmoid gate backward: dL/d logit from <y_shared, dy> and
   the gate value g. */
MOEPT_HD static inline float moept__gate_bwd(double dot, float g) {
    return (float)dot * g * (1.0f - g);
}

/* One AdamW element, as torch.optim.AdamW: decoupled decay, the moments,
   the bias-corrected step. k: {1 - lr wd, b1, b2, lr / (1 - b1^t),
   sqrt(1 - b2^t), eps}, made once a step on the host. The host loop and the
   CUDA kernel both call it (IEEE sqrtf and division on both), so a CUDA
   layer's step equals the host's bitwise. */
MOEPT_HD static inline float moept__adamw1(float p, float g, float *m, float *v, moept__adamw_k k) {
    p *= k.decay;
    *m = k.b1 * *m + (1.0f - k.b1) * g;
    *v = k.b2 * *v + (1.0f - k.b2) * g * g;
    return p - k.step * *m / (sqrtf(*v) / k.sbc2 + k.eps);
}



/* Row runs, what the expert FFN runs over (both executors): run i is rows
   [r0, r0 + rows) of local expert e. Either every group's (offs [n + 1]:
   run e is group e, its rows contiguous from offs[0]) or a chunk's (runs
   [3][stride]: first row, rows, local expert), whose runs lie apart. */
typedef struct moept__runs {
    const int64_t *offs, *runs;
    int64_t n, stride;
} moept__runs;
static inline moept__runs moept__runs_groups(const int64_t *offs, int64_t n) {
    moept__runs R = {offs, NULL, n, 0};
    return R;
}
static inline moept__runs moept__runs_chunk(const int64_t *runs, int64_t n, int64_t stride) {
    moept__runs R = {NULL, runs, n, stride};
    return R;
}
static inline void moept__run_at(const moept__runs *R, int64_t i, int64_t *r0, int64_t *rows, int64_t *e) {
    if (R->offs) {
        *r0 = R->offs[i]; *rows = R->offs[i + 1] - *r0; *e = i;
    } else {
        *r0 = R->runs[i]; *rows = R->runs[R->stride + i]; *e = R->runs[2 * R->stride + i];
    }
}
/* The row spans a per-row pass (the activation) covers: the groups' rows
   as one, a chunk's run by run */
static inline int64_t moept__spans(const moept__runs *R) { return R->offs ? 1 : R->n; }
static inline void moept__span_at(const moept__runs *R, int64_t i, int64_t *r0, int64_t *rows) {
    int64_t e;
    if (R->offs) {
        *r0 = R->offs[0]; *rows = R->offs[R->n] - *r0;
    } else {
        moept__run_at(R, i, r0, rows, &e);
    }
}

/* gd[0..n) = one GEMM descriptor per run that has rows: `make` is an
   expression of its expert e, first row r0 and row count rows. Both
   executors build their expert GEMMs with it. */
#define MOEPT__PER_RUN(gd, n, R, make)                                  \
    do {                                                                \
        (n) = 0;                                                        \
        for (int64_t i_ = 0; i_ < (R)->n; i_++) {                       \
            int64_t r0, rows, e;                                        \
            moept__run_at((R), i_, &r0, &rows, &e);                     \
            if (rows) (gd)[(n)++] = (make);                             \
        }                                                               \
    } while (0)

/* Whether byte ranges [a, a + n) and [b, b + n) overlap (compared as
   integers: the pointers may belong to unrelated objects). */
static inline int moept__overlaps(const void *a, const void *b, size_t n) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return n > 0 && x < y + n && y < x + n;
}
/* both executors' message for dx overlapping x (moept.h's contract) */
#define MOEPT__DX_ALIAS "moept_backward: dx overlaps x (dx may alias dy, not x: the weight gradients " \
                        "read x after dx is written)"

/* Per-expert capacity of a step of T tokens (cf > 0; else -1: dropless):
   ceil(cf T K / E), computed in double and capped at T K (no expert can
   receive more), so any finite cf converts without overflow. The GPU
   computes it on the device from its unmasked tokens. */
MOEPT_HD static inline int64_t moept__capacity(double cf, int64_t T, int64_t K, int64_t E) {
    if (!(cf > 0.0)) return -1;
    double c = ceil(cf * ((double)T * (double)K / (double)E));
    return c < (double)(T * K) ? (int64_t)c : T * K;
}

/* An evaluation forward's slot, both executors' rule (nslots training
   slots; slot nslots is the evaluations'): its own where a training forward
   may still wait for its backward (pending: slot 0 holds a training
   forward not yet differentiated); a one-slot layer otherwise evaluates in
   slot 0, so a training loop's evaluations add no workspace; an inference
   layer has slot 0 alone. */
MOEPT_HD MOEPT__HOST_UNUSED static inline int moept__eval_slot_of(int nslots, int inference, int pending) {
    return inference ? 0 : nslots > 1 || pending ? nslots : 0;
}

/* Chunked overlap: chunk c of C holds tokens [c T / C, (c+1) T / C);
   moept__chunk_of is the chunk of token t (0 <= t < T): the largest c with
   c T / C <= t, i.e. c T < (t + 1) C. */
MOEPT_HD static inline int64_t moept__chunk_start(int64_t T, int64_t C, int64_t c) { return c * T / C; }
MOEPT_HD MOEPT__HOST_UNUSED static inline int64_t moept__chunk_of(int64_t t, int64_t T, int64_t C) {
    return ((t + 1) * C - 1) / T;
}

/* The plan's host side, one implementation both executors call. P ranks of
   El local experts each: slot e = q El + j is rank q's expert j. offsets
   [E+1] and counts [E]: this rank's kept rows per slot, in slot order (the
   send side); rcounts [P][El]: the rows rank p sends this rank's expert j.
   The expert side holds its rows expert-major, then by source rank. */

/* roffsets [El+1]: the first received row of each local expert */
static inline void moept__plan_roffsets(int64_t P, int64_t El, const int64_t *rcounts, int64_t *roffsets) {
    roffsets[0] = 0;
    for (int64_t j = 0; j < El; j++) {
        int64_t n = 0;
        for (int64_t p = 0; p < P; p++) n += rcounts[p * El + j];
        roffsets[j + 1] = roffsets[j] + n;
    }
}

/* The expert exchange's pieces in elements (rows of D): ss [P][El] slot
   (p, j)'s rows in the send buffer, rs [P][El] where rank p's rows for
   expert j land on the expert side */
static inline void moept__plan_segs(int64_t P, int64_t El, int64_t D, const int64_t *offsets,
                                    const int64_t *counts, const int64_t *rcounts, const int64_t *roffsets,
                                    moept_seg *ss, moept_seg *rs) {
    for (int64_t j = 0; j < El; j++) {
        int64_t off = roffsets[j];
        for (int64_t p = 0; p < P; p++) {
            int64_t e = p * El + j; /* p's expert j, as seen from here */
            ss[e].offset = offsets[e] * D;
            ss[e].count = counts[e] * D;
            rs[e].offset = off * D;
            rs[e].count = rcounts[e] * D;
            off += rcounts[e];
        }
    }
}

/* peer_rows [2][P]: the rows this rank (me) sends to each rank, then those
   it receives from each (rank p's for expert j at rcounts[p * rstride + j]:
   a strided view, e.g. of the count messages); *sent and *received: those
   to and from the other ranks */
static inline void moept__plan_peer_rows(int64_t P, int64_t El, int64_t me, const int64_t *counts,
                                         const int64_t *rcounts, int64_t rstride, int64_t *peer_rows,
                                         int64_t *sent, int64_t *received) {
    *sent = *received = 0;
    for (int64_t q = 0; q < P; q++) {
        peer_rows[q] = peer_rows[P + q] = 0;
        for (int64_t j = 0; j < El; j++) {
            peer_rows[q] += counts[q * El + j];
            peer_rows[P + q] += rcounts[q * rstride + j];
        }
        if (q != me) { *sent += peer_rows[q]; *received += peer_rows[P + q]; }
    }
}

/* Chunk c of C's exchange pieces (ss [P][El] on the send side, rs [P][El]
   on the expert side; NULL: not wanted) and its row runs on the expert side
   (runs [3][P El]: first row, rows, local expert); returns the runs. ccnt
   [C][E]: this rank's kept rows per chunk and slot; rccnt [P][C][El]: rank
   p's rows of chunk c for expert j. The plan is a stable sort by slot, so a
   chunk's rows of a slot follow the earlier chunks' on both sides: every
   row lands where the one-chunk step puts it. */
static inline int64_t moept__plan_chunk(int64_t c, int64_t C, int64_t P, int64_t El, int64_t D,
                                        const int64_t *offsets, const int64_t *ccnt, const int64_t *rcounts,
                                        const int64_t *roffsets, const int64_t *rccnt, moept_seg *ss,
                                        moept_seg *rs, int64_t *runs) {
    const int64_t E = P * El, stride = P * El;
    for (int64_t e = 0; e < E && ss; e++) { /* slot e = (q, j) is piece q El + j */
        int64_t start = offsets[e];
        for (int64_t b = 0; b < c; b++) start += ccnt[b * E + e];
        ss[e].offset = start * D;
        ss[e].count = ccnt[c * E + e] * D;
    }
    int64_t n = 0;
    for (int64_t j = 0; j < El; j++) {
        int64_t base = roffsets[j];
        for (int64_t p = 0; p < P; p++) {
            int64_t before = 0;
            for (int64_t b = 0; b < c; b++) before += rccnt[(p * C + b) * El + j];
            int64_t rows = rccnt[(p * C + c) * El + j];
            if (rs) { rs[p * El + j].offset = (base + before) * D; rs[p * El + j].count = rows * D; }
            if (rows) { runs[n] = base + before; runs[stride + n] = rows; runs[2 * stride + n] = j; n++; }
            base += rcounts[p * El + j];
        }
    }
    return n;
}


/* The loss statistics: one vector of doubles per step (all-reduced in one
   call when the balance is global), per expert the selections, the aux
   loss's counts and its score sums, then the tokens, the sum of lse^2, the
   sum of sequence aux values and the sequences. Its fields' offsets: */
typedef struct moept__lso { int64_t sel, auxc, psum, T, lse2, seqaux, nseq, n; } moept__lso;
MOEPT_HD static inline moept__lso moept__lstat_of(int64_t E) {
    moept__lso o = {0, E, 2 * E, 3 * E, 3 * E + 1, 3 * E + 2, 3 * E + 3, 3 * E + 4};
    return o;
}

/* ---- router jitter's noise (host and device) -------------------------
   splitmix64: a small deterministic generator (initialisation, the jitter) */
MOEPT_HD static inline uint64_t moept__mix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* A 64-bit checksum of n floats' bytes, 8 at a time: each step a bijection
   of the state for a given word, so any change of one word changes the
   result. Native byte order: the files' (little-endian) on every target. */
MOEPT_HD static inline uint64_t moept__checksum(const float *v, int64_t n) {
    const unsigned char *b = (const unsigned char *)v;
    size_t len = (size_t)n * sizeof(float), i = 0;
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)len;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    for (; i < len; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}
/* The jitter's hash of a token's row x [D] (fp32 values, as the router
   sees them): the noise is keyed by the token's values, not its place */
MOEPT_HD static inline uint64_t moept__jitter_row(const float *x, int64_t D) {
    return moept__checksum(x, D) * 0x9e3779b97f4a7c15ull;
}
/* Router jitter's factor for element d of a token whose row hashes to
   row: uniform in [1 - eps, 1 + eps] from (seed, key, row, d) by a counter
   hash. Keyed by the token's values, not its place, so a token draws the
   same wherever it is routed (EP = N equals EP = 1 on the whole batch, any
   thread count, either executor), and the backward makes it again instead
   of keeping it. */
MOEPT_HD static inline float moept__jitter_u(uint64_t seed, uint64_t key, uint64_t row, int64_t d,
                                             float eps) {
    uint64_t s = seed ^ (key * 0xd1b54a32d192ed03ull) ^ row ^ ((uint64_t)d * 0xa0761d6478bd642full);
    return 1.0f - eps + 2.0f * eps * ((float)(moept__mix(&s) >> 40) * 0x1.0p-24f);
}

/* FP8 (config.fp8): DeepSeek-V3's blockwise E4M3 (the FP8 section below
   has the spec). Its per-element steps, host and device alike: rounding,
   a tile's scale and running amax, and the byte of a rounded value. */
#define MOEPT__Q8_TILE 128
#define MOEPT__E4M3_MAX 448.0f
MOEPT_HD static inline uint32_t moept__f32_bits(float f) {
    union { float f; uint32_t u; } b;
    b.f = f;
    return b.u;
}
MOEPT_HD static inline float moept__bits_f32(uint32_t u) {
    union { float f; uint32_t u; } b;
    b.u = u;
    return b.f;
}
/* x rounded to E4M3 (OCP float8_e4m3fn: 3 mantissa bits, exponents -6..8,
   subnormals in steps of 2^-9, no infinities), to nearest even, saturating
   at +-448 (cvt.rn.satfinite's rule; 464 and up would round to 480, which
   E4M3 lacks); NaN stays NaN; -0 stays -0, and a negative that rounds to 0
   gives -0, as cvt.rn does */
MOEPT_HD static inline float moept__e4m3_round(float x) {
    const uint32_t u = moept__f32_bits(x), sign = u & 0x80000000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return x;
    const float ax = moept__bits_f32(a);
    float r;
    if (ax >= MOEPT__E4M3_MAX) r = MOEPT__E4M3_MAX;
    else if (ax < 0.015625f) r = (ax + 16384.0f) - 16384.0f; /* below 2^-6: multiples of 2^-9, 2^14's ulp */
    else { /* 3 of float's 23 mantissa bits kept, ties to even */
        a = (a + 0x7FFFFu + ((a >> 20) & 1u)) & ~0xFFFFFu;
        r = moept__bits_f32(a);
        if (r > MOEPT__E4M3_MAX) r = MOEPT__E4M3_MAX;
    }
    return moept__bits_f32(moept__f32_bits(r) | sign);
}
/* the E4M3 byte of r, a value moept__e4m3_round gave (NaN: 0x7f whatever its sign, as cvt writes it) */
MOEPT_HD MOEPT__HOST_UNUSED static inline uint8_t moept__e4m3_byte(float r) {
    const uint32_t u = moept__f32_bits(r), a = u & 0x7fffffffu;
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (a > 0x7f800000u) return 0x7f;
    if (a < 0x3c800000u) return (uint8_t)(sign | (uint8_t)(moept__bits_f32(a) * 512.0f)); /* 0, subnormals */
    return (uint8_t)(sign | (((a >> 23) - 120u) << 3) | ((a >> 20) & 7u));
}
/* the value of E4M3 byte b (float8_e4m3fn: sign, 4 exponent bits biased by 7, 3 mantissa bits; no
   infinities, S.1111.111 is NaN), exact in float */
MOEPT_HD MOEPT__HOST_UNUSED static inline float moept__e4m3_f32(uint8_t b) {
    const uint32_t e = (b >> 3) & 15u, m = b & 7u, sign = (uint32_t)(b & 0x80u) << 24;
    const float v = e == 15 && m == 7 ? moept__bits_f32(0x7fc00000u)
                    : e == 0          ? (float)m * 0x1p-9f
                                      : moept__bits_f32((e + 120u) << 23 | m << 20);
    return moept__bits_f32(moept__f32_bits(v) | sign);
}
/* a tile's scale: amax / 448, at least 2^-63 (a zero tile's too), one quiet NaN for a tile with a NaN
   (whichever NaN the amax met first: an order the GPU's reductions differ in). The floor keeps the
   product of two scales, cuBLASLt's factor of a block's E4M3 sum, a normal fp32 number (2^-126 at the
   least): with smaller scales it would lose bits or underflow to 0 where the CPU's dequantized products
   do not. A tile whose amax is below 448 * 2^-63 keeps its values in steps of 2^-72 */
#define MOEPT__Q8_SMIN 0x1p-63f
MOEPT_HD static inline float moept__q8_scale(float amax) {
    const float s = amax / MOEPT__E4M3_MAX;
    return s >= MOEPT__Q8_SMIN ? s : s == s ? MOEPT__Q8_SMIN : moept__bits_f32(0x7fc00000u);
}
MOEPT_HD static inline float moept__q8(float v, float s) { return moept__e4m3_round(v / s) * s; }
#define MOEPT__Q8_PAD(n) (((n) + 15) / 16 * 16)
#define MOEPT__Q8_L(k) (((k) + MOEPT__Q8_TILE - 1) / MOEPT__Q8_TILE)
/* A routed token's row as config.fp8's dispatch writes it and an exchange moves it (an FP8 record, "x's
   rows quantized once"): its D values in E4M3 in 1 x 128 tiles, zeros to Dp = MOEPT__Q8_PAD(D) bytes,
   then the tiles' fp32 scales; recw(D) bytes, a multiple of 16 (a GPU's TMA row stride; the exchange's
   4-byte words) */
MOEPT_HD static inline int64_t moept__q8_recw(int64_t D) {
    return MOEPT__Q8_PAD(MOEPT__Q8_PAD(D) + 4 * MOEPT__Q8_L(D));
}
/* a tile's running amax with v (a NaN sticks: the tile's values become NaN, as the GPU's would) */
MOEPT_HD static inline float moept__q8_amax(float m, float v) {
    const float av = moept__bits_f32(moept__f32_bits(v) & 0x7fffffffu);
    return av > m || av != av ? av : m;
}

/* Carves 64-byte aligned sub-buffers out of one block; with base NULL it
   only measures (the layouts run twice: size, then carve). Host and device
   workspaces alike. */
typedef struct moept__carve { char *base; size_t off; } moept__carve;
static inline void *moept__take(moept__carve *c, size_t bytes) {
    size_t off = (c->off + 63) & ~(size_t)63;
    c->off = off + bytes;
    return c->base ? c->base + off : NULL;
}

#ifndef MOEPT__KERNELS /* the rest is C11, moept.c's own */
#if defined(__FAST_MATH__)
/* -ffast-math (and -Ofast) assume no NaN or Inf (the input and output checks
   vanish) and change exp and the softmax: every reference case fails */
#error "moept.c must not be built with -ffast-math or -Ofast (NaN/Inf checks, softmax): use -O2 or -O3 here"
#endif
/* Built without OpenMP, the `omp` pragmas are meant to be ignored (serial
   loops); with clang's OpenMP, an `omp simd` loop it cannot vectorise (the
   activation backward) is a note, not a fault. Neither may fail a -Werror
   build of this file. */
#if !defined(_OPENMP) && defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#endif
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

#include <errno.h>
#include <float.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include <dirent.h>
#include <time.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef MOEPT_CBLAS
#include <cblas.h>
#endif

#ifndef MOEPT_MALLOC
#define MOEPT_MALLOC(n) malloc(n)
#define MOEPT_FREE(p) free(p)
#endif

/* ------------------------------------------------------------------------
   The team on a busy machine
   ------------------------------------------------------------------------ */
/* OpenMP threads spin at every barrier: beside another process that holds
   a core, a team as wide as the machine waits at each barrier for a member
   the scheduler put aside (measured: 5x slower beside two busy processes on
   2 cores, under 2x with one thread). So the layer's regions take at most
   moept__team_cap threads: the CPU forward and backward look, at most every
   20 ms, at the share of the time the calling thread waited for a CPU
   (Linux: /proc/thread-self/schedstat). Waiting over 15% narrows the team
   in proportion; eight looks in a row under 3%, each finding a core idle
   (/proc/loadavg's runnable tasks), widen it by one thread. No
   result depends on the team's size (a tile's, a row's and a reduction's
   arithmetic never does). */
#ifdef _OPENMP
static atomic_int moept__team_cap;  /* threads at most; 0: no cap */
static atomic_int moept__team_calm; /* looks in a row that found little waiting */

/* the team for a region (max > 0: at most that, e.g. per-thread scratch) */
static int moept__team(int max) {
    int n = omp_get_max_threads(), cap = atomic_load_explicit(&moept__team_cap, memory_order_relaxed);
    if (cap > 0 && cap < n) n = cap;
    return max > 0 && max < n ? max : n;
}

/* the calling thread's time spent waiting for a CPU so far (ns); -1 unknown */
static int64_t moept__run_delay(void) {
#ifdef __linux__
    char buf[96];
    int fd = open("/proc/thread-self/schedstat", O_RDONLY);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    unsigned long long run, delay;
    if (n <= 0) return -1;
    buf[n] = 0;
    return sscanf(buf, "%llu %llu", &run, &delay) == 2 ? (int64_t)delay : -1;
#else
    return -1;
#endif
}

/* tasks runnable on the machine now, this thread included (Linux:
   /proc/loadavg's fourth field); -1 unknown */
static int moept__runnable(void) {
#ifdef __linux__
    char buf[128];
    int fd = open("/proc/loadavg", O_RDONLY), r = -1, total;
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    double l1, l5, l15;
    if (n <= 0) return -1;
    buf[n] = 0;
    return sscanf(buf, "%lf %lf %lf %d/%d", &l1, &l5, &l15, &r, &total) == 5 ? r : -1;
#else
    return -1;
#endif
}

/* At the end of each CPU forward and backward: once 20 ms or more passed
   since this thread's last look (one hiccup in a short call is no load),
   the share of that time it spent waiting for a CPU sets the team. */
static void moept__load_note(void) {
    static _Thread_local struct timespec t0;
    static _Thread_local int64_t d0 = -2; /* -2: no look yet; -1: cannot tell here */
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (d0 == -1) return;
    double span = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    if (d0 >= 0 && span < 0.02) return;
    int64_t d = moept__run_delay();
    double waited = d0 >= 0 && d >= 0 ? 1e-9 * (double)(d - d0) / span : -1.0;
    d0 = d;
    t0 = t1;
    if (waited < 0.0) return;
    int max = omp_get_max_threads(), cap = atomic_load(&moept__team_cap);
    cap = cap > 0 && cap < max ? cap : max;
    if (waited > 0.15) {
        int want = (int)((double)cap * (1.0 - waited));
        atomic_store(&moept__team_cap, want < 1 ? 1 : want);
        atomic_store(&moept__team_calm, 0);
    } else if (waited < 0.03 && cap < max) {
        /* a narrow team waits for nobody: widen only onto a core that is idle now */
        int r = moept__runnable();
        if (r < 0 || r - 1 + cap + 1 > omp_get_num_procs()) atomic_store(&moept__team_calm, 0);
        else if (atomic_fetch_add(&moept__team_calm, 1) + 1 >= 8) {
            atomic_store(&moept__team_cap, cap + 1 >= max ? 0 : cap + 1);
            atomic_store(&moept__team_calm, 0);
        }
    }
}
#else
static void moept__load_note(void) {} /* one thread: no team to size */
#endif

/* ------------------------------------------------------------------------
   Errors and allocation (and the ABI report)
   ------------------------------------------------------------------------ */
/* The one error channel: every failure, of a layer's call or of a
   layer-less one (moept_create, the file readers), writes the calling
   thread's message, which moept_last_error reads whatever its argument. */
static _Thread_local char moept__thread_err[MOEPT__ERRLEN];

typedef struct moept__counter {
    int64_t allocations, bytes;
} moept__counter;

static void *moept__alloc(moept__counter *c, size_t n) {
    if (n == 0) n = 1;
    void *p = MOEPT_MALLOC(n);
    if (p && c) { c->allocations++; c->bytes += (int64_t)n; }
    return p;
}

/* through a copy: a message may quote the one it replaces */
static void moept__verr(char *buf, const char *fmt, va_list ap) {
    char tmp[MOEPT__ERRLEN];
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    memcpy(buf, tmp, sizeof tmp);
}
moept_status moept__thread_fail(moept_status s, const char *fmt, ...) {
    va_list ap; va_start(ap, fmt);
    moept__verr(moept__thread_err, fmt, ap);
    va_end(ap);
    return s;
}

const char *moept_status_string(moept_status s) {
    switch (s) {
    case MOEPT_OK: return "ok";
    case MOEPT_ERR_INVALID_ARGUMENT: return "invalid argument";
    case MOEPT_ERR_OUT_OF_MEMORY: return "out of memory";
    case MOEPT_ERR_NOT_FOUND: return "not found";
    case MOEPT_ERR_NUMERIC: return "non-finite value";
    case MOEPT_ERR_STATE: return "invalid state";
    case MOEPT_ERR_IO: return "i/o error";
    case MOEPT_ERR_FORMAT: return "malformed file";
    case MOEPT_ERR_COMM: return "communication error";
    case MOEPT_ERR_UNSUPPORTED: return "unsupported";
    case MOEPT_ERR_DEVICE: return "device error";
    }
    return "unknown status";
}

/* moept_abi_layout's text: snprintf into what is left of buf, counting the whole length */
typedef struct moept__abi_out { char *buf; int64_t cap, n; } moept__abi_out;
static void moept__abi_put(moept__abi_out *o, const char *fmt, const char *a, const char *b,
                           int64_t u, int64_t v) {
    /* straight into buf (no line buffer to truncate): what fits, and its NUL, which the next line
       or the final NUL overwrites; o->cap keeps one byte for it */
    const int64_t room = o->n < o->cap ? o->cap - o->n + 1 : 0;
    int len = snprintf(room ? o->buf + o->n : NULL, (size_t)room, fmt, a, b, (long long)u, (long long)v);
    if (len > 0) o->n += len;
}

int64_t moept_abi_layout(char *buf, int64_t cap) {
    moept__abi_out o = {buf, buf && cap > 0 ? cap - 1 : 0, 0}; /* one byte kept for the NUL */
    moept__abi_put(&o, "abi %.0s%.0s%lld\n", "", "", MOEPT_ABI_VERSION, 0);
#define MOEPT__ABI_S(T) moept__abi_put(&o, "struct %s%.0s %lld\n", #T, "", (int64_t)sizeof(T), 0);
#define MOEPT__ABI_F(T, f) moept__abi_put(&o, "field %s.%s %lld %lld\n", #T, #f, \
                                          (int64_t)offsetof(T, f), (int64_t)sizeof(((T *)0)->f));
    MOEPT_ABI_STRUCTS(MOEPT__ABI_S, MOEPT__ABI_F)
#undef MOEPT__ABI_S
#undef MOEPT__ABI_F
    if (buf && cap > 0) buf[o.n < o.cap ? o.n : o.cap] = '\0';
    return o.n;
}

/* ------------------------------------------------------------------------
   GEMM descriptor: row-major C[m][n] = alpha * op(A)[m][k] * op(B)[k][n]
   + beta * C. One descriptor is built by the stages and executed by the
   builtin GEMM, CBLAS, or (moept_kernels.cu) cuBLAS, which swaps operands
   to see the same product column-major.
   ------------------------------------------------------------------------ */
typedef struct moept__gemm_ws {
    float *apack;     /* [round_up(m_max, MR)][KC], builtin GEMM only packed op(A) strips */
    float *bpack;     /* [NC/NR][KC][NR] packed op(B) strips */
    int64_t m_max;
} moept__gemm_ws;

#ifndef MOEPT_CBLAS
/* Builtin GEMM: BLIS-style packing around one register-blocked micro-kernel
   per vector ISA, picked at compile time from the target macros. Each kernel
   keeps its MR x NR tile of C in named vector variables (intrinsics), so the
   compiler's tuning (e.g. znver's preference for 128-bit vectors) cannot
   decide to keep them on the stack; tests/check_gemm_asm.sh reads the
   assembly of every target to make sure. Each element of C is summed over k
   in one fixed order, one fused multiply-add per step, whatever the thread
   count, so results do not depend on threads.
     AVX-512F     12 x 32: 24 zmm accumulators + 2 B vectors + 1 broadcast
     AVX2 + FMA    6 x 16: 12 ymm accumulators + 2 B vectors + 1 broadcast
     NEON (arm64)  8 x 12: 24 q accumulators + 3 B vectors + 2 A vectors
     portable      4 x  8: 8 accumulators of 4 floats (GCC/Clang vectors,
                   else scalar), multiply then add (no FMA assumed)
   The cache blocks: a KC x MR strip of A in L1, used against eight
   KC x NR strips of B in L2 in turn, an MC x KC block of A in L2, a
   KC x NC panel of B in the last-level cache; AVX-512's longer KC halves
   the passes over C, which is what the kernel waits for. The last strip
   of an m that is not a multiple of MR runs a kernel of fewer rows on x86
   (tiles of 64 rows: 5 whole strips and 4 rows, not 6 whole strips). */
#if defined(MOEPT_GEMM_PORTABLE)
#define MOEPT__K_PORTABLE 1
#elif defined(__AVX512F__)
#define MOEPT__K_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define MOEPT__K_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define MOEPT__K_NEON 1
#else
#define MOEPT__K_PORTABLE 1
#endif
#if defined(__AVX__) && !defined(MOEPT_GEMM_PORTABLE)
#define MOEPT__AVX_PACK 1
#include <immintrin.h> /* the x86 kernels, and the AVX transpose in B's packing */
#endif
#if defined(MOEPT__K_AVX512)
#define MOEPT__ISA "avx512f 12x32"
#define MOEPT__MR 12
#define MOEPT__NR 32
#define MOEPT__KC 512 /* C read and written half as often as at 256 */
#define MOEPT__MC 96
#define MOEPT__NC 2048
#elif defined(MOEPT__K_AVX2)
#define MOEPT__ISA "avx2+fma 6x16"
#define MOEPT__MR 6
#define MOEPT__NR 16
#define MOEPT__KC 256
#define MOEPT__MC 168
#define MOEPT__NC 2048
#elif defined(MOEPT__K_NEON)
#include <arm_neon.h>
#define MOEPT__ISA "neon 8x12"
#define MOEPT__MR 8
#define MOEPT__NR 12
#define MOEPT__KC 512
#define MOEPT__MC 120
#define MOEPT__NC 2040
#else
#ifdef MOEPT__GEMM_SCALAR
#define MOEPT__ISA "portable 4x8 scalar"
#else
#define MOEPT__ISA "portable 4x8"
#endif
#define MOEPT__MR 4
#define MOEPT__NR 8
#define MOEPT__KC 256
#define MOEPT__MC 128
#define MOEPT__NC 2048
#if (defined(__GNUC__) || defined(__clang__)) && !defined(MOEPT__GEMM_SCALAR)
#define MOEPT__VEC4 1
typedef float moept__v4 __attribute__((vector_size(16)));
#endif
#endif

#if defined(__GNUC__) || defined(__clang__)
#define MOEPT__NOINLINE __attribute__((noinline))
#else
#define MOEPT__NOINLINE
#endif

#if defined(MOEPT__AVX_PACK)
/* d[q][i] = s[i][q] for an 8 x 8 block (row strides ls, ld): unpack pairs,
   shuffle quads, swap 128-bit halves */
static inline void moept__tr8x8(const float *s, int64_t ls, float *d, int64_t ld) {
    __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + ls);
    __m256 r2 = _mm256_loadu_ps(s + 2 * ls), r3 = _mm256_loadu_ps(s + 3 * ls);
    __m256 r4 = _mm256_loadu_ps(s + 4 * ls), r5 = _mm256_loadu_ps(s + 5 * ls);
    __m256 r6 = _mm256_loadu_ps(s + 6 * ls), r7 = _mm256_loadu_ps(s + 7 * ls);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(d + ld, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(d + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(d + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(d + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(d + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(d + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(d + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

/* packs rows [i0, i0+MR) x k [p0, p0+kc) of op(A) = A into dst[kc][MR]
   (A^T: moept__pack_a_strips) */
static void moept__pack_a(const moept__gemm *g, int64_t i0, int64_t p0,
                          int64_t kc, float *dst) {
    int64_t mr = g->m - i0 < MOEPT__MR ? g->m - i0 : MOEPT__MR;
    /* p outer: contiguous writes; the MR source rows stay in L1 */
    const float *src = g->a + i0 * g->lda + p0;
    if (mr == MOEPT__MR) {
        int64_t p = 0;
#if defined(MOEPT__AVX_PACK)
        /* 8 x 8 blocks through a small tile (MR need not be 8): rows of
           a power-of-two lda alias in L1 and stall the scalar copy */
        float t[8 * 8]; /* [8 of k][8 rows] */
        if (g->m - i0 >= (MOEPT__MR + 7) / 8 * 8)
            for (; p + 8 <= kc; p += 8)
                for (int64_t i = 0; i < MOEPT__MR; i += 8) {
                    int64_t w = MOEPT__MR - i < 8 ? MOEPT__MR - i : 8;
                    moept__tr8x8(src + i * g->lda + p, g->lda, t, 8);
                    for (int64_t q = 0; q < 8; q++)
                        memcpy(dst + (p + q) * MOEPT__MR + i, t + q * 8, (size_t)w * sizeof(float));
                }
#endif
        for (; p < kc; p++)
#pragma GCC unroll 16
            for (int64_t i = 0; i < MOEPT__MR; i++) dst[p * MOEPT__MR + i] = src[i * g->lda + p];
    } else {
        for (int64_t p = 0; p < kc; p++)
            for (int64_t i = 0; i < MOEPT__MR; i++)
                dst[p * MOEPT__MR + i] = i < mr ? src[i * g->lda + p] : 0.0f;
    }
}

/* packs A strips [s0, s1) (rows s0 MR on, k [p0, p0+kc)) each to
   apack + s KC MR. op(A) = A^T (the weight gradients): 8 strips at a time,
   k outer, so each stored row's stretch is read whole, once, where a strip
   at a time reads MR floats of each of kc rows lda apart (at a power-of-two
   lda, rows that share one L1 set) and the next strip reads them again.
   Packing the dW GEMMs' A alone on one thread (bench shape, AVX-512, best
   of 15 in each of five builds): 0.53 ms against 0.61-0.80 a strip at a
   time (m 1024), 3.8 against 4.7-9.2 (m 7168); 4 strips at a time 0.49 and
   4.1, 16 0.60 and 4.3 (16 write streams KC MR floats apart share an L1
   set and outnumber its ways) */
static void moept__pack_a_strips(const moept__gemm *g, int64_t s0, int64_t s1, int64_t p0, int64_t kc,
                                 float *apack) {
    const int64_t MR = MOEPT__MR, KC = MOEPT__KC;
    if (!g->trans_a) {
        for (int64_t s = s0; s < s1; s++) moept__pack_a(g, s * MR, p0, kc, apack + s * KC * MR);
        return;
    }
    for (int64_t sg = s0; sg < s1; sg += 8) {
        const int64_t sg1 = sg + 8 < s1 ? sg + 8 : s1;
        const int64_t rows = (g->m < sg1 * MR ? g->m : sg1 * MR) - sg * MR; /* stored columns to copy */
        for (int64_t p = 0; p < kc; p++) {
            const float *src = g->a + (p0 + p) * g->lda + sg * MR;
            for (int64_t s = sg; s < sg1; s++) {
                float *dst = apack + s * KC * MR + p * MR;
                const int64_t o = (s - sg) * MR, w = rows - o < MR ? rows - o : MR;
                if (w == MR) {
                    memcpy(dst, src + o, (size_t)MR * sizeof(float));
                } else {
                    for (int64_t i = 0; i < MR; i++) dst[i] = i < w ? src[o + i] : 0.0f;
                }
            }
        }
    }
}


/* packs row p of op(B) = B, cols [j0, j0+nc), into row p of each strip of
   dst[nc/NR][KC][NR]: one contiguous read of the row (reading a strip's kc
   rows instead would cross a page per row) */
static void moept__pack_b_row(const moept__gemm *g, int64_t p, int64_t j0, int64_t nc, float *dst) {
    const float *src = g->b + p * g->ldb + j0;
    int64_t s = 0;
    for (; (s + 1) * MOEPT__NR <= nc; s++)
        memcpy(dst + s * MOEPT__KC * MOEPT__NR, src + s * MOEPT__NR, MOEPT__NR * sizeof(float));
    if (s * MOEPT__NR < nc)
        for (int64_t j = 0; j < MOEPT__NR; j++)
            dst[s * MOEPT__KC * MOEPT__NR + j] = s * MOEPT__NR + j < nc ? src[s * MOEPT__NR + j] : 0.0f;
}

/* packs k [p0, p0+kc) x cols [j0, j0+NR) of op(B) = B^T into dst[kc][NR]:
   a transpose, NR source rows read along k */
static void moept__pack_bt(const moept__gemm *g, int64_t p0, int64_t j0,
                           int64_t kc, float *dst) {
    int64_t nr = g->n - j0 < MOEPT__NR ? g->n - j0 : MOEPT__NR;
    const float *src = g->b + j0 * g->ldb + p0;
    int64_t p = 0;
#if defined(MOEPT__AVX_PACK)
    if (nr == MOEPT__NR) /* in 8 x 8 blocks (NR is a multiple of 8) */
        for (; p + 8 <= kc; p += 8)
            for (int64_t j = 0; j < MOEPT__NR; j += 8)
                moept__tr8x8(src + j * g->ldb + p, g->ldb, dst + p * MOEPT__NR + j, MOEPT__NR);
#endif
    for (; p < kc; p++) /* p outer: contiguous writes; the NR source rows stay in L1 */
        for (int64_t j = 0; j < MOEPT__NR; j++)
            dst[p * MOEPT__NR + j] = j < nr ? src[j * g->ldb + p] : 0.0f;
}

/* The micro-kernel: T[MR][NR] = sum over p < kc of ap[p][:] (x) bp[p][:],
   ap packed [kc][MR], bp packed [kc][NR]; then c (row stride ldc) = T, or
   c += T when `add`. R(i) is one row of the tile. */
#if defined(MOEPT__K_AVX512) || defined(MOEPT__K_AVX2)
/* one body for both x86 kernels: VW-float vectors, two a row of the tile */
#if defined(MOEPT__K_AVX512)
#define MOEPT__VW 16
typedef __m512 moept__vx;
#define MOEPT__VZERO _mm512_setzero_ps
#define MOEPT__VLOAD _mm512_loadu_ps
#define MOEPT__VSTORE _mm512_storeu_ps
#define MOEPT__VBCAST(p) _mm512_set1_ps(*(p))
#define MOEPT__VFMA _mm512_fmadd_ps
#define MOEPT__VADD _mm512_add_ps
#else
#define MOEPT__VW 8
typedef __m256 moept__vx;
#define MOEPT__VZERO _mm256_setzero_ps
#define MOEPT__VLOAD _mm256_loadu_ps
#define MOEPT__VSTORE _mm256_storeu_ps
#define MOEPT__VBCAST(p) _mm256_broadcast_ss(p)
#define MOEPT__VFMA _mm256_fmadd_ps
#define MOEPT__VADD _mm256_add_ps
#endif
#define MOEPT__ROWS(R) R(0) R(1) R(2) R(3) R(4) R(5) R(6) R(7) R(8) R(9) R(10) R(11)
#if defined(__GNUC__) || defined(__clang__)
#define MOEPT__KINLINE static inline __attribute__((always_inline))
#else
#define MOEPT__KINLINE static inline
#endif
/* The tile's first `rows` rows (a constant once inlined: the rows past it
   and their accumulators vanish), so the last strip of an m that is not a
   multiple of MR costs what its rows need, not a whole tile. */
MOEPT__KINLINE void moept__kern_rows(int rows, int64_t kc, const float *ap, const float *bp, float *c,
                                     int64_t ldc, int add) {
#define MOEPT__R(i) moept__vx c##i##0 = MOEPT__VZERO(), c##i##1 = MOEPT__VZERO();
    MOEPT__ROWS(MOEPT__R)
#undef MOEPT__R
    for (int i = 0; i < rows; i++) { /* C's rows, while the sums run (both lines they touch) */
        _mm_prefetch((const char *)(c + i * ldc), _MM_HINT_T0);
        _mm_prefetch((const char *)(c + i * ldc + MOEPT__NR - 1), _MM_HINT_T0);
    }
    /* four steps a loop: the loop's own adds and branch a quarter as often (AVX2 on one thread, the best
       of 7 runs of bench_gemm's six products: 0.96-0.99 of OpenBLAS's Haswell kernel rolled, 0.98-1.04
       unrolled, five pairs of runs) */
#pragma GCC unroll 4
    for (int64_t p = 0; p < kc; p++, ap += MOEPT__MR, bp += MOEPT__NR) {
        moept__vx b0 = MOEPT__VLOAD(bp), b1 = MOEPT__VLOAD(bp + MOEPT__VW);
        /* B's strip streams from L2: ask for each of its lines 6 steps ahead (on one
           thread, all six products of bench_gemm: 0.85-0.92 of OpenBLAS without, 0.92-1.02
           with; 4 to 8 steps alike) */
        _mm_prefetch((const char *)(bp + 6 * MOEPT__NR), _MM_HINT_T0);
        if (MOEPT__NR * sizeof(float) > 64)
            _mm_prefetch((const char *)(bp + 6 * MOEPT__NR + 16), _MM_HINT_T0);
#define MOEPT__R(i) if (i < rows) { moept__vx a = MOEPT__VBCAST(ap + i); \
        c##i##0 = MOEPT__VFMA(a, b0, c##i##0); c##i##1 = MOEPT__VFMA(a, b1, c##i##1); }
        MOEPT__ROWS(MOEPT__R)
#undef MOEPT__R
    }
#define MOEPT__R(i) if (i < rows) { if (add) { c##i##0 = MOEPT__VADD(c##i##0, MOEPT__VLOAD(c + i * ldc)); \
        c##i##1 = MOEPT__VADD(c##i##1, MOEPT__VLOAD(c + i * ldc + MOEPT__VW)); } \
    MOEPT__VSTORE(c + i * ldc, c##i##0); MOEPT__VSTORE(c + i * ldc + MOEPT__VW, c##i##1); }
    MOEPT__ROWS(MOEPT__R)
#undef MOEPT__R
}
#undef MOEPT__ROWS
static MOEPT__NOINLINE void moept__kern(int64_t kc, const float *ap, const float *bp, float *c,
                                        int64_t ldc, int add) {
    moept__kern_rows(MOEPT__MR, kc, ap, bp, c, ldc, add);
}
/* the edge strip's kernels: at most a third and two thirds of MR rows */
#define MOEPT__KERN_EDGE 1
static MOEPT__NOINLINE void moept__kern_e1(int64_t kc, const float *ap, const float *bp, float *c,
                                           int64_t ldc, int add) {
    moept__kern_rows(MOEPT__MR / 3, kc, ap, bp, c, ldc, add);
}
static MOEPT__NOINLINE void moept__kern_e2(int64_t kc, const float *ap, const float *bp, float *c,
                                           int64_t ldc, int add) {
    moept__kern_rows(MOEPT__MR * 2 / 3, kc, ap, bp, c, ldc, add);
}
#elif defined(MOEPT__K_NEON)
static MOEPT__NOINLINE void moept__kern(int64_t kc, const float *ap, const float *bp, float *c,
                                        int64_t ldc, int add) {
    /* rows 0-3 take their A value from a lane of a0, rows 4-7 from a1 */
#define MOEPT__ROWS(R) R(0, a0, 0) R(1, a0, 1) R(2, a0, 2) R(3, a0, 3) \
                       R(4, a1, 0) R(5, a1, 1) R(6, a1, 2) R(7, a1, 3)
#define MOEPT__R(i, av, l) float32x4_t c##i##0 = vdupq_n_f32(0.0f), c##i##1 = c##i##0, c##i##2 = c##i##0;
    MOEPT__ROWS(MOEPT__R)
#undef MOEPT__R
    for (int64_t p = 0; p < kc; p++, ap += MOEPT__MR, bp += MOEPT__NR) {
        float32x4_t b0 = vld1q_f32(bp), b1 = vld1q_f32(bp + 4), b2 = vld1q_f32(bp + 8);
        float32x4_t a0 = vld1q_f32(ap), a1 = vld1q_f32(ap + 4);
#define MOEPT__R(i, av, l) c##i##0 = vfmaq_laneq_f32(c##i##0, b0, av, l); \
        c##i##1 = vfmaq_laneq_f32(c##i##1, b1, av, l); c##i##2 = vfmaq_laneq_f32(c##i##2, b2, av, l);
        MOEPT__ROWS(MOEPT__R)
#undef MOEPT__R
    }
#define MOEPT__R(i, av, l) if (add) { c##i##0 = vaddq_f32(c##i##0, vld1q_f32(c + i * ldc)); \
        c##i##1 = vaddq_f32(c##i##1, vld1q_f32(c + i * ldc + 4)); \
        c##i##2 = vaddq_f32(c##i##2, vld1q_f32(c + i * ldc + 8)); } \
    vst1q_f32(c + i * ldc, c##i##0); vst1q_f32(c + i * ldc + 4, c##i##1); vst1q_f32(c + i * ldc + 8, c##i##2);
    MOEPT__ROWS(MOEPT__R)
#undef MOEPT__R
#undef MOEPT__ROWS
}
#elif defined(MOEPT__VEC4)
static MOEPT__NOINLINE void moept__kern(int64_t kc, const float *ap, const float *bp, float *c,
                                        int64_t ldc, int add) {
#define MOEPT__ROWS(R) R(0) R(1) R(2) R(3)
#define MOEPT__R(i) moept__v4 c##i##0 = {0}, c##i##1 = {0};
    MOEPT__ROWS(MOEPT__R)
#undef MOEPT__R
    for (int64_t p = 0; p < kc; p++, ap += MOEPT__MR, bp += MOEPT__NR) {
        moept__v4 b0, b1;
        memcpy(&b0, bp, sizeof b0);
        memcpy(&b1, bp + 4, sizeof b1);
#define MOEPT__R(i) c##i##0 += ap[i] * b0; c##i##1 += ap[i] * b1;
        MOEPT__ROWS(MOEPT__R)
#undef MOEPT__R
    }
#define MOEPT__R(i) if (add) { moept__v4 t0, t1; \
        memcpy(&t0, c + i * ldc, 16); memcpy(&t1, c + i * ldc + 4, 16); c##i##0 += t0; c##i##1 += t1; } \
    memcpy(c + i * ldc, &c##i##0, 16); memcpy(c + i * ldc + 4, &c##i##1, 16);
    MOEPT__ROWS(MOEPT__R)
#undef MOEPT__R
#undef MOEPT__ROWS
}
#else
static void moept__kern(int64_t kc, const float *ap, const float *bp, float *c, int64_t ldc, int add) {
    float acc[MOEPT__MR * MOEPT__NR] = {0}; /* [MR][NR] */
    for (int64_t p = 0; p < kc; p++, ap += MOEPT__MR, bp += MOEPT__NR)
        for (int i = 0; i < MOEPT__MR; i++)
            for (int j = 0; j < MOEPT__NR; j++) acc[i * MOEPT__NR + j] += ap[i] * bp[j];
    for (int i = 0; i < MOEPT__MR; i++)
        for (int j = 0; j < MOEPT__NR; j++)
            c[i * ldc + j] = add ? c[i * ldc + j] + acc[i * MOEPT__NR + j] : acc[i * MOEPT__NR + j];
}
#endif

/* One MR x NR tile of C from packed panels (the first k block applies
   beta, later ones add): a whole tile (or the edge strip's rows, where a
   kernel has that many) with alpha 1 and beta 0 or 1 is the kernel's own
   store; other edges and scalings go through a local tile. */
static void moept__micro(int64_t kc, const float *ap, const float *bp,
                         const moept__gemm *g, int64_t i0, int64_t j0,
                         int first) {
    int64_t mr = g->m - i0 < MOEPT__MR ? g->m - i0 : MOEPT__MR;
    int64_t nr = g->n - j0 < MOEPT__NR ? g->n - j0 : MOEPT__NR;
    float *c0 = g->c + i0 * g->ldc + j0;
    void (*kern)(int64_t, const float *, const float *, float *, int64_t, int) = moept__kern;
    int krows = MOEPT__MR; /* the rows kern writes */
#ifdef MOEPT__KERN_EDGE
    if (mr <= MOEPT__MR / 3) kern = moept__kern_e1, krows = MOEPT__MR / 3;
    else if (mr <= MOEPT__MR * 2 / 3) kern = moept__kern_e2, krows = MOEPT__MR * 2 / 3;
#endif
    int whole = mr == krows && nr == MOEPT__NR && g->alpha == 1.0f;
    if (whole && (!first || g->beta == 0.0f || g->beta == 1.0f)) {
        kern(kc, ap, bp, c0, g->ldc, !first || g->beta == 1.0f);
        return;
    }
    float acc[MOEPT__MR * MOEPT__NR]; /* [MR][NR] */
    kern(kc, ap, bp, acc, MOEPT__NR, 0);
    for (int64_t i = 0; i < mr; i++) {
        float *c = c0 + i * g->ldc;
        const float *s = acc + i * MOEPT__NR;
        if (first) {
            if (g->beta == 0.0f)
                for (int64_t j = 0; j < nr; j++) c[j] = g->alpha * s[j];
            else
                for (int64_t j = 0; j < nr; j++) c[j] = g->beta * c[j] + g->alpha * s[j];
        } else {
            for (int64_t j = 0; j < nr; j++) c[j] += g->alpha * s[j];
        }
    }
}
#endif /* !MOEPT_CBLAS */

#ifndef MOEPT_CBLAS
/* B strips [s0, s1) of the panel (pc, jc; nc columns) into their places in
   bpack: by row when B is row-major (contiguous reads across the strips) */
static void moept__pack_b_span(const moept__gemm *g, int64_t pc, int64_t kc, int64_t jc, int64_t nc,
                               int64_t s0, int64_t s1, float *bpack) {
    const int64_t NR = MOEPT__NR;
    if (g->trans_b) {
        for (int64_t s = s0; s < s1; s++) moept__pack_bt(g, pc, jc + s * NR, kc, bpack + s * MOEPT__KC * NR);
        return;
    }
    int64_t w = (nc < s1 * NR ? nc : s1 * NR) - s0 * NR;
    float *dst = bpack + s0 * MOEPT__KC * NR;
    for (int64_t p = 0; p < kc; p++) moept__pack_b_row(g, pc + p, jc + s0 * NR, w, dst + p * NR);
}

/* How a descriptor's tiles split over nth threads: row blocks of whole MR
   strips, about MC rows, as many as a multiple of the team where m allows
   so each thread gets the same rows; with fewer blocks than threads, column
   chunks of the NR strips too. Where the strips do not divide among the
   threads and are few (17 strips on 2 threads: 9 against 8, a thread idle
   for a ninth of the time), each thread takes a column chunk of every
   block instead, where that leaves the busiest thread fewer tiles. Tasks
   run chunk by chunk (t = chunk * mblocks + block). */
static void moept__gemm_split(const moept__gemm *g, int64_t nth, int64_t nstrips, int64_t *mblocks,
                              int64_t *nchunks) {
    int64_t mstrips = (g->m + MOEPT__MR - 1) / MOEPT__MR;
    int64_t mb0 = (g->m + MOEPT__MC - 1) / MOEPT__MC, mb = mb0, nch = 1;
    if (mb >= nth) mb = (mb + nth - 1) / nth * nth;
    if (mb > mstrips) mb = mstrips;
    if (mb < nth) nch = (4 * nth + mb - 1) / mb;
    else if (mstrips < 32 * nth && nstrips >= 4 * nth && /* the busiest thread's tiles: fewer by columns */
             mstrips * ((nstrips + nth - 1) / nth) < (mstrips + nth - 1) / nth * nstrips) {
        mb = mb0;
        nch = nth;
    }
    *mblocks = mb;
    *nchunks = nch > nstrips ? nstrips : nch;
}

/* One descriptor's tiles of a B panel (jc, pc; call inside the parallel
   region). packa: A's k block is not packed yet. Each row block's A strips
   are packed by the thread that computes them, just before (in its L2, no
   barrier between), unless column chunks share the block: then A is
   packed by all first. packb: B is not packed yet and each strip has one
   task (a single row block), which packs it a few strips at a time, each
   used while in cache. Which thread computes a tile never changes its
   value. */
static void moept__gemm_tiles(const moept__gemm *g, const moept__gemm_ws *ws, int64_t pc, int64_t kc,
                              int64_t jc, int64_t nc, int packa, int packb) {
    const int64_t MR = MOEPT__MR, NR = MOEPT__NR, KC = MOEPT__KC, nstrips = (nc + NR - 1) / NR;
    int64_t nth = 1, mblocks, nchunks;
#ifdef _OPENMP
    nth = omp_get_num_threads();
#endif
    moept__gemm_split(g, nth, nstrips, &mblocks, &nchunks);
    int64_t mstrips = (g->m + MR - 1) / MR;
    if (packa && nchunks > 1) { /* blocks shared by threads: A packed once, first, a stretch a thread */
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < nth; t++)
            moept__pack_a_strips(g, mstrips * t / nth, mstrips * (t + 1) / nth, pc, kc, ws->apack);
    }
    int64_t ntasks = mblocks * nchunks;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < ntasks; t++) {
        int64_t ch = t / mblocks, mb = t % mblocks;
        int64_t s0 = nstrips * ch / nchunks, s1 = nstrips * (ch + 1) / nchunks;
        int64_t i0 = mstrips * mb / mblocks, i1 = mstrips * (mb + 1) / mblocks;
        if (packa && nchunks == 1) moept__pack_a_strips(g, i0, i1, pc, kc, ws->apack);
        for (int64_t sg = s0; sg < s1; sg += 8) {
            int64_t sg1 = sg + 8 < s1 ? sg + 8 : s1;
            if (packb) moept__pack_b_span(g, pc, kc, jc, nc, sg, sg1, ws->bpack);
            for (int64_t i = i0; i < i1; i++) /* A's strip stays in L1 while B's strips stream */
                for (int64_t s = sg; s < sg1; s++)
                    moept__micro(kc, ws->apack + i * KC * MR, ws->bpack + s * KC * NR, g, i * MR, jc + s * NR,
                                 pc == 0);
        }
    }
}

/* The builtin GEMM over `count` descriptors that share op(B) (one call: one
   descriptor; the chunked overlap: one expert's runs from several sources):
   each B panel is packed once for all of them, and every element of C gets
   the same packed operands and the same sequence of k-block sums as with
   one call per descriptor, so the results are bitwise those. Each m must fit
   the A packing buffer (m <= m_max). One parallel region for all panels: B
   is packed by the team (then a barrier), or, for one descriptor of one
   row block, strip by strip by the tasks that use it. k blocks outside
   column panels: one descriptor's A block is packed once for all the
   panels of its k block (at Mixtral's n = 7168 it was packed four times);
   the descriptors of one call share the A buffer, so theirs are packed at
   every panel. */
static void moept__gemm_builtin(const moept__gemm *gs, int64_t count, moept__gemm_ws *ws) {
    const moept__gemm *g0 = &gs[0];
    const int64_t NR = MOEPT__NR;
    int64_t mtotal = 0;
    for (int64_t d = 0; d < count; d++) mtotal += gs[d].m;
    int64_t work = mtotal * (g0->n < MOEPT__NC ? g0->n : MOEPT__NC) * (g0->k < MOEPT__KC ? g0->k : MOEPT__KC);
    (void)work; /* read only by the parallel region's condition */
    #pragma omp parallel if (work > (1 << 19)) num_threads(moept__team(0))
    for (int64_t pc = 0; pc < g0->k; pc += MOEPT__KC) {
        int64_t kc = g0->k - pc < MOEPT__KC ? g0->k - pc : MOEPT__KC;
        for (int64_t jc = 0; jc < g0->n; jc += MOEPT__NC) {
            int64_t nc = g0->n - jc < MOEPT__NC ? g0->n - jc : MOEPT__NC, nstrips = (nc + NR - 1) / NR;
            int64_t nth = 1, mblocks, nchunks;
#ifdef _OPENMP
            nth = omp_get_num_threads();
#endif
            moept__gemm_split(g0, nth, nstrips, &mblocks, &nchunks);
            int packb = count == 1 && mblocks == 1;
            if (!packb) { /* eight strips a task: rows of B read 8 NR wide */
                #pragma omp for schedule(static)
                for (int64_t s = 0; s < nstrips; s += 8)
                    moept__pack_b_span(g0, pc, kc, jc, nc, s, s + 8 < nstrips ? s + 8 : nstrips, ws->bpack);
            }
            for (int64_t d = 0; d < count; d++)
                moept__gemm_tiles(&gs[d], ws, pc, kc, jc, nc, count > 1 || jc == 0, packb);
        }
    }
}
#endif

const char *moept_gemm_kernel(void) {
#ifdef MOEPT_CBLAS
    return "cblas";
#else
    return "builtin " MOEPT__ISA;
#endif
}

/* Executes a batch of descriptors (one per expert group), in order. */
static void moept__gemm_run(const moept__gemm *gs, int64_t count,
                            moept__gemm_ws *ws) {
    for (int64_t i = 0; i < count; i++) {
        const moept__gemm *g = &gs[i];
        if (g->m == 0 || g->n == 0) continue;
        if (g->k == 0) { /* C = beta * C */
            if (g->beta == 1.0f) continue;
            for (int64_t r = 0; r < g->m; r++)
                for (int64_t j = 0; j < g->n; j++)
                    g->c[r * g->ldc + j] = g->beta == 0.0f ? 0.0f : g->beta * g->c[r * g->ldc + j];
            continue;
        }
#ifndef MOEPT_CBLAS
        if (g->m > ws->m_max) { /* row blocks that fit the packing buffer */
            for (int64_t r0 = 0; r0 < g->m; r0 += ws->m_max) {
                moept__gemm b = *g;
                b.m = g->m - r0 < ws->m_max ? g->m - r0 : ws->m_max;
                b.a = g->trans_a ? g->a + r0 : g->a + r0 * g->lda;
                b.c = g->c + r0 * g->ldc;
                moept__gemm_run(&b, 1, ws);
            }
            continue;
        }
#endif
#ifdef MOEPT_CBLAS
        (void)ws;
        cblas_sgemm(CblasRowMajor, g->trans_a ? CblasTrans : CblasNoTrans,
                    g->trans_b ? CblasTrans : CblasNoTrans, (int)g->m, (int)g->n,
                    (int)g->k, g->alpha, g->a, (int)g->lda, g->b, (int)g->ldb,
                    g->beta, g->c, (int)g->ldc);
#else
        moept__gemm_builtin(g, 1, ws);
#endif
    }
}

/* ------------------------------------------------------------------------
   The executor interface
   ------------------------------------------------------------------------ */
/* An executor runs a layer's steps (moept__exec, moept.h's internal part):
   the CPU executor (moept__cpu_exec) from this file's stage functions, the
   CUDA executor (its table at the end of moept_kernels.cu) from its
   kernels. Every call goes through MOEPT__EX: a NULL
   entry is a step that executor does not need (the CPU keeps nothing on a
   device, so it has nothing to copy or settle). What an executor cannot do
   is a missing capability bit, refused in one place (moept__ex_refuse) with
   one message shape, on every rank. */
static const char *const moept__cap_names[MOEPT__NCAPS] = {
    "config.router_jitter", "config.inference_only", "config.grad_backup", "MOEPT_AUX_SEQ",
    "config.expert_sharding = MOEPT_SHARD_FSDP", "a padding mask (opts.mask)", "resharding",
    "running on the host", "device parameters", "config.fp8"};

/* an entry the executor may leave NULL: MOEPT_OK (nothing to do) */
#define MOEPT__EX(L, fn, ...) ((L)->ex->fn ? (L)->ex->fn(__VA_ARGS__) : MOEPT_OK)
static const moept__exec moept__cpu_exec;

/* The one refusal: MOEPT_ERR_UNSUPPORTED and "call: feature is not
   supported by the X executor" in why[MOEPT__ERRLEN] when ex lacks cap */
static moept_status moept__ex_refuse(const moept__exec *ex, unsigned cap, const char *call, char *why) {
    if (ex->caps & cap) return MOEPT_OK;
    int bit = 0;
    while (bit < MOEPT__NCAPS - 1 && !(cap & (1u << bit))) bit++;
    snprintf(why, MOEPT__ERRLEN, "%s: %s is not supported by %s", call, moept__cap_names[bit], ex->name);
    return MOEPT_ERR_UNSUPPORTED;
}

/* A config's features the executor lacks (at create, agreed with the config) */
static moept_status moept__ex_refuse_config(const moept__exec *ex, const moept_config *c, const char *call,
                                            char *why) {
    const int need[6] = {c->router_jitter != 0.0f, c->inference_only != 0, c->grad_backup != 0,
                         c->aux_loss == MOEPT_AUX_SEQ, c->expert_sharding == MOEPT_SHARD_FSDP,
                         c->fp8 != MOEPT_FP8_OFF};
    const unsigned cap[6] = {MOEPT__CAN_JITTER, MOEPT__CAN_INFERENCE, MOEPT__CAN_GRAD_BACKUP,
                             MOEPT__CAN_AUX_SEQ, MOEPT__CAN_FSDP, MOEPT__CAN_FP8};
    moept_status st = MOEPT_OK;
    for (int i = 0; i < 6 && !st; i++)
        if (need[i]) st = moept__ex_refuse(ex, cap[i], call, why);
    return st;
}

/* ------------------------------------------------------------------------
   The layer: its state, config, create and parameters
   ------------------------------------------------------------------------ */
typedef enum moept__ptype {
    MOEPT__P_ROUTER, MOEPT__P_BIAS, MOEPT__P_GATE, MOEPT__P_UP, MOEPT__P_DOWN,
    MOEPT__P_SGATE_PROJ, MOEPT__P_SUP, MOEPT__P_SDOWN, MOEPT__P_SGATE
} moept__ptype;

typedef struct moept__param {
    char name[64];
    moept__ptype type;
    int64_t expert;        /* global expert id for expert weights, else -1 */
    int64_t rows, cols;    /* logical HF shape [rows][cols] */
    int64_t off;           /* first element's index in the parameter buffer; -1: none (the
                              bias, fsdp's expert tensors) */
    float *data;           /* its host home (NULL where the buffers are a device's: L->ex->io) */
    float *grad;           /* NULL: no gradient (the bias, an inference layer, a device's) */
    int trains;            /* it has a gradient (and AdamW moments) */
    int64_t flat;          /* fsdp: offset in the full expert space (data, grad NULL); else -1 */
} moept__param;

/* The layer's state, grouped by concern as llm.c groups its tensors: the
   parameters, the committed forward the backward differentiates, the plan
   of the step, the expert-parallel exchange, the chunked overlap, the FSDP
   shard, the CPU steps' workspace, AdamW's state, the device's counters. */
typedef struct moept__params {      /* one buffer, gradients mirror it */
    /* the host's buffers, NULL where an executor keeps them (L->ex->io: a device's) */
    float *params, *grads; int64_t n_params;
    int trains;            /* the layer has gradients (not inference_only) */
    int64_t o13, o2, os13, os2, osg; /* offsets of w13, w2, ws13, ws2, wsg (-1: none; router at 0) */
    int64_t n_exp;         /* expert floats in the parameter buffer (El (H+F) D, or the fsdp shard) */
    float *w_router;       /* [E][D] (these NULL where the buffers are a device's) */
    float *w13;            /* [El][H][D] local experts: gate rows 0..F-1, up rows F..2F-1 */
    float *w2;             /* [El][D][F] */
    float *ws13;           /* [HS][D] shared gate+up */
    float *ws2;            /* [D][S] shared down */
    float *wsg;            /* [1][D] shared-expert gate (NULL if ungated) */
    float *g_router, *g13, *g2, *gs13, *gs2, *gsg; /* gradient mirrors */
    float *bias;           /* [E] correction bias (not a trainable parameter; the host's always) */
    moept__param *table; int64_t n_table;
    float *block;          /* what holds the host's buffers and the bias */
    float *grads_copy;     /* [n_params] config.grad_backup: the gradients as an accumulating
                              backward found them */
    /* a backward whose dx came out non-finite left partial sums in
       gradients accumulated before it: adamw_step and grad_norm refuse them
       until zero_grad. -1: none; else dx's first bad element (or 0 for a peer's) */
    int64_t grads_dx_bad;
    int64_t grads_dl_bad;       /* CUDA: opts.dlogits' first non-finite element since zero_grad, or -1 */
    moept_status grads_sf_bad;  /* sync-free CUDA: a step since zero_grad failed its device checks */
    char grads_sf_why[MOEPT__ERRLEN];
} moept__params;

typedef struct moept__saved {       /* the committed forward (double-buffered router outputs so
                                       a rejected step leaves the previous one intact) */
    int cur;               /* which of [2] is committed */
    float *logits[2];      /* [Tmax][E] */
    float *probs[2];       /* [Tmax][E] router scores: softmax p or sigmoid s */
    int32_t *ids[2];       /* [Tmax][K] */
    float *wts[2];         /* [Tmax][K] */
    int64_t T;             /* tokens of the committed forward, -1 none */
    int valid;
    int bwd_valid;         /* a backward ran since the last forward */
    const char *stale;     /* the call that changed the weights since this forward (NULL: none) */
    uint64_t x_fp;         /* the forward's x, fingerprinted: backward checks it got the same */
    int eval;              /* the committed forward was an evaluation: nothing kept for backward */
    int jitter;            /* its router saw jittered x, drawn under jkey */
    uint64_t jkey;
    float *xj;             /* [Tmax][D] the router's jittered input (router_jitter > 0) */
    uint64_t *jrow[2];     /* [Tmax] the tokens' hashes that key their noise (as logits[2]) */
    double *lstat;         /* [ls.n] loss statistics (all-reduced when global) */
    moept__lso ls;         /* their fields' offsets (moept.h) */
    double aux_value, z_value; /* the losses in double */
    double loss_T;         /* tokens the losses average over (global or local) */
    int counts_global;     /* sel_counts are the whole batch's (all ranks) */
    int64_t *sel_counts;   /* [E] selections before capacity (loss counts) */
    int64_t *aux_counts;   /* [E] counts used by the aux loss */
    float *aux_g;          /* [nseq][E] d(aux_coef * aux)/d score_t,e: the same for every t
                              (nseq 1), or for every t of a sequence (MOEPT_AUX_SEQ) */
    float *lse;            /* [Tmax] logsumexp of logits (z-loss) */
    int64_t sh_n;          /* unmasked tokens (< T: padded) */
} moept__saved;

typedef struct moept__plan {        /* the placement, and the plan's scratch */
    int32_t *slot_of;      /* [E] placement: expert e lives on rank slot_of[e] / El, local
                              index slot_of[e] % El; the plan orders rows by slot, so
                              dispatch order follows the placement (identity at create) */
    int32_t *expert_at;    /* [E] the inverse: the expert in each slot */
    int64_t *fill;         /* [E] plan cursor */
    double *seqstat;       /* [2E + 1] one sequence's aux counts, score sums, tokens */
    float *choice;         /* [nthreads][2E] per-thread scratch */
    int32_t *kscratch;     /* [nthreads][K] */
} moept__plan;

typedef struct moept__fplan {       /* a forward's plan: where each routed row goes */
    int64_t *counts;       /* [E] rows kept per expert */
    int64_t *counts_next;  /* [E] kept rows per expert of a step not yet committed */
    int64_t *offsets;      /* [E+1] first permuted row of each expert */
    int64_t *row_of;       /* [Tmax*K] permuted row of assignment t*K+k, -1 dropped */
    int64_t *tok_of_row;   /* [Nmax] token of each permuted row */
    int64_t N;             /* rows kept this step */
} moept__fplan;

typedef struct moept__exch {        /* the expert-parallel exchange: the layer's */
    moept_seg *count_segs; /* [2][P] the count exchange's pieces */
    int direct;            /* the experts' rows in the EP comm's shared memory: token ranks
                              write and read them in place (no exchange buffers) */
} moept__exch;

typedef struct moept__fexch {       /* a forward's exchange */
    int64_t *rcounts;      /* [P][El] rows from peer p for local expert j */
    int64_t *rcounts_next; /* [P][El] the same for a step not yet committed */
    int64_t *roffsets;     /* [El+1] first received row of each local expert */
    moept_seg *send_segs;  /* [P][El] dispatch pieces (elements): xs for peer q's expert j */
    moept_seg *recv_segs;  /* [P][El] dispatch pieces (elements): xr from peer p, expert j */
    int64_t R, Rcap;       /* rows received this step; rows the receive block holds */
    void *rwork;           /* receive-side block: [xr | yr (P > 1)] | h | a */
    int64_t *peer_rows;    /* [2][P] rows sent to / received from each peer */
    void *shm;             /* direct: this rank's shared block (ep->shm_free) */
    float **shbase;        /* [2][P] direct: every rank's shared block, [shcap][D] xr then
                              [shcap][D] yr; the second half: a growing step's new blocks */
    int64_t shcap;         /* direct: rows of xr (and of yr) every rank's shared block holds */
    int64_t *allcnt, *allcnt_next; /* [P][E] direct: every rank's rows per slot */
    int64_t *dst_row;      /* [E] direct: where our rows of slot s start in its rank's xr/yr */
} moept__fexch;

typedef struct moept__chunks {      /* chunked overlap (C > 1) */
    int64_t *ccnt, *ccnt_next;   /* [C][E] kept rows per chunk and slot */
    int64_t *rccnt, *rccnt_next; /* [P][C][El] rows from peer p in chunk c for local expert j */
    int64_t *cmsg;         /* [P][C][El] the chunked count message (send side) */
    moept_seg *csend, *crecv; /* [C][P][El] each chunk's exchange pieces (elements) */
    int64_t *cruns;        /* [3][El * P] a chunk's row runs: first row, rows, local expert */
    float *da;             /* [Rcap][F] da (the backward: a must survive for dW2) */
    float *dx;             /* [Rcap][D] dxs (the backward: dyr must survive for dW2) */
} moept__chunks;

typedef struct moept__fsdp {        /* this rank's flat shard of the full expert space
                                       [w13 of all E | w2 of all E] (expert_sharding = FSDP) */
    int64_t total, shard;  /* E (H+F) D, and ceil(that / P) */
    float *full;           /* [P * shard] gathered experts: w13 [E][H][D] then w2 [E][D][F] */
    float *gfull;          /* [P * shard] this rank's full expert gradients of a backward */
    float *w, *g;          /* [shard] the shard in the parameter / gradient buffers */
    double gather_seconds;
} moept__fsdp;

typedef struct moept__fws {         /* a forward's activations (the CPU steps') */
    float *xs;             /* [Nmax][D] permuted input rows = the dispatch send buffer
                              (none on the direct path; moept__q8_recs: [Nmax] FP8 records, packed,
                              as many bytes as the larger: x's, then the backward's dys') */
    union {                /* [Nmax][D] one buffer, a name per content (none on the direct path): */
        float *ys;         /* the experts' outputs (combine's receive buffer) */
        float *dys;        /* backward, combine': their gradients, to the experts */
        float *dxs;        /* backward, experts': the gradients of their inputs, back */
    };
    float *xr;             /* [Rcap][D] rows this rank's experts process (P = 1: xs) */
    union {                /* [Rcap][D] (P = 1: ys) */
        float *yr;         /* the experts' outputs */
        float *dyr;        /* backward: their gradients, received */
        float *dxr;        /* backward: the gradients of the experts' inputs (over dyr) */
    };
    float *h;              /* [Rcap][H] expert pre-activations (gate|up) */
    float *a;              /* [Rcap][lda_a] expert activations; backward: da. An inference
                              layer writes them over h's first F columns (lda_a = H) */
    float *hs;             /* [Tmax][HS] shared pre-activations */
    float *as;             /* [Tmax][lda_as] shared activations; backward: da (inference: hs) */
    float *yss;            /* [Tmax][D] shared outputs; backward: dys_shared */
    float *sg;             /* [Tmax] shared gate values (sigmoid) */
    float *dwts;           /* [Tmax][K] dL/d routing weight */
    float *q1, *q2;        /* config.fp8: [Rcap][max(D, H)] and [Rcap][D] the experts' quantized
                              operands (backward: a, dy, dh, x tiled for the wgrad) */
    uint8_t *xq;           /* [Rcap][moept__q8_recw(D)] config.fp8 under EP (moept__q8_recs): x's rows
                              as they arrive, FP8 records (decoded into xr); the backward's dy's (into
                              dyr) */
} moept__fws;

typedef struct moept__workspace {   /* the CPU steps' scratch, the layer's */
    int64_t lda_a, lda_as; /* a's and as's row strides: F and S, or H and HS */
    float *dsg;            /* [Tmax] shared gate logit gradients */
    /* a padded step's shared expert runs over the unmasked rows only, packed
       (allocated at the first such step): whatever padded rows of x hold
       changes nothing, and the GEMMs are those of the call without them */
    float *xsh;            /* [Tmax][D] the unmasked rows of x, packed */
    int64_t *shrow;        /* [Tmax] their tokens */
    float *xz;             /* [Tmax][D] a padded step's router-gradient input: padded rows zero (made at the
                              first such forward) */
    float *dlogits;        /* [Tmax][E] */
    moept__gemm *descs;    /* [El * P] grouped GEMM descriptors (a chunk: one per expert and source) */
    moept__gemm_ws gws;
    /* config.fp8: the weights quantized (made at each forward) and the shared expert's operands */
    float *q8w13, *q8w2;   /* [El][H][D], [El][D][F] */
    float *q8ws13, *q8ws2; /* [HS][D], [D][S] */
    float *q8s1, *q8s2;    /* [Tmax][max(D, HS)], [Tmax][D] (training: both; else q8s1's D columns) */
    int64_t q8w_bytes;     /* the quantized weights' part of the block (moept_stats' CASTS) */
} moept__workspace;

/* A forward's state: what a training forward writes and its backward reads
   (with the double buffers it commits between), one per forward slot. The
   rest is the layer's: parameters, gradients, AdamW, placement, comms,
   counters, scratch (router choice, fill, seqstat, GEMM packing and
   descriptors, dlogits, dsg, the shared expert's packed rows, which the
   backward packs again, fsdp's gathered experts, which it gathers again). */
typedef struct moept__fstate {
    moept__saved fwd;      /* the router's outputs, losses, x's fingerprint, the jitter key */
    moept__fplan plan;
    moept__fexch xch;
    moept__chunks ch;
    moept__fws ws;
    void *work;            /* the block its buffers live in (the receive rows: xch.rwork) */
    int64_t work_bytes;
    int ready;             /* its buffers are allocated (slot 0 at create, others at first use) */
} moept__fstate;

struct moept_layer {
    moept_config cfg;      /* resolved */
    int64_t D, F, E, K, S; /* hidden, expert width, experts, top-k, shared */
    int64_t H, HS;         /* rows of w13: 2F gated / F; shared: 2S / S */
    int act;
    int64_t Tmax, Nmax;    /* tokens, routed rows per step */
    int64_t C;             /* chunks per step (1: off) */
    int nthreads;
    double capacity_factor;    /* the float config value read as the decimal
                                  it was written as (0.6f -> 0.6), so that
                                  ceil(0.6 * 20) is 12 as in Megatron */
    /* the groups */
    moept_comm *ep, *dp;   /* NULL: a single rank */
    moept_comm *fsdp;      /* expert_sharding = FSDP's group (NULL: expert parallel, or one rank) */
    moept_comm *group;     /* the ranks whose tokens differ and that replicate the router and
                              shared expert: ep, or the fsdp group (NULL: one rank) */
    int P, rank;           /* EP group size and this rank */
    int64_t El;            /* experts per rank, E / P */
    int64_t agreed_calls;  /* calls agreed by moept__agree_call: their order's tag */
    /* the executor that runs the steps (moept__cpu_exec, or the CUDA
       executor's table), and its own state (NULL on the CPU) */
    const struct moept__exec *ex;
    void *xstate;

    moept__params par;
    moept__plan plan;
    moept__exch xch;
    moept__fsdp fs;
    moept__workspace ws;
    /* AdamW: [n_params] moments (the CPU's; first step allocates), steps, whether the
       layer has moments (the CPU's, or its executor's) */
    struct { float *m, *v; int64_t t; int held; } opt;
    double opt_mb, opt_vb; /* bounds on this rank's max |m|, max v (INFINITY: unknown: the step probes) */
    int grads_unsynced;    /* a group layer's backward since moept_sync_grads (zero_grad, grads_synced) */
    struct {               /* the device executor's: since create; held now, by moept_mem_kind on the
                              device, and its own host blocks */
        int64_t allocations, allocated_bytes, workspace_bytes, bytes[MOEPT_MEM_NKINDS], host;
    } dev;

    moept__counter mem;
    void *work;            /* the block the layer's own buffers live in */
    int64_t work_bytes;
    moept_stats stats;
    /* forward slots: slot s's forward state (moept__fstate), s < nslots a
       training forward's (opts.slot), nslots the evaluations' (a training
       layer's); last: the slot of the last forward that succeeded */
    int nslots, last;      /* max(1, max_inflight) */
    moept__fstate *slots;  /* [nslots + 1] */
    int64_t jitter_micro;  /* training forwards since the last AdamW step (the noise key) */
    int jitter_frozen;     /* tests: draw the last forward's noise again (finite differences) */
};



static void moept__fsdp_write(moept_layer *L, int64_t flat, const float *src, int64_t n);
static moept_status moept__io(const moept_layer *L, int which, int64_t off, int64_t n, float *h, int write);
static moept_status moept__tables_changed(moept_layer *L);
static moept_status moept__params_written(moept_layer *L);
static moept_status moept__bias_set(moept_layer *L, const float *src, float *was);
/* The group calls (moept.h's table): each agreement carries the call's id
   and a fingerprint of the arguments that must match on every rank */
static const struct { const char *name, *args; } moept__calls[MOEPT__NCALLS] = {
    [MOEPT__CALL_FORWARD] = {"moept_forward", "opts.slot or opts.eval"},
    [MOEPT__CALL_BACKWARD] = {"moept_backward", "router_loss_scale or opts.slot"},
    [MOEPT__CALL_SYNC_GRADS] = {"moept_sync_grads", "scale"},
    [MOEPT__CALL_GRAD_NORM] = {"moept_grad_norm", ""},
    [MOEPT__CALL_UPDATE_BIAS] = {"moept_update_bias", "rate"},
    [MOEPT__CALL_ADAMW_STEP] = {"moept_adamw_step", "hyperparameters (lr, betas, eps, weight_decay)"},
    [MOEPT__CALL_SAVE_CHECKPOINT] = {"moept_save_checkpoint", "directories"},
    [MOEPT__CALL_SAVE_FILES] = {"moept_save_checkpoint: files", ""},
    [MOEPT__CALL_SAVE_COMMIT] = {"moept_save_checkpoint: commit", ""},
    [MOEPT__CALL_LOAD_CHECKPOINT] = {"moept_load_checkpoint", "directories"},
    [MOEPT__CALL_LOAD_HF] = {"moept_load_hf", "directories or layer indices"},
    [MOEPT__CALL_RESHARD] = {"moept_reshard", "placements (new_rank) or optimizer steps"},
    [MOEPT__CALL_LOAD_COMMIT] = {"a load's commit", ""},
};
static moept_status moept__agree_call(moept_layer *L, moept_comm *grp, moept_comm *dp, moept_status local,
                                      int call, uint64_t args);

/* a layer's failure: the thread's message too (L names the call's layer) */
moept_status moept__fail(const moept_layer *L, moept_status s, const char *fmt, ...) {
    (void)L;
    va_list ap; va_start(ap, fmt);
    moept__verr(moept__thread_err, fmt, ap);
    va_end(ap);
    return s;
}

const char *moept_last_error(const moept_layer *layer) {
    (void)layer;
    return moept__thread_err;
}

static const char *moept__family_name(int f) {
    switch (f) {
    case MOEPT_FAMILY_MIXTRAL: return "mixtral";
    case MOEPT_FAMILY_QWEN2_MOE: return "qwen2_moe";
    case MOEPT_FAMILY_OLMOE: return "olmoe";
    case MOEPT_FAMILY_DEEPSEEK_V3: return "deepseek_v3";
    }
    return "?";
}

moept_config moept_config_default(moept_family family) {
    moept_config c;
    memset(&c, 0, sizeof c);
    c.family = family;
    return c;
}

/* Validates and resolves defaults. Writes a message naming the field. */
#define MOEPT__BAD(...) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, __VA_ARGS__)
/* the model's fields: sizes, routing, the shared expert */
static moept_status moept__resolve_model(moept_config *c) {
    if ((unsigned)c->family > MOEPT_FAMILY_DEEPSEEK_V3)
        MOEPT__BAD("config.family: %d is not a moept_family", (int)c->family);
    if (c->hidden_size <= 0 || c->hidden_size > (1 << 20))
        MOEPT__BAD("config.hidden_size: %lld must be in 1..1048576", (long long)c->hidden_size);
    if (c->intermediate_size <= 0 || c->intermediate_size > (1 << 20))
        MOEPT__BAD("config.intermediate_size: %lld must be in 1..1048576", (long long)c->intermediate_size);
    if (c->num_experts <= 0 || c->num_experts > 65536)
        MOEPT__BAD("config.num_experts: %lld must be in 1..65536", (long long)c->num_experts);
    if (c->top_k <= 0 || c->top_k > c->num_experts)
        MOEPT__BAD("config.top_k: %lld must be in 1..num_experts (%lld)", (long long)c->top_k,
                   (long long)c->num_experts);
    if (c->norm_topk_prob < MOEPT_NORM_OFF || c->norm_topk_prob > MOEPT_NORM_ON)
        MOEPT__BAD("config.norm_topk_prob: %d must be 1 (on), -1 (off) or 0 (the family's default)",
                   c->norm_topk_prob);
    if (c->norm_topk_prob == MOEPT_NORM_DEFAULT) /* as transformers' blocks and configs */
        c->norm_topk_prob = c->family == MOEPT_FAMILY_MIXTRAL || c->family == MOEPT_FAMILY_DEEPSEEK_V3;
    else c->norm_topk_prob = c->norm_topk_prob == MOEPT_NORM_ON;
    if ((unsigned)c->activation > MOEPT_ACT_RELU)
        MOEPT__BAD("config.activation: %d is not a moept_activation", (int)c->activation);
    if (c->shared_intermediate_size < 0 || c->shared_intermediate_size > (1 << 20))
        MOEPT__BAD("config.shared_intermediate_size: %lld must be in 0..1048576",
                   (long long)c->shared_intermediate_size);
    if ((unsigned)c->shared_gate > MOEPT_SHARED_GATE_SIGMOID)
        MOEPT__BAD("config.shared_gate: %d is not a moept_shared_gate", (int)c->shared_gate);
    if (c->shared_gate == MOEPT_SHARED_GATE_DEFAULT)
        c->shared_gate = c->family == MOEPT_FAMILY_QWEN2_MOE ? MOEPT_SHARED_GATE_SIGMOID
                                                            : MOEPT_SHARED_GATE_NONE;
    if (c->overlap_chunks == 0) c->overlap_chunks = 1;
    if (c->overlap_chunks < 1 || c->overlap_chunks > MOEPT_MAX_CHUNKS)
        MOEPT__BAD("config.overlap_chunks: %lld must be in 0..%d", (long long)c->overlap_chunks,
                   MOEPT_MAX_CHUNKS);
    if ((unsigned)c->expert_sharding > MOEPT_SHARD_FSDP)
        MOEPT__BAD("config.expert_sharding: %d is not a moept_sharding", (int)c->expert_sharding);
    if (c->n_group == 0) c->n_group = 1;
    if (c->topk_group == 0) c->topk_group = 1;
    if (c->n_group < 1 || c->n_group > 64 || c->num_experts % c->n_group != 0)
        MOEPT__BAD("config.n_group: %lld must be in 1..64 and divide num_experts (%lld)",
                   (long long)c->n_group, (long long)c->num_experts);
    if (c->topk_group < 1 || c->topk_group > c->n_group)
        MOEPT__BAD("config.topk_group: %lld must be in 1..n_group (%lld)", (long long)c->topk_group,
                   (long long)c->n_group);
    if (c->n_group > 1) {
        if (c->family != MOEPT_FAMILY_DEEPSEEK_V3)
            MOEPT__BAD("config.n_group: group-limited routing (n_group %lld) needs family deepseek_v3",
                       (long long)c->n_group);
        if (c->num_experts / c->n_group < 2)
            MOEPT__BAD("config.n_group: each group needs at least 2 experts (E/n_group = %lld)",
                       (long long)(c->num_experts / c->n_group));
        if (c->top_k > c->topk_group * (c->num_experts / c->n_group))
            MOEPT__BAD("config.top_k: %lld exceeds the experts in topk_group groups (%lld)",
                       (long long)c->top_k, (long long)(c->topk_group * (c->num_experts / c->n_group)));
    }
    if (!(c->routed_scaling_factor >= 0.0f) || !moept__finite(c->routed_scaling_factor))
        MOEPT__BAD("config.routed_scaling_factor: must be finite and >= 0 (0 = 1.0)");
    if (c->routed_scaling_factor == 0.0f) c->routed_scaling_factor = 1.0f;
    if (c->family != MOEPT_FAMILY_DEEPSEEK_V3 && c->routed_scaling_factor != 1.0f)
        MOEPT__BAD("config.routed_scaling_factor: only deepseek_v3 scales routed weights");
    if ((unsigned)c->group_fill > MOEPT_GROUP_FILL_ZERO)
        MOEPT__BAD("config.group_fill: %d is not a moept_group_fill", (int)c->group_fill);
    return MOEPT_OK;
}

/* the training's: losses, capacity, jitter, flags, sizes of a step */
static moept_status moept__resolve_train(moept_config *c) {
    if ((unsigned)c->aux_loss > MOEPT_AUX_SEQ)
        MOEPT__BAD("config.aux_loss: %d is not a moept_aux_loss", (int)c->aux_loss);
    if (c->aux_loss != MOEPT_AUX_SEQ && c->aux_seq_len != 0)
        MOEPT__BAD("config.aux_seq_len: is %lld but config.aux_loss is not MOEPT_AUX_SEQ",
                   (long long)c->aux_seq_len);
    if (!moept__finite(c->aux_loss_coef) || c->aux_loss_coef < 0.0f)
        MOEPT__BAD("config.aux_loss_coef: must be finite and >= 0");
    if (c->aux_loss == MOEPT_AUX_NONE && c->aux_loss_coef != 0.0f)
        MOEPT__BAD("config.aux_loss_coef: is %g but config.aux_loss is none", (double)c->aux_loss_coef);
    if (!moept__finite(c->z_loss_coef) || c->z_loss_coef < 0.0f)
        MOEPT__BAD("config.z_loss_coef: must be finite and >= 0");
    if (!moept__finite(c->capacity_factor) || c->capacity_factor < 0.0f)
        MOEPT__BAD("config.capacity_factor: must be finite and >= 0 (0 = dropless)");
    if (!moept__finite(c->router_jitter) || c->router_jitter < 0.0f || c->router_jitter >= 1.0f)
        MOEPT__BAD("config.router_jitter: must be in [0, 1) (0 = off)");
    if (c->inference_only != 0 && c->inference_only != 1)
        MOEPT__BAD("config.inference_only: %d must be 0 or 1", c->inference_only);
    if (c->grad_backup != 0 && c->grad_backup != 1)
        MOEPT__BAD("config.grad_backup: %d must be 0 or 1", c->grad_backup);
    if ((unsigned)c->fp8 > MOEPT_FP8_BLOCKWISE)
        MOEPT__BAD("config.fp8: %d is not a moept_fp8", (int)c->fp8);
    if (c->fp8 != MOEPT_FP8_OFF && c->expert_sharding == MOEPT_SHARD_FSDP)
        return moept__thread_fail(MOEPT_ERR_UNSUPPORTED, "config.fp8: not with FSDP sharding (not "
                                  "supported yet)");
    if (c->max_inflight < 0 || c->max_inflight > MOEPT_MAX_INFLIGHT)
        MOEPT__BAD("config.max_inflight: %lld must be in 0..%d", (long long)c->max_inflight,
                   MOEPT_MAX_INFLIGHT);
    if (c->max_tokens <= 0 || c->max_tokens > ((int64_t)1 << 31) / c->top_k)
        MOEPT__BAD("config.max_tokens: %lld must be in 1..2^31/top_k", (long long)c->max_tokens);
    if (c->aux_loss == MOEPT_AUX_SEQ && (c->aux_seq_len < 1 || c->aux_seq_len > c->max_tokens))
        MOEPT__BAD("config.aux_seq_len: %lld must be in 1..max_tokens (%lld) for MOEPT_AUX_SEQ",
                   (long long)c->aux_seq_len, (long long)c->max_tokens);
    return MOEPT_OK;
}
#undef MOEPT__BAD

/* Checks the config and fills in the defaults (0 = the family's) */
static moept_status moept__resolve(const moept_config *in, moept_config *c) {
    *c = *in;
    moept_status st = moept__resolve_model(c);
    return st ? st : moept__resolve_train(c);
}

/* g + off, or NULL where there is no buffer */
static float *moept__goff(float *g, int64_t off) { return g ? g + off : NULL; }

/* parameter `off` floats into the buffer (fsdp experts: `off` into the full expert space) */
static void moept__add_param(moept_layer *L, moept__ptype type, int64_t expert,
                             int64_t rows, int64_t cols, int64_t off, const char *fmt, ...) {
    moept__param *p = &L->par.table[L->par.n_table++];
    va_list ap; va_start(ap, fmt);
    vsnprintf(p->name, sizeof p->name, fmt, ap);
    va_end(ap);
    p->type = type; p->expert = expert; p->rows = rows; p->cols = cols;
    p->trains = type != MOEPT__P_BIAS && L->par.trains;
    p->flat = -1;
    p->off = type == MOEPT__P_BIAS ? -1 : off;
    if (L->fsdp && expert >= 0) { /* sharded flat: no contiguous home on this rank */
        p->flat = off;
        p->off = -1;
    }
    p->data = type == MOEPT__P_BIAS ? L->par.bias : p->off >= 0 ? moept__goff(L->par.params, p->off) : NULL;
    p->grad = p->trains && p->off >= 0 ? moept__goff(L->par.grads, p->off) : NULL;
}


static void moept__build_table(moept_layer *L) {
    const int64_t D = L->D, F = L->F, E = L->E, S = L->S, HD = L->H * D;
    int mix = L->cfg.family == MOEPT_FAMILY_MIXTRAL;
    int gated = moept__act_gated(L->act);
    /* fsdp: the experts' offsets in the full expert space (w13 of all, then w2) */
    const int64_t o13 = L->fsdp ? 0 : L->par.o13, o2 = L->fsdp ? E * HD : L->par.o2;
    L->par.n_table = 0;
    moept__add_param(L, MOEPT__P_ROUTER, -1, E, D, 0, "gate.weight");
    for (int64_t j = 0; j < L->El; j++) { /* this rank's experts, named by global id */
        long long e = (long long)L->plan.expert_at[(int64_t)L->rank * L->El + j];
        if (gated) {
            moept__add_param(L, MOEPT__P_GATE, e, F, D, o13 + j * HD,
                             mix ? "experts.%lld.w1.weight" : "experts.%lld.gate_proj.weight", e);
            moept__add_param(L, MOEPT__P_UP, e, F, D, o13 + j * HD + F * D,
                             mix ? "experts.%lld.w3.weight" : "experts.%lld.up_proj.weight", e);
        } else {
            moept__add_param(L, MOEPT__P_UP, e, F, D, o13 + j * HD,
                             mix ? "experts.%lld.w1.weight" : "experts.%lld.up_proj.weight", e);
        }
        moept__add_param(L, MOEPT__P_DOWN, e, D, F, o2 + j * D * F,
                         mix ? "experts.%lld.w2.weight" : "experts.%lld.down_proj.weight", e);
    }
    if (S > 0) {
        const char *pre = L->cfg.family == MOEPT_FAMILY_DEEPSEEK_V3 ? "shared_experts" : "shared_expert";
        const int64_t os = L->par.os13;
        if (gated) {
            moept__add_param(L, MOEPT__P_SGATE_PROJ, -1, S, D, os, "%s.gate_proj.weight", pre);
            moept__add_param(L, MOEPT__P_SUP, -1, S, D, os + S * D, "%s.up_proj.weight", pre);
        } else {
            moept__add_param(L, MOEPT__P_SUP, -1, S, D, os, "%s.up_proj.weight", pre);
        }
        moept__add_param(L, MOEPT__P_SDOWN, -1, D, S, L->par.os2, "%s.down_proj.weight", pre);
        if (L->par.osg >= 0)
            moept__add_param(L, MOEPT__P_SGATE, -1, 1, D, L->par.osg, "shared_expert_gate.weight");
    }
    if (L->cfg.family == MOEPT_FAMILY_DEEPSEEK_V3)
        moept__add_param(L, MOEPT__P_BIAS, -1, 1, E, -1, "gate.e_score_correction_bias");
}

void moept_destroy(moept_layer *L) {
    if (!L) return;
    if (L->ex && L->ex->destroy) L->ex->destroy(L);
    /* every buffer lives in a block: parameters, table, workspace, a slot's */
    MOEPT_FREE(L->par.block);
    MOEPT_FREE(L->par.table);
    MOEPT_FREE(L->work); /* slot 0's buffers too */
    MOEPT_FREE(L->opt.m);
    MOEPT_FREE(L->ws.xsh);
    MOEPT_FREE(L->ws.shrow);
    MOEPT_FREE(L->ws.xz);
    for (int s = 0; L->slots && s <= L->nslots; s++) { /* and every slot's own */
        moept__fstate *sl = &L->slots[s];
        MOEPT_FREE(sl->work);
        MOEPT_FREE(sl->xch.rwork);
        if (sl->xch.shm) L->ep->shm_free(L->ep, sl->xch.shm);
    }
    MOEPT_FREE(L->slots);
    MOEPT_FREE(L);
}


/* Whether config.fp8's routed rows travel as FP8 records (moept__q8_recw:
   the exchange's messages; the direct path writes their values into the
   experts' rows, no message to shrink) */
static int moept__q8_recs(const moept_layer *L) {
    return L->cfg.fp8 != MOEPT_FP8_OFF && L->ep && !L->xch.direct;
}

/* The one-chunk forward dispatches from the token rows themselves when the
   backend can (alltoallv_rows) and the rows leave the rank (P > 1): the
   permuted order is then only an index, tok_of_row, and xs is not needed
   (not config.fp8's: its records are made first, in xs) */
static int moept__rows_dispatch(const moept_layer *L) {
    return L->ep && L->P > 1 && L->C == 1 && !L->xch.direct && L->ep->alltoallv_rows && !moept__q8_recs(L);
}

/* The workspace every executor's layer keeps on the host: the committed
   routing (moept_routing), its gradient (moept_routing_grads), the loss
   counts, placement and peer rows. */
static void moept__layout_host(moept_layer *L, moept__fstate *sl, moept__carve *c, int run, int own) {
    const int64_t T = L->Tmax, E = L->E, K = L->K;
    const size_t f = sizeof(float), i64 = sizeof(int64_t), t = !L->cfg.inference_only;
    for (int b = 0; b < 2; b++) { /* a device executor's host copy: one */
        const size_t on = b == 0 || run;
        sl->fwd.logits[b] = moept__take(c, on * (size_t)(T * E) * f);
        sl->fwd.ids[b] = moept__take(c, on * (size_t)(T * K) * sizeof(int32_t));
        sl->fwd.wts[b] = moept__take(c, on * (size_t)(T * K) * f);
    }
    if (own) {
        L->plan.slot_of = moept__take(c, (size_t)E * sizeof(int32_t));
        L->plan.expert_at = moept__take(c, (size_t)E * sizeof(int32_t));
    }
    sl->fwd.lstat = moept__take(c, (size_t)moept__lstat_of(E).n * sizeof(double));
    sl->xch.peer_rows = moept__take(c, (size_t)(2 * L->P) * i64);
    sl->fwd.sel_counts = moept__take(c, (size_t)E * i64);
    sl->fwd.aux_counts = moept__take(c, (size_t)E * i64);
    sl->ws.dwts = moept__take(c, t * (size_t)(T * K) * f);
}

/* The CPU steps' routing and plan: scores, counts, the exchange's pieces,
   each row's place */
static void moept__layout_plan(moept_layer *L, moept__fstate *sl, moept__carve *c, int own) {
    const int64_t T = L->Tmax, N = L->Nmax, E = L->E, K = L->K, P = L->P, El = L->El;
    const size_t f = sizeof(float), i64 = sizeof(int64_t), dir = L->xch.direct;
    for (int b = 0; b < 2; b++) sl->fwd.probs[b] = moept__take(c, (size_t)(T * E) * f);
    sl->plan.counts = moept__take(c, (size_t)E * i64);
    sl->plan.counts_next = moept__take(c, (size_t)E * i64);
    sl->xch.rcounts = moept__take(c, (size_t)(P * El) * i64);
    sl->xch.rcounts_next = moept__take(c, (size_t)(P * El) * i64);
    sl->xch.roffsets = moept__take(c, (size_t)(El + 1) * i64);
    sl->xch.send_segs = moept__take(c, (size_t)(P * El) * sizeof(moept_seg));
    sl->xch.recv_segs = moept__take(c, (size_t)(P * El) * sizeof(moept_seg));
    sl->plan.offsets = moept__take(c, (size_t)(E + 1) * i64);
    sl->plan.row_of = moept__take(c, (size_t)(T * K) * i64);
    sl->plan.tok_of_row = moept__take(c, (size_t)N * i64);
    sl->xch.shbase = moept__take(c, dir * (size_t)(2 * P) * sizeof(float *));
    sl->xch.allcnt = moept__take(c, dir * (size_t)(P * E) * i64);
    sl->xch.allcnt_next = moept__take(c, dir * (size_t)(P * E) * i64);
    sl->xch.dst_row = moept__take(c, dir * (size_t)E * i64);
    const int64_t nseq = L->cfg.aux_loss == MOEPT_AUX_SEQ ? T / L->cfg.aux_seq_len : 1; /* T a multiple */
    sl->fwd.aux_g = moept__take(c, (size_t)(nseq * E) * f);
    if (own) { /* the layer's scratch */
        L->plan.choice = moept__take(c, (size_t)(2 * L->nthreads * E) * f);
        L->xch.count_segs = moept__take(c, (size_t)(2 * P) * sizeof(moept_seg));
        L->plan.seqstat = moept__take(c, (size_t)(2 * E + 1) * sizeof(double));
        L->plan.fill = moept__take(c, (size_t)E * i64);
        L->plan.kscratch = moept__take(c, (size_t)(L->nthreads * K) * sizeof(int32_t));
        L->ws.descs = moept__take(c, (size_t)(El * P) * sizeof(moept__gemm));
    }
    const size_t on = L->C > 1, C = (size_t)L->C; /* chunked overlap */
    sl->ch.ccnt = moept__take(c, on * C * (size_t)E * i64);
    sl->ch.ccnt_next = moept__take(c, on * C * (size_t)E * i64);
    sl->ch.rccnt = moept__take(c, on * (size_t)(P * El) * C * i64);
    sl->ch.rccnt_next = moept__take(c, on * (size_t)(P * El) * C * i64);
    sl->ch.cmsg = moept__take(c, on * (size_t)(P * El) * C * i64);
    sl->ch.csend = moept__take(c, on * C * (size_t)(P * El) * sizeof(moept_seg));
    sl->ch.crecv = moept__take(c, on * C * (size_t)(P * El) * sizeof(moept_seg));
    sl->ch.cruns = moept__take(c, on * (size_t)(3 * El * P) * i64);
}

/* The CPU steps' activations and the GEMM's packing buffers */
static void moept__layout_acts(moept_layer *L, moept__fstate *sl, moept__carve *c, int own) {
    const int64_t T = L->Tmax, N = L->Nmax, E = L->E, D = L->D;
    const size_t f = sizeof(float);
    /* the direct (shared-memory) path gathers from x and combines from the
       experts' rows in place: no send/receive buffers on the token side */
    int64_t Nxs = L->xch.direct ? 0 : N;
    const int64_t rw = moept__q8_recs(L) ? moept__q8_recw(D) : 0, xsrow = rw > D * 4 ? rw : D * 4;
    sl->ws.xs = moept__take(c, moept__rows_dispatch(L) ? 0 : (size_t)(Nxs * xsrow));
    sl->ws.ys = moept__take(c, (size_t)(Nxs * D) * f);
    /* an inference layer keeps nothing for backward: no router or gate
       gradients, the shared activations over hs, no jitter */
    const int train = !L->cfg.inference_only, jit = train && L->cfg.router_jitter > 0.0f;
    if (L->S > 0) {
        sl->ws.hs = moept__take(c, (size_t)(T * L->HS) * f);
        sl->ws.as = train ? moept__take(c, (size_t)(T * L->S) * f) : sl->ws.hs;
        sl->ws.yss = moept__take(c, (size_t)(T * D) * f);
        sl->ws.sg = moept__take(c, (size_t)T * f);
    }
    sl->fwd.lse = moept__take(c, (size_t)T * f);
    sl->fwd.xj = moept__take(c, jit ? (size_t)(T * D) * f : 0);
    for (int b = 0; b < 2; b++) sl->fwd.jrow[b] = moept__take(c, jit ? (size_t)T * 8 : 0);
    if (!own) return; /* the rest is the layer's scratch */
    L->ws.lda_as = train ? L->S : L->HS;
    L->ws.dsg = moept__take(c, train && L->S > 0 ? (size_t)T * f : 0);
    L->ws.dlogits = moept__take(c, train ? (size_t)(T * E) * f : 0);
    const int q8 = L->cfg.fp8 != MOEPT_FP8_OFF, q8s = q8 && L->S > 0;
    const int64_t HS = L->HS, dhs = D > HS ? D : HS;
    const size_t q0 = c->off;
    L->ws.q8w13 = moept__take(c, q8 ? (size_t)(L->El * L->H * D) * f : 0);
    L->ws.q8w2 = moept__take(c, q8 ? (size_t)(L->El * D * L->F) * f : 0);
    L->ws.q8ws13 = moept__take(c, q8s ? (size_t)(HS * D) * f : 0);
    L->ws.q8ws2 = moept__take(c, q8s ? (size_t)(D * L->S) * f : 0);
    L->ws.q8w_bytes = q8 ? (int64_t)(c->off - q0) : 0;
    L->ws.q8s1 = moept__take(c, q8s ? (size_t)(T * (train ? dhs : D)) * f : 0);
    L->ws.q8s2 = moept__take(c, q8s && train ? (size_t)(T * D) * f : 0);
    if (L->fsdp) {
        L->fs.full = moept__take(c, (size_t)(L->fsdp->size * L->fs.shard) * f);
        L->fs.gfull = moept__take(c, train ? (size_t)(L->fsdp->size * L->fs.shard) * f : 0);
    }
#ifndef MOEPT_CBLAS
    int64_t mmax = N; /* taller GEMMs (received rows at P > 1) run in row blocks */
    int64_t cand[5] = {T, D, L->H, L->HS, E};
    for (int i = 0; i < 5; i++) mmax = cand[i] > mmax ? cand[i] : mmax;
    mmax = (mmax + MOEPT__MR - 1) / MOEPT__MR * MOEPT__MR;
    L->ws.gws.m_max = mmax;
    L->ws.gws.apack = moept__take(c, (size_t)(mmax * MOEPT__KC) * f);
    L->ws.gws.bpack = moept__take(c, (size_t)((MOEPT__NC + MOEPT__NR) * MOEPT__KC) * f);
#endif
}

/* The fixed workspace: what the host keeps for every executor, and, where
   the steps run on the host, theirs (a device executor keeps its own): a
   forward slot's buffers, and with own the layer's scratch too */
static void moept__layout_work(moept_layer *L, moept__fstate *sl, moept__carve *c, int own) {
    const int run = (L->ex->caps & MOEPT__CAN_HOST_STEPS) != 0;
    moept__layout_host(L, sl, c, run, own);
    if (!run) return;
    moept__layout_plan(L, sl, c, own);
    moept__layout_acts(L, sl, c, own);
}

/* The receive block's row widths (floats): xr, yr (at one rank they are
   xs, ys), h, a (an inference layer writes a over h), the chunked
   backward's da, dxs, and config.fp8's q1, q2, and its records as they
   arrive (moept__q8_recs: decoded into xr) */
#define MOEPT__NRECV 9
static void moept__recv_widths(const moept_layer *L, int64_t w[MOEPT__NRECV]) {
    const int own_xy = L->P > 1 && !L->xch.direct, train = !L->cfg.inference_only, ch = train && L->C > 1;
    const int q8 = L->cfg.fp8 != MOEPT_FP8_OFF;
    w[8] = moept__q8_recs(L) ? moept__q8_recw(L->D) / 4 : 0;
    w[0] = w[1] = own_xy ? L->D : 0;
    w[2] = L->H;
    w[3] = train ? L->F : 0;
    w[4] = ch ? L->F : 0;
    w[5] = ch ? L->D : 0;
    w[6] = q8 ? (train && L->H > L->D ? L->H : L->D) : 0;
    w[7] = q8 && train ? L->D : 0;
}

/* Makes the receive block hold `need` rows (geometric growth, never
   shrinks). The rows of the committed step are kept, so a step rejected
   after growing still leaves the layer's saved state intact. Returns 0 on
   out-of-memory (nothing changed). */
static int moept__grow_recv(moept_layer *L, moept__fstate *sl, int64_t need) {
    if (need <= sl->xch.Rcap && sl->xch.rwork) return 1;
    int64_t cap = need > 2 * sl->xch.Rcap ? need : 2 * sl->xch.Rcap;
    if (cap < 1) cap = 1;
    int own_xy = L->P > 1 && !L->xch.direct; /* direct: xr and yr are shared (moept__grow_shared) */
    const int train = !L->cfg.inference_only;
    int64_t wd[MOEPT__NRECV], row = 0;
    moept__recv_widths(L, wd);
    for (int i = 0; i < MOEPT__NRECV; i++) row += wd[i];
    const int64_t w_xr = wd[0], w_yr = wd[1], w_h = wd[2], w_a = wd[3], w_da = wd[4], w_dx = wd[5];
    size_t bytes = (size_t)cap * (size_t)row * sizeof(float) + MOEPT__NRECV * 64;
    char *blk = moept__alloc(&L->mem, bytes);
    if (!blk) return 0;
    moept__carve cv = {blk, 0};
    float *xr = moept__take(&cv, (size_t)(cap * w_xr) * sizeof(float));
    float *yr = moept__take(&cv, (size_t)(cap * w_yr) * sizeof(float));
    float *h = moept__take(&cv, (size_t)(cap * w_h) * sizeof(float));
    float *a = moept__take(&cv, (size_t)(cap * w_a) * sizeof(float));
    float *da = moept__take(&cv, (size_t)(cap * w_da) * sizeof(float));
    float *dxs = moept__take(&cv, (size_t)(cap * w_dx) * sizeof(float));
    float *q1 = moept__take(&cv, (size_t)(cap * wd[6]) * sizeof(float));
    float *q2 = moept__take(&cv, (size_t)(cap * wd[7]) * sizeof(float));
    float *xq = moept__take(&cv, (size_t)(cap * wd[8]) * sizeof(float));
    int64_t keep = sl->xch.rwork && sl->fwd.valid ? sl->xch.R : 0;
    if (keep > 0) {
        if (own_xy) {
            memcpy(xr, sl->ws.xr, (size_t)(keep * w_xr) * sizeof(float));
            memcpy(yr, sl->ws.yr, (size_t)(keep * w_yr) * sizeof(float));
        }
        memcpy(h, sl->ws.h, (size_t)(keep * w_h) * sizeof(float));
        memcpy(a, sl->ws.a, (size_t)(keep * w_a) * sizeof(float));
    }
    MOEPT_FREE(sl->xch.rwork);
    sl->xch.rwork = blk;
    if (!L->xch.direct) {
        sl->ws.xr = own_xy ? xr : sl->ws.xs;
        sl->ws.yr = own_xy ? yr : sl->ws.ys;
    }
    sl->ws.h = h;
    sl->ws.a = train ? a : h;
    L->ws.lda_a = train ? L->F : L->H;
    sl->ch.da = da;
    sl->ch.dx = dxs;
    sl->ws.q1 = wd[6] ? q1 : NULL;
    sl->ws.q2 = wd[7] ? q2 : NULL;
    sl->ws.xq = wd[8] ? (uint8_t *)xq : NULL;
    if (sl->xch.Rcap > 0) L->stats.recv_growths++;
    sl->xch.Rcap = cap;
    L->stats.recv_capacity = cap;
    return 1;
}

/* Direct path: every rank's shared block holds cap >= need rows of xr and
   of yr. Collective: the need is the largest over ranks (all compute it
   alike from the all-gathered counts), so all grow together, the same cap.
   The committed step's rows are kept; on failure (every rank's, the comm
   agrees) nothing changed. */
static moept_status moept__grow_shared(moept_layer *L, moept__fstate *sl, int64_t need) {
    if (need <= sl->xch.shcap && sl->xch.shm) return MOEPT_OK;
    int64_t cap = !sl->xch.shm || need > 2 * sl->xch.shcap ? need : 2 * sl->xch.shcap;
    if (cap < 1) cap = 1;
    const int64_t D = L->D, P = L->P;
    void *h = NULL;
    int64_t bytes = 2 * cap * D * (int64_t)sizeof(float);
    moept_status st = L->ep->shm_alloc(L->ep, bytes, (void **)(sl->xch.shbase + P), &h);
    if (st) return st;
    float *xr = sl->xch.shbase[P + L->rank], *yr = xr + cap * D;
    int64_t keep = sl->xch.shm && sl->fwd.valid ? sl->xch.R : 0;
    if (keep > 0) {
        memcpy(xr, sl->ws.xr, (size_t)(keep * D) * sizeof(float));
        memcpy(yr, sl->ws.yr, (size_t)(keep * D) * sizeof(float));
    }
    if (sl->xch.shm) L->ep->shm_free(L->ep, sl->xch.shm);
    L->mem.allocations++; /* the comm's memory, the layer's rows */
    L->mem.bytes += bytes;
    memcpy(sl->xch.shbase, sl->xch.shbase + P, (size_t)P * sizeof(float *));
    sl->xch.shm = h;
    sl->xch.shcap = cap;
    sl->ws.xr = xr;
    sl->ws.yr = yr;
    return MOEPT_OK;
}

/* A slot's state made empty: no forward saved, nothing received yet */
static void moept__slot_clear(const moept_layer *L, moept__fstate *sl) {
    sl->fwd.ls = moept__lstat_of(L->E);
    sl->fwd.cur = 0; sl->fwd.T = -1; sl->fwd.valid = sl->fwd.bwd_valid = sl->fwd.eval = sl->fwd.jitter = 0;
    sl->plan.N = 0;
    sl->xch.R = sl->xch.Rcap = sl->xch.shcap = 0;
    sl->xch.rwork = sl->xch.shm = NULL;
    sl->ws.xr = sl->ws.yr = sl->ws.h = sl->ws.a = sl->ch.da = sl->ch.dx = sl->ws.q1 = sl->ws.q2 = NULL;
    sl->ws.xq = NULL;
}

/* Slot s's buffers: its part of the workspace and the receive rows as at
   create (the direct path's shared rows come with its first forward's
   growth, collective). 0: out of memory, nothing changed. */
static int moept__slot_alloc(moept_layer *L, int s) {
    moept__fstate *sl = &L->slots[s];
    moept__carve c = {NULL, 0};
    moept__layout_work(L, sl, &c, 0);
    void *blk = moept__alloc(&L->mem, c.off);
    if (!blk) return 0;
    memset(blk, 0, c.off);
    c.base = blk; c.off = 0;
    moept__layout_work(L, sl, &c, 0);
    moept__slot_clear(L, sl);
    if (!moept__grow_recv(L, sl, L->Nmax)) {
        MOEPT_FREE(blk);
        memset(sl, 0, sizeof *sl);
        return 0;
    }
    sl->work = blk; sl->work_bytes = (int64_t)c.off;
    sl->ready = 1;
    return 1;
}

/* Slot s's state (its buffers allocated at its first use; out of memory:
   nothing changed). Nothing switches: the caller works on the state it got. */
static moept_status moept__slot_get(moept_layer *L, int s, const char *call, moept__fstate **out) {
    if (!L->slots[s].ready && !moept__slot_alloc(L, s))
        return moept__fail(L, MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory for forward slot %d's state",
                           call, s);
    *out = &L->slots[s];
    return MOEPT_OK;
}

/* the last successful forward's state: what moept_routing, moept_get_stats
   and update_bias read (moept_routing_grads: its backward's) */
static moept__fstate *moept__last(const moept_layer *L) { return &L->slots[L->last]; }

/* Every slot's saved forward dropped (the placement changed under them) */
static void moept__slots_invalidate(moept_layer *L) {
    for (int s = 0; s <= L->nslots; s++) L->slots[s].fwd.valid = 0;
}

/* A call that changed the weights: every pending forward's backward is
   refused from now on (it would mix the old activations with the new
   weights); the forwards' routing and counts stay readable (update_bias) */
static void moept__stale_forwards(moept_layer *L, const char *call) {
    for (int s = 0; s <= L->nslots; s++) L->slots[s].fwd.stale = call;
    if (L->ex->stale_forwards) L->ex->stale_forwards(L, call);
}

/* Config fields every rank must agree on, serialised for the create-time
   all-gather (a mismatch is an error on every rank, never a hang later):
   all but max_tokens, each rank's own bound on its rows (moept.h). */
#define MOEPT__NFP 31
#define MOEPT__NFP_MODEL 19 /* the model's fields, first: a checkpoint's fingerprint */
static const char *moept__fp_names[MOEPT__NFP] = {
    "(rank's own validation)", "family", "hidden_size", "intermediate_size", "num_experts", "top_k",
    "norm_topk_prob", "activation", "shared_intermediate_size", "shared_gate", "n_group", "topk_group",
    "routed_scaling_factor", "aux_loss", "aux_loss_coef", "z_loss_coef", "capacity_factor",
    "global_balance", "group_fill", "overlap_chunks", "expert_sharding", "router_jitter", "jitter_seed",
    "aux_seq_len", "inference_only", "grad_backup", "max_inflight", "fp8", "EP size", "DP size",
    "EP comm's shared memory (shm_alloc)"};

static void moept__fingerprint(const moept_config *c, int ok, int P, int DP, int shm, int64_t *fp) {
    float fl[5] = {c->routed_scaling_factor, c->aux_loss_coef, c->z_loss_coef, c->capacity_factor,
                   c->router_jitter};
    int32_t b[5];
    memcpy(b, fl, sizeof b);
    int64_t v[MOEPT__NFP] = {ok, c->family, c->hidden_size, c->intermediate_size, c->num_experts, c->top_k,
                             c->norm_topk_prob, c->activation, c->shared_intermediate_size, c->shared_gate,
                             c->n_group, c->topk_group, b[0], c->aux_loss, b[1], b[2], b[3],
                             c->global_balance, c->group_fill, c->overlap_chunks, c->expert_sharding, b[4],
                             (int64_t)c->jitter_seed, c->aux_seq_len,
                             c->inference_only, c->grad_backup, c->max_inflight, c->fp8, P, DP, shm};
    memcpy(fp, v, sizeof v);
}

/* All-gathers fingerprints over `comm`; fails (on every rank alike) if any
   rank failed its own checks or any field differs from rank 0's. */
static moept_status moept__agree_config(moept_comm *comm, const char *group, const int64_t *fp,
                                        const char *call) {
    if (!comm || comm->size == 1) return MOEPT_OK;
    int64_t all[64 * MOEPT__NFP],
        *buf = comm->size <= 64 ? all : moept__alloc(NULL, (size_t)comm->size * sizeof(int64_t) * MOEPT__NFP);
    if (!buf) return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory", call);
    moept_status st = comm->allgather(comm, fp, buf, (int64_t)sizeof(int64_t) * MOEPT__NFP);
    if (st) {
        st = moept__thread_fail(st, "%s: %s config all-gather failed: %s", call, group, comm->err);
    } else {
        for (int r = 0; r < comm->size && !st; r++)
            if (!buf[r * MOEPT__NFP])
                st = moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT,
                                        "%s: %s rank %d rejected its config%s", call, group, r,
                                        r == comm->rank ? "" : " (see that rank's error)");
        for (int r = 1; r < comm->size && !st; r++)
            for (int k = 1; k < MOEPT__NFP && !st; k++)
                if (buf[r * MOEPT__NFP + k] != buf[k])
                    st = moept__thread_fail(
                        MOEPT_ERR_INVALID_ARGUMENT,
                        "%s: config.%s differs between %s ranks 0 (%lld) and %d (%lld)", call,
                        moept__fp_names[k], group, (long long)buf[k], r, (long long)buf[r * MOEPT__NFP + k]);
    }
    if (buf != all) MOEPT_FREE(buf);
    return st;
}

/* the EP comm offers the direct path's shared memory (every rank must agree) */
static int moept__has_shm(const moept_comm *ep) {
    return ep && ep->size > 1 && ep->shm_alloc && ep->shm_free && ep->barrier;
}

static moept_status moept__comm_fail(moept_comm *c, moept_status s, const char *fmt, ...);

/* *most = the largest v over the group (an out-of-memory rank fails all) */
moept_status moept__group_max(moept_comm *g, int64_t v, int64_t *most) {
    int64_t few[64], *all = g->size <= 64 ? few : moept__alloc(NULL, (size_t)g->size * sizeof(int64_t));
    moept_status st;
    int64_t failed = moept__any_failed(g, NULL, all == NULL, &st);
    if (!st && failed) st = moept__comm_fail(g, MOEPT_ERR_OUT_OF_MEMORY, "a rank is out of memory");
    if (!st) st = g->allgather(g, &v, all, (int64_t)sizeof v);
    *most = v;
    for (int q = 0; !st && q < g->size; q++) *most = all[q] > *most ? all[q] : *most;
    if (all != few) MOEPT_FREE(all);
    return st;
}

/* The one sum over the world: all-reduce over the EP (or fsdp) group, then
   over DP (a NULL comm, or one of one rank, is skipped). On failure *bad
   (when given) is the comm that failed: its err says why. */
moept_status moept__sum_ep_dp(moept_comm *ep, moept_comm *dp, void *buf, int64_t n, moept_dtype t,
                              moept_comm **bad) {
    moept_comm *c[2] = {ep, dp};
    for (int i = 0; i < 2; i++) {
        moept_status st = c[i] && c[i]->size > 1 ? c[i]->allreduce(c[i], buf, n, t) : MOEPT_OK;
        if (st) {
            if (bad) *bad = c[i];
            return st;
        }
    }
    return MOEPT_OK;
}

/* Sums a failure flag over the EP (and DP) group: 0 when every rank is fine. */
int64_t moept__any_failed(moept_comm *ep, moept_comm *dp, int64_t mine, moept_status *st) {
    int64_t v = mine;
    *st = moept__sum_ep_dp(ep, dp, &v, 1, MOEPT_DTYPE_I64, NULL);
    return *st ? -1 : v;
}

moept_status moept_create(const moept_config *cfg, moept_layer **out) {
    return moept_create_parallel(cfg, NULL, NULL, out);
}

/* A number no other rank, process or call draws (in practice): the clock,
   the process and a counter, mixed (a checkpoint set's name, a rank's id) */
static int64_t moept__nonce(void) {
    static atomic_ulong calls;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t h = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 24) ^
                 ((uint64_t)atomic_fetch_add(&calls, 1) << 44);
    h *= 0x9e3779b97f4a7c15ull;
    return (int64_t)((h ^ (h >> 31)) & 0xffffffffffffull); /* 48 bits: sums of one value and zeros */
}
/* create, 1b: the EP and DP groups are two axes of one grid: no rank shares
   both with another (one comm passed as both would add different experts'
   gradients together and the router's twice), and a DP group joins ranks
   of one EP rank (the same experts). Each rank draws an id; both groups'
   are gathered; any rank's finding fails every rank of both groups. */
static moept_status moept__agree_grid(moept_comm *ep, moept_comm *dp, const char *call) {
    if (!ep || !dp || ep->size < 2 || dp->size < 2) return MOEPT_OK;
    const int P = ep->size, DP = dp->size;
    int64_t *ids = moept__alloc(NULL, (size_t)(P + 2 * DP) * sizeof(int64_t)), *dps = ids ? ids + P : NULL;
    const int64_t me[2] = {moept__nonce(), ep->rank};
    moept_status st, local = MOEPT_OK;
    int64_t failed = moept__any_failed(ep, dp, ids == NULL, &st);
    if (!st && !failed && !(st = ep->allgather(ep, me, ids, sizeof me[0])))
        st = dp->allgather(dp, me, dps, sizeof me);
    for (int q = 0; !st && !failed && !local && q < DP; q++) {
        int shared = -1;
        for (int r = 0; r < P && q != dp->rank; r++) shared = ids[r] == dps[2 * q] ? r : shared;
        if (ep == dp)
            local = moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: one comm passed as both the EP and "
                                       "the DP comm; they must be two axes of an EP x DP grid", call);
        else if (shared >= 0)
            local = moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: DP rank %d is also EP rank %d of "
                                       "this rank's EP group: the EP and DP groups must be two axes of an "
                                       "EP x DP grid (no rank shares both with another)", call, q, shared);
        else if (dps[2 * q + 1] != ep->rank)
            local = moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: DP rank %d is EP rank %lld, this "
                                       "rank EP rank %d: a DP group joins the ranks that hold the same "
                                       "experts (one EP rank of each EP group)", call, q,
                                       (long long)dps[2 * q + 1], ep->rank);
    }
    MOEPT_FREE(ids);
    if (st) /* (the verdict below is every rank's: none returns before it) */
        local = moept__thread_fail(st, "%s: the EP x DP grid check's all-gather failed: %s", call,
                                   ep->err[0] ? ep->err : dp->err);
    else if (failed)
        local = moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory on a rank", call);
    failed = moept__any_failed(ep, dp, local != MOEPT_OK, &st);
    if (local) return local;
    if (st) return moept__thread_fail(st, "%s: the EP x DP grid agreement failed", call);
    if (failed)
        local = moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: the EP and DP comms do not form an EP x "
                                   "DP grid (another rank names the problem)", call);
    return local;
}

/* create, 1: this rank's checks (comms, config, what the executor can do),
   then the agreement: every rank learns whether any failed */
static moept_status moept__create_checks(const moept_config *cfg, moept_comm *ep, moept_comm *dp,
                                         const moept__exec *ex, const char *call, moept_config *c) {
    if (ep && (ep->size < 1 || ep->rank < 0 || ep->rank >= ep->size || !ep->alltoallv || !ep->allreduce ||
               !ep->allgather))
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: ep comm is incomplete (size, rank or "
                                  "functions)", call);
    if (dp && (dp->size < 1 || dp->rank < 0 || dp->rank >= dp->size || !dp->allreduce || !dp->allgather))
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: dp comm is incomplete (size, rank or "
                                  "functions)", call);
    int P = ep ? ep->size : 1, DP = dp ? dp->size : 1;
    memset(c, 0, sizeof *c);
    moept_status st = cfg ? moept__resolve(cfg, c)
                          : moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: cfg is NULL", call);
    if (!st && c->num_experts % P != 0)
        st = moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT,
                                "config.num_experts: %lld experts cannot be split "
                                "evenly over an EP group of %d ranks",
                                (long long)c->num_experts, P);
    if (!st && (c->global_balance != 0 && c->global_balance != 1))
        st = moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "config.global_balance: %d must be 0 or 1",
                                c->global_balance);
    char why[MOEPT__ERRLEN];
    if (!st && (st = moept__ex_refuse_config(ex, c, call, why))) moept__thread_fail(st, "%s", why);
    char mine[MOEPT__ERRLEN];
    memcpy(mine, moept__thread_err, sizeof mine);
    int64_t fp[MOEPT__NFP];
    moept__fingerprint(c, st == MOEPT_OK, P, DP, moept__has_shm(ep), fp);
    /* both groups' agreements on every rank (a rank that skipped one would leave its group waiting), one
       verdict over both, then (all fine) the grid's */
    moept_status ag = moept__agree_config(ep, "EP", fp, call), cs;
    char first[MOEPT__ERRLEN];
    memcpy(first, moept__thread_err, sizeof first);
    moept_status a2 = moept__agree_config(dp, "DP", fp, call);
    if (!ag && a2) memcpy(first, moept__thread_err, sizeof first);
    ag = ag ? ag : a2;
    const int64_t failed = moept__any_failed(ep, dp, st || ag, &cs);
    if (st || ag) {
        memcpy(moept__thread_err, st ? mine : first, sizeof mine);
        return st ? st : ag;
    }
    if (cs) return moept__thread_fail(cs, "%s: the config agreement failed", call);
    if (failed)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: a rank of another EP or DP group refused "
                                  "its config (see its error)", call);
    return moept__agree_grid(ep, dp, call);
}

/* create, 2: the layer's shapes, groups and executor from the resolved config */
static void moept__layer_shape(moept_layer *L, const moept_config *c, moept_comm *ep, moept_comm *dp,
                               const moept__exec *ex) {
    L->cfg = *c;
    L->ex = ex;
    L->par.grads_dx_bad = L->par.grads_dl_bad = -1;
    L->ep = ep && ep->size > 1 ? ep : NULL;
    L->dp = dp && dp->size > 1 ? dp : NULL;
    L->P = ep ? ep->size : 1; L->rank = ep ? ep->rank : 0;
    if (c->expert_sharding == MOEPT_SHARD_FSDP && L->ep) {
        /* the baseline: every expert computed here, from weights gathered
           each step; the expert path runs as at one rank */
        L->fsdp = L->ep;
        L->ep = NULL;
        L->P = 1; L->rank = 0;
    }
    L->group = L->ep ? L->ep : L->fsdp;
    L->D = c->hidden_size; L->F = c->intermediate_size; L->E = c->num_experts;
    L->K = c->top_k; L->S = c->shared_intermediate_size; L->act = (int)c->activation;
    L->El = L->E / L->P;
    L->C = c->overlap_chunks;
    /* chunked overlap needs the exchange's own buffers (the direct
       shared-memory path has no exchange to overlap); a device executor
       has its own exchange */
    L->xch.direct = L->ep && moept__has_shm(ep) && L->C == 1 && (ex->caps & MOEPT__CAN_HOST_STEPS);
    int gated = moept__act_gated(L->act);
    L->H = gated ? 2 * L->F : L->F;
    L->HS = gated ? 2 * L->S : L->S;
    L->Tmax = c->max_tokens;
    L->Nmax = c->max_tokens * c->top_k;
    L->nslots = c->max_inflight > 1 ? (int)c->max_inflight : 1;
#ifdef _OPENMP
    L->nthreads = omp_get_max_threads();
#else
    L->nthreads = 1;
#endif
    L->stats.capacity = -1;
    char buf[32];
    snprintf(buf, sizeof buf, "%.7g", (double)c->capacity_factor);
    L->capacity_factor = strtod(buf, NULL);
}

/* create, 3: the parameter buffer router | w13 | w2 | ws13 | ws2 | wsg,
   then its gradient mirror (and grad_backup's copy), then the bias; the
   workspace block. An executor with buffers of its own (a device's) gets
   the layout alone: the host keeps the bias, no copy. 0: out of memory
   (the caller frees what is set). */
static int moept__layer_alloc(moept_layer *L, moept__counter *mem) {
    const int64_t D = L->D, F = L->F, E = L->E, S = L->S, El = L->El;
    const moept_config *c = &L->cfg;
    int shared_gate = S > 0 && c->shared_gate == MOEPT_SHARED_GATE_SIGMOID;
    int64_t n_router = E * D, n13 = El * L->H * D, n2 = El * D * F;
    int64_t ns13 = L->HS * D, ns2 = D * S, nsg = shared_gate ? D : 0;
    L->par.n_exp = n13 + n2;
    if (L->fsdp) { /* the parameter buffer holds this rank's flat shard only */
        L->fs.total = n13 + n2;
        L->fs.shard = (L->fs.total + L->fsdp->size - 1) / L->fsdp->size;
        L->par.n_exp = L->fs.shard;
    }
    L->par.n_params = n_router + L->par.n_exp + ns13 + ns2 + nsg;
    L->par.o13 = n_router; L->par.o2 = n_router + n13; /* (fsdp: the shard at n_router) */
    L->par.os13 = n_router + L->par.n_exp; L->par.os2 = L->par.os13 + ns13;
    L->par.osg = nsg ? L->par.os2 + ns2 : -1;
    L->par.trains = !c->inference_only;
    /* an inference layer has no gradient mirror; grad_backup adds its copy */
    const int64_t nmir = L->ex->io ? 0 : c->inference_only ? 1 : c->grad_backup ? 3 : 2;
    size_t pbytes = (size_t)(nmir * L->par.n_params + E) * sizeof(float);
    float *block = L->par.block = moept__alloc(mem, pbytes);
    L->par.table = moept__alloc(mem, (size_t)(3 * El + 8) * sizeof(moept__param));
    /* the forward slots' states; the workspace block: the layer's scratch and slot 0's buffers */
    L->slots = moept__alloc(mem, (size_t)(L->nslots + 1) * sizeof(moept__fstate));
    if (!L->slots) return 0;
    memset(L->slots, 0, (size_t)(L->nslots + 1) * sizeof(moept__fstate));
    moept__fstate *sl0 = &L->slots[0];
    moept__carve wc = {NULL, 0};
    moept__layout_work(L, sl0, &wc, 1);
    size_t wbytes = wc.off;
    L->work = moept__alloc(mem, wbytes);
    L->work_bytes = (int64_t)wbytes;
    if (!block || !L->par.table || !L->work) return 0;
    memset(block, 0, pbytes);
    memset(L->work, 0, wbytes);
    wc.base = L->work; wc.off = 0;
    moept__layout_work(L, sl0, &wc, 1);
    moept__slot_clear(L, sl0);
    sl0->ready = 1;
    L->par.params = nmir ? block : NULL;
    L->par.grads = nmir >= 2 ? block + L->par.n_params : NULL;
    L->par.grads_copy = nmir == 3 ? block + 2 * L->par.n_params : NULL;
    L->par.bias = block + nmir * L->par.n_params;
    float *p = L->par.params, *g = L->par.grads;
    L->par.w_router = p; L->par.g_router = g;
    if (L->fsdp) { /* the experts live gathered in the workspace */
        L->fs.w = moept__goff(p, n_router); L->fs.g = moept__goff(g, n_router);
        L->par.w13 = L->fs.full; L->par.w2 = L->fs.full + n13;
        L->par.g13 = g ? L->fs.gfull : NULL; L->par.g2 = moept__goff(L->par.g13, n13);
    } else {
        L->par.w13 = moept__goff(p, L->par.o13); L->par.g13 = moept__goff(g, L->par.o13);
        L->par.w2 = moept__goff(p, L->par.o2); L->par.g2 = moept__goff(g, L->par.o2);
    }
    L->par.ws13 = moept__goff(p, L->par.os13); L->par.gs13 = moept__goff(g, L->par.os13);
    L->par.ws2 = moept__goff(p, L->par.os2); L->par.gs2 = moept__goff(g, L->par.os2);
    L->par.wsg = nsg ? moept__goff(p, L->par.osg) : NULL;
    L->par.gsg = nsg ? moept__goff(g, L->par.osg) : NULL;
    for (int64_t e = 0; e < E; e++) L->plan.slot_of[e] = L->plan.expert_at[e] = (int32_t)e;
    moept__build_table(L);
    L->stats.param_bytes = (int64_t)pbytes;
    return 1;
}

/* A layer run by executor ex: checks agreed, then allocation agreed (an
   out-of-memory rank fails every rank), then the direct path's shared rows */
moept_status moept__create(const moept_config *cfg, moept_comm *ep, moept_comm *dp, const moept__exec *ex,
                           const char *call, moept_layer **out) {
    if (!out) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: out is NULL", call);
    *out = NULL;
    moept_config c;
    moept_status st = moept__create_checks(cfg, ep, dp, ex, call, &c);
    if (st) return st;
    moept__counter mem = {0, 0};
    moept_layer *L = moept__alloc(&mem, sizeof *L);
    if (L) {
        memset(L, 0, sizeof *L);
        moept__layer_shape(L, &c, ep, dp, ex);
        int ok = moept__layer_alloc(L, &mem);
        L->mem = mem;
        /* the receive block: at one rank it is the send side's own rows */
        if (ok && (ex->caps & MOEPT__CAN_HOST_STEPS)) ok = moept__grow_recv(L, &L->slots[0], L->Nmax);
        if (!ok) {
            L->ex = NULL; /* nothing of the executor's yet */
            moept_destroy(L);
            L = NULL;
        }
    }
    int64_t failed = moept__any_failed(ep, dp, L == NULL, &st);
    if (st || failed) {
        moept_destroy(L);
        if (st) return moept__thread_fail(st, "%s: failure agreement failed: %s", call,
                                          ep && ep->err[0] ? ep->err : dp ? dp->err : "");
        return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, L ? "%s: another rank ran out of memory"
                                                             : "%s: out of memory for the layer", call);
    }
    /* the direct path's shared rows: every rank allocates them, or none,
       all of the same size (the largest max_tokens' rows) */
    int64_t rows = 0;
    if (L->xch.direct &&
        ((st = moept__group_max(ep, L->Nmax, &rows)) || (st = moept__grow_shared(L, &L->slots[0], rows)))) {
        moept_destroy(L);
        return moept__thread_fail(st, "%s: the experts' shared rows: %s", call, ep->err);
    }
    *out = L;
    return MOEPT_OK;
}

moept_status moept_create_parallel(const moept_config *cfg, moept_comm *ep, moept_comm *dp,
                                   moept_layer **out) {
    return moept__create(cfg, ep, dp, &moept__cpu_exec, "moept_create", out);
}

moept_status moept_get_config(const moept_layer *L, moept_config *cfg) {
    if (!L || !cfg) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_get_config: NULL argument");
    *cfg = L->cfg;
    return MOEPT_OK;
}

static const moept__param *moept__find(const moept_layer *L, const char *name) {
    for (int64_t i = 0; i < L->par.n_table; i++)
        if (strcmp(L->par.table[i].name, name) == 0) return &L->par.table[i];
    return NULL;
}

/* Levenshtein distance of a and b (each cut at 127 characters) */
static int moept__edits(const char *a, const char *b) {
    int row[128], na = (int)strnlen(a, 127), nb = (int)strnlen(b, 127);
    for (int j = 0; j <= nb; j++) row[j] = j;
    for (int i = 1; i <= na; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= nb; j++) {
            const int up = row[j], sub = diag + (a[i - 1] != b[j - 1]);
            row[j] = up + 1 < row[j - 1] + 1 ? up + 1 : row[j - 1] + 1;
            row[j] = sub < row[j] ? sub : row[j];
            diag = up;
        }
    }
    return row[nb];
}

/* This layer's parameter name nearest to name (ties: the first in buffer order) */
static const char *moept__nearest_param(const moept_layer *L, const char *name) {
    const char *best = "";
    int bd = INT_MAX;
    for (int64_t i = 0; i < L->par.n_table; i++) {
        const int d = moept__edits(name, L->par.table[i].name);
        if (d < bd) { bd = d; best = L->par.table[i].name; }
    }
    return best;
}

static moept_status moept__param_io(const moept_layer *L, const char *fn,
                                    const char *name, int64_t numel,
                                    const void *ptr, const moept__param **out) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: layer is NULL", fn);
    if (!name) return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "%s: name is NULL", fn);
    if (!ptr) return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "%s(%s): data pointer is NULL", fn, name);
    const moept__param *p = moept__find(L, name);
    if (!p) {
        long long e = -1;
        if (sscanf(name, "experts.%lld.", &e) == 1 && e >= 0 && e < L->E &&
            L->plan.slot_of[e] / L->El != L->rank)
            return moept__fail(L, MOEPT_ERR_NOT_FOUND,
                               "%s: expert %lld of '%s' lives on EP rank %lld, not on rank %d", fn, e, name,
                               (long long)(L->plan.slot_of[e] / L->El), L->rank);
        return moept__fail(L, MOEPT_ERR_NOT_FOUND, "%s: no parameter named '%s' in this %s layer (the "
                           "nearest: '%s'; names are HF's with the MoE block's prefix "
                           "model.layers.N.%s stripped)", fn, name, moept__family_name(L->cfg.family),
                           moept__nearest_param(L, name),
                           L->cfg.family == MOEPT_FAMILY_MIXTRAL ? "block_sparse_moe." : "mlp.");
    }
    if (numel != p->rows * p->cols)
        return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "%s(%s): numel %lld, expected %lld ([%lld][%lld])",
                           fn, name, (long long)numel, (long long)(p->rows * p->cols), (long long)p->rows,
                           (long long)p->cols);
    *out = p;
    return MOEPT_OK;
}

/* the first non-finite of src [n] (-1: none) */
static moept_status moept__finite_in(const moept_layer *L, const char *call, const char *what,
                                     const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!moept__finite(src[i]))
            return moept__fail(L, MOEPT_ERR_NUMERIC, "%s(%s): element %lld is not finite", call, what,
                               (long long)i);
    return MOEPT_OK;
}

moept_status moept_set_param(moept_layer *L, const char *name, const float *src, int64_t numel) {
    const moept__param *p = NULL;
    moept_status st = moept__param_io(L, "moept_set_param", name, numel, src, &p);
    if (st || !p || !src) return st ? st : MOEPT_ERR_INVALID_ARGUMENT;
    if ((st = moept__finite_in(L, "moept_set_param", name, src, numel))) return st;
    if (p->type == MOEPT__P_BIAS) /* the host's alone; it only routes: the pending backwards stand */
        return moept__bias_set(L, src, NULL);
    if (p->flat >= 0) moept__fsdp_write(L, p->flat, src, numel); /* this rank's part */
    else if ((st = moept__io(L, MOEPT_BUF_PARAMS, p->off, numel, (float *)src, 1))) return st;
    moept__stale_forwards(L, "moept_set_param");
    return moept__params_written(L);
}

/* a parameter's values (grad 0) or gradient into dst */
static moept_status moept__get(const moept_layer *L, const char *call, const char *name, float *dst,
                               int64_t numel, int grad) {
    const moept__param *p = NULL;
    moept_status st = moept__param_io(L, call, name, numel, dst, &p);
    if (st) return st;
    if (p->flat >= 0)
        return moept__fail(L, MOEPT_ERR_UNSUPPORTED,
                           "%s(%s): fsdp keeps expert %s sharded flat over the group; read this rank's part "
                           "through %s and moept_fsdp_shard", call, name, grad ? "gradients" : "weights",
                           grad ? "moept_grads" : "moept_params");
    if (grad && !p->trains)
        return moept__fail(L, MOEPT_ERR_NOT_FOUND, "%s: '%s' has no gradient", call, name);
    if (p->type == MOEPT__P_BIAS) {
        memcpy(dst, p->data, (size_t)numel * sizeof(float));
        return MOEPT_OK;
    }
    return moept__io(L, grad ? MOEPT_BUF_GRADS : MOEPT_BUF_PARAMS, p->off, numel, dst, 0);
}

moept_status moept_get_param(const moept_layer *L, const char *name, float *dst, int64_t numel) {
    return moept__get(L, "moept_get_param", name, dst, numel, 0);
}

moept_status moept_get_grad(const moept_layer *L, const char *name, float *dst, int64_t numel) {
    return moept__get(L, "moept_get_grad", name, dst, numel, 1);
}

int64_t moept_param_count(const moept_layer *L) { return L ? L->par.n_table : 0; }

int64_t moept_param_numel(const moept_layer *L) { return L ? L->par.n_params : 0; }

moept_status moept_fsdp_shard(const moept_layer *L, int64_t *offset, int64_t *count, int64_t *total) {
    if (!L || !offset || !count || !total)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_fsdp_shard: NULL argument");
    if (!L->fsdp) return moept__fail(L, MOEPT_ERR_STATE, "moept_fsdp_shard: not an fsdp layer");
    int64_t lo = (int64_t)L->fsdp->rank * L->fs.shard;
    *offset = lo;
    *count = lo >= L->fs.total ? 0 : (lo + L->fs.shard < L->fs.total ? L->fs.shard : L->fs.total - lo);
    *total = L->fs.total;
    return MOEPT_OK;
}

moept_status moept_param_info_at(const moept_layer *L, int64_t i, moept_param_info *info) {
    if (!L || !info)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_param_info_at: NULL argument");
    if (i < 0 || i >= L->par.n_table)
        return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_param_info_at: index %lld not in 0..%lld",
                           (long long)i, (long long)L->par.n_table - 1);
    const moept__param *p = &L->par.table[i];
    info->name = p->name; info->rows = p->rows; info->cols = p->cols;
    info->data = p->data; info->grad = p->grad;
    info->shard_offset = p->flat;
    info->offset = p->off;
    return MOEPT_OK;
}

/* An inference layer has no gradients: the training calls refuse, alike
   on every rank (the flag is in the create-time agreement: no rank waits) */
static moept_status moept__no_grads(moept_layer *L, const char *call) {
    return moept__fail(L, MOEPT_ERR_STATE,
                       "%s: an inference-only layer (config.inference_only) has no gradients", call);
}

/* the host's buffer (moept_params, moept_grads), or the refusal of a layer whose buffers a device keeps */
static moept_status moept__host_buf(moept_layer *L, const char *call, float *buf, float **out,
                                    int64_t *numel) {
    if (!L || !out || !numel)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: NULL argument", call);
    if (L->ex->io)
        return moept__fail(L, MOEPT_ERR_UNSUPPORTED, "%s: this layer's buffers live on its device (%s): "
                           "moept_cuda_params gives their device pointers, moept_buf_read and "
                           "moept_buf_write copy them", call, L->ex->name);
    *out = buf; *numel = L->par.n_params;
    return MOEPT_OK;
}

moept_status moept_params(moept_layer *L, float **params, int64_t *numel) {
    return moept__host_buf(L, "moept_params", L ? L->par.params : NULL, params, numel);
}

moept_status moept_grads(moept_layer *L, float **grads, int64_t *numel) {
    if (L && !L->par.trains) return moept__no_grads(L, "moept_grads");
    return moept__host_buf(L, "moept_grads", L ? L->par.grads : NULL, grads, numel);
}

/* moept_buf_read / moept_buf_write's checks */
static moept_status moept__buf_args(const moept_layer *L, const char *call, moept_buf which, int64_t off,
                                    int64_t n, const float *h) {
    if (!L || (!h && n > 0)) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: NULL argument", call);
    if (which != MOEPT_BUF_PARAMS && which != MOEPT_BUF_GRADS)
        return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "%s: which is %d, not a moept_buf", call,
                           (int)which);
    if (off < 0 || n < 0 || off > L->par.n_params - n)
        return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "%s: [%lld, %lld + %lld) is not within the %lld "
                           "floats of the buffer", call, (long long)off, (long long)off, (long long)n,
                           (long long)L->par.n_params);
    if (which == MOEPT_BUF_GRADS && !L->par.trains) return moept__no_grads((moept_layer *)L, call);
    return MOEPT_OK;
}

moept_status moept_buf_read(const moept_layer *L, moept_buf which, int64_t off, int64_t n, float *dst) {
    moept_status st = moept__buf_args(L, "moept_buf_read", which, off, n, dst);
    return st || !n ? st : moept__io(L, (int)which, off, n, dst, 0);
}

moept_status moept_buf_write(moept_layer *L, moept_buf which, int64_t off, int64_t n, const float *src) {
    moept_status st = moept__buf_args(L, "moept_buf_write", which, off, n, src);
    if (!st) st = moept__finite_in(L, "moept_buf_write", which ? "gradients" : "parameters", src, n);
    if (st || !n || (st = moept__io(L, (int)which, off, n, (float *)src, 1))) return st;
    if (which != MOEPT_BUF_PARAMS) return MOEPT_OK;
    moept__stale_forwards(L, "moept_buf_write");
    return moept__params_written(L);
}

moept_status moept_zero_grad(moept_layer *L) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_zero_grad: layer is NULL");
    if (!L->par.trains) return moept__no_grads(L, "moept_zero_grad");
    moept_status st = MOEPT__EX(L, zero_grad, L); /* the executor's, and its checks reset */
    if (st) return st;
    if (!L->ex->zero_grad) memset(L->par.grads, 0, (size_t)L->par.n_params * sizeof(float));
    L->par.grads_dx_bad = L->par.grads_dl_bad = -1;
    L->par.grads_sf_bad = MOEPT_OK;
    L->grads_unsynced = 0; /* zeros are the same on every rank */
    return MOEPT_OK;
}

/* A backward since zero_grad whose dx came out non-finite (an executor's
   check made without a sync is read here) left
   partial sums in the gradients: `call` refuses them (the caller agrees). */
static moept_status moept__grads_refused(moept_layer *L, const char *call) {
    moept_status st = MOEPT__EX(L, grads_check, L);
    if (st) return st;
    if (L->par.grads_sf_bad)
        return moept__fail(L, L->par.grads_sf_bad,
                           "%s: a sync-free step since moept_zero_grad failed its checks "
                           "(%s); its gradients are refused: moept_zero_grad, then the next micro-batch",
                           call, L->par.grads_sf_why);
    const int64_t dl = L->par.grads_dl_bad; /* checked on the device (the CPU's backward refuses it) */
    if (dl >= 0)
        return moept__fail(L, MOEPT_ERR_NUMERIC,
                           "%s: a backward since moept_zero_grad read its opts.dlogits[%lld][%lld], which "
                           "was not finite; its gradients hold partial sums: moept_zero_grad, then the next "
                           "micro-batch",
                           call, (long long)(dl / L->E), (long long)(dl % L->E));
    if (L->par.grads_dx_bad < 0) return MOEPT_OK;
    return moept__fail(
        L, MOEPT_ERR_NUMERIC,
        "%s: a backward since moept_zero_grad had a non-finite dx (element "
        "[%lld][%lld] here, or on a peer) from finite inputs; its gradients hold partial sums: "
        "moept_zero_grad, then the next micro-batch",
        call, (long long)(L->par.grads_dx_bad / L->D), (long long)(L->par.grads_dx_bad % L->D));
}

/* init_params' stream of values of one parameter (seeded by its name, so a layout change keeps each value) */
typedef struct moept__init_rng { uint64_t s; float bound; } moept__init_rng;
static moept__init_rng moept__init_rng_of(const moept__param *p, uint64_t seed) {
    moept__init_rng r = {seed, 1.0f / sqrtf((float)p->cols)};
    for (const char *c = p->name; *c; c++) r.s = r.s * 131 + (unsigned char)*c;
    return r;
}
/* the next n values into dst (NULL: drawn and dropped) */
static void moept__init_fill(moept__init_rng *r, float *dst, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        double u = (double)(moept__mix(&r->s) >> 11) * (1.0 / 9007199254740992.0);
        if (dst) dst[j] = (float)((2.0 * u - 1.0) * r->bound);
    }
}

moept_status moept_init_params(moept_layer *L, uint64_t seed) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_init_params: layer is NULL");
    enum { CHUNK = 1 << 16 }; /* the host's share of a device layer's write: one chunk */
    float *buf = L->ex->io ? moept__alloc(NULL, CHUNK * sizeof(float)) : NULL;
    if (L->ex->io && !buf) return moept__fail(L, MOEPT_ERR_OUT_OF_MEMORY, "moept_init_params: out of memory");
    moept_status st = MOEPT_OK;
    moept__stale_forwards(L, "moept_init_params");
    for (int64_t i = 0; !st && i < L->par.n_table; i++) {
        const moept__param *p = &L->par.table[i];
        const int64_t n = p->rows * p->cols;
        moept__init_rng r = moept__init_rng_of(p, seed);
        if (p->type == MOEPT__P_BIAS) {
            memset(p->data, 0, (size_t)n * sizeof(float));
        } else if (p->flat >= 0) { /* fsdp: the same values as EP, this rank's part kept */
            int64_t lo = (int64_t)L->fsdp->rank * L->fs.shard, a = p->flat > lo ? p->flat : lo;
            int64_t b = p->flat + n < lo + L->fs.shard ? p->flat + n : lo + L->fs.shard;
            if (b > a) {
                moept__init_fill(&r, NULL, a - p->flat);
                moept__init_fill(&r, L->fs.w + (a - lo), b - a);
            }
        } else if (!buf) {
            moept__init_fill(&r, p->data, n);
        } else {
            for (int64_t j = 0; !st && j < n; j += CHUNK) {
                const int64_t m = n - j < CHUNK ? n - j : CHUNK;
                moept__init_fill(&r, buf, m);
                st = moept__io(L, MOEPT_BUF_PARAMS, p->off + j, m, buf, 1);
            }
        }
    }
    MOEPT_FREE(buf);
    if (!st) st = moept__params_written(L);
    if (!st) st = moept__tables_changed(L);
    return st;
}


/* the host's buffer `which` (moept_buf, MOEPT__BUF_M/V), or NULL where the layer lacks it */
static float *moept__host_of(const moept_layer *L, int which) {
    return which == MOEPT_BUF_PARAMS ? L->par.params : which == MOEPT_BUF_GRADS ? L->par.grads
         : which == MOEPT__BUF_M    ? L->opt.m       : L->opt.v;
}

/* Elements [off, off + n) of buffer `which` (moept_buf, MOEPT__BUF_M/V) to
   or from host memory h: an executor's own buffers through its io (a
   device's), else the host's; moments the layer lacks read as zeros. */
static moept_status moept__io(const moept_layer *cL, int which, int64_t off, int64_t n, float *h, int write) {
    moept_layer *L = (moept_layer *)cL;
    if (L->ex->io) return L->ex->io(L, which, off, n, h, write);
    if (n == 0) return MOEPT_OK;
    float *b = moept__host_of(L, which);
    if (!b && write) return moept__fail(L, MOEPT_ERR_STATE, "internal: a write to a buffer the layer lacks");
    if (!b) memset(h, 0, (size_t)n * sizeof(float));
    else if (write) memcpy(b + off, h, (size_t)n * sizeof(float));
    else memcpy(h, b + off, (size_t)n * sizeof(float));
    return MOEPT_OK;
}

/* the bias or the placement changed on the host, their one home: an executor's copies follow */
static moept_status moept__tables_changed(moept_layer *L) { return MOEPT__EX(L, tables, L); }

/* parameters written (moept__io): an executor's derived copies made again (once, after the writes) */
static moept_status moept__params_written(moept_layer *L) { return MOEPT__EX(L, params_changed, L); }

/* the correction bias set to src [E] on the host and where the executor routes, or, if that fails, as
   it was (was [E]: scratch; NULL: allocated here) */
static moept_status moept__bias_set(moept_layer *L, const float *src, float *was) {
    const size_t bytes = (size_t)L->E * sizeof(float);
    float *own = was ? NULL : moept__alloc(NULL, bytes);
    if (!was && !(was = own)) return moept__fail(L, MOEPT_ERR_OUT_OF_MEMORY, "out of memory (the bias)");
    memcpy(was, L->par.bias, bytes);
    memmove(L->par.bias, src, bytes);
    moept_status st = moept__tables_changed(L);
    if (st) memcpy(L->par.bias, was, bytes);
    MOEPT_FREE(own);
    return st;
}

/* ------------------------------------------------------------------------
   Agreement: every group call agrees before it acts (moept.h's table of group
   calls), so one rank's error is every rank's and no rank waits alone
   ------------------------------------------------------------------------ */
/* The call's tag in the agreement: its id (moept.h's table of group calls)
   and the layer's count of agreed calls (12 bits), so ranks that make
   different calls, or one call more, are told apart instead of running into
   each other's collectives. */
int64_t moept__call_tag(const moept_layer *L, int call) {
    return (int64_t)call << 12 | (L->agreed_calls & 0xfff);
}

/* FNV-1a over n bytes, from h (MOEPT__FNV0 to start): arguments' fingerprints */
#define MOEPT__FNV0 14695981039346656037ull
static uint64_t moept__fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* the fingerprint of n floats' values (-0 as +0: the same value) */
static uint64_t moept__fnv_f32(const float *v, int n) {
    uint64_t h = MOEPT__FNV0;
    for (int i = 0; i < n; i++) {
        float x = v[i] + 0.0f;
        h = moept__fnv(h, &x, sizeof x);
    }
    return h;
}

/* A directory argument's fingerprint: the path as realpath resolves it
   (the same directory named two ways is the same), as given where it does
   not resolve (not made yet) */
#ifndef MOEPT_NO_IO
char *realpath(const char *restrict path, char *restrict resolved); /* POSIX.1-2008 (glibc: XOPEN only) */
static uint64_t moept__fnv_dir(const char *dir) {
    if (!dir) return 0;
#ifdef PATH_MAX
    char real[PATH_MAX];
    if (realpath(dir, real)) dir = real;
#endif
    return moept__fnv(MOEPT__FNV0, dir, strlen(dir));
}
#endif

/* One group's agreement: [failed, calls differ, arguments differ] (out:
   summed over the group) and, to compare, tag, tag^2 and each 16-bit piece
   a of args with a^2. A value is the same on every rank iff its sum is size
   * value and its square's size * value^2 (the squared deviations sum to
   0; no term overflows below 2^23 ranks). The three counts carry into the
   next group's agreement, so after EP then DP every rank of the layout
   knows of a difference in any group. */
#define MOEPT__AGREE_N 13
static moept_status moept__agree_group(moept_comm *c, int64_t *n, int64_t tag, uint64_t args) {
    if (!c || c->size <= 1) return MOEPT_OK;
    int64_t s[MOEPT__AGREE_N] = {n[0], n[1], n[2], tag, tag * tag}, mine[MOEPT__AGREE_N];
    for (int i = 0; i < 4; i++) {
        int64_t a = (int64_t)(args >> (16 * i) & 0xffff);
        s[5 + 2 * i] = a;
        s[6 + 2 * i] = a * a;
    }
    memcpy(mine, s, sizeof s);
    moept_status st = c->allreduce(c, s, MOEPT__AGREE_N, MOEPT_DTYPE_I64);
    if (st) return st;
    memcpy(n, s, 3 * sizeof(int64_t));
    n[1] += s[3] != c->size * mine[3] || s[4] != c->size * mine[4];
    for (int i = 5; i < MOEPT__AGREE_N; i++) n[2] += s[i] != c->size * mine[i];
    return MOEPT_OK;
}

/* A group call's outcome, agreed before it acts: a peer making another
   call, this rank's rejection (`local`, its message already the thread's),
   any peer's, or arguments that differ between ranks (args: their
   fingerprint, 0 for a call without any that must match) fails every rank
   of grp and dp, and nobody leaves a peer waiting in a collective. */
static moept_status moept__agree_call(moept_layer *L, moept_comm *grp, moept_comm *dp, moept_status local,
                                      int call, uint64_t args) {
    const char *name = moept__calls[call].name;
    int64_t n[3] = {local != MOEPT_OK, 0, 0}, tag = moept__call_tag(L, call);
    moept_status cst = moept__agree_group(grp, n, tag, args);
    if (!cst) cst = moept__agree_group(dp, n, tag, args);
    if (cst)
        return moept__fail(L, cst, "%s: agreement failed: %s", name,
                           grp && grp->err[0] ? grp->err : dp ? dp->err : "");
    L->agreed_calls++;
    if (n[1])
        return moept__fail(L, MOEPT_ERR_STATE,
                           "%s: the ranks' call sequences differ (another rank made another "
                           "group call here); nothing changed",
                           name);
    if (local) return local;
    if (n[0]) /* (a peer's own rejection explains its arguments too) */
        return moept__fail(L, MOEPT_ERR_STATE, "%s: %lld other rank(s) rejected the call; nothing changed",
                           name, (long long)n[0]);
    if (n[2])
        return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "%s: the ranks passed different %s (every rank "
                           "must pass the same); nothing changed", name, moept__calls[call].args);
    return MOEPT_OK;
}

/* ------------------------------------------------------------------------
   The steps' parallel loops
   ------------------------------------------------------------------------ */
#ifdef _OPENMP
#define MOEPT__TID omp_get_thread_num()
#else
#define MOEPT__TID 0
#endif
/* parallel loops only where the work pays for the fork. With MOEPT_CBLAS
   the BLAS owns the cores: OpenMP workers spinning after our loops steal
   them from its threads (measured: +12% step time at T=256), so only the
   largest passes (memory-bound, 8M+ elements) fork. The team is at most
   moept__team()'s (fewer on a busy machine); MOEPT__PAR_MAX's at most max
   (a region with per-thread scratch for that many). */
#ifdef MOEPT_CBLAS
#define MOEPT__PAR_MAX(work, max) if ((work) > (1 << 23)) num_threads(moept__team(max))
#else
#define MOEPT__PAR_MAX(work, max) if ((work) > 32768) num_threads(moept__team(max))
#endif
#define MOEPT__PAR(work) MOEPT__PAR_MAX(work, 0)

static int64_t moept__first_nonfinite(const float *v, int64_t n) {
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++)
        if (!moept__finite(v[i])) bad = i;
    return bad;
}

/* every bit of v [n] zero (+0.0f); stops at the first that is not */
static int moept__all_zero(const float *v, int64_t n) {
    const uint32_t *u = (const uint32_t *)(const void *)v;
    for (int64_t i = 0; i < n; i++)
        if (u[i]) return 0;
    return 1;
}

/* ------------------------------------------------------------------------
   The experts' FFN, both directions: activations and grouped GEMMs
   ------------------------------------------------------------------------ */
/* The gated SiLU rows (every family's default) a vector at a time (8 lanes
   with AVX, else 4) in GCC/clang vector types: gcc's -O2 cost model leaves
   the scalar loops of moept.h unvectorised (they need an epilogue, and the
   exp's clamps are branches there). Each lane runs moept__exp's and
   moept__act_fwd1/bwd1's operations in their order, clamps and NaN
   included, so rows equal the scalar functions bitwise (test_props
   checks); the tail and other kinds run those. */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(MOEPT_NO_VEC)
#define MOEPT__VEC 1
#ifdef __AVX__
#define MOEPT__VL 8
#else
#define MOEPT__VL 4 /* a wider generic vector than the target's changes the ABI (gcc warns) */
#endif
typedef float moept__fv __attribute__((vector_size(4 * MOEPT__VL)));
typedef int32_t moept__iv __attribute__((vector_size(4 * MOEPT__VL)));
#define MOEPT__SEL(m, a, b) ((moept__fv)(((m) & (moept__iv)(a)) | (~(m) & (moept__iv)(b))))
static inline moept__fv moept__expv(moept__fv x) {
    const moept__fv zero = {0};
    x = MOEPT__SEL(x < -87.3f, zero - 87.3f, x);
    x = MOEPT__SEL(x > 88.7f, zero + 88.7f, x);
    moept__iv fin = ((moept__iv)x & 0x7f800000) != 0x7f800000;
    moept__fv xi = MOEPT__SEL(fin, x, zero);
    moept__fv n, r, p;
    MOEPT__EXP_STEPS(x, xi, zero, n, r, p);
    moept__iv bits = (__builtin_convertvector(n, moept__iv) + 127) * (1 << 23);
    return p * (moept__fv)bits;
}
static inline moept__fv moept__ldv(const float *p) { moept__fv v; memcpy(&v, p, sizeof v); return v; }
static inline void moept__stv(float *p, moept__fv v) { memcpy(p, &v, sizeof v); }
#endif

/* a[F] from h = [gate | up] (moept__act_fwd_row) */
static void moept__act_fwd_rowv(int kind, const float *h, int64_t F, float *a) {
    int64_t j = 0;
#ifdef MOEPT__VEC
    if (kind == MOEPT_ACT_SILU_GATED)
        for (; j + MOEPT__VL <= F; j += MOEPT__VL) {
            moept__fv g = moept__ldv(h + j);
            moept__stv(a + j, g / (1.0f + moept__expv(-g)) * moept__ldv(h + F + j));
        }
#endif
    if (j == 0) { moept__act_fwd_row(kind, h, F, a); return; }
    for (; j < F; j++) a[j] = moept__act_fwd1(kind, h[j], moept__act_gated(kind) ? h[F + j] : 0.0f);
}

/* da[F] -> dh (layout of h; dh may alias h) (moept__act_bwd_row) */
static void moept__act_bwd_rowv(int kind, const float *h, const float *da, int64_t F, float *dh) {
    int64_t j = 0;
#ifdef MOEPT__VEC
    if (kind == MOEPT_ACT_SILU_GATED)
        for (; j + MOEPT__VL <= F; j += MOEPT__VL) {
            moept__fv g = moept__ldv(h + j), u = moept__ldv(h + F + j), d = moept__ldv(da + j);
            moept__fv s = 1.0f / (1.0f + moept__expv(-g));
            moept__stv(dh + j, d * u * (s * (1.0f + g * (1.0f - s))));
            moept__stv(dh + F + j, d * g * s);
        }
#endif
    if (j == 0) { moept__act_bwd_row(kind, h, da, F, dh); return; }
    for (; j < F; j++) {
        float dg, du;
        moept__act_bwd1(kind, h[j], moept__act_gated(kind) ? h[F + j] : 0.0f, da[j], &dg, &du);
        dh[j] = dg;
        if (moept__act_gated(kind)) dh[F + j] = du;
    }
}

/* ------------------------------------------------------------------------
   FP8 (config.fp8): DeepSeek-V3's blockwise E4M3, the spec a GPU's FP8
   GEMMs are held to. An operand is quantized and dequantized in its tiles,
   then the GEMMs run in fp32: each tile's scale s = max(amax / 448, 2^-63)
   (moept__q8_scale), each value s * e4m3(v / s).
   ------------------------------------------------------------------------ */
/* one row v [D] in its 1 x 128 tiles: its values into out [D] (may be v), or (out NULL) as an FP8
   record rec [moept__q8_recw(D)] bytes, its padding zero (a routed row as the dispatch sends it) */
static void moept__q8_row(const float *v, int64_t D, float *out, uint8_t *rec) {
    const int64_t Dp = MOEPT__Q8_PAD(D), L = MOEPT__Q8_L(D);
    for (int64_t b = 0; b < L; b++) {
        const int64_t j0 = b * MOEPT__Q8_TILE, j1 = j0 + MOEPT__Q8_TILE < D ? j0 + MOEPT__Q8_TILE : D;
        float amax = 0.0f;
        for (int64_t j = j0; j < j1; j++) amax = moept__q8_amax(amax, v[j]);
        const float s = moept__q8_scale(amax);
        for (int64_t j = j0; j < j1; j++) {
            const float r = moept__e4m3_round(v[j] / s);
            if (out) out[j] = r * s; /* (moept__q8) */
            else rec[j] = moept__e4m3_byte(r);
        }
        if (!out) memcpy(rec + Dp + 4 * b, &s, 4);
    }
    if (!out) {
        memset(rec + D, 0, (size_t)(Dp - D));
        memset(rec + Dp + 4 * L, 0, (size_t)(moept__q8_recw(D) - Dp - 4 * L));
    }
}
/* each row's 1 x 128 tiles along its cols: src [rows][lds] -> dst [rows][ldd] (may be src) */
static void moept__q8_rows(const float *src, int64_t rows, int64_t cols, int64_t lds, float *dst,
                           int64_t ldd) {
    #pragma omp parallel for schedule(static) MOEPT__PAR(rows * cols)
    for (int64_t r = 0; r < rows; r++) moept__q8_row(src + r * lds, cols, dst + r * ldd, NULL);
}

/* a record's values into out [D]: each byte's E4M3 value times its tile's scale (moept__q8_row's out) */
static void moept__q8_unrecord(const uint8_t *rec, int64_t D, float *out) {
    const int64_t Dp = MOEPT__Q8_PAD(D);
    for (int64_t b = 0; b < MOEPT__Q8_L(D); b++) {
        const int64_t j0 = b * MOEPT__Q8_TILE, j1 = j0 + MOEPT__Q8_TILE < D ? j0 + MOEPT__Q8_TILE : D;
        float s;
        memcpy(&s, rec + Dp + 4 * b, 4);
        for (int64_t j = j0; j < j1; j++) out[j] = moept__e4m3_f32(rec[j]) * s;
    }
}

/* each run's 128 x 1 tiles down every column, from its first row (the
   wgrad's operands: its reduction runs over a group's rows, R a group a
   run): src [..][ld] -> dst [..][ld] */
static void moept__q8_cols(const float *src, int64_t ld, int64_t cols, const moept__runs *R, float *dst) {
    for (int64_t g = 0; g < R->n; g++) {
        int64_t r0, r1, e;
        moept__run_at(R, g, &r0, &r1, &e);
        r1 += r0;
        #pragma omp parallel for schedule(static) MOEPT__PAR((r1 - r0) * cols)
        for (int64_t j = 0; j < cols; j++)
            for (int64_t i0 = r0; i0 < r1; i0 += MOEPT__Q8_TILE) {
                const int64_t i1 = i0 + MOEPT__Q8_TILE < r1 ? i0 + MOEPT__Q8_TILE : r1;
                float amax = 0.0f;
                for (int64_t i = i0; i < i1; i++) amax = moept__q8_amax(amax, src[i * ld + j]);
                const float s = moept__q8_scale(amax);
                for (int64_t i = i0; i < i1; i++) dst[i * ld + j] = moept__q8(src[i * ld + j], s);
            }
    }
}

/* a weight's 128 x 128 blocks: w [rows][cols] -> dst */
static void moept__q8_blocks(const float *w, int64_t rows, int64_t cols, float *dst) {
    const int64_t nb = (cols + MOEPT__Q8_TILE - 1) / MOEPT__Q8_TILE;
    #pragma omp parallel for schedule(static) MOEPT__PAR(rows * cols)
    for (int64_t b = 0; b < (rows + MOEPT__Q8_TILE - 1) / MOEPT__Q8_TILE * nb; b++) {
        const int64_t i0 = b / nb * MOEPT__Q8_TILE, j0 = b % nb * MOEPT__Q8_TILE;
        const int64_t i1 = i0 + MOEPT__Q8_TILE < rows ? i0 + MOEPT__Q8_TILE : rows;
        const int64_t j1 = j0 + MOEPT__Q8_TILE < cols ? j0 + MOEPT__Q8_TILE : cols;
        float amax = 0.0f;
        for (int64_t i = i0; i < i1; i++)
            for (int64_t j = j0; j < j1; j++) amax = moept__q8_amax(amax, w[i * cols + j]);
        const float s = moept__q8_scale(amax);
        for (int64_t i = i0; i < i1; i++)
            for (int64_t j = j0; j < j1; j++) dst[i * cols + j] = moept__q8(w[i * cols + j], s);
    }
}

/* ------------------------------------------------------------------------
   The expert FFN, written once: gate/up, the activation, down and their
   backward over a list of row runs (moept__runs: every group, or a chunk's
   runs), for the routed experts and the shared expert alike. config.fp8 is
   a property of the operands (the weights' quantized copies, the token
   operands quantized in q1, q2), not another copy of the code.
   ------------------------------------------------------------------------ */
/* One FFN's operands; row buffers are indexed by row (a run touches its own) */
typedef struct moept__ffn {
    const float *w13, *w2; /* [E][H][D], [E][D][F] as the GEMMs read them (config.fp8: quantized) */
    float *g13, *g2;       /* [E][H][D], [E][D][F] their gradients (accumulated) */
    int64_t H, F, lda;     /* h's width (gate|up), a's, a's row stride (an inference layer's a lies
                              over h: H) */
    const float *x;        /* [rows][D] the inputs */
    float *h, *a;          /* [rows][H] gate|up (backward: dh over it), [rows][lda] activations */
    float *y;              /* [rows][D] the outputs; backward: their gradients in */
    float *da, *dx;        /* [rows][F], [rows][D] backward: da (may be a), dxs (may be y) */
    float *q1, *q2;        /* config.fp8: [rows][max(D, H)] (inference: [rows][D]), [rows][D] token
                              operands; NULL: off */
    int xq;                /* config.fp8's routed experts: x's rows reach them quantized (1 x 128, as
                              the forward's gate/up reads them: the dispatch quantized them once, and
                              sends them so, moept__q8_row): the W13 gradient's x is those values,
                              quantized down the columns */
    int yq;                /* ... and dy's (1 x 128: combine' quantized them once, and sends them so):
                              the W2 gradient's dy is those values, quantized down the columns */
} moept__ffn;

/* The routed experts' FFN of a slot (one chunk: da over a, dxs over dys) */
static moept__ffn moept__ffn_routed(moept_layer *L, moept__fstate *sl) {
    const int q8 = L->cfg.fp8 != MOEPT_FP8_OFF, ch = L->C > 1;
    moept__ffn f = {q8 ? L->ws.q8w13 : L->par.w13, q8 ? L->ws.q8w2 : L->par.w2, L->par.g13, L->par.g2,
                    L->H, L->F, L->ws.lda_a, sl->ws.xr, sl->ws.h, sl->ws.a, sl->ws.yr,
                    ch ? sl->ch.da : sl->ws.a, ch ? sl->ch.dx : sl->ws.yr, sl->ws.q1, sl->ws.q2, q8, q8};
    return f;
}

/* The shared expert's over x (its unmasked rows, packed where padded) */
static moept__ffn moept__ffn_shared(moept_layer *L, moept__fstate *sl, const float *x) {
    const int q8 = L->cfg.fp8 != MOEPT_FP8_OFF;
    moept__ffn f = {q8 ? L->ws.q8ws13 : L->par.ws13, q8 ? L->ws.q8ws2 : L->par.ws2, L->par.gs13, L->par.gs2,
                    L->HS, L->S, L->ws.lda_as, x, sl->ws.hs, sl->ws.as, sl->ws.yss, sl->ws.as,
                    sl->ws.yss, q8 ? L->ws.q8s1 : NULL, q8 ? L->ws.q8s2 : NULL, 0, 0};
    return f;
}

/* GEMMs in groups that share op(B) (consecutive runs of one expert: its
   weight panels packed once for all the runs), letting the comm move posted
   messages between groups (chunked overlap). */
static void moept__gemm_run_progress(moept_layer *L, const moept__gemm *g, int64_t n) {
    for (int64_t i = 0; i < n;) {
        int64_t j = i + 1;
#ifndef MOEPT_CBLAS
        int fits = g[i].m > 0 && g[i].m <= L->ws.gws.m_max && g[i].k > 0 && g[i].n > 0;
        while (j < n && fits && g[j].b == g[i].b && g[j].trans_b == g[i].trans_b && g[j].ldb == g[i].ldb &&
               g[j].n == g[i].n && g[j].k == g[i].k && g[j].m > 0 && g[j].m <= L->ws.gws.m_max)
            j++;
        if (j - i > 1) moept__gemm_builtin(&g[i], j - i, &L->ws.gws);
        else
#endif
            moept__gemm_run(&g[i], 1, &L->ws.gws);
        if (L->ep && L->ep->progress) L->ep->progress(L->ep);
        i = j;
    }
}

/* The activation over R's rows: a = act(h); with da, dh = act'(h, da) over h */
static void moept__ffn_act(moept_layer *L, const moept__ffn *f, const moept__runs *R, const float *da) {
    for (int64_t i = 0; i < moept__spans(R); i++) {
        int64_t r0, rows;
        moept__span_at(R, i, &r0, &rows);
        #pragma omp parallel for schedule(static) MOEPT__PAR(rows * f->F)
        for (int64_t r = r0; r < r0 + rows; r++) { /* (a may be h itself: a[j] is h[j]'s only reader) */
            if (da) moept__act_bwd_rowv(L->act, f->h + r * f->H, da + r * f->F, f->F, f->h + r * f->H);
            else moept__act_fwd_rowv(L->act, f->h + r * f->H, f->F, f->a + r * f->lda);
        }
    }
}

/* One matmul of the FFN over R's rows through weight W [wo][wi] (W13 [H][D],
   W2 [D][F]): forward out [rows][wo] = in [rows][wi] W^T, backward (the
   dgrad) out [rows][wi] = in [rows][wo] W. config.fp8: in quantized along
   its rows first (dh into q1; dy into q2; a in place; x, dy where not f->xq, f->yq). */
static void moept__ffn_mm(moept_layer *L, const moept__ffn *f, const moept__runs *R, int w2, int bwd,
                          const float *in, float *out) {
    const int64_t wo = w2 ? L->D : f->H, wi = w2 ? f->F : L->D;
    const int64_t k = bwd ? wo : wi, m = bwd ? wi : wo, ld = w2 && !bwd ? f->lda : k;
    const float *w = w2 ? f->w2 : f->w13;
    if (f->q1 && !(f->xq && in == f->x) && !(f->yq && in == f->y)) {
        float *q = !w2 ? f->q1 : bwd ? f->q2 : f->a;
        for (int64_t i = 0; i < moept__spans(R); i++) {
            int64_t r0, rows;
            moept__span_at(R, i, &r0, &rows);
            moept__q8_rows(in + r0 * ld, rows, k, ld, q + r0 * ld, ld);
        }
        in = q;
    }
    int64_t n;
    MOEPT__PER_RUN(L->ws.descs, n, R,
                   moept__gemm_make(0, !bwd, rows, m, k, in + r0 * ld, ld, w + e * wo * wi, wi, 0.0f,
                                    out + r0 * m, m));
    moept__gemm_run_progress(L, L->ws.descs, n);
}

/* A weight's gradient over R's rows (whole groups: the reduction runs over an
   expert's rows): W2's g2 += dy^T a, W13's g13 += dh^T x. config.fp8: both
   operands quantized down each group's columns first (into q2 and q1; x's and
   dy's rows as they reached the experts, quantized along them: f->xq, f->yq). */
static void moept__ffn_wgrad(moept_layer *L, const moept__ffn *f, const moept__runs *R, int w2) {
    const int64_t wo = w2 ? L->D : f->H, wi = w2 ? f->F : L->D;
    const float *dout = w2 ? f->y : f->h, *in = w2 ? f->a : f->x;
    float *g = w2 ? f->g2 : f->g13;
    if (f->q1) {
        float *qo = w2 ? f->q2 : f->q1, *qi = w2 ? f->q1 : f->q2;
        moept__q8_cols(in, wi, wi, R, qi);
        moept__q8_cols(dout, wo, wo, R, qo);
        dout = qo;
        in = qi;
    }
    int64_t n;
    MOEPT__PER_RUN(L->ws.descs, n, R,
                   moept__gemm_make(1, 0, wo, wi, rows, dout + r0 * wo, wo, in + r0 * wi, wi, 1.0f,
                                    g + e * wo * wi, wi));
    moept__gemm_run_progress(L, L->ws.descs, n);
}

/* The forward over R's rows: h = x W13^T, a = act(h), y = a W2^T */
static void moept__ffn_forward(moept_layer *L, const moept__ffn *f, const moept__runs *R) {
    moept__ffn_mm(L, f, R, 0, 0, f->x, f->h);
    moept__ffn_act(L, f, R, NULL);
    moept__ffn_mm(L, f, R, 1, 0, f->a, f->y);
}

/* Its backward over R's rows, dy in y: a = act(h) again (cheap: one buffer
   serves a and da where da is a), da = dy W2, dh = act'(h, da) over h,
   dxs = dh W13. R every group: the weight gradients in between, each
   before its operand is overwritten; a chunk's runs: the caller runs them
   once every chunk is done (moept__ffn_wgrad over every group: an FP8
   wgrad's tiles run down an expert's rows). */
static void moept__ffn_backward(moept_layer *L, const moept__ffn *f, const moept__runs *R) {
    const int wgrad = R->offs != NULL;
    moept__ffn_act(L, f, R, NULL);
    if (wgrad) moept__ffn_wgrad(L, f, R, 1);
    moept__ffn_mm(L, f, R, 1, 1, f->y, f->da);
    moept__ffn_act(L, f, R, f->da);
    if (wgrad) moept__ffn_wgrad(L, f, R, 0);
    moept__ffn_mm(L, f, R, 0, 1, f->h, f->dx);
}

/* config.fp8: the weights' quantized copies, made at each forward (the
   backward reads the same: a weight change fails the pending backwards) */
static void moept__q8_weights(moept_layer *L) {
    if (L->cfg.fp8 == MOEPT_FP8_OFF) return;
    const int64_t D = L->D, H = L->H, F = L->F;
    for (int64_t e = 0; e < L->El; e++) {
        moept__q8_blocks(L->par.w13 + e * H * D, H, D, L->ws.q8w13 + e * H * D);
        moept__q8_blocks(L->par.w2 + e * D * F, D, F, L->ws.q8w2 + e * D * F);
    }
    if (L->S > 0) {
        moept__q8_blocks(L->par.ws13, L->HS, D, L->ws.q8ws13);
        moept__q8_blocks(L->par.ws2, D, L->S, L->ws.q8ws2);
    }
}

/* ------------------------------------------------------------------------
   The exchange and the direct (shared-memory) path
   ------------------------------------------------------------------------ */
#ifdef _OPENMP
static double moept__now(void) { return omp_get_wtime(); }
#else
static double moept__now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
#endif

/* the bytes of one exchange direction, for the stats: rows of D floats, or (rec) FP8 records */
static void moept__count_bytes(moept_layer *L, int dispatch, int rec) {
    const int64_t rowbytes = rec ? moept__q8_recw(L->D) : L->D * (int64_t)sizeof(float);
    L->stats.bytes_sent += (dispatch ? L->stats.rows_sent : L->stats.rows_received) * rowbytes;
    L->stats.bytes_received += (dispatch ? L->stats.rows_received : L->stats.rows_sent) * rowbytes;
}

/* an exchange's bytes (rows of D floats, or rec: FP8 records) and time into the stats; its failure named */
static moept_status moept__exchanged(moept_layer *L, moept_status st, double t0, int dispatch, int rec) {
    moept__count_bytes(L, dispatch, rec);
    L->stats.comm_seconds += moept__now() - t0;
    if (st)
        return moept__fail(L, st, "expert exchange (%s): %s", dispatch ? "dispatch" : "combine", L->ep->err);
    return MOEPT_OK;
}

/* One direction of the expert exchange. dispatch = 1: rows of xs-side
   buffer `local` go to the experts' ranks, landing expert-major in `remote`;
   dispatch = 0: the reverse. Counted in the stats. */
static moept_status moept__exchange(moept_layer *L, moept__fstate *sl, float *local, float *remote,
                                    int dispatch) {
    double t0 = moept__now();
    moept_seg *s = sl->xch.send_segs, *r = sl->xch.recv_segs;
    moept_status st = dispatch ? L->ep->alltoallv(L->ep, local, s, remote, r, (int)L->El, 4)
                               : L->ep->alltoallv(L->ep, remote, r, local, s, (int)L->El, 4);
    return moept__exchanged(L, st, t0, dispatch, 0);
}

/* the forward dispatch from x by index (moept__rows_dispatch) */
static moept_status moept__exchange_rows(moept_layer *L, moept__fstate *sl, const float *x) {
    double t0 = moept__now();
    moept_status st = L->ep->alltoallv_rows(L->ep, x, sl->plan.tok_of_row, L->D, sl->xch.send_segs, sl->ws.xr,
                                            sl->xch.recv_segs, (int)L->El, 4);
    return moept__exchanged(L, st, t0, 1, 0);
}

/* The exchange's pieces ss, rs [P][El], rows of D floats, as rows of FP8 records' 4-byte words (on),
   or back (config.fp8's records travel in the plan's pieces: rescaled for their exchange, and back once
   it completed) */
static void moept__rec_pieces(const moept_layer *L, moept_seg *ss, moept_seg *rs, int on) {
    const int64_t w = moept__q8_recw(L->D) / 4, from = on ? L->D : w, to = on ? w : L->D;
    for (int64_t i = 0; i < L->P * L->El; i++) {
        ss[i].offset = ss[i].offset / from * to;
        ss[i].count = ss[i].count / from * to;
        rs[i].offset = rs[i].offset / from * to;
        rs[i].count = rs[i].count / from * to;
    }
}

/* config.fp8 under EP: the experts' rows [r0, r0 + n) as their records arrived in xq (the forward's
   x, the backward's dy), decoded into to [Rcap][D] (xr, dyr) */
static void moept__q8_arrived(moept_layer *L, moept__fstate *sl, int64_t r0, int64_t n, float *to) {
    const int64_t D = L->D, W = moept__q8_recw(D);
    #pragma omp parallel for schedule(static) MOEPT__PAR(n * D)
    for (int64_t r = r0; r < r0 + n; r++) moept__q8_unrecord(sl->ws.xq + r * W, D, to + r * D);
}

/* config.fp8's dispatch under EP (the forward's x, the backward's dy): the records in xs to the
   experts' ranks (into xq), then decoded into to */
static moept_status moept__exchange_records(moept_layer *L, moept__fstate *sl, float *to) {
    moept_seg *s = sl->xch.send_segs, *r = sl->xch.recv_segs;
    double t0 = moept__now();
    moept__rec_pieces(L, s, r, 1);
    moept_status st = L->ep->alltoallv(L->ep, sl->ws.xs, s, sl->ws.xq, r, (int)L->El, 4);
    moept__rec_pieces(L, s, r, 0);
    if ((st = moept__exchanged(L, st, t0, 1, 1))) return st;
    moept__q8_arrived(L, sl, 0, sl->xch.roffsets[L->El], to);
    return MOEPT_OK;
}

/* Row kernels of the combine and its backward: y = y + w x (combine_step)
   and y = w x (scale), element by element as moept.h defines them. Eight
   elements a step, all loaded before any is stored, so -O2's cost model
   (which adds no epilogue loop to vectorise) still makes each step vector
   code whether or not y and x overlap. */
static void moept__row_axpy(float *y, float w, const float *x, int64_t n) {
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) {
        float t[8];
#pragma GCC unroll 8
        for (int l = 0; l < 8; l++) t[l] = moept__combine_step(y[d + l], w, x[d + l]);
#pragma GCC unroll 8
        for (int l = 0; l < 8; l++) y[d + l] = t[l];
    }
    for (; d < n; d++) y[d] = moept__combine_step(y[d], w, x[d]);
}

static void moept__row_scale(float *y, float w, const float *x, int64_t n) {
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) {
        float t[8];
#pragma GCC unroll 8
        for (int l = 0; l < 8; l++) t[l] = moept__scale(w, x[d + l]);
#pragma GCC unroll 8
        for (int l = 0; l < 8; l++) y[d + l] = t[l];
    }
    for (; d < n; d++) y[d] = moept__scale(w, x[d]);
}

/* Direct path: row r of this rank's permuted order (slot s) where the
   slot's rank keeps it: in its xr (out = 0) or its yr (out = 1) */
static inline float *moept__shared_row(const moept_layer *L, moept__fstate *sl, int64_t s, int64_t r,
                                       int out) {
    const int64_t D = L->D;
    const int64_t row = out * sl->xch.shcap + sl->xch.dst_row[s] + r - sl->plan.offsets[s];
    return sl->xch.shbase[s / L->El] + row * D;
}

/* Direct plan: where our rows of each slot start in its rank's xr/yr.
   That rank's order (expert-major, then by source rank), from everyone's
   counts. */
static void moept__direct_plan(moept_layer *L, moept__fstate *sl) {
    const int64_t E = L->E, El = L->El, P = L->P;
    for (int64_t q = 0; q < P; q++) {
        int64_t off = 0;
        for (int64_t s = q * El; s < (q + 1) * El; s++)
            for (int64_t p = 0; p < P; p++) {
                if (p == L->rank) sl->xch.dst_row[s] = off;
                off += sl->xch.allcnt[p * E + s];
            }
    }
}

/* Direct dispatch: our rows straight from x into the experts' ranks' xr
   (each row moves once, no send buffer) */
static void moept__direct_push(moept_layer *L, moept__fstate *sl, const float *x) {
    const int64_t D = L->D, E = L->E;
    const int q8 = L->cfg.fp8 != MOEPT_FP8_OFF; /* (x's rows quantized once, as they are written) */
    #pragma omp parallel MOEPT__PAR(sl->plan.N * D)
    for (int64_t s = 0; s < E; s++) {
        float *dst = moept__shared_row(L, sl, s, sl->plan.offsets[s], 0);
        const int64_t *tok = sl->plan.tok_of_row + sl->plan.offsets[s];
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < sl->plan.counts[s]; i++) {
            if (q8) moept__q8_row(x + tok[i] * D, D, dst + i * D, NULL);
            else memcpy(dst + i * D, x + tok[i] * D, (size_t)D * sizeof(float));
        }
    }
}

/* The routed rows into xs in slot order (x's row tok_of_row[r] each): as they are, or config.fp8's
   quantized once (moept__q8_row): their values (one rank: xs is the experts' rows), or under EP FP8
   records (moept__q8_recs: the exchange's rows, moept__q8_recw(D) bytes each, packed) */
static void moept__gather_rows(moept_layer *L, moept__fstate *sl, const float *x) {
    const int64_t D = L->D, N = sl->plan.N, W = moept__q8_recw(D);
    const int q8 = L->cfg.fp8 != MOEPT_FP8_OFF, rec = moept__q8_recs(L);
    #pragma omp parallel for schedule(static) MOEPT__PAR(N * D)
    for (int64_t r = 0; r < N; r++) {
        const float *v = x + sl->plan.tok_of_row[r] * D;
        if (rec) moept__q8_row(v, D, NULL, (uint8_t *)sl->ws.xs + r * W);
        else if (q8) moept__q8_row(v, D, sl->ws.xs + r * D, NULL);
        else memcpy(sl->ws.xs + r * D, v, (size_t)D * sizeof(float));
    }
}

static moept_status moept__direct_sync(moept_layer *L, const char *what) {
    double t0 = moept__now();
    moept_status st = L->ep->barrier(L->ep);
    L->stats.comm_seconds += moept__now() - t0;
    if (st) return moept__fail(L, st, "%s: %s", what, L->ep->err);
    return MOEPT_OK;
}

/* all-reduce over EP then DP (the world), timed */
static moept_status moept__world_sum(moept_layer *L, void *buf, int64_t n, moept_dtype t) {
    double t0 = moept__now();
    moept_comm *bad = NULL;
    moept_status st = moept__sum_ep_dp(L->group, L->dp, buf, n, t, &bad);
    if (st) st = moept__fail(L, st, "all-reduce over %s: %s", bad == L->dp ? "DP" : "EP", bad->err);
    L->stats.comm_seconds += moept__now() - t0;
    return st;
}

/* ------------------------------------------------------------------------
   FSDP: the experts gathered, their gradients reduce-scattered
   ------------------------------------------------------------------------ */
/* fsdp: all-gather of every rank's flat shard into the full experts. */
static moept_status moept__fsdp_gather(moept_layer *L) {
    double t0 = moept__now();
    const int64_t sh = L->fs.shard, P = L->fsdp->size;
    moept_status st = L->fsdp->allgather(L->fsdp, L->fs.w, L->fs.full, sh * (int64_t)sizeof(float));
    L->fs.gather_seconds = moept__now() - t0;
    L->stats.comm_seconds += L->fs.gather_seconds;
    if (st) return moept__fail(L, st, "fsdp all-gather of the experts: %s", L->fsdp->err);
    L->stats.bytes_sent += (P - 1) * sh * (int64_t)sizeof(float);
    L->stats.bytes_received += (P - 1) * sh * (int64_t)sizeof(float);
    return MOEPT_OK;
}

/* fsdp: reduce-scatter of the full expert gradients: piece q of every
   rank's gradients to rank q (an all-to-all-v), summed in rank order (the
   threads and MPI all-reduces' order) into this rank's shard gradient. The
   gathered weights are no longer needed and take the pieces. */
static moept_status moept__fsdp_reduce_scatter(moept_layer *L) {
    double t0 = moept__now();
    const int64_t sh = L->fs.shard;
    const int P = L->fsdp->size;
    moept_seg *sg = L->xch.count_segs, *rg = L->xch.count_segs + P; /* [2][P], free after the forward */
    for (int q = 0; q < P; q++) { sg[q] = (moept_seg){q * sh, sh}; rg[q] = (moept_seg){q * sh, sh}; }
    moept_status st = L->fsdp->alltoallv(L->fsdp, L->fs.gfull, sg, L->fs.full, rg, 1, 4);
    L->stats.comm_seconds += moept__now() - t0;
    L->stats.bytes_sent += (int64_t)(P - 1) * sh * (int64_t)sizeof(float);
    L->stats.bytes_received += (int64_t)(P - 1) * sh * (int64_t)sizeof(float);
    if (st) return moept__fail(L, st, "fsdp reduce-scatter of the expert gradients: %s", L->fsdp->err);
    #pragma omp parallel for schedule(static) MOEPT__PAR(sh * P)
    for (int64_t i = 0; i < sh; i++) {
        float v = L->fs.full[i];
        for (int p = 1; p < P; p++) v += L->fs.full[(int64_t)p * sh + i];
        L->fs.g[i] += v;
    }
    return MOEPT_OK;
}

/* fsdp: this rank's part of a full expert tensor (flat offset `flat`, n
   values) written into its shard (the rest belongs to other ranks). */
static void moept__fsdp_write(moept_layer *L, int64_t flat, const float *src, int64_t n) {
    int64_t lo = (int64_t)L->fsdp->rank * L->fs.shard, hi = lo + L->fs.shard;
    int64_t a = flat > lo ? flat : lo, b = flat + n < hi ? flat + n : hi;
    for (int64_t i = a; i < b; i++) L->fs.w[i - lo] = src[i - flat];
}

/* ------------------------------------------------------------------------
   The shared expert and the combine
   ------------------------------------------------------------------------ */
/* The packed rows of a padded step's shared expert: its unmasked tokens
   (ids -1: padding), their x rows into L->xsh; returns how many. */
static int64_t moept__shared_pack(moept_layer *L, moept__fstate *sl, const float *x, int64_t T) {
    const int32_t *ids = sl->fwd.ids[sl->fwd.cur];
    const int64_t D = L->D, K = L->K;
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++)
        if (ids[t * K] >= 0) L->ws.shrow[n++] = t;
    #pragma omp parallel for schedule(static) MOEPT__PAR(n * D)
    for (int64_t i = 0; i < n; i++)
        memcpy(L->ws.xsh + i * D, x + L->ws.shrow[i] * D, (size_t)D * sizeof(float));
    return n;
}
/* rows [n][w] of v packed (to 1) or unpacked (0: to their tokens' rows, the
   others zero), in place: row i and its token's row shrow[i] >= i */
static void moept__shared_move(const moept_layer *L, float *v, int64_t w, int64_t n, int64_t T,
                               int to_packed) {
    const size_t b = (size_t)w * sizeof(float);
    if (to_packed) {
        for (int64_t i = 0; i < n; i++) memmove(v + i * w, v + L->ws.shrow[i] * w, b);
        return;
    }
    for (int64_t i = n - 1, t = T - 1; t >= 0; t--) {
        if (i >= 0 && L->ws.shrow[i] == t) memmove(v + t * w, v + i-- * w, b);
        else memset(v + t * w, 0, b);
    }
}

/* the committed step's unmasked tokens, which the shared expert runs over
   (packed when fewer than its T tokens) */
static int64_t moept__shared_rows(const moept__fstate *sl, int64_t T) {
    return sl->fwd.sh_n < T ? sl->fwd.sh_n : T;
}

/* The shared expert (and its sigmoid gate) over the T tokens; a padded
   step's over its unmasked rows, packed, then their outputs unpacked */
static void moept__shared_forward(moept_layer *L, moept__fstate *sl, const float *x, int64_t T) {
    if (L->S <= 0) return;
    const int64_t D = L->D;
    const int64_t n = moept__shared_rows(sl, T);
    if (n < T) {
        moept__shared_pack(L, sl, x, T);
        x = L->ws.xsh;
    }
    const int64_t off[2] = {0, n};
    const moept__runs R = moept__runs_groups(off, 1);
    const moept__ffn f = moept__ffn_shared(L, sl, x);
    moept__ffn_forward(L, &f, &R);
    if (L->par.wsg) {
        moept__gemm gg = moept__gemm_make(0, 1, n, 1, D, x, D, L->par.wsg, D, 0.0f, sl->ws.sg, 1);
        moept__gemm_run(&gg, 1, &L->ws.gws);
        for (int64_t t = 0; t < n; t++) sl->ws.sg[t] = moept__sigmoid(sl->ws.sg[t]);
    }
    if (n < T) {
        moept__shared_move(L, sl->ws.yss, D, n, T, 0);
        if (L->par.wsg) moept__shared_move(L, sl->ws.sg, 1, n, T, 0);
    }
}

/* Combine of tokens [t0, t1): each output row written once, the shared
   expert's row first, then the k contributions in slot order. */
static void moept__combine_range(moept_layer *L, moept__fstate *sl, float *y, const float *wts,
                                 const int32_t *ids,
                                 int64_t t0, int64_t t1) {
    const int64_t D = L->D, K = L->K;
    #pragma omp parallel for schedule(static) MOEPT__PAR((t1 - t0) * D * K)
    for (int64_t t = t0; t < t1; t++) {
        float *yt = y + t * D;
        if (ids[t * K] < 0) { memset(yt, 0, (size_t)D * sizeof(float)); continue; } /* padding */
        if (L->S > 0) {
            float gs = L->par.wsg ? sl->ws.sg[t] : 1.0f;
            moept__row_scale(yt, gs, sl->ws.yss + t * D, D);
        } else {
            memset(yt, 0, (size_t)D * sizeof(float));
        }
        for (int64_t k = 0; k < K; k++) {
            int64_t r = sl->plan.row_of[t * K + k];
            if (r < 0) continue;
            float w = wts[t * K + k];
            int64_t s = L->plan.slot_of[ids[t * K + k]];
            const float *src = L->xch.direct ? moept__shared_row(L, sl, s, r, 1) : sl->ws.ys + r * D;
            moept__row_axpy(yt, w, src, D);
        }
    }
}

/* ------------------------------------------------------------------------
   Chunked overlap: the pipeline of both directions
   ------------------------------------------------------------------------ */
/* The step's tokens split into C contiguous chunks (chunk c = tokens
   [c T / C, (c+1) T / C)). The plan is a stable sort by slot, so a chunk's
   rows of each slot are a contiguous part of that slot's rows, and on the
   expert side a chunk's rows from source p for expert j are a contiguous part
   of (j, p)'s rows: every chunk lands exactly where the one-chunk step puts
   it, and per-row results (GEMM rows, activations, combine) are computed
   the same way, so the step is bitwise equal to C = 1. The weight gradients
   reduce over all rows and run once, over the full buffers, after the last
   chunk arrived (overlapping the last chunk's return). */

/* Chunk c's exchange pieces (ss [P][El] on the token side, rs [P][El] on the
   expert side; NULL: not wanted) and its row runs on the expert side;
   returns the runs (moept__plan_chunk above, as the CUDA executor's). */
static int64_t moept__chunk_plan(moept_layer *L, moept__fstate *sl, int64_t c, moept_seg *ss, moept_seg *rs,
                                 int64_t *runs) {
    return moept__plan_chunk(c, L->C, L->P, L->El, L->D, sl->plan.offsets, sl->ch.ccnt,
                             L->ep ? sl->xch.rcounts : sl->plan.counts, sl->xch.roffsets, sl->ch.rccnt, ss,
                                 rs,
                             runs);
}

/* A chunk's expert FFN over its runs (the one-chunk step's descriptors,
   row by row); backward: the data side, the weight gradients once at the
   end (moept__chunk_weight_grads); first its rows' FP8 records decoded (moept__q8_recs: into xr,
   dyr) */
static void moept__chunk_arrived(moept_layer *L, moept__fstate *sl, const moept__runs *R, float *to) {
    for (int64_t i = 0; moept__q8_recs(L) && i < moept__spans(R); i++) {
        int64_t r0, rows;
        moept__span_at(R, i, &r0, &rows);
        moept__q8_arrived(L, sl, r0, rows, to);
    }
}
static void moept__chunk_forward(moept_layer *L, moept__fstate *sl, const moept__runs *R) {
    moept__chunk_arrived(L, sl, R, sl->ws.xr);
    moept__ffn f = moept__ffn_routed(L, sl);
    moept__ffn_forward(L, &f, R);
}
static void moept__chunk_backward(moept_layer *L, moept__fstate *sl, const moept__runs *R) {
    moept__chunk_arrived(L, sl, R, sl->ws.dyr);
    moept__ffn f = moept__ffn_routed(L, sl);
    moept__ffn_backward(L, &f, R);
}

/* Post / complete one exchange of a chunk (non-blocking where the comm has
   it; else the blocking exchange at the post). */
static moept_status moept__post(moept_layer *L, const float *send, const moept_seg *ss, float *recv,
                                const moept_seg *rs, int slot) {
    double t0 = moept__now();
    moept_comm *ep = L->ep;
    moept_status st = ep->ialltoallv && ep->wait ? ep->ialltoallv(ep, send, ss, recv, rs, (int)L->El, 4, slot)
                                                 : ep->alltoallv(ep, send, ss, recv, rs, (int)L->El, 4);
    L->stats.comm_seconds += moept__now() - t0;
    if (st) return moept__fail(L, st, "chunked exchange: %s", ep->err);
    return MOEPT_OK;
}
static moept_status moept__complete(moept_layer *L, int slot) {
    double t0 = moept__now();
    moept_comm *ep = L->ep;
    moept_status st = ep->ialltoallv && ep->wait ? ep->wait(ep, slot) : MOEPT_OK;
    L->stats.comm_seconds += moept__now() - t0;
    if (st) return moept__fail(L, st, "chunked exchange: %s", ep->err);
    return MOEPT_OK;
}


/* The chunk pipeline of both passes: chunk c+1's rows travel out (send ->
   recv) while the experts compute chunk c (`compute`), chunk c's results
   travel back (res -> ret) while the next chunk computes; `done(c)` runs
   once chunk c is back, `tail` before the last chunk's return is awaited.
   Slots: 0/1 out, 2/3 back, alternating. */
typedef struct moept__pipe {
    const float *send; float *recv;   /* out: token side -> expert side */
    int rec;                          /* ... config.fp8's records (moept__q8_recs: xs -> xq) */
    const float *res; float *ret;     /* back: expert side -> token side */
    void (*compute)(moept_layer *L, moept__fstate *sl, const moept__runs *R);
    void (*done)(moept_layer *L, moept__fstate *sl, const struct moept__pipe *p, int64_t c);
    void (*tail)(moept_layer *L, moept__fstate *sl);
    void (*start)(moept_layer *L, moept__fstate *sl, const struct moept__pipe *p); /* chunk 0 in flight */
    const float *x;
    float *y;
    const float *wts;
    const int32_t *ids; /* forward: the shared expert's, the combine's */
} moept__pipe;

/* a chunk's rows out (p->rec: its records, the pieces rescaled until that exchange completes) */
static moept_status moept__post_out(moept_layer *L, const struct moept__pipe *p, moept_seg *ss, moept_seg *rs,
                                    int slot) {
    if (p->rec) moept__rec_pieces(L, ss, rs, 1);
    return moept__post(L, p->send, ss, p->recv, rs, slot);
}

static moept_status moept__pipeline(moept_layer *L, moept__fstate *sl, const moept__pipe *p) {
    const int64_t C = L->C, PE = L->P * L->El;
    moept_status st;
    if (L->ep) {
        moept__chunk_plan(L, sl, 0, sl->ch.csend, sl->ch.crecv, sl->ch.cruns);
        if ((st = moept__post_out(L, p, sl->ch.csend, sl->ch.crecv, 0))) return st;
        moept__count_bytes(L, 1, p->rec);
    }
    if (p->start) p->start(L, sl, p);
    for (int64_t c = 0; c < C; c++) {
        moept_seg *ss = sl->ch.csend + c * PE, *rs = sl->ch.crecv + c * PE;
        if (L->ep && c + 1 < C) {
            moept_seg *s2 = sl->ch.csend + (c + 1) * PE, *r2 = sl->ch.crecv + (c + 1) * PE;
            moept__chunk_plan(L, sl, c + 1, s2, r2, sl->ch.cruns);
            if ((st = moept__post_out(L, p, s2, r2, (int)((c + 1) % 2)))) return st;
        }
        int64_t nruns = moept__chunk_plan(L, sl, c, NULL, NULL, sl->ch.cruns);
        if (L->ep && (st = moept__complete(L, (int)(c % 2)))) return st;
        if (L->ep && p->rec) moept__rec_pieces(L, ss, rs, 0); /* (the results return in rows of D) */
        const moept__runs R = moept__runs_chunk(sl->ch.cruns, nruns, PE);
        p->compute(L, sl, &R);
        if (L->ep && (st = moept__post(L, p->res, rs, p->ret, ss, 2 + (int)(c % 2)))) return st;
        if (c > 0) {
            if (L->ep && (st = moept__complete(L, 2 + (int)((c - 1) % 2)))) return st;
            if (p->done) p->done(L, sl, p, c - 1);
        }
    }
    if (p->tail) p->tail(L, sl);
    if (L->ep && (st = moept__complete(L, 2 + (int)((C - 1) % 2)))) return st;
    if (L->ep) moept__count_bytes(L, 0, 0);
    if (p->done) p->done(L, sl, p, C - 1);
    return MOEPT_OK;
}

/* forward: the shared expert, while chunk 0 travels */
static void moept__chunk_shared(moept_layer *L, moept__fstate *sl, const moept__pipe *p) {
    moept__shared_forward(L, sl, p->x, sl->fwd.T);
}

/* forward: chunk c's tokens combined once its rows are back */
static void moept__chunk_combine(moept_layer *L, moept__fstate *sl, const moept__pipe *p, int64_t c) {
    moept__combine_range(L, sl, p->y, p->wts, p->ids, moept__chunk_start(sl->fwd.T, L->C, c),
                         moept__chunk_start(sl->fwd.T, L->C, c + 1));
}

/* The forward from the permute on, chunked. */
static moept_status moept__forward_chunked(moept_layer *L, moept__fstate *sl, const float *x, float *y,
                                           const float *wts,
                                           const int32_t *ids) {
    double ts = moept__now();
    moept__gather_rows(L, sl, x);
    const int rec = moept__q8_recs(L);
    moept__pipe p = {sl->ws.xs,
                     rec ? (float *)sl->ws.xq : sl->ws.xr,
                     rec,
                     sl->ws.yr,
                     sl->ws.ys,
                     moept__chunk_forward,
                     moept__chunk_combine,
                     NULL,
                     moept__chunk_shared,
                     x,
                     y,
                     wts,
                     ids};
    moept_status st = moept__pipeline(L, sl, &p);
    L->stats.dispatch_seconds += moept__now() - ts;
    return st;
}

/* backward: the weight gradients reduce over every row, as the one-chunk
   step, while the last chunk's dxs travel */
static void moept__chunk_weight_grads(moept_layer *L, moept__fstate *sl) {
    const moept__ffn f = moept__ffn_routed(L, sl);
    const moept__runs R = moept__runs_groups(sl->xch.roffsets, L->El);
    moept__ffn_wgrad(L, &f, &R, 1);
    moept__ffn_wgrad(L, &f, &R, 0);
}

/* The backward's experts part, chunked (after combine' wrote dys; config.fp8 under EP: their records) */
static moept_status moept__backward_chunked(moept_layer *L, moept__fstate *sl) {
    const int rec = moept__q8_recs(L);
    moept__pipe p = {rec ? sl->ws.xs : sl->ws.dys,
                     rec ? (float *)sl->ws.xq : sl->ws.dyr,
                     rec,
                     sl->ch.dx,
                     sl->ws.dxs,
                     moept__chunk_backward,
                     NULL,
                     moept__chunk_weight_grads,
                     NULL,
                     NULL,
                     NULL,
                     NULL,
                     NULL};
    return moept__pipeline(L, sl, &p);
}

/* ------------------------------------------------------------------------
   Checks (finite outputs, agreed) and the router's jitter
   ------------------------------------------------------------------------ */
/* One pass over x [n] (blocks in parallel, each read once while in cache):
   the first non-finite element (-1 if none) and a fingerprint of every
   element, the block hashes combined by XOR after mixing in each block's
   index (any order, same result). Backward compares the fingerprint with
   the forward's: another x, or x changed in between (y written over it
   included), is refused. */
static int64_t moept__x_scan(const float *x, int64_t n, uint64_t *fp) {
    const int64_t B = 1 << 16, nb = (n + B - 1) / B;
    uint64_t h = (uint64_t)n * 0x9e3779b97f4a7c15ull;
    int64_t bad = n;
    #pragma omp parallel for schedule(static) reduction(^ : h) reduction(min : bad) MOEPT__PAR(n)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t len = b + 1 < nb ? B : n - b * B, i = moept__first_nonfinite(x + b * B, len);
        uint64_t v = moept__checksum(x + b * B, len) + (uint64_t)b * 0xff51afd7ed558ccdull;
        v ^= v >> 33;
        h ^= v * 0xc4ceb9fe1a85ec53ull;
        if (i >= 0 && b * B + i < bad) bad = b * B + i;
    }
    *fp = h;
    return bad < n ? bad : -1;
}

/* The first non-finite element of v [T][D] in a row that is not padding
   (mask[t] 0, or with no mask its ids -1: such rows are not read), -1 if
   none; run after a whole scan found one (the rare path) */
static int64_t moept__unpadded_bad(const float *v, int64_t T, int64_t D, const uint8_t *mask,
                                   const int32_t *ids, int64_t K) {
    for (int64_t t = 0; t < T; t++) {
        const int read = mask ? mask[t] != 0 : !ids || ids[t * K] >= 0;
        const int64_t i = read ? moept__first_nonfinite(v + t * D, D) : -1;
        if (i >= 0) return t * D + i;
    }
    return -1;
}

/* A call's output out [T][D] (or a loss, found by the caller: `local`)
   non-finite from finite inputs: the call fails on every rank of the EP
   group and dp, each with `after` said (what the caller must do next). */
static moept_status moept__agree_finite(moept_layer *L, moept__fstate *sl, const char *call,
                                        const char *out, const float *v,
                                        moept_status local, moept_comm *dp, const char *after) {
    int64_t bad = local ? -1 : moept__first_nonfinite(v, sl->fwd.T * L->D), failed;
    moept_status st;
    if (bad >= 0)
        local = moept__fail(L, MOEPT_ERR_NUMERIC,
                            "%s: %s[%lld][%lld] is not finite from finite inputs (an "
                            "overflow?); %s",
                            call, out, (long long)(bad / L->D), (long long)(bad % L->D), after);
    failed = moept__any_failed(L->group, dp, local != MOEPT_OK, &st);
    if (st)
        return moept__fail(L, st, "%s: output agreement failed: %s", call,
                           L->group ? L->group->err : dp->err);
    if (failed && !local)
        local = moept__fail(L, MOEPT_ERR_NUMERIC, "%s: %lld other rank(s) had a non-finite %s or loss; %s",
                            call, (long long)failed, out, after);
    return local;
}

static int moept__finite_d(double v) { return v == v && fabs(v) <= 3.4028234663852886e38; } /* as a float */

/* The first non-finite element of buffer `which` (moept__io's) in [off,
   off + n) into *at (-1: none) and its value into *v, read in chunks where
   an executor keeps the buffers */
static moept_status moept__first_bad(const moept_layer *L, int which, int64_t off, int64_t n, int64_t *at,
                                     float *v) {
    *at = -1;
    if (!L->ex->io) {
        const float *b = moept__host_of(L, which);
        if (b && (*at = moept__first_nonfinite(b + off, n)) >= 0) *v = b[off + *at];
        return MOEPT_OK;
    }
    enum { CHUNK = 1 << 20 }; /* 4 MiB a copy: few host syncs, a bounded host share */
    const int64_t cap = n < CHUNK ? n : CHUNK;
    float *buf = moept__alloc(NULL, (size_t)(cap > 0 ? cap : 1) * sizeof(float));
    moept_status st = buf ? MOEPT_OK : moept__fail(L, MOEPT_ERR_OUT_OF_MEMORY, "out of memory (a scan)");
    for (int64_t j = 0; !st && j < n && *at < 0; j += cap) {
        const int64_t m = n - j < cap ? n - j : cap;
        st = moept__io(L, which, off + j, m, buf, 0);
        const int64_t i = st ? -1 : moept__first_nonfinite(buf, m);
        if (i >= 0) {
            *at = j + i;
            *v = buf[i];
        }
    }
    MOEPT_FREE(buf);
    return st;
}

/* A non-finite parameter, named (which tensor, which element) into why [n],
   so a call whose output is not finite blames its cause, not an overflow;
   0 if every parameter is finite (a scan on the failure path) */
static int moept__params_bad(const moept_layer *L, char *why, size_t n) {
    for (int64_t t = 0; t < L->par.n_table; t++) {
        const moept__param *p = &L->par.table[t];
        int64_t i = -1;
        float v = 0;
        if (p->type == MOEPT__P_BIAS) {
            if ((i = moept__first_nonfinite(p->data, p->cols)) >= 0) v = p->data[i];
        } else if (p->off >= 0 && moept__first_bad(L, MOEPT_BUF_PARAMS, p->off, p->rows * p->cols, &i, &v)) {
            return 0; /* (unread: the executor's report stands) */
        }
        if (i >= 0) {
            snprintf(why, n, "parameter '%s' element [%lld][%lld] is %g (set through moept_params, "
                     "moept_set_param or a load?): every parameter must be finite", p->name,
                     (long long)(i / p->cols), (long long)(i % p->cols), (double)v);
            return 1;
        }
    }
    return 0;
}

/* An executor's report of a non-finite output, logit or loss (an
   overflow?) replaced by its cause where a parameter is not finite: which
   one, which element (the failure path: the host's view of the parameters
   read); an input's own report (x, dy, dlogits) kept */
static moept_status moept__numeric_cause(moept_layer *L, moept_status st, const char *call) {
    char was[MOEPT__ERRLEN], why[MOEPT__ERRLEN - 96];
    if (st != MOEPT_ERR_NUMERIC ||
        !(strstr(moept__thread_err, "from finite inputs") || strstr(moept__thread_err, "router logits")))
        return st;
    memcpy(was, moept__thread_err, sizeof was);
    if (moept__params_bad(L, why, sizeof why))
        return moept__fail(L, st, "%s: %s; the step is rejected, run forward again", call, why);
    memcpy(moept__thread_err, was, sizeof was);
    return st;
}
/* Finite inputs can still give a non-finite output or loss (an overflow in
   the experts or the shared expert): the step fails on every rank of the
   groups it spans. The experts' saved activations are this step's by now,
   so the forward state is dropped (backward and update_bias are refused
   until the next forward). */
static moept_status moept__forward_finite(moept_layer *L, moept__fstate *sl, const float *y, double aux,
                                          double z, int global) {
    static const char *after = "the step is rejected, run forward again";
    moept_status local = MOEPT_OK; /* losses count only where they are part of the objective */
    int zbad = L->cfg.z_loss_coef > 0.0f && !moept__finite_d(z);
    if (zbad || (L->cfg.aux_loss_coef > 0.0f && !moept__finite_d(aux)))
        local = moept__fail(L, MOEPT_ERR_NUMERIC,
                            "moept_forward: the %s loss is not finite from finite inputs; "
                            "%s",
                            zbad ? "z" : "aux", after);
    local = moept__agree_finite(L, sl, "moept_forward", "y", y, local, global ? L->dp : NULL, after);
    if (local) sl->fwd.valid = 0;
    return local;
}

/* ---- forward, stage by stage: checks -> route -> counts (exchanged) ->
   growth agreed -> commit -> losses -> plan -> dispatch -> experts ->
   combine. Until the commit a failure leaves the layer as it was. */


/* Router jitter: its noise (moept__jitter_u) and the rows' hashes are moept.h's, shared with the GPU */
/* The noise key of the next training forward: AdamW steps (checkpointed)
   and forwards since the last one, so a resumed run draws what it drew. */
uint64_t moept__jitter_key(const moept_layer *L) {
    return ((uint64_t)L->opt.t << 20) ^ (uint64_t)L->jitter_micro;
}
/* out [T][D] = x * u (mul) or out * u, the router's input under jitter or
   its gradient; rows [T] the tokens' hashes (hash: computed here from x) */
static void moept__jitter_apply(const moept_layer *L, uint64_t key, const float *x, int64_t T, float *out,
                                uint64_t *rows, int hash) {
    const int64_t D = L->D;
    const float eps = L->cfg.router_jitter;
    const uint64_t seed = L->cfg.jitter_seed;
    #pragma omp parallel for schedule(static) MOEPT__PAR(T * D)
    for (int64_t t = 0; t < T; t++) {
        if (hash) rows[t] = moept__jitter_row(x + t * D, D);
        for (int64_t d = 0; d < D; d++)
            out[t * D + d] =
                (x ? x[t * D + d] : out[t * D + d]) * moept__jitter_u(seed, key, rows[t], d, eps);
    }
}

/* ------------------------------------------------------------------------
   Forward: its stages (the stage map in docs/DESIGN.md)
   ------------------------------------------------------------------------ */
/* 1. this rank's argument checks and x's scan (finite; its fingerprint) */
static moept_status moept__fwd_checks(moept_layer *L, moept__fstep *f) {
    const int64_t T = f->T, D = L->D;
    if (T < 0 || T > L->Tmax)
        return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT,
                           "moept_forward: tokens %lld not in 0..max_tokens (%lld)", (long long)T,
                           (long long)L->Tmax);
    if (T > 0 && (!f->x || !f->y))
        return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_forward: %s is NULL", f->x ? "y" : "x");
    if (L->cfg.aux_loss == MOEPT_AUX_SEQ && T % L->cfg.aux_seq_len != 0)
        return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT,
                           "moept_forward: tokens %lld is not a multiple of config.aux_seq_len (%lld)",
                           (long long)T, (long long)L->cfg.aux_seq_len);
    int64_t bad = moept__x_scan(f->x, T * D, &f->x_fp);
    if (bad >= 0) bad = moept__unpadded_bad(f->x, T, D, f->mask, NULL, L->K);
    if (bad >= 0)
        return moept__fail(L, MOEPT_ERR_NUMERIC, "moept_forward: x[%lld][%lld] is not finite",
                           (long long)(bad / D), (long long)(bad % D));
    for (int64_t t = 0; f->replay && t < T; t++) { /* a padded token's row is not read */
        int code = f->mask && !f->mask[t] ? -1
                   : moept__replay_bad(f->replay + t * L->K, (int)L->E, (int)L->K);
        if (code >= 0)
            return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, MOEPT__REPLAY_FMT, (long long)t,
                               (long long)(code / 2), MOEPT__REPLAY_WHY(code));
    }
    return MOEPT_OK;
}

/* The router gradient's input where a token is padded (its ids -1): xin
   with the padded rows zero in out [T][D] (out may be xin), so nothing a
   padded row holds (a NaN too) reaches the gradient (a padded row's
   logits, which moept_routing reports as transformers' router computes
   them, are its own); xin itself where no token is padded */
static const float *moept__router_in(const float *xin, int64_t T, int64_t D, const int32_t *ids, int64_t K,
                                     float *out) {
    int64_t t = 0;
    while (t < T && ids[t * K] >= 0) t++;
    if (t == T) return xin;
    #pragma omp parallel for schedule(static) MOEPT__PAR(T * D)
    for (int64_t r = 0; r < T; r++) {
        if (ids[r * K] >= 0) {
            if (out != xin) memcpy(out + r * D, xin + r * D, (size_t)D * sizeof(float));
        } else {
            memset(out + r * D, 0, (size_t)D * sizeof(float));
        }
    }
    return out;
}

/* 2. route into the spare buffers: the fp32 router on x (times the jitter
   noise in a training forward), then each token's top-k (or the experts
   opts.replay_ids gives it); a masked token is routed nowhere (ids -1,
   weights 0) */
static moept_status moept__fwd_route(moept_layer *L, moept__fstate *sl, moept__fstep *f) {
    const int64_t T = f->T, D = L->D, E = L->E, K = L->K;
    const int fam = (int)L->cfg.family, nb = f->nb;
    float *logits = sl->fwd.logits[nb], *probs = sl->fwd.probs[nb], *wts = sl->fwd.wts[nb];
    int32_t *ids = sl->fwd.ids[nb];
    const float *xin = f->x;
    if (f->jitter) { /* (frozen, for tests: the committed step's noise again) */
        if (L->jitter_frozen)
            memcpy(sl->fwd.jrow[nb], sl->fwd.jrow[sl->fwd.cur], (size_t)T * sizeof(uint64_t));
        if (L->jitter_frozen) f->jkey = sl->fwd.jkey;
        moept__jitter_apply(L, f->jkey, f->x, T, sl->fwd.xj, sl->fwd.jrow[nb], !L->jitter_frozen);
        xin = sl->fwd.xj;
    }
    moept__gemm g = moept__gemm_make(0, 1, T, E, D, xin, D, L->par.w_router, D, 0.0f, logits, E);
    moept__gemm_run(&g, 1, &L->ws.gws);
    int64_t first_bad = T, valid = 0;
    const float *bias = fam == MOEPT_FAMILY_DEEPSEEK_V3 ? L->par.bias : NULL;
    const int norm = L->cfg.norm_topk_prob, ng = (int)L->cfg.n_group, tg = (int)L->cfg.topk_group;
    const int gfill = (int)L->cfg.group_fill;
    const float scale = L->cfg.routed_scaling_factor;
    const uint8_t *mask = f->mask;
    #pragma omp parallel for schedule(static) reduction(min : first_bad) reduction(+ : valid) \
        MOEPT__PAR_MAX(T * E * K, L->nthreads)
    for (int64_t t = 0; t < T; t++) {
        float *scratch = L->plan.choice + (int64_t)MOEPT__TID * 2 * E;
        float *lo = f->logits_out ? f->logits_out + t * E : NULL; /* padded rows: 0 */
        for (int64_t e = 0; lo && e < E; e++) lo[e] = mask && !mask[t] ? 0.0f : logits[t * E + e];
        if (mask && !mask[t]) {
            for (int64_t k = 0; k < K; k++) { ids[t * K + k] = -1; wts[t * K + k] = 0.0f; }
            continue;
        }
        valid++;
        if (f->replay ? moept__replay_token(fam, logits + t * E, f->replay + t * K, (int)E, (int)K, norm,
                                            scale, probs + t * E, ids + t * K, wts + t * K) != 0
                      : moept__route_token(fam, logits + t * E, bias, (int)E, (int)K, norm, ng, tg, gfill,
                                           scale, probs + t * E, scratch, ids + t * K, wts + t * K) != 0)
            first_bad = t < first_bad ? t : first_bad;
    }
    f->valid = valid;
    if (first_bad < T)
        return moept__fail(L, MOEPT_ERR_NUMERIC, "moept_forward: router logits of token %lld are not finite "
                           "(overflow in x . gate.weight^T?)", (long long)first_bad);
    return MOEPT_OK;
}

/* 3. the pending step's kept rows per chunk and slot, in one pass over the
   assignments (capacity keeps each slot's earliest): counts_next [E], and
   chunked ccnt_next [C][E] */
static void moept__fwd_count(moept_layer *L, moept__fstate *sl, const moept__fstep *f) {
    const int64_t E = L->E, K = L->K, C = L->C, T = f->T, cap = f->cap;
    const int32_t *ids = sl->fwd.ids[f->nb];
    int64_t *cc = C > 1 ? sl->ch.ccnt_next : sl->plan.counts_next; /* [C][E] */
    for (int64_t i = 0; i < C * E; i++) cc[i] = 0;
    for (int64_t c = 0; c < C; c++)
        for (int64_t i = moept__chunk_start(T, C, c) * K; i < moept__chunk_start(T, C, c + 1) * K; i++)
            if (ids[i] >= 0) cc[c * E + L->plan.slot_of[ids[i]]]++;
    for (int64_t e = 0; e < E; e++) {
        int64_t before = 0, kept = 0;
        for (int64_t c = 0; c < C; c++) {
            int64_t sel = cc[c * E + e], room = cap < 0 ? sel : cap - before > 0 ? cap - before : 0;
            cc[c * E + e] = sel < room ? sel : room;
            kept += cc[c * E + e];
            before += sel;
        }
        sl->plan.counts_next[e] = kept;
    }
}

/* 4, direct: every rank's counts to every rank (allcnt_next), so each
   knows where its rows go in the experts' shared rows and how many rows
   every rank's experts get */
static moept_status moept__fwd_gather_counts(moept_layer *L, moept__fstate *sl, moept__fstep *f) {
    const int64_t E = L->E, El = L->El, P = L->P;
    double t0 = moept__now();
    moept_status st =
        L->ep->allgather(L->ep, sl->plan.counts_next, sl->xch.allcnt_next, E * (int64_t)sizeof(int64_t));
    L->stats.comm_seconds += moept__now() - t0;
    if (st) return moept__fail(L, st, "moept_forward: count all-gather failed: %s", L->ep->err);
    int64_t R = 0;
    for (int64_t p = 0; p < P; p++)
        for (int64_t j = 0; j < El; j++)
            R += sl->xch.rcounts_next[p * El + j] = sl->xch.allcnt_next[p * E + L->rank * El + j];
    f->R_next = R;
    return MOEPT_OK;
}

/* the most rows any rank's experts get next step (direct) */
static int64_t moept__max_recv(const moept_layer *L, moept__fstate *sl) {
    int64_t most = 0;
    for (int64_t q = 0; q < L->P; q++) {
        int64_t n = 0;
        for (int64_t p = 0; p < L->P; p++)
            for (int64_t s = q * L->El; s < (q + 1) * L->El; s++) n += sl->xch.allcnt_next[p * L->E + s];
        most = n > most ? n : most;
    }
    return most;
}

/* 4. counts before data, always: no rank trusts sizes it computed alone.
   rcounts_next [P][El] (chunked: rccnt_next [P][C][El]) and R_next, the
   rows this rank's experts will receive. */
static moept_status moept__fwd_exchange_counts(moept_layer *L, moept__fstate *sl, moept__fstep *f) {
    const int64_t E = L->E, El = L->El, C = L->C, P = L->P;
    int64_t R = 0;
    if (!L->ep) {
        if (C > 1) memcpy(sl->ch.rccnt_next, sl->ch.ccnt_next, (size_t)(C * E) * sizeof(int64_t));
        for (int64_t e = 0; e < E; e++) R += sl->plan.counts_next[e];
        f->R_next = R;
        return MOEPT_OK;
    }
    if (L->xch.direct) return moept__fwd_gather_counts(L, sl, f);
    moept_seg *cs = L->xch.count_segs, *cr = L->xch.count_segs + P;
    const int64_t per = C * El; /* chunked: every chunk's counts, [c][j] per peer */
    for (int64_t q = 0; q < P; q++) cs[q] = cr[q] = (moept_seg){q * per, per};
    if (C > 1)
        for (int64_t q = 0; q < P; q++)
            for (int64_t c = 0; c < C; c++)
                for (int64_t j = 0; j < El; j++)
                    sl->ch.cmsg[(q * C + c) * El + j] = sl->ch.ccnt_next[c * E + q * El + j];
    double t0 = moept__now();
    moept_status st = L->ep->alltoallv(L->ep, C > 1 ? sl->ch.cmsg : sl->plan.counts_next, cs,
                                       C > 1 ? sl->ch.rccnt_next : sl->xch.rcounts_next, cr, 1, 8);
    L->stats.comm_seconds += moept__now() - t0;
    if (st) return moept__fail(L, st, "moept_forward: count exchange failed: %s", L->ep->err);
    if (C > 1)
        for (int64_t p = 0; p < P; p++)
            for (int64_t j = 0; j < El; j++) {
                int64_t n = 0;
                for (int64_t c = 0; c < C; c++) n += sl->ch.rccnt_next[(p * C + c) * El + j];
                sl->xch.rcounts_next[p * El + j] = n;
            }
    for (int64_t i = 0; i < P * El; i++) R += sl->xch.rcounts_next[i];
    f->R_next = R;
    return MOEPT_OK;
}

/* 5. room to receive, then agreement on it: every rank commits, or none */
static moept_status moept__fwd_agree_growth(moept_layer *L, moept__fstate *sl, const moept__fstep *f) {
    moept_status local = MOEPT_OK, st;
    moept_comm *grp = L->group, *dp = f->global ? L->dp : NULL;
    int64_t most = L->xch.direct ? moept__max_recv(L, sl) : 0;
    if (L->xch.direct && (st = moept__grow_shared(L, sl, most))) /* all grow, or none */
        local = moept__fail(L, st, "moept_forward: cannot grow the shared rows to %lld: %s", (long long)most,
                            L->ep->err);
    else if (!moept__grow_recv(L, sl, f->R_next))
        local = moept__fail(L, MOEPT_ERR_OUT_OF_MEMORY,
                            "moept_forward: cannot grow the receive buffers to %lld "
                            "rows",
                            (long long)f->R_next);
    if (grp || dp) {
        int64_t failed = moept__any_failed(grp, dp, local != MOEPT_OK, &st);
        if (st)
            return moept__fail(L, st, "moept_forward: failure agreement failed: %s",
                               grp ? grp->err : dp->err);
        if (failed && !local)
            return moept__fail(L, MOEPT_ERR_STATE,
                               "moept_forward: %lld other rank(s) rejected the step; nothing "
                               "changed",
                               (long long)failed);
    }
    return local;
}

/* 6. commit: from here on every rank proceeds */
static void moept__fwd_commit(moept_layer *L, moept__fstate *sl, const moept__fstep *f) {
    sl->fwd.cur = f->nb;
    sl->fwd.T = f->T;
    sl->fwd.x_fp = f->x_fp;
    sl->fwd.valid = 1;
    sl->fwd.bwd_valid = 0;
    sl->fwd.stale = NULL;
    sl->fwd.eval = f->eval;
    sl->fwd.jitter = f->jitter;
    sl->fwd.jkey = f->jkey;
    L->jitter_micro += f->jitter;
    { int64_t *t = sl->plan.counts; sl->plan.counts = sl->plan.counts_next; sl->plan.counts_next = t; }
    { int64_t *t = sl->xch.rcounts; sl->xch.rcounts = sl->xch.rcounts_next; sl->xch.rcounts_next = t; }
    { int64_t *t = sl->xch.allcnt; sl->xch.allcnt = sl->xch.allcnt_next; sl->xch.allcnt_next = t; }
    { int64_t *t = sl->ch.ccnt; sl->ch.ccnt = sl->ch.ccnt_next; sl->ch.ccnt_next = t; }
    { int64_t *t = sl->ch.rccnt; sl->ch.rccnt = sl->ch.rccnt_next; sl->ch.rccnt_next = t; }
    sl->xch.R = f->R_next;
    L->stats.bytes_sent = L->stats.bytes_received = 0;
    L->stats.comm_seconds = L->stats.dispatch_seconds = L->stats.combine_seconds = 0.0;
    if (L->fsdp) { /* the gather before the commit belongs to this step */
        int64_t b = (L->fsdp->size - 1) * L->fs.shard * (int64_t)sizeof(float);
        L->stats.bytes_sent = L->stats.bytes_received = b;
        L->stats.comm_seconds = L->fs.gather_seconds;
    }
}

/* One sequence's aux loss (MOEPT_AUX_SEQ) from its statistics in
   seqstat: its value goes to lstat's sum, its gradient (before the 1/nseq
   of the mean) to aux_g row sq; an all-padding sequence counts for nothing.
   seqstat is cleared for the next one. */
static void moept__seq_close(moept_layer *L, moept__fstate *sl, int64_t sq) {
    const int64_t E = L->E;
    double *c = L->plan.seqstat, *ps = c + E, n = c[2 * E];
    float *g = sl->fwd.aux_g + sq * E;
    if (n > 0.0) {
        sl->fwd.lstat[sl->fwd.ls.seqaux] +=
            moept__aux_finalize(c, ps, E, L->K, MOEPT_AUX_SEQ, n, L->cfg.aux_loss_coef, g);
        sl->fwd.lstat[sl->fwd.ls.nseq] += 1.0;
    } else {
        for (int64_t e = 0; e < E; e++) g[e] = 0.0f;
    }
    for (int64_t i = 0; i < 2 * E + 1; i++) c[i] = 0.0;
}

/* One unmasked token's part of the loss statistics: its lse (z loss), its
   selections, and its aux scores and counts (also into the sequence's) */
static void moept__loss_token(moept_layer *L, moept__fstate *sl, int64_t t, double *sel, double *auxc,
                              double *psum) {
    const int64_t E = L->E, K = L->K;
    const int aux = (int)L->cfg.aux_loss;
    const float *lg = sl->fwd.logits[sl->fwd.cur] + t * E;
    const int32_t *ids = sl->fwd.ids[sl->fwd.cur] + t * K;
    sl->fwd.lse[t] = moept__lse(lg, E);
    sl->fwd.lstat[sl->fwd.ls.lse2] += (double)sl->fwd.lse[t] * sl->fwd.lse[t];
    for (int64_t k = 0; k < K; k++) sel[ids[k]] += 1.0;
    if (aux == MOEPT_AUX_NONE) return;
    float *score = L->plan.choice;
    int32_t *cid = L->plan.kscratch;
    moept__aux_token((int)L->cfg.family, aux, lg, sl->fwd.probs[sl->fwd.cur] + t * E, ids, (int)E, (int)K,
                     score, cid);
    for (int64_t e = 0; e < E; e++) psum[e] += score[e];
    for (int64_t k = 0; k < K; k++) auxc[cid[k]] += 1.0;
    if (aux != MOEPT_AUX_SEQ) return;
    double *sc = L->plan.seqstat;
    for (int64_t e = 0; e < E; e++) sc[E + e] += score[e];
    for (int64_t k = 0; k < K; k++) sc[cid[k]] += 1.0;
    sc[2 * E] += 1.0;
}

/* 7. losses: counts, score sums and the sum of lse^2 over the unmasked
   tokens in token order (double), and each sequence's aux loss
   (MOEPT_AUX_SEQ), summed over the groups when global; returns the aux
   value through *aux_v */
static moept_status moept__fwd_losses(moept_layer *L, moept__fstate *sl, const moept__fstep *f,
                                      double *aux_v) {
    const int64_t T = f->T, E = L->E, K = L->K;
    const int aux = (int)L->cfg.aux_loss, seq = aux == MOEPT_AUX_SEQ;
    const int64_t slen = seq ? L->cfg.aux_seq_len : 0; /* tokens per sequence */
    const int32_t *ids = sl->fwd.ids[sl->fwd.cur];
    double *sel = sl->fwd.lstat + sl->fwd.ls.sel, *auxc = sl->fwd.lstat + sl->fwd.ls.auxc,
           *psum = sl->fwd.lstat + sl->fwd.ls.psum;
    for (int64_t i = 0; i < sl->fwd.ls.n; i++) sl->fwd.lstat[i] = 0.0;
    for (int64_t i = 0; i < 2 * E + 1; i++) L->plan.seqstat[i] = 0.0;
    for (int64_t t = 0; t < T; t++) {
        sl->fwd.lse[t] = 0.0f;
        if (ids[t * K] >= 0) moept__loss_token(L, sl, t, sel, auxc, psum); /* else padding */
        if (seq && (t + 1) % slen == 0) moept__seq_close(L, sl, t / slen);
    }
    sl->fwd.lstat[sl->fwd.ls.T] = (double)f->valid;
    if (f->global) { /* the whole batch's statistics (a failure here is a broken comm) */
        moept_status st = moept__world_sum(L, sl->fwd.lstat, sl->fwd.ls.n, MOEPT_DTYPE_F64);
        if (st) return st;
    }
    for (int64_t e = 0; e < E; e++) {
        sl->fwd.sel_counts[e] = (int64_t)sel[e];
        sl->fwd.aux_counts[e] = (int64_t)auxc[e];
    }
    sl->fwd.counts_global = f->global || (!L->group && !L->dp);
    sl->fwd.loss_T = sl->fwd.lstat[sl->fwd.ls.T] > 0 ? sl->fwd.lstat[sl->fwd.ls.T] : 1.0;
    if (!seq) {
        *aux_v =
            moept__aux_finalize(auxc, psum, E, K, aux, sl->fwd.loss_T, L->cfg.aux_loss_coef, sl->fwd.aux_g);
        return MOEPT_OK;
    }
    /* the mean over sequences: each row's gradient times 1/nseq */
    double nseq = sl->fwd.lstat[sl->fwd.ls.nseq];
    *aux_v = nseq > 0.0 ? sl->fwd.lstat[sl->fwd.ls.seqaux] / nseq : 0.0;
    const float inv = nseq > 0.0 ? (float)(1.0 / nseq) : 0.0f;
    for (int64_t i = 0; i < T / slen * E; i++) sl->fwd.aux_g[i] *= inv;
    return MOEPT_OK;
}

/* 8. plan: a stable counting sort of the T*K assignments by slot (the
   expert's place in the placement); slot order is destination-rank order,
   so xs is the send buffer. Then where the received rows go: expert-major,
   then by source rank, and the exchange's pieces. */
static void moept__fwd_plan(moept_layer *L, moept__fstate *sl) {
    const int64_t T = sl->fwd.T, D = L->D, E = L->E, K = L->K, El = L->El, P = L->P;
    const int32_t *ids = sl->fwd.ids[sl->fwd.cur];
    sl->plan.offsets[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        sl->plan.offsets[e + 1] = sl->plan.offsets[e] + sl->plan.counts[e];
        L->plan.fill[e] = 0;
    }
    sl->plan.N = sl->plan.offsets[E];
    for (int64_t i = 0; i < T * K; i++) {
        if (ids[i] < 0) { sl->plan.row_of[i] = -1; continue; } /* padding */
        int64_t e = L->plan.slot_of[ids[i]];
        moept__plan_place(i, L->plan.fill[e]++, sl->plan.counts[e], sl->plan.offsets[e], K, sl->plan.row_of,
                          sl->plan.tok_of_row);
    }
    moept__plan_roffsets(P, El, L->ep ? sl->xch.rcounts : sl->plan.counts,
                         sl->xch.roffsets); /* one rank: P = 1 */
    if (!L->ep) return;
    moept__plan_segs(P, El, D, sl->plan.offsets, sl->plan.counts, sl->xch.rcounts, sl->xch.roffsets,
                     sl->xch.send_segs, sl->xch.recv_segs);
    moept__plan_peer_rows(P, El, L->rank, sl->plan.counts, sl->xch.rcounts, El, sl->xch.peer_rows,
                          &L->stats.rows_sent, &L->stats.rows_received);
    if (L->xch.direct) moept__direct_plan(L, sl);
}

/* 9. dispatch: each kept row to its expert (direct: written straight into
   the experts' shared rows; a backend with alltoallv_rows sends from x by
   index; else permuted into xs, then exchanged) */
static moept_status moept__fwd_dispatch(moept_layer *L, moept__fstate *sl, const float *x) {
    if (L->xch.direct) { /* our rows into the experts' rows; all have arrived after the barrier */
        moept__direct_push(L, sl, x);
        moept__count_bytes(L, 1, 0);
        return moept__direct_sync(L, "moept_forward");
    }
    if (moept__rows_dispatch(L)) return moept__exchange_rows(L, sl, x);
    moept__gather_rows(L, sl, x);
    if (moept__q8_recs(L)) return moept__exchange_records(L, sl, sl->ws.xr);
    return L->ep ? moept__exchange(L, sl, sl->ws.xs, sl->ws.xr, 1) : MOEPT_OK;
}

/* 10. the experts' rows back (direct: read where they lie), the shared
   expert, and the combine: each output row written once */
static moept_status moept__fwd_combine(moept_layer *L, moept__fstate *sl, const float *x, float *y) {
    moept_status st;
    double ts = moept__now();
    if (L->xch.direct) {
        if ((st = moept__direct_sync(L, "moept_forward"))) return st;
        moept__count_bytes(L, 0, 0);
    } else if (L->ep && (st = moept__exchange(L, sl, sl->ws.ys, sl->ws.yr, 0))) return st;
    L->stats.combine_seconds += moept__now() - ts;
    moept__shared_forward(L, sl, x, sl->fwd.T);
    ts = moept__now();
    moept__combine_range(L, sl, y, sl->fwd.wts[sl->fwd.cur], sl->fwd.ids[sl->fwd.cur], 0, sl->fwd.T);
    L->stats.combine_seconds += moept__now() - ts;
    return MOEPT_OK;
}

/* dispatch -> experts -> combine (chunked: as a pipeline); direct: no rank
   may leave (and free or regrow its rows) while a peer still reads them */
static moept_status moept__fwd_run(moept_layer *L, moept__fstate *sl, const moept__fstep *f) {
    moept_status st;
    if (L->C > 1) {
        if ((st = moept__forward_chunked(L, sl, f->x, f->y, sl->fwd.wts[sl->fwd.cur],
                                         sl->fwd.ids[sl->fwd.cur])))
            return st;
    } else {
        double ts = moept__now();
        if ((st = moept__fwd_dispatch(L, sl, f->x))) return st;
        L->stats.dispatch_seconds += moept__now() - ts;
        const moept__runs R = moept__runs_groups(sl->xch.roffsets, L->El);
        const moept__ffn ff = moept__ffn_routed(L, sl);
        moept__ffn_forward(L, &ff, &R);
        if ((st = moept__fwd_combine(L, sl, f->x, f->y))) return st;
    }
    return L->xch.direct ? moept__direct_sync(L, "moept_forward") : MOEPT_OK;
}

/* The step's statistics, once its output is known finite */
static void moept__fwd_stats(moept_layer *L, moept__fstate *sl, const moept__fstep *f, double aux_v) {
    moept_stats *sts = &L->stats;
    sts->steps++;
    sts->tokens = f->T;
    sts->masked_tokens = f->T - f->valid;
    sts->routed_rows = sl->plan.N;
    sts->dropped_rows = f->valid * L->K - sl->plan.N;
    sts->capacity = f->cap;
    sl->fwd.aux_value = aux_v;
    sl->fwd.z_value = sl->fwd.lstat[sl->fwd.ls.lse2] / sl->fwd.loss_T;
    sts->aux_loss = (float)aux_v;
    sts->z_loss = (float)sl->fwd.z_value;
}

/* An evaluation forward's slot (moept__eval_slot_of) */
static int moept__eval_slot(const moept_layer *L) {
    const moept__fstate *s0 = &L->slots[0];
    return moept__eval_slot_of(L->nslots, L->cfg.inference_only,
                               s0->fwd.valid && !s0->fwd.eval && !s0->fwd.bwd_valid);
}

static moept_status moept__forward(moept_layer *L, moept__fstep *f) {
    /* a training forward's slot; an evaluation's own (a training layer's
       evaluation leaves every training forward's state as it was) */
    const int slot = f->reject ? 0 /* (an out-of-range f->slot is never an index) */
                     : !f->eval ? f->slot : moept__eval_slot(L);
    moept__fstate *sl = &L->slots[slot]; /* its buffers made at its first use; nothing switches */
    moept_status local = f->reject ? moept__fail(L, f->reject, "%s", f->reject_why)
                                   : moept__slot_get(L, slot, "moept_forward", &sl),
                 st;
    f->global = L->cfg.global_balance && (L->group || L->dp);
    f->nb = 1 - sl->fwd.cur;
    if (!local) local = moept__fwd_checks(L, f);
    if (!local && f->mask && !L->ws.xz && memchr(f->mask, 0, (size_t)f->T)) { /* the first padded step */
        L->ws.xz = moept__alloc(&L->mem, (size_t)(L->cfg.max_tokens * L->D) * sizeof(float));
        if (!L->ws.xz)
            local = moept__fail(L, MOEPT_ERR_OUT_OF_MEMORY, "moept_forward: out of memory for the router "
                                "gradient's input with the padded rows zero");
    }
    if (!local) local = moept__fwd_route(L, sl, f);
    if (!local && L->S > 0 && f->valid < f->T && !L->ws.xsh) { /* the first padded step: room to pack */
        L->ws.xsh = moept__alloc(&L->mem, (size_t)(L->cfg.max_tokens * L->D) * sizeof(float));
        L->ws.shrow = moept__alloc(&L->mem, (size_t)L->cfg.max_tokens * sizeof(int64_t));
        if (!L->ws.xsh || !L->ws.shrow) {
            MOEPT_FREE(L->ws.xsh);
            MOEPT_FREE(L->ws.shrow);
            L->ws.xsh = NULL;
            L->ws.shrow = NULL;
            local = moept__fail(L, MOEPT_ERR_OUT_OF_MEMORY, "moept_forward: out of memory for packing the "
                                "shared expert's unmasked rows");
        }
    }
    /* a rank making another call fails here, tagged, not in the count exchange */
    if ((st = moept__agree_call(L, L->group, f->global ? L->dp : NULL, local, MOEPT__CALL_FORWARD,
                                f->eval ? 0 : (uint64_t)f->slot + 1)))
        return st;
    /* the unmasked tokens': padding changes no token's fate */
    f->cap = moept__capacity(L->capacity_factor, f->valid, L->K, L->E);
    moept__fwd_count(L, sl, f);
    if ((st = moept__fwd_exchange_counts(L, sl, f))) return st;
    if ((st = moept__fwd_agree_growth(L, sl, f))) return st;
    /* fsdp: the full experts from every rank's shard (before the commit: a
       broken comm leaves the last step intact) */
    if (L->fsdp && (st = moept__fsdp_gather(L))) return st;
    const moept_stats stats_before = L->stats; /* restored if the output check fails */
    moept__fwd_commit(L, sl, f);
    moept__q8_weights(L);
    sl->fwd.sh_n = f->valid;
    double aux_v = 0.0;
    if ((st = moept__fwd_losses(L, sl, f, &aux_v)) || (moept__fwd_plan(L, sl), (st = moept__fwd_run(L, sl,
            f)))) {
        sl->fwd.valid = 0;
        return st;
    }
    if ((st = moept__forward_finite(L, sl, f->y, aux_v, sl->fwd.lstat[sl->fwd.ls.lse2] / sl->fwd.loss_T,
                                    f->global))) {
        L->stats = stats_before;
        return st;
    }
    moept__fwd_stats(L, sl, f, aux_v);
    L->last = slot; /* what moept_routing and moept_get_stats read from now on */
    return MOEPT_OK;
}

moept_status moept_forward_ex(moept_layer *L, const float *x, int64_t T, float *y,
                              const moept_forward_opts *o) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_forward: layer is NULL");
    moept__fstep f;
    memset(&f, 0, sizeof f);
    f.x = x; f.y = y; f.T = T;
    if (o) {
        f.mask = o->mask; f.eval = o->eval != 0; f.replay = o->replay_ids;
        f.logits_out = o->logits_out;
        f.slot = o->slot;
    }
    f.eval |= L->cfg.inference_only; /* nothing to keep */
    f.jitter = L->cfg.router_jitter > 0.0f && !f.eval; /* the noise's key: every executor's */
    f.jkey = moept__jitter_key(L);
    if (f.mask) f.reject = moept__ex_refuse(L->ex, MOEPT__CAN_MASK, "moept_forward", f.reject_why);
    if (!f.eval && (f.slot < 0 || f.slot >= L->nslots)) { /* agreed as the executor's refusals */
        f.reject = MOEPT_ERR_INVALID_ARGUMENT;
        snprintf(f.reject_why, sizeof f.reject_why, "moept_forward: opts.slot %d is not in "
                 "0..max_inflight-1 (%d)", f.slot, L->nslots - 1);
    }
    return moept__numeric_cause(L, L->ex->forward(L, &f), "moept_forward");
}

moept_status moept_forward(moept_layer *L, const float *x, int64_t T, float *y) {
    return moept_forward_ex(L, x, T, y, NULL);
}

/* ------------------------------------------------------------------------
   Backward: its stages, as the forward's
   ------------------------------------------------------------------------ */
/* Finite dy that gives a non-finite dx (an overflow in the backward): the
   step fails on every rank of the group, its statistics as they were. The
   gradients were accumulated in place by then: where they were zero before
   (zero_grad, forward, backward) they are zero again, exactly; where they
   held earlier micro-batches, config.grad_backup's copy restores them
   exactly, and without it (the copy doubles the gradients' memory)
   adamw_step and grad_norm refuse them until moept_zero_grad. */
static moept_status moept__backward_finite(moept_layer *L, moept__fstate *sl, const float *dx,
                                           int grads_were_zero,
                                           const moept_stats *before) {
    moept_status st = moept__agree_finite(L, sl, "moept_backward", "dx", dx, MOEPT_OK, NULL,
        grads_were_zero ? "the gradients are as they were (zero)"
        : L->par.grads_copy ? "the gradients are as they were (config.grad_backup's copy)"
        : "the gradients accumulated since moept_zero_grad are refused until moept_zero_grad");
    if (!st) return MOEPT_OK;
    L->stats = *before;
    if (grads_were_zero) memset(L->par.grads, 0, (size_t)L->par.n_params * sizeof(float));
    else if (L->par.grads_copy)
        memcpy(L->par.grads, L->par.grads_copy, (size_t)L->par.n_params * sizeof(float));
    else if (L->par.grads_dx_bad < 0) {
        int64_t bad = moept__first_nonfinite(dx, sl->fwd.T * L->D);
        L->par.grads_dx_bad = bad < 0 ? 0 : bad; /* 0: a peer's dx */
    }
    return st;
}

moept_backward_opts moept_backward_default(void) {
    moept_backward_opts o = {1.0f, NULL, 0};
    return o;
}

moept_status moept_backward_ex(moept_layer *L, const float *x, const float *dy, float *dx,
                               const moept_backward_opts *o) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_backward: layer is NULL");
    if (!L->par.trains) return moept__no_grads(L, "moept_backward");
    const moept_backward_opts def = moept_backward_default();
    moept_status st = moept__numeric_cause(L, L->ex->backward(L, x, dy, dx, o ? o : &def), "moept_backward");
    if (!st && (L->group || L->dp)) L->grads_unsynced = 1;
    return st;
}

moept_status moept_backward(moept_layer *L, const float *x, const float *dy, float *dx) {
    return moept_backward_ex(L, x, dy, dx, NULL);
}

/* The backward's stages, as the CUDA executor's (moept_kernels.cu):
   agree -> combine' -> experts' -> router' -> dx. Each rank's output rows
   (ys) become dys, then the experts' dxs; dx is written once, by the last. */

/* agree: this rank's checks, then (EP) agreement so no rank is left waiting */
#define MOEPT__STALE_MSG                                                                                \
    "moept_backward: %s changed the weights since this forward; its gradients would mix the old "      \
    "activations with the new weights: run the forward again"
/* the caller's dlogits [T][E]: its first non-finite element the backward
   reads (padded rows are not read), -1 if none */
static int64_t moept__dlogits_bad(const moept_layer *L, const moept__fstate *sl, const float *dlogits) {
    const int32_t *ids = sl->fwd.ids[sl->fwd.cur];
    for (int64_t t = 0; t < sl->fwd.T; t++)
        for (int64_t e = 0; ids[t * L->K] >= 0 && e < L->E; e++)
            if (!moept__finite(dlogits[t * L->E + e])) return t * L->E + e;
    return -1;
}

static moept_status moept__bwd_agree(moept_layer *L, moept__fstate *sl, const float *x, const float *dy,
                                     const float *dx, const float *dlogits, float rscale, int slot) {
    moept_status local = MOEPT_OK;
    uint64_t x_fp = 0;
    const int32_t *ids = sl->ready ? sl->fwd.ids[sl->fwd.cur] : NULL; /* -1: padding, whose rows go unread */
    if (slot < 0 || slot >= L->nslots)
        local = moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_backward: opts.slot %d is not in "
                            "0..max_inflight-1 (%d)", slot, L->nslots - 1);
    else if (L->last != slot && (!sl->ready || !sl->fwd.valid))
        local = moept__fail(L, MOEPT_ERR_STATE, "moept_backward: slot %d holds no forward to "
                            "differentiate", slot);
    const int64_t T = sl->fwd.T, D = L->D;
    if (local) (void)0;
    else if (!sl->fwd.valid)
        local = moept__fail(L, MOEPT_ERR_STATE, "moept_backward: no forward to differentiate");
    else if (!moept__finite(rscale))
        local = moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT,
                            "moept_backward: opts.router_loss_scale is not finite");
    else if (sl->fwd.eval)
        local = moept__fail(L, MOEPT_ERR_STATE,
                            "moept_backward: the last forward was an evaluation (opts.eval): "
                            "it kept nothing to differentiate");
    else if (sl->fwd.bwd_valid) /* the step's saved activations were consumed in place */
        local = moept__fail(L, MOEPT_ERR_STATE,
                            "moept_backward: this forward was already differentiated; run "
                            "forward again");
    else if (sl->fwd.stale)
        local = moept__fail(L, MOEPT_ERR_STATE, MOEPT__STALE_MSG, sl->fwd.stale);
    else if (T > 0 && (!x || !dy || !dx))
        local = moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_backward: %s is NULL",
                            !x ? "x" : !dy ? "dy" : "dx");
    else if (moept__overlaps(dx, x, (size_t)(T * D) * sizeof(float)))
        local = moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, MOEPT__DX_ALIAS);
    else if ((moept__x_scan(x, T * D, &x_fp) >= 0 && moept__unpadded_bad(x, T, D, NULL, ids, L->K) >= 0) ||
             x_fp != sl->fwd.x_fp)
        local = moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_backward: x is not the last forward's x "
                            "(another buffer, or changed since, e.g. by a y written over it)");
    else {
        int64_t bad = moept__first_nonfinite(dy, T * D);
        if (bad >= 0) bad = moept__unpadded_bad(dy, T, D, NULL, ids, L->K);
        if (bad >= 0)
            local = moept__fail(L, MOEPT_ERR_NUMERIC, "moept_backward: dy[%lld][%lld] is not finite",
                                (long long)(bad / D), (long long)(bad % D));
        else if (dlogits && (bad = moept__dlogits_bad(L, sl, dlogits)) >= 0)
            local = moept__fail(L, MOEPT_ERR_NUMERIC,
                                "moept_backward: opts.dlogits[%lld][%lld] is not finite",
                                (long long)(bad / L->E), (long long)(bad % L->E));
    }
    return moept__agree_call(L, L->group, NULL, local, MOEPT__CALL_BACKWARD,
                             moept__fnv(moept__fnv_f32(&rscale, 1), &slot, sizeof slot));
}

/* fsdp: the experts gathered again (before anything changes: a broken comm
   leaves the step to differentiate), this step's gradients from zero */
static moept_status moept__bwd_fsdp_gather(moept_layer *L) {
    moept_status st = moept__fsdp_gather(L);
    if (!st) memset(L->fs.gfull, 0, (size_t)(L->fsdp->size * L->fs.shard) * sizeof(float));
    return st;
}

/* combine': dL/dw per slot, then dys = w * dy in place of ys (direct path:
   of the output where the expert's rank keeps it), config.fp8's quantized
   once (1 x 128, moept__q8_row: under EP as FP8 records, into xs, which
   the forward's dispatch is done with); the shared expert's dy (gated) in
   yss and its gate's gradient in dsg */
static void moept__bwd_combine(moept_layer *L, moept__fstate *sl, const float *dy) {
    double ts = moept__now();
    const int64_t T = sl->fwd.T, D = L->D, K = L->K, W = moept__q8_recw(D);
    const int q8 = L->cfg.fp8 != MOEPT_FP8_OFF, rec = moept__q8_recs(L);
    const float *wts = sl->fwd.wts[sl->fwd.cur];
    const int32_t *ids = sl->fwd.ids[sl->fwd.cur];
    const int direct = L->xch.direct;
    #pragma omp parallel for schedule(static) MOEPT__PAR(T * D * K)
    for (int64_t t = 0; t < T; t++) {
        const float *dyt = dy + t * D;
        for (int64_t k = 0; k < K; k++) {
            int64_t r = sl->plan.row_of[t * K + k];
            if (r < 0) { sl->ws.dwts[t * K + k] = 0.0f; continue; }
            float *dys =
                direct ? moept__shared_row(L, sl, L->plan.slot_of[ids[t * K + k]], r, 1) : sl->ws.dys + r * D;
            sl->ws.dwts[t * K + k] = (float)moept__dot(dys, dyt, D); /* the output row still, then dys */
            moept__row_scale(dys, wts[t * K + k], dyt, D);
            if (rec) moept__q8_row(dys, D, NULL, (uint8_t *)sl->ws.xs + r * W);
            else if (q8) moept__q8_row(dys, D, dys, NULL);
        }
        if (L->S > 0) { /* padding: its y row was 0, nothing flows back */
            float *yss = sl->ws.yss + t * D;
            float gs = L->par.wsg ? sl->ws.sg[t] : 1.0f;
            int pad = ids[t * K] < 0;
            if (L->par.wsg) L->ws.dsg[t] = pad ? 0.0f : moept__gate_bwd(moept__dot(yss, dyt, D), gs);
            if (pad) memset(yss, 0, (size_t)D * sizeof(float));
            else moept__row_scale(yss, gs, dyt, D);
        }
    }
    L->stats.combine_seconds += moept__now() - ts;
}

/* The shared expert's weight gradients from its dys (yss), its dxs left in
   yss; a padded step's over the packed unmasked rows, as its forward */
static void moept__bwd_shared(moept_layer *L, moept__fstate *sl, const float *x) {
    const int64_t T = sl->fwd.T, D = L->D, n = moept__shared_rows(sl, T);
    if (n < T) {
        moept__shared_pack(L, sl, x, T);
        x = L->ws.xsh;
        moept__shared_move(L, sl->ws.yss, D, n, T, 1);
        if (L->par.wsg) moept__shared_move(L, L->ws.dsg, 1, n, T, 1);
    }
    const int64_t off[2] = {0, n};
    const moept__runs R = moept__runs_groups(off, 1);
    const moept__ffn f = moept__ffn_shared(L, sl, x);
    moept__ffn_backward(L, &f, &R);
}

/* experts': the dys travel to the experts, the FFNs' backward, the dxs
   come back into ys (chunked: as a pipeline); the shared expert's backward
   meanwhile */
static moept_status moept__bwd_experts(moept_layer *L, moept__fstate *sl, const float *x) {
    moept_status st;
    double ts = moept__now();
    if (L->xch.direct) { /* our dys are in place: wait for every rank's */
        moept__count_bytes(L, 1, 0);
        if ((st = moept__direct_sync(L, "moept_backward"))) return st;
    } else if (L->C > 1) { /* chunked: exchanges in flight while the experts compute */
        if ((st = moept__backward_chunked(L, sl))) return st;
    } else if (moept__q8_recs(L)) {
        if ((st = moept__exchange_records(L, sl, sl->ws.dyr))) return st;
    } else if (L->ep && (st = moept__exchange(L, sl, sl->ws.dys, sl->ws.dyr, 1))) return st;
    L->stats.dispatch_seconds += moept__now() - ts;
    if (L->C == 1) { /* dyr in, dxr out over it */
        const moept__runs R = moept__runs_groups(sl->xch.roffsets, L->El);
        const moept__ffn f = moept__ffn_routed(L, sl);
        moept__ffn_backward(L, &f, &R);
    }
    if (L->S > 0) moept__bwd_shared(L, sl, x);
    ts = moept__now();
    if (L->xch.direct) {
        if ((st = moept__direct_sync(L, "moept_backward"))) return st;
        moept__count_bytes(L, 0, 0);
    } else if (L->C == 1 && L->ep && (st = moept__exchange(L, sl, sl->ws.dxs, sl->ws.dxr, 0))) return st;
    L->stats.dispatch_seconds += moept__now() - ts;
    return MOEPT_OK;
}

/* router': per-token dlogits (padding: routed nowhere, in no loss), then
   g_router += dlogits^T xin where the router saw xin = x * u (jitter: the
   noise drawn again into xj; else u = 1), and the shared gate's
   gsg += dsg^T x (over the packed rows as its forward) */
static void moept__bwd_router(moept_layer *L, moept__fstate *sl, const float *x,
                              const moept_backward_opts *o) {
    const int64_t T = sl->fwd.T, D = L->D, E = L->E, K = L->K;
    const int fam = (int)L->cfg.family, aux = (int)L->cfg.aux_loss, norm = L->cfg.norm_topk_prob;
    const float *aux_g = aux != MOEPT_AUX_NONE && L->cfg.aux_loss_coef != 0.0f ? sl->fwd.aux_g : NULL;
    const int64_t slen = aux == MOEPT_AUX_SEQ ? L->cfg.aux_seq_len : 0; /* aux_g's row: t / slen */
    const float zc = L->cfg.z_loss_coef, scale = L->cfg.routed_scaling_factor, Tl = (float)sl->fwd.loss_T;
    const float *logits = sl->fwd.logits[sl->fwd.cur], *probs = sl->fwd.probs[sl->fwd.cur];
    const int32_t *ids = sl->fwd.ids[sl->fwd.cur];
    #pragma omp parallel for schedule(static) MOEPT__PAR_MAX(T * E * K, L->nthreads)
    for (int64_t t = 0; t < T; t++) {
        float *scratch = L->plan.choice + (int64_t)MOEPT__TID * 2 * E;
        if (ids[t * K] < 0) {
            for (int64_t e = 0; e < E; e++) L->ws.dlogits[t * E + e] = 0.0f;
            continue;
        }
        float zgrad = moept__zgrad(zc, sl->fwd.lse[t], Tl);
        moept__router_token_bwd(fam, aux, logits + t * E, probs + t * E, ids + t * K, sl->ws.dwts + t * K,
                                aux_g && slen ? aux_g + t / slen * E : aux_g, zgrad, (int)E, (int)K, norm,
                                scale, o->router_loss_scale, o->dlogits ? o->dlogits + t * E : NULL, scratch,
                                L->ws.dlogits + t * E);
    }
    const float *xin = x;
    if (sl->fwd.jitter) {
        moept__jitter_apply(L, sl->fwd.jkey, x, T, sl->fwd.xj, sl->fwd.jrow[sl->fwd.cur], 0);
        xin = sl->fwd.xj;
    }
    if (L->ws.xz) xin = moept__router_in(xin, T, D, ids, K, sl->fwd.jitter ? sl->fwd.xj : L->ws.xz);
    moept__gemm g = moept__gemm_make(1, 0, E, D, T, L->ws.dlogits, E, xin, D, 1.0f, L->par.g_router, D);
    moept__gemm_run(&g, 1, &L->ws.gws);
    const int64_t n = moept__shared_rows(sl, T);
    if (L->S > 0 && L->par.wsg) {
        g = moept__gemm_make(1, 0, 1, D, n, L->ws.dsg, 1, n < T ? L->ws.xsh : x, D, 1.0f, L->par.gsg, D);
        moept__gemm_run(&g, 1, &L->ws.gws);
    }
}

/* dx in one place: the sum of each token's K rows of dxs in slot order,
   then the shared expert's dxs and its gate's term (over its packed rows),
   then the router's (dlogits W) * u */
static moept_status moept__bwd_dx(moept_layer *L, moept__fstate *sl, float *dx) {
    double ts = moept__now();
    const int64_t T = sl->fwd.T, D = L->D, E = L->E, K = L->K;
    const int32_t *ids = sl->fwd.ids[sl->fwd.cur];
    const int direct = L->xch.direct;
    const float *dxs =
        L->C > 1 && !L->ep ? sl->ch.dx : sl->ws.dxs; /* chunked at one rank: the experts' own rows */
#pragma omp parallel for schedule(static) MOEPT__PAR(T * D * K)
    for (int64_t t = 0; t < T; t++) {
        float *dxt = dx + t * D;
        memset(dxt, 0, (size_t)D * sizeof(float));
        for (int64_t k = 0; k < K; k++) {
            int64_t r = sl->plan.row_of[t * K + k];
            if (r < 0) continue;
            const float *src =
                direct ? moept__shared_row(L, sl, L->plan.slot_of[ids[t * K + k]], r, 1) : dxs + r * D;
            moept__row_axpy(dxt, 1.0f, src, D);
        }
    }
    moept_status st;
    if (direct && (st = moept__direct_sync(L, "moept_backward"))) return st; /* peers done reading */
    L->stats.dispatch_seconds += moept__now() - ts;
    const int64_t n = moept__shared_rows(sl, T);
    if (L->S > 0) {
        if (n < T) moept__shared_move(L, dx, D, n, T, 1);
        #pragma omp parallel for schedule(static) MOEPT__PAR(n * D)
        for (int64_t t = 0; t < n; t++) moept__row_axpy(dx + t * D, 1.0f, sl->ws.yss + t * D, D);
        if (L->par.wsg) { /* dx += dsg wsg */
            moept__gemm g = moept__gemm_make(0, 0, n, D, 1, L->ws.dsg, 1, L->par.wsg, D, 1.0f, dx, D);
            moept__gemm_run(&g, 1, &L->ws.gws);
        }
        if (n < T) moept__shared_move(L, dx, D, n, T, 0);
    }
    if (!sl->fwd.jitter) {
        moept__gemm g = moept__gemm_make(0, 0, T, D, E, L->ws.dlogits, E, L->par.w_router, D, 1.0f, dx, D);
        moept__gemm_run(&g, 1, &L->ws.gws);
        return MOEPT_OK;
    }
    moept__gemm g = moept__gemm_make(0, 0, T, D, E, L->ws.dlogits, E, L->par.w_router, D, 0.0f, sl->fwd.xj,
                                     D);
    moept__gemm_run(&g, 1, &L->ws.gws);
    moept__jitter_apply(L, sl->fwd.jkey, NULL, T, sl->fwd.xj, sl->fwd.jrow[sl->fwd.cur], 0);
    #pragma omp parallel for schedule(static) MOEPT__PAR(T * D)
    for (int64_t i = 0; i < T * D; i++) dx[i] += sl->fwd.xj[i];
    return MOEPT_OK;
}

static moept_status moept__backward_slot(moept_layer *L, const float *x, const float *dy, float *dx,
                                         const moept_backward_opts *o) {
    moept_status st;
    /* the state of the forward it differentiates (a slot out of range is refused, agreed) */
    moept__fstate *sl = &L->slots[o->slot >= 0 && o->slot < L->nslots ? o->slot : L->last];
    if ((st = moept__bwd_agree(L, sl, x, dy, dx, o->dlogits, o->router_loss_scale, o->slot))) return st;
    const moept_stats stats_before = L->stats; /* restored if dx is not finite */
    const int grads_were_zero = moept__all_zero(L->par.grads, L->par.n_params);
    if (L->par.grads_copy && !grads_were_zero)
        memcpy(L->par.grads_copy, L->par.grads, (size_t)L->par.n_params * sizeof(float));
    if (L->fsdp && (st = moept__bwd_fsdp_gather(L))) return st;
    moept__bwd_combine(L, sl, dy);
    if ((st = moept__bwd_experts(L, sl, x))) return st;
    moept__bwd_router(L, sl, x, o);
    if ((st = moept__bwd_dx(L, sl, dx))) return st;
    sl->fwd.bwd_valid = 1; /* the saved activations are consumed, whatever follows */
    if ((st = moept__backward_finite(L, sl, dx, grads_were_zero, &stats_before))) return st;
    if (L->fsdp && (st = moept__fsdp_reduce_scatter(L))) return st;
    return MOEPT_OK;
}

/* The backward of opts.slot's forward (moept_routing, moept_get_stats and
   update_bias go on reading the last forward's; moept_routing_grads its
   backward, once it ran) */
static moept_status moept__backward(moept_layer *L, const float *x, const float *dy, float *dx,
                                    const moept_backward_opts *o) {
    return moept__backward_slot(L, x, dy, dx, o);
}

/* ------------------------------------------------------------------------
   Gradients, statistics and routing read back
   ------------------------------------------------------------------------ */
moept_status moept_sync_grads(moept_layer *L, float scale) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_sync_grads: layer is NULL");
    if (!L->par.trains) return moept__no_grads(L, "moept_sync_grads");
    moept_status bad = MOEPT_OK;
    if (!moept__finite(scale))
        bad = moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_sync_grads: scale is not finite");
    moept_status ag = moept__agree_call(L, L->group, L->dp, bad, MOEPT__CALL_SYNC_GRADS,
                                        moept__fnv_f32(&scale, 1));
    if (ag) return ag;
    moept_status st = L->ex->sync_grads(L, scale);
    if (!st) L->grads_unsynced = 0;
    return st;
}

moept_status moept_grads_synced(moept_layer *L) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_grads_synced: layer is NULL");
    L->grads_unsynced = 0;
    return MOEPT_OK;
}

/* A group layer's step over gradients no sync has summed since a backward
   would let the ranks train different models (their replicated weights
   drift apart): refused, the caller agrees. */
static moept_status moept__unsynced(moept_layer *L) {
    if (!L->grads_unsynced) return MOEPT_OK;
    return moept__fail(L, MOEPT_ERR_STATE, "moept_adamw_step: the gradients were not synced over the group "
                       "since the last backward: call moept_sync_grads first (or moept_grads_synced if you "
                       "summed them yourself)");
}

/* the CPU's: router and shared expert over EP, then everything over DP */
static moept_status moept__cpu_sync_grads(moept_layer *L, float scale) {
    double t0 = moept__now();
    moept_status st = MOEPT_OK;
    int64_t n_router = L->E * L->D, n_exp = L->par.n_exp;
    float *shared = L->par.g_router + n_router + n_exp;
    int64_t n_shared = L->par.n_params - n_router - n_exp;
    /* replicated: router and shared expert, over EP (or the fsdp group) then
       DP; experts (or fsdp shards, already reduce-scattered) over DP */
    moept_comm *grp = L->group;
    if (grp && !st) st = grp->allreduce(grp, L->par.g_router, n_router, MOEPT_DTYPE_F32);
    if (grp && !st && n_shared) st = grp->allreduce(grp, shared, n_shared, MOEPT_DTYPE_F32);
    if (L->dp && !st) st = L->dp->allreduce(L->dp, L->par.grads, L->par.n_params, MOEPT_DTYPE_F32);
    L->stats.comm_seconds += moept__now() - t0;
    if (st)
        return moept__fail(L, st, "moept_sync_grads: %s",
                           (grp && grp->err[0]) ? grp->err
                               : L->dp          ? L->dp->err
                                                : "");
    if (scale != 1.0f)
        for (int64_t i = 0; i < L->par.n_params; i++) L->par.grads[i] *= scale;
    return MOEPT_OK;
}

/* The gradients' squared sums [replicated, experts] when s is given, and
   their first non-finite element (-1: none): a CUDA layer's on the device,
   where they are. */
static moept_status moept__cpu_grad_scan(moept_layer *L, double *s, int64_t *bad) {
    const int64_t n_router = L->E * L->D, n_exp = L->par.n_exp;
    for (int64_t i = 0; s && i < L->par.n_params; i++) {
        double g = L->par.grads[i];
        s[i >= n_router && i < n_router + n_exp] += g * g;
    }
    *bad = s && isfinite(s[0] + s[1]) ? -1 : moept__first_nonfinite(L->par.grads, L->par.n_params);
    return MOEPT_OK;
}

/* The CPU's AdamW check: the largest |g| in one pass that vectorises (max
   and NaN are order-free), where grad_scan's ordered double sum is a serial
   chain (docs/PERF.md, bench_adamw) */
static moept_status moept__cpu_grad_max(moept_layer *L, double *g2, int64_t *bad) {
    const float *g = L->par.grads;
    const int64_t n = L->par.n_params;
    float mx = 0.0f;
    int nonnum = 0;
    #pragma omp parallel for simd schedule(static) reduction(max : mx) reduction(| : nonnum) MOEPT__PAR(n)
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(g[i]);
        mx = a > mx ? a : mx;
        nonnum |= a != a;
    }
    *bad = nonnum || !moept__finite(mx) ? moept__first_nonfinite(g, n) : -1;
    *g2 = (double)mx * mx;
    return MOEPT_OK;
}

moept_status moept_grad_norm(moept_layer *L, double *norm) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_grad_norm: layer is NULL");
    if (!L->par.trains) return moept__no_grads(L, "moept_grad_norm");
    moept_status bad = norm ? moept__grads_refused(L, "moept_grad_norm")
                            : moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_grad_norm: norm is NULL");
    double s[2] = {0.0, 0.0}; /* [replicated, experts] */
    int64_t first_bad;
    if (!bad) bad = L->ex->grad_scan(L, s, &first_bad);
    moept_status ag = moept__agree_call(L, L->group, NULL, bad, MOEPT__CALL_GRAD_NORM, 0);
    if (ag) return ag;
    moept_comm *grp = L->group;
    if (grp) { /* each expert (or shard) lives on one rank: sum those; replicated counted once */
        moept_status st = grp->allreduce(grp, &s[1], 1, MOEPT_DTYPE_F64);
        if (st) return moept__fail(L, st, "moept_grad_norm: %s", grp->err);
    }
    *norm = sqrt(s[0] + s[1]);
    return MOEPT_OK;
}

/* a sync-free CUDA forward's statistics, read when asked for */
static moept_status moept__settle(const moept_layer *cL) {
    moept_layer *L = (moept_layer *)cL;
    return MOEPT__EX(L, settle, L);
}

moept_status moept_get_peer_rows(const moept_layer *L, int64_t *sent, int64_t *received) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_get_peer_rows: layer is NULL");
    const moept__fstate *sl = moept__last(L);
    if (!sl->fwd.valid) return moept__fail(L, MOEPT_ERR_STATE, "moept_get_peer_rows: no forward yet");
    moept_status st = moept__settle(L);
    if (st) return st;
    for (int q = 0; q < L->P; q++) {
        int64_t s = L->ep ? sl->xch.peer_rows[q] : sl->plan.N,
                r = L->ep ? sl->xch.peer_rows[L->P + q] : sl->plan.N;
        if (sent) sent[q] = s;
        if (received) received[q] = r;
    }
    return MOEPT_OK;
}

moept_status moept_update_bias(moept_layer *L, float rate) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_update_bias: layer is NULL");
    moept__fstate *sl = moept__last(L);
    moept_status bad = MOEPT_OK;
    if (L->cfg.family != MOEPT_FAMILY_DEEPSEEK_V3)
        bad = moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT,
                          "moept_update_bias: only deepseek_v3 has a correction bias");
    else if (!moept__finite(rate) || rate < 0.0f)
        bad = moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_update_bias: rate must be finite and >= 0");
    else if (!sl->fwd.valid)
        bad = moept__fail(L, MOEPT_ERR_STATE, "moept_update_bias: no forward has counted tokens yet");
    else if (sl->fwd.eval)
        bad = moept__fail(L, MOEPT_ERR_STATE,
                          "moept_update_bias: the last forward was an evaluation (opts.eval)");
    else bad = moept__settle(L);
    float *nb = bad ? NULL : moept__alloc(NULL, (size_t)(2 * L->E) * sizeof(float)); /* new bias, old */
    if (!bad && !nb) bad = moept__fail(L, MOEPT_ERR_OUT_OF_MEMORY, "moept_update_bias: out of memory");
    moept_status ag = moept__agree_call(L, L->group, L->dp, bad, MOEPT__CALL_UPDATE_BIAS,
                                        moept__fnv_f32(&rate, 1));
    if (ag) MOEPT_FREE(nb);
    if (ag) return ag;
    /* the bias is replicated: every rank must see the whole batch's counts
       (already so with global_balance; otherwise sum them here) */
    double *cnt = sl->fwd.lstat; /* [E] the forward's selection counts; free after the forward */
    if ((L->group || L->dp) && !sl->fwd.counts_global) {
        moept_status st = moept__world_sum(L, cnt, L->E, MOEPT_DTYPE_F64);
        if (st) MOEPT_FREE(nb);
        if (st) return st;
        for (int64_t e = 0; e < L->E; e++) sl->fwd.sel_counts[e] = (int64_t)cnt[e];
        sl->fwd.counts_global = 1; /* a second call after the same forward sums nothing twice */
    }
    double total = 0.0;
    for (int64_t e = 0; e < L->E; e++) total += (double)sl->fwd.sel_counts[e];
    double mean = total / (double)L->E;
    for (int64_t e = 0; e < L->E; e++) {
        double c = (double)sl->fwd.sel_counts[e];
        nb[e] = L->par.bias[e] + rate * (float)((mean > c) - (mean < c));
    }
    moept_status st = moept__bias_set(L, nb, nb + L->E);
    MOEPT_FREE(nb);
    return st;
}

moept_status moept_routing(moept_layer *L, const int32_t **ids, const float **weights, const float **logits) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_routing: layer is NULL");
    const moept__fstate *sl = moept__last(L);
    if (!sl->fwd.valid) return moept__fail(L, MOEPT_ERR_STATE, "moept_routing: no forward yet");
    moept_status cs = MOEPT__EX(L, routing, L, 0); /* a device's routing, copied to the host */
    if (cs) return cs;
    if (ids) *ids = sl->fwd.ids[sl->fwd.cur];
    if (weights) *weights = sl->fwd.wts[sl->fwd.cur];
    if (logits) *logits = sl->fwd.logits[sl->fwd.cur];
    return MOEPT_OK;
}

moept_status moept_routing_grads(moept_layer *L, const float **dweights) {
    if (!L || !dweights)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_routing_grads: NULL argument");
    const moept__fstate *sl = moept__last(L);
    if (!sl->fwd.bwd_valid)
        return moept__fail(L, MOEPT_ERR_STATE, "moept_routing_grads: no backward since the last forward");
    moept_status cs = MOEPT__EX(L, routing, L, 1);
    if (cs) return cs;
    *dweights = sl->ws.dwts;
    return MOEPT_OK;
}

/* What the layer holds on the host now, by moept_mem_kind (every block it
   allocated and still holds, each in one kind; its device executor's host
   blocks in WORKSPACE), and workspace_bytes, param_bytes */
static void moept__host_held(const moept_layer *L, moept_stats *st) {
    const int64_t f = sizeof(float), n = L->par.n_params, D = L->D, T = L->cfg.max_tokens;
    int64_t *h = st->host_bytes, w[MOEPT__NRECV], row = 0;
    moept__recv_widths(L, w);
    for (int i = 0; i < MOEPT__NRECV; i++) row += w[i];
    h[MOEPT_MEM_PARAMS] = ((L->par.params ? n : 0) + L->E) * f; /* (the bias: the host's always) */
    h[MOEPT_MEM_GRADS] = ((L->par.grads ? n : 0) + (L->par.grads_copy ? n : 0)) * f;
    h[MOEPT_MEM_MOMENTS] = L->opt.m ? 2 * n * f : 0;
    h[MOEPT_MEM_CASTS] = L->ws.q8w_bytes;
    st->param_bytes = h[MOEPT_MEM_PARAMS] + h[MOEPT_MEM_GRADS];
    st->workspace_bytes = L->work_bytes;
    int64_t rest = 0; /* the receive blocks' alignment, the bookkeeping, the padded steps' buffers */
    for (int s = 0; s <= L->nslots; s++) { /* every forward slot's */
        const moept__fstate *o = &L->slots[s];
        if (o->ready) st->workspace_bytes += o->work_bytes + o->xch.Rcap * row * f + 2 * o->xch.shcap * D * f;
        if (o->xch.rwork) rest += MOEPT__NRECV * 64;
    }
    rest += (int64_t)(sizeof *L + (size_t)(3 * L->El + 8) * sizeof(moept__param) +
                      (size_t)(L->nslots + 1) * sizeof(moept__fstate));
    rest += (L->ws.xz ? T * D * f : 0) + (L->ws.xsh ? T * D * f : 0) + (L->ws.shrow ? T * 8 : 0);
    h[MOEPT_MEM_WORKSPACE] = st->workspace_bytes - L->ws.q8w_bytes + rest + L->dev.host;
}

moept_status moept_get_stats(const moept_layer *L, moept_stats *st, int64_t *tpe) {
    if (!L || !st) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_get_stats: NULL argument");
    const moept__fstate *sl = moept__last(L);
    moept_status ss = moept__settle(L);
    if (ss) return ss;
    *st = L->stats;
    st->allocations = L->mem.allocations + L->dev.allocations;
    st->allocated_bytes = L->mem.bytes + L->dev.allocated_bytes;
    moept__host_held(L, st);
    st->shared_exchange = L->xch.direct;
    st->device_workspace_bytes = L->dev.workspace_bytes;
    memcpy(st->device_bytes, L->dev.bytes, sizeof st->device_bytes);
    if (tpe)
        for (int64_t e = 0; e < L->E; e++) tpe[e] = sl->fwd.valid ? sl->fwd.sel_counts[e] : 0;
    return MOEPT_OK;
}

/* ------------------------------------------------------------------------
   AdamW
   ------------------------------------------------------------------------ */
/* the parameter whose gradient element i (of the flat buffer) is */
static const char *moept__param_of(const moept_layer *L, int64_t i) {
    for (int64_t t = 0; t < L->par.n_table; t++) {
        const moept__param *p = &L->par.table[t];
        if (p->trains && p->off >= 0 && i >= p->off && i < p->off + p->rows * p->cols) return p->name;
    }
    return "?";
}

/* The CPU's AdamW moments [2][n_params], zero, allocated once, at the
   first step (before the agreement: a rank out of memory fails every rank) */
static moept_status moept__opt_alloc(moept_layer *L, const char *call) {
    if (L->opt.m) return MOEPT_OK;
    float *s = moept__alloc(&L->mem, (size_t)(2 * L->par.n_params) * sizeof(float));
    if (!s) return moept__fail(L, MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory for the optimizer state", call);
    memset(s, 0, (size_t)(2 * L->par.n_params) * sizeof(float));
    L->opt.m = s; L->opt.v = s + L->par.n_params;
    L->opt.held = 1;
    return MOEPT_OK;
}

static moept_status moept__cpu_adamw_ready(moept_layer *L) { return moept__opt_alloc(L, "moept_adamw_step"); }

/* One AdamW step with the step's constants k over the whole buffer (an
   executor with device copies runs it where the gradients are) */
static moept_status moept__cpu_adamw(moept_layer *L, moept__adamw_k k) {
    float *p = L->par.params, *m = L->opt.m, *v = L->opt.v;
    const float *g = L->par.grads;
    const int64_t n = L->par.n_params;
    #pragma omp parallel for schedule(static) MOEPT__PAR(n)
    for (int64_t i = 0; i < n; i++) p[i] = moept__adamw1(p[i], g[i], &m[i], &v[i], k);
    return MOEPT_OK;
}

/* The step computed into registers, nothing written (moept__exec's
   adamw_probe): the lowest failing element wins, whatever the threads */
static moept_status moept__cpu_adamw_probe(moept_layer *L, moept__adamw_k k, int64_t *bad, double *mmax,
                                           double *vmax) {
    const float *p = L->par.params, *g = L->par.grads, *m = L->opt.m, *v = L->opt.v;
    const int64_t n = L->par.n_params;
    int64_t first = INT64_MAX;
    float mm = 0.0f, vm = 0.0f;
    #pragma omp parallel for schedule(static) reduction(min : first) reduction(max : mm, vm) MOEPT__PAR(n)
    for (int64_t i = 0; i < n; i++) {
        float mi = m[i], vi = v[i];
        const float q = moept__adamw1(p[i], g[i], &mi, &vi, k);
        const int code = !moept__finite(vi) ? 2 : !moept__finite(mi) ? 1 : !moept__finite(q) ? 3 : 0;
        if (code) first = first < 4 * i + code ? first : 4 * i + code;
        else { mm = mm > fabsf(mi) ? mm : fabsf(mi); vm = vm > vi ? vm : vi; }
    }
    *bad = first == INT64_MAX ? -1 : first;
    *mmax = mm;
    *vmax = vm;
    return MOEPT_OK;
}

moept_adamw moept_adamw_default(float lr) { return (moept_adamw){lr, 0.9f, 0.999f, 1e-8f, 0.01f}; }

/* The step's constants k for step t, each hyperparameter checked for what
   it does (torch.optim.AdamW's ranges; a decay factor 1 - lr wd in [0, 1];
   a bias-corrected step size finite in fp32 at this t). 0 and why: refused. */
static int moept__adamw_consts(const moept_adamw *o, int64_t t, moept__adamw_k *k, char *why, size_t n) {
    const float lr = o->lr, b1 = o->beta1, b2 = o->beta2, eps = o->eps, wd = o->weight_decay;
    const double bc1 = 1.0 - pow((double)b1, (double)t), bc2 = 1.0 - pow((double)b2, (double)t);
    const double step = lr / bc1;
    if (!moept__finite(lr) || !(lr > 0)) /* lr 0 would only advance t and the moments: a caller's slip */
        snprintf(why, n, "lr %g must be finite and > 0", (double)lr);
    else if (!(b1 >= 0 && b1 < 1))
        snprintf(why, n, "beta1 %g must be in [0, 1)", (double)b1);
    else if (!(b2 >= 0 && b2 < 1))
        snprintf(why, n, "beta2 %g must be in [0, 1)", (double)b2);
    else if (!moept__finite(eps) || !(eps > 0))
        snprintf(why, n, "eps %g must be finite and > 0", (double)eps);
    else if (!moept__finite(wd) || !(wd >= 0))
        snprintf(why, n, "weight_decay %g must be finite and >= 0", (double)wd);
    else if (!((double)lr * wd <= 1.0))
        snprintf(why, n, "lr * weight_decay = %g must be <= 1 (each step multiplies the weights by "
                 "1 - lr * weight_decay)", (double)lr * wd);
    else if (!(step < (double)FLT_MAX))
        snprintf(why, n, "the bias-corrected step size lr / (1 - beta1^%lld) = %g is not finite in fp32 "
                 "at this step; lower lr", (long long)t, step);
    else {
        *k = (moept__adamw_k){1.0f - lr * wd, b1, b2, (float)step, (float)sqrt(bc2), eps};
        return 1;
    }
    return 0;
}

/* Would the step write a non-finite moment or parameter? Bounds settle it
   at no cost where they can: every g^2 <= s (the CPU's max, a device's sum
   of squares), so the new |m| <= b1 mb + (1 - b1) sqrt(s) and v <= b2 vb +
   (1 - b2) s; with the decay in [0, 1], |p'| <= |p| + step |m| / eps, which
   rounds to a finite float while step |m| / eps is under half an ulp of
   FLT_MAX (2^103; 2^100 leaves room for rounding). Otherwise (gradients near
   fp32's limit, moments just loaded or moved) the executor probes: the step
   computed, nothing written. nb: the bounds after the step. */
static moept_status moept__adamw_guard(moept_layer *L, moept__adamw_k k, double s, double nb[2]) {
    const double lim = FLT_MAX / 4.0;
    nb[0] = k.b1 * L->opt_mb + (1.0 - k.b1) * sqrt(s); /* NaN (0 * INFINITY) fails the test: a probe */
    nb[1] = k.b2 * L->opt_vb + (1.0 - k.b2) * s;
    if (nb[0] <= lim && nb[1] <= lim && k.step * nb[0] / k.eps <= 0x1p100) return MOEPT_OK;
    int64_t bad = -1;
    moept_status st = L->ex->adamw_probe(L, k, &bad, &nb[0], &nb[1]);
    if (st || bad < 0) return st;
    const char *name = moept__param_of(L, bad / 4);
    const long long i = (long long)(bad / 4);
    if (bad % 4 == 3)
        return moept__fail(L, MOEPT_ERR_NUMERIC, "moept_adamw_step: the update of '%s' (flat element %lld) "
                           "would make it non-finite (the weight near fp32's limit, or lr / eps too large); "
                           "nothing changed", name, i);
    return moept__fail(L, MOEPT_ERR_NUMERIC, "moept_adamw_step: the gradient of '%s' (flat element %lld) is "
                       "too large for AdamW's fp32 %s moment (%s overflows); nothing changed: clip the "
                       "gradients (scale them to a norm from moept_grad_norm) or lower the loss scale",
                       name, i, bad % 4 == 2 ? "second" : "first",
                       bad % 4 == 2 ? "v = beta2 v + (1 - beta2) g^2" : "m = beta1 m + (1 - beta1) g");
}

/* Agreed over the EP and DP groups (a rank whose own experts' gradients are
   not finite must not leave the others a step ahead): arguments and every
   gradient checked, and the step itself (moept__adamw_guard), then all step
   or none does. */
moept_status moept_adamw_step(moept_layer *L, const moept_adamw *o) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_adamw_step: layer is NULL");
    if (!L->par.trains) return moept__no_grads(L, "moept_adamw_step");
    moept_adamw d = o ? *o : moept_adamw_default(0.0f);
    const int64_t t = L->opt.t + 1;
    moept__adamw_k k;
    char why[200];
    double s[2] = {0.0, 0.0}, g2 = 0.0, nb[2]; /* sums of squares [replicated, experts]; max g^2; bounds */
    moept_status local = MOEPT_OK;
    int64_t bad = -1;
    if (!o)
        local = moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_adamw_step: opt is NULL");
    else if (!moept__adamw_consts(o, t, &k, why, sizeof why))
        local = moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_adamw_step: %s", why);
    else local = moept__grads_refused(L, "moept_adamw_step");
    if (!local) local = moept__unsynced(L);
    if (!local) local = L->ex->grad_max ? L->ex->grad_max(L, &g2, &bad) : L->ex->grad_scan(L, s, &bad);
    if (!local && !L->ex->grad_max) g2 = s[0] + s[1];
    if (!local && bad >= 0)
        local = moept__fail(L, MOEPT_ERR_NUMERIC,
                            "moept_adamw_step: the gradient of '%s' is not finite (flat "
                            "element %lld); nothing changed",
                            moept__param_of(L, bad), (long long)bad);
    if (!local && !(local = MOEPT__EX(L, adamw_ready, L))) L->opt.held = 1; /* (zeros: as none) */
    if (!local) local = moept__adamw_guard(L, k, g2, nb);
    moept_status st = moept__agree_call(L, L->group, L->dp, local, MOEPT__CALL_ADAMW_STEP,
                                        moept__fnv_f32((const float[5]){d.lr, d.beta1, d.beta2, d.eps,
                                                                        d.weight_decay}, 5));
    if (st) return st;
    if ((st = L->ex->adamw(L, k))) return st;
    L->opt.t = t;
    L->opt_mb = nb[0];
    L->opt_vb = nb[1];
    L->jitter_micro = 0; /* the jitter's key: (AdamW steps, forwards since) */
    moept__stale_forwards(L, "moept_adamw_step");
    return MOEPT_OK;
}

/* ------------------------------------------------------------------------
   Executor glue: the CPU executor's table, and a device executor's view
   of the layer and its reports (moept.h's internal part)
   ------------------------------------------------------------------------ */
static moept_status moept__cpu_forward(moept_layer *L, moept__fstep *f) {
    moept_status st = moept__forward(L, f);
    moept__load_note();
    return st;
}

static moept_status moept__cpu_backward(moept_layer *L, const float *x, const float *dy, float *dx,
                                        const moept_backward_opts *o) {
    moept_status st = moept__backward(L, x, dy, dx, o);
    moept__load_note();
    return st;
}

/* the executable spec: every capability, nothing kept off the host */
static const moept__exec moept__cpu_exec = {
    .name = "the CPU executor",
    .caps = MOEPT__CAN_JITTER | MOEPT__CAN_INFERENCE | MOEPT__CAN_GRAD_BACKUP | MOEPT__CAN_AUX_SEQ |
            MOEPT__CAN_FSDP | MOEPT__CAN_MASK | MOEPT__CAN_RESHARD | MOEPT__CAN_HOST_STEPS | MOEPT__CAN_FP8,
    .forward = moept__cpu_forward,
    .backward = moept__cpu_backward,
    .sync_grads = moept__cpu_sync_grads,
    .grad_scan = moept__cpu_grad_scan,
    .grad_max = moept__cpu_grad_max,
    .adamw_ready = moept__cpu_adamw_ready,
    .adamw = moept__cpu_adamw,
    .adamw_probe = moept__cpu_adamw_probe,
};

/* A device executor's view of its layer, and its reports (moept.h's
   internal part): what moept_kernels.cu reads and writes of a layer goes
   through these. */
char *moept__errbuf(void) { return moept__thread_err; }

void moept__view_of(moept_layer *L, moept__view *v) {
    moept__fstate *sl = moept__last(L); /* a device layer's host copies: one state */
    memset(v, 0, sizeof *v);
    v->cfg = &L->cfg;
    v->D = L->D; v->F = L->F; v->E = L->E; v->K = L->K; v->S = L->S; v->H = L->H; v->HS = L->HS;
    v->El = L->El; v->Tmax = L->Tmax; v->C = L->C; v->n_params = L->par.n_params;
    v->P = L->P; v->rank = L->rank; v->nslots = L->nslots; v->act = L->act;
    v->capacity_factor = L->capacity_factor;
    v->ep = L->ep; v->dp = L->dp;
    v->xstate = &L->xstate;
    v->grads = L->par.trains; v->bias = L->par.bias;
    v->moments = L->opt.t > 0;
    v->off13 = L->par.o13; v->off2 = L->par.o2; v->offs13 = L->par.os13; v->offs2 = L->par.os2;
    v->offsg = L->par.osg;
    v->slot_of = L->plan.slot_of;
    v->lstat = sl->fwd.lstat;
    v->peer_rows = sl->xch.peer_rows;
    v->ids = sl->fwd.ids[sl->fwd.cur];
    v->wts = sl->fwd.wts[sl->fwd.cur];
    v->logits = sl->fwd.logits[sl->fwd.cur];
    v->dwts = sl->ws.dwts;
}

void moept__dev_agreed(moept_layer *L, int n) { L->agreed_calls += n; }

void moept__dev_held(moept_layer *L, int64_t allocations, int64_t bytes,
                     const int64_t device[MOEPT_MEM_NKINDS], int64_t host) {
    L->dev.allocations = allocations;
    L->dev.allocated_bytes = bytes;
    memcpy(L->dev.bytes, device, sizeof L->dev.bytes);
    L->dev.host = host;
    L->dev.workspace_bytes =
        device[MOEPT_MEM_MOMENTS] + device[MOEPT_MEM_CASTS] + device[MOEPT_MEM_WORKSPACE];
}

static void moept__dev_stats(moept_layer *L, const moept__dev_step *r) {
    L->stats.recv_capacity = r->recv_capacity;
    L->stats.recv_growths = r->recv_growths;
    L->stats.comm_seconds += r->comm_seconds;
    L->stats.bytes_sent += r->bytes_sent;
    L->stats.bytes_received += r->bytes_received;
}

/* the forward's statistics that come from the device (lstat and peer_rows
   were written by the executor) */
void moept__dev_step_done(moept_layer *L, const moept__dev_step *r) {
    moept__fstate *sl = moept__last(L);
    const int64_t E = L->E;
    for (int64_t e = 0; e < E; e++) {
        sl->fwd.sel_counts[e] = (int64_t)sl->fwd.lstat[sl->fwd.ls.sel + e];
        sl->fwd.aux_counts[e] = (int64_t)sl->fwd.lstat[sl->fwd.ls.auxc + e];
    }
    sl->fwd.counts_global = r->counts_global;
    sl->plan.N = r->N; sl->xch.R = r->R;
    sl->fwd.loss_T = r->loss_T; sl->fwd.aux_value = r->aux_value; sl->fwd.z_value = r->z_value;
    moept_stats *sts = &L->stats;
    sts->routed_rows = r->N;
    sts->masked_tokens = sl->fwd.T - r->valid;
    sts->dropped_rows = r->valid * L->K - r->N;
    sts->capacity = r->capacity;
    sts->rows_sent = r->rows_sent;
    sts->rows_received = r->rows_received;
    sts->aux_loss = (float)r->aux_value;
    sts->z_loss = (float)r->z_value;
}

void moept__dev_forward_done(moept_layer *L, const moept__dev_step *r) {
    moept__fstate *sl = moept__last(L);
    L->jitter_micro += r->f->jitter;
    sl->fwd.T = r->f->T; sl->fwd.valid = 1; sl->fwd.bwd_valid = 0; sl->fwd.eval = r->f->eval;
    moept_stats *sts = &L->stats;
    sts->bytes_sent = sts->bytes_received = 0;
    sts->comm_seconds = sts->dispatch_seconds = sts->combine_seconds = 0.0;
    moept__dev_stats(L, r);
    sts->steps++;
    sts->tokens = r->f->T;
    if (!r->deferred) moept__dev_step_done(L, r); /* sync-free: read when asked for (settle) */
}

void moept__dev_backward_done(moept_layer *L, const moept__dev_step *r, int last) {
    moept__fstate *sl = moept__last(L);
    moept__dev_stats(L, r);
    if (last) sl->fwd.bwd_valid = 1;
}

void moept__dev_count_jitter(moept_layer *L, int n) { L->jitter_micro += n; }

void moept__dev_grads_bad(moept_layer *L, int64_t bad, int64_t dl_bad, moept_status why_st, const char *why) {
    if (bad >= 0 && L->par.grads_dx_bad < 0) L->par.grads_dx_bad = bad;
    if (dl_bad >= 0 && L->par.grads_dl_bad < 0) L->par.grads_dl_bad = dl_bad;
    if (why_st && !L->par.grads_sf_bad) { /* the sync-free mode's checks, made on the device */
        L->par.grads_sf_bad = why_st;
        snprintf(L->par.grads_sf_why, sizeof L->par.grads_sf_why, "%s", why);
    }
}

#ifndef MOEPT_CUDA /* built with it, moept_kernels.cu defines these */
moept_status moept_create_cuda(const moept_config *cfg, moept_comm *ep, moept_comm *dp,
                               const moept_cuda_options *opt, moept_layer **out) {
    (void)cfg; (void)ep; (void)dp; (void)opt;
    if (out) *out = NULL;
    return moept__thread_fail(MOEPT_ERR_UNSUPPORTED,
                              "moept_create_cuda: moept.c was built without MOEPT_CUDA");
}

int moept_cuda_device_count(void) { return 0; }
#endif

moept_status moept_cuda_params(moept_layer *L, float **params, float **grads, int64_t *numel) {
    if (!L || !params || !grads || !numel)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_cuda_params: NULL argument");
    if (!L->ex->device_params)
        return moept__fail(L, MOEPT_ERR_UNSUPPORTED, "moept_cuda_params: not a CUDA layer");
    moept_status st = L->ex->device_params(L, params, grads);
    if (!st) *numel = L->par.n_params;
    return st;
}

moept_status moept_cuda_params_changed(moept_layer *L) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_cuda_params_changed: layer is NULL");
    if (!L->ex->params_changed)
        return moept__fail(L, MOEPT_ERR_UNSUPPORTED, "moept_cuda_params_changed: not a CUDA layer");
    moept_status st = L->ex->params_changed(L);
    if (!st) moept__stale_forwards(L, "moept_cuda_params_changed");
    return st;
}

/* ------------------------------------------------------------------------
   Placement and resharding
   ------------------------------------------------------------------------ */
moept_status moept_get_placement(const moept_layer *L, int32_t *rank_of) {
    if (!L || !rank_of)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_get_placement: NULL argument");
    for (int64_t e = 0; e < L->E; e++) rank_of[e] = (int32_t)(L->plan.slot_of[e] / L->El);
    return MOEPT_OK;
}

/* the pieces of local slot j in one of the three expert-shaped buffers
   (parameters, AdamW m, AdamW v): w13 rows and w2 rows */
static void moept__expert_parts(const moept_layer *L, float *base, int64_t j, float **w13, float **w2) {
    *w13 = base + L->par.o13 + j * L->H * L->D;
    *w2 = base + L->par.o2 + j * L->D * L->F;
}

/* moept_reshard's arguments: every expert to a rank in 0..P-1, E/P to each
   (per [P]: scratch) */
static moept_status moept__reshard_check(moept_layer *L, const int32_t *new_rank, int64_t *per) {
    const int64_t E = L->E, El = L->El, P = L->P;
    for (int64_t r = 0; r < P; r++) per[r] = 0;
    for (int64_t e = 0; e < E; e++) {
        if (new_rank[e] < 0 || new_rank[e] >= P)
            return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_reshard: expert %lld to rank %d, not in "
                               "0..%lld", (long long)e, new_rank[e], (long long)P - 1);
        per[new_rank[e]]++;
    }
    for (int64_t r = 0; r < P; r++)
        if (per[r] != El)
            return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_reshard: rank %lld would hold %lld "
                               "experts; every rank holds E/P = %lld", (long long)r, (long long)per[r],
                               (long long)El);
    return MOEPT_OK;
}

/* Kuhn's augmenting path from rank r over the pairs with edges left
   (first [P+1]: rank r's pairs, pto/pleft [pairs]); mate [P]: the pair
   matched into each rank, seen [P] */
static int moept__rs_augment(int64_t r, const int64_t *first, const int32_t *pfrom, const int32_t *pto,
                             const int64_t *pleft, int32_t *mate, uint8_t *seen) {
    for (int64_t i = first[r]; i < first[r + 1]; i++) {
        const int32_t s = pto[i];
        if (!pleft[i] || seen[s]) continue;
        seen[s] = 1;
        if (mate[s] < 0 || moept__rs_augment(pfrom[mate[s]], first, pfrom, pto, pleft, mate, seen)) {
            mate[s] = (int32_t)i;
            return 1;
        }
    }
    return 0;
}

/* The pairs (old rank, new rank) of the moves, rank by rank (first [P+1]),
   each with its count (pleft) and its experts in id order from ord[pnext];
   each rank's pair with itself holds its R - n_r idle rounds. *R: the most
   moves of one rank. ord [E], pfrom, pto, pleft, pnext [E + P] */
static int64_t moept__rs_pairs(const moept_layer *L, const int32_t *new_rank, int32_t *ord, int64_t *first,
                               int32_t *pfrom, int32_t *pto, int64_t *pleft, int64_t *pnext, int64_t *R) {
    const int64_t El = L->El, P = L->P;
    int64_t no = 0, np = 0;
    *R = 0;
    for (int64_t r = 0; r < P; r++) {
        const int64_t at = no;
        first[r] = np;
        for (int64_t j = 0; j < El; j++) { /* rank r's leaving experts by (new rank, id): insertion */
            const int32_t e = L->plan.expert_at[r * El + j];
            if (new_rank[e] == r) continue;
            int64_t i = no++;
            for (; i > at && (new_rank[ord[i - 1]] > new_rank[e] ||
                              (new_rank[ord[i - 1]] == new_rank[e] && ord[i - 1] > e)); i--)
                ord[i] = ord[i - 1];
            ord[i] = e;
        }
        for (int64_t i = at; i < no; i++) {
            if (i == at || new_rank[ord[i]] != new_rank[ord[i - 1]]) {
                pfrom[np] = (int32_t)r; pto[np] = new_rank[ord[i]]; pleft[np] = 0; pnext[np++] = i;
            }
            pleft[np - 1]++;
        }
        pfrom[np] = pto[np] = (int32_t)r; pleft[np] = -(no - at); pnext[np++] = -1; /* idle: R - n_r */
        *R = no - at > *R ? no - at : *R;
    }
    first[P] = np;
    for (int64_t i = 0; i < np; i++)
        if (pnext[i] < 0) pleft[i] += *R;
    return no;
}

/* moept_reshard's schedule, the same on every rank. Each expert whose owner
   changes is an edge from its old rank to its new one; a rank loses as many
   as it gains (E/P before and after), so with idle self-edges padding every
   rank to R each way the graph is R-regular and splits into R perfect
   matchings (Koenig's theorem): the rounds. In a round each rank sends one
   expert and receives one, or is idle, so a round's messages all meet in
   that round (none waits for a later one) and the arriving expert takes the
   place the leaving one frees: one expert of staging. go, come [R][P]: the
   expert rank r sends, receives in round k (-1: idle); nslot [E]: the new
   slots (an expert that stays keeps its own). scratch: int64 [4E + 5P + 3]. */
static void moept__reshard_plan(const moept_layer *L, const int32_t *new_rank, int64_t *scratch, int32_t *go,
                                int32_t *come, int32_t *nslot, int64_t *rounds, int64_t *moved) {
    const int64_t E = L->E, El = L->El, P = L->P;
    int64_t *first = scratch, *pleft = first + P + 1, *pnext = pleft + E + P;
    int32_t *ord = (int32_t *)(pnext + E + P), *pfrom = ord + E, *pto = pfrom + E + P, *mate = pto + E + P;
    uint8_t *seen = (uint8_t *)(mate + P);
    int64_t R;
    *moved = moept__rs_pairs(L, new_rank, ord, first, pfrom, pto, pleft, pnext, &R);
    *rounds = R;
    for (int64_t e = 0; e < E; e++)
        nslot[e] = new_rank[e] == L->plan.slot_of[e] / El ? L->plan.slot_of[e] : -1;
    for (int64_t k = 0; k < R; k++) {
        for (int64_t s = 0; s < P; s++) mate[s] = -1;
        for (int64_t r = 0; r < P; r++) { /* a regular graph: each finds its path (a perfect matching) */
            memset(seen, 0, (size_t)P);
            moept__rs_augment(r, first, pfrom, pto, pleft, mate, seen);
        }
        for (int64_t s = 0; s < P; s++) go[k * P + s] = come[k * P + s] = -1;
        for (int64_t s = 0; s < P; s++) {
            const int64_t i = mate[s];
            if (i < 0) continue; /* not reached (see above) */
            pleft[i]--;
            if (pfrom[i] != s) go[k * P + pfrom[i]] = come[k * P + s] = ord[pnext[i]++];
        }
        for (int64_t s = 0; s < P; s++) /* into the place its rank's leaving expert frees */
            if (come[k * P + s] >= 0) nslot[come[k * P + s]] = L->plan.slot_of[go[k * P + s]];
    }
}

/* The host's rounds: in round k this rank sends go's expert (parameters,
   then AdamW m and v where allocated) and receives come's through stage
   [H*D + D*F] into the slot go's vacates. Every rank calls the comm in
   every round. Bytes moved add to sent and recvd. */
static moept_status moept__reshard_rounds(moept_layer *L, const moept__moves *mv, float *stage, int64_t *sent,
                                          int64_t *recvd) {
    const int64_t El = L->El, P = L->P, me = L->rank, n13 = L->H * L->D, n2 = L->D * L->F;
    float *bufs[3] = {L->par.params, L->opt.m, L->opt.v};
    for (int64_t k = 0; k < mv->rounds; k++) {
        const int32_t go = mv->go[k * P + me], come = mv->come[k * P + me];
        for (int b = 0; b < 3; b++) {
            /* the moments move once a step made them (agreed state: a rank's own rejected first step
               may have allocated its zeros alone) */
            int have = b == 0 || (L->opt.t > 0 && bufs[b] != NULL);
            moept_p2p s[2], r[2];
            int ns = 0, nr = 0;
            float *w13 = NULL, *w2 = NULL;
            if (have && go >= 0) {
                moept__expert_parts(L, bufs[b], L->plan.slot_of[go] % El, &w13, &w2);
                int to = (int)mv->new_rank[go];
                s[ns++] = (moept_p2p){to, w13, n13 * (int64_t)sizeof(float)};
                s[ns++] = (moept_p2p){to, w2, n2 * (int64_t)sizeof(float)};
                int from = (int)(L->plan.slot_of[come] / El);
                r[nr++] = (moept_p2p){from, stage, n13 * (int64_t)sizeof(float)};
                r[nr++] = (moept_p2p){from, stage + n13, n2 * (int64_t)sizeof(float)};
            }
            double t0 = moept__now();
            moept_status st = L->ep->p2p(L->ep, s, ns, r, nr);
            L->stats.comm_seconds += moept__now() - t0;
            if (st) return moept__fail(L, st, "moept_reshard: round %lld: %s", (long long)k, L->ep->err);
            for (int i = 0; i < ns; i++) *sent += s[i].bytes;
            for (int i = 0; i < nr; i++) *recvd += r[i].bytes;
            if (nr) { /* into the slot go vacated */
                memcpy(w13, stage, (size_t)n13 * sizeof(float));
                memcpy(w2, stage + n13, (size_t)n2 * sizeof(float));
            }
        }
    }
    return MOEPT_OK;
}

/* moept_reshard after its agreement: the placement and the tables built
   from it, gradients zeroed, the report */
static void moept__reshard_commit(moept_layer *L, const moept__moves *mv, int64_t moved, int64_t sent,
                                  int64_t recvd, moept_reshard_report *rep) {
    for (int64_t e = 0; e < L->E; e++) {
        L->plan.slot_of[e] = mv->nslot[e];
        L->plan.expert_at[mv->nslot[e]] = (int32_t)e;
    }
    moept__build_table(L);
    if (L->par.grads) memset(L->par.grads, 0, (size_t)L->par.n_params * sizeof(float));
    moept__slots_invalidate(L); /* the saved forwards' plans used the old placement */
    L->opt_mb = L->opt_vb = INFINITY; /* other experts' moments came in: the next step probes */
    if (rep) {
        rep->experts_moved = moved; rep->bytes_sent = sent; rep->bytes_received = recvd;
        rep->rounds = mv->rounds; rep->extra_bytes = (L->H * L->D + L->D * L->F) * (int64_t)sizeof(float);
    }
}

moept_status moept_reshard(moept_layer *L, const int32_t *new_rank, moept_reshard_report *rep) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_reshard: layer is NULL");
    if (L->fsdp)
        return moept__fail(L, MOEPT_ERR_UNSUPPORTED, "moept_reshard: not in fsdp mode (the expert-parallel "
                           "layer is the one that saves, loads and reshards)");
    char why[MOEPT__ERRLEN];
    if (moept__ex_refuse(L->ex, MOEPT__CAN_RESHARD, "moept_reshard", why))
        return moept__fail(L, MOEPT_ERR_UNSUPPORTED, "%s", why);
    const int64_t E = L->E, P = L->P, me = L->rank;
    moept_status local = MOEPT_OK, st;
    if (!new_rank) local = moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_reshard: new_rank is NULL");
    int64_t *per = moept__alloc(NULL, (size_t)(4 * E + 5 * P + 3) * sizeof(int64_t)); /* checks', plan's */
    int32_t *nslot = moept__alloc(NULL, (size_t)(3 * E) * sizeof(int32_t)); /* nslot [E], go, come [R][P] */
    float *stage = L->ex->reshard ? NULL : moept__alloc(NULL, (size_t)(L->H * L->D + L->D * L->F) * 4);
    if (!local && (!per || !nslot || (!stage && !L->ex->reshard)))
        local = moept__fail(L, MOEPT_ERR_OUT_OF_MEMORY, "moept_reshard: out of memory");
    if (!local) local = moept__reshard_check(L, new_rank, per);
    int64_t moved = 0, sent = 0, recvd = 0;
    moept__moves mv = {new_rank, nslot, nslot + E, nslot + 2 * E, 0, 0};
    if (!local) {
        moept__reshard_plan(L, new_rank, per, nslot + E, nslot + 2 * E, nslot, &mv.rounds, &moved);
        for (int64_t k = 0; k < mv.rounds; k++) mv.n += mv.go[k * P + me] >= 0;
        local = MOEPT__EX(L, reshard_ready, L, &mv);
    }
    /* every rank of the layout must pass the same table (DP replicas hold alike), and be at the
       same AdamW step: what moves (the moments too, once a step made them) pairs send with receive */
    uint64_t fp = new_rank ? moept__fnv(MOEPT__FNV0, new_rank, (size_t)E * sizeof(int32_t)) : 0;
    fp = moept__fnv(fp, &L->opt.t, sizeof L->opt.t);
    if ((st = moept__agree_call(L, L->group, L->dp, local, MOEPT__CALL_RESHARD, fp))) local = st;
    if (L->ex->reshard) { /* released when not agreed */
        if ((st = L->ex->reshard(L, &mv, !local, &sent, &recvd)) && !local) local = st;
    } else if (!local) {
        local = moept__reshard_rounds(L, &mv, stage, &sent, &recvd);
    }
    if (!local) moept__reshard_commit(L, &mv, moved, sent, recvd, rep);
    MOEPT_FREE(per); MOEPT_FREE(nslot); MOEPT_FREE(stage);
    return local;
}

/* ------------------------------------------------------------------------
   Communication backends
   ------------------------------------------------------------------------ */
static moept_status moept__comm_fail(moept_comm *c, moept_status s, const char *fmt, ...) {
    va_list ap; va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    return s;
}

static size_t moept__dtype_size(moept_dtype t) {
    return t == MOEPT_DTYPE_F32 || t == MOEPT_DTYPE_I32                            ? 4
        : t == MOEPT_DTYPE_F16 || t == MOEPT_DTYPE_BF16                            ? 2
        : t == MOEPT_DTYPE_U8 || t == MOEPT_DTYPE_BOOL || t == MOEPT_DTYPE_F8_E4M3 ? 1
                                                                                   : 8;
}

/* sums n elements of src into dst */
static void moept__sum_into(void *dst, const void *src, int64_t n, moept_dtype t) {
    if (t == MOEPT_DTYPE_F32) {
        float *d = dst;
        const float *s = src;
        for (int64_t i = 0; i < n; i++) d[i] += s[i];
    } else if (t == MOEPT_DTYPE_F64) {
        double *d = dst;
        const double *s = src;
        for (int64_t i = 0; i < n; i++) d[i] += s[i];
    } else {
        int64_t *d = dst;
        const int64_t *s = src;
        for (int64_t i = 0; i < n; i++) d[i] += s[i];
    }
}

void moept_comm_destroy(moept_comm *c) {
    if (c && c->destroy) c->destroy(c);
}

/* ---- the caller's collectives (moept_comm_custom): moept's exchanges in
   the plain forms a framework has, its pieces staged only where they are
   not already packed per peer in rank order ---- */
typedef struct moept__cust {
    moept_comm_ops ops;
    void *ctx;
    int64_t *bytes;     /* [2 size]: this exchange's bytes to, then from, each peer */
    char *stage;        /* [cap] the packed send, then the packed receive, where staged */
    int64_t cap;
} moept__cust;

static moept_status moept__cust_rc(moept_comm *c, int rc, const char *op) {
    return rc ? moept__comm_fail(c, MOEPT_ERR_COMM, "moept_comm_custom: the caller's %s returned %d", op, rc)
              : MOEPT_OK;
}

/* n pieces already packed: each nonempty one right after the last */
static int moept__cust_packed(const moept_seg *s, int64_t n) {
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        if (s[i].count && s[i].offset != at) return 0;
        at += s[i].count;
    }
    return 1;
}

/* the pieces of buf (element size es) to or from a packed stage */
static void moept__cust_copy(char *stage, char *buf, const moept_seg *s, int64_t n, int es, int to_stage) {
    for (int64_t i = 0, at = 0; i < n; at += s[i].count * es, i++)
        if (to_stage) memcpy(stage + at, buf + s[i].offset * es, (size_t)(s[i].count * es));
        else memcpy(buf + s[i].offset * es, stage + at, (size_t)(s[i].count * es));
}

static moept_status moept__cust_alltoallv(moept_comm *c, const void *send, const moept_seg *ss, void *recv,
                                          const moept_seg *rs, int nseg, int es) {
    moept__cust *u = c->ctx;
    const int P = c->size;
    const int64_t n = (int64_t)P * nseg;
    int64_t ns = 0, nr = 0;
    for (int q = 0; q < P; q++) {
        u->bytes[q] = u->bytes[P + q] = 0;
        for (int s = 0; s < nseg; s++) {
            u->bytes[q] += ss[q * nseg + s].count * es;
            u->bytes[P + q] += rs[q * nseg + s].count * es;
        }
        ns += u->bytes[q];
        nr += u->bytes[P + q];
    }
    const int sp = moept__cust_packed(ss, n), rp = moept__cust_packed(rs, n);
    const int64_t need = (sp ? 0 : ns) + (rp ? 0 : nr);
    if (need > u->cap) {
        char *g = moept__alloc(NULL, (size_t)need);
        if (!g) return moept__comm_fail(c, MOEPT_ERR_OUT_OF_MEMORY, "moept_comm_custom: out of memory");
        MOEPT_FREE(u->stage);
        u->stage = g; u->cap = need;
    }
    char *sb = sp ? (char *)send : u->stage, *rb = rp ? (char *)recv : u->stage + (sp ? 0 : ns);
    if (!sp) moept__cust_copy(sb, (char *)send, ss, n, es, 1);
    moept_status st = moept__cust_rc(c, u->ops.alltoallv(u->ctx, sb, u->bytes, rb, u->bytes + P),
                                     "alltoallv");
    if (!st && !rp) moept__cust_copy(rb, recv, rs, n, es, 0);
    return st;
}

static moept_status moept__cust_allreduce(moept_comm *c, void *buf, int64_t count, moept_dtype dtype) {
    moept__cust *u = c->ctx;
    return moept__cust_rc(c, u->ops.allreduce(u->ctx, buf, count, dtype), "allreduce");
}

static moept_status moept__cust_allgather(moept_comm *c, const void *send, void *recv, int64_t bytes) {
    moept__cust *u = c->ctx;
    return moept__cust_rc(c, u->ops.allgather(u->ctx, send, recv, bytes), "allgather");
}

static moept_status moept__cust_p2p(moept_comm *c, const moept_p2p *sends, int nsend, const moept_p2p *recvs,
                                    int nrecv) {
    moept__cust *u = c->ctx;
    if (!u->ops.p2p)
        return moept__comm_fail(c, MOEPT_ERR_UNSUPPORTED, "moept_comm_custom: the caller gave no p2p op");
    return moept__cust_rc(c, u->ops.p2p(u->ctx, sends, nsend, recvs, nrecv), "p2p");
}

static moept_status moept__cust_barrier(moept_comm *c) {
    moept__cust *u = c->ctx;
    return moept__cust_rc(c, u->ops.barrier(u->ctx), "barrier");
}

static void moept__cust_destroy(moept_comm *c) {
    moept__cust *u = c->ctx;
    MOEPT_FREE(u->stage);
    MOEPT_FREE(u->bytes);
    MOEPT_FREE(u);
    MOEPT_FREE(c);
}

moept_status moept_comm_custom(const moept_comm_ops *ops, void *ctx, int rank, int size, moept_comm **out) {
    if (!out) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_comm_custom: out is NULL");
    *out = NULL;
    if (!ops || !ops->alltoallv || !ops->allreduce || !ops->allgather)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT,
                                  "moept_comm_custom: ops, with alltoallv, allreduce and allgather, is "
                                  "required");
    if (size < 1 || rank < 0 || rank >= size)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_comm_custom: rank %d of size %d", rank,
                                  size);
    moept_comm *c = moept__alloc(NULL, sizeof *c);
    moept__cust *u = moept__alloc(NULL, sizeof *u);
    int64_t *bytes = moept__alloc(NULL, (size_t)(2 * size) * sizeof(int64_t));
    if (!c || !u || !bytes) {
        MOEPT_FREE(c);
        MOEPT_FREE(u);
        MOEPT_FREE(bytes);
        return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "moept_comm_custom: out of memory");
    }
    memset(c, 0, sizeof *c);
    memset(u, 0, sizeof *u);
    u->ops = *ops; u->ctx = ctx; u->bytes = bytes;
    c->rank = rank; c->size = size; c->ctx = u;
    c->alltoallv = moept__cust_alltoallv;
    c->allreduce = moept__cust_allreduce;
    c->allgather = moept__cust_allgather;
    c->p2p = moept__cust_p2p;
    c->barrier = ops->barrier ? moept__cust_barrier : NULL;
    c->destroy = moept__cust_destroy;
    *out = c;
    return MOEPT_OK;
}

/* ---- threads: ranks are threads of one process; a collective publishes
   each rank's buffers and every receiver copies straight from the sender's
   memory (one copy per byte, no staging). ---- */
#include <pthread.h>
#include <time.h>

typedef struct moept__slot {
    const void *send; const moept_seg *send_segs;
    const void *buf;
    const moept_p2p *sends; int nsend;
    /* posted non-blocking exchanges, by slot */
    const void *asend[MOEPT_COMM_SLOTS]; const moept_seg *asegs[MOEPT_COMM_SLOTS];
    void *arecv[MOEPT_COMM_SLOTS]; const moept_seg *arsegs[MOEPT_COMM_SLOTS];
    int anseg[MOEPT_COMM_SLOTS], aes[MOEPT_COMM_SLOTS];
} moept__slot;

struct moept_thread_group {
    int size, timeout_ms;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived, broken;
    uint64_t generation;
    moept__slot *slots;      /* [size] */
    char *scratch;           /* allreduce result, grows geometrically */
    size_t scratch_bytes;
    int scratch_fail;
    moept_comm *comms;       /* [size] */
    uint64_t *seen;          /* [size] the generation + 1 each rank last arrived in */
    int tag, tag_rank;       /* what the generation's first arrival is in (MOEPT__AT_*), and its rank */
    unsigned char *claimed;  /* [size] ranks with a live moept_comm_cuda_threads comm */
    char why[200];           /* why the group broke */
};

/* what a rank arrives at a barrier for: a collective, or a destroy (of a
   moept_comm_cuda_threads comm); the two never meet */
enum { MOEPT__AT_CALL, MOEPT__AT_DESTROY };

/* under g->mu: the group breaks for good, the first reason kept */
static void moept__break(moept_thread_group *g, const char *fmt, ...) {
    if (!g->broken) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(g->why, sizeof g->why, fmt, ap);
        va_end(ap);
        g->broken = 1;
    }
    pthread_cond_broadcast(&g->cv);
}

/* under g->mu, at a timeout: the ranks that did not arrive in generation gen */
static void moept__break_missing(moept_thread_group *g, uint64_t gen) {
    char list[120] = "";
    int n = 0, len = 0;
    for (int r = 0; r < g->size; r++)
        if (g->seen[r] != gen + 1 && len < (int)sizeof list - 16)
            len += snprintf(list + len, sizeof list - (size_t)len, "%s%d", n++ ? ", " : "", r);
    moept__break(g, "rank%s %s did not arrive within %d ms (group broken)", n > 1 ? "s" : "", list,
                 g->timeout_ms);
}

/* Returns 0, or -1 if the group is broken (g->why): a rank that timed out,
   a rank two threads arrive as, a destroy that meets a peer's call. Every
   later collective then fails at once instead of hanging or mixing data. */
static int moept__barrier(moept_thread_group *g, int rank, int tag) {
    pthread_mutex_lock(&g->mu);
    uint64_t gen = g->generation;
    const int dtor = tag == MOEPT__AT_DESTROY; /* on a mismatch: this rank destroys, the first calls */
    if (!g->broken && g->seen[rank] == gen + 1)
        moept__break(g, "rank %d claimed twice (two threads call as it)", rank);
    else if (!g->broken && g->arrived && g->tag != tag)
        moept__break(g, "rank %d destroyed the comm while rank %d was in a call (destroy is collective)",
                     dtor ? rank : g->tag_rank, dtor ? g->tag_rank : rank);
    if (g->broken) { pthread_mutex_unlock(&g->mu); return -1; }
    g->seen[rank] = gen + 1;
    if (!g->arrived) g->tag = tag, g->tag_rank = rank;
    if (++g->arrived == g->size) {
        g->arrived = 0;
        g->generation++;
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
        return 0;
    }
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    int64_t ns = dl.tv_nsec + (int64_t)(g->timeout_ms % 1000) * 1000000;
    dl.tv_sec += g->timeout_ms / 1000 + ns / 1000000000;
    dl.tv_nsec = ns % 1000000000;
    while (gen == g->generation && !g->broken)
        if (pthread_cond_timedwait(&g->cv, &g->mu, &dl) == ETIMEDOUT && gen == g->generation)
            moept__break_missing(g, gen);
    int ok = gen != g->generation;
    pthread_mutex_unlock(&g->mu);
    return ok ? 0 : -1;
}

#define MOEPT__GROUP(c) ((moept_thread_group *)(c)->ctx)
#define MOEPT__BARRIER(c)                                                                                    \
    do {                                                                                                     \
        if (moept__barrier(MOEPT__GROUP(c), (c)->rank, MOEPT__AT_CALL))                                     \
            return moept__comm_fail(c, MOEPT_ERR_COMM, "threads comm: rank %d: %s", (c)->rank,              \
                                    MOEPT__GROUP(c)->why);                                                   \
    } while (0)

static moept_status moept__thr_alltoallv(moept_comm *c, const void *send, const moept_seg *send_segs,
                                         void *recv, const moept_seg *recv_segs, int nseg, int es) {
    moept_thread_group *g = MOEPT__GROUP(c);
    g->slots[c->rank].send = send;
    g->slots[c->rank].send_segs = send_segs;
    MOEPT__BARRIER(c);
    int bad = -1;
    for (int p = 0; p < c->size; p++)
        for (int s = 0; s < nseg; s++) {
            const moept_seg *ss = &g->slots[p].send_segs[c->rank * nseg + s];
            const moept_seg *rs = &recv_segs[p * nseg + s];
            if (ss->count != rs->count) { bad = p; continue; }
            if (rs->count)
                memcpy((char *)recv + rs->offset * es, (const char *)g->slots[p].send + ss->offset * es,
                       (size_t)(rs->count * es));
        }
    MOEPT__BARRIER(c);
    if (bad >= 0)
        return moept__comm_fail(
            c, MOEPT_ERR_COMM, "threads alltoallv: rank %d expected other counts from rank %d", c->rank, bad);
    return MOEPT_OK;
}

static moept_status moept__thr_allreduce(moept_comm *c, void *buf, int64_t count, moept_dtype t) {
    moept_thread_group *g = MOEPT__GROUP(c);
    size_t es = moept__dtype_size(t), bytes = (size_t)count * es;
    if (c->rank == 0 && bytes > g->scratch_bytes) { /* nobody reads scratch between collectives */
        size_t nb = bytes > 2 * g->scratch_bytes ? bytes : 2 * g->scratch_bytes;
        char *p = moept__alloc(NULL, nb);
        if (p) { MOEPT_FREE(g->scratch); g->scratch = p; g->scratch_bytes = nb; g->scratch_fail = 0; }
        else g->scratch_fail = 1;
    }
    g->slots[c->rank].buf = buf;
    MOEPT__BARRIER(c);
    if (!g->scratch_fail) { /* each rank sums a slice, ranks in order: deterministic */
        int64_t lo = count * c->rank / c->size, hi = count * (c->rank + 1) / c->size;
        if (hi > lo) {
            memcpy(g->scratch + lo * es, (const char *)g->slots[0].buf + lo * es, (size_t)(hi - lo) * es);
            for (int p = 1; p < c->size; p++)
                moept__sum_into(g->scratch + lo * es, (const char *)g->slots[p].buf + lo * es, hi - lo, t);
        }
    }
    MOEPT__BARRIER(c);
    int fail = g->scratch_fail;
    if (!fail && bytes) memcpy(buf, g->scratch, bytes);
    MOEPT__BARRIER(c);
    if (fail)
        return moept__comm_fail(c, MOEPT_ERR_OUT_OF_MEMORY, "threads allreduce: out of memory for %zu bytes",
                                bytes);
    return MOEPT_OK;
}

static moept_status moept__thr_allgather(moept_comm *c, const void *send, void *recv, int64_t bytes) {
    moept_thread_group *g = MOEPT__GROUP(c);
    g->slots[c->rank].buf = send;
    MOEPT__BARRIER(c);
    for (int p = 0; p < c->size; p++)
        if (bytes) memcpy((char *)recv + (int64_t)p * bytes, g->slots[p].buf, (size_t)bytes);
    MOEPT__BARRIER(c);
    return MOEPT_OK;
}

static moept_status moept__thr_p2p(moept_comm *c, const moept_p2p *sends, int nsend,
                                   const moept_p2p *recvs, int nrecv) {
    moept_thread_group *g = MOEPT__GROUP(c);
    g->slots[c->rank].sends = sends;
    g->slots[c->rank].nsend = nsend;
    MOEPT__BARRIER(c);
    int bad = -1;
    for (int i = 0; i < nrecv; i++) {
        int p = recvs[i].peer, nth = 0;
        for (int j = 0; j < i; j++) nth += recvs[j].peer == p;
        const moept_p2p *m = NULL;
        if (p >= 0 && p < c->size)
            for (int j = 0; j < g->slots[p].nsend && !m; j++)
                if (g->slots[p].sends[j].peer == c->rank && nth-- == 0) m = &g->slots[p].sends[j];
        if (!m || m->bytes != recvs[i].bytes) { bad = i; continue; }
        if (m->bytes) memcpy(recvs[i].buf, m->buf, (size_t)m->bytes);
    }
    MOEPT__BARRIER(c);
    if (bad >= 0)
        return moept__comm_fail(
            c, MOEPT_ERR_COMM,
            "threads p2p: rank %d receive %d from rank %d has no matching send of %lld bytes", c->rank, bad,
            recvs[bad].peer, (long long)recvs[bad].bytes);
    return MOEPT_OK;
}


/* Threads, non-blocking: the post publishes this rank's buffers; the wait
   is collective (each rank copies its pieces from every peer's posted send
   between two barriers). One thread per rank has nothing to run the copies
   meanwhile, so this orders the work without overlapping it. */
static moept_status moept__thr_ialltoallv(moept_comm *c, const void *send, const moept_seg *ss, void *recv,
                                          const moept_seg *rs, int nseg, int es, int slot) {
    if (slot < 0 || slot >= MOEPT_COMM_SLOTS)
        return moept__comm_fail(c, MOEPT_ERR_INVALID_ARGUMENT, "threads ialltoallv: slot %d", slot);
    moept__slot *me = &MOEPT__GROUP(c)->slots[c->rank];
    me->asend[slot] = send; me->asegs[slot] = ss;
    me->arecv[slot] = recv; me->arsegs[slot] = rs;
    me->anseg[slot] = nseg; me->aes[slot] = es;
    return MOEPT_OK;
}

static moept_status moept__thr_wait(moept_comm *c, int slot) {
    moept_thread_group *g = MOEPT__GROUP(c);
    if (slot < 0 || slot >= MOEPT_COMM_SLOTS)
        return moept__comm_fail(c, MOEPT_ERR_INVALID_ARGUMENT, "threads wait: slot %d", slot);
    MOEPT__BARRIER(c);
    const moept__slot *me = &g->slots[c->rank];
    int nseg = me->anseg[slot], es = me->aes[slot], bad = -1;
    for (int p = 0; p < c->size; p++)
        for (int s = 0; s < nseg; s++) {
            const moept_seg *ss = &g->slots[p].asegs[slot][c->rank * nseg + s];
            const moept_seg *rs = &me->arsegs[slot][p * nseg + s];
            if (ss->count != rs->count) { bad = p; continue; }
            if (rs->count)
                memcpy((char *)me->arecv[slot] + rs->offset * es,
                       (const char *)g->slots[p].asend[slot] + ss->offset * es, (size_t)(rs->count * es));
        }
    MOEPT__BARRIER(c);
    if (bad >= 0)
        return moept__comm_fail(c, MOEPT_ERR_COMM, "threads wait: rank %d expected other counts from rank %d",
                                c->rank, bad);
    return MOEPT_OK;
}

static moept_status moept__thr_barrier(moept_comm *c) {
    MOEPT__BARRIER(c);
    return MOEPT_OK;
}

/* Threads share the heap: each rank's block is its own allocation (the
   handle; the block is it rounded up to 64 bytes), shown to all. */
static moept_status moept__thr_shm_alloc(moept_comm *c, int64_t bytes, void **all, void **handle) {
    char *raw = bytes >= 0 ? moept__alloc(NULL, (size_t)bytes + 64) : NULL;
    void *mine = raw ? raw + (64 - (uintptr_t)raw % 64) % 64 : NULL;
    int64_t bad = raw == NULL;
    moept_status st = moept__thr_allreduce(c, &bad, 1, MOEPT_DTYPE_I64);
    if (!st && bad)
        st = moept__comm_fail(c, MOEPT_ERR_OUT_OF_MEMORY, "threads shm_alloc: %lld rank(s) out of memory",
                              (long long)bad);
    if (!st) st = moept__thr_allgather(c, &mine, all, (int64_t)sizeof(void *));
    if (st) { MOEPT_FREE(raw); return st; }
    *handle = raw;
    return MOEPT_OK;
}

static void moept__thr_shm_free(moept_comm *c, void *handle) { (void)c; MOEPT_FREE(handle); }

static void moept__thr_destroy(moept_comm *c) { (void)c; /* owned by the group */ }

moept_status moept_thread_group_create(int size, int timeout_ms, moept_thread_group **out) {
    if (!out) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_thread_group_create: out is NULL");
    *out = NULL;
    if (size < 1 || size > 4096)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT,
                                  "moept_thread_group_create: size %d not in 1..4096", size);
    if (timeout_ms < 0)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_thread_group_create: timeout_ms < 0");
    moept_thread_group *g = moept__alloc(NULL, sizeof *g);
    if (!g) return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "moept_thread_group_create: out of memory");
    memset(g, 0, sizeof *g);
    g->size = size;
    g->timeout_ms = timeout_ms ? timeout_ms : 600000;
    g->slots = moept__alloc(NULL, (size_t)size * sizeof *g->slots);
    g->comms = moept__alloc(NULL, (size_t)size * sizeof *g->comms);
    g->seen = moept__alloc(NULL, (size_t)size * sizeof *g->seen);
    g->claimed = moept__alloc(NULL, (size_t)size);
    if (!g->slots || !g->comms || !g->seen || !g->claimed) {
        MOEPT_FREE(g->slots); MOEPT_FREE(g->comms);
        MOEPT_FREE(g->seen); MOEPT_FREE(g->claimed); MOEPT_FREE(g);
        return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "moept_thread_group_create: out of memory");
    }
    memset(g->slots, 0, (size_t)size * sizeof *g->slots);
    memset(g->seen, 0, (size_t)size * sizeof *g->seen);
    memset(g->claimed, 0, (size_t)size);
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    for (int r = 0; r < size; r++) {
        moept_comm *c = &g->comms[r];
        memset(c, 0, sizeof *c);
        c->rank = r; c->size = size; c->ctx = g;
        c->alltoallv = moept__thr_alltoallv;
        c->allreduce = moept__thr_allreduce;
        c->allgather = moept__thr_allgather;
        c->p2p = moept__thr_p2p;
        c->barrier = moept__thr_barrier;
        c->shm_alloc = moept__thr_shm_alloc;
        c->shm_free = moept__thr_shm_free;
        c->ialltoallv = moept__thr_ialltoallv;
        c->wait = moept__thr_wait;
        c->destroy = moept__thr_destroy;
    }
    *out = g;
    return MOEPT_OK;
}

void moept_thread_group_destroy(moept_thread_group *g) {
    if (!g) return;
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    MOEPT_FREE(g->scratch);
    MOEPT_FREE(g->slots);
    MOEPT_FREE(g->comms);
    MOEPT_FREE(g->seen);
    MOEPT_FREE(g->claimed);
    MOEPT_FREE(g);
}

moept_status moept_comm_threads(moept_thread_group *g, int rank, moept_comm **out) {
    if (!g || !out)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_comm_threads: NULL argument");
    if (rank < 0 || rank >= g->size)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_comm_threads: rank %d not in 0..%d",
                                  rank, g->size - 1);
    *out = &g->comms[rank];
    return MOEPT_OK;
}

/* moept_comm_cuda_threads' rank: one live comm a rank. A second claim
   breaks the group (the first claimer and its peers must not go on with a
   rank two threads play); a broken group is refused. */
moept_status moept__thr_claim(moept_thread_group *g, int rank) {
    moept_status st = MOEPT_OK;
    char why[sizeof g->why];
    pthread_mutex_lock(&g->mu);
    if (g->broken) st = MOEPT_ERR_COMM;
    else if (g->claimed[rank]) {
        moept__break(g, "rank %d claimed twice (two threads made its moept_comm_cuda_threads comm)", rank);
        st = MOEPT_ERR_INVALID_ARGUMENT;
    } else g->claimed[rank] = 1;
    snprintf(why, sizeof why, "%s", g->why);
    pthread_mutex_unlock(&g->mu);
    return st ? moept__thread_fail(st, "moept_comm_cuda_threads: rank %d: %s", rank, why) : MOEPT_OK;
}

void moept__thr_release(moept_thread_group *g, int rank) {
    pthread_mutex_lock(&g->mu);
    g->claimed[rank] = 0;
    pthread_mutex_unlock(&g->mu);
}

/* moept_comm_cuda_threads' destroy: a barrier that a peer's call breaks
   (both fail, g->why says so). 0: every rank met it. */
int moept__thr_destroy_barrier(moept_comm *host) {
    return moept__barrier(MOEPT__GROUP(host), host->rank, MOEPT__AT_DESTROY);
}

/* ---- MPI ---- */
#ifdef MOEPT_MPI
#if defined(__linux__)
#include <sys/mman.h>
#endif
typedef struct moept__mpi {
    MPI_Comm comm;
    MPI_Datatype elem[2];    /* 4- and 8-byte elements, as bytes */
    MPI_Request *reqs; int64_t nreqs_cap;
    MPI_Request *preq[MOEPT_COMM_SLOTS]; int64_t npreq[MOEPT_COMM_SLOTS], pcap[MOEPT_COMM_SLOTS]; /* posted */
    int pbad[MOEPT_COMM_SLOTS]; /* a posted exchange's self piece whose counts differ, or -1 */
    int *cnt, *dsp;          /* [4][size] int counts/displacements for MPI_Alltoallv */
    char *scratch;           /* allreduce slices, grows geometrically */
    size_t scratch_bytes;
    int *blen; MPI_Aint *bdisp; int64_t bcap; /* [bcap] a rows type's blocks (alltoallv_rows) */
} moept__mpi;

/* elements per message piece, and the largest count handed to MPI as an
   int; tests shrink both to run the chunked paths on small data */
#ifndef MOEPT__MPI_CHUNK
#define MOEPT__MPI_CHUNK ((int64_t)1 << 30)
#endif
#ifndef MOEPT__MPI_INT_MAX
#define MOEPT__MPI_INT_MAX INT_MAX
#endif

static moept_status moept__mpi_err(moept_comm *c, int rc, const char *call, int line) {
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    MPI_Error_string(rc, s, &n);
    return moept__comm_fail(c, MOEPT_ERR_COMM, "%s failed (moept.c:%d): %s", call, line, s);
}
#define MOEPT__MPI(c, call)                                                     \
    do {                                                                        \
        int rc_ = (call);                                                       \
        if (rc_ != MPI_SUCCESS) return moept__mpi_err(c, rc_, #call, __LINE__); \
    } while (0)

static int moept__mpi_reqs(moept__mpi *m, int64_t n) {
    if (n <= m->nreqs_cap) return 1;
    int64_t cap = n > 2 * m->nreqs_cap ? n : 2 * m->nreqs_cap;
    MPI_Request *r = moept__alloc(NULL, (size_t)cap * sizeof *r);
    if (!r) return 0;
    MOEPT_FREE(m->reqs);
    m->reqs = r; m->nreqs_cap = cap;
    return 1;
}

/* Piecewise exchanges: each piece as messages of at most MOEPT__MPI_CHUNK
   elements. How many requests the pieces of one exchange take: */
static int64_t moept__mpi_nmsg(const moept_seg *ss, const moept_seg *rs, int npieces) {
    int64_t n = 0;
    for (int i = 0; i < npieces; i++)
        n += (ss[i].count + MOEPT__MPI_CHUNK - 1) / MOEPT__MPI_CHUNK +
             (rs[i].count + MOEPT__MPI_CHUNK - 1) / MOEPT__MPI_CHUNK;
    return n;
}

/* posts the receives of every piece (peer i / nseg) into reqs[*n..] */
static moept_status moept__mpi_post_recvs(moept_comm *c, void *recv, const moept_seg *rs, int nseg, int es,
                                          int tag, MPI_Request *reqs, int64_t *n) {
    moept__mpi *m = c->ctx;
    for (int i = 0; i < c->size * nseg; i++)
        for (int64_t o = 0; o < rs[i].count && i / nseg != c->rank; o += MOEPT__MPI_CHUNK) {
            int64_t k = rs[i].count - o < MOEPT__MPI_CHUNK ? rs[i].count - o : MOEPT__MPI_CHUNK;
            char *at = (char *)recv + (rs[i].offset + o) * es;
            MOEPT__MPI(c, MPI_Irecv(at, (int)k, m->elem[es == 8], i / nseg, tag, m->comm, &reqs[(*n)++]));
        }
    return MOEPT_OK;
}

/* Elements [e0, e0 + n) of the virtual buffer whose row r is row rows[r]
   of the send base (re elements a row) as one committed MPI type over the
   base: a block per row touched (a message may start or end mid-row). */
static moept_status moept__mpi_rows_type(moept_comm *c, const int64_t *rows, int64_t re, int es, int64_t e0,
                                         int64_t n, MPI_Datatype *out) {
    moept__mpi *m = c->ctx;
    int64_t r0 = e0 / re, nb = (e0 + n - 1) / re - r0 + 1;
    if (nb > m->bcap) {
        int *bl = moept__alloc(NULL, (size_t)nb * sizeof *bl);
        MPI_Aint *bd = moept__alloc(NULL, (size_t)nb * sizeof *bd);
        if (!bl || !bd) {
            MOEPT_FREE(bl); MOEPT_FREE(bd);
            return moept__comm_fail(c, MOEPT_ERR_OUT_OF_MEMORY, "mpi alltoallv_rows: out of memory");
        }
        MOEPT_FREE(m->blen); MOEPT_FREE(m->bdisp);
        m->blen = bl; m->bdisp = bd; m->bcap = nb;
    }
    for (int64_t b = 0; b < nb; b++) {
        int64_t r = r0 + b, lo = r * re > e0 ? r * re : e0;
        int64_t hi = (r + 1) * re < e0 + n ? (r + 1) * re : e0 + n;
        m->blen[b] = (int)(hi - lo);
        m->bdisp[b] = (MPI_Aint)((rows[r] * re + lo - r * re) * es);
    }
    MOEPT__MPI(c, MPI_Type_create_hindexed((int)nb, m->blen, m->bdisp, m->elem[es == 8], out));
    MOEPT__MPI(c, MPI_Type_commit(out));
    return MOEPT_OK;
}

/* posts the sends of every piece: from a contiguous buffer (rows NULL), or
   from the virtual one whose row r is row rows[r] of `send` (re elements),
   each message then one derived type */
static moept_status moept__mpi_post_sends(moept_comm *c, const void *send, const int64_t *rows, int64_t re,
                                          const moept_seg *ss, int nseg, int es, int tag, MPI_Request *reqs,
                                          int64_t *n) {
    moept__mpi *m = c->ctx;
    for (int i = 0; i < c->size * nseg; i++)
        for (int64_t o = 0; o < ss[i].count && i / nseg != c->rank; o += MOEPT__MPI_CHUNK) {
            int64_t k = ss[i].count - o < MOEPT__MPI_CHUNK ? ss[i].count - o : MOEPT__MPI_CHUNK;
            if (!rows) {
                const char *at = (const char *)send + (ss[i].offset + o) * es;
                MOEPT__MPI(c, MPI_Isend(at, (int)k, m->elem[es == 8], i / nseg, tag, m->comm, &reqs[(*n)++]));
                continue;
            }
            MPI_Datatype rt;
            moept_status st = moept__mpi_rows_type(c, rows, re, es, ss[i].offset + o, k, &rt);
            if (st) return st;
            int rc = MPI_Isend(send, 1, rt, i / nseg, tag, m->comm, &reqs[(*n)++]);
            MPI_Type_free(&rt); /* the posted send keeps what it needs */
            if (rc != MPI_SUCCESS) return moept__mpi_err(c, rc, "MPI_Isend", __LINE__);
        }
    return MOEPT_OK;
}

/* The pieces a rank sends itself, as copies (MPI would move them through
   its self transport: a derived type packed, then unpacked). Counts must
   match, as for a peer's message; a mismatch copies nothing and is named
   once the peers' messages are done, so no rank is left waiting. */
static int moept__mpi_self(moept_comm *c, const void *send, const int64_t *rows, int64_t re,
                           const moept_seg *ss, void *recv, const moept_seg *rs, int nseg, int es) {
    const moept_seg *s = ss + c->rank * nseg, *r = rs + c->rank * nseg;
    for (int j = 0; j < nseg; j++)
        if (s[j].count != r[j].count) return j;
    for (int j = 0; j < nseg; j++) {
        char *to = (char *)recv + r[j].offset * es;
        if (!rows) {
            memcpy(to, (const char *)send + s[j].offset * es, (size_t)(s[j].count * es));
            continue;
        }
        for (int64_t e = s[j].offset, end = e + s[j].count; e < end;) { /* by rows, maybe mid-row */
            int64_t row = e / re, n = (row + 1) * re < end ? (row + 1) * re - e : end - e;
            memcpy(to, (const char *)send + (rows[row] * re + e - row * re) * es, (size_t)(n * es));
            to += n * es; e += n;
        }
    }
    return -1;
}

/* The blocking piecewise exchange (pieces, counts past INT_MAX), and
   alltoallv_rows itself (rows sent by index, moept.h): non-blocking
   point-to-point, each piece split into messages of at most
   MOEPT__MPI_CHUNK elements, then one wait */
static moept_status moept__mpi_pieces(moept_comm *c, const void *send, const int64_t *rows, int64_t re,
                                      const moept_seg *ss, void *recv, const moept_seg *rs, int nseg,
                                      int es) {
    moept__mpi *m = c->ctx;
    int64_t n = moept__mpi_nmsg(ss, rs, c->size * nseg);
    if (!moept__mpi_reqs(m, n))
        return moept__comm_fail(c, MOEPT_ERR_OUT_OF_MEMORY, "mpi alltoallv: out of memory");
    n = 0;
    moept_status st = moept__mpi_post_recvs(c, recv, rs, nseg, es, 0, m->reqs, &n);
    if (!st) st = moept__mpi_post_sends(c, send, rows, re, ss, nseg, es, 0, m->reqs, &n);
    if (st) return st;
    int bad = moept__mpi_self(c, send, rows, re, ss, recv, rs, nseg, es);
    MOEPT__MPI(c, MPI_Waitall((int)n, m->reqs, MPI_STATUSES_IGNORE));
    if (bad >= 0)
        return moept__comm_fail(c, MOEPT_ERR_COMM, "mpi alltoallv: rank %d sends itself other counts than it "
                                "receives (piece %d)", c->rank, bad);
    return MOEPT_OK;
}

static moept_status moept__mpi_alltoallv(moept_comm *c, const void *send, const moept_seg *ss,
                                         void *recv, const moept_seg *rs, int nseg, int es) {
    moept__mpi *m = c->ctx;
    MPI_Datatype t = m->elem[es == 8];
    int P = c->size, fits = nseg == 1;
    for (int p = 0; p < P && fits; p++)
        fits = ss[p].count <= MOEPT__MPI_INT_MAX && ss[p].offset <= MOEPT__MPI_INT_MAX &&
               rs[p].count <= MOEPT__MPI_INT_MAX && rs[p].offset <= MOEPT__MPI_INT_MAX;
    if (fits) { /* the plain collective: one contiguous piece per peer */
        int *sc = m->cnt, *sd = m->dsp, *rc = m->cnt + 2 * P, *rd = m->dsp + 2 * P;
        for (int p = 0; p < P; p++) {
            sc[p] = (int)ss[p].count; sd[p] = (int)ss[p].offset;
            rc[p] = (int)rs[p].count; rd[p] = (int)rs[p].offset;
        }
        MOEPT__MPI(c, MPI_Alltoallv(send, sc, sd, t, recv, rc, rd, t, m->comm));
        return MOEPT_OK;
    }
    return moept__mpi_pieces(c, send, NULL, 1, ss, recv, rs, nseg, es);
}

/* Non-blocking all-to-all-v: the pieces as Irecv/Isend (chunked as the
   blocking path), their requests kept under the slot until the wait. Slot
   tags keep two exchanges in flight apart. */
static moept_status moept__mpi_ialltoallv(moept_comm *c, const void *send, const moept_seg *ss, void *recv,
                                          const moept_seg *rs, int nseg, int es, int slot) {
    moept__mpi *m = c->ctx;
    if (slot < 0 || slot >= MOEPT_COMM_SLOTS || m->npreq[slot])
        return moept__comm_fail(c, MOEPT_ERR_INVALID_ARGUMENT, "mpi ialltoallv: slot %d invalid or busy",
                                slot);
    int64_t n = moept__mpi_nmsg(ss, rs, c->size * nseg);
    if (n > m->pcap[slot]) {
        MPI_Request *r = moept__alloc(NULL, (size_t)n * sizeof(MPI_Request));
        if (!r) return moept__comm_fail(c, MOEPT_ERR_OUT_OF_MEMORY, "mpi ialltoallv: out of memory");
        MOEPT_FREE(m->preq[slot]);
        m->preq[slot] = r; m->pcap[slot] = n;
    }
    int tag = 100 + slot;
    n = 0;
    moept_status st = moept__mpi_post_recvs(c, recv, rs, nseg, es, tag, m->preq[slot], &n);
    if (!st) st = moept__mpi_post_sends(c, send, NULL, 1, ss, nseg, es, tag, m->preq[slot], &n);
    if (st) return st;
    m->pbad[slot] = moept__mpi_self(c, send, NULL, 1, ss, recv, rs, nseg, es);
    m->npreq[slot] = n;
    return MOEPT_OK;
}

static moept_status moept__mpi_wait(moept_comm *c, int slot) {
    moept__mpi *m = c->ctx;
    if (slot < 0 || slot >= MOEPT_COMM_SLOTS)
        return moept__comm_fail(c, MOEPT_ERR_INVALID_ARGUMENT, "mpi wait: slot %d", slot);
    int n = (int)m->npreq[slot], bad = m->pbad[slot];
    m->npreq[slot] = 0;
    m->pbad[slot] = -1;
    if (n) MOEPT__MPI(c, MPI_Waitall(n, m->preq[slot], MPI_STATUSES_IGNORE));
    if (bad >= 0)
        return moept__comm_fail(c, MOEPT_ERR_COMM, "mpi ialltoallv: rank %d sends itself other counts than "
                                "it receives (piece %d)", c->rank, bad);
    return MOEPT_OK;
}

/* Lets Open MPI move posted messages while the caller computes (its
   shared-memory and TCP transports progress only inside MPI calls). */
static void moept__mpi_progress(moept_comm *c) {
    moept__mpi *m = c->ctx;
    for (int s = 0; s < MOEPT_COMM_SLOTS; s++)
        if (m->npreq[s]) {
            int done;
            MPI_Testall((int)m->npreq[s], m->preq[s], &done, MPI_STATUSES_IGNORE);
        }
}

/* Sum over ranks in rank order, the same order as the threads backend, so
   results do not depend on MPI's reduction algorithm: a reduce-scatter by
   all-to-all-v (rank r sums slice r of every rank's buffer, in rank order),
   then an all-gather of the slices. Chunks of 2^28 elements bound the
   scratch and keep counts in int. */
static moept_status moept__mpi_allreduce(moept_comm *c, void *buf, int64_t count, moept_dtype t) {
    moept__mpi *m = c->ctx;
    MPI_Datatype mt = t == MOEPT_DTYPE_F32 ? MPI_FLOAT : t == MOEPT_DTYPE_F64 ? MPI_DOUBLE : MPI_INT64_T;
    size_t es = moept__dtype_size(t);
    int P = c->size, me = c->rank;
    if (P == 1) return MOEPT_OK;
    const int64_t chunk = MOEPT__MPI_CHUNK < ((int64_t)1 << 28) ? MOEPT__MPI_CHUNK : ((int64_t)1 << 28);
    for (int64_t o = 0; o < count; o += chunk) {
        int64_t n = count - o < chunk ? count - o : chunk;
        char *b = (char *)buf + o * (int64_t)es;
        int *sc = m->cnt, *sd = m->dsp, *rc = m->cnt + P, *rd = m->dsp + P;
        for (int q = 0; q < P; q++) {
            int64_t lo = n * q / P, hi = n * (q + 1) / P;
            sc[q] = (int)(hi - lo); sd[q] = (int)lo;
        }
        int mine = sc[me];
        size_t need = (size_t)P * (size_t)mine * es;
        if (need > m->scratch_bytes) {
            size_t nb = need > 2 * m->scratch_bytes ? need : 2 * m->scratch_bytes;
            char *s = moept__alloc(NULL, nb);
            if (!s)
                return moept__comm_fail(c, MOEPT_ERR_OUT_OF_MEMORY,
                                        "mpi allreduce: out of memory for %zu bytes", nb);
            MOEPT_FREE(m->scratch);
            m->scratch = s; m->scratch_bytes = nb;
        }
        for (int p = 0; p < P; p++) { rc[p] = mine; rd[p] = p * mine; }
        MOEPT__MPI(c, MPI_Alltoallv(b, sc, sd, mt, m->scratch, rc, rd, mt, m->comm));
        memcpy(b + (int64_t)sd[me] * (int64_t)es, m->scratch, (size_t)mine * es);
        for (int p = 1; p < P; p++)
            moept__sum_into(b + (int64_t)sd[me] * (int64_t)es, m->scratch + (size_t)p * (size_t)mine * es,
                            mine, t);
        MOEPT__MPI(c, MPI_Allgatherv(MPI_IN_PLACE, 0, mt, b, sc, sd, mt, m->comm));
    }
    return MOEPT_OK;
}

static moept_status moept__mpi_p2p(moept_comm *c, const moept_p2p *sends, int nsend, const moept_p2p *recvs,
                                   int nrecv) {
    moept__mpi *m = c->ctx;
    int64_t n = 0;
    for (int i = 0; i < nsend; i++) n += (sends[i].bytes + MOEPT__MPI_CHUNK - 1) / MOEPT__MPI_CHUNK;
    for (int i = 0; i < nrecv; i++) n += (recvs[i].bytes + MOEPT__MPI_CHUNK - 1) / MOEPT__MPI_CHUNK;
    if (!moept__mpi_reqs(m, n)) return moept__comm_fail(c, MOEPT_ERR_OUT_OF_MEMORY, "mpi p2p: out of memory");
    n = 0;
    for (int i = 0; i < nrecv; i++)
        for (int64_t o = 0; o < recvs[i].bytes; o += MOEPT__MPI_CHUNK) {
            int64_t k = recvs[i].bytes - o < MOEPT__MPI_CHUNK ? recvs[i].bytes - o : MOEPT__MPI_CHUNK;
            MOEPT__MPI(c,
                       MPI_Irecv((char *)recvs[i].buf + o, (int)k, MPI_BYTE, recvs[i].peer, 1, m->comm,
                                 &m->reqs[n++]));
        }
    for (int i = 0; i < nsend; i++)
        for (int64_t o = 0; o < sends[i].bytes; o += MOEPT__MPI_CHUNK) {
            int64_t k = sends[i].bytes - o < MOEPT__MPI_CHUNK ? sends[i].bytes - o : MOEPT__MPI_CHUNK;
            MOEPT__MPI(c,
                       MPI_Isend((const char *)sends[i].buf + o, (int)k, MPI_BYTE, sends[i].peer, 1, m->comm,
                                 &m->reqs[n++]));
        }
    MOEPT__MPI(c, MPI_Waitall((int)n, m->reqs, MPI_STATUSES_IGNORE));
    return MOEPT_OK;
}

static moept_status moept__mpi_allgather(moept_comm *c, const void *send, void *recv, int64_t bytes) {
    moept__mpi *m = c->ctx;
    if (bytes <= MOEPT__MPI_INT_MAX) {
        MOEPT__MPI(c, MPI_Allgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, m->comm));
        return MOEPT_OK;
    }
    /* large: every rank sends its block to every other (own block copied) */
    memcpy((char *)recv + (int64_t)c->rank * bytes, send, (size_t)bytes);
    for (int d = 1; d < c->size; d++) {
        int to = (c->rank + d) % c->size, from = (c->rank - d + c->size) % c->size;
        moept_p2p s = {to, (void *)send, bytes}, r = {from, (char *)recv + (int64_t)from * bytes, bytes};
        moept_status st = moept__mpi_p2p(c, &s, 1, &r, 1);
        if (st) return st;
    }
    return MOEPT_OK;
}

/* with fences: rows written to shared memory before it are seen after it */
static moept_status moept__mpi_barrier(moept_comm *c) {
    atomic_thread_fence(memory_order_seq_cst);
    MOEPT__MPI(c, MPI_Barrier(((moept__mpi *)c->ctx)->comm));
    atomic_thread_fence(memory_order_seq_cst);
    return MOEPT_OK;
}

#if defined(__linux__)
/* MPI ranks on one host: each rank's block is an anonymous memory file
   (memfd_create: it has no name, so no kill at any moment can leave one
   behind in /dev/shm); its peers open it through /proc/<pid>/fd/<fd>
   while the owner keeps the descriptor open, and map it. The memory lives
   until the last unmap. A 64-byte header holds the owner's nonce, which
   every peer checks: a descriptor that does not lead to the owner's block
   fails the call instead of aliasing another's memory. Where /proc does
   not open a same-user peer's descriptor, the probe fails and the ranks
   exchange by message. */
int memfd_create(const char *name, unsigned int flags); /* glibc >= 2.27, musl (declared under _GNU_SOURCE) */
typedef struct moept__mpi_shm { int n; void **map; size_t *len; } moept__mpi_shm;
static atomic_ullong moept__shm_seq; /* blocks this process made: their nonces differ */
typedef struct moept__mpi_seg { int64_t pid, fd; uint64_t len, nonce; } moept__mpi_seg;

static void moept__mpi_shm_free(moept_comm *c, void *handle) {
    (void)c;
    moept__mpi_shm *h = handle;
    if (!h) return;
    for (int q = 0; q < h->n && h->map; q++)
        if (h->map[q]) munmap(h->map[q], h->len[q]);
    MOEPT_FREE(h->map);
    MOEPT_FREE(h->len);
    MOEPT_FREE(h);
}

/* this rank's block, mapped (NULL: could not); me->fd stays open for the
   peers until the caller closes it */
static void *moept__mpi_shm_create(moept__mpi_seg *me) {
    int fd = memfd_create("moept", 1u /* MFD_CLOEXEC */);
    me->fd = fd;
    if (fd < 0) return NULL;
    void *p = MAP_FAILED;
    if (posix_fallocate(fd, 0, (off_t)me->len) == 0) /* room now, not SIGBUS on first touch */
        p = mmap(NULL, (size_t)me->len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { close(fd); me->fd = -1; return NULL; }
    memcpy(p, &me->nonce, sizeof me->nonce);
    return p;
}

/* the peers' segments, mapped and checked; 1 when all are */
static int moept__mpi_shm_map(moept_comm *c, moept__mpi_shm *h, const moept__mpi_seg *every) {
    int ok = 1;
    for (int q = 0; q < c->size; q++) {
        if (q == c->rank) continue;
        char path[64];
        snprintf(path, sizeof path, "/proc/%lld/fd/%lld", (long long)every[q].pid, (long long)every[q].fd);
        int fd = open(path, O_RDWR | O_CLOEXEC);
        size_t len = (size_t)every[q].len;
        void *p = fd < 0 ? MAP_FAILED : mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (fd >= 0) close(fd);
        if (p == MAP_FAILED) { ok = 0; continue; }
        h->map[q] = p;
        h->len[q] = len;
        ok &= memcmp(p, &every[q].nonce, sizeof every[q].nonce) == 0;
    }
    return ok;
}

static moept_status moept__mpi_shm_alloc(moept_comm *c, int64_t bytes, void **all, void **handle) {
    moept__mpi *m = c->ctx;
    const int P = c->size;
    moept__mpi_shm *h = moept__alloc(NULL, sizeof *h);
    moept__mpi_seg me, *every = moept__alloc(NULL, (size_t)P * sizeof *every);
    if (h) {
        h->n = P;
        h->map = moept__alloc(NULL, (size_t)P * sizeof(void *));
        h->len = moept__alloc(NULL, (size_t)P * sizeof(size_t));
        if (h->map) memset(h->map, 0, (size_t)P * sizeof(void *));
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    memset(&me, 0, sizeof me);
    unsigned long long seq = atomic_fetch_add(&moept__shm_seq, 1) + 1;
    me.pid = (int64_t)getpid();
    me.fd = -1;
    me.len = (uint64_t)(bytes < 0 ? 0 : bytes) + 64;
    me.nonce = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 40) ^ seq;
    int ok = bytes >= 0 && h && h->map && h->len && every, all_ok = 0, rc;
    void *mine = ok ? moept__mpi_shm_create(&me) : NULL;
    ok = mine != NULL;
    if (ok) { h->map[c->rank] = mine; h->len[c->rank] = (size_t)me.len; }
    /* every rank's segment exists, then every rank maps its peers' */
    rc = MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, m->comm);
    if (rc == MPI_SUCCESS && all_ok)
        rc = MPI_Allgather(&me, (int)sizeof me, MPI_BYTE, every, (int)sizeof me, MPI_BYTE, m->comm);
    if (rc == MPI_SUCCESS && all_ok) {
        ok = moept__mpi_shm_map(c, h, every);
        rc = MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, m->comm);
    }
    if (me.fd >= 0) close(me.fd); /* all peers have mapped it, or none will */
    MOEPT_FREE(every);
    if (rc != MPI_SUCCESS || !all_ok) {
        moept__mpi_shm_free(c, h);
        if (rc != MPI_SUCCESS) return moept__mpi_err(c, rc, "MPI shm_alloc", __LINE__);
        return moept__comm_fail(c, MOEPT_ERR_OUT_OF_MEMORY, "MPI shm_alloc: a rank could not create or map "
                                "%lld bytes of POSIX shared memory", (long long)me.len);
    }
    for (int q = 0; q < P; q++) all[q] = (char *)h->map[q] + 64;
    *handle = h;
    return MOEPT_OK;
}

/* shared memory when every rank is on this host and a first segment works
   (the same answer on every rank: the probe agrees) */
static void moept__mpi_shm_probe(moept_comm *c) {
    moept__mpi *m = c->ctx;
    MPI_Comm node;
    int n = 0;
    if (MPI_Comm_split_type(m->comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) != MPI_SUCCESS) return;
    MPI_Comm_size(node, &n);
    MPI_Comm_free(&node);
    if (n != c->size) return;
    void **all = moept__alloc(NULL, (size_t)c->size * sizeof(void *)), *h = NULL;
    if (all && moept__mpi_shm_alloc(c, 0, all, &h) == MOEPT_OK) {
        c->shm_alloc = moept__mpi_shm_alloc;
        c->shm_free = moept__mpi_shm_free;
        moept__mpi_shm_free(c, h);
    }
    c->err[0] = 0;
    MOEPT_FREE(all);
}
#endif

static void moept__mpi_destroy(moept_comm *c) {
    moept__mpi *m = c->ctx;
    MPI_Type_free(&m->elem[0]);
    MPI_Type_free(&m->elem[1]);
    MPI_Comm_free(&m->comm);
    MOEPT_FREE(m->reqs);
    for (int i = 0; i < MOEPT_COMM_SLOTS; i++) MOEPT_FREE(m->preq[i]);
    MOEPT_FREE(m->scratch);
    MOEPT_FREE(m->cnt);
    MOEPT_FREE(m->dsp);
    MOEPT_FREE(m->blen);
    MOEPT_FREE(m->bdisp);
    MOEPT_FREE(m);
    MOEPT_FREE(c);
}

moept_status moept_comm_mpi(MPI_Comm comm, moept_comm **out) {
    if (!out) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_comm_mpi: out is NULL");
    *out = NULL;
    int init = 0;
    MPI_Initialized(&init);
    if (!init)
        return moept__thread_fail(MOEPT_ERR_STATE,
                                  "moept_comm_mpi: MPI is not initialised (the caller initialises it)");
    moept_comm *c = moept__alloc(NULL, sizeof *c);
    moept__mpi *m = moept__alloc(NULL, sizeof *m);
    if (!c || !m) {
        MOEPT_FREE(c);
        MOEPT_FREE(m);
        return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "moept_comm_mpi: out of memory");
    }
    memset(c, 0, sizeof *c);
    memset(m, 0, sizeof *m);
    for (int s = 0; s < MOEPT_COMM_SLOTS; s++) m->pbad[s] = -1;
    int rc = MPI_Comm_dup(comm, &m->comm);
    if (rc != MPI_SUCCESS) {
        MOEPT_FREE(c);
        MOEPT_FREE(m);
        return moept__thread_fail(MOEPT_ERR_COMM, "moept_comm_mpi: MPI_Comm_dup failed");
    }
    MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(m->comm, &c->rank);
    MPI_Comm_size(m->comm, &c->size);
    MPI_Type_contiguous(4, MPI_BYTE, &m->elem[0]);
    MPI_Type_contiguous(8, MPI_BYTE, &m->elem[1]);
    MPI_Type_commit(&m->elem[0]);
    MPI_Type_commit(&m->elem[1]);
    m->cnt = moept__alloc(NULL, (size_t)(4 * c->size) * sizeof(int));
    m->dsp = moept__alloc(NULL, (size_t)(4 * c->size) * sizeof(int));
    c->ctx = m;
    c->alltoallv = moept__mpi_alltoallv;
    c->allreduce = moept__mpi_allreduce;
    c->allgather = moept__mpi_allgather;
    c->p2p = moept__mpi_p2p;
    c->ialltoallv = moept__mpi_ialltoallv;
    c->alltoallv_rows = moept__mpi_pieces;
    c->wait = moept__mpi_wait;
    c->progress = moept__mpi_progress;
    c->barrier = moept__mpi_barrier;
    c->destroy = moept__mpi_destroy;
    if (!m->cnt || !m->dsp) {
        moept__mpi_destroy(c);
        return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "moept_comm_mpi: out of memory");
    }
#if defined(__linux__)
    moept__mpi_shm_probe(c);
#endif
    *out = c;
    return MOEPT_OK;
}
#endif /* MOEPT_MPI */

#ifndef MOEPT_NO_IO /* the file formats: a vendor that reads and writes no files may drop them */
/* ------------------------------------------------------------------------
   JSON (RFC 8259), strict, for every file moept reads: the safetensors
   header, config.json, model.safetensors.index.json and a training
   checkpoint's index.json. Every reader walks an object with
   moept__jmember and an array with moept__jelement. moept__json_check
   takes a document whole before its reader walks it (all but the
   safetensors header, whose reader accepts only the shapes it knows):
   UTF-8; the grammar (exact literals, no leading zeros, nothing after the
   object; NaN and Infinity, which Python also reads, are not JSON);
   nesting up to 64; no key twice in one object (Python's json, and so
   transformers, keeps a repeated key's last value, where a reader here
   would take the first: the two would differ silently). Strings may not
   hold U+0000 (they become C strings).
   ------------------------------------------------------------------------ */
typedef struct moept__json {
    char *p, *end;
    const char *err;
} moept__json;

static void moept__ws(moept__json *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

static int moept__utf8_ok(const unsigned char *s, int64_t n) {
    for (int64_t i = 0; i < n;) {
        unsigned c = s[i];
        int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!len || i + len > n) return 0;
        uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
        for (int k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) ||
            (len == 4 && (cp < 0x10000 || cp > 0x10ffff)) || (cp >= 0xd800 && cp <= 0xdfff))
            return 0;
        i += len;
    }
    return 1;
}

static int moept__hex4(const char *p, uint32_t *out) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* Decodes a JSON string in place (the decoded form is never longer). */
static char *moept__jstring(moept__json *j) {
    moept__ws(j);
    if (j->p >= j->end || *j->p != '"') { j->err = "expected a string"; return NULL; }
    char *out = ++j->p, *w = out;
    while (j->p < j->end && *j->p != '"') {
        unsigned char c = (unsigned char)*j->p;
        if (c < 0x20) { j->err = "control character in a string"; return NULL; }
        if (c != '\\') { *w++ = *j->p++; continue; }
        if (j->p + 1 >= j->end) { j->err = "truncated escape"; return NULL; }
        char e = j->p[1];
        j->p += 2;
        switch (e) {
        case '"': *w++ = '"'; break;
        case '\\': *w++ = '\\'; break;
        case '/': *w++ = '/'; break;
        case 'b': *w++ = '\b'; break;
        case 'f': *w++ = '\f'; break;
        case 'n': *w++ = '\n'; break;
        case 'r': *w++ = '\r'; break;
        case 't': *w++ = '\t'; break;
        case 'u': {
            uint32_t cp, lo;
            if (j->end - j->p < 4 || !moept__hex4(j->p, &cp)) { j->err = "bad \\u escape"; return NULL; }
            j->p += 4;
            if (cp >= 0xd800 && cp <= 0xdbff) {
                if (j->end - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u' || !moept__hex4(j->p + 2, &lo) ||
                    lo < 0xdc00 || lo > 0xdfff) { j->err = "unpaired surrogate"; return NULL; }
                j->p += 6;
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            } else if (cp >= 0xdc00 && cp <= 0xdfff) { j->err = "unpaired surrogate"; return NULL; }
            if (cp == 0) { j->err = "NUL in a string"; return NULL; }
            if (cp < 0x80) *w++ = (char)cp;
            else if (cp < 0x800) { *w++ = (char)(0xc0 | (cp >> 6)); *w++ = (char)(0x80 | (cp & 0x3f));
            } else if (cp < 0x10000) {
                *w++ = (char)(0xe0 | (cp >> 12));
                *w++ = (char)(0x80 | ((cp >> 6) & 0x3f));
                *w++ = (char)(0x80 | (cp & 0x3f));
            } else {
                *w++ = (char)(0xf0 | (cp >> 18));
                *w++ = (char)(0x80 | ((cp >> 12) & 0x3f));
                *w++ = (char)(0x80 | ((cp >> 6) & 0x3f));
                *w++ = (char)(0x80 | (cp & 0x3f));
            }
            break;
        }
        default: j->err = "bad escape"; return NULL;
        }
    }
    if (j->p >= j->end) { j->err = "unterminated string"; return NULL; }
    *w = 0;          /* may overwrite the closing quote: already consumed */
    j->p++;
    return out;
}

static int moept__jchar(moept__json *j, char c) {
    moept__ws(j);
    if (j->p < j->end && *j->p == c) { j->p++; return 1; }
    return 0;
}

/* is the next character c (left unread)? */
static int moept__jpeek(moept__json *j, char c) {
    moept__ws(j);
    return j->p < j->end && *j->p == c;
}

static int moept__juint(moept__json *j, int64_t *out) {
    moept__ws(j);
    if (j->p >= j->end || *j->p < '0' || *j->p > '9') {
        j->err = "expected a non-negative integer";
        return 0;
    }
    if (*j->p == '0' && j->p + 1 < j->end && j->p[1] >= '0' && j->p[1] <= '9') {
        j->err = "leading zero";
        return 0;
    }
    int64_t v = 0;
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
        int d = *j->p++ - '0';
        if (v > (INT64_MAX - d) / 10) { j->err = "integer overflows 64 bits"; return 0; }
        v = v * 10 + d;
    }
    if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E')) {
        j->err = "expected an integer";
        return 0;
    }
    *out = v;
    return 1;
}

/* A JSON number, in any locale (strtod's decimal point is the locale's):
   up to 19 significant digits scaled by a power of ten, enough for a
   float's value. */
static int moept__jnum(moept__json *j, double *out) {
    moept__ws(j);
    const char *p = j->p, *e = j->end;
    int neg = p < e && *p == '-', nd = 0, dexp = 0, x = 0, xneg = 0;
    p += neg;
    if (p >= e || *p < '0' || *p > '9') { j->err = "expected a number"; return 0; }
    if (*p == '0' && p + 1 < e && p[1] >= '0' && p[1] <= '9') {
        j->err = "leading zero in a number";
        return 0;
    }
    uint64_t m = 0;
    for (; p < e && *p >= '0' && *p <= '9'; p++)
        if (nd < 19) { m = m * 10 + (uint64_t)(*p - '0'); nd += m != 0; } else dexp++;
    if (p < e && *p == '.') {
        if (++p >= e || *p < '0' || *p > '9') { j->err = "a number's fraction has no digits"; return 0; }
        for (; p < e && *p >= '0' && *p <= '9'; p++)
            if (nd < 19) { m = m * 10 + (uint64_t)(*p - '0'); nd += m != 0; dexp--; }
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < e && (*p == '+' || *p == '-')) xneg = *p++ == '-';
        if (p >= e || *p < '0' || *p > '9') { j->err = "a number's exponent has no digits"; return 0; }
        for (; p < e && *p >= '0' && *p <= '9'; p++) x = x < 10000 ? x * 10 + (*p - '0') : x;
    }
    dexp += xneg ? -x : x;
    if (dexp < -400) dexp = -400;
    if (dexp > 400) dexp = 400;
    double v = (double)m; /* 0 stays 0 at any exponent (0 x inf would be NaN) */
    if (m) v = dexp >= 0 ? v * pow(10.0, dexp) : v / pow(10.0, -dexp);
    *out = neg ? -v : v;
    j->p = (char *)p;
    return 1;
}

/* The iterators' own errors, named so a reader may word them its own way */
static const char moept__jerr_colon[] = "expected ':'", moept__jerr_more[] = "expected ',' or '}'";

/* The one object iterator of every reader: *n = 0 before the first call;
   each call moves to the next member (its decoded name in *key, j at its
   value), or returns 0 past the '}', with j->err set if the object is
   malformed (*key is the member's name where its ':' is missing). */
static int moept__jmember(moept__json *j, int64_t *n, char **key) {
    if ((*n)++ == 0) {
        if (!moept__jchar(j, '{')) { j->err = "expected an object"; return 0; }
        if (moept__jchar(j, '}')) return 0;
    } else if (!moept__jchar(j, ',')) {
        if (!moept__jchar(j, '}')) j->err = moept__jerr_more;
        return 0;
    }
    if (!(*key = moept__jstring(j))) return 0;
    if (!moept__jchar(j, ':')) { j->err = moept__jerr_colon; return 0; }
    return 1;
}

/* The elements of the array at j, likewise (j at each element) */
static int moept__jelement(moept__json *j, int64_t *n) {
    if ((*n)++ == 0) {
        if (!moept__jchar(j, '[')) { j->err = "expected an array"; return 0; }
        return !moept__jchar(j, ']');
    }
    if (moept__jchar(j, ',')) return 1;
    if (!moept__jchar(j, ']')) j->err = "expected ',' or ']'";
    return 0;
}

/* every object's member names (object number, name), for the duplicate check */
typedef struct moept__jkey { int64_t obj; const char *name; } moept__jkey;
typedef struct moept__jkeys { moept__jkey *v; int64_t n, cap, objs; } moept__jkeys;

/* One value, strictly; its objects' names go to keys (NULL: not kept) */
static int moept__jvalue(moept__json *j, int depth, moept__jkeys *keys) {
    moept__ws(j);
    if (j->p >= j->end) { j->err = "expected a value"; return 0; }
    if (depth > 64) { j->err = "nested deeper than 64"; return 0; }
    const char c = *j->p;
    int64_t n = 0;
    if (c == '"') return moept__jstring(j) != NULL;
    if (c == '{') {
        int64_t obj = keys ? keys->objs++ : 0;
        char *k;
        while (moept__jmember(j, &n, &k)) {
            if (keys && keys->n == keys->cap) { j->err = "too many keys"; return 0; }
            if (keys) keys->v[keys->n++] = (moept__jkey){obj, k};
            if (!moept__jvalue(j, depth + 1, keys)) return 0;
        }
        return !j->err;
    }
    if (c == '[') {
        while (moept__jelement(j, &n))
            if (!moept__jvalue(j, depth + 1, keys)) return 0;
        return !j->err;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        double v;
        return moept__jnum(j, &v);
    }
    static const char *const lit[3] = {"true", "false", "null"};
    for (int w = 0; w < 3; w++) {
        size_t len = strlen(lit[w]);
        if ((size_t)(j->end - j->p) >= len && memcmp(j->p, lit[w], len) == 0) { j->p += len; return 1; }
    }
    j->err = c == 't' || c == 'f' || c == 'n' ? "a malformed literal (true, false or null)"
                                               : "expected a value";
    return 0;
}

static int moept__cmp_jkey(const void *a, const void *b) {
    const moept__jkey *x = a, *y = b;
    if (x->obj != y->obj) return (x->obj > y->obj) - (x->obj < y->obj);
    return strcmp(x->name, y->name);
}

/* Checks text[0, n), a document that must be one JSON object, whole;
   messages name `path`. Strings decode in place, so the check runs on a
   copy and the caller's text stays raw for its reader. */
static moept_status moept__json_check(const char *text, int64_t n, const char *path) {
    if (!moept__utf8_ok((const unsigned char *)text, n))
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: not UTF-8 (RFC 8259 JSON is)", path);
    int64_t cap = 1; /* each member has a ':' */
    for (int64_t i = 0; i < n; i++) cap += text[i] == ':';
    char *copy = moept__alloc(NULL, (size_t)n + 1);
    moept__jkeys keys = {moept__alloc(NULL, (size_t)cap * sizeof(moept__jkey)), 0, cap, 0};
    moept_status st = MOEPT_OK;
    if (!copy || !keys.v) {
        st = moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
        goto out;
    }
    memcpy(copy, text, (size_t)n);
    copy[n] = 0;
    moept__json j = {copy, copy + n, NULL};
    moept__ws(&j);
    int ok = j.p < j.end && *j.p == '{' && moept__jvalue(&j, 0, &keys);
    if (ok) moept__ws(&j);
    if (ok && j.p != j.end) { j.err = "trailing content after the object"; ok = 0; }
    if (!ok) {
        st = moept__thread_fail(MOEPT_ERR_FORMAT, "%s: not a JSON object: %s (byte %lld)", path,
                                j.err ? j.err : "expected '{'", (long long)(j.p - copy));
        goto out;
    }
    qsort(keys.v, (size_t)keys.n, sizeof *keys.v, moept__cmp_jkey);
    for (int64_t i = 1; i < keys.n && !st; i++)
        if (keys.v[i].obj == keys.v[i - 1].obj && strcmp(keys.v[i].name, keys.v[i - 1].name) == 0)
            st = moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"%s\" twice in one object (Python's json "
                                    "takes the last value, moept the first: refused)", path, keys.v[i].name);
out:
    MOEPT_FREE(copy);
    MOEPT_FREE(keys.v);
    return st;
}

/* ------------------------------------------------------------------------
   safetensors: the reader (moept_st_open, moept_st_read_*), then the writer
   (moept_st_writer, written atomically). The reader is strict: header
   length 2..100 MB and inside the file; the header is a UTF-8 JSON object;
   __metadata__ maps strings to strings; names are unique; dtypes known;
   shape x dtype size equals the byte range; ranges tile the data area
   exactly (contiguous, in offset order, from 0 to the end of the file: no
   gaps, overlaps or trailing bytes). All arithmetic 64-bit with overflow
   checks.
   ------------------------------------------------------------------------ */
#define MOEPT__ST_MAX_HEADER (100 * 1000 * 1000)

struct moept_st_file {
    int fd;
    int64_t file_size, data_start;
    char *header;            /* [header_len + 1] decoded strings point in here */
    moept_st_tensor *tensors; int64_t n_tensors;
    char **meta; int64_t n_meta; /* key, value pairs */
    int64_t bytes_read;
};

static int moept__dtype_parse(const char *s, moept_dtype *d, int64_t *size) {
    static const struct { const char *n; moept_dtype d; int64_t sz; } tab[] = {
        {"F32", MOEPT_DTYPE_F32, 4}, {"F16", MOEPT_DTYPE_F16, 2}, {"BF16", MOEPT_DTYPE_BF16, 2},
        {"F64", MOEPT_DTYPE_F64, 8}, {"I64", MOEPT_DTYPE_I64, 8}, {"I32", MOEPT_DTYPE_I32, 4},
        {"U8", MOEPT_DTYPE_U8, 1}, {"BOOL", MOEPT_DTYPE_BOOL, 1}, {"F8_E4M3", MOEPT_DTYPE_F8_E4M3, 1}};
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (strcmp(s, tab[i].n) == 0) { *d = tab[i].d; *size = tab[i].sz; return 1; }
    return 0;
}

/* by (begin, end), as the safetensors reference validates: a zero-element
   tensor ([b, b]) sorts before the tensor that starts at b */
static int moept__cmp_offset(const void *a, const void *b) {
    const moept_st_tensor *x = a, *y = b;
    if (x->offset != y->offset) return (x->offset > y->offset) - (x->offset < y->offset);
    return (x->nbytes > y->nbytes) - (x->nbytes < y->nbytes);
}

static int moept__cmp_name(const void *a, const void *b) {
    const moept_st_tensor *x = a, *y = b;
    return strcmp(x->name, y->name);
}

#define MOEPT__JFAIL(...) return moept__thread_fail(MOEPT_ERR_FORMAT, __VA_ARGS__)

/* an iterator's error in the header's wording: a member list that neither
   goes on nor ends is "expected '}'" inside an entry */
static const char *moept__st_jerr(const moept__json *j) {
    return j->err == moept__jerr_more ? "expected '}'" : j->err;
}

/* __metadata__'s members (j at its '{'): strings to strings, no key twice */
static moept_status moept__st_meta(moept_st_file *f, moept__json *j, const char *path) {
    int64_t n = 0;
    char *k;
    while (moept__jmember(j, &n, &k)) {
        char *v = moept__jstring(j);
        if (!v) MOEPT__JFAIL("%s: __metadata__[\"%s\"]: values must be strings (%s)", path, k, j->err);
        for (int64_t m = 0; m < f->n_meta; m++)
            if (strcmp(f->meta[2 * m], k) == 0)
                MOEPT__JFAIL("%s: __metadata__: duplicate key \"%s\"", path, k);
        f->meta[2 * f->n_meta] = k; f->meta[2 * f->n_meta + 1] = v; f->n_meta++;
    }
    if (j->err) MOEPT__JFAIL("%s: __metadata__: %s", path, moept__st_jerr(j));
    return MOEPT_OK;
}

/* Field k of tensor t's entry (j at its value): dtype, shape or
   data_offsets [b0, b1], each once (have[3] says which were seen) */
static moept_status moept__st_field(moept__json *j, const char *path, moept_st_tensor *t, const char *k,
                                    int have[3], int64_t *esize, int64_t b[2]) {
    const char *name = t->name;
    if (strcmp(k, "dtype") == 0 && !have[0]) {
        char *d = moept__jstring(j);
        if (!d) MOEPT__JFAIL("%s: tensor \"%s\": dtype: %s", path, name, j->err);
        if (!moept__dtype_parse(d, &t->dtype, esize))
            MOEPT__JFAIL("%s: tensor \"%s\": unknown dtype \"%s\"", path, name, d);
        have[0] = 1;
    } else if (strcmp(k, "shape") == 0 && !have[1]) {
        if (!moept__jpeek(j, '[')) MOEPT__JFAIL("%s: tensor \"%s\": shape is not an array", path, name);
        for (int64_t n = 0; moept__jelement(j, &n); t->ndim++) {
            if (t->ndim == 8) MOEPT__JFAIL("%s: tensor \"%s\": more than 8 dimensions", path, name);
            if (!moept__juint(j, &t->shape[t->ndim]))
                MOEPT__JFAIL("%s: tensor \"%s\": shape: %s", path, name, j->err);
        }
        if (j->err) MOEPT__JFAIL("%s: tensor \"%s\": shape: expected ']'", path, name);
        have[1] = 1;
    } else if (strcmp(k, "data_offsets") == 0 && !have[2]) {
        if (!moept__jchar(j, '[') || !moept__juint(j, &b[0]) || !moept__jchar(j, ',') ||
            !moept__juint(j, &b[1]) || !moept__jchar(j, ']'))
            MOEPT__JFAIL("%s: tensor \"%s\": data_offsets must be [begin, end]", path, name);
        have[2] = 1;
    } else {
        MOEPT__JFAIL("%s: tensor \"%s\": unexpected or repeated field \"%s\"", path, name, k);
    }
    return MOEPT_OK;
}

/* Tensor `name`'s entry (j at its '{') into the next of f->tensors: its
   fields, and a byte range that matches its shape and dtype */
static moept_status moept__st_tensor(moept_st_file *f, moept__json *j, const char *path, char *name) {
    moept_st_tensor *t = &f->tensors[f->n_tensors];
    memset(t, 0, sizeof *t);
    t->name = name;
    int have[3] = {0, 0, 0};
    int64_t esize = 0, b[2] = {0, 0}, n = 0;
    char *k;
    moept_status st;
    while (moept__jmember(j, &n, &k))
        if ((st = moept__st_field(j, path, t, k, have, &esize, b))) return st;
    if (j->err) MOEPT__JFAIL("%s: tensor \"%s\": %s", path, name, moept__st_jerr(j));
    if (!have[0] || !have[1] || !have[2])
        MOEPT__JFAIL("%s: tensor \"%s\": needs dtype, shape and data_offsets", path, name);
    int64_t numel = 1;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] != 0 && numel > INT64_MAX / t->shape[d])
            MOEPT__JFAIL("%s: tensor \"%s\": shape overflows 64 bits", path, name);
        numel *= t->shape[d];
    }
    if (numel > INT64_MAX / esize) MOEPT__JFAIL("%s: tensor \"%s\": byte size overflows 64 bits", path, name);
    if (b[1] < b[0])
        MOEPT__JFAIL("%s: tensor \"%s\": data_offsets end %lld < begin %lld", path, name, (long long)b[1],
                     (long long)b[0]);
    if (b[1] - b[0] != numel * esize)
        MOEPT__JFAIL("%s: tensor \"%s\": shape needs %lld bytes but data_offsets span %lld", path, name,
                     (long long)(numel * esize), (long long)(b[1] - b[0]));
    t->numel = numel;
    t->offset = b[0];
    t->nbytes = b[1] - b[0];
    f->n_tensors++;
    return MOEPT_OK;
}

/* Unique names, and byte ranges that tile the data area; the offsets
   become the file's */
static moept_status moept__st_tile(moept_st_file *f, const char *path) {
    qsort(f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, moept__cmp_name);
    for (int64_t i = 1; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i - 1].name, f->tensors[i].name) == 0)
            MOEPT__JFAIL("%s: duplicate tensor name \"%s\"", path, f->tensors[i].name);
    qsort(f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, moept__cmp_offset);
    int64_t pos = 0, data_size = f->file_size - f->data_start;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        moept_st_tensor *t = &f->tensors[i];
        if (t->offset != pos)
            MOEPT__JFAIL("%s: tensor \"%s\": data starts at %lld, expected %lld (%s)", path, t->name,
                         (long long)t->offset, (long long)pos, t->offset > pos ? "gap" : "overlap");
        if (t->nbytes > data_size - pos)
            MOEPT__JFAIL("%s: tensor \"%s\": data ends past the end of the file", path, t->name);
        pos += t->nbytes;
        t->offset += f->data_start;
    }
    if (pos != data_size)
        MOEPT__JFAIL("%s: %lld trailing bytes after the last tensor", path, (long long)(data_size - pos));
    return MOEPT_OK;
}

/* The header (decoded in place: the names point into it): one object of
   tensor entries and at most one __metadata__ */
static moept_status moept__st_parse(moept_st_file *f, const char *path) {
    int64_t hlen = f->data_start - 8;
    moept__json j = {f->header, f->header + hlen, NULL};
    /* count entries generously: each needs at least one ':' */
    int64_t cap = 1, n = 0;
    for (int64_t i = 0; i < hlen; i++) cap += f->header[i] == ':';
    f->tensors = moept__alloc(NULL, (size_t)cap * sizeof(moept_st_tensor));
    f->meta = moept__alloc(NULL, (size_t)(2 * cap) * sizeof(char *));
    if (!f->tensors || !f->meta)
        return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory for the header", path);
    if (!moept__jpeek(&j, '{')) MOEPT__JFAIL("%s: header is not a JSON object", path);
    int saw_meta = 0;
    char *name;
    while (moept__jmember(&j, &n, &name)) {
        if (!moept__jpeek(&j, '{')) MOEPT__JFAIL("%s: entry \"%s\" is not an object", path, name);
        int meta = strcmp(name, "__metadata__") == 0;
        if (meta && saw_meta) MOEPT__JFAIL("%s: duplicate __metadata__", path);
        saw_meta |= meta;
        moept_status st = meta ? moept__st_meta(f, &j, path) : moept__st_tensor(f, &j, path, name);
        if (st) return st;
    }
    if (j.err == moept__jerr_colon) MOEPT__JFAIL("%s: header: expected ':' after \"%s\"", path, name);
    if (j.err) MOEPT__JFAIL("%s: header: %s", path, j.err);
    moept__ws(&j);
    if (j.p != j.end) MOEPT__JFAIL("%s: header: trailing characters after the JSON object", path);
    return moept__st_tile(f, path);
}
#undef MOEPT__JFAIL

void moept_st_close(moept_st_file *f) {
    if (!f) return;
    if (f->fd >= 0) close(f->fd);
    MOEPT_FREE(f->header);
    MOEPT_FREE(f->tensors);
    MOEPT_FREE(f->meta);
    MOEPT_FREE(f);
}

static int moept__pread_all(int fd, void *buf, int64_t n, int64_t off) {
    char *p = buf;
    while (n > 0) {
        ssize_t r = pread(fd, p, (size_t)(n > (1 << 30) ? (1 << 30) : n), (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return 0;
        p += r; n -= r; off += r;
    }
    return 1;
}

/* Opens a file to read and gives its size; anything but a regular file is
   refused before it can block (a FIFO's plain open waits for a writer;
   O_NONBLOCK returns at once and does nothing to a regular file's reads).
   On failure *fd is -1, the message names the path, and *missing says the
   path does not exist (ENOENT: a symlink loop or no permission is not). */
static moept_status moept__open_read(const char *path, int *fd, int64_t *size, int *missing) {
    struct stat sb;
    *fd = open(path, O_RDONLY | O_NONBLOCK);
    *missing = *fd < 0 && errno == ENOENT;
    if (*fd < 0) return moept__thread_fail(MOEPT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (fstat(*fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(*fd);
        *fd = -1;
        return moept__thread_fail(MOEPT_ERR_IO, "%s: not a regular file", path);
    }
    *size = (int64_t)sb.st_size;
    return MOEPT_OK;
}

moept_status moept_st_open(const char *path, moept_st_file **out) {
    if (!out) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_open: out is NULL");
    *out = NULL;
    if (!path) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_open: path is NULL");
    moept_st_file *f = moept__alloc(NULL, sizeof *f);
    if (!f) return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "moept_st_open: out of memory");
    memset(f, 0, sizeof *f);
    int missing;
    moept_status st = moept__open_read(path, &f->fd, &f->file_size, &missing);
    if (st) {
        MOEPT_FREE(f);
        return st;
    }
    unsigned char len8[8];
    if (f->file_size < 8 || !moept__pread_all(f->fd, len8, 8, 0)) {
        st = moept__thread_fail(MOEPT_ERR_FORMAT, "%s: shorter than the 8-byte header length", path);
        goto fail;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | len8[i];
    if (hlen < 2 || hlen > MOEPT__ST_MAX_HEADER) {
        st = moept__thread_fail(MOEPT_ERR_FORMAT, "%s: header length %llu not in 2..%d", path,
                                (unsigned long long)hlen, MOEPT__ST_MAX_HEADER);
        goto fail;
    }
    if ((int64_t)hlen > f->file_size - 8) {
        st = moept__thread_fail(MOEPT_ERR_FORMAT,
                                "%s: header length %llu runs past the end of the file (%lld bytes)", path,
                                (unsigned long long)hlen, (long long)f->file_size);
        goto fail;
    }
    f->data_start = 8 + (int64_t)hlen;
    f->header = moept__alloc(NULL, (size_t)hlen + 1);
    if (!f->header) {
        st = moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
        goto fail;
    }
    if (!moept__pread_all(f->fd, f->header, (int64_t)hlen, 8)) {
        st = moept__thread_fail(MOEPT_ERR_IO, "%s: cannot read the header", path);
        goto fail;
    }
    f->header[hlen] = 0;
    f->bytes_read = 8 + (int64_t)hlen;
    if (!moept__utf8_ok((const unsigned char *)f->header, (int64_t)hlen)) {
        st = moept__thread_fail(MOEPT_ERR_FORMAT, "%s: header is not valid UTF-8", path);
        goto fail;
    }
    st = moept__st_parse(f, path);
    if (st) goto fail;
    *out = f;
    return MOEPT_OK;
fail:
    moept_st_close(f);
    return st;
}

int64_t moept_st_count(const moept_st_file *f) { return f ? f->n_tensors : 0; }

const moept_st_tensor *moept_st_at(const moept_st_file *f, int64_t i) {
    return f && i >= 0 && i < f->n_tensors ? &f->tensors[i] : NULL;
}

const moept_st_tensor *moept_st_find(const moept_st_file *f, const char *name) {
    if (!f || !name) return NULL;
    for (int64_t i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}

const char *moept_st_meta(const moept_st_file *f, const char *key) {
    if (!f || !key) return NULL;
    for (int64_t i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[2 * i], key) == 0) return f->meta[2 * i + 1];
    return NULL;
}

/* fp32 -> IEEE half, round to nearest even (past 65504: Inf; NaN stays NaN) */
static uint16_t moept__f32_to_half(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu, q, rem, half;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* a half subnormal (units of 2^-24) or zero */
        if (a < 0x33000000u) return (uint16_t)sign;
        int shift = 126 - (int)(a >> 23);
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        q = m >> shift; rem = m & ((1u << shift) - 1); half = 1u << (shift - 1);
    } else {
        q = (a - 0x38000000u) >> 13; rem = a & 0x1fffu; half = 0x1000u;
    }
    if (rem > half || (rem == half && (q & 1))) q++;
    return (uint16_t)(sign | q);
}

static float moept__half_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f; memcpy(&f, &bits, 4);
    return f;
}

/* reads the tensor's bytes in chunks through a small stack buffer and
   converts; dst receives numel values of `out_size` bytes */

static moept_status moept__st_read(moept_st_file *f, const moept_st_tensor *t, void *dst,
                                   int64_t numel, int want_int) {
    if (!f || !t || !dst)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_read: NULL argument");
    if (numel != t->numel)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT,
                                  "tensor \"%s\": has %lld elements, caller expects %lld", t->name,
                                  (long long)t->numel, (long long)numel);
    int isint = t->dtype == MOEPT_DTYPE_I64 || t->dtype == MOEPT_DTYPE_I32;
    int isflt = t->dtype == MOEPT_DTYPE_F32 || t->dtype == MOEPT_DTYPE_F16 || t->dtype == MOEPT_DTYPE_BF16 ||
                t->dtype == MOEPT_DTYPE_F64 || t->dtype == MOEPT_DTYPE_F8_E4M3;
    if ((want_int && !isint) || (!want_int && !isflt))
        return moept__thread_fail(MOEPT_ERR_FORMAT, "tensor \"%s\": dtype cannot be read as %s", t->name,
                                  want_int ? "integers" : "floats");
    int64_t es = t->numel ? t->nbytes / t->numel : 1;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* same type on a little-endian host: one positioned read into place */
    if ((!want_int && t->dtype == MOEPT_DTYPE_F32) || (want_int && t->dtype == MOEPT_DTYPE_I64)) {
        if (!moept__pread_all(f->fd, dst, t->nbytes, t->offset))
            return moept__thread_fail(MOEPT_ERR_IO, "tensor \"%s\": read failed", t->name);
        f->bytes_read += t->nbytes;
        return MOEPT_OK;
    }
#endif
    unsigned char buf[1 << 16];
    int64_t per = (int64_t)sizeof buf / es, done = 0;
    while (done < numel) {
        int64_t n = numel - done < per ? numel - done : per;
        if (!moept__pread_all(f->fd, buf, n * es, t->offset + done * es))
            return moept__thread_fail(MOEPT_ERR_IO, "tensor \"%s\": read failed", t->name);
        f->bytes_read += n * es;
        for (int64_t i = 0; i < n; i++) {
            const unsigned char *b = buf + i * es;
            if (want_int) {
                int64_t v;
                if (t->dtype == MOEPT_DTYPE_I64) {
                    uint64_t u = 0;
                    for (int k = 7; k >= 0; k--) u = (u << 8) | b[k];
                    memcpy(&v, &u, 8);
                } else {
                    uint32_t u = 0;
                    for (int k = 3; k >= 0; k--) u = (u << 8) | b[k];
                    int32_t s;
                    memcpy(&s, &u, 4);
                    v = s;
                }
                ((int64_t *)dst)[done + i] = v;
            } else {
                float v;
                if (t->dtype == MOEPT_DTYPE_F32) {
                    uint32_t u = 0;
                    for (int k = 3; k >= 0; k--) u = (u << 8) | b[k];
                    memcpy(&v, &u, 4);
                } else if (t->dtype == MOEPT_DTYPE_F64) {
                    uint64_t u = 0;
                    double d;
                    for (int k = 7; k >= 0; k--) u = (u << 8) | b[k];
                    memcpy(&d, &u, 8);
                    v = (float)d;
                } else if (t->dtype == MOEPT_DTYPE_BF16)
                    v = moept__bf16_to_f32((uint16_t)(b[0] | (b[1] << 8)));
                else if (t->dtype == MOEPT_DTYPE_F8_E4M3) v = moept__e4m3_f32(b[0]);
                else v = moept__half_to_f32((uint16_t)(b[0] | (b[1] << 8)));
                ((float *)dst)[done + i] = v;
            }
        }
        done += n;
    }
    return MOEPT_OK;
}

moept_status moept_st_read_f32(moept_st_file *f, const moept_st_tensor *t, float *dst, int64_t numel) {
    return moept__st_read(f, t, dst, numel, 0);
}

moept_status moept_st_read_i64(moept_st_file *f, const moept_st_tensor *t, int64_t *dst, int64_t numel) {
    return moept__st_read(f, t, dst, numel, 1);
}

/* ---- the writer ---------------------------------------------------------- */
typedef struct moept__st_entry {
    char *name; moept_dtype dtype; int ndim; int64_t shape[8]; const void *data; int64_t nbytes;
} moept__st_entry;

struct moept_st_writer {
    moept__st_entry *e; int64_t n, cap;
    char **meta; int64_t nmeta, metacap;   /* key, value pairs (copies) */
};

static char *moept__strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = moept__alloc(NULL, n);
    if (p) memcpy(p, s, n);
    return p;
}

moept_status moept_st_writer_create(moept_st_writer **out) {
    if (!out) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_writer_create: out is NULL");
    *out = moept__alloc(NULL, sizeof **out);
    if (!*out) return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "moept_st_writer_create: out of memory");
    memset(*out, 0, sizeof **out);
    return MOEPT_OK;
}

void moept_st_writer_destroy(moept_st_writer *w) {
    if (!w) return;
    for (int64_t i = 0; i < w->n; i++) MOEPT_FREE(w->e[i].name);
    for (int64_t i = 0; i < 2 * w->nmeta; i++) MOEPT_FREE(w->meta[i]);
    MOEPT_FREE(w->e);
    MOEPT_FREE(w->meta);
    MOEPT_FREE(w);
}

static const char *moept__dtype_name(moept_dtype t) {
    static const char *n[] = {"F32", "F16", "BF16", "F64", "I64", "I32", "U8", "BOOL", "F8_E4M3"};
    return (unsigned)t < 9 ? n[t] : "?";
}

moept_status moept_st_add(moept_st_writer *w, const char *name, moept_dtype dtype, int ndim,
                          const int64_t *shape, const void *data) {
    if (!w || !name || (ndim > 0 && !shape))
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_add: NULL argument");
    if ((unsigned)dtype > MOEPT_DTYPE_BOOL || ndim < 0 || ndim > 8)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_add(%s): bad dtype or ndim", name);
    if (!name[0] || strcmp(name, "__metadata__") == 0)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_add: invalid tensor name '%s'", name);
    if (!moept__utf8_ok((const unsigned char *)name, (int64_t)strlen(name)))
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_add: tensor name is not UTF-8");
    for (int64_t i = 0; i < w->n; i++)
        if (strcmp(w->e[i].name, name) == 0)
            return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_add: duplicate tensor name '%s'",
                                      name);
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || (shape[d] && numel > INT64_MAX / 8 / shape[d]))
            return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_add(%s): bad shape", name);
        numel *= shape[d];
    }
    if (numel > 0 && !data)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_add(%s): data is NULL", name);
    if (w->n == w->cap) {
        int64_t cap = w->cap ? 2 * w->cap : 16;
        moept__st_entry *e = moept__alloc(NULL, (size_t)cap * sizeof *e);
        if (!e) return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "moept_st_add: out of memory");
        if (w->n) memcpy(e, w->e, (size_t)w->n * sizeof *e);
        MOEPT_FREE(w->e);
        w->e = e; w->cap = cap;
    }
    moept__st_entry *t = &w->e[w->n];
    memset(t, 0, sizeof *t);
    if (!(t->name = moept__strdup(name)))
        return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "moept_st_add: out of memory");
    t->dtype = dtype; t->ndim = ndim; t->data = data;
    for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
    t->nbytes = numel * (int64_t)moept__dtype_size(dtype);
    w->n++;
    return MOEPT_OK;
}

moept_status moept_st_add_meta(moept_st_writer *w, const char *key, const char *value) {
    if (!w || !key || !value)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_add_meta: NULL argument");
    if (!moept__utf8_ok((const unsigned char *)key, (int64_t)strlen(key)) ||
        !moept__utf8_ok((const unsigned char *)value, (int64_t)strlen(value)))
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_add_meta: key or value is not UTF-8");
    for (int64_t i = 0; i < w->nmeta; i++)
        if (strcmp(w->meta[2 * i], key) == 0)
            return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_add_meta: duplicate key '%s'",
                                      key);
    if (w->nmeta == w->metacap) {
        int64_t cap = w->metacap ? 2 * w->metacap : 8;
        char **m = moept__alloc(NULL, (size_t)(2 * cap) * sizeof *m);
        if (!m) return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "moept_st_add_meta: out of memory");
        if (w->nmeta) memcpy(m, w->meta, (size_t)(2 * w->nmeta) * sizeof *m);
        MOEPT_FREE(w->meta);
        w->meta = m; w->metacap = cap;
    }
    char *k = moept__strdup(key), *v = moept__strdup(value);
    if (!k || !v) {
        MOEPT_FREE(k);
        MOEPT_FREE(v);
        return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "moept_st_add_meta: out of memory");
    }
    w->meta[2 * w->nmeta] = k; w->meta[2 * w->nmeta + 1] = v; w->nmeta++;
    return MOEPT_OK;
}

/* appends s as a JSON string; returns the new length (counting only when buf is NULL) */
static size_t moept__json_str(char *buf, size_t at, const char *s) {
    static const char hex[] = "0123456789abcdef";
#define MOEPT__PUT(ch) do { if (buf) buf[at] = (ch); at++; } while (0)
    MOEPT__PUT('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') { MOEPT__PUT('\\'); MOEPT__PUT((char)*p);
        } else if (*p < 0x20) {
            MOEPT__PUT('\\');
            MOEPT__PUT('u');
            MOEPT__PUT('0');
            MOEPT__PUT('0');
            MOEPT__PUT(hex[*p >> 4]);
            MOEPT__PUT(hex[*p & 15]);
        } else MOEPT__PUT((char)*p);
    }
    MOEPT__PUT('"');
#undef MOEPT__PUT
    return at;
}

static size_t moept__json_raw(char *buf, size_t at, const char *s) {
    size_t n = strlen(s);
    if (buf) memcpy(buf + at, s, n);
    return at + n;
}

/* the header JSON; buf NULL: just the length */
static size_t moept__st_header(const moept_st_writer *w, char *buf) {
    size_t at = moept__json_raw(buf, 0, "{");
    int first = 1;
    if (w->nmeta) {
        at = moept__json_raw(buf, at, "\"__metadata__\":{");
        for (int64_t i = 0; i < w->nmeta; i++) {
            if (i) at = moept__json_raw(buf, at, ",");
            at = moept__json_str(buf, at, w->meta[2 * i]);
            at = moept__json_raw(buf, at, ":");
            at = moept__json_str(buf, at, w->meta[2 * i + 1]);
        }
        at = moept__json_raw(buf, at, "}");
        first = 0;
    }
    int64_t off = 0;
    for (int64_t i = 0; i < w->n; i++) {
        const moept__st_entry *t = &w->e[i];
        char num[64];
        if (!first) at = moept__json_raw(buf, at, ",");
        first = 0;
        at = moept__json_str(buf, at, t->name);
        at = moept__json_raw(buf, at, ":{\"dtype\":\"");
        at = moept__json_raw(buf, at, moept__dtype_name(t->dtype));
        at = moept__json_raw(buf, at, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) {
            snprintf(num, sizeof num, d ? ",%lld" : "%lld", (long long)t->shape[d]);
            at = moept__json_raw(buf, at, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%lld,%lld]}", (long long)off,
                 (long long)(off + t->nbytes));
        at = moept__json_raw(buf, at, num);
        off += t->nbytes;
    }
    return moept__json_raw(buf, at, "}");
}

static int moept__write_all(int fd, const void *p, int64_t n) {
    const char *c = p;
    while (n > 0) {
        ssize_t r = write(fd, c, (size_t)(n > (1 << 30) ? (1 << 30) : n));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return 0;
        c += r; n -= r;
    }
    return 1;
}

/* writes `path` atomically with the writer callback's bytes. The temporary
   name is unique per process and call (pid, then a process-wide counter):
   ranks and data-parallel replicas that are threads of one process may
   write the same path at once (replicas write the same bytes; the last
   rename wins). */
typedef int (*moept__emit_fn)(int fd, const void *ctx);
static atomic_ulong moept__tmp_seq;
static moept_status moept__atomic_write(const char *path, moept__emit_fn emit, const void *ctx) {
    size_t pl = strlen(path);
    char *tmp = moept__alloc(NULL, pl + 48);
    if (!tmp) return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    unsigned long seq = atomic_fetch_add(&moept__tmp_seq, 1);
    snprintf(tmp, pl + 48, "%s.tmp.%ld.%lu", path, (long)getpid(), seq);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0) {
        int e = errno;
        MOEPT_FREE(tmp);
        return moept__thread_fail(MOEPT_ERR_IO, "%s: cannot create a temporary file: %s", path, strerror(e));
    }
    int ok = emit(fd, ctx) && fsync(fd) == 0;
    int e = errno;
    ok = close(fd) == 0 && ok;
    if (ok && rename(tmp, path) != 0) { e = errno; ok = 0; }
    if (!ok) {
        unlink(tmp);
        MOEPT_FREE(tmp);
        return moept__thread_fail(MOEPT_ERR_IO, "%s: write failed: %s", path, strerror(e));
    }
    MOEPT_FREE(tmp);
    /* make the rename itself durable */
    char *dir = moept__strdup(path);
    if (dir) {
        char *slash = strrchr(dir, '/');
        if (slash) { if (slash == dir) slash[1] = 0; else *slash = 0; }
        int dfd = open(slash ? dir : ".", O_RDONLY);
        if (dfd >= 0) { fsync(dfd); close(dfd); }
        MOEPT_FREE(dir);
    }
    return MOEPT_OK;
}

static int moept__st_emit(int fd, const void *ctx) {
    const moept_st_writer *w = ctx;
    size_t hl = moept__st_header(w, NULL);
    size_t padded = (hl + 7) / 8 * 8; /* data starts 8-byte aligned, as the reference writer does */
    char *hdr = moept__alloc(NULL, padded + 8);
    if (!hdr) return 0;
    for (int i = 0; i < 8; i++) hdr[i] = (char)((uint64_t)padded >> (8 * i));
    moept__st_header(w, hdr + 8);
    memset(hdr + 8 + hl, ' ', padded - hl);
    int ok = moept__write_all(fd, hdr, (int64_t)padded + 8);
    MOEPT_FREE(hdr);
    for (int64_t i = 0; ok && i < w->n; i++)
        if (w->e[i].nbytes) ok = moept__write_all(fd, w->e[i].data, w->e[i].nbytes); /* little-endian host */
    return ok;
}

moept_status moept_st_write(moept_st_writer *w, const char *path) {
    if (!w || !path) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_st_write: NULL argument");
    if (moept__st_header(w, NULL) > MOEPT__ST_MAX_HEADER)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: header would exceed %d bytes", path,
                                  MOEPT__ST_MAX_HEADER);
    return moept__atomic_write(path, moept__st_emit, w);
}

/* ------------------------------------------------------------------------
   Hugging Face checkpoints: config.json into a moept_config, and one
   decoder layer's weights loaded from and saved as safetensors
   ------------------------------------------------------------------------ */
static void moept__hf_prefix(const moept_layer *L, int64_t layer_index, char *buf, size_t n) {
    snprintf(buf, n, "model.layers.%lld.%s", (long long)layer_index,
             L->cfg.family == MOEPT_FAMILY_MIXTRAL ? "block_sparse_moe." : "mlp.");
}
/* config.json's top-level keys: numbers (true/false as 1/0), null,
   strings, and the raw text of arrays (read when asked for). */
#define MOEPT__HF_KEYS 512
#define MOEPT__CONFIG_MAX (1 << 20)
enum { MOEPT__HK_NUM, MOEPT__HK_NULL, MOEPT__HK_STR, MOEPT__HK_ARR, MOEPT__HK_OTHER };
typedef struct moept__hfconf {
    char path[4096];
    char *text, *raw;      /* [size + 1] the parsed text (strings unescaped in place), its copy */
    int64_t size;
    int n;
    char *key[MOEPT__HF_KEYS], *str[MOEPT__HF_KEYS];
    int kind[MOEPT__HF_KEYS];
    int form[MOEPT__HF_KEYS]; /* a number's JSON form: 0 float (8.0, 1E1), 1 integer, 2 true/false */
    double num[MOEPT__HF_KEYS];
} moept__hfconf;

/* a top-level value (the document checked): arrays and objects are read
   later from their raw text, where h->str[i] points */
static int moept__hf_value(moept__json *j, moept__hfconf *h, int i) {
    moept__ws(j);
    if (j->p >= j->end) return 0;
    char c = *j->p;
    h->str[i] = j->p;
    if (c == '"') { h->kind[i] = MOEPT__HK_STR; return (h->str[i] = moept__jstring(j)) != NULL; }
    if (c == '[') { h->kind[i] = MOEPT__HK_ARR; return moept__jvalue(j, 1, NULL); }
    if (c == '{') { h->kind[i] = MOEPT__HK_OTHER; return moept__jvalue(j, 1, NULL); }
    static const char *words[3] = {"true", "false", "null"};
    for (int w = 0; w < 3; w++)
        if (j->end - j->p >= (ptrdiff_t)strlen(words[w]) && memcmp(j->p, words[w], strlen(words[w])) == 0) {
            j->p += strlen(words[w]);
            h->kind[i] = w == 2 ? MOEPT__HK_NULL : MOEPT__HK_NUM;
            h->num[i] = w == 0;
            h->form[i] = 2;
            return 1;
        }
    h->kind[i] = MOEPT__HK_NUM;
    const char *at = j->p;
    if (!moept__jnum(j, &h->num[i])) return 0;
    h->form[i] = 1; /* Python's json: an int unless a fraction or an exponent is written */
    for (; at < j->p; at++)
        if (*at == '.' || *at == 'e' || *at == 'E') h->form[i] = 0;
    return 1;
}

static moept_status moept__hf_parse(moept__hfconf *h, char *buf, int64_t size) {
    moept_status st = moept__json_check(buf, size, h->path);
    if (st) return st;
    moept__json j = {buf, buf + size, NULL};
    int64_t n = 0;
    char *k;
    while (moept__jmember(&j, &n, &k)) {
        if (h->n == MOEPT__HF_KEYS)
            return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: more than %d keys", h->path, MOEPT__HF_KEYS);
        if (!moept__hf_value(&j, h, h->n)) break;
        h->key[h->n++] = k;
    }
    if (j.err) return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: not a JSON object (%s)", h->path, j.err);
    return MOEPT_OK;
}

/* the raw (undecoded) text of top-level value i, to its end */
static moept__json moept__hf_raw(const moept__hfconf *h, int i) {
    moept__json j = {h->raw + (h->str[i] - h->text), h->raw + h->size, NULL};
    return j;
}

static void moept__hf_free(moept__hfconf *h) {
    if (h) MOEPT_FREE(h->text);
    MOEPT_FREE(h);
}

/* Reads and parses the config.json at `file` into *out (free with
   moept__hf_free); *missing: there is no such file. */
static moept_status moept__hf_load(const char *file, moept__hfconf **out, int *missing) {
    int fd;
    int64_t size = 0;
    *out = NULL;
    moept_status st = moept__open_read(file, &fd, &size, missing);
    if (st) return st;
    moept__hfconf *h = moept__alloc(NULL, sizeof *h);
    char *buf = size > 0 && size <= MOEPT__CONFIG_MAX ? moept__alloc(NULL, 2 * ((size_t)size + 1)) : NULL;
    int got = buf && h && moept__pread_all(fd, buf, (size_t)size, 0);
    close(fd);
    if (!got) {
        MOEPT_FREE(buf);
        MOEPT_FREE(h);
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: empty, unreadable or over %d bytes", file,
                                  MOEPT__CONFIG_MAX);
    }
    memset(h, 0, sizeof *h);
    snprintf(h->path, sizeof h->path, "%s", file);
    buf[size] = 0;
    h->text = buf;
    h->raw = memcpy(buf + size + 1, buf, (size_t)size + 1);
    h->size = size;
    if ((st = moept__hf_parse(h, buf, size))) {
        moept__hf_free(h);
        return st;
    }
    *out = h;
    return MOEPT_OK;
}

static int moept__hf_key(const moept__hfconf *h, const char *key) {
    for (int i = 0; i < h->n; i++)
        if (strcmp(h->key[i], key) == 0) return i;
    return -1;
}

/* An integer key in lo..hi; absent or null: dflt (-1: required) */
static moept_status moept__hf_int(const moept__hfconf *h, const char *key, int64_t dflt, int64_t lo,
                                  int64_t hi, int64_t *out) {
    int i = moept__hf_key(h, key);
    if (i < 0 || h->kind[i] == MOEPT__HK_NULL) {
        if (dflt < 0) return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"%s\" is missing", h->path, key);
        *out = dflt;
        return MOEPT_OK;
    }
    double v = h->num[i];
    const int flag = lo == 0 && hi == 1 && h->form[i] == 2; /* a boolean key: true, false, 0 or 1 */
    if (h->kind[i] != MOEPT__HK_NUM || (h->form[i] != 1 && !flag) || v != floor(v) || v < (double)lo ||
        v > (double)hi)
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"%s\" must be a JSON integer in %lld..%lld%s "
                                  "(as transformers reads it)", h->path, key, (long long)lo, (long long)hi,
                                  h->kind[i] != MOEPT__HK_NUM ? "" : h->form[i] == 2 ? ", not a boolean"
                                  : h->form[i] == 0 ? ", not a float (a fraction or an exponent)" : "");
    *out = (int64_t)v;
    return MOEPT_OK;
}

static moept_status moept__hf_float(const moept__hfconf *h, const char *key, double dflt, float *out) {
    int i = moept__hf_key(h, key);
    double v = i < 0 || h->kind[i] == MOEPT__HK_NULL ? dflt : h->num[i];
    if ((i >= 0 && h->kind[i] != MOEPT__HK_NUM && h->kind[i] != MOEPT__HK_NULL) || !(fabs(v) <= 3.4e38))
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"%s\" must be a finite number", h->path, key);
    *out = (float)v;
    return MOEPT_OK;
}

static const char *moept__hf_str(const moept__hfconf *h, const char *key, const char *dflt) {
    int i = moept__hf_key(h, key);
    return i >= 0 && h->kind[i] == MOEPT__HK_STR ? h->str[i]
        : i >= 0 && h->kind[i] != MOEPT__HK_NULL ? ""
                                                 : dflt;
}

/* Qwen's mlp_only_layers: is `layer` listed (a list of integers)? */
static moept_status moept__hf_listed(const moept__hfconf *h, const char *key, int64_t layer, int *listed) {
    int i = moept__hf_key(h, key);
    *listed = 0;
    if (i < 0 || h->kind[i] == MOEPT__HK_NULL) return MOEPT_OK;
    int ok = h->kind[i] == MOEPT__HK_ARR;
    moept__json j = moept__hf_raw(h, i);
    int64_t n = 0, v;
    while (ok && moept__jelement(&j, &n)) {
        ok = moept__juint(&j, &v);
        if (ok && v == layer) *listed = 1;
    }
    if (!ok || j.err)
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"%s\" must be a list of layer numbers", h->path,
                                  key);
    return MOEPT_OK;
}

/* model_type: the family, and the keys that hold its expert count and
   expert FFN size (*ekey, *fkey) */
static moept_status moept__hf_model_type(const moept__hfconf *h, moept_config *c, const char **ekey,
                                         const char **fkey) {
    const char *mt = moept__hf_str(h, "model_type", NULL), *P = h->path;
    if (!mt) return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"model_type\" is missing", P);
    *ekey = "num_experts";
    *fkey = "moe_intermediate_size";
    if (strcmp(mt, "mixtral") == 0) {
        c->family = MOEPT_FAMILY_MIXTRAL;
        *ekey = "num_local_experts";
        *fkey = "intermediate_size";
    }
    else if (strcmp(mt, "qwen2_moe") == 0 || strcmp(mt, "qwen3_moe") == 0) {
        /* transformers 5 writes qwen3's count as num_local_experts */
        c->family = MOEPT_FAMILY_QWEN2_MOE;
        int a = moept__hf_key(h, "num_experts"), b = moept__hf_key(h, "num_local_experts");
        if (a >= 0 && b >= 0 && h->kind[a] == MOEPT__HK_NUM && h->kind[b] == MOEPT__HK_NUM &&
            h->num[a] != h->num[b])
            return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: keys \"num_experts\" and \"num_local_experts\" "
                                      "differ", P);
        if (a < 0 && b >= 0) *ekey = "num_local_experts";
    }
    else if (strcmp(mt, "olmoe") == 0) { c->family = MOEPT_FAMILY_OLMOE; *fkey = "intermediate_size"; }
    else if (strcmp(mt, "deepseek_v3") == 0) {
        c->family = MOEPT_FAMILY_DEEPSEEK_V3;
        *ekey = "n_routed_experts";
    }
    else return moept__thread_fail(MOEPT_ERR_UNSUPPORTED, "%s: \"model_type\" \"%s\" is not mixtral, "
                                   "qwen2_moe, qwen3_moe, olmoe or deepseek_v3", P, mt);
    return MOEPT_OK;
}

/* deepseek_v3's routing: sigmoid scores, noaux_tc, and n_group groups of
   which topk_group are chosen, as moept_create takes them */
static moept_status moept__hf_ds_groups(const moept__hfconf *h, int64_t E, int64_t K, int64_t ng,
                                        int64_t tg) {
    const char *P = h->path;
    const char *sf = moept__hf_str(h, "scoring_func", "sigmoid");
    const char *tm = moept__hf_str(h, "topk_method", "noaux_tc");
    if (strcmp(sf, "sigmoid") != 0 || strcmp(tm, "noaux_tc") != 0)
        return moept__thread_fail(MOEPT_ERR_UNSUPPORTED, "%s: key \"%s\" is \"%s\"; deepseek_v3 routes by "
                                  "\"sigmoid\" with \"noaux_tc\"", P, strcmp(sf, "sigmoid") ? "scoring_func"
                                  : "topk_method", strcmp(sf, "sigmoid") ? sf : tm);
    if (E > 0 && (E % ng != 0 || tg > ng))
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: keys \"n_group\" (%lld) and \"topk_group\" (%lld) "
                                  "do not split \"n_routed_experts\" (%lld)", P, (long long)ng, (long long)tg,
                                  (long long)E);
    /* moept_create's group rules: a group's score is its best two experts'; K from topk_group groups */
    if (E > 0 && ng > 1 && (E / ng < 2 || K > tg * (E / ng)))
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: keys \"n_group\" (%lld) and \"topk_group\" "
                                  "(%lld) leave groups of fewer than 2 experts or fewer than "
                                  "\"num_experts_per_tok\" (%lld) to choose from", P, (long long)ng,
                                  (long long)tg, (long long)K);
    return MOEPT_OK;
}

/* The model's sizes and routing for one layer; the MoE-or-dense rules are
   transformers': qwen2/qwen3 (layer + 1) % decoder_sparse_step == 0 and not
   in mlp_only_layers; deepseek_v3 layer >= first_k_dense_replace (and, as
   DeepSeek's own code, layer % moe_layer_freq == 0). Absent non-size keys
   take transformers' class defaults. */
static moept_status moept__hf_family(const moept__hfconf *h, int64_t layer, moept_config *c) {
    const char *P = h->path, *ekey, *fkey;
    int64_t E, K, L, v, ng = 1, tg = 1, dense = 0, shared = 0;
    moept_status st = moept__hf_model_type(h, c, &ekey, &fkey);
    if (st) return st;
    int qwen3 = strcmp(moept__hf_str(h, "model_type", ""), "qwen3_moe") == 0;
    if ((st = moept__hf_int(h, "hidden_size", -1, 1, 1 << 20, &c->hidden_size)) ||
        (st = moept__hf_int(h, fkey, -1, 1, 1 << 20, &c->intermediate_size)) ||
        (st = moept__hf_int(h, ekey, -1, 0, 65536, &E)) ||
        (st = moept__hf_int(h, "num_experts_per_tok", -1, 1, 65536, &K)) ||
        (st = moept__hf_int(h, "num_hidden_layers", -1, 1, 1 << 20, &L)))
        return st;
    if (layer < 0 || layer >= L)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: layer %lld is not in "
                                  "0..num_hidden_layers-1 (%lld)", P, (long long)layer, (long long)L);
    if (c->family == MOEPT_FAMILY_QWEN2_MOE) {
        int listed;
        if ((st = moept__hf_int(h, "decoder_sparse_step", 1, 1, 1 << 20, &v)) ||
            (st = moept__hf_listed(h, "mlp_only_layers", layer, &listed)))
            return st;
        dense = listed || E == 0 || (layer + 1) % v != 0;
        if (!qwen3 && (st = moept__hf_int(h, "shared_expert_intermediate_size", -1, 0, 1 << 20, &shared)))
            return st;
    } else if (c->family == MOEPT_FAMILY_DEEPSEEK_V3) {
        int64_t first, freq, ns;
        if ((st = moept__hf_int(h, "first_k_dense_replace", 3, 0, 1 << 20, &first)) ||
            (st = moept__hf_int(h, "moe_layer_freq", 1, 1, 1 << 20, &freq)) ||
            (st = moept__hf_int(h, "n_shared_experts", 1, 0, 1 << 10, &ns)) ||
            (st = moept__hf_int(h, "n_group", 8, 1, 64, &ng)) ||
            (st = moept__hf_int(h, "topk_group", 4, 1, 64, &tg)) ||
            (st = moept__hf_float(h, "routed_scaling_factor", 2.5, &c->routed_scaling_factor)))
            return st;
        if (!(c->routed_scaling_factor > 0.0f)) /* (as a float: moept_config's 0 means 1.0) */
            return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"routed_scaling_factor\" must be > 0", P);
        dense = layer < first || layer % freq != 0;
        shared = ns * c->intermediate_size; /* at most 2^10 x 2^20 */
        if (shared > (1 << 20))
            return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: keys \"n_shared_experts\" (%lld) x \"%s\" "
                                      "(%lld) exceed 1048576", P, (long long)ns, fkey,
                                      (long long)c->intermediate_size);
        if ((st = moept__hf_ds_groups(h, E, K, ng, tg))) return st;
    }
    if (dense || E == 0)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: layer %lld is a dense MLP layer, not MoE",
                                  P, (long long)layer);
    if (K > E)
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"num_experts_per_tok\" (%lld) exceeds \"%s\" "
                                  "(%lld)", P, (long long)K, ekey, (long long)E);
    c->num_experts = E; c->top_k = K; c->shared_intermediate_size = shared;
    c->n_group = ng; c->topk_group = tg;
    return MOEPT_OK;
}

/* Activation, top-k renormalisation and the aux loss's coefficient */
static moept_status moept__hf_behaviour(const moept__hfconf *h, moept_config *c) {
    const char *act = moept__hf_str(h, "hidden_act", "silu");
    if (strcmp(act, "silu") == 0 || strcmp(act, "swish") == 0) c->activation = MOEPT_ACT_SILU_GATED;
    else if (strcmp(act, "gelu") == 0) c->activation = MOEPT_ACT_GELU_GATED;
    else return moept__thread_fail(MOEPT_ERR_UNSUPPORTED, "%s: key \"hidden_act\" \"%s\" is not silu or gelu",
                                   h->path, act);
    int64_t norm;
    moept_status st;
    if (c->family == MOEPT_FAMILY_MIXTRAL) c->norm_topk_prob = MOEPT_NORM_DEFAULT; /* always on: no key */
    else if ((st = moept__hf_int(h, "norm_topk_prob", c->family == MOEPT_FAMILY_DEEPSEEK_V3, 0, 1, &norm)))
        return st;
    else c->norm_topk_prob = norm ? MOEPT_NORM_ON : MOEPT_NORM_OFF;
    c->aux_loss = MOEPT_AUX_NONE;
    c->aux_loss_coef = 0.0f;
    if (c->family != MOEPT_FAMILY_DEEPSEEK_V3) { /* deepseek_v3 balances by its correction bias */
        if ((st = moept__hf_float(h, "router_aux_loss_coef", c->family == MOEPT_FAMILY_OLMOE ? 0.01 : 0.001,
                                  &c->aux_loss_coef)))
            return st;
        if (c->aux_loss_coef < 0.0f)
            return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"router_aux_loss_coef\" is negative",
                                      h->path);
        c->aux_loss = c->aux_loss_coef > 0.0f ? MOEPT_AUX_HF : MOEPT_AUX_NONE;
    }
    c->router_jitter = 0.0f;
    if (c->family == MOEPT_FAMILY_MIXTRAL) { /* (transformers jitters the experts' input too: see moept.h) */
        if ((st = moept__hf_float(h, "router_jitter_noise", 0.0, &c->router_jitter))) return st;
        if (!(c->router_jitter >= 0.0f && c->router_jitter < 1.0f))
            return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"router_jitter_noise\" is not in [0, 1)",
                                      h->path);
    }
    return MOEPT_OK;
}

moept_status moept_config_from_hf(const char *path, int64_t layer, moept_config *cfg) {
    if (!path || !cfg)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_config_from_hf: %s is NULL",
                                  path ? "cfg" : "path");
    char file[4096];
    struct stat sb;
    int isdir = stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
    if (snprintf(file, sizeof file, isdir ? "%s/config.json" : "%s", path) >= (int)sizeof file)
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_config_from_hf: path too long");
    int missing;
    moept__hfconf *h;
    moept_status st = moept__hf_load(file, &h, &missing);
    if (st) return st;
    moept_config c = *cfg; /* max_tokens and the training choices stay the caller's */
    if (!(st = moept__hf_family(h, layer, &c))) st = moept__hf_behaviour(h, &c);
    moept__hf_free(h);
    if (!st) {
        c.shared_gate = MOEPT_SHARED_GATE_DEFAULT;
        c.group_fill = MOEPT_GROUP_FILL_NEG_INF; /* the reference's; config.json has no key */
        if (c.family != MOEPT_FAMILY_DEEPSEEK_V3) c.routed_scaling_factor = 0.0f;
        *cfg = c;
    }
    return st;
}

typedef struct moept__hf_src {
    int64_t fp8_block[2];              /* FP8 weights' scale blocks (config.json) */
    char **files;  int64_t nfiles;     /* shard file names */
    char **names; int64_t *file_of; int64_t nnames; /* weight_map */
    char *json;                        /* the index text (names point in here) */
    moept_st_file **open;              /* [nfiles] opened on demand */
} moept__hf_src;

static void moept__hf_src_free(moept__hf_src *s) {
    for (int64_t i = 0; i < s->nfiles; i++) { if (s->open) moept_st_close(s->open[i]); }
    MOEPT_FREE(s->open);
    MOEPT_FREE(s->files);
    MOEPT_FREE(s->names);
    MOEPT_FREE(s->file_of);
    MOEPT_FREE(s->json);
}

/* model.safetensors.index.json -> weight_map; or a single model.safetensors */
static moept_status moept__hf_open(const char *dir, moept__hf_src *s, int64_t *bytes) {
    memset(s, 0, sizeof *s);
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    int fd, missing;
    int64_t n = 0;
    moept_status st = moept__open_read(path, &fd, &n, &missing);
    if (st && !missing) return st; /* a symlink loop, no permission, a FIFO: not "no index" */
    if (st) { /* one file */
        s->files = moept__alloc(NULL, sizeof(char *));
        s->open = moept__alloc(NULL, sizeof(moept_st_file *));
        if (!s->files || !s->open)
            return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory", dir);
        s->files[0] = "model.safetensors";
        s->open[0] = NULL;
        s->nfiles = 1;
        return MOEPT_OK;
    }
    if (n > MOEPT__ST_MAX_HEADER) {
        close(fd);
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: larger than %d bytes", path, MOEPT__ST_MAX_HEADER);
    }
    s->json = moept__alloc(NULL, (size_t)n + 1);
    if (!s->json) {
        close(fd);
        return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    int ok = moept__pread_all(fd, s->json, n, 0);
    close(fd);
    if (!ok) return moept__thread_fail(MOEPT_ERR_IO, "%s: read failed", path);
    *bytes += n;
    s->json[n] = 0;
    if ((st = moept__json_check(s->json, n, path))) return st; /* (a name twice in weight_map, too) */
    int64_t cap = 1;
    for (int64_t i = 0; i < n; i++) cap += s->json[i] == ':';
    s->names = moept__alloc(NULL, (size_t)cap * sizeof(char *));
    s->file_of = moept__alloc(NULL, (size_t)cap * sizeof(int64_t));
    s->files = moept__alloc(NULL, (size_t)cap * sizeof(char *));
    if (!s->names || !s->file_of || !s->files)
        return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    moept__json j = {s->json, s->json + n, NULL};
    int have_map = 0;
    int64_t m = 0, e;
    char *k, *name, *file;
#define MOEPT__IFAIL(what) \
    return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: %s (%s)", path, what, j.err ? j.err : "syntax")
    while (moept__jmember(&j, &m, &k)) {
        if (strcmp(k, "weight_map") != 0) {
            if (!moept__jvalue(&j, 1, NULL)) break;
            continue;
        }
        have_map = 1;
        for (e = 0; moept__jmember(&j, &e, &name);) {
            if (!(file = moept__jstring(&j))) MOEPT__IFAIL("weight_map values must be file names");
            if (strchr(file, '/') || strcmp(file, "..") == 0 || !file[0])
                MOEPT__IFAIL("shard names must be plain file names");
            int64_t f = 0;
            while (f < s->nfiles && strcmp(s->files[f], file) != 0) f++;
            if (f == s->nfiles) s->files[s->nfiles++] = file;
            s->names[s->nnames] = name;
            s->file_of[s->nnames++] = f;
        }
        if (j.err) MOEPT__IFAIL("bad weight_map");
    }
    if (j.err) MOEPT__IFAIL("bad index");
    if (!have_map) MOEPT__IFAIL("no weight_map");
#undef MOEPT__IFAIL
    s->open = moept__alloc(NULL, (size_t)(s->nfiles ? s->nfiles : 1) * sizeof(moept_st_file *));
    if (!s->open) return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    for (int64_t i = 0; i < s->nfiles; i++) s->open[i] = NULL;
    return MOEPT_OK;
}

/* finds `name` in the checkpoint, opening (header only) its shard on demand */
static moept_status moept__hf_find(const char *dir, moept__hf_src *s, const char *name, moept_st_file **f,
                                   const moept_st_tensor **t, int64_t *bytes) {
    int64_t fi = 0;
    if (s->json) { /* an index: its weight_map (even an empty one) says where, not the single file */
        int64_t i = 0;
        while (i < s->nnames && strcmp(s->names[i], name) != 0) i++;
        if (i == s->nnames)
            return moept__thread_fail(MOEPT_ERR_NOT_FOUND, "%s: '%s' is not in the weight_map", dir, name);
        fi = s->file_of[i];
    }
    if (!s->open[fi]) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, s->files[fi]);
        moept_status st = moept_st_open(path, &s->open[fi]);
        if (st) return st;
        *bytes += s->open[fi]->bytes_read;
    }
    *f = s->open[fi];
    *t = moept_st_find(*f, name);
    if (!*t) return moept__thread_fail(MOEPT_ERR_NOT_FOUND, "%s/%s: no tensor '%s'", dir, s->files[fi], name);
    return MOEPT_OK;
}

/* One member of config.json's quantization_config (j at its value):
   weight_block_size is honoured; fmt, quant_method and activation_scheme
   must be DeepSeek-V3's, the only FP8 scheme moept dequantises (E4M3
   weights times one scale a block); other keys are not read. */
static moept_status moept__hf_quant_key(moept__json *j, const char *k, const char *path, int64_t blk[2]) {
    static const char *const want[3][2] = {
        {"fmt", "e4m3"}, {"quant_method", "fp8"}, {"activation_scheme", "dynamic"}};
    if (strcmp(k, "weight_block_size") == 0) {
        if (moept__jchar(j, '[') && moept__juint(j, &blk[0]) && moept__jchar(j, ',') &&
            moept__juint(j, &blk[1]) && moept__jchar(j, ']') && blk[0] > 0 && blk[1] > 0)
            return MOEPT_OK;
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"quantization_config\": weight_block_size "
                                  "must be [rows, cols] (positive integers)", path);
    }
    for (int i = 0; i < 3; i++) {
        if (strcmp(k, want[i][0]) != 0) continue;
        const char *v = moept__jpeek(j, '"') ? moept__jstring(j) : NULL;
        if (!v)
            return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: quantization_config.%s must be a string "
                                      "(\"%s\")", path, k, want[i][1]);
        if (strcmp(v, want[i][1]) != 0)
            return moept__thread_fail(MOEPT_ERR_UNSUPPORTED, "%s: quantization_config.%s is \"%s\": moept "
                                      "loads only \"%s\" (DeepSeek-V3's block-scaled FP8)", path, k, v,
                                      want[i][1]);
        return MOEPT_OK;
    }
    if (moept__jvalue(j, 1, NULL)) return MOEPT_OK;
    return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"quantization_config\": %s", path,
                              j->err ? j->err : "syntax");
}

/* The scale block of FP8 weights: config.json's
   quantization_config.weight_block_size, or DeepSeek-V3's 128 x 128 where
   the directory has no config.json or it says nothing; the object's other
   fields checked (moept__hf_quant_key) */
static moept_status moept__hf_fp8_block(const char *dir, int64_t blk[2]) {
    blk[0] = blk[1] = 128;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    int missing;
    moept__hfconf *h;
    moept_status st = moept__hf_load(path, &h, &missing);
    if (st) return missing ? MOEPT_OK : st;
    int i = moept__hf_key(h, "quantization_config");
    if (i >= 0 && h->kind[i] != MOEPT__HK_OTHER && h->kind[i] != MOEPT__HK_NULL)
        st = moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"quantization_config\" must be an object", path);
    if (i >= 0 && h->kind[i] == MOEPT__HK_OTHER) {
        moept__json j = moept__hf_raw(h, i);
        int64_t n = 0;
        char *k;
        while (!st && moept__jmember(&j, &n, &k)) st = moept__hf_quant_key(&j, k, path, blk);
        if (!st && j.err)
            st = moept__thread_fail(MOEPT_ERR_FORMAT, "%s: key \"quantization_config\": %s", path, j.err);
    }
    moept__hf_free(h);
    return st;
}

/* An FP8 weight dst [rows][cols] times its `<name>_scale_inv` [ceil(rows /
   br)][ceil(cols / bc)] block scales (F32 or BF16), in place */
static moept_status moept__hf_fp8_scale(const char *dir, moept__hf_src *src, const char *name, int64_t rows,
                                        int64_t cols, float *dst, int64_t *bytes) {
    char sname[300];
    snprintf(sname, sizeof sname, "%s_scale_inv", name);
    moept_st_file *f = NULL;
    const moept_st_tensor *t = NULL;
    moept_status st = moept__hf_find(dir, src, sname, &f, &t, bytes);
    if (st)
        return moept__thread_fail(MOEPT_ERR_NOT_FOUND, "%s: FP8 tensor '%s' has no '%s'", dir, name, sname);
    /* ceil(rows / br) as rows / br + remainder: br comes from config.json, up to 2^63 - 1 */
    const int64_t br = src->fp8_block[0], bc = src->fp8_block[1];
    const int64_t sr = rows / br + (rows % br != 0), sc = cols / bc + (cols % bc != 0);
    if (t->ndim != 2 || t->shape[0] != sr || t->shape[1] != sc || (t->dtype != MOEPT_DTYPE_F32 &&
                                                                   t->dtype != MOEPT_DTYPE_BF16))
        return moept__thread_fail(MOEPT_ERR_FORMAT,
                                  "%s: '%s' must be F32 or BF16 [%lld, %lld] (blocks of %lld x "
                                  "%lld: config.json's quantization_config.weight_block_size)",
                                  dir, sname, (long long)sr, (long long)sc, (long long)br, (long long)bc);
    float *scale = moept__alloc(NULL, (size_t)(sr * sc) * sizeof(float));
    if (!scale) return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "%s: out of memory", dir);
    int64_t before = f->bytes_read;
    st = moept_st_read_f32(f, t, scale, sr * sc);
    *bytes += f->bytes_read - before;
    /* 0, -0 or < 0 zeroes or negates a block, a denormal loses its bits: a corrupt file, not a scale */
    for (int64_t b = 0; !st && b < sr * sc; b++) {
        uint32_t u;
        memcpy(&u, &scale[b], sizeof u);
        if (u < 0x00800000u || u >= 0x7f800000u) /* not in [2^-126, FLT_MAX] (the sign bit: >= 2^31) */
            st = moept__thread_fail(MOEPT_ERR_NUMERIC, "%s: '%s' block [%lld][%lld] is %g: a scale must be a "
                                    "positive normal finite number", dir, sname, (long long)(b / sc),
                                    (long long)(b % sc), (double)scale[b]);
    }
    for (int64_t r = 0; !st && r < rows; r++) /* e4m3 x float: one rounding, as float64 then float */
        for (int64_t c = 0; c < cols; c++) dst[r * cols + c] *= scale[r / br * sc + c / bc];
    MOEPT_FREE(scale);
    return st;
}

/* One parameter's tensor of an HF checkpoint, checked (shape, dtype,
   finiteness), into dst, an FP8 one dequantised; *bytes counts what was
   read. */
static moept_status moept__hf_read_one(const char *dir, moept__hf_src *src, const char *name,
                                       const moept__param *p, float *dst, int64_t *bytes) {
    moept_st_file *f = NULL;
    const moept_st_tensor *t = NULL;
    moept_status st = moept__hf_find(dir, src, name, &f, &t, bytes);
    if (st) return st;
    int shape_ok = (t->ndim == 2 && t->shape[0] == p->rows && t->shape[1] == p->cols) ||
                   (t->ndim == 1 && p->rows == 1 && t->shape[0] == p->cols);
    if (!shape_ok)
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: tensor '%s' has shape [%lld%s%lld], the layer "
                                  "expects [%lld, %lld]", dir, name, (long long)t->shape[0],
                                  t->ndim > 1 ? ", " : "", (long long)(t->ndim > 1 ? t->shape[1] : 0),
                                  (long long)p->rows, (long long)p->cols);
    if (t->dtype != MOEPT_DTYPE_F32 && t->dtype != MOEPT_DTYPE_BF16 && t->dtype != MOEPT_DTYPE_F16 &&
        t->dtype != MOEPT_DTYPE_F8_E4M3)
        return moept__thread_fail(MOEPT_ERR_FORMAT,
                                  "%s: tensor '%s' is %s; F32, BF16, F16 or F8_E4M3 expected", dir, name,
                                  moept__dtype_name(t->dtype));
    int64_t before = f->bytes_read;
    st = moept_st_read_f32(f, t, dst, p->rows * p->cols);
    *bytes += f->bytes_read - before;
    if (!st && t->dtype == MOEPT_DTYPE_F8_E4M3)
        st = moept__hf_fp8_scale(dir, src, name, p->rows, p->cols, dst, bytes);
    for (int64_t k = 0; !st && k < p->rows * p->cols; k++)
        if (!moept__finite(dst[k]))
            st = moept__thread_fail(MOEPT_ERR_NUMERIC, "%s: tensor '%s' element %lld is not finite", dir,
                                    name, (long long)k);
    return st;
}

/* A collective load (moept_load_hf, moept_load_checkpoint): every rank
   reads its part into a staging copy and changes nothing, all agree, then
   all commit or none does (one rank's bad file fails every rank, and no
   replica diverges). A loader gives its read and its commit. */
typedef struct moept__load moept__load;
struct moept__load {
    const char *call;      /* the public call, for messages */
    int id;                /* its MOEPT__CALL_* */
    uint64_t args;         /* the arguments every rank must pass alike */
    const char *bad_args;  /* non-NULL: the arguments are refused, with this */
    int copies;            /* the stage: [copies * n_params] then the bias [E] */
    moept_status (*read)(const moept_layer *L, moept__load *ld, float *stage, int64_t *bytes);
    moept_status (*commit)(moept_layer *L, moept__load *ld, const float *stage); /* fails: a device's */
    const char *dir;       /* the loader's arguments */
    int64_t layer_index;
    long long step;        /* the checkpoint's step (its read sets it) */
    float *opt;            /* [2 n_params] AdamW state its read allocated: freed unless committed */
    int moments;           /* the layer has moments once committed (its read made them ready) */
};

static moept_status moept__load_staged(moept_layer *L, moept__load *ld) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: layer is NULL", ld->call);
    if (L->fsdp) /* the same on every rank: the config was agreed at create */
        return moept__fail(L, MOEPT_ERR_UNSUPPORTED, "%s: not in fsdp mode (the expert-parallel layer is the "
                           "one that saves, loads and reshards)", ld->call);
    const size_t nstage = (size_t)ld->copies * (size_t)L->par.n_params + (size_t)L->E;
    int64_t bytes = 0; /* counted only if the load commits */
    float *stage = NULL; /* (a whole copy, what this call needs while it runs) */
    /* (a device's pending errors: agreed here, not found by the commit on one rank) */
    moept_status local = moept__io(L, MOEPT_BUF_PARAMS, 0, 0, NULL, 0);
    moept_status st = local ? local
                      : ld->bad_args ? moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s", ld->bad_args)
                      : !(stage = moept__alloc(NULL, nstage * sizeof(float)))
                          ? moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "out of memory")
                          : ld->read(L, ld, stage, &bytes);
    if (st && !local) local = moept__fail(L, st, "%s: %s", ld->call, moept__thread_err);
    if ((st = moept__agree_call(L, L->group, L->dp, local, ld->id, ld->args))) { /* statistics neither */
        MOEPT_FREE(stage);
        MOEPT_FREE(ld->opt);
        return st;
    }
    /* the device writes first, then the host's state; a device that fails them (after the agreement:
       this rank alone) fails every rank through the commit's own agreement */
    st = ld->commit(L, ld, stage);
    MOEPT_FREE(stage);
    moept__stale_forwards(L, ld->call);
    if (!st) st = moept__params_written(L);
    if (!st) st = moept__tables_changed(L);
    if (!st) L->stats.checkpoint_bytes_read += bytes;
    local = st ? moept__fail(L, st, "%s: the commit on this rank failed (the layer may be part-loaded: "
                             "load again): %s", ld->call, moept__thread_err) : MOEPT_OK;
    return moept__agree_call(L, L->group, L->dp, local, MOEPT__CALL_LOAD_COMMIT, 0);
}

/* Every parameter of decoder layer `layer_index` into stage [n_params + E]
   (the bias last); changes nothing. */
static moept_status moept__hf_read(const moept_layer *L, const char *dir, int64_t layer_index, float *stage,
                                   int64_t *bytes) {
    char prefix[128], name[256];
    moept__hf_prefix(L, layer_index, prefix, sizeof prefix);
    moept__hf_src src;
    moept_status st = moept__hf_open(dir, &src, bytes);
    if (!st) st = moept__hf_fp8_block(dir, src.fp8_block);
    for (int64_t i = 0; !st && i < L->par.n_table; i++) {
        const moept__param *p = &L->par.table[i];
        snprintf(name, sizeof name, "%s%s", prefix, p->name);
        float *dst = p->type == MOEPT__P_BIAS ? stage + L->par.n_params : stage + p->off;
        st = moept__hf_read_one(dir, &src, name, p, dst, bytes);
    }
    moept__hf_src_free(&src);
    return st;
}

static moept_status moept__hf_stage(const moept_layer *L, moept__load *ld, float *stage, int64_t *bytes) {
    return moept__hf_read(L, ld->dir, ld->layer_index, stage, bytes);
}

static moept_status moept__hf_commit(moept_layer *L, moept__load *ld, const float *stage) {
    (void)ld;
    moept_status st = moept__io(L, MOEPT_BUF_PARAMS, 0, L->par.n_params, (float *)stage, 1);
    if (!st) memcpy(L->par.bias, stage + L->par.n_params, (size_t)L->E * sizeof(float));
    return st;
}

/* Collective over the EP and DP groups (moept__load_staged) */
moept_status moept_load_hf(moept_layer *L, const char *dir, int64_t layer_index) {
    moept__load ld = {"moept_load_hf", MOEPT__CALL_LOAD_HF,
                      moept__fnv(moept__fnv_dir(dir), &layer_index, sizeof layer_index),
                      !dir || layer_index < 0 ? "bad directory or layer index" : NULL, 1,
                      moept__hf_stage, moept__hf_commit, dir, layer_index, -1, NULL, 0};
    return moept__load_staged(L, &ld);
}

moept_status moept_save_hf(moept_layer *L, const char *path, int64_t layer_index, int with_replicated) {
    return moept_save_hf_as(L, path, layer_index, with_replicated, MOEPT_DTYPE_F32);
}

/* The weights in the file's dtype (2 or 4 bytes), one block in table order
   (the writer keeps pointers until it writes); NULL where they are written
   from the host's own fp32 buffer. An executor's are read through one
   buffer of the largest tensor. */
static void *moept__hf_block(const moept_layer *L, int with_replicated, moept_dtype dtype, moept_status *st) {
    *st = MOEPT_OK;
    if (dtype == MOEPT_DTYPE_F32 && !L->ex->io) return NULL;
    const size_t esz = dtype == MOEPT_DTYPE_F32 ? 4 : 2;
    int64_t n = 0, most = 1;
    for (int64_t i = 0; i < L->par.n_table; i++) {
        const moept__param *p = &L->par.table[i];
        if (p->expert >= 0 || with_replicated) n += p->rows * p->cols;
        most = p->rows * p->cols > most ? p->rows * p->cols : most;
    }
    unsigned char *block = moept__alloc(NULL, (size_t)(n > 0 ? n : 1) * esz), *o = block;
    float *tmp = L->ex->io ? moept__alloc(NULL, (size_t)most * sizeof(float)) : NULL;
    if (!block || (L->ex->io && !tmp))
        *st = moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "out of memory for the %s copy",
                                 moept__dtype_name(dtype));
    for (int64_t i = 0; !*st && i < L->par.n_table; i++) {
        const moept__param *p = &L->par.table[i];
        const int64_t m = p->rows * p->cols;
        if (p->expert < 0 && !with_replicated) continue;
        const float *v = p->data;
        if (p->type != MOEPT__P_BIAS && tmp && !(*st = moept__io(L, MOEPT_BUF_PARAMS, p->off, m, tmp, 0)))
            v = tmp;
        for (int64_t k = 0; !*st && k < m; k++, o += esz) {
            uint16_t h = dtype == MOEPT_DTYPE_BF16 ? moept__f32_to_bf16(v[k]) : moept__f32_to_half(v[k]);
            if (esz == 4) memcpy(o, &v[k], 4);
            else memcpy(o, &h, 2);
        }
    }
    MOEPT_FREE(tmp);
    if (*st) MOEPT_FREE(block);
    return *st ? NULL : block;
}

moept_status moept_save_hf_as(moept_layer *L, const char *path, int64_t layer_index, int with_replicated,
                              moept_dtype dtype) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_save_hf: layer is NULL");
    if (!path || layer_index < 0)
        return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_save_hf: bad path or layer index");
    if (dtype != MOEPT_DTYPE_F32 && dtype != MOEPT_DTYPE_BF16 && dtype != MOEPT_DTYPE_F16)
        return moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "moept_save_hf: dtype %d is not F32, BF16 or F16",
                           (int)dtype);
    if (L->fsdp)
        return moept__fail(L, MOEPT_ERR_UNSUPPORTED,
                           "moept_save_hf: not in fsdp mode (the expert-parallel layer is the one that "
                           "saves, loads and reshards)");
    char prefix[128], name[256];
    moept__hf_prefix(L, layer_index, prefix, sizeof prefix);
    moept_st_writer *w = NULL;
    moept_status st;
    unsigned char *low = moept__hf_block(L, with_replicated, dtype, &st), *o = low;
    const size_t esz = dtype == MOEPT_DTYPE_F32 ? 4 : 2;
    if (!st) st = moept_st_writer_create(&w);
    for (int64_t i = 0; !st && i < L->par.n_table; i++) {
        const moept__param *p = &L->par.table[i];
        if (p->expert < 0 && !with_replicated) continue;
        snprintf(name, sizeof name, "%s%s", prefix, p->name);
        int64_t shape[2] = {p->rows, p->cols};
        const void *data = low ? (const void *)o : (const void *)p->data;
        o += low ? (size_t)(p->rows * p->cols) * esz : 0;
        /* the correction bias stays F32, as DeepSeek-V3's published bf16 weights keep it */
        st = p->type == MOEPT__P_BIAS ? moept_st_add(w, name, MOEPT_DTYPE_F32, 1, shape + 1, p->data)
                                      : moept_st_add(w, name, dtype, 2, shape, data);
    }
    if (!st) st = moept_st_add_meta(w, "format", "pt");
    if (!st) st = moept_st_write(w, path);
    moept_st_writer_destroy(w);
    MOEPT_FREE(low);
    if (st) return moept__fail(L, st, "moept_save_hf: %s", moept__thread_err);
    return MOEPT_OK;
}

/* ------------------------------------------------------------------------
   Training checkpoints
   ------------------------------------------------------------------------ */
/* The model's config fields of the fingerprint, "v1,v2,..." (index.json's "config") */
static void moept__fp_fields(const moept_layer *L, char *out, size_t n) {
    int64_t fp[MOEPT__NFP];
    moept__fingerprint(&L->cfg, 1, L->P, L->dp ? L->dp->size : 1, L->xch.direct, fp);
    size_t at = 0;
    out[0] = 0;
    for (int i = 1; i < MOEPT__NFP_MODEL && at < n; i++)
        at += (size_t)snprintf(out + at, n - at, "%s%lld", i > 1 ? "," : "", (long long)fp[i]);
}

/* Where a checkpoint's config (saved, moept__fp_fields') and this layer's
   differ: the first field and both values, into why ("" if not known) */
static void moept__fp_diff(const moept_layer *L, const char *saved, char *why, size_t n) {
    char mine[512];
    moept__fp_fields(L, mine, sizeof mine);
    why[0] = 0;
    const char *a = saved, *b = mine;
    for (int i = 1; i < MOEPT__NFP_MODEL && *a; i++) {
        char *ea, *eb;
        const long long va = strtoll(a, &ea, 10), vb = strtoll(b, &eb, 10);
        if (va != vb) {
            const int fl = i == 12 || i == 14 || i == 15 || i == 16; /* a float's bits (moept__fingerprint) */
            float fa, fb;
            int32_t ba = (int32_t)va, bb = (int32_t)vb;
            memcpy(&fa, &ba, 4);
            memcpy(&fb, &bb, 4);
            const char *f = moept__fp_names[i];
            if (fl) snprintf(why, n, ": %s %g there, %g in this layer", f, (double)fa, (double)fb);
            else snprintf(why, n, ": %s %lld there, %lld in this layer", f, va, vb);
            return;
        }
        if (*ea != ',' || *eb != ',') return;
        a = ea + 1;
        b = eb + 1;
    }
}

static void moept__fp_hex(const moept_layer *L, char *out, size_t n) {
    int64_t fp[MOEPT__NFP];
    moept__fingerprint(&L->cfg, 1, L->P, L->dp ? L->dp->size : 1, L->xch.direct, fp);
    uint64_t h = 1469598103934665603ull; /* FNV-1a over the model's fields; execution choices
                                            (overlap, sharding) and the layout (EP, DP) left out */
    for (int i = 0; i < MOEPT__NFP_MODEL; i++) {
        if (i == MOEPT__NFP_MODEL - 1 && !fp[i]) continue; /* group_fill's default: left out, so
                                                             older checkpoints keep their print */
        for (int b = 0; b < 8; b++) { h ^= (uint64_t)((fp[i] >> (8 * b)) & 0xff); h *= 1099511628211ull; }
    }
    snprintf(out, n, "%016llx", (unsigned long long)h);
}

typedef struct moept__text { const char *s; } moept__text;
static int moept__text_emit(int fd, const void *ctx) {
    const moept__text *t = ctx;
    return moept__write_all(fd, t->s, (int64_t)strlen(t->s));
}

/* tensor `name` of n floats at v, with its checksum in the file's metadata */
static moept_status moept__ckpt_add(moept_st_writer *w, const char *name, const int64_t *shape,
                                    const float *v) {
    char key[300], sum[24];
    moept_status st = moept_st_add(w, name, MOEPT_DTYPE_F32, 2, shape, v);
    snprintf(key, sizeof key, "checksum.%s", name);
    snprintf(sum, sizeof sum, "%016llx", (unsigned long long)moept__checksum(v, shape[0] * shape[1]));
    return st ? st : moept_st_add_meta(w, key, sum);
}

/* This rank's file of a checkpoint set, in directory `set` (made here if
   another rank has not yet): parameters, AdamW state and bias, each with
   its checksum, and the step and config fingerprint as metadata. */
static moept_status moept__ckpt_write_rank(const moept_layer *L, const char *set, const char *fp,
                                           const char *step, float *const b[3]) {
    char path[4096], name[256];
    struct stat sb;
    if (mkdir(set, 0755) != 0 && errno != EEXIST)
        return moept__thread_fail(MOEPT_ERR_IO, "cannot create %s: %s", set, strerror(errno));
    if (lstat(set, &sb) != 0 || !S_ISDIR(sb.st_mode)) /* another rank's mkdir, not a link put there */
        return moept__thread_fail(MOEPT_ERR_IO, "%s is not a directory the save made", set);
    moept_st_writer *w;
    moept_status st = moept_st_writer_create(&w);
    for (int64_t i = 0; !st && i < L->par.n_table; i++) {
        const moept__param *p = &L->par.table[i];
        int64_t shape[2] = {p->rows, p->cols};
        st = moept__ckpt_add(w, p->name, shape, p->type == MOEPT__P_BIAS ? p->data : b[0] + p->off);
        if (!st && p->trains && b[1]) {
            snprintf(name, sizeof name, "optimizer.m.%s", p->name);
            st = moept__ckpt_add(w, name, shape, b[1] + p->off);
            snprintf(name, sizeof name, "optimizer.v.%s", p->name);
            if (!st) st = moept__ckpt_add(w, name, shape, b[2] + p->off);
        }
    }
    if (!st) st = moept_st_add_meta(w, "format", "moept-train-v1");
    if (!st) st = moept_st_add_meta(w, "step", step);
    if (!st) st = moept_st_add_meta(w, "fingerprint", fp);
    if (!st &&
        snprintf(path, sizeof path, "%s/rank-%d-of-%d.safetensors", set, L->rank, L->P) >= (int)sizeof path)
        st = moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: path too long", set);
    if (!st) st = moept_st_write(w, path);
    moept_st_writer_destroy(w);
    return st;
}

/* A set's directory name: "save-<step>-<12 hex digits>", nothing that could
   leave the checkpoint directory (the index names it; a hand-edited index
   must not point elsewhere). */
static int moept__ckpt_set_name_ok(const char *s) {
    size_t n = strlen(s);
    if (strncmp(s, "save-", 5) != 0 || n > 60) return 0;
    for (size_t i = 5; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f') || s[i] == '-')) return 0;
    return 1;
}

/* The checkpoint directory is a boundary: what is removed is a regular
   file in it (unlinkat never follows a link: a link named like ours is
   left alone, and so is what it points to) */
static void moept__unlink_regular(int dfd, const char *name) {
    struct stat sb;
    if (fstatat(dfd, name, &sb, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(sb.st_mode)) unlinkat(dfd, name, 0);
}

/* Removes set directory `name` of the directory open as dfd: its rank files
   and their temporaries, then the directory (left if anything else is in
   it). A link named like a set is not opened (O_NOFOLLOW). */
static void moept__ckpt_rmset(int dfd, const char *name) {
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return;
    DIR *s = fdopendir(fd);
    if (!s) { close(fd); return; }
    for (struct dirent *f; (f = readdir(s));)
        if (strncmp(f->d_name, "rank-", 5) == 0) moept__unlink_regular(fd, f->d_name);
    closedir(s); /* (closes fd) */
    unlinkat(dfd, name, AT_REMOVEDIR);
}

/* After a commit: removes what superseded or killed saves left in `dir`,
   sets other than `keep`, the index's temporaries and the rank files of the
   older flat layout. Best effort: what cannot be removed stays, and is never
   read (only the index's set is). keep NULL: only the set `only` (a failed
   save's). */
static void moept__ckpt_clean(const char *dir, const char *keep, const char *only) {
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return;
    if (only) {
        moept__ckpt_rmset(dfd, only);
        close(dfd);
        return;
    }
    DIR *d = fdopendir(dfd);
    if (!d) { close(dfd); return; }
    for (struct dirent *e; (e = readdir(d));) {
        const char *n = e->d_name;
        if (strncmp(n, "index.json.tmp.", 15) == 0 || strncmp(n, "rank-", 5) == 0)
            moept__unlink_regular(dfd, n);
        else if (moept__ckpt_set_name_ok(n) && strcmp(n, keep) != 0) moept__ckpt_rmset(dfd, n);
    }
    closedir(d);
}

/* A save writes only what a load takes: a non-finite parameter, moment or
   bias refuses it (the caller agrees) before the directory is touched */
static moept_status moept__ckpt_finite(moept_layer *L, const char *call, float *const bufs[3]) {
    static const char *pre[3] = {"", "optimizer.m.", "optimizer.v."};
    for (int b = 0; b < 3; b++) {
        const int64_t i = bufs[b] ? moept__first_nonfinite(bufs[b], L->par.n_params) : -1;
        if (i >= 0)
            return moept__fail(L, MOEPT_ERR_NUMERIC, "%s: '%s%s' (flat element %lld) is not finite; nothing "
                               "was written and the previous checkpoint stays current", call, pre[b],
                               moept__param_of(L, i), (long long)i);
    }
    if (moept__first_nonfinite(L->par.bias, L->E) >= 0)
        return moept__fail(L, MOEPT_ERR_NUMERIC, "%s: the correction bias is not finite; nothing was written "
                           "and the previous checkpoint stays current", call);
    return MOEPT_OK;
}

/* A save's view of the parameters and the moments (b[1], b[2] NULL: none):
   the host's own buffers, or whole copies of an executor's (the writer
   keeps pointers until it writes; moept__unstage frees them) */
static moept_status moept__stage_bufs(moept_layer *L, float *b[3]) {
    static const int which[3] = {MOEPT_BUF_PARAMS, MOEPT__BUF_M, MOEPT__BUF_V};
    const int64_t n = L->par.n_params;
    b[0] = b[1] = b[2] = NULL;
    for (int k = 0; k < 3; k++) {
        if (!L->ex->io) {
            b[k] = moept__host_of(L, which[k]);
            continue;
        }
        if (k > 0 && !L->opt.held) break;
        if (!(b[k] = moept__alloc(NULL, (size_t)(n > 0 ? n : 1) * sizeof(float))))
            return moept__fail(L, MOEPT_ERR_OUT_OF_MEMORY, "out of host memory for a copy of the buffers");
        moept_status st = moept__io(L, which[k], 0, n, b[k], 0);
        if (st) return st;
    }
    return MOEPT_OK;
}
static void moept__unstage(const moept_layer *L, float *b[3]) {
    for (int k = 0; k < 3 && L->ex->io; k++) MOEPT_FREE(b[k]);
}

/* A value the layer's root (EP rank 0 of DP replica 0) chose, given to every
   rank: the others add 0. */
static moept_status moept__share(moept_layer *L, int64_t *v, const char *call) {
    moept_comm *bad = NULL;
    moept_status st = moept__sum_ep_dp(L->group, L->dp, v, 1, MOEPT_DTYPE_I64, &bad);
    if (st) return moept__fail(L, st, "%s: all-reduce failed: %s", call, bad->err);
    return MOEPT_OK;
}

/* Saves a training checkpoint as a set: every rank of DP replica 0 writes
   its file into a new set directory, all agree that every file is whole,
   then the root renames index.json (naming the set) into place: the one
   commit point. Until then the previous set stays current and loadable; a
   save killed anywhere leaves either the old set or the new one current.
   After the commit the root removes the sets it superseded and any that
   killed saves left behind. */
static moept_status moept__save_ckpt(moept_layer *L, const char *dir, float *b[3]);
moept_status moept_save_checkpoint(moept_layer *L, const char *dir) {
    if (!L) return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "moept_save_checkpoint: layer is NULL");
    float *b[3] = {NULL, NULL, NULL};
    moept_status st = moept__save_ckpt(L, dir, b);
    moept__unstage(L, b);
    return st;
}
static moept_status moept__save_ckpt(moept_layer *L, const char *dir, float *b[3]) {
    static const char *call = "moept_save_checkpoint";
    moept_status local = MOEPT_OK;
    if (!dir || strlen(dir) > 3000)
        local = moept__fail(L, MOEPT_ERR_INVALID_ARGUMENT, "%s: dir is %s", call, dir ? "too long" : "NULL");
    else if (L->fsdp)
        local = moept__fail(L, MOEPT_ERR_UNSUPPORTED,
                            "%s: not in fsdp mode (the expert-parallel layer is the "
                            "one that saves, loads and reshards)",
                            call);
    else if ((local = moept__stage_bufs(L, b)) == MOEPT_OK)
        local = moept__ckpt_finite(L, call, b);
    /* nothing is made before the ranks agree, on the directory too */
    moept_status st = moept__agree_call(L, L->group, L->dp, local, MOEPT__CALL_SAVE_CHECKPOINT,
                                        moept__fnv_dir(dir));
    const int root = L->rank == 0 && (!L->dp || L->dp->rank == 0), writer = !L->dp || L->dp->rank == 0;
    int committed = 0;
    int64_t nonce = root ? moept__nonce() : 0;
    if (st || (st = moept__share(L, &nonce, call))) return st;
    char fp[32], step[32], set[64], path[4096], meta[1024], cfg[512];
    moept__fp_hex(L, fp, sizeof fp);
    moept__fp_fields(L, cfg, sizeof cfg);
    snprintf(step, sizeof step, "%lld", (long long)L->opt.t);
    snprintf(set, sizeof set, "save-%s-%012llx", step, (unsigned long long)nonce);
    snprintf(path, sizeof path, "%s/%s", dir, set);
    if (writer && mkdir(dir, 0755) != 0 && errno != EEXIST)
        local = moept__fail(L, MOEPT_ERR_IO, "%s: cannot create %s: %s", call, dir, strerror(errno));
    else if (writer && (local = moept__ckpt_write_rank(L, path, fp, step, b)))
        local = moept__fail(L, local, "%s: %s", call, moept__thread_err);
    if (!(st = moept__agree_call(L, L->group, L->dp, local, MOEPT__CALL_SAVE_FILES, 0)) && root) {
        snprintf(meta, sizeof meta,
                 "{\"format\": \"moept-train-v1\", \"num_experts\": %lld, \"ep_size\": %d, "
                 "\"fingerprint\": \"%s\", \"step\": %s, \"set\": \"%s\", \"config\": \"%s\"}\n",
                 (long long)L->E, L->P, fp, step, set, cfg);
        moept__text t = {meta};
        snprintf(path, sizeof path, "%s/index.json", dir);
        if ((local = moept__atomic_write(path, moept__text_emit, &t))) /* <- the commit */
            local = moept__fail(L, local, "%s: %s", call, moept__thread_err);
        committed = !local;
    }
    if (!st) st = moept__agree_call(L, L->group, L->dp, local, MOEPT__CALL_SAVE_COMMIT, 0);
    if (committed) moept__ckpt_clean(dir, set, NULL);
    else if (root) moept__ckpt_clean(dir, NULL, set); /* a failed save's set goes; the current one stays */
    return st;
}

/* index.json of a training checkpoint: the EP size it was saved at, the
   config fingerprint, the step (-1 if absent: older indexes) and the set
   directory that holds the rank files ("" in the older flat layout: `dir`
   itself). Any size up to MOEPT__INDEX_MAX is read whole (other keys may
   grow it). */
#define MOEPT__INDEX_MAX (1 << 20)
/* cfg (NULL: not wanted): the model's config fields as saved ("config":
   "v1,v2,...", the fingerprint's, so a mismatch can name its field; "" in
   older indexes) */
static moept_status moept__read_ckpt_index(const char *dir, int64_t *ep, char *fp, size_t fpn, int64_t *step,
                                           char *set, size_t setn, char *cfg, size_t cfgn) {
    char path[4096];
    snprintf(path, sizeof path, "%s/index.json", dir);
    int fd, missing;
    int64_t size = 0;
    moept_status st = moept__open_read(path, &fd, &size, &missing);
    if (st) return st;
    char *buf = size > 0 && size <= MOEPT__INDEX_MAX ? moept__alloc(NULL, (size_t)size + 1) : NULL;
    int got = buf && moept__pread_all(fd, buf, (size_t)size, 0);
    close(fd);
    if (!got) {
        MOEPT_FREE(buf);
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: empty, unreadable or over %d bytes", path,
                                  MOEPT__INDEX_MAX);
    }
    buf[size] = 0;
    *ep = *step = -1;
    fp[0] = set[0] = 0;
    if (cfg) cfg[0] = 0;
    if ((st = moept__json_check(buf, size, path))) {
        MOEPT_FREE(buf);
        return st;
    }
    moept__json j = {buf, buf + size, NULL};
    int set_ok = 1, ok = 1;
    int64_t n = 0;
    char *k;
    while (ok && moept__jmember(&j, &n, &k)) {
        if (strcmp(k, "ep_size") == 0) ok = moept__juint(&j, ep);
        else if (strcmp(k, "step") == 0) ok = moept__juint(&j, step);
        else if (strcmp(k, "fingerprint") == 0) {
            char *v = moept__jstring(&j);
            if (v) snprintf(fp, fpn, "%s", v);
            ok = v != NULL;
        } else if (strcmp(k, "set") == 0) {
            char *v = moept__jstring(&j);
            if (v) snprintf(set, setn, "%s", v);
            ok = v != NULL;
            set_ok = v && moept__ckpt_set_name_ok(v) && strlen(v) < setn;
        } else if (cfg && strcmp(k, "config") == 0) {
            char *v = moept__jstring(&j);
            if (v) snprintf(cfg, cfgn, "%s", v);
            ok = v != NULL;
        } else ok = moept__jvalue(&j, 1, NULL);
    }
    ok = ok && !j.err;
    MOEPT_FREE(buf);
    if (!ok || *ep < 1 || !fp[0])
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: not a moept checkpoint index", path);
    if (!set_ok)
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: \"set\" is not a set directory's name", path);
    return MOEPT_OK;
}

/* The file of the rank that saved parameter p: where a contiguous placement
   puts it, else (a resharded placement) the first file that holds it. Opens
   files as needed, checking each one's format, fingerprint and step (*t, the
   same in all). -1 with the status in *st. */
static int64_t moept__ckpt_source(const moept_layer *L, const char *dir, const moept__param *p, int64_t P,
                                  moept_st_file **files, const char *fp, long long *t, int64_t *bytes,
                                  moept_status *st) {
    char path[4096];
    int64_t guess = p->expert >= 0 ? p->expert / (L->E / P) : 0;
    for (int64_t k = 0; k <= P; k++) {
        int64_t r = k == 0 ? guess : k - 1;
        if (k > 0 && r == guess) continue;
        if (!files[r]) {
            if (snprintf(path, sizeof path, "%s/rank-%lld-of-%lld.safetensors", dir, (long long)r,
                         (long long)P) >= (int)sizeof path) {
                *st = moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: path too long", dir);
                return -1;
            }
            if ((*st = moept_st_open(path, &files[r]))) return -1;
            *bytes += files[r]->bytes_read;
            const char *fmt = moept_st_meta(files[r], "format"), *fs = moept_st_meta(files[r], "step");
            const char *f2 = moept_st_meta(files[r], "fingerprint");
            char *end = NULL;
            long long ts = fs ? strtoll(fs, &end, 10) : -1;
            int ours = fmt && strcmp(fmt, "moept-train-v1") == 0 && f2 && strcmp(f2, fp) == 0;
            if (!ours || !fs || *end || ts < 0 || (*t >= 0 && ts != *t)) {
                *st = moept__thread_fail(MOEPT_ERR_FORMAT, "%s: not a training checkpoint of this config, "
                                         "or its step disagrees with the others", path);
                return -1;
            }
            *t = ts;
        }
        if (moept_st_find(files[r], p->name)) return r;
    }
    *st = moept__thread_fail(MOEPT_ERR_NOT_FOUND, "%s: no rank's file has '%s'", dir, p->name);
    return -1;
}

/* A tensor read from rank src's file: its checksum (where the file has
   one: older checkpoints do not) and finiteness (AdamW's v also >= 0), as
   set_param checks what it is given. */
static moept_status moept__ckpt_verify(const moept_st_file *f, const char *dir, int64_t src, const char *name,
                                       const float *v, int64_t n, int second_moment) {
    char key[300], sum[24];
    snprintf(key, sizeof key, "checksum.%s", name);
    const char *want = moept_st_meta(f, key);
    snprintf(sum, sizeof sum, "%016llx", (unsigned long long)moept__checksum(v, n));
    if (want && strcmp(want, sum) != 0)
        return moept__thread_fail(MOEPT_ERR_FORMAT,
                                  "%s: rank %lld's tensor '%s' fails its checksum (%s, saved "
                                  "%s): the file is corrupt",
                                  dir, (long long)src, name, sum, want);
    for (int64_t i = 0; i < n; i++)
        if (!moept__finite(v[i]) || (second_moment && v[i] < 0.0f))
            return moept__thread_fail(MOEPT_ERR_NUMERIC, "%s: rank %lld's tensor '%s' element %lld is %s",
                                      dir, (long long)src, name, (long long)i,
                                      moept__finite(v[i]) ? "negative" : "not finite");
    return MOEPT_OK;
}

/* Reads a training checkpoint into stage [3n + E] (parameters | AdamW m |
   v | bias), its step into *t and the bytes read into *bytes; changes
   nothing. */
static moept_status moept__ckpt_read(const moept_layer *L, const char *dir, float *stage, long long *t,
                                     int64_t *bytes) {
    char fp[32], ffp[64], name[256], set[64], base[4096], cfg[512], why[200];
    moept__fp_hex(L, fp, sizeof fp);
    int64_t P = 0, istep = -1;
    const size_t n = (size_t)L->par.n_params;
    moept_status st =
        moept__read_ckpt_index(dir, &P, ffp, sizeof ffp, &istep, set, sizeof set, cfg, sizeof cfg);
    if (st) return st;
    if (strcmp(ffp, fp) != 0) {
        moept__fp_diff(L, cfg, why, sizeof why);
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s was saved with another config%s "
                                  "(fingerprint %s, this layer %s)", dir, why, ffp, fp);
    }
    if (P > L->E || L->E % P != 0)
        return moept__thread_fail(MOEPT_ERR_FORMAT, "%s: EP size %lld does not divide E=%lld", dir,
                                  (long long)P, (long long)L->E);
    if (snprintf(base, sizeof base, "%s%s%s", dir, set[0] ? "/" : "", set) >=
        (int)sizeof base) /* the index's set */
        return moept__thread_fail(MOEPT_ERR_INVALID_ARGUMENT, "%s: path too long", dir);
    moept_st_file **files = moept__alloc(NULL, (size_t)P * sizeof *files);
    if (!files) return moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "out of memory");
    for (int64_t r = 0; r < P; r++) files[r] = NULL;
    memset(stage, 0, (3 * n + (size_t)L->E) * sizeof(float));
    *t = -1;
    for (int64_t i = 0; !st && i < L->par.n_table; i++) {
        const moept__param *p = &L->par.table[i];
        int64_t src = moept__ckpt_source(L, base, p, P, files, fp, t, bytes, &st);
        if (src < 0) break;
        int64_t off = p->type == MOEPT__P_BIAS ? 3 * (int64_t)n : p->off,
                cnt = p->rows * p->cols;
        for (int k = 0; k < (p->trains && *t > 0 ? 3 : 1) && !st; k++) {
            if (k == 0) snprintf(name, sizeof name, "%s", p->name);
            else snprintf(name, sizeof name, "optimizer.%c.%s", k == 1 ? 'm' : 'v', p->name);
            const moept_st_tensor *tt = moept_st_find(files[src], name);
            if (!tt) {
                st = moept__thread_fail(MOEPT_ERR_NOT_FOUND, "%s: rank %lld's file has no tensor '%s'", base,
                                        (long long)src, name);
                break;
            }
            int64_t before = files[src]->bytes_read;
            float *dst = stage + off + (int64_t)k * (int64_t)n;
            st = moept_st_read_f32(files[src], tt, dst, cnt);
            *bytes += files[src]->bytes_read - before;
            if (!st) st = moept__ckpt_verify(files[src], base, src, name, dst, cnt, k == 2);
        }
    }
    for (int64_t r = 0; r < P; r++) moept_st_close(files[r]);
    MOEPT_FREE(files);
    if (!st && istep >= 0 && *t != istep) /* an edited index, or an older flat checkpoint's torn save */
        st = moept__thread_fail(MOEPT_ERR_FORMAT,
                                "%s: the rank files are of step %lld, index.json of step %lld", base, *t,
                                (long long)istep);
    return st;
}

/* moept_load_checkpoint's read: the checkpoint, and AdamW state the layer
   lacks (allocated before the agreement, counted at the commit) */
static moept_status moept__ckpt_stage(const moept_layer *L, moept__load *ld, float *stage, int64_t *bytes) {
    moept_status st = moept__ckpt_read(L, ld->dir, stage, &ld->step, bytes);
    if (st || ld->step <= 0 || !L->par.trains || L->opt.held) return st;
    ld->moments = 1;
    if (L->ex->io) return MOEPT__EX((moept_layer *)L, adamw_ready, (moept_layer *)L); /* (zeros: as none) */
    if (!(ld->opt = moept__alloc(NULL, 2 * (size_t)L->par.n_params * sizeof(float))))
        st = moept__thread_fail(MOEPT_ERR_OUT_OF_MEMORY, "out of memory for the optimizer state");
    return st;
}

static moept_status moept__ckpt_commit(moept_layer *L, moept__load *ld, const float *stage) {
    const size_t n = (size_t)L->par.n_params;
    const long long t = ld->step;
    if (ld->opt) {
        L->opt.m = ld->opt;
        L->opt.v = ld->opt + n;
        L->mem.allocations++;
        L->mem.bytes += (int64_t)(2 * n * sizeof(float));
    }
    const int held = L->opt.held || ld->moments;
    /* the moments: the checkpoint's, or zeros at step 0 (the stage's; an inference layer has none) */
    moept_status st = moept__io(L, MOEPT_BUF_PARAMS, 0, (int64_t)n, (float *)stage, 1);
    if (!st && held) st = moept__io(L, MOEPT__BUF_M, 0, (int64_t)n, (float *)stage + n, 1);
    if (!st && held) st = moept__io(L, MOEPT__BUF_V, 0, (int64_t)n, (float *)stage + 2 * n, 1);
    if (st) return st;
    L->opt.held = held;
    memcpy(L->par.bias, stage + 3 * n, (size_t)L->E * sizeof(float));
    L->opt.t = L->par.trains ? t : 0; /* an inference layer saves no optimizer state: step 0 */
    L->opt_mb = L->opt_vb = INFINITY; /* the next step probes the loaded moments */
    L->jitter_micro = 0;
    return st;
}

/* Loads a training checkpoint saved at any EP size P that divides E into
   this layer's layout (Q ranks): every tensor this rank needs is read with
   positioned reads from the file of the rank that saved it (replicated
   ones from rank 0's), nothing else. Collective over the EP and DP groups
   (moept__load_staged). */
moept_status moept_load_checkpoint(moept_layer *L, const char *dir) {
    moept__load ld = {"moept_load_checkpoint", MOEPT__CALL_LOAD_CHECKPOINT, moept__fnv_dir(dir),
                      !dir ? "dir is NULL" : NULL, 3, moept__ckpt_stage, moept__ckpt_commit, dir, 0, -1,
                      NULL, 0};
    return moept__load_staged(L, &ld);
}

#endif /* !MOEPT_NO_IO */

#endif /* !MOEPT__KERNELS */
#endif /* !__cplusplus || MOEPT__KERNELS */
#endif /* MOEPT__C_ONCE */
