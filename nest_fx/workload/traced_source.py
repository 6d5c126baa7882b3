"""Layer costs derived from a traced OpGraph and a per-op timing model (``TracedSource``).

Every variant (tensor-parallel degree, expert-parallel degree, microbatch size, sequence
parallelism, context-parallel degree, loss parallelism) is derived from the traced nodes (``block_facts``): how TP
and EP shard each node follows from the TP pairs the tracer found, the vocabulary-parallel head
and tail from the embeddings and output linears, what context parallelism splits from the
attention calls (``docs/cost_model.md``). Each recompute policy is costed from the aten ops the
tracer recorded (``recompute_costs``); ``for_runtime`` derives the costs under torch.compile and
Float8 linears (``runtime_costs``). ``workload_from_graph`` turns a graph into the
:class:`Workload` chain.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence, Tuple

from nest_fx.graph.context_sites import attention_sites, blocks_without_attention
from nest_fx.graph.recompute_policies import LAYER_POLICIES
from nest_fx.workload.attention_share import (
    SCORE_GEMM_PASSES,
    attention_length_share,
    attention_work,
    fused_call_keys,
    materialised_score_seconds,
    window_share,
)
from nest_fx.workload.block_facts import LOSS_STATE_BYTES, BlockFacts, block_facts, scaled_facts
from nest_fx.workload.block_collectives import vocab_parallel_nodes
from nest_fx.workload.expert_dispatch import dispatch_bytes
from nest_fx.workload.expert_gemms import ep_shaped_times, has_expert_matmuls
from nest_fx.workload.fp8_kept import fp8_input_shares
from nest_fx.workload.fused_norms import NormGroup, fused_groups, fused_nodes, fused_times, norm_kernel_problem
from nest_fx.workload.recompute_costs import OP_LEVEL_POLICIES
from nest_fx.workload.kernels import kernel_backend
from nest_fx.workload.loss_terms import loss_terms
from nest_fx.workload.routed_weighting import routed_weighting_bytes
from nest_fx.workload.runtime_costs import RuntimeCosts
from nest_fx.workload.tp_collective_counts import expert_tp_collectives, tp_region_collectives
from nest_fx.workload.types import Comm, Layer, LayerCost, ModelDims, Workload, WorkloadError


class TracedSource:
    """Layer costs derived from an OpGraph and a per-op timing model.

    ``timing`` has ``op_seconds(flops, bytes, matmul)``, ``backward_factor`` and
    ``attention_half_tokens`` (the analytical model in ``nest_fx.workload.roofline``). ``attention``:
    "flash" keeps O(s) bytes for fused attention (q, k, v, out, log-sum-exp) as flash
    attention does on GPUs, and a causal call computes the lower triangle only; "traced" keeps
    what the traced kernel saved and computes every score (the math path).
    ``runtime``: the kernel backend and Float8 (``runtime_costs.RuntimeCosts``; eager, no Float8
    by default).
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
        self.ring_split = False  # attention under CP as ring attention's chunked calls (for_runtime cp_mode=ring)
        self.num_experts = 0  # experts per MoE layer (the model's dims; workload_from_graph sets it)
        self._facts: Dict[int, BlockFacts] = {}
        self._traced: Dict[int, BlockFacts] = self._facts  # the facts at the trace's dtype
        self._cp_reason: Optional[str] = None  # cp_problem's verdict without the degree, once known
        self._node_seconds: Dict[tuple, List[float]] = {}  # _analytical's, per (block, tp, mbs, sp, cp)
        self._kept: Dict[tuple, tuple] = {}  # _kept_bytes', per (block, tp, mbs, sp, cp, ep shape)
        self._reset_memos()

    def _reset_memos(self) -> None:
        """:meth:`cost`'s memos of one timing model and runtime (the solver asks hundreds of variants)."""
        self._times: Dict[tuple, tuple] = {}  # (variant_times, their sums) per (block, tp, mbs, sp, cp)
        self._params: Dict[tuple, tuple] = {}  # RuntimeCosts.param_counts per (block, tp, ep)
        self._blocks: Dict[tuple, object] = {}  # the graph's block per (signature, kind)
        self._fused: Dict[tuple, list] = {}  # fused_nodes per (block, tp, sp)
        self._ep_shaped: Dict[int, bool] = {}  # has_expert_matmuls per block
        self._backend_inputs: Dict[int, tuple] = {}  # _backend_kept per block

    def facts(self, block_index: int) -> BlockFacts:
        if block_index not in self._facts:
            if block_index not in self._traced:
                self._traced[block_index] = block_facts(self.graph, self.graph.blocks[block_index])
            facts = self._traced[block_index]
            self._facts[block_index] = facts if self.byte_scale == 1.0 else scaled_facts(facts, self.byte_scale)
        return self._facts[block_index]

    def for_runtime(
        self,
        *,
        compile: bool = False,
        float8: bool = False,
        timing=None,
        byte_scale: float = 1.0,
        kernels: str = "",
        attention_kernel: str = "",
        norm_kernel: str = "",
        loss_kernel: str = "",
        cp_mode: str = "",
    ) -> "TracedSource":
        """This source with a kernel backend (``kernels``: eager, compile, fused; '' = compile
        when ``compile``, else eager: ``nest_fx.workload.kernels``) and/or Float8 linears costed
        (``runtime_costs``) and, given ``timing`` and ``byte_scale``, in another dtype: the op
        times of ``timing`` (the device's rate for that dtype) on activations ``byte_scale``
        times the traced bytes (``Workload.for_runtime``); fused attention at the measured rate of
        ``attention_kernel`` (``roofline.SDPA_ATTENTION``); the model's RMSNorms as ``F.rms_norm``
        unless ``norm_kernel`` is ``model``, keeping their output with ``memory-efficient``
        (``fused_norms``; WorkloadError with compile), the loss on full logits torch.compile'd with
        ``loss_kernel=compile`` and the vocabulary-parallel loss's backward op by op with
        ``loss_kernel=eager`` (``loss_terms``); under context parallelism with ``cp_mode=ring`` the
        attention at the rate its chunked calls reach (``attention_share.fused_call_keys``). The
        traced facts are shared."""
        derived = copy.copy(self)
        backend = kernel_backend(kernels, compile)
        if problem := norm_kernel_problem(norm_kernel, backend.name):
            raise WorkloadError(problem)
        derived.runtime = RuntimeCosts(
            backend,
            float8,
            norm_kernel != "model",
            norm_kernel == "memory-efficient",
            loss_kernel == "compile",
            loss_kernel != "eager",
        )
        base = timing if timing is not None else getattr(self, "_plain_timing", self.timing)
        derived._plain_timing = base
        with_kernels = getattr(base, "with_kernels", None)
        derived.timing = with_kernels(backend.hopper_attention, attention_kernel) if with_kernels else base
        derived.byte_scale = byte_scale
        derived.ring_split = cp_mode == "ring"
        derived._node_seconds = {}  # another timing model or byte scale
        derived._kept = {}
        derived._reset_memos()
        derived._facts = self._facts if byte_scale == self.byte_scale else {}
        return derived

    def cp_problem(self, cp: int) -> str:
        """'' when the trace can be split over ``cp`` context-parallel ranks as the runtime splits
        it (every layer mixes tokens through causal SDPA calls only), else why not. The runtime's
        own verdict on a model (``plan.support.ParallelSupport.cp_problem``) checks more (position
        readers, masks, MoE capacity); this is what the cost model needs to cost it."""
        if getattr(self, "_cp_reason", None) is None:  # the graph's verdict, the same for every degree
            missing = blocks_without_attention(self.graph)
            site = None if missing else next((s for s in attention_sites(self.graph) if not s.causal), None)
            if missing:
                self._cp_reason = (
                    f"layer {missing[0]} has no scaled_dot_product_attention call for context parallelism to split"
                )
            elif site is not None:
                self._cp_reason = (
                    f"{site.module} computes non-causal attention; context parallelism runs causal attention only"
                )
            else:
                self._cp_reason = ""
        return f"cp={cp}: {self._cp_reason}" if self._cp_reason else ""

    def loss_parallel_problem(self) -> str:
        """'' when the tail's output linear can keep its logits sharded by vocabulary (an untied LM
        head), else why not (the runtime's verdict is ``ParallelSupport.loss_parallel_problem``)."""
        tail = next((b for b in self.graph.blocks if b.kind == "tail"), None)
        if tail is None or not vocab_parallel_nodes(self.graph, tail):
            return "loss_parallel: the model's tail has no untied output linear whose logits could stay sharded"
        return ""

    def fused_norms(self, block, tp: int, sp: bool) -> List[NormGroup]:
        """The RMSNorms of ``block`` the runtime runs as one fused ``F.rms_norm`` in a variant
        (``fused_norms.fused_groups``), on a device with the fused kernel (memory-efficient norms:
        on every device, nest-fx's own autograd function)."""
        if not self.runtime.norm_keeps_output and not getattr(self.timing, "fused_rms_norm", True):
            return []
        facts = self.facts(block.index)
        sharded = tp > 1 and sp and block.kind == "block"
        return fused_groups(
            facts.norms, facts.nodes, model_norms_fused=self.runtime.model_norms_fused, sharded=sharded, tp=tp
        )

    def cost(self, layer: Layer, tp: int, ep: int, mbs: int, sp: bool, cp: int = 1, lp: bool = False) -> LayerCost:
        block = self._blocks.get((layer.signature, layer.kind))
        if block is None:
            block = self._blocks[(layer.signature, layer.kind)] = next(
                b for b in self.graph.blocks if b.signature == layer.signature and b.kind == layer.kind
            )
        facts = self.facts(block.index)
        scale = mbs / self.batch
        tokens = scale / cp  # a context-parallel rank holds 1/cp of every sequence
        sp = sp and block.kind == "block"  # the head and the tail see full sequences
        lp = lp and tp > 1 and block.kind == "tail"
        if block.index not in self._ep_shaped:
            self._ep_shaped[block.index] = has_expert_matmuls(facts.nodes)
        ep_shape = ep if self._ep_shaped[block.index] else 1  # the node times: per EP degree where experts are
        kept_key = (block.index, tp, mbs, sp, cp, ep_shape)  # ... and the kept bytes; the same for every lp
        hit = self._times.get(kept_key)
        if hit is None:  # (the node times, read only, and their forward and backward sums)
            times = self.variant_times(block, tp, mbs, sp, cp, ep_shape)
            hit = self._times[kept_key] = (times, sum(t for t, _ in times), sum(tb for _, tb in times))
        times, fwd, bwd = hit
        if kept_key not in self._kept:
            # the eager backend keeps what the fused op keeps; the others their region's min cut (fused_norms)
            nodes = facts.nodes if self.runtime.fuses else self._fused.get((block.index, tp, sp))
            if nodes is None:
                norms = self.fused_norms(block, tp, sp)
                nodes = self._fused[(block.index, tp, sp)] = fused_nodes(
                    facts.nodes, norms, self.runtime.norm_keeps_output
                )
            shares, routed = self._backend_kept(block, facts)
            self._kept[kept_key] = self._kept_bytes(facts, nodes, times, tp, sp, cp, scale, tokens, shares, routed)
        act, rec = (dict(d) for d in self._kept[kept_key])
        if (block.index, tp, ep) not in self._params:
            self._params[(block.index, tp, ep)] = self.runtime.param_counts(block.kind, facts.nodes, tp, ep)
        params, param_bytes, expert_params, fp8_params = self._params[(block.index, tp, ep)]
        act["full"] = facts.in_bytes * tokens / (tp if sp else 1)
        rec["full"] = fwd
        # loss parallel: each rank's vocabulary shard, the vocabulary-parallel loss as it is (never compiled)
        loss = loss_terms(
            facts,
            tokens / (tp if lp else 1),
            self.runtime.loss_compiled and not lp,
            self.byte_scale,
            in_place=(lp or self.runtime.backend.loss_in_place_always) and self.runtime.loss_in_place,
        )
        if loss.kept:
            loss_t = self.timing.op_seconds(loss.flops, loss.bytes_moved, False)
            fwd += loss_t
            bwd += loss_t * self.timing.backward_factor
            act["none"] += loss.kept
        comms = self._comms(facts, tp, ep, scale, cp, sp, lp)
        if not facts.recomputed:  # the head and the tail are never checkpointed
            act = dict.fromkeys(LAYER_POLICIES, act["none"])
            rec = dict.fromkeys(LAYER_POLICIES, 0.0)
        act = {k: min(v, act["none"]) if k == "full" else v for k, v in act.items()}
        return LayerCost(
            fwd_s=fwd,
            bwd_s=bwd,
            num_params=params,
            param_bytes=param_bytes,
            act_bytes=act,
            recompute_s=rec,
            out_bytes=facts.out_bytes * scale,
            comms=comms,
            expert_params=expert_params,
            bwd_scratch=loss.backward_scratch,
            fp8_params=fp8_params,
            tied_params=facts.tied_params,
        )

    def _backend_kept(self, block, facts: BlockFacts) -> tuple:
        """(``fp8_kept.fp8_input_shares``, ``routed_weighting_bytes`` at the run's width or None) of
        ``block`` under this runtime's backend: per block, the same for every variant."""
        if block.index not in self._backend_inputs:
            g = self.graph.graph
            shares = fp8_input_shares(g, block, facts.nodes, self.runtime, self.byte_scale, self.num_experts)
            routed = None
            if self.runtime.backend.expert_probs_in_activation:
                routed = [b * self.byte_scale for b in routed_weighting_bytes(g, block.nodes, block.is_moe)]
            self._backend_inputs[block.index] = (shares, routed)
        return self._backend_inputs[block.index]

    def _kept_bytes(
        self,
        facts: BlockFacts,
        nodes,
        times,
        tp: int,
        sp: bool,
        cp: int,
        scale: float,
        tokens: float,
        fp8_shares: Optional[Sequence[Optional[float]]] = None,
        routed: Optional[Sequence[float]] = None,
    ) -> Tuple[Dict[str, float], Dict[str, float]]:
        """(activation bytes kept, recompute seconds) per policy of :meth:`cost`'s ``nodes`` (the
        block's, with the fused norms the variant runs), before the full-recompute and loss terms:
        they do not depend on the EP degree or loss parallelism, so :meth:`cost` asks them once
        per (block, tp, mbs, sp, cp) of this runtime. ``fp8_shares``: per node, the share of its
        saved bytes a quantized input keeps (``fp8_kept.fp8_input_shares``); ``routed``: per node, the
        expert outputs a router-weighting multiply keeps that the backend's experts do not
        (``routed_weighting``)."""
        act = dict.fromkeys(LAYER_POLICIES, 0.0)
        rec = dict.fromkeys(LAYER_POLICIES, 0.0)
        keeps = [tp if (sp or (n.tp and not n.column)) else 1 for n in nodes]
        shares = fp8_shares or [None] * len(nodes)
        for n, (t, _), keep, share in zip(nodes, times, keeps, shares):
            f = 1.0 if share is None else share
            saved = n.saved * f
            flash = n.saved_flash if n.attention else saved
            whole = n.saved_whole * f if keep > 1 else 0.0  # a sharded call's input, kept whole on every rank
            none = ((flash if self.attention == "flash" else saved) - whole) * tokens / keep + whole * tokens
            if n.attention and cp > 1:  # the gathered keys and values are whole sequences
                none += n.kv_bytes * scale / keep * (1 - 1 / cp)
            act["none"] += none
            shard = tp if (n.tp or sp) else 1  # a created tensor is a shard in a TP region or under SP
            for policy in OP_LEVEL_POLICIES:
                act[policy] += n.kept.get(policy, 0.0) * f * tokens / shard
                rec[policy] += t * n.recomputed.get(policy, 0.0)
        if self.runtime.backend.fused_activations:  # each fused region keeps its min-cut tensors instead
            region_kept = facts.region_kept_lean if self.runtime.norm_keeps_output else facts.region_kept
            for (members, _), kept in zip(facts.regions, region_kept):
                act["none"] += kept * tokens / keeps[members[0]] - sum(
                    facts.nodes[k].saved * tokens / keeps[k] for k in members
                )
        if self.runtime.backend.shared_attention_output:  # the projection's input is the kernel's output
            act["none"] -= sum(  # (unless the projection keeps a quantized copy of its own)
                n.saved * tokens / keep
                for n, keep, share in zip(nodes, keeps, shares)
                if n.reads_attention_output and self.attention == "flash" and share is None
            )
        if routed:  # the router weights multiply the experts' activation: no expert output kept for them
            act["none"] -= sum(b * tokens / keep for b, keep in zip(routed, keeps))
        return act, rec

    def _comms(self, facts: BlockFacts, tp: int, ep: int, scale: float, cp: int, sp: bool, lp: bool) -> List[Comm]:
        """The layer's collectives per microbatch (docs/cost_model.md): TP's around its regions
        as the runtime runs them (:func:`tp_region_collectives`), the vocabulary-parallel
        head/tail's, the statistics of whole-width norms, EP's all-to-alls, CP's key/value
        all-gather (backward: reduce-scatter)."""
        tokens = scale / cp
        comms: List[Comm] = []
        if tp > 1 and facts.tp_allreduces:
            nbytes = facts.row_bytes * tokens
            # the last row's forward collective (SP: its reduce-scatter) ends what the block saves
            last = ("reduce_scatter" if sp else "all_reduce", "fwd") if facts.tail_unsaved else None
            comms += [
                Comm(kind, "tp", nbytes, phase, count, int((kind, phase) == last))
                for (kind, phase), count in tp_region_collectives(facts, sp).items()
                if count
            ]
            comms += [
                Comm(kind, "tp", each * tokens, phase, count, unrecomputed)
                for kind, phase, count, each, unrecomputed in expert_tp_collectives(facts, sp, ep)
                if count
            ]
        if tp > 1:
            # a multi-query column's shared rows: their gradient summed over TP in each backward
            comms += [Comm("all_reduce", "tp", nbytes, "bwd") for nbytes in facts.grad_comms]
            for kind, nbytes, phase in facts.vocab_comms + facts.norm_comms:
                if lp and kind == "all_gather":  # loss parallel: the logits stay sharded
                    continue
                comms.append(Comm(kind, "tp", nbytes * tokens, phase))
            if lp:  # the max, then the sum of exponentials and the target logit, over the vocabulary shards
                rows = facts.loss_tokens * tokens
                comms += [
                    Comm("all_reduce", "tp", rows * LOSS_STATE_BYTES, "fwd"),
                    Comm("all_reduce", "tp", 2 * rows * LOSS_STATE_BYTES, "fwd"),
                ]
        if ep > 1 and facts.a2a_bytes:
            # stacked experts: each token once per owner rank (expert_dispatch); the zoo's buffer: its slots
            runs = "per-rank" if facts.stacked_experts else "slots"
            slots, rows = facts.a2a_bytes * tokens / tp, facts.row_bytes * tokens / tp  # rows: a token each
            nbytes, each = dispatch_bytes(slots, rows, runs, self.num_experts, facts.top_k, ep)
            comms += [Comm("all_to_all", "ep", nbytes, phase, 2, dispatched=each) for phase in ("fwd", "bwd")]
        if cp > 1:
            kv = [n.kv_bytes * scale / (tp if n.tp else 1) for n in facts.nodes if n.attention]
            for nbytes in sorted(set(kv)):
                count = kv.count(nbytes)
                comms += [
                    Comm("all_gather", "cp", nbytes, "fwd", count),
                    Comm("reduce_scatter", "cp", nbytes, "bwd", count),
                ]
        return comms

    def variant_times(self, block, tp: int, mbs: int, sp: bool, cp: int = 1, ep: int = 1) -> List[Tuple[float, float]]:
        """(forward, backward) seconds of each node for a variant: :meth:`node_times` (the
        analytical model, or measurements in a subclass) at ``cp = 1``, scaled to a context-parallel
        rank's share by the analytical model's own ratio, the RMSNorms the runtime runs as
        ``F.rms_norm`` as one fused op each (``fused_norms``), then under torch.compile / Float8
        (``runtime_costs``); expert matmuls at the shape EP ``ep`` runs them (``expert_gemms``)."""
        nodes = self.facts(block.index).nodes
        if ep > 1:
            shares = self.node_shares(block, tp, mbs, sp, cp)
            return ep_shaped_times(self.timing, nodes, self.variant_times(block, tp, mbs, sp, cp), shares, ep)
        times = self.node_times(block, tp, mbs, sp)
        if cp > 1:
            base = self._analytical(block, tp, mbs, sp, 1)
            split = self._analytical(block, tp, mbs, sp, cp)
            times = [(f * _ratio(b, c), tb * _ratio(b, c)) for (f, tb), b, c in zip(times, base, split)]
        norms = self.fused_norms(block, tp, sp)
        if not norms or self.runtime.backend.fusion >= 1:  # full fusion: every region at its boundary traffic
            return self.runtime.apply(self, block, nodes, times, tp, mbs, sp, cp)
        # each F.rms_norm the runtime runs: one fused op (a memory-efficient one: its op-by-op backward; fused_norms);
        # a fusing backend realises its share of the saving left over that (runtime_costs: the eager baseline ``base``)
        shares = self.node_shares(block, tp, mbs, sp, cp)
        fused = fused_times(self.timing, nodes, norms, shares, times, self.runtime.norm_keeps_output)
        if not self.runtime.fuses:
            return self.runtime.apply(self, block, nodes, fused, tp, mbs, sp, cp)
        plain = [self.timing.op_seconds(n.flops * s, n.bytes_moved * s, False) for n, s in zip(nodes, shares)]
        base = [f for f, _ in fused_times(self.timing, nodes, norms, shares, [(t, t) for t in plain])]
        return self.runtime.apply(self, block, nodes, fused, tp, mbs, sp, cp, base=base)

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
        return [
            (t, t * (attention if n.attention else backward))
            for t, n in zip(self._analytical(block, tp, mbs, sp, 1), self.facts(block.index).nodes)
        ]

    def node_shares(self, block, tp: int, mbs: int, sp: bool, cp: int) -> List[float]:
        """Per node, the share of its traced FLOPs and activation bytes one rank runs in a variant
        (microbatch over the traced batch, over TP where it shards the node, over CP)."""
        scale = mbs / self.batch
        sp = sp and block.kind == "block"
        return [scale / (n.tp_divisor(tp) if n.tp else (tp if sp else 1)) / cp for n in self.facts(block.index).nodes]

    def _analytical(self, block, tp: int, mbs: int, sp: bool, cp: int) -> List[float]:
        """Forward seconds of each node by the analytical model, on a context-parallel rank's
        tokens (``docs/cost_model.md``: attention under context parallelism); once per
        (block, tp, mbs, sp, cp): the variants that differ in EP degree or loss parallelism,
        and a CP variant's own cp = 1 base, share them. Read only."""
        key = (block.index, tp, mbs, sp, cp)
        hit = self._node_seconds.get(key)
        if hit is None:
            hit = self._node_seconds[key] = self._analytical_of(block, tp, mbs, sp, cp)
        return hit

    def _analytical_of(self, block, tp: int, mbs: int, sp: bool, cp: int) -> List[float]:
        scale = mbs / self.batch
        out = []
        sp = sp and block.kind == "block"  # the head and the tail see full sequences
        for n in self.facts(block.index).nodes:
            shard = n.tp_divisor(tp) if n.tp else (tp if sp else 1)
            share = scale / shard
            if not n.attention:
                out.append(self.timing.op_seconds(n.flops * share / cp, n.bytes_moved * share / cp, n.matmul))
                continue
            work = attention_work(n.seq, cp, n.causal and (self.attention == "flash" or cp > 1))
            if n.window and self.attention == "flash":  # the band of a windowed kernel (CP refuses windows)
                work = window_share(n.seq, n.window)
            nbytes = (n.bytes_moved - n.kv_bytes) / cp + n.kv_bytes
            extra = n.score_bytes * SCORE_GEMM_PASSES * work if self.attention == "traced" else 0.0
            t = self.timing.op_seconds(
                n.flops * share * work, (nbytes + extra) * share, n.matmul, attention=self.attention == "flash"
            )
            if self.attention == "flash":  # the rate by call length (ring: chunk-pair calls, merged)
                keys = fused_call_keys(n.seq, cp, self.ring_split, n.window)
                t /= attention_length_share(keys, self.timing.attention_half_tokens)
            if extra:
                t += materialised_score_seconds(self.timing, n.scores * share * work, n.score_bytes * share * work)
            out.append(t)
        return out


def _ratio(base: float, scaled: float) -> float:
    return scaled / base if base > 0 else 0.0


def workload_from_graph(
    graph,
    timing,
    dims: ModelDims,
    *,
    attention: str = "flash",
    provenance: str = "analytical",
    source: Optional[TracedSource] = None,
) -> Workload:
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
        layers.append(
            Layer(
                name=b.name,
                kind=b.kind,
                signature=b.signature,
                num_params=float(b.num_params),
                flops_per_sample=b.flops / batch,
                is_moe=b.is_moe,
            )
        )
    source = source or TracedSource(graph, timing, attention=attention)
    source.num_experts = dims.num_experts
    return Workload(graph.model_name, layers, dims, source, provenance=provenance)
