"""The error bands a run of ``bench_published.py`` gives, next to the bands nest-fx carries.

``nest_fx.cost.error_bands`` holds each band as a constant (the package does not read the
benchmark's results). This derives them from a results JSON by the module's rule: a row on a
device with published runs of its own (B200, GB200) counts for that device's band only; every
other row counts for its kernel backend's band when it uses no feature, else for the band of the
last feature it uses in ``FEATURE_BANDS``' order. A band is its rows' largest relative throughput
error, rounded up to a whole percent. After a cost-model change, run the benchmark, then this; a
band that differs is set to the derived figure (``tests/unit/cost/test_error_bands.py`` fails
until it is).

    python scripts/published_bands.py                        # results/bench_published.json
    python scripts/published_bands.py path/to/bench_published.json
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from nest_fx.cost.error_bands import BACKEND_BANDS, DEVICE_BANDS, FEATURE_BANDS, features_used

from _published_report import predicted_value, published_value

# the rows' hardware presets whose device family has a band of its own (DEVICE_BANDS)
DEVICE_OF_HARDWARE = {"dgx-b200": "B200", "gb200-nvl72": "GB200"}


@dataclass(frozen=True)
class DerivedBand:
    """A band as the rows give it: ``rel`` (rounded up), the widest row and its error."""

    rel: float
    widest: str
    widest_error: float
    rows: Tuple[str, ...]


def row_features(row: dict) -> List[str]:
    """The banded features a benchmark row uses, in ``FEATURE_BANDS``' order."""
    return features_used(row["float8"], row["tp"], row.get("ep", 1), row["pp"], row["cp"])


def row_band(row: dict) -> str:
    """The band a row counts for: its device's, else its last feature's, else its backend's."""
    device = DEVICE_OF_HARDWARE.get(row["hardware"])
    if device:
        return device
    features = row_features(row)
    return features[-1] if features else row.get("backend") or ("compile" if row["compile"] else "eager")


def row_errors(data: dict) -> List[Tuple[dict, float]]:
    """(row, relative throughput error) for every expressible row of a results JSON."""
    out = []
    for row in data["rows"]:
        value = predicted_value(row, data["after"].get(row["key"]))
        if value is not None:
            out.append((row, abs(value / published_value(row) - 1)))
    return out


def rounded_up(error: float) -> float:
    """``error`` rounded up to a whole percent (a float error a hair over a whole percent is not
    rounded to the next one)."""
    return math.ceil(round(100 * error, 6)) / 100


def derived_bands(data: dict) -> Dict[str, DerivedBand]:
    """Band name (backend, feature or device family) -> the band the rows give it."""
    grouped: Dict[str, List[Tuple[str, float]]] = {}
    for row, error in row_errors(data):
        grouped.setdefault(row_band(row), []).append((row["key"], error))
    out = {}
    for name, rows in grouped.items():
        key, widest = max(rows, key=lambda r: r[1])
        out[name] = DerivedBand(rounded_up(widest), key, widest, tuple(k for k, _ in rows))
    return out


def carried_bands() -> Dict[str, Optional[float]]:
    """Band name -> the band nest-fx carries (None: unchecked)."""
    return {
        **{k: b.rel for k, b in BACKEND_BANDS.items()},
        **{k: b.rel for k, b in FEATURE_BANDS.items()},
        **{k: b.rel for k, b in DEVICE_BANDS.items()},
    }


def bands_table(data: dict) -> str:
    """A markdown table: each band's rows, widest row, derived and carried figure."""
    derived = derived_bands(data)
    lines = [
        "| band | rows | widest row | derived | carried |",
        "|---|---|---|---:|---:|",
    ]
    for name, carried in carried_bands().items():
        d = derived.get(name)
        shown = "unchecked" if carried is None else f"{100 * carried:.0f}%"
        if d is None:
            lines.append(f"| {name} | none here | | | {shown} |")
            continue
        mark = "" if carried == d.rel else " (differs)"
        lines.append(
            f"| {name} | {', '.join(d.rows)} | {d.widest} {100 * d.widest_error:.1f}% | "
            f"{100 * d.rel:.0f}%{mark} | {shown} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = argv[0] if argv else os.path.join(root, "results", "bench_published.json")
    with open(path, encoding="utf-8") as fh:
        print(bands_table(json.load(fh)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
