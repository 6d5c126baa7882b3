"""Whole-width norms inside a TP pair: a norm module applied to the whole output of one of the
pair's projections before its heads are viewed (OLMo2's and OLMoE's ``q_norm =
RMSNorm(heads * head_dim)`` on ``q_proj``'s output, ``k_norm`` likewise).

Under tensor parallelism a rank holds ``1/tp`` of that projection's features (whole heads), but
the norm's statistic (the mean of squares over *all* features) needs every rank's. Two exact ways
exist: all-gather the projection, normalise, keep the rank's slice; or all-reduce the statistic.
nest-fx all-reduces the statistic (``nest_fx.apply.tp_wide_norm``): each rank sums over its own
features, one all-reduce sums the ranks' partial sums (a sum of squares is a sum, so this is the
full-width sum up to the order of fp32 additions), and each rank normalises its features with
its slice of the norm's weight, sharded like the projection's columns. It moves one value per
token (``tokens x 4`` bytes in fp32) per norm and direction, where the all-gather would move
``(tp-1)/tp`` of the projection and compute the norm on all features on every rank.

This module finds the candidates for :mod:`nest_fx.graph.tp_pairs` (so that the walk back from a
row does not stop at such a norm as at the residual stream's) and counts what the runtime
all-reduces for the cost model; :mod:`nest_fx.graph.tp_flow` decides whether a candidate is one
(it normalises exactly one whole part of a column, with statistics the runtime gathers:
:data:`GATHERED_REDUCTIONS`, :data:`GATHERED_NORMS`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Set

import networkx as nx

from nest_fx.graph.tp_flow_ops import REDUCTIONS, Flow, _arg, _norm_dim, _Stop

# reductions over the sharded features the runtime makes global (their statistic all-reduced)
GATHERED_REDUCTIONS = {"mean"}
# norm ops (``F.rms_norm``, ``F.layer_norm``; ``nn.RMSNorm``, ``nn.LayerNorm`` traced as leaves) the
# runtime computes from all-reduced statistics: op -> all-reduces each (a layer norm: mean, variance)
GATHERED_NORMS = {"rms_norm": 1, "rmsnorm": 1, "layer_norm": 2, "layernorm": 2}
STATISTIC_BYTES = 4  # the runtime all-reduces its statistics in fp32
_FLOAT = ("float", "bfloat16", "half")


def _float(data: dict) -> bool:
    return any(str(t).startswith(_FLOAT) for t in data.get("out_dtypes") or [])


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def projection_norms(graph: nx.DiGraph, nodes: List[str]) -> Set[str]:
    """Module FQNs among ``nodes`` (one block's) that may be whole-width norms: a module with no
    projection of its own, computing a statistic (:data:`GATHERED_REDUCTIONS`, a norm op) from
    one floating-point input that is the output of a projection of its parent module (``q_norm``
    on ``q_proj``, both in ``self_attn``). A block's residual-stream norms do not qualify: their
    input is the stream, or (a post-norm) the output of a projection of another module."""
    by_module: Dict[str, List[str]] = defaultdict(list)
    for n in nodes:
        by_module[graph.nodes[n].get("module", "")].append(n)
    found: Set[str] = set()
    for module, members in by_module.items():
        if not module or any(graph.nodes[n].get("weight") for n in members):
            continue
        if not any(graph.nodes[n].get("op") in GATHERED_REDUCTIONS | set(GATHERED_NORMS) for n in members):
            continue
        inside = set(members)
        external = {p for n in members for p in graph.predecessors(n) if p not in inside and _float(graph.nodes[p])}
        if len(external) != 1:
            continue
        weight = graph.nodes[next(iter(external))].get("weight")
        if weight and _parent(_parent(weight)) == _parent(module):
            found.add(module)
    return found


def statistic_bytes(graph: nx.DiGraph, nodes: List[str], modules: Set[str]) -> List[float]:
    """Bytes of each statistic the runtime all-reduces (per direction) for the whole-width norms
    ``modules`` among ``nodes``: one fp32 value per row of the normalised tensor (a token), per
    gathered reduction, two for a layer norm (mean and variance)."""
    out: List[float] = []
    for n in nodes:
        d = graph.nodes[n]
        op = d.get("op", "")
        if d.get("module", "") not in modules or op not in GATHERED_REDUCTIONS | set(GATHERED_NORMS):
            continue
        shape = (d.get("in_shapes") or [[]])[0]
        rows = 1
        for k in shape[:-1]:
            rows *= k
        out += [float(rows * STATISTIC_BYTES)] * GATHERED_NORMS.get(op, 1)
    return out


class WideNormRules:
    """The follower's rules for whole-width norms (mixed into ``tp_flow._Follower``, which
    provides ``g``, ``where``, ``single``, ``check_unsharded``, ``layout`` and ``wide``, the
    candidate modules of :func:`projection_norms`)."""

    def wide_module(self, node: str) -> str:
        """The candidate whole-width norm module ``node`` runs in ("" when none)."""
        module = self.g.nodes[node].get("module", "")
        return next((m for m in self.wide if module == m or module.startswith(m + ".")), "")

    def wide_statistic(self, node: str, op: str, ins: List[Optional[Flow]]) -> Optional[List[Optional[Flow]]]:
        """The flows out of a reduction or norm over the sharded features inside a whole-width
        norm (the statistic: unsharded once all-reduced; a norm op: sharded as its input), or
        None when ``node`` is no such statistic (the ordinary rules apply)."""
        module = self.wide_module(node)
        if not module:
            return None
        d = self.g.nodes[node]
        _, f = self.single(node, ins)
        shape = d["in_shapes"][0]
        last = len(shape) - 1
        if op in REDUCTIONS:
            dims = _arg(d, 1, d.get("kwargs", {}).get("dim"))
            dims = list(range(len(shape))) if dims is None else ([dims] if isinstance(dims, int) else list(dims))
            dims = sorted(_norm_dim(x, len(shape)) for x in dims)
            if f.dim not in dims:
                return None
            if op not in GATHERED_REDUCTIONS or dims != [last]:
                raise _Stop(
                    f"{self.where(node)} reduces over the sharded features of the whole-width norm {module}; "
                    f"tensor parallelism gathers only {sorted(GATHERED_REDUCTIONS)} over the last dim there"
                )
        else:
            normalized = _arg(d, 1, None)
            count = len(normalized) if isinstance(normalized, (tuple, list)) else 1
            if f.dim < len(shape) - count:
                return None  # a per-head norm: the ordinary rule
            if op not in GATHERED_NORMS or count != 1:
                raise _Stop(
                    f"{self.where(node)} normalises the sharded features of {module} with an op tensor "
                    f"parallelism does not gather statistics for (it does for {sorted(GATHERED_NORMS)})"
                )
        if f.heads or f.inner != 1 or f.source is None or f.dim != last or f.count != f.source[2]:
            raise _Stop(
                f"{self.where(node)}: the norm {module} normalises features that are not one whole "
                "projection's; tensor parallelism cannot gather a statistic for them"
            )
        if self.layout.wide_norms.setdefault(module, f.source) != f.source:
            raise _Stop(f"the norm {module} normalises features of two projections ({self.where(node)})")
        if op in REDUCTIONS:
            return [None] * len(d.get("out_shapes") or [[]])
        if d.get("fx_op") == "call_module":  # nn.LayerNorm / nn.RMSNorm: its parameters are no inputs
            for param, numel in zip(d.get("params") or [], d.get("param_numels") or []):
                self.wide_param(node, param, 0, numel == f.count)
        self.check_unsharded(node, f, len(d["out_shapes"][0]))
        return [f]

    def wide_param(self, node: str, param: str, at: int, carries: bool) -> bool:
        """True when ``param`` belongs to a whole-width norm: recorded to be sharded along its
        dim ``at`` (the one meeting the sharded features) like the projection's columns."""
        module = param.rpartition(".")[0]
        if module not in self.wide:
            return False
        if not carries:
            raise _Stop(
                f"parameter {param} of the whole-width norm {module} meets the sharded features without "
                f"one entry per feature ({self.where(node)}); tensor parallelism cannot shard it"
            )
        self.layout.wide_params[param] = at
        return True

    def check_wide_norms(self) -> None:
        """Each whole-width norm normalises exactly one part of its column (the runtime shards
        its weight as that part is sharded: ``tp`` contiguous chunks)."""
        for module, (column, start, size) in self.layout.wide_norms.items():
            parts = self.layout.parts.get(column, [])
            if not any(s == start and n == size for s, n, _ in parts):
                raise _Stop(
                    f"the norm {module} normalises {size} features of {self.g.nodes[column].get('weight')} "
                    "that are not one of the parts tensor parallelism shards it into"
                )
