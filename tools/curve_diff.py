#!/usr/bin/env python3
"""Two training logs of examples/train.c (--csv) side by side: the loss's moving average (0.95 decay, as
train prints it) every 50 steps and the held-out loss where logged, with the second's relative difference
from the first (docs/PERF.md's FP8 curve).

usage: python3 tools/curve_diff.py BASE.csv OTHER.csv [--every N]
"""
import csv
import math
import sys


def curve(path):
    rows, avg, out = list(csv.DictReader(open(path))), None, []
    for r in rows:
        loss = float(r["loss"])
        avg = loss if avg is None else 0.95 * avg + 0.05 * loss
        out.append((int(r["step"]), loss, avg, float(r["val_loss"])))
    return out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    every = int(sys.argv[sys.argv.index("--every") + 1]) if "--every" in sys.argv else 50
    if len(args) < 2:
        sys.exit(__doc__)
    a, b = curve(args[0]), curve(args[1])
    print("| step | moving average, base | other | relative difference | held-out, base | other |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for (s, _, aa, va), (_, _, ab, vb) in zip(a, b):
        rel = (ab - aa) / aa
        if s > 50:
            worst = max(worst, abs(rel))
        if s == 1 or s % every == 0 or s == len(a):
            v = f"{va:.4f} | {vb:.4f}" if not math.isnan(va) else "- | -"
            print(f"| {s} | {aa:.4f} | {ab:.4f} | {rel:+.2%} | {v} |")
    print(f"\nlargest |relative difference| of the moving average after step 50: {worst:.2%}")


if __name__ == "__main__":
    main()
