#!/usr/bin/env python3
"""test_torch_contract: moept_torch under ordinary PyTorch use (CPU layers; a few seconds).

    python3 tests/test_torch_contract.py [--lib PATH] [--module DIR] [--only NAME] [--backend B]

What a PyTorch user does without reading the docs, each against torch's own behaviour or the unswapped
transformers model:
  - lifetime: state_dict values, a kept parameter and an optimizer outlive the module (each in a child
    process, so a crash is a failure, not the end of the run), and a later layer does not reuse them;
  - checks before any pointer crosses: a width other than hidden_size, 0-d, more than max_tokens, 0 tokens;
    a non-finite weight named by the module's own parameter name;
  - autograd: an in-place write (optimizer.step, load_state_dict) between a forward and its backward
    raises as torch's layers do; vector_to_parameters (p.data = ...) keeps the parameters moept's;
    gradient checkpointing (reentrant and not) with hf_aux_loss gives transformers' router gradient;
    eval() with grad enabled has no jitter, train() has HF's; a rejected forward leaves the pending
    backward as it was; 4 threads x 25 forwards equal the serial ones bitwise; deepcopy is independent;
  - .grad is the layer's own gradient buffer (no per-backward copy); accumulation and set_to_none work;
  - HF conventions: Mixtral's parameter order (an AdamW state moved both ways), fused=True on a 4.x
    block returns 4.x's (y, logits), stats() as a dict;
  - torch.compile (torch >= 2.4; skip before): the block is one custom op of the graph, no graph break, and
    compiled forward and backward give eager's values (--backend: aot_eager, or inductor).
--module DIR imports moept_torch.py from DIR (an older copy: shows which of these fail there; --only NAME
runs one test, as a crash ends the run).
Prints "ok - " / "FAIL - " lines; exits 1 on a failure.
"""
import argparse
import copy
import os
import subprocess
import sys
import threading

import torch

failed = 0
A = None  # the parsed arguments
mt = None  # the moept_torch under test


def ok(cond, msg):
    global failed
    failed += not cond
    print(("ok - " if cond else "FAIL - ") + msg, flush=True)


def raises(fn, exc, words=()):
    """fn() raises exc whose message holds every one of words"""
    try:
        fn()
    except exc as e:
        return all(w in str(e) for w in words)
    except Exception:  # noqa: BLE001 (another exception is a failure too)
        return False
    return False


def mixtral(seed=0, jitter=0.0, layers=2):
    import transformers as tf
    torch.manual_seed(seed)
    return tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        router_aux_loss_coef=0.02, output_router_logits=True, tie_word_embeddings=False,
        initializer_range=0.1, router_jitter_noise=jitter))


def block(model, i=0):
    layer = model.model.layers[i]
    return getattr(layer, "block_sparse_moe", None) or layer.mlp


def layer(hf=None, **kw):
    """hf and a MoeptMoE of its first block, returning (y, logits) under any transformers"""
    hf = hf or mixtral()
    return hf, mt.MoeptMoE(block(hf), hf.config, layer_idx=0, max_tokens=64, lib=A.lib,
                           **dict(dict(hf_outputs=True), **kw))


def child(code, tail=True):
    """code run in a fresh python with moept_torch imported as mt: (exit status, its last output line, or
    every line)"""
    pre = (f"import sys, gc, io, torch; sys.path.insert(0, {A.module!r}); import moept_torch as mt; "
           f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
           f"import test_torch_contract as tc; tc.setup({A.lib_path!r}, {A.module!r})\n")
    r = subprocess.run([sys.executable, "-c", pre + code], capture_output=True, text=True, timeout=300)
    lines = (r.stdout + r.stderr).strip().splitlines()
    return r.returncode, (lines[-1:] or [""]) if tail else lines


def test_lifetime():
    cases = {
        "state_dict() kept, the module deleted, torch.save": """
hf, m = tc.layer()
sd = m.state_dict(); ref = {k: v.clone() for k, v in sd.items()}
del m; gc.collect()
junk = [tc.layer()[1] for _ in range(3)]  # layers made after: their memory is not sd's
torch.save(sd, io.BytesIO())
sys.exit(0 if all(torch.equal(sd[k], ref[k]) for k in ref) else 3)""",
        "optimizer.step() after the module is deleted": """
hf, m = tc.layer()
opt = torch.optim.AdamW(m.parameters(), lr=0.1)
m(torch.randn(8, 32))[0].square().sum().backward()
w = [p.detach().clone() for p in m.parameters()]
del m; gc.collect()
junk = [tc.layer()[1] for _ in range(3)]
opt.step()
ps = opt.param_groups[0]["params"]
sys.exit(0 if all(not torch.equal(p, q) and torch.isfinite(p).all() for p, q in zip(ps, w)) else 3)""",
        "a kept m.gate.weight, the module deleted, new layers made": """
hf, m = tc.layer()
g = m.gate.weight; ref = g.detach().clone()
del m; gc.collect()
junk = [tc.layer(tc.mixtral(seed=5))[1] for _ in range(3)]
sys.exit(0 if torch.equal(g.detach(), ref) else 3)""",
    }
    cases["the layer is freed when the module and its last view are gone"] = """
import weakref
hf, m = tc.layer()
g = m.gate.weight; owner = weakref.ref(m._layer)
del m; gc.collect(); alive = owner() is not None
del g; gc.collect()
sys.exit(0 if alive and owner() is None else 3)"""
    # one child runs them in turn, each in a function of its own, printing its exit code; a crash ends
    # the child, and the cases it did not reach fail with it
    run = "try:\n    case{0}()\nexcept SystemExit as e:\n    print('case', {0}, e.code, flush=True)\n"
    body = "".join(f"def case{i}():\n" + "".join(f"    {ln}\n" for ln in code.strip().splitlines()) +
                   run.format(i) for i, code in enumerate(cases.values()))
    rc, out = child(body + "print('done')", tail=False)
    codes = {int(w[1]): int(w[2]) for w in (ln.split() for ln in out) if len(w) == 3 and w[0] == "case"}
    for i, what in enumerate(cases):
        ok(codes.get(i) == 0, f"lifetime: {what} (exit {codes.get(i, f'none: the child ended {rc}')})")


def test_checks():
    hf, m = layer(fused=False)
    x = torch.randn(4, 32)
    ok(raises(lambda: m(torch.randn(2, 8)), ValueError, ["hidden_size", "32"]) and
       raises(lambda: m(torch.randn(4, 64)), ValueError, ["hidden_size"]),
       "a width other than hidden_size ([2][8], [4][64] into a 32-wide layer): ValueError")
    ok(raises(lambda: m(torch.tensor(1.0)), ValueError, ["hidden_size"]), "a 0-d input: ValueError")
    ok(raises(lambda: m(torch.randn(65, 32)), ValueError, ["max_tokens"]), "more than max_tokens: ValueError")
    e = torch.randn(0, 32, requires_grad=True)
    y = m(e)[0]
    y.sum().backward()
    ok(tuple(y.shape) == (0, 32) and tuple(e.grad.shape) == (0, 32), "0 tokens: an empty y and dx")
    with torch.no_grad():
        m.experts[1].w1.weight[2, 3] = float("nan")
    ok(raises(lambda: m(x), RuntimeError, ["experts.1.w1.weight", "[2][3]"]),
       "a NaN weight is named (experts.1.w1.weight element [2][3])")
    hf, mf = layer(fused=True)
    with torch.no_grad():
        mf.experts.gate_up_proj[1, 48 + 2, 3] = float("inf")  # w3 (up) row 2 of expert 1
    ok(raises(lambda: mf(x), RuntimeError, ["experts.gate_up_proj", "[1][50][3]"]),
       "an Inf in a fused weight is named by the module's name (experts.gate_up_proj element [1][50][3])")


def test_inplace():
    hf, m = layer()
    x = torch.randn(8, 32)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(x)[0].sum().backward()
    y = m(x)[0]
    opt.step()
    ok(raises(lambda: y.sum().backward(), RuntimeError, ["inplace"]),
       "optimizer.step() between a forward and its backward: autograd's in-place error")
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    y = m(x)[0]
    m.load_state_dict(sd)
    ok(raises(lambda: y.sum().backward(), RuntimeError, ["inplace"]),
       "load_state_dict between a forward and its backward: autograd's in-place error")
    # vector_to_parameters assigns p.data: the values reach the layer, the parameters stay its memory
    ptrs = [p.data_ptr() for p in m.parameters()]
    vec = torch.nn.utils.parameters_to_vector(m.parameters()) * 0.5
    torch.nn.utils.vector_to_parameters(vec, m.parameters())
    hf2, ref = layer()
    with torch.no_grad():
        for p, q in zip(ref.parameters(), m.parameters()):
            p.copy_(q)
        same = torch.equal(m(x)[0], ref(x)[0])
    ok(same and [p.data_ptr() for p in m.parameters()] == ptrs,
       "vector_to_parameters: the layer computes with the new values, the parameters still its memory")


def router_grad(model, hf_loss, reentrant):
    """the routers' gradient of the LM loss + HF's aux; reentrant None: no checkpointing"""
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    model.train()
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if hf_loss:
        loss = model(input_ids=ids, labels=ids, output_router_logits=True).loss
    else:
        blocks = [block(model, i) for i in range(len(model.model.layers))]
        loss = model(input_ids=ids, labels=ids, output_router_logits=False).loss + \
            mt.hf_aux_loss(blocks, model.config)
    loss.backward()
    return torch.cat([block(model, i).gate.weight.grad.reshape(-1) for i in range(len(model.model.layers))])


def test_checkpointing():
    """against the unswapped model without checkpointing: transformers 5.x's own reentrant checkpointing
    loses part of the router's gradient (its hooks record the no-grad pass's logits), 4.x's does not"""
    for reentrant in (True, False):
        hf = mixtral()
        model = copy.deepcopy(hf)
        mt.swap_moe_blocks(model, max_tokens=64, lib=A.lib)
        try:
            g, h = router_grad(model, False, reentrant), router_grad(hf, True, None)
            err = float((g - h).abs().max() / h.abs().max())
        except RuntimeError as e:
            err = str(e)
        ok(isinstance(err, float) and err <= 1e-5,
           f"gradient checkpointing ({'reentrant' if reentrant else 'non-reentrant'}) with hf_aux_loss: the "
           f"routers' gradient is transformers' without checkpointing "
           f"({err if isinstance(err, str) else f'{err:.1e}'})")


def test_jitter():
    hf = mixtral(jitter=0.2)
    _, m = layer(hf)
    hb = block(hf)
    x = torch.randn(2, 8, 32, requires_grad=True)
    m.eval()
    y1, y2 = m(x)[0], m(x)[0]
    with torch.no_grad():
        y3 = m(x)[0]
    ok(torch.equal(y1, y2) and torch.equal(y1, y3),
       "eval() with grad enabled: no jitter (y as under no_grad)")
    m.train(), hb.train()
    torch.manual_seed(7)
    ym = m(x)[0]
    torch.manual_seed(7)
    yh = hb(x.detach().clone())
    yh = yh[0] if isinstance(yh, tuple) else yh  # 4.x: (y, logits); 5.x: y
    err = float((ym - yh).abs().max() / yh.abs().max())
    ok(err <= 1e-5 and not torch.equal(ym, y1),
       f"train(): HF's jitter (the block's input times torch's noise), y as the HF block's ({err:.1e})")


def test_rejected():
    _, m = layer()
    _, ref = layer()
    x = torch.randn(8, 32, requires_grad=True)
    y = m(x)[0]
    bad = torch.randn(8, 32, requires_grad=True)
    with torch.no_grad():
        bad[3, 4] = float("nan")
    rejected = raises(lambda: m(bad), RuntimeError, ["not finite"])
    y.square().sum().backward()
    xr = x.detach().clone().requires_grad_()
    ref(xr)[0].square().sum().backward()
    same = torch.equal(x.grad, xr.grad) and all(torch.equal(p.grad, q.grad) for p, q in
                                                zip(m.parameters(), ref.parameters()))
    ok(rejected and same, "a rejected forward, then the pending forward's backward: as if it had not run")


def test_threads():
    _, m = layer()
    xs = [torch.randn(3 + i % 5, 2, 32, generator=torch.Generator().manual_seed(i)) for i in range(100)]
    with torch.no_grad():
        serial = [m(x)[0] for x in xs]
    got = [None] * len(xs)

    def run(k):
        with torch.no_grad():
            for i in range(k, len(xs), 4):
                got[i] = m(xs[i])[0]
    ts = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    ok(all(g is not None and torch.equal(g, s) for g, s in zip(got, serial)),
       "4 threads x 25 forwards on one module: each equals its serial forward, bitwise")


def test_deepcopy():
    _, m = layer()
    x = torch.randn(8, 32)
    try:
        c = copy.deepcopy(m)
    except Exception as e:  # noqa: BLE001
        ok(False, f"deepcopy: {type(e).__name__}: {str(e)[:80]}")
        return
    with torch.no_grad():
        y = m(x)[0]
        same = torch.equal(c(x)[0], y)
        for p in c.parameters():
            p.mul_(0.5)
        ok(same and torch.equal(m(x)[0], y) and not torch.equal(c(x)[0], y) and
           all(p.data_ptr() != q.data_ptr() for p, q in zip(m.parameters(), c.parameters())),
           "deepcopy: the same y, then independent (writing the copy leaves the original)")


def test_grads():
    _, m = layer()
    _, ref = layer()
    xs = [torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for x in xs[:2]:
        m(x)[0].square().sum().backward()
    bound = all(p.grad.data_ptr() == g.data_ptr() for p, g in zip(m._params, m._grads))
    want = []
    for x in xs[:2]:  # each backward's own gradients
        ref.zero_grad(set_to_none=True)
        ref(x)[0].square().sum().backward()
        want.append([p.grad.clone() for p in ref.parameters()])
    acc = all(torch.allclose(p.grad, a + b, rtol=1e-6, atol=1e-7) for p, a, b in
              zip(m.parameters(), *want))
    ok(bound and acc, ".grad is the layer's gradient buffer (no copy a backward); 2 micro-batches accumulate")
    m.zero_grad(set_to_none=True)
    m(xs[1])[0].square().sum().backward()
    fresh = all(torch.equal(p.grad, w) for p, w in zip(m.parameters(), want[1]))
    m.zero_grad(set_to_none=False)
    zeroed = all(float(p.grad.abs().max()) == 0 for p in m.parameters())
    ok(fresh and zeroed, "zero_grad(set_to_none=True) then a backward: that backward's gradients; "
       "zero_grad(set_to_none=False) zeroes them")


def test_order():
    hf = mixtral()
    model = copy.deepcopy(hf)
    mt.swap_moe_blocks(model, max_tokens=64, lib=A.lib)
    names = [n for n, _ in model.named_parameters()]
    hnames = [n for n, _ in hf.named_parameters()]
    ok(names == hnames, "Mixtral: the swapped model's parameters in transformers' order (w1, w2, w3)")
    _, fresh = layer(mixtral())
    fresh = mt.MoeptMoE(None, hf.config, layer_idx=0, max_tokens=64, lib=A.lib)
    ok([n for n, _ in fresh.named_parameters()] == [n for n, _ in block(hf).named_parameters()],
       "Mixtral, built from the config alone: transformers' order too")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    errs = []
    for src, dst in ((hf, model), (model, hf)):  # one AdamW step on src, its state moved to dst
        a, b = copy.deepcopy(hf), copy.deepcopy(hf)
        if src is model:
            mt.swap_moe_blocks(a, max_tokens=64, lib=A.lib)
        if dst is model:
            mt.swap_moe_blocks(b, max_tokens=64, lib=A.lib)
        oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
        a(input_ids=ids, labels=ids, output_router_logits=False).loss.backward()
        oa.step()
        ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
        ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # torch 2.x's keeps the dict's tensors: not shared
        sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
        ok_shapes = all(sa[i]["exp_avg"].shape == p.shape for i, p in enumerate(b.parameters()))
        with torch.no_grad():
            for p, q in zip(b.parameters(), a.parameters()):
                p.copy_(q)
        for m_, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m_(input_ids=ids, labels=ids, output_router_logits=False).loss.backward()
            o.step()
        errs.append(max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))
                    if ok_shapes and sb else float("inf"))
    ok(max(errs) <= 1e-5, f"an AdamW state moved swapped -> transformers and back: the next step agrees "
       f"({errs[0]:.1e}, {errs[1]:.1e})")


def test_hf_outputs_and_stats():
    hf = mixtral()
    model = copy.deepcopy(hf)
    blocks = mt.swap_moe_blocks(model, max_tokens=64, lib=A.lib, fused=True)
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(4))
    try:
        with torch.no_grad():
            lm = model(input_ids=ids, output_router_logits=False).logits  # 5.x: its hooks see no router
            lh = hf(input_ids=ids, output_router_logits=False).logits
        err = float((lm - lh).abs().max())
    except (ValueError, RuntimeError) as e:
        err = str(e)[:80]
    ok(isinstance(err, float) and err <= 1e-5, f"fused=True on a transformers 4.x block: 4.x's (y, logits), "
       f"the model's logits as transformers' at batch 3 ({err if isinstance(err, str) else f'{err:.1e}'})")
    b = blocks[0]
    model(input_ids=ids, output_router_logits=False)
    try:
        s = b.stats()
        good = (isinstance(s, dict) and s["tokens"] == 48 and sum(s["tokens_per_expert"]) == 48 * 2 and
                len(s["tokens_per_expert"]) == 4 and s["param_bytes"] > 0 and
                s["host_bytes"]["params"] + s["host_bytes"]["grads"] == s["param_bytes"] and
                s["host_bytes"]["workspace"] > 0 and list(s["device_bytes"]) == list(mt.MEM_KINDS))
    except AttributeError:
        good = False
    ok(good, "stats(): moept's stats as a dict (tokens, tokens_per_expert, bytes; by kind, host and device)")


def test_compile():
    """torch.compile: the block is one op of the graph (moept::forward); compiled = eager"""
    if not hasattr(torch.library, "custom_op"):  # torch < 2.4
        print(f"skip - torch.compile: torch {torch.__version__} (moept's custom ops need torch >= 2.4)")
        return
    hf = mixtral()
    _, m = layer(hf, hf_outputs=True)  # (y, logits) under transformers 5.x too
    _, c = layer(hf, hf_outputs=True)
    if getattr(mt, "_OPS", None) is not True:  # set by the first layer
        ok(False, "torch.compile: moept_torch defines no custom ops (moept::forward, moept::backward)")
        return
    import torch._dynamo as dynamo
    be = A.backend
    x, mask = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(6)), torch.ones(2, 8)
    mask[1, 6:] = 0  # padding
    fn = torch.compile(c, backend=be, fullgraph=True)  # fullgraph: a graph break raises

    def run(mod, f, x_grad=True):
        xx = x.clone().requires_grad_(x_grad)
        y, logits = f(xx, attention_mask=mask)
        (y.square().sum() + logits.square().sum()).backward()
        return [y, logits] + ([xx.grad] if x_grad else []) + [p.grad.clone() for p in mod.parameters()]

    def err(a, b):
        return max(float((u - v).abs().max() / v.abs().max().clamp_min(1e-30)) for u, v in
                   zip([t.detach() for t in a], [t.detach() for t in b]))
    try:
        e = [err(run(c, fn), run(m, m))]
        m.zero_grad(set_to_none=True)
        c.zero_grad(set_to_none=True)
        e.append(err(run(c, fn, False), run(m, m, False)))  # no dx: the backward still runs (parameters)
        bound = all(p.grad.data_ptr() == g.data_ptr() for p, g in zip(c._params, c._grads))
        what = f"{e[0]:.1e}, {e[1]:.1e}"
    except Exception as ex:  # noqa: BLE001
        e, bound, what = [1.0], False, f"{type(ex).__name__}: {str(ex)[:150]}"
    ok(max(e) <= 1e-5 and bound, f"torch.compile(block, fullgraph=True, backend={be}): no graph break; y, "
       f"logits, dx and the gradients as eager's, padded, and with x taking no gradient ({what}); .grad is "
       "the layer's buffer")
    opt = torch.optim.SGD(c.parameters(), lr=0.1)
    y = fn(x)[0]
    opt.step()
    inplace = raises(lambda: y.sum().backward(), RuntimeError, ["inplace"])
    f2 = torch.compile(layer(hf, hf_outputs=True)[1], backend=be, fullgraph=True)
    y1 = f2(x)[0]
    f2(x)
    ok(inplace and raises(lambda: y1.sum().backward(), RuntimeError, ["overwritten", "max_inflight"]),
       "compiled: optimizer.step() before the backward raises (inplace); a reused slot too (max_inflight)")

    # a swapped Mixtral, torch.compile(model): the graphs call moept::forward once a layer and no graph
    # break is the block's; two training steps (SGD between: the graph sees the new weights) and a no_grad
    # forward as eager's
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    got = []
    for compiled in (False, True):
        model = copy.deepcopy(hf)
        blocks = mt.swap_moe_blocks(model, max_tokens=64, lib=A.lib)
        if compiled:
            dynamo.reset()
            ex = dynamo.explain(model)(input_ids=ids, labels=ids, output_router_logits=False)
            ops = sum(str(n.target).startswith("moept.forward") for g in ex.graphs for n in g.graph.nodes)
            ours = [b for b in ex.break_reasons if any("moept_torch" in f.filename for f in b.user_stack)]
        f = torch.compile(model, backend=be) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss = f(input_ids=ids, labels=ids, output_router_logits=False).loss + \
                mt.hf_aux_loss(blocks, model.config)
            loss.backward()
            out += [loss] + [p.grad.clone() for p in model.parameters()]
            opt.step()
        with torch.no_grad():
            out.append(f(input_ids=ids, output_router_logits=False).logits)
        got.append(out)
    ok(ops == len(model.model.layers) and not ours,
       f"torch.compile(model): moept::forward in the graphs once a layer ({ops}), no graph break in the "
       f"block ({len(ex.break_reasons)} in all: {[str(b.reason)[:60] for b in ex.break_reasons]})")
    e = err(got[1], got[0])
    ok(e <= 1e-5, f"torch.compile(model, backend={be}): two steps' losses and gradients, then a no_grad "
       f"forward's logits, as eager's ({e:.1e})")


def setup(lib_path, module):
    """moept_torch from `module`, its library at lib_path (child processes call this too)"""
    global A, mt
    sys.path.insert(0, module)
    import moept_torch
    mt = moept_torch
    A = argparse.Namespace(lib_path=lib_path, module=module, lib=mt.load_library(lib_path))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--lib", default=os.path.join(here, "..", "build", "libmoept.so"))
    ap.add_argument("--module", default=os.path.join(here, ".."))
    ap.add_argument("--only", default=None, help="one test by name (test_checks, ...)")
    ap.add_argument("--backend", default="aot_eager", help="test_compile's torch.compile backend (inductor: "
                    "the default one, slower to compile)")
    a = ap.parse_args()
    setup(os.path.abspath(a.lib), os.path.abspath(a.module))
    A.backend = a.backend
    import transformers
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, "
          f"moept_torch from {A.module}")
    for t in (test_lifetime, test_checks, test_inplace, test_checkpointing, test_jitter, test_rejected,
              test_threads, test_deepcopy, test_grads, test_order, test_hf_outputs_and_stats, test_compile):
        if a.only and t.__name__ != a.only:
            continue
        try:
            t()
        except Exception as e:  # noqa: BLE001 (an old module may fail anywhere: a failure, and on)
            ok(False, f"{t.__name__}: {type(e).__name__}: {str(e)[:100]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
