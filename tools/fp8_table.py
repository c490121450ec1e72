#!/usr/bin/env python3
"""tools/fp8_table.py - the FP8 layer against bf16 as one markdown table, from what tools/gpu_check.sh fp8
wrote to its output folder (OUT): fp8.log (bench_cuda's steps, bench_q8's passes, the torch peer's lines,
tools/curve_diff.py's), profile_*_fp8.txt (tools/cupti_summary.py's sums of each FP8 step's kernels).

    python3 tools/fp8_table.py OUT

One column a shape, one row a timed variant ("bf16, auto", "FP8, kernel", ..., from the step's name:
"bench_cuda SHAPE T=N VARIANT"): an FP8 step with its bf16 twin's (the same GEMM form) step over it; then
the quantizing kernels' share of each FP8 step (moept__k_q8_*), each bench_q8 form's slowest pass, the
peer's bf16 / FP8; then every goal at every shape with its measured value, "-" where the logs have none
(a step not run, failed, skipped; a line cut short is left out). docs/PERF.md keeps the tables a lent
GPU gave."""
import collections
import math
import os
import re
import sys

# the shapes (the columns: these, then any other the logs name)
NAMES = {"mixtral": "Mixtral-8x7B", "deepseek": "DeepSeek-V3 experts", "qwen3": "Qwen3-30B-A3B"}
PEER = {"Mixtral": "mixtral", "DeepSeek-V3": "deepseek", "Qwen3-30B-A3B": "qwen3"}
# the goals: bf16 step / FP8 step at least (by shape) in each of the layer's FP8 GEMM forms (gpu_check.sh's
# "FP8, FORM" steps: AUTO's cuBLASLt a matmul an expert, and the grouped kernel), the quantizing kernels'
# share of an FP8 step at most, every quantizing pass's rate at least (TB/s), the loss's moving average
# off bf16's at most after warm-up (curve_diff's step 50), for each model gpu_check.sh trains
STEP_GOAL = {"mixtral": 1.4, "deepseek": 1.4, "qwen3": 1.2}
FORMS = ("auto", "kernel")
SHARE_GOAL, RATE_GOAL, LOSS_GOAL = 0.08, 3.5, 0.0025
MODELS = ("the example's model", "the wide model")


def fields(line):
    """a RESULT line's key=value pairs"""
    return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)


def number(f, key):
    """f[key] as a finite float; None where missing or no such number (a line cut short)"""
    try:
        v = float(f[key])
    except (KeyError, ValueError):
        return None
    return v if math.isfinite(v) else None


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
    """the logs' values: T[shape]; bench[shape][variant] = (ms, dtype, form); q8[shape] = [(form, pass,
    TB/s, over a copy's)]; peer[shape] = [(GEMM, bf16/FP8 or why not)]; loss[model]"""
    T, bench = {}, collections.defaultdict(collections.OrderedDict)
    q8, peer, loss = collections.defaultdict(list), collections.defaultdict(list), {}
    log = os.path.join(out_dir, "fp8.log")
    for name, lines in steps(log) if os.path.exists(log) else []:
        m = re.match(r"(bench_cuda|bench_q8) (\S+) T=(\d+)", name)
        if m:
            T.setdefault(m.group(2), m.group(3))
        v = re.match(r"bench_cuda (\S+) T=\d+ (.+)$", name)
        for line in lines:
            f = fields(line) if line.startswith("RESULT ") else {}
            if v and line.startswith("RESULT tokens=") and number(f, "step_ms") and "sync_free" in f:
                bench[v.group(1)][v.group(2)] = (number(f, "step_ms"), f.get("dtype", ""), f["gemm_form"])
            elif line.startswith("RESULT q8 ") and None not in (number(f, "tbs"), number(f, "over_copy")):
                if "shape" in f and "form" in f and "pass" in f:
                    q8[f["shape"]].append((f["form"], f["pass"], number(f, "tbs"), number(f, "over_copy")))
            elif re.match(r"(Mixtral|DeepSeek-V3|Qwen3-30B-A3B) \S+ .*: bf16 ", line):
                r = re.search(r"bf16/fp8 ([\d.]+)|(bf16|fp8) unavailable", line)
                cell = (r.group(1) or r.group(0)) if r else "-"
                peer[PEER[line.split()[0]]].append((line.split()[1], cell))
            elif name.startswith("curve_diff") and "largest |relative difference|" in line:
                model = MODELS[1] if name.endswith("_wide") else MODELS[0]
                pct = number({"v": line.rsplit(" ", 1)[1][:-1]}, "v") if line.endswith("%") else None
                if pct is not None:
                    loss[model] = pct / 100
    return T, bench, q8, peer, loss


def share(out_dir, shape, form):
    """(the moept__k_q8_* kernels' share of the FP8 step, ms by kernel) from profile fp8's summary; None
    where it has no step (not run, nsys's instead, no whole step) or no such kernel (every FP8 step has
    one, the records' at least: their names not read)"""
    p = os.path.join(out_dir, f"profile_{shape}{'' if form == 'auto' else '_' + form}_fp8.txt")
    step, q = None, collections.OrderedDict()
    for line in open(p) if os.path.exists(p) else []:
        m = re.search(r"per step: ([\d.]+) ms", line)
        step = float(m.group(1)) if m else step
        m = re.match(r"  (\S+)\s+[\d.]+ launches\s+([\d.]+) ms", line)
        k = re.search(r"moept__k_q8[a-z0-9_]*", m.group(1)) if m else None  # (demangled or not)
        if k:
            q[k.group(0)] = q.get(k.group(0), 0.0) + float(m.group(2))
    return (sum(q.values()) / step, q) if step and q else None


def value_rows(out_dir, cols, bench, q8, peer):
    """{row: {shape: cell}} (the steps', the shares', the passes', the peer's) and the values the goals
    judge: ratio[(shape, form)], shares[(shape, form)], slowest[(shape, bench_q8 form)]"""
    kinds = [collections.OrderedDict() for _ in range(4)]
    ratio, shares, slowest = {}, {}, {}
    for s in cols:
        for v, (ms, dtype, form) in bench[s].items():
            twin = [t for t in bench[s].values() if t[1] == "bf16" and t[2] == form]
            cell = f"{ms:.2f} ms"
            if "fp8" in dtype and twin:
                r = twin[0][0] / ms
                cell += f": {r:.2f}"
                if v == f"FP8, {form}":
                    ratio[(s, form)] = r
            kinds[0].setdefault(f"step, {v}", {})[s] = cell
        for form in FORMS:
            sh = share(out_dir, s, form)
            if sh:
                shares[(s, form)] = sh[0]
                k = ", ".join(f"{n.replace('moept__', '')} {ms:.2f}" for n, ms in sh[1].items())
                kinds[1].setdefault(f"quantizing kernels' share of the FP8 step, {form}", {})[s] = \
                    f"{sh[0]:.1%} ({k} ms)"
        for form, p, tbs, oc in q8.get(s, []):
            if (s, form) not in slowest or tbs < slowest[(s, form)]:
                slowest[(s, form)] = tbs
                kinds[2].setdefault(f"slowest quantizing pass, {forms(form)} (bench_q8)", {})[s] = \
                    f"{p} {tbs:.2f} TB/s, {oc:.2f} of a copy's"
        for gemm, r in peer.get(s, []):
            kinds[3].setdefault(f"torch._scaled_grouped_mm: bf16 / FP8, {gemm}", {})[s] = r
    rows = collections.OrderedDict()
    for k in kinds:
        rows.update(k)
    return rows, ratio, shares, slowest


def goals(cols, T, ratio, shares, slowest, loss):
    """the goals' rows: (goal, measured or None, met)"""
    out, rate_forms = [], sorted({f for (_, f) in slowest}) or ["any"]
    for s in cols:
        name = f"{NAMES.get(s, s)} T {T.get(s, '?')}"
        for form in FORMS:
            g, r = STEP_GOAL.get(s), ratio.get((s, form))
            if g:
                out.append((f"bf16 / FP8 step >= {g}, {name}, FP8 {form}", r and f"{r:.2f}", r and r >= g))
            v = shares.get((s, form))
            out.append((f"quantizing kernels' share <= {SHARE_GOAL:.0%}, {name}, FP8 {form}",
                        v is not None and f"{v:.1%}", v is not None and v <= SHARE_GOAL))
        for f in rate_forms:
            v = slowest.get((s, f))
            out.append((f"every quantizing pass >= {RATE_GOAL} TB/s, {name}, {forms(f)}",
                        v is not None and f"slowest {v:.2f}", v is not None and v >= RATE_GOAL))
    for m in MODELS:
        v = loss.get(m)
        out.append((f"loss's moving average off bf16's <= {LOSS_GOAL:.2%} after step 50, {m}",
                    v is not None and f"{v:.2%}", v is not None and v <= LOSS_GOAL))
    return out


def forms(form):
    """bench_q8's form: per-expert, kernel, or both (a pass either form runs)"""
    return "both forms" if form == "both" else form + " form"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out_dir = sys.argv[1]
    T, bench, q8, peer, loss = read(out_dir)
    cols = list(dict.fromkeys(list(NAMES) + list(bench) + list(q8) + list(peer)))
    rows, ratio, shares, slowest = value_rows(out_dir, cols, bench, q8, peer)
    if rows:
        print("| | " + " | ".join(f"{NAMES.get(s, s)} T {T.get(s, '?')}" for s in cols) + " |")
        print("|---|" + "---|" * len(cols))
        for row, cells in rows.items():
            print(f"| {row} | " + " | ".join(cells.get(c, "-") for c in cols) + " |")
        print("\nFP8 steps: their bf16 twin's step (the same GEMM form) over theirs after the colon. The"
              " share: the kernels named moept__k_q8_* (the passes, and at one rank the dispatch's"
              " records), not what the GEMMs' epilogues and combine's backward (moept__k_combine_bwd8)"
              " quantize as they write.\n")
    print("| goal | measured | met |\n|---|---|---|")
    for goal, v, ok in goals(cols, T, ratio, shares, slowest, loss):
        print(f"| {goal} | {v or '-'} | {'-' if not v else 'yes' if ok else 'no'} |")


if __name__ == "__main__":
    main()
