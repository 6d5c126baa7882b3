"""What the runtime can parallelise in one model: the model-level verdicts behind
``nest_fx.plan.may_run`` (the one entry point the planner and the runtime's checks ask).

:func:`parallel_support` inspects a model and its traced graph and answers, per parallelism and
degree, ``""`` (the runtime runs it and computes what the single-device model computes) or the
reason it cannot (naming the module). The planner searches only the degrees it allows
(``nest_fx.solver.runtime_planner``); the runtime's checks (``nest_fx.apply.checks``) refuse
the rest before any collective with the same reason. A plan is therefore never offered that the
runtime refuses, and never run when it would give a wrong number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from nest_fx.common.arith import divisors
from nest_fx.graph.context_sites import attention_sites, blocks_without_attention, unknown_position_embeddings
from nest_fx.graph.moe_modules import expert_counts, find_moe_modules, unconvertible_experts
from nest_fx.graph.opgraph import OpGraph
from nest_fx.graph.stage_layout import StageLayout, stage_layout
from nest_fx.graph.stage_modules import rehearsal_problem
from nest_fx.graph.tp_inputs import sequence_bypass
from nest_fx.graph.tp_regions import CONFIG_HEAD_ATTRS, block_regions, lowest_common_module
from nest_fx.graph.tp_rehearsal import tp_rehearsal_problem
from nest_fx.workload.types import dims_from_config


def model_dims(model: nn.Module) -> Dict[str, Optional[int]]:
    """heads, kv_heads, ffn, experts, vocab of a zoo or HuggingFace model (None when unknown)."""
    d = dims_from_config(getattr(model, "config", None), seq_len=0)
    return {
        "heads": d.heads or None,
        "kv_heads": d.kv_heads or None,
        "ffn": d.ffn_hidden or None,
        "experts": d.num_experts or None,
        "vocab": d.vocab_size or None,
    }


CONV_OPS = ("convolution", "_convolution", "conv1d", "conv2d", "conv3d")


def _fix(n: int, tp: int) -> str:
    return f"fix: use tp in {[d for d in divisors(n) if d <= 64]}"


def config_head_counts(model: nn.Module) -> Set[int]:
    """Head counts a model's config announces (attention and key/value heads, in any of the
    ecosystem's spellings); empty when it has no config."""
    config = getattr(model, "config", None)
    names = ("heads", "kv_heads") + CONFIG_HEAD_ATTRS
    return {v for v in (getattr(config, n, None) for n in names) if isinstance(v, int) and not isinstance(v, bool)}


def _pair_problem(model: nn.Module, block, pair, tp: int) -> str:
    """Why ``tp`` cannot shard one traced TP pair of ``block`` exactly ("" when it can)."""
    where = f"{block.name}: {pair.kind} pair {pair.column} -> {pair.row}"
    if pair.problem:
        return f"tp={tp} cannot shard {where}: {pair.problem}. fix: use tp=1 for this model"
    heads = config_head_counts(model) if pair.kind == "attention" else set()
    for spec in pair.params:
        for k, (part, unit) in enumerate(zip(spec.parts or [None], spec.units)):
            if k in spec.whole:  # a shared key/value head, kept whole on every rank
                continue
            size = part or tuple(model.get_parameter(block.fqn(spec.name)).shape)[spec.dim]
            if heads and unit > 1 and size // unit not in heads:
                # the region groups its projection by a count of its own (CodeGen's mp_num): a rank's
                # copy would regroup its shard by the same constant
                return (
                    f"tp={tp} cannot shard {where}: {block.fqn(spec.name)} is viewed as {size // unit} groups, "
                    f"which are not the model's heads ({sorted(heads)}). fix: use tp=1 for this model"
                )
    for spec in pair.params:
        shape = tuple(model.get_parameter(block.fqn(spec.name)).shape)
        size = shape[spec.dim]
        parts = spec.parts or [size]
        units = spec.units if len(spec.units) == len(parts) else [1] * len(parts)
        for k, (part, unit) in enumerate(zip(parts, units)):
            if k in spec.whole:
                continue
            count = part // max(unit, 1)
            if count % tp:
                what = f"{count} heads" if unit > 1 else f"{count} features"
                fused = f" (part of {len(parts)} fused along dim {spec.dim})" if len(parts) > 1 else ""
                share = "whole heads" if unit > 1 else "an equal share"
                return (
                    f"tp={tp} does not divide {block.fqn(spec.name)}: {what}{fused}; each rank keeps {share}. "
                    f"{_fix(count, tp)}"
                )
    for inp in pair.head_inputs:
        if inp.count % tp:
            return (
                f"tp={tp} does not divide the {inp.count} heads of a per-head input of {where}; {_fix(inp.count, tp)}"
            )
    return ""


def tp_graph_problem(model: nn.Module, graph: OpGraph, tp: int) -> str:
    """Why ``tp`` cannot shard the traced model's blocks ("" when it can): a TP pair whose region
    cannot be followed (``graph.tp_flow``), a degree that splits a head or a fused part, or no
    pair at all (a plan must never say tp while sharding nothing)."""
    layers = graph.layer_blocks
    if not layers:
        return (
            f"tp={tp}: the traced model has no repeated layers ({type(model).__name__} is one block), and tensor "
            "parallelism shards the column->row linear pairs inside layers; fix: use tp=1"
        )
    seen, pairs = set(), 0
    for block in layers:
        if block.signature in seen:
            continue
        seen.add(block.signature)
        pattern = graph.patterns.get(block.signature)
        if pattern is None:
            continue
        if pattern.tp_problem:
            return f"tp={tp} cannot shard {block.name}: {pattern.tp_problem}. fix: use tp=1 for this model"
        for pair in pattern.tp_pairs:
            problem = _pair_problem(model, block, pair, tp)
            if problem:
                return problem
        pairs += len(pattern.tp_pairs)
    if pairs:
        return tp_rehearsal_problem(model, graph, tp)  # the model's own code on one rank's shard
    container = graph.block_container or "<root>"
    convs = list(
        dict.fromkeys(
            graph.graph.nodes[n].get("module")
            for b in layers
            for n in b.nodes
            if graph.graph.nodes[n].get("op") in CONV_OPS
        )
    )
    why = (
        (
            f"; its layers compute with convolutions ({', '.join(convs[:3])}), whose channels tensor parallelism "
            "does not shard yet (pipeline and data parallelism apply)"
        )
        if convs
        else ""
    )
    return (
        f"tp={tp} would shard nothing: no column->row linear pair (a linear whose output features feed "
        f"another linear through per-feature ops) was found in the layers of {container}{why}; fix: use tp=1"
    )


def batchnorm_modules(model: nn.Module) -> List[str]:
    """FQNs of the model's BatchNorm layers (their training statistics are those of the batch they see)."""
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


@dataclass
class ParallelSupport:
    """The runtime's verdict on one model, per parallelism and degree (see the module docstring).

    Each ``*_problem`` method returns ``""`` when the runtime runs that degree on this model and
    gives the single-device numbers, else one sentence naming the module and the reason.
    """

    model: nn.Module
    graph: Optional[OpGraph]
    _memo: Dict[Tuple[str, int], str] = field(default_factory=dict, repr=False)
    _layout: Optional[StageLayout] = field(default=None, repr=False)

    def _cached(self, kind: str, degree: int, compute) -> str:
        key = (kind, degree)
        if key not in self._memo:
            self._memo[key] = compute(degree)
        return self._memo[key]

    # -- tensor parallelism ---------------------------------------------------------------
    def tp_problem(self, tp: int) -> str:
        """Why ``tp`` cannot shard this model's blocks ("" when it can)."""
        return "" if tp == 1 else self._cached("tp", tp, self._tp_problem)

    def _tp_problem(self, tp: int) -> str:
        dims = model_dims(self.model)
        for key, what in (("heads", "attention heads"), ("kv_heads", "key/value heads"), ("ffn", "FFN hidden size")):
            n = dims.get(key)
            if n is not None and n % tp:
                return (
                    f"tp={tp} does not divide the model's {n} {what} ({key}); tensor parallelism shards "
                    f"them evenly. fix: use tp in {[d for d in divisors(n) if d <= 64]}"
                )
        if self.graph is None:
            return ""
        return tp_graph_problem(self.model, self.graph, tp)

    def sp_problem(self, tp: int = 0) -> str:
        """Why sequence parallelism (TP's activations sharded on the sequence dim between regions)
        cannot run on this model ("" when it can); with ``tp`` > 1, also under that degree: each
        rank keeps an equal share of the sequence, so the layers' sequence dim must divide by it."""
        if self.graph is None:
            return ""
        if tp > 1:
            uneven = self._uneven_sequence(tp)
            if uneven:
                return uneven
        groups = [b.name for b in self.graph.layer_blocks if b.members]
        if groups:
            return (
                f"sequence parallelism shards the sequence dim of activations between layer modules, but the "
                f"layers of {type(self.model).__name__} are groups of nn.Sequential children ({groups[0]}, ...); "
                "fix: sequence_parallel=false"
            )
        for block in self.graph.layer_blocks:
            pattern = self.graph.patterns.get(block.signature)
            leaf = [p.leaf for p in (pattern.tp_pairs if pattern else []) if p.leaf]
            if leaf:
                return (
                    f"sequence parallelism gathers the sequence on entry to each TP region, but "
                    f"{block.fqn(leaf[0])} is an nn.MultiheadAttention, which nest-fx shards by heads with a "
                    "forward of its own that takes whole sequences only; fix: sequence_parallel=false"
                )
            whole = [
                p
                for p in (pattern.tp_pairs if pattern else [])
                if p.kind != "expert" and not lowest_common_module(list(p.column) + [p.row])
            ]
            if whole:
                return (
                    f"sequence parallelism gathers the sequence on entry to each TP region (the module holding a "
                    f"pair), but {block.name}.{whole[0].row} and its columns {whole[0].column} are direct children "
                    "of the layer, so the region would be the whole layer; fix: sequence_parallel=false"
                )
            for region, kind, pairs in block_regions(pattern) if pattern else []:
                bypass = "" if kind == "expert" else sequence_bypass(self.graph.graph, block, region, pairs)
                if bypass:
                    return (
                        f"sequence parallelism reduce-scatters each TP region's output over the sequence at its row "
                        f"linear, but in {block.fqn(region)} {bypass} reaches the region's output without passing "
                        f"the row {block.fqn(pairs[0].row)} (a whole sequence added to one rank's share); "
                        "fix: sequence_parallel=false"
                    )
        return ""

    def _uneven_sequence(self, tp: int) -> str:
        """Why the layers' activations are no ``[batch, sequence, features]`` tensors whose sequence
        splits evenly over ``tp`` ranks ("" when they are), read from the inputs of the linears in
        the layers (2-D inputs, an MoE's routed tokens, are the region's own business): a linear
        fed 4-D channels-last maps (ConvNeXt), two sizes on dim 1 (MLP-Mixer's token-mixing MLP
        over the transposed patches, Swin's windows), a sequence tp does not divide (a ViT's 16
        patches and class token)."""
        seen: Dict[int, str] = {}
        for block in self.graph.layer_blocks:
            for node in block.nodes:
                data = self.graph.graph.nodes[node]
                shapes = data.get("in_shapes") or []
                if data.get("op") != "linear" or not shapes or len(shapes[0]) < 3:
                    continue
                shape, module = list(shapes[0]), data.get("module") or block.name
                if len(shape) > 3:
                    return (
                        f"sequence parallelism shards dim 1 of [batch, sequence, features] activations, but "
                        f"{module} takes a {len(shape)}-D input {shape}; fix: sequence_parallel=false"
                    )
                seen.setdefault(shape[1], module)
        if len(seen) > 1:
            (a, first), (b, second) = list(seen.items())[:2]
            return (
                f"sequence parallelism shards dim 1 of the layers' activations as their sequence, but {first} "
                f"takes {a} there and {second} {b} (a mixing MLP over a transposed dim, or windows); fix: "
                "sequence_parallel=false"
            )
        for positions, module in seen.items():
            if positions % tp:
                return (
                    f"sequence parallelism with tp={tp}: {module} takes {positions} positions (dim 1 of its "
                    f"input), which tp={tp} ranks cannot share evenly; fix: sequence_parallel=false, or a "
                    "sequence length divisible by tp"
                )
        return ""

    # -- pipeline parallelism -------------------------------------------------------------
    def pp_problem(self, pp: int) -> str:
        """Why the model cannot be split into ``pp`` pipeline stages ("" when it can)."""
        return "" if pp == 1 else self._cached("pp", pp, self._pp_problem)

    def _pp_problem(self, pp: int) -> str:
        if self.graph is None:
            return ""
        layout = self.stage_layout()
        problem = layout.first_problem() or rehearsal_problem(self.model, self.graph, layout)
        return f"pp={pp}: {problem}" if problem else ""

    def tp_pp_problem(self, tp: int) -> str:
        """Why TP of degree ``tp`` cannot run beside a pipeline cut ("" when it can): a cut that
        passes a layer's extra output beside the activation (T5's position biases, returned by
        every decoder layer) carries a tensor each TP rank builds from its own heads, whose shape
        the receiving stage cannot check against the traced model's; values of other modules (an
        encoder's output) are whole on every rank and run."""
        if tp == 1 or self.graph is None:
            return ""
        layout = self.stage_layout()
        layers = set(layout.layer_modules())
        for module, shape, _dtype, _passed in (v for c in sorted(layout.side_values) for v in layout.side_values[c]):
            if module in layers:
                return (
                    f"tp={tp} with pp > 1: a pipeline cut passes {module}'s extra output {tuple(shape)} beside the "
                    "activation, and under tensor parallelism each rank builds it from its own heads. fix: use "
                    "tp=1 or pp=1"
                )
        return ""

    def stage_layout(self) -> StageLayout:
        """Which modules each chain block uses and what crosses each cut (``nest_fx.graph.stage_layout``)."""
        if self._layout is None:
            self._layout = stage_layout(self.model, self.graph)
        return self._layout

    # -- expert parallelism ---------------------------------------------------------------
    def num_experts(self) -> Optional[int]:
        """Experts per MoE layer that expert parallelism splits: counted on the model's MoE modules
        (zoo MoE lists, HF stacked experts), else the config's count, else None (a dense model)."""
        counts = expert_counts(self.model)
        if counts:
            return math.gcd(*counts)
        return model_dims(self.model)["experts"]

    def ep_problem(self, ep: int, dp: Optional[int] = None) -> str:
        """Why ``ep`` cannot split this model's experts ("" when it can); ``dp`` names the divisors
        that also divide the data-parallel degree in the fix."""
        if ep == 1:
            return ""
        experts = self.num_experts()
        if experts is None:
            return f"ep={ep} but the model has no experts (no MoE layer, no config.num_experts); fix: set ep=1"
        if experts % ep:
            fits = [d for d in divisors(experts) if dp is None or dp % d == 0]
            tail = f" (it must also divide dp={dp})" if dp is not None else ""
            return (
                f"ep={ep} does not divide the model's {experts} experts; each expert-parallel rank holds "
                f"experts/ep of them. fix: use ep in {fits}{tail}"
            )
        return self._cached("ep", ep, self._ep_layout_problem)

    def _ep_layout_problem(self, ep: int) -> str:
        other = unconvertible_experts(self.model)
        if other:
            return (
                f"ep={ep}: {type(self.model).__name__} keeps experts in {other[0]} in a layout expert "
                "parallelism does not split (it converts the nest-fx zoo MoE and HuggingFace stacked experts, "
                "whose parameters are [num_experts, ...] tensors). fix: use ep=1"
            )
        if not expert_counts(self.model):
            return (
                f"ep={ep} but {type(self.model).__name__} has no MoE layer expert parallelism can convert (the "
                "nest-fx zoo MoE or HuggingFace stacked experts). fix: use ep=1"
            )
        return ""

    # -- loss parallelism -----------------------------------------------------------------
    def loss_parallel_problem(self, tp: int) -> str:
        """Why the LM head's logits cannot stay sharded by vocabulary over ``tp`` ranks ("" when
        they can; always "" at tp=1, where loss parallel changes nothing)."""
        if tp == 1 or self.graph is None:
            return ""
        layout = self.stage_layout()
        last = layout.num_blocks - 1
        tail = [path for path, blocks in layout.owned.items() if last in blocks]
        linears = [t for t in tail if isinstance(self.model.get_submodule(t), nn.Linear)]
        if not linears:
            return (
                "loss_parallel: the model's tail has no output linear (LM head) whose logits could stay sharded "
                "by vocabulary; fix: loss_parallel=false"
            )
        shared = {name for names in layout.shared.values() for name in names}
        tied = [
            t for t in linears if any(f"{t}.{n}" in shared for n, _ in self.model.get_submodule(t).named_parameters())
        ]
        if tied:
            return (
                f"loss_parallel: {tied[0]} shares its weight with the embedding, so it stays replicated under "
                "TP and its logits are not sharded; fix: untie the embeddings or loss_parallel=false"
            )
        return ""

    # -- microbatches ----------------------------------------------------------------------
    def microbatch_problem(self, microbatches: int) -> str:
        """Why a step of ``microbatches`` forwards per replica does not compute what one forward of the
        whole batch computes ("" when it does): BatchNorm statistics are per forward."""
        if microbatches <= 1:
            return ""
        norms = batchnorm_modules(self.model)
        if not norms:
            return ""
        shown = ", ".join(norms[:4]) + (f" and {len(norms) - 4} more" if len(norms) > 4 else "")
        return (
            f"BatchNorm layers ({shown}) normalise with the statistics of the batch one forward sees; with "
            f"{microbatches} microbatches per step each forward sees 1/{microbatches} of the batch, so the "
            "numbers differ from the single-device run. fix: one microbatch per step (microbatch_size = "
            "global_batch / dp, pp=1), or auto_parallelize(..., sync_batchnorm=False) to accept per-microbatch "
            "statistics (as DDP with gradient accumulation)"
        )

    # -- context parallelism --------------------------------------------------------------
    def cp_problem(self, cp: int) -> str:
        """Why the model's sequence cannot be split over ``cp`` ranks ("" when it can).

        The runtime's CP path (``nest_fx.apply.context_parallel``) shards every sequence into
        ``2 cp`` chunks, exchanges K/V in each ``scaled_dot_product_attention`` call under a
        causal mask, and remaps the positions that rotary tables, HF rotary embeddings and
        learned position embeddings read. It refuses what it cannot make exact: a layer without
        an SDPA call, non-causal attention or attention under another mask (sliding windows,
        ALiBi, custom masks), positions it cannot remap, and MoE layers whose capacity drops
        depend on the tokens a rank sees.
        """
        return "" if cp == 1 else self._cached("cp", cp, self._cp_problem)

    def _cp_problem(self, cp: int) -> str:
        fix = "fix: use cp=1"
        config = getattr(self.model, "config", None)
        for moe in find_moe_modules(self.model):
            if moe.capacity_factor * moe.top_k < moe.num_experts:
                return (
                    f"cp={cp}: the MoE layers route each sequence into experts of capacity_factor="
                    f"{moe.capacity_factor} x seq x top_k / experts slots, so which tokens are dropped depends on "
                    f"the part of the sequence a rank holds; {fix}, or a capacity_factor >= experts / top_k = "
                    f"{moe.num_experts / moe.top_k:g} (no drops)"
                )
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) is not False:
            return (
                f"cp={cp}: the model attends within a sliding window of {window} tokens (config.sliding_window); "
                f"the CP path runs full causal attention only. {fix}"
            )
        layer_types = set(getattr(config, "layer_types", None) or ())
        if layer_types - {"full_attention"}:
            return (
                f"cp={cp}: the model has attention layers of types {sorted(layer_types)}; the CP path runs "
                f"full causal attention only. {fix}"
            )
        if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", "") == "alibi":
            return (
                f"cp={cp}: the model adds ALiBi position biases to its attention scores, which the CP path "
                f"does not shard. {fix}"
            )
        if self.graph is None:
            return ""
        seq = self.graph.input_shapes[0][1] if self.graph.input_shapes and len(self.graph.input_shapes[0]) > 1 else 0
        if seq % (2 * cp):
            return (
                f"cp={cp}: the sequence length {seq} is not divisible by 2 x cp = {2 * cp} (each CP rank holds "
                f"two of 2 x cp equal chunks); fix: a sequence length that is a multiple of {2 * cp}, or cp in "
                f"{[d for d in divisors(max(seq // 2, 1)) if d <= 64]}"
            )
        missing = blocks_without_attention(self.graph)
        if missing:
            return (
                f"cp={cp}: layer {missing[0]} has no scaled_dot_product_attention call; the CP path exchanges "
                "keys and values in SDPA calls only, and a layer that mixes tokens another way (eager or "
                "flash-attn attention, convolutions over the sequence) would compute wrong numbers. fix: use "
                "SDPA attention (HF: attn_implementation='sdpa') or cp=1"
            )
        modules = dict(self.model.named_modules())
        for site in attention_sites(self.graph):
            causal = site.causal or (site.mask and getattr(modules.get(site.module), "is_causal", False) is True)
            if not causal:
                what = "under an attention mask it builds" if site.mask else "without a causal mask (is_causal=False)"
                return (
                    f"cp={cp}: {site.module} computes attention {what}; the CP path runs causal attention only "
                    f"(each token attends to itself and earlier tokens). {fix}"
                )
        unknown = unknown_position_embeddings(self.graph)
        if unknown:
            return (
                f"cp={cp}: embedding {unknown[0]} is indexed by a tensor that is neither the input tokens nor "
                f"an arange (a position buffer, token types?), which the CP path cannot remap to the positions "
                f"of a rank's tokens. {fix}"
            )
        return ""


def parallel_support(model: nn.Module, graph: Optional[OpGraph]) -> ParallelSupport:
    """The runtime's verdict on ``model`` (traced as ``graph``), for the planner and the runtime."""
    return ParallelSupport(model, graph)
