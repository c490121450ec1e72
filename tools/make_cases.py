#!/usr/bin/env python3
"""Writes moept-case-v1 reference cases (see docs/CASES.md) from
Hugging Face transformers' own MoE blocks.

Each block is built with transformers' class, run in float64 (including the
router, whose float32 casts are kept at float64: see Float64Routers), and
differentiated by autograd. Everything is stored as float32. A case whose routing has a near
tie (a selection margin below --margin) is redrawn with the next seed, so
the fp32 implementation under test routes exactly as the reference did.

    pip install -r tools/requirements.txt
    python3 tools/make_cases.py --out tests/cases
"""
import argparse
import inspect
import os
import textwrap
import types

import torch
from safetensors.torch import save_file
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock, Qwen2MoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock, OlmoeConfig
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3Config

# name, family, T, D, F, E, K, norm, shared S, n_group, topk_group, scaling, aux coef, z coef
CASES = [
    ("mixtral_basic",          "mixtral",     7, 13, 11, 5, 2, 1, 0, 1, 1, 1.0, 0.02, 0.001),
    ("mixtral_k1",             "mixtral",     9, 10, 6, 4, 1, 1, 0, 1, 1, 1.0, 0.01, 0.0),
    ("mixtral_t1",             "mixtral",     1, 12, 9, 6, 2, 1, 0, 1, 1, 1.0, 0.01, 0.01),
    ("mixtral_empty_experts",  "mixtral",     3, 9, 7, 16, 2, 1, 0, 1, 1, 1.0, 0.05, 0.0),
    ("mixtral_e8_t40",         "mixtral",     40, 24, 20, 8, 2, 1, 0, 1, 1, 1.0, 0.01, 0.001),
    ("qwen2_shared_nonorm",    "qwen2_moe",   11, 14, 10, 6, 2, 0, 9, 1, 1, 1.0, 0.01, 0.001),
    ("qwen2_shared_norm_e8",   "qwen2_moe",   16, 15, 7, 8, 4, 1, 13, 1, 1, 1.0, 0.02, 0.0),
    ("olmoe_nonorm",           "olmoe",       13, 11, 9, 8, 3, 0, 0, 1, 1, 1.0, 0.01, 0.002),
    ("olmoe_k_eq_e",           "olmoe",       6, 10, 5, 4, 4, 0, 0, 1, 1, 1.0, 0.01, 0.001),
    ("olmoe_k_eq_e_norm",      "olmoe",       5, 9, 6, 3, 3, 1, 0, 1, 1, 1.0, 0.0, 0.001),
    ("deepseek_group",         "deepseek_v3", 12, 16, 6, 8, 2, 1, 6, 4, 2, 2.5, 0.01, 0.001),
    ("deepseek_group_k3",      "deepseek_v3", 10, 13, 5, 12, 3, 1, 10, 3, 1, 1.5, 0.0, 0.002),
    ("deepseek_nogroup_nonorm","deepseek_v3", 9, 11, 7, 6, 2, 0, 7, 1, 1, 1.0, 0.02, 0.0),
    ("deepseek_t1",            "deepseek_v3", 1, 10, 5, 8, 2, 1, 5, 2, 1, 2.0, 0.01, 0.001),
]
# Padding (attention_mask 0 at these tokens): T splits 3/3/3/3 at --ep 4, so
# mixtral_mask has a rank whose tokens are all padding
MASKED = [
    (("mixtral_mask",          "mixtral",     12, 12, 9, 8, 2, 1, 0, 1, 1, 1.0, 0.02, 0.001), [3, 4, 5, 11]),
    (("qwen2_shared_mask",     "qwen2_moe",   12, 14, 10, 8, 2, 0, 9, 1, 1, 1.0, 0.01, 0.001), [0, 7, 10, 11]),
    (("deepseek_group_mask",   "deepseek_v3", 12, 16, 6, 8, 2, 1, 6, 4, 2, 2.5, 0.01, 0.001), [0, 1, 2, 8]),
]

# The sequence-wise aux loss (aux_loss "seq"): sequences of S tokens; T splits
# into whole sequences at --ep 1/2/4/8; deepseek's sequence 0 is all padding
SEQ = [
    (("mixtral_seq",           "mixtral",     24, 12, 9, 8, 2, 1, 0, 1, 1, 1.0, 0.05, 0.001), [], 3),
    (("deepseek_seq_mask",     "deepseek_v3", 24, 16, 6, 8, 2, 1, 6, 4, 2, 2.5, 0.05, 0.001),
     [0, 1, 2, 7, 13, 14], 3),
]

# The group fill (metadata group_fill): the value the excluded groups' experts
# take before the top-k. Negative biased scores (a negative correction bias)
# make the two choose differently; these have 2 excluded experts and K >= 2,
# so where 0 wins it takes both (no tie between the zeros)
GROUP_FILL = [
    (("deepseek_fill_neg_inf", "deepseek_v3", 12, 16, 6, 8, 4, 1, 6, 4, 3, 2.5, 0.01, 0.001), "-inf"),
    (("deepseek_fill_zero",    "deepseek_v3", 12, 14, 5, 12, 3, 0, 10, 6, 5, 1.5, 0.01, 0.002), "0"),
]
# Widths of multiples of 8 (D, F and the shared expert's S): the rows a GPU's TMA loads (16-byte row
# strides), so the grouped kernel form runs every expert GEMM of these
WIDE = [
    ("qwen2_shared_wide8",     "qwen2_moe",   48, 32, 24, 4, 2, 1, 16, 1, 1, 1.0, 0.01, 0.001),
    ("deepseek_wide8",         "deepseek_v3", 40, 32, 16, 8, 2, 1, 16, 4, 2, 2.5, 0.01, 0.001),
]
# F a multiple of 128, as in every released model: each 1 x 128 FP8 tile of h's and dh's gate and up
# halves is whole, so the FP8 grouped kernel's down dgrad quantizes dh in its epilogue
FULL_TILES = [
    ("mixtral_f128",           "mixtral",     32, 64, 128, 4, 2, 1, 0, 1, 1, 1.0, 0.01, 0.001),
]
FILL_LINE = 'masked_fill(~score_mask.bool(), float("-inf"))'


def zero_fill(gate):
    """Gives this router instance transformers' own forward with the excluded
    groups filled with 0.0 instead of -inf: transformers <= 5.5's line (and
    DeepSeek-V3's first modeling_deepseek.py). transformers >= 5.6, as
    DeepSeek's reference inference code (inference/model.py), fills -inf."""
    src = textwrap.dedent(inspect.getsource(type(gate).forward))
    assert src.count(FILL_LINE) == 1, "transformers' DeepseekV3 router changed: update zero_fill"
    ns = {}
    exec(compile(src.replace(FILL_LINE, FILL_LINE.replace('float("-inf")', "0.0")), "<zero_fill>", "exec"),
         vars(modeling_deepseek_v3), ns)
    gate.forward = types.MethodType(ns["forward"], gate)


def seq_aux_loss(family, logits, ids, mask, E, K, S):
    """DeepSeek-V3's complementary sequence-wise balance loss in float64, in
    the form of Megatron-Core's sequence_load_balancing_loss_func (cost
    coefficient count / (S K / E) times the sequence's mean score, summed over
    experts, averaged over sequences), on the router's own scores (softmax;
    sigmoid normalised over experts for deepseek) and its selection. Padding
    (our extension) leaves a sequence's padded tokens out of its counts, means
    and length, and an all-padding sequence out of the average."""
    T = logits.shape[0]
    if family == "deepseek_v3":
        sg = logits.sigmoid()
        scores = sg / (sg.sum(-1, keepdim=True) + 1e-20)
    else:
        scores = logits.softmax(-1)
    m = mask.double().view(T, 1)
    routing = torch.zeros(T, E, dtype=torch.float64).scatter_(1, ids.view(T, K).long(), 1.0) * m
    B = T // S
    count = routing.view(B, S, E).sum(1)
    ssum = (scores * m).view(B, S, E).sum(1)
    n = m.view(B, S).sum(1)
    keep = n > 0
    cost = count[keep] / (n[keep].view(-1, 1) * K / E)
    return (cost * ssum[keep] / n[keep].view(-1, 1)).sum(-1).mean()


def build(family, D, F, E, K, norm, S, n_group, topk_group, scaling, fill="-inf"):
    if family == "mixtral":
        cfg = MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                            num_experts_per_tok=K, hidden_act="silu", router_jitter_noise=0.0)
        return MixtralSparseMoeBlock(cfg)
    if family == "qwen2_moe":
        cfg = Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                             num_experts_per_tok=K, norm_topk_prob=bool(norm),
                             shared_expert_intermediate_size=S, hidden_act="silu")
        return Qwen2MoeSparseMoeBlock(cfg)
    if family == "olmoe":
        cfg = OlmoeConfig(hidden_size=D, intermediate_size=F, num_experts=E,
                          num_experts_per_tok=K, norm_topk_prob=bool(norm), hidden_act="silu")
        return OlmoeSparseMoeBlock(cfg)
    assert S % F == 0, "deepseek shared width is a multiple of F"
    cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=E,
                           num_experts_per_tok=K, n_group=n_group, topk_group=topk_group,
                           norm_topk_prob=bool(norm), routed_scaling_factor=scaling,
                           n_shared_experts=S // F, hidden_act="silu")
    block = DeepseekV3MoE(cfg)
    assert FILL_LINE in inspect.getsource(type(block.gate).forward), "transformers' router does not fill -inf"
    if fill == "0":
        zero_fill(block.gate)
    return block


class Float64Routers:
    """Keeps HF's router code in float64: inside this context the float32
    casts the routers make (`.float()`, `.type(torch.float32)`,
    `softmax(..., dtype=torch.float)`) leave float64 tensors as they are, so
    the reference is float64 throughout (an fp32 router leaves ~1e-5 of
    rounding noise in the router gradient, e.g. when K = 1 renormalises to
    exactly 1). The HF code itself runs unchanged."""

    def __enter__(self):
        self.saved = (torch.Tensor.float, torch.Tensor.type, torch.nn.functional.softmax)
        f, ty, sm = self.saved
        torch.Tensor.float = lambda t, *a, **k: t if t.dtype == torch.float64 else f(t, *a, **k)
        torch.Tensor.type = lambda t, *a, **k: (t if t.dtype == torch.float64 and a and a[0] is torch.float32
                                                else ty(t, *a, **k))

        def softmax(t, *a, dtype=None, **k):
            return sm(t, *a, dtype=None if t.dtype == torch.float64 else dtype, **k)
        torch.nn.functional.softmax = softmax
        return self

    def __exit__(self, *exc):
        torch.Tensor.float, torch.Tensor.type, torch.nn.functional.softmax = self.saved


def group_choice(c, n_group, topk_group, fill):
    """The scores the top K is taken of: c with the excluded groups' experts
    at fill (the rule of the router above)."""
    gs = c.shape[-1] // n_group
    gscore = c.view(-1, n_group, gs).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(gscore).scatter_(1, gscore.topk(topk_group, dim=-1).indices, 1)
    return c.masked_fill(~keep.repeat_interleave(gs, dim=1).bool(), float(fill)), gscore


def margin_ok(block, family, x, K, E, n_group, topk_group, margin, fill=None):
    """True if every selection in the routing is decided by more than margin;
    for a group-fill case also that the other fill routes at least a third
    of the tokens differently (so a checker with the wrong fill fails)."""
    with torch.no_grad():
        logits = torch.nn.functional.linear(x.float(), block.gate.weight.float()).double()

        def gap(score, k):  # distance between the k-th and (k+1)-th largest
            if k >= score.shape[-1]:
                return torch.full(score.shape[:-1], float("inf"), dtype=score.dtype)
            v = score.sort(dim=-1, descending=True).values
            return v[..., k - 1] - v[..., k]

        soft = logits.softmax(-1)
        gaps = [gap(soft, K)]  # softmax top-k (also the HF aux-loss counts)
        if family == "deepseek_v3":
            s = logits.sigmoid()
            c = s + block.gate.e_score_correction_bias.double()
            gs = E // n_group
            gaps.append(gap(c.view(-1, n_group, gs), 2).reshape(-1))
            cm, gscore = group_choice(c, n_group, topk_group, fill or "-inf")
            if n_group > 1:
                gaps.append(gap(gscore, topk_group))
            gaps.append(gap(cm, K))
            if fill:
                other = group_choice(c, n_group, topk_group, "0" if fill == "-inf" else "-inf")[0]
                ids = [m.topk(K, dim=-1).indices.sort(dim=-1).values for m in (cm, other)]
                if 3 * int((ids[0] != ids[1]).any(-1).sum()) < x.shape[0]:
                    return False
        return all(bool((g > margin).all()) for g in gaps)


def per_expert_names(family, E):
    if family == "mixtral":
        return [(f"experts.{e}.w1.weight", f"experts.{e}.w3.weight", f"experts.{e}.w2.weight") for e in range(E)]
    return [(f"experts.{e}.gate_proj.weight", f"experts.{e}.up_proj.weight", f"experts.{e}.down_proj.weight")
            for e in range(E)]


def flatten_params(block, family, E, F, grads=False):
    """HF module params -> per-expert checkpoint names (fused experts split)."""
    out = {}
    get = (lambda p: p.grad) if grads else (lambda p: p.data)
    for name, p in block.named_parameters():
        if name == "experts.gate_up_proj":
            gu = get(p)
            for e, (g, u, _) in enumerate(per_expert_names(family, E)):
                out[g] = gu[e, :F]
                out[u] = gu[e, F:]
        elif name == "experts.down_proj":
            dn = get(p)
            for e, (_, _, d) in enumerate(per_expert_names(family, E)):
                out[d] = dn[e]
        else:
            out[name] = get(p)
    if not grads and family == "deepseek_v3":
        out["gate.e_score_correction_bias"] = block.gate.e_score_correction_bias
    return out


def make_case(spec, seed, margin, pad=(), seq=0, fill=None):
    """pad: tokens whose attention_mask is 0. Their output rows are zeroed
    (the block's output times the mask), they are left out of the aux loss
    (transformers' attention_mask) and of the z loss's mean, so nothing
    differentiates through them; their expected ids are -1, weights 0.
    seq: the sequence length of the sequence-wise aux loss (0: HF's).
    fill: a group-fill case's fill ("-inf", "0"); its correction bias is
    drawn in [-1.3, -0.8), so most biased scores are negative and the two
    fills route apart."""
    (name, family, T, D, F, E, K, norm, S, n_group, topk_group, scaling, aux_coef, z_coef) = spec
    for attempt in range(1000):
        g = torch.Generator().manual_seed(seed * 1000 + attempt)
        block = build(family, D, F, E, K, norm, S, n_group, topk_group, scaling, fill or "-inf").double()
        with torch.no_grad():
            for pname, p in block.named_parameters():
                fan_in = p.shape[-1]
                std = 1.5 / fan_in ** 0.5 if pname.startswith("gate") else 0.7 / fan_in ** 0.5
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
            if family == "deepseek_v3":
                u = torch.rand(E, generator=g, dtype=torch.float64)
                block.gate.e_score_correction_bias.copy_(u * 0.5 - 1.3 if fill else u * 0.1)
            # store float32, compute on exactly those values
            for p in block.parameters():
                p.copy_(p.float().double())
            for b in block.buffers():
                b.copy_(b.float().double())
        x = torch.randn(1, T, D, generator=g, dtype=torch.float64).float().double()
        gy = torch.randn(1, T, D, generator=g, dtype=torch.float64).float().double()
        if margin_ok(block, family, x.view(T, D), K, E, n_group, topk_group, margin, fill):
            break
    else:
        raise RuntimeError(f"{name}: no draw without near ties")
    x.requires_grad_(True)
    captured = {}

    def hook(_mod, _inp, out):
        captured["logits"], captured["weights"], captured["ids"] = out

    block.gate.register_forward_hook(hook)
    mask = torch.ones(T, dtype=torch.int64)
    mask[list(pad)] = 0
    with Float64Routers():
        y = block(x) * mask.view(1, T, 1).double()
    logits = captured["logits"]
    assert logits.dtype == torch.float64 and captured["weights"].dtype == torch.float64
    if seq:
        aux = seq_aux_loss(family, logits.view(T, E), captured["ids"], mask, E, K, seq)
    else:
        aux = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func(
            (logits,), E, K, attention_mask=mask.view(1, T) if pad else None)
    lse2 = torch.logsumexp(logits.double(), dim=-1) ** 2
    z = (lse2 * mask.double()).sum() / mask.sum() if pad else lse2.mean()
    obj = (y * gy).sum() + aux_coef * aux + z_coef * z
    obj.backward()

    tensors = {"input": x.detach().view(T, D), "grad_output": gy.view(T, D)}
    tensors.update(flatten_params(block, family, E, F))
    tensors["expected.output"] = y.detach().view(T, D)
    tensors["expected.router_logits"] = logits.detach().view(T, E)
    keep = mask.view(T, 1).bool()
    tensors["expected.topk_ids"] = captured["ids"].detach().view(T, K).to(torch.int64).masked_fill(~keep, -1)
    tensors["expected.topk_weights"] = captured["weights"].detach().view(T, K).masked_fill(~keep, 0.0)
    if pad:
        tensors["attention_mask"] = mask
    tensors["expected.aux_loss"] = aux.detach().reshape(1)
    tensors["expected.z_loss"] = z.detach().reshape(1)
    tensors["expected.grad.input"] = x.grad.view(T, D)
    for k, v in flatten_params(block, family, E, F, grads=True).items():
        tensors["expected.grad." + k] = v if v is not None else torch.zeros_like(dict(block.named_parameters())[k])
    tensors = {k: v.detach().to(torch.int64 if v.dtype == torch.int64 else torch.float32).contiguous()
               for k, v in tensors.items()}
    meta = {
        "format": "moept-case-v1", "family": family, "tokens": str(T), "hidden_size": str(D),
        "intermediate_size": str(F), "num_experts": str(E), "top_k": str(K),
        "norm_topk_prob": str(norm), "hidden_act": "silu", "shared_intermediate_size": str(S),
        "n_group": str(n_group), "topk_group": str(topk_group),
        "routed_scaling_factor": repr(float(scaling)), "aux_loss": "seq" if seq else "hf",
        "aux_loss_coef": repr(float(aux_coef)), "z_loss_coef": repr(float(z_coef)),
        **({"aux_seq_len": str(seq)} if seq else {}),
        **({"group_fill": fill} if fill else {}),
        "generator": f"tools/make_cases.py torch {torch.__version__} transformers {transformers.__version__}",
    }
    return tensors, meta


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/cases")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--margin", type=float, default=2e-4)
    ap.add_argument("--only", default=None, help="comma-separated case names")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    every = ([(c, (), 0, None) for c in CASES] + [m + (0, None) for m in MASKED] + [q + (None,) for q in SEQ]
             + [(c, (), 0, fill) for c, fill in GROUP_FILL]
             + [(c, (), 0, None) for c in WIDE + FULL_TILES])  # new cases last: the others keep their seeds
    for i, (spec, pad, seq, fill) in enumerate(every):
        if args.only and spec[0] not in args.only.split(","):
            continue
        tensors, meta = make_case(spec, args.seed + i, args.margin, pad, seq, fill)
        path = os.path.join(args.out, spec[0] + ".safetensors")
        save_file(tensors, path, metadata=meta)
        ids = tensors["expected.topk_ids"]
        used = ids[ids >= 0].unique().numel()
        print(f"{path}: T={meta['tokens']} E={meta['num_experts']} K={meta['top_k']} experts used {used}")


if __name__ == "__main__":
    main()
