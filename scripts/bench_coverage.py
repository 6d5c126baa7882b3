#!/usr/bin/env python
"""Model coverage: every model of the coverage suite under every plan of it, on 4 CPU ranks.

    python scripts/bench_coverage.py                                   # the whole matrix
    python scripts/bench_coverage.py --models hf:t5,cnn --plans planner,TP2xDP2
    python scripts/bench_coverage.py --out results/bench_coverage_before
    python scripts/bench_coverage.py --suite styles                    # models people bring (below)

``--suite styles`` runs instead the models written in the styles of the common codebases outside
HuggingFace (``nest_fx.testing_styles.STYLE_MODELS``: a nanoGPT GPT trained on its own loss, timm's
and torchvision's ViTs, DeiT, a torchvision CNN with nested stages, Meta's reference Llama and
torchtitan's Llama 3 with complex RoPE, Swin, MLP-Mixer, ConvNeXt) under the same plans except
EP, written to ``results/bench_coverage_styles``.

The suite (``nest_fx.testing.COVERAGE_MODELS``): tiny configs of transformers families
(``hf:<model_type>``: its default config shrunk, no download) of five kinds (decoders, encoders,
encoder-decoders, MoE, vision) and two plain PyTorch models (an ``nn.Sequential`` MLP and a CNN
with BatchNorm). The plans (``COVERAGE_PLANS``): the planner's choice (``auto_parallelize`` with no
plan, the NEST DP on the cpu-gloo preset), TP2xDP2, PP2xDP2 (1F1B, 2 microbatches), TP2xPP2, and
EP2xDP2 for MoE models.

Each cell launches 4 gloo ranks (``nest_fx.apply.launch``), trains the model for 3 SGD steps under
the plan with ``auto_parallelize`` and, on every rank, the same weights on one device
(``nest_fx.testing.equivalence``: the model's own inputs, e.g. T5's ``input_ids`` and
``decoder_input_ids``, its own loss from ``labels``, dropout off), and reports:

* ``ok``: losses, full gradients and parameters within 1e-5 of the single-device run;
* ``refused``: nest-fx refused the model or the plan before the ranks' first collective, with its
  reason (the default group's collective count is 0 when the ``NestFxError`` is raised);
* ``mismatch``: it trained and the numbers differ (the worst defect);
* ``crash``: it failed once training had started (a bug, whatever the model);
* ``late refusal``: a ``NestFxError`` after the first collective (a refusal must come before it);
* ``error`` / ``timeout``: another exception while setting up, a rank that died, or a hang (the
  last line of the first failing rank).

Only ``ok`` and ``refused`` keep the rule (``nest_fx.testing_coverage``); the exit status is 1
when any other outcome appears.

Before its cells, each model's fp32 noise is measured in this process (``testing.fp32_noise``):
how far its single-device fp32 run drifts from the same run in fp64 over the same 3 steps (the
largest parameter difference). A model whose noise reaches the tolerance cannot be judged at
1e-5 by any run that sums in another order; the column says so (``over tol``).

A progress line per cell (status, seconds). Writes ``<out>.md`` (the matrix and the refusal
reasons, for the README) and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List


from nest_fx.testing import COVERAGE_BATCH, COVERAGE_MODELS, COVERAGE_PLANS, COVERAGE_SEQ, COVERAGE_TOL, fp32_noise
from nest_fx.testing_coverage import KEPT
from nest_fx.testing_coverage import run_cell as run_coverage_cell
from nest_fx.testing_styles import STYLE_MODELS, style_spec

from _bench_common import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 4
MARK = {
    "ok": "ok",
    "refused": "refused",
    "mismatch": "**MISMATCH**",
    "crash": "**CRASH**",
    "late-refusal": "late refusal",
    "error": "error",
    "timeout": "timeout",
    "n/a": "-",
}


def _spec(model: str, plan: Dict[str, Any]) -> Dict[str, Any]:
    if model in STYLE_MODELS:
        return style_spec(model, plan, batch=COVERAGE_BATCH)
    return {"model": model, "plan": dict(plan), "batch": COVERAGE_BATCH, "seq": COVERAGE_SEQ, "steps": 3, "lr": 0.5}


def noise(model: str) -> Dict[str, Any]:
    """The model's fp32 rounding drift over the cells' 3 steps (``testing.fp32_noise``), or why unknown."""
    try:
        return fp32_noise(_spec(model, {}))
    except Exception as exc:  # noqa: BLE001 - a model that cannot build fails its cells with the reason
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}


def run_cell(model: str, plan_name: str, timeout: float) -> Dict[str, Any]:
    """One cell: launch, classify (``nest_fx.testing_coverage.run_cell``), time."""
    if plan_name.startswith("EP") and _kind(model) != "moe":
        return {"status": "n/a", "seconds": 0.0}
    start = time.perf_counter()
    cell = run_coverage_cell(_spec(model, COVERAGE_PLANS[plan_name]), WORLD, timeout)
    cell["seconds"] = round(time.perf_counter() - start, 1)
    return cell


def _kind(model: str) -> str:
    return STYLE_MODELS[model][0] if model in STYLE_MODELS else COVERAGE_MODELS.get(model, "?")


def _short(reason: str, limit: int = 160) -> str:
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def _noise_text(row: Dict[str, Any]) -> str:
    if "param" not in row:
        return "n/a"
    flag = " (over tol)" if row["param"] >= COVERAGE_TOL else ""
    return f"{row['param']:.0e}{flag}"


def markdown(matrix: Dict[str, Dict[str, Dict[str, Any]]], plans: List[str], noises: Dict[str, Dict[str, Any]]) -> str:
    """The matrix (one row per model, one column per plan, the model's fp32 drift from fp64) and the
    distinct refusal/error reasons."""
    lines = ["| model | kind | " + " | ".join(plans) + " | fp32 noise |", "|---|---|" + "---|" * (len(plans) + 1)]
    reasons: Dict[str, List[str]] = {}
    for model, row in matrix.items():
        cells = []
        for plan in plans:
            cell = row[plan]
            text = MARK[cell["status"]]
            if cell.get("reason"):
                key = _short(cell["reason"])
                number = list(reasons).index(key) + 1 if key in reasons else len(reasons) + 1
                reasons.setdefault(key, []).append(f"{model} {plan}")
                text += f" [{number}]"
            cells.append(text)
        lines.append(
            f"| `{model}` | {_kind(model)} | " + " | ".join(cells) + f" | {_noise_text(noises.get(model, {}))} |"
        )
    counts: Dict[str, int] = {}
    for row in matrix.values():
        for cell in row.values():
            counts[cell["status"]] = counts.get(cell["status"], 0) + 1
    lines += ["", "Cells: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "n/a"), ""]
    if reasons:
        lines += ["Reasons (refusals and errors, first 160 characters):", ""]
        for number, (reason, where) in enumerate(reasons.items(), 1):
            lines.append(f"{number}. {reason} ({len(where)} cells)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--suite",
        choices=("coverage", "styles"),
        default="coverage",
        help="coverage: COVERAGE_MODELS (default); styles: nest_fx.testing_styles.STYLE_MODELS",
    )
    parser.add_argument("--models", help="comma-separated model names (default: the suite's)")
    parser.add_argument("--plans", help=f"comma-separated, of {list(COVERAGE_PLANS)} (default: all; styles: no EP)")
    parser.add_argument(
        "--out",
        help="output path without extension (.md and .json are written; default "
        "results/bench_coverage or results/bench_coverage_styles)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per cell before its ranks are killed")
    parser.add_argument(
        "--reuse",
        metavar="JSON",
        help="a previous run of the same code: keep its cells and fp32 "
        "noise, run again only its error and timeout cells and what it lacks",
    )
    args = parser.parse_args(argv)
    styles = args.suite == "styles"
    args.models = args.models or ",".join(STYLE_MODELS if styles else COVERAGE_MODELS)
    args.plans = args.plans or ",".join(p for p in COVERAGE_PLANS if not (styles and p.startswith("EP")))
    args.out = args.out or os.path.join(ROOT, "results", "bench_coverage_styles" if styles else "bench_coverage")
    previous = json.load(open(args.reuse, encoding="utf-8")) if args.reuse else {"matrix": {}, "fp32_noise": {}}
    models = [m for m in args.models.split(",") if m]
    plans = [p for p in args.plans.split(",") if p]
    unknown = [p for p in plans if p not in COVERAGE_PLANS]
    if unknown:
        parser.error(f"unknown plan(s) {unknown}; use {list(COVERAGE_PLANS)}")
    matrix: Dict[str, Dict[str, Dict[str, Any]]] = {}
    total = len(models) * len(plans)
    start = time.perf_counter()
    noises: Dict[str, Dict[str, Any]] = {}
    for model in models:
        noises[model] = previous["fp32_noise"].get(model) or noise(model)
        print(f"{model:<16} fp32 noise {_noise_text(noises[model])} {noises[model].get('error', '')[:100]}", flush=True)
        matrix[model] = {}
        for plan in plans:
            cell = previous["matrix"].get(model, {}).get(plan)
            if cell is None or cell["status"] in ("error", "timeout"):
                cell = run_cell(model, plan, args.timeout)
            matrix[model][plan] = cell
            done = sum(len(r) for r in matrix.values())
            detail = cell.get("plan") or _short(cell.get("reason", ""), 100)
            print(
                f"[{done}/{total}] {model:<16} {plan:<8} {cell['status']:<8} {cell['seconds']:6.1f}s  {detail}",
                flush=True,
            )
    table = markdown(matrix, plans, noises)
    write_json(
        args.out + ".json",
        {
            "world": WORLD,
            "batch": COVERAGE_BATCH,
            "seq": COVERAGE_SEQ,
            "tolerance": 1e-5,
            "plans": {p: COVERAGE_PLANS[p] for p in plans},
            "matrix": matrix,
            "fp32_noise": noises,
            "seconds": round(time.perf_counter() - start, 1),
            "reused_run_seconds": previous.get("seconds"),
        },
        indent=2,
        quiet=True,
    )
    with open(args.out + ".md", "w", encoding="utf-8") as fh:
        fh.write(table)
    print(table)
    print(f"wrote {args.out}.md and {args.out}.json")
    return 1 if any(c["status"] not in KEPT + ("n/a",) for r in matrix.values() for c in r.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
