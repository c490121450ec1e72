/* plan: what an MoE training step costs per GPU, in three modes (fsdp
   baseline, expert parallel, expert parallel with overlapped chunks), from
   the model's shape and the cluster's numbers. The model is in
   docs/PLAN.md.

   usage: plan [--preset mixtral-8x7b|qwen2-57b-a14b|deepseek-v3]
               [--hidden D --ffn F --experts E --topk K --moe-layers L --layers L
                --shared-ffn S --dense-params N --attn-params N]
               [--world W] [--ep P] [--gpus-per-node G] [--nvlink GBps] [--ib GBps]
               [--tflops X] [--mfu X] [--tokens T] [--chunks C] [--capacity-factor CF]
               [--weight-bytes B] [--grad-bytes B] [--opt-bytes B] [--gpu-gib M]
          plan --check [--scenarios build/scenarios.csv]
   --check compares the Mixtral-8x7B fine-tune on 8 x A100-80GB with the
   published measurements (FSDP only: 83 tokens/s, 54.8 GB peak; expert
   parallel: 337 tokens/s, 45.5 GB peak), and with --scenarios the byte
   formulas with the bytes bench/run_scenarios.py counted. The last lines
   are the CUDA layer's sync-free mode (moept_cuda_options.sync_free): its
   static blocks' memory and traffic against the default mode's, dropless or
   at --capacity-factor. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

typedef struct result {
    double p_total, p_active, p_exp, p_nonexp, p_layer;
    double mem_states, mem_buffers, mem_act, mem_comm, mem_total;  /* bytes per GPU */
    double comm_bytes, comm_s, compute_s, step_s, tokens_s;        /* per GPU per step */
} result;

static double link_bw(const cluster *c, double group) { return (group <= c->G ? c->nvlink : c->ib) * 1e9; }

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

static void print_plan(const model *m, const cluster *c) {
    static const char *modes[3] = {"fsdp", "ep", "ep+overlap"};
    printf("%s: %.1fB parameters (%.1fB in experts), %.1fB active per token\n", m->name, plan(m, c, 0).p_total / 1e9,
           plan(m, c, 0).p_exp / 1e9, plan(m, c, 0).p_active / 1e9);
    printf("cluster: %g GPUs (%g per node), EP %g, NVLink %g GB/s, IB %g GB/s, %g TFLOP/s at %.0f%%, %g tokens/GPU/step, C=%g\n",
           c->W, c->G, c->P, c->nvlink, c->ib, c->tflops, 100 * c->mfu, c->T, c->C);
    printf("bytes/param: weights %g, gradients %g, optimizer %g\n\n", c->wb, c->gb, c->ob);
    printf("%-11s %9s %9s %9s %9s %9s | %10s %9s %9s %9s %11s\n", "mode", "states", "buffers", "activ.", "comm buf",
           "total GB", "comm GB", "comm s", "compute s", "step s", "tokens/s");
    for (int mode = 0; mode < 3; mode++) {
        result r = plan(m, c, mode);
        printf("%-11s %9.1f %9.1f %9.1f %9.2f %9.1f | %10.1f %9.2f %9.2f %9.2f %11.0f%s\n", modes[mode], r.mem_states / 1e9,
               r.mem_buffers / 1e9, r.mem_act / 1e9, r.mem_comm / 1e9, r.mem_total / 1e9, r.comm_bytes / 1e9, r.comm_s,
               r.compute_s, r.step_s, r.tokens_s, r.mem_total > c->gpu_gib * 1073741824.0 ? "  (does not fit)" : "");
    }
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

static int check(const char *scen) {
    const model *m = &presets[0];
    cluster c = {8, 8, 8, 300, 25, 312, 0.4, 4096, 4, 0, 2, 2, 4, 80};
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
    return check_scenarios(scen);
}

int main(int argc, char **argv) {
    model m = presets[0];
    cluster c = {8, 8, 8, 450, 50, 989, 0.4, 4096, 4, 0, 2, 2, 4, 80};
    int do_check = 0, ep_set = 0;
    const char *scen = "build/scenarios.csv";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--check")) { do_check = 1; continue; }
        if (!v) { fprintf(stderr, "plan: %s needs a value (see the top of tools/plan.c)\n", a); return 2; }
        i++;
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
        else if (!strcmp(a, "--chunks")) c.C = atof(v);
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
    print_plan(&m, &c);
    return 0;
}
