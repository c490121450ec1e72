/* libFuzzer target: config.json, read by moept's strict JSON reader
   (moept__json_check) and then by moept_config_from_hf (layers 0..3) and
   the FP8 block reader (quantization_config: weight_block_size read, fmt,
   quant_method and activation_scheme checked).

   The input is the file. Every input must give MOEPT_OK or an error status
   with a message, never a crash, a leak or UB; and what
   moept_config_from_hf accepts, moept_create's checks (moept__resolve)
   must accept too: its sizes and groups are the file's keys, checked and
   named where the file is read. Built by `make fuzz-config` with clang
   -fsanitize=fuzzer,address,undefined; corpus tests/fuzz/corpus_config,
   dictionary tests/fuzz/config.dict. */
#include "../../moept.c"

static char g_dir[64];

static void cleanup(void) {
    char path[128];
    snprintf(path, sizeof path, "%s/config.json", g_dir);
    remove(path);
    rmdir(g_dir);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* a file per input: in memory where there is a tmpfs (/tmp on a busy disk ran 30x slower) */
    if (!g_dir[0]) {
        snprintf(g_dir, sizeof g_dir, "/dev/shm/moept_fuzz_config_%ld", (long)getpid());
        if (mkdir(g_dir, 0700) != 0) {
            snprintf(g_dir, sizeof g_dir, "/tmp/moept_fuzz_config_%ld", (long)getpid());
            mkdir(g_dir, 0700);
        }
        atexit(cleanup);
    }
    /* the checker on its own, in memory (any size, no file) */
    moept__thread_err[0] = 0;
    moept_status cst = moept__json_check((const char *)data, (int64_t)size, "mem");
    if (cst != MOEPT_OK && !moept__thread_err[0]) abort();
    char path[128];
    snprintf(path, sizeof path, "%s/config.json", g_dir);
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    if (size) fwrite(data, 1, size, f);
    fclose(f);
    for (int64_t layer = 0; layer < 4; layer++) {
        moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL), r;
        c.max_tokens = 64;
        moept__thread_err[0] = 0;
        moept_status st = moept_config_from_hf(g_dir, layer, &c);
        if (st != MOEPT_OK && !moept__thread_err[0]) abort(); /* a failure says why */
        if (st == MOEPT_OK && moept__resolve(&c, &r) != MOEPT_OK) {
            fprintf(stderr, "layer %lld accepted, moept_create refuses: %s\n", (long long)layer,
                    moept__thread_err);
            abort();
        }
    }
    int64_t blk[2] = {0, 0};
    if (moept__hf_fp8_block(g_dir, blk) == MOEPT_OK && (blk[0] < 1 || blk[1] < 1)) abort();
    return 0;
}
