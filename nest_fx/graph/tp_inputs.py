"""What the column linears of a TP pair read, and whether the runtime can prepare it once.

Every column-parallel linear needs a replicated input whose gradient (each rank's is partial: it
holds only its own output features' share) is summed over the TP group in backward. When the
columns of one region all read the same tensor (q, k and v of an attention, gate and up of a
SwiGLU MLP) and that tensor is what the region module is given, the sum can be taken once for all
of them: their partial gradients add up locally first, then one all-reduce (Megatron's f
operator, torchtitan's ``PrepareModuleInput``). :func:`shared_column_input` says when the trace
shows that (``TPPair.input_module``), :func:`once_input` and :func:`prepares_input_once` when
the runtime then does it, and
:func:`column_inputs` how the regions of a block reduce their column inputs' gradients (the
runtime's count, which the cost model prices). :func:`sequence_bypass` finds a region that
sequence parallelism cannot run (its gathered input reaching its output beside the row).

The input must not be read by anything else inside the region: such a reader's gradient is
whole on every rank, and summing it with the columns' would count it ``tp`` times.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

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


def once_input(kind: str, pairs: List) -> str:
    """The module (relative to the block) whose input the runtime prepares once for all of a
    region's columns ("" when none): the region's one dense pair's ``input_module``, its columns
    sharded by ``ColumnShard`` (not a multi-query column with whole rows, nor an
    ``nn.MultiheadAttention`` leaf, which enters each distinct input once by itself)."""
    if kind == "expert" or len(pairs) != 1:
        return ""
    pair = pairs[0]
    if pair.leaf or pair.problem or any(p.whole for p in pair.params):
        return ""
    return pair.input_module


def prepares_input_once(region: str, kind: str, pairs: List, sequence_parallel: bool = False) -> bool:
    """Whether the runtime prepares the columns' input of ``region`` once (:func:`once_input`).
    Under sequence parallelism only where that input is the region's own, which the region
    gathers on entry as a DTensor (the columns' common module inside a region that also reads
    the input elsewhere is left to its columns: that reader would meet a DTensor)."""
    module = once_input(kind, pairs)
    return bool(module) and (not sequence_parallel or module == region)


class ColumnInputs(NamedTuple):
    """How the dense regions of a block reduce their column inputs' gradients in backward."""

    once: int  # regions prepared once: one reduction each (an all-reduce; SP: the gather's reduce-scatter)
    alone: int  # regions whose columns each reduce their own input
    column_reduces: int  # ... their all-reduces: one per column module, one per nn.MultiheadAttention
    experts: int = 0  # expert regions (gathered whole under SP; their experts reduce apart, below)
    expert_rows: int = 0  # the experts' row linears: each all-reduces its output (forward)
    expert_column_reduces: int = 0  # the experts' column modules: each all-reduces its input's gradient


def stacked_pair(pair) -> bool:
    """A pair whose columns and row are parameters of one module (3-D stacked expert weights,
    transformers 5's ``experts.gate_up_proj``), not modules: the runtime runs that module on its
    local shards (``apply.tp_styles.LocalShards``)."""
    names = {spec.name for spec in pair.params}
    return bool(pair.column) and all(c in names for c in pair.column) and pair.row in names


def column_inputs(pattern, sequence_parallel: bool = False) -> ColumnInputs:
    """:class:`ColumnInputs` of a block with this pattern under TP: a region is prepared once
    when :func:`prepares_input_once`; in any other region each column module all-reduces its own
    input's gradient, an ``nn.MultiheadAttention`` pair each distinct input once (one:
    self-attention). Under sequence parallelism such a region gathers its input to a plain
    tensor, so its backward has those all-reduces and no reduce-scatter."""
    once = alone = reduces = experts = expert_rows = expert_reduces = 0
    for region, kind, pairs in block_regions(pattern):
        pairs = [p for p in pairs if not p.problem]
        if kind == "expert" or not pairs:
            experts += bool(pairs)
            modules = [p for p in pairs if not stacked_pair(p)]  # stacked experts: BlockFacts.stacked_experts
            expert_rows += len(modules)
            expert_reduces += sum(len(p.column) for p in modules)
            continue
        if prepares_input_once(region, kind, pairs, sequence_parallel):
            once += 1
        else:
            alone += 1
            reduces += sum(1 if p.leaf else len(p.column) for p in pairs)
    return ColumnInputs(once, alone, reduces, experts, expert_rows, expert_reduces)


def column_input_reduces(pattern) -> int:
    """All-reduces of column inputs' gradients in one backward of a block with this pattern under
    TP without sequence parallelism (expert regions not counted): one per region prepared once,
    else one per column module (:func:`column_inputs`)."""
    counts = column_inputs(pattern)
    return counts.once + counts.column_reduces


def sequence_bypass(graph: nx.DiGraph, block, region: str, pairs: List) -> str:
    """Under sequence parallelism a region gathers the input its columns read and its row
    reduce-scatters its output over the sequence, so the gathered input must reach the region's
    output through a row only: '' when it does, else the op that reads it on another way there (a
    module adding its own input to its output would add a whole sequence to one rank's share; a
    residual passed in beside it, sequence-sharded, is fine: Bloom)."""
    path = block.fqn(region)
    rows = [block.fqn(p.row) for p in pairs]
    columns = [block.fqn(c) for p in pairs for c in p.column]
    inside = {n for n in block.nodes if _under(graph.nodes[n].get("module", ""), path)}
    gathered = {
        read
        for n in inside
        if graph.nodes[n].get("weight")
        for unit in columns
        if _under(graph.nodes[n].get("module", ""), unit)
        for read in _read_by(graph, n, unit)
    }
    row_shapes = [
        (graph.nodes[n].get("out_shapes") or [None])[0]
        for n in inside
        if any(_under(graph.nodes[n].get("module", ""), r) for r in rows)
    ]
    stack = [
        n
        for n in inside
        if is_float(graph.nodes[n])
        and (graph.nodes[n].get("out_shapes") or [None])[0] in row_shapes
        and any(s not in inside for s in graph.successors(n))
    ]
    seen: Set[str] = set()
    while stack:
        node = stack.pop()
        if node in seen or any(_under(graph.nodes[node].get("module", ""), r) for r in rows):
            continue
        seen.add(node)
        for p in graph.predecessors(node):
            if not is_float(graph.nodes[p]) or (p not in inside and p not in gathered):
                continue
            if p not in inside:
                data = graph.nodes[node]
                return f"op {data.get('op')!r} in module {data.get('module') or '<root>'}"
            stack.append(p)
    return ""
