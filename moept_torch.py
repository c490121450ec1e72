"""moept_torch: a moept MoE layer as a torch.nn.Module, on the CPU or a CUDA GPU (one file, ctypes over
moept's shared library; no build against torch).

    make build/libmoept.so            # CPU layers
    make build/libmoept_cuda.so       # CUDA layers (nvcc, cuBLAS, NCCL): also runs CPU layers
    import moept_torch
    blocks = moept_torch.swap_moe_blocks(model, device="cuda", dtype=torch.bfloat16, max_tokens=B * S)
    moept_torch.set_padding_mask(blocks, attention_mask)        # optional: padding routed nowhere
    out = model(input_ids=ids, labels=ids, output_router_logits=False)
    loss = out.loss + moept_torch.hf_aux_loss(blocks, model.config, attention_mask)

docs/TORCH.md says what it does, what it checks and what it refuses; in short:
  - MoeptMoE(block, config) stands in for a transformers MoE block (Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3;
    transformers 4.40 to 4.4x's per-expert modules and 5.x's fused gate_up_proj / down_proj); sizes and
    routing from moept_config_from_hf on the block's config; weights copied in.
  - Its parameters are torch tensors viewing the layer's fp32 master weights (host memory, or the CUDA
    layer's device buffers), their .grad views of its gradients (moept's backward adds into them: no
    copy): torch's optimizer, clipping and state_dict see them, under the HF block's names and in its
    order; every such tensor keeps the layer alive; .to()/.cuda()/.half() cannot move or cast them (a
    move raises; a dtype cast leaves them fp32); an in-place write between a forward and its backward
    raises, as autograd does for torch's layers.
  - forward(x) -> y, with the router's logits kept (block.router_logits) and their gradient taken back
    (hf_aux_loss: transformers' own load_balancing_loss_func over every layer's logits); under
    transformers 4.x the block returns (y, logits) as HF's did, and HF's own loss adds the aux term.
  - every tensor's dtype, device, shape and layout is checked before its pointer crosses: a wrong dtype
    or device raises TypeError / ValueError; a non-contiguous tensor is copied (the one cast done).
  - calls on one module are serialised (thread-safe, not parallel); ep_group shards the experts over a
    torch.distributed group (CUDA layers: NCCL; CPU layers: the group's own collectives, e.g. gloo).
  - torch.compile (torch >= 2.4): the block is a custom op, moept::forward, in the graph (no graph break).
"""
import copy
import ctypes as C
import json
import os
import re
import tempfile
import threading
import weakref

import torch

ABI_VERSION = 1  # moept.h's MOEPT_ABI_VERSION these mirrors follow
MOEPT_AUX_NONE, MOEPT_DTYPE_F32, MOEPT_DTYPE_BF16 = 0, 0, 2
DTYPES = {torch.float32: MOEPT_DTYPE_F32, torch.bfloat16: MOEPT_DTYPE_BF16}
MEM_KINDS = ("params", "grads", "moments", "casts", "workspace")  # moept_mem_kind, in its order


class moept_config(C.Structure):
    _fields_ = [("family", C.c_int), ("hidden_size", C.c_int64), ("intermediate_size", C.c_int64),
                ("num_experts", C.c_int64), ("top_k", C.c_int64), ("norm_topk_prob", C.c_int),
                ("activation", C.c_int), ("shared_intermediate_size", C.c_int64), ("shared_gate", C.c_int),
                ("n_group", C.c_int64), ("topk_group", C.c_int64), ("routed_scaling_factor", C.c_float),
                ("aux_loss", C.c_int), ("aux_loss_coef", C.c_float), ("group_fill", C.c_int),
                ("aux_seq_len", C.c_int64), ("z_loss_coef", C.c_float), ("capacity_factor", C.c_float),
                ("max_tokens", C.c_int64), ("global_balance", C.c_int), ("overlap_chunks", C.c_int64),
                ("expert_sharding", C.c_int), ("router_jitter", C.c_float), ("jitter_seed", C.c_uint64),
                ("inference_only", C.c_int), ("grad_backup", C.c_int), ("max_inflight", C.c_int64),
                ("fp8", C.c_int)]


class moept_forward_opts(C.Structure):
    _fields_ = [("mask", C.c_void_p), ("eval", C.c_int), ("replay_ids", C.c_void_p),
                ("logits_out", C.c_void_p), ("slot", C.c_int)]


class moept_backward_opts(C.Structure):
    _fields_ = [("router_loss_scale", C.c_float), ("dlogits", C.c_void_p), ("slot", C.c_int)]


class moept_param_info(C.Structure):
    _fields_ = [("name", C.c_char_p), ("rows", C.c_int64), ("cols", C.c_int64),
                ("data", C.c_void_p), ("grad", C.c_void_p), ("shard_offset", C.c_int64),
                ("offset", C.c_int64)]


class moept_cuda_options(C.Structure):
    _fields_ = [("dtype", C.c_int), ("stream", C.c_void_p), ("unchecked_backward", C.c_int),
                ("sync_free", C.c_int), ("gemm_form", C.c_int)]


class moept_stats(C.Structure):
    _fields_ = [("steps", C.c_int64), ("tokens", C.c_int64), ("routed_rows", C.c_int64),
                ("dropped_rows", C.c_int64), ("masked_tokens", C.c_int64), ("capacity", C.c_int64),
                ("aux_loss", C.c_float), ("z_loss", C.c_float), ("allocations", C.c_int64),
                ("allocated_bytes", C.c_int64), ("workspace_bytes", C.c_int64), ("param_bytes", C.c_int64),
                ("rows_sent", C.c_int64), ("rows_received", C.c_int64), ("bytes_sent", C.c_int64),
                ("bytes_received", C.c_int64), ("comm_seconds", C.c_double), ("dispatch_seconds", C.c_double),
                ("combine_seconds", C.c_double), ("recv_capacity", C.c_int64), ("recv_growths", C.c_int64),
                ("checkpoint_bytes_read", C.c_int64), ("device_workspace_bytes", C.c_int64),
                ("shared_exchange", C.c_int64), ("host_bytes", C.c_int64 * len(MEM_KINDS)),
                ("device_bytes", C.c_int64 * len(MEM_KINDS))]


class moept_p2p(C.Structure):
    _fields_ = [("peer", C.c_int), ("buf", C.c_void_p), ("bytes", C.c_int64)]


_I64P = C.POINTER(C.c_int64)


class moept_comm_ops(C.Structure):
    _fields_ = [("alltoallv", C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, _I64P, C.c_void_p, _I64P)),
                ("allreduce", C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_int64, C.c_int)),
                ("allgather", C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_void_p, C.c_int64)),
                ("p2p", C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(moept_p2p), C.c_int,
                                    C.POINTER(moept_p2p), C.c_int)),
                ("barrier", C.CFUNCTYPE(C.c_int, C.c_void_p))]


class nccl_unique_id(C.Structure):  # nccl.h: ncclUniqueId, NCCL_UNIQUE_ID_BYTES 128
    _fields_ = [("internal", C.c_char * 128)]


MIRRORS = [moept_config, moept_forward_opts, moept_backward_opts, moept_param_info, moept_cuda_options,
           moept_stats, moept_p2p, moept_comm_ops]


def check_abi(lib):
    """The library's layout of every mirrored struct, field by field, or ImportError (before other calls)"""
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
        raise ImportError("moept_torch: the library's ABI differs from this binding:\n  " + "\n  ".join(errs))


_LIBS = {}


def load_library(path=None, cuda=False):
    """moept's shared library (once per path): `path`, else $MOEPT_LIB, else build/libmoept_cuda.so (cuda)
    or build/libmoept.so beside this file"""
    path = path or os.environ.get("MOEPT_LIB") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "build", "libmoept_cuda.so" if cuda else "libmoept.so")
    if path in _LIBS:
        return _LIBS[path]
    lib = C.CDLL(path)
    check_abi(lib)
    P, I64, S = C.c_void_p, C.c_int64, C.c_int
    sig = {"moept_config_from_hf": ([C.c_char_p, I64, C.POINTER(moept_config)], S),
           "moept_create": ([C.POINTER(moept_config), C.POINTER(P)], S),
           "moept_create_parallel": ([C.POINTER(moept_config), P, P, C.POINTER(P)], S),
           "moept_create_cuda": ([C.POINTER(moept_config), P, P, C.POINTER(moept_cuda_options),
                                  C.POINTER(P)], S),
           "moept_cuda_device_count": ([], S),
           "moept_cuda_params": ([P, C.POINTER(P), C.POINTER(P), C.POINTER(I64)], S),
           "moept_cuda_params_changed": ([P], S),
           "moept_destroy": ([P], None),
           "moept_set_param": ([P, C.c_char_p, P, I64], S),
           "moept_get_param": ([P, C.c_char_p, P, I64], S),
           "moept_param_count": ([P], I64),
           "moept_param_info_at": ([P, I64, C.POINTER(moept_param_info)], S),
           "moept_params": ([P, C.POINTER(P), C.POINTER(I64)], S),
           "moept_forward_ex": ([P, P, I64, P, C.POINTER(moept_forward_opts)], S),
           "moept_backward_ex": ([P, P, P, P, C.POINTER(moept_backward_opts)], S),
           "moept_zero_grad": ([P], S),
           "moept_get_stats": ([P, C.POINTER(moept_stats), P], S),
           "moept_routing": ([P, C.POINTER(C.POINTER(C.c_int32)), P, P], S),
           "moept_comm_destroy": ([P], None),
           "moept_comm_custom": ([C.POINTER(moept_comm_ops), P, S, S, C.POINTER(P)], S),
           "moept_last_error": ([P], C.c_char_p)}
    if hasattr(lib, "moept_comm_nccl"):  # CUDA builds
        sig["moept_comm_nccl"] = ([P, P, S, C.POINTER(P)], S)
        sig["moept_comm_nccl_aborted"] = ([P], S)
    for name, (args, res) in sig.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, res
    _LIBS[path] = lib
    return lib


class _Layer:
    """the C layer and what it uses (comms, an NCCL communicator): destroyed when the module and every
    tensor viewing the layer's memory (parameters, gradients, state_dict values) are gone"""

    def __init__(self, lib):
        self.lib, self.h, self.comms, self.nccl, self.keep = lib, C.c_void_p(), [], None, []

    def __del__(self):
        lib = self.lib
        if self.h:
            lib.moept_destroy(self.h)
            self.h = C.c_void_p()
        for c in self.comms:  # after the layer, which uses them
            aborted = lib.moept_comm_nccl_aborted(c) if self.nccl is not None else 0
            lib.moept_comm_destroy(c)
            if self.nccl is not None and not aborted:
                self.nccl[0].ncclCommDestroy(self.nccl[1])
        self.comms = []


def _host(ptr, n, dtype=torch.uint8):
    """n elements of host memory at ptr as a tensor (no copy; the caller keeps the memory)"""
    if not n:
        return torch.empty(0, dtype=dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((C.c_uint8 * (n * size)).from_address(ptr), dtype=dtype)


class _TorchCollectives:
    """moept_comm_ops over a torch.distributed group (host tensors: gloo); an op that raises returns 1
    and keeps its message (the moept call fails with MOEPT_ERR_COMM; _ok adds it)"""
    DTYPES = {0: torch.float32, 3: torch.float64, 4: torch.int64}  # moept_dtype F32, F64, I64

    def __init__(self, group):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.error = None

    @staticmethod
    def make(group):
        ctx = _TorchCollectives(group)
        T = {f: t for f, t in moept_comm_ops._fields_}
        ops = moept_comm_ops(*(T[f](ctx._guard(getattr(ctx, f))) for f, _ in moept_comm_ops._fields_))
        return ops, ctx

    def _guard(self, fn):
        def op(_ctx, *args):
            try:
                fn(*args)
                return 0
            except Exception as e:  # noqa: BLE001 (nothing may unwind through C)
                self.error = f"{type(e).__name__}: {e}"
                return 1
        return op

    def _global(self, peer):
        d = self.dist
        if self.group is None:
            return peer
        get = getattr(d, "get_global_rank", None) or d.distributed_c10d._get_global_rank
        return get(self.group, peer)

    def alltoallv(self, send, sb, recv, rb):
        sb, rb = [sb[q] for q in range(self.size)], [rb[q] for q in range(self.size)]
        self.dist.all_to_all_single(_host(recv, sum(rb)), _host(send, sum(sb)), rb, sb, group=self.group)

    def allreduce(self, buf, count, dtype):
        self.dist.all_reduce(_host(buf, count, self.DTYPES[dtype]), group=self.group)

    def allgather(self, send, recv, n):
        out = list(_host(recv, n * self.size).split(n)) if n else [_host(0, 0)] * self.size
        self.dist.all_gather(out, _host(send, n), group=self.group)

    def p2p(self, sends, ns, recvs, nr):
        d = self.dist
        ops = [d.P2POp(d.isend, _host(sends[i].buf, sends[i].bytes), self._global(sends[i].peer), self.group)
               for i in range(ns) if sends[i].bytes]
        ops += [d.P2POp(d.irecv, _host(recvs[i].buf, recvs[i].bytes), self._global(recvs[i].peer), self.group)
                for i in range(nr) if recvs[i].bytes]
        for w in d.batch_isend_irecv(ops) if ops else []:
            w.wait()

    def barrier(self):
        self.dist.barrier(group=self.group)


class _DeviceMemory:
    """fp32 device memory moept owns, as torch sees CUDA memory of others (__cuda_array_interface__); torch
    keeps this object, and so the layer, while a tensor views it"""

    def __init__(self, ptr, shape, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": "<f4", "data": (ptr, False),
                                         "version": 2, "strides": None}


def _view(ptr, shape, device, owner):
    """the layer's own fp32 memory at `ptr` as a tensor of `shape`, no copy; the tensor (and every view
    of it) keeps `owner` alive"""
    n = 1
    for s in shape:
        n *= s
    if device.type == "cpu":
        buf = type("_HostMemory", (C.c_float * n,), {}).from_address(ptr)  # a class whose objects take
        buf.owner = owner                                                  # attributes: torch keeps buf
        return torch.frombuffer(buf, dtype=torch.float32).view(*shape)
    return torch.as_tensor(_DeviceMemory(ptr, shape, owner), device=device)


def _hf_config_to_moept(lib, hf_config, layer_idx):
    """moept_config_from_hf on the config's JSON (sizes, routing, activation: moept's own reading of
    config.json); the first MoE layer when layer_idx is None"""
    d = hf_config.to_dict()
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(d, f, default=str)
        layers = [layer_idx] if layer_idx is not None else range(int(d.get("num_hidden_layers", 1)))
        cfg, err = moept_config(), ""
        for i in layers:
            if lib.moept_config_from_hf(tmp.encode(), i, C.byref(cfg)) == 0:
                return cfg
            err = lib.moept_last_error(None).decode()
    raise ValueError(f"moept_torch: no MoE layer in this config (layer {layer_idx}): {err}")


class _Param(torch.nn.Parameter):
    """a parameter viewing the layer's memory: `p.data = t` copies t's values in (shape kept) instead of
    detaching p from the layer, and reading `p.data` (which writes can bypass version counters through)
    makes a CUDA layer recast its low-precision copies before its next forward"""

    @property
    def data(self):
        owner = getattr(self, "_moept", None)
        if owner is not None and owner() is not None:
            owner()._dirty = True
        return torch.nn.Parameter.data.__get__(self)

    @data.setter
    def data(self, t):
        if tuple(t.shape) != tuple(self.shape):
            raise ValueError(f"moept_torch: p.data = a {tuple(t.shape)} tensor; this parameter is moept's "
                             f"memory of shape {tuple(self.shape)} (its values can change, not its shape)")
        with torch.no_grad():
            torch.Tensor.copy_(self, t)

    def __repr__(self):
        return "Parameter (moept) containing:\n" + repr(self.detach())

    def __reduce_ex__(self, proto):  # pickles (torch.save of a parameter) as a plain one, by value
        return torch.nn.Parameter.__reduce_ex__(torch.nn.Parameter(self.detach().clone(), self.requires_grad),
                                                proto)


class _Fn(torch.autograd.Function):
    """y, logits = moept forward of x [T][D] (the layer's dtype) and mask [T] uint8 or None; the backward
    takes dy and the gradient of the caller's router loss on the logits (None: none) and adds the
    parameters' gradients into their .grad, which are views of the layer's gradient buffers"""

    @staticmethod
    def forward(ctx, x, mask, m, train, *params):
        ctx.set_materialize_grads(False)
        y, logits, slot, generation = _forward_call(m, x, mask, train)
        ctx.m, ctx.slot, ctx.generation = m, slot, generation
        ctx.save_for_backward(x, mask, *params)  # autograd's version check: no in-place write before backward
        return y, logits

    @staticmethod
    def backward(ctx, dy, dlogits):
        m = ctx.m
        with m._lock:
            # a non-reentrant checkpoint recomputes its region when a saved tensor is first read: the
            # forward it runs then is this one's again, into this slot (its state, for the x it returns)
            reused, m._replay = m._slot_gen[ctx.slot] != ctx.generation, ctx.slot
            try:
                x, mask = ctx.saved_tensors[:2]  # raises if a parameter was written in place since
            finally:
                m._replay = None
            if reused:
                raise _overwritten(m, ctx.slot)
            dx = _backward_call(m, ctx.slot, x, mask, dy, dlogits)
        return (dx if ctx.needs_input_grad[0] else None, None, None, None) + (None,) * len(m._params)


def _forward_call(m, x, mask, train):
    """moept's forward (m._lock held): y, logits, the slot it took and that slot's generation"""
    y = torch.empty_like(x)
    logits = torch.empty(x.shape[0], m.num_experts, device=x.device, dtype=torch.float32)
    slot = m._slot if m._replay is None else m._replay  # a recomputation: the slot of its backward
    o = moept_forward_opts(mask.data_ptr() if mask is not None else None, 0 if train else 1, None,
                           logits.data_ptr(), slot)
    m._call("moept_forward_ex", m._h, x.data_ptr(), x.shape[0], y.data_ptr(), C.byref(o),
            tensors=(x, y, logits, mask), named=True)
    if train:  # the forward took its slot: the binding's state moves only now (a refusal leaves it)
        m._slot = (slot + 1) % m.max_inflight if m._replay is None else m._slot
        m._slot_gen[slot] += 1
    return y, logits, slot, m._slot_gen[slot]


def _backward_call(m, slot, x, mask, dy, dlogits):
    """moept's backward of the forward in `slot` (m._lock held): dx; the parameters' gradients added into
    the layer's buffers, bound as their .grad"""
    dy = torch.zeros_like(x) if dy is None else m._check(dy.contiguous(), "dy", x.dtype, x.shape)
    dlogits = m._take_stash(dlogits, x.shape[0])
    if dlogits is not None:
        dlogits = m._check(dlogits.contiguous(), "dlogits", torch.float32, (x.shape[0], m.num_experts))
    dx = torch.empty_like(x)
    o = moept_backward_opts(1.0, dlogits.data_ptr() if dlogits is not None else None, slot)
    bind = m._grads_begin()
    m._call("moept_backward_ex", m._h, x.data_ptr(), dy.data_ptr(), dx.data_ptr(), C.byref(o),
            tensors=(x, dy, dx, dlogits, mask))
    m._grads_end(bind)
    return dx


def _overwritten(m, slot):
    return RuntimeError(f"moept_torch: the forward this backward differentiates was overwritten: slot {slot} "
                        f"was reused by a later forward (raise max_inflight: forwards in flight at once, "
                        f"{m.max_inflight} now)")


# -- torch.compile (torch >= 2.4): the layer as custom ops ----------------------------------------------
# Under torch.compile the module's forward calls moept::forward, an opaque op with a fake (shape-only)
# implementation, so Dynamo keeps the MoE block in its graph instead of breaking at the ctypes calls; its
# autograd formula calls moept::backward. Both run the machinery above, at run time. What a compiled
# graph holds of a layer:
#   - its id, a string (_OP_LAYERS finds the module; an int could be traced as a symbol);
#   - an anchor, an empty parameter of its own that requires a gradient, instead of the parameters
#     (Dynamo in torch 2.4 to 2.7 does not trace a Parameter subclass): it makes y require a gradient, and
#     the gradient moept::backward returns for it keeps the backward in the graph when x takes none (the
#     parameters' gradients go to the layer's buffers, which no graph shows);
#   - the ticket, a tensor a forward returns for its backward: its slot, that slot's generation and the
#     parameters' versions (Python state in a compiled graph is fixed when traced; autograd's version
#     check does not see the parameters, so the backward does it).
# moept::forward changes the layer's hidden state (its slots): it is an ordered effect (torch >= 2.7), so
# the compiler neither drops, merges nor reorders it; before, a plain op (a merge of two same-input calls
# changes no value or gradient).
_OP_LAYERS = weakref.WeakValueDictionary()  # op id -> MoeptMoE
_OP_IDS = iter(range(1, 1 << 62))  # never reused: a compiled graph's id cannot name a later layer
_OPS = None  # True once the ops are defined; False: torch < 2.4, or defined by another copy of this file
_TORCH = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2])
_OP_LOCK = threading.Lock()  # layers made in two threads at once: the ops defined once


def _op_register(m):
    """m's id and anchor for the ops (defined on the first layer, where torch has torch.library.custom_op)"""
    global _OPS
    with _OP_LOCK:
        if _OPS is None:
            _OPS = _TORCH >= (2, 4) and _op_define()
    m._op_id = str(next(_OP_IDS))
    m._op_anchor = [torch.nn.Parameter(torch.zeros(0, device=m.device_))]  # a list: not m's parameter
    _OP_LAYERS[m._op_id] = m


def _compiling():
    return _OPS is True and torch.compiler.is_compiling()


def _op_layer(i):
    m = _OP_LAYERS.get(i)
    if m is None:
        raise RuntimeError(f"moept_torch: a compiled graph calls layer {i}, which no longer exists")
    return m


def _outside_graph(fn):
    c = getattr(torch, "compiler", None)
    return c.disable(fn) if hasattr(c, "disable") else fn


@_outside_graph
def _stash_outside(m, logits):
    """m._stash_leaf outside any compiled graph (Dynamo traces no hook that keeps state: under torch.compile
    a graph break)"""
    return m._stash_leaf(logits)


def _versions(m):
    return sum(p._version for p in m._params)  # a write to any parameter raises it


def _op_inputs(m, x, mask):
    """x and mask checked as eager mode's are, before their pointers cross (a graph passes what it made)"""
    x = m._check(x.contiguous(), "x", m.dtype_, (x.shape[0], m.hidden_size))
    return x, None if mask is None else m._check(mask.contiguous(), "mask", torch.uint8, (x.shape[0],))


def _op_define():
    """moept::forward and moept::backward; False where another copy of this file defined them"""
    from typing import Optional, Tuple
    from torch import Tensor
    try:  # another copy of this file (imported from another path) defined them: its registry, not ours
        torch.ops.moept.forward
        return False
    except (AttributeError, RuntimeError):
        pass
    try:
        @torch.library.custom_op("moept::forward", mutates_args=())
        def forward(x: Tensor, mask: Optional[Tensor], anchor: Tensor, layer: str,
                    train: bool) -> Tuple[Tensor, Tensor, Tensor]:
            """y, logits and the ticket of the layer's forward"""
            m = _op_layer(layer)
            x, mask = _op_inputs(m, x, mask)
            with m._lock:
                m._sync_params()
                y, logits, slot, generation = _forward_call(m, x, mask, train)
                return y, logits, torch.tensor([slot, generation, _versions(m)])

        @torch.library.custom_op("moept::backward", mutates_args=())
        def backward(x: Tensor, mask: Optional[Tensor], ticket: Tensor, dy: Tensor, dlogits: Tensor,
                     layer: str) -> Tuple[Tensor, Tensor]:
            """dx and the anchor's (empty) gradient of the forward that gave ticket; the parameters'
            gradients added into the layer's buffers"""
            m = _op_layer(layer)
            x, mask = _op_inputs(m, x, mask)
            slot, generation, versions = ticket.tolist()
            with m._lock:
                if versions != _versions(m):  # autograd's words
                    raise RuntimeError("moept_torch: one of the variables needed for gradient computation "
                                       "has been modified by an inplace operation: a parameter of the "
                                       "layer, written between the forward and this backward")
                if m._slot_gen[slot] != generation:
                    raise _overwritten(m, slot)
                dx = _backward_call(m, slot, x, mask, dy, dlogits)
            return dx, m._op_anchor[0].new_zeros(0)
    except (RuntimeError, ValueError):  # a torch that refuses these definitions: the eager path alone
        return False

    @forward.register_fake
    def _(x, mask, anchor, layer, train):
        n = _op_layer(layer).num_experts
        return torch.empty_like(x), x.new_empty(x.shape[0], n, dtype=torch.float32), \
            torch.empty(3, dtype=torch.int64)

    @backward.register_fake
    def _(x, mask, ticket, dy, dlogits, layer):
        return torch.empty_like(x), x.new_empty(0, dtype=torch.float32)

    def setup_context(ctx, inputs, output):
        ctx.layer = inputs[3]
        ctx.save_for_backward(inputs[0], inputs[1], output[2])

    def grad(ctx, dy, dlogits, _):
        x, mask, ticket = ctx.saved_tensors
        dx, danchor = torch.ops.moept.backward(x, mask, ticket, dy, dlogits, ctx.layer)
        return dx if ctx.needs_input_grad[0] else None, None, danchor, None, None

    forward.register_autograd(grad, setup_context=setup_context)
    if _TORCH < (2, 7):  # effect tokens miscompile: 2.4 misplaces input gradients, 2.5's inductor the inputs
        return True
    try:  # an ordered effect: newer torch's registration, else the table before it
        from torch._library.effects import EffectType
        torch.library._register_effectful_op(forward._opoverload, EffectType.ORDERED)
    except (ImportError, AttributeError):
        from torch._higher_order_ops.effects import SIDE_EFFECTS, _EffectType
        SIDE_EFFECTS[forward._opoverload] = _EffectType.ORDERED
    return True


class MoeptMoE(torch.nn.Module):
    """A moept layer standing in for a transformers MoE block (or built from a config alone).

    block:       the HF block whose weights are copied in (None: moept_init_params' torch-like init);
                 its parameter names and order are kept (5.x's fused experts.gate_up_proj [E][2F][D] and
                 experts.down_proj [E][D][F], or 4.x's experts.N.w1.weight ...)
    config:      the HF model config (sizes and routing: moept_config_from_hf); layer_idx: which layer
                 (None: the first MoE layer)
    device:      "cpu" or a CUDA device; dtype: the token rows' and expert GEMMs' type (CPU: float32;
                 CUDA: float32 or bfloat16; the master weights, router and logits stay fp32)
    max_tokens:  most tokens a forward (B*S): moept sizes its buffers from it
    max_inflight: training forwards whose backward is still to come (recomputation, pipelines)
    ep_group:    experts sharded over this torch.distributed group: CUDA layers through moept's NCCL comm
                 (from an ncclUniqueId the group broadcasts), CPU layers through the group's own
                 collectives (moept_comm_custom); None: every expert here
    fused:       parameter names: True 5.x's fused ones, False 4.x's per expert; None: as the block's
                 (no block: as the installed transformers' major version)
    hf_outputs:  return (y, router_logits) as transformers 4.x's blocks did (None: as the block does: a
                 block with per-expert modules, or with no block the installed transformers' major version)
    """

    def __init__(self, block=None, config=None, *, layer_idx=None, device="cpu", dtype=torch.float32,
                 max_tokens=4096, max_inflight=1, ep_group=None, lib=None, fused=None, hf_outputs=None,
                 cuda_options=None):
        super().__init__()
        if config is None:
            raise ValueError("moept_torch: MoeptMoE needs the HF model config (config=model.config)")
        self.device_ = torch.device(device)
        if self.device_.type == "cuda" and self.device_.index is None:
            self.device_ = torch.device("cuda", torch.cuda.current_device())
        cuda = self.device_.type == "cuda"
        if dtype not in (torch.float32, torch.bfloat16) or (not cuda and dtype != torch.float32):
            raise TypeError(f"moept_torch: dtype {dtype} on {self.device_.type}: CPU layers take float32, "
                            "CUDA layers float32 or bfloat16")
        self.dtype_, self.max_inflight, self.max_tokens = dtype, max(1, max_inflight), max_tokens
        self._args = dict(layer_idx=layer_idx, device=self.device_, dtype=dtype, max_tokens=max_tokens,
                          max_inflight=self.max_inflight, lib=lib, cuda_options=cuda_options)
        self._hf_config, self._ep_group = config, ep_group
        lib = lib if isinstance(lib, C.CDLL) else load_library(lib, cuda=cuda)
        cfg = _hf_config_to_moept(lib, config, layer_idx)
        cfg.aux_loss, cfg.aux_loss_coef, cfg.z_loss_coef = MOEPT_AUX_NONE, 0.0, 0.0  # the aux: hf_aux_loss
        cfg.max_tokens, cfg.max_inflight = max_tokens, self.max_inflight
        # transformers' jitter (Mixtral's router_jitter_noise): the block's input times uniform noise from
        # torch's generator, when training, as HF's block does (so moept's own, router-only jitter is off)
        self.jitter_noise, cfg.router_jitter = float(cfg.router_jitter), 0.0
        self.num_experts, self.top_k, self.F, self.hidden_size = (cfg.num_experts, cfg.top_k,
                                                                  cfg.intermediate_size, cfg.hidden_size)
        self._layer = _Layer(lib)
        self._lock = threading.RLock()  # one call at a time on this layer (its workspace is one)
        self._stream = None
        if cuda:
            self._create_cuda(cfg, ep_group, cuda_options)
        elif ep_group is not None:
            comm = self._torch_comm(ep_group)
            self._call("moept_create_parallel", C.byref(cfg), comm, None, C.byref(self._layer.h))
        else:
            self._call("moept_create", C.byref(cfg), C.byref(self._layer.h))
        self._slot, self._slot_gen, self._stash, self._dirty = 0, [0] * self.max_inflight, [], False
        self._replay = None  # the slot of the backward whose checkpoint recomputes its forward now
        _op_register(self)  # torch.compile's handles on the layer
        self.router_logits, self._mask = None, None
        self._build_params(block, fused)
        if hf_outputs is None:
            per_expert = block is not None and not hasattr(getattr(block, "experts", None), "gate_up_proj")
            hf_outputs = per_expert if block is not None else _transformers_major() < 5
        self.hf_outputs = hf_outputs
        self._versions = self._param_versions()

    @property
    def _lib(self):
        return self._layer.lib

    @property
    def _h(self):
        return self._layer.h

    # -- creation --------------------------------------------------------------------------------------
    def _create_cuda(self, cfg, ep_group, cuda_options):
        lib = self._lib
        if not hasattr(lib, "moept_comm_nccl"):
            raise ValueError("moept_torch: device cuda needs the CUDA build (make build/libmoept_cuda.so)")
        if lib.moept_cuda_device_count() < 1:
            raise RuntimeError("moept_torch: the CUDA build sees no GPU")
        o = moept_cuda_options() if cuda_options is None else cuda_options
        o.dtype = DTYPES[self.dtype_]
        with torch.cuda.device(self.device_):
            self._stream = torch.cuda.current_stream(self.device_)  # the layer's stream, fixed at create
            o.stream = self._stream.cuda_stream
            ep = None
            if ep_group is not None:
                ep = self._nccl_comm(ep_group)
            self._call("moept_create_cuda", C.byref(cfg), ep, None, C.byref(o), C.byref(self._layer.h))

    def _nccl_comm(self, group):
        """moept's NCCL comm over the ranks of `group`: rank 0 of it draws the ncclUniqueId, the group
        broadcasts it (torch.distributed), every rank inits its communicator on this device"""
        import torch.distributed as dist
        nccl = C.CDLL("libnccl.so.2")  # the one the CUDA build linked (already loaded)
        uid, rank, size = nccl_unique_id(), dist.get_rank(group), dist.get_world_size(group)
        if rank == 0:
            _nccl_ok(nccl.ncclGetUniqueId(C.byref(uid)), "ncclGetUniqueId")
        box = [C.string_at(C.addressof(uid), C.sizeof(uid)) if rank == 0 else None]  # all 128 bytes
        src = 0 if group is None else dist.get_global_rank(group, 0)  # broadcast's src: a global rank
        dist.broadcast_object_list(box, src=src, group=group)
        if len(box[0]) != C.sizeof(uid):
            raise RuntimeError("moept_torch: the broadcast ncclUniqueId is not 128 bytes")
        C.memmove(C.addressof(uid), box[0], C.sizeof(uid))
        comm = C.c_void_p()
        nccl.ncclCommInitRank.argtypes = [C.POINTER(C.c_void_p), C.c_int, nccl_unique_id, C.c_int]
        _nccl_ok(nccl.ncclCommInitRank(C.byref(comm), size, uid, rank), "ncclCommInitRank")
        self._layer.nccl = (nccl, comm)
        self._comm_stream = torch.cuda.Stream(self.device_)  # the EP exchange's stream
        c = C.c_void_p()
        self._call("moept_comm_nccl", comm, self._comm_stream.cuda_stream, 0, C.byref(c))
        self._layer.comms.append(c)
        return c

    def _torch_comm(self, group):
        """moept's comm whose collectives are torch.distributed's over `group` (gloo on the CPU)"""
        ops, ctx = _TorchCollectives.make(group)
        c = C.c_void_p()
        self._call("moept_comm_custom", C.byref(ops), None, ctx.rank, ctx.size, C.byref(c))
        self._layer.keep.append((ops, ctx))  # the callbacks live as long as the comm
        self._layer.comms.append(c)
        return c

    def _build_params(self, block, fused):
        """every moept parameter as a torch view of the layer's fp32 masters, registered under the HF
        block's names and in its order; the block's weights copied in first"""
        lib, infos = self._lib, []
        for i in range(lib.moept_param_count(self._h)):
            info = moept_param_info()
            self._call("moept_param_info_at", self._h, i, C.byref(info))
            infos.append((info.name.decode(), info.rows, info.cols, info.data, info.grad, info.offset))
        ex = getattr(block, "experts", None)
        if fused is None:  # the block's layout; with no block, the installed transformers' (5.x: fused)
            fused = hasattr(ex, "gate_up_proj") if block is not None else _transformers_major() >= 5
        self._fused = fused
        if block is not None:
            for name, rows, cols, _, _, _ in infos:
                t = _hf_source(block, name, self.F, rows, cols)
                t = t.detach().to("cpu", torch.float32).contiguous()
                self._call("moept_set_param", self._h, name.encode(), t.data_ptr(), t.numel())
        if self.device_.type == "cuda":  # its buffers live on the device alone: views of those
            dp, dg, n = C.c_void_p(), C.c_void_p(), C.c_int64()
            self._call("moept_cuda_params", self._h, C.byref(dp), C.byref(dg), C.byref(n))
            infos = [(nm, r, c, None if o < 0 else dp.value + 4 * o,
                      None if o < 0 or dg.value is None else dg.value + 4 * o) for nm, r, c, _, _, o in infos]
        else:
            infos = [i[:5] for i in infos]
        self._names, self._grads, self._moept_names = [], [], {}
        views = [(nm, r, c, d, g) for nm, r, c, d, g in infos if g is not None]
        me = weakref.ref(self)
        for name, shape, d, g in _hf_order(_hf_layout(views, self._fused, self.F), block):
            p = _Param(_view(d, shape, self.device_, self._layer))
            p._moept = me
            _register(self, name, p)
            self._names.append(name)
            self._grads.append(_view(g, shape, self.device_, self._layer))
        # the DeepSeek-V3 correction bias (no gradient), a buffer: a CPU layer's host memory; a CUDA
        # layer keeps it in its host copy, so the buffer is a device copy that the next forward after an
        # in-place write (load_state_dict, copy_) sets through moept_set_param (E floats each way)
        self._bufs = []
        for name, r, c, d, g in infos:
            if g is not None:
                continue
            shape = (c,) if r == 1 else (r, c)
            if self.device_.type == "cpu":
                _register(self, name, _view(d, shape, self.device_, self._layer), buffer=True)
                continue
            h = torch.empty(shape, dtype=torch.float32)
            self._call("moept_get_param", self._h, name.encode(), h.data_ptr(), h.numel())
            self._bufs.append((name, h.to(self.device_)))
            _register(self, name, self._bufs[-1][1], buffer=True)
        self._buf_versions = [t._version for _, t in self._bufs]
        self._params = [self.get_parameter(n) for n in self._names]
        self._ptrs = [p.data_ptr() for p in self._params]

    # -- calls -----------------------------------------------------------------------------------------
    def _call(self, fn, *args, tensors=(), named=False):
        """a library call, on the layer's stream joined to torch's current one (CUDA)"""
        lib = self._lib
        if self._stream is None or fn in ("moept_create_cuda",):
            return self._ok(getattr(lib, fn)(*args), fn, named)
        cur = torch.cuda.current_stream(self.device_)
        if cur == self._stream:
            return self._ok(getattr(lib, fn)(*args), fn, named)
        self._stream.wait_stream(cur)  # the caller's stream switched: order the layer's work after it
        st = getattr(lib, fn)(*args)
        for t in tensors:
            if t is not None:
                t.record_stream(self._stream)
        cur.wait_stream(self._stream)
        return self._ok(st, fn, named)

    def _ok(self, status, fn, named):
        if status == 0:
            return
        msg = self._lib.moept_last_error(None).decode()
        if named:  # moept names a non-finite parameter by its own name: say the module's too
            msg = _hf_name_in(msg, self._fused, self.F)
        for _, ctx in self._layer.keep:  # a torch.distributed op that raised: what it said
            if ctx.error:
                msg, ctx.error = f"{msg} ({ctx.error})", None
        raise RuntimeError(f"moept: {fn}: {msg}")

    def _check(self, t, what, dtype, shape=None):
        if t.dtype != dtype:
            raise TypeError(f"moept_torch: {what} is {t.dtype}, this layer takes {dtype} (a layer's dtype "
                            f"is set at create: dtype=)")
        if t.device != self.device_:
            raise ValueError(f"moept_torch: {what} is on {t.device}, this layer on {self.device_} (its "
                             "parameters cannot move: create it on the device)")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"moept_torch: {what} is {tuple(t.shape)}, this call needs {tuple(shape)}")
        return t

    def _param_versions(self):
        return [p._version for p in self._params]

    def _apply(self, fn, *args, **kwargs):
        """.to()/.cuda()/.cpu()/.half()...: a move off the layer's device raises; a dtype cast leaves the
        fp32 master weights as they are (the compute dtype is the layer's, set at create)"""
        probe = fn(torch.empty(0, device=self.device_, dtype=torch.float32))
        if probe.device != self.device_:
            raise RuntimeError(f"moept_torch: this layer's parameters are moept's memory on {self.device_}; "
                               f"moving them to {probe.device} would detach them from the layer (create "
                               "the layer on the device instead)")
        return self

    def forward(self, hidden_states, attention_mask=None, **unused):
        """hidden_states [..][D] -> y of its shape (transformers 4.x blocks: (y, router logits [T][E]));
        attention_mask: as set_padding_mask, for this call; other keywords a decoder layer passes: unused"""
        x = self._input(hidden_states)
        mask = attention_mask if attention_mask is not None else self._mask
        if mask is not None:
            mask = self._check_mask(mask, x.shape[0])
        if self.training and self.jitter_noise > 0:  # HF's jitter: the block's input, when training
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        # grad mode decides only whether state is kept for a backward (module.training: the jitter); under
        # torch.compile grad mode alone (the parameters' requires_grad is not traced)
        train = torch.is_grad_enabled() and (_compiling() or x.requires_grad or
                                             any(p.requires_grad for p in self._params))
        if x.shape[0] == 0:  # no tokens: nothing to route (a 0-row call is not moept's)
            y, logits = x * 0, torch.zeros(0, self.num_experts, device=x.device)
        elif _compiling():  # torch.compile: the layer is one op of the graph, not ctypes calls
            y, logits, _ = torch.ops.moept.forward(x, mask, self._op_anchor[0], self._op_id, train)
        else:
            with self._lock:
                self._sync_params()
                y, logits = _Fn.apply(x, mask, self, train, *self._params)
        # hf_aux_loss reads these; a forward without autograd while training (a reentrant checkpoint's first
        # pass) gives them a gradient of their own, for the recomputed forward's backward
        self.router_logits = _stash_outside(self, logits) if self.training and not train else logits
        y = y.reshape(hidden_states.shape)
        return (y, logits) if self.hf_outputs else y

    def _input(self, hidden_states):
        """hidden_states [..][D] as x [T][D] of the layer's dtype and device, checked before any pointer
        crosses"""
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"moept_torch: hidden_states is {tuple(hidden_states.shape)}; this layer takes "
                             f"[..][{self.hidden_size}] (hidden_size)")
        x = hidden_states.reshape(-1, self.hidden_size)
        if x.device == self.device_ and x.dtype != self.dtype_ and x.dtype.is_floating_point and \
                _autocast_dtype(self.device_) == self.dtype_:
            x = x.to(self.dtype_)  # autocast: the layer's dtype, as autocast would cast a matmul's input
        x = self._check(x, "hidden_states", self.dtype_).contiguous()
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"moept_torch: hidden_states holds {x.shape[0]} tokens, more than this layer's "
                             f"max_tokens ({self.max_tokens}, set at create)")
        return x

    def _sync_params(self):
        """what was written since the last call reaches the layer: a parameter whose storage was replaced
        (set_) gets its values copied back into the layer's memory and views it again; a CUDA layer
        recasts after in-place writes; a CUDA layer's bias buffer is set"""
        for i, p in enumerate(self._params):
            if p.data_ptr() != self._ptrs[i]:
                grad, p.grad = p.grad, None
                view = _view(self._ptrs[i], tuple(p.shape), self.device_, self._layer)
                with torch.no_grad():
                    view.copy_(torch.nn.Parameter.data.__get__(p))
                torch.nn.Parameter.data.__set__(p, view)
                p.grad = grad
        if self._versions != self._param_versions() or self._dirty:  # optimizer, load_state_dict, p.data
            if self.device_.type == "cuda":
                self._call("moept_cuda_params_changed", self._h)
            self._versions, self._dirty = self._param_versions(), False
        if [t._version for _, t in self._bufs] != self._buf_versions:  # a CUDA layer's bias buffer written
            for name, t in self._bufs:
                h = t.detach().to("cpu", torch.float32).contiguous()
                self._call("moept_set_param", self._h, name.encode(), h.data_ptr(), h.numel())
            self._buf_versions = [t._version for _, t in self._bufs]

    def _check_mask(self, mask, T):
        if mask.numel() != T:
            raise ValueError(f"moept_torch: attention_mask has {mask.numel()} elements, the input {T} tokens")
        if mask.device != self.device_:
            raise ValueError(f"moept_torch: attention_mask is on {mask.device}, this layer on {self.device_}")
        return (mask.reshape(-1) != 0).to(torch.uint8).contiguous()  # moept's padding mask: 0 = padding

    # -- gradients: .grad is the layer's own gradient buffer -----------------------------------------
    def _grads_begin(self):
        """before a backward (moept adds into its gradient buffers): which parameters' .grad already are
        those buffers. All that take a gradient: nothing to do; none: the buffers are zeroed, then bound;
        a mix (a .grad replaced or set to None alone): the bound ones' sums are kept aside"""
        want = [i for i, p in enumerate(self._params) if p.requires_grad]
        bound = {i for i in want if self._is_bound(i)}
        if len(bound) == len(want):
            return None
        kept = {i: self._grads[i].clone() for i in bound}
        self._call("moept_zero_grad", self._h)
        return want, kept

    def _grads_end(self, bind):
        if bind is None:
            return
        want, kept = bind
        for i in want:
            p, g = self._params[i], self._grads[i]
            if i in kept:
                g.add_(kept[i])
            elif p.grad is None:
                p.grad = g
            else:  # a .grad of the caller's: this backward's part added to it
                p.grad.add_(g)

    def _is_bound(self, i):
        g = self._params[i].grad
        return g is not None and g.data_ptr() == self._grads[i].data_ptr() and g.shape == self._grads[i].shape

    # -- the router's logits under reentrant checkpointing -------------------------------------------
    def _stash_leaf(self, logits):
        """a forward run without autograd while training (a reentrant checkpoint's first pass): its logits
        still take a gradient (hf_aux_loss), kept until this layer's next backward (the recomputed
        forward's) adds it to its own"""
        leaf = logits.detach().requires_grad_()
        me = weakref.ref(self)

        def keep(g):
            if me() is not None:
                me()._stash.append(g.detach())
        leaf.register_hook(keep)
        return leaf

    def _take_stash(self, dlogits, T):
        if not self._stash:
            return dlogits
        g = self._stash.pop(0)
        if g.shape[0] != T:
            raise RuntimeError(f"moept_torch: a router-logit gradient of {g.shape[0]} tokens reached a "
                               f"forward run without autograd, and the next backward is of {T} tokens: it "
                               "belongs to no backward (differentiate the logits of a training forward)")
        return g if dlogits is None else dlogits + g

    # -- the rest ----------------------------------------------------------------------------------------
    def routing(self):
        """the last training forward's top-k expert ids [T][K] (int64, on the CPU)"""
        ids = C.POINTER(C.c_int32)()
        self._call("moept_routing", self._h, C.byref(ids), None, None)
        T = self.router_logits.shape[0]
        return torch.tensor(ids[:T * self.top_k], dtype=torch.int64).view(T, self.top_k)

    def stats(self):
        """moept_get_stats as a dict: the last forward's losses and token counts, tokens_per_expert (a
        list over all E experts), drops, the layer's bytes (param_bytes, workspace_bytes, ...; held now
        by kind: host_bytes and device_bytes, dicts over MEM_KINDS) and the expert exchange's rows,
        bytes and seconds"""
        s, per = moept_stats(), (C.c_int64 * self.num_experts)()
        with self._lock:
            self._call("moept_get_stats", self._h, C.byref(s), per)
        d = {f: getattr(s, f) for f, _ in moept_stats._fields_}
        for f in ("host_bytes", "device_bytes"):
            d[f] = dict(zip(MEM_KINDS, getattr(s, f)))
        d["tokens_per_expert"] = list(per)
        return d

    def __deepcopy__(self, memo):
        """an independent layer: the same config and options, these parameters, buffers and gradients
        (forwards in flight are not copied); an expert-parallel layer raises (its copy would need its
        own group)"""
        if self._ep_group is not None:
            raise RuntimeError("moept_torch: deepcopy of an expert-parallel MoeptMoE: each copy would need "
                               "its own comm; build one with MoeptMoE(None, config, ep_group=...) and "
                               "load_state_dict")
        new = MoeptMoE(None, copy.deepcopy(self._hf_config, memo), fused=self._fused,
                       hf_outputs=self.hf_outputs, **self._args)
        memo[id(self)] = new
        with torch.no_grad():
            for p, q, g in zip(self._params, new._params, new._grads):
                q.copy_(p)
                q.requires_grad_(p.requires_grad)
                if p.grad is not None:
                    q.grad = g.copy_(p.grad)
            for (_, t), (_, u) in zip(self.named_buffers(), new.named_buffers()):
                u.copy_(t)
        new.train(self.training)
        new._mask = copy.deepcopy(self._mask, memo)
        return new


def _autocast_dtype(device):
    """the dtype torch.autocast casts to on this device type now, or None (off; CUDA only)"""
    if device.type != "cuda":
        return None
    try:  # torch >= 2.4
        return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    except (AttributeError, TypeError):
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def _nccl_ok(r, what):
    if r != 0:
        raise RuntimeError(f"moept_torch: {what} returned ncclResult_t {r}")


def _hf_source(block, name, F, rows, cols):
    """the HF block's tensor holding moept's parameter `name` [rows][cols]: by name (4.x per-expert
    modules, the router, shared experts), or a slice of 5.x's fused experts.gate_up_proj [E][2F][D]
    (gate rows first) and experts.down_proj [E][D][F]"""
    w, ex = name.split("."), getattr(block, "experts", None)
    if w[0] == "experts" and hasattr(ex, "gate_up_proj"):
        e = int(w[1])
        t = {"w1": ex.gate_up_proj[e, :F], "gate_proj": ex.gate_up_proj[e, :F],
             "w3": ex.gate_up_proj[e, F:], "up_proj": ex.gate_up_proj[e, F:],
             "w2": ex.down_proj[e], "down_proj": ex.down_proj[e]}[w[2]]
    else:
        try:
            t = block.get_parameter(name)
        except AttributeError:
            t = block.get_buffer(name)
    if tuple(t.shape) != (rows, cols) and not (t.dim() == 1 and t.numel() == rows * cols):
        raise ValueError(f"moept_torch: the block's {name} is {tuple(t.shape)}, moept's [{rows}][{cols}] "
                         "(transposed expert weights are not supported)")
    return t.reshape(rows, cols)


def _hf_layout(views, fused, F):
    """(HF name, shape, data, grad) of each parameter: moept's own names (= 4.x's), or the experts'
    tensors fused as 5.x's (moept's w13 [El][2F][D] and w2 [El][D][F] are contiguous, in local order)"""
    if not fused:
        return [(nm, (r, c), d, g) for nm, r, c, d, g in views]
    out, gu, dn, at = [], [], [], None
    for nm, r, c, d, g in views:
        w = nm.split(".")
        if w[0] != "experts":
            out.append((nm, (r, c), d, g))
            continue
        at = len(out) if at is None else at  # the fused tensors where the experts were, as in HF's order
        if w[2] in ("w2", "down_proj"):
            dn.append((r, c, d, g))
        else:
            gu.append((r, c, d, g))
    El = len(dn)
    if El:
        D, Fx = dn[0][0], dn[0][1]
        H = len(gu) // El * Fx  # 2F gated, F not
        for j in range(El):  # the fused views are only right if moept's layout is as assumed
            if gu[j * (H // Fx)][2] != gu[0][2] + j * H * D * 4 or dn[j][2] != dn[0][2] + j * D * Fx * 4:
                raise RuntimeError("moept_torch: moept's expert weights are not [E][2F][D] contiguous")
        out[at:at] = [("experts.gate_up_proj", (El, H, D), gu[0][2], gu[0][3]),
                      ("experts.down_proj", (El, D, Fx), dn[0][2], dn[0][3])]
    return out


def _hf_order(items, block):
    """items (name, ...) in the order the HF block registers its parameters (so a positional optimizer
    state moves between a swapped and an unswapped model): the block's own where it has every name; else
    transformers' convention, where moept's differs: a Mixtral expert registers w1, w2, w3 (moept holds
    w1, w3, w2)"""
    if block is not None:
        order = {n: i for i, (n, _) in enumerate(block.named_parameters())}
        if all(it[0] in order for it in items):
            return sorted(items, key=lambda it: order[it[0]])
    rank, first = {"w1": 0, "w2": 1, "w3": 2}, {}

    def key(i):
        w = items[i][0].split(".")
        if w[0] != "experts" or len(w) < 3 or w[2] not in rank:
            return (i, 0)
        return (first.setdefault(w[1], i), rank[w[2]])
    return [items[i] for i in sorted(range(len(items)), key=key)]


def _hf_name_in(msg, fused, F):
    """moept's message naming a parameter element ('experts.3.w1.weight' element [i][j]) with the fused
    layout's name and index where the module holds 5.x's fused tensors"""
    m = re.search(r"parameter '(experts\.(\d+)\.(\w+)\.weight)' element \[(\d+)\]\[(\d+)\]", msg)
    if not fused or m is None:
        return msg
    e, w, i, j = int(m.group(2)), m.group(3), int(m.group(4)), int(m.group(5))
    name = "experts.down_proj" if w in ("w2", "down_proj") else "experts.gate_up_proj"
    i += F if w in ("w3", "up_proj") else 0
    return msg[:m.start()] + f"parameter '{name}' element [{e}][{i}][{j}]" + msg[m.end():]


def _transformers_major():
    try:
        import transformers
        return int(transformers.__version__.split(".")[0])
    except (ImportError, ValueError):
        return 5


class _Names(torch.nn.Module):
    """a level of an HF name (experts, experts.3, ...): holds the parameters under it; [i] as a ModuleList"""

    def __getitem__(self, i):
        return self._modules[str(i)]


def _register(module, name, t, buffer=False):
    """t under the dotted `name` (plain submodules for the prefixes), so state_dict shows HF's key"""
    *path, leaf = name.split(".")
    m = module
    for p in path:
        if p not in m._modules:
            m.add_module(p, _Names())
        m = m._modules[p]
    if buffer:
        m.register_buffer(leaf, t)
    else:
        m.register_parameter(leaf, t)


def _is_moe_block(mod):
    return hasattr(mod, "gate") and hasattr(mod, "experts") and not isinstance(mod, MoeptMoE)


def swap_moe_blocks(model, **kwargs):
    """every decoder layer's MoE block (mlp, or 4.x Mixtral's block_sparse_moe) for a MoeptMoE built
    from it; returns them in layer order (keyword arguments: MoeptMoE's)"""
    blocks = []
    for i, layer in enumerate(model.model.layers):
        for attr in ("mlp", "block_sparse_moe"):
            mod = getattr(layer, attr, None)
            if mod is not None and _is_moe_block(mod):
                b = MoeptMoE(mod, model.config, **dict(kwargs, layer_idx=i))
                setattr(layer, attr, b)
                blocks.append(b)
    return blocks


def set_padding_mask(blocks, attention_mask):
    """moept's padding mask for the blocks' next forwards (kept until set again; None: no padding):
    attention_mask [B][S] (nonzero = token), on the layers' device; padding is routed nowhere, gets y 0
    and no gradient, and is left out of the losses' token counts (moept_forward_opts.mask)"""
    for b in blocks:
        b._mask = attention_mask


def hf_aux_loss(blocks, config, attention_mask=None):
    """transformers' aux term over every swapped layer's logits (router_aux_loss_coef times its own
    load_balancing_loss_func, the padding left out as HF does with attention_mask); its gradient reaches
    each layer's router through the logits"""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    logits = tuple(b.router_logits for b in blocks)
    return config.router_aux_loss_coef * load_balancing_loss_func(
        logits, blocks[0].num_experts, config.num_experts_per_tok, attention_mask)
