/* bench_reshard: moving experts of a running EP group to a new placement.
   moept_reshard (point-to-point moves of only the experts that change owner,
   one expert of staging memory per rank) against the gather-everything-
   then-slice baseline (every rank all-gathers every expert, then copies out
   its new ones), in one run, 4 ranks over threads.

   E=64 experts of Mixtral's proportions (F = 3.5 D) scaled to fit: D=256,
   F=896 (2.6 MiB per expert). The new placement moves the first 4 experts
   of each rank to the next rank (16 of 64 experts change owner).

   usage: bench_reshard [--hidden D] [--ffn F] [--experts E] [--ranks P] */
#include "../moept.c"

#include "bench_threads.h"

typedef struct rs_cfg { int64_t D, F, E; int P; } rs_cfg;
typedef struct rs_res {
    double t_moept, t_base;
    int64_t b_moept, b_base, x_moept, x_base, moved;
    moept_status st;
} rs_res;

static void rs_rank(const void *kv, moept_comm *comm, void *outv) {
    const rs_cfg *k = kv;
    rs_res *out = outv;
    moept_config c = {0};
    c.family = MOEPT_FAMILY_MIXTRAL;
    c.hidden_size = k->D; c.intermediate_size = k->F; c.num_experts = k->E; c.top_k = 2; c.norm_topk_prob = 1;
    c.max_tokens = 1;
    moept_layer *L;
    if ((out->st = moept_create_parallel(&c, comm, NULL, &L))) return;
    moept_init_params(L, 1);
    int64_t El = L->El, P = k->P, E = k->E, part = L->H * L->D + L->D * L->F;
    int32_t *to = malloc((size_t)E * sizeof(int32_t));
    for (int64_t e = 0; e < E; e++) to[e] = (int32_t)((e / El + (e % El < 4 ? 1 : 0)) % P);
    /* baseline first (on a copy of the layout): all-gather every local expert
       block, then slice the new ones */
    comm->barrier(comm);
    double t0 = moept__now();
    float *mine = malloc((size_t)(El * part) * 4), *everything = malloc((size_t)(E * part) * 4);
    for (int64_t q = 0; q < El; q++) { /* pack this rank's experts contiguously to all-gather them */
        memcpy(mine + q * part, L->par.w13 + q * L->H * L->D, (size_t)(L->H * L->D) * 4);
        memcpy(mine + q * part + L->H * L->D, L->par.w2 + q * L->D * L->F, (size_t)(L->D * L->F) * 4);
    }
    comm->allgather(comm, mine, everything, El * part * 4);
    float *newblk = malloc((size_t)(El * part) * 4);
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++)
        if (to[e] == comm->rank) memcpy(newblk + (n++) * part, everything + e * part, (size_t)part * 4);
    comm->barrier(comm);
    out->t_base = moept__now() - t0;
    out->b_base = (E - El) * part * 4; /* every other rank's experts arrive here */
    out->x_base = (E * part + El * part + El * part) * 4; /* gathered copy + packed + sliced block */
    free(mine); free(everything); free(newblk);
    /* moept */
    moept_reshard_report rep;
    comm->barrier(comm);
    t0 = moept__now();
    out->st = moept_reshard(L, to, &rep);
    comm->barrier(comm);
    out->t_moept = moept__now() - t0;
    out->b_moept = rep.bytes_received;
    out->x_moept = rep.extra_bytes;
    out->moved = rep.experts_moved;
    free(to);
    moept_destroy(L);
    return;
}

int main(int argc, char **argv) {
    rs_cfg k = {256, 896, 64, 4};
    for (int i = 1; i + 1 < argc; i += 2) {
        long long v = atoll(argv[i + 1]);
        if (!strcmp(argv[i], "--hidden")) k.D = v;
        else if (!strcmp(argv[i], "--ffn")) k.F = v;
        else if (!strcmp(argv[i], "--experts")) k.E = v;
        else if (!strcmp(argv[i], "--ranks")) k.P = (int)v;
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    rs_res out[BENCH_MAX_RANKS];
    if (!bench_run_threads(k.P, rs_rank, &k, out, sizeof out[0])) return 2;
    printf("E=%lld experts, D=%lld, F=%lld, %d ranks (threads); %lld experts change owner\n\n", (long long)k.E, (long long)k.D,
           (long long)k.F, k.P, (long long)out[0].moved);
    printf("| rank | moept bytes received | gather-all bytes received | moept time (ms) | gather-all time (ms) | moept extra memory (MiB) | gather-all extra memory (MiB) |\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (int r = 0; r < k.P; r++) {
        if (out[r].st) { printf("rank %d failed\n", r); return 1; }
        printf("| %d | %lld | %lld | %.1f | %.1f | %.2f | %.1f |\n", r, (long long)out[r].b_moept, (long long)out[r].b_base,
               out[r].t_moept * 1e3, out[r].t_base * 1e3, out[r].x_moept / 1048576.0, out[r].x_base / 1048576.0);
    }
    return 0;
}
