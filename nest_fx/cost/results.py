"""What the cost model answers: :class:`StageCost` per stage, :class:`SimResult` per plan, and
``microbatch_time``, the per-microbatch stage time t_i both report (and the solver tabulates)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from nest_fx.cost.arrays import Count


def stage_work(fwd: Count, bwd: Count, recompute: Count, tp_comm: Count, ep_comm: Count, cp_comm: Count) -> Count:
    """A stage's per-microbatch work: compute, recompute and its in-layer collectives."""
    return fwd + bwd + recompute + tp_comm + ep_comm + cp_comm


def microbatch_time(work: Count, p2p: Count, v: int = 1, overlap: float = 0.0) -> Tuple[Count, Count]:
    """(t_i, s_i) of a stage from its per-microbatch ``work`` (compute, recompute, collectives)
    and its incoming p2p transfer ``p2p`` (v chunks: v transfers each way per microbatch).

    t_i is what the stage takes per microbatch in steady state (``max_i t_i`` paces the pipeline),
    s_i what it adds to the fill and drain (summed over the stages). Without overlap the sends
    wait: t_i = s_i = work + 2 v p2p. With overlap (the runtime's pipeline schedules send
    asynchronously) the transfers run under the next microbatch's compute: t_i = max(work, v p2p)
    (a link slower than the stage paces it), and the first forward and last backward still cross
    each boundary: s_i = t_i + 2 v p2p. ``overlap`` is the share ``f`` of the sends run under
    compute (``CostOptions.overlap_p2p``; True/False read as 1/0): t_i = max(work + (1 - f) 2 v
    p2p, v p2p), s_i = t_i + f 2 v p2p, the two forms above at f = 1 and f = 0."""
    f = float(overlap)
    if f <= 0:
        t = work + 2 * p2p * v
        return t, t
    waited = work + (1 - f) * 2 * p2p * v
    t = (
        np.maximum(waited, p2p * v)
        if isinstance(work, np.ndarray) or isinstance(p2p, np.ndarray)
        else max(waited, p2p * v)
    )
    return t, t + f * 2 * p2p * v


@dataclass
class StageCost:
    """Per-microbatch time and per-device memory of one stage."""

    index: int
    layers: Tuple[int, int]
    tp: int
    recompute: str
    # seconds per microbatch on one device (dp_sync: per step, before overlap)
    fwd_compute: float = 0.0
    bwd_compute: float = 0.0
    recompute_s: float = 0.0
    tp_comm: float = 0.0  # exposed (CostOptions.overlap_tp_comm; ep_comm, cp_comm likewise)
    ep_comm: float = 0.0
    cp_comm: float = 0.0
    memory: Dict[str, float] = field(default_factory=dict)  # bytes per device by term, and "total"
    reserved: float = 0.0  # what the caching allocator reserves at the peak (memory.reserved_bytes)
    p2p: float = 0.0
    overlap_p2p: float = 0.0  # share of the sends run under compute (CostOptions.overlap_p2p)
    dp_sync: float = 0.0
    tied_sync: float = 0.0  # after backward: the tied embedding's gradient exchanged with its twin stage
    num_params: float = 0.0
    fits: bool = True
    binding: str = ""  # the largest memory term when the stage does not fit

    @property
    def work(self) -> float:
        """Compute, recompute and in-layer collectives per microbatch."""
        return stage_work(
            self.fwd_compute, self.bwd_compute, self.recompute_s, self.tp_comm, self.ep_comm, self.cp_comm
        )

    def per_microbatch(self, v: int = 1) -> float:
        """t_i (``microbatch_time``): what the stage takes per microbatch in steady state."""
        return microbatch_time(self.work, self.p2p, v, self.overlap_p2p)[0]

    def span(self, v: int = 1) -> float:
        """s_i (``microbatch_time``): what the stage adds to the pipeline's fill and drain."""
        return microbatch_time(self.work, self.p2p, v, self.overlap_p2p)[1]


@dataclass
class SimResult:
    """Step-time breakdown, throughput and memory of one plan."""

    step_s: float
    breakdown: Dict[str, float]
    tokens_per_s: float
    model_flops_per_device: float  # 6*N-style model FLOPs (no recompute) per second per device
    hardware_flops_per_device: float  # including recomputation
    stages: List[StageCost]
    feasible: bool
    peak_reserved: float = 0.0  # the largest stage's reserved bytes (memory.reserved_bytes)
    binding: str = ""  # "" when feasible, else "stage i: <term>"
    devices_used: int = 0
    world_size: int = 0
    # relative error of the step time from published runs (cost.error_bands; None: unchecked) and its rows
    error_band: Optional[float] = None
    error_basis: str = ""

    def to_dict(self) -> dict:
        return asdict(self)
