#!/usr/bin/env python3
"""torch's FP8 grouped GEMM (torch._scaled_grouped_mm: E4M3 operands, row-wise fp32 scales) against its
bf16 grouped GEMM (torch._grouped_mm) at the expert GEMMs of one MoE layer's forward, on a CUDA GPU:
Mixtral-8x7B (8 experts, 2048 rows each at T 8192, K 2), DeepSeek-V3's experts (16 local, 4096 rows
each at T 8192, K 8) and Qwen3-30B-A3B's (128, 256 rows each at T 4096, K 8). Prints ms and TFLOP/s of
each, or why a call could not run (tools/fp8_table.py reads the lines: "NAME GEMM ...: bf16 ...").

usage: python3 bench/fp8_grouped_peer.py [--reps N]
"""
import argparse
import sys

import torch


def timed(fn, reps):
    for _ in range(3):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def one(name, G, rows, n, k, reps):
    """G groups of `rows` rows: a [G*rows][k] @ b[g] [k][n] -> [G*rows][n]"""
    dev = torch.device("cuda")
    a = torch.randn(G * rows, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(G, n, k, device=dev, dtype=torch.bfloat16).transpose(1, 2)  # [G][k][n], k-major
    offs = torch.arange(1, G + 1, device=dev, dtype=torch.int32) * rows
    flops = 2.0 * G * rows * n * k
    line = f"{name:34s} G {G:3d} rows {rows:5d} n {n:5d} k {k:5d}:"
    try:
        t16 = timed(lambda: torch._grouped_mm(a, b, offs=offs), reps)
    except Exception as ex:  # noqa: BLE001 - a torch that cannot: say why, go on to the next GEMM
        print(f"{line} bf16 unavailable: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
        return
    line += f" bf16 {t16:.3f} ms ({flops / t16 / 1e9:.0f} TFLOP/s)"
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn)
        sa = torch.ones(G * rows, device=dev, dtype=torch.float32)
        sb = torch.ones(G, n, device=dev, dtype=torch.float32)
        def fp8():
            return torch._scaled_grouped_mm(a8, b8, sa, sb, offs=offs, out_dtype=torch.bfloat16)
        t8 = timed(fp8, reps)
        line += f", fp8 row-wise {t8:.3f} ms ({flops / t8 / 1e9:.0f} TFLOP/s), bf16/fp8 {t16 / t8:.2f}"
    except Exception as ex:  # noqa: BLE001 - a torch that cannot: say why
        line += f", fp8 unavailable: {type(ex).__name__}: {str(ex)[:160]}"
    print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("skip - no CUDA device")
        return 0
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}")
    one("Mixtral gate_up (2F x D)", 8, 2048, 28672, 4096, a.reps)
    one("Mixtral down (D x F)", 8, 2048, 4096, 14336, a.reps)
    one("DeepSeek-V3 gate_up (2F x D)", 16, 4096, 4096, 7168, a.reps)
    one("DeepSeek-V3 down (D x F)", 16, 4096, 7168, 2048, a.reps)
    one("Qwen3-30B-A3B gate_up (2F x D)", 128, 256, 1536, 2048, a.reps)
    one("Qwen3-30B-A3B down (D x F)", 128, 256, 2048, 768, a.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
