#!/usr/bin/env python3
"""Runs bench_layer (builtin GEMM and OpenBLAS builds) and the PyTorch eager
baseline at the three shapes (T = 4096, 1024, 256), in one go, and prints the table.

    make bench            (or: python3 bench/run_bench_layer.py)

OpenBLAS picks its kernel from the CPU; where it does not recognise a
virtual CPU and falls back to a generic SSE kernel (Prescott), the runner
sets OPENBLAS_CORETYPE to SkylakeX or Haswell if, and only if, the CPU has
every instruction set that kernel uses, so the baseline is the library at
its best here (a value the environment sets is removed first). The builtin
build times OpenBLAS's floor in its own process too, in turn with its own:
the "same process" rate ratio, which the machine's drift between processes
does not move. Then bench_gemm: each of the step's GEMMs against the
machine's measured FMA peak and OpenBLAS, for the native and the
-march=x86-64-v3 builds."""
import os
import re
import subprocess
import sys

SHAPES = [("GEMM-bound", 4096, 7), ("between", 1024, 7), ("overhead-bound", 256, 11)]
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


# OpenBLAS kernels it falls back to on CPUs it does not recognise, and the
# CPU flags each better kernel needs (forcing one the CPU lacks dies of SIGILL)
GENERIC = {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Katmai", "Northwood", "Banias", "Atom"}
NEEDS = [("SkylakeX", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}), ("Haswell", {"avx2", "fma"})]


def openblas_core(env):
    out = run(["build/cblas/bench_layer", "--tokens", "16", "--hidden", "64", "--ffn", "64", "--reps", "1"],
              dict(env, OPENBLAS_VERBOSE="2"))
    m = re.search(r"Core: (\S+)", out)
    return m.group(1) if m else "unknown"


def set_coretype(env):
    """OpenBLAS's own choice for this CPU (OPENBLAS_CORETYPE removed, should
    the environment pin one), unless that is a generic fallback: then the
    best kernel whose instructions this CPU has (or none)."""
    env.pop("OPENBLAS_CORETYPE", None)
    native = openblas_core(env)
    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if native in GENERIC:
        for core, need in NEEDS:
            if need <= flags:
                env["OPENBLAS_CORETYPE"] = core
                break
    print(f"OpenBLAS's own kernel here: {native}")
    print(f"OpenBLAS kernel: {openblas_core(env)} (OPENBLAS_CORETYPE={env.get('OPENBLAS_CORETYPE', 'unset')})")


def v3_env(env):
    """The x86-64-v3 build stands for an AVX2 machine: on an AVX-512 CPU,
    OpenBLAS beside it runs its AVX2 kernel (Haswell); elsewhere its own."""
    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return dict(env, OPENBLAS_CORETYPE="Haswell") if "avx512f" in flags else env


def gemm_tables(env):
    """bench_gemm (builtin vs the FMA peak vs OpenBLAS) at both token counts,
    for the native build and the -march=x86-64-v3 one when built"""
    for exe, what in (("build/bench_gemm", "-march=native"), ("build/v3/bench_gemm", "-march=x86-64-v3")):
        if not os.path.exists(exe):
            continue
        for _, T, _ in SHAPES:
            print(f"\n### bench_gemm, {what}, T={T}\n")
            out = run([exe, "--tokens", str(T), "--hidden", str(D), "--ffn", str(F), "--experts", str(E),
                       "--topk", str(K), "--reps", "7" if T > 1024 else "9"], v3_env(env) if "v3" in exe else env)
            print("\n".join(l for l in out.splitlines() if not l.startswith("RESULT")))


def paired(r):
    """the layer's ratio to its floor: the medians' ratio, then the median and range over reps of each
    step over the mean of the floors timed right before and after it; the fastest step over the fastest floor"""
    return (f"{float(r['ratio']):.3f} ({float(r['ratio_paired']):.3f} [{float(r['ratio_paired_min']):.3f}-"
            f"{float(r['ratio_paired_max']):.3f}]; best {float(r['ratio_best']):.3f})")


def main():
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), OPENBLAS_NUM_THREADS=str(THREADS))
    have_cblas = os.path.exists("build/cblas/bench_layer")
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    if have_cblas:  # (the Makefile links the builtin build with OpenBLAS exactly when it builds this one)
        set_coretype(env)
    rows = []
    for name, T, reps in SHAPES:
        args = ["--tokens", str(T), "--hidden", str(D), "--ffn", str(F), "--experts", str(E), "--topk", str(K),
                "--reps", str(reps)]
        res = {"builtin": parse(run(["build/bench_layer"] + args, env))}
        if os.path.exists("build/v3/bench_layer"):
            res["v3"] = parse(run(["build/v3/bench_layer"] + args, v3_env(env)))
        if have_cblas:
            res["cblas"] = parse(run(["build/cblas/bench_layer"] + args, env))
        if have_torch:
            res["torch"] = parse(run([sys.executable, "tools/bench_torch.py", "--threads", str(THREADS),
                                      "--reps", str(max(2, reps // 2))] + args[:-2], env))
        rows.append((name, T, res))
    print(f"\nMixtral-shaped layer D={D} F={F} E={E} K={K}, fp32, forward+backward, {THREADS} threads, median of reps\n")
    print("| shape | T | moept builtin (s) | its GEMM floor (s) | ratio (paired: median [range] of reps, each step over the floors beside it; best: fastest over fastest) | moept CBLAS (s) | its GEMM floor (s) | ratio "
          "| PyTorch eager (s) | torch / moept CBLAS | builtin / OpenBLAS floor rate, same process: median [range; fastest reps] of reps (separate processes) | moept peak MiB | torch peak MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, T, r in rows:
        b = r["builtin"]
        c = r.get("cblas")
        t = r.get("torch")
        best = c or b
        cells = [name, str(T), f"{float(b['moept_s']):.3f}", f"{float(b['floor_s']):.3f}", paired(b)]
        if c:
            cells += [f"{float(c['moept_s']):.3f}", f"{float(c['floor_s']):.3f}", f"{float(c['ratio']):.3f}"]
        else:
            cells += ["skipped", "-", "-"]
        if t:
            cells += [f"{float(t['torch_s']):.3f}", f"{float(t['torch_s']) / float(best['moept_s']):.2f}x"]
        else:
            cells += ["skipped (no torch)", "-"]
        same = (f"{float(b['rate_vs_openblas']):.2f} [{float(b['rate_vs_openblas_min']):.2f}-"
                f"{float(b['rate_vs_openblas_max']):.2f}; best {float(b['rate_vs_openblas_best']):.2f}]"
                if "rate_vs_openblas" in b else "-")
        cells += [f"{same} ({float(c['floor_s']) / float(b['floor_s']):.2f})" if c else same]
        mp = int(best["peak_bytes"]) / 2**20
        cells += [f"{mp:.0f}"]
        if t:
            tp = int(t["peak_bytes"]) / 2**20
            cells += [f"{tp:.0f}", f"{mp / tp:.2f}"]
        else:
            cells += ["-", "-"]
        print("| " + " | ".join(cells) + " |")
    def pk(r, key):
        return f"{float(r[key]):.0f} ({100 * float(r[key]) / float(r['peak_gflops']):.0f}%)"
    print("\nGFLOP/s, moept / floor (of the FMA peak measured in the same process): " + "; ".join(
        f"T={T} builtin {pk(r['builtin'], 'gflops')}/{pk(r['builtin'], 'floor_gflops')}"
        + (f", CBLAS {pk(r['cblas'], 'gflops')}/{pk(r['cblas'], 'floor_gflops')}" if "cblas" in r else "")
        for _, T, r in rows))
    print("FMA peak measured: " + ", ".join(f"{float(r['builtin']['peak_gflops']):.0f}" for _, _, r in rows)
          + f" GFLOP/s on {THREADS} threads")
    for _, T, r in rows:
        if "v3" in r:
            v = r["v3"]
            same = (f", builtin / OpenBLAS {v['openblas']} floor rate {float(v['rate_vs_openblas']):.2f}"
                    f" [{float(v['rate_vs_openblas_min']):.2f}-{float(v['rate_vs_openblas_max']):.2f};"
                    f" best {float(v['rate_vs_openblas_best']):.2f}]"
                    if "rate_vs_openblas" in v else "")
            print(f"-march=x86-64-v3 build, T={T}: moept {float(v['moept_s']):.3f} s, floor {float(v['floor_s']):.3f} s,"
                  f" ratio {paired(v)}, {float(v['gflops']):.0f}/{float(v['floor_gflops']):.0f} GFLOP/s{same}")
    gemm_tables(env)


if __name__ == "__main__":
    main()
