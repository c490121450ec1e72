/* bench_a2a: the expert exchange of one MoE layer against a raw all-to-all-v
   of the same bytes, measured in the same run.

   Each of P ranks routes T tokens (D, K, E as below; a tiny expert FFN so
   the step is all exchange) and runs forward+backward. moept's time is
   dispatch + combine, forward and backward (permute, the four exchanges,
   the weighted sums), from the layer's stage timers. The baseline moves the
   same per-peer bytes with the backend's plain all-to-all-v (MPI_Alltoallv
   over MPI; the threads backend's own over threads), four times, from
   buffers already in order. Steps and baseline alternate. Reports the
   slowest rank, algbw (bytes a rank sends per exchange / time) and busbw
   (algbw * (P-1)/P), and checks that the bytes moved equal the routed rows
   x D x 4 exactly.

   usage: bench_a2a [--ranks P] [--tokens T] [--hidden D] [--experts E]
                    [--topk K] [--ffn F] [--reps R]  (threads)
          mpirun -np P bench_a2a_mpi [same options]  (MPI)          */
#include "../moept.c"

#include "bench_threads.h"

typedef struct a2a_cfg { int P, reps; int64_t T, D, E, K, F; } a2a_cfg;
typedef struct a2a_res { double moept, raw, wait; int64_t routed, peer_sum; int bytes_ok; } a2a_res;

static int a2a_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, a2a_cmp);
    return v[n / 2];
}

/* the baseline: one plain all-to-all-v of rows (counts in floats) */
static double raw_exchange(moept_comm *c, float *send, float *recv, const int64_t *sent, const int64_t *recvd, int64_t D) {
    int P = c->size;
    moept_seg ss[64], rs[64];
    int64_t so = 0, ro = 0;
    for (int q = 0; q < P; q++) {
        ss[q] = (moept_seg){so * D, sent[q] * D};
        rs[q] = (moept_seg){ro * D, recvd[q] * D};
        so += sent[q]; ro += recvd[q];
    }
    double t0 = moept__now();
#ifdef MOEPT_MPI
    moept__mpi *m = c->ctx;
    int sc[64], sd[64], rc[64], rd[64];
    for (int q = 0; q < P; q++) {
        sc[q] = (int)ss[q].count; sd[q] = (int)ss[q].offset;
        rc[q] = (int)rs[q].count; rd[q] = (int)rs[q].offset;
    }
    MPI_Alltoallv(send, sc, sd, MPI_FLOAT, recv, rc, rd, MPI_FLOAT, m->comm);
#else
    c->alltoallv(c, send, ss, recv, rs, 1, 4);
#endif
    return moept__now() - t0;
}

static void rank_run(const void *kv, moept_comm *c, void *outv) {
    const a2a_cfg *k = kv;
    a2a_res *out = outv;
#ifdef _OPENMP
    omp_set_num_threads(1); /* one core per rank */
#endif
    moept_config mc = {0};
    mc.family = MOEPT_FAMILY_MIXTRAL;
    mc.hidden_size = k->D; mc.intermediate_size = k->F; mc.num_experts = k->E; mc.top_k = k->K;
    mc.norm_topk_prob = 1; mc.max_tokens = k->T;
    moept_layer *L;
    if (moept_create_parallel(&mc, c, NULL, &L)) { fprintf(stderr, "%s\n", moept_last_error(NULL)); exit(1); }
    moept_init_params(L, 1);
    int64_t n = k->T * k->D;
    float *x = malloc((size_t)n * 4), *dy = malloc((size_t)n * 4), *y = malloc((size_t)n * 4), *dx = malloc((size_t)n * 4);
    uint64_t s = 11 + (uint64_t)c->rank;
    for (int64_t i = 0; i < n; i++) {
        x[i] = (float)((double)(moept__mix(&s) >> 11) / 9007199254740992.0 * 2 - 1);
        dy[i] = x[i] * 1e-3f;
    }
    double *tm = malloc((size_t)k->reps * 8), *tr = malloc((size_t)k->reps * 8), *tw = malloc((size_t)k->reps * 8);
    int64_t sent[64], recvd[64];
    float *sb = NULL, *rb = NULL;
    for (int r = -2; r < k->reps; r++) {
        moept_forward(L, x, k->T, y);
        moept_backward(L, x, dy, dx);
        moept_stats st;
        moept_get_stats(L, &st, NULL);
        if (r == -2) {
            moept_get_peer_rows(L, sent, recvd);
            int64_t ns = 0, nr = 0;
            for (int q = 0; q < c->size; q++) { ns += sent[q]; nr += recvd[q]; }
            int64_t big = (ns > nr ? ns : nr) * k->D;
            sb = calloc((size_t)big + 1, 4); rb = calloc((size_t)big + 1, 4);
            out->routed = st.routed_rows;
            out->peer_sum = ns;
            /* four exchanges: each direction twice */
            out->bytes_ok = ns == st.routed_rows &&
                            st.bytes_sent == 2 * (st.rows_sent + st.rows_received) * k->D * 4 &&
                            st.bytes_received == st.bytes_sent;
        }
        /* the same four exchanges, plain: dispatch, combine, and backward */
        double t = raw_exchange(c, sb, rb, sent, recvd, k->D) + raw_exchange(c, rb, sb, recvd, sent, k->D) +
                   raw_exchange(c, sb, rb, sent, recvd, k->D) + raw_exchange(c, rb, sb, recvd, sent, k->D);
        if (r >= 0) { tm[r] = st.dispatch_seconds + st.combine_seconds; tr[r] = t; tw[r] = st.comm_seconds; }
    }
    out->moept = median(tm, k->reps);
    out->raw = median(tr, k->reps);
    out->wait = median(tw, k->reps);
    free(tm); free(tr); free(tw); free(sb); free(rb); free(x); free(dy); free(y); free(dx);
    moept_destroy(L);
}

/* prints the RESULT line; returns whether every rank moved exactly its rows' bytes */
static int a2a_report(const char *backend, const a2a_cfg *k, a2a_res *all) {
    double sm = 0, sr = 0, sw = 0;
    int slow = 0;
    for (int r = 0; r < k->P; r++) {
        if (all[r].moept > sm) { sm = all[r].moept; slow = r; sw = all[r].wait; }
        if (all[r].raw > sr) sr = all[r].raw;
    }
    /* bytes one rank sends per exchange: its routed rows (own piece too, as
       an all-to-all buffer), averaged over ranks */
    double bytes = 0;
    int ok = 1;
    for (int r = 0; r < k->P; r++) { bytes += (double)all[r].routed * k->D * 4; ok &= all[r].bytes_ok; }
    bytes /= k->P;
    double algbw_m = 4 * bytes / sm / 1e9, algbw_r = 4 * bytes / sr / 1e9, f = (k->P - 1.0) / k->P;
    printf("RESULT backend=%s ranks=%d tokens=%lld hidden=%lld experts=%lld topk=%lld ffn=%lld reps=%d "
           "moept_ms=%.2f comm_calls_ms=%.2f raw_ms=%.2f ratio=%.3f algbw_moept=%.2f busbw_moept=%.2f algbw_raw=%.2f busbw_raw=%.2f "
           "slowest_rank=%d bytes_per_exchange=%.0f bytes_exact=%s\n",
           backend, k->P, (long long)k->T, (long long)k->D, (long long)k->E, (long long)k->K, (long long)k->F,
           k->reps, sm * 1e3, sw * 1e3, sr * 1e3,
           sm / sr, algbw_m, algbw_m * f, algbw_r, algbw_r * f, slow, bytes, ok ? "yes" : "NO");
    return ok;
}

int main(int argc, char **argv) {
#ifdef MOEPT_MPI
    MPI_Init(&argc, &argv);
#endif
    a2a_cfg k = {4, 9, 4096, 1024, 8, 2, 16};
    for (int i = 1; i + 1 < argc; i += 2) {
        long long v = atoll(argv[i + 1]);
        if (!strcmp(argv[i], "--ranks")) k.P = (int)v;
        else if (!strcmp(argv[i], "--tokens")) k.T = v;
        else if (!strcmp(argv[i], "--hidden")) k.D = v;
        else if (!strcmp(argv[i], "--experts")) k.E = v;
        else if (!strcmp(argv[i], "--topk")) k.K = v;
        else if (!strcmp(argv[i], "--reps")) k.reps = (int)v;
        else if (!strcmp(argv[i], "--ffn")) k.F = v;
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
#ifdef MOEPT_MPI
    a2a_res all[BENCH_MAX_RANKS];
    int me = bench_run_mpi(&k.P, rank_run, &k, all, sizeof all[0]);
    if (me < 0) MPI_Abort(MPI_COMM_WORLD, 2);
    int exact = me != 0 || a2a_report("mpi", &k, all);
    MPI_Finalize();
#else
    a2a_res all[BENCH_MAX_RANKS];
    if (!bench_run_threads(k.P, rank_run, &k, all, sizeof all[0])) return 2;
    int exact = a2a_report("threads", &k, all);
#endif
    return exact ? 0 : 1;
}
