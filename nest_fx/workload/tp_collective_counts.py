"""A layer's TP collectives counted as the runtime runs them (``apply.tensor_parallel``): the dense
regions' all-reduces, or under sequence parallelism their all-gathers and reduce-scatters, and the
all-reduces inside an expert region (``docs/cost_model.md``, "Tensor parallelism"). ``TracedSource``
prices them on a block's ``BlockFacts``."""

from __future__ import annotations

from typing import Dict, List, Tuple

from nest_fx.graph.tp_inputs import ColumnInputs
from nest_fx.workload.block_facts import BlockFacts


def tp_region_collectives(facts: BlockFacts, sp: bool) -> Dict[Tuple[str, str], int]:
    """{(kind, phase): count} of a layer's TP collectives of ``row_bytes`` per token, as the runtime
    runs them (``docs/cost_model.md``). Dense regions, forward: an all-reduce after each row (SP:
    the region's all-gather, the row's reduce-scatter); backward: per region prepared once one
    all-reduce of its input's gradient (SP: the gather's reduce-scatter, and the row's
    all-gather), per other region one all-reduce per column module
    (``graph.tp_inputs.column_inputs``; SP: those and the row's all-gather). An expert region
    under SP gathers its input whole and slices its output (an all-gather each way); its experts'
    own all-reduces are :func:`expert_tp_collectives`."""
    rows = facts.tp_allreduces
    inputs = facts.tp_inputs[sp] if facts.tp_inputs else ColumnInputs(once=rows, alone=0, column_reduces=0)
    dense = rows - inputs.experts
    if not sp:
        return {("all_reduce", "fwd"): dense, ("all_reduce", "bwd"): inputs.once + inputs.column_reduces}
    return {
        ("all_gather", "fwd"): rows,
        ("reduce_scatter", "fwd"): dense,
        ("all_gather", "bwd"): rows,
        ("reduce_scatter", "bwd"): dense - inputs.alone,
        ("all_reduce", "bwd"): inputs.column_reduces,
    }


def expert_tp_collectives(facts: BlockFacts, sp: bool, ep: int) -> List[Tuple[str, str, int, float, int]]:
    """(kind, phase, count, bytes per token of each, of them never recomputed:
    ``Comm.unrecomputed``) of the TP all-reduces inside a block's expert
    region, as the runtime runs them (``apply.tensor_parallel``). Each expert module its ``ep``
    rank holds is a TP pair of its own: its row all-reduces its output (forward) and each of its
    column modules its input's gradient (backward), over the tokens routed to it (the traced
    experts' outputs, ``a2a_bytes``, spread evenly over the experts; under ``ep`` each rank's
    experts take the tokens of ``ep`` ranks). A stacked-expert module runs on its local shards
    (``LocalShards``): one all-reduce of its output (never recomputed when nothing after it in
    the block saves a tensor), one of each floating input's gradient
    (``BlockFacts.stacked_experts``)."""
    out: List[Tuple[str, str, int, float, int]] = []
    inputs = facts.tp_inputs[sp] if facts.tp_inputs else None
    if inputs is not None and inputs.expert_rows:
        local = max(inputs.expert_rows // ep, 1)
        each = (facts.a2a_bytes or facts.row_bytes * inputs.expert_rows) * ep / inputs.expert_rows
        per_expert_columns = inputs.expert_column_reduces // inputs.expert_rows
        out += [("all_reduce", "fwd", local, each, 0), ("all_reduce", "bwd", local * per_expert_columns, each, 0)]
    for sent, taken, unsaved in facts.stacked_experts:
        out.append(("all_reduce", "fwd", 1, sent, int(unsaved)))
        out += [("all_reduce", "bwd", 1, nbytes, 0) for nbytes in taken]
    return out
