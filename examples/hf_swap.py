#!/usr/bin/env python3
"""hf_swap: every MoE block of a transformers Mixtral, Qwen2-MoE or OLMoE swapped for a moept layer
(moept_torch.py: CPU or CUDA layers), trained with torch's AdamW on HF's exact objective.

    make build/libmoept.so                      # or build/libmoept_cuda.so for --device cuda
    python3 examples/hf_swap.py [--family mixtral|qwen2_moe|olmoe] [--steps 40] [--check]
                                [--device cpu|cuda] [--dtype fp32|bf16] [--lib PATH] [--layers 2]
                                [--hidden 32] [--ffn 64] [--shared-ffn 64] [--experts 4] [--topk 2]
                                [--norm-topk] [--vocab 64] [--batch 4] [--seq 16]

The glue is moept_torch (docs/TORCH.md): swap_moe_blocks puts a MoeptMoE where each MoE block was, its
weights copied in and kept under HF's names; the aux loss is transformers' own load_balancing_loss_func
over every layer's router logits (hf_aux_loss: moept's own aux is off, since no per-layer loss equals
HF's cross-layer term; its gradient goes back through the logits into moept's backward). Qwen2-MoE's
shared expert and sigmoid gate are inside moept's layer. OLMoE needs transformers >= 4.45.

With --check the original HF model trains beside the swapped one from the same init and batches: it
prints the largest per-step loss difference, the step-1 gradient error, tokens routed differently, and
the MoE block's time, forward + backward, moept against HF's block (same run, same input), and exits 1
if a step's loss, or a step-1 gradient relative to the largest, differs by more than the tolerance:
  fp32: --tol (1e-5);
  bf16 (--dtype bf16, CUDA): both models keep fp32 weights and run under torch.autocast(bf16), so each
    MoE block rounds its GEMM inputs and outputs to bf16 (unit roundoff u = 2^-9) at different points
    (HF: every matmul's operands and result; moept: x, the expert activations and y). A block's output
    differs by a few u of its magnitude, the loss by about that relative to it after the layers add up:
    the bound is 2^-5 of the loss (16 u, over 2 layers and the steps' drift). Step-1 gradients are held
    to an fp32 copy of the HF model (no autocast) on the same batch: moept's error against it must stay
    within twice transformers' own bf16 error plus 2^-7 of the largest gradient (how far bf16 moves a
    gradient grows with the model; this asks moept to move it no more than transformers does).
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
    ap.add_argument("--tol", type=float, default=None, help="fp32: 1e-5; bf16: relative, see the top")
    ap.add_argument("--time-tokens", type=int, default=None, help="tokens of the block timing "
                    "(default batch*seq)")
    a = ap.parse_args()
    dev, bf16 = torch.device(a.device), a.dtype == "bf16"
    if bf16 and dev.type != "cuda":
        sys.exit("hf_swap: --dtype bf16 runs CUDA layers (--device cuda); CPU layers are fp32")
    dtype = torch.bfloat16 if bf16 else torch.float32
    tol_loss, tol_grad = (a.tol or 2 ** -5, a.tol or 2 ** -3) if bf16 else (a.tol or 1e-5, a.tol or 1e-5)

    def autocast():
        return torch.autocast("cuda", torch.bfloat16) if bf16 else contextlib.nullcontext()

    torch.manual_seed(0)
    hf = FAMILIES[a.family](a).float().to(dev)
    config = hf.config
    model = copy.deepcopy(hf)
    T = a.batch * a.seq
    blocks = mt.swap_moe_blocks(model, device=dev, dtype=dtype, max_tokens=max(T, a.time_tokens or 0),
                                lib=a.lib)
    print(f"# torch {torch.__version__}, transformers {tf.__version__}, {a.family}, {dev}, {a.dtype}")
    models = [model] + ([hf] if a.check else [])
    ref = copy.deepcopy(hf) if a.check and bf16 else None  # bf16: the fp32 model the gradients are held to
    opts = [torch.optim.AdamW(m.parameters(), lr=a.lr, foreach=False) for m in models]
    gen = torch.Generator().manual_seed(1)
    worst, grads, apart = 0.0, None, 0
    for step in range(1, a.steps + 1):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(dev)
        losses = []
        for m, opt in zip(models, opts):
            opt.zero_grad()
            with autocast():
                if m is hf:   # transformers' own objective: LM loss + coef * aux over all layers
                    loss = m(input_ids=ids, labels=ids, output_router_logits=True).loss
                else:
                    loss = m(input_ids=ids, labels=ids, output_router_logits=False).loss
                    loss = loss + mt.hf_aux_loss(blocks, config)
            loss.backward()
            losses.append(float(loss.detach()))
        if a.check:
            diff = abs(losses[0] - losses[1]) / (abs(losses[1]) if bf16 else 1.0)
            worst = max(worst, diff)
            apart += routed_apart(blocks)
            if step == 1 and ref is None:
                grads = grad_error(hf, model)
            elif step == 1:
                ref(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
                grads, grads_hf = grad_error(ref, model), grad_error(ref, hf)
                tol_grad = a.tol or 2 * max(grads_hf) + 2 ** -7
                del ref
        for opt in opts:
            opt.step()
        if step == 1 or step % 10 == 0 or step == a.steps:
            print(f"step {step:4d}  loss {losses[0]:.6f}" +
                  (f"  transformers {losses[1]:.6f}  diff {losses[0] - losses[1]:+.2e}" if a.check else ""))
    if not a.check:
        return 0
    Tt = a.time_tokens or T
    x = torch.randn(1, Tt, a.hidden, device=dev)
    hb, mb = moe_block(hf.model.layers[0]), moe_block(model.model.layers[0])
    hf.eval(), model.eval()  # the blocks alone, without the aux loss; no jitter
    t_hf, t_mo = block_times(hb, mb, x, 30, autocast)
    rel = " (relative to the loss)" if bf16 else ""
    print(f"largest per-step loss difference over {a.steps} steps{rel}: {worst:.3e}")
    if bf16:
        print(f"step-1 gradient error against fp32 HF (max |g - g_fp32| / max |g_fp32|): moept: MoE blocks "
              f"{grads[0]:.3e}, other weights {grads[1]:.3e}; transformers bf16: {grads_hf[0]:.3e}, "
              f"{grads_hf[1]:.3e}")
    else:
        print(f"step-1 gradient error (max |g - g_hf| / max |g_hf|): MoE blocks {grads[0]:.3e}, "
              f"other weights {grads[1]:.3e}")
    print(f"token-layer routings that differ (moept vs torch top-k, all steps): {apart}")
    print(f"MoE block forward+backward, {Tt} tokens, {a.dtype}: transformers {t_hf * 1e3:.3f} ms, "
          f"moept {t_mo * 1e3:.3f} ms, ratio HF/moept {t_hf / t_mo:.2f}")
    ok = [worst <= tol_loss, max(grads) <= tol_grad]
    print(f"{'ok' if ok[0] else 'FAIL'} - per-step loss within {tol_loss:g}{rel} of transformers over "
          f"{a.steps} steps (largest {worst:.2e})")
    against = "fp32 HF's (2 x transformers' bf16 error + 2^-7)" if bf16 else "transformers'"
    print(f"{'ok' if ok[1] else 'FAIL'} - step-1 gradients within {tol_grad:.3g} of {against} (relative to "
          f"the largest; {max(grads):.2e})")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
