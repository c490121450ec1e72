/* White box: config.fp8's token-row quantizers on the emulated GPU, byte for byte, each against the
   separate pass it replaces and against the CPU layer's spec (moept.c's moept__q8_rows, _cols, written
   here again from the tile rules' shared math: amax, scale, rounding):
   - the dispatch's FP8 records (moept__q8_records: x's rows through the row index, -1 zeros) hold the
     bytes and scales moept__q8_along makes of the same rows gathered first, and their values
     e4m3 * scale are the CPU's quantized rows;
   - a record as cuBLASLt's operand (moept__q8_unrec) is moept__q8_along's output, padding rows too;
   - the W13 wgrad's column-wise x from the records (moept__q8_down<uint8_t>, dequantized as read)
     is moept__q8_down of the dequantized rows in fp32, and the CPU's moept__q8_cols of them.
   fp32 and bf16 rows; widths with whole, edge and lone tiles. */
#include "../moept_kernels.cu"
#include "testutil.h"

/* [n] floats of a 16-bit or 32-bit device buffer's host copy, as floats */
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
static void *q8t_dev(const void *h, size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes + 16) != cudaSuccess) return NULL;
    if (h) cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    else cudaMemset(d, 0xa5, bytes + 16); /* (what a kernel leaves unwritten shows) */
    return d;
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

template <typename T>
static void q8t_width(int64_t D, cudaStream_t s) {
    const int64_t Tn = 50, n = 37, Dp = MOEPT__Q8_PAD(D), L = MOEPT__Q8_L(D), W = moept__q8_recw(D);
    const int64_t np = MOEPT__Q8_PAD(n);
    unsigned long long rs = 11 + (unsigned long long)D;
    T *x = (T *)malloc((size_t)(Tn * D) * sizeof(T));
    float *xs = (float *)calloc((size_t)(n * D), sizeof(float)), *cpu = (float *)malloc((size_t)(n * D) * 4);
    int64_t idx[n];
    for (int64_t i = 0; i < Tn * D; i++) { /* magnitudes 2^-20 .. 2^20 a row, some rows zero */
        const int64_t r = i / D;
        x[i] = q8t_t<T>(r % 9 == 4 ? 0.0f : (float)tu_rand(&rs) * ldexpf(1.0f, (int)(r % 41) - 20));
    }
    for (int64_t r = 0; r < n; r++) idx[r] = r % 7 == 3 ? -1 : (r * 13 + 5) % Tn;
    for (int64_t r = 0; r < n; r++)
        for (int64_t d = 0; d < D && idx[r] >= 0; d++) xs[r * D + d] = q8t_f<T>(x, idx[r] * D + d);
    T *xst = (T *)malloc((size_t)(n * D) * sizeof(T));
    for (int64_t i = 0; i < n * D; i++) xst[i] = q8t_t<T>(xs[i]);
    moept__cuda c;
    memset(&c, 0, sizeof c);
    c.sp.D = D;
    c.s = s;
    c.esz = (int)sizeof(T);
    char err[MOEPT__ERRLEN] = "";
    void *xd = q8t_dev(x, (size_t)(Tn * D) * sizeof(T)), *xsd = q8t_dev(xst, (size_t)(n * D) * sizeof(T));
    int64_t *idxd = (int64_t *)q8t_dev(idx, sizeof idx);
    uint8_t *rec = (uint8_t *)q8t_dev(NULL, (size_t)(n * W));
    uint8_t *q = (uint8_t *)q8t_dev(NULL, (size_t)(np * Dp));
    uint8_t *q2 = (uint8_t *)q8t_dev(NULL, (size_t)(np * Dp));
    float *sc = (float *)q8t_dev(NULL, (size_t)(L * np) * 4);
    float *sc2 = (float *)q8t_dev(NULL, (size_t)(L * np) * 4);
    moept_status st = moept__q8_records<T>(&c, (const T *)xd, idxd, n, rec, err);
    if (!st) st = moept__q8_along<T>(&c, xsd, n, D, D, q, sc, 0, err);
    if (!st) st = moept__q8_unrec(&c, rec, n, D, q2, sc2, 0, err);
    cudaStreamSynchronize(s);
    EXPECT(!st, "D %lld: %s", (long long)D, err);
    uint8_t *hrec = (uint8_t *)malloc((size_t)(n * W)), *hq = (uint8_t *)malloc((size_t)(np * Dp));
    uint8_t *hq2 = (uint8_t *)malloc((size_t)(np * Dp));
    float *hs = (float *)malloc((size_t)(L * np) * 4), *hs2 = (float *)malloc((size_t)(L * np) * 4);
    cudaMemcpy(hrec, rec, (size_t)(n * W), cudaMemcpyDeviceToHost);
    cudaMemcpy(hq, q, (size_t)(np * Dp), cudaMemcpyDeviceToHost);
    cudaMemcpy(hq2, q2, (size_t)(np * Dp), cudaMemcpyDeviceToHost);
    cudaMemcpy(hs, sc, (size_t)(L * np) * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(hs2, sc2, (size_t)(L * np) * 4, cudaMemcpyDeviceToHost);
    /* the records against the separate pass, and their values against the CPU's rows */
    q8t_cpu(xs, n, D, 0, cpu);
    int64_t bytes = 0, scales = 0, vals = 0;
    float *deq = (float *)malloc((size_t)(n * D) * 4);
    for (int64_t r = 0; r < n; r++) {
        const float *rsc = (const float *)(hrec + r * W + Dp);
        bytes += !q8t_same(hrec + r * W, hq + r * Dp, (size_t)Dp);
        for (int64_t b = 0; b < L; b++) scales += !q8t_same(&rsc[b], &hs[b * np + r], 4);
        for (int64_t d = 0; d < D; d++) {
            deq[r * D + d] = moept__e4m3_f32(hrec[r * W + d]) * rsc[d / MOEPT__Q8_TILE];
            vals += !q8t_same(&deq[r * D + d], &cpu[r * D + d], 4);
        }
    }
    EXPECT(bytes == 0 && scales == 0, "D %lld, %s rows: records against moept__q8_along: %lld rows' bytes, "
           "%lld scales differ", (long long)D, sizeof(T) == 2 ? "bf16" : "fp32", (long long)bytes,
           (long long)scales);
    EXPECT(vals == 0, "D %lld, %s rows: %lld record values differ from the CPU's quantized rows",
           (long long)D, sizeof(T) == 2 ? "bf16" : "fp32", (long long)vals);
    EXPECT(q8t_same(hq, hq2, (size_t)(np * Dp)) && q8t_same(hs, hs2, (size_t)(L * np) * 4),
           "D %lld: the records as cuBLASLt's operand differ from moept__q8_along's", (long long)D);
    /* the wgrad's column-wise x: from the records against from their values in fp32, and the CPU's */
    const int64_t Cp = Dp, nb = MOEPT__Q8_L(np);
    uint8_t *qa = (uint8_t *)q8t_dev(NULL, (size_t)(Cp * np));
    uint8_t *qb = (uint8_t *)q8t_dev(NULL, (size_t)(Cp * np));
    float *sa = (float *)q8t_dev(NULL, (size_t)(nb * Cp) * 4);
    float *sb = (float *)q8t_dev(NULL, (size_t)(nb * Cp) * 4);
    float *deqd = (float *)q8t_dev(deq, (size_t)(n * D) * 4);
    st = moept__q8_down<uint8_t>(&c, rec, n, D, W, qa, sa, err);
    if (!st) st = moept__q8_down<float>(&c, deqd, n, D, D, qb, sb, err);
    cudaStreamSynchronize(s);
    EXPECT(!st, "D %lld: %s", (long long)D, err);
    uint8_t *ha = (uint8_t *)malloc((size_t)(Cp * np)), *hb = (uint8_t *)malloc((size_t)(Cp * np));
    float *hsa = (float *)malloc((size_t)(nb * Cp) * 4), *hsb = (float *)malloc((size_t)(nb * Cp) * 4);
    cudaMemcpy(ha, qa, (size_t)(Cp * np), cudaMemcpyDeviceToHost);
    cudaMemcpy(hb, qb, (size_t)(Cp * np), cudaMemcpyDeviceToHost);
    cudaMemcpy(hsa, sa, (size_t)(nb * Cp) * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(hsb, sb, (size_t)(nb * Cp) * 4, cudaMemcpyDeviceToHost);
    EXPECT(q8t_same(ha, hb, (size_t)(Cp * np)) && q8t_same(hsa, hsb, (size_t)(nb * Cp) * 4),
           "D %lld: the wgrad's x from the records differs from the same values' in fp32", (long long)D);
    q8t_cpu(deq, n, D, 1, cpu); /* (the CPU's, in place of its rows) */
    int64_t cvals = 0;
    for (int64_t r = 0; r < n; r++)
        for (int64_t d = 0; d < D; d++) {
            const float v = moept__e4m3_f32(ha[d * np + r]) * hsa[r / MOEPT__Q8_TILE * Cp + d];
            cvals += !q8t_same(&v, &cpu[r * D + d], 4);
        }
    EXPECT(cvals == 0, "D %lld: %lld of the wgrad's column-wise x differ from the CPU's", (long long)D,
           (long long)cvals);
    cudaFree(xd); cudaFree(xsd); cudaFree(idxd); cudaFree(rec); cudaFree(q); cudaFree(q2); cudaFree(sc);
    cudaFree(sc2); cudaFree(qa); cudaFree(qb); cudaFree(sa); cudaFree(sb); cudaFree(deqd);
    free(x); free(xs); free(cpu); free(xst); free(hrec); free(hq); free(hq2); free(hs); free(hs2); free(deq);
    free(ha); free(hb); free(hsa); free(hsb);
}

static void test_records(void) {
    const int64_t widths[5] = {64, 200, 7, 300, 136};
    for (int i = 0; i < 5; i++) { /* (on the legacy stream, as the test's own copies and sets) */
        q8t_width<float>(widths[i], 0);
        q8t_width<moept__bf16>(widths[i], 0);
    }
}

int main(void) {
    if (moept_cuda_device_count() < 1) {
        tu_skip("FP8 records, their cuBLASLt copy and the wgrad's column-wise x: the separate passes' bytes, "
                "the CPU's values", "no CUDA device");
        return tu_done();
    }
    tu_run("FP8 records, their cuBLASLt copy and the wgrad's column-wise x: the separate passes' bytes, the "
           "CPU's values", test_records);
    return tu_done();
}
