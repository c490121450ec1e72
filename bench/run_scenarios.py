#!/usr/bin/env python3
"""Runs the scenario matrix (bench/scenarios) and prints the table for
docs/PERF.md: per row the step time (median of the timed steps of the slowest
rank), tokens/s, memory per rank, bytes sent per rank per step, and the
ratios to the fsdp row of the same backend, rank count and shape, all from
this one run (the rows of one backend, rank count and shape run in one
process group, their steps alternating). Writes build/scenarios.csv (tools/plot.py and tools/plan
--check read it).

    python3 bench/run_scenarios.py [--slow] [--steps N] [--only mpi|threads]
"""
import argparse
import csv
import os
import subprocess
import sys

ENV = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")


def rows(path, slow):
    for line in open(path):
        f = line.split("#")[0].split()
        if not f:
            continue
        if len(f) not in (9, 10):
            sys.exit(f"run_scenarios: bad row: {line.strip()}")
        if len(f) == 10 and not slow:
            continue
        b, p, m, c, t, d, ff, e, k = f[:9]
        yield dict(backend=b, ranks=int(p), mode=m, chunks=int(c), tokens=int(t), dim=int(d), ffn=int(ff),
                   experts=int(e), topk=int(k))


def run_group(group, steps):
    """One invocation per backend, rank count and shape: its modes alternate
    step by step inside the bench, so they see the same machine conditions."""
    r = group[0]
    modes = ",".join(m["mode"] + (f":{m['chunks']}" if m["mode"] == "overlap" else "") for m in group)
    args = ["--modes", modes, "--tokens", str(r["tokens"]), "--dim", str(r["dim"]), "--ffn", str(r["ffn"]),
            "--experts", str(r["experts"]), "--topk", str(r["topk"]), "--steps", str(steps), "--warmup", "1"]
    if r["backend"] == "mpi":
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(r["ranks"]), "build/bench_scenario_mpi"] + args
    else:
        cmd = ["build/bench_scenario", "--ranks", str(r["ranks"])] + args
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"run_scenarios: {' '.join(cmd)} failed:\n{out.stderr}")
    names = ["mode", "chunks", "ranks", "tokens", "dim", "ffn", "experts", "topk", "step_s", "tokens_per_s",
             "mem_bytes", "bytes_per_rank", "exposed_comm_s"]
    return [dict(zip(names, l.split(","))) for l in out.stdout.splitlines() if l and not l.startswith("mode,")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slow", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", choices=["mpi", "threads"])
    ap.add_argument("--file", default="bench/scenarios")
    ap.add_argument("--csv", default="build/scenarios.csv")
    a = ap.parse_args()
    groups = {}
    for r in rows(a.file, a.slow):
        if a.only and r["backend"] != a.only:
            continue
        g = (r["backend"], r["ranks"], r["tokens"], r["dim"], r["ffn"], r["experts"], r["topk"])
        groups.setdefault(g, []).append(r)
    results = []
    for g, members in groups.items():
        for m in run_group(members, a.steps):
            m["backend"] = g[0]
            results.append(m)
            print(f"  {g[0]:7} P={g[1]} {m['mode']:7} C={m['chunks']}: {float(m['step_s']):.3f} s", file=sys.stderr)
    key = lambda m: (m["backend"], m["ranks"], m["tokens"], m["dim"], m["ffn"], m["experts"], m["topk"])
    base = {key(m): m for m in results if m["mode"] == "fsdp"}
    ep = {key(m): m for m in results if m["mode"] == "ep"}
    cols = ["backend", "ranks", "mode", "chunks", "tokens", "dim", "ffn", "step_s", "tokens_per_s", "mem_MiB",
            "MB_per_rank", "exposed_comm_s", "speedup_vs_fsdp", "bytes_fsdp_over_this", "mem_vs_fsdp", "step_vs_ep"]
    os.makedirs(os.path.dirname(a.csv), exist_ok=True)
    with open(a.csv, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols + ["mem_bytes", "bytes_per_rank", "experts", "topk"])
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for m in results:
            b, e = base.get(key(m)), ep.get(key(m))
            st, by, mem = float(m["step_s"]), int(m["bytes_per_rank"]), int(m["mem_bytes"])
            row = [m["backend"], m["ranks"], m["mode"], m["chunks"], m["tokens"], m["dim"], m["ffn"], f"{st:.3f}",
                   f"{float(m['tokens_per_s']):.0f}", f"{mem / 2**20:.1f}", f"{by / 1e6:.2f}",
                   f"{float(m['exposed_comm_s']):.3f}",
                   f"{float(b['step_s']) / st:.2f}x" if b else "-",
                   f"{int(b['bytes_per_rank']) / by:.2f}x" if b and by else "-",
                   f"{mem / int(b['mem_bytes']):.2f}" if b else "-",
                   f"{st / float(e['step_s']):.2f}" if e else "-"]
            print("| " + " | ".join(str(x) for x in row) + " |")
            w.writerow(row + [mem, by, m["experts"], m["topk"]])
    print(f"\n(written to {a.csv})", file=sys.stderr)


if __name__ == "__main__":
    main()
