"""A device's kernel rates (``KernelRates``) from a run of ``scripts/bench_gpu_kernels.py``.

Three fits, the ones the roofline's tables and the attention length law come from
(``nest_fx.workload.roofline``, ``nest_fx.workload.attention_share``):

* the GEMM curve ``e_max F / (F + F_half)`` fitted to measured (FLOPs, share of peak) pairs, by
  least mean relative error: for each ``F_half`` on a log grid the best ``e_max`` is a weighted
  median (minimising ``sum |e a_i - 1| = sum a_i |e - 1 / a_i|`` with ``a_i = g_i / s_i``,
  ``g_i = F_i / (F_i + F_half)``), then the best pair; ``F_half`` is returned as a time at peak
  (``gemm_ramp``), the form the tables keep;
* each fused attention kernel's forward and backward share: the medians over the lengths of at
  least 8K tokens (shorter ones run below the kernel's rate, and training runs longer ones);
* the length law's ``attention_half_tokens`` (a call over ``k`` keys runs at ``k / (k + h)`` of the
  long-call rate), by least mean relative error over two kinds of ratio: each SDPA length's
  forward + backward share against its kernel's median (``length_ratios``) and ring attention's
  chunked calls against the whole sequence (``ring_ratios``).

On the H200 and H100 runs committed under ``results/gpu/`` the fit gives ``e_max`` 0.75 and a
ramp of 11 us, the Hopper table's, and both runs together an ``attention_half_tokens`` of 1,050; on
the published B200 timings (``results/sourced/``) 0.674 and 1.5 us, the B200's
(``tests/unit/cluster/test_kernel_fit.py``, ``tests/unit/workload/test_attention_length.py``).
"""

from __future__ import annotations

import statistics
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from nest_fx.cluster.errors import ClusterError
from nest_fx.cluster.kernel_rates import KernelRates
from nest_fx.workload.attention_share import attention_length_share, ring_chunk_share

# the F_half grid: 0.01 to 1,000 GFLOP, 200 points per decade
_HALF_GRID = [1e7 * 10 ** (i / 200) for i in range(1001)]
# the shortest attention a share is taken from (tokens)
MIN_ATTENTION_TOKENS = 8192
# the attention_half_tokens grid (tokens) and the kernels the length law is fitted on (those priced)
_HALF_TOKENS_GRID = range(0, 3001, 10)
LENGTH_LAW_KERNELS = ("cudnn", "flash")


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


def length_ratios(rows: Iterable[Mapping]) -> List[dict]:
    """Per ``sdpa`` row that timed forward + backward, ``{kernel, tokens, measured}``: its
    forward + backward share over its kernel's median over the lengths of at least
    ``MIN_ATTENTION_TOKENS`` (the rate the tables hold); kernels with no such length are left out."""
    runs: Dict[str, List[Mapping]] = {}
    for row in rows:
        if "error" not in row and "fwd_bwd_share" in row:
            runs.setdefault(row["backend"], []).append(row)
    out = []
    for kernel, picked in sorted(runs.items()):
        long = [r["fwd_bwd_share"] for r in picked if r["seq"] >= MIN_ATTENTION_TOKENS]
        if long:
            median = statistics.median(long)
            out += [
                dict(kernel=kernel, tokens=r["seq"], measured=r["fwd_bwd_share"] / median)
                for r in sorted(picked, key=lambda r: r["seq"])
            ]
    return out


def ring_ratios(run: Mapping) -> List[dict]:
    """Ring attention's cost of splitting, per (tokens, cp) of the ``ring`` section: one CP rank's
    chunked calls (mean of the ranks timed) against FlashAttention-2 over the whole sequence / cp
    (the ``sdpa`` section's batch-1 flash row of that length: the ring steps run that kernel),
    forward and forward + backward, as ``{tokens, cp, chunk_tokens, efficiency_fwd,
    efficiency_fwd_bwd}``."""
    flash = {
        r["seq"]: r
        for r in run.get("sdpa", {}).get("rows", [])
        if r.get("backend") == "flash" and r.get("batch") == 1 and "error" not in r
    }
    groups: Dict[Tuple[int, int], List[Mapping]] = {}
    for r in run.get("ring", {}).get("rows", []):
        if r["seq"] in flash:
            groups.setdefault((r["seq"], r["cp"]), []).append(r)
    out = []
    for (seq, cp), ranks in sorted(groups.items()):
        whole = flash[seq]
        out.append(
            dict(
                tokens=seq,
                cp=cp,
                chunk_tokens=seq // (2 * cp),
                efficiency_fwd=statistics.mean(whole["fwd_s"] / cp / r["fwd_s"] for r in ranks),
                efficiency_fwd_bwd=statistics.mean(whole["fwd_bwd_s"] / cp / r["fwd_bwd_s"] for r in ranks),
            )
        )
    return out


def length_law_errors(length: Iterable[Mapping], ring: Iterable[Mapping], half_tokens: float) -> List[float]:
    """The relative errors of the length law with ``half_tokens`` on ``length`` ratios (of the
    ``LENGTH_LAW_KERNELS``: ``attention_length_share``) and ``ring`` ratios (``ring_chunk_share``)."""
    errors = [
        abs(attention_length_share(r["tokens"], half_tokens) / r["measured"] - 1)
        for r in length
        if r["kernel"] in LENGTH_LAW_KERNELS
    ]
    errors += [
        abs(ring_chunk_share(r["chunk_tokens"], r["tokens"], half_tokens) / r["efficiency_fwd_bwd"] - 1) for r in ring
    ]
    return errors


def fit_attention_half_tokens(length: Sequence[Mapping], ring: Sequence[Mapping]) -> Optional[Tuple[float, float]]:
    """``(attention_half_tokens, mean relative error)`` of the length law fitted to ``length``
    and ``ring`` ratios (grid of 10 tokens); None when there is no ring ratio and no length ratio
    shorter than ``MIN_ATTENTION_TOKENS`` (nothing then shows the law)."""
    short = [r for r in length if r["tokens"] < MIN_ATTENTION_TOKENS and r["kernel"] in LENGTH_LAW_KERNELS]
    if not short and not ring:
        return None
    best = min(_HALF_TOKENS_GRID, key=lambda h: statistics.mean(length_law_errors(length, ring, h)))
    return float(best), statistics.mean(length_law_errors(length, ring, best))


def kernel_rates_from_run(run: Mapping) -> KernelRates:
    """The ``device.kernel_rates`` a ``bench_gpu_kernels.py`` run measured: its GEMM curve (section
    ``gemm``), the shares of SDPA's cuDNN and FlashAttention-2 kernels (section ``sdpa``; the
    ``fused`` backend's attention is cuDNN's, Transformer Engine's fused attention) and the
    attention length law (sections ``sdpa`` and ``ring``: :func:`fit_attention_half_tokens`).
    Sections missing or failed are left to the roofline's tables. ClusterError for a smoke run
    (its tiny shapes on CPU measure nothing) or a run with neither section."""
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
    law = fit_attention_half_tokens(length_ratios(run.get("sdpa", {}).get("rows", [])), ring_ratios(run))
    return KernelRates(
        attention=attention,
        gemm_ramp=curve[1] if curve else None,
        gemm_efficiency=curve[0] if curve else None,
        attention_half_tokens=law[0] if law else None,
    )
