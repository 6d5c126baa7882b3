#!/usr/bin/env python
"""Predicted against published throughput of every row of ``results/bench_published.json``, one
point per row and source system, on log axes with the 10% and 15% bands around parity; an open
marker for the cost model before the change (``before``), a filled one after. Rows the model
calls infeasible are drawn as crosses. Written by ``bench_published.py`` after each run; run
alone to redraw from a JSON:

    python scripts/plot_published.py results/bench_published.json results/bench_published.png
"""

from __future__ import annotations

import argparse
import json

from nest_fx.report.plotting import pyplot_or_none

from _published_report import predicted_value, published_value

COLORS = {"torchtitan": "tab:blue", "nemo": "tab:green", "automodel": "tab:purple", "llama3": "tab:red"}


def plot(data: dict, out: str) -> bool:
    """Draw ``data`` (the benchmark's JSON) to ``out``; False when matplotlib is missing."""
    plt = pyplot_or_none()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 6))
    values = []
    for row in data["rows"]:
        pub = published_value(row)
        color = COLORS.get(row.get("system", "torchtitan"), "tab:gray")
        for label, filled in (("before", False), ("after", True)):
            pred = predicted_value(row, data.get(label, {}).get(row["key"]))
            if pred is None:
                continue
            values += [pub, pred]
            feasible = data[label][row["key"]].get("feasible", True)
            if not feasible:
                ax.scatter(pub, pred, marker="x", color=color, s=36, zorder=3)
            else:
                ax.scatter(
                    pub, pred, marker="o", facecolors=color if filled else "none", edgecolors=color, s=36, zorder=3
                )
            if filled:
                ax.annotate(row["key"], (pub, pred), fontsize=6, xytext=(3, 2), textcoords="offset points")
    lo, hi = min(values) / 1.3, max(values) * 1.3
    for band, style in ((0.10, ":"), (0.15, "--")):
        for sign in (1, -1):
            ax.plot([lo, hi], [lo * (1 + sign * band), hi * (1 + sign * band)], style, color="gray", lw=0.8)
    ax.plot([lo, hi], [lo, hi], "-", color="black", lw=0.8)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
    ax.set_xlabel("published (tokens/s per GPU; Llama 3 rows: model TFLOP/s per GPU)")
    ax.set_ylabel("predicted by nest-fx")
    for system, color in COLORS.items():
        ax.scatter([], [], color=color, label=system)
    ax.scatter([], [], facecolors="none", edgecolors="gray", label="before (open)")
    ax.scatter([], [], marker="x", color="gray", label="called infeasible")
    ax.legend(fontsize=7, loc="upper left")
    after = data.get("summary", {}).get("after_all", {}).get("throughput", {})
    if after.get("mean_abs_pct") is not None:
        ax.set_title(
            f"Published runs: mean |error| {after['mean_abs_pct']:.1f}% over {after['rows']} rows (dotted 10%, dashed 15%)",
            fontsize=9,
        )
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", default="results/bench_published.json")
    ap.add_argument("png", nargs="?", default="results/bench_published.png")
    args = ap.parse_args()
    with open(args.json, encoding="utf-8") as fh:
        data = json.load(fh)
    if plot(data, args.png):
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
