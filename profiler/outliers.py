"""A profile's self-check: op entries far slower than a peer that does at least as much work.

On a shared machine one burst of load during an op's repeats can make its entry many times too
slow (CPU profiles have shown 20x). An entry is flagged when its forward or backward time is more
than ``factor`` (10) times that of an entry of the same structure (op, dtypes, input ranks, which
inputs broadcast) whose work is at least as large: FLOPs, or for ops without FLOPs the bytes they
keep (``peak_bytes``). A larger op of the same structure is never that much faster, so the check
needs no model of the device; small ops that run below peak because of their fixed overheads are
not flagged (they are compared with larger ops' absolute times). The shipped H100 profile has no
flagged entry; ``results/validate_cpu-profile.json`` (a loaded 2-core CPU box) has one, 17x.
"""

from __future__ import annotations

import json
import warnings
from typing import Dict, List, Tuple

from nest_fx.workload.profile_file import OpEntry, Profile

FACTOR = 10.0


def _work(entry: OpEntry) -> Tuple[str, float]:
    return ("flops", entry.flops) if entry.flops > 0 else ("bytes", entry.peak_bytes)


def _structure(key: str, entry: OpEntry) -> tuple:
    """What peers share: the op, the dtypes, each input's rank and which inputs broadcast (an
    ``add`` whose gradient reduces a broadcast input is a different op from a plain one)."""
    parts = key.split("|")
    try:
        shapes = json.loads(parts[1]) if len(parts) > 1 else []
    except ValueError:
        shapes = []
    shapes = [s for s in shapes if isinstance(s, list)]
    return (
        entry.op,
        parts[3] if len(parts) > 3 else "",
        tuple(len(s) for s in shapes),
        tuple(s == shapes[0] for s in shapes),
    )


OUTLIER_PREFIX = "outlier: "


def find_outliers(profile: Profile, factor: float = FACTOR) -> List[str]:
    """One line per flagged entry: its key, the phase, how many times slower than which peer."""
    kinds: Dict[tuple, List[Tuple[str, OpEntry]]] = {}
    for key, entry in profile.ops.items():
        unit, work = _work(entry)
        if entry.usable and work > 0:
            kinds.setdefault((unit,) + _structure(key, entry), []).append((key, entry))
    found = []
    for (unit, *_), entries in sorted(kinds.items(), key=str):
        for key, entry in entries:
            for phase in ("fwd_s", "bwd_s"):
                mine = getattr(entry, phase)
                peers = [
                    (getattr(p, phase), pk)
                    for pk, p in entries
                    if pk != key and _work(p)[1] >= _work(entry)[1] and getattr(p, phase) > 0
                ]
                if not peers:
                    continue
                best, peer = min(peers)
                if mine > factor * best:
                    found.append(
                        f"{OUTLIER_PREFIX}{key} {phase[:3]} {mine * 1e3:.3g} ms is {mine / best:.1f}x the "
                        f"{best * 1e3:.3g} ms of {peer}, which does at least as many {unit}; "
                        "re-measure it on a quiet machine (nest-fx profile ... --append keeps the rest)"
                    )
    return found


def flag_outliers(profile: Profile, factor: float = FACTOR) -> List[str]:
    """Record :func:`find_outliers` in ``profile.warnings`` (saved with it), replacing the flags of
    an earlier run (entries re-measured since), and warn about each; returns them."""
    found = find_outliers(profile, factor)
    profile.warnings[:] = [w for w in profile.warnings if not w.startswith(OUTLIER_PREFIX)] + found
    for message in found:
        warnings.warn(message, stacklevel=2)
    return found
