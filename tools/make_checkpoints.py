#!/usr/bin/env python3
"""Writes small Hugging Face checkpoints with transformers' own
save_pretrained, one per family, whose decoder layer 1 MoE block holds the
parameters of a reference case (tests/cases). Then

    build/moept_check --weights tests/checkpoints/NAME --layer 1 tests/cases/NAME.safetensors

takes every parameter from the checkpoint and must match the case. The
models are tiny (vocab 32, 2 layers); one is sharded (index.json + 3 files)
so the multi-shard path is exercised.

    python3 tools/make_checkpoints.py --out tests/checkpoints
"""
import argparse
import os

import torch
from safetensors.torch import load_file
import transformers
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          OlmoeConfig, OlmoeForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM)

CASES = {
    "mixtral_e8_t40": "mixtral",
    "qwen2_shared_norm_e8": "qwen2_moe",
    "olmoe_nonorm": "olmoe",
    "deepseek_group": "deepseek_v3",
}


def model_for(family, meta):
    D, F, E, K = (int(meta[k]) for k in ("hidden_size", "intermediate_size", "num_experts", "top_k"))
    S, norm = int(meta["shared_intermediate_size"]), bool(int(meta["norm_topk_prob"]))
    common = dict(vocab_size=32, hidden_size=D, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if family == "mixtral":
        return MixtralForCausalLM(MixtralConfig(intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, **common))
    if family == "qwen2_moe":
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=F, moe_intermediate_size=F, num_experts=E,
                                                  num_experts_per_tok=K, norm_topk_prob=norm,
                                                  shared_expert_intermediate_size=S, decoder_sparse_step=1, **common))
    if family == "olmoe":
        return OlmoeForCausalLM(OlmoeConfig(intermediate_size=F, num_experts=E, num_experts_per_tok=K,
                                            norm_topk_prob=norm, **common))
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        intermediate_size=2 * F, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K,
        n_group=int(meta["n_group"]), topk_group=int(meta["topk_group"]), norm_topk_prob=norm,
        routed_scaling_factor=float(meta["routed_scaling_factor"]), n_shared_experts=S // F,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=4, **common))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/checkpoints")
    ap.add_argument("--cases", default="tests/cases")
    a = ap.parse_args()
    torch.manual_seed(0)
    for name, family in CASES.items():
        path = os.path.join(a.cases, name + ".safetensors")
        case = load_file(path)
        from safetensors import safe_open
        with safe_open(path, "pt") as f:
            meta = f.metadata()
        model = model_for(family, meta).float()
        prefix = "model.layers.1." + ("block_sparse_moe." if family == "mixtral" else "mlp.")
        # the case's per-expert tensors under the checkpoint names
        sd = {}
        for k, v in case.items():
            if k in ("input", "grad_output") or k.startswith("expected."):
                continue
            sd[prefix + k] = v
        out = os.path.join(a.out, name)
        os.makedirs(out, exist_ok=True)
        shard = "20KB" if family == "mixtral" else "2GB"
        model.save_pretrained(out, safe_serialization=True, max_shard_size=shard)
        # put the case's MoE block into the saved files, keeping everything else
        # exactly as save_pretrained wrote it (names, shards, index)
        import json
        from safetensors.torch import save_file
        idx = os.path.join(out, "model.safetensors.index.json")
        files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
        seen = set()
        for fn in files:
            p = os.path.join(out, fn)
            with safe_open(p, "pt") as f:
                fmeta = f.metadata()
            t = load_file(p)
            for k in list(t):
                if k in sd:
                    assert t[k].shape == sd[k].shape, (k, t[k].shape, sd[k].shape)
                    t[k] = sd[k].to(t[k].dtype).contiguous()
                    seen.add(k)
            save_file(t, p, metadata=fmeta)
        missing = set(sd) - seen
        assert not missing, f"{name}: save_pretrained wrote no {sorted(missing)[:3]}"
        # transformers loads it back and its layer 1 block holds the case's weights
        back = type(model).from_pretrained(out)
        layer = back.model.layers[1]
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        assert torch.equal(block.gate.weight.detach(), case["gate.weight"]), "router differs after reload"
        E, F = int(meta["num_experts"]), int(meta["intermediate_size"])
        gname = "w1" if family == "mixtral" else "gate_proj"
        for e in range(E):
            gu = block.experts.gate_up_proj[e].detach()
            assert torch.equal(gu[:F], case[f"experts.{e}.{gname}.weight"]), f"expert {e} differs after reload"
        print(f"{out}: {len(files)} file(s), layer 1 MoE block = {name}; transformers "
              f"{transformers.__version__} reloads it with the case's router and experts")


if __name__ == "__main__":
    main()
