#!/usr/bin/env python3
"""Writes tests/checkpoints/deepseek_fp8: tests/checkpoints/deepseek_group
(written by transformers) in the layout of DeepSeek-V3's published FP8
weights: every 2-D weight of the attention and MLP projections (routed and
shared experts included; the router and norms stay F32) as an F8_E4M3
tensor plus a F32 `<name>_scale_inv` of per-block scales, and config.json's
`quantization_config` (quant_method fp8, fmt e4m3, weight_block_size).
The block here is [4, 8], not DeepSeek's [128, 128], so this model's small
weights span several blocks and end in partial ones.

dequant.safetensors holds decoder layer 1's MoE parameters dequantised in
float64 (fp8 value times its block's scale) and stored as F32: what
moept_load_hf must produce.

    python3 tools/make_fp8_checkpoint.py
"""
import argparse
import json
import os

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize(w, block):
    """w [R, C] -> (fp8 [R, C], scale_inv [ceil(R/br), ceil(C/bc)]): each
    block's amax maps to FP8_MAX."""
    br, bc = block
    R, C = w.shape
    sr, sc = -(-R // br), -(-C // bc)
    scale = torch.empty(sr, sc, dtype=torch.float32)
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].double()
            s = float(blk.abs().max()) / FP8_MAX or 1.0
            scale[i, j] = s
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (blk / float(scale[i, j])).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q, scale, block):
    br, bc = block
    full = scale.double().repeat_interleave(br, 0)[:q.shape[0]].repeat_interleave(bc, 1)[:, :q.shape[1]]
    return (q.double() * full).float()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default="tests/checkpoints/deepseek_group")
    ap.add_argument("--out", default="tests/checkpoints/deepseek_fp8")
    ap.add_argument("--block", default="4,8")
    args = ap.parse_args()
    block = [int(v) for v in args.block.split(",")]
    os.makedirs(args.out, exist_ok=True)
    src = load_file(os.path.join(args.src, "model.safetensors"))
    out, ref = {}, {}
    for name, w in src.items():
        proj = name.endswith("_proj.weight") or name.endswith("proj_with_mqa.weight")
        if w.ndim == 2 and proj and ".layers." in name:
            q, s = quantize(w, block)
            out[name], out[name + "_scale_inv"] = q, s
            if name.startswith("model.layers.1.mlp."):
                ref[name[len("model.layers.1.mlp."):]] = dequantize(q, s, block)
        else:
            out[name] = w
            if name.startswith("model.layers.1.mlp."):
                ref[name[len("model.layers.1.mlp."):]] = w
    save_file(out, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, os.path.join(args.out, "dequant.safetensors"),
              metadata={"generator": f"tools/make_fp8_checkpoint.py torch {torch.__version__}"})
    with open(os.path.join(args.src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": block}
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"{args.out}: {sum(1 for k in out if k.endswith('_scale_inv'))} FP8 tensors, block {block}")


if __name__ == "__main__":
    main()
