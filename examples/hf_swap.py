#!/usr/bin/env python3
"""hf_swap: every MoE block of a transformers Mixtral, Qwen2-MoE or OLMoE
swapped for moept (CPU layers, through ctypes), trained with torch's AdamW on
HF's exact objective.

    make build/libmoept.so
    python3 examples/hf_swap.py [--family mixtral|qwen2_moe|olmoe] [--steps 40] [--check]
                                [--lib build/libmoept.so] [--layers 2] [--hidden 32] [--ffn 64]
                                [--shared-ffn 64] [--experts 4] [--topk 2] [--norm-topk]
                                [--vocab 64] [--batch 4] [--seq 16]

The glue, for any model whose MoE block is one module (`model.layers[i].mlp`
in all three; FAMILIES below holds what differs: the block class, the moept
config, and where each moept parameter lives in the HF block):
  - the library's struct layout is checked against the ctypes mirrors below
    before any other call (moept_abi_layout; a mismatch stops the program);
  - one moept layer per block, its weights copied in under HF names
    (moept_set_param), its parameters viewed as torch tensors in place
    (moept_param_info_at: data pointer and shape), so torch's optimizer,
    clipping and state dict see them;
  - a torch.autograd.Function whose forward calls moept_forward_ex and
    returns y and the router's logits (opts.logits_out), and whose backward
    calls moept_backward_ex with dy and the gradient autograd brings to
    those logits (opts.dlogits), giving dx (the gradients moept accumulated
    are handed to autograd as the parameters' gradients);
  - the aux loss: transformers adds router_aux_loss_coef times
    load_balancing_loss_func over every layer's router logits concatenated
    (output_router_logits=True), which no per-layer loss equals (see "AUX
    AGAINST TRANSFORMERS" in moept.h). So moept's aux is off
    (MOEPT_AUX_NONE), transformers' own function runs on the logits moept
    returned, and its gradient on them goes back into moept's backward,
    which carries it to the router weight and x. Qwen2-MoE and OLMoE add the
    same term (same function); transformers' OLMoE adds no router z-loss.
  - Qwen2-MoE's shared expert and its sigmoid gate are inside moept's layer
    (shared_intermediate_size, shared_gate); norm_topk_prob maps to
    MOEPT_NORM_ON / MOEPT_NORM_OFF (Mixtral always renormalises).
With --check the original HF model trains beside the swapped one from the
same init and batches: it prints the largest per-step loss difference, the
step-1 gradient error, tokens routed differently, and the MoE block's time,
forward + backward, moept against HF's block (same run, same input), and
exits 1 if a step's loss, or a step-1 gradient relative to the largest,
differs by more than --tol (1e-5).
"""
import argparse
import copy
import ctypes as C
import os
import sys
import time

import torch
from transformers import (MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM)
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

ABI_VERSION = 1  # moept.h's MOEPT_ABI_VERSION these mirrors follow
MOEPT_FAMILY_MIXTRAL, MOEPT_FAMILY_QWEN2_MOE, MOEPT_FAMILY_OLMOE = 0, 1, 2
MOEPT_AUX_NONE, MOEPT_NORM_ON, MOEPT_NORM_OFF, MOEPT_SHARED_GATE_SIGMOID = 0, 1, -1, 2


class moept_config(C.Structure):
    _fields_ = [("family", C.c_int), ("hidden_size", C.c_int64), ("intermediate_size", C.c_int64),
                ("num_experts", C.c_int64), ("top_k", C.c_int64), ("norm_topk_prob", C.c_int),
                ("activation", C.c_int), ("shared_intermediate_size", C.c_int64), ("shared_gate", C.c_int),
                ("n_group", C.c_int64), ("topk_group", C.c_int64), ("routed_scaling_factor", C.c_float),
                ("aux_loss", C.c_int), ("aux_loss_coef", C.c_float), ("group_fill", C.c_int),
                ("aux_seq_len", C.c_int64), ("z_loss_coef", C.c_float), ("capacity_factor", C.c_float),
                ("max_tokens", C.c_int64), ("global_balance", C.c_int), ("overlap_chunks", C.c_int64),
                ("expert_sharding", C.c_int), ("router_jitter", C.c_float), ("jitter_seed", C.c_uint64),
                ("inference_only", C.c_int), ("grad_backup", C.c_int), ("max_inflight", C.c_int64)]


class moept_forward_opts(C.Structure):
    _fields_ = [("mask", C.c_void_p), ("eval", C.c_int), ("replay_ids", C.c_void_p),
                ("logits_out", C.c_void_p), ("slot", C.c_int)]


class moept_backward_opts(C.Structure):
    _fields_ = [("router_loss_scale", C.c_float), ("dlogits", C.c_void_p), ("slot", C.c_int)]


class moept_param_info(C.Structure):
    _fields_ = [("name", C.c_char_p), ("rows", C.c_int64), ("cols", C.c_int64),
                ("data", C.c_void_p), ("grad", C.c_void_p), ("shard_offset", C.c_int64)]


MIRRORS = [moept_config, moept_forward_opts, moept_backward_opts, moept_param_info]


def check_abi(lib):
    """The library's layout of every mirrored struct, field by field, or SystemExit."""
    lib.moept_abi_layout.restype = C.c_int64
    lib.moept_abi_layout.argtypes = [C.c_char_p, C.c_int64]
    n = lib.moept_abi_layout(None, 0)
    buf = C.create_string_buffer(n + 1)
    lib.moept_abi_layout(buf, n + 1)
    sizes, fields, errs = {}, {}, []
    for line in buf.value.decode().splitlines():
        w = line.split()
        if w[0] == "abi" and int(w[1]) != ABI_VERSION:
            errs.append(f"ABI version {w[1]}, these mirrors follow {ABI_VERSION}")
        elif w[0] == "struct":
            sizes[w[1]] = int(w[2])
        elif w[0] == "field":
            s, f = w[1].split(".")
            fields.setdefault(s, []).append((f, int(w[2]), int(w[3])))
    for m in MIRRORS:
        s = m.__name__
        mine = [(f, getattr(m, f).offset, getattr(m, f).size) for f, _ in m._fields_]
        if sizes.get(s) != C.sizeof(m):
            errs.append(f"{s}: {C.sizeof(m)} bytes here, {sizes.get(s)} in the library")
        if mine != fields.get(s):
            errs.append(f"{s}: fields (name, offset, size) here {mine}, in the library {fields.get(s)}")
    if errs:
        sys.exit("hf_swap: the library's ABI differs from this binding:\n  " + "\n  ".join(errs))


def load_lib(path):
    lib = C.CDLL(path)
    check_abi(lib)  # before any other call
    P, I64 = C.c_void_p, C.c_int64
    sig = {"moept_config_default": ([C.c_int], moept_config),
           "moept_create": ([C.POINTER(moept_config), C.POINTER(P)], C.c_int),
           "moept_destroy": ([P], None),
           "moept_set_param": ([P, C.c_char_p, P, I64], C.c_int),
           "moept_param_count": ([P], I64),
           "moept_param_info_at": ([P, I64, C.POINTER(moept_param_info)], C.c_int),
           "moept_forward_ex": ([P, P, I64, P, C.POINTER(moept_forward_opts)], C.c_int),
           "moept_backward_ex": ([P, P, P, P, C.POINTER(moept_backward_opts)], C.c_int),
           "moept_zero_grad": ([P], C.c_int),
           "moept_routing": ([P, C.POINTER(C.POINTER(C.c_int32)), P, P], C.c_int),
           "moept_last_error": ([P], C.c_char_p)}
    for name, (args, res) in sig.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, res
    return lib


class Moept:
    """One moept layer: calls that raise on failure, parameters and gradients as torch views."""

    def __init__(self, lib, cfg):
        self.lib, self.h, self.k, self.E = lib, C.c_void_p(), cfg.top_k, cfg.num_experts
        self.ok(lib.moept_create(C.byref(cfg), C.byref(self.h)))
        self.names, self.params, self.grads = [], [], []
        for i in range(lib.moept_param_count(self.h)):
            info = moept_param_info()
            self.ok(lib.moept_param_info_at(self.h, i, C.byref(info)))
            self.names.append(info.name.decode())
            self.params.append(self.view(info.data, info.rows, info.cols))
            self.grads.append(self.view(info.grad, info.rows, info.cols))

    @staticmethod
    def view(ptr, rows, cols):  # the layer's own memory, no copy
        return torch.frombuffer((C.c_float * (rows * cols)).from_address(ptr),
                                dtype=torch.float32).view(rows, cols)

    def ok(self, status):
        if status != 0:
            raise RuntimeError("moept: " + self.lib.moept_last_error(None).decode())

    def set_param(self, name, t):
        t = t.detach().to(torch.float32).contiguous()
        self.ok(self.lib.moept_set_param(self.h, name.encode(), t.data_ptr(), t.numel()))

    def __del__(self):
        if self.h:
            self.lib.moept_destroy(self.h)


class _MoeptFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer, *params):  # x [T][D] fp32 -> y [T][D], logits [T][E] fp32
        x = x.detach().contiguous()
        y, logits = torch.empty_like(x), x.new_empty(x.shape[0], layer.E)
        o = moept_forward_opts(None, 0, None, logits.data_ptr())
        layer.ok(layer.lib.moept_forward_ex(layer.h, x.data_ptr(), x.shape[0], y.data_ptr(), C.byref(o)))
        ctx.layer = layer
        ctx.save_for_backward(x)
        return y, logits

    @staticmethod
    def backward(ctx, dy, dlogits):  # dlogits: the gradient of the caller's router loss (zeros: none)
        (x,), layer = ctx.saved_tensors, ctx.layer
        dy, dx, dlogits = dy.contiguous(), torch.empty_like(x), dlogits.contiguous()
        o = moept_backward_opts(1.0, dlogits.data_ptr())
        layer.ok(layer.lib.moept_zero_grad(layer.h))  # this call's gradients only: autograd sums them
        layer.ok(layer.lib.moept_backward_ex(layer.h, x.data_ptr(), dy.data_ptr(), dx.data_ptr(),
                                             C.byref(o)))
        return (dx, None, *[g.clone() for g in layer.grads])


def mixtral_source(block, name, F):
    """(HF parameter, its slice) holding moept's Mixtral parameter `name`"""
    w, ex = name.split("."), block.experts  # gate_up_proj [E][2F][D], down_proj [E][D][F]
    if w[0] != "experts":
        return block.get_parameter(name), lambda t: t
    e = int(w[1])
    return {"w1": (ex.gate_up_proj, lambda t: t[e, :F]), "w3": (ex.gate_up_proj, lambda t: t[e, F:]),
            "w2": (ex.down_proj, lambda t: t[e])}[w[2]]


def experts_source(block, name, F):
    """(HF parameter, its slice) for Qwen2-MoE's and OLMoE's names: gate_proj and up_proj are the halves
    of gate_up_proj; the router and the shared expert and its gate have moept's names"""
    w, ex = name.split("."), block.experts
    if w[0] != "experts":
        return block.get_parameter(name), lambda t: t
    e = int(w[1])
    return {"gate_proj": (ex.gate_up_proj, lambda t: t[e, :F]),
            "up_proj": (ex.gate_up_proj, lambda t: t[e, F:]),
            "down_proj": (ex.down_proj, lambda t: t[e])}[w[2]]


def mixtral_cfg(cfg, c):
    cfg.intermediate_size, cfg.num_experts = c.intermediate_size, c.num_local_experts


def qwen2_moe_cfg(cfg, c):
    cfg.intermediate_size, cfg.num_experts = c.moe_intermediate_size, c.num_experts
    cfg.shared_intermediate_size = c.shared_expert_intermediate_size
    cfg.shared_gate = MOEPT_SHARED_GATE_SIGMOID
    cfg.norm_topk_prob = MOEPT_NORM_ON if c.norm_topk_prob else MOEPT_NORM_OFF


def olmoe_cfg(cfg, c):
    cfg.intermediate_size, cfg.num_experts = c.intermediate_size, c.num_experts
    cfg.norm_topk_prob = MOEPT_NORM_ON if c.norm_topk_prob else MOEPT_NORM_OFF


def mixtral_model(a):
    return MixtralForCausalLM(MixtralConfig(intermediate_size=a.ffn, num_local_experts=a.experts,
                                            **common_config(a)))


def qwen2_moe_model(a):
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        intermediate_size=a.ffn, moe_intermediate_size=a.ffn, shared_expert_intermediate_size=a.shared_ffn,
        num_experts=a.experts, norm_topk_prob=a.norm_topk, decoder_sparse_step=1, **common_config(a)))


def olmoe_model(a):
    # no padding token: OLMoE's default (1) has a zero embedding, so a sequence starting with it gives x = 0,
    # equal logits and a tie that torch's topk breaks unlike moept (lower index; harmless: y = 0 either
    # way, but counted as routed apart); eos 50279 is outside the small vocabulary
    return OlmoeForCausalLM(OlmoeConfig(intermediate_size=a.ffn, num_experts=a.experts, pad_token_id=None,
                                        eos_token_id=None, norm_topk_prob=a.norm_topk, **common_config(a)))


def common_config(a):
    return dict(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=4,
                num_key_value_heads=2, num_experts_per_tok=a.topk, max_position_embeddings=a.seq,
                router_aux_loss_coef=a.aux_coef, output_router_logits=True, tie_word_embeddings=False,
                initializer_range=a.init)


# family: (moept family, HF MoE block class, the model, the moept config's sizes, where each parameter lives)
FAMILIES = {"mixtral": (MOEPT_FAMILY_MIXTRAL, MixtralSparseMoeBlock, mixtral_model, mixtral_cfg,
                        mixtral_source),
            "qwen2_moe": (MOEPT_FAMILY_QWEN2_MOE, Qwen2MoeSparseMoeBlock, qwen2_moe_model, qwen2_moe_cfg,
                          experts_source),
            "olmoe": (MOEPT_FAMILY_OLMOE, OlmoeSparseMoeBlock, olmoe_model, olmoe_cfg, experts_source)}


class MoeptBlock(torch.nn.Module):
    """Stands in for the family's sparse MoE block: same input and output, moept inside."""

    def __init__(self, lib, family, hf_block, hf_config, max_tokens):
        super().__init__()
        fam, _, _, set_sizes, self.source = FAMILIES[family]
        cfg = lib.moept_config_default(fam)
        cfg.hidden_size, cfg.top_k = hf_config.hidden_size, hf_config.num_experts_per_tok
        cfg.max_tokens = max_tokens
        set_sizes(cfg, hf_config)
        cfg.aux_loss = MOEPT_AUX_NONE  # HF's cross-layer aux is computed in torch (hf_aux_loss)
        self.moe, self.F = Moept(lib, cfg), cfg.intermediate_size
        for name in self.moe.names:
            param, part = self.source(hf_block, name, self.F)
            self.moe.set_param(name, part(param))
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(p) for p in self.moe.params)
        self.logits = None

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        y, logits = _MoeptFn.apply(x, self.moe, *self.weights)
        self.logits = logits if self.training else None  # hf_aux_loss reads them
        return y.reshape(shape)


def hf_aux_loss(blocks, config):
    """transformers' aux term (all three families): router_aux_loss_coef * load_balancing_loss_func over
    every MoE layer (Qwen2-MoE's dense layers have no router)."""
    logits = tuple(b.logits for b in blocks)
    return config.router_aux_loss_coef * load_balancing_loss_func(
        logits, blocks[0].moe.E, config.num_experts_per_tok, None)


def swap_blocks(model, lib, family, max_tokens):
    """every layer's MoE block (an instance of the family's class) for a MoeptBlock"""
    blocks = []
    for layer in model.model.layers:
        if isinstance(layer.mlp, FAMILIES[family][1]):
            layer.mlp = MoeptBlock(lib, family, layer.mlp, model.config, max_tokens)
            blocks.append(layer.mlp)
    return blocks


def moe_grad_pairs(hf, swapped):
    """(moept gradient, HF gradient of the same weights) for every MoE parameter."""
    for hl, ml in zip(hf.model.layers, swapped.model.layers):
        if isinstance(ml.mlp, MoeptBlock):
            for name, p in zip(ml.mlp.moe.names, ml.mlp.weights):
                param, part = ml.mlp.source(hl.mlp, name, ml.mlp.F)
                yield p.grad, part(param.grad)


def grad_error(hf, swapped):
    """max |g - g_hf| / max |g_hf| over the MoE blocks' weights, and over every other weight"""
    def rel(pairs):
        num = max(float((a - b).abs().max()) for a, b in pairs)
        return num / max(float(b.abs().max()) for _, b in pairs)
    moe = list(moe_grad_pairs(hf, swapped))
    named = dict(swapped.named_parameters())
    rest = [(named[n].grad, p.grad) for n, p in hf.named_parameters() if ".mlp." not in n]
    return rel(moe), rel(rest)


def routed_apart(blocks):
    """tokens whose moept top-k differs from torch's top-k of the logits moept returned"""
    n = 0
    for b in blocks:
        ids = C.POINTER(C.c_int32)()
        b.moe.ok(b.moe.lib.moept_routing(b.moe.h, C.byref(ids), None, None))
        T, K = b.logits.shape[0], b.moe.k
        mine = torch.tensor(ids[:T * K], dtype=torch.int64).view(T, K)
        ref = torch.topk(torch.softmax(b.logits.detach(), -1), K, dim=-1).indices
        n += int((mine.sort(-1).values != ref.sort(-1).values).any(-1).sum())
    return n


def block_times(hf_block, moept_block, x, reps):
    """seconds per forward + backward of each block on x, interleaved, best of reps (eval mode:
    the blocks alone, without the aux loss)"""
    best = [float("inf"), float("inf")]
    hf_block.eval(), moept_block.eval()
    dy = torch.randn_like(x)
    for _ in range(reps):
        for i, blk in enumerate((hf_block, moept_block)):
            xi = x.detach().requires_grad_()
            t0 = time.perf_counter()
            blk(xi).backward(dy)
            best[i] = min(best[i], time.perf_counter() - t0)
    hf_block.train(), moept_block.train()
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=list(FAMILIES), default="mixtral")
    ap.add_argument("--lib", default=os.path.join(os.path.dirname(__file__), "..", "build", "libmoept.so"))
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
    ap.add_argument("--tol", type=float, default=1e-5)
    a = ap.parse_args()

    lib = load_lib(a.lib)
    torch.manual_seed(0)
    hf = FAMILIES[a.family][2](a).float()
    config = hf.config
    model = copy.deepcopy(hf)
    blocks = swap_blocks(model, lib, a.family, a.batch * a.seq)
    models = [model] + ([hf] if a.check else [])
    opts = [torch.optim.AdamW(m.parameters(), lr=a.lr, foreach=False) for m in models]
    gen = torch.Generator().manual_seed(1)
    worst, grads, apart = 0.0, None, 0
    for step in range(1, a.steps + 1):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)
        losses = []
        for m, opt in zip(models, opts):
            opt.zero_grad()
            if m is hf:   # transformers' own objective: LM loss + coef * aux over all layers
                loss = m(input_ids=ids, labels=ids, output_router_logits=True).loss
            else:
                loss = m(input_ids=ids, labels=ids, output_router_logits=False).loss
                loss = loss + hf_aux_loss(blocks, config)
            loss.backward()
            losses.append(float(loss.detach()))
        if a.check:
            worst = max(worst, abs(losses[0] - losses[1]))
            apart += routed_apart(blocks)
            if step == 1:
                grads = grad_error(hf, model)
        for opt in opts:
            opt.step()
        if step == 1 or step % 10 == 0 or step == a.steps:
            print(f"step {step:4d}  loss {losses[0]:.6f}" +
                  (f"  transformers {losses[1]:.6f}  diff {losses[0] - losses[1]:+.2e}" if a.check else ""))
    if not a.check:
        return 0
    x = torch.randn(a.batch, a.seq, a.hidden)
    t_hf, t_mo = block_times(hf.model.layers[0].mlp, model.model.layers[0].mlp, x, 30)
    print(f"largest per-step loss difference over {a.steps} steps: {worst:.3e}")
    print(f"step-1 gradient error (max |g - g_hf| / max |g_hf|): MoE blocks {grads[0]:.3e}, "
          f"other weights {grads[1]:.3e}")
    print(f"token-layer routings that differ (moept vs torch top-k, all steps): {apart}")
    print(f"MoE block forward+backward, {a.batch * a.seq} tokens: transformers {t_hf * 1e3:.3f} ms, "
          f"moept {t_mo * 1e3:.3f} ms, ratio HF/moept {t_hf / t_mo:.2f}")
    ok = [worst <= a.tol, max(grads) <= a.tol]
    print(f"{'ok' if ok[0] else 'FAIL'} - per-step loss within {a.tol:g} of transformers over "
          f"{a.steps} steps (largest {worst:.2e})")
    print(f"{'ok' if ok[1] else 'FAIL'} - step-1 gradients within {a.tol:g} of transformers' (relative to "
          f"the largest; {max(grads):.2e})")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
