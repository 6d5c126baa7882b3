"""What the column linears of a TP pair read, and whether the runtime can prepare it once.

Every column-parallel linear needs a replicated input whose gradient (each rank's is partial: it
holds only its own output features' share) is summed over the TP group in backward. When the
columns of one region all read the same tensor (q, k and v of an attention, gate and up of a
SwiGLU MLP) and that tensor is what the region module is given, the sum can be taken once for all
of them: their partial gradients add up locally first, then one all-reduce (Megatron's f
operator, torchtitan's ``PrepareModuleInput``). :func:`shared_column_input` says when the trace
shows that, :func:`prepares_input_once` when the runtime then does it, and
:func:`column_input_reduces` how many backward all-reduces the column inputs of a block cost
(the runtime's count, which the cost model prices).

The input must not be read by anything else inside the region: such a reader's gradient is
whole on every rank, and summing it with the columns' would count it ``tp`` times.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import networkx as nx

from nest_fx.graph.tp_regions import block_regions

_FLOAT = ("float", "bfloat16", "half", "complex")


def is_float(data: dict) -> bool:
    """Whether a traced node's output is floating-point data (features, not indices or sizes)."""
    return any(str(dt).startswith(_FLOAT) for dt in data.get("out_dtypes") or [])


def _under(module: str, path: str) -> bool:
    return module == path or module.startswith(path + ".")


def _read_by(graph: nx.DiGraph, node: str, unit: str) -> Set[str]:
    """The floating-point nodes outside module ``unit`` that feed matmul ``node`` through the ops
    of ``unit`` itself (a HF ``Conv1D`` views its input before its ``addmm``)."""
    found: Set[str] = set()
    stack = [p for p in graph.predecessors(node) if is_float(graph.nodes[p])]
    seen: Set[str] = set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        if _under(graph.nodes[p].get("module", ""), unit):
            stack.extend(q for q in graph.predecessors(p) if is_float(graph.nodes[q]))
        else:
            found.add(p)
    return found


def shared_column_input(
    graph: nx.DiGraph, columns: Sequence[str], units: Dict[str, Tuple[str, bool]], region: str
) -> bool:
    """True when the column matmuls ``columns`` (nodes; ``units``: node -> (unit FQN, is a
    module)) all read one tensor produced outside the region module ``region`` (an FQN, not the
    block itself), and every floating-point reader of that tensor inside the region is one of
    the columns' own ops."""
    if not region or not columns or not all(units[c][1] for c in columns):
        return False
    inputs: Optional[Set[str]] = None
    for c in columns:
        read = _read_by(graph, c, units[c][0])
        if len(read) != 1 or (inputs is not None and read != inputs):
            return False
        inputs = read
    (source,) = inputs
    if _under(graph.nodes[source].get("module", ""), region):
        return False
    own = [units[c][0] for c in columns]
    for user in graph.successors(source):
        data = graph.nodes[user]
        module = data.get("module", "")
        if is_float(data) and _under(module, region) and not any(_under(module, u) for u in own):
            return False
    return True


def prepares_input_once(kind: str, pairs: List) -> bool:
    """Whether the runtime (without sequence parallelism) prepares a region's input once for
    all its columns: one dense pair whose columns share the region's input (``shared_input``)
    and are sharded by ``ColumnShard`` (not a multi-query column with whole rows, nor an
    ``nn.MultiheadAttention`` leaf, which enters each distinct input once by itself)."""
    if kind == "expert" or len(pairs) != 1:
        return False
    pair = pairs[0]
    return pair.shared_input and not pair.leaf and not pair.problem and not any(p.whole for p in pair.params)


def column_input_reduces(pattern) -> int:
    """All-reduces of column inputs' gradients in one backward of a block with this pattern under
    TP without sequence parallelism (expert regions not counted): one per region prepared once
    (:func:`prepares_input_once`), else one per column module (each sums its own input's
    gradient), one per ``nn.MultiheadAttention`` pair."""
    count = 0
    for _, kind, pairs in block_regions(pattern):
        pairs = [p for p in pairs if not p.problem]
        if kind == "expert" or not pairs:
            continue
        if prepares_input_once(kind, pairs):
            count += 1
        else:
            count += sum(1 if p.leaf else len(p.column) for p in pairs)
    return count
