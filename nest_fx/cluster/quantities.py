"""Quantities in cluster files: numbers in SI units, or strings such as ``"80GiB"``,
``"300GB/s"``, ``"200Gb/s"``, ``"5us"`` or ``"312TFLOPS"`` (see :func:`parse_quantity`)."""

from __future__ import annotations

import math
import re
from typing import Optional, Union

from nest_fx.cluster.errors import ClusterError
from nest_fx.common.fileio import brief

UNITS = ("B", "B/s", "s", "FLOP/s")
_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9}
_NUMBER = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(.*?)\s*$")
_EXPECTED = {
    "B": "bytes: a number or e.g. '80GiB', '80GB', '512MiB' (B = 1e3 powers, iB = 2**10 powers)",
    "B/s": "bytes/s: a number or e.g. '300GB/s', '25e9', '200Gb/s' (lower-case b = bits)",
    "s": "seconds: a number or e.g. '5us', '1.5ms', '2e-6s'",
    "FLOP/s": "FLOP/s: a number or e.g. '312T', '312e12', '312TFLOPS', '312 TFLOP/s'",
}


def _size_factor(suffix: str) -> Optional[float]:
    """Multiplier of a size suffix such as 'GiB', 'MB', 'Gb' (bits: /8); None if not one."""
    m = re.fullmatch(r"([kKMGTPE]?i?)([Bb])", suffix)
    if not m or (m.group(1).endswith("i") and m.group(1)[:-1].upper() + "i" not in _BINARY):
        return None
    prefix = m.group(1)
    scale = _BINARY[prefix[:-1].upper() + "i"] if prefix.endswith("i") else _DECIMAL[prefix]
    return scale / 8.0 if m.group(2) == "b" else scale


def _suffix_factor(suffix: str, unit: str) -> Optional[float]:
    """Multiplier for a quantity suffix in ``unit``; '' is always 1; None when not understood."""
    if suffix == "":
        return 1.0
    if unit == "B":
        return _size_factor(suffix)
    if unit == "B/s":
        for tail in ("/s", "ps"):
            if suffix.endswith(tail):
                return _size_factor(suffix[: -len(tail)])
        return None
    if unit == "s":
        return _TIME.get(suffix)
    # FLOP/s: a bare decimal prefix, optionally followed by FLOPS / FLOP/s / FLOPs.
    m = re.fullmatch(r"([kKMGTPE]?)\s*(?:FLOPS|FLOP/s|FLOPs|flops|flop/s)?", suffix)
    return _DECIMAL[m.group(1)] if m else None


def parse_quantity(text: Union[str, int, float], unit: str, path: str = "value") -> float:
    """Parse a number or a human-friendly quantity string into SI units.

    ``unit`` is one of ``"B"`` (bytes), ``"B/s"`` (bytes per second), ``"s"`` (seconds) or
    ``"FLOP/s"``. Decimal prefixes k/K, M, G, T, P, E are powers of 1e3; binary prefixes Ki, Mi,
    Gi, Ti, Pi are powers of 2**10; a lower-case ``b`` means bits (value / 8), so
    ``"200Gb/s"`` is 25e9 bytes/s. Plain numbers (or numeric strings like ``"25e9"``) are taken
    as already in SI units. Raises :class:`ClusterError` naming ``path`` (the field) and the
    accepted forms.
    """
    if unit not in UNITS:
        raise ValueError(f"parse_quantity: unit must be one of {UNITS}, got {unit!r}")
    if isinstance(text, bool):
        raise ClusterError(f"{path}: expected {_EXPECTED[unit]}; got {brief(text)}")
    if isinstance(text, (int, float)):
        try:
            value = float(text)
        except OverflowError:  # an int beyond the float range
            raise ClusterError(f"{path}: must be finite, got {brief(text)}") from None
    elif isinstance(text, str) and (m := _NUMBER.match(text)):
        number, suffix = float(m.group(1)), m.group(2)
        factor = _suffix_factor(suffix, unit)
        if factor is None:
            raise ClusterError(f"{path}: cannot read unit {suffix!r} in {brief(text)}; expected {_EXPECTED[unit]}")
        value = number * factor
    else:
        raise ClusterError(f"{path}: expected {_EXPECTED[unit]}; got {brief(text)}")
    if not math.isfinite(value):
        raise ClusterError(f"{path}: must be finite, got {brief(text)}")
    return value
