"""Multi-query attention from one fused projection under tensor parallelism (Falcon's default layout).

HF Falcon with ``multi_query=True`` (and not ``new_decoder_architecture``) computes
``query_key_value = Linear(h, (heads + 2) * head_dim)``, views it as ``[.., heads + 2, head_dim]``
and takes ``qkv[..., :-2, :]`` as the query heads, ``qkv[..., [-2], :]`` as the one key head and
``qkv[..., [-1], :]`` as the one value head, which every query head shares. No contiguous cut of the
heads gives every rank whole key/value groups, so tensor parallelism shards the *query* rows of
the fused weight by heads (column-parallel) and keeps the shared key/value rows *whole* on every
rank: each rank computes the key and value itself, and its attention uses its own query heads
against them (broadcast over the heads dim, which has size 1). The whole rows' gradient on one
rank only covers its own query heads' contribution, so the runtime sums it over the TP group
(``apply.tp_styles.SharedHeadsColumn``); the cost model prices those rows, their FLOPs and that
all-reduce as unsharded (``workload.block_facts``).

The follower (``graph.tp_flow``) records these parts in ``PairLayout.parts`` like any fused
projection's, and their indices in ``PairLayout.whole``. The traced graph does not record the
values of a tensor index (``[-2]``), so a single-head tensor index of the heads view is taken to
pick one of the heads left over by the query slice; the rule asks that each leftover head is
picked exactly once and that the picked tensors reach the attention with a heads dim of 1.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import networkx as nx

from nest_fx.graph.tp_flow_ops import Flow, _Stop


class MultiQueryRules:
    """Mixed into ``tp_flow._Follower`` (which provides ``g``, ``block``, ``ranges``, ``layout``,
    ``where``)."""

    def _mq(self) -> Tuple[Dict[str, Tuple[int, int, int, int]], Dict[str, List[str]]]:
        state = self.__dict__.setdefault("_multi_query", ({}, {}))
        return state

    def query_heads(self, node: str, f: Flow, size: int) -> Flow:
        """``qkv[..., :size, :]`` of heads viewed straight from a column: the query heads; the
        heads after them are shared (kept whole on every rank)."""
        column, start, unit = f.view
        queries, _ = self._mq()
        if column in queries or size >= f.count:
            raise _Stop(f"{self.where(node)} slices the sharded heads")
        queries[column] = (start, size, f.count, unit)
        self.head_counts.add(size)
        return Flow(dim=f.dim, count=size, heads=True)

    def shared_head(self, node: str, f: Flow) -> Optional[Flow]:
        """``qkv[..., [k], :]``: one head of a column's heads view, taken whole by every rank."""
        _, picks = self._mq()
        picks.setdefault(f.view[0], []).append(node)
        return None

    def shared_inputs_ok(self, node: str, ins: List[Optional[Flow]], heads_dim: int) -> bool:
        """An attention whose key and value come unsharded: acceptable when each is computed from
        the shared heads of a multi-query projection and has one head (broadcast to every query head)."""
        d = self.g.nodes[node]
        _, picks = self._mq()
        shared = {n for nodes in picks.values() for n in nodes}
        if not shared:
            return False
        block = self.g.subgraph(self.block.nodes)
        for name, flow, shape in list(zip(d.get("inputs", []), ins, d.get("in_shapes", [])))[1:3]:
            if flow is not None:
                continue
            if name not in block or len(shape) <= heads_dim or shape[heads_dim] != 1:
                return False
            if not (shared & (nx.ancestors(block, name) | {name})):
                return False
        return True

    def finish_multi_query(self) -> Dict[str, set]:
        """Replace the heads view's range of each multi-query column by its query part and one
        part per shared head (called before the parts are assembled); returns {column: starts of
        the parts every rank keeps whole}."""
        queries, picks = self._mq()
        whole: Dict[str, set] = {}
        for column in set(picks) - set(queries):
            raise _Stop(f"{self.where(picks[column][0])} indexes the sharded dim")
        for column, (start, size, count, unit) in queries.items():
            taken = picks.get(column, [])
            if len(taken) != count - size:
                weight = self.g.nodes[column].get("weight")
                raise _Stop(
                    f"{self.where(taken[0] if taken else column)} takes {len(taken)} of the {count - size} "
                    f"heads of {weight} left over by its query slice; tensor parallelism keeps them whole "
                    "only when each is taken once as a shared key or value head"
                )
            self.ranges[column].discard((start, count * unit, unit))
            self.ranges[column].add((start, size * unit, unit))
            for k in range(size, count):
                self.ranges[column].add((start + k * unit, unit, unit))
            whole[column] = {start + k * unit for k in range(size, count)}
        return whole
