/* The worker of the kill -9 loop (tests/crash.sh): a small DeepSeek-V3 layer
   trains at P EP ranks (threads of this process, or MPI processes when built
   with -DMOEPT_MPI), resuming from the checkpoint in DIR if there is one,
   and saves after every step until it is killed.

     crash_save train DIR P [STEPS]   resume (or start), then STEPS steps
                                      (forever without), a save after each;
                                      rank 0 appends each committed step to
                                      DIR.log
     crash_save verify DIR            the checkpoint loads (checksums,
                                      finiteness, steps) at the EP size it
                                      was saved at; its step is the last one
                                      DIR.log names, or the one after (killed
                                      between the commit and the log); and
                                      parameters, AdamW state and bias equal
                                      a replay from scratch to that step,
                                      bit for bit.

   verify prints one line, "ok ..." or "FAIL ...", with the leftovers a killed
   save left (sets the index does not name, temporary files): the evidence
   that the kill landed inside a save. */
#include "../moept.c"
#include "testutil.h"

#include <dirent.h>
#ifdef MOEPT_MPI
#include <mpi.h>
#endif

enum { T_ = 8, D_ = 12 };

static moept_config crash_cfg(void) {
    moept_config c;
    memset(&c, 0, sizeof c);
    c.family = MOEPT_FAMILY_DEEPSEEK_V3;
    c.hidden_size = D_; c.intermediate_size = 10; c.num_experts = 8; c.top_k = 2;
    c.norm_topk_prob = 1; c.max_tokens = T_; c.shared_intermediate_size = 6;
    c.n_group = 4; c.topk_group = 2;
    c.aux_loss = MOEPT_AUX_HF; c.aux_loss_coef = 0.01f; c.global_balance = 1;
    return c;
}

static void fill(float *v, int n, unsigned long long *s) {
    for (int i = 0; i < n; i++) {
        *s = *s * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    }
}

/* step s (1-based) of rank r: the data depend on both only */
static moept_status train_step(moept_layer *L, int r, int64_t s) {
    static const moept_adamw opt = {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
    float x[T_ * D_], y[T_ * D_], dy[T_ * D_], dx[T_ * D_];
    unsigned long long seed = 1000 + (unsigned long long)s * 31 + (unsigned long long)r;
    fill(x, T_ * D_, &seed);
    fill(dy, T_ * D_, &seed);
    moept_status st;
    moept_zero_grad(L);
    if ((st = moept_forward(L, x, T_, y)) || (st = moept_backward(L, x, dy, dx)) ||
        (st = moept_sync_grads(L, 1.0f)) || (st = moept_adamw_step(L, &opt)))
        return st;
    return moept_update_bias(L, 1e-3f);
}

static int has_index(const char *dir) {
    char p[4096];
    snprintf(p, sizeof p, "%s/index.json", dir);
    return access(p, F_OK) == 0;
}

static void log_step(const char *dir, int64_t s) {
    char p[4096], line[32];
    snprintf(p, sizeof p, "%s.log", dir);
    int fd = open(p, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) return;
    int n = snprintf(line, sizeof line, "%lld\n", (long long)s);
    if (write(fd, line, (size_t)n) == n) fsync(fd);
    close(fd);
}

/* one rank's training: resume or start, then steps, a save after each */
static int train_rank(moept_comm *c, int r, const char *dir, int64_t steps) {
    moept_config cfg = crash_cfg();
    moept_layer *L = NULL;
    moept_status st = moept_create_parallel(&cfg, c, NULL, &L);
    if (!st) st = has_index(dir) ? moept_load_checkpoint(L, dir) : moept_init_params(L, 1);
    if (st) {
        fprintf(stderr, "rank %d: %s\n", r, L ? moept_last_error(L) : moept_last_error(NULL));
        moept_destroy(L);
        return 3;
    }
    for (int64_t i = 0; (steps < 0 || i < steps) && !st; i++) {
        st = train_step(L, r, L->opt.t + 1);
        if (!st) st = moept_save_checkpoint(L, dir);
        if (!st && r == 0) log_step(dir, L->opt.t);
    }
    if (st) fprintf(stderr, "rank %d: %s\n", r, moept_last_error(L));
    moept_destroy(L);
    return st ? 3 : 0;
}

/* ---- threads: P ranks in this process ---- */
typedef struct job {
    moept_thread_group *g;
    int r, P, rc, same;
    const char *dir;
    int64_t steps, step;
    char err[600];
} job;

#ifndef MOEPT_MPI
static void *train_main(void *arg) {
    job *j = arg;
    moept_comm *c = NULL;
    if (j->P > 1) moept_comm_threads(j->g, j->r, &c);
    j->rc = train_rank(c, j->r, j->dir, j->steps);
    moept_comm_destroy(c);
    return NULL;
}
#endif

/* loads the checkpoint, replays its steps from scratch, compares */
static void *verify_main(void *arg) {
    job *j = arg;
    moept_comm *c = NULL;
    if (j->P > 1) moept_comm_threads(j->g, j->r, &c);
    moept_config cfg = crash_cfg();
    moept_layer *L = NULL, *R = NULL;
    moept_status st = moept_create_parallel(&cfg, c, NULL, &L);
    if (!st) st = moept_create_parallel(&cfg, c, NULL, &R);
    if (!st && (st = moept_load_checkpoint(L, j->dir)))
        snprintf(j->err, sizeof j->err, "the checkpoint does not load: %s", moept_last_error(L));
    if (!st) st = moept_init_params(R, 1);
    j->step = L ? L->opt.t : -1;
    for (int64_t s = 1; s <= j->step && !st; s++)
        if ((st = train_step(R, j->r, s))) snprintf(j->err, sizeof j->err, "replay: %s", moept_last_error(R));
    if (!st) {
        size_t n = (size_t)L->par.n_params * sizeof(float);
        j->same = memcmp(L->par.params, R->par.params, n) == 0 && memcmp(L->par.bias, R->par.bias, (size_t)L->E * 4) == 0 &&
                  (j->step == 0 || (memcmp(L->opt.m, R->opt.m, n) == 0 && memcmp(L->opt.v, R->opt.v, n) == 0));
    }
    j->rc = st ? 1 : 0;
    moept_destroy(L);
    moept_destroy(R);
    moept_comm_destroy(c);
    return NULL;
}

static int run_threads(void *(*fn)(void *), const char *dir, int P, int64_t steps, job *js) {
    job proto = {.P = P, .dir = dir, .steps = steps};
    tu_ranks_from(P, 60000, fn, js, sizeof js[0], &proto);
    int rc = 0;
    for (int r = 0; r < P; r++) rc = js[r].rc > rc ? js[r].rc : rc;
    return rc;
}

/* what killed saves left: sets the index does not name, temporaries */
static int leftovers(const char *dir) {
    char set[64] = "", fp[64], p[4096];
    int64_t ep, step;
    moept__read_ckpt_index(dir, &ep, fp, sizeof fp, &step, set, sizeof set, NULL, 0);
    int n = 0;
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));) {
        if (strstr(e->d_name, ".tmp.")) n++;
        if (strncmp(e->d_name, "save-", 5) != 0) continue;
        if (strcmp(e->d_name, set) != 0) { n++; continue; }
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        DIR *s = opendir(p);
        for (struct dirent *f; s && (f = readdir(s));) n += strstr(f->d_name, ".tmp.") != NULL;
        if (s) closedir(s);
    }
    if (d) closedir(d);
    return n;
}

static int64_t last_logged(const char *dir) {
    char p[4096], line[64];
    snprintf(p, sizeof p, "%s.log", dir);
    FILE *f = fopen(p, "r");
    long long s = -1, v;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "%lld", &v) == 1) s = v;
    if (f) fclose(f);
    return s;
}

static int verify(const char *dir) {
    char fp[64], set[64];
    int64_t P = 0, istep;
    int left = leftovers(dir);
    int64_t logged = last_logged(dir);
    if (moept__read_ckpt_index(dir, &P, fp, sizeof fp, &istep, set, sizeof set, NULL, 0) || P < 1 || P > 8) {
        printf("FAIL no readable index.json in %s (last committed step %lld)\n", dir, (long long)logged);
        return 1;
    }
    job js[8];
    int rc = run_threads(verify_main, dir, (int)P, 0, js);
    int64_t s = js[0].step;
    if (rc) printf("FAIL %s (last committed step %lld)\n", js[0].err[0] ? js[0].err : js[P - 1].err,
                   (long long)logged);
    else if (s != logged && s != logged + 1)
        printf("FAIL the checkpoint is of step %lld, the last committed was %lld\n", (long long)s,
               (long long)logged);
    for (int r = 0; !rc && r < P; r++)
        if (!js[r].same) {
            printf("FAIL rank %d: the state of step %lld differs from a replay\n", r, (long long)s);
            rc = 1;
        }
    if (!rc && (s == logged || s == logged + 1))
        printf("ok step %lld (logged %lld) leftovers %d\n", (long long)s, (long long)logged, left);
    return rc || (s != logged && s != logged + 1);
}

int main(int argc, char **argv) {
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
    if (argc >= 3 && strcmp(argv[1], "verify") == 0) return verify(argv[2]);
    if (argc < 4 || strcmp(argv[1], "train") != 0) {
        fprintf(stderr, "usage: crash_save train DIR P [STEPS] | crash_save verify DIR\n");
        return 2;
    }
    const char *dir = argv[2];
    int P = atoi(argv[3]);
    int64_t steps = argc > 4 ? atoll(argv[4]) : -1;
    if (P < 1 || P > 8) return 2;
#ifdef MOEPT_MPI
    MPI_Init(&argc, &argv);
    moept_comm *c = NULL;
    int rc = moept_comm_mpi(MPI_COMM_WORLD, &c) ? 2 : c->size != P ? 2 : 0;
    if (!rc) {
        char pid[4200];
        snprintf(pid, sizeof pid, "%s.pid%d", dir, c->rank); /* for killing one rank only */
        FILE *f = fopen(pid, "w");
        if (f) { fprintf(f, "%ld\n", (long)getpid()); fclose(f); }
        rc = train_rank(P > 1 ? c : NULL, c->rank, dir, steps);
    }
    moept_comm_destroy(c);
    MPI_Finalize();
    return rc;
#else
    job js[8];
    return run_threads(train_main, dir, P, steps, js);
#endif
}
