#!/usr/bin/env python3
"""tools/fp8_table.py - the FP8 layer against bf16 as one markdown table, from what tools/gpu_check.sh fp8
wrote to its output folder (OUT): fp8.log (bench_cuda's steps, bench_q8's passes, the torch peer's lines,
tools/curve_diff.py's), profile_*_fp8.txt (tools/cupti_summary.py's sums of each FP8 step's kernels).

    python3 tools/fp8_table.py OUT

One column a shape (the bench steps' order), one row a timed variant ("bf16, auto", "FP8, kernel", ...,
from the step's name: "bench_cuda SHAPE T=N VARIANT"): an FP8 step with its bf16 twin's (the same GEMM
form) step over it; then the separate quantizing kernels' share of each FP8 step (moept__k_q8_*), the
quantizing passes' rates (bench_q8), the peer's bf16 / FP8; then the goals, each measured value beside
its goal. A value not in the logs (a step not run, failed, skipped) is "-". docs/PERF.md keeps the
tables a lent GPU gave."""
import collections
import glob
import os
import re
import sys

NAMES = {"mixtral": "Mixtral-8x7B", "deepseek": "DeepSeek-V3 experts", "qwen3": "Qwen3-30B-A3B"}
PEER = {"Mixtral": "mixtral", "DeepSeek-V3": "deepseek", "Qwen3-30B-A3B": "qwen3"}
# the goals: bf16 step / FP8 step at least (by shape), the quantizing kernels' share of an FP8 step at
# most, every separate pass's rate at least, the loss's moving average off bf16's at most (after warm-up)
STEP_GOAL = {"mixtral": 1.4, "deepseek": 1.4, "qwen3": 1.2}
SHARE_GOAL, RATE_GOAL, LOSS_GOAL = 0.08, 3.5, 0.0025


def fields(line):
    return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)


def steps(log):
    """[(step name, its lines)] of a gpu_check.sh log"""
    out = []
    for line in open(log, errors="replace"):
        if line.startswith("== "):
            out.append((line[3:].strip(), []))
        elif out:
            out[-1][1].append(line.rstrip("\n"))
    return out


def read(out_dir):
    """the logs' values: bench[(shape, T)][variant] = RESULT fields; q8[shape] = RESULT q8 lines' fields;
    peer[shape] = [(GEMM, bf16/FP8 or why not)]; loss[model] = its largest relative difference"""
    bench, q8 = collections.OrderedDict(), collections.defaultdict(list)
    peer, loss = collections.defaultdict(list), {}
    log = os.path.join(out_dir, "fp8.log")
    for name, lines in steps(log) if os.path.exists(log) else []:
        m = re.match(r"bench_cuda (\S+) T=(\d+) (.+)$", name)
        for line in lines:
            if m and line.startswith("RESULT tokens="):
                col = bench.setdefault((m.group(1), m.group(2)), collections.OrderedDict())
                col[m.group(3)] = fields(line)
            elif line.startswith("RESULT q8 "):
                f = fields(line)
                q8[f["shape"]].append(f)
            elif re.match(r"(Mixtral|DeepSeek-V3|Qwen3-30B-A3B) \S+ .*: bf16 ", line):
                r = re.search(r"bf16/fp8 ([\d.]+)|fp8 unavailable", line)
                cell = (r.group(1) or "unavailable") if r else "-"
                peer[PEER[line.split()[0]]].append((line.split()[1], cell))
            elif name.startswith("curve_diff") and "largest |relative difference|" in line:
                model = "the wide model" if name.endswith("_wide") else "the example's model"
                loss[model] = float(line.rsplit(" ", 1)[1].rstrip("%")) / 100
    return bench, q8, peer, loss


def share(out_dir, shape, form):
    """(the moept__k_q8_* kernels' share of the FP8 step, ms by kernel) from profile fp8's summary"""
    p = os.path.join(out_dir, f"profile_{shape}{'' if form == 'auto' else '_' + form}_fp8.txt")
    if not os.path.exists(p):
        return None
    step, q = None, collections.OrderedDict()
    for line in open(p):
        m = re.search(r"per step: ([\d.]+) ms", line)
        step = float(m.group(1)) if m else step
        m = re.match(r"  (moept__k_q8\w*)\s+[\d.]+ launches\s+([\d.]+) ms", line)
        if m:
            q[m.group(1)] = q.get(m.group(1), 0.0) + float(m.group(2))
    return (sum(q.values()) / step, q) if step else None


def bench_rows(bench):
    """{row: {column: cell}}: each variant's step, FP8's with its bf16 twin's over it; (ratios)"""
    rows, ratios = collections.OrderedDict(), {}
    for col, variants in bench.items():
        for v, f in variants.items():
            ms = float(f["step_ms"])
            cell = f"{ms:.2f} ms"
            twin = [g for g in variants.values() if g["dtype"] == "bf16" and g["gemm_form"] == f["gemm_form"]]
            if "fp8" in f["dtype"] and twin:
                ratios[col + (v,)] = r = float(twin[0]["step_ms"]) / ms
                cell += f": {r:.2f}"
            rows.setdefault(f"step, {v}", {})[col] = cell
    return rows, ratios


def q8_rows(q8, col):
    """{row: cell} of bench_q8's passes at col's shape: each form's slowest pass; (their rates)"""
    rows, slow = {}, {}
    for f in q8.get(col[0], []):
        if "sum" in f or "pass" not in f:
            continue
        if f["form"] not in slow or float(f["tbs"]) < float(slow[f["form"]]["tbs"]):
            slow[f["form"]] = f
    for form, f in slow.items():
        rows[f"slowest quantizing pass, {forms(form)} (bench_q8)"] = \
            f"{f['pass']} {float(f['tbs']):.2f} TB/s, {float(f['over_copy']):.2f} of a copy's"
    return rows, {(col[0], k): float(f["tbs"]) for k, f in slow.items()}


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out_dir = sys.argv[1]
    bench, q8, peer, loss = read(out_dir)
    cols = list(bench)
    rows, ratios = bench_rows(bench)
    shares, rates = {}, {}
    for col in cols:
        for form in ("auto", "kernel"):
            s = share(out_dir, col[0], form)
            if s:
                shares[col + (form,)] = s[0]
                k = ", ".join(f"{n.replace('moept__', '')} {ms:.2f}" for n, ms in s[1].items())
                rows.setdefault(f"quantizing kernels' share of the FP8 step, {form}", {})[col] = \
                    f"{s[0]:.1%} ({k or 'none'} ms)"
        r, slow = q8_rows(q8, col)
        rates.update(slow)
        for k, v in r.items():
            rows.setdefault(k, {})[col] = v
        for gemm, r in peer.get(col[0], []):
            rows.setdefault(f"torch._scaled_grouped_mm: bf16 / FP8, {gemm}", {})[col] = r
    print("| | " + " | ".join(f"{NAMES.get(s, s)} T {t}" for s, t in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for row, cells in rows.items():
        print(f"| {row} | " + " | ".join(cells.get(c, "-") for c in cols) + " |")
    print("\nFP8 steps: their bf16 twin's step (the same GEMM form) over theirs after the colon. The share:"
          " the quantizing kernels of their own (moept__k_q8_*), not what the GEMMs' epilogues, the"
          " dispatch and the combine quantize as they write.\n")
    print("| goal | measured | met |\n|---|---|---|")
    for (s, t, v), r in ratios.items():
        g = STEP_GOAL.get(s)
        print(f"| bf16 / FP8 step >= {g}, {NAMES.get(s, s)} T {t}, {v} | {r:.2f} | {yes(g and r >= g)} |")
    for (s, t, form), v in shares.items():
        print(f"| quantizing kernels' share <= {SHARE_GOAL:.0%}, {NAMES.get(s, s)}, {form} | {v:.1%} | "
              f"{yes(v <= SHARE_GOAL)} |")
    for (s, form), v in rates.items():
        print(f"| every quantizing pass >= {RATE_GOAL} TB/s, {NAMES.get(s, s)}, {forms(form)} | "
              f"slowest {v:.2f} | {yes(v >= RATE_GOAL)} |")
    for name, v in loss.items():
        print(f"| loss's moving average off bf16's <= {LOSS_GOAL:.2%} after step 50, {name} | {v:.2%} | "
              f"{yes(v <= LOSS_GOAL)} |")


def yes(ok):
    return "yes" if ok else "no"


def forms(form):
    """bench_q8's form: per-expert, kernel, or both (a pass either form runs)"""
    return "both forms" if form == "both" else form + " form"


if __name__ == "__main__":
    main()
