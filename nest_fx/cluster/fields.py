"""Checks of a cluster's field values and file mappings: each raises ClusterError naming the
field's path (``device.memory_bytes``, ``levels[1].group_size``) and what is wrong."""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, TypeVar

from nest_fx.cluster.errors import ClusterError
from nest_fx.common.fileio import brief
from nest_fx.common.limits import MAX_QUANTITY, MIN_RATE
from nest_fx.common.names import close_matches

T = TypeVar("T")


def check_real(value: object, path: str, *, strict: bool) -> None:
    """Raise ClusterError unless ``value`` is a finite real number > 0 (``strict``: a rate or a
    capacity, then also >= MIN_RATE) or >= 0, and at most MAX_QUANTITY (nest_fx.common.limits)."""
    bound = "> 0" if strict else ">= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value):
        raise ClusterError(f"{path}: must be a finite number {bound}, got {brief(value)}")
    if value < 0 or (strict and value == 0):
        raise ClusterError(f"{path}: must be {bound}, got {brief(value)}")
    if strict and value < MIN_RATE:
        raise ClusterError(
            f"{path}: must be at least {MIN_RATE:g} (SI units: bytes, bytes/s, FLOP/s), got {brief(value)}"
        )
    if value > MAX_QUANTITY:
        raise ClusterError(f"{path}: must be at most {MAX_QUANTITY:g} (SI units), got {brief(value)}")


def finite(value: float) -> bool:
    """``math.isfinite`` that also answers for ints beyond the float range (they are not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_positive_int(value: object, path: str, most: Optional[int] = None) -> None:
    """Raise ClusterError unless ``value`` is an integer >= 1 (and at most ``most`` devices)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterError(f"{path}: must be an integer >= 1, got {brief(value)}")
    if value < 1:
        raise ClusterError(f"{path}: must be >= 1, got {brief(value)}")
    if most is not None and value > most:
        raise ClusterError(f"{path}: {brief(value)} is more devices than nest-fx plans for (at most {most:,})")


def check_name(value: object, path: str) -> None:
    """Raise ClusterError unless ``value`` is a non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise ClusterError(f"{path}: must be a non-empty string, got {brief(value)}")


def prefixed(prefix: str, build: Callable[[], T]) -> T:
    """Run ``build`` and prepend ``prefix`` to the field path of any ClusterError it raises."""
    try:
        return build()
    except ClusterError as exc:
        raise ClusterError(f"{prefix}{exc}") from None


def check_keys(data: object, path: str, required: Tuple[str, ...], optional: Tuple[str, ...] = ()) -> dict:
    """``data`` must be a mapping with all ``required`` keys and nothing unknown."""
    where = path or "cluster"
    if not isinstance(data, dict):
        raise ClusterError(f"{where}: expected a mapping with keys {list(required)}, got {type(data).__name__}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ClusterError(f"{where}: missing key(s) {missing}")
    unknown = sorted(set(data) - set(required) - set(optional), key=str)  # YAML keys need not be strings
    if unknown:
        raise ClusterError(
            f"{where}: unknown key(s) {unknown}{close_matches(unknown[0], required + optional)}; "
            f"expected {list(required + optional)}"
        )
    return data
