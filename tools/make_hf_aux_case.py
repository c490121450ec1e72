#!/usr/bin/env python3
"""Writes the cross-layer aux case (docs/CASES.md, "HF's cross-layer aux
loss"): two transformers MixtralSparseMoeBlocks in float64, each with its
own input, and the objective

    sum_l sum(y_l * dy_l) + coef * load_balancing_loss_func((logits_0, logits_1))

(transformers' function over both layers' router logits concatenated, as
MixtralForCausalLM adds it), differentiated by autograd. Stored as float32
in tests/cases_hf_aux/ (not tests/cases: no moept_check case; read by
tests/test_router_io.c, which computes that loss's gradient itself).

    python3 tools/make_hf_aux_case.py --out tests/cases_hf_aux
"""
import argparse
import os
import sys

import torch
from safetensors.torch import save_file
import transformers
from transformers.models.mixtral import modeling_mixtral

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_cases import Float64Routers, build, flatten_params, margin_ok

LAYERS, T, D, F, E, K, COEF = 2, 24, 16, 12, 8, 2, 0.05


def draw_layer(seed):
    """one block and its input, redrawn until no near tie in the routing"""
    for attempt in range(1000):
        g = torch.Generator().manual_seed(seed * 1000 + attempt)
        block = build("mixtral", D, F, E, K, 1, 0, 1, 1, 1.0).double()
        with torch.no_grad():
            for pname, p in block.named_parameters():
                std = (1.5 if pname.startswith("gate") else 0.7) / p.shape[-1] ** 0.5
                p.copy_((torch.randn(p.shape, generator=g, dtype=torch.float64) * std).float().double())
        x = torch.randn(1, T, D, generator=g, dtype=torch.float64).float().double()
        gy = torch.randn(1, T, D, generator=g, dtype=torch.float64).float().double()
        if margin_ok(block, "mixtral", x.view(T, D), K, E, 1, 1, 1e-3, None):
            return block, x, gy
    raise RuntimeError("no draw without near ties")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/cases_hf_aux")
    args = ap.parse_args()
    layers = [draw_layer(100 + l) for l in range(LAYERS)]
    logits, ys = [], []
    for block, x, gy in layers:
        x.requires_grad_(True)
        cap = {}
        block.gate.register_forward_hook(lambda _m, _i, out, cap=cap: cap.update(logits=out[0]))
        with Float64Routers():
            ys.append(block(x))
        assert cap["logits"].dtype == torch.float64
        logits.append(cap["logits"])
    aux = modeling_mixtral.load_balancing_loss_func(tuple(logits), E, K)
    obj = sum((y * gy).sum() for y, (_, _, gy) in zip(ys, layers)) + COEF * aux
    obj.backward()
    tensors = {"expected.aux_loss": aux.detach().reshape(1)}
    for l, ((block, x, gy), y, lg) in enumerate(zip(layers, ys, logits)):
        p = f"layer{l}."
        tensors[p + "input"] = x.detach().view(T, D)
        tensors[p + "grad_output"] = gy.view(T, D)
        tensors.update({p + k: v for k, v in flatten_params(block, "mixtral", E, F).items()})
        tensors[p + "expected.output"] = y.detach().view(T, D)
        tensors[p + "expected.router_logits"] = lg.detach().view(T, E)
        tensors[p + "expected.grad.input"] = x.grad.view(T, D)
        for k, v in flatten_params(block, "mixtral", E, F, grads=True).items():
            tensors[p + "expected.grad." + k] = v
    tensors = {k: v.detach().float().contiguous() for k, v in tensors.items()}
    meta = {"format": "moept-hf-aux-v1",
            "generator": f"tools/make_hf_aux_case.py torch {torch.__version__} "
                         f"transformers {transformers.__version__}",
            "family": "mixtral", "layers": str(LAYERS), "tokens": str(T), "hidden_size": str(D),
            "intermediate_size": str(F), "num_experts": str(E), "top_k": str(K),
            "aux_loss_coef": repr(COEF)}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "mixtral_2layers.safetensors")
    save_file(tensors, path, metadata=meta)
    print(path, f"aux {aux.item():.6f}")


if __name__ == "__main__":
    main()
