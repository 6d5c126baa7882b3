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
from typing import Dict, List, Optional, Set, Tuple

import torch.nn as nn

from nest_fx.common.arith import divisors
from nest_fx.graph.moe_modules import find_moe_modules
from nest_fx.graph.opgraph import OpGraph
from nest_fx.graph.tp_regions import CONFIG_HEAD_ATTRS, lowest_common_module
from nest_fx.plan.plan import Plan
from nest_fx.workload.types import dims_from_config


def model_dims(model: nn.Module) -> Dict[str, Optional[int]]:
    """heads, kv_heads, ffn, experts, vocab of a zoo or HuggingFace model (None when unknown)."""
    d = dims_from_config(getattr(model, "config", None), seq_len=0)
    return {"heads": d.heads or None, "kv_heads": d.kv_heads or None, "ffn": d.ffn_hidden or None,
            "experts": d.num_experts or None, "vocab": d.vocab_size or None}


def _ancestors(path: str) -> List[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[:k]) for k in range(len(parts) + 1)]


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
        for part, unit in zip(spec.parts or [None], spec.units):
            size = part or tuple(model.get_parameter(block.fqn(spec.name)).shape)[spec.dim]
            if heads and unit > 1 and size // unit not in heads:
                # the region groups its projection by a count of its own (CodeGen's mp_num): a rank's
                # copy would regroup its shard by the same constant
                return (f"tp={tp} cannot shard {where}: {block.fqn(spec.name)} is viewed as {size // unit} groups, "
                        f"which are not the model's heads ({sorted(heads)}). fix: use tp=1 for this model")
    for spec in pair.params:
        shape = tuple(model.get_parameter(block.fqn(spec.name)).shape)
        size = shape[spec.dim]
        parts = spec.parts or [size]
        units = spec.units if len(spec.units) == len(parts) else [1] * len(parts)
        for part, unit in zip(parts, units):
            count = part // max(unit, 1)
            if count % tp:
                what = f"{count} heads" if unit > 1 else f"{count} features"
                fused = f" (part of {len(parts)} fused along dim {spec.dim})" if len(parts) > 1 else ""
                share = "whole heads" if unit > 1 else "an equal share"
                return (f"tp={tp} does not divide {block.fqn(spec.name)}: {what}{fused}; each rank keeps {share}. "
                        f"{_fix(count, tp)}")
    for inp in pair.head_inputs:
        if inp.count % tp:
            return f"tp={tp} does not divide the {inp.count} heads of a per-head input of {where}; {_fix(inp.count, tp)}"
    return ""


def tp_graph_problem(model: nn.Module, graph: OpGraph, tp: int) -> str:
    """Why ``tp`` cannot shard the traced model's blocks ("" when it can): a TP pair whose region
    cannot be followed (``graph.tp_flow``), a degree that splits a head or a fused part, or no
    pair at all (a plan must never say tp while sharding nothing)."""
    layers = graph.layer_blocks
    if not layers:
        return (f"tp={tp}: the traced model has no repeated layers ({type(model).__name__} is one block), and tensor "
                "parallelism shards the column->row linear pairs inside layers; fix: use tp=1")
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
    if not pairs:
        container = graph.block_container or "<root>"
        convs = list(dict.fromkeys(graph.graph.nodes[n].get("module") for b in layers for n in b.nodes
                                   if graph.graph.nodes[n].get("op") in CONV_OPS))
        why = (f"; its layers compute with convolutions ({', '.join(convs[:3])}), whose channels tensor parallelism "
               "does not shard yet (pipeline and data parallelism apply)") if convs else ""
        return (f"tp={tp} would shard nothing: no column->row linear pair (a linear whose output features feed "
                f"another linear through per-feature ops) was found in the layers of {container}{why}; fix: use tp=1")
    return ""


def head_tail_modules(model: nn.Module, graph) -> Tuple[List[str], List[str]]:
    """Top-most parameterised modules of the head and tail blocks (not above the layer container)."""
    container = graph.block_container
    above = set(_ancestors(container))
    modules = dict(model.named_modules())

    def tops(block) -> List[str]:
        found: List[str] = []
        for node in block.nodes:
            path = graph.graph.nodes[node].get("module", "")
            if not path:
                continue
            parts = path.split(".")
            for k in range(1, len(parts) + 1):
                prefix = ".".join(parts[:k])
                if prefix not in above:
                    if prefix in modules and prefix not in found and any(True for _ in modules[prefix].parameters()):
                        found.append(prefix)
                    break
        return found

    head = next((b for b in graph.blocks if b.kind == "head"), None)
    tail = next((b for b in graph.blocks if b.kind == "tail"), None)
    return (tops(head) if head else []), (tops(tail) if tail else [])


@dataclass
class ParallelSupport:
    """The runtime's verdict on one model, per parallelism and degree (see the module docstring).

    Each ``*_problem`` method returns ``""`` when the runtime runs that degree on this model and
    gives the single-device numbers, else one sentence naming the module and the reason.
    """

    model: nn.Module
    graph: Optional[OpGraph]
    _memo: Dict[Tuple[str, int], str] = field(default_factory=dict, repr=False)

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
        return tp_graph_problem(self.model, self.graph, tp)

    def sp_problem(self) -> str:
        """Why sequence parallelism (TP's activations sharded on the sequence dim between regions)
        cannot run on this model ("" when it can)."""
        if self.graph is None:
            return ""
        groups = [b.name for b in self.graph.layer_blocks if b.members]
        if groups:
            return (f"sequence parallelism shards the sequence dim of activations between layer modules, but the "
                    f"layers of {type(self.model).__name__} are groups of nn.Sequential children ({groups[0]}, ...); "
                    "fix: sequence_parallel=false")
        for block in self.graph.layer_blocks:
            pattern = self.graph.patterns.get(block.signature)
            whole = [p for p in (pattern.tp_pairs if pattern else []) if p.kind != "expert"
                     and not lowest_common_module(list(p.column) + [p.row])]
            if whole:
                return (f"sequence parallelism gathers the sequence on entry to each TP region (the module holding a "
                        f"pair), but {block.name}.{whole[0].row} and its columns {whole[0].column} are direct children "
                        "of the layer, so the region would be the whole layer; fix: sequence_parallel=false")
        return ""

    # -- pipeline parallelism -------------------------------------------------------------
    def pp_problem(self, pp: int) -> str:
        """Why the model cannot be split into ``pp`` pipeline stages ("" when it can)."""
        return "" if pp == 1 else self._cached("pp", pp, self._pp_problem)

    def _pp_problem(self, pp: int) -> str:
        if self.graph is None:
            return ""
        if not self.graph.block_container and isinstance(self.model, nn.Sequential) \
                and type(self.model).forward is not nn.Sequential.forward:
            return (f"{type(self.model).__name__} is an nn.Sequential with its own forward; a pipeline stage keeps a "
                    "range of its children and runs them in order, which would skip that forward. fix: use pp=1")
        head, tail = head_tail_modules(self.model, self.graph)
        head_params = {id(p) for h in head for p in self.model.get_submodule(h).parameters()}
        tied = sorted({t for t in tail for p in self.model.get_submodule(t).parameters() if id(p) in head_params})
        if tied:
            return (f"the model ties {tied} to its embedding, but with pp={pp} the head and the tail sit on "
                    "different pipeline stages; fix: untie the embeddings (e.g. tie_embeddings=False) or use pp=1")
        return ""

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

    # -- context parallelism --------------------------------------------------------------
    def cp_problem(self, cp: int) -> str:
        """Why the model's sequence cannot be split over ``cp`` ranks ("" when it can)."""
        if cp == 1:
            return ""
        return f"cp={cp}: the runtime does not run context parallelism yet; fix: use cp=1"


def parallel_support(model: nn.Module, graph: Optional[OpGraph]) -> ParallelSupport:
    """The runtime's verdict on ``model`` (traced as ``graph``), for the planner and the runtime."""
    return ParallelSupport(model, graph)


def unimplemented_fields(plan: Plan) -> List[str]:
    """Plan fields the format holds but neither the cost model nor the runtime handles yet; both
    refuse a plan that uses them (never silently ignored)."""
    used = [name for name, on in (("cp", plan.cp > 1), ("dp_shard", plan.dp_shard not in (0, plan.dp)),
                                  ("loss_parallel", plan.loss_parallel), ("compile", plan.compile),
                                  ("float8", plan.float8)) if on]
    return used + [f"stages[{i}].recompute={s.recompute}" for i, s in enumerate(plan.stages)
                   if s.recompute not in ("none", "selective", "full")]
