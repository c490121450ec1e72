/* bench_q8: config.fp8's quantizing passes (moept_kernels.cu's moept__k_q8_*, and moept__k_combine_bwd8:
   combine' with dy's records; its unit included: a white box) at a layer's shapes, each launched as the
   layer launches it and timed with CUDA events, against a
   device-to-device copy of the bytes it reads in the same run. Per pass: its bytes read and written, its
   time, its rate (bytes read + written a second) and that rate over the copy's (2 x the bytes read over
   the copy's time).

   The routed rows n = T K split evenly over the E experts. Which passes a step runs depends on the GEMM
   form (the column "form"):
     both:       the dispatches' FP8 records (one launch each): the forward's of x, and combine''s
                 of dy (each row times its routing weight as read), which reads the expert's output
                 row too for dL/dw (the whole of combine''s work in FP8);
     per-expert: the per-expert (cuBLASLt) form's: each product's operand along its rows (the records'
                 copy for x and dy; a, dh) and its fp32 result into bf16 (h, y, da, dx); the wgrads'
                 column-wise x and dy (from the records), a and dh;
     kernel:     where F is not a multiple of 128, the kernel form's column passes of x's and dy's
                 records and of a and its wgrad column pass of dh that also writes the dgrad's rows (one
                 read); where it is, none: its gate/up product quantizes a along and down the rows itself
                 and writes x's records' copy down their rows from the tiles it loads (the backward's
                 passes over a and x find those copies and return; a layer of several forward slots'
                 first forward into one, as 1F1B's, writes none and the passes run, as the per-expert
                 form's), its down dgrad dh both ways and dy's records' copy down their rows.
                 Its products read the records and write bf16.
   Each pass but the records runs over every expert's rows at once, MOEPT__Q8_G experts a launch (the
   column passes as the per-expert form lays them out; the kernel form's write one matrix, each expert's
   rows padded to 128: the same reads, at most 127 zero columns an expert more written). A
   chunked step runs its row passes a launch a run instead (the kernel form's: of dh where F is not a
   multiple of 128, and the column passes of x's records, a and dh, plain, in place of its own or its
   kernels'). The "sum"
   lines add up each form's passes: its quantizing bytes and time a step, less the GEMMs.

   usage: bench_q8 [--shape mixtral|deepseek|qwen3] [--tokens T] [--hidden D] [--ffn F] [--experts E]
                   [--topk K] [--reps R]
   Defaults: Mixtral-8x7B at T 8192 (bench_shape.h's shapes, bench_cuda's). Prints "RESULT q8 ..." lines.
   Under the emulated GPU (build/emu/bench_q8) it checks that the bench runs; its times mean nothing. */
#ifndef MOEPT__KERNELS /* (tests/q8.cu includes it once, for this and test_q8) */
#include "../moept_kernels.cu"
#endif
#include "bench_shape.h"

#define BQ_CK(call)                                                                             \
    do {                                                                                        \
        long e_ = (long)(call);                                                                 \
        if (e_ != 0) {                                                                          \
            fprintf(stderr, "bench_q8: %s failed (%ld), line %d: %s\n", #call, e_, __LINE__, err); \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

static char err[MOEPT__ERRLEN] = "";

enum bq_kind { BQ_RECORDS, BQ_COMBINE, BQ_UNREC, BQ_ROWS, BQ_OUT, BQ_COLS_REC, BQ_COLS, BQ_COLS_RW };
typedef struct bq_pass {
    const char *name, *form;
    int kind;
    char w; /* its columns: 'D', 'F' or 'H' (2F) */
} bq_pass;
static const bq_pass bq_passes[] = {
    {"records_x", "both", BQ_RECORDS, 'D'},       {"combine_dy", "both", BQ_COMBINE, 'D'},
    {"operand_x", "per-expert", BQ_UNREC, 'D'},   {"operand_a", "per-expert", BQ_ROWS, 'F'},
    {"operand_dy", "per-expert", BQ_UNREC, 'D'},  {"operand_dh", "per-expert", BQ_ROWS, 'H'},
    {"result_h", "per-expert", BQ_OUT, 'H'},      {"result_y", "per-expert", BQ_OUT, 'D'},
    {"result_da", "per-expert", BQ_OUT, 'F'},     {"result_dx", "per-expert", BQ_OUT, 'D'},
    {"wgrad_dy", "per-expert", BQ_COLS_REC, 'D'}, {"wgrad_x", "per-expert", BQ_COLS_REC, 'D'},
    {"wgrad_a", "per-expert", BQ_COLS, 'F'},      {"wgrad_dh", "per-expert", BQ_COLS, 'H'},
    {"wgrad_dy", "kernel", BQ_COLS_REC, 'D'},     {"wgrad_x", "kernel", BQ_COLS_REC, 'D'},
    {"wgrad_a", "kernel", BQ_COLS, 'F'},          {"wgrad_dh_rows", "kernel", BQ_COLS_RW, 'H'},
};
enum { BQ_N = (int)(sizeof bq_passes / sizeof bq_passes[0]) };

/* the operands: src [n][max(D, 2F)] bf16 random, x [T][D] bf16 random (dy's too), rec [n][recw(D)] its
   records, idx [n] (row r: token r / K), wts [T][K] routing weights, rof [T K] (assignment i's row: i)
   and dw [T K] (combine''s dL/dw; src its outputs, D wide), c.q8out
   [np + 16 E][max(D, 2F) padded] fp32 random (the products' results, and the copy's source); q
   [np + 16 E][max padded], qr [np][max padded] and their scales, the passes' outputs; cp as large as
   q8out, the results' and the copy's destination */
typedef struct bq_bufs {
    moept__bf16 *src, *x, *cp;
    uint8_t *rec, *q, *qr;
    float *s, *sr, *wts, *dw;
    int64_t *idx, *rof;
} bq_bufs;

/* n values, random bf16 (or fp32) in [-1, 1): one random block of 2^20 on the host, copied along */
static void *bq_random(int64_t n, size_t es) {
    const int64_t nb = (int64_t)1 << 20;
    char *h = (char *)malloc((size_t)nb * es);
    void *d = NULL;
    uint64_t seed = 7;
    for (int64_t i = 0; i < nb; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        const float v = (float)((double)(seed >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
        if (es == 2) ((moept__bf16 *)h)[i] = moept__f32_to_bf16(v);
        else ((float *)h)[i] = v;
    }
    BQ_CK(cudaMalloc(&d, (size_t)n * es + 16));
    for (int64_t o = 0; o < n; o += nb)
        BQ_CK(cudaMemcpy((char *)d + o * (int64_t)es, h, (size_t)((n - o < nb ? n - o : nb) * (int64_t)es),
                         cudaMemcpyHostToDevice));
    free(h);
    return d;
}
static void *bq_alloc(size_t bytes) {
    void *d = NULL;
    BQ_CK(cudaMalloc(&d, bytes + 16));
    BQ_CK(cudaMemset(d, 0, bytes + 16));
    return d;
}

/* pass p over the n rows, as the layer's whole groups call it (every expert's rows in one call,
   MOEPT__Q8_G experts a launch; the records: one launch), its bytes read and written into *in, *out,
   its launches into *l */
static moept_status bq_run(moept__cuda *c, const bq_pass *p, const bench_shape *s, bq_bufs *b, double *in,
                           double *out, int64_t *l) {
    const int64_t n = s->T * s->K, D = s->D, W = moept__q8_recw(D), np = MOEPT__Q8_PAD(n), E = s->E;
    const int64_t C = p->w == 'D' ? D : p->w == 'F' ? s->F : 2 * s->F, Cp = MOEPT__Q8_PAD(C);
    *in = *out = 0.0, *l = (E + MOEPT__Q8_G - 1) / MOEPT__Q8_G;
    if (p->kind == BQ_RECORDS) {
        *in = (double)n * (D * 2 + 8), *out = (double)n * W, *l = 1;
        return moept__q8_records<moept__bf16>(c, b->x, b->idx, n, b->rec, err);
    }
    if (p->kind == BQ_COMBINE) { /* (dy's row, the output's, its row index and weight; dL/dw) */
        *in = (double)n * (D * 4 + 12), *out = (double)n * (W + 4), *l = 1;
        return moept__q8_combine<moept__bf16>(c, b->src, b->rof, b->wts, b->x, n, s->K, NULL, 0, b->rec,
                                              b->dw, err);
    }
    int64_t offs[4097]; /* (the experts' rows) */
    for (int64_t e = 0; e <= E; e++) offs[e] = n * e / E;
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = offs[e + 1] - offs[e], rp = MOEPT__Q8_PAD(rows);
        const int down = p->kind >= BQ_COLS_REC; /* (the column passes' scales: 128 rows x 1) */
        const double sc = down ? (double)MOEPT__Q8_L(rp) * Cp : (double)rp * MOEPT__Q8_L(C);
        const double qb = (double)rp * Cp + 4.0 * sc; /* (an operand's bytes and scales) */
        const double rb = (double)rows * Cp + 4.0 * (double)rows * MOEPT__Q8_L(C); /* (RW's rows' copy) */
        *in += p->kind == BQ_UNREC || p->kind == BQ_COLS_REC ? (double)rows * W
               : (p->kind == BQ_OUT ? 4.0 : 2.0) * (double)rows * C;
        *out += p->kind == BQ_OUT ? 2.0 * (double)rows * C : p->kind == BQ_COLS_RW ? qb + rb : qb;
    }
    switch (p->kind) {
    case BQ_UNREC: return moept__q8_unrec(c, b->rec, 0, D, b->q, b->s, 0, err, offs, E);
    case BQ_ROWS: return moept__q8_along<moept__bf16>(c, b->src, 0, C, C, b->q, b->s, 0, err, offs, E);
    case BQ_OUT: return moept__q8_result<moept__bf16>(c, 0, C, Cp, b->cp, C, 0, err, offs, E);
    case BQ_COLS_REC: return moept__q8_down<uint8_t>(c, b->rec, offs, E, D, W, b->q, b->s, err);
    case BQ_COLS: return moept__q8_down<moept__bf16>(c, b->src, offs, E, C, C, b->q, b->s, err);
    default: return moept__q8_down<moept__bf16>(c, b->src, offs, E, C, C, b->q, b->s, err, b->qr, b->sr, np);
    }
}

static float bq_ms(cudaEvent_t a, cudaEvent_t b) {
    float ms = 0.0f;
    BQ_CK(cudaEventSynchronize(b));
    BQ_CK(cudaEventElapsedTime(&ms, a, b));
    return ms;
}

int main(int argc, char **argv) {
    bench_shape s = {8192, 0, 0, 0, 0, 5, 1, "mixtral"};
    if (!bench_shape_args(argc, argv, &s)) return 2;
    const char *shape = s.shape;
    if (moept_cuda_device_count() < 1) { printf("skip - bench_q8: no CUDA device\n"); return 0; }
    const int64_t n = s.T * s.K, M = s.D > 2 * s.F ? s.D : 2 * s.F, Mp = MOEPT__Q8_PAD(M);
    const int64_t np = MOEPT__Q8_PAD(n);
    moept__cuda c;
    memset(&c, 0, sizeof c);
    c.sp.D = s.D, c.esz = 2;
    BQ_CK(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking));
    bq_bufs b;
    b.src = (moept__bf16 *)bq_random(n * M, 2), b.x = (moept__bf16 *)bq_random(s.T * s.D, 2);
    /* (the groups' operands and results: every expert's rows, each padded to 16) */
    const int64_t nq = np + 16 * s.E;
    b.cp = (moept__bf16 *)bq_alloc((size_t)(nq * Mp) * 4);
    c.q8out = (float *)bq_random(nq * Mp, 4);
    b.rec = (uint8_t *)bq_alloc((size_t)(n * moept__q8_recw(s.D)));
    const int64_t sr = MOEPT__Q8_L(Mp) * nq, sc = (MOEPT__Q8_L(nq) + s.E) * Mp;
    const int64_t ns = sr > sc ? sr : sc;
    b.q = (uint8_t *)bq_alloc((size_t)(nq * Mp)), b.qr = (uint8_t *)bq_alloc((size_t)(np * Mp));
    b.s = (float *)bq_alloc((size_t)ns * 4), b.sr = (float *)bq_alloc((size_t)ns * 4); /* (rows', columns') */
    int64_t *idx = (int64_t *)malloc((size_t)n * 8);
    for (int64_t r = 0; r < n; r++) idx[r] = r / s.K;
    b.idx = (int64_t *)bq_alloc((size_t)n * 8), b.rof = (int64_t *)bq_alloc((size_t)n * 8);
    b.wts = (float *)bq_random(n, 4), b.dw = (float *)bq_alloc((size_t)n * 4); /* ([T][K]) */
    BQ_CK(cudaMemcpy(b.idx, idx, (size_t)n * 8, cudaMemcpyHostToDevice));
    for (int64_t r = 0; r < n; r++) idx[r] = r;
    BQ_CK(cudaMemcpy(b.rof, idx, (size_t)n * 8, cudaMemcpyHostToDevice));
    free(idx);
    printf("# bench_q8 shape=%s tokens=%lld hidden=%lld ffn=%lld experts=%lld topk=%lld reps=%d\n", shape,
           (long long)s.T, (long long)s.D, (long long)s.F, (long long)s.E, (long long)s.K, s.reps);
    double in, out;
    int64_t l;
    if (s.E > 4096) { fprintf(stderr, "bench_q8: at most 4096 experts\n"); return 2; }
    BQ_CK(bq_run(&c, &bq_passes[0], &s, &b, &in, &out, &l)); /* (the records: the other passes read them) */
    cudaEvent_t ev[4];
    for (int i = 0; i < 4; i++) BQ_CK(cudaEventCreate(&ev[i]));
    double sum_ms[3] = {0, 0, 0}, sum_b[3] = {0, 0, 0}; /* both, per-expert, kernel */
    const int f128 = s.F % MOEPT__Q8_TILE == 0; /* (the kernel form's gate/up product quantizes a both ways
                                                   and copies x's records, its down dgrad dh and dy's) */
    for (int i = 0; i < BQ_N; i++) {
        const bq_pass *p = &bq_passes[i];
        const int f = !strcmp(p->form, "both") ? 0 : !strcmp(p->form, "per-expert") ? 1 : 2;
        if (f128 && f == 2) continue;
        BQ_CK(bq_run(&c, p, &s, &b, &in, &out, &l)); /* (warm-up) */
        BQ_CK(cudaEventRecord(ev[0], c.s));
        for (int r = 0; r < s.reps; r++) BQ_CK(bq_run(&c, p, &s, &b, &in, &out, &l));
        BQ_CK(cudaEventRecord(ev[1], c.s));
        for (int r = 0; r < s.reps; r++)
            BQ_CK(cudaMemcpyAsync(b.cp, c.q8out, (size_t)in, cudaMemcpyDeviceToDevice, c.s));
        BQ_CK(cudaEventRecord(ev[2], c.s));
        const double ms = bq_ms(ev[0], ev[1]) / s.reps, cms = bq_ms(ev[1], ev[2]) / s.reps;
        const double tbs = (in + out) / (ms * 1e9), ctbs = 2.0 * in / (cms * 1e9);
        sum_ms[f] += ms, sum_b[f] += in + out;
        printf("RESULT q8 shape=%s tokens=%lld pass=%s form=%s launches=%lld read_mb=%.1f written_mb=%.1f "
               "ms=%.4f tbs=%.3f copy_tbs=%.3f over_copy=%.3f\n", shape, (long long)s.T, p->name, p->form,
               (long long)l, in / 1e6, out / 1e6, ms, tbs, ctbs, tbs / ctbs);
    }
    for (int f = 1; f < 3; f++) /* each form's passes with the ones both run */
        printf("RESULT q8 shape=%s tokens=%lld sum form=%s mb=%.1f ms=%.4f tbs=%.3f\n", shape, (long long)s.T,
               f == 1 ? "per-expert" : "kernel", (sum_b[0] + sum_b[f]) / 1e6, sum_ms[0] + sum_ms[f],
               (sum_b[0] + sum_b[f]) / ((sum_ms[0] + sum_ms[f]) * 1e9));
    for (int i = 0; i < 4; i++) cudaEventDestroy(ev[i]);
    void *bufs[] = {b.src, b.x, b.cp, c.q8out, b.rec, b.q, b.qr, b.s, b.sr, b.idx, b.wts, b.rof, b.dw};
    for (void *p : bufs) cudaFree(p);
    cudaStreamDestroy(c.s);
    return 0;
}
