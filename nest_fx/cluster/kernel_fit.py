"""A device's kernel rates (``KernelRates``) from a run of ``scripts/bench_gpu_kernels.py``.

Two fits, the ones the roofline's tables come from (``nest_fx.workload.roofline``):

* the GEMM curve ``e_max F / (F + F_half)`` fitted to measured (FLOPs, share of peak) pairs, by
  least mean relative error: for each ``F_half`` on a log grid the best ``e_max`` is a weighted
  median (minimising ``sum |e a_i - 1| = sum a_i |e - 1 / a_i|`` with ``a_i = g_i / s_i``,
  ``g_i = F_i / (F_i + F_half)``), then the best pair; ``F_half`` is returned as a time at peak
  (``gemm_ramp``), the form the tables keep;
* each fused attention kernel's forward and backward share: the medians over the lengths of at
  least 8K tokens (shorter ones run below the kernel's rate, and training runs longer ones).

On the H200 and H100 runs committed under ``results/gpu/`` the fit gives ``e_max`` 0.75 and a
ramp of 11 us, the Hopper table's; on the published B200 timings (``results/sourced/``) 0.674 and
1.5 us, the B200's (``tests/unit/cluster/test_kernel_fit.py``).
"""

from __future__ import annotations

import statistics
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

from nest_fx.cluster.errors import ClusterError
from nest_fx.cluster.kernel_rates import KernelRates

# the F_half grid: 0.01 to 1,000 GFLOP, 200 points per decade
_HALF_GRID = [1e7 * 10 ** (i / 200) for i in range(1001)]
# the shortest attention a share is taken from (tokens)
MIN_ATTENTION_TOKENS = 8192


def _weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    pairs = sorted(zip(values, weights))
    half, acc = sum(weights) / 2, 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= half:
            return value
    return pairs[-1][0]


def fit_gemm_curve(rows: Iterable[Tuple[float, float]], peak: float) -> Tuple[float, float, float]:
    """``(e_max, ramp_s, mean_error)`` of ``e_max F / (F + F_half)`` fitted to ``rows`` of
    (GEMM FLOPs, measured share of ``peak``), with ``F_half = peak x ramp_s``; ``mean_error``:
    the fit's mean relative error. ClusterError when fewer than two rows have a positive share."""
    data = [(float(f), float(s)) for f, s in rows if f > 0 and s > 0]
    if len(data) < 2:
        raise ClusterError(f"fit_gemm_curve: needs two or more measured GEMMs with a positive share, got {len(data)}")
    if not peak > 0:
        raise ClusterError(f"fit_gemm_curve: peak must be > 0 FLOP/s, got {peak!r}")
    best = (float("inf"), 0.0, 0.0)
    for half in _HALF_GRID:
        ratios = [f / (f + half) / s for f, s in data]
        top = _weighted_median([1 / a for a in ratios], ratios)
        error = statistics.mean(abs(top * a - 1) for a in ratios)
        if error < best[0]:
            best = (error, top, half)
    error, top, half = best
    return top, half / peak, error


def attention_shares(rows: Iterable[Mapping], min_tokens: int = MIN_ATTENTION_TOKENS) -> Dict[str, Tuple[float, float]]:
    """{backend: (forward, backward) median share of peak} over the ``sdpa`` rows of at least
    ``min_tokens`` tokens that ran (rows with an ``error`` are skipped)."""
    runs: Dict[str, List[Mapping]] = {}
    for row in rows:
        if "error" not in row and row.get("seq", 0) >= min_tokens:
            runs.setdefault(row["backend"], []).append(row)
    return {
        backend: (statistics.median(r["fwd_share"] for r in picked), statistics.median(r["bwd_share"] for r in picked))
        for backend, picked in runs.items()
    }


def kernel_rates_from_run(run: Mapping) -> KernelRates:
    """The ``device.kernel_rates`` a ``bench_gpu_kernels.py`` run measured: its GEMM curve (section
    ``gemm``) and the shares of SDPA's cuDNN and FlashAttention-2 kernels (section ``sdpa``); the
    ``fused`` backend's attention is cuDNN's (Transformer Engine's fused attention). Sections
    missing or failed are left to the roofline's tables. ClusterError for a smoke run (its tiny
    shapes on CPU measure nothing) or a run with neither section."""
    if run.get("smoke"):
        raise ClusterError("a --smoke run measures no kernel rates: run scripts/bench_gpu_kernels.py on the GPU")
    peak = float(run.get("peak", {}).get("bf16", 0.0))
    gemm = run.get("gemm", {})
    curve = None
    if "rows" in gemm:
        top, ramp, _ = fit_gemm_curve(((r["flops"], r["share"]) for r in gemm["rows"]), peak)
        curve = (round(top, 3), float(f"{ramp:.2g}"))
    attention = {
        k: (round(fwd, 3), round(bwd, 3))
        for k, (fwd, bwd) in attention_shares(run.get("sdpa", {}).get("rows", [])).items()
        if k in ("cudnn", "flash")
    }
    if "cudnn" in attention:
        attention["fused"] = attention["cudnn"]
    if curve is None and not attention:
        raise ClusterError("the run has neither a 'gemm' nor an 'sdpa' section that ran: nothing to fit")
    return KernelRates(
        attention=attention, gemm_ramp=curve[1] if curve else None, gemm_efficiency=curve[0] if curve else None
    )
