"""The CUDA caching allocator's segment mode the plan was costed with (``allocator_segments``).

nest-fx's cost model prices what PyTorch's caching allocator reserves beyond the live tensors per
segment mode (``nest_fx.cost.allocator``, measured on an H100): ``expandable`` (the default;
PyTorch's ``expandable_segments:True``, which keeps about 0.4 of the largest working set cached
where the fixed segments keep about 0.9 of it and 3% of everything) or ``fixed`` (PyTorch's own
default). Before the device mesh is built the runtime turns on the mode the plan's constraints
record (``expandable`` when they record none) through PyTorch's allocator-settings call,
which applies to the segments allocated from then on. A user's ``PYTORCH_CUDA_ALLOC_CONF`` (or
``PYTORCH_ALLOC_CONF``) that names ``expandable_segments`` is their choice and is kept; one that
contradicts the costed mode is refused, naming the fix, since the plan's memory was priced for
the other allocator.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

import torch

from nest_fx.apply.checks import ApplyError
from nest_fx.plan import Plan
from nest_fx.solver.constraints import cost_options

ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def costed_segments(plan: Plan) -> str:
    """The segment mode ``plan`` was costed with: its constraints' ``allocator_segments``, read as
    the cost model reads them (``solver.constraints.cost_options``), else the setting's default
    (``expandable``)."""
    return cost_options(plan.constraints).allocator_segments


def configured_expandable(environ: Mapping[str, str]) -> Optional[bool]:
    """Whether the user's allocator configuration turns expandable segments on (True) or off
    (False); None when it does not name them (PyTorch's ``key:value`` pairs, comma-separated)."""
    for name in ALLOC_CONF_VARIABLES:
        for pair in environ.get(name, "").split(","):
            key, _, value = pair.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() in ("true", "1")
    return None


def use_costed_segments(plan: Plan, device_type: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """On CUDA, the allocator setting that turns on ``plan``'s costed segment mode ('' when the
    user's configuration already names it, or off CUDA), applied; ApplyError when the user's
    configuration contradicts it."""
    if device_type != "cuda":
        return ""
    want = costed_segments(plan) == "expandable"
    mine = configured_expandable(os.environ if environ is None else environ)
    if mine is not None and mine != want:
        other = "expandable" if mine else "fixed"
        raise ApplyError(
            f"the plan's memory was costed with the CUDA caching allocator's {costed_segments(plan)} segments, "
            f"but PYTORCH_CUDA_ALLOC_CONF sets expandable_segments:{mine}; fix: re-plan with "
            f"--allocator-segments {other}, or drop expandable_segments from PYTORCH_CUDA_ALLOC_CONF"
        )
    if mine is not None:
        return ""
    text = f"expandable_segments:{want}"
    _set_allocator_settings(text)
    return text


def _set_allocator_settings(text: str) -> None:
    # newer torch names it on the accelerator API (2.13 warns that the CUDA spelling is deprecated)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(text)
