/* train: a character-level language model built from moept layers, trained
   end to end on the CPU.

     model:  h0 = sum_j emb_j[c_{t-j}]           (j = 1..ctx previous bytes)
             h_{l+1} = h_l + MoE_l(rmsnorm_l(h_l)) (moept does MoE_l)
             p(c_t) = softmax(rmsnorm(h_L) W_out^T)
     loss:   cross-entropy + the layers' aux and z losses; AdamW.

   usage: train [--data FILE]... [--steps N] [--batch B] [--layers L]
                [--dim D] [--ffn F] [--experts E] [--topk K] [--ctx C]
                [--family mixtral|qwen2_moe|olmoe|deepseek_v3] [--lr X]
                [--csv FILE] [--seed S] [--ep N] [--quiet] [--dtype fp8]
          mpirun -np N train_mpi --ep N ...      (built with -DMOEPT_MPI)
          mpirun -np N*M train_mpi --ep N --dp M ...
          train_cuda [--bf16] ... (built with -DMOEPT_CUDA: the MoE layers on the
                              GPU, one rank; skipped without a device)
          mpirun -np N*M train_cuda_mpi --ep N [--dp M] [--bf16] ...
                             (both: one process per GPU, as users deploy it)
   With no --data it trains on examples/corpus.txt, a fixed snapshot of the
   project's docs and sources (so its figures do not move with edits).

   Output: "loss" is each printed step's training loss, "avg" its moving
   average (0.95 decay) over every step so far. Exit status: 0, or 1 when a
   check failed: a library call, or, in a run of at least MIN_JUDGED_STEPS
   (100) steps, the moving average not below the first step's loss (fewer
   steps are not judged: warm-up alone is 50 steps); 2: usage.

   --ep N: expert parallel over N ranks (threads, or MPI processes). Each
   rank keeps E/N experts and a replica of everything else, and takes a
   contiguous slice of every batch; the dense parts' gradients are summed
   over ranks and the aux loss is over the global batch, so the run follows
   the one-rank run up to fp32 rounding.
   --dp N (train_mpi, N * ep processes): N replicas of the experts, each
   split over --ep ranks; MPI_Comm_split makes the EP and DP groups, and
   moept_sync_grads sums the layers' gradients over both.
   train_cuda_mpi: each process drives device local_rank % device_count
   (local_rank: its place among the processes of its host); rank 0 of each
   EP and DP group makes an NCCL id and broadcasts it over the group's MPI
   communicator, and every rank joins with ncclCommInitRank. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 (with no -fopenmp to declare it) */
#include "../moept.h"

#define MIN_JUDGED_STEPS 100 /* a run this long is expected to lower its loss */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef MOEPT_CUDA
#include <cuda_runtime.h>
#endif
#if defined(MOEPT_CUDA) && defined(MOEPT_MPI)
#include <mpi.h>
#include <nccl.h>
#endif

typedef struct opts {
    const char *data[32]; int ndata;
    int steps, batch, layers, dim, ffn, experts, topk, ctx, quiet;
    moept_family family;
    float lr;
    const char *csv;
    unsigned long long seed;
    int ep, dp;
    int bf16;              /* train_cuda --bf16: the MoE layers in bf16 (rows and expert weights) */
    int fp8;               /* --dtype fp8: the expert GEMMs in FP8 (config.fp8) */
} opts;

/* p, g: the MoE layers' copies this optimizer steps (moept_buf_read/write: a CUDA layer's live on its GPU) */
typedef struct adam { float *m, *v, *p, *g; int64_t n; } adam;

typedef struct model {
    int V, D, C, NL, B;    /* B: this rank's rows per step */
    int Bg;                /* the global batch (the loss is its mean) */
    float *emb;      /* [C][V][D] one table per context position */
    float *norm;     /* [NL+1][D] rmsnorm gains (last: final norm) */
    float *head;     /* [V][D] */
    float *g_emb, *g_norm, *g_head;
    moept_layer **moe;
    /* activations for one batch */
    float *h;        /* [NL+1][B][D] residual stream */
    float *n;        /* [NL+1][B][D] normalised inputs of each layer / head */
    float *rms;      /* [NL+1][B] 1/rms */
    float *m;        /* [B][D] moe output */
    float *logits;   /* [B][V] */
    float *dh, *dn, *dm; /* [B][D] */
    adam a_emb, a_norm, a_head, *a_moe;
    float **dev_in;  /* CUDA: [NL] each layer's input [B][D] on the device, kept for its backward */
    float *dev_a, *dev_b; /* CUDA: [B][D] output / dy, dx */
    int bf16;             /* CUDA: the device rows are bf16 */
    uint16_t *stage;      /* CUDA bf16: [B][D] rows converted on the host */
} model;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double urand(unsigned long long *st) {
    *st = *st * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*st >> 11) / 9007199254740992.0;
}

static void *xcalloc(size_t n, size_t s) {
    void *p = calloc(n ? n : 1, s);
    if (!p) { fprintf(stderr, "train: out of memory\n"); exit(1); }
    return p;
}

static void check(moept_status s, const moept_layer *L, const char *what) {
    if (s != MOEPT_OK) {
        fprintf(stderr, "train: %s: %s\n", what, moept_last_error(L));
        exit(1);
    }
}

/* sums over the ranks (no-op at one rank) */
static void allsum(moept_comm *c, void *buf, int64_t n, moept_dtype t) {
    if (c && c->size > 1 && c->allreduce(c, buf, n, t) != MOEPT_OK) {
        fprintf(stderr, "train: all-reduce failed: %s\n", c->err);
        exit(1);
    }
}

static adam adam_new(int64_t n) {
    adam a = {xcalloc((size_t)n, 4), xcalloc((size_t)n, 4), NULL, NULL, n};
    return a;
}

/* AdamW as torch.optim.AdamW (decoupled weight decay, bias correction) */
static void adam_step(adam *a, float *p, float *g, int step, float lr, float wd) {
    const float b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
    float c1 = 1.0f - powf(b1, (float)step), c2 = 1.0f - powf(b2, (float)step);
    for (int64_t i = 0; i < a->n; i++) {
        a->m[i] = b1 * a->m[i] + (1 - b1) * g[i];
        a->v[i] = b2 * a->v[i] + (1 - b2) * g[i] * g[i];
        p[i] -= lr * wd * p[i];
        p[i] -= lr * (a->m[i] / c1) / (sqrtf(a->v[i] / c2) + eps);
    }
}

static void rmsnorm_fwd(const float *x, const float *g, int B, int D, float *y, float *inv) {
    for (int b = 0; b < B; b++) {
        double ss = 0;
        for (int d = 0; d < D; d++) ss += (double)x[b * D + d] * x[b * D + d];
        float r = 1.0f / sqrtf((float)(ss / D) + 1e-6f);
        inv[b] = r;
        for (int d = 0; d < D; d++) y[b * D + d] = x[b * D + d] * r * g[d];
    }
}

/* dx += rmsnorm'(dy); dg += */
static void rmsnorm_bwd(const float *x, const float *g, const float *inv, const float *dy, int B, int D,
                        float *dx, float *dg) {
    for (int b = 0; b < B; b++) {
        const float *xb = x + b * D, *dyb = dy + b * D;
        float r = inv[b];
        double dot = 0;
        for (int d = 0; d < D; d++) {
            dot += (double)dyb[d] * g[d] * xb[d];
            dg[d] += dyb[d] * xb[d] * r;
        }
        float c = (float)dot * r * r * r / (float)D;
        for (int d = 0; d < D; d++) dx[b * D + d] += dyb[d] * g[d] * r - xb[d] * c;
    }
}

static void usage(void) {
    fprintf(stderr, "usage: train [--data FILE]... [--steps N] [--batch B] [--layers L] [--dim D] [--ffn F]\n"
                    "             [--experts E] [--topk K] [--ctx C] [--family NAME] [--lr X] [--csv FILE]\n"
                    "             [--seed S] [--ep N] [--dp N (train_mpi)] [--quiet] [--bf16 (train_cuda)]\n"
                    "             [--dtype fp8 (the experts' GEMMs in E4M3: config.fp8)]\n"
                    "exit status 1: a check failed (a library call; with --steps >= %d, the loss's moving\n"
                    "average not below step 1's loss); 2: usage\n", MIN_JUDGED_STEPS);
    exit(2);
}

static void parse(int argc, char **argv, opts *o) {
    *o = (opts){.steps = 800, .batch = 512, .layers = 2, .dim = 96, .ffn = 192, .experts = 8, .topk = 2,
                .ctx = 8, .family = MOEPT_FAMILY_MIXTRAL, .lr = 3e-3f, .csv = "build/train_log.csv", .seed = 1,
                .ep = 1, .dp = 1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT_INT(name, field) if (strcmp(a, name) == 0 && v) { o->field = atoi(v); i++; continue; }
        OPT_INT("--steps", steps) OPT_INT("--batch", batch) OPT_INT("--layers", layers) OPT_INT("--dim", dim)
        OPT_INT("--ffn", ffn) OPT_INT("--experts", experts) OPT_INT("--topk", topk) OPT_INT("--ctx", ctx)
        OPT_INT("--ep", ep) OPT_INT("--dp", dp)
        if (strcmp(a, "--data") == 0 && v && o->ndata < 32) { o->data[o->ndata++] = v; i++; continue; }
        if (strcmp(a, "--lr") == 0 && v) { o->lr = (float)atof(v); i++; continue; }
        if (strcmp(a, "--csv") == 0 && v) { o->csv = v; i++; continue; }
        if (strcmp(a, "--seed") == 0 && v) { o->seed = strtoull(v, NULL, 10); i++; continue; }
        if (strcmp(a, "--quiet") == 0) { o->quiet = 1; continue; }
        if (strcmp(a, "--dtype") == 0 && v && strcmp(v, "fp8") == 0) { o->fp8 = 1; i++; continue; }
#ifdef MOEPT_CUDA
        if (strcmp(a, "--bf16") == 0) { o->bf16 = 1; continue; }
#endif
        if (strcmp(a, "--family") == 0 && v) {
            static const char *f[] = {"mixtral", "qwen2_moe", "olmoe", "deepseek_v3"};
            int k = 0;
            while (k < 4 && strcmp(v, f[k]) != 0) k++;
            if (k == 4) usage();
            o->family = (moept_family)k; i++; continue;
        }
        usage();
    }
    if (o->steps < 1 || o->batch < 1 || o->layers < 1 || o->dim < 1 || o->ffn < 1 || o->experts < 1 ||
        o->topk < 1 || o->topk > o->experts || o->ctx < 1 || o->ep < 1 || o->dp < 1 || o->ep * o->dp > o->batch ||
        o->experts % o->ep != 0) usage();
}

static unsigned char *load_text(opts *o, int64_t *len) {
    /* a fixed text (a snapshot of this project's docs and sources), so the
       loss figures in the docs do not move with every edit of the sources */
    static const char *defaults[] = {"examples/corpus.txt"};
    const char **files = o->ndata ? o->data : defaults;
    int nf = o->ndata ? o->ndata : (int)(sizeof defaults / sizeof defaults[0]);
    unsigned char *buf = NULL;
    int64_t n = 0;
    for (int i = 0; i < nf; i++) {
        FILE *f = fopen(files[i], "rb");
        if (!f) { fprintf(stderr, "train: cannot open %s (run from the repository root)\n", files[i]); exit(1); }
        fseek(f, 0, SEEK_END);
        long sz = ftell(f);
        fseek(f, 0, SEEK_SET);
        buf = realloc(buf, (size_t)(n + sz + 1));
        if (!buf) { fprintf(stderr, "train: out of memory\n"); exit(1); }
        n += (int64_t)fread(buf + n, 1, (size_t)sz, f);
        fclose(f);
    }
    *len = n;
    return buf;
}

/* The MoE layers' calls; the CUDA build moves the rows to and from the
   device around them (the rest of this small model stays on the CPU), as
   bf16 with --bf16 (round to nearest even). */
#ifdef MOEPT_CUDA
static void to_device(model *M, void *dev, const float *h) {
    int64_t n = (int64_t)M->B * M->D;
    const void *src = h;
    if (M->bf16) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, &h[i], 4);
            M->stage[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* finite inputs only */
        }
        src = M->stage;
    }
    if (cudaMemcpy(dev, src, (size_t)n * (M->bf16 ? 2 : 4), cudaMemcpyHostToDevice) != cudaSuccess) {
        fprintf(stderr, "train: cudaMemcpy failed\n");
        exit(1);
    }
}
static void to_host(model *M, float *h, const void *dev) {
    int64_t n = (int64_t)M->B * M->D;
    if (cudaMemcpy(M->bf16 ? (void *)M->stage : (void *)h, dev, (size_t)n * (M->bf16 ? 2 : 4),
                   cudaMemcpyDeviceToHost) != cudaSuccess) {
        fprintf(stderr, "train: cudaMemcpy failed\n");
        exit(1);
    }
    for (int64_t i = 0; M->bf16 && i < n; i++) {
        uint32_t u = (uint32_t)M->stage[i] << 16;
        memcpy(&h[i], &u, 4);
    }
}
#endif
static void moe_forward(model *M, int l, const float *x, float *y) {
#ifdef MOEPT_CUDA
    to_device(M, M->dev_in[l], x);
    check(moept_forward(M->moe[l], M->dev_in[l], M->B, M->dev_a), M->moe[l], "moe forward");
    to_host(M, y, M->dev_a);
#else
    check(moept_forward(M->moe[l], x, M->B, y), M->moe[l], "moe forward");
#endif
}
static void moe_backward(model *M, int l, const float *x, const float *dy, float *dx) {
#ifdef MOEPT_CUDA
    (void)x;
    to_device(M, M->dev_a, dy);
    check(moept_backward(M->moe[l], M->dev_in[l], M->dev_a, M->dev_b), M->moe[l], "moe backward");
    to_host(M, dx, M->dev_b);
#else
    check(moept_backward(M->moe[l], x, dy, dx), M->moe[l], "moe backward");
#endif
}

/* forward + (optionally) backward over the batch at positions pos[B];
   returns the mean cross-entropy */
static double step(model *M, const unsigned char *text, const int64_t *pos, const int *vmap, int train) {
    /* returns the sum of this rank's cross-entropies; gradients are of the
       global batch's mean */
    const int B = M->B, D = M->D, V = M->V, C = M->C, NL = M->NL;
    float *h0 = M->h;
    memset(h0, 0, (size_t)B * D * 4);
    for (int b = 0; b < B; b++)
        for (int j = 0; j < C; j++) {
            const float *e = M->emb + ((size_t)j * V + vmap[text[pos[b] - 1 - j]]) * D;
            for (int d = 0; d < D; d++) h0[b * D + d] += e[d];
        }
    for (int l = 0; l < NL; l++) {
        float *h = M->h + (size_t)l * B * D, *hn = h + (size_t)B * D, *n = M->n + (size_t)l * B * D;
        rmsnorm_fwd(h, M->norm + l * D, B, D, n, M->rms + l * B);
        moe_forward(M, l, n, M->m);
        for (int i = 0; i < B * D; i++) hn[i] = h[i] + M->m[i];
    }
    float *hf = M->h + (size_t)NL * B * D, *nf = M->n + (size_t)NL * B * D;
    rmsnorm_fwd(hf, M->norm + NL * D, B, D, nf, M->rms + NL * B);
    double loss = 0;
    for (int b = 0; b < B; b++) {
        float *lg = M->logits + (size_t)b * V, mx = -1e30f;
        for (int v = 0; v < V; v++) {
            float s = 0;
            for (int d = 0; d < D; d++) s += nf[b * D + d] * M->head[v * D + d];
            lg[v] = s;
            mx = s > mx ? s : mx;
        }
        double z = 0;
        for (int v = 0; v < V; v++) z += exp(lg[v] - mx);
        int tgt = vmap[text[pos[b]]];
        loss += -(lg[tgt] - mx - log(z));
        if (train) /* dlogits = (softmax - onehot) / B_global */
            for (int v = 0; v < V; v++) lg[v] = (float)((exp(lg[v] - mx) / z - (v == tgt)) / M->Bg);
    }
    if (!train) return loss;
    /* head */
    memset(M->dn, 0, (size_t)B * D * 4);
    for (int b = 0; b < B; b++)
        for (int v = 0; v < V; v++) {
            float g = M->logits[(size_t)b * V + v];
            for (int d = 0; d < D; d++) {
                M->g_head[v * D + d] += g * nf[b * D + d];
                M->dn[b * D + d] += g * M->head[v * D + d];
            }
        }
    memset(M->dh, 0, (size_t)B * D * 4);
    rmsnorm_bwd(hf, M->norm + NL * D, M->rms + NL * B, M->dn, B, D, M->dh, M->g_norm + NL * D);
    for (int l = NL - 1; l >= 0; l--) {
        float *h = M->h + (size_t)l * B * D, *n = M->n + (size_t)l * B * D;
        /* the residual passes dh through; the MoE branch adds rmsnorm'(moe'(dh)) */
        moe_backward(M, l, n, M->dh, M->dn);
        rmsnorm_bwd(h, M->norm + l * D, M->rms + l * B, M->dn, B, D, M->dh, M->g_norm + l * D);
    }
    for (int b = 0; b < B; b++)
        for (int j = 0; j < C; j++) {
            float *ge = M->g_emb + ((size_t)j * V + vmap[text[pos[b] - 1 - j]]) * D;
            for (int d = 0; d < D; d++) ge[d] += M->dh[b * D + d];
        }
    return loss;
}

/* comm: every rank (the batch's slices, the dense gradients); ep, dp: the
   MoE layers' groups (ep = comm, dp = NULL without data parallelism) */
static int train_rank(const opts *op, moept_comm *comm, moept_comm *ep, moept_comm *dp) {
    opts o = *op;
    int P = comm ? comm->size : 1, rank = comm ? comm->rank : 0, lead = rank == 0;
    unsigned long long rng = o.seed;
    int64_t len;
    unsigned char *text = load_text(&o, &len);
    if (len < 1000) { fprintf(stderr, "train: need at least 1000 bytes of text (have %lld)\n", (long long)len); return 1; }
    int vmap[256] = {0}, V = 0;
    for (int64_t i = 0; i < len; i++) vmap[text[i]] = 1;
    for (int c = 0; c < 256; c++) vmap[c] = vmap[c] ? V++ : 0;
    int64_t split = len - len / 10; /* last 10% held out */

    model M = {0};
    /* this rank's slice of each global batch: the first Bg mod P ranks take one more */
    int Bg = o.batch, lo = Bg / P * rank + (rank < Bg % P ? rank : Bg % P), Bl = Bg / P + (rank < Bg % P);
    M.V = V; M.D = o.dim; M.C = o.ctx; M.NL = o.layers; M.B = Bl; M.Bg = Bg;
    const int D = M.D, B = M.B, NL = M.NL;
    M.emb = xcalloc((size_t)M.C * V * D, 4); M.g_emb = xcalloc((size_t)M.C * V * D, 4);
    M.norm = xcalloc((size_t)(NL + 1) * D, 4); M.g_norm = xcalloc((size_t)(NL + 1) * D, 4);
    M.head = xcalloc((size_t)V * D, 4); M.g_head = xcalloc((size_t)V * D, 4);
    for (int64_t i = 0; i < (int64_t)M.C * V * D; i++) M.emb[i] = (float)((urand(&rng) * 2 - 1) * 0.5);
    for (int i = 0; i < (NL + 1) * D; i++) M.norm[i] = 1.0f;
    for (int i = 0; i < V * D; i++) M.head[i] = (float)((urand(&rng) * 2 - 1) / sqrt(D));
    M.h = xcalloc((size_t)(NL + 1) * B * D, 4); M.n = xcalloc((size_t)(NL + 1) * B * D, 4);
    M.rms = xcalloc((size_t)(NL + 1) * B, 4); M.m = xcalloc((size_t)B * D, 4);
    M.logits = xcalloc((size_t)B * V, 4);
    M.dh = xcalloc((size_t)B * D, 4); M.dn = xcalloc((size_t)B * D, 4); M.dm = xcalloc((size_t)B * D, 4);
    M.moe = xcalloc((size_t)NL, sizeof *M.moe);
    M.a_moe = xcalloc((size_t)NL, sizeof *M.a_moe);
    moept_config cfg = {0};
    cfg.family = o.family; cfg.hidden_size = D; cfg.intermediate_size = o.ffn;
    cfg.num_experts = o.experts; cfg.top_k = o.topk; cfg.norm_topk_prob = 1;
    cfg.aux_loss = MOEPT_AUX_HF; cfg.aux_loss_coef = 0.01f; cfg.z_loss_coef = 1e-3f;
    cfg.max_tokens = B; cfg.global_balance = 1;
    cfg.fp8 = o.fp8 ? MOEPT_FP8_BLOCKWISE : MOEPT_FP8_OFF;
    if (o.family == MOEPT_FAMILY_QWEN2_MOE || o.family == MOEPT_FAMILY_DEEPSEEK_V3) cfg.shared_intermediate_size = o.ffn;
    if (o.family == MOEPT_FAMILY_DEEPSEEK_V3 && o.experts % 4 == 0 && o.topk <= o.experts / 2) { cfg.n_group = 4; cfg.topk_group = 2; }
#ifdef MOEPT_CUDA
    M.bf16 = o.bf16;
    M.stage = xcalloc((size_t)B * D, 2);
    moept_cuda_options copt = {.dtype = o.bf16 ? MOEPT_DTYPE_BF16 : MOEPT_DTYPE_F32};
    M.dev_in = xcalloc((size_t)NL, sizeof *M.dev_in);
    for (int l = 0; l <= NL; l++)
        if (cudaMalloc(l < NL ? (void **)&M.dev_in[l] : (void **)&M.dev_a, (size_t)B * D * 4) != cudaSuccess ||
            (l == NL && cudaMalloc((void **)&M.dev_b, (size_t)B * D * 4) != cudaSuccess)) {
            fprintf(stderr, "train: cudaMalloc failed\n");
            return 1;
        }
#endif
    for (int l = 0; l < NL; l++) {
#ifdef MOEPT_CUDA
        check(moept_create_cuda(&cfg, ep, dp, &copt, &M.moe[l]), NULL, "moept_create_cuda");
#else
        check(moept_create_parallel(&cfg, ep, dp, &M.moe[l]), NULL, "moept_create");
#endif
        check(moept_init_params(M.moe[l], o.seed * 100 + (unsigned long long)l), M.moe[l], "init");
        const int64_t n = moept_param_numel(M.moe[l]);
        M.a_moe[l] = adam_new(n);
        M.a_moe[l].p = xcalloc((size_t)n, 4);
        M.a_moe[l].g = xcalloc((size_t)n, 4);
    }
    M.a_emb = adam_new((int64_t)M.C * V * D); M.a_norm = adam_new((int64_t)(NL + 1) * D); M.a_head = adam_new((int64_t)V * D);

    FILE *csv = lead && o.csv ? fopen(o.csv, "w") : NULL;
    if (csv) {
        fprintf(csv, "step,loss,val_loss,aux_loss,z_loss,tokens_per_s");
        for (int l = 0; l < NL; l++) for (int e = 0; e < o.experts; e++) fprintf(csv, ",load_l%d_e%d", l, e);
        fprintf(csv, "\n");
    }
    if (!o.quiet && lead)
        printf("train: %lld bytes of text, vocab %d, %d MoE layers (%s, D=%d F=%d E=%d K=%d), batch %d, EP=%d\n",
               (long long)len, V, NL, o.family == MOEPT_FAMILY_MIXTRAL ? "mixtral" : o.family == MOEPT_FAMILY_QWEN2_MOE ? "qwen2_moe" :
               o.family == MOEPT_FAMILY_OLMOE ? "olmoe" : "deepseek_v3", D, o.ffn, o.experts, o.topk, Bg, P);
    if (!o.quiet && lead)
        printf("loss: this step's training loss; avg: its moving average (0.95 decay); val: held-out "
               "loss every 100 steps (- before the first); aux: the layers' mean aux loss, %d when "
               "balanced (HF convention: top_k); load: layer 0's rows per expert, ' .:-=+*#%%@' from none "
               "to the busiest\n", o.topk);
    int64_t *pos = xcalloc((size_t)Bg, sizeof(int64_t));
    int64_t *load = xcalloc((size_t)o.experts, sizeof(int64_t));
    double t0 = now(), tlast = t0, first_loss = 0, ema = 0, val = NAN;
    for (int s = 1; s <= o.steps; s++) {
        /* every rank draws the whole batch's positions and takes its slice */
        for (int b = 0; b < Bg; b++) pos[b] = M.C + (int64_t)(urand(&rng) * (double)(split - M.C - 1));
        for (int l = 0; l < NL; l++) moept_zero_grad(M.moe[l]);
        memset(M.g_emb, 0, (size_t)M.C * V * D * 4); memset(M.g_norm, 0, (size_t)(NL + 1) * D * 4);
        memset(M.g_head, 0, (size_t)V * D * 4);
        double loss = step(&M, text, pos + lo, vmap, 1);
        allsum(comm, &loss, 1, MOEPT_DTYPE_F64);
        loss /= Bg;
        /* gradients of the global batch: sum the replicas' contributions */
        allsum(comm, M.g_emb, (int64_t)M.C * V * D, MOEPT_DTYPE_F32);
        allsum(comm, M.g_norm, (int64_t)(NL + 1) * D, MOEPT_DTYPE_F32);
        allsum(comm, M.g_head, (int64_t)V * D, MOEPT_DTYPE_F32);
        float lr = o.lr * (s < 50 ? (float)s / 50 : 0.5f * (1 + cosf(3.14159265f * (float)(s - 50) / (float)(o.steps - 49))));
        for (int l = 0; l < NL; l++) {
            adam *a = &M.a_moe[l];
            check(moept_sync_grads(M.moe[l], 1.0f), M.moe[l], "sync_grads");
            check(moept_buf_read(M.moe[l], MOEPT_BUF_PARAMS, 0, a->n, a->p), M.moe[l], "buf_read");
            check(moept_buf_read(M.moe[l], MOEPT_BUF_GRADS, 0, a->n, a->g), M.moe[l], "buf_read");
            adam_step(a, a->p, a->g, s, lr, 0.01f);
            check(moept_buf_write(M.moe[l], MOEPT_BUF_PARAMS, 0, a->n, a->p), M.moe[l], "buf_write");
        }
        adam_step(&M.a_emb, M.emb, M.g_emb, s, lr, 0.0f);
        adam_step(&M.a_norm, M.norm, M.g_norm, s, lr, 0.0f);
        adam_step(&M.a_head, M.head, M.g_head, s, lr, 0.01f);
        if (s == 1) first_loss = ema = loss;
        ema = 0.95 * ema + 0.05 * loss;
        moept_stats st;
        double aux = 0, z = 0;
        for (int l = 0; l < NL; l++) { moept_get_stats(M.moe[l], &st, NULL); aux += st.aux_loss; z += st.z_loss; }
        if (s % 100 == 0 || s == o.steps) { /* held-out loss over a fixed set of positions */
            unsigned long long vr = 42;
            double vs = 0;
            for (int r = 0; r < 4; r++) {
                for (int b = 0; b < Bg; b++) pos[b] = split + M.C + (int64_t)(urand(&vr) * (double)(len - split - M.C - 1));
                vs += step(&M, text, pos + lo, vmap, 0);
            }
            allsum(comm, &vs, 1, MOEPT_DTYPE_F64);
            val = vs / (4.0 * Bg);
        }
        double t = now();
        double tps = (double)Bg / (t - tlast);
        tlast = t;
        if (csv) {
            fprintf(csv, "%d,%.6f,%.6f,%.6f,%.6f,%.1f", s, loss, (s % 100 == 0 || s == o.steps) ? val : NAN, aux / NL, z / NL, tps);
            for (int l = 0; l < NL; l++) {
                moept_get_stats(M.moe[l], &st, load);
                for (int e = 0; e < o.experts; e++) fprintf(csv, ",%lld", (long long)load[e]);
            }
            fprintf(csv, "\n");
        }
        if (lead && !o.quiet && (s % 50 == 0 || s == 1 || s == o.steps)) {
            moept_get_stats(M.moe[0], &st, load);
            int64_t mx = 1;
            for (int e = 0; e < o.experts; e++) mx = load[e] > mx ? load[e] : mx;
            char bar[80];
            int nb = o.experts < 64 ? o.experts : 64;
            for (int e = 0; e < nb; e++) bar[e] = " .:-=+*#%@"[(int)(9 * load[e] / mx)];
            bar[nb] = 0;
            char vs[16] = "     -"; /* not evaluated yet */
            if (val == val) snprintf(vs, sizeof vs, "%.4f", val);
            printf("step %4d | loss %.4f | avg %.4f | val %s | aux %.4f | %7.0f tok/s | layer-0 load [%s]\n",
                   s, loss, ema, vs, aux / NL, (double)Bg * s / (t - t0), bar);
            fflush(stdout);
        }
    }
    if (lead) {
        double secs = now() - t0;
#ifdef MOEPT_CUDA
        /* (the CPU's kernel runs none of them) */
        const char *gemm = o.fp8 ? (M.bf16 ? "cuBLASLt FP8, bf16 rows" : "cuBLASLt FP8, fp32 rows")
                           : M.bf16 ? "cuBLAS, bf16" : "cuBLAS, fp32";
#else
        const char *gemm = moept_gemm_kernel();
#endif
        printf("train: loss %.4f at step 1 -> moving average %.4f (held-out %.4f) in %d steps, %.1f s, "
               "%.0f tokens/s (MoE GEMMs: %s)\n", first_loss, ema, val, o.steps, secs,
               (double)Bg * o.steps / secs, gemm);
        if (o.steps < MIN_JUDGED_STEPS)
            printf("train: %d steps: the loss's drop is judged only from %d steps\n", o.steps,
                   MIN_JUDGED_STEPS);
        else if (!(ema < first_loss))
            printf("train: FAIL - the loss's moving average %.4f is not below step 1's %.4f\n", ema,
                   first_loss);
        if (csv) printf("train: log written to %s\n", o.csv);
    }
    if (csv) fclose(csv);
    for (int l = 0; l < NL; l++) moept_destroy(M.moe[l]);
    return o.steps < MIN_JUDGED_STEPS || ema < first_loss ? 0 : 1;
}

#if defined(MOEPT_CUDA) && defined(MOEPT_MPI)
/* The GPU ranks' comms: NCCL over the EP group and, with --dp, the DP
   group, each on its own stream, on this process's device */
typedef struct gpu_comms {
    ncclComm_t nc[2];
    cudaStream_t s[2];
    moept_comm *c[2]; /* EP, DP (NULL: none) */
} gpu_comms;

static void gpu_comms_open(gpu_comms *g, MPI_Comm epc, MPI_Comm dpc) {
    memset(g, 0, sizeof *g);
    MPI_Comm node;
    int local = 0;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
    if (cudaSetDevice(local % moept_cuda_device_count()) != cudaSuccess) {
        fprintf(stderr, "train: cudaSetDevice failed\n");
        exit(1);
    }
    MPI_Comm groups[2] = {epc, dpc};
    for (int i = 0; i < 2; i++) {
        if (groups[i] == MPI_COMM_NULL) continue;
        int r, n;
        MPI_Comm_rank(groups[i], &r);
        MPI_Comm_size(groups[i], &n);
        ncclUniqueId id;
        if (r == 0 && ncclGetUniqueId(&id) != ncclSuccess) {
            fprintf(stderr, "train: ncclGetUniqueId failed\n");
            exit(1);
        }
        MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, groups[i]);
        if (cudaStreamCreateWithFlags(&g->s[i], cudaStreamNonBlocking) != cudaSuccess ||
            ncclCommInitRank(&g->nc[i], n, id, r) != ncclSuccess) {
            fprintf(stderr, "train: cannot make the NCCL communicator\n");
            exit(1);
        }
        check(moept_comm_nccl(g->nc[i], g->s[i], 0, &g->c[i]), NULL, "moept_comm_nccl");
    }
}
static void gpu_comms_close(gpu_comms *g) {
    for (int i = 0; i < 2; i++) {
        if (!g->c[i]) continue;
        int aborted = moept_comm_nccl_aborted(g->c[i]); /* then NCCL freed it already */
        moept_comm_destroy(g->c[i]);
        if (!aborted) ncclCommDestroy(g->nc[i]);
        cudaStreamDestroy(g->s[i]);
    }
}
#endif

#ifndef MOEPT_MPI
typedef struct rank_job { const opts *o; moept_comm *comm; int rc; } rank_job;

static void *rank_main(void *arg) {
    rank_job *j = arg;
#ifdef _OPENMP
    int per = omp_get_num_procs() / j->comm->size;
    omp_set_num_threads(per > 0 ? per : 1);
#endif
    j->rc = train_rank(j->o, j->comm, j->comm, NULL);
    return NULL;
}
#endif

int main(int argc, char **argv) {
#ifdef MOEPT_MPI
    MPI_Init(&argc, &argv);
#endif
    opts o;
    parse(argc, argv, &o);
#ifdef MOEPT_CUDA
#ifndef MOEPT_MPI
    if (o.ep != 1 || o.dp != 1) {
        fprintf(stderr, "train_cuda: one GPU rank (--ep 1; train_cuda_mpi for more)\n");
        return 2;
    }
#endif
    if (moept_cuda_device_count() < 1) {
        printf("skip - no CUDA device: the GPU run was not made\n");
#ifdef MOEPT_MPI
        MPI_Finalize();
#endif
        return 0;
    }
#endif
#ifdef MOEPT_MPI
    moept_comm *world;
    check(moept_comm_mpi(MPI_COMM_WORLD, &world), NULL, "moept_comm_mpi");
    if (world->size != o.ep * o.dp) {
        if (world->rank == 0)
            fprintf(stderr, "train_mpi: --ep %d --dp %d but %d MPI processes\n", o.ep, o.dp, world->size);
        MPI_Finalize();
        return 2;
    }
    /* EP x DP: ranks r*ep .. r*ep+ep-1 are one EP group (one replica of the
       experts); ranks with the same r % ep hold the same experts: a DP group */
    moept_comm *ep = world, *dp = NULL;
    MPI_Comm epc = MPI_COMM_NULL, dpc = MPI_COMM_NULL;
    if (o.dp > 1) {
        MPI_Comm_split(MPI_COMM_WORLD, world->rank / o.ep, world->rank, &epc);
        MPI_Comm_split(MPI_COMM_WORLD, world->rank % o.ep, world->rank, &dpc);
    }
#ifdef MOEPT_CUDA
    gpu_comms gc;
    gpu_comms_open(&gc, epc != MPI_COMM_NULL ? epc : MPI_COMM_WORLD, o.dp > 1 ? dpc : MPI_COMM_NULL);
    ep = gc.c[0];
    dp = gc.c[1];
    int rc = train_rank(&o, world, ep, dp); /* the dense parts' sums stay on MPI */
    gpu_comms_close(&gc);
    if (o.dp > 1) {
        MPI_Comm_free(&epc);
        MPI_Comm_free(&dpc);
    }
#else
    if (o.dp > 1) {
        check(moept_comm_mpi(epc, &ep), NULL, "moept_comm_mpi (EP)");
        check(moept_comm_mpi(dpc, &dp), NULL, "moept_comm_mpi (DP)");
    }
    int rc = train_rank(&o, world, ep, dp);
    if (dp) {
        moept_comm_destroy(ep);
        moept_comm_destroy(dp);
        MPI_Comm_free(&epc);
        MPI_Comm_free(&dpc);
    }
#endif
    moept_comm_destroy(world);
    MPI_Finalize();
    return rc;
#else
    if (o.dp != 1) { fprintf(stderr, "train: --dp needs train_mpi\n"); return 2; }
    if (o.ep == 1) return train_rank(&o, NULL, NULL, NULL);
    moept_thread_group *g;
    check(moept_thread_group_create(o.ep, 0, &g), NULL, "thread group");
    rank_job *jobs = xcalloc((size_t)o.ep, sizeof *jobs);
    pthread_t *th = xcalloc((size_t)o.ep, sizeof *th);
    for (int r = 0; r < o.ep; r++) {
        jobs[r].o = &o;
        moept_comm_threads(g, r, &jobs[r].comm);
        pthread_create(&th[r], NULL, rank_main, &jobs[r]);
    }
    int rc = 0;
    for (int r = 0; r < o.ep; r++) { pthread_join(th[r], NULL); rc |= jobs[r].rc; }
    moept_thread_group_destroy(g);
    return rc;
#endif
}
