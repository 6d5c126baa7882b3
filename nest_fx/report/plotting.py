"""matplotlib, an optional extra (``nest-fx[plot]``), on the headless Agg backend."""

from __future__ import annotations

from typing import Any, Optional

from nest_fx.common.errors import MissingDependency

_MISSING = "matplotlib is not installed: pip install 'nest-fx[plot]' (or pip install matplotlib)"


def require_pyplot() -> Any:
    """The pyplot module (Agg backend); ImportError naming the extra to install when missing."""
    try:
        import matplotlib
    except ImportError:
        raise MissingDependency(_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pyplot_or_none() -> Optional[Any]:
    """The pyplot module, or None after printing that the figures are skipped (benchmarks plot
    when they can and still write their tables and JSON)."""
    try:
        return require_pyplot()
    except ImportError:
        print(f"{_MISSING}: no figure written")
        return None
