"""The optimizer a plan names, built and checked: the plan options ``optimizer`` (adam, adamw, sgd,
sgd-momentum) and ``optimizer_kernel`` (how torch.optim runs the step: for-loop, foreach, fused;
'' = torch's own default), both recorded in the plan's constraints and costed by
``nest_fx.cost.optimizers``.

:func:`build_optimizer` builds the ``torch.optim`` optimizer with the implementation the plan
names (``ParallelModule.build_optimizer``). :func:`implementation` says which code path a built
optimizer's step will take, resolved as torch resolves it (``foreach``/``fused`` of each param
group; both unset: ``torch.optim.optimizer._default_to_fused_or_foreach``, foreach when every
parameter is on a foreach device such as CUDA, else the for-loop), so every rank, holding
parameters of the same kind on the same kind of device, resolves the same way.
:func:`kernel_problem` is the check ``ParallelModule.check_optimizer`` runs before the ranks'
agreement: an optimizer that runs another implementation than the plan names explicitly.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch

# torch's own resolution of foreach/fused left unset (private: the one rule torch.optim applies)
from torch.optim.optimizer import _default_to_fused_or_foreach

from nest_fx.apply.checks import ApplyError
from nest_fx.cost.optimizers import kernel_value_problem
from nest_fx.solver.constraints import cost_options

# the torch.optim class of each plan optimizer name (nest_fx.plan.vocabulary.OPTIMIZER_NAMES)
TORCH_OPTIMIZERS = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "sgd-momentum": torch.optim.SGD,
}
# the torch.optim arguments that select each implementation ('': none, torch's default)
KERNEL_ARGUMENTS: Dict[str, Dict[str, bool]] = {
    "": {},
    "for-loop": {"foreach": False, "fused": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


class OptimizerError(ApplyError):
    """The optimizer does not run as the plan says (its kind, its hyperparameters, its implementation)."""


def plan_optimizer(plan) -> Tuple[str, str]:
    """(optimizer, optimizer_kernel) the plan was costed with: what its constraints record, read as
    the cost model reads them (``solver.constraints.cost_options``), else the declared defaults."""
    costed = cost_options(plan.constraints)
    return costed.optimizer, costed.optimizer_kernel


def _arguments(kernel: str) -> str:
    return ", ".join(f"{k}={v}" for k, v in KERNEL_ARGUMENTS[kernel].items()) or "neither foreach nor fused"


def build_optimizer(
    params: Iterable[torch.nn.Parameter], optimizer: str, kernel: str, **hyperparameters: Any
) -> torch.optim.Optimizer:
    """``torch.optim``'s ``optimizer`` (a plan optimizer name) over ``params``, run as ``kernel``
    (''/for-loop/foreach/fused), with ``hyperparameters`` (``lr``, ``betas``, ``weight_decay``,
    ``momentum``, ...). ``sgd`` is SGD without momentum; ``sgd-momentum`` needs ``momentum > 0``.
    :class:`OptimizerError` for what contradicts the plan."""
    if optimizer not in TORCH_OPTIMIZERS:
        raise OptimizerError(f"optimizer: {optimizer!r} is not one of {sorted(TORCH_OPTIMIZERS)}")
    problem = kernel_value_problem(kernel)  # the values the cost model prices
    if problem:
        raise OptimizerError(problem)
    chosen = sorted(k for k in ("foreach", "fused") if k in hyperparameters)
    if chosen:
        raise OptimizerError(
            f"build_optimizer: {', '.join(chosen)} given, but the plan's optimizer_kernel ({kernel!r}) chooses the "
            "implementation; fix: leave them out, or plan with --optimizer-kernel for-loop|foreach|fused"
        )
    momentum = float(hyperparameters.get("momentum", 0.0))
    if optimizer == "sgd" and momentum:
        raise OptimizerError(
            f"build_optimizer: momentum={momentum:g} given, but the plan's optimizer is sgd (no momentum buffer, "
            "costed so); fix: leave momentum out, or plan with --optimizer sgd-momentum"
        )
    if optimizer == "sgd-momentum" and momentum <= 0:
        raise OptimizerError(
            "build_optimizer: the plan's optimizer is sgd-momentum but no momentum > 0 was given; "
            "fix: pm.build_optimizer(lr=..., momentum=0.9), or plan with --optimizer sgd"
        )
    return TORCH_OPTIMIZERS[optimizer](params, **KERNEL_ARGUMENTS[kernel], **hyperparameters)


def _group_implementation(group: Dict[str, Any]) -> str:
    """The code path torch takes for one param group (``adam()`` / ``sgd()`` in torch.optim)."""
    fused, foreach = group.get("fused"), group.get("foreach")
    if fused:
        return "fused"
    if foreach:
        return "foreach"
    if fused is None and foreach is None:
        _, by_default = _default_to_fused_or_foreach(
            list(group["params"]), bool(group.get("differentiable", False)), use_fused=False
        )
        # Adam keeps the for-loop for a tensor learning rate without capturable (torch.optim.adam.adam)
        if by_default and isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable", False):
            by_default = False
        return "foreach" if by_default else "for-loop"
    return "for-loop"


def implementation(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """The implementation ``optimizer``'s step runs (``for-loop``, ``foreach``, ``fused``; groups
    that differ: their names joined by ``+``), None for an optimizer without torch's
    ``foreach``/``fused`` options (it runs its own code), '' when it holds no parameter here
    (its step runs nothing). Groups without parameters are left out: torch's default on an
    empty list would say foreach on any device, and a rank whose group is empty (a stage without
    biases, say) must resolve as the others do."""
    groups = [g for g in optimizer.param_groups if g["params"]]
    if not all("foreach" in g or "fused" in g for g in groups):
        return None
    return "+".join(sorted({_group_implementation(g) for g in groups}))


def kernel_problem(optimizer: torch.optim.Optimizer, kernel: str) -> str:
    """'' when ``optimizer`` runs as the plan's ``optimizer_kernel`` ``kernel`` says ('' accepts
    whatever torch chose), else one line naming both and the fix."""
    if not kernel:
        return ""
    runs = implementation(optimizer)
    name = type(optimizer).__name__
    if runs in (kernel, ""):
        return ""
    if runs is None:
        return (
            f"the plan's optimizer_kernel is {kernel!r} but {name} has no foreach/fused option (it runs its own "
            f"code); fix: build a torch.optim Adam/AdamW/SGD with pm.build_optimizer(...), or plan with "
            "--optimizer-kernel '' (not recorded)"
        )
    replan = runs if "+" not in runs else "''"  # param groups that run differently: only '' accepts them
    return (
        f"the plan's optimizer_kernel is {kernel!r} but this {name} runs {runs}; fix: build it with "
        f"pm.build_optimizer(...) or torch.optim.{name}(pm.parameters(), {_arguments(kernel)}, ...), or plan "
        f"with --optimizer-kernel {replan}"
    )


def check_kernel(optimizer: torch.optim.Optimizer, plan) -> None:
    """:class:`OptimizerError` when ``optimizer`` contradicts the plan's explicit ``optimizer_kernel``."""
    problem = kernel_problem(optimizer, plan_optimizer(plan)[1])
    if problem:
        raise OptimizerError(problem)
