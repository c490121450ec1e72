/* test_alloc: every allocation of moept.c goes through MOEPT_MALLOC and
   MOEPT_FREE, and every block it allocates is freed.

   moept.c is compiled here with MOEPT_MALLOC/MOEPT_FREE defined to
   counting wrappers and, after the system headers, malloc, calloc,
   realloc, free, strdup and the libc calls that hand back malloc'd memory
   (getline, asprintf, open_memstream, ...) defined to undeclared names: a
   direct call in moept.c does not compile (-Werror=implicit-function-
   declaration). realpath stays allowed with a caller's buffer only (its
   NULL form allocates): the wrapper below fails the test if it is ever
   given NULL. At run time each cycle (one rank; EP 2 over threads with
   chunks, reshard and checkpoints; fsdp; the file readers and writer,
   their error paths included) must free as many blocks as it allocated, and
   MOEPT_FREE must only ever be given blocks MOEPT_MALLOC gave.

     build/test_alloc */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <dirent.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef MOEPT_CBLAS
#include <cblas.h>
#endif
#ifdef MOEPT_MPI
#include <mpi.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* its _mm_malloc calls posix_memalign: included before the poison */
#endif
#if defined(__aarch64__) || defined(__ARM_NEON)
#include <arm_neon.h>
#endif

/* the live blocks MOEPT_MALLOC gave, under a lock (ranks are threads) */
static pthread_mutex_t ta_mu = PTHREAD_MUTEX_INITIALIZER;
static void **ta_live;                  /* [ta_cap] */
static size_t *ta_size;                 /* [ta_cap] their sizes */
static size_t ta_n, ta_cap;
static long long ta_allocs, ta_frees, ta_foreign, ta_realpath_null;
static long long ta_bytes;              /* allocated through MOEPT_MALLOC, in all */
static long long ta_held;               /* the live blocks' bytes */

static void *ta_malloc(size_t n) {
    void *p = malloc(n);
    if (!p) return NULL;
    pthread_mutex_lock(&ta_mu);
    if (ta_n == ta_cap) {
        size_t cap = ta_cap ? 2 * ta_cap : 1024;
        void **v = realloc(ta_live, cap * sizeof *v);
        size_t *z = v ? realloc(ta_size, cap * sizeof *z) : NULL;
        if (!v || !z) abort();
        ta_live = v;
        ta_size = z;
        ta_cap = cap;
    }
    ta_size[ta_n] = n;
    ta_live[ta_n++] = p;
    ta_allocs++;
    ta_bytes += (long long)n;
    ta_held += (long long)n;
    pthread_mutex_unlock(&ta_mu);
    return p;
}

static void ta_free(void *p) {
    if (!p) return;
    pthread_mutex_lock(&ta_mu);
    size_t i = ta_n;
    while (i > 0 && ta_live[i - 1] != p) i--;
    if (i == 0) ta_foreign++; /* not from MOEPT_MALLOC: freed anyway, and counted */
    else {
        ta_held -= (long long)ta_size[i - 1];
        ta_n--;
        ta_live[i - 1] = ta_live[ta_n];
        ta_size[i - 1] = ta_size[ta_n];
        ta_frees++;
    }
    pthread_mutex_unlock(&ta_mu);
    free(p);
}

char *ta_realpath(const char *restrict path, char *restrict resolved);
char *realpath(const char *restrict path, char *restrict resolved);
char *ta_realpath(const char *restrict path, char *restrict resolved) {
    if (!resolved) { ta_realpath_null++; return NULL; } /* its malloc'd result would need free() */
    return realpath(path, resolved);
}

#define MOEPT_MALLOC(n) ta_malloc(n)
#define MOEPT_FREE(p) ta_free(p)
/* from here on a direct call is a call to an undeclared function */
#define malloc moept_direct_malloc_is_forbidden
#define calloc moept_direct_calloc_is_forbidden
#define realloc moept_direct_realloc_is_forbidden
#define reallocarray moept_direct_reallocarray_is_forbidden
#define free moept_direct_free_is_forbidden
#define strdup moept_direct_strdup_is_forbidden
#define strndup moept_direct_strndup_is_forbidden
#define aligned_alloc moept_direct_aligned_alloc_is_forbidden
#define posix_memalign moept_direct_posix_memalign_is_forbidden
#define getline moept_getline_needs_free_is_forbidden
#define getdelim moept_getdelim_needs_free_is_forbidden
#define asprintf moept_asprintf_needs_free_is_forbidden
#define vasprintf moept_vasprintf_needs_free_is_forbidden
#define open_memstream moept_open_memstream_needs_free_is_forbidden
#define scandir moept_scandir_needs_free_is_forbidden
#define realpath(p, r) ta_realpath(p, r)

#include "../moept.c" /* one translation unit, as the other tests */
#undef malloc /* (moept.c's calls were the poison's target; the tests' helpers may allocate) */
#undef free
#include "testutil.h"

enum { T = 12 };

/* blocks allocated and not freed since `mark` (and anything freed that was not allocated) */
typedef struct ta_mark { long long allocs, frees; } ta_mark;
static ta_mark ta_now(void) {
    pthread_mutex_lock(&ta_mu);
    ta_mark m = {ta_allocs, ta_frees};
    pthread_mutex_unlock(&ta_mu);
    return m;
}
static void ta_expect_balanced(ta_mark m, const char *what) {
    ta_mark e = ta_now();
    EXPECT(e.allocs > m.allocs, "%s: no allocation went through MOEPT_MALLOC", what);
    EXPECT(e.allocs - m.allocs == e.frees - m.frees, "%s: %lld blocks allocated, %lld freed", what,
           e.allocs - m.allocs, e.frees - m.frees);
    EXPECT(ta_foreign == 0, "%s: MOEPT_FREE was given %lld blocks MOEPT_MALLOC did not give", what,
           ta_foreign);
    EXPECT(ta_realpath_null == 0, "%s: realpath called to allocate", what);
}

static moept_config ta_cfg(void) {
    moept_config c = moept_config_default(MOEPT_FAMILY_DEEPSEEK_V3); /* routed, shared and a bias */
    c.hidden_size = 16; c.intermediate_size = 8; c.num_experts = 4; c.top_k = 2;
    c.n_group = 2; c.topk_group = 1; c.shared_intermediate_size = 8; c.max_tokens = T;
    c.max_inflight = 2; /* a second forward slot, and an evaluation's, allocate and free too */
    return c;
}

/* an evaluation, a forward, a forward into slot 1, both backwards, gradient
   calls, a step, a checkpoint saved and loaded back (and one that fails to
   load), an HF save, through an index, and load */
static moept_status ta_train(moept_layer *L, const char *dir, int rank) {
    float x[T * 16], y[T * 16], dy[T * 16], dx[T * 16];
    unsigned long long seed = 7u + (unsigned)rank;
    tu_fill(x, T * 16, 1.0, &seed);
    tu_fill(dy, T * 16, 1.0, &seed);
    moept_adamw o = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f};
    double norm;
    char path[300];
    moept_status st;
    moept_forward_opts f1 = {NULL, 0, NULL, NULL, 1}, ev = {NULL, 1, NULL, NULL, 0};
    moept_backward_opts b1 = moept_backward_default();
    b1.slot = 1;
    if ((st = moept_init_params(L, 1)) || (st = moept_forward_ex(L, x, T, y, &ev)) ||
        (st = moept_forward(L, x, T, y)) || (st = moept_forward_ex(L, x, T, y, &f1)) ||
        (st = moept_backward_ex(L, x, dy, dx, &b1)) ||
        (st = moept_backward(L, x, dy, dx)) || (st = moept_sync_grads(L, 1.0f)) ||
        (st = moept_grad_norm(L, &norm)) || (st = moept_update_bias(L, 1e-3f)) ||
        (st = moept_adamw_step(L, &o)) || (st = moept_save_checkpoint(L, dir)) ||
        (st = moept_load_checkpoint(L, dir)))
        return st;
    snprintf(path, sizeof path, "%s/nowhere", dir);
    if (moept_load_checkpoint(L, path) == MOEPT_OK) return MOEPT_ERR_STATE; /* the failure path frees too */
    return moept_forward(L, x, T, y);
}

static void test_one_rank(void) {
    ta_mark m = ta_now();
    moept_config c = ta_cfg();
    moept_layer *L = NULL;
    EXPECT_OK(moept_create(&c, &L));
    if (!L) return;
    mkdir("build/alloc_files", 0755);
    EXPECT(ta_train(L, "build/alloc_files/one", 0) == MOEPT_OK, "train: %s", moept_last_error(L));
    /* an HF file, its bf16 form, and an index naming the file for every tensor */
    mkdir("build/alloc_files/hf", 0755);
    EXPECT_OK(moept_save_hf(L, "build/alloc_files/hf/model.safetensors", 0, 1));
    EXPECT_OK(moept_save_hf_as(L, "build/alloc_files/bf16.safetensors", 0, 1, MOEPT_DTYPE_BF16));
    EXPECT_OK(moept_load_hf(L, "build/alloc_files/hf", 0));
    moept_st_file *f = NULL;
    EXPECT_OK(moept_st_open("build/alloc_files/hf/model.safetensors", &f));
    FILE *ix = fopen("build/alloc_files/hf/model.safetensors.index.json", "w");
    if (f && ix) {
        fputs("{\"metadata\": {\"total_size\": 0}, \"weight_map\": {", ix);
        for (int64_t i = 0; i < moept_st_count(f); i++)
            fprintf(ix, "%s\"%s\": \"model.safetensors\"", i ? ", " : "", moept_st_at(f, i)->name);
        fputs("}}", ix);
    }
    if (ix) fclose(ix);
    moept_st_close(f);
    EXPECT_OK(moept_load_hf(L, "build/alloc_files/hf", 0));
    EXPECT(moept_load_hf(L, "build/alloc_files/hf", 5) != MOEPT_OK, "layer 5 of a one-layer file loaded");
    moept_destroy(L);
    ta_expect_balanced(m, "one rank");
}

/* the readers on their own: a real checkpoint's config and shards, a
   malformed file, the writer */
static void test_files(void) {
    ta_mark m = ta_now();
    mkdir("build/alloc_files", 0755);
    moept_config c = moept_config_default(MOEPT_FAMILY_MIXTRAL);
    EXPECT_OK(moept_config_from_hf("tests/checkpoints/mixtral_e8_t40", 1, &c));
    c.max_tokens = T;
    moept_layer *L = NULL;
    EXPECT_OK(moept_create(&c, &L));
    EXPECT_OK(moept_load_hf(L, "tests/checkpoints/mixtral_e8_t40", 1));
    moept_destroy(L);
    int64_t blk[2];
    EXPECT_OK(moept__hf_fp8_block("tests/checkpoints/deepseek_fp8", blk));
    moept_st_writer *w = NULL;
    float v[6] = {1, 2, 3, 4, 5, 6};
    int64_t shape[2] = {2, 3};
    EXPECT_OK(moept_st_writer_create(&w));
    EXPECT_OK(moept_st_add(w, "t", MOEPT_DTYPE_F32, 2, shape, v));
    EXPECT_OK(moept_st_add_meta(w, "k", "v"));
    EXPECT(moept_st_add(w, "t", MOEPT_DTYPE_F32, 2, shape, v) != MOEPT_OK, "a duplicate name added");
    EXPECT_OK(moept_st_write(w, "build/alloc_files/w.safetensors"));
    moept_st_writer_destroy(w);
    moept_st_file *f = NULL;
    EXPECT_OK(moept_st_open("build/alloc_files/w.safetensors", &f));
    float r[6];
    if (f) EXPECT_OK(moept_st_read_f32(f, moept_st_find(f, "t"), r, 6));
    moept_st_close(f);
    FILE *bad = fopen("build/alloc_files/bad.safetensors", "wb");
    if (bad) { fwrite("\x0b\0\0\0\0\0\0\0{\"t\":{\"x\"}}", 1, 19, bad); fclose(bad); }
    EXPECT(moept_st_open("build/alloc_files/bad.safetensors", &f) == MOEPT_ERR_FORMAT, "a bad header opened");
    ta_expect_balanced(m, "files");
}

/* moept_stats' bytes by kind against what the layer holds: host, the live blocks MOEPT_MALLOC gave
   since `held0` (and the device executor's own host blocks, which it allocates itself); device, the
   emulated GPU's live allocations since `dev0` (-1: no device); and the older fields' relations */
static long long ta_sum(const int64_t *b) {
    long long s = 0;
    for (int k = 0; k < MOEPT_MEM_NKINDS; k++) s += b[k];
    return s;
}
static void ta_expect_held(moept_layer *L, long long held0, long long dev0, long long dev_now,
                           const char *what) {
    moept_stats st;
    memset(&st, 0, sizeof st);
    EXPECT_OK(moept_get_stats(L, &st, NULL));
    pthread_mutex_lock(&ta_mu);
    const long long held = ta_held - held0;
    pthread_mutex_unlock(&ta_mu);
    const long long h = ta_sum(st.host_bytes) - L->dev.host, d = ta_sum(st.device_bytes);
    EXPECT(h == held, "%s: host_bytes sum to %lld (less the executor's own %lld), the layer holds %lld", what,
           h, (long long)L->dev.host, held);
    EXPECT(dev0 < 0 ? d == 0 : d == dev_now - dev0, "%s: device_bytes sum to %lld, the device holds %lld",
           what, d, dev0 < 0 ? 0 : dev_now - dev0);
    const int64_t *db = st.device_bytes;
    EXPECT(st.param_bytes == st.host_bytes[MOEPT_MEM_PARAMS] + st.host_bytes[MOEPT_MEM_GRADS] &&
           st.device_workspace_bytes == d - db[MOEPT_MEM_PARAMS] - db[MOEPT_MEM_GRADS],
           "%s: param_bytes %lld, device_workspace_bytes %lld against the kinds", what,
           (long long)st.param_bytes, (long long)st.device_workspace_bytes);
    for (int k = 0; k < MOEPT_MEM_NKINDS; k++)
        EXPECT(st.host_bytes[k] >= 0 && st.device_bytes[k] >= 0, "%s: kind %d negative", what, k);
}

/* Every byte a CPU layer holds is in exactly one kind: the sums equal the live blocks after create,
   an evaluation (its own slot), forwards into both slots, their backwards, an AdamW step (the
   moments), a padded forward (its buffers) and a checkpoint loaded into a fresh layer (its moments),
   in plain, grad_backup, fp8 and inference layers */
static void test_held_by_kind(void) {
    mkdir("build/alloc_files", 0755);
    for (int v = 0; v < 4; v++) {
        moept_config c = ta_cfg();
        c.grad_backup = v == 1;
        c.fp8 = v == 2 ? MOEPT_FP8_BLOCKWISE : MOEPT_FP8_OFF;
        c.inference_only = v == 3;
        char what[64];
        snprintf(what, sizeof what, "%s", (const char *[]){"plain", "grad_backup", "fp8", "inference"}[v]);
        pthread_mutex_lock(&ta_mu);
        const long long h0 = ta_held;
        pthread_mutex_unlock(&ta_mu);
        moept_layer *L = NULL;
        EXPECT_OK(moept_create(&c, &L));
        if (!L) return;
        ta_expect_held(L, h0, -1, 0, what);
        float x[T * 16], y[T * 16], dx[T * 16];
        uint8_t mask[T];
        unsigned long long seed = 11;
        tu_fill(x, T * 16, 1.0, &seed);
        for (int t = 0; t < T; t++) mask[t] = t % 3 != 0;
        moept_forward_opts ev = {NULL, 1, NULL, NULL, 0}, f1 = {NULL, 0, NULL, NULL, 1};
        moept_forward_opts fm = {mask, 0, NULL, NULL, 0};
        moept_backward_opts b1 = moept_backward_default();
        b1.slot = 1;
        const moept_adamw o = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f};
        EXPECT_OK(moept_init_params(L, 2));
        EXPECT_OK(moept_forward_ex(L, x, T, y, &ev));
        if (!c.inference_only) {
            EXPECT_OK(moept_forward(L, x, T, y));
            EXPECT_OK(moept_forward_ex(L, x, T, y, &f1));
            ta_expect_held(L, h0, -1, 0, what);
            EXPECT_OK(moept_backward(L, x, x, dx));
            EXPECT_OK(moept_backward_ex(L, x, x, dx, &b1));
            EXPECT_OK(moept_adamw_step(L, &o));
            EXPECT_OK(moept_save_checkpoint(L, "build/alloc_files/held"));
        }
        EXPECT_OK(moept_forward_ex(L, x, T, y, &fm));
        ta_expect_held(L, h0, -1, 0, what);
        moept_destroy(L);
        if (c.inference_only) continue;
        EXPECT_OK(moept_create(&c, &L)); /* the moments from a checkpoint, before any step */
        if (!L) return;
        EXPECT_OK(moept_load_checkpoint(L, "build/alloc_files/held"));
        ta_expect_held(L, h0, -1, 0, what);
        moept_destroy(L);
    }
}

typedef struct ta_job {
    moept_thread_group *g; int r;
    moept_sharding sh;
    moept_status st;
    char why[512];
} ta_job;

static int ta_direct; /* EP 2 unchunked: the experts' rows in shared memory, a block per slot */

static void *ta_rank(void *arg) {
    ta_job *j = arg;
    moept_comm *comm = NULL;
    moept_layer *L = NULL;
    moept_config c = ta_cfg();
    c.expert_sharding = j->sh;
    if (j->sh == MOEPT_SHARD_EP && !ta_direct) c.overlap_chunks = 2;
    j->st = moept_comm_threads(j->g, j->r, &comm);
    if (!j->st) j->st = moept_create_parallel(&c, comm, NULL, &L);
    if (!j->st && j->sh == MOEPT_SHARD_EP) {
        int32_t swap[4] = {1, 0, 1, 0}; /* experts 0, 2 to rank 1; 1, 3 to rank 0 */
        moept_reshard_report rep;
        j->st = ta_train(L, "build/alloc_files/ep", j->r);
        if (!j->st) j->st = moept_reshard(L, swap, &rep);
    } else if (!j->st) {
        float x[T * 16], y[T * 16], dy[T * 16], dx[T * 16];
        unsigned long long seed = 3;
        tu_fill(x, T * 16, 1.0, &seed);
        tu_fill(dy, T * 16, 1.0, &seed);
        if (!(j->st = moept_init_params(L, 1)) && !(j->st = moept_forward(L, x, T, y)))
            j->st = moept_backward(L, x, dy, dx);
    }
    if (j->st) snprintf(j->why, sizeof j->why, "%s", moept_last_error(L));
    moept_destroy(L);
    moept_comm_destroy(comm);
    return NULL;
}

static void ta_two_ranks(moept_sharding sh, const char *what) {
    ta_mark m = ta_now();
    ta_job jobs[2], proto = {.sh = sh};
    tu_ranks_from(2, 20000, ta_rank, jobs, sizeof jobs[0], &proto);
    for (int r = 0; r < 2; r++) EXPECT(jobs[r].st == MOEPT_OK, "%s rank %d: %s", what, r, jobs[r].why);
    ta_expect_balanced(m, what);
}

static void test_ep_threads(void) { ta_two_ranks(MOEPT_SHARD_EP, "EP 2, chunked, reshard, checkpoints"); }
static void test_fsdp_threads(void) { ta_two_ranks(MOEPT_SHARD_FSDP, "fsdp 2"); }
static void test_ep_direct_threads(void) {
    ta_direct = 1;
    ta_two_ranks(MOEPT_SHARD_EP, "EP 2, shared-memory rows, reshard, checkpoints");
    ta_direct = 0;
}

#ifdef MOEPT_CUDA
#include <cuda_runtime.h>
#include "emu/emu.h"
/* Host bytes allocated (through MOEPT_MALLOC: moept.c's; moept_kernels.cu's host state is a fixed struct)
   and device bytes held by a CUDA layer with experts F wide, over its create, init_params, a forward,
   a backward, an AdamW step and a parameter read, and its destroy balanced */
static void ta_cuda_layer(int64_t F, long long *host, long long *dev, int64_t *numel) {
    moept_config c = ta_cfg();
    c.intermediate_size = F;
    c.shared_intermediate_size = F;
    float x[T * 16], w[16 * 4];
    for (int i = 0; i < T * 16; i++) x[i] = (float)(i % 7) * 0.1f - 0.3f;
    void *xd = NULL, *yd = NULL, *dxd = NULL;
    cudaMalloc(&xd, sizeof x); cudaMalloc(&yd, sizeof x); cudaMalloc(&dxd, sizeof x);
    cudaMemcpy(xd, x, sizeof x, cudaMemcpyHostToDevice);
    const long long d0 = moept_emu_device_bytes(0), b0 = ta_bytes, h0 = ta_held;
    ta_mark m = ta_now();
    moept_layer *L = NULL;
    const moept_adamw o = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f};
    moept_status st = moept_create_cuda(&c, NULL, NULL, NULL, &L);
    if (!st) st = moept_init_params(L, 1);
    if (!st) st = moept_forward(L, xd, T, yd);
    if (!st) st = moept_backward(L, xd, xd, dxd);
    if (!st) st = moept_adamw_step(L, &o);
    if (!st) st = moept_get_param(L, "gate.weight", w, 4 * 16);
    EXPECT(!st, "F %lld: %s", (long long)F, moept_last_error(L));
    if (L) ta_expect_held(L, h0, d0, moept_emu_device_bytes(0), "a CUDA layer");
    *host = ta_bytes - b0;
    *dev = moept_emu_device_bytes(0) - d0;
    *numel = moept_param_numel(L);
    moept_destroy(L);
    ta_expect_balanced(m, "a CUDA layer");
    cudaFree(xd); cudaFree(yd); cudaFree(dxd);
}

/* A CUDA layer keeps no host copy of its parameters, gradients or moments: at 1 and 1024 times the
   expert width (params x ~1000 on the device) the host allocates the same bytes */
static void test_cuda_host_bytes(void) {
    long long h[2], d[2];
    int64_t n[2];
    ta_cuda_layer(8, &h[0], &d[0], &n[0]);
    ta_cuda_layer(8192, &h[1], &d[1], &n[1]);
    printf("# CUDA layer, F 8 and 8192: %lld and %lld parameters; host %lld and %lld bytes, device %lld and "
           "%lld\n", (long long)n[0], (long long)n[1], h[0], h[1], d[0], d[1]);
    EXPECT(d[1] - d[0] >= 12 * (n[1] - n[0]), "the device bytes grew by %lld, not the parameters, gradients "
           "and moments' (%lld more parameters)", d[1] - d[0], (long long)(n[1] - n[0]));
    EXPECT(h[0] == h[1] && h[1] < n[1], "the host allocated %lld bytes at F 8, %lld at F 8192 (%lld "
           "parameters)", h[0], h[1], (long long)n[1]);
}

/* Every byte a CUDA layer holds is in exactly one kind, on both sides: after create, forwards into
   each slot, a padded one (its unpadded rows), the backwards, an AdamW step (the moments), in fp32,
   bf16 with two slots, bf16 with fp8 and bf16 inference layers */
static void test_cuda_held_by_kind(void) {
    for (int v = 0; v < 4; v++) {
        moept_config c = ta_cfg();
        c.fp8 = v == 2 ? MOEPT_FP8_BLOCKWISE : MOEPT_FP8_OFF;
        c.inference_only = v == 3;
        c.max_inflight = v == 1 ? 2 : 1;
        const moept_cuda_options opt = {v ? MOEPT_DTYPE_BF16 : MOEPT_DTYPE_F32, NULL, 0, 0, MOEPT_GEMM_AUTO};
        const char *what =
            (const char *[]){"cuda fp32", "cuda bf16, 2 slots", "cuda bf16 fp8", "cuda bf16 inference"}[v];
        uint16_t x[T * 16];
        uint8_t mask[T];
        for (int i = 0; i < T * 16; i++) x[i] = v ? 0x3e00 + (uint16_t)(i % 7) : 0;
        float xf[T * 16];
        for (int i = 0; i < T * 16; i++) xf[i] = (float)(i % 7) * 0.1f - 0.3f;
        for (int t = 0; t < T; t++) mask[t] = t % 3 != 0;
        void *xd = NULL, *yd = NULL, *dxd = NULL, *md = NULL;
        cudaMalloc(&xd, sizeof xf); cudaMalloc(&yd, sizeof xf); cudaMalloc(&dxd, sizeof xf);
        cudaMalloc(&md, T);
        cudaMemcpy(xd, v ? (const void *)x : (const void *)xf, v ? sizeof x : sizeof xf,
                   cudaMemcpyHostToDevice);
        cudaMemcpy(md, mask, T, cudaMemcpyHostToDevice);
        const long long d0 = moept_emu_device_bytes(0), h0 = ta_held;
        moept_layer *L = NULL;
        EXPECT_OK(moept_create_cuda(&c, NULL, NULL, &opt, &L));
        if (!L) return;
        ta_expect_held(L, h0, d0, moept_emu_device_bytes(0), what);
        moept_forward_opts f1 = {NULL, 0, NULL, NULL, 1}, fm = {md, 0, NULL, NULL, 0};
        moept_backward_opts b1 = moept_backward_default();
        b1.slot = 1;
        const moept_adamw o = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f};
        EXPECT_OK(moept_init_params(L, 2));
        if (c.max_inflight > 1) EXPECT_OK(moept_forward_ex(L, xd, T, yd, &f1));
        EXPECT_OK(moept_forward_ex(L, xd, T, yd, &fm));
        if (!c.inference_only) {
            EXPECT_OK(moept_backward(L, xd, xd, dxd));
            if (c.max_inflight > 1) EXPECT_OK(moept_backward_ex(L, xd, xd, dxd, &b1));
            EXPECT_OK(moept_adamw_step(L, &o));
        }
        ta_expect_held(L, h0, d0, moept_emu_device_bytes(0), what);
        moept_destroy(L);
        cudaFree(xd); cudaFree(yd); cudaFree(dxd); cudaFree(md);
    }
}
#endif

int main(void) {
#ifdef MOEPT_CUDA
    RUN(test_cuda_host_bytes);
    RUN(test_cuda_held_by_kind);
    printf("# %lld blocks through MOEPT_MALLOC, %lld freed through MOEPT_FREE\n", ta_allocs, ta_frees);
    return tu_done();
#endif
    RUN(test_one_rank);
    RUN(test_held_by_kind);
    RUN(test_files);
    RUN(test_ep_threads);
    RUN(test_fsdp_threads);
    RUN(test_ep_direct_threads);
    printf("# %lld blocks through MOEPT_MALLOC, %lld freed through MOEPT_FREE\n", ta_allocs, ta_frees);
    return tu_done();
}
