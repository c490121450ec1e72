/* bench_threads.h: runs one function on P ranks, the threads of this
   process, each with its threads-backend comm; shared by the benches. */
#ifndef BENCH_THREADS_H
#define BENCH_THREADS_H
#include <pthread.h>

#define BENCH_MAX_RANKS 64

typedef struct bench_job {
    const void *k;   /* the bench's config */
    moept_comm *c;   /* this rank's comm */
    void *out;       /* this rank's result slot */
} bench_job;

/* fn gets a bench_job*; outs is an array of P result slots of out_size
   bytes, zeroed first. Returns 0 (after saying why) if P is out of range. */
static inline int bench_run_threads(int P, void *(*fn)(void *), const void *k, void *outs, size_t out_size) {
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
        jobs[r].k = k;
        jobs[r].out = (char *)outs + (size_t)r * out_size;
        moept_comm_threads(g, r, &jobs[r].c);
        pthread_create(&th[r], NULL, fn, &jobs[r]);
    }
    for (int r = 0; r < P; r++) pthread_join(th[r], NULL);
    moept_thread_group_destroy(g);
    return 1;
}
#endif
