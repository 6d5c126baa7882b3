"""How far the published-run benchmark's predictions move with one cost option that the rows'
sources do not state (``bench_published.py``'s assumptions): each chosen row costed with each
given value of the option in place of its own.

    python scripts/bench_published_sensitivity.py --rows n r --option overlap_tp_comm --values 0 0.5 1

NVIDIA's performance recipes turn on Transformer Engine's userbuffers TP overlap for their TP rows
(Megatron-Bridge's ``COMM_OVERLAP_CONFIG_MAP``, ``userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192``
and its kin), but no source gives the share of the TP collectives it hides, so ``bench_published``
prices them exposed (0). This script shows what each share would predict.

Writes ``OUT/bench_published_sensitivity_<option>.{md,json}``: per row and value, the predicted
figure in the row's unit and its error against the published one.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from nest_fx.plan.settings import setting

from _bench_common import write_json
from bench_published import predict
from _published_rows import rows_named


def sensitivity(keys: List[str], option: str, values: list) -> List[dict]:
    """One entry per chosen row: its key, tensor-parallel degree, published figure and, per
    value, the predicted figure and its error in percent."""
    out = []
    for row in rows_named(keys):
        entry = {"key": row.key, "tp": row.tp, "published": row.published, "predicted": {}, "error_pct": {}}
        for value in values:
            found = predict(row, **{option: value})
            if not found.get("expressible"):
                continue
            entry["predicted"][str(value)] = found["value"]
            entry["error_pct"][str(value)] = 100 * (found["value"] / row.published - 1)
        out.append(entry)
    return out


def table(entries: List[dict], option: str, values: list) -> str:
    """The entries as a markdown table: one column of errors per value."""
    head = "| row | tp | published | " + " | ".join(f"{option}={v}" for v in values) + " |"
    rule = "|---|---:|---:|" + "---:|" * len(values)
    lines = [head, rule]
    for e in entries:
        errors = " | ".join(f"{e['error_pct'][str(v)]:+.1f}%" if str(v) in e["error_pct"] else "-" for v in values)
        lines.append(f"| {e['key']} | {e['tp']} | {e['published']:,.0f} | {errors} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", required=True, help="row keys or prefixes (n, r1, t5, ...)")
    parser.add_argument(
        "--option", required=True, help="a cost option the plan settings declare (overlap_tp_comm, ...)"
    )
    parser.add_argument("--values", nargs="+", required=True, help="the values to cost the rows with")
    parser.add_argument("--out", default="results", help="output folder (default results)")
    args = parser.parse_args(argv)
    kind = setting(args.option).type  # a KeyError naming the known settings otherwise
    values = [kind(v) for v in args.values]
    entries = sensitivity(args.rows, args.option, values)
    text = table(entries, args.option, values)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"bench_published_sensitivity_{args.option}")
    command = " ".join(["python scripts/bench_published_sensitivity.py"] + (sys.argv[1:] if argv is None else argv))
    with open(stem + ".md", "w", encoding="utf-8") as fh:
        fh.write(f"# Published rows against `{args.option}`\n\nWritten by `{command}`.\n\n{text}\n")
    write_json(stem + ".json", {"option": args.option, "values": values, "rows": entries})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
