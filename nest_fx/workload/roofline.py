"""Analytical compute model: a roofline per op with documented efficiency assumptions.

For planning without a GPU. An op doing ``F`` FLOPs and moving ``Q`` bytes takes

    t = max(F / (P * e_mm(F)), Q / (W * e_mem)) + t_launch        (roofline, Williams et al. 2009)

with ``P`` the device's peak FLOP/s for the training dtype (tensor cores for matmuls, the
vector rate ``P * vector_fraction`` for other ops), ``W`` its memory bandwidth, and

    e_mm(F) = e_max * F / (F + F_half)

a saturating GEMM efficiency: large GEMMs reach ``e_max`` of peak, a GEMM of ``F_half``
FLOPs reaches half of that. Defaults (``e_max`` 0.75, ``F_half`` 2 GFLOP, ``e_mem`` 0.7,
5 us per kernel) are the usual figures for A100/H100 cuBLAS and elementwise kernels; they are
assumptions, written down here, and checked end to end against Narayanan et al. 2021's GPT-3
175B throughput in ``tests/test_published.py``. Backward ops cost twice their forward
(two GEMMs per forward GEMM: input gradient and weight gradient).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class AnalyticalCompute:
    """Roofline op timing for one device type and dtype (see module docstring)."""

    peak_flops: float  # FLOP/s of the training dtype on tensor cores
    mem_bandwidth: float  # bytes/s
    matmul_efficiency: float = 0.75
    matmul_half_flops: float = 2e9
    memory_efficiency: float = 0.7
    vector_fraction: float = 0.125  # non-matmul FLOP/s as a fraction of peak (CUDA cores vs tensor cores)
    launch_s: float = 5e-6
    backward_factor: float = 2.0

    @classmethod
    def for_device(cls, device, dtype: str = "bf16", **overrides) -> "AnalyticalCompute":
        """Defaults for a ``DeviceSpec`` (from ``nest_fx.cluster``) and a dtype name."""
        return cls(peak_flops=device.peak(dtype), mem_bandwidth=device.mem_bandwidth, **overrides)

    def matmul_eff(self, flops: float) -> float:
        """e_mm(F) = e_max * F / (F + F_half)."""
        return self.matmul_efficiency * flops / (flops + self.matmul_half_flops) if flops > 0 else 0.0

    def op_seconds(self, flops: float, bytes_moved: float, matmul: bool) -> float:
        """Forward time of one op (roofline plus launch overhead); 0 for ops that do nothing."""
        if flops <= 0 and bytes_moved <= 0:
            return 0.0
        if matmul and flops > 0:
            compute = flops / (self.peak_flops * self.matmul_eff(flops))
        else:
            compute = flops / (self.peak_flops * self.vector_fraction)
        memory = bytes_moved / (self.mem_bandwidth * self.memory_efficiency)
        return max(compute, memory) + self.launch_s

    def to_dict(self) -> dict:
        return asdict(self)
