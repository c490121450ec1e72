/* bench_scenario: rows of the scenario matrix (bench/scenarios) that share
   a backend, rank count and shape: a training step of one MoE layer
   (forward, backward, gradient sync) on every rank, in each of the given
   modes, the modes' steps alternating so that all see the same machine
   conditions (this 2-core VM's speed drifts by tens of percent over
   minutes):

     fsdp     the baseline without expert parallelism (each rank keeps 1/P of
              every expert, all-gathers them in forward and backward, reduce-
              scatters the expert gradients)
     ep       expert parallel (E/P whole experts per rank, token rows move)
     overlap  ep with the step split into --chunks C, one chunk's exchange in
              flight while the experts compute another

   usage: bench_scenario --modes fsdp,ep,overlap:2,... [--ranks P] [--tokens T] [--dim D]
                         [--ffn F] [--experts E] [--topk K] [--steps N] [--warmup W]
          mpirun -np P bench_scenario_mpi --modes ...       (MPI: P = processes)

   Prints one CSV line per mode (header first):
     mode,chunks,ranks,tokens,dim,ffn,experts,topk,step_s,tokens_per_s,mem_bytes,bytes_per_rank,exposed_comm_s
   step_s: the median over --steps timed steps (after --warmup) of the
   slowest rank's step; tokens_per_s: all ranks' tokens / step_s; mem_bytes:
   the largest rank's layer memory (parameters, gradients, workspace);
   bytes_per_rank: bytes a rank sends per step in the layer's exchanges
   (expert rows, or expert weights and gradients), the mean over ranks (the
   replicated gradients' all-reduce is the same in every mode and left out);
   exposed_comm_s: median time inside communication calls (not hidden). */
#include "../moept.c"

#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "bench_threads.h"

#define MAXMODES 8
typedef struct bconf {
    int nm, mode[MAXMODES], C[MAXMODES]; /* mode: 0 fsdp, 1 ep, 2 overlap */
    int P, steps, warmup;
    int64_t T, D, F, E, K;
} bconf;

#define MAXSTEPS 64
typedef struct bres {
    double step[MAXMODES][MAXSTEPS], comm[MAXMODES][MAXSTEPS];
    int64_t mem[MAXMODES], bytes[MAXMODES];
    char err[600];
} bres;

static double sc_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void run_rank(const void *kv, moept_comm *c, void *outv) {
    const bconf *k = kv;
    bres *out = outv;
#ifdef _OPENMP
    omp_set_num_threads(1); /* one core per rank */
#endif
    moept_layer *L[MAXMODES] = {0};
    for (int m = 0; m < k->nm; m++) {
        moept_config cfg = {0};
        cfg.family = MOEPT_FAMILY_MIXTRAL;
        cfg.hidden_size = k->D; cfg.intermediate_size = k->F; cfg.num_experts = k->E; cfg.top_k = k->K;
        cfg.norm_topk_prob = 1; cfg.aux_loss = MOEPT_AUX_HF; cfg.aux_loss_coef = 0.01f;
        cfg.max_tokens = k->T; cfg.global_balance = 1;
        cfg.expert_sharding = k->mode[m] == 0 ? MOEPT_SHARD_FSDP : MOEPT_SHARD_EP;
        cfg.overlap_chunks = k->mode[m] == 2 ? k->C[m] : 1;
        if (moept_create_parallel(&cfg, c, NULL, &L[m])) {
            snprintf(out->err, sizeof out->err, "%s", moept_last_error(NULL));
            for (int i = 0; i < m; i++) moept_destroy(L[i]);
            return;
        }
        moept_init_params(L[m], 1);
    }
    const int64_t T = k->T, D = k->D;
    float *x = malloc((size_t)(T * D) * 4), *dy = malloc((size_t)(T * D) * 4);
    float *y = malloc((size_t)(T * D) * 4), *dx = malloc((size_t)(T * D) * 4);
    uint64_t s = 7 + (uint64_t)c->rank;
    for (int64_t i = 0; i < T * D; i++) { x[i] = (float)((moept__mix(&s) >> 40) * (1.0 / 16777216.0) - 0.5); dy[i] = x[i] * 0.1f; }
    for (int it = 0; it < k->warmup + k->steps && !out->err[0]; it++)
        for (int m = 0; m < k->nm; m++) {
            { int64_t z = 0; c->allreduce(c, &z, 1, MOEPT_DTYPE_I64); } /* start together */
            double t0 = sc_now();
            moept_zero_grad(L[m]);
            if (moept_forward(L[m], x, T, y) || moept_backward(L[m], x, dy, dx) || moept_sync_grads(L[m], 1.0f)) {
                snprintf(out->err, sizeof out->err, "%s", moept_last_error(L[m]));
                break;
            }
            double t = sc_now() - t0;
            moept_stats st;
            moept_get_stats(L[m], &st, NULL);
            if (it >= k->warmup) {
                out->step[m][it - k->warmup] = t;
                out->comm[m][it - k->warmup] = st.comm_seconds;
            }
            out->bytes[m] = st.bytes_sent;
            out->mem[m] = st.param_bytes + st.workspace_bytes;
        }
    free(x); free(dy); free(y); free(dx);
    for (int m = 0; m < k->nm; m++) moept_destroy(L[m]);
}

static int cmpd(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void sc_report(const bconf *k, const bres *all, int P) {
    for (int r = 0; r < P; r++)
        if (all[r].err[0]) { fprintf(stderr, "bench_scenario: rank %d: %s\n", r, all[r].err); exit(1); }
    static const char *names[3] = {"fsdp", "ep", "overlap"};
    printf("mode,chunks,ranks,tokens,dim,ffn,experts,topk,step_s,tokens_per_s,mem_bytes,bytes_per_rank,exposed_comm_s\n");
    for (int m = 0; m < k->nm; m++) {
        double worst[MAXSTEPS], comm[MAXSTEPS];
        int64_t mem = 0, bytes = 0;
        for (int i = 0; i < k->steps; i++) {
            worst[i] = 0; comm[i] = 0;
            for (int r = 0; r < P; r++) {
                worst[i] = all[r].step[m][i] > worst[i] ? all[r].step[m][i] : worst[i];
                comm[i] = all[r].comm[m][i] > comm[i] ? all[r].comm[m][i] : comm[i];
            }
        }
        for (int r = 0; r < P; r++) {
            mem = all[r].mem[m] > mem ? all[r].mem[m] : mem;
            bytes += all[r].bytes[m];
        }
        bytes /= P;
        qsort(worst, (size_t)k->steps, sizeof(double), cmpd);
        qsort(comm, (size_t)k->steps, sizeof(double), cmpd);
        double med = worst[k->steps / 2], cmed = comm[k->steps / 2];
        printf("%s,%d,%d,%lld,%lld,%lld,%lld,%lld,%.6f,%.1f,%lld,%lld,%.6f\n", names[k->mode[m]],
               k->mode[m] == 2 ? k->C[m] : 1, P, (long long)k->T, (long long)k->D, (long long)k->F, (long long)k->E,
               (long long)k->K, med, (double)(k->T * P) / med, (long long)mem, (long long)bytes, cmed);
    }
}

static void parse(int argc, char **argv, bconf *k) {
    memset(k, 0, sizeof *k);
    k->P = 1; k->steps = 5; k->warmup = 1; k->T = 1024; k->D = 512; k->F = 1792; k->E = 8; k->K = 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) { fprintf(stderr, "bench_scenario: %s needs a value\n", a); exit(2); }
        if (!strcmp(a, "--modes")) {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", v);
            for (char *t = strtok(buf, ","); t && k->nm < MAXMODES; t = strtok(NULL, ",")) {
                int m = !strncmp(t, "fsdp", 4) ? 0 : !strncmp(t, "ep", 2) ? 1 : !strncmp(t, "overlap", 7) ? 2 : -1;
                const char *colon = strchr(t, ':');
                k->mode[k->nm] = m;
                k->C[k->nm] = colon ? atoi(colon + 1) : 2;
                if (m < 0 || k->C[k->nm] < 1 || k->C[k->nm] > MOEPT_MAX_CHUNKS) { fprintf(stderr, "bench_scenario: bad mode %s\n", t); exit(2); }
                k->nm++;
            }
        }
        else if (!strcmp(a, "--ranks")) k->P = atoi(v);
        else if (!strcmp(a, "--steps")) k->steps = atoi(v);
        else if (!strcmp(a, "--warmup")) k->warmup = atoi(v);
        else if (!strcmp(a, "--tokens")) k->T = atoll(v);
        else if (!strcmp(a, "--dim")) k->D = atoll(v);
        else if (!strcmp(a, "--ffn")) k->F = atoll(v);
        else if (!strcmp(a, "--experts")) k->E = atoll(v);
        else if (!strcmp(a, "--topk")) k->K = atoll(v);
        else { fprintf(stderr, "bench_scenario: unknown option %s\n", a); exit(2); }
        i++;
    }
    if (k->nm < 1 || k->steps < 1 || k->steps > MAXSTEPS) {
        fprintf(stderr, "bench_scenario: need --modes, and --steps in 1..%d\n", MAXSTEPS);
        exit(2);
    }
}

int main(int argc, char **argv) {
#ifdef MOEPT_MPI
    MPI_Init(&argc, &argv);
#endif
    bconf k;
    parse(argc, argv, &k);
#ifdef MOEPT_MPI
    bres *all = calloc(BENCH_MAX_RANKS, sizeof *all);
    int me = bench_run_mpi(&k.P, run_rank, &k, all, sizeof *all);
    if (me < 0) MPI_Abort(MPI_COMM_WORLD, 2);
    if (me == 0) sc_report(&k, all, k.P);
    free(all);
    MPI_Finalize();
#else
    bres *all = calloc((size_t)(k.P > 0 ? k.P : 1), sizeof *all);
    if (!bench_run_threads(k.P, run_rank, &k, all, sizeof *all)) return 2;
    sc_report(&k, all, k.P);
    free(all);
#endif
    return 0;
}
