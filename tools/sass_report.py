#!/usr/bin/env python3
"""sass_report.py - what the elementwise kernels compile to (sm_90 SASS),
without a GPU: per kernel its global loads and stores by width, and per
activation the instructions of its inner loop per element.

Needs nvcc and cuobjdump (the CUDA toolkit's, or `pip install
nvidia-cuda-cuobjdump`: its bin/ on PATH). Run from the repository root:
    python3 tools/sass_report.py
The activation probe compiles moept_kernels.cu with one kernel per kind and
element type around moept__act_fwd_rows / moept__act_bwd_rows, so each inner
loop is that kind's straight code (the real kernels switch once, then run
the same loop). The loop count is static: the division's slow path (a CALL,
taken only for denormal or huge operands) is outside it."""
import os
import re
import subprocess
import sys
import tempfile

NVCC = os.environ.get("NVCC", "nvcc")
FLAGS = ["-O3", "-std=c++17", "--fmad=false", "-arch", "sm_90", "-cubin"]
ELEMENTWISE = ("k_check", "k_cast", "k_gather", "k_act_", "k_combine", "k_shared_bwd", "k_dx")
PROBE = """#include "moept_kernels.cu"
template <int A, typename T, int V>
__global__ void probe_fwd(const T *h, int64_t R, int F, int H, T *a) { moept__act_fwd_rows<A, T, V>(h, R, F, H, a); }
template <int A, typename T, int V>
__global__ void probe_bwd(T *h, const T *da, int64_t R, int F, int H) { moept__act_bwd_rows<A, T, V>(h, da, R, F, H); }
"""
KINDS = {"silu_gated": ("MOEPT_ACT_SILU_GATED", 0), "gelu_gated": ("MOEPT_ACT_GELU_GATED", 1)}  # moept.h's values


def sass(cubin):
    out = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    funcs, f = {}, None
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            f = m.group(1)
            funcs[f] = []
            continue
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m and f:
            funcs[f].append((int(m.group(1), 16), m.group(2)))
    return funcs


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


def mem_ops(code):
    """(opcode, bits) of each global load and store"""
    ops = []
    for _, ins in code:
        m = re.search(r"\b((LDG|STG)[.A-Z0-9_]*)", ins)
        if m:
            op = m.group(1)
            bits = 128 if ".128" in op else 64 if ".64" in op else 16 if "16" in op else 8 if "8" in op else 32
            ops.append((m.group(2), bits))
    return ops


def widths(code):
    n = {}
    for op, bits in mem_ops(code):
        n[f"{op}{bits}"] = n.get(f"{op}{bits}", 0) + 1
    return " ".join(f"{k}x{v}" for k, v in sorted(n.items()))


def inner_loop(code):
    """the shortest backward branch's body: the innermost loop"""
    best = None
    for a, ins in code:
        m = re.search(r"BRA 0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < a:
            body = [i for x, i in code if int(m.group(1), 16) <= x <= a]
            if best is None or len(body) < len(best):
                best = body
    return best or []


def compile_(src, cubin):
    r = subprocess.run([NVCC] + FLAGS + ["-I.", src, "-o", cubin], capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr)


def main():
    with tempfile.TemporaryDirectory() as d:
        compile_("moept_kernels.cu", os.path.join(d, "k.cubin"))
        funcs = sass(os.path.join(d, "k.cubin"))
        names = demangle(list(funcs))
        print("kernel (sm_90)".ljust(44), "SASS  global loads/stores (opcode+bits x count)")
        for f in sorted(funcs, key=lambda k: names[k]):
            if any(e in f for e in ELEMENTWISE):
                short = re.sub(r"\(.*", "", names[f]).replace("void ", "").replace("unsigned short", "bf16")
                print(f"{short:44} {len(funcs[f]):5}  {widths(funcs[f])}")
        probe = PROBE
        for kind, (enum, _) in KINDS.items():
            for t, v in (("moept__bf16", 8), ("moept__bf16", 1), ("float", 4), ("float", 1)):
                for p in ("fwd", "bwd"):
                    args = ("const T *, int64_t, int, int, T *" if p == "fwd" else "T *, const T *, int64_t, int, int")
                    probe += f"template __global__ void probe_{p}<{enum}, {t}, {v}>({args.replace('T', t)});\n"
        src = os.path.join(d, "probe.cu")
        with open(src, "w") as fh:
            fh.write(probe.replace('#include "moept_kernels.cu"', f'#include "{os.path.abspath("moept_kernels.cu")}"'))
        compile_(src, os.path.join(d, "p.cubin"))
        funcs = sass(os.path.join(d, "p.cubin"))
        names = demangle(list(funcs))
        print("\nactivation inner loop (sm_90)".ljust(45), "instr  lanes  per element  memory ops")
        for f in sorted(funcs, key=lambda k: names[k]):
            m = re.search(r"probe_(fwd|bwd)<(\d+), (float|unsigned short), (\d+)>", names[f])
            if not m:
                continue
            kind = [k for k, (_, val) in KINDS.items() if str(val) == m.group(2)]
            body = inner_loop(funcs[f])
            v, ebits = int(m.group(4)), 16 if "short" in m.group(3) else 32
            # elements a trip (the compiler may unroll): bits stored / (1 output fwd, dg and du bwd)
            stored = sum(bits for op, bits in mem_ops([(0, i) for i in body]) if op == "STG")
            lanes = max(1, stored // ebits // (1 if m.group(1) == "fwd" else 2))
            label = f"{kind[0] if kind else m.group(2)} {m.group(1)} {'bf16' if 'short' in m.group(3) else 'fp32'} V={v}"
            print(f"{label:44} {len(body):5}  {lanes:5}  {len(body) / lanes:11.1f}  {widths([(0, i) for i in body])}")


if __name__ == "__main__":
    main()
