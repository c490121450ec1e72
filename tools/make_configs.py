#!/usr/bin/env python3
"""Writes config.json files with transformers' own config classes
(to_json_file, as save_pretrained writes them; no torch needed) for
moept_config_from_hf's dense-layer rules and the families no checkpoint in
tests/checkpoints covers. tests/test_ckpt.c reads them.

    python3 tools/make_configs.py --out tests/configs
"""
import argparse
import os

from transformers import DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

SMALL = dict(vocab_size=32, hidden_size=64, num_attention_heads=2, num_key_value_heads=1)

CONFIGS = {
    # layers 0..5: MoE where (l + 1) % 2 == 0 and l not in [3]: 1, 5
    "qwen2_sparse": Qwen2MoeConfig(num_hidden_layers=6, moe_intermediate_size=48, num_experts=8,
                                   num_experts_per_tok=2, shared_expert_intermediate_size=80,
                                   decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True,
                                   router_aux_loss_coef=0.02, **SMALL),
    # the Qwen3 block: no shared expert; transformers' default norm_topk_prob (False)
    "qwen3_moe": Qwen3MoeConfig(num_hidden_layers=2, moe_intermediate_size=40, num_experts=16,
                                num_experts_per_tok=4, head_dim=32, **SMALL),
    # layers 0, 1 dense (first_k_dense_replace 2), 2.. MoE; 2 shared experts
    "deepseek_dense2": DeepseekV3Config(num_hidden_layers=4, first_k_dense_replace=2, moe_intermediate_size=24,
                                        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                        n_shared_experts=2, routed_scaling_factor=1.5, norm_topk_prob=False,
                                        intermediate_size=96, kv_lora_rank=16, q_lora_rank=None,
                                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **SMALL),
    "mixtral_gelu": MixtralConfig(num_hidden_layers=1, intermediate_size=56, num_local_experts=4,
                                  num_experts_per_tok=2, hidden_act="gelu", router_jitter_noise=0.05, **SMALL),
    "olmoe_default": OlmoeConfig(num_hidden_layers=1, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                 **SMALL),
}

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/configs")
    a = ap.parse_args()
    for name, cfg in CONFIGS.items():
        os.makedirs(os.path.join(a.out, name), exist_ok=True)
        cfg.to_json_file(os.path.join(a.out, name, "config.json"))
        print(name, cfg.model_type)

if __name__ == "__main__":
    main()
