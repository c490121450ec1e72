/* plan: what an MoE training step costs per GPU, in three modes (fsdp
   baseline, expert parallel, expert parallel with overlapped chunks), from
   the model's shape and the cluster's numbers; and what one moept layer
   holds, by kind (moept_stats.host_bytes, device_bytes), from its config.
   The model is in docs/PLAN.md.

   usage: plan [--preset mixtral-8x7b|qwen2-57b-a14b|deepseek-v3]
               [--hidden D --ffn F --experts E --topk K --moe-layers L --layers L
                --shared-ffn S --dense-params N --attn-params N]
               [--world W] [--ep P] [--gpus-per-node G] [--nvlink GBps] [--ib GBps]
               [--tflops X] [--mfu X] [--tokens T] [--chunks C] [--capacity-factor CF]
               [--weight-bytes B] [--grad-bytes B] [--opt-bytes B] [--gpu-gib M]
               [--executor cpu|cuda] [--dtype fp32|bf16] [--fp8] [--cc N] [--framework]
          plan --layer [the shape options, --ep P --tokens T --chunks C]
               [--executor cpu|cuda] [--dtype fp32|bf16] [--fp8] [--inference]
               [--inflight N] [--grad-backup] [--shared-gate] [--gemm KERNEL] [--cc N]
               [--gemm-form auto|kernel]
          plan --check [--scenarios build/scenarios.csv]
   The ep modes' MoE layers are moept's (default: CUDA, bf16; --framework:
   as the rest of the model, --weight-bytes and the others a parameter,
   sharded over the world). --layer prints one layer's bytes by kind on a
   rank (the shapes of --preset and the options; --gemm avx512, avx2, neon,
   portable or cblas: a CPU layer's GEMM packing; --cc: the GPU's compute
   capability x 10, which sizes cuBLAS's workspaces; --gemm-form kernel: a
   CUDA layer in moept's grouped kernel form, which needs 9.0).
   --check compares the Mixtral-8x7B fine-tune on 8 x A100-80GB with the
   published measurements (FSDP only: 83 tokens/s, 54.8 GB peak; expert
   parallel: 337 tokens/s, 45.5 GB peak), and with --scenarios the byte
   formulas with the bytes bench/run_scenarios.py counted; then the layer
   model with layers it makes (CPU layers; built with the CUDA executor,
   build/emu/plan on the emulated GPU, CUDA layers too): moept_stats by kind
   within 5% of the model's, each kind and in all ("ok - " / "FAIL - "
   lines; exit status 1 on any failure). The sync-free lines are the CUDA
   layer's sync-free mode (moept_cuda_options.sync_free): its static blocks'
   memory and traffic against the default mode's, dropless or at
   --capacity-factor. */
#define _DEFAULT_SOURCE /* setenv: the emulated GPU's compute capability for the kernel form's layer */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef MOEPT_CUDA
#include <cuda_runtime.h>
#endif
#include "../moept.h"

typedef struct model {
    const char *name;
    double D, F, E, K, S;       /* hidden, expert ffn, experts, top-k, shared ffn (0: none) */
    double L, Lmoe;             /* layers, of which MoE */
    double attn;                /* attention parameters per layer */
    double dense;               /* other parameters: embeddings, dense FFN layers, norms */
} model;

typedef struct cluster {
    double W, P, G;             /* GPUs, EP size, GPUs per node */
    double nvlink, ib;          /* GB/s per GPU per direction */
    double tflops, mfu;         /* GEMM rate (dense, the dtype's) and the achieved fraction */
    double T, C;                /* tokens per GPU per step, overlap chunks */
    double cf;                  /* capacity factor (0: dropless): the sync-free mode's blocks */
    double wb, gb, ob;          /* bytes per parameter: weights, gradients, optimizer state */
    double gpu_gib;
    /* the MoE layers in the ep modes: moept's (1: its executor's bytes, mem_layer) or, 0, as the rest
       of the model (wb + gb + ob a parameter, sharded over all W GPUs) */
    int moept, cuda, bf16, fp8; /* the executor (CPU, CUDA), the CUDA layer's dtype, config.fp8 */
    double cc;                  /* the GPU's compute capability x 10 */
} cluster;

static const model presets[] = {
    /* Mixtral-8x7B: 32 layers; GQA attention (32 heads, 8 KV heads, 128 wide); vocab 32000 */
    {"mixtral-8x7b", 4096, 14336, 8, 2, 0, 32, 32, 2 * 4096.0 * 4096 + 2 * 4096.0 * 1024, 2 * 32000.0 * 4096},
    /* Qwen2-57B-A14B: 28 layers; 64 experts of 2560, top-8, shared expert 20480; GQA 28/4 heads of 128; vocab 151936 */
    {"qwen2-57b-a14b", 3584, 2560, 64, 8, 20480, 28, 28, 2 * 3584.0 * 3584 + 2 * 3584.0 * 512, 2 * 151936.0 * 3584},
    /* DeepSeek-V3: 61 layers, the first 3 dense (FFN 18432); 256 experts of 2048, top-8, 1 shared; MLA attention ~187M; vocab 129280 */
    {"deepseek-v3", 7168, 2048, 256, 8, 2048, 61, 58,
     7168.0 * 1536 + 1536.0 * 128 * 192 + 7168.0 * 576 + 512.0 * 128 * 256 + 128.0 * 128 * 7168,
     2 * 129280.0 * 7168 + 3 * 3 * 7168.0 * 18432},
};

/* ---- one moept layer's memory, by kind ----------------------------------
   What moept_stats.host_bytes and device_bytes report a layer holds (moept.h,
   moept_mem_kind), from its config: the buffers moept.c lays out
   (moept__layer_alloc, moept__layout_work, moept__grow_recv) and the CUDA
   executor's (moept__create, moept__layout, moept__slot_layout, moept__grow,
   the FP8 blocks), each 64-byte aligned as their blocks place them. Per rank;
   gated activations (H = 2F, every family's default); balanced routing (T K
   receive rows, the create's; a step that receives more grows them
   geometrically); no router jitter, FSDP, sync-free mode or padding mask
   (each adds buffers of its own); the bookkeeping (structs, the parameter
   table) at their x86-64 sizes. */
enum { MEM_PARAMS, MEM_GRADS, MEM_MOMENTS, MEM_CASTS, MEM_WORKSPACE, MEM_NKINDS };
static const char *const mem_kinds[MEM_NKINDS] = {"params", "grads", "moments", "casts", "workspace"};

typedef struct memcfg {
    double D, F, E, K, S;  /* hidden, expert ffn, experts, top-k, shared ffn (0: none) */
    double P, T;           /* EP size, max_tokens (a rank's) */
    double C;              /* overlap chunks (1: off; > 1 only at P > 1) */
    double rows;           /* receive rows a slot holds (0: T K) */
    int gate;              /* the shared expert's sigmoid gate (qwen2_moe's): D more parameters */
    int cuda, bf16, fp8;   /* the executor (0: CPU); a CUDA layer's dtype; config.fp8 */
    int train;             /* 0: config.inference_only */
    int slots;             /* forward slots used (config.max_inflight's, >= 1) */
    int shm;               /* CPU, EP > 1: the exchange through shared memory (ranks on one node) */
    int moments;           /* 1: after the first AdamW step */
    int grad_backup;       /* config.grad_backup (a CPU layer's second copy of the gradients) */
    double mr, nr, kc, nc; /* CPU: the builtin GEMM's blocking (kc 0: MOEPT_CBLAS, no packing) */
    double cc;             /* CUDA: compute capability x 10 (cuBLAS's workspaces: 32 MiB from 90, else 4) */
    int kernel;            /* CUDA: options.gemm_form MOEPT_GEMM_KERNEL (compute capability 9.0) */
} memcfg;

typedef struct membytes { double host[MEM_NKINDS], dev[MEM_NKINDS]; } membytes;

static double a64(double b) { return ceil(b / 64) * 64; }
static double dmax(double a, double b) { return a > b ? a : b; }
static double pad16(double n) { return ceil(n / 16) * 16; }

/* moept_param_numel: router | experts (this rank's) | shared expert | its gate */
static double mem_nparams(const memcfg *c) {
    return c->E * c->D + c->E / c->P * 3 * c->F * c->D + 3 * c->S * c->D + (c->gate && c->S > 0 ? c->D : 0);
}

/* the host's routing copies, loss counts, peer rows (every executor's; a CUDA layer's: one copy of
   the routing, no dL/dw's second) */
static double mem_host_routing(const memcfg *c, int run) {
    const double T = c->T, E = c->E, K = c->K;
    return (run ? 2 : 1) * (a64(4 * T * E) + 2 * a64(4 * T * K)) + a64(8 * (3 * E + 4)) + a64(16 * c->P) +
           2 * a64(8 * E) + c->train * a64(4 * T * K);
}

/* moept.c's struct, parameter table and slot states */
static double mem_book(const memcfg *c) { return 1824 + 136 * (3 * c->E / c->P + 8) + 680 * (c->slots + 1); }

/* A CPU layer's workspace: each slot's plan, activations and rows; the layer's scratch */
static double mem_cpu_workspace(const memcfg *c) {
    const double T = c->T, E = c->E, K = c->K, D = c->D, F = c->F, S = c->S, P = c->P, El = E / P;
    const double H = 2 * F, HS = 2 * S, N = T * K, R = c->rows > 0 ? c->rows : N, tr = c->train;
    const double C = P > 1 && c->C > 1 ? c->C : 1, ch = C > 1;
    /* shared memory (one node, unchunked): no token rows; messages: the rows leave from x unchunked
       (MPI's), from their own send rows chunked or as FP8 records (rec: their bytes, xs's rows the
       larger of theirs and D floats) */
    const int dir = P > 1 && c->shm && !ch, msg = P > 1 && !dir, xs = !dir && !(msg && !ch && !c->fp8);
    const double rec = c->fp8 && msg ? pad16(pad16(D) + 4 * ceil(D / 128)) : 0;
    double slot = mem_host_routing(c, 1);
    /* the plan: scores, counts, exchange pieces, each row's place */
    slot += 2 * a64(4 * T * E) + 4 * a64(8 * E) + a64(8 * (El + 1)) + 2 * a64(16 * E) + a64(8 * (E + 1)) +
            a64(8 * N) + a64(8 * N) + a64(4 * E) +
            (dir ? a64(16 * P) + 2 * a64(8 * P * E) + a64(8 * E) : 0);
    if (ch) slot += 5 * a64(8 * C * E) + 2 * a64(16 * C * E) + a64(24 * E); /* each chunk's counts, pieces */
    /* the token rows (send, receive; none through shared memory), the shared expert's, lse */
    slot += xs * a64(N * dmax(4 * D, rec)) + (dir ? 0 : a64(4 * N * D)) + a64(4 * T);
    if (S > 0) slot += a64(4 * T * HS) + tr * a64(4 * T * S) + a64(4 * T * D) + a64(4 * T);
    /* the receive rows: x, y (messages), h, a, a chunked backward's da and dx, FP8's operands and its
       records as they arrive; the shared memory's x, y */
    const double row = (msg ? 2 * D : 0) + H + tr * F + tr * ch * (F + D) +
                       (c->fp8 ? (tr && H > D ? H : D) + tr * D : 0) + rec / 4;
    slot += 4 * R * row + 9 * 64 + (dir ? 8 * R * D : 0);
    /* the layer's: placement, plan scratch, GEMM descriptors, gradients of the gate and logits,
       FP8's shared operands, the GEMM's packing */
    double own = 2 * a64(4 * E) + a64(8 * E) + a64(32 * P) + a64(8 * (2 * E + 1)) + a64(8 * E) + a64(4 * K) +
                 a64(88 * El * P) + tr * (S > 0) * a64(4 * T) + tr * a64(4 * T * E);
    if (c->fp8 && S > 0) own += a64(4 * T * (tr ? dmax(D, HS) : D)) + tr * a64(4 * T * D);
    if (c->kc > 0) {
        const double m = ceil(dmax(dmax(N, T), dmax(dmax(D, H), dmax(HS, E))) / c->mr) * c->mr;
        own += a64(4 * m * c->kc) + a64(4 * (c->nc + c->nr) * c->kc);
    }
    return own + c->slots * slot + mem_book(c);
}

/* one weight set's E4M3 copies on the device: W13, W2, their transposes, their 128 x 128 scales */
static double mem_q8w(double n, double H, double F, double D) {
    if (n == 0) return 0;
    const double Dp = pad16(D), Hp = pad16(H), Fp = pad16(F);
    const double s[4] = {ceil(Hp / 128) * ceil(Dp / 512) * 4, ceil(Dp / 128) * ceil(Hp / 512) * 4,
                         ceil(Dp / 128) * ceil(Fp / 512) * 4, ceil(Fp / 128) * ceil(Dp / 512) * 4};
    return 2 * a64(n * Hp * Dp) + 2 * a64(n * Dp * Fp) + a64(4 * n * s[0]) + a64(4 * n * s[1]) +
           a64(4 * n * s[2]) + a64(4 * n * s[3]);
}

/* A CUDA layer's device workspace: the fixed block, cuBLAS's workspaces, FP8's token scratch, each
   slot's block (routing, plan, send rows, shared activations) and receive rows */
static double mem_cuda_workspace(const memcfg *c) {
    const double T = c->T, E = c->E, K = c->K, D = c->D, F = c->F, S = c->S, P = c->P, El = E / P;
    const double H = 2 * F, HS = 2 * S, N = T * K, R = c->rows > 0 ? c->rows : N, tr = c->train;
    const double C = P > 1 && c->C > 1 ? c->C : 1, ch = C > 1, G = dmax(1, El * (ch ? P : 1));
    const double es = c->bf16 ? 2 : 4, M = E + 4 + ch * C * E, nblk = dmax(1, ceil(N / 256));
    double w = a64(8 * T * E) + 2 * a64(4 * N) + a64(8 * (3 * E + 5)) + a64(8 * nblk * E) + a64(8 * E) +
               a64(8 * (E + 1)) + a64(8 * M) + a64(8 * P * M) + ch * a64(8 * C * E) + 64 + 16384 +
               tr * (a64(4 * T) + a64(4 * T * E)) + a64(24 * G);
    const int kb = c->kernel && c->bf16; /* the kernel form's bf16 layer: no side streams; at one rank
                                            unchunked without FP8, the experts' x gathered (no xr) */
    const double nside = G > 1 && c->bf16 && !kb ? (G < 4 ? G : 4) : 0;
    /* an x row's bytes as the experts receive it: config.fp8's record (D E4M3 bytes, then the 1 x 128
       scales, each part padded to 16), or D of the dtype */
    const double xrow = c->fp8 ? pad16(pad16(D) + 4 * ceil(D / 128)) : es * D;
    const double xr = kb && !c->fp8 && P == 1 ? 0 : xrow; /* (at P 1 the chunks are off) */
    w += (1 + nside) * (c->cc >= 90 ? 32 : 4) * 1048576.0;
    if (c->fp8) {
        /* (16 rows an expert more: the wgrads' column passes hold every expert's rows padded; the kernel
           form's grouped wgrad, 128) */
        const double cap = pad16(dmax(R, T) + (kb ? 128 : 16) * El);
        const double W = dmax(pad16(D), dmax(pad16(H), pad16(HS)));
        const double sc = dmax(ceil(W / 128) * cap, W * (ceil(cap / 128) + El));
        const double nq = kb ? 3 : 2; /* (the kernel form's: the rows' copy of a, dh) */
        /* (a training kernel form's, unchunked, F a multiple of 128: x's records' copy down their rows,
           kept from the forward, and dy's, the down dgrad's, with their scales) */
        const double xw = kb && tr && C == 1 && fmod(F, 128) == 0 ? pad16(D) : 0;
        /* (cuBLASLt's fp32 result: none in the kernel form, every product the grouped kernel's) */
        w += nq * cap * W + 4 * nq * sc + (kb ? 0 : 4 * dmax(cap, W) * W) + (2 * nq + 1) * 64 +
             2 * (xw * cap + 4 * xw * (ceil(cap / 128) + El) + 2 * 64);
    }
    double slot = (c->bf16 ? a64(4 * T * D) : 0) + 2 * (2 * a64(4 * T * E) + 2 * a64(4 * N) + a64(4 * T)) +
                  a64(4 * E) + 64 + 2 * a64(8 * N) +
                  (P > 1 ? a64(N * xrow) + a64(es * N * D) : 0) +
                  a64(es * T * HS) + tr * a64(es * T * S) + (S > 0 ? a64(es * T * D) : 0) + a64(4 * T) +
                  tr * a64(4 * N);
    /* (chunked: the backward's da, dx; config.fp8's training: dy's records) */
    slot += R * ((D + H + tr * F + tr * ch * (D + F)) * es + xr + tr * c->fp8 * xrow) + 7 * 64;
    return w + c->slots * slot;
}

/* A CUDA layer's host workspace: the routing copy, placement, moept.c's bookkeeping, and the
   executor's own: its state, pinned block (count messages, loss statistics, the gradient scan's
   block sums), GEMM descriptors and each slot's plan arrays */
static double mem_cuda_host(const memcfg *c) {
    const double E = c->E, P = c->P, El = E / P, C = P > 1 && c->C > 1 ? c->C : 1, ch = C > 1;
    const double G = dmax(1, El * (ch ? P : 1)), M = E + 4 + ch * C * E;
    const double pinned = 8 * P * M + 8 * (3 * E + 5) + 64 + 16384 + 4 * E + 6 * 64;
    const double descs = a64(8 * P) + a64(72 * G) + a64(88 * G) + 2 * a64(8 * G) +
                         ch * (a64(24 * G) + 2 * a64(16 * E)) + c->fp8 * a64(32 * E); /* (FP8: q8segs) */
    const double plan = a64(8 * E) + a64(8 * (E + 1)) + a64(8 * E) + a64(8 * (El + 1)) + 2 * a64(16 * E) +
                        ch * 2 * a64(8 * C * E);
    const double structs = 1456 + 488 * (c->slots + 1); /* its state, its slots' */
    return mem_host_routing(c, 0) + 2 * a64(4 * E) + mem_book(c) + structs + pinned + descs + c->slots * plan;
}

typedef struct gemm_kind { const char *tag; double mr, nr, kc, nc; } gemm_kind;
static const gemm_kind gemm_kinds[] = {
    {"12x32", 12, 32, 512, 2048}, {"6x16", 6, 16, 256, 2048}, {"8x12", 8, 12, 512, 2040},
    {"4x8", 4, 8, 256, 2048},
};
/* the blocking of the builtin GEMM named (moept_gemm_kernel(), or avx512, avx2, neon, portable);
   cblas: none. 0: unknown */
static int gemm_of(const char *name, memcfg *c) {
    static const char *const alias[4] = {"avx512", "avx2", "neon", "portable"};
    c->mr = c->nr = c->kc = c->nc = 0;
    if (strstr(name, "cblas")) return 1;
    for (int i = 0; i < 4; i++)
        if (strstr(name, gemm_kinds[i].tag) || !strcmp(name, alias[i])) {
            const gemm_kind *g = &gemm_kinds[i];
            c->mr = g->mr, c->nr = g->nr, c->kc = g->kc, c->nc = g->nc;
            return 1;
        }
    return 0;
}

static membytes mem_layer(const memcfg *c) {
    membytes m;
    memset(&m, 0, sizeof m);
    const double n = mem_nparams(c), E = c->E, D = c->D, El = E / c->P;
    if (!c->cuda) {
        m.host[MEM_PARAMS] = 4 * (n + E);
        m.host[MEM_GRADS] = c->train * (c->grad_backup ? 8 : 4) * n;
        m.host[MEM_MOMENTS] = c->train * c->moments * 8 * n;
        if (c->fp8)
            m.host[MEM_CASTS] = a64(4 * El * 2 * c->F * D) + a64(4 * El * D * c->F) +
                                (c->S > 0 ? a64(4 * 2 * c->S * D) + a64(4 * D * c->S) : 0);
        m.host[MEM_WORKSPACE] = mem_cpu_workspace(c);
        return m;
    }
    const double npad = ceil(n / 64) * 64;
    m.dev[MEM_PARAMS] = 4 * npad + 8 * E + 256; /* with the bias, the placement, the alignment */
    m.dev[MEM_GRADS] = c->train * 4 * npad;
    m.dev[MEM_MOMENTS] = c->train * c->moments * 8 * npad;
    m.dev[MEM_CASTS] = (c->bf16 ? 2 * (n - E * D) : 0) +
                       (c->fp8 ? mem_q8w(El, 2 * c->F, c->F, D) + mem_q8w(c->S > 0, 2 * c->S, c->S, D) : 0);
    m.dev[MEM_WORKSPACE] = mem_cuda_workspace(c);
    m.host[MEM_PARAMS] = 4 * E; /* the correction bias: its one home */
    m.host[MEM_WORKSPACE] = mem_cuda_host(c);
    return m;
}

typedef struct result {
    double p_total, p_active, p_exp, p_nonexp, p_layer;
    double mem_states, mem_buffers, mem_act, mem_comm, mem_total;  /* bytes per GPU */
    double moe[MEM_NKINDS];     /* moept: its MoE layers' bytes per GPU, by kind (ep modes; 0 otherwise) */
    double comm_bytes, comm_s, compute_s, step_s, tokens_s;        /* per GPU per step */
} result;

static double link_bw(const cluster *c, double group) { return (group <= c->G ? c->nvlink : c->ib) * 1e9; }

/* one moept MoE layer of the model on a GPU of the cluster, training (ep modes: EP P, its chunks) */
static membytes cluster_layer(const model *m, const cluster *c, int mode) {
    memcfg l;
    memset(&l, 0, sizeof l);
    l.D = m->D, l.F = m->F, l.E = m->E, l.K = m->K, l.S = m->S, l.P = c->P, l.T = c->T;
    l.C = mode == 2 ? c->C : 1;
    l.cuda = c->cuda, l.bf16 = c->bf16, l.fp8 = c->fp8, l.train = l.moments = l.slots = 1;
    l.shm = c->P <= c->G, l.cc = c->cc;
    gemm_of("avx512", &l);
    return mem_layer(&l);
}

/* mode: 0 fsdp, 1 ep, 2 ep + overlap */
static result plan(const model *m, const cluster *c, int mode) {
    result r;
    memset(&r, 0, sizeof r);
    const double D = m->D, F = m->F, E = m->E, K = m->K, T = c->T, W = c->W, P = mode ? c->P : 1, DP = c->W / P;
    double expert = 3 * D * F, shared = m->S > 0 ? 3 * D * m->S : 0;
    r.p_exp = m->Lmoe * E * expert;
    r.p_nonexp = m->L * m->attn + m->Lmoe * (shared + D * E) + m->dense;
    r.p_total = r.p_exp + r.p_nonexp;
    r.p_active = m->Lmoe * K * expert + r.p_nonexp; /* every non-expert parameter is active */
    r.p_layer = m->attn + E * expert + shared + D * E;
    const double per_param = c->wb + c->gb + c->ob;
    /* states: everything sharded over all W GPUs in both modes (experts by
       EP, then their optimizer state over DP) */
    r.mem_states = r.p_total * per_param / W;
    /* unsharded buffers: fsdp gathers whole layers (two prefetched weights
       + one gradient); ep gathers only the non-expert part of a layer */
    double layer_nonexp = m->attn + shared + D * E;
    r.mem_buffers = mode == 0 ? 3 * r.p_layer * c->wb : 3 * layer_nonexp * c->wb;
    /* activations with per-layer checkpointing: every layer's input, plus one
       layer's working set (attention ~10 T D, the MoE's routed rows: x, h,
       a, y = (2D + 3F) per row, the router's scores) */
    r.mem_act = m->L * T * D * c->wb + 10 * T * D * c->wb + T * K * (2 * D + 3 * F) * c->wb + T * E * 4;
    /* exchange buffers: send + receive of a layer's routed rows */
    r.mem_comm = mode ? 2 * T * K * D * c->wb : 0;
    if (mode && c->moept) { /* moept's layers: their executor's states, whole on every replica; each
                               layer's own workspace (its activations and exchange rows among them) */
        const membytes b = cluster_layer(m, c, mode);
        for (int k = 0; k < MEM_NKINDS; k++) r.moe[k] = m->Lmoe * (c->cuda ? b.dev[k] : b.host[k]);
        r.mem_states = (m->L * m->attn + m->dense) * per_param / W + r.moe[MEM_PARAMS] + r.moe[MEM_GRADS] +
                       r.moe[MEM_MOMENTS] + r.moe[MEM_CASTS];
        r.mem_buffers = 3 * m->attn * c->wb; /* a layer's attention gathered; router, shared expert whole */
        r.mem_act = m->L * T * D * c->wb + 10 * T * D * c->wb + r.moe[MEM_WORKSPACE];
        r.mem_comm = 0;
    }
    r.mem_total = r.mem_states + r.mem_buffers + r.mem_act + r.mem_comm;
    /* communication per GPU per step */
    double nonexp_bytes = 3 * (W - 1) / W * r.p_nonexp * c->wb; /* gathered twice, reduce-scattered */
    double a2a = m->Lmoe * 4 * T * K * (P - 1) / P * D * c->wb;  /* dispatch, combine, and their backward */
    double exp_dp = DP > 1 ? 2 * (DP - 1) / DP * (r.p_exp / P) * c->gb : 0; /* expert gradients over DP */
    double fsdp_bytes = 3 * (W - 1) / W * r.p_total * c->wb;
    /* compute: forward + backward + the checkpointed recompute = 8 x active params per token */
    r.compute_s = 8 * r.p_active * T / (c->tflops * 1e12 * c->mfu);
    double t_expert = 8 * m->Lmoe * K * expert * T / (c->tflops * 1e12 * c->mfu);
    if (mode == 0) {
        r.comm_bytes = fsdp_bytes;
        r.comm_s = fsdp_bytes / link_bw(c, W);
        r.step_s = r.comm_s > r.compute_s ? r.comm_s : r.compute_s; /* prefetch hides what it can */
    } else {
        r.comm_bytes = nonexp_bytes + a2a + exp_dp;
        double t_a2a = a2a / link_bw(c, P), t_rest = (nonexp_bytes + exp_dp) / link_bw(c, W);
        double exposed = t_a2a; /* the dispatch precedes the experts: on the critical path */
        if (mode == 2) {
            double hidden = (t_a2a - t_expert) * (c->C - 1) / c->C;
            exposed = t_a2a / c->C + (hidden > 0 ? hidden : 0);
        }
        r.comm_s = t_a2a + t_rest;
        r.step_s = r.compute_s + exposed + (t_rest > r.compute_s ? t_rest - r.compute_s : 0);
    }
    r.tokens_s = W * T / r.step_s;
    return r;
}

/* The sync-free mode (moept.h): every rank sends each expert a block of B
   rows, B = ceil(cf T K / E) (at most T) or, dropless, T; a layer's
   receive rows are E B instead of the T K routed (on average), and the
   exchanges and expert GEMMs run over all of them. */
static void print_sync_free(const model *m, const cluster *c) {
    const double D = m->D, F = m->F, E = m->E, K = m->K, T = c->T, P = c->P, wb = c->wb;
    double B = c->cf > 0 ? ceil(c->cf * T * K / E) : T;
    B = B < T ? B : T;
    const double rows = E * B, routed = T * K, per_row = (2 * D + 3 * F + 2 * D) * wb; /* x, h, a, y, send, recv */
    const double a2a = 4 * (P - 1) / P * D * wb;
    printf("\nsync-free mode (moept_cuda_options.sync_free), per MoE layer per GPU, %s:\n",
           c->cf > 0 ? "at the capacity factor" : "dropless");
    printf("  blocks of B = %.0f rows: E B = %.0f receive rows against T K = %.0f routed (%.2fx)\n", B, rows, routed,
           rows / routed);
    printf("  rows' buffers %.2f GB (default %.2f), exchanges %.2f GB a step (default %.2f), expert GEMMs %.2fx\n",
           rows * per_row / 1e9, routed * per_row / 1e9, rows * a2a / 1e9, routed * a2a / 1e9, rows / routed);
}

/* the ep modes' moept layers per GPU by kind (moept_stats' kinds), and what a parameter of theirs costs */
static void print_moept_layers(const model *m, const cluster *c) {
    const double per_layer = m->E / c->P * 3 * m->D * m->F + m->E * m->D + 3 * m->S * m->D;
    printf("\nmoept's %g MoE layers per GPU (%s layers, moept_stats' kinds; each layer its own workspace: "
           "its activations,\nexchange rows and scratch, sized for %g tokens), GB:\n", m->Lmoe,
           c->cuda ? "CUDA" : "CPU", c->T);
    printf("%-11s", "mode");
    for (int k = 0; k < MEM_NKINDS; k++) printf(" %10s", mem_kinds[k]);
    printf(" %10s %12s\n", "total", "bytes/param");
    for (int mode = 1; mode < 3; mode++) {
        const result r = plan(m, c, mode);
        double t = 0, st = 0;
        printf("%-11s", mode == 1 ? "ep" : "ep+overlap");
        for (int k = 0; k < MEM_NKINDS; k++) {
            printf(" %10.2f", r.moe[k] / 1e9);
            t += r.moe[k];
            st += k < MEM_WORKSPACE ? r.moe[k] : 0;
        }
        printf(" %10.2f %12.2f  (states; %.2f with the workspace)\n", t / 1e9, st / (m->Lmoe * per_layer),
               t / (m->Lmoe * per_layer));
    }
}

static void print_plan(const model *m, const cluster *c) {
    static const char *modes[3] = {"fsdp", "ep", "ep+overlap"};
    printf("%s: %.1fB parameters (%.1fB in experts), %.1fB active per token\n", m->name, plan(m, c, 0).p_total / 1e9,
           plan(m, c, 0).p_exp / 1e9, plan(m, c, 0).p_active / 1e9);
    printf("cluster: %g GPUs (%g per node), EP %g, NVLink %g GB/s, IB %g GB/s, %g TFLOP/s at %.0f%%, %g tokens/GPU/step, C=%g\n",
           c->W, c->G, c->P, c->nvlink, c->ib, c->tflops, 100 * c->mfu, c->T, c->C);
    if (c->moept)
        printf("bytes/param: weights %g, gradients %g, optimizer %g (fsdp; the rest of the model in ep: its "
               "MoE layers are moept's, %s%s%s)\n\n", c->wb, c->gb, c->ob, c->cuda ? "CUDA " : "CPU ",
               c->cuda ? (c->bf16 ? "bf16" : "fp32") : "", c->fp8 ? ", fp8" : "");
    else
        printf("bytes/param: weights %g, gradients %g, optimizer %g\n\n", c->wb, c->gb, c->ob);
    printf("%-11s %9s %9s %9s %9s %9s | %10s %9s %9s %9s %11s\n", "mode", "states", "buffers", "activ.", "comm buf",
           "total GB", "comm GB", "comm s", "compute s", "step s", "tokens/s");
    for (int mode = 0; mode < 3; mode++) {
        result r = plan(m, c, mode);
        printf("%-11s %9.1f %9.1f %9.1f %9.2f %9.1f | %10.1f %9.2f %9.2f %9.2f %11.0f%s\n", modes[mode], r.mem_states / 1e9,
               r.mem_buffers / 1e9, r.mem_act / 1e9, r.mem_comm / 1e9, r.mem_total / 1e9, r.comm_bytes / 1e9, r.comm_s,
               r.compute_s, r.step_s, r.tokens_s, r.mem_total > c->gpu_gib * 1073741824.0 ? "  (does not fit)" : "");
    }
    if (c->moept) print_moept_layers(m, c);
    print_sync_free(m, c);
}

/* The CPU scenario bench's layer in fp32: its bytes per rank per step. */
static double scenario_bytes(const char *mode, double P, double T, double D, double F, double E, double K) {
    if (!strcmp(mode, "fsdp")) {
        double total = E * 3 * D * F, shard = ceil(total / P);
        return 3 * (P - 1) * shard * 4;
    }
    return 4 * T * K * (P - 1) / P * D * 4;
}

static int check_scenarios(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) { printf("\nscenarios: %s not found (run: python3 bench/run_scenarios.py)\n", path); return 0; }
    char line[1024];
    int bad = 0, n = 0;
    printf("\nbyte formulas against the scenario bench (%s):\n", path);
    printf("%-8s %3s %-8s %2s %9s %14s %14s %8s\n", "backend", "P", "mode", "C", "tokens", "predicted MB", "counted MB", "ratio");
    double fsdp_pred = 0, fsdp_meas = 0;
    char last_key[256] = "";
    if (!fgets(line, sizeof line, f)) { fclose(f); return 0; }
    while (fgets(line, sizeof line, f)) {
        /* backend,ranks,mode,chunks,tokens,dim,ffn,... mem_bytes,bytes_per_rank,experts,topk (last four) */
        char *tok[32];
        int nt = 0;
        for (char *p = strtok(line, ",\n"); p && nt < 32; p = strtok(NULL, ",\n")) tok[nt++] = p;
        if (nt < 20) continue;
        double P = atof(tok[1]), T = atof(tok[4]), D = atof(tok[5]), F = atof(tok[6]);
        double by = atof(tok[nt - 3]), E = atof(tok[nt - 2]), K = atof(tok[nt - 1]);
        double pred = scenario_bytes(tok[2], P, T, D, F, E, K);
        char key[256];
        snprintf(key, sizeof key, "%s/%s/%s/%s/%s", tok[0], tok[1], tok[4], tok[5], tok[6]);
        if (strcmp(key, last_key)) { fsdp_pred = fsdp_meas = 0; snprintf(last_key, sizeof last_key, "%s", key); }
        if (!strcmp(tok[2], "fsdp")) { fsdp_pred = pred; fsdp_meas = by; }
        printf("%-8s %3.0f %-8s %2s %9.0f %14.2f %14.2f %8.3f", tok[0], P, tok[2], tok[3], T, pred / 1e6, by / 1e6,
               pred > 0 ? by / pred : (by == 0 ? 1.0 : INFINITY));
        if (pred == 0 && by != 0) bad++;
        if (strcmp(tok[2], "fsdp") && fsdp_pred > 0 && by > 0) {
            double fp = fsdp_pred / pred, fm = fsdp_meas / by;
            int ok = fabs(fm / fp - 1) <= 0.10;
            printf("   fsdp/this: predicted %.2fx, counted %.2fx %s", fp, fm, ok ? "(within 10%)" : "(OFF by more than 10%)");
            bad += !ok;
        }
        printf("\n");
        n++;
    }
    fclose(f);
    printf("%s\n", bad ? "byte-factor check: FAILED" : n ? "byte-factor check: every row within 10% of the prediction" : "no rows");
    return bad;
}

/* ---- the model against layers made here (plan --check) ----------------
   Each case's layer is made (on P ranks: threads, one device), routed in
   balance (router row e reads x's column e; token t's two largest are
   columns t mod E and t + 1 mod E), stepped (a forward into each slot,
   their backwards, an AdamW step; an inference layer: a forward), and its
   moept_stats by kind compared with mem_layer's, within 5% each and in all. */
typedef struct lrank {
    const memcfg *m;
    moept_thread_group *g;
    int rank;
    moept_stats st;
    char err[256];
} lrank;

#ifdef MOEPT_CUDA
/* n floats as the layer's rows on the device (bf16: their top halves, x's values exact) */
static void *dev_rows(const float *h, int64_t n, int bf16) {
    void *d = NULL;
    uint16_t *b = bf16 ? malloc((size_t)n * 2) : NULL;
    for (int64_t i = 0; b && i < n; i++) { uint32_t u; memcpy(&u, &h[i], 4); b[i] = (uint16_t)(u >> 16); }
    if (cudaMalloc(&d, (size_t)n * (bf16 ? 2 : 4)) == cudaSuccess)
        cudaMemcpy(d, bf16 ? (const void *)b : (const void *)h, (size_t)n * (bf16 ? 2 : 4),
                   cudaMemcpyHostToDevice);
    free(b);
    return d;
}
#endif

/* one rank's layer: made, routed in balance, stepped; its stats */
static moept_status lrank_run(lrank *r, moept_comm *ep, void *stream) {
    const memcfg *m = r->m;
    const int64_t D = (int64_t)m->D, E = (int64_t)m->E, T = (int64_t)m->T;
    moept_config cfg = moept_config_default(m->S > 0 ? MOEPT_FAMILY_QWEN2_MOE : MOEPT_FAMILY_MIXTRAL);
    cfg.hidden_size = D; cfg.intermediate_size = (int64_t)m->F;
    cfg.num_experts = E; cfg.top_k = (int64_t)m->K;
    cfg.shared_intermediate_size = (int64_t)m->S; cfg.max_tokens = T; cfg.max_inflight = m->slots;
    cfg.fp8 = m->fp8 ? MOEPT_FP8_BLOCKWISE : MOEPT_FP8_OFF; cfg.inference_only = !m->train;
    cfg.shared_gate = m->gate ? MOEPT_SHARED_GATE_SIGMOID : MOEPT_SHARED_GATE_NONE;
    cfg.grad_backup = m->grad_backup; cfg.overlap_chunks = m->C > 1 ? (int64_t)m->C : 0;
    moept_layer *L = NULL;
    moept_status st;
#ifdef MOEPT_CUDA
    moept_cuda_options o = {m->bf16 ? MOEPT_DTYPE_BF16 : MOEPT_DTYPE_F32, stream, 0, 0,
                            m->kernel ? MOEPT_GEMM_KERNEL : MOEPT_GEMM_AUTO};
    st = m->cuda ? moept_create_cuda(&cfg, ep, NULL, &o, &L) : moept_create_parallel(&cfg, ep, NULL, &L);
#else
    (void)stream;
    st = moept_create_parallel(&cfg, ep, NULL, &L);
#endif
    float *w = calloc((size_t)(E * D), 4), *x = calloc((size_t)(T * D), 4);
    for (int64_t e = 0; e < E; e++) w[e * D + e] = 1;
    for (int64_t t = 0; t < T; t++) x[t * D + t % E] = 2, x[t * D + (t + 1) % E] = 1;
    if (!st) st = moept_init_params(L, 5);
    if (!st) st = moept_set_param(L, "gate.weight", w, E * D);
    void *xd = x, *yd = NULL, *dxd = NULL;
#ifdef MOEPT_CUDA
    if (m->cuda)
        xd = dev_rows(x, T * D, m->bf16), yd = dev_rows(x, T * D, m->bf16), dxd = dev_rows(x, T * D, m->bf16);
    else
#endif
        yd = calloc((size_t)(T * D), 4), dxd = calloc((size_t)(T * D), 4);
    for (int s = 0; !st && s < m->slots; s++) {
        moept_forward_opts fo = {NULL, 0, NULL, NULL, s};
        st = moept_forward_ex(L, xd, T, yd, &fo);
    }
    for (int s = 0; !st && m->train && s < m->slots; s++) {
        moept_backward_opts bo = moept_backward_default();
        bo.slot = s;
        st = moept_backward_ex(L, xd, xd, dxd, &bo); /* (dy: x's values) */
    }
    moept_adamw a = {1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f};
    if (!st && m->train && m->moments && ep) st = moept_sync_grads(L, 1.0f);
    if (!st && m->train && m->moments) st = moept_adamw_step(L, &a);
    if (!st) st = moept_get_stats(L, &r->st, NULL);
    if (st) snprintf(r->err, sizeof r->err, "%s", moept_last_error(NULL));
    moept_destroy(L);
#ifdef MOEPT_CUDA
    if (m->cuda) { cudaFree(xd); cudaFree(yd); cudaFree(dxd); }
    else
#endif
        free(yd), free(dxd);
    free(w); free(x);
    return st;
}

static void *lrank_thread(void *arg) {
    lrank *r = arg;
    moept_comm *ep = NULL;
    void *stream = NULL;
#ifdef MOEPT_CUDA
    cudaStream_t s = NULL;
    if (r->m->cuda) {
        cudaSetDevice(0);
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        stream = s;
    }
#endif
    moept_status st = MOEPT_OK;
    if (r->g) {
#ifdef MOEPT_CUDA
        if (r->m->cuda) st = moept_comm_cuda_threads(r->g, r->rank, stream, 60000, &ep);
        else
#endif
            st = moept_comm_threads(r->g, r->rank, &ep);
    }
    if (st) snprintf(r->err, sizeof r->err, "%s", moept_last_error(NULL));
    else if (lrank_run(r, ep, stream)) r->err[0] = r->err[0] ? r->err[0] : '?';
    moept_comm_destroy(ep);
#ifdef MOEPT_CUDA
    if (s) cudaStreamDestroy(s);
#endif
    return NULL;
}

/* prints one case's comparison (each kind: the model's bytes, measured / model); 1: a kind, or the
   total, off by more than 5% (worst: the largest |measured / model - 1| of each, so far) */
static int mem_compare(const char *name, const memcfg *m, const moept_stats *st, double *worst) {
    const membytes b = mem_layer(m);
    int bad = 0;
    for (int side = 0; side < 2; side++) {
        const double *want = side ? b.dev : b.host;
        const int64_t *got = side ? st->device_bytes : st->host_bytes;
        double tw = 0, tg = 0;
        for (int k = 0; k < MEM_NKINDS; k++) tw += want[k], tg += (double)got[k];
        if (side && tw == 0 && tg == 0) continue; /* a CPU layer: nothing on a device */
        printf("  %-6s", side ? "device" : "host");
        for (int k = 0; k <= MEM_NKINDS; k++) {
            const double w = k < MEM_NKINDS ? want[k] : tw, g = k < MEM_NKINDS ? (double)got[k] : tg;
            const double e = w > 0 ? fabs(g / w - 1) : g > 0 ? INFINITY : 0;
            worst[k] = e > worst[k] ? e : worst[k];
            bad |= e > 0.05;
            if (w > 0) printf(" %12.0f %5.3f", w, g / w);
            else printf(" %12.0f %5s", g, g > 0 ? "inf" : "-");
        }
        printf("\n");
    }
    printf("%s - %s\n", bad ? "FAIL" : "ok", name);
    return bad;
}

static int check_layers(void) {
    /* T tokens a rank (a multiple of E: balanced), AdamW moments where training, EP through shared memory
       unchunked */
    static const struct lcase {
        const char *name;
        double D, F, E, K, S, P, C, T;
        int gate, cuda, bf16, fp8, train, slots, grad_backup, kernel;
    } cases[] = {
        {"cpu: mixtral-like, training", 64, 96, 8, 2, 0, 1, 1, 1024, 0, 0, 0, 0, 1, 1, 0, 0},
        {"cpu: qwen2-like (shared expert, gate), 2 forward slots", 64, 64, 8, 2, 128, 1, 1, 256, 1, 0, 0, 0,
         1, 2, 0, 0},
        {"cpu: fp8, shared expert", 64, 96, 8, 2, 64, 1, 1, 256, 0, 0, 0, 1, 1, 1, 0, 0},
        {"cpu: inference_only, shared expert", 64, 96, 8, 2, 64, 1, 1, 256, 1, 0, 0, 0, 0, 1, 0, 0},
        {"cpu: EP 2 (threads, shared memory), grad_backup", 64, 96, 8, 2, 0, 2, 1, 256, 0, 0, 0, 0, 1, 1, 1,
         0},
        {"cpu: EP 2, 2 overlap chunks (threads, messages), shared expert", 64, 96, 8, 2, 64, 2, 2, 256, 0, 0,
         0, 0, 1, 1, 0, 0},
        {"cpu: fp8, EP 2, 2 overlap chunks (threads, FP8 records)", 72, 96, 8, 2, 0, 2, 2, 256, 0, 0,
         0, 1, 1, 1, 0, 0},
#ifdef MOEPT_CUDA
        {"cuda: fp32, training", 64, 96, 8, 2, 0, 1, 1, 1024, 0, 1, 0, 0, 1, 1, 0, 0},
        {"cuda: bf16, shared expert, 2 forward slots", 64, 64, 8, 2, 128, 1, 1, 256, 1, 1, 1, 0, 1, 2, 0, 0},
        {"cuda: bf16, fp8, shared expert", 128, 128, 8, 2, 128, 1, 1, 256, 0, 1, 1, 1, 1, 1, 0, 0},
        {"cuda: bf16, inference_only", 64, 96, 8, 2, 0, 1, 1, 256, 0, 1, 1, 0, 0, 1, 0, 0},
        {"cuda: bf16, EP 2 (threads on one device)", 64, 96, 8, 2, 0, 2, 1, 256, 0, 1, 1, 0, 1, 1, 0, 0},
        {"cuda: fp32, EP 2, 2 overlap chunks", 64, 96, 8, 2, 0, 2, 2, 256, 0, 1, 0, 0, 1, 1, 0, 0},
        {"cuda: bf16, the kernel GEMM form, shared expert (sm_90)", 64, 96, 8, 2, 64, 1, 1, 256, 0, 1, 1, 0,
         1, 1, 0, 1},
        {"cuda: bf16, fp8, the kernel GEMM form, shared expert (sm_90)", 128, 128, 8, 2, 128, 1, 1, 256, 0, 1,
         1, 1, 1, 1, 0, 1},
#endif
    };
    memcfg gemm;
    memset(&gemm, 0, sizeof gemm);
    if (!gemm_of(moept_gemm_kernel(), &gemm)) {
        printf("FAIL - the GEMM kernel %s: its blocking is not in plan's table\n", moept_gemm_kernel());
        return 1;
    }
    double cc = 90;
#ifdef MOEPT_CUDA
    int major = 0, minor = 0;
    if (moept_cuda_device_count() > 0 &&
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) == cudaSuccess)
        cc = 10 * major + minor;
#endif
    printf("\n== one layer's bytes by kind: the model (mem_layer) against moept_stats of layers made here\n");
    printf("(GEMM %s; each kind: the model's bytes and measured / model; 5%% allowed)\n",
           moept_gemm_kernel());
    printf("  %-6s", "");
    for (int k = 0; k <= MEM_NKINDS; k++) printf(" %18s", k < MEM_NKINDS ? mem_kinds[k] : "total");
    printf("\n");
    double worst[MEM_NKINDS + 1] = {0};
    int bad = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const struct lcase *q = &cases[i];
        memcfg m = gemm;
        m.D = q->D, m.F = q->F, m.E = q->E, m.K = q->K, m.S = q->S, m.P = q->P, m.C = q->C, m.T = q->T;
        m.gate = q->gate;
        m.cuda = q->cuda, m.bf16 = q->bf16, m.fp8 = q->fp8, m.train = m.moments = q->train;
        m.slots = q->slots;
        m.grad_backup = q->grad_backup, m.shm = 1, m.cc = cc, m.kernel = q->kernel;
#ifdef MOEPT_CUDA
        if (m.cuda && moept_cuda_device_count() == 0) {
            printf("skip - %s: no CUDA device\n", q->name);
            continue;
        }
#ifdef MOEPT_EMU
        if (m.kernel) setenv("MOEPT_EMU_CC", "90", 1), m.cc = 90; /* (the emulated GPU answers 9.0) */
#endif
        if (m.kernel && m.cc != 90) {
            printf("skip - %s: compute capability %.0f\n", q->name, m.cc);
            continue;
        }
#endif
        const int P = (int)m.P;
        lrank r[2];
        memset(r, 0, sizeof r);
        moept_thread_group *g = NULL;
        if (P > 1 && moept_thread_group_create(P, 60000, &g)) {
            printf("FAIL - %s: moept_thread_group_create: %s\n", q->name, moept_last_error(NULL));
            bad = 1;
            continue;
        }
        pthread_t th[2];
        for (int k = 0; k < P; k++) {
            r[k].m = &m, r[k].g = g, r[k].rank = k;
            if (P > 1) pthread_create(&th[k], NULL, lrank_thread, &r[k]);
        }
        if (P == 1) lrank_thread(&r[0]);
        for (int k = 0; P > 1 && k < P; k++) pthread_join(th[k], NULL);
        moept_thread_group_destroy(g);
        printf("%s\n", q->name);
        for (int k = 0; k < P; k++) {
            char name[160];
            snprintf(name, sizeof name, "%s%s", q->name, P > 1 ? (k ? ", rank 1" : ", rank 0") : "");
            if (r[k].err[0]) {
                printf("FAIL - %s: %s\n", name, r[k].err);
                bad = 1;
                continue;
            }
            bad |= mem_compare(name, &m, &r[k].st, worst);
        }
    }
    printf("worst |measured / model - 1|:");
    for (int k = 0; k <= MEM_NKINDS; k++)
        printf(" %s %.4f", k < MEM_NKINDS ? mem_kinds[k] : "total", worst[k]);
    printf("\n");
    return bad;
}

static int check(const char *scen) {
    const model *m = &presets[0];
    cluster c = {8, 8, 8, 300, 25, 312, 0.4, 4096, 4, 0, 2, 2, 4, 80, 0, 1, 1, 0, 80};
    printf("== Mixtral-8x7B fine-tune, 8 x A100-80GB (published: FSDP only 83 tokens/s, 54.8 GB; expert parallel 337 tokens/s, 45.5 GB)\n");
    printf("assumed: bf16 weights and gradients, bf16 AdamW moments (%g+%g+%g bytes/param: the states fit in 80 GB only so),\n"
           "activation checkpointing per layer, %g tokens per GPU per step, MFU %.0f%%; the interconnect is not in the\n"
           "published numbers, so both: NVLink (SXM, 300 GB/s) and PCIe 4.0 without NVLink (~20 GB/s achieved by NCCL).\n\n",
           c.wb, c.gb, c.ob, c.T, 100 * c.mfu);
    const double pub_tps[2] = {83, 337}, pub_gb[2] = {54.8, 45.5};
    for (int link = 0; link < 2; link++) {
        c.nvlink = link == 0 ? 300 : 20;
        printf("-- %s\n", link == 0 ? "NVLink" : "PCIe, no NVLink");
        print_plan(m, &c);
        result f = plan(m, &c, 0), e = plan(m, &c, 1);
        printf("\n%-28s %12s %12s %10s\n", "", "predicted", "published", "ratio");
        printf("%-28s %12.0f %12.0f %10.2f\n", "fsdp tokens/s (8 GPUs)", f.tokens_s, pub_tps[0], f.tokens_s / pub_tps[0]);
        printf("%-28s %12.0f %12.0f %10.2f\n", "ep tokens/s (8 GPUs)", e.tokens_s, pub_tps[1], e.tokens_s / pub_tps[1]);
        printf("%-28s %12.2f %12.2f %10.2f\n", "ep / fsdp speed-up", e.tokens_s / f.tokens_s, pub_tps[1] / pub_tps[0],
               (e.tokens_s / f.tokens_s) / (pub_tps[1] / pub_tps[0]));
        printf("%-28s %12.1f %12.1f %10.2f\n", "fsdp peak GB per GPU", f.mem_total / 1e9, pub_gb[0], f.mem_total / 1e9 / pub_gb[0]);
        printf("%-28s %12.1f %12.1f %10.2f\n", "ep peak GB per GPU", e.mem_total / 1e9, pub_gb[1], e.mem_total / 1e9 / pub_gb[1]);
        printf("%-28s %12.1f %12.1f %10.2f\n\n", "memory saved by ep (GB)", (f.mem_total - e.mem_total) / 1e9,
               pub_gb[0] - pub_gb[1], (f.mem_total - e.mem_total) / 1e9 / (pub_gb[0] - pub_gb[1]));
    }
    const int scen_bad = check_scenarios(scen);
    return check_layers() | scen_bad;
}

/* plan --layer: one moept layer's bytes by kind (a rank's), and per parameter */
static void print_layer(const memcfg *l) {
    const membytes b = mem_layer(l);
    const double n = mem_nparams(l), nexp = l->E / l->P * 3 * l->D * l->F;
    printf("one moept layer, a rank's: %s%s%s, EP %g%s, %g tokens, %d forward slot(s), %s\n",
           l->cuda ? "CUDA " : "CPU", l->cuda ? (l->bf16 ? "bf16" : "fp32") : "", l->fp8 ? ", fp8" : "", l->P,
           l->C > 1 && l->P > 1 ? ", overlap chunks" : "", l->T, l->slots,
           l->train ? "training (after the first AdamW step)" : "inference_only");
    printf("%.0f parameters on this rank (%.0f in its experts); D %g, F %g, E %g, top-%g, shared %g\n", n,
           nexp, l->D, l->F, l->E, l->K, l->S);
    printf("%-10s %16s %16s %14s\n", "kind", "host bytes", "device bytes", "bytes/param");
    double th = 0, td = 0;
    for (int k = 0; k < MEM_NKINDS; k++) {
        printf("%-10s %16.0f %16.0f %14.3f\n", mem_kinds[k], b.host[k], b.dev[k], (b.host[k] + b.dev[k]) / n);
        th += b.host[k], td += b.dev[k];
    }
    printf("%-10s %16.0f %16.0f %14.3f\n", "total", th, td, (th + td) / n);
}

/* the options that describe one moept layer (--layer, and the ep modes' layers); 0: not one of them,
   -1: a bad value */
static int layer_option(const char *a, const char *v, memcfg *l, cluster *c) {
    if (!strcmp(a, "--executor")) {
        if (strcmp(v, "cpu") && strcmp(v, "cuda")) return -1;
        l->cuda = c->cuda = !strcmp(v, "cuda");
    } else if (!strcmp(a, "--dtype")) {
        if (strcmp(v, "fp32") && strcmp(v, "bf16")) return -1;
        l->bf16 = c->bf16 = !strcmp(v, "bf16");
    } else if (!strcmp(a, "--inflight")) {
        l->slots = atoi(v) > 1 ? atoi(v) : 1;
    } else if (!strcmp(a, "--gemm")) {
        if (!gemm_of(v, l)) return -1;
    } else if (!strcmp(a, "--cc")) {
        l->cc = c->cc = atof(v);
    } else if (!strcmp(a, "--gemm-form")) {
        if (strcmp(v, "auto") && strcmp(v, "kernel")) return -1;
        l->kernel = !strcmp(v, "kernel");
    } else {
        return 0;
    }
    return 1;
}

int main(int argc, char **argv) {
    model m = presets[0];
    cluster c = {8, 8, 8, 450, 50, 989, 0.4, 4096, 4, 0, 2, 2, 4, 80, 1, 1, 1, 0, 90};
    int do_check = 0, ep_set = 0, layer = 0, chunks_set = 0;
    memcfg l;
    memset(&l, 0, sizeof l);
    l.cuda = l.bf16 = l.train = l.moments = l.slots = 1, l.cc = 90;
    gemm_of("avx512", &l);
    const char *scen = "build/scenarios.csv";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--check")) { do_check = 1; continue; }
        if (!strcmp(a, "--layer")) { layer = 1; continue; }
        if (!strcmp(a, "--fp8")) { l.fp8 = c.fp8 = 1; continue; }
        if (!strcmp(a, "--inference")) { l.train = 0; continue; }
        if (!strcmp(a, "--grad-backup")) { l.grad_backup = 1; continue; }
        if (!strcmp(a, "--shared-gate")) { l.gate = 1; continue; }
        if (!strcmp(a, "--framework")) { c.moept = 0; continue; }
        if (!v) { fprintf(stderr, "plan: %s needs a value (see the top of tools/plan.c)\n", a); return 2; }
        i++;
        const int lo = layer_option(a, v, &l, &c);
        if (lo < 0) { fprintf(stderr, "plan: %s %s: not a value it takes (tools/plan.c)\n", a, v); return 2; }
        if (lo) continue;
        if (!strcmp(a, "--preset")) {
            int found = 0;
            for (size_t p = 0; p < sizeof presets / sizeof presets[0]; p++)
                if (!strcmp(v, presets[p].name)) { m = presets[p]; found = 1; }
            if (!found) { fprintf(stderr, "plan: presets: mixtral-8x7b, qwen2-57b-a14b, deepseek-v3\n"); return 2; }
        } else if (!strcmp(a, "--scenarios")) scen = v;
        else if (!strcmp(a, "--hidden")) m.D = atof(v);
        else if (!strcmp(a, "--ffn")) m.F = atof(v);
        else if (!strcmp(a, "--experts")) m.E = atof(v);
        else if (!strcmp(a, "--topk")) m.K = atof(v);
        else if (!strcmp(a, "--shared-ffn")) m.S = atof(v);
        else if (!strcmp(a, "--layers")) m.L = atof(v);
        else if (!strcmp(a, "--moe-layers")) m.Lmoe = atof(v);
        else if (!strcmp(a, "--attn-params")) m.attn = atof(v);
        else if (!strcmp(a, "--dense-params")) m.dense = atof(v);
        else if (!strcmp(a, "--world")) c.W = atof(v);
        else if (!strcmp(a, "--ep")) { c.P = atof(v); ep_set = 1; }
        else if (!strcmp(a, "--gpus-per-node")) c.G = atof(v);
        else if (!strcmp(a, "--nvlink")) c.nvlink = atof(v);
        else if (!strcmp(a, "--ib")) c.ib = atof(v);
        else if (!strcmp(a, "--tflops")) c.tflops = atof(v);
        else if (!strcmp(a, "--mfu")) c.mfu = atof(v);
        else if (!strcmp(a, "--tokens")) c.T = atof(v);
        else if (!strcmp(a, "--chunks")) c.C = atof(v), chunks_set = 1;
        else if (!strcmp(a, "--capacity-factor")) c.cf = atof(v);
        else if (!strcmp(a, "--weight-bytes")) c.wb = atof(v);
        else if (!strcmp(a, "--grad-bytes")) c.gb = atof(v);
        else if (!strcmp(a, "--opt-bytes")) c.ob = atof(v);
        else if (!strcmp(a, "--gpu-gib")) c.gpu_gib = atof(v);
        else { fprintf(stderr, "plan: unknown option %s\n", a); return 2; }
    }
    if (do_check) return check(scen) ? 1 : 0;
    if (!ep_set) c.P = c.W < m.E ? c.W : m.E;
    if (c.P < 1 || c.W < c.P || fmod(c.W, c.P) != 0 || fmod(m.E, c.P) != 0 || c.C < 1 || c.T <= 0) {
        fprintf(stderr, "plan: need 1 <= EP <= world, EP dividing world and experts, chunks >= 1, tokens > 0\n");
        return 2;
    }
    if (!layer) {
        print_plan(&m, &c);
        return 0;
    }
    l.D = m.D, l.F = m.F, l.E = m.E, l.K = m.K, l.S = m.S, l.P = c.P, l.T = c.T;
    l.C = chunks_set ? c.C : 1, l.shm = c.P <= c.G;
    print_layer(&l);
    return 0;
}
