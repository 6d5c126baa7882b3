"""Per-op rules of ``graph.tp_flow``'s follower for attention: the attention call itself (query,
key and value sharded alike by heads, or one shared key/value head of a multi-query projection:
``graph.tp_multi_query``), batched matmuls of an eager attention, and the reason an attention
input is left unsharded by a norm over a whole projection."""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

import networkx as nx

from nest_fx.graph.tp_flow_ops import FILLS, NORMS, REDUCTIONS, Flow, _normalises_last, _Stop


class AttentionRules:
    """Mixed into ``tp_flow._Follower`` (which provides ``g``, ``block``, ``where``, ``inside``,
    ``head_counts``, ``check_unsharded`` and ``shared_inputs_ok``)."""

    def local_fill(self, node: str, at: int) -> bool:
        """True when ``node`` is a tensor of one value built inside the region with one entry per
        head along ``at`` (T5's cross-attention without a bias table of its own: ``position_bias =
        torch.zeros((1, self.n_heads, q, k))``). A rank's copy of the region reads its localised head
        count and builds its own heads, which equal any rank's slice (one value everywhere); the TP
        rehearsal refuses a region whose code builds it from a count nest-fx does not localise.
        Where it leaves the region (T5 passes it to the later layers' cross-attention) it must reach
        only copies of the same module, which take a tensor of ``heads / tp`` heads as it is."""
        d = self.g.nodes[node]
        shape = (d.get("out_shapes") or [[]])[0]
        if d.get("op") not in FILLS or not self.inside(node) or not (0 <= at < len(shape)):
            return False
        if shape[at] not in self.head_counts or any(_is_float_input(self.g, n) for n in d.get("inputs", [])):
            return False
        owner = d.get("module_class")
        return all(
            self.inside(user) or (owner and self.g.nodes[user].get("module_class") == owner)
            for user in self.g.successors(node)
        )

    def whole_width_norm(self, node: str, ins: List[Optional[Flow]]) -> str:
        """Why an attention's query, key or value is left unsharded, when a norm over its whole
        projection (all heads' features: OLMo2's ``q_norm``/``k_norm``) stands between it and its
        linear, so that linear is no column of the pair ("" when none does)."""
        d = self.g.nodes[node]
        head_dim = d["in_shapes"][0][-1]
        block = self.g.subgraph(self.block.nodes)
        for name, flow, what in zip(d.get("inputs", [])[:3], ins[:3], ("query", "key", "value")):
            if flow is not None or name not in block:
                continue
            for source in (n for n in self.block.nodes if n in nx.ancestors(block, name) and self.inside(n)):
                a = self.g.nodes[source]
                op, shape = a.get("op", ""), (a.get("in_shapes") or [[]])[0]
                if (op in NORMS or _normalises_last(op) or op in REDUCTIONS) and shape and shape[-1] > head_dim:
                    return (
                        f"{self.where(node)} takes its {what} through {a.get('module')!r}, a norm over all the "
                        f"heads' {shape[-1]} features (not per head of {head_dim}); a TP rank holds only its "
                        "heads' features, and nest-fx gathers the statistic only for a norm module of the attention "
                        "applied to the whole output of one projection (OLMo2's q_norm)"
                    )
        return ""

    def attention(self, node: str, ins: List[Optional[Flow]]) -> List[Optional[Flow]]:
        d = self.g.nodes[node]
        shapes = d["in_shapes"]
        q = ins[0]
        if q is not None and any(f is None for f in ins[1:3]) and self.shared_inputs_ok(node, ins, q.dim):
            ins = [q, q, q] + list(ins[3:])  # one shared key/value head, whole on every rank
        if q is None or any(f is None for f in ins[1:3]):
            raise _Stop(
                self.whole_width_norm(node, ins)
                or f"{self.where(node)} mixes sharded and unsharded queries, keys or values"
            )
        nd = len(shapes[0])
        if q.dim >= nd - 2 or not all(f.dim == q.dim for f in ins[1:3]):
            raise _Stop(f"{self.where(node)}: the sharded dim is not the heads dim of the attention")
        for f in ins[1:3]:
            if q.count % f.count and f.extent != q.extent:
                raise _Stop(f"{self.where(node)}: query and key/value heads are sharded differently")
        if len(ins) > 3 and ins[3] is not None and not ins[3].same_split(q):
            raise _Stop(f"{self.where(node)}: the attention mask is sharded differently from the heads")
        self.check_unsharded(node, q, nd, skip={0, 1, 2})
        return [q] + [
            replace(q) if len(o) > q.dim and o[q.dim] == shapes[0][q.dim] else None for o in d["out_shapes"][1:]
        ]

    def batched_matmul(self, node: str, op: str, ins: List[Optional[Flow]]) -> Flow:
        d = self.g.nodes[node]
        shapes, out = d["in_shapes"], d["out_shapes"][0]
        operands = [1, 2] if op == "baddbmm" else [0, 1]
        aligned = []
        for i in operands:
            f = ins[i] if i < len(ins) else None
            if f is None:
                continue
            if f.dim >= len(shapes[i]) - 2:
                raise _Stop(f"{self.where(node)} contracts or keeps the sharded dim as a matrix dim")
            aligned.append(replace(f, dim=f.dim + len(out) - len(shapes[i])))
        if not aligned:
            raise _Stop(f"{self.where(node)} combines sharded data in a way tensor parallelism cannot follow")
        first = aligned[0]
        if any(not f.same_split(first) for f in aligned[1:]):
            raise _Stop(f"{self.where(node)} multiplies tensors sharded differently")
        for i in operands:
            if (
                i < len(ins)
                and ins[i] is None
                and 0 <= first.dim - (len(out) - len(shapes[i])) < len(shapes[i])
                and shapes[i][first.dim - (len(out) - len(shapes[i]))] != 1
            ):
                raise _Stop(f"{self.where(node)} multiplies sharded heads with an unsharded per-head tensor")
        self.check_unsharded(node, first, len(out), skip=set(operands))
        return replace(first, source=None) if first.source else first


def _is_float_input(graph: nx.DiGraph, name: str) -> bool:
    return name in graph and str((graph.nodes[name].get("out_dtypes") or [""])[0]).startswith(("float", "bfloat"))
