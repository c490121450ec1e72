/* hf_resave: loads layer L's MoE block from a Hugging Face checkpoint with
   moept_load_hf and writes it back with moept_save_hf, for
   tools/check_hf_save.py (which has transformers load the result).
   usage: hf_resave FAMILY D F E K S N_GROUP TOPK_GROUP DIR LAYER OUT */
#include "../moept.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    if (argc != 12) { fprintf(stderr, "usage: hf_resave FAMILY D F E K S N_GROUP TOPK_GROUP DIR LAYER OUT\n"); return 2; }
    static const char *fams[] = {"mixtral", "qwen2_moe", "olmoe", "deepseek_v3"};
    moept_config c = {0};
    int f = 0;
    while (f < 4 && strcmp(argv[1], fams[f]) != 0) f++;
    if (f == 4) { fprintf(stderr, "hf_resave: unknown family %s\n", argv[1]); return 2; }
    c.family = (moept_family)f;
    c.hidden_size = atoll(argv[2]); c.intermediate_size = atoll(argv[3]); c.num_experts = atoll(argv[4]);
    c.top_k = atoll(argv[5]); c.shared_intermediate_size = atoll(argv[6]); c.n_group = atoll(argv[7]);
    c.topk_group = atoll(argv[8]); c.max_tokens = 1; c.norm_topk_prob = 1;
    moept_layer *L;
    if (moept_create(&c, &L) || moept_load_hf(L, argv[9], atoll(argv[10])) ||
        moept_save_hf(L, argv[11], atoll(argv[10]), 1)) {
        fprintf(stderr, "hf_resave: %s\n", moept_last_error(L));
        return 1;
    }
    moept_destroy(L);
    return 0;
}
