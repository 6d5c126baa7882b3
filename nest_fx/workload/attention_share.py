"""Sliding-window attention in the traced cost: which window an SDPA call uses, and the share of
the score matrix a fused kernel computes over it (``docs/cost_model.md``, "Sliding-window attention").

The zoo's windowed attention passes SDPA a band mask made by ``models.layers.sliding_window_mask``
(a leaf call whose literal argument is the window). A fused kernel with a window (FlashAttention-2's
``window_size``, cuDNN's sliding window) skips the tiles outside the band and keeps no mask, so the
cost model prices the band's scores and the q, k, v bytes alone.
"""

from __future__ import annotations

from typing import Optional

import networkx as nx

WINDOW_MASK_OP = "sliding_window_mask"


def attention_window(graph: nx.DiGraph, node: str) -> int:
    """The sliding window of attention node ``node`` (0: none): the literal argument of the
    ``sliding_window_mask`` call feeding its mask."""
    for pred in graph.predecessors(node):
        d = graph.nodes[pred]
        if d.get("op") == WINDOW_MASK_OP or str(d.get("target", "")).endswith(WINDOW_MASK_OP):
            window = _last_int(d.get("consts", ""))
            if window:
                return window
    return 0


def _last_int(consts: str) -> Optional[int]:
    for part in reversed(consts.split(",")):
        try:
            return int(part.strip())
        except ValueError:
            continue
    return None


def window_share(seq: int, window: int) -> float:
    """Share of the ``seq x seq`` score matrix inside a causal window of ``window`` keys: query i
    sees min(i + 1, window) keys, so the band holds ``w (w + 1) / 2 + (s - w) w`` scores (the causal
    triangle ``s (s + 1) / 2`` when the window covers the sequence)."""
    if seq <= 0:
        return 1.0
    w = min(window, seq)
    return (w * (w + 1) / 2 + (seq - w) * w) / (seq * seq)
