#!/usr/bin/env python3
"""bench_peers: one MoE layer's forward + backward on one device, moept beside what a PyTorch user would
run instead, at the same shape, with the same weights, input and output gradient.

    python3 bench/bench_peers.py [--device cuda|cpu] [--shape mixtral|deepseek|qwen3|olmoe|tiny|all]
                                 [--tokens T] [--reps R] [--lib PATH] [--bench-cuda PATH] [--peers DIR]

Peers (each row: time per step, TFLOP/s of the expert GEMMs, device memory, time over the fastest's,
and y and dx against transformers' eager block, the first row: max |difference| and its norm relative to the
norm), in two regimes, the label of each row ending with its own:
  - "bf16 params" (on the CPU "fp32 params"): the parameters, their gradients and the GEMMs in the layer's
    dtype, as a pure-bf16 user trains;
  - "fp32 params + autocast": fp32 parameters and fp32 gradients, the forward under
    torch.autocast(device, dtype=torch.bfloat16) and the backward outside it (torch's AMP documentation:
    backward ops run in the dtype autocast chose for their forward ops), as a mixed-precision user trains;
    the same weights (bf16 values, exact in fp32), input and output gradient as the bf16 rows.
The rows:
  - transformers, bf16 params: the Mixtral block in each experts implementation the installed version offers
    (4.x: its per-expert loop; 5.x: "eager" and every registered one, e.g. batched_mm, grouped_mm);
  - grouped_mm (own layer), bf16 params: a layer of this file's own over torch._grouped_mm
    (torch.nn.functional.grouped_mm where present) as its documentation gives it: tokens sorted by expert,
    each expert's rows padded to a multiple of 16, one grouped GEMM for gate/up and one for down, the
    router fp32; on the CPU (no grouped GEMM) the same layer with a loop of torch.mm per expert, so the
    smoke mode runs its code;
  - ScatterMoE, bf16 params (GPU only, where --peers DIR, default build/peers, holds its scattermoe package:
    tools/gpu_prebuild.sh copies it there from $SCATTERMOE, never into the repository): its GLUMLP (Triton
    kernels that gather and scatter the rows inside the grouped GEMMs) behind the own layer's fp32 router;
  - moept (moept_torch): MoeptMoE built from the transformers block; on the GPU a bf16 CUDA layer, which
    holds fp32 master parameters and fp32 gradients (torch's .grad views them) and bf16 copies of the
    weights inside, x and y bf16: the fp32 params + autocast regime, so its row sits just above those rows
    (on the CPU an fp32 layer, the fp32 regime);
  - moept (C API), printed just above the module's row: bench/bench_cuda at the shape (--bench-cuda; CUDA
    only; the same bf16 layer, fp32 masters inside; its own random weights and input, so its outputs are not
    compared: the module's row runs the same layer on these);
  - transformers, fp32 params + autocast: the same block with fp32 parameters, in each implementation.
    transformers' grouped_mm casts its input to the weights' dtype (torch's grouped GEMM is not on
    autocast's lists), so with fp32 parameters its expert GEMMs are fp32 ones (where torch's grouped GEMM
    takes fp32; its row says why not otherwise), only the router in bf16;
  - grouped_mm (own layer), fp32 params + autocast: the own layer with fp32 expert weights, which it casts
    to autocast's dtype itself, with the token rows, as autocast casts a matmul's operands (differentiable
    casts: the gradients are fp32); its router stays fp32 (autocast off around it), as in its bf16 row.
Shapes (bf16 on the GPU): mixtral: Mixtral-8x7B (D 4096, F 14336, E 8, K 2), T 8192; deepseek: DeepSeek-V3's
experts (D 7168, F 2048) with 16 of its 256 experts local, top-8 among them (each expert gets about T/2
rows, as one rank of a 16-way EP group), T 8192, no shared expert; qwen3: Qwen3-30B-A3B (D 2048, F 768,
E 128, K 8), T 4096; olmoe: OLMoE-1B-7B (D 2048, F 1024, E 64, K 8), T 4096; tiny (the smoke mode:
--device cpu): D 32, F 48, E 4, K 2, T 64, fp32. Every shape
routes as Mixtral (softmax, top-k, renormalised: Qwen3's norm_topk_prob), so every peer does the same work.
Time: median of --reps steps after 2 warm-ups, CUDA-synchronised. Memory: the device memory in use at the
end of the peer's steps less before it (torch.cuda.mem_get_info: torch's cached blocks and moept's own
buffers alike; the caches emptied between peers), the parameters and their gradients included: bf16 for
the bf16 rows, fp32 (and autocast's transient bf16 casts) for the autocast rows, fp32 masters, gradients
and bf16 copies for moept's. With --device cpu (the smoke mode, fp32, so the first row is fp32
transformers): exits 1 if an fp32 peer's y or dx differs from transformers' by more than 1e-5
(relative), or an autocast peer's (CPU autocast to bf16) by more than AMP_BOUND, 2^-6 (bf16 keeps 8
significant bits, a rounding 2^-9 relative; x, the weights and each GEMM's output are rounded, and the
rows measure about 3 roundings' worth, 5e-3 to 7e-3), or fewer than 2 peers of either regime ran, so
the script cannot rot.
"""
import argparse
import contextlib
import gc
import os
import re
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import moept_torch as mt  # noqa: E402

SHAPES = {"mixtral": dict(D=4096, F=14336, E=8, K=2, T=8192),
          "deepseek": dict(D=7168, F=2048, E=16, K=8, T=8192),
          "qwen3": dict(D=2048, F=768, E=128, K=8, T=4096),
          "olmoe": dict(D=2048, F=1024, E=64, K=8, T=4096),
          "tiny": dict(D=32, F=48, E=4, K=2, T=64)}
AMP_BOUND = 2.0 ** -6  # the smoke mode's bound on an autocast row's y and dx against fp32 transformers'


def hf_block(s, dtype, device):
    """transformers' Mixtral block at shape s, weights drawn here; (block, config, version's style)"""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = MixtralConfig(hidden_size=s["D"], intermediate_size=s["F"], num_local_experts=s["E"],
                        num_experts_per_tok=s["K"], num_hidden_layers=1, router_jitter_noise=0.0)
    try:
        cfg._experts_implementation = "eager"  # 5.x: read by the experts' forward
    except Exception:
        pass
    # made on the device where torch can (torch >= 2.0: a device as context), and drawn there
    with (device if hasattr(torch.device, "__enter__") else contextlib.nullcontext()):
        blk = MixtralSparseMoeBlock(cfg)
    blk = blk.to(device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(blk.named_parameters()):
            p.normal_(0.0, 0.02, generator=g)
    return blk, cfg


def hf_impls(blk):
    """the experts implementations the installed transformers offers for this block"""
    if not hasattr(blk.experts, "gate_up_proj"):
        return ["eager (4.x)"]
    names = ["eager"]
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        names += [n for n in ALL_EXPERTS_FUNCTIONS.keys() if n not in names]
    except Exception:
        pass
    return names


def expert_weights(blk, F):
    """(router [E][D], w13 [E][2F][D] gate rows first, w2 [E][D][F]) of either version's block"""
    ex = blk.experts
    if hasattr(ex, "gate_up_proj"):
        return blk.gate.weight, ex.gate_up_proj, ex.down_proj
    w13 = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in ex])
    return blk.gate.weight, w13, torch.stack([e.w2.weight for e in ex])


class GroupedMM(torch.nn.Module):
    """A Mixtral-routed MoE layer over one grouped GEMM per projection (this file's own code, after
    torch._grouped_mm's documentation: mat_a [M][K] rows grouped by offs, mat_b [G][K][N], offs [G] int32
    cumulative row ends)"""

    ALIGN = 16  # rows a group starts at a multiple of (the grouped GEMM's alignment)

    def __init__(self, router, w13, w2, K, dtype=None):
        super().__init__()
        dtype = dtype or w13.dtype  # the experts' weights' (fp32 for the autocast rows)
        self.router = torch.nn.Parameter(router.detach().to(torch.float32, copy=True))  # [E][D] fp32
        self.w13 = torch.nn.Parameter(w13.detach().to(dtype, copy=True))               # [E][2F][D]
        self.w2 = torch.nn.Parameter(w2.detach().to(dtype, copy=True))                 # [E][D][F]
        self.K = K
        f = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
        self.gmm = f if f is not None and w13.is_cuda else None

    def grouped(self, a, b, offs, ends):
        """a [M][k] in groups, b [G][k][n] -> [M][n]"""
        if self.gmm is not None:
            return self.gmm(a, b, offs=offs)
        out, start = [], 0
        for g, end in enumerate(ends):
            out.append(a[start:end] @ b[g])
            start = end
        return torch.cat(out)

    def forward(self, x):  # x [T][D] -> y [T][D] of x's dtype
        T, D = x.shape
        # the GEMMs' dtype: autocast's when on (torch._grouped_mm is not on autocast's lists, so the layer
        # casts its weights and rows itself, as autocast does for a matmul), else the weights'
        cd = autocast_dtype(x.device) or self.w13.dtype
        w13, w2 = self.w13.to(cd), self.w2.to(cd)  # differentiable casts: fp32 gradients for fp32 weights
        E, F = self.w2.shape[0], self.w2.shape[2]
        with torch.autocast(x.device.type, enabled=False):  # the router in fp32, under autocast too
            probs = torch.softmax(x.float() @ self.router.t(), -1)                   # [T][E] fp32
        top, ids = torch.topk(probs, self.K, dim=-1)                                 # [T][K]
        top = top / top.sum(-1, keepdim=True)
        flat = ids.reshape(-1)                                                       # [T*K]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)                                   # [E]
        padded = (counts + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        pstart = torch.cumsum(padded, 0) - padded                                    # [E]
        start = torch.cumsum(counts, 0) - counts
        e_sorted = flat[order]
        pos = pstart[e_sorted] + torch.arange(flat.numel(), device=x.device) - start[e_sorted]
        M = int(padded.sum())
        xp = x.new_zeros(M, D, dtype=cd).index_copy(0, pos, x[order // self.K].to(cd))  # [M][D]
        ends = torch.cumsum(padded, 0)
        offs = ends.to(torch.int32)
        h = self.grouped(xp, w13.transpose(1, 2), offs, ends.tolist())              # [M][2F]
        a = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
        yp = self.grouped(a, w2.transpose(1, 2), offs, ends.tolist())               # [M][D]
        rows = yp[pos] * top.reshape(-1)[order, None].to(yp.dtype)                   # [T*K][D]
        return x.new_zeros(T, D).index_add(0, order // self.K, rows.to(x.dtype))


class ScatterMoE(torch.nn.Module):
    """ScatterMoE's GLUMLP (github.com/shawntan/scattermoe: weights [E][out][in], its gate/up output split
    as (up, gate) by chunk(2)), routed as the own layer (fp32 router, softmax top-k renormalised)"""

    def __init__(self, router, w13, w2, K):
        super().__init__()
        from scattermoe.mlp import GLUMLP
        E, F2, D = w13.shape
        F = F2 // 2
        self.router = torch.nn.Parameter(router.detach().to(torch.float32, copy=True))  # [E][D] fp32
        self.mlp = GLUMLP(D, F, E, K).to(device=w13.device, dtype=w13.dtype)
        with torch.no_grad():
            self.mlp.experts.weight.copy_(torch.cat([w13[:, F:], w13[:, :F]], 1))  # [E][2F][D] up first
            self.mlp.output_experts.weight.copy_(w2)                                # [E][D][F]
        self.K = K

    def forward(self, x):  # x [T][D] -> y [T][D]
        with torch.autocast(x.device.type, enabled=False):
            probs = torch.softmax(x.float() @ self.router.t(), -1)                   # [T][E] fp32
        top, ids = torch.topk(probs, self.K, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        return self.mlp(x, top.to(x.dtype), ids)


def autocast_dtype(dev):
    """the dtype torch.autocast computes matrix products in on dev's type now, or None (autocast off)"""
    try:  # torch >= 2.4
        return torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else None
    except (AttributeError, TypeError):  # older: one call per device type
        if dev.type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def step_fn(mod, x, dy, style, amp=None):
    """one forward + backward; (y, dx). amp: a dtype, the forward under torch.autocast to it and the
    backward outside, as torch's AMP documentation says (backward ops run in the dtype autocast chose for
    their forward ops)"""
    xi = x.detach().requires_grad_()
    with torch.autocast(x.device.type, dtype=amp) if amp is not None else contextlib.nullcontext():
        out = mod(xi.unsqueeze(0)) if style == "hf" else mod(xi)
        y = out[0] if isinstance(out, tuple) else out
        y = y.reshape(x.shape)
    y.backward(dy.to(y.dtype))
    return y.detach(), xi.grad


def device_used(dev):
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    return total - free


def time_peer(name, make, x, dy, style, amp, reps, dev):
    """(median seconds, bytes, y, dx) of a peer built by make(), its forward under autocast to amp if given"""
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    base = device_used(dev)
    mod = make()
    if getattr(mod, "shared_weights", False):  # built before base: its weights counted here
        base -= sum(p.numel() * p.element_size() for p in mod.parameters())
    ts, y, dx = [], None, None
    for i in range(reps + 2):
        for p in mod.parameters():
            p.grad = None
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        y, dx = step_fn(mod, x, dy, style, amp)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= 2:
            ts.append(time.perf_counter() - t0)
    used = device_used(dev) - base
    for p in mod.parameters():
        p.grad = None
    del mod
    gc.collect()
    return statistics.median(ts), used, y.float(), dx.float()


def bench_cuda_row(path, s, reps):
    """moept's C API: bench_cuda's step time at the shape (default GEMM form)"""
    args = [path, "--tokens", str(s["T"]), "--hidden", str(s["D"]), "--ffn", str(s["F"]), "--experts",
            str(s["E"]), "--topk", str(s["K"]), "--bf16", "--gemm-form", "auto", "--reps", str(reps)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300).stdout
    m = re.search(r"RESULT tokens=.*?step_ms=([0-9.]+)", out)
    return float(m.group(1)) / 1e3 if m else None


def hf_copy(blk, s, dtype, dev):
    """transformers' block at shape s holding blk's weights in dtype (bf16 values are exact in fp32)"""
    b, _ = hf_block(s, dtype, dev)
    with torch.no_grad():
        for p, q in zip(b.parameters(), blk.parameters()):
            p.copy_(q)
    return b


def run_shape(a, name, s, dev, dtype, rows):
    import transformers
    torch.manual_seed(1)
    T, D, F, E, K = s["T"], s["D"], s["F"], s["E"], s["K"]
    x = torch.randn(T, D, device=dev).to(dtype)
    dy = (torch.randn(T, D, device=dev) * 0.01).to(dtype)
    flops = 6.0 * T * K * 3 * D * F  # forward (2 per multiply-add) + backward (twice that), 3 GEMMs
    blk, cfg = hf_block(s, dtype, dev)
    blk32 = hf_copy(blk, s, torch.float32, dev)  # the autocast rows' fp32 parameters, the same values
    short = str(dtype).replace("torch.", "").replace("bfloat", "bf").replace("float", "fp")
    pure, amp = f", {short} params", ", fp32 params + autocast"
    peers = []  # (label, make, style, autocast dtype or None, regime: "pure", "moept" or "amp")

    def hf_peers(b, suffix, amp_dtype, regime):
        for impl in hf_impls(b):
            def make(impl=impl):
                b.shared_weights = True  # built before the peer's base: time_peer counts its weights
                if impl not in ("eager", "eager (4.x)"):
                    b.experts.config._experts_implementation = impl
                return b
            peers.append((f"transformers {transformers.__version__} {impl}{suffix}", make, "hf", amp_dtype,
                          regime))

    loop = "" if dev.type == "cuda" else ", torch.mm loop"
    hf_peers(blk, pure, None, "pure")
    peers.append((f"grouped_mm (own layer){loop}{pure}", lambda: GroupedMM(*expert_weights(blk, F), K),
                  "own", None, "pure"))
    if dev.type == "cuda":  # (a row saying why where its package or Triton is missing)
        peers.append((f"ScatterMoE (Triton){pure}", lambda: ScatterMoE(*expert_weights(blk, F), K), "own",
                      None, "pure"))
    ldtype = dtype if dev.type == "cuda" else torch.float32
    mixed = ", fp32 masters + bf16 copies" if ldtype == torch.bfloat16 else ", fp32"

    def make_moept():
        return mt.MoeptMoE(blk, cfg, layer_idx=0, device=dev, dtype=ldtype, max_tokens=T, lib=a.lib,
                           hf_outputs=False)
    peers.append(("moept (moept_torch)" + mixed, make_moept, "hf", None, "moept"))
    hf_peers(blk32, amp, torch.bfloat16, "amp")
    peers.append((f"grouped_mm (own layer){loop}{amp}",
                  lambda: GroupedMM(*expert_weights(blk, F), K, dtype=torch.float32), "own", torch.bfloat16,
                  "amp"))
    results, ref = [], None
    for pname, make, style, amp_dtype, regime in peers:
        try:
            t, used, y, dx = time_peer(pname, make, x, dy, style, amp_dtype, a.reps, dev)
        except Exception as e:  # a peer this install cannot run: a row saying why
            results.append((pname, None, None, None, None, f"{type(e).__name__}: {str(e)[:80]}", regime))
            continue
        finally:
            for hb in (blk, blk32):  # as they were, also after a peer that raised mid-step
                if hasattr(hb.experts, "config"):
                    hb.experts.config._experts_implementation = "eager"
                for p in hb.parameters():
                    p.grad = None
        if ref is None:
            ref = (y, dx)
        dif = [float((u - v).abs().max()) for u, v in zip((y, dx), ref)]
        rel = [float((u - v).norm() / v.norm()) for u, v in zip((y, dx), ref)]
        results.append((pname, t, used, dif, rel, "", regime))
    if a.bench_cuda and dev.type == "cuda" and os.path.exists(a.bench_cuda):  # above the module's row
        t = bench_cuda_row(a.bench_cuda, s, a.reps)
        at = [r[6] for r in results].index("moept")
        results.insert(at, ("moept (C API, bench_cuda)" + mixed, t, None, None, None,
                            "" if t else "no RESULT line", "moept"))
    best = min(r[1] for r in results if r[1])
    print(f"\n{name}: T {T}, D {D}, F {F}, E {E}, K {K}, x and dy {short}, "
          f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}")
    if dev.type == "cuda":
        legend = ["bf16 params: the weights, their gradients and the GEMMs bf16. fp32 params + autocast:",
                  "fp32 weights and gradients, the forward under torch.autocast(\"cuda\", bf16), the "
                  "backward outside.",
                  "moept's layer holds fp32 masters and gradients with bf16 copies inside, x and y bf16:",
                  "compare its rows with the fp32 params + autocast rows below them (memory: parameters and "
                  "gradients included)"]
    else:
        legend = ["fp32 params: all fp32, held to 1e-5 of the first row. fp32 params + autocast: the forward",
                  f"under torch.autocast(\"cpu\", bf16), the backward outside, held to {AMP_BOUND:.1e} (bf16 "
                  "GEMMs)"]
    print("\n".join("  " + line for line in legend))
    w = max(44, max(len(r[0]) for r in results))
    print(f"  {'peer':{w}s} {'ms':>9s} {'TFLOP/s':>8s} {'mem GiB':>8s} {'x best':>7s}  "
          f"y max|diff| (rel)    dx max|diff| (rel)")
    for pname, t, used, dif, rel, why, regime in results:
        if t is None:
            print(f"  {pname:{w}s} {'-':>9s}  unavailable: {why}")
            continue
        mem = f"{used / 2**30:8.2f}" if used is not None else f"{'-':>8s}"
        cmp = (f"  {dif[0]:9.2e} ({rel[0]:7.1e})  {dif[1]:9.2e} ({rel[1]:7.1e})" if dif else
               "  (own weights: not compared)")
        print(f"  {pname:{w}s} {t * 1e3:9.3f} {flops / t / 1e12:8.1f} {mem} {t / best:7.2f}{cmp}")
        rows.append((name, pname, t, used, rel, regime))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=None, help="mixtral, deepseek, qwen3, olmoe, tiny, all (default: all "
                    "on CUDA, tiny on the CPU)")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lib", default=None)
    ap.add_argument("--bench-cuda", default=os.path.join("build", "bench_cuda"))
    ap.add_argument("--peers", default=os.path.join("build", "peers"),
                    help="a directory holding peers' packages (scattermoe), put first on sys.path")
    a = ap.parse_args()
    if os.path.isdir(a.peers):
        sys.path.insert(0, os.path.abspath(a.peers))
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("skip - bench_peers --device cuda: torch sees no GPU")
        return 0
    a.lib = mt.load_library(a.lib, cuda=dev.type == "cuda")
    shapes = a.shape or ("all" if dev.type == "cuda" else "tiny")
    names = ["mixtral", "deepseek", "qwen3", "olmoe"] if shapes == "all" else shapes.split(",")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for n in names:
        s = dict(SHAPES[n])
        if a.tokens:
            s["T"] = a.tokens
        run_shape(a, n, s, dev, dtype, rows)
    if dev.type == "cpu":  # the smoke mode: every peer that ran agrees with transformers
        ran = [r for r in rows if r[4] is not None]
        bad = [r for r in ran if max(r[4]) > (AMP_BOUND if r[5] == "amp" else 1e-5)]
        n_amp = sum(r[5] == "amp" for r in ran)
        ok = not bad and len(ran) - n_amp >= 2 and n_amp >= 2
        not_ok = "" if not bad else f" (not: {', '.join(r[1] for r in bad)})"
        print(("ok" if ok else "FAIL") + f" - bench_peers --device cpu: {len(ran) - n_amp} peers ran in "
              f"fp32, y and dx within 1e-5 (relative) of transformers'; {n_amp} with fp32 params under "
              f"autocast (bf16), within {AMP_BOUND:.1e}" + not_ok)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
