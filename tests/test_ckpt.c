/* Checkpoints: safetensors round trips, Hugging Face names in and out for
   all four families, per-rank loading that reads only the owned experts'
   bytes, every malformed-file rule, and a save killed mid-write. */
#include "../moept.c"
#include "testutil.h"

#include <signal.h>
#include <sys/wait.h>

static moept_config fam_cfg(moept_family f) {
    moept_config c = {0};
    c.family = f; c.hidden_size = 12; c.intermediate_size = 10; c.num_experts = 8; c.top_k = 2;
    c.norm_topk_prob = 1; c.max_tokens = 8;
    if (f == MOEPT_FAMILY_QWEN2_MOE || f == MOEPT_FAMILY_DEEPSEEK_V3) c.shared_intermediate_size = 6;
    if (f == MOEPT_FAMILY_DEEPSEEK_V3) { c.n_group = 4; c.topk_group = 2; }
    return c;
}

/* rank r's file of the set the checkpoint in dir is at now ("" if none) */
static const char *rank_file(const char *dir, int r, int P) {
    static char path[3][512];
    static int next;
    char fp[64], set[64];
    int64_t ep, step;
    char *out = path[next++ % 3];
    out[0] = 0;
    if (moept__read_ckpt_index(dir, &ep, fp, sizeof fp, &step, set, sizeof set, NULL, 0) == MOEPT_OK)
        snprintf(out, 512, "%s/%s/rank-%d-of-%d.safetensors", dir, set, r, P);
    return out;
}

static void test_hf_round_trip_all_families(void) {
    mkdir("build/ckpt_rt", 0755);
    for (int f = 0; f < 4; f++) {
        moept_config c = fam_cfg((moept_family)f);
        moept_layer *A, *B;
        EXPECT_OK(moept_create(&c, &A));
        EXPECT_OK(moept_create(&c, &B));
        if (!A || !B) return;
        moept_init_params(A, 3 + (uint64_t)f);
        for (int64_t e = 0; e < A->E; e++) A->par.bias[e] = 0.1f * (float)e;
        EXPECT_OK(moept_save_hf(A, "build/ckpt_rt/model.safetensors", 7, 1));
        EXPECT_OK(moept_load_hf(B, "build/ckpt_rt", 7));
        EXPECT(memcmp(A->par.params, B->par.params, (size_t)A->par.n_params * 4) == 0, "family %d: parameters differ after the round trip", f);
        if (f == MOEPT_FAMILY_DEEPSEEK_V3)
            EXPECT(memcmp(A->par.bias, B->par.bias, (size_t)A->E * 4) == 0, "correction bias differs after the round trip");
        /* the names on disk are the HF ones */
        moept_st_file *sf;
        EXPECT_OK(moept_st_open("build/ckpt_rt/model.safetensors", &sf));
        const char *want = f == 0 ? "model.layers.7.block_sparse_moe.experts.3.w3.weight" : "model.layers.7.mlp.experts.3.up_proj.weight";
        EXPECT(sf && moept_st_find(sf, want), "family %d: '%s' not in the saved file", f, want);
        moept_st_close(sf);
        moept_destroy(A);
        moept_destroy(B);
    }
}

/* fp32 -> half against a reference that tries the neighbours: every half
   survives the trip, and random floats go to the nearest half (ties even) */
static void test_f32_to_half(void) {
    int64_t bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = moept__half_to_f32((uint16_t)h);
        if (f == f && moept__f32_to_half(f) != h) bad++;
    }
    EXPECT(bad == 0, "%lld halves do not survive fp32 -> half", (long long)bad);
    unsigned long long r = 5;
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (uint32_t)(tu_rand(&r) * 4294967296.0);
        u = (u & 0x80000000u) | (0x33000000u + u % (0x47800000u - 0x33000000u)); /* 2^-25 .. 65536 */
        if (i % 4 == 0) u = (u & 0xffffe000u) | 0x1000u;                        /* a tie in the normal range */
        float f;
        memcpy(&f, &u, 4);
        uint16_t got = moept__f32_to_half(f), best = got;
        double dbest = 1e300;
        for (int d = -1; d <= 1; d++) {
            uint16_t c = (uint16_t)(got + d);
            float cf = moept__half_to_f32(c);
            if ((c & 0x7c00) == 0x7c00 || ((c ^ got) & 0x8000)) continue;
            double e = fabs((double)cf - (double)f);
            if (e < dbest || (e == dbest && !(c & 1))) { dbest = e; best = c; }
        }
        int inf = (got & 0x7fff) == 0x7c00 && fabs((double)f) >= 65520.0;
        if (!inf && best != got) bad++;
    }
    EXPECT(bad == 0, "%lld of 200000 floats not rounded to the nearest half, ties even", (long long)bad);
    EXPECT(moept__f32_to_half(65519.0f) == 0x7bff && moept__f32_to_half(65520.0f) == 0x7c00 &&
           moept__f32_to_half(-1e30f) == 0xfc00 && (moept__f32_to_half(NAN) & 0x7fff) > 0x7c00,
           "overflow or NaN");
}

/* save_hf_as BF16 / F16: values the dtype holds come back bitwise, from
   2-byte tensors (the bias stays F32) */
static void test_hf_low_precision_round_trip(void) {
    mkdir("build/ckpt_low", 0755);
    const moept_dtype dts[2] = {MOEPT_DTYPE_BF16, MOEPT_DTYPE_F16};
    for (int f = 0; f < 4; f++)
        for (int k = 0; k < 2; k++) {
            moept_config c = fam_cfg((moept_family)f);
            moept_layer *A, *B;
            EXPECT_OK(moept_create(&c, &A));
            EXPECT_OK(moept_create(&c, &B));
            if (!A || !B) return;
            moept_init_params(A, 11 + (uint64_t)f);
            for (int64_t i = 0; i < A->par.n_params; i++) /* representable in the dtype */
                A->par.params[i] = k ? moept__half_to_f32(moept__f32_to_half(A->par.params[i]))
                                 : moept__bf16_to_f32(moept__f32_to_bf16(A->par.params[i]));
            for (int64_t e = 0; e < A->E; e++) A->par.bias[e] = 0.1f * (float)e + 1e-4f; /* stays F32 */
            EXPECT_OK(moept_save_hf_as(A, "build/ckpt_low/model.safetensors", 2, 1, dts[k]));
            EXPECT_OK(moept_load_hf(B, "build/ckpt_low", 2));
            EXPECT(memcmp(A->par.params, B->par.params, (size_t)A->par.n_params * 4) == 0 &&
                   (f != MOEPT_FAMILY_DEEPSEEK_V3 || memcmp(A->par.bias, B->par.bias, (size_t)A->E * 4) == 0),
                   "family %d dtype %d: not bitwise after the round trip", f, (int)dts[k]);
            moept_st_file *sf;
            EXPECT_OK(moept_st_open("build/ckpt_low/model.safetensors", &sf));
            for (int64_t i = 0; sf && i < moept_st_count(sf); i++) {
                const moept_st_tensor *t = moept_st_at(sf, i);
                int bias = strstr(t->name, "e_score_correction_bias") != NULL;
                EXPECT(t->dtype == (bias ? MOEPT_DTYPE_F32 : dts[k]) && t->nbytes == t->numel * (bias ? 4 : 2),
                       "%s: dtype %d, %lld bytes", t->name, (int)t->dtype, (long long)t->nbytes);
            }
            moept_st_close(sf);
            moept_destroy(A);
            moept_destroy(B);
        }
    moept_layer *A;
    moept_config c = fam_cfg(MOEPT_FAMILY_MIXTRAL);
    EXPECT_OK(moept_create(&c, &A));
    EXPECT(moept_save_hf_as(A, "build/ckpt_low/x.safetensors", 0, 1, MOEPT_DTYPE_I64) == MOEPT_ERR_INVALID_ARGUMENT,
           "dtype I64 accepted");
    moept_destroy(A);
}

static void test_load_failure_leaves_layer_unchanged(void) {
    moept_config c = fam_cfg(MOEPT_FAMILY_OLMOE);
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    moept_init_params(L, 1);
    float *before = malloc((size_t)L->par.n_params * 4);
    memcpy(before, L->par.params, (size_t)L->par.n_params * 4);
    /* a checkpoint of another family: names do not match */
    moept_config m = fam_cfg(MOEPT_FAMILY_MIXTRAL);
    moept_layer *M;
    EXPECT_OK(moept_create(&m, &M));
    mkdir("build/ckpt_bad", 0755);
    EXPECT_OK(moept_save_hf(M, "build/ckpt_bad/model.safetensors", 0, 1));
    moept_status st = moept_load_hf(L, "build/ckpt_bad", 0);
    EXPECT(st == MOEPT_ERR_NOT_FOUND, "wrong-family checkpoint: status %d", st);
    EXPECT(strstr(moept_last_error(L), "model.layers.0.mlp.gate.weight") != NULL, "message: %s", moept_last_error(L));
    EXPECT(memcmp(before, L->par.params, (size_t)L->par.n_params * 4) == 0, "a failed load changed the layer");
    EXPECT(moept_load_hf(L, "build/no_such_dir", 0) == MOEPT_ERR_IO, "missing directory");
    /* rejected after reading: a NaN in the last expert's weight (HF), a rank
       file missing all but the router (training checkpoint); the bytes read
       stay out of the statistics, as everything else */
    moept_layer *N;
    EXPECT_OK(moept_create(&c, &N));
    moept_init_params(N, 2);
    N->par.w2[N->E * N->D * N->F - 1] = NAN;
    EXPECT_OK(moept_save_hf(N, "build/ckpt_bad/model.safetensors", 0, 1));
    moept_stats s0, s1;
    moept_get_stats(L, &s0, NULL);
    st = moept_load_hf(L, "build/ckpt_bad", 0);
    moept_get_stats(L, &s1, NULL);
    EXPECT(st == MOEPT_ERR_NUMERIC, "a NaN weight: status %d", st);
    EXPECT(s1.checkpoint_bytes_read == s0.checkpoint_bytes_read, "a rejected load_hf counted %lld bytes",
           (long long)(s1.checkpoint_bytes_read - s0.checkpoint_bytes_read));
    mkdir("build/ckpt_part", 0755);
    EXPECT_OK(moept_save_checkpoint(L, "build/ckpt_part"));
    moept_st_file *f = NULL;
    const char *rank = rank_file("build/ckpt_part", 0, 1);
    EXPECT_OK(moept_st_open(rank, &f));
    if (f) {
        moept_st_writer *w = NULL;
        int64_t shape[2] = {L->E, L->D};
        moept_st_writer_create(&w);
        const char *keys[3] = {"format", "step", "fingerprint"};
        for (int i = 0; i < 3; i++) moept_st_add_meta(w, keys[i], moept_st_meta(f, keys[i]));
        moept_st_add(w, "gate.weight", MOEPT_DTYPE_F32, 2, shape, L->par.w_router);
        moept_st_close(f);
        EXPECT_OK(moept_st_write(w, rank));
        moept_st_writer_destroy(w);
        moept_get_stats(L, &s0, NULL);
        st = moept_load_checkpoint(L, "build/ckpt_part");
        moept_get_stats(L, &s1, NULL);
        EXPECT(st == MOEPT_ERR_NOT_FOUND, "a partial rank file: status %d (%s)", st, moept_last_error(L));
        EXPECT(s1.checkpoint_bytes_read == s0.checkpoint_bytes_read, "a rejected load_checkpoint counted %lld bytes",
               (long long)(s1.checkpoint_bytes_read - s0.checkpoint_bytes_read));
    }
    free(before);
    moept_destroy(L);
    moept_destroy(M);
    moept_destroy(N);
}

/* ---- per-rank loading at EP=4 from a transformers-written checkpoint ---- */
typedef struct lj { moept_thread_group *g; int r; int64_t read, bound, owned; moept_status st; char err[512]; } lj;

static void *load_main(void *arg) {
    lj *j = arg;
    moept_comm *c;
    moept_comm_threads(j->g, j->r, &c);
    moept_st_file *sf;
    moept_st_open("tests/cases/mixtral_e8_t40.safetensors", &sf);
    moept_config cfg = {0};
    cfg.family = MOEPT_FAMILY_MIXTRAL;
    cfg.hidden_size = 24; cfg.intermediate_size = 20; cfg.num_experts = 8; cfg.top_k = 2; cfg.norm_topk_prob = 1;
    cfg.max_tokens = 16;
    moept_st_close(sf);
    moept_layer *L = NULL;
    j->st = moept_create_parallel(&cfg, c, NULL, &L);
    if (!j->st) j->st = moept_load_hf(L, "tests/checkpoints/mixtral_e8_t40", 1);
    if (j->st) { snprintf(j->err, sizeof j->err, "%s", L ? moept_last_error(L) : moept_last_error(NULL)); moept_destroy(L); return NULL; }
    moept_stats st;
    moept_get_stats(L, &st, NULL);
    j->read = st.checkpoint_bytes_read;
    /* the bound: this rank's experts + the router + every file header it
       had to open + the index */
    int64_t owned = (int64_t)L->par.n_params * 4; /* router + local experts (no shared expert here) */
    j->owned = owned;
    int64_t headers = 0;
    struct stat sb;
    if (stat("tests/checkpoints/mixtral_e8_t40/model.safetensors.index.json", &sb) == 0) headers += sb.st_size;
    for (int i = 1; i <= 9; i++) {
        char p[256];
        snprintf(p, sizeof p, "tests/checkpoints/mixtral_e8_t40/model-%05d-of-00009.safetensors", i);
        FILE *f = fopen(p, "rb");
        unsigned char len[8] = {0};
        if (f && fread(len, 1, 8, f) == 8) {
            uint64_t hl = 0;
            for (int b = 7; b >= 0; b--) hl = (hl << 8) | len[b];
            headers += 8 + (int64_t)hl;
        }
        if (f) fclose(f);
    }
    j->bound = owned + headers;
    moept_destroy(L);
    return NULL;
}

static void test_per_rank_loading_reads_only_owned_bytes(void) {
    lj js[4];
    tu_ranks(4, 20000, load_main, js, sizeof js[0]);
    for (int r = 0; r < 4; r++) {
        EXPECT(js[r].st == MOEPT_OK, "rank %d: %s", r, js[r].err);
        EXPECT(js[r].read <= js[r].bound, "rank %d read %lld bytes > owned + replicated + headers = %lld", r,
               (long long)js[r].read, (long long)js[r].bound);
        EXPECT(js[r].read >= js[r].owned, "rank %d read %lld bytes < its own tensors' %lld", r, (long long)js[r].read,
               (long long)js[r].owned);
    }
}

/* FP8 weights as DeepSeek-V3 publishes them (tools/make_fp8_checkpoint.py:
   F8_E4M3 tensors with F32 weight_scale_inv blocks of 4 x 8, partial blocks
   at the edges): every parameter a rank holds equals the float64
   dequantisation, bitwise; at EP = 4 a rank reads fewer bytes than the
   whole layer (only its experts' weights and scales) */
typedef struct f8j { moept_thread_group *g; int r; int64_t read; moept_status st; int64_t bad; char err[512]; } f8j;
/* rank r's layer 1 of dir, sized by its config.json and loaded (EP over g where given) */
static moept_status fp8_open(moept_thread_group *g, int r, const char *dir, moept_comm **c, moept_layer **L) {
    *c = NULL;
    if (g) moept_comm_threads(g, r, c);
    moept_config cfg = moept_config_default(MOEPT_FAMILY_DEEPSEEK_V3);
    cfg.max_tokens = 8;
    moept_status st = moept_config_from_hf(dir, 1, &cfg);
    if (!st) st = moept_create_parallel(&cfg, *c, NULL, L);
    return st ? st : moept_load_hf(*L, dir, 1);
}
static void *fp8_main(void *arg) {
    f8j *j = arg;
    moept_comm *c;
    moept_layer *L = NULL;
    j->st = fp8_open(j->g, j->r, "tests/checkpoints/deepseek_fp8", &c, &L);
    moept_st_file *ref = NULL;
    if (!j->st) j->st = moept_st_open("tests/checkpoints/deepseek_fp8/dequant.safetensors", &ref);
    if (j->st) snprintf(j->err, sizeof j->err, "%s", L ? moept_last_error(L) : moept_last_error(NULL));
    for (int64_t i = 0; !j->st && i < moept_param_count(L); i++) {
        moept_param_info pi;
        moept_param_info_at(L, i, &pi);
        const moept_st_tensor *t = moept_st_find(ref, pi.name);
        float *want = malloc((size_t)(pi.rows * pi.cols) * 4), *got = malloc((size_t)(pi.rows * pi.cols) * 4);
        if (!t || moept_st_read_f32(ref, t, want, pi.rows * pi.cols) ||
            moept_get_param(L, pi.name, got, pi.rows * pi.cols) ||
            memcmp(want, got, (size_t)(pi.rows * pi.cols) * 4))
            j->bad++;
        free(want); free(got);
    }
    moept_stats st;
    if (L) moept_get_stats(L, &st, NULL);
    j->read = L ? st.checkpoint_bytes_read : 0;
    moept_st_close(ref);
    moept_destroy(L);
    moept_comm_destroy(c);
    return NULL;
}

static void test_fp8_checkpoint_dequantised(void) {
    f8j one = {0};
    fp8_main(&one);
    EXPECT(one.st == MOEPT_OK && one.bad == 0, "EP=1: %s, %lld parameters differ from the float64 dequantisation",
           one.err, (long long)one.bad);
    f8j js[4];
    tu_ranks(4, 20000, fp8_main, js, sizeof js[0]);
    for (int r = 0; r < 4; r++) {
        EXPECT(js[r].st == MOEPT_OK && js[r].bad == 0, "EP=4 rank %d: %s, %lld parameters differ", r, js[r].err,
               (long long)js[r].bad);
        EXPECT(js[r].read < one.read, "EP=4 rank %d read %lld bytes, the whole layer %lld", r, (long long)js[r].read,
               (long long)one.read);
    }
    /* the e4m3 decoding on its own: every byte against ldexp's */
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        double v = e == 0 ? m * pow(2, -9) : (1 + m / 8.0) * pow(2, e - 7);
        float got = moept__e4m3_f32((uint8_t)b);
        if (e == 15 && m == 7) EXPECT(isnan(got), "e4m3 %#x: NaN expected, %g", b, got);
        else EXPECT(got == (float)(b & 0x80 ? -v : v), "e4m3 %#x: %g, want %g", b, got, b & 0x80 ? -v : v);
    }
}

/* ---- malformed files: one per rule ---- */
static void write_raw(const char *path, const char *header, int64_t hlen_field, const void *data, size_t nd) {
    FILE *f = fopen(path, "wb");
    uint64_t n = hlen_field >= 0 ? (uint64_t)hlen_field : strlen(header);
    unsigned char len[8];
    for (int b = 0; b < 8; b++) len[b] = (unsigned char)(n >> (8 * b));
    fwrite(len, 1, 8, f);
    fwrite(header, 1, strlen(header), f);
    if (nd) fwrite(data, 1, nd, f);
    fclose(f);
}

static void test_malformed_rules(void) {
    static const struct { const char *why, *header; int64_t hlen; size_t data; const char *msg; } cases[] = {
        {"header length 0", "", 0, 0, "header length"},
        {"header length 1", "{", 1, 0, "header length"},
        {"header length over 100 MB", "{}", 100000001, 0, "header length"},
        {"header past the end of the file", "{}", 4000, 0, "past the end"},
        {"not UTF-8", "{\"\xff\":{}}", -1, 0, "UTF-8"},
        {"not an object", "[1,2]", -1, 0, "not a JSON object"},
        {"trailing garbage after the object", "{} x", -1, 0, "trailing characters"},
        {"metadata value not a string", "{\"__metadata__\":{\"a\":1}}", -1, 0, "must be strings"},
        {"duplicate metadata key", "{\"__metadata__\":{\"a\":\"1\",\"a\":\"2\"}}", -1, 0, "duplicate key"},
        {"duplicate tensor name", "{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", -1, 2, "duplicate tensor name"},
        {"unknown dtype", "{\"t\":{\"dtype\":\"F8\",\"shape\":[1],\"data_offsets\":[0,1]}}", -1, 1, "unknown dtype"},
        {"shape x dtype != byte range", "{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", -1, 4, "shape needs 8 bytes"},
        {"end before begin", "{\"t\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,0]}}", -1, 4, "end"},
        {"gap between tensors", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,3]}}", -1, 3, "gap"},
        {"overlapping tensors", "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[1,3]}}", -1, 3, "overlap"},
        {"data past the end", "{\"t\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}", -1, 4, "past the end"},
        {"trailing bytes", "{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}", -1, 5, "trailing bytes"},
        {"shape overflows 64 bits", "{\"t\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", -1, 4, "overflows"},
        {"integer overflows 64 bits", "{\"t\":{\"dtype\":\"U8\",\"shape\":[99999999999999999999],\"data_offsets\":[0,1]}}", -1, 1, "overflows"},
        {"negative number", "{\"t\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}}", -1, 1, "non-negative integer"},
        {"float in shape", "{\"t\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,1]}}", -1, 1, "integer"},
        {"unknown field", "{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":1}}", -1, 1, "unexpected or repeated field"},
        {"missing data_offsets", "{\"t\":{\"dtype\":\"U8\",\"shape\":[1]}}", -1, 1, "needs dtype, shape and data_offsets"},
        {"unpaired surrogate", "{\"\\ud800\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", -1, 1, "surrogate"},
        {"control character in a name", "{\"a\x01\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", -1, 1, "control character"},
        {"more than 8 dimensions", "{\"t\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", -1, 1, "more than 8"},
    };
    static const unsigned char zeros[64] = {0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_raw("build/malformed.safetensors", cases[i].header, cases[i].hlen, zeros, cases[i].data);
        moept_st_file *f = (moept_st_file *)1;
        moept_status st = moept_st_open("build/malformed.safetensors", &f);
        EXPECT(st == MOEPT_ERR_FORMAT && f == NULL, "%s: accepted (status %d)", cases[i].why, st);
        EXPECT(strstr(moept_last_error(NULL), cases[i].msg) != NULL, "%s: message '%s' lacks '%s'", cases[i].why,
               moept_last_error(NULL), cases[i].msg);
    }
    /* shorter than the length field */
    FILE *f = fopen("build/malformed.safetensors", "wb");
    fwrite("abc", 1, 3, f);
    fclose(f);
    moept_st_file *sf;
    EXPECT(moept_st_open("build/malformed.safetensors", &sf) == MOEPT_ERR_FORMAT, "3-byte file accepted");
    /* and a well-formed one with escapes, an empty tensor and metadata */
    write_raw("build/malformed.safetensors",
              "{\"__metadata__\":{\"k\":\"v\\n\"},\"a\\\"b\\u00e9\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
              "\"e\":{\"dtype\":\"F32\",\"shape\":[0,3],\"data_offsets\":[4,4]}}", -1, zeros, 4);
    EXPECT(moept_st_open("build/malformed.safetensors", &sf) == MOEPT_OK, "valid file rejected: %s", moept_last_error(NULL));
    if (sf) {
        EXPECT(moept_st_find(sf, "a\"b\xc3\xa9") != NULL, "escaped name not decoded");
        EXPECT(moept_st_meta(sf, "k") && strcmp(moept_st_meta(sf, "k"), "v\n") == 0, "metadata not decoded");
        moept_st_close(sf);
    }
}

/* Two writers of one path at once (data-parallel replicas as threads of one
   process save the same rank file): every write succeeds and the file is
   whole. With one temporary name per process, one writer's rename took the
   other's file away and about half the writes failed. */
static void *write_same_path(void *arg) {
    int *fails = arg;
    float v[64];
    for (int i = 0; i < 64; i++) v[i] = (float)i;
    int64_t n = 64;
    for (int it = 0; it < 40; it++) {
        moept_st_writer *w = NULL;
        if (moept_st_writer_create(&w) || moept_st_add(w, "v", MOEPT_DTYPE_F32, 1, &n, v) ||
            moept_st_write(w, "build/same_path.safetensors"))
            (*fails)++;
        moept_st_writer_destroy(w);
    }
    return NULL;
}
static void test_concurrent_writers_of_one_path(void) {
    int fails[2] = {0, 0};
    tu_threads(2, write_same_path, fails, sizeof fails[0]);
    EXPECT(fails[0] + fails[1] == 0, "%d of 80 writes failed", fails[0] + fails[1]);
    moept_st_file *f = NULL;
    float out[64];
    EXPECT_OK(moept_st_open("build/same_path.safetensors", &f));
    if (f) {
        EXPECT_OK(moept_st_read_f32(f, moept_st_find(f, "v"), out, 64));
        EXPECT(out[63] == 63.0f, "the file is not whole");
        moept_st_close(f);
    }
}

/* Zero-element tensors (the reference writer emits them; so does moept's):
   [b, b] ranges at the boundaries of others read back, in every order the
   header sort may see them. */
static void test_zero_element_tensors(void) {
    float v[6] = {1, 2, 3, 4, 5, 6};
    int64_t z = 0, four = 4, two = 2;
    /* names sort apart from offsets: z0 [0, 0] after b4 [0, 16] by name */
    const char *names[4] = {"z0", "b4", "y0", "d2"};
    const int64_t *shapes[4] = {&z, &four, &z, &two};
    const float *data[4] = {v, v, v, v + 4};
    moept_st_writer *w = NULL;
    EXPECT_OK(moept_st_writer_create(&w));
    for (int i = 0; i < 4; i++) EXPECT_OK(moept_st_add(w, names[i], MOEPT_DTYPE_F32, 1, shapes[i], data[i]));
    EXPECT_OK(moept_st_write(w, "build/zero_elem.safetensors"));
    moept_st_writer_destroy(w);
    moept_st_file *f = NULL;
    EXPECT_OK(moept_st_open("build/zero_elem.safetensors", &f));
    if (!f) return;
    float out[4] = {0};
    EXPECT_OK(moept_st_read_f32(f, moept_st_find(f, "z0"), out, 0));
    EXPECT_OK(moept_st_read_f32(f, moept_st_find(f, "d2"), out, 2));
    EXPECT(out[0] == 5.0f && out[1] == 6.0f, "d2 read %g %g", out[0], out[1]);
    EXPECT_OK(moept_st_read_f32(f, moept_st_find(f, "b4"), out, 4));
    EXPECT(out[3] == 4.0f, "b4 read %g", out[3]);
    moept_st_close(f);
}

/* index.json: any reasonable size reads (a 6 KB one was refused at 4 KB),
   and its step must be the rank files' (a save interrupted between them). */
static void write_text(const char *path, const char *s) {
    FILE *f = fopen(path, "w");
    if (f) { fputs(s, f); fclose(f); }
}
static void test_ckpt_index_size_and_step(void) {
    moept_config c = fam_cfg(MOEPT_FAMILY_MIXTRAL);
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    moept_init_params(L, 5);
    mkdir("build/ckpt_idx", 0755);
    EXPECT_OK(moept_save_checkpoint(L, "build/ckpt_idx"));
    char fp[32], set[64], *big = malloc(8192);
    int64_t ep, step;
    moept__fp_hex(L, fp, sizeof fp);
    EXPECT_OK(moept__read_ckpt_index("build/ckpt_idx", &ep, fp, sizeof fp, &step, set, sizeof set, NULL, 0));
    int n = snprintf(big, 8192, "{\"note\": \"");
    for (int i = 0; i < 6000; i++) big[n++] = 'x';
    snprintf(big + n, (size_t)(8192 - n), "\", \"format\": \"moept-train-v1\", \"ep_size\": 1, \"fingerprint\": \"%s\", "
             "\"step\": 0, \"set\": \"%s\"}\n", fp, set);
    write_text("build/ckpt_idx/index.json", big);
    EXPECT_OK(moept_load_checkpoint(L, "build/ckpt_idx"));
    snprintf(big, 8192, "{\"format\": \"moept-train-v1\", \"ep_size\": 1, \"fingerprint\": \"%s\", \"step\": 7, "
             "\"set\": \"%s\"}\n", fp, set);
    write_text("build/ckpt_idx/index.json", big);
    moept_status st = moept_load_checkpoint(L, "build/ckpt_idx");
    EXPECT(st == MOEPT_ERR_FORMAT && strstr(moept_last_error(L), "step 7"), "index step 7, rank files step 0: %d (%s)",
           (int)st, moept_last_error(L));
    /* an index naming a set outside the directory is refused */
    snprintf(big, 8192, "{\"format\": \"moept-train-v1\", \"ep_size\": 1, \"fingerprint\": \"%s\", \"step\": 0, "
             "\"set\": \"save-0/../../ckpt_part\"}\n", fp);
    write_text("build/ckpt_idx/index.json", big);
    st = moept_load_checkpoint(L, "build/ckpt_idx");
    EXPECT(st == MOEPT_ERR_FORMAT && strstr(moept_last_error(L), "set"), "a set outside the directory: %d (%s)",
           (int)st, moept_last_error(L));
    /* the older flat layout (rank files beside an index without a set) loads */
    char from[256], to[256];
    snprintf(from, sizeof from, "build/ckpt_idx/%s/rank-0-of-1.safetensors", set);
    snprintf(to, sizeof to, "build/ckpt_idx/rank-0-of-1.safetensors");
    EXPECT(rename(from, to) == 0, "rename %s", from);
    snprintf(big, 8192, "{\"format\": \"moept-train-v1\", \"ep_size\": 1, \"fingerprint\": \"%s\", \"step\": 0}\n", fp);
    write_text("build/ckpt_idx/index.json", big);
    EXPECT_OK(moept_load_checkpoint(L, "build/ckpt_idx"));
    free(big);
    moept_destroy(L);
}

/* Training checkpoint payloads are verified: a flipped bit anywhere in a
   tensor fails its checksum (naming it); a NaN parameter or a negative AdamW
   v saved as such fails finiteness. Each loaded as OK before. */
static void flip_bit(const char *path, int64_t at) {
    FILE *f = fopen(path, "r+b");
    if (!f) return;
    fseek(f, (long)at, SEEK_SET);
    int ch = fgetc(f);
    fseek(f, (long)at, SEEK_SET);
    fputc(ch ^ 0x10, f);
    fclose(f);
}
static void test_ckpt_payload_verified(void) {
    moept_config c = fam_cfg(MOEPT_FAMILY_QWEN2_MOE);
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    moept_init_params(L, 8);
    for (int64_t i = 0; i < L->par.n_params; i++) L->par.grads[i] = 0.01f * (float)(i % 7);
    moept_adamw opt = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f};
    EXPECT_OK(moept_adamw_step(L, &opt)); /* m and v saved too */
    const char *dir = "build/ckpt_verify";
    mkdir(dir, 0755);
    EXPECT_OK(moept_save_checkpoint(L, dir));
    const char *rank = rank_file(dir, 0, 1);
    EXPECT_OK(moept_load_checkpoint(L, dir));
    moept_st_file *f = NULL;
    EXPECT_OK(moept_st_open(rank, &f));
    const moept_st_tensor *t = f ? moept_st_find(f, "optimizer.v.experts.3.down_proj.weight") : NULL;
    int64_t at = t ? t->offset + t->nbytes / 2 : 0;
    moept_st_close(f);
    EXPECT(t != NULL, "no optimizer.v tensor in the file");
    flip_bit(rank, at);
    moept_status st = moept_load_checkpoint(L, dir);
    EXPECT(st == MOEPT_ERR_FORMAT && strstr(moept_last_error(L), "checksum") &&
           strstr(moept_last_error(L), "optimizer.v.experts.3.down_proj.weight"), "a flipped bit: %d (%s)", (int)st,
           moept_last_error(L));
    L->opt.v[5] = -1.0f;
    EXPECT_OK(moept_save_checkpoint(L, dir));
    st = moept_load_checkpoint(L, dir);
    EXPECT(st == MOEPT_ERR_NUMERIC && strstr(moept_last_error(L), "negative"), "a negative v: %d (%s)", (int)st,
           moept_last_error(L));
    L->opt.v[5] = 0.0f;
    L->par.params[3] = NAN; /* a save refuses it; the set it would replace stays current */
    st = moept_save_checkpoint(L, dir);
    EXPECT(st == MOEPT_ERR_NUMERIC && strstr(moept_last_error(L), "'gate.weight' (flat element 3) is not finite"),
           "the save of a NaN parameter: %d (%s)", (int)st, moept_last_error(L));
    st = moept_load_checkpoint(L, dir);
    EXPECT(st == MOEPT_ERR_NUMERIC && strstr(moept_last_error(L), "negative"), "the previous set: %d (%s)", (int)st,
           moept_last_error(L));
    moept_destroy(L);
}

static void test_dtypes_convert(void) {
    /* F16 and BF16 read as fp32; writer and reader agree on every dtype */
    uint16_t h[4] = {0x3c00, 0xc000, 0x0001, 0x7bff};   /* 1, -2, 2^-24, 65504 */
    uint16_t b[3] = {0x3f80, 0xc040, 0x4049};           /* 1, -3, 3.140625 */
    moept_st_writer *w;
    EXPECT_OK(moept_st_writer_create(&w));
    int64_t s4 = 4, s3 = 3;
    EXPECT_OK(moept_st_add(w, "h", MOEPT_DTYPE_F16, 1, &s4, h));
    EXPECT_OK(moept_st_add(w, "b", MOEPT_DTYPE_BF16, 1, &s3, b));
    EXPECT(moept_st_add(w, "h", MOEPT_DTYPE_F16, 1, &s4, h) == MOEPT_ERR_INVALID_ARGUMENT, "duplicate name accepted by the writer");
    EXPECT_OK(moept_st_write(w, "build/dtypes.safetensors"));
    moept_st_writer_destroy(w);
    moept_st_file *f;
    EXPECT_OK(moept_st_open("build/dtypes.safetensors", &f));
    if (!f) return;
    float out[4];
    EXPECT_OK(moept_st_read_f32(f, moept_st_find(f, "h"), out, 4));
    EXPECT(out[0] == 1.0f && out[1] == -2.0f && out[2] == ldexpf(1.0f, -24) && out[3] == 65504.0f, "F16 conversion: %g %g %g %g",
           out[0], out[1], out[2], out[3]);
    EXPECT_OK(moept_st_read_f32(f, moept_st_find(f, "b"), out, 3));
    EXPECT(out[0] == 1.0f && out[1] == -3.0f && out[2] == 3.140625f, "BF16 conversion");
    moept_st_close(f);
}

static void test_crash_during_save_keeps_previous(void) {
    /* a valid checkpoint, then a save of a large one killed mid-write */
    moept_st_writer *w;
    float small[4] = {1, 2, 3, 4};
    int64_t s4 = 4;
    moept_st_writer_create(&w);
    moept_st_add(w, "v", MOEPT_DTYPE_F32, 1, &s4, small);
    EXPECT_OK(moept_st_write(w, "build/crash.safetensors"));
    moept_st_writer_destroy(w);
    int64_t big = (int64_t)96 << 20; /* 384 MB of floats: takes a while to write */
    unsigned long seq = atomic_load(&moept__tmp_seq); /* the child's temporary name: pid, then this */
    pid_t pid = fork();
    if (pid == 0) {
        float *data = calloc((size_t)big, 4);
        moept_st_writer *cw;
        moept_st_writer_create(&cw);
        moept_st_add(cw, "v", MOEPT_DTYPE_F32, 1, &big, data);
        moept_st_write(cw, "build/crash.safetensors");
        _exit(0);
    }
    /* kill it once the temporary file has started to grow */
    char tmp[256];
    snprintf(tmp, sizeof tmp, "build/crash.safetensors.tmp.%ld.%lu", (long)pid, seq);
    struct stat sb;
    for (int i = 0; i < 2000; i++) {
        if (stat(tmp, &sb) == 0 && sb.st_size > (1 << 20)) break;
        usleep(1000);
    }
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    EXPECT(WIFSIGNALED(status), "the writer finished before it was killed; the test proves nothing");
    moept_st_file *f;
    EXPECT_OK(moept_st_open("build/crash.safetensors", &f));
    if (f) {
        float out[4] = {0};
        const moept_st_tensor *t = moept_st_find(f, "v");
        EXPECT(t && t->numel == 4, "the previous checkpoint was replaced by a partial one");
        if (t && t->numel == 4) {
            moept_st_read_f32(f, t, out, 4);
            EXPECT(memcmp(out, small, sizeof small) == 0, "previous checkpoint's data changed");
        }
        moept_st_close(f);
    }
    unlink(tmp);
}

/* ---- resume: N steps, save, a fresh layer loads, M more steps: the losses
   equal those of the uninterrupted run bit for bit ---- */
typedef struct rj { moept_thread_group *g; int r, P, from, to; const char *dir; int save_at; double loss[16]; moept_status st; char err[512]; } rj;

static void *resume_main(void *arg) {
    rj *j = arg;
    moept_comm *c = NULL;
    if (j->P > 1) moept_comm_threads(j->g, j->r, &c);
    tu_rank_thread();
    moept_config cfg = fam_cfg(MOEPT_FAMILY_DEEPSEEK_V3);
    cfg.aux_loss = MOEPT_AUX_HF; cfg.aux_loss_coef = 0.01f; cfg.global_balance = 1;
    moept_layer *L = NULL;
    j->st = moept_create_parallel(&cfg, c, NULL, &L);
    if (!j->st) j->st = moept_init_params(L, 9);
    if (!j->st && j->from > 0) j->st = moept_load_checkpoint(L, j->dir);
    moept_adamw opt = {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
    float x[8 * 12], y[8 * 12], dy[8 * 12], dx[8 * 12];
    for (int s = j->from; s < j->to && !j->st; s++) {
        unsigned long long seed = 1000 + (unsigned long long)s * 31 + (unsigned long long)j->r;
        tu_fill(x, 8 * 12, 1.0, &seed);
        tu_fill(dy, 8 * 12, 1.0, &seed);
        moept_zero_grad(L);
        if ((j->st = moept_forward(L, x, 8, y))) break;
        if ((j->st = moept_backward(L, x, dy, dx))) break;
        if ((j->st = moept_sync_grads(L, 1.0f))) break;
        if ((j->st = moept_adamw_step(L, &opt))) break;
        if ((j->st = moept_update_bias(L, 1e-3f))) break;
        double l = 0;
        for (int i = 0; i < 8 * 12; i++) l += (double)y[i] * dy[i];
        moept_stats st;
        moept_get_stats(L, &st, NULL);
        j->loss[s] = l + st.aux_loss;
        if (s + 1 == j->save_at && (j->st = moept_save_checkpoint(L, j->dir))) break;
    }
    if (j->st) snprintf(j->err, sizeof j->err, "%s", L ? moept_last_error(L) : moept_last_error(NULL));
    moept_destroy(L);
    return NULL;
}

static void run_resume(int P, rj *js, int from, int to, int save_at, const char *dir) {
    rj proto = {.P = P, .from = from, .to = to, .save_at = save_at, .dir = dir};
    tu_ranks_from(P, 20000, resume_main, js, sizeof js[0], &proto);
}

static void test_resume_is_bitwise(void) {
    static const int Ps[2] = {1, 4};
    for (int pi = 0; pi < 2; pi++) {
        int P = Ps[pi];
        rj full[4], a[4], b[4];
        char dir[64];
        snprintf(dir, sizeof dir, "build/resume_ep%d", P);
        run_resume(P, full, 0, 10, 0, dir);   /* uninterrupted */
        /* 5 steps and a save in another process, which then exits; its
           losses come back through a pipe */
        int fds[2];
        EXPECT(pipe(fds) == 0, "pipe");
        pid_t pid = fork();
        if (pid == 0) {
            close(fds[0]);
            run_resume(P, a, 0, 5, 5, dir);
            ssize_t wr = write(fds[1], a, sizeof a);
            _exit(wr == (ssize_t)sizeof a ? 0 : 1);
        }
        close(fds[1]);
        size_t got = 0;
        while (got < sizeof a) {
            ssize_t n = read(fds[0], (char *)a + got, sizeof a - got);
            if (n <= 0) break;
            got += (size_t)n;
        }
        close(fds[0]);
        int status = 0;
        waitpid(pid, &status, 0);
        EXPECT(got == sizeof a && WIFEXITED(status) && WEXITSTATUS(status) == 0, "the saving process failed");
        run_resume(P, b, 5, 10, 0, dir);      /* this process resumes from the files */
        for (int r = 0; r < P; r++) {
            EXPECT(full[r].st == MOEPT_OK && a[r].st == MOEPT_OK && b[r].st == MOEPT_OK, "EP=%d rank %d: %s %s %s", P, r,
                   full[r].err, a[r].err, b[r].err);
            for (int s = 0; s < 10; s++) {
                double l = s < 5 ? a[r].loss[s] : b[r].loss[s];
                EXPECT(memcmp(&l, &full[r].loss[s], sizeof l) == 0, "EP=%d rank %d step %d: %.17g resumed vs %.17g", P, r, s,
                       l, full[r].loss[s]);
            }
        }
        /* a config that differs is refused */
        moept_config cfg = fam_cfg(MOEPT_FAMILY_DEEPSEEK_V3);
        cfg.aux_loss = MOEPT_AUX_HF; cfg.aux_loss_coef = 0.02f; cfg.global_balance = 1;
        moept_layer *L;
        EXPECT_OK(moept_create(&cfg, &L));
        EXPECT(moept_load_checkpoint(L, dir) == MOEPT_ERR_INVALID_ARGUMENT, "a checkpoint of another config loaded");
        moept_destroy(L);
    }
}

/* load a checkpoint at another EP size, save it again there */
typedef struct rs { moept_thread_group *g; int r, Q; const char *src, *dst; moept_status st; char err[512]; } rs;
static void *reshard_main(void *arg) {
    rs *j = arg;
    moept_comm *c = NULL;
    if (j->Q > 1) moept_comm_threads(j->g, j->r, &c);
    moept_config cfg = fam_cfg(MOEPT_FAMILY_DEEPSEEK_V3);
    cfg.aux_loss = MOEPT_AUX_HF; cfg.aux_loss_coef = 0.01f; cfg.global_balance = 1;
    moept_layer *L = NULL;
    j->st = moept_create_parallel(&cfg, c, NULL, &L);
    if (!j->st) j->st = moept_load_checkpoint(L, j->src);
    if (!j->st) j->st = moept_save_checkpoint(L, j->dst);
    if (j->st) snprintf(j->err, sizeof j->err, "%s", L ? moept_last_error(L) : moept_last_error(NULL));
    moept_destroy(L);
    return NULL;
}

static moept_layer *load_one(const char *dir) {
    moept_config cfg = fam_cfg(MOEPT_FAMILY_DEEPSEEK_V3);
    cfg.aux_loss = MOEPT_AUX_HF; cfg.aux_loss_coef = 0.01f; cfg.global_balance = 1;
    moept_layer *L = NULL;
    if (moept_create(&cfg, &L) || moept_load_checkpoint(L, dir)) {
        EXPECT(0, "%s: %s", dir, L ? moept_last_error(L) : moept_last_error(NULL));
        moept_destroy(L);
        return NULL;
    }
    return L;
}

/* Loads are collective: at two EP ranks, rank 1's file of a checkpoint is
   cut short (rank 0 needs only its own), then rank 1 alone is given a
   missing HF directory. Every rank fails (rank 0 with "other rank(s)
   rejected"), and no rank's parameters change: before, rank 0 loaded while
   rank 1 did not, and the replicated router diverged. */
typedef struct cl { moept_thread_group *g; int r; moept_status st[2]; int changed; char err[2][512]; } cl;
static void *collective_load_main(void *arg) {
    cl *j = arg;
    moept_comm *c = NULL;
    moept_comm_threads(j->g, j->r, &c);
    moept_config cfg = fam_cfg(MOEPT_FAMILY_MIXTRAL);
    moept_layer *L = NULL;
    if (moept_create_parallel(&cfg, c, NULL, &L)) { j->st[0] = j->st[1] = MOEPT_ERR_STATE; return NULL; }
    moept_init_params(L, 3);
    moept_save_checkpoint(L, "build/ckpt_coll");
    moept_zero_grad(L);
    moept_init_params(L, 4); /* what a failed load must leave */
    float *before = malloc((size_t)L->par.n_params * 4);
    memcpy(before, L->par.params, (size_t)L->par.n_params * 4);
    if (j->r == 1) truncate(rank_file("build/ckpt_coll", 1, 2), 100);
    j->st[0] = moept_load_checkpoint(L, "build/ckpt_coll");
    snprintf(j->err[0], sizeof j->err[0], "%s", moept_last_error(L));
    j->st[1] = moept_load_hf(L, j->r ? "build/no_such_hf_dir" : "build/ckpt_coll_hf", 0);
    snprintf(j->err[1], sizeof j->err[1], "%s", moept_last_error(L));
    j->changed = memcmp(before, L->par.params, (size_t)L->par.n_params * 4) != 0;
    free(before);
    moept_destroy(L);
    return NULL;
}
static void test_loads_are_collective(void) {
    mkdir("build/ckpt_coll", 0755);
    mkdir("build/ckpt_coll_hf", 0755);
    moept_config cfg = fam_cfg(MOEPT_FAMILY_MIXTRAL); /* a whole HF checkpoint of the config: rank 0's is good */
    moept_layer *W = NULL;
    EXPECT_OK(moept_create(&cfg, &W));
    moept_init_params(W, 9);
    EXPECT_OK(moept_save_hf(W, "build/ckpt_coll_hf/model.safetensors", 0, 1));
    moept_destroy(W);
    cl js[2];
    tu_ranks(2, 20000, collective_load_main, js, sizeof js[0]);
    for (int r = 0; r < 2; r++) {
        for (int i = 0; i < 2; i++)
            EXPECT(js[r].st[i] != MOEPT_OK && (r == 1 || strstr(js[r].err[i], "other rank")),
                   "rank %d, %s: status %d (%s)", r, i ? "load_hf" : "load_checkpoint", (int)js[r].st[i], js[r].err[i]);
        EXPECT(!js[r].changed, "rank %d: a rejected load changed the parameters", r);
    }
}

/* Saves are collective and atomic as a set: at two EP ranks, rank 1
   rejects its directory argument (a path over the 3000-byte limit), so
   every rank fails, the new set is removed, and the previous checkpoint stays
   current and loads with the previous parameters. A good save then makes
   its set current and removes the old one and a killed save's leftover. */
typedef struct cs { moept_thread_group *g; int r; moept_status st[3]; int same; char err[512]; } cs;
static void *collective_save_main(void *arg) {
    cs *j = arg;
    moept_comm *c = NULL;
    moept_comm_threads(j->g, j->r, &c);
    moept_config cfg = fam_cfg(MOEPT_FAMILY_MIXTRAL);
    moept_layer *L = NULL;
    if (moept_create_parallel(&cfg, c, NULL, &L)) { j->st[0] = MOEPT_ERR_STATE; return NULL; }
    const char *dir = "build/ckpt_csave";
    moept_init_params(L, 3);
    j->st[0] = moept_save_checkpoint(L, dir);
    float *saved = malloc((size_t)L->par.n_params * 4);
    memcpy(saved, L->par.params, (size_t)L->par.n_params * 4);
    moept_init_params(L, 4);
    char *too_long = calloc(3002, 1);
    memset(too_long, 'd', 3001);
    j->st[1] = moept_save_checkpoint(L, j->r ? too_long : dir);
    free(too_long);
    snprintf(j->err, sizeof j->err, "%s", moept_last_error(L));
    j->st[2] = moept_load_checkpoint(L, dir);
    j->same = memcmp(saved, L->par.params, (size_t)L->par.n_params * 4) == 0;
    free(saved);
    moept_destroy(L);
    return NULL;
}
static int count_sets(const char *dir) {
    int n = 0;
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));) n += strncmp(e->d_name, "save-", 5) == 0;
    if (d) closedir(d);
    return n;
}
static void test_saves_are_collective(void) {
    mkdir("build/ckpt_csave", 0755);
    cs js[2];
    tu_ranks(2, 20000, collective_save_main, js, sizeof js[0]);
    for (int r = 0; r < 2; r++) {
        EXPECT(js[r].st[0] == MOEPT_OK, "rank %d: the first save failed", r);
        EXPECT(js[r].st[1] != MOEPT_OK && (r == 1 || strstr(js[r].err, "other rank")),
               "rank %d: a save rank 1 could not write: status %d (%s)", r, (int)js[r].st[1], js[r].err);
        EXPECT(js[r].st[2] == MOEPT_OK && js[r].same, "rank %d: the previous checkpoint did not load as saved", r);
    }
    EXPECT(count_sets("build/ckpt_csave") == 1, "%d sets after a failed save (its set not removed)",
           count_sets("build/ckpt_csave"));
    /* a killed save's leftover set, then a good save at one rank */
    mkdir("build/ckpt_csave/save-9-00000000dead", 0755);
    write_text("build/ckpt_csave/save-9-00000000dead/rank-0-of-2.safetensors", "torn");
    moept_config cfg = fam_cfg(MOEPT_FAMILY_MIXTRAL);
    moept_layer *L = NULL;
    EXPECT_OK(moept_create(&cfg, &L));
    EXPECT_OK(moept_load_checkpoint(L, "build/ckpt_csave"));
    EXPECT_OK(moept_save_checkpoint(L, "build/ckpt_csave"));
    EXPECT(count_sets("build/ckpt_csave") == 1, "%d sets after a good save", count_sets("build/ckpt_csave"));
    struct stat sb;
    EXPECT(stat(rank_file("build/ckpt_csave", 0, 1), &sb) == 0, "the new set is not the index's");
    moept_destroy(L);
}

static void test_checkpoint_across_ep_sizes(void) {
    static const int pairs[3][2] = {{4, 2}, {2, 4}, {4, 1}};
    for (int pi = 0; pi < 3; pi++) {
        int P = pairs[pi][0], Q = pairs[pi][1];
        char dp[64], dq[64];
        snprintf(dp, sizeof dp, "build/xep_%d", P);
        snprintf(dq, sizeof dq, "build/xep_%d_to_%d", P, Q);
        rj a[4];
        run_resume(P, a, 0, 3, 3, dp); /* 3 steps at EP=P (optimizer state, bias moved), saved */
        rs js[4], proto = {.Q = Q, .src = dp, .dst = dq};
        tu_ranks_from(Q, 20000, reshard_main, js, sizeof js[0], &proto);
        for (int r = 0; r < Q; r++) EXPECT(js[r].st == MOEPT_OK, "EP=%d -> EP=%d rank %d: %s", P, Q, r, js[r].err);
        /* EP=P -> 1 and EP=P -> Q -> 1 hold the same state, bit for bit */
        moept_layer *A = load_one(dp), *B = load_one(dq);
        if (A && B) {
            EXPECT(memcmp(A->par.params, B->par.params, (size_t)A->par.n_params * 4) == 0, "EP=%d -> %d: parameters differ", P, Q);
            EXPECT(memcmp(A->par.bias, B->par.bias, (size_t)A->E * 4) == 0, "EP=%d -> %d: correction bias differs", P, Q);
            EXPECT(A->opt.t == 3 && B->opt.t == 3, "step not restored (%lld, %lld)", (long long)A->opt.t, (long long)B->opt.t);
            EXPECT(A->opt.m && B->opt.m && memcmp(A->opt.m, B->opt.m, (size_t)(2 * A->par.n_params) * 4) == 0,
                   "EP=%d -> %d: optimizer state differs", P, Q);
        }
        moept_destroy(A);
        moept_destroy(B);
    }
}

static void test_adamw_matches_formula(void) {
    moept_config c = fam_cfg(MOEPT_FAMILY_OLMOE);
    moept_layer *L;
    EXPECT_OK(moept_create(&c, &L));
    moept_init_params(L, 2);
    double p = L->par.params[5], m = 0, v = 0;
    moept_adamw opt = {0.01f, 0.9f, 0.999f, 1e-8f, 0.1f};
    for (int t = 1; t <= 3; t++) {
        float g = 0.3f * (float)t - 0.5f;
        L->par.grads[5] = g;
        EXPECT_OK(moept_adamw_step(L, &opt));
        p *= 1 - 0.01 * 0.1;
        m = 0.9 * m + 0.1 * g;
        v = 0.999 * v + 0.001 * (double)g * g;
        p -= 0.01 / (1 - pow(0.9, t)) * m / (sqrt(v) / sqrt(1 - pow(0.999, t)) + 1e-8);
        EXPECT(fabs(L->par.params[5] - p) < 1e-6, "step %d: %.9g vs torch.optim.AdamW's %.9g", t, L->par.params[5], p);
    }
    moept_destroy(L);
}

/* config.json -> moept_config on configs written by transformers itself
   (tools/make_configs.py, tests/checkpoints): sizes, routing, the dense-layer
   rules, and errors that name the key. */
typedef struct hf_want {
    const char *dir;
    int64_t layer;
    moept_family fam;
    int64_t D, F, E, K, S, ng, tg;
    int norm;
    float scale, aux;
    moept_activation act;
} hf_want;

static void check_hf_config(const hf_want *w) {
    moept_config c = moept_config_default(MOEPT_FAMILY_OLMOE);
    c.max_tokens = 77; c.z_loss_coef = 0.5f; /* the caller's: kept */
    moept_status st = moept_config_from_hf(w->dir, w->layer, &c);
    EXPECT(st == MOEPT_OK, "%s layer %lld: %s", w->dir, (long long)w->layer, moept_last_error(NULL));
    if (st) return;
    EXPECT(c.family == w->fam && c.hidden_size == w->D && c.intermediate_size == w->F && c.num_experts == w->E &&
           c.top_k == w->K && c.shared_intermediate_size == w->S && c.n_group == w->ng && c.topk_group == w->tg &&
           c.norm_topk_prob == w->norm && c.activation == w->act && c.max_tokens == 77 && c.z_loss_coef == 0.5f,
           "%s: family %d D %lld F %lld E %lld K %lld S %lld groups %lld/%lld norm %d act %d", w->dir,
           (int)c.family, (long long)c.hidden_size, (long long)c.intermediate_size, (long long)c.num_experts,
           (long long)c.top_k, (long long)c.shared_intermediate_size, (long long)c.n_group,
           (long long)c.topk_group, c.norm_topk_prob, (int)c.activation);
    EXPECT(c.routed_scaling_factor == w->scale && c.aux_loss_coef == w->aux &&
           c.aux_loss == (w->aux > 0 ? MOEPT_AUX_HF : MOEPT_AUX_NONE),
           "%s: scale %g aux %d coef %g", w->dir, (double)c.routed_scaling_factor, (int)c.aux_loss,
           (double)c.aux_loss_coef);
    moept_layer *L = NULL;
    EXPECT(moept_create(&c, &L) == MOEPT_OK, "%s: the config is not accepted: %s", w->dir, moept_last_error(NULL));
    moept_destroy(L);
}

static void expect_hf_error(const char *path, int64_t layer, moept_status want, const char *needle) {
    moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL), before = c;
    moept_status st = moept_config_from_hf(path, layer, &c);
    EXPECT(st == want && strstr(moept_last_error(NULL), needle), "%s layer %lld: status %d (%d wanted), '%s' (wanted "
           "'%s')", path, (long long)layer, (int)st, (int)want, moept_last_error(NULL), needle);
    EXPECT(memcmp(&c, &before, sizeof c) == 0, "%s: a failed call changed the config", path);
}

#define OLMOE_KEYS "\"model_type\": \"olmoe\", \"hidden_size\": 8, \"intermediate_size\": 4, \"num_experts\": 4, " \
                   "\"num_experts_per_tok\": 2, \"num_hidden_layers\": 1"
#define DSV3_KEYS "\"model_type\": \"deepseek_v3\", \"hidden_size\": 8, \"moe_intermediate_size\": 4, " \
                  "\"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"num_hidden_layers\": 2, " \
                  "\"first_k_dense_replace\": 0"
static void test_config_from_hf(void) {
    const hf_want ok[] = {
        {"tests/checkpoints/mixtral_e8_t40", 1, MOEPT_FAMILY_MIXTRAL, 24, 20, 8, 2, 0, 1, 1, MOEPT_NORM_DEFAULT, 0.0f,
         0.001f, MOEPT_ACT_SILU_GATED},
        {"tests/checkpoints/deepseek_group/config.json", 1, MOEPT_FAMILY_DEEPSEEK_V3, 16, 6, 8, 2, 6, 4, 2,
         MOEPT_NORM_ON, 2.5f, 0.0f, MOEPT_ACT_SILU_GATED},
        {"tests/configs/qwen2_sparse", 1, MOEPT_FAMILY_QWEN2_MOE, 64, 48, 8, 2, 80, 1, 1, MOEPT_NORM_ON, 0.0f, 0.02f,
         MOEPT_ACT_SILU_GATED},
        {"tests/configs/qwen2_sparse", 5, MOEPT_FAMILY_QWEN2_MOE, 64, 48, 8, 2, 80, 1, 1, MOEPT_NORM_ON, 0.0f, 0.02f,
         MOEPT_ACT_SILU_GATED},
        {"tests/configs/qwen3_moe", 0, MOEPT_FAMILY_QWEN2_MOE, 64, 40, 16, 4, 0, 1, 1, MOEPT_NORM_OFF, 0.0f, 0.001f,
         MOEPT_ACT_SILU_GATED},
        {"tests/configs/deepseek_dense2", 3, MOEPT_FAMILY_DEEPSEEK_V3, 64, 24, 16, 4, 48, 4, 2, MOEPT_NORM_OFF, 1.5f,
         0.0f, MOEPT_ACT_SILU_GATED},
        {"tests/configs/mixtral_gelu", 0, MOEPT_FAMILY_MIXTRAL, 64, 56, 4, 2, 0, 1, 1, MOEPT_NORM_DEFAULT, 0.0f,
         0.001f, MOEPT_ACT_GELU_GATED},
        {"tests/configs/olmoe_default", 0, MOEPT_FAMILY_OLMOE, 64, 32, 8, 2, 0, 1, 1, MOEPT_NORM_OFF, 0.0f, 0.01f,
         MOEPT_ACT_SILU_GATED},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) check_hf_config(&ok[i]);
    const int64_t qdense[] = {0, 2, 3, 4}; /* (l+1) % 2 != 0, or listed in mlp_only_layers */
    for (int i = 0; i < 4; i++)
        expect_hf_error("tests/configs/qwen2_sparse", qdense[i], MOEPT_ERR_INVALID_ARGUMENT, "dense MLP layer");
    expect_hf_error("tests/configs/deepseek_dense2", 1, MOEPT_ERR_INVALID_ARGUMENT, "dense MLP layer");
    expect_hf_error("tests/checkpoints/deepseek_group", 0, MOEPT_ERR_INVALID_ARGUMENT, "dense MLP layer");
    expect_hf_error("tests/configs/qwen2_sparse", 6, MOEPT_ERR_INVALID_ARGUMENT, "num_hidden_layers");
    expect_hf_error("tests/configs/nowhere", 0, MOEPT_ERR_IO, "cannot open");
    const char *p = "build/hf_config_test.json";
    write_text(p, "{\"model_type\": \"llama\", \"hidden_size\": 8}");
    expect_hf_error(p, 0, MOEPT_ERR_UNSUPPORTED, "\"llama\"");
    write_text(p, "{\"model_type\": \"mixtral\", \"hidden_size\": 8, \"intermediate_size\": 4, "
               "\"num_experts_per_tok\": 2, \"num_hidden_layers\": 1}");
    expect_hf_error(p, 0, MOEPT_ERR_FORMAT, "\"num_local_experts\" is missing");
    write_text(p, "{\"model_type\": \"olmoe\", \"hidden_size\": 8, \"intermediate_size\": 4, \"num_experts\": 4, "
               "\"num_experts_per_tok\": 5, \"num_hidden_layers\": 1}");
    expect_hf_error(p, 0, MOEPT_ERR_FORMAT, "\"num_experts_per_tok\" (5) exceeds");
    write_text(p, "{\"model_type\": \"olmoe\", \"hidden_size\": 8.5, \"intermediate_size\": 4, \"num_experts\": 4, "
               "\"num_experts_per_tok\": 2, \"num_hidden_layers\": 1}");
    expect_hf_error(p, 0, MOEPT_ERR_FORMAT, "\"hidden_size\" must be a JSON integer");
    /* integers only from JSON integers, as Python's json and transformers read them */
    const char *notint[3][2] = {{"true", "not a boolean"}, {"8.0", "not a float"}, {"1E1", "not a float"}};
    for (int i = 0; i < 3; i++) {
        char t[400];
        snprintf(t, sizeof t, "{\"model_type\": \"mixtral\", \"hidden_size\": 8, \"intermediate_size\": 4, "
                 "\"num_local_experts\": %s, \"num_experts_per_tok\": 1, \"num_hidden_layers\": 1}", notint[i][0]);
        write_text(p, t);
        expect_hf_error(p, 0, MOEPT_ERR_FORMAT, "\"num_local_experts\" must be a JSON integer");
        expect_hf_error(p, 0, MOEPT_ERR_FORMAT, notint[i][1]);
    }
    write_text(p, "{\"model_type\": \"deepseek_v3\", \"hidden_size\": 8, \"moe_intermediate_size\": 4, "
               "\"n_routed_experts\": 6, \"num_experts_per_tok\": 2, \"num_hidden_layers\": 2, \"n_group\": 4, "
               "\"first_k_dense_replace\": 0}");
    expect_hf_error(p, 0, MOEPT_ERR_FORMAT, "\"n_group\" (4)");
    /* what moept_config_from_hf accepts, moept_create accepts: sizes and groups it would refuse, named */
#define DSV3_GROUPS(ng, tg, k, ns) "{\"model_type\": \"deepseek_v3\", \"hidden_size\": 8, \"moe_intermediate_size\": " \
    "2048, \"n_routed_experts\": 8, \"num_experts_per_tok\": " #k ", \"num_hidden_layers\": 1, " \
    "\"first_k_dense_replace\": 0, \"n_group\": " #ng ", \"topk_group\": " #tg ", \"n_shared_experts\": " #ns "}"
    write_text(p, DSV3_GROUPS(1, 1, 2, 1024));
    expect_hf_error(p, 0, MOEPT_ERR_FORMAT, "\"n_shared_experts\" (1024) x \"moe_intermediate_size\" (2048)");
    write_text(p, DSV3_GROUPS(8, 1, 1, 0));
    expect_hf_error(p, 0, MOEPT_ERR_FORMAT, "groups of fewer than 2 experts");
    write_text(p, DSV3_GROUPS(4, 1, 3, 0));
    expect_hf_error(p, 0, MOEPT_ERR_FORMAT, "\"n_group\" (4) and \"topk_group\" (1)");
    write_text(p, DSV3_GROUPS(4, 2, 4, 512)); /* the limits themselves: accepted, and by moept_create */
    moept_config g = moept_config_default(MOEPT_FAMILY_MIXTRAL), r;
    g.max_tokens = 4;
    EXPECT(moept_config_from_hf(p, 0, &g) == MOEPT_OK && g.shared_intermediate_size == 1 << 20,
           "the group and size limits: %s", moept_last_error(NULL));
    EXPECT(moept__resolve(&g, &r) == MOEPT_OK, "moept_create refuses: %s", moept_last_error(NULL));
#undef DSV3_GROUPS
    write_text(p, "{\"model_type\": \"mixtral\", \"hidden_act\": \"relu2\", \"hidden_size\": 8, "
               "\"intermediate_size\": 4, \"num_local_experts\": 4, \"num_experts_per_tok\": 2, \"num_hidden_layers\": 1}");
    expect_hf_error(p, 0, MOEPT_ERR_UNSUPPORTED, "\"hidden_act\" \"relu2\"");
    write_text(p, "{\"model_type\": \"mixtral\", \"hidden_size\": 8,");
    expect_hf_error(p, 0, MOEPT_ERR_FORMAT, "not a JSON object");
    /* numbers in any locale's spelling of JSON: exponents, fractions */
    write_text(p, "{\"model_type\": \"olmoe\", \"hidden_size\": 8, \"intermediate_size\": 4, \"num_experts\": 4, "
               "\"num_experts_per_tok\": 2, \"num_hidden_layers\": 1, \"router_aux_loss_coef\": 2.5E-3, "
               "\"norm_topk_prob\": true, \"extra\": {\"a\": [1, {\"b\": null}]}}");
    moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL);
    EXPECT(moept_config_from_hf("tests/configs/mixtral_gelu", 0, &c) == MOEPT_OK && c.router_jitter == 0.05f,
           "mixtral router_jitter_noise: %s, %g", moept_last_error(NULL), (double)c.router_jitter);
    EXPECT(moept_config_from_hf("tests/configs/olmoe_default", 0, &c) == MOEPT_OK && c.router_jitter == 0.0f,
           "olmoe: router_jitter %g", (double)c.router_jitter);
    EXPECT(moept_config_from_hf(p, 0, &c) == MOEPT_OK && c.hidden_size == 8 && c.aux_loss_coef == 2.5e-3f &&
           c.norm_topk_prob == MOEPT_NORM_ON, "numbers: %s, D %lld, coef %.9g", moept_last_error(NULL),
           (long long)c.hidden_size, (double)c.aux_loss_coef);
    remove(p);
}

/* config.json, the HF index and a checkpoint's index.json are read as
   strictly as RFC 8259 says, by one reader: a key twice in one object
   (Python's json, and so transformers, takes the last; moept took the
   first) is refused naming the key, at any depth and however it is
   escaped; trailing content, leading zeros, malformed literals in values
   moept skips and invalid UTF-8 are refused; routed_scaling_factor 0 is
   refused (moept_config's 0 means 1.0); what Python reads, moept reads */
static void test_config_json_strict(void) {
    const char *p = "build/hf_strict.json";
    static const struct { const char *why, *text, *needle; } bad[] = {
        {"a key twice", "{" OLMOE_KEYS ", \"num_experts_per_tok\": 4}", "\"num_experts_per_tok\" twice"},
        {"a key twice, once escaped", "{" OLMOE_KEYS ", \"hidden\\u005fsize\": 16}", "\"hidden_size\" twice"},
        {"a nested key twice", "{" OLMOE_KEYS ", \"quantization_config\": {\"weight_block_size\": [1, 1], "
         "\"fmt\": \"e4m3\", \"weight_block_size\": [2, 2]}}", "\"weight_block_size\" twice"},
        {"trailing content", "{" OLMOE_KEYS "} x", "trailing"},
        {"a second object", "{" OLMOE_KEYS "}{}", "trailing"},
        {"a leading zero", "{" OLMOE_KEYS ", \"router_aux_loss_coef\": 00.01}", "leading zero"},
        {"a leading zero, skipped", "{" OLMOE_KEYS ", \"vocab_size\": 032000}", "leading zero"},
        {"a leading zero, negative", "{" OLMOE_KEYS ", \"x\": [-01]}", "leading zero"},
        {"a malformed nested literal", "{" OLMOE_KEYS ", \"rope_scaling\": {\"a\": tru}}", "literal"},
        {"a malformed literal", "{" OLMOE_KEYS ", \"use_cache\": nul}", "literal"},
        {"a number without digits", "{" OLMOE_KEYS ", \"x\": [-]}", "number"},
        {"a number's bare exponent", "{" OLMOE_KEYS ", \"x\": 1e}", "number"},
        {"a plus sign", "{" OLMOE_KEYS ", \"x\": +1}", "value"},
        {"a trailing comma", "{" OLMOE_KEYS ", \"x\": [1, 2,]}", "value"},
        {"a single-quoted string", "{" OLMOE_KEYS ", \"x\": 'a'}", "value"},
        {"invalid UTF-8", "{" OLMOE_KEYS ", \"name\": \"\xff\"}", "UTF-8"},
        {"an overlong UTF-8 '/'", "{" OLMOE_KEYS ", \"name\": \"\xc0\xaf\"}", "UTF-8"},
        {"routed_scaling_factor 0", "{" DSV3_KEYS ", \"n_group\": 1, \"topk_group\": 1, "
         "\"routed_scaling_factor\": 0.0}", "\"routed_scaling_factor\""},
        {"routed_scaling_factor < 0", "{" DSV3_KEYS ", \"n_group\": 1, \"topk_group\": 1, "
         "\"routed_scaling_factor\": -2.5}", "\"routed_scaling_factor\""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_text(p, bad[i].text);
        moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL), before = c;
        moept_status st = moept_config_from_hf(p, 0, &c);
        EXPECT(st == MOEPT_ERR_FORMAT && strstr(moept_last_error(NULL), bad[i].needle), "%s: status %d, '%s' "
               "(wanted '%s')", bad[i].why, (int)st, moept_last_error(NULL), bad[i].needle);
        EXPECT(memcmp(&c, &before, sizeof c) == 0, "%s: a failed call changed the config", bad[i].why);
    }
    /* what Python's json reads: escapes, exponents, -0, empty and nested containers, whitespace; 0e400 is 0 */
    write_text(p, " {\"model_\\u0074ype\" : \"olmoe\",\"hidden_size\":8,\"intermediate_size\":4,\n\t\"num_experts\""
               ":4,\"num_experts_per_tok\":2,\"num_hidden_layers\":1,\"router_aux_loss_coef\":0e400,\"a\":[],"
               "\"b\":{},\"c\":[[{\"d\":[true,false,null,-0,-0.5e-3,\"\\\"\\\\\\/\\b\\f\\n\\r\\t\\ud83d\\ude00\"]}]],"
               "\"e\":\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"} \r\n");
    moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL);
    moept_status st = moept_config_from_hf(p, 0, &c);
    EXPECT(st == MOEPT_OK && c.hidden_size == 8 && c.num_experts == 4 && c.aux_loss == MOEPT_AUX_NONE,
           "valid JSON: status %d (%s), D %lld E %lld aux %d", (int)st, moept_last_error(NULL), (long long)c.hidden_size,
           (long long)c.num_experts, (int)c.aux_loss);
    remove(p);
    /* the HF index: a metadata key twice, a leading zero in a value moept skips, a tensor twice (named) */
    moept_config fc = fam_cfg(MOEPT_FAMILY_MIXTRAL);
    moept_layer *L = NULL;
    EXPECT_OK(moept_create(&fc, &L));
    if (!L) return;
    mkdir("build/hf_strict_idx", 0755);
#define MAP "{\"model.layers.0.block_sparse_moe.gate.weight\": \"a.safetensors\"}"
    static const struct { const char *text, *needle; } idx[] = {
        {"{\"metadata\": {}, \"metadata\": {}, \"weight_map\": " MAP "}", "\"metadata\" twice"},
        {"{\"metadata\": {\"total_size\": 0100}, \"weight_map\": " MAP "}", "leading zero"},
        {"{\"metadata\": {\"x\": fals}, \"weight_map\": " MAP "}", "literal"},
        {"{\"weight_map\": " MAP "} x", "trailing"},
        {"{\"weight_map\": {\"model.layers.0.block_sparse_moe.gate.weight\": \"a.safetensors\", "
         "\"model.layers.0.block_sparse_moe.gate.weight\": \"b.safetensors\"}}",
         "\"model.layers.0.block_sparse_moe.gate.weight\" twice"},
    };
    for (size_t i = 0; i < sizeof idx / sizeof idx[0]; i++) {
        write_text("build/hf_strict_idx/model.safetensors.index.json", idx[i].text);
        st = moept_load_hf(L, "build/hf_strict_idx", 0);
        EXPECT(st == MOEPT_ERR_FORMAT && strstr(moept_last_error(L), idx[i].needle), "index %zu: status %d, '%s' "
               "(wanted '%s')", i, (int)st, moept_last_error(L), idx[i].needle);
    }
#undef MAP
    /* a checkpoint's index.json with trailing content */
    mkdir("build/ckpt_strict", 0755);
    EXPECT_OK(moept_save_checkpoint(L, "build/ckpt_strict"));
    FILE *f = fopen("build/ckpt_strict/index.json", "a");
    if (f) { fputs("{}", f); fclose(f); }
    st = moept_load_checkpoint(L, "build/ckpt_strict");
    EXPECT(st == MOEPT_ERR_FORMAT && strstr(moept_last_error(L), "trailing"), "index.json with trailing content: "
           "status %d, '%s'", (int)st, moept_last_error(L));
    /* an empty weight_map names no tensor (the lookup read an unset shard pointer) */
    write_text("build/hf_strict_idx/model.safetensors.index.json", "{\"weight_map\": {}}");
    st = moept_load_hf(L, "build/hf_strict_idx", 0);
    EXPECT(st == MOEPT_ERR_NOT_FOUND && strstr(moept_last_error(L), "weight_map"), "an empty weight_map: status %d, "
           "'%s'", (int)st, moept_last_error(L));
    remove("build/hf_strict_idx/model.safetensors.index.json");
    rmdir("build/hf_strict_idx");
    moept_destroy(L);
}

/* A zeroed config with a family set takes that family's routing defaults */
static void test_family_defaults(void) {
    const moept_family fams[4] = {MOEPT_FAMILY_MIXTRAL, MOEPT_FAMILY_QWEN2_MOE, MOEPT_FAMILY_OLMOE,
                                  MOEPT_FAMILY_DEEPSEEK_V3};
    const int norm[4] = {1, 0, 0, 1}, gate[4] = {MOEPT_SHARED_GATE_NONE, MOEPT_SHARED_GATE_SIGMOID,
                                                  MOEPT_SHARED_GATE_NONE, MOEPT_SHARED_GATE_NONE};
    for (int i = 0; i < 4; i++) {
        moept_config c = moept_config_default(fams[i]), r;
        c.hidden_size = 8; c.intermediate_size = 4; c.num_experts = 4; c.top_k = 2; c.max_tokens = 4;
        c.shared_intermediate_size = 4;
        EXPECT(moept__resolve(&c, &r) == MOEPT_OK && r.norm_topk_prob == norm[i] && (int)r.shared_gate == gate[i] &&
               r.activation == MOEPT_ACT_SILU_GATED && r.routed_scaling_factor == 1.0f,
               "family %d: norm %d gate %d act %d scale %g", (int)fams[i], r.norm_topk_prob, (int)r.shared_gate,
               (int)r.activation, (double)r.routed_scaling_factor);
        c.norm_topk_prob = MOEPT_NORM_OFF;
        EXPECT(moept__resolve(&c, &r) == MOEPT_OK && r.norm_topk_prob == 0, "family %d: NORM_OFF", (int)fams[i]);
        c.norm_topk_prob = MOEPT_NORM_ON;
        EXPECT(moept__resolve(&c, &r) == MOEPT_OK && r.norm_topk_prob == 1, "family %d: NORM_ON", (int)fams[i]);
    }
}

/* A trained layer's checkpoint (with AdamW state) into an inference layer:
   its y is the training layer's, bitwise; what the inference layer saves
   (parameters, step 0) loads back into a training layer; the inference
   layer allocated no optimizer state */
static void test_inference_layer_checkpoints(void) {
    moept_config c = fam_cfg(MOEPT_FAMILY_DEEPSEEK_V3);
    moept_layer *Lt, *Li, *L2;
    EXPECT_OK(moept_create(&c, &Lt));
    c.inference_only = 1;
    EXPECT_OK(moept_create(&c, &Li));
    c.inference_only = 0;
    EXPECT_OK(moept_create(&c, &L2));
    if (tu_bad) return;
    moept_init_params(Lt, 3);
    float x[8 * 12], y[8 * 12], yi[8 * 12], dx[8 * 12];
    unsigned long long s = 5;
    tu_fill(x, 96, 1.0, &s);
    moept_adamw o = {1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f};
    for (int step = 0; step < 2; step++) {
        EXPECT_OK(moept_zero_grad(Lt));
        EXPECT_OK(moept_forward(Lt, x, 8, y));
        EXPECT_OK(moept_backward(Lt, x, x, dx));
        EXPECT_OK(moept_adamw_step(Lt, &o));
    }
    EXPECT_OK(moept_save_checkpoint(Lt, "build/ckpt_infer_a"));
    EXPECT_OK(moept_load_checkpoint(Li, "build/ckpt_infer_a"));
    moept_stats st;
    moept_get_stats(Li, &st, NULL);
    EXPECT(Li->opt.m == NULL && st.allocations == Li->mem.allocations, "the inference layer took optimizer state");
    EXPECT_OK(moept_forward(Lt, x, 8, y));
    EXPECT_OK(moept_forward(Li, x, 8, yi));
    EXPECT(!memcmp(y, yi, sizeof y), "the inference layer's y differs from the trained layer's");
    EXPECT_OK(moept_save_checkpoint(Li, "build/ckpt_infer_b"));
    EXPECT_OK(moept_load_checkpoint(L2, "build/ckpt_infer_b"));
    EXPECT(!memcmp(L2->par.params, Lt->par.params, (size_t)Lt->par.n_params * 4) && !memcmp(L2->par.bias, Lt->par.bias, 8 * 4),
           "parameters through the inference layer's checkpoint differ");
    EXPECT(L2->opt.t == 0 && L2->opt.m == NULL, "the inference layer's checkpoint carried optimizer state");
    moept_destroy(Lt); moept_destroy(Li); moept_destroy(L2);
}

/* A scale block larger than the weight (weight_block_size up to 2^63 - 1,
   as a config.json may say): one block per row or column, computed
   without overflow (rows + br - 1 overflowed: UB, and the expected shape
   came out [0, 0]); the deepseek_fp8 scales, made for 4 x 8 blocks, are
   then refused with the expected shape [1, 1] and the key named */
static void test_fp8_block_size_huge(void) {
    const char *dir = "build/ckpt_fp8_huge", *src = "tests/checkpoints/deepseek_fp8";
    char path[256];
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    remove(path);
    EXPECT(symlink("../../tests/checkpoints/deepseek_fp8/model.safetensors", path) == 0, "symlink %s", path);
    FILE *f = fopen("tests/checkpoints/deepseek_fp8/config.json", "r");
    char *text = calloc(1, 1 << 16);
    size_t n = f ? fread(text, 1, (1 << 16) - 1, f) : 0;
    if (f) fclose(f);
    char *at = strstr(text, "\"weight_block_size\"");
    EXPECT(n > 0 && at, "no weight_block_size in %s/config.json", src);
    if (!at) { free(text); return; }
    char *close = strchr(at, ']');
    char conf[1 << 16];
    snprintf(conf, sizeof conf, "%.*s\"weight_block_size\": [9223372036854775807, 9223372036854775807%s",
             (int)(at - text), text, close);
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_text(path, conf);
    free(text);
    moept_config cfg = moept_config_default(MOEPT_FAMILY_DEEPSEEK_V3);
    cfg.max_tokens = 8;
    moept_layer *L = NULL;
    EXPECT_OK(moept_config_from_hf(dir, 1, &cfg));
    EXPECT_OK(moept_create(&cfg, &L));
    if (!L) return;
    moept_status st = moept_load_hf(L, dir, 1);
    const char *m = moept_last_error(L);
    EXPECT(st == MOEPT_ERR_FORMAT && strstr(m, "weight_block_size") && strstr(m, "[1, 1]") && !strstr(m, "[0, "),
           "blocks of 2^63 - 1: status %d, '%s'", (int)st, m);
    moept_destroy(L);
}

/* deepseek_fp8 copied into dir, its config.json with `from` replaced by
   `to` (from NULL: as it is); 0 if the copy failed */
static int fp8_copy(const char *dir, const char *from, const char *to) {
    static const char *const names[2] = {"config.json", "model.safetensors"};
    mkdir(dir, 0755);
    int ok = 1;
    for (int i = 0; i < 2; i++) {
        char path[256], *text = calloc(1, 1 << 17), *out = calloc(1, 1 << 17);
        snprintf(path, sizeof path, "tests/checkpoints/deepseek_fp8/%s", names[i]);
        FILE *f = fopen(path, "rb");
        size_t n = f ? fread(text, 1, (1 << 17) - 1, f) : 0, m = n;
        if (f) fclose(f);
        char *at = i == 0 && from ? strstr(text, from) : NULL;
        ok = ok && n > 0 && (!from || i == 1 || at);
        if (at) m = (size_t)snprintf(out, 1 << 17, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
        else memcpy(out, text, n);
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        f = fopen(path, "wb");
        ok = ok && f && fwrite(out, 1, m, f) == m;
        if (f) fclose(f);
        free(text); free(out);
    }
    return ok;
}

/* A layer loaded from deepseek_fp8, then from j->dir: the second load's
   status and message, and whether it changed the parameters or the bias */
typedef struct f8b {
    moept_thread_group *g; int r; const char *dir; moept_status st; int changed; char err[512];
} f8b;
static void *fp8_reload_main(void *arg) {
    f8b *j = arg;
    moept_comm *c;
    moept_layer *L = NULL;
    if (fp8_open(j->g, j->r, "tests/checkpoints/deepseek_fp8", &c, &L)) {
        j->st = MOEPT_ERR_STATE;
        snprintf(j->err, sizeof j->err, "set-up: %.400s", moept_last_error(L));
    } else {
        size_t np = (size_t)L->par.n_params, ne = (size_t)L->E;
        float *before = malloc((np + ne) * 4);
        memcpy(before, L->par.params, np * 4);
        memcpy(before + np, L->par.bias, ne * 4);
        j->st = moept_load_hf(L, j->dir, 1);
        snprintf(j->err, sizeof j->err, "%s", j->st ? moept_last_error(L) : "loaded");
        j->changed = memcmp(before, L->par.params, np * 4) != 0 ||
                     memcmp(before + np, L->par.bias, ne * 4) != 0;
        free(before);
    }
    moept_destroy(L);
    moept_comm_destroy(c);
    return NULL;
}

/* An FP8 checkpoint's scale that is not a positive normal finite fp32
   number (0, -0, negative, denormal, NaN, Inf: a block zeroed, negated or
   not finite) is refused with MOEPT_ERR_NUMERIC naming the scale tensor
   and the block, the parameters bitwise as they were; at EP = 4 the rank
   holding the expert refuses and every rank fails, none changed */
static void test_fp8_bad_scale_refused(void) {
    const char *dir = "build/ckpt_fp8_scale";
    const char *sname = "model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv";
    static const float bad[] = {0.0f, -0.0f, -0.5f, 1e-40f, NAN, INFINITY, -INFINITY};
    static const char *const shown[] = {"is 0:", "is -0:", "is -0.5:", "e-41:", "nan:", "is inf:",
                                        "is -inf:"};
    EXPECT(fp8_copy(dir, NULL, NULL), "copying deepseek_fp8 into %s", dir);
    moept_st_file *sf = NULL;
    EXPECT_OK(moept_st_open("build/ckpt_fp8_scale/model.safetensors", &sf));
    const moept_st_tensor *t = sf ? moept_st_find(sf, sname) : NULL;
    EXPECT(t && t->dtype == MOEPT_DTYPE_F32 && t->ndim == 2 && t->shape[1] == 2, "no F32 [.., 2] '%s'",
           sname);
    int64_t at = t ? t->offset + 4 : 0; /* block [0][1] */
    moept_st_close(sf);
    if (!t) return;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int fd = open("build/ckpt_fp8_scale/model.safetensors", O_WRONLY);
        EXPECT(fd >= 0 && pwrite(fd, &bad[i], 4, at) == 4, "writing the scale");
        if (fd >= 0) close(fd);
        f8b one = {0};
        one.dir = dir;
        fp8_reload_main(&one);
        EXPECT(one.st == MOEPT_ERR_NUMERIC && strstr(one.err, sname) && strstr(one.err, "block [0][1]") &&
               strstr(one.err, shown[i]) &&
               strstr(one.err, "a scale must be a positive normal finite number"),
               "scale %g: status %d, '%s'", (double)bad[i], (int)one.st, one.err);
        EXPECT(!one.changed, "scale %g: the refused load changed the layer", (double)bad[i]);
        if (bad[i] != -0.5f) continue;
        f8b js[4], proto = {0};
        proto.dir = dir;
        tu_ranks_from(4, 20000, fp8_reload_main, js, sizeof js[0], &proto);
        int named = 0;
        for (int r = 0; r < 4; r++) {
            EXPECT(js[r].st != MOEPT_OK && !strstr(js[r].err, "set-up"),
                   "EP=4 rank %d: status %d, '%s'", r, (int)js[r].st, js[r].err);
            EXPECT(!js[r].changed, "EP=4 rank %d: the refused load changed the layer", r);
            named += js[r].st == MOEPT_ERR_NUMERIC && strstr(js[r].err, sname) != NULL;
        }
        EXPECT(named == 1, "EP=4: %d ranks named the scale (the one holding expert 3 should)", named);
    }
}

/* quantization_config's fields moept does not implement are refused, the
   parameters unchanged: fmt but "e4m3", quant_method but "fp8",
   activation_scheme but "dynamic" (MOEPT_ERR_UNSUPPORTED); a field or the
   object of the wrong type (MOEPT_ERR_FORMAT). Absent fields are
   DeepSeek-V3's, keys moept does not read are ignored, weight_block_size
   is honoured (4 x 8 here) */
static void test_fp8_quant_config_refused(void) {
    static const struct { const char *from, *to; moept_status st; const char *needle; } cases[] = {
        {"\"fmt\": \"e4m3\"", "\"fmt\": \"e5m2\"", MOEPT_ERR_UNSUPPORTED,
         "quantization_config.fmt is \"e5m2\""},
        {"\"quant_method\": \"fp8\"", "\"quant_method\": \"fbgemm_fp8\"", MOEPT_ERR_UNSUPPORTED,
         "quantization_config.quant_method is \"fbgemm_fp8\""},
        {"\"activation_scheme\": \"dynamic\"", "\"activation_scheme\": \"static\"", MOEPT_ERR_UNSUPPORTED,
         "quantization_config.activation_scheme is \"static\""},
        {"\"fmt\": \"e4m3\"", "\"fmt\": 4", MOEPT_ERR_FORMAT, "quantization_config.fmt must be a string"},
        {"\"fmt\": \"e4m3\"", "\"fmt\": null", MOEPT_ERR_FORMAT, "quantization_config.fmt must be a string"},
        {"\"quantization_config\": {", "\"quantization_config\": \"fp8\", \"q\": {", MOEPT_ERR_FORMAT,
         "\"quantization_config\" must be an object"},
        {"\"activation_scheme\": \"dynamic\",\n    \"fmt\": \"e4m3\",\n    \"quant_method\": \"fp8\",\n    ",
         "",
         MOEPT_OK, NULL},
        {"\"fmt\": \"e4m3\"", "\"fmt\": \"e4m3\", \"modules_to_not_convert\": null", MOEPT_OK, NULL},
    };
    const char *dir = "build/ckpt_fp8_qconf";
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        EXPECT(fp8_copy(dir, cases[i].from, cases[i].to), "case %zu: no '%s' in the config", i,
               cases[i].from);
        f8b one = {0};
        one.dir = dir;
        fp8_reload_main(&one);
        EXPECT(one.st == cases[i].st && (!cases[i].needle || strstr(one.err, cases[i].needle)),
               "case %zu: status %d, '%s' (wanted %d, '%s')", i, (int)one.st, one.err, (int)cases[i].st,
               cases[i].needle ? cases[i].needle : "");
        EXPECT(!one.changed, "case %zu: the load changed the layer", i);
    }
}

/* group_fill is in a checkpoint's fingerprint, the default's print being
   the one from before the field (FNV-1a over the 18 fields before it);
   moept_config_from_hf sets the reference's -inf */
static void test_group_fill_checkpoints(void) {
    moept_config c = fam_cfg(MOEPT_FAMILY_DEEPSEEK_V3);
    moept_layer *L0, *Lz, *Lz2;
    EXPECT_OK(moept_create(&c, &L0));
    c.group_fill = MOEPT_GROUP_FILL_ZERO;
    EXPECT_OK(moept_create(&c, &Lz));
    EXPECT_OK(moept_create(&c, &Lz2));
    if (tu_bad) return;
    int64_t fp[MOEPT__NFP];
    moept__fingerprint(&L0->cfg, 1, 1, 1, 0, fp);
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < 18; i++)
        for (int b = 0; b < 8; b++) { h ^= (uint64_t)((fp[i] >> (8 * b)) & 0xff); h *= 1099511628211ull; }
    char before[24], now[24], zero[24];
    snprintf(before, sizeof before, "%016llx", (unsigned long long)h);
    moept__fp_hex(L0, now, sizeof now);
    moept__fp_hex(Lz, zero, sizeof zero);
    EXPECT(!strcmp(before, now), "the default group fill changed the fingerprint: %s, was %s", now, before);
    EXPECT(strcmp(zero, now) != 0, "the zero fill's fingerprint is the default's");
    moept_init_params(Lz, 3);
    EXPECT_OK(moept_save_checkpoint(Lz, "build/ckpt_gfill"));
    EXPECT(moept_load_checkpoint(L0, "build/ckpt_gfill") == MOEPT_ERR_INVALID_ARGUMENT,
           "a zero-fill checkpoint loaded into a -inf layer");
    EXPECT_OK(moept_load_checkpoint(Lz2, "build/ckpt_gfill"));
    moept_config hf = moept_config_default(MOEPT_FAMILY_MIXTRAL);
    hf.group_fill = MOEPT_GROUP_FILL_ZERO;
    EXPECT_OK(moept_config_from_hf("tests/checkpoints/deepseek_group", 1, &hf));
    EXPECT(hf.group_fill == MOEPT_GROUP_FILL_NEG_INF, "moept_config_from_hf left group_fill %d", (int)hf.group_fill);
    moept_destroy(L0); moept_destroy(Lz); moept_destroy(Lz2);
}

int main(void) {
    RUN(test_hf_round_trip_all_families);
    RUN(test_load_failure_leaves_layer_unchanged);
    RUN(test_per_rank_loading_reads_only_owned_bytes);
    RUN(test_malformed_rules);
    RUN(test_dtypes_convert);
    RUN(test_ckpt_payload_verified);
    RUN(test_ckpt_index_size_and_step);
    RUN(test_zero_element_tensors);
    RUN(test_concurrent_writers_of_one_path);
    RUN(test_crash_during_save_keeps_previous);
    RUN(test_adamw_matches_formula);
    RUN(test_resume_is_bitwise);
    RUN(test_checkpoint_across_ep_sizes);
    RUN(test_loads_are_collective);
    RUN(test_saves_are_collective);
    RUN(test_f32_to_half);
    RUN(test_hf_low_precision_round_trip);
    RUN(test_config_from_hf);
    RUN(test_config_json_strict);
    RUN(test_family_defaults);
    RUN(test_inference_layer_checkpoints);
    RUN(test_group_fill_checkpoints);
    RUN(test_fp8_checkpoint_dequantised);
    RUN(test_fp8_block_size_huge);
    RUN(test_fp8_bad_scale_refused);
    RUN(test_fp8_quant_config_refused);
    return tu_done();
}
