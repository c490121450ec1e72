#!/usr/bin/env python3
"""tools/cupti_summary.py - one layer step of what tools/cupti_trace.c
recorded of a bench_cuda run (one GEMM form): the GPU's time in cuBLAS's
kernels (the union of their spans: side streams overlap), in moept's own
kernels by name, in copies and memsets, and idle; and the host's time in the
runtime calls that wait (synchronize, synchronous copies).

    python3 tools/cupti_summary.py cupti_trace.csv [--skip 2]

A step runs from one routing kernel (moept__k_route) to the next; the first
--skip steps (bench_cuda's warm-ups: growth, uploads) and the last (which
runs on into the optimizer's bench) are left out, the rest averaged."""
import argparse
import collections
import csv
import re
import shutil
import subprocess


def union(rows):
    """ns covered by the [start, end) spans of rows"""
    total, s0, e0 = 0, None, None
    for r in sorted(rows, key=lambda r: r[2]):
        if e0 is None or r[2] > e0:
            total += 0 if e0 is None else e0 - s0
            s0, e0 = r[2], r[3]
        else:
            e0 = max(e0, r[3])
    return total + (0 if e0 is None else e0 - s0)


def bare(n):
    """a kernel's name from its mangled one (_Z, the name's length, the name), else up to its arguments"""
    m = re.match(r"_Z(\d+)", n)
    return n[m.end():m.end() + int(m.group(1))] if m else n.split("(")[0].split("<")[0]


def demangle(names):
    """each kernel's name without its arguments and template's: c++filt's, else bare()'s"""
    if not shutil.which("c++filt"):
        return {n: bare(n) for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    return {n: d.split("(")[0].replace("void ", "").split("<")[0] for n, d in zip(names, out.split("\n"))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--skip", type=int, default=2)
    a = ap.parse_args()
    rows, dropped = [], 0  # (kind, name, start, end)
    with open(a.trace) as f:
        for r in csv.DictReader(f):
            rows.append((r["kind"], r["name"], int(r["start_ns"]), int(r["end_ns"])))
            dropped += int(r["bytes"]) if r["kind"] == "D" else 0
    if dropped:
        print(f"warning: CUPTI dropped {dropped} records; the sums below miss them")
    gpu = sorted((r for r in rows if r[0] in ("K", "C", "S")), key=lambda r: r[2])
    # the routing kernel by its mangled name (its length, 14, leads it), its demangled one or its bare name
    # (the emulated GPU's trace)
    routes = [r[2] for r in gpu
              if r[0] == "K" and ("14moept__k_route" in r[1] or r[1].split("(")[0] == "moept__k_route")]
    if len(routes) < a.skip + 2:
        print(f"{len(routes)} routing kernels: no whole step after {a.skip} skipped")
        return
    t0, t1 = routes[a.skip], routes[-1]
    n = len(routes) - 1 - a.skip
    use = [r for r in gpu if t0 <= r[2] < t1]
    ms = 1e-6 / n
    own = collections.defaultdict(lambda: [0, 0])
    blas = [r for r in use if r[0] == "K" and "moept__" not in r[1]]
    for r in use:
        if r[0] == "K" and "moept__" in r[1]:
            own[r[1]][0] += 1
            own[r[1]][1] += r[3] - r[2]
    names = demangle(sorted(own))
    print(f"{n} steps (of {len(routes)}), per step: {(t1 - t0) * ms:.3f} ms, the GPU idle "
          f"{(t1 - t0 - union(use)) * ms:.3f} ms")
    print(f"  cuBLAS kernels (union) {union(blas) * ms:.3f} ms, "
          f"moept kernels {sum(v[1] for v in own.values()) * ms:.3f} ms")
    print(f"  copies {sum(r[3] - r[2] for r in use if r[0] == 'C') * ms:.3f} ms, "
          f"memsets {sum(r[3] - r[2] for r in use if r[0] == 'S') * ms:.3f} ms")
    for k, v in sorted(own.items(), key=lambda kv: -kv[1][1]):
        print(f"  {names[k]:28s} {v[0] / n:5.1f} launches {v[1] * ms:8.3f} ms")
    waits = collections.defaultdict(lambda: [0, 0])
    for r in rows:
        if r[0] == "R" and t0 <= r[2] < t1 and ("ynchronize" in r[1] or r[1].split("_v")[0] == "cudaMemcpy"):
            waits[r[1]][0] += 1
            waits[r[1]][1] += r[3] - r[2]
    for k, v in sorted(waits.items(), key=lambda kv: -kv[1][1]):
        print(f"  host {k:28s} {v[0] / n:5.1f} calls {v[1] * ms:8.3f} ms")


if __name__ == "__main__":
    main()
