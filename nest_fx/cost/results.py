"""What the cost model answers: :class:`StageCost` per stage, :class:`SimResult` per plan, and
``microbatch_time``, the per-microbatch stage time t_i both report (and the solver tabulates)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Tuple

from nest_fx.cost.arrays import Count

def microbatch_time(fwd: Count, bwd: Count, recompute: Count, tp_comm: Count, ep_comm: Count, p2p: Count,
                    v: int = 1) -> Count:
    """t_i: forward + backward + recompute + collectives + both p2p directions (v chunks)."""
    return fwd + bwd + recompute + tp_comm + ep_comm + 2 * p2p * v


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
    tp_comm: float = 0.0
    ep_comm: float = 0.0
    memory: Dict[str, float] = field(default_factory=dict)  # bytes per device by term, and "total"
    p2p: float = 0.0
    dp_sync: float = 0.0
    num_params: float = 0.0
    fits: bool = True
    binding: str = ""  # the largest memory term when the stage does not fit

    def per_microbatch(self, v: int = 1) -> float:
        """t_i: forward + backward + recompute + collectives + both p2p directions (v chunks)."""
        return microbatch_time(self.fwd_compute, self.bwd_compute, self.recompute_s, self.tp_comm, self.ep_comm,
                               self.p2p, v)


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
    binding: str  # "" when feasible, else "stage i: <term>"
    devices_used: int
    world_size: int

    def to_dict(self) -> dict:
        return asdict(self)
