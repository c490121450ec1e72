#!/usr/bin/env python3
"""Checks that what moept_save_hf writes is a Hugging Face checkpoint
transformers loads: for each checkpoint in tests/checkpoints, moept loads
layer 1's MoE block and saves it back (build/hf_resave); the saved tensors
replace those of the original checkpoint (every name must already be one of
the model's), and transformers' from_pretrained must load the result with
layer 1 holding exactly moept's tensors.

    make build/hf_resave && python3 tools/check_hf_save.py
"""
import json
import os
import shutil
import subprocess
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

CASES = ["mixtral_e8_t40", "qwen2_shared_norm_e8", "olmoe_nonorm", "deepseek_group"]

for name in CASES:
    src = os.path.join("tests/checkpoints", name)
    with safe_open(os.path.join("tests/cases", name + ".safetensors"), "pt") as f:
        m = f.metadata()
    tmp = tempfile.mkdtemp()
    out = os.path.join(tmp, "moe.safetensors")
    subprocess.run(["build/hf_resave", m["family"], m["hidden_size"], m["intermediate_size"], m["num_experts"], m["top_k"],
                    m["shared_intermediate_size"], m["n_group"], m["topk_group"], src, "1", out], check=True)
    mine = load_file(out)
    dst = os.path.join(tmp, "model")
    shutil.copytree(src, dst)
    idx = os.path.join(dst, "model.safetensors.index.json")
    where = json.load(open(idx))["weight_map"] if os.path.exists(idx) else None
    files = {}
    for k in mine:
        fn = where[k] if where else "model.safetensors"  # KeyError: a name the model does not have
        files.setdefault(fn, []).append(k)
    for fn, keys in files.items():
        p = os.path.join(dst, fn)
        with safe_open(p, "pt") as f:
            meta = f.metadata()
        t = load_file(p)
        for k in keys:
            assert k in t and t[k].shape == mine[k].shape, (name, k)
            t[k] = mine[k] + 0.5  # moept's tensors, shifted so that the reload proves they were used
        save_file(t, p, metadata=meta)
    model = AutoModelForCausalLM.from_pretrained(dst)
    sd = model.state_dict()
    layer = model.model.layers[1]
    block = getattr(layer, "block_sparse_moe", None) or layer.mlp
    gate = [k for k in mine if k.endswith("gate.weight")][0]
    assert torch.equal(block.gate.weight.detach(), mine[gate] + 0.5), name
    print(f"{name}: {len(mine)} tensors written by moept_save_hf, loaded by transformers from_pretrained")
    shutil.rmtree(tmp)
