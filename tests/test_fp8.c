/* test_fp8: config.fp8 (DeepSeek-V3's blockwise E4M3) on CPU layers, held to
   its definition by code of this file's own:
   - E4M3 rounding against the format's 254 finite values (decoded from the
     bytes by the safetensors reader's decoder) by nearest search, ties to
     the even mantissa, saturating at 448, NaN kept, every subnormal; and
     each value's byte (the GPU's operands) against the decoder;
   - a tile's scale (amax / 448: the largest element maps to 448) and the
     round trip of every element within E4M3's step; edge tiles (fewer than
     128 elements) and blocks take their own scales; zero tiles stay zero;
   - the scale's floor, 2^-63 (no product of two scales under fp32's least
     normal): tiles of amax 1e-20 and 1e-30 quantize at it;
   - each of a layer's GEMMs, stage by stage, with D 200, F 136 (2F 272)
     and 150 rows an expert, so every operand has whole and edge tiles: h,
     the experts' outputs, both weight gradients, dh and the experts' dx
     equal fp64 products of operands this file quantizes, in the tiles
     moept.h names (rows 1 x 128 along the reduction, the wgrad's 128 x 1
     down each expert's rows, of x's and dy's rows as quantized along them,
     weights 128 x 128), to fp32 accumulation;
   - the FP8 layer differs from the fp32 one (it quantizes) within 2^-2;
   - an inference layer, and two forwards in flight, equal the training
     layer bitwise;
   - the combinations refused at create. */
#include "../moept.c"
#include "testutil.h"

/* ---- E4M3 by search over the format's values ---- */
static float e4m3_vals[256];
static void e4m3_table(void) { /* (sign, exponent biased by 7, 3 mantissa bits; S.1111.111 NaN) */
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        const double v = e == 15 && m == 7 ? NAN : e == 0 ? m * pow(2, -9) : (1 + m / 8.0) * pow(2, e - 7);
        e4m3_vals[b] = (float)(b & 0x80 ? -v : v);
    }
}

/* nearest finite E4M3 value to x, ties to the even mantissa (the byte's low bit), saturating */
static float e4m3_ref(float x) {
    if (x != x) return x;
    if (fabsf(x) >= 448.0f) return x < 0 ? -448.0f : 448.0f;
    int best = -1;
    double bd = INFINITY;
    for (int b = 0; b < 256; b++) {
        float v = e4m3_vals[b];
        if (v != v || (b & 0x80) != (x < 0 ? 0x80 : 0)) continue;
        double d = fabs((double)v - (double)x);
        if (d < bd || (d == bd && !(b & 1))) { bd = d; best = b; }
    }
    return e4m3_vals[best];
}

static void test_e4m3_round(void) {
    e4m3_table();
    int bad = 0;
    float worst_x = 0;
    /* every value, every midpoint between neighbours (the ties), and just off them */
    for (int b = 0; b < 0x7F; b++) {
        float v = e4m3_vals[b], w = b + 1 < 0x7F ? e4m3_vals[b + 1] : 480.0f, m = (v + w) / 2;
        const float xs[] = {v, m, nextafterf(m, 0), nextafterf(m, 1e9f), -v, -m, -nextafterf(m, 0)};
        for (int i = 0; i < 7; i++)
            if (moept__e4m3_round(xs[i]) != e4m3_ref(xs[i]) && !bad++) worst_x = xs[i];
    }
    unsigned long long s = 7;
    for (int i = 0; i < 200000; i++) { /* magnitudes 2^-14 .. 2^10 */
        double m = ldexp(1.0 + tu_rand(&s), (int)(tu_rand(&s) * 25) - 14);
        float x = (float)(tu_rand(&s) < 0.5 ? -m : m);
        if (moept__e4m3_round(x) != e4m3_ref(x) && !bad++) worst_x = x;
    }
    EXPECT(bad == 0, "%d values round apart from the nearest E4M3, first %.9g -> %.9g (want %.9g)", bad,
           (double)worst_x, (double)moept__e4m3_round(worst_x), (double)e4m3_ref(worst_x));
    EXPECT(moept__e4m3_round(448.0f) == 448.0f && moept__e4m3_round(463.9f) == 448.0f &&
           moept__e4m3_round(-1e30f) == -448.0f && moept__e4m3_round(INFINITY) == 448.0f,
           "saturation: 448, 463.9, -1e30, inf -> %g %g %g %g", moept__e4m3_round(448.0f),
           moept__e4m3_round(463.9f), moept__e4m3_round(-1e30f), moept__e4m3_round(INFINITY));
    EXPECT(moept__e4m3_round(0x1p-9f) == 0x1p-9f && moept__e4m3_round(0x1p-10f) == 0.0f &&
           moept__e4m3_round(0x3p-10f) == 0x1p-8f && moept__e4m3_round(0x7p-9f) == 0x7p-9f,
           "subnormals: 2^-9, 2^-10 (tie to 0), 3 2^-10 (tie to 2^-8), 7 2^-9");
    EXPECT(isnan(moept__e4m3_round(NAN)), "NaN stays NaN");
    /* a NaN tile's scale is one quiet NaN, whichever NaN its amax kept (the GPU's reductions keep another) */
    const uint32_t nans[3] = {0x7fc00000u, 0x7fc00123u, 0x7f800001u};
    for (int i = 0; i < 3; i++) {
        const uint32_t got = moept__f32_bits(moept__q8_scale(moept__q8_amax(1.0f, moept__bits_f32(nans[i]))));
        EXPECT(got == 0x7fc00000u, "the scale of a tile with NaN 0x%08x: 0x%08x", nans[i], got);
    }
    EXPECT(e4m3_vals[0x7E] == 448.0f && isnan(e4m3_vals[0x7F]) && e4m3_vals[1] == 0x1p-9f,
           "the decoder: 0x7E is 448, 0x7F NaN, 0x01 2^-9");
}

/* the byte a GPU's FP8 operand holds (moept__e4m3_byte): every byte's value encodes back to that byte,
   NaN to 0x7F whatever its sign (the NaN sm_89's cvt.rn.satfinite writes, as cuda_fp8.hpp has it);
   and the decoder (moept__e4m3_f32: checkpoints, FP8 rows) gives each byte's value */
static void test_e4m3_bytes(void) {
    e4m3_table();
    int bad = 0, first = -1, dbad = 0, dfirst = -1;
    for (int b = 0; b < 256; b++) {
        const int want = (b & 0x7F) == 0x7F ? 0x7F : b;
        if (moept__e4m3_byte(moept__e4m3_round(e4m3_vals[b])) != want && !bad++) first = b;
        const float v = moept__e4m3_f32((uint8_t)b);
        if (!(v == e4m3_vals[b] || (isnan(v) && isnan(e4m3_vals[b]))) && !dbad++) dfirst = b;
    }
    EXPECT(bad == 0, "%d bytes encode apart from their value, first 0x%02x (%g) -> 0x%02x", bad, first,
           first < 0 ? 0.0 : (double)e4m3_vals[first],
           first < 0 ? 0 : moept__e4m3_byte(moept__e4m3_round(e4m3_vals[first])));
    EXPECT(dbad == 0, "%d bytes decode apart from their value, first 0x%02x: %g, want %g", dbad, dfirst,
           dfirst < 0 ? 0.0 : (double)moept__e4m3_f32((uint8_t)dfirst),
           dfirst < 0 ? 0.0 : (double)e4m3_vals[dfirst]);
}

/* ---- tiles ---- */
static float q8_ref(float v, float s) { return e4m3_ref(v / s) * s; }
/* amax / 448, not under 2^-63 */
static float amax_scale(float amax) { return amax / 448.0f > 0x1p-63f ? amax / 448.0f : 0x1p-63f; }
static float scale_ref(const float *v, int64_t n, int64_t stride) {
    float amax = 0;
    for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(v[i * stride]));
    return amax_scale(amax);
}

static void test_tiles(void) {
    const int64_t R = 3, C = 200; /* tiles of 128 and 72 along each row */
    float x[3 * 200], q[3 * 200];
    unsigned long long s = 3;
    tu_fill(x, R * C, 1.0, &s);
    x[0 * C + 150] = 1000.0f; /* row 0's second tile: its own scale, the first tile's untouched */
    for (int64_t j = 0; j < 128; j++) x[2 * C + j] = 0.0f; /* row 2's first tile: zero */
    moept__q8_rows(x, R, C, C, q, C);
    int bad = 0;
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < C; j++) {
            int64_t j0 = j / 128 * 128, n = j0 + 128 < C ? 128 : C - j0;
            float sc = scale_ref(x + r * C + j0, n, 1);
            bad += q[r * C + j] != q8_ref(x[r * C + j], sc);
        }
    EXPECT(bad == 0, "rows: %d elements differ from their tile's quantization", bad);
    EXPECT(q[150] == 1000.0f, "a tile's largest element is exact (maps to 448): %g", q[150]);
    double worst = 0;
    for (int64_t j = 0; j < 128; j++) { /* row 0's first tile: within E4M3's step of each value */
        float sc = scale_ref(x, 128, 1), v = x[j], d = fabsf(q[j] - v);
        double step = fabsf(v / sc) >= 0x1p-6f ? 0x1p-4 * fabsf(v) : 0x1p-10 * sc;
        if (d / step > worst) worst = d / step;
    }
    EXPECT(worst <= 1.0, "round trip: an element off by %.3g of its half-step", worst);
    int zero = 1;
    for (int64_t j = 0; j < 128; j++) zero &= q[2 * C + j] == 0.0f;
    EXPECT(zero, "a zero tile stays zero");
    /* blocks of 128 x 128 with edges (200 x 136), and columns by groups of rows */
    const int64_t BR = 200, BC = 136;
    float *w = malloc(BR * BC * 4), *wq = malloc(BR * BC * 4);
    tu_fill(w, BR * BC, 0.5, &s);
    w[150 * BC + 130] = -77.0f; /* the corner block's */
    moept__q8_blocks(w, BR, BC, wq);
    bad = 0;
    for (int64_t i = 0; i < BR; i++)
        for (int64_t j = 0; j < BC; j++) {
            int64_t i0 = i / 128 * 128, j0 = j / 128 * 128;
            float amax = 0;
            for (int64_t a = i0; a < BR && a < i0 + 128; a++)
                for (int64_t b = j0; b < BC && b < j0 + 128; b++) amax = fmaxf(amax, fabsf(w[a * BC + b]));
            bad += wq[i * BC + j] != q8_ref(w[i * BC + j], amax_scale(amax));
        }
    EXPECT(bad == 0, "blocks: %d elements differ", bad);
    const int64_t off[3] = {0, 150, 190}; /* two groups: 128 + 22 rows, then 40 */
    const moept__runs gr = moept__runs_groups(off, 2);
    moept__q8_cols(w, BC, BC, &gr, wq);
    bad = 0;
    for (int64_t g = 0; g < 2; g++)
        for (int64_t i = off[g]; i < off[g + 1]; i++)
            for (int64_t j = 0; j < BC; j++) {
                int64_t i0 = off[g] + (i - off[g]) / 128 * 128;
                int64_t n = i0 + 128 < off[g + 1] ? 128 : off[g + 1] - i0;
                bad += wq[i * BC + j] != q8_ref(w[i * BC + j], scale_ref(w + i0 * BC + j, n, BC));
            }
    EXPECT(bad == 0, "columns by group: %d elements differ", bad);
    free(w); free(wq);
}

/* The scale's floor: s = max(amax / 448, 2^-63), so that the product of two scales (a block-scaled GEMM's
   factor of a block's E4M3 sum) is never under fp32's least normal, 2^-126; a tile of smaller amax
   quantizes in steps of 2^-72 (its values at or below 2^-73 to 0), rows and blocks alike */
static void test_scale_floor(void) {
    const float amax[8] = {0.0f, 0x1p-149f, 1e-40f, 1e-30f, 1e-20f, 448.0f * 0x1p-63f, 1.0f, 3e38f};
    const float want[8] = {0x1p-63f, 0x1p-63f, 0x1p-63f, 0x1p-63f, 0x1p-63f, 0x1p-63f, 1.0f / 448.0f,
                           3e38f / 448.0f};
    for (int i = 0; i < 8; i++) {
        EXPECT(moept__q8_scale(amax[i]) == want[i], "amax %g: scale %a, want %a", (double)amax[i],
               (double)moept__q8_scale(amax[i]), (double)want[i]);
        for (int j = 0; j < 8; j++) {
            const float p = moept__q8_scale(amax[i]) * moept__q8_scale(amax[j]);
            EXPECT(p >= 0x1p-126f, "amax %g and %g: the scales' product %a is under fp32's least normal",
                   (double)amax[i], (double)amax[j], (double)p);
        }
    }
    float x[2 * 200], q[2 * 200], w[130 * 130], wq[130 * 130];
    unsigned long long s = 5;
    tu_fill(x, 2 * 200, 1e-20, &s); /* row 0: amax ~1e-20, below 448 * 2^-63 */
    tu_fill(x + 200, 200, 1e-30, &s); /* row 1: ~1e-30, under 2^-73 */
    x[7] = 1e-20f;
    moept__q8_rows(x, 2, 200, 200, q, 200);
    int bad = 0, zero = 1;
    for (int j = 0; j < 200; j++) {
        bad += q[j] != q8_ref(x[j], 0x1p-63f);
        zero &= q[200 + j] == 0.0f;
    }
    EXPECT(bad == 0, "rows of amax 1e-20: %d elements not at the floor's scale", bad);
    EXPECT(q[7] == 0x1.8p-4f * 0x1p-63f, "1e-20 in a floored tile: %a, want 0x1.8p-4 * 2^-63", (double)q[7]);
    EXPECT(zero, "a tile of amax 1e-30 quantizes to 0");
    tu_fill(w, 130 * 130, 1e-25, &s);
    moept__q8_blocks(w, 130, 130, wq);
    bad = 0;
    for (int i = 0; i < 130 * 130; i++) bad += wq[i] != q8_ref(w[i], 0x1p-63f);
    EXPECT(bad == 0, "blocks of amax 1e-25: %d elements not at the floor's scale", bad);
}

/* ---- a layer's GEMMs against fp64 products of this file's quantization ---- */
enum { QROWS, QCOLS, QBLK };
/* m [rows][cols] quantized by this file: rows 1 x 128, columns 128 x 1 (one group), blocks */
static float *quant(const float *m, int64_t rows, int64_t cols, int how) {
    float *o = malloc((size_t)(rows * cols) * 4);
    for (int64_t i0 = 0; i0 < rows; i0 += how == QROWS ? 1 : 128)
        for (int64_t j0 = 0; j0 < cols; j0 += how == QCOLS ? 1 : 128) {
            int64_t i1 = how == QROWS ? i0 + 1 : i0 + 128 < rows ? i0 + 128 : rows;
            int64_t j1 = how == QCOLS ? j0 + 1 : j0 + 128 < cols ? j0 + 128 : cols;
            float amax = 0;
            for (int64_t i = i0; i < i1; i++)
                for (int64_t j = j0; j < j1; j++) amax = fmaxf(amax, fabsf(m[i * cols + j]));
            float sc = amax_scale(amax);
            for (int64_t i = i0; i < i1; i++)
                for (int64_t j = j0; j < j1; j++) o[i * cols + j] = q8_ref(m[i * cols + j], sc);
        }
    return o;
}

/* normwise error of got against C = op(A) op(B) in fp64: A [m][k] or (ta) [k][m], B [k][n] or (tb) [n][k] */
static double gemm_err(const float *got, const float *A, int ta, const float *B, int tb, int64_t m, int64_t n,
                       int64_t k) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double c = 0;
            for (int64_t l = 0; l < k; l++)
                c += (double)(ta ? A[l * m + i] : A[i * k + l]) * (tb ? B[j * k + l] : B[l * n + j]);
            num += (got[i * n + j] - c) * (got[i * n + j] - c);
            den += c * c;
        }
    return sqrt(num / (den > 0 ? den : 1));
}

static moept_config fp8_cfg(void) {
    moept_config c = {0};
    c.family = MOEPT_FAMILY_MIXTRAL; c.hidden_size = 200; c.intermediate_size = 136;
    c.num_experts = 2; c.top_k = 2; c.max_tokens = 150; c.fp8 = MOEPT_FP8_BLOCKWISE;
    return c;
}

static void test_layer_gemms(void) {
    moept_config c = fp8_cfg();
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    if (tu_bad) return;
    moept_init_params(L, 5);
    memset(L->par.w_router, 0, (size_t)(L->E * L->D) * 4); /* both experts weigh 1/2 for every token */
    const int64_t T = 150, D = 200, F = 136, H = 272;
    float *x = malloc(T * D * 4), *dy = malloc(T * D * 4), *y = malloc(T * D * 4), *dx = malloc(T * D * 4);
    unsigned long long s = 9;
    tu_fill(x, T * D, 1.0, &s);
    tu_fill(dy, T * D, 1.0, &s);
    x[3 * D + 140] = 40.0f; /* an outlier: its tile's scale, no other's */
    EXPECT_OK(moept_forward(L, x, T, y));
    moept__fstate *sl = moept__last(L);
    EXPECT(sl->xch.roffsets[1] == T && sl->xch.roffsets[2] == 2 * T, "every token at both experts");
    float *h = malloc(2 * T * H * 4), *a = malloc(2 * T * F * 4), *ys = malloc(2 * T * D * 4);
    memcpy(h, sl->ws.h, (size_t)(2 * T * H) * 4);
    memcpy(ys, sl->ws.yr, (size_t)(2 * T * D) * 4);
    for (int64_t r = 0; r < 2 * T; r++) moept__act_fwd_rowv(L->act, h + r * H, F, a + r * F);
    EXPECT_OK(moept_backward(L, x, dy, dx));
    float *dys = malloc(T * D * 4);
    for (int64_t i = 0; i < T * D; i++) dys[i] = 0.5f * dy[i]; /* the combine's weight, exactly */
    /* (the wgrads' x and dys: the rows as the experts received them, quantized, then down the columns) */
    float *xq = quant(x, T, D, QROWS), *xc = quant(xq, T, D, QCOLS), *dyq = quant(dys, T, D, QROWS);
    float *dyc = quant(dyq, T, D, QCOLS);
    const double tol = 1e-5; /* fp32 accumulation over k <= 272 */
    for (int64_t e = 0; e < 2; e++) {
        const float *w13 = L->par.w13 + e * H * D, *w2 = L->par.w2 + e * D * F;
        float *w13q = quant(w13, H, D, QBLK), *w2q = quant(w2, D, F, QBLK);
        float *aq = quant(a + e * T * F, T, F, QROWS), *ac = quant(a + e * T * F, T, F, QCOLS);
        const float *dh = sl->ws.h + e * T * H; /* the backward left dh over h */
        float *dhq = quant(dh, T, H, QROWS), *dhc = quant(dh, T, H, QCOLS);
        double e1 = gemm_err(h + e * T * H, xq, 0, w13q, 1, T, H, D);       /* h = x W13^T */
        double e2 = gemm_err(ys + e * T * D, aq, 0, w2q, 1, T, D, F);       /* ys = a W2^T */
        double e3 = gemm_err(L->par.g2 + e * D * F, dyc, 1, ac, 0, D, F, T); /* g2 = dys^T a */
        double e4 = gemm_err(L->par.g13 + e * H * D, dhc, 1, xc, 0, H, D, T); /* g13 = dh^T x */
        double e5 = gemm_err(sl->ws.yr + e * T * D, dhq, 0, w13q, 0, T, D, H); /* dxs = dh W13 */
        /* dh = act'(h, da), da = dys W2: da from fp64 products, then moept's own act backward */
        float *da = malloc(T * F * 4), *dh2 = malloc(T * H * 4);
        for (int64_t r = 0; r < T; r++)
            for (int64_t f = 0; f < F; f++) {
                double v = 0;
                for (int64_t d = 0; d < D; d++) v += (double)dyq[r * D + d] * w2q[d * F + f];
                da[r * F + f] = (float)v;
            }
        for (int64_t r = 0; r < T; r++)
            moept__act_bwd_rowv(L->act, h + (e * T + r) * H, da + r * F, F, dh2 + r * H);
        double e6 = tu_relerr(dh, dh2, T * H);
        EXPECT(e1 <= tol && e2 <= tol, "expert %lld forward: h %.3g, outputs %.3g", (long long)e, e1, e2);
        EXPECT(e3 <= tol && e4 <= tol, "expert %lld wgrads: W2 %.3g, W13 %.3g", (long long)e, e3, e4);
        EXPECT(e5 <= tol && e6 <= tol, "expert %lld dgrads: dx %.3g, dh %.3g", (long long)e, e5, e6);
        free(w13q); free(w2q); free(aq); free(ac); free(dhq); free(dhc); free(da); free(dh2);
    }
    free(xq); free(xc); free(dyq); free(dyc); free(dys);
    free(h); free(a); free(ys); free(x); free(dy); free(y); free(dx);
    moept_destroy(L);
}

/* the FP8 layer against the fp32 one: it quantizes (differs), by E4M3's precision */
static void test_fp8_vs_fp32(void) {
    moept_config c = fp8_cfg();
    c.num_experts = 8; c.shared_intermediate_size = 0; c.family = MOEPT_FAMILY_QWEN2_MOE;
    c.shared_intermediate_size = 96; c.top_k = 2; c.max_tokens = 64;
    moept_layer *L8, *L32;
    EXPECT_OK(moept_create(&c, &L8));
    c.fp8 = MOEPT_FP8_OFF;
    EXPECT_OK(moept_create(&c, &L32));
    if (tu_bad) return;
    moept_init_params(L8, 2);
    moept_init_params(L32, 2);
    const int64_t T = 64, D = 200;
    float *x = malloc(T * D * 4), *y8 = malloc(T * D * 4), *y32 = malloc(T * D * 4);
    unsigned long long s = 4;
    tu_fill(x, T * D, 1.0, &s);
    EXPECT_OK(moept_forward(L8, x, T, y8));
    EXPECT_OK(moept_forward(L32, x, T, y32));
    double e = tu_relerr(y8, y32, T * D);
    EXPECT(e > 1e-3 && e <= 0.25, "fp8 against fp32: %.3g (it must quantize: > 1e-3; within 2^-2)", e);
    moept_stats s8, s32;
    moept_get_stats(L8, &s8, NULL);
    moept_get_stats(L32, &s32, NULL);
    int64_t wbytes = (L8->E * (L8->H + L8->F) + L8->HS + L8->S) * D * 4;
    const long long more = (long long)(s8.workspace_bytes - s32.workspace_bytes);
    EXPECT(more >= wbytes, "the quantized weights counted: %lld more bytes, want >= %lld", more,
           (long long)wbytes);
    free(x); free(y8); free(y32);
    moept_destroy(L8); moept_destroy(L32);
}

/* an inference layer (a written over h) and two forwards in flight (each slot its own scratch, one copy of
   the quantized weights) give the training layer's results bitwise */
static void test_inference_and_slots(void) {
    moept_config c = fp8_cfg();
    c.family = MOEPT_FAMILY_DEEPSEEK_V3; c.shared_intermediate_size = 72; c.routed_scaling_factor = 2.5f;
    c.num_experts = 4; c.max_inflight = 2;
    moept_layer *L, *Li, *S;
    EXPECT_OK(moept_create(&c, &L));
    EXPECT_OK(moept_create(&c, &S));
    c.inference_only = 1; c.max_inflight = 0;
    EXPECT_OK(moept_create(&c, &Li));
    if (tu_bad) return;
    moept_init_params(L, 6); moept_init_params(Li, 6); moept_init_params(S, 6);
    const int64_t T = 70, D = 200, n = T * D;
    float *x = malloc(2 * n * 4), *dy = malloc(2 * n * 4), *y = malloc(4 * n * 4), *dx = malloc(4 * n * 4);
    unsigned long long s = 12;
    tu_fill(x, 2 * n, 1.0, &s);
    tu_fill(dy, 2 * n, 1.0, &s);
    EXPECT_OK(moept_forward(Li, x, T, y + 2 * n));
    for (int k = 0; k < 2; k++) { /* L: forward, backward; twice */
        EXPECT_OK(moept_forward(L, x + k * n, T, y + k * n));
        EXPECT_OK(moept_backward(L, x + k * n, dy + k * n, dx + k * n));
    }
    EXPECT(memcmp(y, y + 2 * n, (size_t)n * 4) == 0, "the inference layer's y is not the training one's");
    moept_forward_opts fo = {0};
    moept_backward_opts bo = moept_backward_default();
    for (int k = 0; k < 2; k++) { /* S: two forwards, then their backwards in reverse */
        fo.slot = k;
        EXPECT_OK(moept_forward_ex(S, x + k * n, T, y + 2 * n + k * n, &fo));
    }
    for (int k = 1; k >= 0; k--) {
        bo.slot = k;
        EXPECT_OK(moept_backward_ex(S, x + k * n, dy + k * n, dx + 2 * n + k * n, &bo));
    }
    EXPECT(memcmp(y, y + 2 * n, (size_t)(2 * n) * 4) == 0 && memcmp(dx, dx + 2 * n, (size_t)(2 * n) * 4) == 0,
           "two forwards in flight differ from one after the other");
    float *g1, *g2;
    int64_t np;
    moept_grads(L, &g1, &np);
    moept_grads(S, &g2, &np);
    EXPECT(memcmp(g1, g2, (size_t)np * 4) == 0, "two forwards in flight: the gradients differ");
    free(x); free(dy); free(y); free(dx);
    moept_destroy(L); moept_destroy(Li); moept_destroy(S);
}

static void test_refusals(void) {
    moept_config c = fp8_cfg();
    moept_layer *L = NULL;
    c.expert_sharding = MOEPT_SHARD_FSDP;
    EXPECT(moept_create(&c, &L) == MOEPT_ERR_UNSUPPORTED && strstr(moept_last_error(NULL), "FSDP"),
           "fp8 with FSDP: %s", moept_last_error(NULL));
    c = fp8_cfg();
    c.fp8 = (moept_fp8)7;
    EXPECT(moept_create(&c, &L) == MOEPT_ERR_INVALID_ARGUMENT && strstr(moept_last_error(NULL), "config.fp8"),
           "fp8 = 7: %s", moept_last_error(NULL));
}

int main(void) {
    RUN(test_e4m3_round);
    RUN(test_e4m3_bytes);
    RUN(test_tiles);
    RUN(test_scale_floor);
    RUN(test_layer_gemms);
    RUN(test_fp8_vs_fp32);
    RUN(test_inference_and_slots);
    RUN(test_refusals);
    return tu_done();
}
