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
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

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
    duplicate = copy.deepcopy(module, memo)
    for sub in duplicate.modules():
        config = sub.__dict__.get("config")
        if getattr(config, "_experts_implementation", None) == "grouped_mm":
            # on the meta device torch's grouped_mm accepts bf16 only (its CPU kernel takes fp32 too);
            # batched_mm gives the same output shapes with ops that run on meta for every dtype
            config._experts_implementation = "batched_mm"
    return duplicate


def _poison(dtype: torch.dtype):
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max  # an index out of every range


def _signature(value: Any) -> Any:
    """A hashable key of a module call's inputs: tensor shapes and dtypes, literal values, and the
    types of other objects (a hand-written walk: the stand-ins run on every microbatch)."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_signature(v) for v in value))
    if isinstance(value, dict):
        return (type(value), tuple((k, _signature(v)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__qualname__


def _device_of(value: Any) -> Optional[torch.device]:
    """The device of the first tensor in a call's inputs."""
    if isinstance(value, torch.Tensor):
        return value.device
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return next((d for d in map(_device_of, items) if d is not None), None)


def _poisoned(template: Any, device: torch.device) -> Any:
    """Real tensors of the template's shapes and dtypes, filled with :func:`_poison`."""
    if isinstance(template, torch.Tensor):
        return torch.full(template.shape, _poison(template.dtype), dtype=template.dtype, device=device)
    if isinstance(template, (tuple, list)) and type(template) in (tuple, list):
        return type(template)(_poisoned(t, device) for t in template)
    return tree_map_only(torch.Tensor, lambda t: _poisoned(t, device), template)


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
        fargs, fkwargs = tree_map_only(
            torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), (args, kwargs)
        )
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
                    f"{str(exc).splitlines()[0] if str(exc) else ''} (a forward that needs real values, such as "
                    "data-dependent shapes, cannot run there); fix: use pp=1"
                ) from exc
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

    def __getattr__(self, name: str) -> Any:
        """What the stage does not hold, read from the module's meta copy: root code reading an
        attribute of a module another stage owns (HF ViT casts its pixels to
        ``embeddings.patch_embeddings.projection.weight.dtype`` on every stage) gets the original's
        value, on meta, instead of failing on the stand-in. Values and submodules only: a method
        (``reset_parameters``) stays missing, so code probing for one skips the stand-in."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            shapes = self.__dict__.get("shapes")
            if shapes is None or name.startswith("__"):
                raise
            value = getattr(shapes.meta, name)
            if callable(value) and not isinstance(value, nn.Module):
                raise  # a method (reset_parameters, ...) is the stand-in's to lack: probes must not run the copy's
            return value

    def register_shared(self, name: str, param: nn.Parameter) -> None:
        """Register ``param`` at the relative path ``name`` (``word_embeddings.weight``)."""
        owner: nn.Module = self
        *parents, leaf = name.split(".")
        # straight into the registries: hasattr (add_module's and register_parameter's check) would
        # find the meta copy's attribute of that name through __getattr__
        for part in parents:
            if part not in owner._modules:
                owner._modules[part] = nn.Module()
            owner = owner._modules[part]
        owner._parameters[leaf] = param

    def outputs(self, args: tuple, kwargs: dict) -> Any:
        """NaN-filled real tensors shaped like the module's output for these inputs."""
        device = _device_of((args, kwargs)) or torch.get_default_device()
        return _poisoned(self.shapes.template(args, kwargs), device)

    def forward(self, *args, **kwargs):
        return self.outputs(args, kwargs)

    def extra_repr(self) -> str:
        return f"stand-in for {self.path}"
