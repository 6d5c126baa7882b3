"""The layers of a chain that :meth:`Workload.cost` gives one answer for, in every variant.

``Workload.cost(i, v)`` reads layer i's signature, kind and MoE flag (``own_cost``'s key) and,
under sequence parallelism, the sequence-parallel edges it runs (``sequence_edges``) with the
layer before it (the slice's input) or the one it gathers. Layers equal in all of these get the
same cost object in every variant, so a caller that needs every layer's cost of many variants
(the solver's tier 0 asks 256 variants of a 35-layer chain) asks one layer of each class per
variant and reads the others from it (:func:`layer_costs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Tuple

from nest_fx.workload.sequence_edges import GATHER, SLICE, sequence_edge

if TYPE_CHECKING:  # (types imports this module: Workload.variant_costs asks layer_costs)
    from nest_fx.workload.types import LayerCost, Variant, Workload


def _own(layer) -> tuple:
    """What ``Workload.own_cost`` reads of a layer (with the variant)."""
    return layer.signature, layer.kind, layer.is_moe


def cost_classes(workload: "Workload") -> Tuple[List[int], List[int]]:
    """(one layer index per class, in order of first appearance; each layer's class): two layers
    share a class when ``Workload.cost`` reads the same of them (module docstring). Computed
    from the chain each call is asked for a new chain (keyed by what it reads of every layer)."""
    layers = workload.layers
    key = tuple((*_own(x), x.num_params) for x in layers)
    memo = workload.__dict__.get("_cost_classes")
    if memo is not None and memo[0] == key:
        return memo[1]
    kinds, params = [x.kind for x in layers], [x.num_params for x in layers]
    ids: Dict[tuple, int] = {}
    reps: List[int] = []
    of: List[int] = []
    for i, layer in enumerate(layers):
        edges = sequence_edge(kinds, params, i)
        entering = _own(layers[i - 1]) if SLICE in edges else None
        before = i - 1 if layer.kind != "block" else i
        gathered = _own(layers[before]) if GATHER in edges else None
        k = ids.setdefault((_own(layer), edges, entering, gathered), len(reps))
        if k == len(reps):
            reps.append(i)
        of.append(k)
    workload.__dict__["_cost_classes"] = (key, (reps, of))
    return reps, of


def layer_costs(workload: "Workload", variant: "Variant") -> List["LayerCost"]:
    """``[workload.cost(i, variant) for i in range(len(workload))]`` (the same objects), asking
    one layer per :func:`cost_classes` class."""
    reps, of = cost_classes(workload)
    costs = [workload.cost(r, variant) for r in reps]
    return [costs[k] for k in of]
