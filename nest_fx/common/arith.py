"""Integer helpers the planner and the runtime's checks share."""

from __future__ import annotations

import math
from typing import List


def divisors(n: int) -> List[int]:
    """The positive divisors of ``n`` in increasing order (O(sqrt n): a global batch may be large)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]
