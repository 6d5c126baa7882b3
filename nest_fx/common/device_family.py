"""The GPU family a device name names, the one reading of device names the cost model has: the
kernel-rate tables (``workload.roofline``), the error bands (``cost.error_bands``) and the GPU
benchmark's peaks (``scripts/bench_gpu_kernels.py``) all look a device up by it, so a name gets
a family's measured rates exactly when it gets that family's band."""

from __future__ import annotations

import re
from typing import Iterable, Optional

# A family is a letter prefix and three digits standing apart from other letters and digits:
# "H100-SXM5-80GB", "NVIDIA H100 80GB HBM3" and "h100" name H100, "GB200-186GB" names GB200 (not
# B200); "GH200" (a Grace Hopper superchip, no preset) and "H20" name none.
_FAMILY = re.compile(r"(?<![A-Za-z0-9])(GB|[ABH])(\d{3})(?!\d)", re.IGNORECASE)


def device_family(name: str) -> str:
    """The GPU family a device name names (``H100-SXM5-80GB``, ``NVIDIA H100 80GB HBM3``: ``H100``;
    ``GB200-186GB``: ``GB200``); '' when it names none (``TPUv4``, ``cpu``, ``NVIDIA GH200``)."""
    found = _FAMILY.search(name)
    return (found.group(1) + found.group(2)).upper() if found else ""


def device_entry(table: Iterable[tuple], name: str) -> Optional[tuple]:
    """The row of ``table`` (rows of (family, ...)) for the family :func:`device_family` reads in
    ``name``; None when the name names no family or the table has no row for it."""
    family = device_family(name)
    return next((row for row in table if family and row[0] == family), None)
