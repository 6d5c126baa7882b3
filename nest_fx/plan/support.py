"""What the runtime can parallelise in one model: the one decision the planner and the runtime share.

:func:`parallel_support` inspects a model and its traced graph and answers, per parallelism and
degree, ``""`` (the runtime runs it and computes what the single-device model computes) or the
reason it cannot (naming the module). The planner searches only the degrees it allows
(``nest_fx.solver.runtime_planner``); the runtime's checks (``nest_fx.apply.checks``) refuse
the rest before any collective with the same reason. A plan is therefore never offered that the
runtime refuses, and never run when it would give a wrong number.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch.nn as nn

from nest_fx.common.arith import divisors
from nest_fx.graph.context_sites import attention_sites, blocks_without_attention, unknown_position_embeddings
from nest_fx.graph.moe_modules import find_moe_modules
from nest_fx.graph.opgraph import OpGraph
from nest_fx.graph.recompute_policies import recompute_policy_problem
from nest_fx.graph.stage_layout import StageLayout, stage_layout
from nest_fx.graph.stage_modules import rehearsal_problem
from nest_fx.plan.plan import Plan
from nest_fx.workload.types import dims_from_config


def model_dims(model: nn.Module) -> Dict[str, Optional[int]]:
    """heads, kv_heads, ffn, experts, vocab of a zoo or HuggingFace model (None when unknown)."""
    d = dims_from_config(getattr(model, "config", None), seq_len=0)
    return {"heads": d.heads or None, "kv_heads": d.kv_heads or None, "ffn": d.ffn_hidden or None,
            "experts": d.num_experts or None, "vocab": d.vocab_size or None}


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
                return (f"tp={tp} does not divide the model's {n} {what} ({key}); tensor parallelism shards "
                        f"them evenly. fix: use tp in {[d for d in divisors(n) if d <= 64]}")
        if self.graph is None:
            return ""
        modules = dict(self.model.named_modules())
        for block in self.graph.blocks:
            pattern = self.graph.patterns.get(block.signature) if block.kind == "block" else None
            if pattern is None:
                continue
            for pair in pattern.tp_pairs:
                for rel, attr in [(c, "out_features") for c in pair.column] + [(pair.row, "in_features")]:
                    n = getattr(modules.get(f"{block.name}.{rel}"), attr, None)
                    if isinstance(n, int) and n % tp:
                        return (f"tp={tp} does not divide {block.name}.{rel}.{attr}={n}; fix: use tp in "
                                f"{[d for d in divisors(n) if d <= 64]}")
            break  # identical blocks share the pattern; one of each signature is enough
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

    def stage_layout(self) -> StageLayout:
        """Which modules each chain block uses and what crosses each cut (``nest_fx.graph.stage_layout``)."""
        if self._layout is None:
            self._layout = stage_layout(self.model, self.graph)
        return self._layout

    # -- expert parallelism ---------------------------------------------------------------
    def ep_problem(self, ep: int, dp: Optional[int] = None) -> str:
        """Why ``ep`` cannot split this model's experts ("" when it can); ``dp`` names the divisors
        that also divide the data-parallel degree in the fix."""
        if ep == 1:
            return ""
        experts = model_dims(self.model)["experts"]
        if experts is None:
            return f"ep={ep} but the model has no experts (no config.num_experts); fix: set ep=1"
        if experts % ep:
            fits = [d for d in divisors(experts) if dp is None or dp % d == 0]
            tail = f" (it must also divide dp={dp})" if dp is not None else ""
            return (f"ep={ep} does not divide the model's {experts} experts; each expert-parallel rank holds "
                    f"experts/ep of them. fix: use ep in {fits}{tail}")
        if not find_moe_modules(self.model):
            return (f"ep={ep} but {type(self.model).__name__} has no MoE module with the route/dispatch/run_experts/"
                    "combine steps expert parallelism replaces (the nest-fx zoo MoE has them; HF Mixtral's fused "
                    "experts are not supported yet). fix: use ep=1")
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
            return ("loss_parallel: the model's tail has no output linear (LM head) whose logits could stay sharded "
                    "by vocabulary; fix: loss_parallel=false")
        shared = {name for names in layout.shared.values() for name in names}
        tied = [t for t in linears if any(f"{t}.{n}" in shared for n, _ in self.model.get_submodule(t).named_parameters())]
        if tied:
            return (f"loss_parallel: {tied[0]} shares its weight with the embedding, so it stays replicated under "
                    "TP and its logits are not sharded; fix: untie the embeddings or loss_parallel=false")
        return ""

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
                return (f"cp={cp}: the MoE layers route each sequence into experts of capacity_factor="
                        f"{moe.capacity_factor} x seq x top_k / experts slots, so which tokens are dropped depends on "
                        f"the part of the sequence a rank holds; {fix}, or a capacity_factor >= experts / top_k = "
                        f"{moe.num_experts / moe.top_k:g} (no drops)")
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) is not False:
            return (f"cp={cp}: the model attends within a sliding window of {window} tokens (config.sliding_window); "
                    f"the CP path runs full causal attention only. {fix}")
        layer_types = set(getattr(config, "layer_types", None) or ())
        if layer_types - {"full_attention"}:
            return (f"cp={cp}: the model has attention layers of types {sorted(layer_types)}; the CP path runs "
                    f"full causal attention only. {fix}")
        if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", "") == "alibi":
            return f"cp={cp}: the model adds ALiBi position biases to its attention scores, which the CP path does not shard. {fix}"
        if self.graph is None:
            return ""
        seq = self.graph.input_shapes[0][1] if self.graph.input_shapes and len(self.graph.input_shapes[0]) > 1 else 0
        if seq % (2 * cp):
            return (f"cp={cp}: the sequence length {seq} is not divisible by 2 x cp = {2 * cp} (each CP rank holds "
                    f"two of 2 x cp equal chunks); fix: a sequence length that is a multiple of {2 * cp}, or cp in "
                    f"{[d for d in divisors(max(seq // 2, 1)) if d <= 64]}")
        missing = blocks_without_attention(self.graph)
        if missing:
            return (f"cp={cp}: layer {missing[0]} has no scaled_dot_product_attention call; the CP path exchanges "
                    "keys and values in SDPA calls only, and a layer that mixes tokens another way (eager or "
                    "flash-attn attention, convolutions over the sequence) would compute wrong numbers. fix: use "
                    "SDPA attention (HF: attn_implementation='sdpa') or cp=1")
        modules = dict(self.model.named_modules())
        for site in attention_sites(self.graph):
            causal = site.causal or (site.mask and getattr(modules.get(site.module), "is_causal", False) is True)
            if not causal:
                what = "under an attention mask it builds" if site.mask else "without a causal mask (is_causal=False)"
                return (f"cp={cp}: {site.module} computes attention {what}; the CP path runs causal attention only "
                        f"(each token attends to itself and earlier tokens). {fix}")
        unknown = unknown_position_embeddings(self.graph)
        if unknown:
            return (f"cp={cp}: embedding {unknown[0]} is indexed by a tensor that is neither the input tokens nor "
                    f"an arange (a position buffer, token types?), which the CP path cannot remap to the positions "
                    f"of a rank's tokens. {fix}")
        return ""


def parallel_support(model: nn.Module, graph: Optional[OpGraph]) -> ParallelSupport:
    """The runtime's verdict on ``model`` (traced as ``graph``), for the planner and the runtime."""
    return ParallelSupport(model, graph)


def unrun_fields(plan: Plan) -> List[str]:
    """Combinations of plan fields the runtime refuses before training, each with the reason:
    unknown recompute policies and :func:`unrun_combination`."""
    out = [f"stages[{i}]: {problem}" for i, s in enumerate(plan.stages)
           for problem in [recompute_policy_problem(s.recompute)] if problem]
    return out + unrun_combination(tp=max(s.tp for s in plan.stages), ep=plan.ep, dp_shard=plan.dp_shard,
                                   hsdp=plan.replicate_degree > 1, compile=plan.compile, float8=plan.float8)


def unrun_combination(*, tp: int, ep: int, dp_shard: int, hsdp: bool, compile: bool, float8: bool) -> List[str]:
    """[] when the runtime runs these degrees and options together, else why not (the planner
    searches only combinations it runs): HSDP with expert parallelism (the mesh splits the
    replicas into expert groups or into shard groups, not both); torch.compile or Float8 with
    tensor parallelism (a compiled block with TP's hooks fails in backward on torch 2.13; Float8
    TP needs torchao's float8 TP styles)."""
    out = []
    if hsdp and ep > 1:
        out.append(f"dp_shard={dp_shard} with ep={ep}: HSDP does not run with expert parallelism yet "
                   "(use dp_shard=0, or ep=1)")
    for name, on in (("compile", compile), ("float8", float8)):
        if on and tp > 1:
            out.append(f"{name} with tp={tp}: the runtime does not run {name} with tensor parallelism yet "
                       f"(use {name}=false, or tp=1)")
    return out
