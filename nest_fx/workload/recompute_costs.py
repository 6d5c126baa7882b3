"""What each op-level recompute policy keeps and re-runs, per node of a traced block.

The tracer records, per node, the aten ops it ran and the storages it created
(``nest_fx.graph.annotate``). Under a selective policy (``selective``, ``op``, ``op:<policy>``:
``nest_fx.graph.recompute_policies``, the definitions the runtime applies) the block forward
keeps the storages its saved op outputs refer to, and its recompute re-runs every op it does not
save. For one block this module returns, per node:

* ``kept[policy]``: bytes of the storages the node created that the policy keeps, apart from the
  block's outputs (the next layer's input, counted there). The runtime's measurement
  (``profiler.recompute_memory.kept_bytes``) sums the same storages;
* ``recomputed[policy]``: the share of the node's forward the recompute re-runs: of its ops that
  create a storage (views and in-place ops cost nothing here), those the policy does not save.

Bytes are attributed to the node that created a storage, so the cost model scales them with the
creator's sharding (a column linear's output is a tensor-parallel shard, a norm's output is
sharded only under sequence parallelism).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Set, Tuple

from nest_fx.graph.recompute_policies import LAYER_POLICIES, RecordedOp, parse_recompute, saved_op_flags

# the per-layer policies decided op by op (none keeps what autograd saves, full only the input)
OP_LEVEL_POLICIES: Tuple[str, ...] = tuple(p for p in LAYER_POLICIES if p not in ("none", "full"))


def block_policy_costs(g, nodes: Sequence[str]) -> Tuple[List[Dict[str, float]], List[Dict[str, float]]]:
    """(kept bytes, recomputed share) per node of a block (``nodes`` in execution order, node
    attributes of the traced graph ``g``), each a dict over :data:`OP_LEVEL_POLICIES`."""
    members = set(nodes)
    ops: List[RecordedOp] = []
    owner: List[int] = []  # node index of each op
    creator: Dict[int, Tuple[int, float]] = {}  # storage -> (node index, bytes)
    for k, name in enumerate(nodes):
        d = g.nodes[name]
        for op in d.get("aten_ops", ()):
            ops.append(op)
            owner.append(k)
        for sid, nbytes in d.get("created", {}).items():
            creator[sid] = (k, nbytes)
    outputs = _block_outputs(g, nodes, members)
    kept = [dict.fromkeys(OP_LEVEL_POLICIES, 0.0) for _ in nodes]
    recomputed = [dict.fromkeys(OP_LEVEL_POLICIES, 0.0) for _ in nodes]
    computing = [0] * len(nodes)  # ops of the node that create a storage
    makes = [any(sid in creator and creator[sid][0] == owner[j] for sid in op[2]) for j, op in enumerate(ops)]
    for j, k in enumerate(owner):
        computing[k] += makes[j]
    for policy in OP_LEVEL_POLICIES:
        flags = saved_op_flags(parse_recompute(policy), ops)
        storages: Set[int] = set()
        for op, keep in zip(ops, flags):
            if keep:
                storages.update(op[2])
        for sid in storages - outputs:
            if sid in creator:
                k, nbytes = creator[sid]
                kept[k][policy] += nbytes
        for j, (k, keep) in enumerate(zip(owner, flags)):
            if makes[j] and not keep:
                recomputed[k][policy] += 1.0 / computing[k]
    return kept, recomputed


def _block_outputs(g, nodes: Sequence[str], members: Set[str]) -> Set[int]:
    """Storages of the values a block hands on (outputs of its nodes read outside it, or of its
    last node)."""
    out: Set[int] = set()
    for name in nodes:
        if any(s not in members for s in g.successors(name)) or not any(True for _ in g.successors(name)):
            out.update(g.nodes[name].get("out_storages", ()))
    return out
