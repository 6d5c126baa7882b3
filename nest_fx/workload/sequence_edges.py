"""The collectives at the ends of the sequence-parallel span (``docs/cost_model.md``, "Sequence
parallelism's edges").

Under sequence parallelism (``tp > 1``) the layer blocks hold each TP rank's share of the sequence
and the layers around them (the head, the tail) whole sequences, as nest-fx's runtime runs it
(``apply.tensor_parallel``): the first layer block slices its input (forward: a local slice; its
backward all-gathers the input's gradient, when the input needs one: a layer with parameters
comes before it) and the layer after the last block all-gathers what it reads (forward only: the
gather's backward keeps each rank's part of the gradient, no collective). The runtime runs them
in hooks outside a block's checkpoint, so a recompute never re-runs them; a pipeline boundary
between two layer blocks carries the shard and runs neither (``apply.tensor_parallel.sharded_cut``),
so each runs once per microbatch, on the stage holding the layer that :func:`sequence_edge` names.

They depend on a layer's place in the chain, not on its signature, so they are added to the
source's cost by ``Workload.cost`` (the simulator and the solver's tables both read it) and left
out of a written layer table (``Workload.own_cost``).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

SLICE, GATHER = "slice", "gather"


def sequence_edge(kinds: Sequence[str], params: Sequence[float], index: int) -> Tuple[str, ...]:
    """The edges of the sequence-parallel span layer ``index`` runs collectives for, given the
    chain's layer kinds (head | block | tail) and parameter counts: ``slice`` on the first layer
    block when a layer with parameters precedes it (its input's gradient is all-gathered),
    ``gather`` on the layer after the last block (the tail), or on the last block when none
    follows it. Empty for a chain without layer blocks."""
    blocks = [k for k, kind in enumerate(kinds) if kind == "block"]
    if not blocks:
        return ()
    first, last = blocks[0], blocks[-1]
    edges: Tuple[str, ...] = ()
    if index == first and any(p > 0 for p in params[:first]):
        edges += (SLICE,)
    if index == min(last + 1, len(kinds) - 1):
        edges += (GATHER,)
    return edges


def edge_collectives(
    edges: Sequence[str], entering: float, gathered: float, recomputed: bool
) -> List[Tuple[str, str, float, int]]:
    """(kind, phase, bytes, unrecomputed) of the TP collectives of ``edges`` per microbatch, one
    each (``workload.types.Comm``'s fields): the slice's backward all-gather of ``entering`` bytes
    (the first block's whole input) and the gather's forward all-gather of ``gathered`` bytes (the
    last block's whole output). ``recomputed``: the layer is a block a recompute may re-run; the
    gather runs in a hook outside its checkpoint, so it is marked as never re-run
    (``Comm.unrecomputed``; the slice's collective is a backward one, never re-run)."""
    out = []
    if SLICE in edges:
        out.append(("all_gather", "bwd", entering, 0))
    if GATHER in edges:
        out.append(("all_gather", "fwd", gathered, int(recomputed)))
    return out
