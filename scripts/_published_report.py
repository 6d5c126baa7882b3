"""The report of a ``bench_published.py`` run: the markdown table of its rows and the summary
statistics (mean and largest errors per group of rows, the rows called infeasible, where the planner
was slower than a published configuration)."""

from __future__ import annotations

from typing import Dict, List, Optional

from _published_rows import SOURCES, Row


def published_value(row: dict) -> float:
    """The figure a row of a results JSON publishes: model TFLOP/s or tokens/s per GPU."""
    return row.get("tflops_per_gpu") or row["tps_per_gpu"]


def predicted_value(row: dict, pred: Optional[dict]) -> Optional[float]:
    """The cost model's figure in the row's unit; None when the row was not expressible."""
    if not pred or not pred.get("expressible"):
        return None
    return pred["tflops_per_gpu"] if row.get("tflops_per_gpu") else pred["tps_per_gpu"]


def _err(pred: Optional[float], published: float) -> Optional[float]:
    return None if pred is None or not published else 100.0 * (pred / published - 1.0)


def _fmt(x: Optional[float], spec: str = ".0f", pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.1f}%" if pct else format(x, spec)


def table(rows: List[Row], before: Dict[str, dict], after: Dict[str, dict], planner: Dict[str, dict]) -> str:
    lines = [
        f"Sources: {'; '.join(SOURCES)}. Rows w: Trainy; n1-n7: NeMo 24.12; n8-n10: NeMo 24.07; r: Megatron-Bridge; "
        "a: AutoModel; m: Llama 3. Throughput is tokens/s per GPU or model TFLOP/s per GPU (Llama 3: marked TF); "
        "memory is reserved GiB (torchtitan's figure; NVIDIA's systems and Llama 3 publish none, their rows "
        "check feasibility). Each row names its kernel backend; the planner's column is in the row's unit.",
        "",
        "| row | configuration | published | GiB | before | err | before GiB | err | "
        "after | err | after GiB | err | planner | planner plan |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        b, a, p = before.get(r.key, {}), after[r.key], planner.get(r.key, {})
        bt = _value(r, b) if b.get("expressible") else None
        bm = b.get("memory_gib") if b.get("expressible") else None
        bcell = "not expressible" if b and not b.get("expressible") else _fmt(bt)
        notes = "; ".join(b.get("notes", []))
        flags = f" ({'bf16' if r.bf16 else 'fp8'}, {r.kernels})"
        unit = " TF" if r.tflops_per_gpu else ""
        lines.append(
            f"| {r.key} | {r.label}{flags} | {r.published:,.0f}{unit} | {_fmt(r.memory_gib or None, '.1f')} | {bcell}"
            f"{' [' + notes + ']' if notes else ''}{'' if b.get('feasible', True) else ' INFEASIBLE'} | "
            f"{_fmt(_err(bt, r.published), pct=True)} | {_fmt(bm, '.1f')} | "
            f"{_fmt(_err(bm, r.memory_gib), pct=True)} | {_fmt(_value(r, a))} | "
            f"{_fmt(_err(_value(r, a), r.published), pct=True)} | {_fmt(a.get('memory_gib'), '.1f')} | "
            f"{_fmt(_err(a.get('memory_gib'), r.memory_gib), pct=True)}{'' if a.get('feasible', True) else ' INFEASIBLE'} | "
            f"{_fmt(p.get('tflops_per_gpu') if r.tflops_per_gpu else p.get('tps_per_gpu'))} | "
            f"{p.get('plan', p.get('why', '-'))} |"
        )
    return "\n".join(lines)


def _value(row: Row, pred: dict) -> Optional[float]:
    """The predicted figure the row's source publishes (model TFLOP/s or tokens/s per GPU)."""
    return predicted_value(row.__dict__, pred)


def summary(rows: List[Row], before: Dict[str, dict], after: Dict[str, dict], planner: Dict[str, dict]) -> dict:
    def stats(preds: Dict[str, dict], subset: List[Row], memory: bool) -> dict:
        errs = [
            abs(
                _err(
                    preds[r.key]["memory_gib"] if memory else _value(r, preds[r.key]),
                    r.memory_gib if memory else r.published,
                )
            )
            for r in subset
            if preds.get(r.key, {}).get("expressible") and (r.memory_gib or not memory)
        ]
        return {
            "rows": len(errs),
            "mean_abs_pct": sum(errs) / len(errs) if errs else None,
            "max_abs_pct": max(errs) if errs else None,
        }

    out = {}
    groups = [("bf16", [r for r in rows if r.bf16]), ("all", rows)]
    groups += [(f"kernels_{k}", [r for r in rows if r.kernels == k]) for k in ("eager", "compile", "fused")]
    groups += [
        (f"system_{s}", [r for r in rows if r.system == s]) for s in ("torchtitan", "nemo", "automodel", "llama3")
    ]
    blackwell = ("dgx-b200", "gb200-nvl72")  # the device presets' own check (error_bands.DEVICE_BANDS)
    groups += [("hopper", [r for r in rows if r.hardware not in blackwell])]
    groups += [("blackwell", [r for r in rows if r.hardware in blackwell])]
    for name, subset in groups:
        if not subset:
            continue
        for label, preds in (("before", before), ("after", after)):
            if preds:
                out[f"{label}_{name}"] = {
                    "throughput": stats(preds, subset, False),
                    "memory": stats(preds, subset, True),
                    "expressible": sum(1 for r in subset if preds.get(r.key, {}).get("expressible")),
                }
    for label, preds in (("before", before), ("after", after)):
        if preds:
            out[f"{label}_infeasible"] = [
                r.key
                for r in rows
                if preds.get(r.key, {}).get("expressible") and not preds[r.key].get("feasible", True)
            ]
    slower = [
        r.key
        for r in rows
        if planner.get(r.key, {}).get("found")
        # a configuration the model calls infeasible is not the planner's to match: after_infeasible lists it
        and after[r.key].get("feasible", True)
        and planner[r.key]["tps_per_gpu"] < after[r.key]["tps_per_gpu"] * (1 - 1e-9)
    ]
    out["planner_slower_than_published"] = slower
    out["planner_not_found"] = [r.key for r in rows if planner and not planner.get(r.key, {}).get("found")]
    return out
