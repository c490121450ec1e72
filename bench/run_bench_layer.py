#!/usr/bin/env python3
"""Runs bench_layer (builtin GEMM and OpenBLAS builds) and the PyTorch eager
baseline at the two shapes of docs/PERF.md, in one go, and prints the table.

    make bench            (or: python3 bench/run_bench_layer.py)

OpenBLAS 0.3.21 does not recognise this machine's virtual CPU and falls back
to its generic Prescott (SSE3) kernels; where the CPU has AVX-512 (or AVX2)
the runner sets OPENBLAS_CORETYPE=SkylakeX (Haswell) and prints the kernel
OpenBLAS reports, so the baseline is the library at its best here."""
import os
import re
import subprocess
import sys

SHAPES = [("GEMM-bound", 4096, 3), ("overhead-bound", 256, 9)]
D, F, E, K, THREADS = 1024, 3584, 8, 2, 2


def parse(out):
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return dict(kv.split("=", 1) for kv in line.split()[1:])
    raise RuntimeError("no RESULT line in:\n" + out)


def run(cmd, env):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(" ".join(cmd) + " failed:\n" + r.stdout + r.stderr)
    return r.stdout + r.stderr


def main():
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), OPENBLAS_NUM_THREADS=str(THREADS))
    flags = open("/proc/cpuinfo").read()
    if "OPENBLAS_CORETYPE" not in os.environ:
        if " avx512f" in flags:
            env["OPENBLAS_CORETYPE"] = "SkylakeX"
        elif " avx2" in flags:
            env["OPENBLAS_CORETYPE"] = "Haswell"
    have_cblas = os.path.exists("build/cblas/bench_layer")
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    if have_cblas:
        kern = run(["build/cblas/bench_layer", "--tokens", "16", "--hidden", "64", "--ffn", "64", "--reps", "1"],
                   dict(env, OPENBLAS_VERBOSE="2"))
        m = re.search(r"Core: (\S+)", kern)
        print(f"OpenBLAS kernel: {m.group(1) if m else 'unknown'}"
              f" (OPENBLAS_CORETYPE={env.get('OPENBLAS_CORETYPE', 'unset')})")
    rows = []
    for name, T, reps in SHAPES:
        args = ["--tokens", str(T), "--hidden", str(D), "--ffn", str(F), "--experts", str(E), "--topk", str(K),
                "--reps", str(reps)]
        res = {"builtin": parse(run(["build/bench_layer"] + args, env))}
        if have_cblas:
            res["cblas"] = parse(run(["build/cblas/bench_layer"] + args, env))
        if have_torch:
            res["torch"] = parse(run([sys.executable, "tools/bench_torch.py", "--threads", str(THREADS),
                                      "--reps", str(max(2, reps // 2))] + args[:-2], env))
        rows.append((name, T, res))
    print(f"\nMixtral-shaped layer D={D} F={F} E={E} K={K}, fp32, forward+backward, {THREADS} threads, median of reps\n")
    print("| shape | T | moept builtin (s) | its GEMM floor (s) | ratio | moept CBLAS (s) | its GEMM floor (s) | ratio "
          "| PyTorch eager (s) | torch / moept CBLAS | builtin floor / CBLAS floor | moept peak MiB | torch peak MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, T, r in rows:
        b = r["builtin"]
        c = r.get("cblas")
        t = r.get("torch")
        best = c or b
        cells = [name, str(T), f"{float(b['moept_s']):.3f}", f"{float(b['floor_s']):.3f}", f"{float(b['ratio']):.3f}"]
        if c:
            cells += [f"{float(c['moept_s']):.3f}", f"{float(c['floor_s']):.3f}", f"{float(c['ratio']):.3f}"]
        else:
            cells += ["skipped", "-", "-"]
        if t:
            cells += [f"{float(t['torch_s']):.3f}", f"{float(t['torch_s']) / float(best['moept_s']):.2f}x"]
        else:
            cells += ["skipped (no torch)", "-"]
        cells += [f"{float(b['floor_s']) / float(c['floor_s']):.2f}x" if c else "-"]
        mp = int(best["peak_bytes"]) / 2**20
        cells += [f"{mp:.0f}"]
        if t:
            tp = int(t["peak_bytes"]) / 2**20
            cells += [f"{tp:.0f}", f"{mp / tp:.2f}"]
        else:
            cells += ["-", "-"]
        print("| " + " | ".join(cells) + " |")
    print("\nGFLOP/s (moept / floor): " + "; ".join(
        f"T={T} builtin {float(r['builtin']['gflops']):.0f}/{float(r['builtin']['floor_gflops']):.0f}"
        + (f", CBLAS {float(r['cblas']['gflops']):.0f}/{float(r['cblas']['floor_gflops']):.0f}" if "cblas" in r else "")
        for _, T, r in rows))


if __name__ == "__main__":
    main()
