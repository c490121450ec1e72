#!/usr/bin/env python3
"""test_torch: moept_torch.MoeptMoE against transformers' own MoE blocks (tiny shapes, a few seconds).

    python3 tests/test_torch.py [--device cpu|cuda] [--dtype fp32|bf16] [--lib PATH]

  - a transformers Mixtral (with right padding: moept's padding mask against HF's attention_mask) and a
    Qwen2-MoE (shared expert, sigmoid gate) swapped through swap_moe_blocks train beside the originals
    (torch's AdamW, HF's loss + HF's aux over every layer): per-step loss and step-1 gradients within
    1e-5 (fp32; bf16 on CUDA under autocast: 2^-5 of the loss, 2^-3 of the largest gradient);
  - state_dict: HF's keys, HF's values bitwise; a layer built from the config alone and loaded from it
    gives the same outputs bitwise; the HF block loaded from it gives moept's outputs (1e-5); 5.x's fused
    experts (gate_up_proj, down_proj) built from the same weights give the per-expert layer's outputs bitwise;
  - recomputation: two training forwards (max_inflight 2), backwards in reverse, equal each forward
    followed by its backward, bitwise; a slot overwritten before its backward is refused;
  - what crosses to C: a wrong dtype or device, a bad mask: a clear error; a non-contiguous input: copied,
    the same result; .to()/.half()/.double() leave the parameters moept's, a move off the device raises.
Prints "ok - " / "FAIL - " lines; exits 1 on a failure.
"""
import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import moept_torch as mt  # noqa: E402

failed = 0


def ok(cond, msg):
    global failed
    failed += not cond
    print(("ok - " if cond else "FAIL - ") + msg, flush=True)


def same(a, u, v):
    """u equals v: bitwise with CPU layers; on the GPU within 1e-5 (fp32) or 2^-6 (bf16) of max |v|, since
    cuBLAS may pick another kernel for another row count"""
    if a.device == "cpu":
        return torch.equal(u, v)
    tol = 1e-5 if a.dtype == "fp32" else 2 ** -6
    return float((u.float() - v.float()).abs().max()) <= tol * max(float(v.float().abs().max()), 1e-30)


def raises(fn, exc, words):
    """fn() raises exc whose message holds every one of words"""
    try:
        fn()
    except exc as e:
        return all(w in str(e) for w in words)
    return False


def tiny(family, seed=0):
    """a 2-layer transformers model of the family, fp32, tiny"""
    import transformers as tf
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=16,
                  router_aux_loss_coef=0.02, output_router_logits=True, tie_word_embeddings=False,
                  initializer_range=0.1)
    torch.manual_seed(seed)
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=64, num_local_experts=4, **common))
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        intermediate_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=48, num_experts=4,
        norm_topk_prob=False, decoder_sparse_step=1, **common))


def autocast(a):
    """bf16: torch's autocast on the GPU (HF's matmuls in bf16 over fp32 weights, as moept's layer)"""
    import contextlib
    return torch.autocast("cuda", torch.bfloat16) if a.dtype == "bf16" else contextlib.nullcontext()


def moe_block(layer):
    return getattr(layer, "block_sparse_moe", None) or layer.mlp


def train_side_by_side(a, family, steps, pad):
    """per-step loss difference and step-1 relative gradient error (MoE blocks, the rest)"""
    dev = torch.device(a.device)
    hf = tiny(family).to(dev)
    model = copy.deepcopy(hf)
    blocks = mt.swap_moe_blocks(model, device=dev, dtype=a.torch_dtype, max_tokens=64, lib=a.lib)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, foreach=False) for m in (model, hf)]
    gen = torch.Generator().manual_seed(1)
    worst, gerr = 0.0, None
    for step in range(steps):
        ids = torch.randint(0, 64, (4, 16), generator=gen).to(dev)
        mask = torch.ones_like(ids)
        if pad:  # right padding: rows 1 and 3 end early
            mask[1, 11:], mask[3, 5:] = 0, 0
        labels = ids.masked_fill(mask == 0, -100)
        mt.set_padding_mask(blocks, mask if pad else None)
        losses = []
        for m, opt in zip((model, hf), opts):
            opt.zero_grad()
            with autocast(a):
                if m is hf:
                    loss = m(input_ids=ids, attention_mask=mask, labels=labels,
                             output_router_logits=True).loss
                else:
                    loss = m(input_ids=ids, attention_mask=mask, labels=labels,
                             output_router_logits=False).loss + mt.hf_aux_loss(blocks, m.config, mask)
            loss.backward()
            losses.append(float(loss.detach()))
        worst = max(worst, abs(losses[0] - losses[1]) / (abs(losses[1]) if a.dtype == "bf16" else 1))
        if step == 0:
            gerr = grad_error(hf, model, blocks)
        for opt in opts:
            opt.step()
    return worst, gerr


def grad_error(hf, model, blocks):
    """max |g - g_hf| / max |g_hf| over the MoE blocks' parameters (by HF name), and over the rest"""
    def rel(pairs):
        return max(float((g - h).abs().max()) for g, h in pairs) / max(float(h.abs().max()) for _, h in pairs)
    moe = []
    for hl, ml in zip(hf.model.layers, model.model.layers):
        b = moe_block(ml)
        if isinstance(b, mt.MoeptMoE):
            hb = moe_block(hl)
            moe += [(p.grad, hb.get_parameter(n).grad) for n, p in b.named_parameters()]
    named = dict(model.named_parameters())
    rest = [(named[n].grad, p.grad) for n, p in hf.named_parameters()  # every MoE block is swapped
            if ".mlp." not in n and ".block_sparse_moe." not in n]
    return rel(moe), rel(rest)


def test_train(a):
    tol_loss, tol_grad = (1e-5, 1e-5) if a.dtype == "fp32" else (2 ** -5, 2 ** -3)
    for family, pad in (("mixtral", True), ("qwen2_moe", False)):
        worst, (gm, gr) = train_side_by_side(a, family, a.steps, pad)
        ok(worst <= tol_loss, f"{family}{' (padded)' if pad else ''}: {a.steps} steps beside transformers, "
           f"per-step loss within {tol_loss:g} (largest {worst:.2e})")
        ok(max(gm, gr) <= tol_grad, f"{family}: step-1 gradients within {tol_grad:g} of transformers' "
           f"(MoE blocks {gm:.2e}, the rest {gr:.2e})")


def test_deepseek(a):
    """a DeepSeek-V3 (group-limited sigmoid routing, its correction bias, a shared expert, a dense first
    layer) swapped: one step's loss and MoE gradients against transformers', the block's keys"""
    import transformers as tf
    if not hasattr(tf, "DeepseekV3ForCausalLM"):
        print(f"skip - deepseek_v3: transformers {tf.__version__} has none")
        return
    torch.manual_seed(0)
    c = tf.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, max_position_embeddings=16,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        tie_word_embeddings=False, initializer_range=0.1, routed_scaling_factor=2.5)
    hf = tf.DeepseekV3ForCausalLM(c).float()
    with torch.no_grad():  # a bias that moves the routing (HF starts it at zero)
        hf.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    hf = hf.to(a.device)
    model = copy.deepcopy(hf)
    blocks = mt.swap_moe_blocks(model, device=a.device, dtype=a.torch_dtype, max_tokens=64, lib=a.lib)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2)).to(a.device)
    losses = []
    for m in (model, hf):
        with autocast(a):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss.detach()))
    hb, mb = hf.model.layers[1].mlp, model.model.layers[1].mlp
    gm = max(float((p.grad - hb.get_parameter(n).grad).abs().max()) for n, p in mb.named_parameters()) / \
        max(float(hb.get_parameter(n).grad.abs().max()) for n, _ in mb.named_parameters())
    tol_loss, tol_grad = (1e-5, 1e-5) if a.dtype == "fp32" else (2 ** -5 * abs(losses[1]), 2 ** -3)
    ok(len(blocks) == 1 and sorted(mb.state_dict()) == sorted(hb.state_dict()) and
       abs(losses[0] - losses[1]) <= tol_loss and gm <= tol_grad,
       f"deepseek_v3 (group routing, correction bias, shared expert): the block's keys, loss within "
       f"{tol_loss:.1g} ({abs(losses[0] - losses[1]):.1e}), MoE gradients {gm:.1e} of the largest")


def block_pair(a, family="qwen2_moe", **kw):
    hf = tiny(family)
    hb = moe_block(hf.model.layers[0])
    return hf, hb, mt.MoeptMoE(hb, hf.config, layer_idx=0, device=a.device, dtype=a.torch_dtype,
                               max_tokens=64, lib=a.lib, hf_outputs=True, **kw)


def test_state_dict(a):
    hf, hb, m = block_pair(a)
    sd, hsd = m.state_dict(), hb.state_dict()
    ok(list(sd) == list(hsd),
       f"state_dict keys are the HF block's ({len(sd)}: {', '.join(list(sd)[:3])}, ...)")
    ok(all(torch.equal(sd[k].cpu(), hsd[k].float()) for k in hsd), "state_dict values are HF's, bitwise")
    x = torch.randn(2, 8, 32, device=a.device, dtype=a.torch_dtype)
    with torch.no_grad():
        p = next(iter(m.parameters()))
        p.add_(0.01)  # written in place (as an optimizer): the layer sees it
        y0 = m(x)[0]
        saved = {k: v.clone() for k, v in m.state_dict().items()}
        m2 = mt.MoeptMoE(None, hf.config, layer_idx=0, device=a.device, dtype=a.torch_dtype, max_tokens=64,
                         lib=a.lib, hf_outputs=True, fused=m._fused)
        m2.load_state_dict(saved)
        ok(all(torch.equal(v, saved[k]) for k, v in m2.state_dict().items()) and torch.equal(m2(x)[0], y0),
           "state_dict round trip: a layer from the config alone, loaded, gives the same state and y bitwise")
        hb.load_state_dict(saved)
        yh = hb(x.float().cpu())
        yh = yh[0] if isinstance(yh, tuple) else yh  # 4.x: (y, logits); 5.x: y
        err = float((yh - y0.float().cpu()).abs().max()) / float(yh.abs().max())
        tol = 1e-5 if a.dtype == "fp32" else 2 ** -5
        ok(err <= tol, f"the HF block loaded from moept's state_dict gives moept's y (max diff {err:.1e} "
           "of the largest)")
    # the other transformers layout of the same weights (4.x per-expert modules <-> 5.x's fused
    # gate_up_proj [E][2F][D] and down_proj [E][D][F]): its own keys and values, and the same y
    other = other_layout(hb, m.F)
    mo = mt.MoeptMoE(other, hf.config, layer_idx=0, device=a.device, dtype=a.torch_dtype, max_tokens=64,
                     lib=a.lib, hf_outputs=True)
    osd, ref = mo.state_dict(), other.state_dict()
    fused = hasattr(other.experts, "gate_up_proj")
    ok(list(osd) == list(ref) and all(torch.equal(osd[k].cpu(), ref[k].float()) for k in ref),
       f"{'fused (5.x)' if fused else 'per-expert (4.x)'} experts from the same weights: that block's keys "
       f"and values ({', '.join(list(osd)[:3])}, ...)")
    with torch.no_grad():
        m3 = mt.MoeptMoE(hb, hf.config, layer_idx=0, device=a.device, dtype=a.torch_dtype, max_tokens=64,
                         lib=a.lib, hf_outputs=True)
        ok(torch.equal(mo(x)[0], m3(x)[0]), "the other layout gives the same layer's y bitwise")


def other_layout(hb, F):
    """a block with hb's weights (Qwen2-MoE names) in the other layout: 4.x's ModuleList of experts
    becomes 5.x's fused tensors, and the reverse"""
    blk = torch.nn.Module()
    blk.gate = torch.nn.Module()
    blk.gate.weight = torch.nn.Parameter(hb.gate.weight.detach().clone())
    if hasattr(hb.experts, "gate_up_proj"):
        gu, dn = hb.experts.gate_up_proj.detach(), hb.experts.down_proj.detach()
        blk.experts = torch.nn.ModuleList()
        for e in range(gu.shape[0]):
            ex = torch.nn.Module()
            for name, w in (("gate_proj", gu[e, :F]), ("up_proj", gu[e, F:]), ("down_proj", dn[e])):
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight = torch.nn.Parameter(w.clone())
                setattr(ex, name, lin)
            blk.experts.append(ex)
    else:
        blk.experts = torch.nn.Module()
        blk.experts.gate_up_proj = torch.nn.Parameter(torch.stack([
            torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in hb.experts]).detach())
        blk.experts.down_proj = torch.nn.Parameter(
            torch.stack([e.down_proj.weight for e in hb.experts]).detach())
    blk.shared_expert, blk.shared_expert_gate = hb.shared_expert, hb.shared_expert_gate
    return blk


def test_mask(a):
    """moept's padding mask from an attention mask: padded rows y 0, logits 0, dx 0; the others as the
    unpadded tokens' own forward, bitwise; hf_aux_loss with the mask = transformers' with attention_mask
    on the unpadded logits alone"""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    hf, _, m = block_pair(a)
    x = torch.randn(2, 8, 32, device=a.device, dtype=a.torch_dtype, requires_grad=True)
    mask = torch.ones(2, 8, dtype=torch.long, device=a.device)
    mask[0, 5:] = 0
    keep = mask.reshape(-1) != 0
    mt.set_padding_mask([m], mask)
    y, logits = m(x)
    aux = mt.hf_aux_loss([m], hf.config, mask)
    (y.float().square().sum() + aux).backward()
    mt.set_padding_mask([m], None)
    xk = x.detach().reshape(-1, 32)[keep].clone().requires_grad_()
    yk, lk = m(xk)
    ref = hf.config.router_aux_loss_coef * load_balancing_loss_func((lk,), 4, 2, None)
    (yk.float().square().sum() + ref).backward()
    y, logits, dx = y.reshape(-1, 32), logits.reshape(-1, 4), x.grad.reshape(-1, 32)
    ok(float(y[~keep].abs().max()) == 0 and float(logits[~keep].abs().max()) == 0 and
       float(dx[~keep].abs().max()) == 0, "attention_mask: padded tokens get y 0, logits 0, dx 0")
    ok(same(a, y[keep], yk) and same(a, logits[keep], lk) and same(a, dx[keep], xk.grad),
       "attention_mask: the other tokens' y, logits and dx are those of their forward alone "
       f"({'bitwise' if a.device == 'cpu' else 'to rounding'})")
    ok(abs(float(aux) - float(ref)) <= 1e-6 * abs(float(ref)),
       f"hf_aux_loss with the mask = transformers' on the unpadded tokens ({float(aux):.6f})")


def test_recompute(a):
    torch.manual_seed(3)
    _, _, m1 = block_pair(a, max_inflight=2)
    _, _, m2 = block_pair(a)
    xs = [torch.randn(2, 8, 32, device=a.device, dtype=a.torch_dtype, requires_grad=True) for _ in range(2)]
    dys = [torch.randn(2, 8, 32, device=a.device, dtype=a.torch_dtype) for _ in range(2)]
    ys = [m1(x)[0] for x in xs]  # two forwards in flight
    for y, dy in reversed(list(zip(ys, dys))):
        y.backward(dy)
    x2 = [x.detach().clone().requires_grad_() for x in xs]
    y2 = []
    for x, dy in zip(x2, dys):  # each forward then its backward
        y2.append(m2(x)[0])
        y2[-1].backward(dy)
    same = all(torch.equal(u, v) for u, v in zip(ys, y2)) and all(torch.equal(u.grad, v.grad) for u, v in
                                                                   zip(xs, x2))
    same = same and all(torch.equal(p.grad, q.grad) for p, q in zip(m1.parameters(), m2.parameters()))
    ok(same, "recomputation: 2 forwards in flight, backwards in reverse = forward+backward each "
       "(y, dx, grads)")
    x = torch.randn(16, 32, device=a.device, dtype=a.torch_dtype, requires_grad=True)
    first = m2(x)[0]
    m2(x)[0].sum().backward()
    ok(raises(lambda: first.sum().backward(), RuntimeError, ["slot", "max_inflight"]),
       "a backward whose slot a later forward reused is refused (max_inflight 1)")


def test_checks(a):
    _, _, m = block_pair(a)
    x = torch.randn(16, 32, device=a.device, dtype=a.torch_dtype)
    wrong = torch.float64 if a.dtype == "bf16" else torch.bfloat16
    ok(raises(lambda: m(x.to(wrong)), TypeError, [str(wrong), str(a.torch_dtype)]),
       f"a {wrong} input: TypeError naming both dtypes")
    ok(raises(lambda: m(x.to("meta")), ValueError, ["meta"]), "an input on another device: ValueError")
    ok(raises(lambda: m(x, attention_mask=torch.ones(15, device=a.device)), ValueError, ["attention_mask"]),
       "a mask of the wrong size: ValueError")
    with torch.no_grad():
        y = m(x)[0]
        big = torch.randn(32, 64, device=a.device, dtype=a.torch_dtype)
        big[::2, ::2] = x
        xs = big[::2, ::2]  # non-contiguous: every other row and column
        ok(not xs.is_contiguous() and torch.equal(m(xs)[0], y), "a non-contiguous input: copied, the same y")
    ptrs = [p.data_ptr() for p in m.parameters()]
    m.half()
    m.to(torch.float64)
    m.double()
    m.float()
    m.to(a.device)
    kept = [p.data_ptr() for p in m.parameters()] == ptrs and all(p.dtype == torch.float32 for p in
                                                                   m.parameters())
    with torch.no_grad():
        ok(kept and torch.equal(m(x)[0], y), ".half(), .to(float64), .double(): the parameters stay moept's "
           "fp32 masters, the same y")
        ok(raises(lambda: m.to("meta"), RuntimeError, ["detach"]) and
           [p.data_ptr() for p in m.parameters()] == ptrs, ".to(another device): RuntimeError, nothing moved")
        with torch.no_grad():
            next(iter(m.parameters())).mul_(0.5)
        ok(not torch.equal(m(x)[0], y), "an in-place write of a parameter reaches the layer")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--lib", default=None)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    a.torch_dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("skip - test_torch --device cuda: torch sees no GPU")
        return 0
    a.lib = mt.load_library(a.lib, cuda=a.device.startswith("cuda"))
    import transformers
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, {a.device}, {a.dtype}")
    test_train(a)
    test_deepseek(a)
    test_state_dict(a)
    test_mask(a)
    test_recompute(a)
    test_checks(a)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
