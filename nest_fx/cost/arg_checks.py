"""Argument checks the cost model's pure functions share: a ValueError naming the argument
when a count, a number of bytes or a choice is not one the formulas accept."""

from __future__ import annotations

import math
from typing import Tuple

import numpy as np

from nest_fx.cost.arrays import Count


def require_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return value


def require_number(value: object, name: str, *, positive: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ValueError(f"{name}: must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def require_amount(value: object, name: str) -> Count:
    """A finite number >= 0 (as float), or a numpy array of them."""
    if isinstance(value, np.ndarray):
        if value.size and not (np.all(np.isfinite(value)) and np.all(value >= 0)):
            raise ValueError(f"{name}: every entry must be a finite number >= 0")
        return value
    return require_number(value, name)


def require_choice(value: object, name: str, choices: Tuple[str, ...], hint: str = "") -> str:
    """``value`` when it is one of ``choices``; ValueError naming them otherwise (and ``hint``,
    in brackets, where given)."""
    if value not in choices:
        more = f" ({hint})" if hint else ""
        raise ValueError(f"{name}: must be one of {list(choices)}, got {value!r}{more}")
    return value  # type: ignore[return-value]
