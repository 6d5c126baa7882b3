"""Suggestions for a mistyped name: every "unknown X" error lists the closest known names."""

from __future__ import annotations

import difflib
from typing import Iterable


def close_matches(word: object, choices: Iterable[str], n: int = 5) -> str:
    """``" (close matches: a, b)"`` for an error message, or ``""`` when none is close."""
    found = difflib.get_close_matches(str(word), [str(c) for c in choices], n=n, cutoff=0.6)
    return f" (close matches: {', '.join(found)})" if found else ""
