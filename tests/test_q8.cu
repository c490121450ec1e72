/* White box: config.fp8's token-row quantizers on the emulated GPU, byte for byte, each against the
   separate pass it replaces and against the CPU layer's spec (moept.c's moept__q8_rows, _cols, written
   here again from the tile rules' shared math, amax, scale and rounding: an oracle apart from both):
   - the dispatch's FP8 records (moept__q8_records: x's rows through the row index, -1 zeros) hold the
     bytes and scales moept__q8_along makes of the same rows gathered first, their padding zero, and
     their values e4m3 * scale are the CPU's quantized rows;
   - combine''s records of dy (its FP8 kernel: each row times its routing weight as read, with dL/dw
     in the same read) hold the bytes of the weighted rows' in fp32, and the CPU's quantized products;
   - a record as cuBLASLt's operand (moept__q8_unrec) is moept__q8_along's output, padding rows too;
     a chunk's runs quantized or copied one run at a time (ss > 0) give the whole operand's rows;
   - the W13 wgrad's column-wise x from the records (moept__q8_down<uint8_t>, dequantized as read)
     is moept__q8_down of the dequantized rows in fp32, and the CPU's column tiles of them.
   - a backward's dh from the wgrad's column pass that also quantizes it along the rows (one
     read): its columns the plain pass's, its rows moept__q8_along's, run by run;
   - the kernel form's layer: the grouped kernel's copies of a (the gate/up kernel's, the one down its
     rows kept for the backward while nothing writes over it), of x's records down their rows (the same
     kernel's, from the A tiles it loads, kept with a's) and of dh (the down dgrad's) against the passes
     on the same rows, and its results against the separate passes';
   - the column passes over every expert's rows in one call, and the per-expert form's row passes (the
     operands along the rows, of bf16 rows and of records, and the results): each group's bytes a call
     of its own's;
   - the weights' E4M3 copies as the AdamW step makes them (its own kernel: the masters read once)
     and as the separate pass does: each 128 x 128 block's bytes and scale from the tile rules, the
     step's masters, moments and bf16 copy the plain step's.
   fp32 and bf16 rows; widths with whole, edge and lone tiles; 37 rows and 300 (three row tiles). */
#ifndef MOEPT__KERNELS /* (tests/q8.cu includes it once, for this and bench_q8) */
#include "../moept_kernels.cu"
#endif
#ifdef MOEPT_CUDA_EMU_KERNELS_H
#include "emu/emu.h" /* (on the emulated GPU: its launch counts) */
#endif
#include "testutil.h"

template <typename T>
static float q8t_f(const T *h, int64_t i) {
    if constexpr (sizeof(T) == 2) return moept__bf16_to_f32(h[i]);
    else return h[i];
}
template <typename T>
static T q8t_t(float v) {
    if constexpr (sizeof(T) == 2) return moept__f32_to_bf16(v);
    else return v;
}
/* a device copy of h (NULL: bytes of 0xa5, so what a kernel leaves unwritten shows) */
template <typename B>
static B *q8t_dev(const void *h, size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes + 16) != cudaSuccess) return NULL;
    if (h) cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    else cudaMemset(d, 0xa5, bytes + 16);
    return (B *)d;
}
template <typename B>
static B *q8t_host(const void *d, size_t bytes) {
    B *h = (B *)malloc(bytes + 16);
    cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost);
    return h;
}
static int q8t_same(const void *a, const void *b, size_t n) { return memcmp(a, b, n) == 0; }
/* the CPU's quantized values of v [n][D]: 1 x 128 tiles along the rows (down: 128 x 1 down the columns,
   from row 0), each s * e4m3(v / s), s = moept__q8_scale(the tile's amax) */
static void q8t_cpu(const float *v, int64_t n, int64_t D, int down, float *out) {
    const int64_t outer = down ? D : n, inner = down ? n : D, so = down ? 1 : D, si = down ? D : 1;
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i0 = 0; i0 < inner; i0 += MOEPT__Q8_TILE) {
            const int64_t i1 = i0 + MOEPT__Q8_TILE < inner ? i0 + MOEPT__Q8_TILE : inner;
            float amax = 0.0f;
            for (int64_t i = i0; i < i1; i++) amax = moept__q8_amax(amax, v[o * so + i * si]);
            const float sc = moept__q8_scale(amax);
            for (int64_t i = i0; i < i1; i++) out[o * so + i * si] = moept__q8(v[o * so + i * si], sc);
        }
}

/* One width's case: x [Tn][D] of T (magnitudes 2^-20 .. 2^20 a row, some rows zero), n rows of it
   through the index idx (-1 some), and xs, those rows gathered (fp32 values and T) */
template <typename T>
struct q8t_case {
    int64_t D, n, Tn, Dp, L, W, np;
    T *x, *xst;
    float *xs;
    int64_t *idx;
    moept__cuda c;
};
template <typename T>
static void q8t_make(q8t_case<T> *k, int64_t D, int64_t n) {
    k->D = D; k->n = n; k->Tn = n + 13; k->Dp = MOEPT__Q8_PAD(D); k->L = MOEPT__Q8_L(D);
    k->W = moept__q8_recw(D); k->np = MOEPT__Q8_PAD(n);
    unsigned long long rs = 11 + (unsigned long long)(D * n);
    k->x = (T *)malloc((size_t)(k->Tn * D) * sizeof(T));
    k->xst = (T *)malloc((size_t)(n * D) * sizeof(T));
    k->xs = (float *)calloc((size_t)(n * D), sizeof(float));
    k->idx = (int64_t *)malloc((size_t)n * 8);
    for (int64_t i = 0; i < k->Tn * D; i++) {
        const int64_t r = i / D;
        k->x[i] = q8t_t<T>(r % 9 == 4 ? 0.0f : (float)tu_rand(&rs) * ldexpf(1.0f, (int)(r % 41) - 20));
    }
    for (int64_t r = 0; r < n; r++) k->idx[r] = r % 7 == 3 ? -1 : (r * 13 + 5) % k->Tn;
    for (int64_t r = 0; r < n; r++)
        for (int64_t d = 0; d < D && k->idx[r] >= 0; d++)
            k->xs[r * D + d] = q8t_f<T>(k->x, k->idx[r] * D + d);
    for (int64_t i = 0; i < n * D; i++) k->xst[i] = q8t_t<T>(k->xs[i]);
    memset(&k->c, 0, sizeof k->c);
    k->c.sp.D = D;
    k->c.esz = (int)sizeof(T); /* (c.s 0: the legacy stream, as the test's own copies and sets) */
}
template <typename T>
static void q8t_free(q8t_case<T> *k) { free(k->x); free(k->xst); free(k->xs); free(k->idx); }

/* the records against moept__q8_along, their padding, their values against the CPU's; their cuBLASLt
   copy; the rows dequantized into deq [n][D], the records left in *recd (device) */
template <typename T>
static void q8t_records(q8t_case<T> *k, float *deq, uint8_t **recd) {
    const int64_t D = k->D, n = k->n, Dp = k->Dp, L = k->L, W = k->W, np = k->np;
    char err[MOEPT__ERRLEN] = "";
    T *xd = q8t_dev<T>(k->x, (size_t)(k->Tn * D) * sizeof(T));
    T *xsd = q8t_dev<T>(k->xst, (size_t)(n * D) * sizeof(T));
    int64_t *idxd = q8t_dev<int64_t>(k->idx, (size_t)n * 8);
    uint8_t *rec = q8t_dev<uint8_t>(NULL, (size_t)(n * W)), *q = q8t_dev<uint8_t>(NULL, (size_t)(np * Dp));
    uint8_t *q2 = q8t_dev<uint8_t>(NULL, (size_t)(np * Dp));
    float *sc = q8t_dev<float>(NULL, (size_t)(L * np) * 4), *sc2 = q8t_dev<float>(NULL, (size_t)(L * np) * 4);
    moept_status st = moept__q8_records<T>(&k->c, xd, idxd, n, rec, err);
    if (!st) st = moept__q8_along<T>(&k->c, xsd, n, D, D, q, sc, 0, err);
    if (!st) st = moept__q8_unrec(&k->c, rec, n, D, q2, sc2, 0, err);
    EXPECT(!st, "D %lld: %s", (long long)D, err);
    uint8_t *hrec = q8t_host<uint8_t>(rec, (size_t)(n * W)), *hq = q8t_host<uint8_t>(q, (size_t)(np * Dp));
    uint8_t *hq2 = q8t_host<uint8_t>(q2, (size_t)(np * Dp));
    float *hs = q8t_host<float>(sc, (size_t)(L * np) * 4), *hs2 = q8t_host<float>(sc2, (size_t)(L * np) * 4);
    float *cpu = (float *)malloc((size_t)(n * D) * 4);
    q8t_cpu(k->xs, n, D, 0, cpu);
    int64_t bytes = 0, scales = 0, pad = 0, vals = 0;
    for (int64_t r = 0; r < n; r++) {
        const float *rsc = (const float *)(hrec + r * W + Dp);
        bytes += !q8t_same(hrec + r * W, hq + r * Dp, (size_t)Dp);
        for (int64_t b = 0; b < L; b++) scales += !q8t_same(&rsc[b], &hs[b * np + r], 4);
        for (int64_t t = Dp + 4 * L; t < W; t++) pad += hrec[r * W + t] != 0;
        for (int64_t d = 0; d < D; d++) {
            deq[r * D + d] = moept__e4m3_f32(hrec[r * W + d]) * rsc[d / MOEPT__Q8_TILE];
            vals += !q8t_same(&deq[r * D + d], &cpu[r * D + d], 4);
        }
    }
    const char *ty = sizeof(T) == 2 ? "bf16" : "fp32";
    EXPECT(bytes == 0 && scales == 0 && pad == 0, "D %lld n %lld, %s rows: records against moept__q8_along: "
           "%lld rows' bytes, %lld scales differ, %lld padding bytes not zero", (long long)D, (long long)n,
           ty, (long long)bytes, (long long)scales, (long long)pad);
    EXPECT(vals == 0, "D %lld n %lld, %s rows: %lld record values differ from the CPU's quantized rows",
           (long long)D, (long long)n, ty, (long long)vals);
    EXPECT(q8t_same(hq, hq2, (size_t)(np * Dp)) && q8t_same(hs, hs2, (size_t)(L * np) * 4),
           "D %lld n %lld: the records as cuBLASLt's operand differ from moept__q8_along's", (long long)D,
           (long long)n);
    *recd = rec;
    cudaFree(xd); cudaFree(xsd); cudaFree(idxd); cudaFree(q); cudaFree(q2); cudaFree(sc); cudaFree(sc2);
    free(hrec); free(hq); free(hq2); free(hs); free(hs2); free(cpu);
}

/* a chunk's runs, [0, n1) and [n1, n) one at a time (ss > 0, the rows' own places), quantized from the
   gathered rows and copied from the records: the whole operand's rows, bytes and scales */
template <typename T>
static void q8t_pieces(q8t_case<T> *k, const uint8_t *rec) {
    const int64_t D = k->D, n = k->n, Dp = k->Dp, L = k->L, np = k->np, n1 = n / 3, W = k->W;
    char err[MOEPT__ERRLEN] = "";
    T *xsd = q8t_dev<T>(k->xst, (size_t)(n * D) * sizeof(T));
    uint8_t *q[3];
    float *s[3];
    for (int v = 0; v < 3; v++) {
        q[v] = q8t_dev<uint8_t>(NULL, (size_t)(np * Dp));
        s[v] = q8t_dev<float>(NULL, (size_t)(L * np) * 4);
    }
    moept_status st = moept__q8_along<T>(&k->c, xsd, n, D, D, q[0], s[0], 0, err);
    const int64_t r0[2] = {0, n1}, rows[2] = {n1, n - n1};
    for (int p = 0; p < 2 && !st; p++) {
        st = moept__q8_along<T>(&k->c, xsd + r0[p] * D, rows[p], D, D, q[1] + r0[p] * Dp, s[1] + r0[p], np,
                                err);
        if (!st)
            st = moept__q8_unrec(&k->c, rec + r0[p] * W, rows[p], D, q[2] + r0[p] * Dp, s[2] + r0[p], np,
                                 err);
    }
    EXPECT(!st, "D %lld: %s", (long long)D, err);
    uint8_t *hq[3];
    float *hs[3];
    for (int v = 0; v < 3; v++) {
        hq[v] = q8t_host<uint8_t>(q[v], (size_t)(np * Dp));
        hs[v] = q8t_host<float>(s[v], (size_t)(L * np) * 4);
    }
    int64_t diff = 0;
    for (int v = 1; v < 3; v++) {
        diff += !q8t_same(hq[0], hq[v], (size_t)(n * Dp));
        for (int64_t b = 0; b < L; b++) diff += !q8t_same(hs[0] + b * np, hs[v] + b * np, (size_t)n * 4);
    }
    EXPECT(diff == 0, "D %lld n %lld: a chunk's runs one at a time differ from the whole operand",
           (long long)D, (long long)n);
    cudaFree(xsd);
    for (int v = 0; v < 3; v++) { cudaFree(q[v]); cudaFree(s[v]); free(hq[v]); free(hs[v]); }
}

/* the wgrad's column-wise x from the records against the same from their values in fp32, and the
   CPU's column tiles of those values */
static void q8t_columns(int64_t D, int64_t n, const uint8_t *rec, const float *deq, moept__cuda *c) {
    const int64_t Cp = MOEPT__Q8_PAD(D), np = MOEPT__Q8_PAD(n), nb = MOEPT__Q8_L(np), W = moept__q8_recw(D);
    char err[MOEPT__ERRLEN] = "";
    uint8_t *qa = q8t_dev<uint8_t>(NULL, (size_t)(Cp * np)), *qb = q8t_dev<uint8_t>(NULL, (size_t)(Cp * np));
    const size_t sbytes = (size_t)(nb * Cp) * 4;
    float *sa = q8t_dev<float>(NULL, sbytes), *sb = q8t_dev<float>(NULL, sbytes);
    float *deqd = q8t_dev<float>(deq, (size_t)(n * D) * 4);
    const int64_t all[2] = {0, n}; /* (one group) */
    moept_status st = moept__q8_down<uint8_t>(c, rec, all, 1, D, W, qa, sa, err);
    if (!st) st = moept__q8_down<float>(c, deqd, all, 1, D, D, qb, sb, err);
    EXPECT(!st, "D %lld: %s", (long long)D, err);
    uint8_t *ha = q8t_host<uint8_t>(qa, (size_t)(Cp * np)), *hb = q8t_host<uint8_t>(qb, (size_t)(Cp * np));
    float *hsa = q8t_host<float>(sa, sbytes), *hsb = q8t_host<float>(sb, sbytes);
    EXPECT(q8t_same(ha, hb, (size_t)(Cp * np)) && q8t_same(hsa, hsb, sbytes),
           "D %lld n %lld: the wgrad's x from the records differs from the same values' in fp32",
           (long long)D, (long long)n);
    float *cpu = (float *)malloc((size_t)(n * D) * 4);
    q8t_cpu(deq, n, D, 1, cpu);
    int64_t vals = 0;
    for (int64_t r = 0; r < n; r++)
        for (int64_t d = 0; d < D; d++) {
            const float v = moept__e4m3_f32(ha[d * np + r]) * hsa[r / MOEPT__Q8_TILE * Cp + d];
            vals += !q8t_same(&v, &cpu[r * D + d], 4);
        }
    EXPECT(vals == 0, "D %lld n %lld: %lld of the wgrad's column-wise x differ from the CPU's", (long long)D,
           (long long)n, (long long)vals);
    cudaFree(qa); cudaFree(qb); cudaFree(sa); cudaFree(sb); cudaFree(deqd);
    free(ha); free(hb); free(hsa); free(hsb); free(cpu);
}

/* bf16 rows in two runs, [0, n1) and [n1, n), each through the wgrad's column pass that also quantizes
   the rows along them (moept__q8_down's qr: a backward's dh, the shared expert's dy): its columns the
   plain pass's, its rows moept__q8_along's of the whole operand (bytes and scales; the rows past n are
   not its to write) */
static void q8t_twin(q8t_case<moept__bf16> *k) {
    const int64_t D = k->D, n = k->n, Dp = k->Dp, L = k->L, np = k->np, n1 = n / 3;
    const int64_t r0[2] = {0, n1}, rows[2] = {n1, n - n1};
    char err[MOEPT__ERRLEN] = "";
    moept__bf16 *xsd = q8t_dev<moept__bf16>(k->xst, (size_t)(n * D) * 2);
    uint8_t *q = q8t_dev<uint8_t>(NULL, (size_t)(np * Dp)), *qr = q8t_dev<uint8_t>(NULL, (size_t)(np * Dp));
    float *s = q8t_dev<float>(NULL, (size_t)(L * np) * 4), *sr = q8t_dev<float>(NULL, (size_t)(L * np) * 4);
    moept_status st = moept__q8_along<moept__bf16>(&k->c, xsd, n, D, D, q, s, 0, err);
    int64_t cols = 0;
    for (int p = 0; p < 2 && !st; p++) {
        const int64_t pn = MOEPT__Q8_PAD(rows[p]), sb = (size_t)(MOEPT__Q8_L(pn) * Dp) * 4;
        const size_t qb = (size_t)(Dp * pn);
        uint8_t *qc[2] = {q8t_dev<uint8_t>(NULL, qb), q8t_dev<uint8_t>(NULL, qb)};
        float *sc[2] = {q8t_dev<float>(NULL, (size_t)sb), q8t_dev<float>(NULL, (size_t)sb)};
        const int64_t run[2] = {0, rows[p]}, at[2] = {r0[p], r0[p] + rows[p]}; /* (the run, by xsd's rows) */
        st = moept__q8_down<moept__bf16>(&k->c, xsd + r0[p] * D, run, 1, D, D, qc[0], sc[0], err);
        if (!st) st = moept__q8_down<moept__bf16>(&k->c, xsd, at, 1, D, D, qc[1], sc[1], err, qr, sr, np);
        uint8_t *h0 = q8t_host<uint8_t>(qc[0], qb), *h1 = q8t_host<uint8_t>(qc[1], qb);
        float *g0 = q8t_host<float>(sc[0], (size_t)sb), *g1 = q8t_host<float>(sc[1], (size_t)sb);
        cols += !q8t_same(h0, h1, qb) + !q8t_same(g0, g1, (size_t)sb);
        for (int v = 0; v < 2; v++) { cudaFree(qc[v]); cudaFree(sc[v]); }
        free(h0); free(h1); free(g0); free(g1);
    }
    EXPECT(!st, "D %lld: %s", (long long)D, err);
    uint8_t *hq = q8t_host<uint8_t>(q, (size_t)(np * Dp)), *hqr = q8t_host<uint8_t>(qr, (size_t)(np * Dp));
    float *hs = q8t_host<float>(s, (size_t)(L * np) * 4), *hsr = q8t_host<float>(sr, (size_t)(L * np) * 4);
    int64_t diff = !q8t_same(hq, hqr, (size_t)(n * Dp));
    for (int64_t b = 0; b < L; b++) diff += !q8t_same(hs + b * np, hsr + b * np, (size_t)n * 4);
    EXPECT(cols == 0 && diff == 0, "D %lld n %lld: the column pass with the rows' copy: %lld runs' columns "
           "differ from the plain pass's, the rows from moept__q8_along's in %lld parts", (long long)D,
           (long long)n, (long long)cols, (long long)diff);
    cudaFree(xsd); cudaFree(q); cudaFree(qr); cudaFree(s); cudaFree(sr);
    free(hq); free(hqr); free(hs); free(hsr);
}

/* the wgrads' column passes over many groups (an expert's rows each) in one call against the same pass a
   group at a time, bitwise: bf16 rows (plain, and with the rows' copy) and FP8 records. 70 groups (two
   launches of MOEPT__Q8_G), empty ones among them; every output buffer compared whole, so a group's
   operand must land where moept__q8_gnext puts it and nothing else be written. And the kernel form's
   layout (S: every group's columns of one [Dp][S]): each group's bytes the same, then zeros to 128, the
   scales and the rows' copy the same bytes */
template <typename T>
static void q8t_groups1(moept__cuda *c, const T *src, int64_t lds, const int64_t *offs, int64_t ng, int64_t D,
                        int rw, int64_t np) {
    const int64_t Dp = MOEPT__Q8_PAD(D), L = MOEPT__Q8_L(D);
    int64_t qo = 0, so = 0;
    for (int64_t g = 0; g < ng; g++) moept__q8_gnext(offs[g + 1] - offs[g], Dp, &qo, &so);
    const size_t qb = (size_t)qo, sb = (size_t)so * 4, rb = (size_t)(np * Dp), srb = (size_t)(L * np) * 4;
    uint8_t *q[2], *qr[2];
    float *sc[2], *sr[2];
    for (int v = 0; v < 2; v++) {
        q[v] = q8t_dev<uint8_t>(NULL, qb); sc[v] = q8t_dev<float>(NULL, sb);
        qr[v] = q8t_dev<uint8_t>(NULL, rb); sr[v] = q8t_dev<float>(NULL, srb);
    }
    char err[MOEPT__ERRLEN] = "";
#ifdef MOEPT_CUDA_EMU_KERNELS_H
    const long k0 = moept_emu_launches("moept__k_q8_cols");
#endif
    moept_status st = moept__q8_down<T>(c, src, offs, ng, D, lds, q[0], sc[0], err, rw ? qr[0] : NULL,
                                        rw ? sr[0] : NULL, np);
#ifdef MOEPT_CUDA_EMU_KERNELS_H
    EXPECT(moept_emu_launches("moept__k_q8_cols") - k0 == (ng + MOEPT__Q8_G - 1) / MOEPT__Q8_G,
           "%lld groups: %ld launches", (long long)ng, moept_emu_launches("moept__k_q8_cols") - k0);
#endif
    qo = so = 0;
    for (int64_t g = 0; g < ng && !st; g++) { /* (one group a call, its rows by src's: offs + g) */
        st = moept__q8_down<T>(c, src, offs + g, 1, D, lds, q[1] + qo, sc[1] + so, err, rw ? qr[1] : NULL,
                               rw ? sr[1] : NULL, np);
        moept__q8_gnext(offs[g + 1] - offs[g], Dp, &qo, &so);
    }
    EXPECT(!st, "D %lld: %s", (long long)D, err);
    void *h[2][4];
    for (int v = 0; v < 2; v++) {
        h[v][0] = q8t_host<uint8_t>(q[v], qb); h[v][1] = q8t_host<float>(sc[v], sb);
        h[v][2] = q8t_host<uint8_t>(qr[v], rb); h[v][3] = q8t_host<float>(sr[v], srb);
    }
    const size_t size[4] = {qb, sb, rb, srb};
    int diff = 0;
    for (int i = 0; i < 4; i++) diff |= !q8t_same(h[0][i], h[1][i], size[i]) << i;
    EXPECT(diff == 0, "D %lld, %s%s, %lld groups in one call against a group a call: parts %d differ "
           "(1 bytes, 2 scales, 4 the rows' bytes, 8 their scales)", (long long)D, sizeof(T) == 1 ? "records"
           : "bf16", rw ? " with the rows' copy" : "", (long long)ng, diff);
    int64_t S = 0; /* the kernel form's layout, into q[1], sc[1], qr[1], sr[1] again */
    for (int64_t g = 0; g < ng; g++) S += MOEPT__Q8_P128(offs[g + 1] - offs[g]);
    uint8_t *qw = q8t_dev<uint8_t>(NULL, (size_t)(Dp * S));
    st = moept__q8_down<T>(c, src, offs, ng, D, lds, qw, sc[1], err, rw ? qr[1] : NULL, rw ? sr[1] : NULL, np,
                           S);
    EXPECT(!st, "D %lld: %s", (long long)D, err);
    uint8_t *hw = q8t_host<uint8_t>(qw, (size_t)(Dp * S));
    int64_t moved = 0, at = 0; /* (at: group g's first column) */
    qo = 0;
    for (int64_t g = 0; g < ng; g++) {
        const int64_t n = offs[g + 1] - offs[g], gp = MOEPT__Q8_PAD(n), w = MOEPT__Q8_L(n) * MOEPT__Q8_TILE;
        for (int64_t col = 0; col < Dp; col++)
            for (int64_t r = 0; r < w; r++)
                moved += hw[col * S + at + r] != (r < gp ? ((uint8_t *)h[0][0])[qo + col * gp + r] : 0);
        at += w, qo += Dp * gp;
    }
    for (int i = 1; i < 4; i++) {
        void *hn = q8t_host<char>(i == 1 ? (void *)sc[1] : i == 2 ? (void *)qr[1] : (void *)sr[1], size[i]);
        moved += !q8t_same(h[0][i], hn, size[i]);
        free(hn);
    }
    EXPECT(moved == 0, "D %lld, %s%s, %lld groups into one [Dp][S]: %lld bytes or parts not the groups' own",
           (long long)D, sizeof(T) == 1 ? "records" : "bf16", rw ? " with the rows' copy" : "", (long long)ng,
           (long long)moved);
    cudaFree(qw);
    free(hw);
    for (int v = 0; v < 2; v++) {
        cudaFree(q[v]); cudaFree(sc[v]); cudaFree(qr[v]); cudaFree(sr[v]);
        for (int i = 0; i < 4; i++) free(h[v][i]);
    }
}
/* the per-expert form's row passes over every expert's rows in one call (the operands of bf16 rows and of
   FP8 records, each group's padded rows after the one before; the fp32 results into the groups' rows)
   against the same a group a call into the same places, every output buffer bitwise */
static void q8t_rgroups(q8t_case<moept__bf16> *k, const moept__bf16 *xsd, const uint8_t *rec,
                        const int64_t *offs, int64_t ng) {
    const int64_t D = k->D, Dp = k->Dp, L = k->L, W = k->W, n = offs[ng];
    int64_t o = 0;
    for (int64_t g = 0; g < ng; g++) o += MOEPT__Q8_PAD(offs[g + 1] - offs[g]);
    const size_t qb = (size_t)(o * Dp), sb = (size_t)(o * L) * 4, yb = (size_t)(n * D) * 2;
    uint8_t *q[2][2];
    float *sc[2][2];
    moept__bf16 *y[2];
    for (int v = 0; v < 2; v++) {
        for (int p = 0; p < 2; p++) q[v][p] = q8t_dev<uint8_t>(NULL, qb), sc[v][p] = q8t_dev<float>(NULL, sb);
        y[v] = q8t_dev<moept__bf16>(NULL, yb);
    }
    float *res = (float *)malloc((size_t)(o * Dp) * 4), *saved = k->c.q8out;
    for (int64_t i = 0; i < o * Dp; i++) res[i] = (float)(i % 1001) * 0.37f - 150.0f;
    float *resd = q8t_dev<float>(res, (size_t)(o * Dp) * 4);
    char err[MOEPT__ERRLEN] = "";
    moept__cuda *c = &k->c;
    c->q8out = resd;
    moept_status st = moept__q8_along<moept__bf16>(c, xsd, 0, D, D, q[0][0], sc[0][0], 0, err, offs, ng);
    if (!st) st = moept__q8_unrec(c, rec, 0, D, q[0][1], sc[0][1], 0, err, offs, ng);
    if (!st) st = moept__q8_result<moept__bf16>(c, 0, D, Dp, y[0], D, 0, err, offs, ng);
    o = 0;
    for (int64_t g = 0; g < ng && !st; g++) {
        const int64_t r0 = offs[g], rows = offs[g + 1] - r0;
        st = moept__q8_along<moept__bf16>(c, xsd + r0 * D, rows, D, D, q[1][0] + o * Dp, sc[1][0] + o * L, 0,
                                          err);
        if (!st) st = moept__q8_unrec(c, rec + r0 * W, rows, D, q[1][1] + o * Dp, sc[1][1] + o * L, 0, err);
        c->q8out = resd + o * Dp;
        if (!st) st = moept__q8_result<moept__bf16>(c, rows, D, Dp, y[1] + r0 * D, D, 0, err);
        o += MOEPT__Q8_PAD(rows);
    }
    c->q8out = saved;
    EXPECT(!st, "D %lld: %s", (long long)D, err);
    int diff = 0;
    for (int p = 0; p < 2; p++) {
        uint8_t *h0 = q8t_host<uint8_t>(q[0][p], qb), *h1 = q8t_host<uint8_t>(q[1][p], qb);
        float *g0 = q8t_host<float>(sc[0][p], sb), *g1 = q8t_host<float>(sc[1][p], sb);
        const int bytes = !q8t_same(h0, h1, qb), scales = !q8t_same(g0, g1, sb);
        diff |= (bytes | scales << 1) << (2 * p);
        free(h0); free(h1); free(g0); free(g1);
    }
    moept__bf16 *h0 = q8t_host<moept__bf16>(y[0], yb), *h1 = q8t_host<moept__bf16>(y[1], yb);
    diff |= !q8t_same(h0, h1, yb) << 4;
    EXPECT(diff == 0, "D %lld, %lld groups in one call against a group a call: parts %d differ (1, 2 the "
           "rows' bytes, scales; 4, 8 the records'; 16 the results)", (long long)D, (long long)ng, diff);
    free(h0); free(h1); free(res); cudaFree(resd);
    for (int v = 0; v < 2; v++) {
        for (int p = 0; p < 2; p++) cudaFree(q[v][p]), cudaFree(sc[v][p]);
        cudaFree(y[v]);
    }
}
static void q8t_groups(int64_t D) {
    enum { NG = 70 };
    int64_t offs[NG + 1] = {0};
    for (int g = 0; g < NG; g++) offs[g + 1] = offs[g] + (g % 9 == 4 ? 0 : (g * 37 + 5) % 151);
    const int64_t n = offs[NG], W = moept__q8_recw(D);
    q8t_case<moept__bf16> k;
    q8t_make<moept__bf16>(&k, D, n);
    char err[MOEPT__ERRLEN] = "";
    moept__bf16 *xd = q8t_dev<moept__bf16>(k.x, (size_t)(k.Tn * D) * 2);
    moept__bf16 *xsd = q8t_dev<moept__bf16>(k.xst, (size_t)(n * D) * 2);
    int64_t *idxd = q8t_dev<int64_t>(k.idx, (size_t)n * 8);
    uint8_t *rec = q8t_dev<uint8_t>(NULL, (size_t)(n * W));
    moept_status st = moept__q8_records<moept__bf16>(&k.c, xd, idxd, n, rec, err);
    EXPECT(!st, "D %lld: %s", (long long)D, err);
    for (int rw = 0; rw < 2; rw++) q8t_groups1<moept__bf16>(&k.c, xsd, D, offs, NG, D, rw, k.np);
    q8t_groups1<uint8_t>(&k.c, rec, W, offs, NG, D, 0, k.np);
    q8t_rgroups(&k, xsd, rec, offs, NG);
    cudaFree(xd); cudaFree(xsd); cudaFree(idxd); cudaFree(rec);
    q8t_free<moept__bf16>(&k);
}

/* the routed experts' rows of src (F columns, lds apart) as a kernel's epilogue quantized them (q8r, q8sr)
   against moept__q8_along of src as stored, rows and scales: the last forward's a (the gate/up kernel),
   or after a backward dh over h (2F: the down dgrad's) */
static void q8t_epilogue(moept__cuda *c, const void *src, int64_t F, int64_t lds, const char *what) {
    const moept__cslot *sl = &c->slots[c->last];
    const int64_t end = sl->roffsets[c->sp.El], np = MOEPT__Q8_PAD(end), Fp = MOEPT__Q8_PAD(F);
    const int64_t L = MOEPT__Q8_L(F);
    char err[MOEPT__ERRLEN] = "";
    uint8_t *q = q8t_dev<uint8_t>(NULL, (size_t)(np * Fp));
    float *s = q8t_dev<float>(NULL, (size_t)(L * np) * 4);
    moept_status st = moept__q8_along<moept__bf16>(c, src, end, F, lds, q, s, 0, err);
    EXPECT(!st && end > 0 && c->q8r, "%s (%lld rows)", err, (long long)end);
    if (st || !c->q8r) return;
    const size_t sb = (size_t)(L * np) * 4;
    uint8_t *hq = q8t_host<uint8_t>(q, (size_t)(np * Fp));
    uint8_t *hr = q8t_host<uint8_t>(c->q8r, (size_t)(end * Fp));
    float *hs = q8t_host<float>(s, sb), *hsr = q8t_host<float>(c->q8sr, sb);
    int64_t diff = !q8t_same(hq, hr, (size_t)(end * Fp));
    for (int64_t b = 0; b < L; b++) diff += !q8t_same(hs + b * np, hsr + b * np, (size_t)end * 4);
    EXPECT(diff == 0, "%s differs from moept__q8_along's (%lld parts)", what, (long long)diff);
    cudaFree(q); cudaFree(s);
    free(hq); free(hr); free(hs); free(hsr);
}

#ifdef MOEPT_CUDA_EMU_KERNELS_H
/* the emulated GPU's kernel counts: zeroed once the device is idle (q8t_count0), then what the calls since
   counted in stage s (NULL: every stage) once they are done */
static void q8t_count0(void) {
    cudaDeviceSynchronize();
    moept_emu_counts_reset();
}
static moept_emu_counts q8t_counts(const char *s) {
    moept_emu_counts n;
    cudaDeviceSynchronize();
    moept_emu_counts_get(0, s, &n);
    return n;
}
#endif

/* the a whose copy down its rows the kernel form's scratch holds (moept__q8_kept), NULL: none */
static const void *q8t_owner(const moept__cuda *c) {
    unsigned long long v = 0;
    cudaMemcpy(&v, c->q8own, 8, cudaMemcpyDeviceToHost);
    return (const void *)(uintptr_t)v;
}

/* ... and the routed experts' src (C columns, lds apart) down its rows as a kernel wrote it (qd, sd: the
   groups' columns of one [Cp][S]) against moept__q8_down's column pass: the last forward's a (the gate/up
   kernel's epilogue's, kept in q8a for the W2 wgrad: moept__q8_kept) or x's records (the same kernel's,
   from the A tiles it loads: q8x, the W13 wgrad's), or after a backward dh over h (2F columns: the down
   dgrad's, the W13 wgrad's O in q8b; moept__q8_dhc) or dy's records (the down dgrad's, from its A tiles:
   q8y, the W2 wgrad's O; moept__q8_dyc); wide: the runs past a launch's, else an expert's rows past a
   tile */
static void q8t_epilogue_down(moept__cuda *c, const void *src, int64_t C, int64_t lds, const uint8_t *qd,
                              const float *sd, int wide, const char *what) {
    moept__cslot *sl = &c->slots[c->last];
    const int64_t El = c->sp.El, Cp = MOEPT__Q8_PAD(C);
    const moept__runs R = moept__runs_groups(sl->roffsets, El);
    const moept__ffn f = moept__ffn_routed(c, sl, NULL, 1);
    const int rec = src == sl->xr || src == sl->yq; /* (x's, dy's records: dequantized as read) */
    EXPECT(src == sl->a || src == sl->xr ? q8t_owner(c) == sl->a && moept__q8_kept(c, &f, &R)
           : rec                        ? moept__q8_dyc(c, &f, &R)
                                        : moept__q8_dhc(c, &f, &R),
           "%s: the layer's kernel does not write it", what);
    const int64_t S = moept__q8_wide(&R);
    int64_t most = 0, runs = 0; /* (an expert's rows past a tile: a column's two halves and its second
                                   tile; or the down dgrad's second launch, its runs' first column) */
    for (int64_t e = 0; e < El; e++) {
        most = std::max(most, sl->roffsets[e + 1] - sl->roffsets[e]);
        runs += sl->roffsets[e + 1] > sl->roffsets[e];
    }
    EXPECT(wide ? runs > MOEPT__GK_RUNS : most > 128, "%s: an expert's %lld rows at most, %lld experts with "
           "rows: no second %s", what, (long long)most, (long long)runs, wide ? "launch" : "tile");
    const size_t qb = (size_t)(Cp * S), sb = (size_t)(S / 128 * Cp) * 4;
    char err[MOEPT__ERRLEN] = "";
    uint8_t *q = q8t_dev<uint8_t>(NULL, qb);
    float *s = q8t_dev<float>(NULL, sb);
    const moept_status st =
        rec ? moept__q8_down<uint8_t>(c, src, sl->roffsets, El, C, lds, q, s, err, NULL, NULL, 0, S)
            : moept__q8_down<moept__bf16>(c, src, sl->roffsets, El, C, lds, q, s, err, NULL, NULL, 0, S);
    EXPECT(!st && S > 0, "%s (%lld columns)", err, (long long)S);
    uint8_t *h0 = q8t_host<uint8_t>(q, qb), *h1 = q8t_host<uint8_t>(qd, qb);
    float *s0 = q8t_host<float>(s, sb), *s1 = q8t_host<float>(sd, sb);
    EXPECT(!st && q8t_same(h0, h1, qb) && q8t_same(s0, s1, sb), "%s: the kernel's copy differs from the "
           "column pass's (bytes %d, scales %d)", what, !q8t_same(h0, h1, qb), !q8t_same(s0, s1, sb));
    cudaFree(q); cudaFree(s);
    free(h0); free(h1); free(s0); free(s1);
}

/* combine' in FP8 (moept__q8_combine, one read of dy: row r token idx[r]'s dy times its assignment's
   routing weight w[idx[r] K + ks[r]], and that assignment's dL/dw): its records the bytes of the
   separate path's (the rows w dy in fp32, as the fp32 layer's combine' stores them, then recorded),
   the rows no assignment has (idx -1: the sync-free blocks' unused ones) zero records, their values
   the CPU's quantized products; dL/dw the sums <ys[r], dy[t]> in double, ys rows of their own (signed
   random; an assignment without a row, a padded token's: 0) */
template <typename T>
static void q8t_weighted(q8t_case<T> *k) {
    const int64_t D = k->D, n = k->n, W = k->W, K = 3, TK = k->Tn * K;
    char err[MOEPT__ERRLEN] = "";
    float *w = (float *)malloc((size_t)TK * 4), *ws = (float *)calloc((size_t)(n * D), 4);
    float *cpu = (float *)malloc((size_t)(n * D) * 4), *dwr = (float *)calloc((size_t)TK, 4);
    int64_t *row_of = (int64_t *)malloc((size_t)TK * 8);
    T *ys = (T *)malloc((size_t)(n * D) * sizeof(T));
    unsigned long long rs = 3 + (unsigned long long)D;
    for (int64_t i = 0; i < TK; i++) w[i] = ldexpf((float)tu_rand(&rs), (int)(i % 7) - 3), row_of[i] = -1;
    for (int64_t i = 0; i < n * D; i++) ys[i] = q8t_t<T>((float)tu_rand(&rs));
    for (int64_t r = 0; r < n; r++) { /* (idx's tokens differ: any assignment of each will do) */
        const int64_t ks = (r * 5) % K, t = k->idx[r];
        double dot = 0.0;
        if (t < 0) continue;
        row_of[t * K + ks] = r;
        for (int64_t d = 0; d < D; d++) {
            ws[r * D + d] = moept__scale(w[t * K + ks], k->xs[r * D + d]);
            dot += (double)q8t_f<T>(ys, r * D + d) * (double)k->xs[r * D + d];
        }
        dwr[t * K + ks] = (float)dot;
    }
    q8t_cpu(ws, n, D, 0, cpu);
    T *xd = q8t_dev<T>(k->x, (size_t)(k->Tn * D) * sizeof(T));
    T *ysd = q8t_dev<T>(ys, (size_t)(n * D) * sizeof(T));
    float *wd = q8t_dev<float>(w, (size_t)TK * 4), *wsd = q8t_dev<float>(ws, (size_t)(n * D) * 4);
    float *dwd = q8t_dev<float>(NULL, (size_t)TK * 4);
    int64_t *idxd = q8t_dev<int64_t>(k->idx, (size_t)n * 8), *rod = q8t_dev<int64_t>(row_of, (size_t)TK * 8);
    uint8_t *rec[2] = {q8t_dev<uint8_t>(NULL, (size_t)(n * W)), q8t_dev<uint8_t>(NULL, (size_t)(n * W))};
    moept_status st = moept__q8_combine<T>(&k->c, ysd, rod, wd, xd, TK, K, idxd, n, rec[0], dwd, err);
    if (!st) st = moept__q8_records<float>(&k->c, wsd, NULL, n, rec[1], err);
    EXPECT(!st, "D %lld: %s", (long long)D, err);
    uint8_t *h0 = q8t_host<uint8_t>(rec[0], (size_t)(n * W));
    uint8_t *h1 = q8t_host<uint8_t>(rec[1], (size_t)(n * W));
    float *dw = q8t_host<float>(dwd, (size_t)TK * 4);
    int64_t vals = 0, dws = 0;
    for (int64_t r = 0; r < n; r++)
        for (int64_t d = 0; d < D; d++) {
            const float v = moept__e4m3_f32(h0[r * W + d]) * ((const float *)(h0 + r * W + k->Dp))[d / 128];
            vals += !q8t_same(&v, &cpu[r * D + d], 4);
        }
    for (int64_t i = 0; i < TK; i++) /* (the same sum in another order: within a rounding of its terms) */
        dws += !(fabsf(dw[i] - dwr[i]) <= 1e-6f * fabsf(dwr[i]) + 1e-30f);
    EXPECT(q8t_same(h0, h1, (size_t)(n * W)) && vals == 0 && dws == 0, "D %lld n %lld, %s rows: the "
           "records of combine' differ from the weighted rows (%lld values from the CPU's); %lld dL/dw off",
           (long long)D, (long long)n, sizeof(T) == 2 ? "bf16" : "fp32", (long long)vals, (long long)dws);
    cudaFree(xd); cudaFree(ysd); cudaFree(wd); cudaFree(wsd); cudaFree(dwd); cudaFree(idxd); cudaFree(rod);
    cudaFree(rec[0]); cudaFree(rec[1]);
    free(w); free(ws); free(cpu); free(dwr); free(row_of); free(ys); free(h0); free(h1); free(dw);
}

template <typename T>
static void q8t_width(int64_t D, int64_t n) {
    q8t_case<T> k;
    q8t_make<T>(&k, D, n);
    float *deq = (float *)malloc((size_t)(n * D) * 4);
    uint8_t *rec = NULL;
    q8t_records<T>(&k, deq, &rec);
    if (rec) {
        q8t_pieces<T>(&k, rec);
        q8t_columns(D, n, rec, deq, &k.c);
    }
    q8t_weighted<T>(&k);
    if constexpr (sizeof(T) == 2) q8t_twin(&k);
    cudaFree(rec);
    free(deq);
    q8t_free<T>(&k);
}

static void test_records(void) {
    const int64_t widths[5] = {64, 200, 7, 300, 136};
    for (int i = 0; i < 5; i++)
        for (int64_t n = 37; n <= 300; n += 263) {
            q8t_width<float>(widths[i], n);
            q8t_width<moept__bf16>(widths[i], n);
        }
    q8t_case<moept__bf16> k; /* (combine' over more tiles than a block's round: 34) */
    q8t_make<moept__bf16>(&k, 4296, 37);
    q8t_weighted<moept__bf16>(&k);
    q8t_free<moept__bf16>(&k);
    q8t_groups(200);
}

/* The device's E4M3 conversions (moept__e4m3x2 and back: sm_89's cvt where the binary has it, the
   software rules where not) against moept.c's spec on the host, byte for byte: x's values in pairs (lo,
   hi), and the 256 bytes decoded as pairs (b, 255 - b), each byte in both places */
__global__ void q8t_k_cvt(const float *x, int n, uint16_t *out, float *dec) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n / 2) out[i] = (uint16_t)moept__e4m3x2(x[2 * i], x[2 * i + 1]);
    if (i < 256) {
        const float2 d = moept__e4m3x2_f32((uint32_t)i | (uint32_t)(255 - i) << 8);
        dec[2 * i] = d.x, dec[2 * i + 1] = d.y;
    }
}
/* the values that decide a rounding: every E4M3 value, each midpoint between neighbours and the floats
   either side of it, past 448 (to 464, the midpoint to E4M3's missing 480, and on), the zeros, the
   smallest floats, the infinities, NaNs of either sign, and random bit patterns of every exponent */
static int q8t_cvt_values(float *x) {
    int n = 0;
    for (int b = 0; b < 256; b++) {
        const float v = moept__e4m3_f32((uint8_t)b);
        x[n++] = v;
        if ((b & 0x7f) >= 0x7e) continue; /* (448 and NaN: no next value) */
        const float m = 0.5f * (v + moept__e4m3_f32((uint8_t)(b + 1))); /* (exact: 5 significant bits) */
        x[n++] = m, x[n++] = nextafterf(m, 0.0f), x[n++] = nextafterf(m, 2.0f * m);
    }
    const float edge[] = {448.0f, 455.9f, 456.0f, 463.99997f, 464.0f, 464.00003f, 480.0f, 1e30f, INFINITY,
                          0x1p-10f, 0x1p-11f, 0x1p-149f, 0x1p-126f, 0.0f, NAN, 0x1.8p-10f, 0x1.fffffep-7f};
    for (size_t i = 0; i < sizeof edge / sizeof *edge; i++) x[n++] = edge[i], x[n++] = -edge[i];
    uint64_t r = 11;
    for (int i = 0; i < 4096; i++) x[n++] = moept__bits_f32((uint32_t)(moept__mix(&r) >> 32));
    return n;
}
static void q8t_cvt(const char *on) {
    float *x = (float *)malloc(8192 * sizeof(float)), dh[512];
    const int n = q8t_cvt_values(x) & ~1;
    float *xd = q8t_dev<float>(x, (size_t)n * 4), *decd = q8t_dev<float>(NULL, sizeof dh);
    uint16_t *od = q8t_dev<uint16_t>(NULL, (size_t)n);
    MOEPT__LAUNCH(q8t_k_cvt, (n / 2 + 255) / 256, 256, 0, 0)(xd, n, od, decd);
    uint16_t *o = q8t_host<uint16_t>(od, (size_t)n);
    cudaMemcpy(dh, decd, sizeof dh, cudaMemcpyDeviceToHost);
    int bad = 0, first = -1, dbad = 0, dfirst = -1;
    for (int i = 0; i < n; i++) {
        const int got = o[i / 2] >> (8 * (i & 1)) & 0xff, want = moept__e4m3_byte(moept__e4m3_round(x[i]));
        if (got != want && !bad++) first = i;
    }
    for (int i = 0; i < 512; i++) {
        const float want = moept__e4m3_f32((uint8_t)(i & 1 ? 255 - i / 2 : i / 2));
        const int same = want == want ? moept__f32_bits(dh[i]) == moept__f32_bits(want) : dh[i] != dh[i];
        if (!same && !dbad++) dfirst = i;
    }
    EXPECT(bad == 0, "%s: %d of %d values convert apart from moept.c's bytes, first %a: 0x%02x, want 0x%02x",
           on, bad, n, first < 0 ? 0.0 : (double)x[first],
           first < 0 ? 0 : o[first / 2] >> (8 * (first & 1)) & 0xff,
           first < 0 ? 0 : moept__e4m3_byte(moept__e4m3_round(x[first])));
    EXPECT(dbad == 0, "%s: %d of 512 bytes decode apart from moept.c's values, first (pair %d) %a", on, dbad,
           dfirst / 2, dfirst < 0 ? 0.0 : (double)dh[dfirst]);
    cudaFree(xd), cudaFree(decd), cudaFree(od);
    free(o), free(x);
}
static void test_cvt(void) {
#ifdef MOEPT_CUDA_EMU_KERNELS_H
    setenv("MOEPT_EMU_CC", "80", 1);
    q8t_cvt("sm_80 (software)");
    setenv("MOEPT_EMU_CC", "90", 1);
    q8t_cvt("sm_90 (cvt)");
    unsetenv("MOEPT_EMU_CC");
#else
    q8t_cvt("this GPU");
#endif
}

/* The kernel form's FP8 layer (an emulated GPU of compute capability 9.0) of T tokens with its fused
   stages (a by the gate/up kernel's epilogue along its rows, and down them (F a multiple of 128) for the
   backward, dh by the down dgrad's, along its rows and down them there (F a multiple of 128) or by the
   W13 wgrad's column pass, the shared expert's dy's by the W2 wgrad's) and without (q8r NULL: the down
   dgrad's da stored, then an activation pass; each quantization a pass of its own): y, dx and every
   gradient bitwise; the backward's column passes counted; and (a layer with no shared expert, whose a
   comes last) the gate/up kernel's two copies of a are moept__q8_along's and moept__q8_down's of a as
   stored, byte for byte, as (F 256) the down dgrad's two copies of dh are of dh as stored, and (F a
   multiple of 128) its copy of x's records down their rows is moept__q8_down's of the records (D 300:
   three k-steps, F 384: three n-tiles that share each k-step's 128 columns unevenly; F 1280: ten, a
   consumer's threads past the share idle).
   F 200: a's second tile an edge of two subtiles, the up rows' blocks crossed within a subtile; F 136:
   an edge of one subtile; F 256: whole tiles, where the kernels' epilogues write the copies down the
   rows (a's, dh's), and their k-steps x's and dy's records' (q8x, q8y), each against the column pass */
static void q8t_fused(moept_family fam, int64_t F, int64_t T, int64_t E = 4, int64_t D = 72) {
    moept_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.family = fam; cfg.hidden_size = D; cfg.intermediate_size = F; cfg.num_experts = E; cfg.top_k = 2;
    cfg.norm_topk_prob = 1; cfg.max_tokens = T; cfg.fp8 = MOEPT_FP8_BLOCKWISE;
    cfg.shared_intermediate_size = fam == MOEPT_FAMILY_QWEN2_MOE ? 136 : 0;
    moept_cuda_options o = {MOEPT_DTYPE_BF16, NULL, 0, 0, MOEPT_GEMM_KERNEL};
    moept_layer *L[2] = {NULL, NULL};
    unsigned long long rs = 5;
    moept__bf16 *xh = (moept__bf16 *)malloc((size_t)(T * D) * 2);
    for (int64_t i = 0; i < T * D; i++) xh[i] = moept__f32_to_bf16((float)tu_rand(&rs));
    moept__bf16 *x = q8t_dev<moept__bf16>(xh, (size_t)(T * D) * 2);
    void *y[2] = {NULL, NULL}, *dx[2] = {NULL, NULL};
    float *g[2] = {NULL, NULL};
    int64_t np = 0;
    for (int v = 0; v < 2 && !tu_bad; v++) {
        y[v] = q8t_dev<char>(NULL, (size_t)(T * D) * 2);
        dx[v] = q8t_dev<char>(NULL, (size_t)(T * D) * 2);
        EXPECT_OK(moept_create_cuda(&cfg, NULL, NULL, &o, &L[v]));
        if (!L[v]) break;
        moept_init_params(L[v], 7);
        moept__view view;
        moept__cuda *c = moept__cx(L[v], &view);
        if (v) c->q8r = NULL; /* (the separate passes) */
        const float *xf = (const float *)x; /* (the layer's dtype: bf16) */
#ifdef MOEPT_CUDA_EMU_KERNELS_H
        const long k0 = moept_emu_launches("GK_GATE8");
        q8t_count0();
#endif
        EXPECT(!moept_forward(L[v], xf, T, (float *)y[v]), "forward: %s", moept_last_error(L[v]));
#ifdef MOEPT_CUDA_EMU_KERNELS_H
        const long k8 = moept_emu_launches("GK_GATE8") - k0;
        EXPECT(v ? k8 == 0 : k8 > 0, "layer %d: %ld launches of the fused gate/up form", v, k8);
        const long long tw = tu_stored_twice();
        EXPECT(!tw, "layer %d: the forward's kernels stored %lld bytes twice", v, tw);
#endif
        if (!v && fam == MOEPT_FAMILY_MIXTRAL)
            q8t_epilogue(c, c->slots[c->last].a, F, c->lda_a, "a, quantized");
        const int kept = !v && F % 128 == 0 && moept__gk_w8(c); /* (a's, dh's copies down the rows: the
                                                                   kernels') */
        if (kept && fam == MOEPT_FAMILY_MIXTRAL) { /* (the forward's copies, before the backward reads
                                                     them) */
            q8t_epilogue_down(c, c->slots[c->last].a, F, c->lda_a, c->q8a, c->q8sa, E > MOEPT__GK_RUNS,
                              "a down its rows");
            q8t_epilogue_down(c, c->slots[c->last].xr, D, moept__q8_recw(D), c->q8x, c->q8sx,
                              E > MOEPT__GK_RUNS, "x's records down their rows");
        }
#ifdef MOEPT_CUDA_EMU_KERNELS_H
        const long p0 = moept_emu_launches("moept__k_q8_cols");
        q8t_count0();
#endif
        EXPECT(!moept_backward(L[v], xf, xf, (float *)dx[v]), "backward: %s", moept_last_error(L[v]));
#ifdef MOEPT_CUDA_EMU_KERNELS_H /* (x, a, dy and dh down their rows, a launch each 64 experts; dy's and
                                   dh's by the down dgrad; x's and a's launched, and done at once where
                                   the copies are there) */
        const long long twb = tu_stored_twice();
        EXPECT(!twb, "layer %d: the backward's kernels stored %lld bytes twice", v, twb);
        const long np8 = moept_emu_launches("moept__k_q8_cols") - p0;
        const long per = kept ? 2 : 4; /* (passes a launch of groups) */
        EXPECT(fam != MOEPT_FAMILY_MIXTRAL || np8 == per * ((E + MOEPT__Q8_G - 1) / MOEPT__Q8_G),
               "layer %d: %ld column passes in the backward", v, np8);
#endif
        if (!v && fam == MOEPT_FAMILY_MIXTRAL && F % 128 == 0) { /* (q8r, q8b last written by the down
                                                                    dgrad) */
            q8t_epilogue(c, c->slots[c->last].h, 2 * F, 2 * F, "dh, quantized");
            if (kept)
                q8t_epilogue_down(c, c->slots[c->last].h, 2 * F, 2 * F, c->q8b, c->q8sb, E > MOEPT__GK_RUNS,
                                  "dh down its rows");
            if (kept)
                q8t_epilogue_down(c, c->slots[c->last].yq, D, moept__q8_recw(D), c->q8y, c->q8sy,
                                  E > MOEPT__GK_RUNS, "dy's records down their rows");
        }
        float *pp = NULL, *gp = NULL;
        EXPECT_OK(moept_cuda_params(L[v], &pp, &gp, &np));
        if (gp) g[v] = q8t_host<float>(gp, (size_t)np * 4);
    }
    int same = g[0] && g[1] && q8t_same(g[0], g[1], (size_t)np * 4);
    for (int k = 0; k < 2 && L[1]; k++) {
        char *h0 = q8t_host<char>(k ? dx[0] : y[0], (size_t)(T * D) * 2);
        char *h1 = q8t_host<char>(k ? dx[1] : y[1], (size_t)(T * D) * 2);
        same = same && q8t_same(h0, h1, (size_t)(T * D) * 2);
        free(h0); free(h1);
    }
    EXPECT(same, "family %d: the fused quantizers' y, dx or gradients differ from the separate passes'",
           (int)fam);
    for (int v = 0; v < 2; v++) { moept_destroy(L[v]); cudaFree(y[v]); cudaFree(dx[v]); free(g[v]); }
    cudaFree(x);
    free(xh);
}

/* The grouped kernel's FP8 weight gradient (WGRAD8) on a kernel-form layer's scratch: O [n][wo] and
   I [n][wi] bf16 rows in groups of 37, 0, 130, 1 and 256 rows (k-steps 1, 0, 2, 1, 2; wo 200 and wi
   136: M and N tiles past the gradient's edge), their column passes into one [Cp][S] each (moept__q8_down's
   S; q8t_groups1 holds that layout), then g [E][wo][wi] (random first) += O^T I in one launch: against
   the sums in double of those E4M3 bytes times their scales, each 128 rows' sum times its row's scale of
   O and its column's of I, within fp32's rounding of them (on the emulated GPU, whose tensor cores add
   in fp32; a real one's keep fewer bits over a k-step: 2^-8 of the terms there, docs/PERF.md); the empty
   group's gradient untouched */
static void q8t_wgrad8(void) {
    moept_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.family = MOEPT_FAMILY_MIXTRAL; cfg.hidden_size = 72; cfg.intermediate_size = 128; cfg.num_experts = 5;
    cfg.top_k = 2; cfg.max_tokens = 16; cfg.fp8 = MOEPT_FP8_BLOCKWISE;
    moept_cuda_options o = {MOEPT_DTYPE_BF16, NULL, 0, 0, MOEPT_GEMM_KERNEL};
    moept_layer *L = NULL;
    EXPECT_OK(moept_create_cuda(&cfg, NULL, NULL, &o, &L));
    if (!L) return;
    moept__view view;
    moept__cuda *c = moept__cx(L, &view);
    char err[MOEPT__ERRLEN] = "";
    const int64_t E = 5, wo = 200, wi = 136, wop = 208, wip = 144, offs[6] = {0, 37, 37, 167, 168, 424};
    const int64_t n = offs[E], S = 768; /* (the groups' columns, each padded to 128) */
    const moept__runs R = moept__runs_groups(offs, E);
    unsigned long long rs = 17;
    moept__bf16 *oh = (moept__bf16 *)malloc((size_t)(n * (wo + wi)) * 2); /* (O's rows, then I's) */
    float *g0 = (float *)malloc((size_t)(E * wo * wi) * 4);
    for (int64_t i = 0; i < n * (wo + wi); i++) /* (magnitudes by row: the 128 x 1 scales differ) */
        oh[i] = moept__f32_to_bf16((float)tu_rand(&rs) * ldexpf(1.0f, (int)((i / 7) % 9) - 4));
    for (int64_t i = 0; i < E * wo * wi; i++) g0[i] = (float)tu_rand(&rs);
    moept__bf16 *od = q8t_dev<moept__bf16>(oh, (size_t)(n * (wo + wi)) * 2), *id = od + n * wo;
    float *gd = q8t_dev<float>(g0, (size_t)(E * wo * wi) * 4);
    moept_status st = moept__q8_room(c, 2048, err);
    if (!st) st = moept__q8_down<moept__bf16>(c, od, offs, E, wo, wo, c->q8b, c->q8sb, err, NULL, NULL, 0, S);
    if (!st) st = moept__q8_down<moept__bf16>(c, id, offs, E, wi, wi, c->q8a, c->q8sa, err, NULL, NULL, 0, S);
    moept__gk_ext ge = {};
    ge.bn = wip; ge.sa = c->q8sb; ge.sarows = wop; ge.sars = wop; ge.sb = c->q8sa; ge.sbld = wip;
    if (!st)
        st = moept__gk<MOEPT__GK_WGRAD8>(c, &R, c->q8b, S, c->q8a, S, NULL, wo, wi, 0, gd, wi, NULL, &ge,
                                         err);
    EXPECT(!st, "%s", err);
    uint8_t *qa = q8t_host<uint8_t>(c->q8a, (size_t)(wip * S));
    uint8_t *qb = q8t_host<uint8_t>(c->q8b, (size_t)(wop * S));
    float *sa = q8t_host<float>(c->q8sa, (size_t)(6 * wip) * 4);
    float *sb = q8t_host<float>(c->q8sb, (size_t)(6 * wop) * 4);
    float *g = q8t_host<float>(gd, (size_t)(E * wo * wi) * 4);
#ifdef MOEPT_CUDA_EMU_KERNELS_H
    const double tol = 1.5e-5;
#else
    const double tol = 0x1p-8;
#endif
    int64_t k0 = 0, lb = 0, bad = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = offs[e + 1] - offs[e], L8 = MOEPT__Q8_L(rows);
        for (int64_t m = 0; m < wo; m++)
            for (int64_t j = 0; j < wi; j++) {
                double sum = g0[(e * wo + m) * wi + j], mag = fabs(sum);
                for (int64_t b = 0; b < L8; b++) {
                    double t = 0.0, ta = 0.0;
                    for (int64_t k = 128 * b; k < 128 * b + 128; k++) {
                        const double p = (double)moept__e4m3_f32(qb[m * S + k0 + k]) *
                                         (double)moept__e4m3_f32(qa[j * S + k0 + k]);
                        t += p, ta += fabs(p);
                    }
                    const double sc = (double)sb[(lb + b) * wop + m] * sa[(lb + b) * wip + j];
                    sum += t * sc, mag += ta * sc;
                }
                const float got = g[(e * wo + m) * wi + j];
                bad += rows ? !(fabs(got - sum) <= tol * mag) : got != g0[(e * wo + m) * wi + j];
            }
        k0 += L8 * 128, lb += L8;
    }
    EXPECT(bad == 0, "the FP8 weight gradient: %lld of %lld gradients off the sums in double", (long long)bad,
           (long long)(E * wo * wi));
    moept_destroy(L);
    cudaFree(od); cudaFree(gd);
    free(oh); free(g0); free(qa); free(qb); free(sa); free(sb); free(g);
}

/* a's and x's records' copies down their rows, kept in the scratch from a training forward for its
   backward (moept__q8_kept),
   and between them (v) 1: an evaluation of T2 tokens (the copy stays), 2: the scratch grown in place (the
   copy gone), 3: the receive block grown, a moved (the scratch first grown apart: the copy gone with a),
   4: in a layer of two slots (whose first forward into a slot writes none), the forward run again (a
   copy), then, its backward dropped as a non-finite y drops it, a forward into the slot again (none:
   the copy gone with the a it rewrote), against the two calls alone: y, dx and every gradient bitwise;
   on the emulated GPU the bytes the backward's kernels write counted: the copies', their bytes and
   scales, more where they are gone (their passes run, once c->q8own's word is zeroed) */
static void q8t_kept(int64_t T, int64_t T2) {
    enum { NV = 5 };
    moept_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.family = MOEPT_FAMILY_MIXTRAL; cfg.hidden_size = 72; cfg.intermediate_size = 128; cfg.num_experts = 4;
    cfg.top_k = 2; cfg.max_tokens = T2; cfg.fp8 = MOEPT_FP8_BLOCKWISE;
    const int64_t D = cfg.hidden_size;
    const size_t ob = (size_t)(T * D) * 4; /* (y, then dx: bf16) */
    moept_cuda_options o = {MOEPT_DTYPE_BF16, NULL, 0, 0, MOEPT_GEMM_KERNEL};
    unsigned long long rs = 9;
    moept__bf16 *xh = (moept__bf16 *)malloc((size_t)(T2 * D) * 2);
    for (int64_t i = 0; i < T2 * D; i++) xh[i] = moept__f32_to_bf16((float)tu_rand(&rs));
    float *x = (float *)q8t_dev<moept__bf16>(xh, (size_t)(T2 * D) * 2);
    char *out[NV] = {NULL}, *ye = q8t_dev<char>(NULL, (size_t)(T2 * D) * 2), *h[NV] = {NULL};
    float *g[NV] = {NULL};
#ifdef MOEPT_CUDA_EMU_KERNELS_H /* (the emulator's counts: the backward's kernels' bytes, the first forward's;
                                   the copies') */
    long long wrote[NV] = {0}, fwrote[NV] = {0}, copy = 0;
#endif
    int64_t np = 0;
    char err[MOEPT__ERRLEN] = "";
    const char *what[NV] = {"", "the evaluation", "the scratch's growth", "the receive block's growth",
                            "a forward again after a dropped one"};
    for (int v = 0; v < NV && !tu_bad; v++) {
        moept_layer *L = NULL;
        moept_config cv = cfg;
        cv.max_inflight = v == 4 ? 2 : 0;
        EXPECT_OK(moept_create_cuda(&cv, NULL, NULL, &o, &L));
        if (!L) break;
        moept_init_params(L, 7);
        moept__view view;
        moept__cuda *c = moept__cx(L, &view);
        if (v == 3) EXPECT_OK(moept__q8_room(c, 4 * c->q8rows, err));
        out[v] = q8t_dev<char>(NULL, ob);
#ifdef MOEPT_CUDA_EMU_KERNELS_H
        q8t_count0();
#endif
        EXPECT(!moept_forward(L, x, T, (float *)out[v]), "forward: %s", moept_last_error(L));
#ifdef MOEPT_CUDA_EMU_KERNELS_H
        fwrote[v] = q8t_counts(NULL).kwrite;
        const long long tw = tu_stored_twice();
        EXPECT(!tw, "%s: the forward's kernels stored %lld bytes twice", what[v], tw);
#endif
        EXPECT(v < 4 || !q8t_owner(c), "two slots: the first forward into one wrote a copy of a");
        if (v == 4) EXPECT(!moept_forward(L, x, T, (float *)out[v]), "again: %s", moept_last_error(L));
        moept__cslot *sl = &c->slots[c->last];
        const void *a = sl->a;
        const int64_t rows = c->q8rows;
        EXPECT(q8t_owner(c) == a, "the forward kept no copy of a");
        moept_forward_opts fo = {NULL, 1, NULL, NULL, 0};
        if (v == 1)
            EXPECT(!moept_forward_ex(L, x, T2, (float *)ye, &fo), "evaluation: %s", moept_last_error(L));
        if (v == 2) EXPECT_OK(moept__q8_room(c, c->q8rows + 1, err));
        if (v == 3) EXPECT_OK(moept__grow(c, sl, sl->Rcap + 1, err));
        if (v == 4) sl->fwd_valid = 0; /* (as a backward that found y not finite leaves it) */
        if (v == 4) EXPECT(!moept_forward(L, x, T, (float *)out[v]), "third: %s", moept_last_error(L));
        EXPECT(v < 2 || ((v == 2) == (c->q8rows > rows) && (v == 3) == (sl->a != a)), "%s: the scratch %lld "
               "rows, then %lld; a %s", what[v], (long long)rows, (long long)c->q8rows,
               sl->a != a ? "moved" : "in place");
        EXPECT((q8t_owner(c) == a) == (v < 2), "%s: the copy %s", what[v], q8t_owner(c) ? "kept" : "gone");
#ifdef MOEPT_CUDA_EMU_KERNELS_H
        q8t_count0();
#endif
        EXPECT(!moept_backward(L, x, x, (float *)(out[v] + ob / 2)), "backward: %s", moept_last_error(L));
#ifdef MOEPT_CUDA_EMU_KERNELS_H
        wrote[v] = q8t_counts(NULL).kwrite;
        const long long twb = tu_stored_twice();
        EXPECT(!twb, "%s: the backward's kernels stored %lld bytes twice", what[v], twb);
        const moept__runs R = moept__runs_groups(sl->roffsets, c->sp.El);
        const int64_t S = moept__q8_wide(&R);
        const int64_t wide = cfg.intermediate_size + MOEPT__Q8_PAD(D); /* (a's columns, x's) */
        copy = wide * S + wide * (S / 128) * 4;
#endif
        float *pp = NULL, *gp = NULL;
        EXPECT_OK(moept_cuda_params(L, &pp, &gp, &np));
        if (gp) g[v] = q8t_host<float>(gp, (size_t)np * 4);
        moept_destroy(L);
    }
    for (int v = 0; v < NV && out[NV - 1]; v++) h[v] = q8t_host<char>(out[v], ob);
    for (int v = 1; v < NV; v++) {
        EXPECT(h[v] && g[0] && g[v] && q8t_same(h[0], h[v], ob) && q8t_same(g[0], g[v], (size_t)np * 4),
               "%s between a forward and its backward changed y, dx or the gradients", what[v]);
#ifdef MOEPT_CUDA_EMU_KERNELS_H
        EXPECT(wrote[v] == wrote[0] + (v > 1) * (copy + 8), "%s: the backward's kernels wrote %lld bytes, "
               "%lld without (the copies: %lld, and c->q8own zeroed before a's pass)", what[v], wrote[v],
               wrote[0], copy);
#endif
    }
#ifdef MOEPT_CUDA_EMU_KERNELS_H /* (the bytes the forward that writes the copies writes: the first into a
                                   slot of two's, which writes none, the copies' and c->q8own's) */
    EXPECT(fwrote[0] == fwrote[NV - 1] + copy + 16, "the forward's kernels wrote %lld bytes, %lld without "
           "the copies (%lld bytes)", fwrote[0], fwrote[NV - 1], copy);
#endif
    for (int v = 0; v < NV; v++) free(h[v]), free(g[v]), cudaFree(out[v]);
    free(xh);
    cudaFree(ye); cudaFree(x);
}

/* the weights' E4M3 copies (c->q8w: each matrix's bytes and scales, both layouts) set to 0xa5, so what a
   kernel leaves unwritten shows */
static void q8t_wpoison(moept__cuda *c) {
    for (int i = 0; i < 2; i++) {
        const moept__q8w *w = &c->q8w[i];
        const size_t n = (size_t)w->n, Dp = (size_t)MOEPT__Q8_PAD(c->sp.D);
        void *p[8] = {w->w13, w->w13t, w->w2, w->w2t, w->s13, w->s13t, w->s2, w->s2t};
        const size_t b[8] = {n * w->Hp * Dp, n * w->Hp * Dp, n * Dp * w->Fp, n * Dp * w->Fp,
                             n * w->ns13 * 4, n * w->ns13t * 4, n * w->ns2 * 4, n * w->ns2t * 4};
        for (int k = 0; k < 8; k++) cudaMemset(p[k], 0xa5, b[k]);
    }
}
/* the weights' E4M3 copies (c->q8w, both layouts) against the tile rules' shared math on the masters w
   (the layer's parameters): each 128 x 128 block's scale moept__q8_scale(its amax) at its place in both
   scale layouts (their padding to 4 blocks as q8t_wpoison left it), each byte e4m3(v / s), zeros in the
   padding to 16; the mismatches */
static int64_t q8t_wcheck(moept__cuda *c, const float *w) {
    int64_t bad = 0;
    const int64_t D = c->sp.D, Dp = MOEPT__Q8_PAD(D), TL = MOEPT__Q8_TILE;
    for (int i = 0; i < 2; i++)
        for (int m = 0; m < 2 && c->q8w[i].n; m++) {
            const moept__q8w *qw = &c->q8w[i];
            const int64_t M = m ? D : qw->H, K = m ? qw->F : D, Mp = m ? Dp : qw->Hp, Kp = m ? qw->Fp : Dp;
            const int64_t ns = m ? qw->ns2 : qw->ns13, nst = m ? qw->ns2t : qw->ns13t, n = qw->n;
            uint8_t *q = q8t_host<uint8_t>(m ? qw->w2 : qw->w13, (size_t)(n * Mp * Kp));
            uint8_t *qt = q8t_host<uint8_t>(m ? qw->w2t : qw->w13t, (size_t)(n * Mp * Kp));
            float *sq = q8t_host<float>(m ? qw->s2 : qw->s13, (size_t)(n * ns) * 4);
            float *st = q8t_host<float>(m ? qw->s2t : qw->s13t, (size_t)(n * nst) * 4);
            for (int64_t e = 0; e < n; e++)
                for (int64_t i0 = 0; i0 < Mp; i0 += TL)
                    for (int64_t j0 = 0; j0 < Kp; j0 += TL) {
                        const float *we = w + (m ? qw->off2 : qw->off13) + e * M * K;
                        float amax = 0.0f;
                        for (int64_t r = i0; r < i0 + TL && r < M; r++)
                            for (int64_t k = j0; k < j0 + TL && k < K; k++)
                                amax = moept__q8_amax(amax, we[r * K + k]);
                        const float sc = moept__q8_scale(amax);
                        bad += sq[e * ns + i0 / TL * MOEPT__Q8_L4(Kp) + j0 / TL] != sc;
                        bad += st[e * nst + j0 / TL * MOEPT__Q8_L4(Mp) + i0 / TL] != sc;
                        for (int64_t r = i0; r < i0 + TL && r < Mp; r++)
                            for (int64_t k = j0; k < j0 + TL && k < Kp; k++) {
                                const float v = r < M && k < K ? we[r * K + k] / sc : 0.0f;
                                const uint8_t b = r < M && k < K ? moept__e4m3_byte(moept__e4m3_round(v)) : 0;
                                bad += q[(e * Mp + r) * Kp + k] != b;
                                bad += qt[(e * Kp + k) * Mp + r] != b;
                            }
                    }
            for (int l = 0; l < 2; l++) { /* (each scale layout's rows past their blocks: unwritten) */
                const float *sc = l ? st : sq;
                const int64_t rows = MOEPT__Q8_L(l ? Kp : Mp), live = MOEPT__Q8_L(l ? Mp : Kp);
                const int64_t len = MOEPT__Q8_L4(l ? Mp : Kp), per = l ? nst : ns;
                for (int64_t e = 0; e < n; e++)
                    for (int64_t r = 0; r < rows; r++)
                        for (int64_t k = live; k < len; k++) {
                            uint32_t u;
                            memcpy(&u, sc + e * per + r * len + k, 4);
                            bad += u != 0xa5a5a5a5u;
                        }
            }
            free(q); free(qt); free(sq); free(st);
        }
    return bad;
}
/* AdamW's own pass (moept__cuda_adamw: the expert weights stepped a 128 x 128 block a thread block, their
   E4M3 copies made from the new values in the same pass) against the plain pass and moept__q8_weights: a
   bf16 layer in FP8 and the same layer without (the flat kernel over every parameter), the same
   parameters and two steps' gradients: the masters, the moments and the bf16 copy bitwise the flat
   kernel's (one element's step, moept__adamw1, in both), and the E4M3 copies and their scales (every byte
   poisoned first) bitwise moept__q8_weights' of the new masters; on the emulated GPU the optimizer's
   kernels read the bytes the flat one reads (the masters once) and write the copies' bytes more. D 302
   (rows of no 4-vectors), F 200 and the shared expert's 136 (blocks past the edges); D 72, F 256 with a
   shared expert (4-vectors, the shared gate's too, the flat kernel's run after the copies' masters) and
   without one in an fp32 layer (no bf16 copy) */
static void q8t_adamw(moept_family fam, int64_t D, int64_t F, int64_t S, moept_dtype dt) {
    moept_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.family = fam; cfg.hidden_size = D; cfg.intermediate_size = F; cfg.num_experts = 3; cfg.top_k = 2;
    cfg.norm_topk_prob = 1; cfg.max_tokens = 16; cfg.shared_intermediate_size = S;
    moept_cuda_options o = {dt, NULL, 0, 0, MOEPT_GEMM_AUTO};
    moept_adamw opt = {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
    moept_layer *L[2] = {NULL, NULL};
    moept__cuda *c[2] = {NULL, NULL};
    moept__view view[2];
    int64_t np = 0;
    float *pp[2] = {NULL, NULL}, *gp[2] = {NULL, NULL}, *gh = NULL;
#ifdef MOEPT_CUDA_EMU_KERNELS_H
    long long rd[2] = {0, 0}, wr[2] = {0, 0}; /* (the emulator's counts: the optimizer's bytes) */
#endif
    unsigned long long rs = 11;
    for (int v = 0; v < 2; v++) { /* (0: FP8) */
        moept_config cv = cfg;
        cv.fp8 = v ? MOEPT_FP8_OFF : MOEPT_FP8_BLOCKWISE;
        EXPECT_OK(moept_create_cuda(&cv, NULL, NULL, &o, &L[v]));
        if (!L[v]) break;
        moept_init_params(L[v], 7);
        c[v] = moept__cx(L[v], &view[v]);
        EXPECT_OK(moept_cuda_params(L[v], &pp[v], &gp[v], &np));
    }
    if (L[1]) gh = (float *)malloc((size_t)np * 4);
    for (int step = 0; step < 2 && gh && !tu_bad; step++) {
        for (int64_t i = 0; i < np; i++) gh[i] = (float)tu_rand(&rs) * 0.25f;
        for (int v = 0; v < 2; v++) {
            cudaMemcpy(gp[v], gh, (size_t)np * 4, cudaMemcpyHostToDevice);
            if (!v) q8t_wpoison(c[v]);
#ifdef MOEPT_CUDA_EMU_KERNELS_H
            q8t_count0();
#endif
            EXPECT(!moept_adamw_step(L[v], &opt), "AdamW: %s", moept_last_error(L[v]));
#ifdef MOEPT_CUDA_EMU_KERNELS_H
            const moept_emu_counts n = q8t_counts("optimizer");
            rd[v] = n.kread, wr[v] = n.kwrite;
#endif
        }
        float *h[2][3] = {{NULL}};
        for (int v = 0; v < 2; v++) {
            h[v][0] = q8t_host<float>(pp[v], (size_t)np * 4);
            h[v][1] = q8t_host<float>(c[v]->opt_m, (size_t)np * 4);
            h[v][2] = q8t_host<float>(c[v]->opt_v, (size_t)np * 4);
        }
        const int64_t nl = c[0]->wlow ? np - c[0]->sp.E * D : 0; /* (the bf16 copy's: a bf16 layer's) */
        char *l[2] = {NULL, NULL};
        for (int v = 0; v < 2 && nl; v++) l[v] = q8t_host<char>(c[v]->wlow, (size_t)nl * 2);
        int same = !nl || q8t_same(l[0], l[1], (size_t)nl * 2);
        for (int k = 0; k < 3; k++) same = same && q8t_same(h[0][k], h[1][k], (size_t)np * 4);
        EXPECT(same, "D %lld, step %d: AdamW's own pass's masters, moments or bf16 copy differ from the "
               "flat kernel's", (long long)D, step);
        int64_t bad[2] = {q8t_wcheck(c[0], h[0][0]), 0};
        q8t_wpoison(c[0]);
        EXPECT(moept__q8_weights(c[0]) == cudaSuccess, "moept__q8_weights");
        bad[1] = q8t_wcheck(c[0], h[0][0]);
        EXPECT(!bad[0] && !bad[1], "D %lld, step %d: the E4M3 copies of the new masters, AdamW's own pass's "
               "and the separate pass's, differ from their tiles' bytes and scales in %lld and %lld places",
               (long long)D, step, (long long)bad[0], (long long)bad[1]);
#ifdef MOEPT_CUDA_EMU_KERNELS_H
        long long qw = 0; /* (the copies' bytes and each block's two scales) */
        for (int i = 0; i < 2; i++) {
            const moept__q8w *w = &c[0]->q8w[i];
            const int64_t Dp = MOEPT__Q8_PAD(D), b13 = MOEPT__Q8_L(w->Hp) * MOEPT__Q8_L(Dp);
            qw += w->n * (2 * w->Hp * Dp + 2 * Dp * w->Fp + 8 * (b13 + MOEPT__Q8_L(Dp) * MOEPT__Q8_L(w->Fp)));
        }
        EXPECT(rd[0] == rd[1] && wr[0] == wr[1] + qw, "D %lld, step %d: the FP8 layer's optimizer read %lld "
               "bytes and wrote %lld, the flat step's %lld and %lld (the E4M3 copies: %lld)", (long long)D,
               step, rd[0], wr[0], rd[1], wr[1], qw);
#endif
        for (int v = 0; v < 2; v++) free(h[v][0]), free(h[v][1]), free(h[v][2]), free(l[v]);
    }
    free(gh);
    for (int v = 0; v < 2; v++) moept_destroy(L[v]);
}

static void test_fused(void) {
    setenv("MOEPT_EMU_CC", "90", 1);
    q8t_fused(MOEPT_FAMILY_MIXTRAL, 200, 40);
    q8t_fused(MOEPT_FAMILY_MIXTRAL, 136, 40); /* (a's second tile of one subtile, 8 columns) */
    q8t_fused(MOEPT_FAMILY_QWEN2_MOE, 200, 40);
    q8t_fused(MOEPT_FAMILY_MIXTRAL, 256, 300); /* (F a multiple of 128: the down dgrad quantizes dh too;
                                                   an expert's rows past a tile) */
    q8t_fused(MOEPT_FAMILY_QWEN2_MOE, 256, 40);
    q8t_fused(MOEPT_FAMILY_MIXTRAL, 384, 300, 4, 300); /* (x's copy: three k-steps, three n-tiles) */
    q8t_fused(MOEPT_FAMILY_MIXTRAL, 1280, 150, 2); /* (... ten n-tiles, a share of 12 or 13 columns a CTA) */
    q8t_kept(40, 300);
    q8t_wgrad8();
    q8t_adamw(MOEPT_FAMILY_QWEN2_MOE, 302, 200, 136, MOEPT_DTYPE_BF16);
    q8t_adamw(MOEPT_FAMILY_QWEN2_MOE, 72, 256, 128, MOEPT_DTYPE_BF16);
    q8t_adamw(MOEPT_FAMILY_MIXTRAL, 72, 256, 0, MOEPT_DTYPE_F32);
    unsetenv("MOEPT_EMU_CC");
}
/* The kernel form's FP8 step of cfg (T tokens) against the per-expert (cuBLASLt) form's on the same
   parameters and tokens: y, dx and each parameter's gradient within 2^-4 of its largest value (the
   same quantized operands, summed in other orders: an E4M3 rounding moved here and there), a form's
   launch over runs past its first (each a run's offsets of its own) among them */
static void q8t_forms(moept_config cfg, int64_t T) {
    const int64_t D = cfg.hidden_size;
    unsigned long long rs = 9;
    moept__bf16 *xh = (moept__bf16 *)malloc((size_t)(T * D) * 2);
    for (int64_t i = 0; i < T * D; i++) xh[i] = moept__f32_to_bf16((float)tu_rand(&rs));
    const float *x = (const float *)q8t_dev<moept__bf16>(xh, (size_t)(T * D) * 2); /* (the layer's bf16) */
    float *h[2][3] = {{NULL, NULL, NULL}, {NULL, NULL, NULL}}; /* [form][y, dx, gradients] */
    int64_t np = 0;
    for (int f = 0; f < 2 && !tu_bad; f++) {
        const moept_cuda_options o = {MOEPT_DTYPE_BF16, NULL, 0, 0,
                                      f ? MOEPT_GEMM_PER_EXPERT : MOEPT_GEMM_KERNEL};
        moept_layer *L = NULL;
        char *yd = q8t_dev<char>(NULL, (size_t)(T * D) * 2), *dxd = q8t_dev<char>(NULL, (size_t)(T * D) * 2);
        float *pp = NULL, *gp = NULL;
        EXPECT_OK(moept_create_cuda(&cfg, NULL, NULL, &o, &L));
        if (L && !moept_init_params(L, 7) && !moept_forward(L, x, T, (float *)yd) &&
            !moept_backward(L, x, x, (float *)dxd) && !moept_cuda_params(L, &pp, &gp, &np)) {
            moept__bf16 *by = q8t_host<moept__bf16>(yd, (size_t)(T * D) * 2);
            moept__bf16 *bdx = q8t_host<moept__bf16>(dxd, (size_t)(T * D) * 2);
            h[f][0] = (float *)malloc((size_t)(T * D) * 4), h[f][1] = (float *)malloc((size_t)(T * D) * 4);
            for (int64_t i = 0; i < T * D; i++) h[f][0][i] = q8t_f(by, i), h[f][1][i] = q8t_f(bdx, i);
            h[f][2] = q8t_host<float>(gp, (size_t)np * 4);
            free(by); free(bdx);
        }
        EXPECT(L && h[f][2], "form %d: %s", f, L ? moept_last_error(L) : "not made");
        moept_destroy(L);
        cudaFree(yd); cudaFree(dxd);
    }
    for (int k = 0; k < 3 && h[1][2]; k++) { /* (the gradients: one buffer; its largest) */
        const int64_t n = k < 2 ? T * D : np;
        double big = 1e-30, diff = 0.0;
        for (int64_t i = 0; i < n; i++) {
            big = fmax(big, fabs(h[1][k][i]));
            diff = fmax(diff, fabs((double)h[0][k][i] - h[1][k][i]));
        }
        EXPECT(diff <= big / 16, "%s: the kernel form's off the per-expert form's by %.3g (largest %.3g)",
               k == 0 ? "y" : k == 1 ? "dx" : "the gradients", diff, big);
    }
    for (int f = 0; f < 2; f++) for (int k = 0; k < 3; k++) free(h[f][k]);
    cudaFree((void *)x);
    free(xh);
}

/* ... with 300 experts, each form's launches over runs past its first (240 runs, then the rest), and F
   16512 (more n-tiles than the records' 128 columns): --wide (make stress, where the emulator takes a
   few minutes over it) */
static void test_wide(void) {
    setenv("MOEPT_EMU_CC", "90", 1);
    q8t_fused(MOEPT_FAMILY_MIXTRAL, 128, 300, 300);
    q8t_fused(MOEPT_FAMILY_MIXTRAL, 16512, 150, 2); /* (129 n-tiles: some CTAs' share of x's and dy's copies
                                                      none) */
    moept_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.family = MOEPT_FAMILY_MIXTRAL; cfg.hidden_size = 72; cfg.intermediate_size = 128;
    cfg.num_experts = 300; cfg.top_k = 2; cfg.max_tokens = 300; cfg.fp8 = MOEPT_FP8_BLOCKWISE;
    q8t_forms(cfg, 300);
    unsetenv("MOEPT_EMU_CC");
}

int main(int argc, char **argv) {
    const int wide = argc > 1 && !strcmp(argv[1], "--wide");
    const char *cvt = "E4M3 conversions on the device (sm_89's cvt, or software): moept.c's bytes and values "
                      "at every tie, saturation, zero and NaN";
    const char *name = "FP8 records, their cuBLASLt copy, a chunk's runs, the wgrad's column-wise x and "
                       "the rows' copy from its read: the separate passes' bytes, the CPU's values";
    const char *fused =
        wide ? "the kernel form's FP8 layer with 300 experts (each grouped launch 240 runs): its fused "
               "quantizers' results the separate passes' bitwise, a's and dh's two copies theirs; its step "
               "the per-expert form's"
             : "the kernel form's FP8 layer: its fused quantizers' results the separate passes' bitwise, the "
               "gate/up kernel's a and the down dgrad's dh both ways theirs, a's copy kept for the backward "
               "(an evaluation between, a growth); its weight gradient against sums in double";
    int major = 0, minor = 0; /* (the kernel form: compute capability 9.0; the emulator answers it) */
    if (moept_cuda_device_count() > 0) {
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
    }
#ifdef MOEPT_CUDA_EMU_KERNELS_H
    major = 9, minor = 0;
#endif
    if (moept_cuda_device_count() < 1) {
        if (!wide) tu_skip(cvt, "no CUDA device");
        if (!wide) tu_skip(name, "no CUDA device");
        tu_skip(fused, "no CUDA device");
    } else {
        if (!wide) tu_run(cvt, test_cvt);
        if (!wide) tu_run(name, test_records);
        if (major == 9 && minor == 0) tu_run(fused, wide ? test_wide : test_fused);
        else tu_skip(fused, "the kernel GEMM form needs compute capability 9.0");
    }
    return tu_done();
}
