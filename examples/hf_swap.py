#!/usr/bin/env python3
"""hf_swap: every MoE block of a transformers Mixtral, Qwen2-MoE or OLMoE swapped for a moept layer
(moept_torch.py: CPU or CUDA layers), trained with torch's AdamW on HF's exact objective.

    make build/libmoept.so                      # or build/libmoept_cuda.so for --device cuda
    python3 examples/hf_swap.py [--family mixtral|qwen2_moe|olmoe] [--steps 40] [--check]
                                [--device cpu|cuda] [--dtype fp32|bf16] [--lib PATH] [--layers 2]
                                [--hidden 32] [--ffn 64] [--shared-ffn 64] [--experts 4] [--topk 2]
                                [--norm-topk] [--vocab 64] [--batch 4] [--seq 16] [--seed 0] [--window 4]

The glue is moept_torch (docs/TORCH.md): swap_moe_blocks puts a MoeptMoE where each MoE block was, its
weights copied in and kept under HF's names; the aux loss is transformers' own load_balancing_loss_func
over every layer's router logits (hf_aux_loss: moept's own aux is off, since no per-layer loss equals
HF's cross-layer term; its gradient goes back through the logits into moept's backward). Qwen2-MoE's
shared expert and sigmoid gate are inside moept's layer. OLMoE needs transformers >= 4.45.

With --check the original HF model trains beside the swapped one from the same init and batches: it
prints the largest per-step loss difference, the gradient errors, tokens routed differently, and the MoE
block's time, forward + backward, moept against HF's block (same run, same input), and exits 1 if a
step's loss or a gradient strays further than transformers' own rounding takes it:
  fp32: a third model, transformers' in float64 (same init, batches and AdamW), stands for the exact
    values; HF's fp32 model, the same sums in another valid order, shows how far fp32 rounding alone
    takes them. Left alone, two fp32 models part chaotically: AdamW's update ignores a gradient's scale,
    so a weight whose gradient rounding alone signs moves by lr one way or the other, and a token then
    routed to another expert jumps the loss by about 1/T of its own. When that starts is chance, and
    either model may start first by many steps (docs/PERF.md, "hf_swap --check's bound"); after it a
    wrong gradient looks like rounding. So both fp32 models restart from the fp64 model's weights and
    AdamW state (rounded) at step 1, at step 3 (AdamW's first update, lr times each gradient's sign, is
    the one that turns rounding into whole steps of lr) and every --window steps after (4; 0: at step 1
    alone, the free comparison), and each step is held to:
    - loss: |L - L64| within 4 times transformers' own |L32 - L64| (the largest so far: two samples of
      the same rounding spread by a small factor) plus 64 u of the loss (u = 2^-24: the loss is itself
      rounded, and the step after AdamW's first update can put an fp32 model a few dozen u from fp64,
      the other not as far);
    - gradients at each restart (the three models hold the same weights then): per group, the MoE
      blocks' weights and the others, max |g - g64| / max |g64| within 4 times transformers' own plus
      4 u (a maximum over elements is a noisy statistic; its two samples sit within a factor of about 2).
    A gradient 1e-3 of its largest off on one weight, a plausible bug, takes the gradient error tens to
    hundreds of times past its bound at every restart; the loss drift sees it only as far as a few
    AdamW updates carry it into the weights (--perturb-grad plants one, to show the check failing).
    --tol: the loss bound's term in place of 64 u.
  bf16 (--dtype bf16, CUDA): both models keep fp32 weights and run under torch.autocast(bf16), so each
    MoE block rounds its GEMM inputs and outputs to bf16 (unit roundoff u = 2^-9) at different points
    (HF: every matmul's operands and result; moept: x, the expert activations and y). A block's output
    differs by a few u of its magnitude, the loss by about that relative to it after the layers add up:
    the bound is 2^-5 of the loss (16 u, over 2 layers and the steps' drift; no restarts). Step-1
    gradients are held to an fp32 copy of the HF model (no autocast) on the same batch: moept's error
    against it must stay within twice transformers' own bf16 error plus 2^-7 of the largest gradient
    (how far bf16 moves a gradient grows with the model; this asks moept to move it no more than
    transformers does).
"""
import argparse
import contextlib
import copy
import os
import sys
import time

import torch
import transformers as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import moept_torch as mt  # noqa: E402


def mixtral_model(a):
    return tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=a.ffn, num_local_experts=a.experts,
                                                  **common_config(a)))


def qwen2_moe_model(a):
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        intermediate_size=a.ffn, moe_intermediate_size=a.ffn, shared_expert_intermediate_size=a.shared_ffn,
        num_experts=a.experts, norm_topk_prob=a.norm_topk, decoder_sparse_step=1, **common_config(a)))


def olmoe_model(a):
    if not hasattr(tf, "OlmoeForCausalLM"):
        print(f"skip - hf_swap --family olmoe: transformers {tf.__version__} has no OLMoE "
              "(4.45 and later have)")
        sys.exit(0)
    # no padding token: OLMoE's default (1) has a zero embedding, so a sequence starting with it gives x = 0,
    # equal logits and a tie that torch's topk breaks unlike moept (lower index; harmless: y = 0 either
    # way, but counted as routed apart); eos 50279 is outside the small vocabulary
    return tf.OlmoeForCausalLM(tf.OlmoeConfig(intermediate_size=a.ffn, num_experts=a.experts,
                                              pad_token_id=None, eos_token_id=None,
                                              norm_topk_prob=a.norm_topk, **common_config(a)))


def common_config(a):
    return dict(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=4,
                num_key_value_heads=2, num_experts_per_tok=a.topk, max_position_embeddings=a.seq,
                router_aux_loss_coef=a.aux_coef, output_router_logits=True, tie_word_embeddings=False,
                initializer_range=a.init)


FAMILIES = {"mixtral": mixtral_model, "qwen2_moe": qwen2_moe_model, "olmoe": olmoe_model}


def moe_block(layer):
    return getattr(layer, "block_sparse_moe", None) or layer.mlp


def grad_error(hf, swapped):
    """max |g - g_hf| / max |g_hf| over the MoE blocks' weights (by HF name), and over every other weight"""
    def rel(pairs):
        num = max(float((a - b).abs().max()) for a, b in pairs)
        return num / max(float(b.abs().max()) for _, b in pairs)
    moe = []
    for hl, ml in zip(hf.model.layers, swapped.model.layers):
        b = moe_block(ml)
        if hasattr(b, "experts"):  # a MoE block, moept's or HF's: by the HF names
            moe += [(p.grad, moe_block(hl).get_parameter(n).grad) for n, p in b.named_parameters()]
    named = dict(swapped.named_parameters())
    rest = [(named[n].grad, p.grad) for n, p in hf.named_parameters()
            if ".mlp." not in n and ".block_sparse_moe." not in n]
    return rel(moe), rel(rest)


def routed_apart(blocks):
    """tokens whose moept top-k differs from torch's top-k of the logits moept returned"""
    n = 0
    for b in blocks:
        mine = b.routing()
        ref = torch.topk(torch.softmax(b.router_logits.detach().float(), -1), b.top_k, dim=-1).indices.cpu()
        n += int((mine.sort(-1).values != ref.sort(-1).values).any(-1).sum())
    return n


def block_times(hf_block, moept_block, x, reps, autocast):
    """seconds per forward + backward of each block on x, interleaved, best of reps"""
    best = [float("inf"), float("inf")]
    dy = torch.randn_like(x)
    cuda = x.is_cuda
    for _ in range(reps):
        for i, blk in enumerate((hf_block, moept_block)):
            xi = x.detach().requires_grad_()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with autocast():
                out = blk(xi)
            (out[0] if isinstance(out, tuple) else out).backward(dy)
            if cuda:
                torch.cuda.synchronize()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


# the fp32 check's bounds (the top of the file argues them)
LOSS_C, LOSS_U, GRAD_C, GRAD_U = 4.0, 64 * 2.0 ** -24, 4.0, 4 * 2.0 ** -24


def restarts_at(step, window):
    """whether the fp32 models restart from the fp64 one before this step: 1, 3, then every window (0:
    1 alone)"""
    return step == 1 or (window > 0 and (step == 3 or (step > 3 and (step - 3) % window == 0)))


def restart(models, opts, exact, exact_opt):
    """each model's weights and AdamW state set to the fp64 model's, rounded to the model's dtype (by
    name: a swapped block keeps HF's)"""
    with torch.no_grad():
        for m, opt in zip(models, opts):
            for n, p in m.named_parameters():
                q = exact.get_parameter(n)
                p.copy_(q)
                st = exact_opt.state.get(q)
                if st:
                    opt.state[p] = {k: v.to(p.dtype, copy=True) if torch.is_tensor(v) and k != "step"
                                    else copy.deepcopy(v) for k, v in st.items()}


@contextlib.contextmanager
def default_dtype(dtype):
    """torch's default dtype for a while: transformers 4.40 fills its causal mask with the model dtype's
    min in the default dtype (float64's overflows float32)"""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def wrong_gradient(block, eps):
    """a deliberate bug: the block's first expert weight's gradient plus eps times its largest element,
    in a fixed pattern of signs, after each backward (a scaled gradient would not do: AdamW's update
    ignores the scale)"""
    name, p = next((n, p) for n, p in block.named_parameters() if "experts" in n)
    signs = torch.randint(0, 2, p.shape, generator=torch.Generator().manual_seed(7)).to(p.device) * 2.0 - 1

    def apply():
        with torch.no_grad():
            p.grad.add_(eps * float(p.grad.abs().max()) * signs)
    return name, apply


class Fp32Check:
    """the fp32 bounds, step by step: the loss drift and the gradients at each restart against fp64"""

    def __init__(self, tol):
        self.loss_u = tol
        self.ref = 0.0                      # transformers fp32's largest |L32 - L64| so far
        self.drift = [0.0, 0.0]             # the largest |L - L64|: moept, transformers fp32
        self.loss_share, self.grad_share = 0.0, 0.0  # the largest error over its bound
        self.grads = [(0.0, 0.0), (0.0, 0.0)]  # the largest gradient errors: moept, transformers fp32
        self.restarts = 0

    def loss(self, mine, hf32, hf64):
        e, r = abs(mine - hf64), abs(hf32 - hf64)
        self.ref = max(self.ref, r)
        self.drift = [max(self.drift[0], e), max(self.drift[1], r)]
        bound = LOSS_C * self.ref + (self.loss_u if self.loss_u is not None else LOSS_U * abs(hf64))
        self.loss_share = max(self.loss_share, e / bound)

    def gradients(self, exact, model, hf):
        mine, own = grad_error(exact, model), grad_error(exact, hf)
        self.restarts += 1
        self.grads = [tuple(map(max, self.grads[0], mine)), tuple(map(max, self.grads[1], own))]
        self.grad_share = max([self.grad_share] + [e / (GRAD_C * r + GRAD_U) for e, r in zip(mine, own)])

    def report(self, steps, window):
        g, h = self.grads
        loss_term = "64 u of the loss" if self.loss_u is None else f"{self.loss_u:g}"
        at = f"steps 1, 3 and every {window} after" if window > 0 else "step 1 alone"
        print(f"loss drift from transformers fp64 (restarts at {at}): moept "
              f"{self.drift[0]:.3e}, transformers fp32 {self.drift[1]:.3e}")
        print(f"gradients against fp64 at {self.restarts} restarts (max |g - g64| / max |g64|): moept: MoE "
              f"blocks {g[0]:.3e}, other weights {g[1]:.3e}; transformers fp32: {h[0]:.3e}, {h[1]:.3e}")
        ok = [self.loss_share <= 1.0, self.grad_share <= 1.0]
        print(f"{'ok' if ok[0] else 'FAIL'} - per-step loss within {LOSS_C:g} x transformers fp32's own "
              f"drift from fp64 + {loss_term}, {steps} steps (at most {self.loss_share:.2f} of the bound)")
        print(f"{'ok' if ok[1] else 'FAIL'} - gradients within {GRAD_C:g} x transformers fp32's error "
              f"+ 4 u, against fp64 at each restart (at most {self.grad_share:.2f} of the bound)")
        return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=list(FAMILIES), default="mixtral")
    ap.add_argument("--lib", default=None, help="moept's shared library (default: build/libmoept.so, "
                    "build/libmoept_cuda.so for --device cuda)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: CUDA, under autocast")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=64)
    ap.add_argument("--shared-ffn", type=int, default=64, help="qwen2_moe's shared expert width")
    ap.add_argument("--norm-topk", action="store_true", help="norm_topk_prob (qwen2_moe, olmoe; "
                    "mixtral always renormalises)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--aux-coef", type=float, default=0.02)
    ap.add_argument("--init", type=float, default=0.1, help="initializer_range (HF's 0.02 leaves the "
                    "MoE blocks' outputs too small to move the loss)")
    ap.add_argument("--seed", type=int, default=0, help="the init's seed (the batches': seed + 1)")
    ap.add_argument("--window", type=int, default=4, help="fp32 --check: the fp32 models restart from the "
                    "fp64 one at steps 1, 3 and every WINDOW steps after (0: at step 1 alone)")
    ap.add_argument("--tol", type=float, default=None, help="fp32: the loss bound's term in place of 64 u "
                    "of the loss; bf16: the bounds, relative (see the top)")
    ap.add_argument("--time-tokens", type=int, default=None, help="tokens of the block timing "
                    "(default batch*seq)")
    ap.add_argument("--perturb-grad", type=float, default=0.0, help=argparse.SUPPRESS)  # wrong_gradient
    a = ap.parse_args()
    dev, bf16 = torch.device(a.device), a.dtype == "bf16"
    if bf16 and dev.type != "cuda":
        sys.exit("hf_swap: --dtype bf16 runs CUDA layers (--device cuda); CPU layers are fp32")
    dtype = torch.bfloat16 if bf16 else torch.float32
    tol_loss, tol_grad = a.tol or 2 ** -5, a.tol or 2 ** -3  # bf16's

    def autocast():
        return torch.autocast("cuda", torch.bfloat16) if bf16 else contextlib.nullcontext()

    torch.manual_seed(a.seed)
    hf = FAMILIES[a.family](a).float().to(dev)
    config = hf.config
    model = copy.deepcopy(hf)
    T = a.batch * a.seq
    blocks = mt.swap_moe_blocks(model, device=dev, dtype=dtype, max_tokens=max(T, a.time_tokens or 0),
                                lib=a.lib)
    print(f"# torch {torch.__version__}, transformers {tf.__version__}, {a.family}, {dev}, {a.dtype}")
    perturb = None
    if a.perturb_grad:
        name, perturb = wrong_gradient(blocks[0], a.perturb_grad)
        print(f"# --perturb-grad: layer 0's {name} gets {a.perturb_grad:g} of its largest gradient added "
              "(fixed signs) after each backward" + (": the check must fail" if a.check else ""))
    models = [model] + ([hf] if a.check else [])
    exact = copy.deepcopy(hf).double() if a.check and not bf16 else None  # fp32: the exact values
    models += [exact] if exact is not None else []
    ref = copy.deepcopy(hf) if a.check and bf16 else None  # bf16: the fp32 model the gradients are held to
    opts = [torch.optim.AdamW(m.parameters(), lr=a.lr, foreach=False) for m in models]
    fp32 = Fp32Check(a.tol) if exact is not None else None
    gen = torch.Generator().manual_seed(a.seed + 1)
    worst, grads, apart = 0.0, None, 0
    for step in range(1, a.steps + 1):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(dev)
        again = fp32 is not None and restarts_at(step, a.window)
        if again:
            restart(models[:2], opts[:2], exact, opts[2])
        losses = []
        for m, opt in zip(models, opts):
            opt.zero_grad()
            with autocast(), default_dtype(torch.float64 if m is exact else torch.float32):
                if m is not model:   # transformers' own objective: LM loss + coef * aux over all layers
                    loss = m(input_ids=ids, labels=ids, output_router_logits=True).loss
                else:
                    loss = m(input_ids=ids, labels=ids, output_router_logits=False).loss
                    loss = loss + mt.hf_aux_loss(blocks, config)
            loss.backward()
            if m is model and perturb is not None:
                perturb()
            losses.append(float(loss.detach()))
        if a.check:
            diff = abs(losses[0] - losses[1]) / (abs(losses[1]) if bf16 else 1.0)
            worst = max(worst, diff)
            apart += routed_apart(blocks)
            if fp32 is not None:
                fp32.loss(*losses)
                if again:
                    fp32.gradients(exact, model, hf)
            elif step == 1:
                ref(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
                grads, grads_hf = grad_error(ref, model), grad_error(ref, hf)
                tol_grad = a.tol or 2 * max(grads_hf) + 2 ** -7
                del ref
        for opt in opts:
            opt.step()
        if step == 1 or step % 10 == 0 or step == a.steps:
            print(f"step {step:4d}  loss {losses[0]:.6f}" +
                  (f"  transformers {losses[1]:.6f}  diff {losses[0] - losses[1]:+.2e}" if a.check else "") +
                  (f"  fp64 {losses[2]:.6f}" if fp32 is not None else ""))
    if not a.check:
        return 0
    del exact, models, opts
    Tt = a.time_tokens or T
    x = torch.randn(1, Tt, a.hidden, device=dev)
    hb, mb = moe_block(hf.model.layers[0]), moe_block(model.model.layers[0])
    hf.eval(), model.eval()  # the blocks alone, without the aux loss; no jitter
    t_hf, t_mo = block_times(hb, mb, x, 30, autocast)
    rel = " (relative to the loss)" if bf16 else ""
    print(f"largest per-step loss difference from transformers over {a.steps} steps{rel}: {worst:.3e}")
    if bf16:
        print(f"step-1 gradient error against fp32 HF (max |g - g_fp32| / max |g_fp32|): moept: MoE blocks "
              f"{grads[0]:.3e}, other weights {grads[1]:.3e}; transformers bf16: {grads_hf[0]:.3e}, "
              f"{grads_hf[1]:.3e}")
    print(f"token-layer routings that differ (moept vs torch top-k, all steps): {apart}")
    print(f"MoE block forward+backward, {Tt} tokens, {a.dtype}: transformers {t_hf * 1e3:.3f} ms, "
          f"moept {t_mo * 1e3:.3f} ms, ratio HF/moept {t_hf / t_mo:.2f}")
    if fp32 is not None:
        return 0 if all(fp32.report(a.steps, a.window)) else 1
    ok = [worst <= tol_loss, max(grads) <= tol_grad]
    print(f"{'ok' if ok[0] else 'FAIL'} - per-step loss within {tol_loss:g}{rel} of transformers over "
          f"{a.steps} steps (largest {worst:.2e})")
    print(f"{'ok' if ok[1] else 'FAIL'} - step-1 gradients within {tol_grad:.3g} of fp32 HF's (2 x "
          f"transformers' bf16 error + 2^-7) (relative to the largest; {max(grads):.2e})")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
