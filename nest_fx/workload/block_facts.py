"""What a traced block's nodes say about its cost (:func:`block_facts`): the facts
``TracedSource`` derives every variant from.

Per node: FLOPs and bytes moved, what it saves for backward (and what fused attention would),
whether tensor parallelism shards it (the TP pairs the tracer found, the vocabulary-parallel
head and tail), whether expert parallelism does, its parameters, an attention call's scores and
key/value bytes, and what each op-level recompute policy keeps (``recompute_costs``). Per block:
its input and output bytes, the collectives TP and EP need, the loss on the tail (the user's
code, assumed a token-level cross-entropy), a tied LM head, and the regions torch.compile fuses
(``runtime_costs.fusion_regions``). :func:`scaled_facts` re-costs the same facts in a wider or
narrower dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import replace as dataclass_replace
from typing import Dict, List, Optional, Tuple

import networkx as nx
import torch

from nest_fx.graph.annotate import LSE_BYTES
from nest_fx.graph.op_kinds import ATTENTION_CALLS, MATMUL_OPS, VIEW_OPS, is_weight_view
from nest_fx.graph.tp_inputs import ColumnInputs, column_inputs
from nest_fx.graph.tp_mha import MHA_OP
from nest_fx.graph.tp_wide_norms import statistic_bytes
from nest_fx.workload.expert_dispatch import routed_top_k
from nest_fx.workload.block_collectives import stacked_experts, tail_unsaved, tied_linear, vocab_parallel_nodes
from nest_fx.workload.recompute_costs import block_policy_costs
from nest_fx.workload.attention_share import attention_window
from nest_fx.workload.fused_norms import NormGroup, norm_groups, region_kept_lean
from nest_fx.workload.kernels import region_kept_bytes
from nest_fx.workload.runtime_costs import fusion_regions

DTYPE_BYTES = {
    name: torch.empty((), dtype=getattr(torch, name)).element_size()
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")
}


def tensor_bytes(shapes, dtypes) -> float:
    """Bytes of the tensors of ``shapes`` and ``dtypes`` (a node's ``in_shapes`` / ``in_dtypes``)."""
    total = 0.0
    for shape, dtype in zip(shapes or [], dtypes or []):
        n = 1
        for d in shape:
            n *= d
        total += n * DTYPE_BYTES.get(dtype, 4)
    return total


@dataclass
class NodeCost:
    flops: float
    bytes_moved: float
    matmul: bool
    saved: float
    saved_flash: float
    attention: bool
    tp: bool  # sharded by tensor parallelism
    column: bool  # a column-parallel linear: computes a shard, but saves its full (replicated) input
    expert: bool  # sharded by expert parallelism (its parameters)
    params: float
    param_bytes: float
    scores: float = 0.0  # attention: elements of the (batch, heads, s_q, s_k) score matrix; 0 otherwise
    score_bytes: float = 0.0  # ... and its bytes
    causal: bool = False  # attention: a causal call (is_causal=True)
    seq: int = 0  # attention: key length
    window: int = 0  # attention: causal sliding window (0: none; workload.attention_share)
    q_bytes: float = 0.0  # attention: bytes of the query (the rest of its inputs are keys and values)
    kv_bytes: float = 0.0  # attention: bytes of keys and values
    kept: Dict[str, float] = field(default_factory=dict)  # op-level policy -> bytes kept (recompute_costs)
    recomputed: Dict[str, float] = field(default_factory=dict)  # op-level policy -> share of the forward re-run
    linear_dims: Tuple[int, int, int] = (0, 0, 0)  # a linear with a weight: (rows, in, out features)
    tp_params: float = 0.0  # of ``params``, those tensor parallelism shards (a row's bias stays whole)
    tp_param_bytes: float = 0.0
    # a linear whose input is an attention output seen through view ops only (the output
    # projection): the tensor it saves is the one the attention kernel saved (attention_output_reader)
    reads_attention_output: bool = False
    saved_whole: float = 0.0  # of ``saved``, what every TP rank keeps whole (a sharded call's replicated input)
    # of its work under TP, the share the ranks divide: a multi-query column's shared key/value rows
    # (graph/tp_multi_query.py) run whole on every rank
    tp_work: float = 1.0

    def tp_divisor(self, tp: int) -> float:
        """What TP divides this node's FLOPs and bytes by (``tp`` unless part of it runs whole)."""
        return 1.0 / (self.tp_work / tp + 1.0 - self.tp_work)


@dataclass
class BlockFacts:
    nodes: List[NodeCost]
    out_bytes: float
    in_bytes: float
    tp_allreduces: int  # row linears whose outputs TP all-reduces in forward (an expert region: one)
    row_bytes: float  # bytes of one such output
    a2a_bytes: float  # expert-parallel dispatch bytes (one direction), one row per routed pair or slot
    top_k: int = 0  # experts each token is routed to (expert_dispatch.routed_top_k; 0: no router traced)
    # how the dense regions reduce their column inputs' gradients (graph.tp_inputs.column_inputs:
    # regions prepared once, regions whose columns reduce alone, those columns' all-reduces),
    # without and with SP; None: one reduction per row, as before the runtime told them apart
    tp_inputs: Optional[Tuple[ColumnInputs, ColumnInputs]] = None
    vocab_comms: Tuple[Tuple[str, float, str], ...] = ()  # head/tail under TP: (kind, bytes, phase) each
    # whole-width norms under TP (graph.tp_wide_norms): (kind, bytes, phase) of each statistic's
    # all-reduce, fp32 whatever the model's dtype (not scaled by scaled_facts)
    norm_comms: Tuple[Tuple[str, float, str], ...] = ()
    # bytes of each gradient all-reduced over TP in every backward, not scaled by tokens (a
    # multi-query column's shared key/value rows)
    grad_comms: Tuple[float, ...] = ()
    loss_saved: float = 0.0  # bytes the loss keeps for backward (fp32 log-softmax of the logits)
    loss_flops: float = 0.0
    loss_bytes_moved: float = 0.0
    loss_tokens: float = 0.0  # rows of the logits (tokens) the loss runs over
    recomputed: bool = True  # activation checkpointing wraps blocks only, never the head or tail
    tied_params: float = 0.0  # the tail's LM head weight when it is the embedding's (counted once, in the head)
    regions: List[Tuple[List[int], List[Tuple[int, float]]]] = field(
        default_factory=list
    )  # runtime_costs.fusion_regions
    region_kept: List[float] = field(default_factory=list)  # per region, bytes kept fused (kernels.region_kept_bytes)
    # the same with the region's RMSNorms keeping their output, not their input (fused_norms)
    region_kept_lean: List[float] = field(default_factory=list)
    # the last dense TP row's forward collective ends the block's saved tensors: no node it feeds
    # saves anything (a pre-norm block's residual add), so a recompute never re-runs it
    tail_unsaved: bool = False
    # per stacked-expert module run on local shards (graph.tp_inputs.stacked_pair): (bytes of its
    # output, all-reduced forward; bytes of each floating input it takes, whose gradient is
    # all-reduced backward; whether nothing after it in the block saves a tensor, so a recompute
    # never re-runs that all-reduce), at the traced microbatch
    stacked_experts: Tuple[Tuple[float, Tuple[float, ...], bool], ...] = ()
    norms: List[NormGroup] = field(default_factory=list)  # the RMSNorms F.rms_norm computes (fused_norms.norm_groups)


def _scores(d: dict) -> Tuple[float, float]:
    """(elements, bytes) of the score matrix of an attention node: (batch, heads, s_q) of the
    query times s_k of the key, in the output's dtype; (0, 0) when the shapes are not recorded."""
    shapes = d.get("in_shapes") or []
    if len(shapes) < 2 or len(shapes[0]) < 2 or len(shapes[1]) < 2:
        return 0.0, 0.0
    rows = 1
    for k in shapes[0][:-1]:
        rows *= k
    elements = float(rows * shapes[1][-2])
    return elements, elements * DTYPE_BYTES.get((d.get("out_dtypes") or ["bfloat16"])[0], 2)


def _head_table_nodes(g, block, pair, up: set) -> set:
    """The nodes feeding ``pair``'s row that read its per-head tables (Swin's bias table lookup,
    T5's bias embedding): each rank looks up its own heads' entries only."""
    if pair.kind == "expert":
        return set()
    units = set(pair.column) | {pair.row}
    tables = {block.fqn(p.name) for p in pair.params if not any(p.name.startswith(u + ".") for u in units)}
    tables |= {block.fqn(t) + ".weight" for t in pair.head_tables}
    return {n for n in up if tables & set(g.nodes[n].get("input_params") or [])} if tables else set()


def block_facts(graph, block) -> BlockFacts:
    """Classify a block's nodes: TP-sharded region, expert nodes, attention cores."""
    g = graph.graph
    members = set(block.nodes)
    pattern = graph.pattern_of(block) if block.kind == "block" else None
    weight_node = {g.nodes[n]["weight"]: n for n in block.nodes if g.nodes[n].get("weight")}

    def node_for(rel: str) -> Optional[str]:
        full = block.fqn(rel)
        return weight_node.get(full + ".weight") or weight_node.get(full)

    tp_nodes: set = set()
    leaf_calls: set = set()  # nn.MultiheadAttention calls TP shards: each saves its whole input
    sharded = {
        block.fqn(p.name) for pair in (pattern.tp_pairs if pattern else []) if not pair.problem for p in pair.params
    } | {
        block.fqn(t) + ".weight"
        for pair in (pattern.tp_pairs if pattern else [])
        if not pair.problem
        for t in pair.head_tables
    }
    # parameter -> share of it every TP rank keeps whole (multi-query shared key/value rows)
    whole = {
        block.fqn(p.name): p.whole_size() / sum(p.parts)
        for pair in (pattern.tp_pairs if pattern else [])
        if not pair.problem
        for p in pair.params
        if p.whole
    }
    column_nodes: set = set()
    expert_nodes: set = set()
    expert_paths = getattr(graph, "expert_modules", None)
    rows: List[Tuple[str, str]] = []
    for pair in pattern.tp_pairs if pattern else []:
        if pair.problem:  # the runtime refuses to shard it (ParallelSupport.tp_problem)
            continue
        if pair.leaf:  # nn.MultiheadAttention: one node computes the pair; its output is all-reduced
            call = next(
                (
                    n
                    for n in block.nodes
                    if g.nodes[n].get("module") == block.fqn(pair.leaf) and g.nodes[n].get("fx_op") == "call_module"
                ),
                None,
            )
            if call is not None:
                tp_nodes.add(call)
                leaf_calls.add(call)
                rows.append((pair.kind, call))
            continue
        cols = [c for c in (node_for(x) for x in pair.column) if c]
        row = node_for(pair.row)
        if not cols or not row:
            continue
        # the nodes on a path from a column to the row: every node of such a path is an ancestor
        # of the row, so the columns' descendants are searched among those alone (the same set;
        # the whole graph below an early block is the rest of the model)
        ancestors = nx.ancestors(g, row)
        up = ancestors & members
        inner = g.subgraph(ancestors)
        down = set().union(*(nx.descendants(inner, c) for c in cols if c in ancestors)) & members
        region = (down & up) | set(cols) | {row}
        tp_nodes |= region | _head_table_nodes(g, block, pair, up)
        column_nodes |= set(cols)
        if pair.kind == "expert":  # the experts' nodes of it (a shared expert is dense: Qwen2-MoE)
            expert_nodes |= {n for n in region if _in_experts(g.nodes[n].get("module", ""), expert_paths)}
        rows.append((pair.kind, row))
    vocab_nodes = vocab_parallel_nodes(graph, block)
    tp_nodes |= set(vocab_nodes)
    column_nodes |= {n for n, kind in vocab_nodes.items() if kind == "colwise"}
    for n in block.nodes:
        if _in_experts(g.nodes[n].get("module", ""), expert_paths):
            expert_nodes.add(n)

    if block.kind == "block":
        kept, recomputed = block_policy_costs(g, block.nodes)
    else:  # never checkpointed
        kept = recomputed = [{} for _ in block.nodes]
    nodes = []
    whole_grads: List[float] = []
    for k, n in enumerate(block.nodes):
        d = g.nodes[n]
        in_b = tensor_bytes(d.get("in_shapes"), d.get("in_dtypes"))
        out_b = d.get("out_bytes", 0.0)
        attention = d.get("op") in ATTENTION_CALLS
        saved_flash = d.get("saved_bytes", 0.0)
        q_bytes = kv_bytes = 0.0
        seq = window = 0
        if attention and d.get("out_shapes"):
            shape = d["out_shapes"][0]
            lse = out_b / max(shape[-1], 1) * LSE_BYTES / max(DTYPE_BYTES.get(d["out_dtypes"][0], 2), 1)
            q_bytes = tensor_bytes(d["in_shapes"][:1], d["in_dtypes"][:1])
            kv_bytes = tensor_bytes(d["in_shapes"][1:3], d["in_dtypes"][1:3])
            window = attention_window(g, n)
            if window:  # a windowed fused kernel reads and keeps no mask
                in_b = q_bytes + kv_bytes
            saved_flash = min(saved_flash, in_b + out_b + lse)
            seq = d["in_shapes"][1][-2] if len(d["in_shapes"]) > 1 and len(d["in_shapes"][1]) >= 2 else 0
        scores, score_bytes = _scores(d) if attention else (0.0, 0.0)
        tp_numel = (
            d.get("num_params", 0)
            if n in vocab_nodes
            else sum(
                numel * (1 - whole.get(name, 0.0))
                for name, numel in zip(d.get("params", []), d.get("param_numels", []))
                if name in sharded
            )
        )
        kept_whole = whole.get(d.get("weight") or "", 0.0)  # the matmul of a multi-query column
        bytes_per = d.get("param_bytes", 0.0) / max(d.get("num_params", 0), 1)
        if any(name in whole for name in d.get("params", [])):
            whole_grads.append(
                bytes_per
                * sum(
                    numel * whole.get(name, 0.0) for name, numel in zip(d.get("params", []), d.get("param_numels", []))
                )
            )
        nodes.append(
            NodeCost(
                flops=d.get("flops", 0.0),
                bytes_moved=0.0 if is_weight_view(d) else in_b + out_b + d.get("param_bytes", 0.0),
                matmul=bool(d.get("weight")) or d.get("op") in MATMUL_OPS or d.get("op") == MHA_OP or attention,
                saved=d.get("saved_bytes", 0.0),
                saved_flash=saved_flash,
                attention=attention,
                tp=n in tp_nodes,
                column=n in column_nodes,
                expert=n in expert_nodes,
                params=float(d.get("num_params", 0)),
                param_bytes=d.get("param_bytes", 0.0),
                scores=scores,
                score_bytes=score_bytes,
                causal=attention and "is_causal=True" in d.get("consts", ""),
                seq=seq,
                q_bytes=q_bytes,
                kv_bytes=kv_bytes,
                window=window,
                kept=kept[k],
                recomputed=recomputed[k],
                linear_dims=_linear_dims(d),
                tp_params=float(tp_numel),
                tp_param_bytes=tp_numel * bytes_per,
                reads_attention_output=attention_output_reader(g, n),
                saved_whole=min(d.get("saved_bytes", 0.0), in_b) if n in leaf_calls else 0.0,
                tp_work=1.0 - kept_whole,
            )
        )
    in_bytes = sum(
        g.nodes[p].get("out_bytes", 0.0)
        for p in {p for n in block.nodes for p in g.predecessors(n) if p not in members}
    )
    dense_rows = [r for k, r in rows if k != "expert"]
    expert_rows = [r for k, r in rows if k == "expert"]
    n_ar = len(dense_rows) + (1 if expert_rows else 0)
    row_bytes = g.nodes[dense_rows[0]]["out_bytes"] if dense_rows else (block.out_bytes or 0.0)
    a2a = sum(g.nodes[r]["out_bytes"] for r in expert_rows) if block.is_moe else 0.0
    vocab_comms: List[Tuple[str, float, str]] = []
    for n, kind in vocab_nodes.items():
        d = g.nodes[n]
        if kind == "rowwise":  # vocabulary-sharded lookup: partial outputs all-reduced (forward)
            vocab_comms.append(("all_reduce", d.get("out_bytes", 0.0), "fwd"))
        else:  # output linear: input gradient all-reduced (backward), logits all-gathered (forward)
            vocab_comms += [
                ("all_reduce", tensor_bytes(d.get("in_shapes"), d.get("in_dtypes")), "bwd"),
                ("all_gather", d.get("out_bytes", 0.0), "fwd"),
            ]
    wide = {block.fqn(m) for pair in (pattern.tp_pairs if pattern else []) if not pair.problem for m in pair.wide_norms}
    norm_comms = tuple(
        (kind, nbytes, phase)
        for nbytes in statistic_bytes(g, block.nodes, wide)
        for kind, phase in (("all_reduce", "fwd"), ("all_reduce", "bwd"))
    )
    # the whole rows' gradient, summed over TP in each backward (apply.tp_styles.SharedHeadsColumn)
    grad_comms = tuple(whole_grads)
    loss = _loss_facts(g, block)
    inputs = (column_inputs(pattern), column_inputs(pattern, True)) if pattern and block.kind == "block" else None
    if block.kind in ("head", "tail"):
        n_ar = 0
    tied = sum(_tied_weight_params(g, n) for n in block.nodes) if block.kind == "tail" else 0.0
    fusible = [
        not (n.matmul or n.attention)
        and (n.flops > 0 or n.bytes_moved > 0 or is_weight_view(g.nodes[name]))
        and g.nodes[name].get("fx_op") not in ("placeholder", "output")
        for n, name in zip(nodes, block.nodes)
    ]
    regions = fusion_regions(g, block.nodes, fusible) if block.kind == "block" else []
    saved = [n.saved for n in nodes]
    norms = norm_groups(g, block.nodes)
    return BlockFacts(
        nodes=nodes,
        out_bytes=block.out_bytes,
        in_bytes=in_bytes,
        tp_allreduces=n_ar,
        tp_inputs=inputs,
        row_bytes=row_bytes,
        a2a_bytes=a2a,
        top_k=routed_top_k(g, block.nodes) if block.is_moe else 0,
        vocab_comms=tuple(vocab_comms),
        norm_comms=norm_comms,
        grad_comms=grad_comms,
        loss_saved=loss[0],
        loss_flops=loss[1],
        loss_bytes_moved=loss[2],
        loss_tokens=loss[3],
        recomputed=block.kind == "block",
        tail_unsaved=block.kind == "block" and not expert_rows and tail_unsaved(g, block.nodes, dense_rows),
        stacked_experts=stacked_experts(g, block, pattern),
        tied_params=tied,
        regions=regions,
        region_kept=[region_kept_bytes(g, block.nodes, members, saved) for members, _ in regions],
        region_kept_lean=region_kept_lean(g, block.nodes, regions, saved, norms),
        norms=norms,
    )


def scaled_facts(facts: BlockFacts, k: float) -> BlockFacts:
    """``facts`` with every activation, weight and message byte count times ``k`` (a trace
    re-costed in a dtype ``k`` times as wide). The loss's figures stay: it computes in fp32
    whatever the model's dtype (``_loss_facts``)."""
    nodes = [
        dataclass_replace(
            n,
            bytes_moved=n.bytes_moved * k,
            saved=n.saved * k,
            saved_flash=n.saved_flash * k,
            param_bytes=n.param_bytes * k,
            score_bytes=n.score_bytes * k,
            q_bytes=n.q_bytes * k,
            kv_bytes=n.kv_bytes * k,
            tp_param_bytes=n.tp_param_bytes * k,
            saved_whole=n.saved_whole * k,
            kept={p: b * k for p, b in n.kept.items()},
        )
        for n in facts.nodes
    ]
    return dataclass_replace(
        facts,
        nodes=nodes,
        out_bytes=facts.out_bytes * k,
        in_bytes=facts.in_bytes * k,
        row_bytes=facts.row_bytes * k,
        a2a_bytes=facts.a2a_bytes * k,
        vocab_comms=tuple((kind, b * k, phase) for kind, b, phase in facts.vocab_comms),
        stacked_experts=tuple(
            (sent * k, tuple(b * k for b in taken), unsaved) for sent, taken, unsaved in facts.stacked_experts
        ),
        regions=[(members, [(j, b * k) for j, b in boundary]) for members, boundary in facts.regions],
        region_kept=[b * k for b in facts.region_kept],
        region_kept_lean=[b * k for b in facts.region_kept_lean],
        norms=[grp.scaled(k) for grp in facts.norms],
    )


def attention_output_reader(g, node: str) -> bool:
    """Whether ``node`` is a linear whose input is an attention call's output seen through view
    ops only (``transpose``/``reshape``/``contiguous``: the attention output projection) and no
    larger than it. A fused runtime feeds the attention kernel's output to that linear in place
    (Megatron-LM / Transformer Engine lay it out ``[s, b, heads x head_dim]``), so the tensor the
    linear saves for its weight gradient is the one the attention kernel saved for its backward."""
    d = g.nodes[node]
    if d.get("op") != "linear" or not d.get("weight"):
        return False
    seen = set()
    current = _tensor_input(g, node)
    while current is not None and current not in seen:
        seen.add(current)
        c = g.nodes[current]
        if c.get("op") in ATTENTION_CALLS:
            return d.get("saved_bytes", 0.0) <= c.get("out_bytes", 0.0) * (1 + 1e-6)
        if c.get("op") not in VIEW_OPS:
            return False
        current = _tensor_input(g, current)
    return False


def _tensor_input(g, node: str) -> Optional[str]:
    """The largest input of ``node`` (its data; the others are sizes or weights), None without one."""
    preds = list(g.predecessors(node))
    return max(preds, key=lambda p: g.nodes[p].get("out_bytes", 0.0)) if preds else None


def _linear_dims(d: dict) -> Tuple[int, int, int]:
    """(rows, in features, out features) of a node with a weight (a linear), else zeros."""
    inputs, outputs = d.get("in_shapes") or [], d.get("out_shapes") or []
    if not d.get("weight") or d.get("op") != "linear" or not inputs or not outputs or not inputs[0]:
        return 0, 0, 0
    rows = 1
    for k in inputs[0][:-1]:
        rows *= k
    return rows, inputs[0][-1], outputs[0][-1]


def _tied_weight_params(g, node: str) -> float:
    """Parameters of the weight a tail linear shares with an earlier layer (the tracer counts a
    shared weight once, at its first use: a tied LM head's linear records a weight that is not
    among its parameters)."""
    d = g.nodes[node]
    if not tied_linear(d):
        return 0.0
    inputs, outputs = d.get("in_shapes") or [], d.get("out_shapes") or []
    if not inputs or not outputs or not inputs[0] or not outputs[0]:
        return 0.0
    return float(inputs[0][-1] * outputs[0][-1])  # in_features x out_features


def _in_experts(module: str, expert_modules: Optional[List[str]]) -> bool:
    """Whether a node of ``module`` computes with expert weights (sharded by expert parallelism):
    under one of the traced model's expert modules; for a graph that did not record them, any module
    path naming an expert. A shared expert (Qwen2-MoE ``shared_expert``) is dense and replicated."""
    if expert_modules is None:
        return "expert" in module
    return any(module == p or module.startswith(p + ".") for p in expert_modules)


LOSS_STATE_BYTES = 4  # the loss runs in fp32 (logits upcast), as usual for language-model training
# its backward holds two fp32 logit-sized gradients at once: of the log-probabilities and of the logits
LOSS_BACKWARD_COPIES = 2


def _loss_facts(g, block) -> Tuple[float, float, float, float]:
    """(saved bytes, FLOPs, bytes moved, rows) of a token-level cross-entropy on the model's
    output, assumed for every model whose tail ends in a linear (an LM head): the fp32
    log-softmax it keeps for backward, about 5 FLOPs per logit, and the logits read once, upcast
    and written as log-probabilities; rows are the tokens. The loss is the user's code, not in
    the trace; zeros otherwise."""
    if block.kind != "tail":
        return 0.0, 0.0, 0.0, 0.0
    heads = [n for n in block.nodes if g.nodes[n].get("op") == "linear" and g.nodes[n].get("weight")]
    if not heads:
        return 0.0, 0.0, 0.0, 0.0
    d = g.nodes[heads[-1]]
    shapes, dtypes = d.get("out_shapes") or [], d.get("out_dtypes") or []
    if not shapes:
        return 0.0, 0.0, 0.0, 0.0
    numel = 1
    for k in shapes[0]:
        numel *= k
    logits = numel * DTYPE_BYTES.get(dtypes[0] if dtypes else "float32", 4)
    rows = numel / max(shapes[0][-1], 1)
    return numel * LOSS_STATE_BYTES, 5.0 * numel, logits + 2 * numel * LOSS_STATE_BYTES, rows
