#!/usr/bin/env python
"""Fused attention's rate by call length: the measured ratios of ``bench_gpu_vs_model.py``'s JSONs
(one per GPU) against the law the cost model prices (``attention_share``). Left: SDPA over whole
sequences, each length's forward + backward rate over its kernel's median over >= 8K tokens, with
the law's share of the tabled rate; right: ring attention's chunked calls against the whole
sequence, with the law's chunk-over-sequence ratio. Run on one or more of those JSONs (several
GPUs on one figure):

    python scripts/plot_attention_length.py results/gpu/attention_length.png \\
        results/gpu/gpu_vs_model.json results/gpu/gpu_vs_model_h100.json
"""

from __future__ import annotations

import argparse
import json
from typing import List, Optional, Sequence

from nest_fx.report.plotting import pyplot_or_none
from nest_fx.workload.attention_share import ATTENTION_HALF_RATE_TOKENS, attention_length_share, ring_chunk_share

MARKERS = {"flash": "o", "cudnn": "s", "efficient": "^"}


def plot(results: Sequence[dict], out: str, half_tokens: float = ATTENTION_HALF_RATE_TOKENS) -> bool:
    """Draw ``results`` (``bench_gpu_vs_model.py`` JSONs) to ``out``; False when matplotlib is missing."""
    plt = pyplot_or_none()
    if plt is None:
        return False
    fig, (whole, ring) = plt.subplots(1, 2, figsize=(11, 4.5))
    lengths = [2 ** (i / 4) for i in range(40, 69)]  # 1K-128K tokens
    whole.plot(lengths, [attention_length_share(k, half_tokens) for k in lengths], "k-", label="law (priced)")
    for n, result in enumerate(results):
        color = f"C{n}"
        device = result["measured_on"].split(",")[0]
        for kernel, marker in MARKERS.items():
            rows = [r for r in result.get("length", []) if r["kernel"] == kernel]
            if rows:
                whole.plot(
                    [r["tokens"] for r in rows],
                    [r["measured"] for r in rows],
                    marker,
                    color=color,
                    fillstyle="none" if kernel == "efficient" else "full",
                    label=f"{device} {kernel}" + (" (not priced)" if kernel == "efficient" else ""),
                )
        rows = result.get("ring", [])
        if rows:
            ring.plot(
                [r["chunk_tokens"] for r in rows],
                [r["efficiency_fwd_bwd"] for r in rows],
                "o",
                color=color,
                label=device,
            )
    chunks = sorted({(r["chunk_tokens"], r["tokens"]) for result in results for r in result.get("ring", [])})
    for seq in sorted({s for _, s in chunks}):
        xs = [c for c, s in chunks if s == seq]
        law = [ring_chunk_share(c, seq, half_tokens) for c in xs]
        ring.plot(xs, law, "k--" if seq == chunks[0][1] else "k:", label=f"law, {seq:,}-token sequence")
    for ax, title, xlabel in (
        (whole, "SDPA over the whole sequence (fwd + bwd)", "tokens (keys per call)"),
        (ring, "ring attention's chunk-pair calls (fwd + bwd)", "chunk tokens (keys per call)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    whole.set_ylabel("rate / the kernel's median over >= 8K tokens")
    ring.set_ylabel("rate / the whole sequence's")
    fig.suptitle(
        f"fused attention's rate by call length: k / (k + {half_tokens:,.0f}) of the long-call rate", fontsize=11
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("results", nargs="+", help="bench_gpu_vs_model.py JSONs")
    args = parser.parse_args(argv)
    results = []
    for path in args.results:
        with open(path) as fh:
            results.append(json.load(fh))
    if not plot(results, args.out):
        print("matplotlib is not installed: pip install -e '.[plot]'")
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
