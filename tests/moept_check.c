/* moept_check: runs moept-case-v1 reference cases (docs/CASES.md)
   through moept and compares every output and gradient.

   usage: moept_check [--ep N] [--chunks C] [--no-shm] [--expect-shm] [--sync-free] [--reshard]
                      [--comm nccl|nccl-one-gpu|device]
                      [--gemm-form auto|grouped|per-expert|strided|kernel] [--tol X]
                      [--weights DIR --layer L [--hf-config]] FILE...
          mpirun -np N moept_check_mpi --ep N FILE...   (built with -DMOEPT_MPI)
   With --ep N the experts are sharded over N ranks (threads, or MPI
   processes) and the tokens split into N contiguous slices (the first T mod N
   ranks take one more); losses are over the global batch, router and shared
   gradients are summed over ranks, each expert's gradient is compared on its
   owner. --chunks C sets config.overlap_chunks (the chunked pipeline; on
   the GPU it runs only with --ep > 1). The exchange goes through the EP
   comm's shared memory where it has some (checked: stats.shared_exchange);
   --no-shm turns that off for the message path, --expect-shm fails the
   cases when the comm has none (MPI across hosts, or /proc not opening a peer's memory file).
   --reshard (with --ep N > 1): once the weights are set, moept_reshard moves
   every expert to the next rank, and those moved weights compute the step.
   With --weights every parameter comes from the Hugging Face
   checkpoint DIR (decoder layer L's MoE block, this rank's experts only)
   instead of the case file; with --hf-config too, the model's sizes and
   routing come from DIR/config.json (moept_config_from_hf, norm_topk_prob
   left to the family's default where the model has no such key) instead
   of the case's metadata, which they must equal. One line per case, then "N passed, N failed";
   exit 1 if any failed.

   Built with -DMOEPT_CUDA (build/moept_check_cuda, or build/emu/moept_check
   on the emulated GPU) the layer runs on GPUs: every case twice, in fp32
   (--tol, 1e-5, against the file) and in bf16 (--tol-bf16, 2^-6 normwise,
   against the CPU layer run on the bf16-rounded inputs and expert weights,
   routing exactly), with x, dy, y and dx in device memory; --ep N runs N
   GPUs as threads over NCCL (--comm device: N threads on device 0 over
   moept_comm_cuda_threads, no NCCL; --comm nccl-one-gpu: over NCCL, all on
   device 0, which NCCL allows from 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1); --sync-free runs the CUDA layer in its
   sync-free mode (moept_cuda_options.sync_free); --gemm-form picks
   moept_cuda_options.gemm_form (ignored on the CPU). With fewer devices than
   ranks every case is reported skipped and the exit status is 0.
   Built with both (build/moept_check_cuda_mpi, build/emu/moept_check_mpi)
   it is the deployment users run: one process per GPU, each on device
   local_rank % device_count, the NCCL id made by rank 0 and broadcast over
   MPI (the bf16 reference's CPU layer runs over MPI). */
#define MOEPT_INTERNAL /* moept__f32_to_bf16 / moept__bf16_to_f32 */
#include "../moept.h"
#include "testutil.h" /* tu_threads */
#ifdef MOEPT_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#endif
#ifdef MOEPT_MPI
#include <mpi.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *g_weights; /* --weights DIR */
static int g_hf_config;       /* --hf-config: the model's sizes and routing from DIR/config.json */
static long long g_layer = -1;  /* --layer L */
static int g_chunks;            /* --chunks C: config.overlap_chunks */
static int g_no_shm;            /* --no-shm: the EP comm's shm_alloc off (the message path) */
static int g_expect_shm;        /* --expect-shm: fail if the EP comm offers no shared memory */
static int g_bf16;              /* CUDA: this pass runs in bf16 */
static int g_fp8;               /* --dtype fp8: config.fp8 = MOEPT_FP8_BLOCKWISE, against the file */
static int g_vs_cpu;            /* CUDA --dtype fp8: this fp32 pass against the CPU's FP8 layer */
static int g_bf16_only;         /* CUDA --dtype bf16: the bf16 pass alone (with --dtype fp8: FP8's) */
static int g_sync_free;         /* CUDA: --sync-free */
static int g_gemm_form;         /* CUDA: --gemm-form (moept_gemm_form) */
static int g_comm_device;       /* CUDA: --comm device: the ranks threads on device 0, no NCCL */
static int g_one_gpu;           /* CUDA: --comm device or nccl-one-gpu: every rank on device 0 */
static int g_digest;            /* --digest: print a hash of every compared result's bits (refactors
                                   that must leave results bitwise unchanged compare two runs' hashes) */
static int g_reshard;           /* --reshard: with the weights set, every expert to the next rank */
static int g_ep_digest;         /* --ep-digest: a hash of the results an EP split leaves bitwise alone (each
                                   token's output, input gradient and routing, each expert's gradients; not
                                   the losses nor gradients summed over the ranks), a term a value of its
                                   name, place and bits, summed over the ranks: --ep N prints EP 1's */

/* ---- the layer, on the CPU or (MOEPT_CUDA) on the GPU ---- */
#ifdef MOEPT_CUDA
/* a device copy of n host floats (as bf16 when g_bf16); NULL on failure */
static void *to_device(const float *h, int64_t n) {
    size_t es = g_bf16 ? 2 : 4;
    void *d = NULL, *stage = malloc((size_t)(n + 1) * es);
    if (!stage || cudaMalloc(&d, (size_t)(n + 1) * es) != cudaSuccess) { free(stage); return NULL; }
    for (int64_t i = 0; i < n; i++) {
        if (g_bf16) ((uint16_t *)stage)[i] = moept__f32_to_bf16(h[i]);
        else ((float *)stage)[i] = h[i];
    }
    if (n > 0 && cudaMemcpy(d, stage, (size_t)n * es, cudaMemcpyHostToDevice) != cudaSuccess) { cudaFree(d); d = NULL; }
    free(stage);
    return d;
}
static int to_host(float *h, const void *d, int64_t n) {
    size_t es = g_bf16 ? 2 : 4;
    void *stage = malloc((size_t)(n + 1) * es);
    if (!stage) return 0;
    int ok = n == 0 || cudaMemcpy(stage, d, (size_t)n * es, cudaMemcpyDeviceToHost) == cudaSuccess;
    for (int64_t i = 0; ok && i < n; i++) h[i] = g_bf16 ? moept__bf16_to_f32(((uint16_t *)stage)[i]) : ((float *)stage)[i];
    free(stage);
    return ok;
}
#endif
static moept_status layer_create(const moept_config *cfg, moept_comm *ep, void *stream, moept_layer **L) {
#ifdef MOEPT_CUDA
    moept_cuda_options o = {g_bf16 ? MOEPT_DTYPE_BF16 : MOEPT_DTYPE_F32, stream, 0, g_sync_free,
                            (moept_gemm_form)g_gemm_form};
    return moept_create_cuda(cfg, ep, NULL, &o, L);
#else
    (void)stream;
    return moept_create_parallel(cfg, ep, NULL, L);
#endif
}
/* (CUDA: the layer's outputs are ready in its stream's order: synchronise
   it before reading them on another stream) */
static moept_status layer_forward(moept_layer *L, void *stream, const float *x, int64_t T, int64_t D, float *y,
                                  const uint8_t *mask) {
#ifdef MOEPT_CUDA
    void *dxp = to_device(x, T * D), *dyp = to_device(y, T * D), *dm = NULL; /* a CUDA layer's mask: device */
    int mok = !mask || (cudaMalloc(&dm, (size_t)T + 1) == cudaSuccess &&
                        cudaMemcpy(dm, mask, (size_t)T, cudaMemcpyHostToDevice) == cudaSuccess);
    moept_forward_opts o = {(const uint8_t *)dm, 0, NULL, NULL, 0};
    moept_status st = dxp && dyp && mok ? moept_forward_ex(L, (const float *)dxp, T, (float *)dyp, &o)
                                        : MOEPT_ERR_OUT_OF_MEMORY;
    if (!st && cudaStreamSynchronize((cudaStream_t)stream) != cudaSuccess) st = MOEPT_ERR_DEVICE;
    if (!st && !to_host(y, dyp, T * D)) st = MOEPT_ERR_DEVICE;
    cudaFree(dxp); cudaFree(dyp); cudaFree(dm);
    return st;
#else
    (void)D; (void)stream;
    moept_forward_opts o = {mask, 0, NULL, NULL, 0};
    return moept_forward_ex(L, x, T, y, &o);
#endif
}
static moept_status layer_backward(moept_layer *L, void *stream, const float *x, const float *dy, int64_t T, int64_t D,
                                   float *dx) {
#ifdef MOEPT_CUDA
    void *a = to_device(x, T * D), *b = to_device(dy, T * D), *c = to_device(dx, T * D);
    moept_status st = a && b && c ? moept_backward(L, (const float *)a, (const float *)b, (float *)c) : MOEPT_ERR_OUT_OF_MEMORY;
    if (!st && cudaStreamSynchronize((cudaStream_t)stream) != cudaSuccess) st = MOEPT_ERR_DEVICE;
    if (!st && !to_host(dx, c, T * D)) st = MOEPT_ERR_DEVICE;
    cudaFree(a); cudaFree(b); cudaFree(c);
    return st;
#else
    (void)T; (void)D; (void)stream;
    return moept_backward(L, x, dy, dx);
#endif
}

typedef struct check {
    const char *path;
    moept_comm *ep;         /* NULL: one rank */
    moept_comm *ref_ep;     /* CUDA --ep: the bf16 reference's comm (threads), NULL at one rank */
    void *stream;           /* CUDA: the layer's compute stream (NULL: the default stream) */
    struct ref *ref;        /* CUDA bf16: what the reference made, in place of the file's expected.* */
    moept_st_file *f;
    double worst;           /* largest relative error so far */
    double den_full;        /* compare_rows: the norm^2 a slice is measured against (0: its own) */
    char worst_name[128];
    char reason[600];       /* non-empty: the case failed for this reason */
    char skip[200];         /* non-empty: the case cannot run at this --ep */
    uint64_t digest;        /* --digest: FNV-1a of the names and bits of every result compared */
    uint64_t ep_digest;     /* --ep-digest: this rank's sum */
    int64_t at;             /* the compared values' first one's place in the whole result (--ep: a slice) */
} check;

static int failf(check *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int failf(check *c, const char *fmt, ...) {
    if (c->reason[0]) return 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->reason, sizeof c->reason, fmt, ap);
    va_end(ap);
    return 0;
}

static int meta_int(check *c, const char *key, int64_t *out) {
    const char *v = moept_st_meta(c->f, key);
    if (!v) return failf(c, "metadata '%s' missing", key);
    char *end;
    long long x = strtoll(v, &end, 10);
    if (end == v || *end) return failf(c, "metadata '%s' = '%s' is not an integer", key, v);
    *out = x;
    return 1;
}

static int meta_float(check *c, const char *key, float *out) {
    const char *v = moept_st_meta(c->f, key);
    if (!v) return failf(c, "metadata '%s' missing", key);
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end || !isfinite(x)) return failf(c, "metadata '%s' = '%s' is not a number", key, v);
    *out = (float)x;
    return 1;
}

/* optional 'group_fill': "-inf" (absent: the default) or "0" */
static int meta_group_fill(check *c, moept_group_fill *out) {
    const char *v = moept_st_meta(c->f, "group_fill");
    if (!v || strcmp(v, "-inf") == 0) *out = MOEPT_GROUP_FILL_NEG_INF;
    else if (strcmp(v, "0") == 0) *out = MOEPT_GROUP_FILL_ZERO;
    else return failf(c, "metadata 'group_fill' = '%s' is not '-inf' or '0'", v);
    return 1;
}

/* reads a float tensor that must have shape [rows][cols] (or rows*cols) */
static float *read_f(check *c, const char *name, int64_t rows, int64_t cols) {
    const moept_st_tensor *t = moept_st_find(c->f, name);
    if (!t) { failf(c, "tensor '%s' missing", name); return NULL; }
    int64_t want = rows * cols;
    int ok = t->numel == want && (t->ndim == 2 ? t->shape[0] == rows && t->shape[1] == cols
                                               : t->ndim == 1 && (rows == 1 || cols == 1));
    if (!ok) { failf(c, "tensor '%s' has the wrong shape (want [%lld, %lld])", name, (long long)rows, (long long)cols); return NULL; }
    float *buf = malloc((size_t)(want ? want : 1) * sizeof(float));
    if (!buf) { failf(c, "out of memory"); return NULL; }
    if (moept_st_read_f32(c->f, t, buf, want) != MOEPT_OK) {
        failf(c, "%s", moept_last_error(NULL));
        free(buf);
        return NULL;
    }
    return buf;
}

/* splitmix64's finaliser */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
/* the results --ep-digest holds: a token's or an expert's, computed where it lives */
static int ep_split_free(const char *name) {
    return !strcmp(name, "output") || !strcmp(name, "grad.input") || !strcmp(name, "router_logits") ||
           !strcmp(name, "topk_weights") || !strncmp(name, "grad.experts.", 13);
}

/* relative error |a-b|/|b|; an absolute allowance floor_abs is taken off
   |a-b| first (see the router gradient below) */
static void compare_floor(check *c, const char *name, const float *got, const float *want, int64_t n,
                          double floor_abs) {
    if (g_digest) { /* the name, then the bits: a result moved to another name changes the hash */
        for (const char *p = name; *p; p++) c->digest = (c->digest ^ (uint8_t)*p) * 0x100000001b3ULL;
        const uint8_t *b = (const uint8_t *)got;
        for (int64_t i = 0; i < n * (int64_t)sizeof(float); i++) c->digest = (c->digest ^ b[i]) * 0x100000001b3ULL;
    }
    if (g_ep_digest && ep_split_free(name)) {
        uint64_t hn = 0xcbf29ce484222325ULL;
        for (const char *p = name; *p; p++) hn = (hn ^ (uint8_t)*p) * 0x100000001b3ULL;
        for (int64_t i = 0; i < n; i++) {
            uint32_t b;
            memcpy(&b, got + i, sizeof b);
            c->ep_digest += mix64(hn + mix64((uint64_t)(c->at + i) << 32 | b));
        }
    }
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)got[i] - (double)want[i];
        num += d * d;
        den += (double)want[i] * want[i];
    }
    double err = sqrt(num) > floor_abs ? sqrt(num) - floor_abs : 0.0;
    if (isnan(num)) err = NAN;
    if (c->den_full > 0.0) den = c->den_full; /* compare_rows */
    double rel = den > 0.0 ? err / sqrt(den) : err;
    if (!(rel <= c->worst) || c->worst_name[0] == 0) {
        if (!(rel <= c->worst)) c->worst = isnan(rel) ? INFINITY : rel;
        if (c->worst == rel || isnan(rel)) snprintf(c->worst_name, sizeof c->worst_name, "%s", name);
    }
}

static void compare(check *c, const char *name, const float *got, const float *want, int64_t n) {
    compare_floor(c, name, got, want, n, 0.0);
}
/* the same, got the values of the whole result's from its at-th on */
static void compare_at(check *c, const char *name, const float *got, const float *want, int64_t n,
                       int64_t at) {
    c->at = at;
    compare(c, name, got, want, n);
    c->at = 0;
}

/* this rank's rows lo..lo+Tr of a [T][w] result (--ep: tokens in slices). FP8 measures a slice against
   the whole tensor's norm, scaled to the slice's rows: a few tokens can cancel to a norm far under
   their terms', which E4M3's rounding follows */
static void compare_rows(check *c, const char *name, const float *got, const float *want, int64_t lo, int64_t Tr,
                         int64_t T, int64_t w) {
    if (g_fp8 && Tr < T && !c->ref) { /* (a reference holds this rank's rows alone) */
        double den = 0.0;
        for (int64_t i = 0; i < T * w; i++) den += (double)want[i] * want[i];
        c->den_full = den * (double)Tr / (double)T;
    }
    compare_at(c, name, got, want + lo * w, Tr * w, lo * w);
    c->den_full = 0.0;
}

/* 1 if every rank is fine; keeps ranks in step so none waits forever on a
   collective another rank skipped */
static int all_ok(check *c) {
    int64_t bad = c->reason[0] != 0;
    if (c->ep && c->ep->allreduce(c->ep, &bad, 1, MOEPT_DTYPE_I64) != MOEPT_OK) {
        failf(c, "agreement failed: %s", c->ep->err);
        return 0;
    }
    if (bad && !c->reason[0]) failf(c, "another rank failed this case");
    return bad == 0;
}

/* attention_mask [T] (I64, 1 = token, 0 = padding) as moept's [T] bytes */
static int read_mask(check *c, const moept_st_tensor *t, int64_t T, uint8_t **out) {
    int64_t *m = malloc((size_t)(T + 1) * sizeof(int64_t));
    uint8_t *b = malloc((size_t)(T + 1));
    int ok = m && b && t->ndim == 1 && t->shape[0] == T && moept_st_read_i64(c->f, t, m, T) == MOEPT_OK;
    for (int64_t i = 0; ok && i < T; i++) {
        ok = m[i] == 0 || m[i] == 1;
        b[i] = (uint8_t)m[i];
    }
    free(m);
    if (!ok) { free(b); return failf(c, "tensor 'attention_mask' is not [T] of 0 and 1"); }
    *out = b;
    return 1;
}

static int family_of(const char *s, moept_family *f) {
    static const char *names[] = {"mixtral", "qwen2_moe", "olmoe", "deepseek_v3"};
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0) { *f = (moept_family)i; return 1; }
    return 0;
}

/* ---- bf16 (CUDA): the reference ----
   A bf16 run is compared with the CPU layer run on what the GPU computes
   from: x, dy and every non-router weight rounded to bf16, the router (its
   weight, the DeepSeek bias, logits, losses) in fp32. Against the file's
   fp32 expectations a bf16 run would be judged on rounding its inputs,
   which moves logits past the top-k margin of some tokens; against this
   reference routing must match exactly, and what differs is the GPU's own
   bf16 storage of h, a, ys, y and dx (see docs/CUDA.md for the bound). */
typedef struct ref {
    int n;
    char name[512][96];
    float *v[512];          /* [total] each, this rank's slice at its offset */
    int64_t *ids;           /* [T][K] */
} ref;

static float *ref_get(ref *r, const char *name) {
    for (int i = 0; i < r->n; i++)
        if (strcmp(r->name[i], name) == 0) return r->v[i];
    return NULL;
}
static int ref_put(ref *r, const char *name, const float *v, int64_t n, int64_t at, int64_t total) {
    if (r->n == 512) return 0;
    float *a = calloc((size_t)(total + 1), sizeof(float));
    if (!a) return 0;
    if (v) memcpy(a + at, v, (size_t)n * sizeof(float));
    snprintf(r->name[r->n], sizeof r->name[0], "%s", name);
    r->v[r->n++] = a;
    return 1;
}
static void ref_free(ref *r) {
    if (!r) return;
    for (int i = 0; i < r->n; i++) free(r->v[i]);
    free(r->ids);
    free(r);
}
static int is_router(const char *name) {
    return strcmp(name, "gate.weight") == 0 || strcmp(name, "gate.e_score_correction_bias") == 0;
}
static void round_bf16(float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) v[i] = moept__bf16_to_f32(moept__f32_to_bf16(v[i]));
}

/* --reshard: every expert of L (E over P ranks) to the next rank */
static moept_status reshard_next(moept_layer *L, int64_t E, int P) {
    int32_t *place = malloc((size_t)E * sizeof(int32_t));
    if (!place) return MOEPT_ERR_OUT_OF_MEMORY;
    for (int64_t e = 0; e < E; e++) place[e] = (int32_t)((e / (E / P) + 1) % P);
    moept_status st = moept_reshard(L, place, NULL);
    free(place);
    return st;
}

/* runs the CPU reference on rounded copies of L's parameters (at L's
   placement: --reshard moves its experts too); x and gy are
   this rank's Tr rows (already rounded), at row lo of T; mask its padding
   (or NULL) */
static int ref_build(check *c, const moept_config *cfg, moept_layer *L, const float *x, const float *gy, int64_t T,
                     int64_t lo, int64_t Tr, const uint8_t *mask) {
    const int64_t D = cfg->hidden_size, E = cfg->num_experts, K = cfg->top_k;
    moept_layer *R = NULL;
    ref *r = calloc(1, sizeof *r);
    float *y = calloc((size_t)(Tr * D + 1), sizeof(float)), *dx = calloc((size_t)(Tr * D + 1), sizeof(float));
    int ok = r && y && dx && moept_create_parallel(cfg, c->ref_ep, NULL, &R) == MOEPT_OK;
    const int P = c->ref_ep ? c->ref_ep->size : 1;
    ok = ok && (!g_reshard || P == 1 || reshard_next(R, E, P) == MOEPT_OK);
    for (int64_t i = 0; ok && i < moept_param_count(L); i++) {
        moept_param_info pi;
        float *w = tu_param(L, i, 0, &pi); /* (a CUDA layer's: a copy of its device's) */
        int64_t n = pi.rows * pi.cols;
        ok = w != NULL;
        if (ok && !is_router(pi.name) && g_bf16) round_bf16(w, n);
        ok = ok && moept_set_param(R, pi.name, w, n) == MOEPT_OK;
        free(w);
    }
    moept_forward_opts fo = {mask, 0, NULL, NULL, 0};
    ok = ok && moept_forward_ex(R, x, Tr, y, &fo) == MOEPT_OK;
    const int32_t *ids; const float *wts, *logits;
    moept_stats st;
    if (ok) {
        moept_routing(R, &ids, &wts, &logits);
        moept_get_stats(R, &st, NULL);
        r->ids = calloc((size_t)(T * K + 1), sizeof(int64_t));
        ok = r->ids != NULL;
        for (int64_t i = 0; ok && i < Tr * K; i++) r->ids[lo * K + i] = ids[i];
        ok = ok && ref_put(r, "output", y, Tr * D, lo * D, T * D) && ref_put(r, "router_logits", logits, Tr * E, lo * E, T * E);
        ok = ok && ref_put(r, "topk_weights", wts, Tr * K, lo * K, T * K);
        ok = ok && ref_put(r, "aux_loss", &st.aux_loss, 1, 0, 1) && ref_put(r, "z_loss", &st.z_loss, 1, 0, 1);
    }
    ok = ok && moept_backward(R, x, gy, dx) == MOEPT_OK && moept_sync_grads(R, 1.0f) == MOEPT_OK;
    ok = ok && ref_put(r, "grad.input", dx, Tr * D, lo * D, T * D);
    for (int64_t i = 0; ok && i < moept_param_count(R); i++) {
        moept_param_info pi;
        moept_param_info_at(R, i, &pi);
        char name[120];
        snprintf(name, sizeof name, "grad.%s", pi.name);
        if (pi.grad) ok = ref_put(r, name, pi.grad, pi.rows * pi.cols, 0, pi.rows * pi.cols);
    }
    if (!ok)
        failf(c, "reference (CPU layer%s): %s", g_bf16 ? " on bf16-rounded inputs" : "", moept_last_error(R));
    moept_destroy(R);
    free(y); free(dx);
    if (!ok) { ref_free(r); return 0; }
    c->ref = r;
    return 1;
}

/* the expected tensor: the file's expected.<name>, or the bf16 reference's */
static float *want_f(check *c, const char *name, int64_t rows, int64_t cols) {
    char full[160];
    snprintf(full, sizeof full, "expected.%s", name);
    if (!c->ref) return read_f(c, full, rows, cols);
    float *v = ref_get(c->ref, name), *out = malloc((size_t)(rows * cols + 1) * sizeof(float));
    if (!v || !out) { free(out); failf(c, "bf16 reference: no %s", name); return NULL; }
    memcpy(out, v, (size_t)(rows * cols) * sizeof(float));
    return out;
}


/* --hf-config: the config from config.json (the losses stay the case's:
   they are training choices, not the model's; so does the group fill,
   which config.json does not hold); every model field must
   equal the case's, norm_topk_prob as it resolves. 0 after failf. */
static int eff_norm(const moept_config *c) {
    return c->norm_topk_prob ? c->norm_topk_prob > 0
                             : c->family == MOEPT_FAMILY_MIXTRAL || c->family == MOEPT_FAMILY_DEEPSEEK_V3;
}
static int hf_config(check *c, moept_config *cfg) {
    moept_config h = moept_config_default(MOEPT_FAMILY_MIXTRAL);
    if (moept_config_from_hf(g_weights, g_layer, &h) != MOEPT_OK) {
        failf(c, "--hf-config: %s", moept_last_error(NULL));
        return 0;
    }
    const char *bad = h.family != cfg->family ? "family" : h.hidden_size != cfg->hidden_size ? "hidden_size"
        : h.intermediate_size != cfg->intermediate_size ? "intermediate_size"
        : h.num_experts != cfg->num_experts ? "num_experts" : h.top_k != cfg->top_k ? "top_k"
        : eff_norm(&h) != eff_norm(cfg) ? "norm_topk_prob"
        : h.shared_intermediate_size != cfg->shared_intermediate_size ? "shared_intermediate_size"
        : (h.n_group ? h.n_group : 1) != (cfg->n_group ? cfg->n_group : 1) ? "n_group"
        : (h.topk_group ? h.topk_group : 1) != (cfg->topk_group ? cfg->topk_group : 1) ? "topk_group"
        : (h.routed_scaling_factor ? h.routed_scaling_factor : 1.0f) !=
          (cfg->routed_scaling_factor ? cfg->routed_scaling_factor : 1.0f) ? "routed_scaling_factor"
        : h.activation != MOEPT_ACT_SILU_GATED ? "activation" : NULL;
    if (bad) {
        failf(c, "--hf-config: config.json's %s differs from the case's", bad);
        return 0;
    }
    h.group_fill = cfg->group_fill; /* config.json has no key for it */
    h.aux_loss = cfg->aux_loss;
    h.aux_seq_len = cfg->aux_seq_len;
    h.aux_loss_coef = cfg->aux_loss_coef;
    h.z_loss_coef = cfg->z_loss_coef;
    *cfg = h;
    return 1;
}

static void run_case(check *c) {
    moept_layer *L = NULL;
    float *x = NULL, *y = NULL, *gy = NULL, *dx = NULL, *want = NULL, *got = NULL;
    uint8_t *mask = NULL;  /* [T] the case's attention_mask, NULL: none */
    if (moept_st_open(c->path, &c->f) != MOEPT_OK) { failf(c, "%s", moept_last_error(NULL)); return; }
    const char *fmt = moept_st_meta(c->f, "format");
    if (!fmt || strcmp(fmt, "moept-case-v1") != 0) { failf(c, "metadata 'format' is not moept-case-v1"); goto done; }
    moept_config cfg = {0};
    const char *fam = moept_st_meta(c->f, "family");
    if (!fam || !family_of(fam, &cfg.family)) { failf(c, "metadata 'family' = '%s' is not supported", fam ? fam : "(missing)"); goto done; }
    int64_t T, norm, ng, tg;
    if (!meta_int(c, "tokens", &T) || !meta_int(c, "hidden_size", &cfg.hidden_size) ||
        !meta_int(c, "intermediate_size", &cfg.intermediate_size) || !meta_int(c, "num_experts", &cfg.num_experts) ||
        !meta_int(c, "top_k", &cfg.top_k) || !meta_int(c, "norm_topk_prob", &norm) ||
        !meta_int(c, "shared_intermediate_size", &cfg.shared_intermediate_size) ||
        !meta_int(c, "n_group", &ng) || !meta_int(c, "topk_group", &tg) ||
        !meta_float(c, "routed_scaling_factor", &cfg.routed_scaling_factor) ||
        !meta_float(c, "aux_loss_coef", &cfg.aux_loss_coef) || !meta_float(c, "z_loss_coef", &cfg.z_loss_coef) ||
        !meta_group_fill(c, &cfg.group_fill))
        goto done;
    const char *act = moept_st_meta(c->f, "hidden_act");
    if (!act || strcmp(act, "silu") != 0) { failf(c, "metadata 'hidden_act' must be 'silu'"); goto done; }
    const char *aux = moept_st_meta(c->f, "aux_loss");
    if (!aux) { failf(c, "metadata 'aux_loss' missing"); goto done; }
    if (strcmp(aux, "hf") == 0) cfg.aux_loss = MOEPT_AUX_HF;
    else if (strcmp(aux, "megatron") == 0) cfg.aux_loss = MOEPT_AUX_MEGATRON;
    else if (strcmp(aux, "none") == 0) cfg.aux_loss = MOEPT_AUX_NONE;
    else if (strcmp(aux, "seq") == 0) {
        cfg.aux_loss = MOEPT_AUX_SEQ;
        if (!meta_int(c, "aux_seq_len", &cfg.aux_seq_len)) goto done;
    } else { failf(c, "metadata 'aux_loss' = '%s' is not supported", aux); goto done; }
    if (T < 0 || T > (1 << 24)) { failf(c, "metadata 'tokens' out of range"); goto done; }
    cfg.norm_topk_prob = norm ? MOEPT_NORM_ON : MOEPT_NORM_OFF;
    cfg.n_group = ng; cfg.topk_group = tg;
    if (g_hf_config && !hf_config(c, &cfg)) goto done;
    int P = c->ep ? c->ep->size : 1, rank = c->ep ? c->ep->rank : 0;
    /* this rank's slice of the tokens: the first T mod P ranks take one more */
    int64_t lo = T / P * rank + (rank < T % P ? rank : T % P);
    int64_t Tr = T / P + (rank < T % P);
    cfg.max_tokens = Tr > 0 ? Tr : 1;
    if (cfg.aux_loss == MOEPT_AUX_SEQ && (cfg.aux_seq_len < 1 || Tr % cfg.aux_seq_len || T % P)) {
        /* the same on every rank: a sequence is never split over ranks */
        snprintf(c->skip, sizeof c->skip, "sequences of %lld tokens do not split over --ep %d",
                 (long long)cfg.aux_seq_len, P);
        goto done;
    }
    if (cfg.aux_loss == MOEPT_AUX_SEQ && cfg.max_tokens < cfg.aux_seq_len) cfg.max_tokens = cfg.aux_seq_len;
    cfg.global_balance = P > 1;
    cfg.overlap_chunks = g_chunks;
    cfg.fp8 = g_fp8 ? MOEPT_FP8_BLOCKWISE : MOEPT_FP8_OFF;
    const moept_st_tensor *tm = moept_st_find(c->f, "attention_mask");
    if (tm && !read_mask(c, tm, T, &mask)) goto done;
    if (cfg.num_experts % P != 0) { /* the same on every rank: no collective is left waiting */
        snprintf(c->skip, sizeof c->skip, "E=%lld experts do not split over --ep %d", (long long)cfg.num_experts, P);
        goto done;
    }
    if (layer_create(&cfg, c->ep, c->stream, &L) != MOEPT_OK) { failf(c, "config rejected: %s", moept_last_error(NULL)); goto done; }
    const int64_t D = cfg.hidden_size, E = cfg.num_experts, K = cfg.top_k;

    /* parameters: every one the layer has must be in the file (or the checkpoint) */
    int64_t np = moept_param_count(L);
    if (g_weights && moept_load_hf(L, g_weights, g_layer) != MOEPT_OK) {
        failf(c, "--weights: %s", moept_last_error(L));
        goto done;
    }
    for (int64_t i = 0; i < np && !g_weights; i++) {
        moept_param_info pi;
        moept_param_info_at(L, i, &pi);
        float *w = read_f(c, pi.name, pi.rows, pi.cols);
        if (!w) goto done;
        moept_status st = moept_set_param(L, pi.name, w, pi.rows * pi.cols);
        free(w);
        if (st) { failf(c, "%s", moept_last_error(L)); goto done; }
    }
    if (g_reshard && P > 1 && reshard_next(L, E, P) != MOEPT_OK) { /* the moved weights compute the step */
        failf(c, "--reshard: %s", moept_last_error(L));
        goto done;
    }
    if (!(x = read_f(c, "input", T, D)) || !(gy = read_f(c, "grad_output", T, D))) goto done;
    if (g_bf16 || g_vs_cpu) { /* the values the GPU sees, and the reference made from them */
        if (g_bf16) round_bf16(x, T * D);
        if (g_bf16) round_bf16(gy, T * D);
        if (!ref_build(c, &cfg, L, x + lo * D, gy + lo * D, T, lo, Tr, mask ? mask + lo : NULL)) goto done;
    }
    y = calloc((size_t)(T * D + 1), sizeof(float));
    dx = calloc((size_t)(T * D + 1), sizeof(float));
    if (!y || !dx) { failf(c, "out of memory"); goto done; }
    if (!all_ok(c)) goto done;
    if (layer_forward(L, c->stream, x + lo * D, Tr, D, y, mask ? mask + lo : NULL) != MOEPT_OK) { failf(c, "forward: %s", moept_last_error(L)); goto done; }

    if (!(want = want_f(c, "output", T, D))) goto done;
    compare_rows(c, "output", y, want, lo, Tr, T, D);
    free(want); want = NULL;
    const int32_t *ids; const float *wts, *logits;
    moept_routing(L, &ids, &wts, &logits);
    if (!(want = want_f(c, "router_logits", T, E))) goto done;
    compare_at(c, "router_logits", logits, want + lo * E, Tr * E, lo * E);
    free(want); want = NULL;
    /* top-k: the same set per token; weights paired with their ids */
    const moept_st_tensor *tid = moept_st_find(c->f, "expected.topk_ids");
    if (!tid || tid->ndim != 2 || tid->shape[0] != T || tid->shape[1] != K) { failf(c, "tensor 'expected.topk_ids' missing or not [T, K]"); goto done; }
    int64_t *eid = malloc((size_t)(T * K + 1) * sizeof(int64_t));
    if (!eid || moept_st_read_i64(c->f, tid, eid, T * K) != MOEPT_OK) { free(eid); failf(c, "cannot read expected.topk_ids"); goto done; }
    if (c->ref) memcpy(eid, c->ref->ids, (size_t)(T * K) * sizeof(int64_t)); /* bf16: the reference's choices, exactly */
    if (!(want = want_f(c, "topk_weights", T, K))) { free(eid); goto done; }
    got = malloc((size_t)(T * K + 1) * sizeof(float));
    for (int64_t t = 0; t < Tr && got; t++)
        for (int64_t k = 0; k < K; k++) {
            int64_t j = 0, te = lo + t;
            while (j < K && ids[t * K + j] != eid[te * K + k]) j++;
            if (j == K) {
                failf(c, "topk_ids differ at token %lld: expert %lld expected but not selected", (long long)te, (long long)eid[te * K + k]);
                break;
            }
            got[t * K + k] = wts[t * K + j];
        }
    free(eid);
    if (!c->reason[0]) compare_at(c, "topk_weights", got, want + lo * K, Tr * K, lo * K);
    free(want); want = NULL;
    moept_stats st;
    moept_get_stats(L, &st, NULL);
#ifndef MOEPT_CUDA
    { /* the exchange took the path asked for: shared memory when the comm has it */
        int has = c->ep && c->ep->size > 1 && c->ep->shm_alloc, want_shared = has && g_chunks <= 1;
        if (g_expect_shm && c->ep && c->ep->size > 1 && !has)
            failf(c, "--expect-shm: the EP comm has no shm_alloc");
        else if (st.shared_exchange != want_shared)
            failf(c, "stats.shared_exchange %lld, expected %d", (long long)st.shared_exchange, want_shared);
    }
#endif
    if (!(want = want_f(c, "aux_loss", 1, 1))) goto done;
    compare(c, "aux_loss", &st.aux_loss, want, 1);
    free(want); want = NULL;
    if (!(want = want_f(c, "z_loss", 1, 1))) goto done;
    compare(c, "z_loss", &st.z_loss, want, 1);
    free(want); want = NULL;

    if (!all_ok(c)) goto done;
    if (layer_backward(L, c->stream, x + lo * D, gy + lo * D, Tr, D, dx) != MOEPT_OK) { failf(c, "backward: %s", moept_last_error(L)); goto done; }
    if (moept_sync_grads(L, 1.0f) != MOEPT_OK) { failf(c, "sync_grads: %s", moept_last_error(L)); goto done; }
    if (!(want = want_f(c, "grad.input", T, D))) goto done;
    compare_rows(c, "grad.input", dx, want, lo, Tr, T, D);
    free(want); want = NULL;
    /* The router weight's gradient carries a rounding floor when the
       reference ran its router in fp32 (as transformers does by default):
       dL/dlogits is formed from terms of size |dL/dw|, rounded at fp32.
       Cancellation (K = 1 with renormalisation makes dw/dlogits exactly 0)
       can leave that floor above 1e-5 of a tiny true gradient. The checker
       allows that floor on top of the relative tolerance:
           eps32 * sum_t (sum_k |dL/dw_t,k|) * |x_t|  */
    const float *dw = NULL;
    double floor_abs = 0.0;
    if (moept_routing_grads(L, &dw) == MOEPT_OK)
        for (int64_t t = 0; t < Tr; t++) {
            double g = 0.0, xn = 0.0;
            for (int64_t k = 0; k < K; k++) g += fabs(dw[t * K + k]);
            for (int64_t d = 0; d < D; d++) xn += (double)x[(lo + t) * D + d] * x[(lo + t) * D + d];
            floor_abs += 5.96e-8 * g * sqrt(xn);
        }
    if (c->ep) c->ep->allreduce(c->ep, &floor_abs, 1, MOEPT_DTYPE_F64); /* the summed gradient's floor */
    for (int64_t i = 0; i < np; i++) {
        moept_param_info pi;
        float *g = tu_param(L, i, 1, &pi);
        if (!g) continue;
        char name[160];
        snprintf(name, sizeof name, "grad.%s", pi.name);
        if (!(want = want_f(c, name, pi.rows, pi.cols))) { free(g); goto done; }
        compare_floor(c, name, g, want, pi.rows * pi.cols, strcmp(pi.name, "gate.weight") == 0 ? floor_abs : 0.0);
        free(g);
        free(want); want = NULL;
    }
done:
    free(x); free(y); free(gy); free(dx); free(want); free(got); free(mask);
    moept_destroy(L);
    moept_st_close(c->f);
    ref_free(c->ref);
    c->ref = NULL;
}

/* ---- several ranks ---- */
/* merges the ranks' verdicts into c (worst error, first reason) */
static void merge(check *c, const check *r, int rank) {
    c->digest = (c->digest ^ r->digest) * 0x100000001b3ULL; /* in rank order */
    c->ep_digest += r->ep_digest;
    if (r->skip[0] && !c->skip[0]) snprintf(c->skip, sizeof c->skip, "%s", r->skip);
    if (r->reason[0] && !c->reason[0]) snprintf(c->reason, sizeof c->reason, "rank %d: %.560s", rank, r->reason);
    if (!(r->worst <= c->worst) || (r->worst > c->worst)) {
        c->worst = r->worst;
        snprintf(c->worst_name, sizeof c->worst_name, "%s", r->worst_name);
    }
}

#ifdef MOEPT_CUDA
/* A GPU rank: its device, its place in the NCCL clique and the clique's id
   (--comm device: the thread group of the ranks on device 0 instead) */
typedef struct gpu_rank {
    int dev, rank, size;
    ncclUniqueId id;
    moept_thread_group *tg;
} gpu_rank;

/* One GPU per rank: its NCCL communicator and two non-blocking streams
   (compute, communication), so that only the layer's own events order
   them. g NULL: one rank, device 0, no communicator. */
static void run_case_gpu(check *c, const gpu_rank *g) {
    cudaStream_t ks = NULL, cs = NULL;
    ncclComm_t nc = NULL;
    moept_comm *ep = NULL;
    int ok = cudaSetDevice(g ? g->dev : 0) == cudaSuccess &&
             cudaStreamCreateWithFlags(&ks, cudaStreamNonBlocking) == cudaSuccess &&
             cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) == cudaSuccess;
    if (ok && g && g->tg) ok = moept_comm_cuda_threads(g->tg, g->rank, cs, 60000, &ep) == MOEPT_OK;
    else if (ok && g) ok = ncclCommInitRank(&nc, g->size, g->id, g->rank) == ncclSuccess &&
                           moept_comm_nccl(nc, cs, 60000, &ep) == MOEPT_OK;
    if (!ok) {
        failf(c, "cannot set up this rank's device, streams or %s",
              g && g->tg ? "device comm" : "NCCL communicator");
    } else {
        c->ep = ep;
        c->stream = ks;
        run_case(c);
    }
    const int aborted = ep && moept_comm_nccl_aborted(ep); /* then NCCL freed it already */
    moept_comm_destroy(ep);
    c->ep = NULL;
    if (nc && !aborted) ncclCommDestroy(nc);
    if (ks) cudaStreamDestroy(ks);
    if (cs) cudaStreamDestroy(cs);
}
#endif

#ifndef MOEPT_MPI
typedef struct rank_job {
    check c;
#ifdef MOEPT_CUDA
    gpu_rank g;
#endif
} rank_job;

static void *check_rank(void *arg) {
    rank_job *j = arg;
    tu_rank_thread();
#ifdef MOEPT_CUDA
    run_case_gpu(&j->c, &j->g);
#else
    run_case(&j->c);
#endif
    return NULL;
}

static void run_threads(check *c, int P) {
    moept_thread_group *g;
    if (moept_thread_group_create(P, 60000, &g) != MOEPT_OK) { failf(c, "%s", moept_last_error(NULL)); return; }
    rank_job *jobs = calloc((size_t)P, sizeof *jobs);
#ifdef MOEPT_CUDA
    ncclUniqueId id;
    moept_thread_group *tg = NULL; /* --comm device: the device comms' group */
    if (g_comm_device ? moept_thread_group_create(P, 60000, &tg) != MOEPT_OK
                      : ncclGetUniqueId(&id) != ncclSuccess) {
        failf(c, "%s failed", g_comm_device ? "moept_thread_group_create" : "ncclGetUniqueId");
        P = 0;
    }
#endif
    for (int r = 0; r < P; r++) {
        jobs[r].c.path = c->path;
#ifdef MOEPT_CUDA
        jobs[r].g = (gpu_rank){g_one_gpu ? 0 : r, r, P, id, tg};
        moept_comm_threads(g, r, &jobs[r].c.ref_ep); /* the bf16 reference's */
#else
        moept_comm_threads(g, r, &jobs[r].c.ep);
        if (g_no_shm) jobs[r].c.ep->shm_alloc = NULL;
#endif
    }
    tu_threads(P, check_rank, jobs, sizeof *jobs);
    for (int r = 0; r < P; r++) merge(c, &jobs[r].c, r);
    free(jobs);
    moept_thread_group_destroy(g);
#ifdef MOEPT_CUDA
    moept_thread_group_destroy(tg);
#endif
}
#endif

int main(int argc, char **argv) {
    double tol = 1e-5, tol_bf16 = 0.015625; /* bf16: 4u, u = 2^-8 (docs/CUDA.md) */
    double tol_fp8 = 0.25;                  /* fp8: 4u, u = 2^-4 (E4M3 rounding; docs/GUIDE.md) */
    double tol_fp8_cpu = 0.03125;           /* CUDA fp8 vs the CPU's: 2^-5 (docs/CUDA.md, "FP8") */
    int first = 1, P = 1;
    for (; first < argc && strncmp(argv[first], "--", 2) == 0; first++) {
        if (strcmp(argv[first], "--tol") == 0 && first + 1 < argc) tol = atof(argv[++first]);
        else if (strcmp(argv[first], "--tol-bf16") == 0 && first + 1 < argc) tol_bf16 = atof(argv[++first]);
        else if (strcmp(argv[first], "--ep") == 0 && first + 1 < argc) P = atoi(argv[++first]);
        else if (strcmp(argv[first], "--chunks") == 0 && first + 1 < argc) g_chunks = atoi(argv[++first]);
        else if (strcmp(argv[first], "--weights") == 0 && first + 1 < argc) g_weights = argv[++first];
        else if (strcmp(argv[first], "--layer") == 0 && first + 1 < argc) g_layer = atoll(argv[++first]);
        else if (strcmp(argv[first], "--hf-config") == 0) g_hf_config = 1;
        else if (strcmp(argv[first], "--sync-free") == 0) g_sync_free = 1;
        else if (strcmp(argv[first], "--dtype") == 0 && first + 1 < argc && !strcmp(argv[first + 1], "fp8"))
            g_fp8 = 1, first++;
        else if (strcmp(argv[first], "--dtype") == 0 && first + 1 < argc && !strcmp(argv[first + 1], "bf16"))
            g_bf16_only = 1, first++;
        else if (strcmp(argv[first], "--tol-fp8") == 0 && first + 1 < argc) tol_fp8 = atof(argv[++first]);
        else if (strcmp(argv[first], "--tol-fp8-cpu") == 0 && first + 1 < argc)
            tol_fp8_cpu = atof(argv[++first]);
        else if (strcmp(argv[first], "--gemm-form") == 0 && first + 1 < argc) {
            const char *f = argv[++first], *names[5] = {"auto", "grouped", "per-expert", "strided", "kernel"};
            g_gemm_form = -1;
            for (int i = 0; i < 5; i++)
                if (strcmp(f, names[i]) == 0) g_gemm_form = i;
            if (g_gemm_form < 0) {
                fprintf(stderr, "moept_check: --gemm-form auto|grouped|per-expert|strided|kernel, not %s\n", f);
                return 2;
            }
        }
        else if (strcmp(argv[first], "--comm") == 0 && first + 1 < argc) {
            const char *m = argv[++first];
            if (strcmp(m, "device") != 0 && strcmp(m, "nccl") != 0 && strcmp(m, "nccl-one-gpu") != 0) {
                fprintf(stderr, "moept_check: --comm nccl|nccl-one-gpu|device, not %s\n", m);
                return 2;
            }
            g_comm_device = strcmp(m, "device") == 0;
            g_one_gpu = strcmp(m, "nccl") != 0;
        }
        else if (strcmp(argv[first], "--no-shm") == 0) g_no_shm = 1;
        else if (strcmp(argv[first], "--digest") == 0) g_digest = 1;
        else if (strcmp(argv[first], "--ep-digest") == 0) g_ep_digest = 1;
        else if (strcmp(argv[first], "--reshard") == 0) g_reshard = 1;
        else if (strcmp(argv[first], "--expect-shm") == 0) g_expect_shm = 1;
        else if (strcmp(argv[first], "--") == 0) { first++; break; }
        else {
            fprintf(stderr, "usage: %s [--ep N] [--chunks C] [--no-shm] [--expect-shm] [--sync-free] "
                    "[--dtype fp8|bf16] [--digest] [--ep-digest] [--reshard] [--gemm-form F] [--comm C] "
                    "[--tol X] "
                    "[--weights DIR --layer L] FILE...\n", argv[0]);
            return 2;
        }
    }
    if (!g_weights != (g_layer < 0) || (g_hf_config && !g_weights)) {
        fprintf(stderr, "moept_check: --weights and --layer go together (and --hf-config needs them)\n");
        return 2;
    }
    if (P < 1 || P > 1024) { fprintf(stderr, "moept_check: --ep %d not in 1..1024\n", P); return 2; }
#if defined(MOEPT_MPI) || !defined(MOEPT_CUDA)
    if (g_one_gpu) {
        fprintf(stderr, "moept_check: --comm device, nccl-one-gpu: ranks as threads of a CUDA build only\n");
        return 2;
    }
#endif
#ifdef MOEPT_MPI
    MPI_Init(&argc, &argv);
    moept_comm *world = NULL;
    if (moept_comm_mpi(MPI_COMM_WORLD, &world) != MOEPT_OK) { fprintf(stderr, "%s\n", moept_last_error(NULL)); return 2; }
    if (g_no_shm) world->shm_alloc = NULL;
    if (world->size != P) {
        if (world->rank == 0) fprintf(stderr, "moept_check_mpi: --ep %d but %d MPI processes\n", P, world->size);
        MPI_Finalize();
        return 2;
    }
#ifdef MOEPT_CUDA
    int local_rank = 0; /* this process's place among the processes of its host */
    {
        MPI_Comm node;
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
        MPI_Comm_rank(node, &local_rank);
        MPI_Comm_free(&node);
    }
#endif
    int me = world->rank;
#else
    int me = 0;
#endif
    int passed = 0, failed = 0, skipped = 0;
#ifdef MOEPT_CUDA
#ifdef MOEPT_MPI
    const int need = 1; /* a GPU a process: device local_rank % device_count */
#else
    const int need = g_one_gpu ? 1 : P; /* --comm device, nccl-one-gpu: every rank on device 0 */
#endif
    if (moept_cuda_device_count() < need) { /* a GPU check without a GPU is skipped, never passed */
        for (int i = first; i < argc && me == 0; i++) {
            const char *b = strrchr(argv[i], '/');
            printf("%-40s SKIP  %s (fp32 and bf16 not run)\n", b ? b + 1 : argv[i],
                   need > 1 ? "fewer CUDA devices than --ep" : "no CUDA device");
            skipped++;
        }
        if (me == 0) printf("0 passed, 0 failed, %d skipped\n", skipped);
#ifdef MOEPT_MPI
        moept_comm_destroy(world);
        MPI_Finalize();
#endif
        return 0;
    }
    /* fp32, then bf16; FP8 also holds its fp32 pass to the CPU's FP8 layer (docs/CUDA.md, "FP8") */
    const int passes = g_fp8 ? 3 : 2;
#else
    const int passes = 1;
#endif
    const int nfiles = argc - first;
    if (g_bf16_only && passes == 1) {
        fprintf(stderr, "moept_check: --dtype bf16: a CUDA build's bf16 pass\n");
        return 2;
    }
    /* CUDA: fp32 pass, (FP8: against the CPU,) bf16 */
    for (int it = g_bf16_only ? nfiles * (passes - 1) : 0; it < nfiles * passes; it++) {
        int arg = first + it % nfiles;
        g_bf16 = passes > 1 && it >= nfiles * (passes - 1);
        g_vs_cpu = passes == 3 && it / nfiles == 1;
        double case_tol = g_vs_cpu ? tol_fp8_cpu : g_fp8 ? tol_fp8 : g_bf16 ? tol_bf16 : tol;
        check c;
        memset(&c, 0, sizeof c);
        c.path = argv[arg];
#ifdef MOEPT_MPI
        { /* this process is one rank; gather every rank's verdict */
            check mine;
            memset(&mine, 0, sizeof mine);
            mine.path = argv[arg];
#ifdef MOEPT_CUDA
            gpu_rank g = {local_rank % moept_cuda_device_count(), me, P, {{0}}, NULL};
            if (me == 0 && ncclGetUniqueId(&g.id) != ncclSuccess) failf(&mine, "ncclGetUniqueId failed");
            MPI_Bcast(&g.id, (int)sizeof g.id, MPI_BYTE, 0, MPI_COMM_WORLD);
            mine.ref_ep = world;
            run_case_gpu(&mine, &g);
            mine.ref_ep = NULL;
#else
            mine.ep = world;
            run_case(&mine);
#endif
            mine.ep = NULL;
            mine.f = NULL;
            check *all = calloc((size_t)P, sizeof *all);
            world->allgather(world, &mine, all, (int64_t)sizeof mine);
            for (int r = 0; r < P; r++) merge(&c, &all[r], r);
            free(all);
        }
#else
        if (P > 1) run_threads(&c, P);
#ifdef MOEPT_CUDA
        else run_case_gpu(&c, NULL);
#else
        else run_case(&c);
#endif
#endif
        const char *base = strrchr(c.path, '/');
        base = base ? base + 1 : c.path;
        if (!c.reason[0] && !(c.worst <= case_tol))
            snprintf(c.reason, sizeof c.reason, "relative error %.3g > %.3g in %s", c.worst, case_tol, c.worst_name);
        if (c.reason[0]) failed++;
        else if (c.skip[0]) skipped++;
        else passed++;
        if (me != 0) continue;
        char label[300];
        snprintf(label, sizeof label, "%s%s", base,
                 passes == 1 ? "" : g_bf16 ? "[bf16]" : g_vs_cpu ? "[fp32 vs CPU fp8]" : "[fp32]");
        if (!c.reason[0] && c.skip[0])
            printf("%-40s SKIP  %s\n", label, c.skip);
        else if (c.reason[0])
            printf("%-40s FAIL  max rel err %.3g (%s): %s\n", label, c.worst, c.worst_name[0] ? c.worst_name : "-", c.reason);
        else if (g_digest || g_ep_digest)
            printf("%-40s PASS  max rel err %.3g (%s) %s %016llx\n", label, c.worst, c.worst_name,
                   g_digest ? "digest" : "ep-digest",
                   (unsigned long long)(g_digest ? c.digest : c.ep_digest));
        else
            printf("%-40s PASS  max rel err %.3g (%s)\n", label, c.worst, c.worst_name);
    }
    if (me == 0) {
        if (skipped) printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
        else printf("%d passed, %d failed\n", passed, failed);
    }
#ifdef MOEPT_MPI
    moept_comm_destroy(world);
    MPI_Finalize();
#endif
    return failed || passed == 0 ? 1 : 0;
}
