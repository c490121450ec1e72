/* bench_threads.h: runs a bench's rank function on P ranks, shared by the
   benches: the threads of this process (each with its threads-backend comm)
   or, built with MOEPT_MPI, the MPI processes (every rank's result gathered
   on every rank). */
#ifndef BENCH_THREADS_H
#define BENCH_THREADS_H
#include <pthread.h>

#define BENCH_MAX_RANKS 64

/* k: the bench's config; out: this rank's result slot */
typedef void (*bench_rank_fn)(const void *k, moept_comm *c, void *out);

typedef struct bench_job {
    bench_rank_fn fn;
    const void *k;
    moept_comm *c;
    void *out;
} bench_job;

static void *bench__thread_main(void *a) {
    bench_job *j = a;
    j->fn(j->k, j->c, j->out);
    return NULL;
}

/* outs: P result slots of out_size bytes, zeroed first. Returns 0 (after
   saying why) if P is out of range or the group cannot be made. */
static inline int bench_run_threads(int P, bench_rank_fn fn, const void *k, void *outs, size_t out_size) {
    if (P < 1 || P > BENCH_MAX_RANKS) {
        fprintf(stderr, "bench: --ranks %d not in 1..%d\n", P, BENCH_MAX_RANKS);
        return 0;
    }
    moept_thread_group *g;
    if (moept_thread_group_create(P, 0, &g) != MOEPT_OK) {
        fprintf(stderr, "bench: %s\n", moept_last_error(NULL));
        return 0;
    }
    bench_job jobs[BENCH_MAX_RANKS];
    pthread_t th[BENCH_MAX_RANKS];
    memset(outs, 0, (size_t)P * out_size);
    for (int r = 0; r < P; r++) {
        jobs[r] = (bench_job){fn, k, NULL, (char *)outs + (size_t)r * out_size};
        moept_comm_threads(g, r, &jobs[r].c);
        pthread_create(&th[r], NULL, bench__thread_main, &jobs[r]);
    }
    for (int r = 0; r < P; r++) pthread_join(th[r], NULL);
    moept_thread_group_destroy(g);
    return 1;
}

#ifdef MOEPT_MPI
/* This process is one rank of MPI_COMM_WORLD (MPI initialised by the
   caller). outs: BENCH_MAX_RANKS slots; every rank's result lands in
   outs[rank] on every rank. Returns this rank (or -1, after saying why),
   the world size in *P. */
static inline int bench_run_mpi(int *P, bench_rank_fn fn, const void *k, void *outs, size_t out_size) {
    moept_comm *c;
    if (moept_comm_mpi(MPI_COMM_WORLD, &c) != MOEPT_OK) { fprintf(stderr, "bench: %s\n", moept_last_error(NULL)); return -1; }
    if (c->size > BENCH_MAX_RANKS) {
        fprintf(stderr, "bench: at most %d ranks\n", BENCH_MAX_RANKS);
        moept_comm_destroy(c);
        return -1;
    }
    *P = c->size;
    void *mine = calloc(1, out_size);
    memset(outs, 0, (size_t)c->size * out_size);
    fn(k, c, mine);
    c->allgather(c, mine, outs, (int64_t)out_size);
    free(mine);
    int me = c->rank;
    moept_comm_destroy(c);
    return me;
}
#endif
#endif
