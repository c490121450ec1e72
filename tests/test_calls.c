/* test_calls: every group call is tagged in the agreement, and the
   arguments that must match across ranks are agreed with it.

     build/test_calls                     two ranks as threads (also ASan+UBSan, TSan)
     mpirun -np 2 build/test_calls_mpi    two MPI processes

   The call-pair matrix: for each ordered pair (a, b) of different group
   calls, rank 0 makes a while rank 1 makes b. Both must fail with "call
   sequences differ", the layer (parameters, gradients, bias, placement) and
   the checkpoint directory as they were, and a matching call must work
   right after (the ranks' counts of agreed calls still in step). Then each
   call whose arguments must match, with rank 1's differing: every rank
   fails before anything is written or changed. The same body runs on both
   backends; only uses the public API. */
#include "../moept.h" /* the public API only: linked with moept.o */
#include "testutil.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

enum { NCALL = 10, T = 8 };
static const char *call_name[NCALL] = {"forward", "backward", "sync_grads", "grad_norm", "update_bias",
                                       "adamw_step", "save_checkpoint", "load_checkpoint", "load_hf", "reshard"};

typedef struct rank_ctx {
    moept_layer *L;
    int rank;
    char base[256], ck[300], ck_b[300], hf[300], hf_b[300];
    float x[T * 40], y[T * 40], dy[T * 40], dx[T * 40];
    int32_t placement[8];  /* [E] a valid placement other than the current one */
    int pairs_done, args_done;
    char why[2048];        /* the first failure, empty if none */
} rank_ctx;

static void fail(rank_ctx *c, const char *fmt, ...) {
    if (c->why[0]) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->why, sizeof c->why, fmt, ap);
    va_end(ap);
}

static moept_config calls_cfg(void) {
    moept_config c = moept_config_default(MOEPT_FAMILY_DEEPSEEK_V3); /* has every call: a bias to update */
    c.hidden_size = 40; c.intermediate_size = 24; c.num_experts = 8; c.top_k = 2;
    c.n_group = 4; c.topk_group = 2; c.shared_intermediate_size = 16; c.max_tokens = T;
    return c;
}

/* call k with this rank's arguments (variant 1: rank 1's differing ones) */
static moept_status make_call(rank_ctx *c, int k, int variant) {
    moept_layer *L = c->L;
    double norm;
    moept_adamw o = {variant ? 2e-3f : 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f};
    moept_reshard_report rep;
    int32_t same[8];
    switch (k) {
    case 0: return moept_forward(L, c->x, T, c->y);
    case 1: return moept_backward(L, c->x, c->dy, c->dx);
    case 2: return moept_sync_grads(L, variant ? 0.5f : 1.0f);
    case 3: return moept_grad_norm(L, &norm);
    case 4: return moept_update_bias(L, variant ? 0.02f : 0.01f);
    case 5: return moept_adamw_step(L, &o);
    case 6: return moept_save_checkpoint(L, variant ? c->ck_b : c->ck);
    case 7: return moept_load_checkpoint(L, variant ? c->ck_b : c->ck);
    case 8: return moept_load_hf(L, variant ? c->hf_b : c->hf, 0);
    default:
        if (variant) return moept_reshard(L, c->placement, &rep);
        moept_get_placement(L, same);
        int32_t r0 = same[0]; /* experts 0 and 7 trade ranks: another valid table */
        same[0] = same[7];
        same[7] = r0;
        return moept_reshard(L, same, &rep);
    }
}

static uint64_t hash(uint64_t h, const void *p, size_t n) { /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ull;
    return h;
}

/* the layer's state and the checkpoint directory's entries, for "unchanged" */
typedef struct snap { uint64_t params, grads; int32_t place[8]; char dir[1024]; } snap;
static void take_snap(rank_ctx *c, snap *s) {
    moept_layer *L = c->L;
    s->params = s->grads = 14695981039346656037ull;
    for (int64_t i = 0; i < moept_param_count(L); i++) {
        moept_param_info a;
        moept_param_info_at(L, i, &a);
        if (a.data) s->params = hash(s->params, a.data, (size_t)(a.rows * a.cols) * sizeof(float));
        if (a.grad) s->grads = hash(s->grads, a.grad, (size_t)(a.rows * a.cols) * sizeof(float));
    }
    moept_get_placement(L, s->place);
    s->dir[0] = 0;
    const char *dirs[3] = {c->base, c->ck, c->ck_b};
    for (int i = 0; i < 3; i++) { /* (in the file system's order: the same for the same entries) */
        DIR *d = opendir(dirs[i]);
        for (struct dirent *e; d && (e = readdir(d));)
            if (strlen(s->dir) + strlen(e->d_name) + 2 < sizeof s->dir) {
                strcat(s->dir, e->d_name);
                strcat(s->dir, " ");
            }
        if (d) closedir(d);
        strcat(s->dir, "| ");
    }
}
static int snap_same(const snap *a, const snap *b) {
    return a->params == b->params && a->grads == b->grads && !memcmp(a->place, b->place, sizeof a->place) &&
           !strcmp(a->dir, b->dir);
}

/* A forward and backward, so that every call has what it needs */
static moept_status step(rank_ctx *c) {
    moept_status st = moept_zero_grad(c->L);
    if (!st) st = moept_forward(c->L, c->x, T, c->y);
    if (!st) st = moept_backward(c->L, c->x, c->dy, c->dx);
    if (!st) st = moept_sync_grads(c->L, 1.0f); /* (adamw_step refuses unsynced gradients) */
    return st;
}

/* The matrix: (a, b) for every a != b, then a matching call */
static void pairs(rank_ctx *c) {
    for (int a = 0; a < NCALL && !c->why[0]; a++)
        for (int b = 0; b < NCALL && !c->why[0]; b++) {
            if (a == b) continue;
            snap s0, s1;
            take_snap(c, &s0);
            moept_status st = make_call(c, c->rank == 0 ? a : b, 0);
            const char *msg = moept_last_error(c->L);
            if (st != MOEPT_ERR_STATE || !strstr(msg, "call sequences differ"))
                fail(c, "rank %d, %s against %s: status %d (%s)", c->rank, call_name[c->rank ? b : a],
                     call_name[c->rank ? a : b], (int)st, msg);
            take_snap(c, &s1);
            if (!snap_same(&s0, &s1))
                fail(c, "rank %d, %s against %s: the layer or the checkpoint directory changed", c->rank,
                     call_name[c->rank ? b : a], call_name[c->rank ? a : b]);
            double norm;
            c->pairs_done++;
            if ((st = moept_grad_norm(c->L, &norm)))
                fail(c, "rank %d, after %s/%s: a matching call failed: %s", c->rank, call_name[a], call_name[b],
                     moept_last_error(c->L));
        }
}

/* Each call whose arguments must match, rank 1's differing */
static void arguments(rank_ctx *c) {
    static const int k_args[] = {2, 4, 5, 6, 7, 8, 9};
    for (size_t i = 0; i < sizeof k_args / sizeof k_args[0] && !c->why[0]; i++) {
        int k = k_args[i];
        if (step(c)) { fail(c, "rank %d: step: %s", c->rank, moept_last_error(c->L)); break; }
        snap s0, s1;
        take_snap(c, &s0);
        moept_status st = make_call(c, k, c->rank == 1);
        const char *msg = moept_last_error(c->L);
        if (st != MOEPT_ERR_INVALID_ARGUMENT || !strstr(msg, "passed different"))
            fail(c, "rank %d, %s with another rank's arguments differing: status %d (%s)", c->rank,
                 call_name[k], (int)st, msg);
        take_snap(c, &s1);
        c->args_done++;
        if (!snap_same(&s0, &s1))
            fail(c, "rank %d, %s with differing arguments: the layer or the checkpoint directory changed "
                 "(entries before: %s; after: %s)", c->rank, call_name[k], s0.dir, s1.dir);
    }
    /* one directory named two ways is the same directory */
    char alias[400];
    snprintf(alias, sizeof alias, "%s/./ck", c->base);
    if (!c->why[0] && moept_load_checkpoint(c->L, c->rank ? alias : c->ck))
        fail(c, "rank %d: one checkpoint named two ways: %s", c->rank, moept_last_error(c->L));
}

/* rank 0 writes the Hugging Face files both ranks load (a one-rank layer
   of the same seed: the same values) */
static moept_status write_hf(rank_ctx *c) {
    moept_config cfg = calls_cfg();
    moept_layer *one = NULL;
    char path[400];
    moept_status st = moept_create(&cfg, &one);
    for (int seed = 0; seed < 2 && !st; seed++) {
        st = moept_init_params(one, 11 + (uint64_t)seed);
        mkdir(seed ? c->hf_b : c->hf, 0755);
        snprintf(path, sizeof path, "%s/model.safetensors", seed ? c->hf_b : c->hf);
        if (!st) st = moept_save_hf(one, path, 0, 1);
    }
    moept_destroy(one);
    return st;
}

/* one rank's whole run; sync(): a barrier between the set-up's phases */
static void run_rank(rank_ctx *c, moept_comm *comm, void (*sync)(void *), void *arg) {
    moept_config cfg = calls_cfg();
    unsigned long long seed = 5 + (unsigned long long)c->rank;
    tu_fill(c->x, T * 40, 1.0, &seed);
    tu_fill(c->dy, T * 40, 1.0, &seed);
    snprintf(c->ck, sizeof c->ck, "%s/ck", c->base);
    snprintf(c->ck_b, sizeof c->ck_b, "%s/ck_b", c->base);
    snprintf(c->hf, sizeof c->hf, "%s/hf", c->base);
    snprintf(c->hf_b, sizeof c->hf_b, "%s/hf_b", c->base);
    if (c->rank == 0) { mkdir(c->base, 0755); if (write_hf(c)) fail(c, "hf: %s", moept_last_error(NULL)); }
    sync(arg);
    if (moept_create_parallel(&cfg, comm, NULL, &c->L)) { fail(c, "create: %s", moept_last_error(NULL)); return; }
    moept_status st = moept_init_params(c->L, 3);
    if (!st) st = moept_load_hf(c->L, c->hf, 0); /* both HF sets load */
    if (!st) st = moept_load_hf(c->L, c->hf_b, 0);
    if (!st) st = step(c);
    if (!st) st = moept_save_checkpoint(c->L, c->ck_b);
    if (!st) st = moept_init_params(c->L, 4);
    if (!st) st = moept_save_checkpoint(c->L, c->ck); /* ck and ck_b differ */
    if (!st) st = step(c);
    if (st) { fail(c, "rank %d: set-up: %s", c->rank, moept_last_error(c->L)); }
    for (int e = 0; e < 8; e++) c->placement[e] = (int32_t)(e % 2); /* valid, unlike create's blocks */
    if (!c->why[0]) pairs(c);
    if (!c->why[0]) arguments(c);
    if (!c->why[0] && (c->pairs_done != NCALL * (NCALL - 1) || c->args_done != 7))
        fail(c, "rank %d: %d pairs and %d argument checks made", c->rank, c->pairs_done, c->args_done);
    moept_destroy(c->L);
}

#ifndef MOEPT_MPI
typedef struct tjob { moept_thread_group *g; int r; rank_ctx c; } tjob;
static pthread_barrier_t g_bar;
static void thread_sync(void *arg) { (void)arg; pthread_barrier_wait(&g_bar); }
static void *thread_main(void *arg) {
    tjob *j = arg;
    moept_comm *comm = NULL;
    j->c.rank = j->r;
    snprintf(j->c.base, sizeof j->c.base, "/tmp/moept_test_calls.%ld", (long)getpid());
    if (moept_comm_threads(j->g, j->r, &comm)) { fail(&j->c, "comm: %s", moept_last_error(NULL)); return NULL; }
    run_rank(&j->c, comm, thread_sync, NULL);
    moept_comm_destroy(comm);
    return NULL;
}

static tjob g_jobs[2];
static void test_calls_threads(void) {
    pthread_barrier_init(&g_bar, NULL, 2);
    tu_ranks(2, 10000, thread_main, g_jobs, sizeof g_jobs[0]);
    pthread_barrier_destroy(&g_bar);
    for (int r = 0; r < 2; r++) EXPECT(!g_jobs[r].c.why[0], "%s", g_jobs[r].c.why);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_jobs[0].c.base);
    if (system(cmd)) EXPECT(0, "could not remove %s", g_jobs[0].c.base);
}

/* EP 2 x DP 2: the EP groups are {0,1} and {2,3}, the DP groups {0,2} and
   {1,3}; rank 3 alone passes another lr. Rank 1's EP group and DP group
   each hold one differing rank, rank 0's neither: every rank must still fail
   (the difference found in one group's round carries into the next). */
typedef struct lj { int r; moept_thread_group *ep, *dp; moept_status st; char msg[600]; } lj;
static void *layout_main(void *arg) {
    lj *j = arg;
    moept_comm *ep = NULL, *dp = NULL;
    moept_config cfg = calls_cfg();
    moept_layer *L = NULL;
    float x[T * 40], y[T * 40], dy[T * 40], dx[T * 40];
    unsigned long long seed = 9 + (unsigned long long)j->r;
    tu_fill(x, T * 40, 1.0, &seed);
    tu_fill(dy, T * 40, 1.0, &seed);
    moept_comm_threads(j->ep, j->r % 2, &ep);
    moept_comm_threads(j->dp, j->r / 2, &dp);
    j->st = moept_create_parallel(&cfg, ep, dp, &L);
    if (!j->st) j->st = moept_init_params(L, 3);
    if (!j->st) j->st = moept_forward(L, x, T, y);
    if (!j->st) j->st = moept_backward(L, x, dy, dx);
    if (!j->st) j->st = moept_sync_grads(L, 1.0f);
    if (!j->st) {
        moept_adamw o = {j->r == 3 ? 2e-3f : 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f};
        j->st = moept_adamw_step(L, &o);
        snprintf(j->msg, sizeof j->msg, "%s", moept_last_error(L));
    } else {
        snprintf(j->msg, sizeof j->msg, "set-up: %s", moept_last_error(L));
        j->st = MOEPT_ERR_STATE;
    }
    moept_destroy(L);
    moept_comm_destroy(ep);
    moept_comm_destroy(dp);
    return NULL;
}
static void test_layout(void) {
    moept_thread_group *eg[2], *dg[2];
    for (int i = 0; i < 2; i++) {
        moept_thread_group_create(2, 10000, &eg[i]);
        moept_thread_group_create(2, 10000, &dg[i]);
    }
    lj js[4];
    for (int r = 0; r < 4; r++) {
        memset(&js[r], 0, sizeof js[r]);
        js[r].r = r; js[r].ep = eg[r / 2]; js[r].dp = dg[r % 2];
    }
    tu_threads(4, layout_main, js, sizeof js[0]);
    for (int r = 0; r < 4; r++)
        EXPECT(js[r].st == MOEPT_ERR_INVALID_ARGUMENT && strstr(js[r].msg, "passed different"),
               "rank %d: status %d (%s)", r, (int)js[r].st, js[r].msg);
    for (int i = 0; i < 2; i++) {
        moept_thread_group_destroy(eg[i]);
        moept_thread_group_destroy(dg[i]);
    }
}

int main(void) {
    tu_run("an lr differing on one rank of EP 2 x DP 2 fails all four ranks (threads)", test_layout);
    tu_run("every pair of different group calls fails on both ranks, and differing arguments fail every "
           "rank before anything changes (threads, EP=2)", test_calls_threads);
    return tu_done();
}
#else
static void mpi_sync(void *arg) {
    moept_comm *w = arg;
    int64_t v = 0;
    w->allreduce(w, &v, 1, MOEPT_DTYPE_I64);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    moept_comm *world = NULL;
    if (moept_comm_mpi(MPI_COMM_WORLD, &world)) { fprintf(stderr, "%s\n", moept_last_error(NULL)); return 2; }
    if (world->size != 2) {
        if (world->rank == 0) printf("skip - call pairs and arguments (MPI): needs -np 2\n");
        moept_comm_destroy(world);
        MPI_Finalize();
        return 0;
    }
    static rank_ctx c;
    c.rank = world->rank;
    int64_t pid = world->rank == 0 ? (int64_t)getpid() : 0; /* rank 0's names the directory */
    world->allreduce(world, &pid, 1, MOEPT_DTYPE_I64);
    snprintf(c.base, sizeof c.base, "/tmp/moept_test_calls_mpi.%lld", (long long)pid);
    run_rank(&c, world, mpi_sync, world);
    int64_t bad = c.why[0] != 0;
    if (bad) fprintf(stderr, "%s\n", c.why);
    world->allreduce(world, &bad, 1, MOEPT_DTYPE_I64);
    if (world->rank == 0) {
        printf("%s - every pair of different group calls fails on both ranks, and differing arguments fail "
               "every rank before anything changes (MPI, EP=2)\n", bad ? "FAIL" : "ok");
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf %s", c.base);
        if (system(cmd)) bad = 1;
    }
    moept_comm_destroy(world);
    MPI_Finalize();
    return bad != 0;
}
#endif
