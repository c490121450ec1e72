/* bench_load: loading one MoE layer from a multi-shard Hugging Face
   checkpoint at EP=4 (threads), moept_load_hf (each rank reads its experts'
   and the router's byte ranges) against the gather-everything baseline
   (each rank reads every shard file whole, then keeps its slice), in one
   run. Reports bytes read per rank and time (the files are in the page
   cache after being written, so times are memory-speed reads; the bytes are
   what a network filesystem would carry).

   usage: bench_load [--hidden D] [--ffn F] [--experts E] [--shards S] [--ranks P] */
#include "../moept.c"

#include "bench_threads.h"

typedef struct load_cfg { int64_t D, F, E; int S, P; const char *dir; } load_cfg;
typedef struct load_res { double t_moept, t_all; int64_t b_moept, b_all; moept_status st; } load_res;

static moept_config layer_cfg(const load_cfg *k) {
    moept_config c = {0};
    c.family = MOEPT_FAMILY_MIXTRAL;
    c.hidden_size = k->D; c.intermediate_size = k->F; c.num_experts = k->E; c.top_k = 2; c.norm_topk_prob = 1;
    c.max_tokens = 1;
    return c;
}

/* writes the layer as S shards (experts split evenly, router in shard 0) + index */
static void write_checkpoint(const load_cfg *k) {
    moept_config c = layer_cfg(k);
    moept_layer *L;
    moept_create(&c, &L);
    moept_init_params(L, 1);
    mkdir(k->dir, 0755);
    char path[512], name[256];
    FILE *idx;
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", k->dir);
    idx = fopen(path, "w");
    fprintf(idx, "{\"metadata\": {}, \"weight_map\": {");
    int first = 1;
    for (int s = 0; s < k->S; s++) {
        moept_st_writer *w;
        moept_st_writer_create(&w);
        char file[64];
        snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, k->S);
        for (int64_t i = 0; i < L->par.n_table; i++) {
            const moept__param *p = &L->par.table[i];
            int shard = p->expert < 0 ? 0 : (int)(p->expert * k->S / k->E);
            if (shard != s) continue;
            snprintf(name, sizeof name, "model.layers.0.block_sparse_moe.%s", p->name);
            int64_t shape[2] = {p->rows, p->cols};
            moept_st_add(w, name, MOEPT_DTYPE_F32, 2, shape, p->data);
            fprintf(idx, "%s\"%s\": \"%s\"", first ? "" : ", ", name, file);
            first = 0;
        }
        snprintf(path, sizeof path, "%s/%s", k->dir, file);
        moept_st_write(w, path);
        moept_st_writer_destroy(w);
    }
    fprintf(idx, "}}\n");
    fclose(idx);
    moept_destroy(L);
}

static void load_rank(const void *kv, moept_comm *comm, void *outv) {
    const load_cfg *k = kv;
    load_res *out = outv;
    moept_config c = layer_cfg(k);
    moept_layer *L;
    if ((out->st = moept_create_parallel(&c, comm, NULL, &L))) return;
    double t0 = moept__now();
    out->st = moept_load_hf(L, k->dir, 0);
    out->t_moept = moept__now() - t0;
    moept_stats st;
    moept_get_stats(L, &st, NULL);
    out->b_moept = st.checkpoint_bytes_read;
    comm->barrier(comm);
    /* baseline: read every file whole, then slice this rank's experts out of
       the buffers (what a loader that concatenates all experts does) */
    t0 = moept__now();
    int64_t total = 0;
    for (int s = 0; s <= k->S; s++) {
        char path[512];
        if (s == k->S) snprintf(path, sizeof path, "%s/model.safetensors.index.json", k->dir);
        else snprintf(path, sizeof path, "%s/model-%05d-of-%05d.safetensors", k->dir, s + 1, k->S);
        int fd = open(path, O_RDONLY);
        struct stat sb;
        fstat(fd, &sb);
        char *buf = malloc((size_t)sb.st_size + 1);
        moept__pread_all(fd, buf, (int64_t)sb.st_size, 0);
        close(fd);
        total += (int64_t)sb.st_size;
        if (s < k->S) { /* keep the slices this rank owns */
            moept_st_file *f;
            moept_st_open(path, &f);
            for (int64_t i = 0; i < L->par.n_table; i++) {
                const moept__param *p = &L->par.table[i];
                char name[256];
                snprintf(name, sizeof name, "model.layers.0.block_sparse_moe.%s", p->name);
                const moept_st_tensor *t = moept_st_find(f, name);
                if (t) memcpy(p->data, buf + t->offset, (size_t)t->nbytes);
            }
            moept_st_close(f);
        }
        free(buf);
    }
    out->t_all = moept__now() - t0;
    out->b_all = total;
    moept_destroy(L);
    return;
}

int main(int argc, char **argv) {
    load_cfg k = {1024, 3584, 8, 4, 4, "build/bench_load_ckpt"};
    for (int i = 1; i + 1 < argc; i += 2) {
        long long v = atoll(argv[i + 1]);
        if (!strcmp(argv[i], "--hidden")) k.D = v;
        else if (!strcmp(argv[i], "--ffn")) k.F = v;
        else if (!strcmp(argv[i], "--experts")) k.E = v;
        else if (!strcmp(argv[i], "--shards")) k.S = (int)v;
        else if (!strcmp(argv[i], "--ranks")) k.P = (int)v;
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    write_checkpoint(&k);
    load_res out[BENCH_MAX_RANKS];
    if (!bench_run_threads(k.P, load_rank, &k, out, sizeof out[0])) return 2;
    printf("| rank | moept bytes read | moept time (ms) | read-everything bytes | read-everything time (ms) | bytes ratio | time ratio |\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (int r = 0; r < k.P; r++) {
        if (out[r].st) { printf("rank %d failed\n", r); return 1; }
        printf("| %d | %lld | %.1f | %lld | %.1f | %.3f | %.2fx |\n", r, (long long)out[r].b_moept, out[r].t_moept * 1e3,
               (long long)out[r].b_all, out[r].t_all * 1e3, (double)out[r].b_moept / (double)out[r].b_all,
               out[r].t_all / out[r].t_moept);
    }
    return 0;
}
