"""Sliding-window attention in the traced cost: which window an SDPA call uses, and the share of
the score matrix a fused kernel computes over it (``docs/cost_model.md``, "Sliding-window attention").

The zoo's windowed attention passes SDPA a band mask made by ``models.layers.sliding_window_mask``
(a leaf call whose literal argument is the window). A fused kernel with a window (FlashAttention-2's
``window_size``, cuDNN's sliding window) skips the tiles outside the band and keeps no mask, so the
cost model prices the band's scores and the q, k, v bytes alone. Also: the share of the score
matrix one rank computes with or without context parallelism (``attention_work``), the rate a
fused call reaches by its length (``attention_length_share``), and the softmax of an attention core
that materialises its scores (``materialised_score_seconds``).
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


def attention_work(seq: int, cp: int, causal: bool) -> float:
    """Share of the full ``seq x seq`` score matrix one rank's attention kernel computes.

    Without context parallelism: all of it for non-causal attention (or the math path), the
    lower triangle with its diagonal, ``(s + 1) / 2s``, for a causal fused kernel (flash skips
    the masked tiles). Under ``cp`` ranks, as the runtime runs it (``apply.context_parallel``:
    chunks ``i`` and ``2 cp - 1 - i`` of ``2 cp``, each attending under an explicit causal mask
    to the keys up to its end): ``(2 cp + 1) c^2`` scores per rank with ``c = s / 2 cp``, i.e.
    ``(2 cp + 1) / (4 cp^2)`` of the matrix (the masked kernel computes its diagonal chunks
    whole)."""
    if cp > 1:
        return (2 * cp + 1) / (4 * cp * cp)
    if causal and seq > 0:
        return (seq + 1) / (2 * seq)
    return 1.0


# Fused attention's rate by call length. A flash-style kernel (FlashAttention-2, cuDNN) loops over
# the key tiles of each query tile; what it does once per query tile (loading it, rescaling and
# writing its output) is spread over the keys the call sees, so a call over k keys reaches
# k / (k + ATTENTION_HALF_RATE_TOKENS) of the long-call rate. One law fits both measurements of it
# on an H100 and an H200 (scripts/bench_gpu_kernels.py; least mean relative error 2.4% over 28
# ratios, results/gpu/gpu_vs_model*.md): SDPA over whole sequences of 2K-131K tokens (flash and
# cuDNN, each against its median over >= 8K tokens, the rate the tables hold: 0.67-0.72 at 2K) and
# ring attention's chunk-pair calls on 2K-32K-token chunks against the whole sequence (0.65-0.67 at
# 2K, 0.95 at 16K).
ATTENTION_HALF_RATE_TOKENS = 1050
# The tabled rates (roofline.SDPA_ATTENTION, a cluster file's kernel_rates, kernel_fit's fit) are
# medians over calls of 8K, 32K and 131K tokens: for a rate that rises with length, the middle one's.
ATTENTION_RATE_REF_TOKENS = 32768
# The shortest calls measured: shorter ones are priced at its rate (the law is not checked below it).
ATTENTION_LENGTH_FLOOR_TOKENS = 2048


def call_length_rate(key_tokens: float, half_tokens: float = ATTENTION_HALF_RATE_TOKENS) -> float:
    """``k / (k + half_tokens)``: the share of the long-call rate a fused attention call over
    ``key_tokens`` keys reaches, ``k`` at least ``ATTENTION_LENGTH_FLOOR_TOKENS``."""
    k = max(float(key_tokens), ATTENTION_LENGTH_FLOOR_TOKENS)
    return k / (k + half_tokens)


def attention_length_share(key_tokens: float, half_tokens: float = ATTENTION_HALF_RATE_TOKENS) -> float:
    """The share of the tabled fused-attention rate (measured at ``ATTENTION_RATE_REF_TOKENS``)
    a call over ``key_tokens`` keys reaches under the law of ``half_tokens`` (a device's
    ``kernel_rates.attention_half_tokens``, else the Hopper fit): 0.68 at 2K and below, 0.92 at 8K,
    1.02 at 131K with the Hopper fit."""
    return call_length_rate(key_tokens, half_tokens) / call_length_rate(ATTENTION_RATE_REF_TOKENS, half_tokens)


def ring_chunk_share(chunk_tokens: float, seq_tokens: float, half_tokens: float = ATTENTION_HALF_RATE_TOKENS) -> float:
    """The share of the whole-sequence rate ring attention's chunk-pair calls over ``chunk_tokens``
    keys reach, against one call over ``seq_tokens``: the chunk's length rate over the sequence's
    (what ``bench_gpu_kernels.py``'s ``ring`` section measures)."""
    return call_length_rate(chunk_tokens, half_tokens) / call_length_rate(seq_tokens, half_tokens)


def fused_call_keys(seq: int, cp: int, ring: bool, window: int = 0) -> float:
    """The keys one fused attention call of a ``seq``-token layer runs over: the ``window`` of a
    windowed kernel; under ``cp`` ranks run as ring attention, the chunk ``seq / 2cp`` of its
    chunk-pair calls; else the sequence (the all-gather mode's query chunks see the gathered keys)."""
    if window and window < seq:
        return window
    if cp > 1 and ring:
        return seq / (2 * cp)
    return seq


# An attention core without a fused kernel (attention="traced": the math path of PyTorch's SDPA,
# Megatron-LM before flash attention) materialises the score matrix S = QK^T and its softmax P:
# the QK^T GEMM writes S and the PV GEMM reads P (two passes, added to the GEMMs' bytes), and a
# separate softmax kernel reads S and writes P (two passes) at about five vector FLOPs per score
# (scale, mask, max, exp, normalise). Backward costs backward_factor x forward, as for every op.
SCORE_GEMM_PASSES = 2
SOFTMAX_PASSES = 2
SOFTMAX_FLOPS_PER_SCORE = 5.0


def materialised_score_seconds(timing, scores: float, score_bytes: float) -> float:
    """Forward seconds of the softmax kernel over a materialised score matrix of ``scores``
    elements and ``score_bytes`` bytes (see the constants above); the GEMMs' score traffic is
    charged on the attention node itself."""
    if scores <= 0:
        return 0.0
    return timing.op_seconds(SOFTMAX_FLOPS_PER_SCORE * scores, SOFTMAX_PASSES * score_bytes, False)
