"""Which modules of a model are MoE layers that expert parallelism can convert: those with an
``experts`` ModuleList and the route/dispatch/run_experts/combine steps (the zoo MoE)."""
from __future__ import annotations

from typing import List

import torch.nn as nn

def find_moe_modules(module: nn.Module) -> List[nn.Module]:
    """MoE modules: ones with ``experts`` (a ModuleList) and the route/dispatch/run_experts/combine API."""
    return [m for m in module.modules()
            if isinstance(getattr(m, "experts", None), nn.ModuleList)
            and all(callable(getattr(m, f, None)) for f in ("route", "dispatch", "run_experts", "combine"))]


def expert_parameters(module: nn.Module) -> List[nn.Parameter]:
    """Parameters of the experts of every MoE in ``module`` (the ones reduced over ``edp``)."""
    return [p for moe in find_moe_modules(module) for p in moe.experts.parameters()]
