"""How sure a step-time prediction is: an error band per kernel backend and per feature, from
the published runs ``scripts/bench_published.py`` checks (``results/bench_published.json``).

A band is the largest relative error of the predicted throughput against the published one over
a set of rows (rounded up to a whole percent): a backend's over its rows that use none of the
features below; a feature's (in the order ``float8``, tensor parallelism ``tp``, expert
parallelism ``ep``, pipelining ``pp``, context parallelism ``cp``) over the rows that use it and
no feature later in that order, so every published row is covered by the band of its last feature.
The order runs from the best-predicted feature to the worst, so a row's error is charged to the
least sure feature it uses: the 405B rows that pipeline a 131K-262K context (m3, t6.2-t6.4) widen
the CP band, not that of every pipelined plan (PP's was 65% with ``pp`` last, 22% now). Those
come from the Hopper rows (H100, H200: ``BANDED_FAMILIES``); a device with published runs of its own
has a band from them (``DEVICE_BANDS``, by the device family its name names: :func:`device_family`).
A plan's band is the widest of its backend's, each feature's it uses and its device's. A backend
no published run checks has no band (``None``: "unchecked"), and neither has a plan that uses it,
nor one on a device no published run checks (a TPU, a CPU, an unnamed part): the Hopper rows say
nothing about its rates. ``tests/unit/cost/test_error_bands.py`` checks every band against the
benchmark's JSON (A100's against Narayanan et al.'s rows, ``tests/unit/cost/test_published.py``),
so a cost-model change that moves the errors outside the bands fails until they are measured again.

A plan's predicted gain over another (``g = T_other / T_plan``) is inside the model's error when
both step times may be off by the band ``e`` in opposite directions: ``g <= (1 + e) / (1 - e)``
(:func:`within_error`); ``nest-fx plan`` then says "within the model's error: measure both".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from nest_fx.common.device_family import device_family


@dataclass(frozen=True)
class ErrorBand:
    """Relative error of a step-time prediction (``rel``; None: no published run checks it) and
    the rows it comes from (``basis``)."""

    rel: Optional[float]
    basis: str

    def text(self) -> str:
        """'+-6% (torchtitan eager rows)' or 'unchecked (...)'."""
        if self.rel is None:
            return f"unchecked ({self.basis})"
        return f"+-{100 * self.rel:.0f}% ({self.basis})"


SOURCE = "scripts/bench_published.py, results/bench_published.json"

BACKEND_BANDS: Dict[str, ErrorBand] = {
    "eager": ErrorBand(0.03, "torchtitan Llama 3.1 8B eager rows t1.1, t3.1"),
    "compile": ErrorBand(0.03, "torchtitan Llama 3.1 8B compile rows t1.2, t3.2 (compile's factor measured on them)"),
    "fused": ErrorBand(
        None,
        "no published fused-kernel run without Float8, TP, EP, PP or CP checked; NeMo's and Megatron-Bridge's "
        "rows n1-n10, r1-r6, AutoModel's a1 and Llama 3's m1-m3 are in their features' bands",
    ),
}
FEATURE_BANDS: Dict[str, ErrorBand] = {  # in order: each from the rows using it and none later
    "float8": ErrorBand(
        0.18,
        "Float8 rows t1.3, t3.3, t2.1, w1, w2 (torchtitan 8B, FSDP, 8K-32K tokens, H100 and H200), n1, n8 (NeMo "
        "Llama 2 7B, GPT-3 5B)",
    ),
    "tp": ErrorBand(0.13, "TP rows t4.1, t4.2 (torchtitan 70B), n9, n10 (NeMo GPT-3 20B, Nemotron-3 8B)"),
    "ep": ErrorBand(
        0.06,
        "AutoModel Qwen3-30B-A3B row a1 (EP 8 x FSDP 8, DGX H100, bf16, DeepEP, a balanced stand-in gate); "
        "Megatron-Bridge's EP 8 row r6 pipelines too: in the PP band",
    ),
    "pp": ErrorBand(
        0.22,
        "pipelined rows without CP: t5, t6.1 (torchtitan 405B), m1, m2 (Llama 3 405B, 8K), n2, n3, n6, n7 (NeMo "
        "Llama, GPT-3), r1 (Megatron-Bridge Llama 3 70B), r6 (Megatron-Bridge Qwen3-30B-A3B, EP 8, PP 2 VP 24)",
    ),
    "cp": ErrorBand(
        0.65,
        "context-parallel rows t2.2-t2.4, t6.2-t6.4 (torchtitan 8B, 405B: 64K-262K tokens), m3 (Llama 3 405B, 131K), "
        "n4, n5 (NeMo Llama 3, CP 2), r2 (Megatron-Bridge 405B, CP 2)",
    ),
}


# the device families the backend and feature bands come from: their published rows ran on them
BANDED_FAMILIES = ("H100", "H200")
DEVICE_BANDS: Dict[str, ErrorBand] = {  # devices with published runs of their own, against those runs
    "A100": ErrorBand(
        0.11,
        "Narayanan et al. 2021: 12 Megatron-LM GPT runs, 1.7B-1T on 32-3,072 A100; tests/unit/cost/test_published.py",
    ),
    "B200": ErrorBand(
        0.09, "Megatron-Bridge rows r3, r5 (DGX B200, FP8: Llama 3 8B DP 8, Llama 3.1 405B TP 4 PP 8 CP 2)"
    ),
    "GB200": ErrorBand(0.10, "Megatron-Bridge Llama 3 8B row r4 (GB200 NVL72, FP8, DP 8)"),
}


def features_used(float8: bool, tp: int, ep: int, pp: int, cp: int) -> List[str]:
    """The banded features (FEATURE_BANDS keys, in their order) a run of these degrees uses."""
    used = {"float8": bool(float8), "tp": tp > 1, "ep": ep > 1, "pp": pp > 1, "cp": cp > 1}
    return [name for name in FEATURE_BANDS if used[name]]


def plan_features(plan) -> List[str]:
    """The features of ``plan`` that have bands of their own (FEATURE_BANDS keys)."""
    return features_used(plan.float8, max(s.tp for s in plan.stages), plan.ep, plan.pp, plan.cp)


def error_band(plan, device: str = "") -> ErrorBand:
    """The band of ``plan``'s step time on the device named ``device`` (a ``DeviceSpec`` name; ''
    none): the widest of its kernel backend's, its features' and the device's (module docstring);
    unchecked when any of them is, or when no published run checks the device."""
    family = device_family(device)
    if device and family not in BANDED_FAMILIES and family not in DEVICE_BANDS:
        return ErrorBand(
            None, f"no published run on {device} checked; the bands come from runs on {', '.join(BANDED_FAMILIES)}"
        )
    backend = plan.kernels or ("compile" if plan.compile else "eager")
    bands = [BACKEND_BANDS[backend]] + [FEATURE_BANDS[f] for f in plan_features(plan)]
    if family in DEVICE_BANDS:
        bands.append(DEVICE_BANDS[family])
    unchecked = [b for b in bands if b.rel is None]
    if unchecked:
        return unchecked[0]
    return max(bands, key=lambda b: b.rel)


def within_error(gain: float, band: ErrorBand) -> bool:
    """Whether a predicted gain ``gain`` (other step / this step) could vanish within the band:
    ``gain <= (1 + e) / (1 - e)``; always True for an unchecked band."""
    if band.rel is None:
        return True
    return gain <= (1 + band.rel) / (1 - band.rel)
