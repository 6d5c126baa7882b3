"""Checks run before any collective: a mismatch fails on every rank with the same clear message.

Each check raises :class:`ApplyError` naming what does not fit and how to fix it, instead of
letting a rank hang in a collective or die inside a reshape.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch.nn as nn

from nest_fx.apply.moe_modules import find_moe_modules
from nest_fx.plan.plan import Plan, PlanError
from nest_fx.solver.space import divisors
from nest_fx.workload.types import chain_fingerprint, dims_from_config


class ApplyError(PlanError):
    """The plan does not fit the model, the batch or the launched world."""


def model_dims(model: nn.Module) -> Dict[str, Optional[int]]:
    """heads, kv_heads, ffn, experts, vocab of a zoo or HuggingFace model (None when unknown)."""
    d = dims_from_config(getattr(model, "config", None), seq_len=0)
    return {"heads": d.heads or None, "kv_heads": d.kv_heads or None, "ffn": d.ffn_hidden or None,
            "experts": d.num_experts or None, "vocab": d.vocab_size or None}


def check_world(plan: Plan, world_size: int) -> None:
    used = plan.devices_used
    if world_size != used:
        raise ApplyError(
            f"world size mismatch: the plan uses {used} devices (dp={plan.dp} x {plan.devices_per_replica} "
            f"per replica: stage tp={[s.tp for s in plan.stages]}) but {world_size} processes were launched; "
            f"fix: run torchrun --nproc_per_node={used} (or nnodes x nproc = {used}), or re-plan for "
            f"{world_size} devices (idle ranks are not supported by the runtime)")


def check_tp(plan: Plan, model: nn.Module, graph=None) -> None:
    tps = sorted({s.tp for s in plan.stages if s.tp > 1})
    if not tps:
        return
    dims = model_dims(model)
    for tp in tps:
        for key, what in (("heads", "attention heads"), ("kv_heads", "key/value heads"), ("ffn", "FFN hidden size")):
            n = dims.get(key)
            if n is not None and n % tp:
                raise ApplyError(
                    f"tp={tp} does not divide the model's {n} {what} ({key}); tensor parallelism shards "
                    f"them evenly. fix: use tp in {[d for d in divisors(n) if d <= 64]}")
        if graph is None:
            continue
        modules = dict(model.named_modules())
        for block in graph.blocks:
            pattern = graph.patterns.get(block.signature) if block.kind == "block" else None
            if pattern is None:
                continue
            for pair in pattern.tp_pairs:
                for rel, attr in [(c, "out_features") for c in pair.column] + [(pair.row, "in_features")]:
                    mod = modules.get(f"{block.name}.{rel}")
                    n = getattr(mod, attr, None)
                    if isinstance(n, int) and n % tp:
                        raise ApplyError(
                            f"tp={tp} does not divide {block.name}.{rel}.{attr}={n}; fix: use tp in "
                            f"{[d for d in divisors(n) if d <= 64]}")
            break  # identical blocks share the pattern; one of each signature is enough


def check_ep(plan: Plan, model: nn.Module) -> None:
    if plan.ep == 1:
        return
    experts = model_dims(model)["experts"]
    if experts is None:
        raise ApplyError(f"ep={plan.ep} but the model has no experts (no config.num_experts); fix: set ep=1")
    if experts % plan.ep:
        raise ApplyError(
            f"ep={plan.ep} does not divide the model's {experts} experts; each expert-parallel rank holds "
            f"experts/ep of them. fix: use ep in {[d for d in divisors(experts) if plan.dp % d == 0]} "
            f"(it must also divide dp={plan.dp})")
    if not find_moe_modules(model):
        raise ApplyError(
            f"ep={plan.ep} but {type(model).__name__} has no MoE module with the route/dispatch/run_experts/"
            "combine steps expert parallelism replaces (the nest-fx zoo MoE has them; HF Mixtral's fused "
            "experts are not supported yet). fix: use ep=1")


def check_batch(plan: Plan, global_batch_size: int) -> int:
    """Validate the batch; return the number of microbatches per step (scaled up if the batch is a
    multiple of the plan's global batch)."""
    unit = plan.dp * plan.microbatch_size * plan.num_microbatches
    if global_batch_size <= 0 or global_batch_size % unit:
        raise ApplyError(
            f"global batch {global_batch_size} is not divisible by dp * microbatch_size * num_microbatches = "
            f"{plan.dp} * {plan.microbatch_size} * {plan.num_microbatches} = {unit}; fix: use a global batch "
            f"that is a multiple of {unit}, or a plan with num_microbatches = global_batch / (dp * microbatch_size)")
    return global_batch_size // (plan.dp * plan.microbatch_size)


def check_layers(plan: Plan, graph) -> None:
    n = len(graph.blocks)
    if plan.num_layers and plan.num_layers != n:
        raise ApplyError(
            f"plan.num_layers={plan.num_layers} but the traced model has {n} layers in its workload chain "
            f"(head + {n - 2} blocks + tail); fix: plan for this model (a plan for another model?)")
    plan.validate(num_layers=n)
    try:
        plan.check_model(chain_fingerprint((b.kind, b.num_params) for b in graph.blocks), "the traced model")
    except PlanError as exc:
        raise ApplyError(str(exc)) from None
    if plan.pp > 1 and any(b.kind == "head" for b in graph.blocks) and n < plan.pp:
        raise ApplyError(f"pp={plan.pp} stages but only {n} layers")


def check_supported(plan: Plan) -> None:
    """ApplyError for a plan field the runtime cannot run yet (never silently ignored)."""
    unsupported = [name for name, used in (("cp", plan.cp > 1), ("dp_shard", plan.dp_shard not in (0, plan.dp)),
                                           ("loss_parallel", plan.loss_parallel), ("compile", plan.compile),
                                           ("float8", plan.float8)) if used]
    unsupported += [f"stages[{i}].recompute={s.recompute}" for i, s in enumerate(plan.stages)
                    if s.recompute not in ("none", "selective", "full")]
    if unsupported:
        raise ApplyError(f"{', '.join(unsupported)}: the runtime does not run this yet; use a plan without it")


def run_all(plan: Plan, model: nn.Module, graph, world_size: int, global_batch_size: int) -> int:
    """Every check, cheapest first; returns the number of microbatches per step."""
    check_supported(plan)
    check_world(plan, world_size)
    if graph is not None:
        check_layers(plan, graph)
    check_tp(plan, model, graph)
    check_ep(plan, model)
    nmb = check_batch(plan, global_batch_size)
    if plan.schedule == "interleaved" and nmb % plan.pp:
        raise ApplyError(f"the interleaved schedule needs num_microbatches ({nmb}) to be a multiple of pp={plan.pp}")
    if plan.pp > 1 and plan.schedule == "1f1b" and nmb < plan.pp:
        raise ApplyError(
            f"1F1B with pp={plan.pp} stages needs at least {plan.pp} microbatches per step, got {nmb}; "
            f"fix: raise num_microbatches to >= {plan.pp} or use schedule 'gpipe'")
    return nmb
