#!/usr/bin/env python3
"""Renders examples/train's CSV log to PNG: loss and held-out loss, aux loss,
and a heat map of each expert's share of the routed tokens over the steps
(layer 0), optionally with a second run (e.g. EP=4) overlaid. With
--scenarios it renders the scenario bench's table instead (bars of step
time, memory and bytes per rank for each mode).

    build/train --csv build/ep1.csv && build/train --ep 4 --csv build/ep4.csv
    python3 tools/plot.py build/ep1.csv --compare build/ep4.csv --out docs/train.png
    python3 tools/plot.py --scenarios build/scenarios.csv --out docs/scenarios.png
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


def scenarios(path, out):
    rows = list(csv.DictReader(open(path)))
    groups = []
    for r in rows:
        g = (r["backend"], r["ranks"], r["tokens"], r["dim"], r["ffn"])
        if g not in groups:
            groups.append(g)
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = {"fsdp": "tab:gray", "ep": "tab:blue", "overlap": "tab:green"}
    metrics = [("step_s", "step time (s), lower is better"), ("mem_MiB", "layer memory per rank (MiB)"),
               ("MB_per_rank", "MB sent per rank per step (log)")]
    for mi, (key, title) in enumerate(metrics):
        x, labels = 0, []
        for g in groups:
            members = [r for r in rows if (r["backend"], r["ranks"], r["tokens"], r["dim"], r["ffn"]) == g]
            for r in members:
                name = r["mode"] + (f" C={r['chunks']}" if r["mode"] == "overlap" else "")
                ax[mi].bar(x, float(r[key]), color=colors.get(r["mode"], "tab:orange"))
                labels.append((x, name))
                x += 1
            ax[mi].text(x - len(members) / 2 - 0.5, 0.99, f"{g[0]} P={g[1]}", ha="center", va="top",
                        transform=ax[mi].get_xaxis_transform(), fontsize=8, fontweight="bold")
            x += 1
        ax[mi].set_xticks([p for p, _ in labels])
        ax[mi].set_xticklabels([n for _, n in labels], rotation=60, fontsize=7)
        ax[mi].set_title(title)
        ax[mi].grid(axis="y", alpha=0.3)
        if key == "MB_per_rank":
            ax[mi].set_yscale("log")
    fig.suptitle(f"one MoE layer per rank, D={rows[0]['dim']} F={rows[0]['ffn']} E={rows[0]['experts']} "
                 f"K={rows[0]['topk']}, {rows[0]['tokens']} tokens per rank (bench/scenarios)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="?")
    ap.add_argument("--scenarios", default=None, help="the scenario bench's CSV (build/scenarios.csv)")
    ap.add_argument("--compare", default=None, help="a second run's CSV to overlay")
    ap.add_argument("--label", default="EP=1")
    ap.add_argument("--compare-label", default="EP=4")
    ap.add_argument("--out", default="docs/train.png")
    a = ap.parse_args()
    if a.scenarios:
        scenarios(a.scenarios, a.out)
        return
    if not a.csv:
        ap.error("give the training log's CSV, or --scenarios")
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
