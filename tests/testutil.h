/* Tiny test harness: each test prints "ok - name", "FAIL - name: why" or
   "skip - name: why"; tu_done() prints the totals and gives the exit code. */
#ifndef MOEPT_TESTUTIL_H
#define MOEPT_TESTUTIL_H
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int tu_passed, tu_failed, tu_skipped, tu_bad;
static char tu_msg[1024];

static inline void tu_note(const char *file, int line, const char *fmt, ...) {
    if (getenv("TU_VERBOSE")) { /* every failure to stderr (a rare GPU run) */
        va_list aq;
        va_start(aq, fmt);
        fprintf(stderr, "  %s:%d: ", file, line);
        vfprintf(stderr, fmt, aq);
        fputc('\n', stderr);
        va_end(aq);
    }
    if (tu_bad++) return; /* keep the first failure's message */
    int n = snprintf(tu_msg, sizeof tu_msg, "%s:%d: ", file, line);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tu_msg + n, sizeof tu_msg - (size_t)n, fmt, ap);
    va_end(ap);
}

#define EXPECT(cond, ...) \
    do { if (!(cond)) tu_note(__FILE__, __LINE__, __VA_ARGS__); } while (0)
#define EXPECT_OK(call) \
    do { moept_status s_ = (call); \
         if (s_ != MOEPT_OK) tu_note(__FILE__, __LINE__, "%s -> %s", #call, moept_last_error(NULL)); } while (0)

/* TU_PART=i/n in the environment: this process runs only every n-th test,
   from the i-th (tests/halves.sh runs a slow program's halves at once, a
   core each). A test that reads what the one before it wrote runs through
   tu_run_after, in the same process as that one. A program whose tests
   draw from one random stream sets tu_before to reseed it, so a test's
   inputs do not depend on which tests ran before it. */
static int tu_part_last = 1; /* whether the last test counted was this process's */
static void (*tu_before)(void); /* called before each test this process runs */
static inline int tu_mine(int follow) {
    static int idx;
    int i = 0, n = 1;
    if (follow) return tu_part_last;
    const char *p = getenv("TU_PART");
    tu_part_last = !(p && sscanf(p, "%d/%d", &i, &n) == 2 && n > 1 && i >= 0 && i < n) || idx % n == i;
    idx++;
    return tu_part_last;
}

static inline void tu_run_in(const char *name, void (*fn)(void), int follow) {
    if (!tu_mine(follow)) return;
    tu_bad = 0;
    tu_msg[0] = 0;
    if (tu_before) tu_before();
    fn();
    if (tu_bad) { printf("FAIL - %s: %s\n", name, tu_msg); tu_failed++; }
    else { printf("ok - %s\n", name); tu_passed++; }
    fflush(stdout);
}
static inline void tu_run(const char *name, void (*fn)(void)) { tu_run_in(name, fn, 0); }
static inline void tu_run_after(const char *name, void (*fn)(void)) { tu_run_in(name, fn, 1); }
static inline void tu_skip(const char *name, const char *why) {
    if (!tu_mine(0)) return;
    printf("skip - %s: %s\n", name, why);
    tu_skipped++;
}
static inline int tu_done(void) {
    printf("%d passed, %d failed, %d skipped\n", tu_passed, tu_failed, tu_skipped);
    return tu_failed ? 1 : 0;
}
#define RUN(fn) tu_run(#fn, fn)

/* deterministic uniform(-1, 1) */
static inline double tu_rand(unsigned long long *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*s >> 11) / 4503599627370496.0 - 1.0;
}
/* FNV-1a over the bits of v [n] (a bitwise fingerprint: -0 and NaN payloads count) */
static inline unsigned long long tu_hash(const float *v, long long n) {
    unsigned long long h = 1469598103934665603ull;
    for (long long i = 0; i < n; i++) {
        unsigned int u;
        memcpy(&u, &v[i], 4);
        h = (h ^ u) * 1099511628211ull;
    }
    return h;
}
/* parameter i of any layer (a CUDA layer's buffers live on its device): a malloc'd copy of its
   values (grad 0) or gradient (1), NULL where it has none; *info filled when given */
static inline float *tu_param(const moept_layer *L, int64_t i, int grad, moept_param_info *info) {
    moept_param_info pi;
    if (moept_param_info_at(L, i, &pi) != MOEPT_OK) return NULL;
    if (info) *info = pi;
    const int64_t n = pi.rows * pi.cols;
    float *v = (float *)malloc((size_t)(n + 1) * sizeof(float));
    if (v && (grad ? moept_get_grad(L, pi.name, v, n) : moept_get_param(L, pi.name, v, n)) == MOEPT_OK)
        return v;
    free(v);
    return NULL;
}
/* a malloc'd copy of a layer's whole parameter or gradient buffer (any executor's), *n its floats */
static inline float *tu_buf(const moept_layer *L, moept_buf which, int64_t *n) {
    *n = moept_param_numel(L);
    float *v = (float *)malloc((size_t)(*n + 1) * sizeof(float));
    if (v && moept_buf_read(L, which, 0, *n, v) == MOEPT_OK) return v;
    free(v);
    return NULL;
}
static inline void tu_fill(float *v, long long n, double scale, unsigned long long *s) {
    for (long long i = 0; i < n; i++) v[i] = (float)(scale * tu_rand(s));
}
static inline double tu_relerr(const float *a, const float *b, long long n) {
    double num = 0, den = 0;
    for (long long i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}
/* max |a - b| / max |b| (the reference checker's measure) */
static inline double tu_maxrelerr(const float *a, const float *b, long long n) {
    double num = 0, den = 0;
    for (long long i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]), m = fabs((double)b[i]);
        num = d > num ? d : num;
        den = m > den ? m : den;
    }
    return den > 0 ? num / den : num;
}
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif
/* a rank thread's first call: one OpenMP thread (the ranks share the cores) */
static inline void tu_rank_thread(void) {
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
}
/* fn on n threads at once (n <= 64), fn(jobs + i * job_size) on thread i;
   back when every one has returned */
static inline void tu_threads(int n, void *(*fn)(void *), void *jobs, size_t job_size) {
    pthread_t th[64];
    if (n > 64) { printf("FAIL - tu_threads: %d threads, at most 64\n", n); exit(1); }
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, fn, (char *)jobs + (size_t)i * job_size);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}
#ifdef MOEPT_H
/* Runs fn on P thread ranks of group g (NULL: no group), one job each, and
   waits for them: jobs is an array of P structs of job_size bytes, each
   starting with the group and its rank (`moept_thread_group *g; int r;`),
   filled in here after the job is zeroed (proto NULL) or copied from *proto. */
typedef struct tu_rank { moept_thread_group *g; int r; } tu_rank;
static inline void tu_ranks_on(moept_thread_group *g, int P, void *(*fn)(void *), void *jobs, size_t job_size,
                               const void *proto) {
    for (int r = 0; r < P; r++) {
        tu_rank *j = (tu_rank *)((char *)jobs + (size_t)r * job_size);
        if (proto) memcpy(j, proto, job_size);
        else memset(j, 0, job_size);
        j->g = g; j->r = r;
    }
    tu_threads(P, fn, jobs, job_size);
}
/* the same on a new group of P ranks (timeout_ms), destroyed after */
static inline void tu_ranks(int P, int timeout_ms, void *(*fn)(void *), void *jobs, size_t job_size) {
    moept_thread_group *g = NULL;
    moept_thread_group_create(P, timeout_ms, &g);
    tu_ranks_on(g, P, fn, jobs, job_size, NULL);
    moept_thread_group_destroy(g);
}
/* each job a copy of *proto first, and a group only at P > 1 (at P = 1,
   g NULL: the rank is a layer of its own) */
static inline void tu_ranks_from(int P, int timeout_ms, void *(*fn)(void *), void *jobs, size_t job_size,
                                 const void *proto) {
    moept_thread_group *g = NULL;
    if (P > 1) moept_thread_group_create(P, timeout_ms, &g);
    tu_ranks_on(g, P, fn, jobs, job_size, proto);
    moept_thread_group_destroy(g);
}
#endif

#ifdef MOEPT_EMU_H
/* the bytes the emulated kernels since the last moept_emu_counts_reset stored twice in one launch, the
   router's kernels aside (moept__k_route, _router_bwd, _replay: a token's thread rewrites its scratch):
   a duplicated store, which no comparison of results sees (after a synchronize: the counts land as
   the ops complete) */
static inline long long tu_stored_twice(void) {
    cudaDeviceSynchronize();
    return moept_emu_stored_again(NULL) - moept_emu_stored_again("moept__k_route") -
           moept_emu_stored_again("moept__k_replay");
}
#endif
#endif
