"""Which modules of a model hold experts, and which of them expert parallelism can convert.

Two layouts are converted (``nest_fx.apply.expert_parallel``):

* the nest-fx zoo MoE: a module with an ``experts`` ``ModuleList`` and the
  route/dispatch/run_experts/combine steps (``nest_fx/models/moe.py``);
* HuggingFace ``transformers`` 5 experts modules (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek, OLMoE,
  GPT-OSS, ... every class decorated with ``use_experts_implementation``): one module whose
  parameters are stacked per expert on dim 0 (``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``,
  optional biases ``[E, ...]``), called as ``experts(hidden [T, H], top_k_index [T, k],
  top_k_weights [T, k]) -> [T, H]`` and computing, for each token, the sum over its k choices of
  expert ``e``'s output times its weight. A shared expert beside it (Qwen2-MoE) is a plain MLP
  and stays replicated.

Anything else that looks like a mixture of experts (an ``experts`` container of another shape,
e.g. older HuggingFace MoEs with a ``ModuleList`` of expert MLPs and their own loop) is reported
by :func:`unconvertible_experts`, so the planner and the runtime can refuse expert parallelism
for it by name.
"""

from __future__ import annotations

from typing import List, Tuple

import torch.nn as nn

_ZOO_STEPS = ("route", "dispatch", "run_experts", "combine")


def find_moe_modules(module: nn.Module) -> List[nn.Module]:
    """Zoo MoE modules: ones with ``experts`` (a ModuleList) and the route/dispatch/run_experts/combine API."""
    return [
        m
        for m in module.modules()
        if isinstance(getattr(m, "experts", None), nn.ModuleList)
        and all(callable(getattr(m, f, None)) for f in _ZOO_STEPS)
    ]


def is_stacked_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a HuggingFace experts module: ``num_experts`` experts whose own
    parameters are all stacked on dim 0 and the ``use_experts_implementation`` interface (its
    ``_is_expert_parallel`` flag), before or after expert parallelism converted it."""
    count = getattr(module, "_nest_fx_global_experts", None) or getattr(module, "num_experts", None)
    own = list(module.parameters(recurse=False))
    local = getattr(module, "num_experts", None)
    return (
        hasattr(module, "_is_expert_parallel")
        and isinstance(count, int)
        and count > 0
        and bool(own)
        and all(p.dim() >= 2 and p.shape[0] in (count, local) for p in own)
    )


def find_stacked_experts(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(FQN, module) of every HuggingFace stacked-experts module in ``module``."""
    return [(name, m) for name, m in module.named_modules() if is_stacked_experts(m)]


def stacked_experts_problem(name: str, module: nn.Module) -> str:
    """Why expert parallelism cannot split this stacked-experts module ("" when it can)."""
    shared = sorted(n for n, p in module.named_parameters() if "." in n)
    if shared:
        return (
            f"{name} ({type(module).__name__}) has parameters shared by all its experts ({', '.join(shared)}); "
            "expert parallelism splits only per-expert (stacked) parameters"
        )
    return ""


def expert_counts(module: nn.Module) -> List[int]:
    """Number of experts of every convertible MoE layer in ``module`` (zoo and HuggingFace)."""
    counts = [len(m.experts) for m in find_moe_modules(module)]
    counts += [getattr(m, "_nest_fx_global_experts", None) or m.num_experts for _, m in find_stacked_experts(module)]
    return counts


def expert_modules(module: nn.Module) -> List[nn.Module]:
    """The modules holding expert weights (a zoo expert MLP each; a HF stacked-experts module), the
    units FSDP shards over the expert-data-parallel group."""
    return [e for m in find_moe_modules(module) for e in m.experts] + [m for _, m in find_stacked_experts(module)]


def expert_parameters(module: nn.Module) -> List[nn.Parameter]:
    """Parameters of the experts of every MoE in ``module`` (the ones reduced over ``edp``)."""
    return [p for e in expert_modules(module) for p in e.parameters()]


def expert_module_paths(module: nn.Module) -> List[str]:
    """FQNs of the modules holding expert weights (zoo ``<moe>.experts`` lists and HF stacked
    experts): the tracer records them so the workload knows which nodes expert parallelism shards."""
    ids = {id(m): name for name, m in module.named_modules()}
    paths = [ids[id(m.experts)] for m in find_moe_modules(module) if id(m.experts) in ids]
    return paths + [name for name, _ in find_stacked_experts(module)]


def unconvertible_experts(module: nn.Module) -> List[str]:
    """FQNs of modules that hold experts in a layout expert parallelism does not convert: an
    ``experts`` container that is neither a zoo MoE's list nor HF stacked experts, or stacked experts
    with shared parameters."""
    converted = {id(m.experts) for m in find_moe_modules(module)}
    found = []
    for name, m in module.named_modules():
        if is_stacked_experts(m):
            if stacked_experts_problem(name, m):
                found.append(name)
            continue
        experts = getattr(m, "experts", None)
        if isinstance(experts, nn.Module) and id(experts) not in converted and not is_stacked_experts(experts):
            found.append(f"{name}.experts" if name else "experts")
    return found
