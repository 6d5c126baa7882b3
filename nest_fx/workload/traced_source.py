"""Layer costs derived from a traced OpGraph and a per-op timing model (``TracedSource``).

Every variant (tensor-parallel degree, expert-parallel degree, microbatch size, sequence
parallelism, context-parallel degree, loss parallelism) is derived from the traced nodes: how TP
and EP shard each node follows from the TP pairs the tracer found, the vocabulary-parallel head
and tail from the embeddings and output linears, what context parallelism splits from the
attention calls (``docs/cost_model.md``). Each recompute policy is costed from the aten ops the
tracer recorded (``recompute_costs``); ``for_runtime`` derives the costs under torch.compile and
Float8 linears (``runtime_costs``). ``workload_from_graph`` turns a graph into the
:class:`Workload` chain.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from dataclasses import replace as dataclass_replace
from typing import Dict, List, Optional, Tuple

import networkx as nx
import torch

from nest_fx.graph.annotate import ATTENTION_CALLS, LSE_BYTES, MATMUL_OPS
from nest_fx.graph.context_sites import attention_sites, blocks_without_attention
from nest_fx.graph.recompute_policies import LAYER_POLICIES
from nest_fx.graph.tp_regions import vocab_parallel_lookup
from nest_fx.workload.attention_share import attention_window, window_share
from nest_fx.workload.recompute_costs import OP_LEVEL_POLICIES, block_policy_costs
from nest_fx.workload.runtime_costs import RuntimeCosts, fusion_regions
from nest_fx.workload.types import Comm, Layer, LayerCost, ModelDims, Workload

_DTYPE_BYTES = {name: torch.empty((), dtype=getattr(torch, name)).element_size()
                for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")}


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
    causal: bool = False  # attention: a causal call (is_causal=True)
    seq: int = 0  # attention: key length
    q_bytes: float = 0.0  # attention: bytes of the query (the rest of its inputs are keys and values)
    kv_bytes: float = 0.0  # attention: bytes of keys and values
    window: int = 0  # attention: causal sliding window (0: none; workload.attention_share)
    kept: Dict[str, float] = field(default_factory=dict)  # op-level policy -> bytes kept (recompute_costs)
    recomputed: Dict[str, float] = field(default_factory=dict)  # op-level policy -> share of the forward re-run
    linear_dims: Tuple[int, int, int] = (0, 0, 0)  # a linear with a weight: (rows, in, out features)
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
    loss_tokens: float = 0.0  # rows of the logits (tokens) the loss runs over
    recomputed: bool = True  # activation checkpointing wraps blocks only, never the head or tail
    tied_params: float = 0.0  # the tail's LM head weight when it is the embedding's (counted once, in the head)
    regions: List[Tuple[List[int], List[Tuple[int, float]]]] = field(default_factory=list)  # runtime_costs.fusion_regions


class TracedSource:
    """Layer costs derived from an OpGraph and a per-op timing model.

    ``timing`` has ``op_seconds(flops, bytes, matmul)`` and ``backward_factor`` (the
    analytical model in ``nest_fx.workload.roofline``; a measured profile later). ``attention``:
    "flash" keeps O(s) bytes for fused attention (q, k, v, out, log-sum-exp) as flash
    attention does on GPUs, and a causal call computes the lower triangle only; "traced" keeps
    what the traced kernel saved and computes every score (the math path).
    ``runtime``: torch.compile / Float8 costs (``runtime_costs.RuntimeCosts``; off by default).
    """

    def __init__(self, graph, timing, *, attention: str = "flash", runtime: Optional[RuntimeCosts] = None):
        if attention not in ("flash", "traced"):
            raise ValueError(f"attention={attention!r}: use 'flash' or 'traced'")
        self.graph = graph
        self.timing = timing
        self.attention = attention
        self.runtime = runtime or RuntimeCosts()
        self.batch = graph.input_shapes[0][0] if graph.input_shapes and graph.input_shapes[0] else 1
        self.byte_scale = 1.0  # activation bytes relative to the trace's (for_runtime with another dtype)
        self._facts: Dict[int, _BlockFacts] = {}
        self._traced: Dict[int, _BlockFacts] = self._facts  # the facts at the trace's dtype

    def facts(self, block_index: int) -> _BlockFacts:
        if block_index not in self._facts:
            if block_index not in self._traced:
                self._traced[block_index] = _block_facts(self.graph, self.graph.blocks[block_index])
            facts = self._traced[block_index]
            self._facts[block_index] = facts if self.byte_scale == 1.0 else _scaled_facts(facts, self.byte_scale)
        return self._facts[block_index]

    def for_runtime(self, *, compile: bool = False, float8: bool = False, timing=None,
                    byte_scale: float = 1.0) -> "TracedSource":
        """This source with torch.compile and/or Float8 linears costed (``runtime_costs``) and,
        given ``timing`` and ``byte_scale``, in another dtype: the op times of ``timing`` (the
        device's rate for that dtype) on activations ``byte_scale`` times the traced bytes
        (``Workload.for_runtime``). The traced facts are shared."""
        derived = copy.copy(self)
        derived.runtime = RuntimeCosts(compile=compile, float8=float8)
        if timing is not None:
            derived.timing = timing
        derived.byte_scale = byte_scale
        derived._facts = self._facts if byte_scale == self.byte_scale else {}
        return derived

    def cp_problem(self, cp: int) -> str:
        """'' when the trace can be split over ``cp`` context-parallel ranks as the runtime splits
        it (every layer mixes tokens through causal SDPA calls only), else why not. The runtime's
        own verdict on a model (``plan.support.ParallelSupport.cp_problem``) checks more (position
        readers, masks, MoE capacity); this is what the cost model needs to cost it."""
        missing = blocks_without_attention(self.graph)
        if missing:
            return f"cp={cp}: layer {missing[0]} has no scaled_dot_product_attention call for context parallelism to split"
        site = next((s for s in attention_sites(self.graph) if not s.causal), None)
        if site is not None:
            return f"cp={cp}: {site.module} computes non-causal attention; context parallelism runs causal attention only"
        return ""

    def loss_parallel_problem(self) -> str:
        """'' when the tail's output linear can keep its logits sharded by vocabulary (an untied LM
        head), else why not (the runtime's verdict is ``ParallelSupport.loss_parallel_problem``)."""
        tail = next((b for b in self.graph.blocks if b.kind == "tail"), None)
        if tail is None or not _vocab_parallel_nodes(self.graph, tail):
            return "loss_parallel: the model's tail has no untied output linear whose logits could stay sharded"
        return ""

    def cost(self, layer: Layer, tp: int, ep: int, mbs: int, sp: bool, cp: int = 1, lp: bool = False) -> LayerCost:
        block = next(b for b in self.graph.blocks if b.signature == layer.signature and b.kind == layer.kind)
        facts = self.facts(block.index)
        scale = mbs / self.batch
        tokens = scale / cp  # a context-parallel rank holds 1/cp of every sequence
        sp = sp and block.kind == "block"  # the head and the tail see full sequences
        lp = lp and tp > 1 and block.kind == "tail"
        times = self.variant_times(block, tp, mbs, sp, cp)
        fwd = sum(t for t, _ in times)
        bwd = sum(tb for _, tb in times)
        act = dict.fromkeys(LAYER_POLICIES, 0.0)
        rec = dict.fromkeys(LAYER_POLICIES, 0.0)
        params = param_bytes = expert_params = fp8_params = 0.0
        for n, (t, _) in zip(facts.nodes, times):
            flash = n.saved_flash if n.attention else n.saved
            keep = tp if (sp or (n.tp and not n.column)) else 1
            none = (flash if self.attention == "flash" else n.saved) * tokens / keep
            if n.attention and cp > 1:  # the gathered keys and values are whole sequences
                none += n.kv_bytes * scale / keep * (1 - 1 / cp)
            act["none"] += none
            shard = tp if (n.tp or sp) else 1  # a created tensor is a shard in a TP region or under SP
            for policy in OP_LEVEL_POLICIES:
                act[policy] += n.kept.get(policy, 0.0) * tokens / shard
                rec[policy] += t * n.recomputed.get(policy, 0.0)
            epdiv = ep if n.expert else 1
            node_params = (n.params - n.tp_params + n.tp_params / tp) / epdiv
            params += node_params
            param_bytes += (n.param_bytes - n.tp_param_bytes + n.tp_param_bytes / tp) / epdiv
            if n.expert:
                expert_params += node_params
            if self.runtime.float8_node(block.kind, n):
                fp8_params += node_params
        act["full"] = facts.in_bytes * tokens / (tp if sp else 1)
        rec["full"] = fwd
        loss_share = tokens / (tp if lp else 1)  # loss parallel: each rank's vocabulary shard
        if facts.loss_saved:
            loss_t = self.timing.op_seconds(facts.loss_flops * loss_share, facts.loss_bytes_moved * loss_share, False)
            fwd += loss_t
            bwd += loss_t * self.timing.backward_factor
            act["none"] += facts.loss_saved * loss_share
        comms = self._comms(facts, tp, ep, scale, cp, sp, lp)
        if not facts.recomputed:  # the head and the tail are never checkpointed
            act = dict.fromkeys(LAYER_POLICIES, act["none"])
            rec = dict.fromkeys(LAYER_POLICIES, 0.0)
        act = {k: min(v, act["none"]) if k == "full" else v for k, v in act.items()}
        return LayerCost(
            fwd_s=fwd, bwd_s=bwd, num_params=params, param_bytes=param_bytes, act_bytes=act, recompute_s=rec,
            out_bytes=facts.out_bytes * scale, comms=comms, expert_params=expert_params,
            bwd_scratch=LOSS_BACKWARD_COPIES * facts.loss_saved * loss_share, fp8_params=fp8_params,
            tied_params=facts.tied_params)

    def _comms(self, facts: _BlockFacts, tp: int, ep: int, scale: float, cp: int, sp: bool, lp: bool) -> List[Comm]:
        """The layer's collectives per microbatch (docs/cost_model.md): TP (all-reduce, or
        all-gather + reduce-scatter under SP) after each row linear, the vocabulary-parallel
        head/tail's, EP's all-to-alls, CP's key/value all-gather (backward: reduce-scatter)."""
        tokens = scale / cp
        comms: List[Comm] = []
        if tp > 1 and facts.tp_allreduces:
            nbytes = facts.row_bytes * tokens
            if sp:
                for phase in facts.tp_phases:
                    comms += [Comm("all_gather", "tp", nbytes, phase, facts.tp_allreduces),
                              Comm("reduce_scatter", "tp", nbytes, phase, facts.tp_allreduces)]
            else:
                comms += [Comm("all_reduce", "tp", nbytes, phase, facts.tp_allreduces) for phase in facts.tp_phases]
        if tp > 1:
            for kind, nbytes, phase in facts.vocab_comms:
                if lp and kind == "all_gather":  # loss parallel: the logits stay sharded
                    continue
                comms.append(Comm(kind, "tp", nbytes * tokens, phase))
            if lp:  # the max, then the sum of exponentials and the target logit, over the vocabulary shards
                rows = facts.loss_tokens * tokens
                comms += [Comm("all_reduce", "tp", rows * LOSS_STATE_BYTES, "fwd"),
                          Comm("all_reduce", "tp", 2 * rows * LOSS_STATE_BYTES, "fwd")]
        if ep > 1 and facts.a2a_bytes:
            nbytes = facts.a2a_bytes * tokens / tp
            comms += [Comm("all_to_all", "ep", nbytes, phase, 2) for phase in ("fwd", "bwd")]
        if cp > 1:
            kv = [n.kv_bytes * scale / (tp if n.tp else 1) for n in facts.nodes if n.attention]
            for nbytes in sorted(set(kv)):
                count = kv.count(nbytes)
                comms += [Comm("all_gather", "cp", nbytes, "fwd", count),
                          Comm("reduce_scatter", "cp", nbytes, "bwd", count)]
        return comms

    def variant_times(self, block, tp: int, mbs: int, sp: bool, cp: int = 1) -> List[Tuple[float, float]]:
        """(forward, backward) seconds of each node for a variant: :meth:`node_times` (the
        analytical model, or measurements in a subclass) at ``cp = 1``, scaled to a context-parallel
        rank's share by the analytical model's own ratio, then under torch.compile / Float8
        (``runtime_costs``)."""
        times = self.node_times(block, tp, mbs, sp)
        nodes = self.facts(block.index).nodes
        if cp > 1:
            base = self._analytical(block, tp, mbs, sp, 1)
            split = self._analytical(block, tp, mbs, sp, cp)
            times = [(f * _ratio(b, c), tb * _ratio(b, c)) for (f, tb), b, c in zip(times, base, split)]
        return self.runtime.apply(self, block, nodes, times, tp, mbs, sp, cp)

    def node_times(self, block, tp: int, mbs: int, sp: bool) -> List[Tuple[float, float]]:
        """(forward, backward) seconds of each node of ``block`` on one device for a variant:
        the analytical model on the node's FLOPs and bytes, divided by the TP degree where TP
        (or sequence parallelism) shards the node, and backward = ``backward_factor`` x forward
        (a fused attention kernel: ``attention_backward_factor``, 2.5).
        A causal flash attention computes the lower triangle of its scores; with
        ``attention="traced"`` an attention core also pays its materialised scores
        (:func:`materialised_score_seconds`)."""
        fused = self.attention == "flash"
        backward = self.timing.backward_factor
        attention = getattr(self.timing, "attention_backward_factor", backward) if fused else backward
        return [(t, t * (attention if n.attention else backward))
                for t, n in zip(self._analytical(block, tp, mbs, sp, 1), self.facts(block.index).nodes)]

    def node_shares(self, block, tp: int, mbs: int, sp: bool, cp: int) -> List[float]:
        """Per node, the share of its traced FLOPs and activation bytes one rank runs in a variant
        (microbatch over the traced batch, over TP where it shards the node, over CP)."""
        scale = mbs / self.batch
        sp = sp and block.kind == "block"
        return [scale / (tp if (n.tp or sp) else 1) / cp for n in self.facts(block.index).nodes]

    def _analytical(self, block, tp: int, mbs: int, sp: bool, cp: int) -> List[float]:
        """Forward seconds of each node by the analytical model, on a context-parallel rank's
        tokens (``docs/cost_model.md``: attention under context parallelism)."""
        scale = mbs / self.batch
        out = []
        sp = sp and block.kind == "block"  # the head and the tail see full sequences
        for n in self.facts(block.index).nodes:
            shard = tp if n.tp else (tp if sp else 1)
            share = scale / shard
            if not n.attention:
                out.append(self.timing.op_seconds(n.flops * share / cp, n.bytes_moved * share / cp, n.matmul))
                continue
            work = attention_work(n.seq, cp, n.causal and (self.attention == "flash" or cp > 1))
            if n.window and self.attention == "flash":  # the band of a windowed kernel (CP refuses windows)
                work = window_share(n.seq, n.window)
            nbytes = (n.bytes_moved - n.kv_bytes) / cp + n.kv_bytes
            extra = n.score_bytes * SCORE_GEMM_PASSES * work if self.attention == "traced" else 0.0
            t = self.timing.op_seconds(n.flops * share * work, (nbytes + extra) * share, n.matmul,
                                       attention=self.attention == "flash")
            if extra:
                t += materialised_score_seconds(self.timing, n.scores * share * work, n.score_bytes * share * work)
            out.append(t)
        return out


def _ratio(base: float, scaled: float) -> float:
    return scaled / base if base > 0 else 0.0


def attention_work(seq: int, cp: int, causal: bool) -> float:
    """Share of the full ``seq x seq`` score matrix one rank's attention kernel computes.

    Without context parallelism: all of it for non-causal attention (or the math path), the
    lower triangle with its diagonal, ``(s + 1) / 2s``, for a causal fused kernel (flash skips
    the masked tiles). Under ``cp`` ranks, as the runtime runs it (``apply.context_parallel``:
    chunks ``i`` and ``2 cp - 1 - i`` of ``2 cp``, each attending under an explicit causal mask
    to the keys up to its end): ``(2 cp + 1) c^2`` scores per rank with ``c = s / 2 cp``, i.e.
    ``(2 cp + 1) / (4 cp^2)`` of the matrix (the masked kernel computes its diagonal chunks
    whole)."""
    if cp > 1:
        return (2 * cp + 1) / (4 * cp * cp)
    if causal and seq > 0:
        return (seq + 1) / (2 * seq)
    return 1.0


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

    if block.kind == "block":
        kept, recomputed = block_policy_costs(g, block.nodes)
    else:  # never checkpointed
        kept = recomputed = [{} for _ in block.nodes]
    nodes = []
    for k, n in enumerate(block.nodes):
        d = g.nodes[n]
        in_b = _bytes_of(d.get("in_shapes"), d.get("in_dtypes"))
        out_b = d.get("out_bytes", 0.0)
        attention = d.get("op") in ATTENTION_CALLS
        saved_flash = d.get("saved_bytes", 0.0)
        q_bytes = kv_bytes = 0.0
        seq = window = 0
        if attention and d.get("out_shapes"):
            shape = d["out_shapes"][0]
            lse = out_b / max(shape[-1], 1) * LSE_BYTES / max(_DTYPE_BYTES.get(d["out_dtypes"][0], 2), 1)
            q_bytes = _bytes_of(d["in_shapes"][:1], d["in_dtypes"][:1])
            kv_bytes = _bytes_of(d["in_shapes"][1:3], d["in_dtypes"][1:3])
            window = attention_window(g, n)
            if window:  # a windowed fused kernel reads and keeps no mask
                in_b = q_bytes + kv_bytes
            saved_flash = min(saved_flash, in_b + out_b + lse)
            seq = d["in_shapes"][1][-2] if len(d["in_shapes"]) > 1 and len(d["in_shapes"][1]) >= 2 else 0
        scores, score_bytes = _scores(d) if attention else (0.0, 0.0)
        tp_numel = d.get("num_params", 0) if n in vocab_nodes else \
            sum(numel for name, numel in zip(d.get("params", []), d.get("param_numels", [])) if name in sharded)
        bytes_per = d.get("param_bytes", 0.0) / max(d.get("num_params", 0), 1)
        nodes.append(_NodeCost(
            flops=d.get("flops", 0.0), bytes_moved=in_b + out_b + d.get("param_bytes", 0.0),
            matmul=bool(d.get("weight")) or d.get("op") in MATMUL_OPS or attention,
            saved=d.get("saved_bytes", 0.0), saved_flash=saved_flash, attention=attention,
            tp=n in tp_nodes, column=n in column_nodes, expert=n in expert_nodes,
            params=float(d.get("num_params", 0)), param_bytes=d.get("param_bytes", 0.0),
            scores=scores, score_bytes=score_bytes, causal=attention and "is_causal=True" in d.get("consts", ""),
            seq=seq, q_bytes=q_bytes, kv_bytes=kv_bytes, window=window, kept=kept[k], recomputed=recomputed[k],
            linear_dims=_linear_dims(d), tp_params=float(tp_numel), tp_param_bytes=tp_numel * bytes_per))
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
    tied = sum(_tied_weight_params(g, n) for n in block.nodes) if block.kind == "tail" else 0.0
    fusible = [not (n.matmul or n.attention) and (n.flops > 0 or n.bytes_moved > 0)
               and g.nodes[name].get("fx_op") not in ("placeholder", "output") for n, name in zip(nodes, block.nodes)]
    return _BlockFacts(nodes=nodes, out_bytes=block.out_bytes, in_bytes=in_bytes, tp_allreduces=n_ar,
                       row_bytes=row_bytes, a2a_bytes=a2a, vocab_comms=tuple(vocab_comms),
                       loss_saved=loss[0], loss_flops=loss[1], loss_bytes_moved=loss[2], loss_tokens=loss[3],
                       recomputed=block.kind == "block", tied_params=tied,
                       regions=fusion_regions(g, block.nodes, fusible) if block.kind == "block" else [])


def _scaled_facts(facts: _BlockFacts, k: float) -> _BlockFacts:
    """``facts`` with every activation, weight and message byte count times ``k`` (a trace
    re-costed in a dtype ``k`` times as wide). The loss's figures stay: it computes in fp32
    whatever the model's dtype (``_loss_facts``)."""
    nodes = [dataclass_replace(n, bytes_moved=n.bytes_moved * k, saved=n.saved * k, saved_flash=n.saved_flash * k,
                               param_bytes=n.param_bytes * k, score_bytes=n.score_bytes * k, q_bytes=n.q_bytes * k,
                               kv_bytes=n.kv_bytes * k, tp_param_bytes=n.tp_param_bytes * k,
                               kept={p: b * k for p, b in n.kept.items()}) for n in facts.nodes]
    return dataclass_replace(facts, nodes=nodes, out_bytes=facts.out_bytes * k, in_bytes=facts.in_bytes * k,
                             row_bytes=facts.row_bytes * k, a2a_bytes=facts.a2a_bytes * k,
                             vocab_comms=tuple((kind, b * k, phase) for kind, b, phase in facts.vocab_comms),
                             regions=[(members, [(j, b * k) for j, b in boundary]) for members, boundary in facts.regions])


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
    shared weight once, at its first use: a tied LM head's linear records a weight but no
    parameters of its own)."""
    d = g.nodes[node]
    if d.get("op") != "linear" or not d.get("weight") or d.get("num_params"):
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
    logits = numel * _DTYPE_BYTES.get(dtypes[0] if dtypes else "float32", 4)
    rows = numel / max(shapes[0][-1], 1)
    return numel * LOSS_STATE_BYTES, 5.0 * numel, logits + 2 * numel * LOSS_STATE_BYTES, rows


def workload_from_graph(graph, timing, dims: ModelDims, *, attention: str = "flash",
                        provenance: str = "analytical", source: Optional[TracedSource] = None) -> Workload:
    """Workload over an OpGraph's blocks (head, layers, tail), one layer per block, so a plan's
    layer ranges index the same chain the runtime cuts (a head or tail that computes nothing is
    kept as a layer of no cost: the planner's plan for a model whose forward starts with its layer
    list was refused by the runtime's count); its costs come from ``source`` (default: a
    TracedSource with ``timing``)."""
    batch = graph.input_shapes[0][0] if graph.input_shapes and graph.input_shapes[0] else 1
    layers = []
    for b in graph.blocks:
        if not b.nodes:
            continue
        layers.append(Layer(name=b.name, kind=b.kind, signature=b.signature, num_params=float(b.num_params),
                            flops_per_sample=b.flops / batch, is_moe=b.is_moe))
    return Workload(graph.model_name, layers, dims, source or TracedSource(graph, timing, attention=attention),
                    provenance=provenance)
