"""Measured kernel rates of one device type, settable in a cluster file (``device.kernel_rates``).

The analytical roofline (``nest_fx.workload.roofline``) prices two things by rates measured on a
device, not derived from its peak:

* ``attention``: a fused attention kernel's forward and backward rate as fractions of the
  device's peak in the dtype computed in, per kernel: ``cudnn`` and ``flash`` (PyTorch SDPA's
  cuDNN attention and FlashAttention-2, ``plan.attention_kernel``) and ``fused`` (the attention of
  ``kernels=fused``: Transformer Engine's, which is cuDNN's);
* ``gemm_ramp``: the GEMM efficiency ramp, the time at peak of the GEMM that reaches half of the
  top efficiency (``F_half = peak x gemm_ramp``);
* ``gemm_efficiency``: that top efficiency (``e_max``), the share of peak large GEMMs reach;
* ``attention_half_tokens``: fused attention's rate by call length, ``k / (k + this)`` of the
  long-call rate for a call over ``k`` keys (``workload.attention_share``).

The roofline's tables hold them for the devices measured (H100, H200) and for those priced from
published measurements (B200, GB200), by name; a device named otherwise has none: ``e_max`` 0.75,
a 2 GFLOP ramp, its attention at ``e_max``; the length law's constant is the Hopper fit on every
device. Rates given here replace the tables' figures for that device, kernel by kernel
(``scripts/bench_gpu_kernels.py`` measures them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from nest_fx.cluster.errors import ClusterError
from nest_fx.cluster.fields import check_keys, check_real, finite
from nest_fx.cluster.quantities import parse_quantity
from nest_fx.common.fileio import brief

RATED_ATTENTION_KERNELS = ("cudnn", "flash", "fused")


@dataclass(frozen=True)
class KernelRates:
    """``attention``: kernel -> (forward, backward) fraction of peak, each in (0, 1];
    ``gemm_ramp``: seconds > 0, or None (the roofline's figure for the device);
    ``gemm_efficiency``: a fraction of peak in (0, 1], or None (likewise);
    ``attention_half_tokens``: tokens >= 0, or None (the Hopper fit)."""

    attention: Dict[str, Tuple[float, float]] = field(default_factory=dict)
    gemm_ramp: Optional[float] = None
    gemm_efficiency: Optional[float] = None
    attention_half_tokens: Optional[float] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "") -> None:
        """Check every field; errors name the field as ``{prefix}{field}``."""
        if not isinstance(self.attention, dict):
            raise ClusterError(
                f"{prefix}attention: must be a mapping kernel -> [forward, backward], got {brief(self.attention)}"
            )
        for kernel, rates in self.attention.items():
            where = f"{prefix}attention.{kernel}"
            if kernel not in RATED_ATTENTION_KERNELS:
                raise ClusterError(f"{where}: unknown kernel; use one of {list(RATED_ATTENTION_KERNELS)}")
            if not isinstance(rates, (list, tuple)) or len(rates) != 2:
                raise ClusterError(f"{where}: must be [forward, backward] fractions of peak, got {brief(rates)}")
            for name, value in zip(("forward", "backward"), rates):
                _check_fraction(value, f"{where} {name}")
        if self.gemm_ramp is not None:
            check_real(self.gemm_ramp, f"{prefix}gemm_ramp", strict=False)
            if self.gemm_ramp == 0:
                raise ClusterError(f"{prefix}gemm_ramp: must be > 0 seconds, got 0")
        if self.gemm_efficiency is not None:
            _check_fraction(self.gemm_efficiency, f"{prefix}gemm_efficiency")
        if self.attention_half_tokens is not None:
            check_real(self.attention_half_tokens, f"{prefix}attention_half_tokens", strict=False)

    def to_dict(self) -> dict:
        """The file form: only what is set."""
        out: dict = {}
        if self.attention:
            out["attention"] = {k: list(v) for k, v in self.attention.items()}
        if self.gemm_ramp is not None:
            out["gemm_ramp"] = self.gemm_ramp
        if self.gemm_efficiency is not None:
            out["gemm_efficiency"] = self.gemm_efficiency
        if self.attention_half_tokens is not None:
            out["attention_half_tokens"] = self.attention_half_tokens
        return out

    @classmethod
    def from_dict(cls, data: object, path: str = "device.kernel_rates") -> "KernelRates":
        """From the file form; ``gemm_ramp`` may carry a unit (``11us``)."""
        d = check_keys(data, path, (), ("attention", "gemm_ramp", "gemm_efficiency", "attention_half_tokens"))
        attention = d.get("attention", {})
        if not isinstance(attention, dict):
            raise ClusterError(
                f"{path}.attention: must be a mapping kernel -> [forward, backward], got {brief(attention)}"
            )
        ramp = d.get("gemm_ramp")
        if ramp is not None:
            ramp = parse_quantity(ramp, "s", f"{path}.gemm_ramp")
        rates = {str(k): tuple(v) if isinstance(v, list) else v for k, v in attention.items()}
        try:
            return cls(
                attention=rates,
                gemm_ramp=ramp,
                gemm_efficiency=d.get("gemm_efficiency"),
                attention_half_tokens=d.get("attention_half_tokens"),
            )
        except ClusterError as exc:
            raise ClusterError(f"{path}.{exc}") from None


def _check_fraction(value: object, where: str) -> None:
    """ClusterError unless ``value`` is a real number in (0, 1] (a fraction of peak)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value):
        raise ClusterError(f"{where}: must be a number in (0, 1], got {brief(value)}")
    if not 0 < value <= 1:
        raise ClusterError(f"{where}: must be a fraction of peak in (0, 1], got {brief(value)}")
