#!/usr/bin/env python3
"""PyTorch eager baseline for bench/bench_layer: transformers'
MixtralSparseMoeBlock forward+backward, fp32, at a given shape and thread
count. Prints one RESULT line in bench_layer's format."""
import argparse
import statistics
import time

import torch
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralConfig


def rss():
    cur = peak = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) * 1024
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return cur, peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=3584)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    rss0, _ = rss()
    cfg = MixtralConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_local_experts=a.experts,
                        num_experts_per_tok=a.topk, router_jitter_noise=0.0)
    block = MixtralSparseMoeBlock(cfg).float()
    with torch.no_grad():
        for p in block.parameters():
            p.uniform_(-1, 1).mul_(p.shape[-1] ** -0.5)
    x = (torch.rand(1, a.tokens, a.hidden) * 2 - 1).requires_grad_(True)
    dy = (torch.rand(1, a.tokens, a.hidden) * 2 - 1) * 1e-3
    times = []
    for r in range(a.reps + 1):
        t0 = time.perf_counter()
        y = block(x)
        y.backward(dy)
        t = time.perf_counter() - t0
        if r > 0:
            times.append(t)
        del y
    _, peak = rss()
    print(f"RESULT gemm=torch tokens={a.tokens} hidden={a.hidden} ffn={a.ffn} experts={a.experts} "
          f"topk={a.topk} threads={torch.get_num_threads()} reps={a.reps} torch_s={statistics.median(times):.6f} "
          f"peak_bytes={peak - rss0} torch={torch.__version__}")


if __name__ == "__main__":
    main()
