"""Layer costs derived from a traced OpGraph and a per-op timing model (``TracedSource``).

Every variant (tensor-parallel degree, expert-parallel degree, microbatch size, sequence
parallelism) is derived from the traced nodes: how TP and EP shard each node follows from the
TP pairs the tracer found, and the vocabulary-parallel head and tail from the embeddings and
output linears. ``workload_from_graph`` turns a graph into the :class:`Workload` chain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import networkx as nx
import torch

from nest_fx.graph.annotate import MATMUL_OPS
from nest_fx.graph.tp_regions import vocab_parallel_lookup
from nest_fx.workload.types import Comm, Layer, LayerCost, ModelDims, Workload

_DTYPE_BYTES = {name: torch.empty((), dtype=getattr(torch, name)).element_size()
                for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu"}


def _bytes_of(shapes, dtypes) -> float:
    total = 0.0
    for shape, dtype in zip(shapes or [], dtypes or []):
        n = 1
        for d in shape:
            n *= d
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


@dataclass
class _NodeCost:
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
    tp_params: float = 0.0  # of ``params``, those tensor parallelism shards (a row's bias stays whole)
    tp_param_bytes: float = 0.0


@dataclass
class _BlockFacts:
    nodes: List[_NodeCost]
    out_bytes: float
    in_bytes: float
    tp_allreduces: int  # row linears whose outputs TP must all-reduce (per direction)
    row_bytes: float  # bytes of one such output
    a2a_bytes: float  # expert-parallel dispatch bytes (one direction)
    tp_phases: Tuple[str, ...] = ("fwd", "bwd")
    vocab_comms: Tuple[Tuple[str, float, str], ...] = ()  # head/tail under TP: (kind, bytes, phase) each
    loss_saved: float = 0.0  # bytes the loss keeps for backward (fp32 log-softmax of the logits)
    loss_flops: float = 0.0
    loss_bytes_moved: float = 0.0
    recomputed: bool = True  # activation checkpointing wraps blocks only, never the head or tail


class TracedSource:
    """Layer costs derived from an OpGraph and a per-op timing model.

    ``timing`` has ``op_seconds(flops, bytes, matmul)`` and ``backward_factor`` (the
    analytical model in ``nest_fx.workload.roofline``; a measured profile later). ``attention``:
    "flash" keeps O(s) bytes for fused attention (q, k, v, out, log-sum-exp) as flash
    attention does on GPUs; "traced" keeps what the traced kernel saved.
    """

    def __init__(self, graph, timing, *, attention: str = "flash"):
        if attention not in ("flash", "traced"):
            raise ValueError(f"attention={attention!r}: use 'flash' or 'traced'")
        self.graph = graph
        self.timing = timing
        self.attention = attention
        self.batch = graph.input_shapes[0][0] if graph.input_shapes and graph.input_shapes[0] else 1
        self._facts: Dict[int, _BlockFacts] = {}

    def facts(self, block_index: int) -> _BlockFacts:
        if block_index not in self._facts:
            self._facts[block_index] = _block_facts(self.graph, self.graph.blocks[block_index])
        return self._facts[block_index]

    def cost(self, layer: Layer, tp: int, ep: int, mbs: int, sp: bool) -> LayerCost:
        block = next(b for b in self.graph.blocks if b.signature == layer.signature and b.kind == layer.kind)
        facts = self.facts(block.index)
        scale = mbs / self.batch
        sp = sp and block.kind == "block"  # the head and the tail see full sequences
        fwd = bwd = attn_fwd = 0.0
        act_none = act_sel = 0.0
        params = param_bytes = expert_params = 0.0
        for n, (t, tb) in zip(facts.nodes, self.node_times(block, tp, mbs, sp)):
            fwd += t
            bwd += tb
            if n.attention:
                attn_fwd += t
            flash = n.saved_flash if n.attention else n.saved
            keep = tp if (sp or (n.tp and not n.column)) else 1
            act_none += (flash if self.attention == "flash" else n.saved) * scale / keep
            act_sel += flash * scale / keep
            epdiv = ep if n.expert else 1
            node_params = (n.params - n.tp_params + n.tp_params / tp) / epdiv
            params += node_params
            param_bytes += (n.param_bytes - n.tp_param_bytes + n.tp_param_bytes / tp) / epdiv
            if n.expert:
                expert_params += node_params
        if facts.loss_saved:
            loss_t = self.timing.op_seconds(facts.loss_flops * scale, facts.loss_bytes_moved * scale, False)
            fwd += loss_t
            bwd += loss_t * self.timing.backward_factor
            act_none += facts.loss_saved * scale
            act_sel += facts.loss_saved * scale
        full = facts.in_bytes * scale / (tp if sp else 1)
        comms: List[Comm] = []
        if tp > 1 and facts.tp_allreduces:
            nbytes = facts.row_bytes * scale
            if sp:
                for phase in facts.tp_phases:
                    comms += [Comm("all_gather", "tp", nbytes, phase, facts.tp_allreduces),
                              Comm("reduce_scatter", "tp", nbytes, phase, facts.tp_allreduces)]
            else:
                comms += [Comm("all_reduce", "tp", nbytes, phase, facts.tp_allreduces) for phase in facts.tp_phases]
        if tp > 1:
            comms += [Comm(kind, "tp", nbytes * scale, phase) for kind, nbytes, phase in facts.vocab_comms]
        if ep > 1 and facts.a2a_bytes:
            nbytes = facts.a2a_bytes * scale / tp
            comms += [Comm("all_to_all", "ep", nbytes, phase, 2) for phase in ("fwd", "bwd")]
        if not facts.recomputed:
            act_sel, full = act_none, act_none
            recompute_s = {"none": 0.0, "selective": 0.0, "full": 0.0}
        else:
            recompute_s = {"none": 0.0, "selective": attn_fwd, "full": fwd}
        return LayerCost(
            fwd_s=fwd, bwd_s=bwd, num_params=params, param_bytes=param_bytes,
            act_bytes={"none": act_none, "selective": min(act_sel, act_none), "full": min(full, act_none)},
            recompute_s=recompute_s, out_bytes=facts.out_bytes * scale, comms=comms, expert_params=expert_params,
            bwd_scratch=LOSS_BACKWARD_COPIES * facts.loss_saved * scale)

    def node_times(self, block, tp: int, mbs: int, sp: bool) -> List[Tuple[float, float]]:
        """(forward, backward) seconds of each node of ``block`` on one device for a variant:
        the analytical model on the node's FLOPs and bytes, divided by the TP degree where TP
        (or sequence parallelism) shards the node, and backward = ``backward_factor`` x forward.
        With ``attention="traced"`` an attention core also pays its materialised scores
        (:func:`materialised_score_seconds`)."""
        scale = mbs / self.batch
        out = []
        sp = sp and block.kind == "block"  # the head and the tail see full sequences
        for n in self.facts(block.index).nodes:
            shard = tp if n.tp else (tp if sp else 1)
            extra = n.score_bytes * SCORE_GEMM_PASSES if n.attention and self.attention == "traced" else 0.0
            t = self.timing.op_seconds(n.flops * scale / shard, (n.bytes_moved + extra) * scale / shard, n.matmul)
            if extra:
                t += materialised_score_seconds(self.timing, n.scores * scale / shard, n.score_bytes * scale / shard)
            out.append((t, t * self.timing.backward_factor))
        return out


# An attention core without a fused kernel (attention="traced": the math path of PyTorch's SDPA,
# Megatron-LM before flash attention) materialises the score matrix S = QK^T and its softmax P:
# the QK^T GEMM writes S and the PV GEMM reads P (two passes, added to the GEMMs' bytes), and a
# separate softmax kernel reads S and writes P (two passes) at about five vector FLOPs per score
# (scale, mask, max, exp, normalise). Backward costs backward_factor x forward, as for every op.
SCORE_GEMM_PASSES = 2
SOFTMAX_PASSES = 2
SOFTMAX_FLOPS_PER_SCORE = 5.0


def materialised_score_seconds(timing, scores: float, score_bytes: float) -> float:
    """Forward seconds of the softmax kernel over a materialised score matrix of ``scores``
    elements and ``score_bytes`` bytes (see the constants above); the GEMMs' score traffic is
    charged on the attention node itself."""
    if scores <= 0:
        return 0.0
    return timing.op_seconds(SOFTMAX_FLOPS_PER_SCORE * scores, SOFTMAX_PASSES * score_bytes, False)


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
    return elements, elements * _DTYPE_BYTES.get((d.get("out_dtypes") or ["bfloat16"])[0], 2)


def _block_facts(graph, block) -> _BlockFacts:
    """Classify a block's nodes: TP-sharded region, expert nodes, attention cores."""
    g = graph.graph
    members = set(block.nodes)
    pattern = graph.pattern_of(block) if block.kind == "block" else None
    weight_node = {g.nodes[n]["weight"]: n for n in block.nodes if g.nodes[n].get("weight")}

    def node_for(rel: str) -> Optional[str]:
        full = block.fqn(rel)
        return weight_node.get(full + ".weight") or weight_node.get(full)

    tp_nodes: set = set()
    sharded = {block.fqn(p.name) for pair in (pattern.tp_pairs if pattern else []) if not pair.problem
               for p in pair.params} | {block.fqn(t) + ".weight" for pair in (pattern.tp_pairs if pattern else [])
                                        if not pair.problem for t in pair.head_tables}
    column_nodes: set = set()
    expert_nodes: set = set()
    expert_paths = getattr(graph, "expert_modules", None)
    rows: List[Tuple[str, str]] = []
    for pair in (pattern.tp_pairs if pattern else []):
        if pair.problem:  # the runtime refuses to shard it (ParallelSupport.tp_problem)
            continue
        cols = [c for c in (node_for(x) for x in pair.column) if c]
        row = node_for(pair.row)
        if not cols or not row:
            continue
        down = set().union(*(nx.descendants(g, c) for c in cols)) & members
        up = nx.ancestors(g, row) & members
        region = (down & up) | set(cols) | {row}
        tp_nodes |= region
        column_nodes |= set(cols)
        if pair.kind == "expert":  # the experts' nodes of it (a shared expert is dense: Qwen2-MoE)
            expert_nodes |= {n for n in region if _in_experts(g.nodes[n].get("module", ""), expert_paths)}
        rows.append((pair.kind, row))
    vocab_nodes = _vocab_parallel_nodes(graph, block)
    tp_nodes |= set(vocab_nodes)
    column_nodes |= {n for n, kind in vocab_nodes.items() if kind == "colwise"}
    for n in block.nodes:
        if _in_experts(g.nodes[n].get("module", ""), expert_paths):
            expert_nodes.add(n)

    nodes = []
    for n in block.nodes:
        d = g.nodes[n]
        in_b = _bytes_of(d.get("in_shapes"), d.get("in_dtypes"))
        out_b = d.get("out_bytes", 0.0)
        attention = d.get("op") in _ATTENTION
        saved_flash = d.get("saved_bytes", 0.0)
        if attention and d.get("out_shapes"):
            shape = d["out_shapes"][0]
            lse = out_b / max(shape[-1], 1) * 4 / max(_DTYPE_BYTES.get(d["out_dtypes"][0], 2), 1)
            saved_flash = min(saved_flash, in_b + out_b + lse)
        scores, score_bytes = _scores(d) if attention else (0.0, 0.0)
        tp_numel = d.get("num_params", 0) if n in vocab_nodes else \
            sum(k for name, k in zip(d.get("params", []), d.get("param_numels", [])) if name in sharded)
        bytes_per = d.get("param_bytes", 0.0) / max(d.get("num_params", 0), 1)
        nodes.append(_NodeCost(
            flops=d.get("flops", 0.0), bytes_moved=in_b + out_b + d.get("param_bytes", 0.0),
            matmul=bool(d.get("weight")) or d.get("op") in MATMUL_OPS or attention,
            saved=d.get("saved_bytes", 0.0), saved_flash=saved_flash, attention=attention,
            tp=n in tp_nodes, column=n in column_nodes, expert=n in expert_nodes,
            params=float(d.get("num_params", 0)), param_bytes=d.get("param_bytes", 0.0),
            scores=scores, score_bytes=score_bytes, tp_params=float(tp_numel), tp_param_bytes=tp_numel * bytes_per))
    in_bytes = sum(g.nodes[p].get("out_bytes", 0.0) for p in
                   {p for n in block.nodes for p in g.predecessors(n) if p not in members})
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
            vocab_comms += [("all_reduce", _bytes_of(d.get("in_shapes"), d.get("in_dtypes")), "bwd"),
                            ("all_gather", d.get("out_bytes", 0.0), "fwd")]
    loss = _loss_facts(g, block)
    if block.kind in ("head", "tail"):
        n_ar = 0
    return _BlockFacts(nodes=nodes, out_bytes=block.out_bytes, in_bytes=in_bytes, tp_allreduces=n_ar,
                       row_bytes=row_bytes, a2a_bytes=a2a, vocab_comms=tuple(vocab_comms),
                       loss_saved=loss[0], loss_flops=loss[1], loss_bytes_moved=loss[2],
                       recomputed=block.kind == "block")


def _in_experts(module: str, expert_modules: Optional[List[str]]) -> bool:
    """Whether a node of ``module`` computes with expert weights (sharded by expert parallelism):
    under one of the traced model's expert modules; for a graph that did not record them, any module
    path naming an expert. A shared expert (Qwen2-MoE ``shared_expert``) is dense and replicated."""
    if expert_modules is None:
        return "expert" in module
    return any(module == p or module.startswith(p + ".") for p in expert_modules)


def _vocab_parallel_nodes(graph, block) -> Dict[str, str]:
    """{node: "rowwise" | "colwise"} that vocabulary parallelism shards in a head or tail block,
    as the runtime does (``nest_fx.apply.tensor_parallel.vocab_parallel_modules``): the head's
    embedding lookups and the tail's output linears. A tied LM head (the tracer counts its
    shared weight once, under the embedding) stays replicated with the largest embedding."""
    g = graph.graph
    if block.kind == "head":
        found = {n: "rowwise" for n in block.nodes if vocab_parallel_lookup(g.nodes[n])}
        tail = next((b for b in graph.blocks if b.kind == "tail"), None)
        tied = tail is not None and any(g.nodes[n].get("op") == "linear" and g.nodes[n].get("weight")
                                        and not g.nodes[n].get("num_params") for n in tail.nodes)
        if tied and found:
            found.pop(max(found, key=lambda n: g.nodes[n].get("num_params", 0)))
        return found
    if block.kind == "tail":
        return {n: "colwise" for n in block.nodes if g.nodes[n].get("op") == "linear"
                and g.nodes[n].get("weight") and g.nodes[n].get("num_params")}
    return {}


LOSS_STATE_BYTES = 4  # the loss runs in fp32 (logits upcast), as usual for language-model training
# its backward holds two fp32 logit-sized gradients at once: of the log-probabilities and of the logits
LOSS_BACKWARD_COPIES = 2


def _loss_facts(g, block) -> Tuple[float, float, float]:
    """(saved bytes, FLOPs, bytes moved) of a token-level cross-entropy on the model's output,
    assumed for every model whose tail ends in a linear (an LM head): the fp32 log-softmax
    it keeps for backward, about 5 FLOPs per logit, and the logits read once, upcast and written
    as log-probabilities. The loss is the user's code, not in the trace; (0, 0, 0) otherwise."""
    if block.kind != "tail":
        return 0.0, 0.0, 0.0
    heads = [n for n in block.nodes if g.nodes[n].get("op") == "linear" and g.nodes[n].get("weight")]
    if not heads:
        return 0.0, 0.0, 0.0
    d = g.nodes[heads[-1]]
    shapes, dtypes = d.get("out_shapes") or [], d.get("out_dtypes") or []
    if not shapes:
        return 0.0, 0.0, 0.0
    numel = 1
    for k in shapes[0]:
        numel *= k
    logits = numel * _DTYPE_BYTES.get(dtypes[0] if dtypes else "float32", 4)
    return numel * LOSS_STATE_BYTES, 5.0 * numel, logits + 2 * numel * LOSS_STATE_BYTES


def workload_from_graph(graph, timing, dims: ModelDims, *, attention: str = "flash",
                        provenance: str = "analytical", source: Optional[TracedSource] = None) -> Workload:
    """Workload over an OpGraph's blocks (head, layers, tail; empty head/tail dropped); its costs
    come from ``source`` (default: a TracedSource with ``timing``)."""
    batch = graph.input_shapes[0][0] if graph.input_shapes and graph.input_shapes[0] else 1
    layers = []
    for b in graph.blocks:
        if not b.nodes or (b.kind != "block" and b.flops == 0 and b.num_params == 0 and b.saved_bytes == 0):
            continue
        layers.append(Layer(name=b.name, kind=b.kind, signature=b.signature, num_params=float(b.num_params),
                            flops_per_sample=b.flops / batch, is_moe=b.is_moe))
    return Workload(graph.model_name, layers, dims, source or TracedSource(graph, timing, attention=attention),
                    provenance=provenance)
