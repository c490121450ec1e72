/* libFuzzer target: the safetensors parser, the checkpoint indexes
   (model.safetensors.index.json, moept's training index.json) and
   config.json (moept_config_from_hf, for layers 0..3).

   The first input byte picks the parser; the rest is the file. Every input
   must give MOEPT_OK or an error status, never a crash, a leak or UB.
   Built by `make fuzz` with clang -fsanitize=fuzzer,address,undefined. */
#include "../../moept.c"

static char g_dir[64];

static void put(const char *name, const uint8_t *d, size_t n) {
    char path[128];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return;
    if (n) fwrite(d, 1, n, f);
    fclose(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_dir[0]) {
        snprintf(g_dir, sizeof g_dir, "/tmp/moept_fuzz_%ld", (long)getpid());
        mkdir(g_dir, 0700);
    }
    if (size < 1) return 0;
    int which = data[0] % 4, layer = data[0] / 4 % 4;
    data++; size--;
    char path[128];
    if (which == 0) { /* a safetensors file: parse, then read every tensor */
        put("model.safetensors", data, size);
        snprintf(path, sizeof path, "%s/model.safetensors", g_dir);
        moept_st_file *f;
        if (moept_st_open(path, &f) == MOEPT_OK) {
            for (int64_t i = 0; i < moept_st_count(f); i++) {
                const moept_st_tensor *t = moept_st_at(f, i);
                if (t->numel > (1 << 16)) continue;
                float fb[1 << 8];
                int64_t ib[1 << 8];
                if (t->numel <= 256) {
                    moept_st_read_f32(f, t, fb, t->numel);
                    moept_st_read_i64(f, t, ib, t->numel);
                }
            }
            moept_st_meta(f, "format");
            moept_st_close(f);
        }
    } else if (which == 1) { /* a shard index */
        put("model.safetensors.index.json", data, size);
        moept__hf_src s;
        int64_t bytes = 0;
        moept__hf_open(g_dir, &s, &bytes);
        moept__hf_src_free(&s);
    } else if (which == 2) { /* a training checkpoint index */
        put("index.json", data, size);
        int64_t ep, step;
        char fp[32], set[64], cfg[512]; /* the config's fields too: the whole index is parsed */
        moept__read_ckpt_index(g_dir, &ep, fp, sizeof fp, &step, set, sizeof set, cfg, sizeof cfg);
    } else { /* a model's config.json */
        put("config.json", data, size);
        moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL);
        moept_config_from_hf(g_dir, layer, &c);
    }
    return 0;
}
