#!/usr/bin/env python3
"""Renders examples/train's CSV log to PNG: loss and held-out loss, aux loss,
and a heat map of each expert's share of the routed tokens over the steps
(layer 0), optionally with a second run (e.g. EP=4) overlaid.

    build/train --csv build/ep1.csv && build/train --ep 4 --csv build/ep4.csv
    python3 tools/plot.py build/ep1.csv --compare build/ep4.csv --out docs/train.png
"""
import argparse
import csv
import math

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    rows = list(csv.DictReader(open(path)))
    loads = sorted((k for k in rows[0] if k.startswith("load_l0_e")), key=lambda k: int(k.split("_e")[1]))
    return rows, loads


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--compare", default=None, help="a second run's CSV to overlay")
    ap.add_argument("--label", default="EP=1")
    ap.add_argument("--compare-label", default="EP=4")
    ap.add_argument("--out", default="docs/train.png")
    a = ap.parse_args()
    rows, loads = read(a.csv)
    step = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1.2, 1, 1.4]})
    ax[0].plot(step, [float(r["loss"]) for r in rows], lw=0.8, label=f"train loss ({a.label})")
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if not math.isnan(float(r["val_loss"]))]
    ax[0].plot([s for s, _ in val], [v for _, v in val], "o-", ms=3, label=f"held-out ({a.label})")
    if a.compare:
        crow, _ = read(a.compare)
        ax[0].plot([int(r["step"]) for r in crow], [float(r["loss"]) for r in crow], lw=0.8, ls="--",
                   label=f"train loss ({a.compare_label})")
    ax[0].set_xlabel("step"); ax[0].set_ylabel("cross-entropy (nats/char)"); ax[0].legend(); ax[0].grid(alpha=0.3)
    ax[0].set_title("loss")
    ax[1].plot(step, [float(r["aux_loss"]) for r in rows], lw=0.8, color="tab:red")
    ax[1].set_xlabel("step"); ax[1].set_ylabel("aux loss (HF convention; balanced = K)"); ax[1].grid(alpha=0.3)
    ax[1].set_title("load-balancing loss")
    share = []
    for r in rows:
        c = [float(r[k]) for k in loads]
        s = sum(c) or 1.0
        share.append([x / s for x in c])
    im = ax[2].imshow(list(map(list, zip(*share))), aspect="auto", interpolation="nearest", cmap="viridis",
                      extent=[step[0], step[-1], len(loads) - 0.5, -0.5])
    ax[2].set_xlabel("step"); ax[2].set_ylabel("expert (layer 0)"); ax[2].set_title("share of routed tokens")
    fig.colorbar(im, ax=ax[2])
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
