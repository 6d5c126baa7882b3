"""Expert matmuls at the shape expert parallelism runs them.

The trace holds one matmul per expert and projection, on the rows routed to that expert on one
rank (the zoo MoE's capacity buffer ``[B, C, H]`` per expert). Under expert-parallel degree ``e``
each rank keeps ``E / e`` experts and, after the dispatch all-to-all, runs each of them on the rows
of all ``e`` ranks (``apply.expert_parallel``: ``[e B, E/e, C, H]``): ``E / e`` GEMMs of ``e``
times the rows, in place of ``E`` GEMMs. The FLOPs per rank are the same; the GEMM efficiency is
not (the roofline's ``e_mm(F) = e_max F / (F + F_half)``, ``workload.roofline``), nor are the
kernel launches. Qwen3-30B-A3B's experts at 4 x 4,096 tokens are 1,024 rows each: 3.2 GFLOP per
GEMM, 17% of an H100's bf16 peak by the measured ramp; under EP 8, 8,192 rows: 53%.

Each such node's (forward, backward) time is scaled by the analytical model's ratio

    r = t(e F, e Q_rows + Q_weight) / (e t(F, Q_rows + Q_weight))

whatever timed it (the analytical model or a profile), as context parallelism scales measured
times by the analytical model's ratio. A backward is two GEMMs of the forward's shape, so the
same ratio holds for it. Only a node that multiplies by one expert's weight is scaled: a stacked
(grouped) experts op already runs every local expert's rows in one kernel.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple


def one_expert_matmul(node) -> bool:
    """Whether ``node`` is a matmul by a single expert's weight (``linear_dims`` ``(rows, in,
    out)`` and exactly ``in x out`` parameters, plus a bias row at most)."""
    dims = getattr(node, "linear_dims", None)
    if not (node.expert and node.matmul and dims and len(dims) == 3):
        return False
    _, k, n = dims
    return k > 0 and n > 0 and node.params in (k * n, k * n + n)


def ep_shaped_times(
    timing, nodes: Sequence, times: List[Tuple[float, float]], shares: Sequence[float], ep: int
) -> List[Tuple[float, float]]:
    """``times`` (per node, forward and backward seconds on one rank) with every single-expert
    matmul priced at ``ep`` times its rows and ``1 / ep`` of its count (module docstring);
    ``shares``: each node's share of its traced FLOPs and bytes in the variant
    (``TracedSource.node_shares``)."""
    if ep <= 1:
        return times
    out = []
    for n, (fwd, bwd), share in zip(nodes, times, shares):
        if not one_expert_matmul(n) or n.flops <= 0:
            out.append((fwd, bwd))
            continue
        flops, rows = n.flops * share, max(n.bytes_moved - n.param_bytes, 0.0) * share
        plain = timing.op_seconds(flops, rows + n.param_bytes, True)
        shaped = timing.op_seconds(flops * ep, rows * ep + n.param_bytes, True) / ep
        ratio = shaped / plain if plain > 0 else 1.0
        out.append((fwd * ratio, bwd * ratio))
    return out


def has_expert_matmuls(nodes: Sequence) -> bool:
    """Whether any node of a block is a single-expert matmul (its times depend on the EP degree)."""
    return any(one_expert_matmul(n) for n in nodes)
