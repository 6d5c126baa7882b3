"""The hardware figures a cluster is made of: one device type (:class:`DeviceSpec`) and one
level of the network hierarchy (:class:`NetworkLevel`), each checking its fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from nest_fx.cluster.errors import ClusterError
from nest_fx.cluster.fields import check_name, check_positive_int, check_real
from nest_fx.cluster.kernel_rates import KernelRates
from nest_fx.common.fileio import brief


@dataclass
class DeviceSpec:
    """One accelerator: memory capacity (bytes), peak FLOP/s per dtype name, HBM bandwidth (bytes/s),
    and optionally its measured kernel rates (:class:`KernelRates`; None: the roofline's tables)."""

    name: str
    memory_bytes: float
    peak_flops: Dict[str, float]
    mem_bandwidth: float
    kernel_rates: Optional[KernelRates] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "") -> None:
        """Check every field; errors name the field as ``{prefix}{field}``."""
        check_name(self.name, f"{prefix}name")
        check_real(self.memory_bytes, f"{prefix}memory_bytes", strict=True)
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise ClusterError(
                f"{prefix}peak_flops: must be a non-empty mapping dtype -> FLOP/s "
                f"(e.g. {{'bf16': 312e12}}), got {brief(self.peak_flops)}"
            )
        for dtype, flops in self.peak_flops.items():
            check_name(dtype, f"{prefix}peak_flops key")
            check_real(flops, f"{prefix}peak_flops.{dtype}", strict=True)
        check_real(self.mem_bandwidth, f"{prefix}mem_bandwidth", strict=True)
        if self.kernel_rates is not None:
            if not isinstance(self.kernel_rates, KernelRates):
                raise ClusterError(f"{prefix}kernel_rates: must be a KernelRates, got {brief(self.kernel_rates)}")
            self.kernel_rates.validate(f"{prefix}kernel_rates.")

    def to_dict(self) -> dict:
        """The file form (``device`` of a cluster or topology file), numbers in SI units."""
        out = {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "peak_flops": dict(self.peak_flops),
            "mem_bandwidth": self.mem_bandwidth,
        }
        if self.kernel_rates is not None:
            out["kernel_rates"] = self.kernel_rates.to_dict()
        return out

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (e.g. "bf16"); ClusterError listing the known dtypes otherwise."""
        try:
            return float(self.peak_flops[dtype])
        except KeyError:
            raise ClusterError(
                f"device {self.name!r} has no peak_flops entry for dtype {dtype!r}; known: {sorted(self.peak_flops)}"
            ) from None


@dataclass
class NetworkLevel:
    """One level of the network hierarchy (see module docstring for ``group_size``)."""

    name: str
    group_size: int
    bandwidth: float  # bytes/s per device per direction
    latency: float  # seconds per message

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "") -> None:
        """Check every field; errors name the field as ``{prefix}{field}``."""
        check_name(self.name, f"{prefix}name")
        check_positive_int(self.group_size, f"{prefix}group_size")
        check_real(self.bandwidth, f"{prefix}bandwidth", strict=True)
        check_real(self.latency, f"{prefix}latency", strict=False)
