/* test_overlap: the chunked overlap (config.overlap_chunks = C) gives
   bitwise the same outputs, input gradients, parameter gradients and losses
   as C = 1, over several steps, at EP = 1, 2 and 4, in fp32 and in FP8
   (config.fp8: a chunk's rows quantized as the whole step's, the wgrad's
   tiles down each expert's rows once every chunk is in).

     build/test_overlap                       threads (EP = 1, 2, 4)
     mpirun -np N build/test_overlap_mpi      MPI processes (EP = N)

   Each rank builds both layers from the same seed, feeds both the same
   tokens (uneven per rank, some ranks with none in one step) and compares
   with memcmp. */
#include "../moept.h" /* the public API only: linked with moept.o */
#include "testutil.h"

#include <pthread.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct job {
    moept_thread_group *g; int r; /* threads: the group (NULL: EP = 1) and rank (tu_ranks_on) */
    moept_comm *ep;
    moept_config cfg;
    int C;
    int64_t T[3];       /* tokens of this rank in each step */
    char why[1200];     /* empty: equal */
} job;

static void run_job(job *j) {
    moept_layer *A = NULL, *B = NULL;
    moept_config ca = j->cfg, cb = j->cfg;
    ca.overlap_chunks = 1;
    cb.overlap_chunks = j->C;
    j->why[0] = 0;
    /* (FP8: C = 1 over messages too, so both send FP8 records and count the same bytes; the shared
       rows take the quantized rows as floats) */
    moept_status (*shm)(moept_comm *, int64_t, void **, void **) =
        j->ep && j->cfg.fp8 ? j->ep->shm_alloc : NULL;
    if (shm) j->ep->shm_alloc = NULL;
    moept_status st = moept_create_parallel(&ca, j->ep, NULL, &A);
    if (shm) j->ep->shm_alloc = shm;
    if (st || moept_create_parallel(&cb, j->ep, NULL, &B)) {
        snprintf(j->why, sizeof j->why, "create: %s", moept_last_error(NULL));
        moept_destroy(A);
        return;
    }
    moept_init_params(A, 77);
    moept_init_params(B, 77);
    const int64_t D = j->cfg.hidden_size, Tmax = j->cfg.max_tokens, rank = j->ep ? j->ep->rank : 0;
    float *x = malloc((size_t)(Tmax * D + 1) * 4), *dy = malloc((size_t)(Tmax * D + 1) * 4);
    float *ya = malloc((size_t)(Tmax * D + 1) * 4), *yb = malloc((size_t)(Tmax * D + 1) * 4);
    float *da = malloc((size_t)(Tmax * D + 1) * 4), *db = malloc((size_t)(Tmax * D + 1) * 4);
    unsigned long long seed = 1000 + (unsigned long long)rank;
    for (int step = 0; step < 3 && !j->why[0]; step++) {
        int64_t T = j->T[step];
        tu_fill(x, T * D, 1.0, &seed);
        tu_fill(dy, T * D, 1.0, &seed);
        moept_zero_grad(A);
        moept_zero_grad(B);
        if (moept_forward(A, x, T, ya) || moept_forward(B, x, T, yb) || moept_backward(A, x, dy, da) ||
            moept_backward(B, x, dy, db) || moept_sync_grads(A, 1.0f) || moept_sync_grads(B, 1.0f)) {
            snprintf(j->why, sizeof j->why, "step %d: %s | %s", step, moept_last_error(A),
                     moept_last_error(B));
            break;
        }
        const size_t bytes = (size_t)(T * D) * 4;
        if (memcmp(ya, yb, bytes)) snprintf(j->why, sizeof j->why, "step %d: outputs differ", step);
        else if (memcmp(da, db, bytes)) snprintf(j->why, sizeof j->why, "step %d: dx differs", step);
        float *ga = NULL, *gb = NULL;
        int64_t n = 0;
        moept_grads(A, &ga, &n);
        moept_grads(B, &gb, &n);
        if (!j->why[0] && memcmp(ga, gb, (size_t)n * 4)) {
            int64_t i = 0;
            while (ga[i] == gb[i]) i++;
            snprintf(j->why, sizeof j->why, "step %d: gradient %lld differs (%.9g vs %.9g)", step,
                     (long long)i, ga[i], gb[i]);
        }
        moept_stats sa, sb;
        moept_get_stats(A, &sa, NULL);
        moept_get_stats(B, &sb, NULL);
        if (!j->why[0] &&
            (sa.aux_loss != sb.aux_loss || sa.z_loss != sb.z_loss || sa.bytes_sent != sb.bytes_sent))
            snprintf(j->why, sizeof j->why, "step %d: losses or byte counts differ", step);
        /* the optimizer step keeps both on the same parameters */
        moept_adamw o = {1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f};
        moept_adamw_step(A, &o);
        moept_adamw_step(B, &o);
    }
    moept_stats sb;
    moept_get_stats(B, &sb, NULL);
    if (!j->why[0] && sb.steps != 3)
        snprintf(j->why, sizeof j->why, "%lld steps counted", (long long)sb.steps);
    free(x); free(dy); free(ya); free(yb); free(da); free(db);
    moept_destroy(A);
    moept_destroy(B);
}

static const char *g_names[8] = {"mixtral", "qwen2_moe+shared", "deepseek_v3 groups+shared",
                                 "olmoe capacity gelu", "fp8 mixtral", "fp8 qwen2_moe+shared",
                                 "fp8 deepseek_v3 groups+shared", "fp8 olmoe capacity gelu"};

/* variant v % 4 the family, v / 4 config.fp8 (wide enough for a full 128-tile and an edge) */
static moept_config make_cfg(int variant) {
    moept_config c = {0};
    if (variant >= 4) {
        c = make_cfg(variant - 4);
        c.fp8 = MOEPT_FP8_BLOCKWISE;
        c.hidden_size = 136;
        return c;
    }
    c.hidden_size = 24; c.intermediate_size = 20; c.num_experts = 8; c.top_k = 2;
    c.norm_topk_prob = 1; c.aux_loss = MOEPT_AUX_HF; c.aux_loss_coef = 0.01f; c.z_loss_coef = 1e-3f;
    c.max_tokens = 150; c.global_balance = 1;
    switch (variant) {
    case 0: c.family = MOEPT_FAMILY_MIXTRAL; break;
    case 1: c.family = MOEPT_FAMILY_QWEN2_MOE; c.shared_intermediate_size = 16; break;
    case 2: c.family = MOEPT_FAMILY_DEEPSEEK_V3; c.n_group = 4; c.topk_group = 2; c.top_k = 3;
            c.shared_intermediate_size = 12; c.routed_scaling_factor = 2.0f; c.aux_loss = MOEPT_AUX_MEGATRON;
            break;
    default: c.family = MOEPT_FAMILY_OLMOE; c.capacity_factor = 0.8f; c.activation = MOEPT_ACT_GELU; break;
    }
    return c;
}

/* uneven: rank r of P has 150 - 37 r tokens, none in the middle step on the last rank */
static void set_tokens(job *j, int r, int P) {
    j->T[0] = 150 - 37 * (r % 4); j->T[1] = r == P - 1 && P > 1 ? 0 : 97; j->T[2] = 5 + r;
}

#ifndef MOEPT_MPI
static void *thread_main(void *arg) {
    job *j = arg;
    tu_rank_thread();
    if (moept_comm_threads(j->g, j->r, &j->ep)) {
        snprintf(j->why, sizeof j->why, "comm: %s", moept_last_error(NULL));
        return NULL;
    }
    set_tokens(j, j->r, j->ep->size);
    run_job(j);
    return NULL;
}

static int g_P, g_C, g_variant;
static void test_case(void) {
    job jobs[4], proto = {.cfg = make_cfg(g_variant), .C = g_C};
    if (g_P == 1) { /* one rank, on this thread */
        jobs[0] = proto;
        set_tokens(&jobs[0], 0, 1);
        run_job(&jobs[0]);
    } else {
        tu_ranks_from(g_P, 60000, thread_main, jobs, sizeof jobs[0], &proto);
    }
    for (int r = 0; r < g_P; r++) EXPECT(!jobs[r].why[0], "rank %d: %s", r, jobs[r].why);
}

int main(void) {
    int Ps[3] = {1, 2, 4}, Cs[3] = {2, 3, 4};
    for (int v = 0; v < 8; v++)
        for (int p = 0; p < 3; p++) {
            char name[160];
            g_variant = v; g_P = Ps[p]; g_C = Cs[(v + p) % 3];
            snprintf(name, sizeof name, "overlap C=%d equals C=1 bitwise: %s, EP=%d (threads)", g_C,
                     g_names[v], g_P);
            tu_run(name, test_case);
        }
    return tu_done();
}
#else
/* Ranks in different calls (rank 0 forward, the others backward) fail
   with "call sequences differ" on every rank instead of waiting in each
   other's collectives (MPI has no timeout: run.sh's turns a hang into a
   failure); matching calls then work. */
static int mpi_call_mismatch(moept_comm *world) {
    if (world->size < 2) {
        if (world->rank == 0) printf("skip - ranks in different calls (MPI): needs 2 ranks or more\n");
        return 0;
    }
    moept_config cfg = make_cfg(0);
    moept_layer *L = NULL;
    int64_t bad = moept_create_parallel(&cfg, world, NULL, &L) != MOEPT_OK;
    const int64_t T = 16, D = cfg.hidden_size;
    float *x = calloc((size_t)(T * D), 4), *y = calloc((size_t)(T * D), 4), *dx = calloc((size_t)(T * D), 4);
    for (int64_t i = 0; i < T * D; i++) x[i] = 0.01f * (float)((i * 7 + world->rank) % 13);
    moept_status st = MOEPT_OK;
    if (!bad) bad = moept_forward(L, x, T, y) != MOEPT_OK;
    if (!bad) {
        st = world->rank == 0 ? moept_forward(L, x, T, y) : moept_backward(L, x, x, dx);
        bad = st != MOEPT_ERR_STATE || !strstr(moept_last_error(L), "call sequences differ");
        if (bad) fprintf(stderr, "rank %d: status %d (%s)\n", world->rank, (int)st, moept_last_error(L));
    }
    if (!bad) bad = moept_backward(L, x, x, dx) != MOEPT_OK;
    int64_t any = bad;
    world->allreduce(world, &any, 1, MOEPT_DTYPE_I64);
    if (world->rank == 0)
        printf("%s - forward on one rank, backward on the others: all fail, tagged (MPI, EP=%d)\n",
               any ? "FAIL" : "ok", world->size);
    moept_destroy(L);
    free(x); free(y); free(dx);
    return any != 0;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    moept_comm *world = NULL;
    if (moept_comm_mpi(MPI_COMM_WORLD, &world)) { fprintf(stderr, "%s\n", moept_last_error(NULL)); return 2; }
    int bad = 0;
    for (int v = 0; v < 8; v++)
        for (int C = 2; C <= 4; C += 2) {
            job j;
            memset(&j, 0, sizeof j);
            j.ep = world; j.cfg = make_cfg(v); j.C = C;
            int r = world->rank, P = world->size;
            set_tokens(&j, r, P);
            run_job(&j);
            /* every rank's verdict */
            int64_t mine = j.why[0] != 0, any = mine;
            world->allreduce(world, &any, 1, MOEPT_DTYPE_I64);
            if (mine) fprintf(stderr, "rank %d: %s\n", r, j.why);
            if (r == 0)
                printf("%s - overlap C=%d equals C=1 bitwise: %s, EP=%d (MPI)\n", any ? "FAIL" : "ok", C,
                       g_names[v], P);
            bad |= any != 0;
        }
    bad |= mpi_call_mismatch(world);
    moept_comm_destroy(world);
    MPI_Finalize();
    return bad;
}
#endif
