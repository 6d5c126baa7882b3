"""Stand-ins for the modules a pipeline stage does not own.

A stage runs the model's own forward (``nest_fx.graph.stage_modules``), so a module another stage owns is
still *called* there: an embedding on a later stage, the layers before the stage's first one.
:class:`StandIn` takes its place: it computes nothing and returns tensors shaped like the real
module's output, filled with NaN. The shapes come from running a parameter-free copy of the
module on fake tensors (once per input signature). NaN is deliberate: a stage discards
these values (its first layer's input is replaced by the activation it received), so if a split
ever let one of them reach a real computation, the loss would be NaN instead of a plausible
wrong number.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn as nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only

from nest_fx.common.errors import NestFxError


class SplitError(NestFxError, ValueError):
    """A pipeline stage cannot be built or run as its block range requires."""


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers live on the meta device (no memory).

    Parameters and buffers are swapped for meta tensors through the deepcopy memo, so the real
    ones are never copied; ties inside the module stay tied."""
    memo: Dict[int, Any] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for _, b in module.named_buffers(remove_duplicate=False):
        if id(b) not in memo:
            memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def _poison(dtype: torch.dtype):
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max  # an index out of every range


def _signature(value: Any) -> Tuple:
    leaves, spec = tree_flatten(value)
    key = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append(("T", tuple(leaf.shape), leaf.dtype))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            key.append(leaf)
        else:
            key.append(type(leaf).__qualname__)
    return (str(spec), tuple(key))


def run_on_fake(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` on fake meta-device copies of the tensors in the inputs: shapes and
    dtypes only, no memory, no values. Runs under a ``FakeTensorMode`` (the active one, when
    called inside another fake run) so that tensors the function creates are fake too; code that
    checks values when not tracing (HF's mask helpers) sees fake tensors and skips the check,
    as under ``torch.export``. Real and meta parameters are accepted as inputs."""
    mode = detect_fake_mode()
    entered = mode is None
    if entered:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        mode.__enter__()
    try:
        fargs, fkwargs = tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"),
                                       (args, kwargs))
        return fn(*fargs, **fkwargs)
    finally:
        if entered:
            mode.__exit__(None, None, None)


class OutputShapes:
    """The output structure of one module per input signature, learned on its meta copy.

    Shared by every stand-in of that module (interleaved chunks each hold their own stand-in)
    and of the layers traced identical to it (same block signature: same ops and shapes)."""

    def __init__(self, original: nn.Module, path: str):
        self.path = path
        self.meta = meta_copy(original)
        self.templates: Dict[Tuple, Any] = {}

    def template(self, args: tuple, kwargs: dict) -> Any:
        """The module's output for these inputs, as meta tensors."""
        key = _signature((args, kwargs))
        if key not in self.templates:
            try:
                with torch.no_grad():
                    self.templates[key] = run_on_fake(self.meta, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - any failure means the stage cannot be built
                raise SplitError(
                    f"pipeline: the stand-in for {self.path} (a module another stage owns) runs a copy of it on "
                    f"fake tensors to learn its output shape, and that failed: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}. The module's forward needs real data "
                    "(data-dependent shapes or Python branches on values); fix: use pp=1") from exc
        return self.templates[key]


class StandIn(nn.Module):
    """Takes the place of the module at ``path`` on a stage that does not own it (module docstring).

    Holds no parameters or buffers of its own; ``register_shared`` adds a parameter this stage
    owns through another module (a tied weight), so the stage's parameter names stay those of
    the whole model."""

    def __init__(self, shapes: OutputShapes, path: str):
        super().__init__()
        self.__dict__["shapes"] = shapes  # not a submodule: its meta copy holds no state of the stage
        self.path = path

    def register_shared(self, name: str, param: nn.Parameter) -> None:
        """Register ``param`` at the relative path ``name`` (``word_embeddings.weight``)."""
        owner: nn.Module = self
        *parents, leaf = name.split(".")
        for part in parents:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        owner.register_parameter(leaf, param)

    def outputs(self, args: tuple, kwargs: dict) -> Any:
        """NaN-filled real tensors shaped like the module's output for these inputs."""
        template = self.shapes.template(args, kwargs)
        device = next((t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)),
                      torch.get_default_device())
        return tree_map(lambda t: torch.full(t.shape, _poison(t.dtype), dtype=t.dtype, device=device)
                        if isinstance(t, torch.Tensor) else t, template)

    def forward(self, *args, **kwargs):
        return self.outputs(args, kwargs)

    def extra_repr(self) -> str:
        return f"stand-in for {self.path}"
