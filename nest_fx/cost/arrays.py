"""Numbers or numpy arrays of them: the cost formulas run on both.

``simulate`` evaluates one plan (numbers); the solver's stage tables evaluate every layer range
of a stage slot at once (arrays, one entry per range). The formulas are written once for both:
``+``, ``*`` and ``/`` broadcast, and the helpers here cover what does not.
"""

from __future__ import annotations

from typing import Callable, Union

import numpy as np

Count = Union[int, float, np.ndarray]  # a number, or an array of them (the solver's stage tables)


def per_value(fn: Callable[[float], float], x: Count) -> Count:
    """``fn(x)`` for a number; for an array, ``fn`` of each distinct entry, in x's shape (``fn``
    need not be vectorised: it may ask the collective model, one size at a time)."""
    if not isinstance(x, np.ndarray):
        return fn(x)
    values, inverse = np.unique(x.ravel(), return_inverse=True)
    return np.array([fn(float(v)) for v in values], dtype=float)[inverse].reshape(x.shape)


def positive_part(x: Count) -> Count:
    """``max(x, 0)``, elementwise for an array."""
    return np.maximum(x, 0.0) if isinstance(x, np.ndarray) else max(x, 0.0)


def any_nonzero(x: Count) -> bool:
    """Whether ``x`` is non-zero; for an array, whether any entry is."""
    return bool(x.any()) if isinstance(x, np.ndarray) else bool(x)
