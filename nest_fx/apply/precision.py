"""``plan.precision``: the dtypes a step computes, stores and reduces in, under every plan.

``fp32``        nothing changes: the model trains in its own dtype (as before this field existed).
``bf16-mixed``  forward and backward in bf16, fp32 master weights, fp32 gradients (accumulation
                and data-parallel reduction) and fp32 optimizer states (the optimizer sees the
                fp32 parameters). What the cost model prices.
``bf16-true``   parameters, gradients and optimizer states in bf16.

One rule, two mechanisms that compute the same thing, and one output cast (docs/runtime.md, "Precision"):

- Where FSDP2 runs (zero >= 1, HSDP), ``bf16-mixed`` is FSDP2's ``MixedPrecisionPolicy(param_dtype=
  bf16, reduce_dtype=fp32)`` on every block and the stage root (:func:`fsdp_policy`): the fp32
  shard is cast to bf16 when it is gathered, each microbatch's bf16 gradient is cast to fp32 for
  the reduce-scatter and accumulation, and every sharded unit casts its floating inputs to bf16.
- Everywhere else (replicated DP, TP, PP, CP, EP and the single-device reference run of
  ``nest_fx.testing``) :func:`apply_precision` installs casts that do the same: a unit's
  forward sees its parameters cast to bf16 (``p.to(bfloat16)`` inside autograd, so the
  gradient of the cast lands, cast back, in the fp32 parameter's ``.grad``; a DTensor parameter
  casts as a DTensor), unit by unit as FSDP2 gathers them (each block's subtree, and the root's
  modules outside the blocks: :func:`cast_parameters_in_forward`), and the stage root and the
  blocks cast their floating inputs to bf16. A recomputed block casts again, inside its
  checkpointed region.
- The last stage's root casts its floating outputs to fp32 in both ``bf16`` modes, so the loss
  (``loss_fn``, or a HF model's logits next to its loss) is computed in fp32 from bf16 logits;
  the activations a pipeline stage hands on stay bf16.

Buffers (RoPE tables, BatchNorm statistics) keep their dtype in every mode: models cast their
tables to the activation's dtype themselves. ``bf16-true`` converts the parameters in place (the
``Parameter`` objects stay, so tied weights stay tied) and casts floating inputs as above.

BatchNorm layers keep fp32 parameters in both bf16 modes (:func:`fp32_modules`): their running
statistics are fp32 buffers, ``batch_norm`` takes a bf16 input with fp32 weights and statistics
(computing in fp32, returning bf16), and the data-parallel BatchNorm (``batchnorm.py``) computes
in fp32 anyway. Under FSDP2 each of them is its own unit without a cast (``apply_fsdp``'s
``fp32_modules``), since FSDP2 gathers a unit's parameters in one dtype.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_map

from nest_fx.plan.vocabulary import PRECISIONS

# the model trains in its own dtype: fp32, and "" (a plan that records no precision, docs/plan_format.md)
KEEPS_MODEL_DTYPE = ("fp32", "")

BF16 = torch.bfloat16


def compute_dtype(precision: str) -> Optional[torch.dtype]:
    """The dtype of forward/backward under ``precision`` (None: the model's own, for ``fp32`` and
    for ``""``, a plan that records no precision)."""
    if precision not in PRECISIONS + ("",):
        raise ValueError(f"precision {precision!r}: use one of {PRECISIONS}")
    return None if precision in KEEPS_MODEL_DTYPE else BF16


def fp32_modules(module: nn.Module, precision: str) -> List[nn.Module]:
    """The submodules of ``module`` whose parameters stay fp32 under ``precision`` (BatchNorm
    layers in both bf16 modes; none under ``fp32``)."""
    if precision in KEEPS_MODEL_DTYPE:
        return []
    return [m for m in module.modules() if isinstance(m, _BatchNorm)]


def fsdp_policy(precision: str) -> Optional[MixedPrecisionPolicy]:
    """FSDP2's policy for ``precision``: bf16 gather and compute with fp32 gradient reduction for
    ``bf16-mixed``; None otherwise (``bf16-true`` parameters are bf16 already, so FSDP2 gathers
    and reduces in bf16)."""
    if precision != "bf16-mixed":
        return None
    return MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)


def _cast_floats(dtype: torch.dtype, value: Any) -> Any:
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t,
        value,
    )


class _ParamCast:
    """Swaps the floating parameters of a set of modules for their bf16 casts and back: the
    parameters of one FSDP2-like unit (a block's subtree, or the root's modules outside the
    blocks), BatchNorm layers excepted. The fp32 ``Parameter`` objects are put back after the
    unit's forward, also when it raises."""

    def __init__(self, modules: Sequence[nn.Module], dtype: torch.dtype):
        self.modules, self.dtype = list(modules), dtype
        self.saved: List[List[Tuple[nn.Module, str, nn.Parameter]]] = []  # a stack: a unit may call itself

    def cast(self) -> None:
        swapped = []
        for m in self.modules:
            for name, p in m._parameters.items():
                if p is not None and p.is_floating_point() and p.dtype != self.dtype:
                    swapped.append((m, name, p))
                    m._parameters[name] = p.to(self.dtype)  # type: ignore[assignment]  # a tensor in autograd
        self.saved.append(swapped)

    def restore(self) -> None:
        if self.saved:
            for m, name, p in reversed(self.saved.pop()):
                m._parameters[name] = p


def cast_parameters_in_forward(root: nn.Module, block_names: Sequence[str], dtype: torch.dtype = BF16) -> None:
    """While a block of ``root`` runs its forward, its subtree's parameters are bf16 casts; while
    ``root`` runs, so are those of its modules outside the blocks (FSDP2's units).

    The cast is part of the block's own ``forward`` (replaced on the instance; call this before
    activation checkpointing wraps that ``forward``), so a recomputed block casts again inside the
    checkpointed region, op for op as in its forward (selective checkpointing matches ops by
    their order). A whole unit, not each module's own parameters: code that reads a descendant's
    weight (``self.wo.weight.dtype`` in T5's MLP, ``projection.weight.dtype`` in ViT's embeddings,
    HF's ``self.dtype``) sees bf16 as it does under FSDP2, and a weight used twice in a unit
    (tied embeddings on one stage) is cast once, its bf16 gradients summed before the cast."""
    keep = {id(m) for m in fp32_modules(root, "bf16-mixed")}
    inside = set()
    for name in block_names:
        block = root.get_submodule(name)
        members = [m for m in block.modules() if id(m) not in keep]
        inside.update(id(m) for m in block.modules())
        if members:
            _cast_in_forward(block, _ParamCast(members, dtype))
    outside = [m for m in root.modules() if id(m) not in inside and id(m) not in keep]
    cast = _ParamCast(outside, dtype)
    root.register_forward_pre_hook(lambda _m, _a: cast.cast())
    root.register_forward_hook(lambda _m, _a, _o: cast.restore(), always_call=True)


def _cast_in_forward(module: nn.Module, cast: _ParamCast) -> None:
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        cast.cast()
        try:
            return inner(*args, **kwargs)
        finally:
            cast.restore()

    module.forward = forward


def cast_inputs(module: nn.Module, dtype: torch.dtype = BF16) -> None:
    """A forward pre-hook casting the floating tensors among ``module``'s inputs to ``dtype``
    (FSDP2's ``cast_forward_inputs``)."""

    def hook(_m, args, kwargs):
        return _cast_floats(dtype, args), _cast_floats(dtype, kwargs)

    module.register_forward_pre_hook(hook, with_kwargs=True)


def cast_outputs(module: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """A forward hook casting the floating tensors of ``module``'s output (a tensor, a tuple or a
    HF ``ModelOutput``) to ``dtype``."""

    def hook(_m, _args, output):
        if hasattr(output, "keys") and hasattr(output, "__setitem__"):  # HF ModelOutput: keep its class
            for key in list(output.keys()):
                output[key] = _cast_floats(dtype, output[key])
            return output
        return _cast_floats(dtype, output)

    module.register_forward_hook(hook)


@torch.no_grad()
def _convert(params, dtype: torch.dtype, only: Callable[[torch.dtype], bool]) -> None:
    """Convert the floating ``params`` whose dtype satisfies ``only`` to ``dtype``, in place
    (``.data``: the ``Parameter`` objects, and so tied weights, stay)."""
    for p in params:
        if p.is_floating_point() and p.dtype != dtype and only(p.dtype):
            p.data = p.data.to(dtype)


def prepare_parameters(modules: Sequence[nn.Module], precision: str) -> None:
    """Before the parameters are sharded: ``bf16-true`` converts them to bf16 (BatchNorm's to fp32);
    ``bf16-mixed`` makes sure the masters are fp32 (a model loaded in bf16 or fp16 is upcast);
    ``fp32`` (and ``""``: not recorded) leaves them."""
    if precision in KEEPS_MODEL_DTYPE:
        return
    for module in modules:
        kept = fp32_modules(module, precision)
        kept_ids = {id(p) for m in kept for p in m.parameters()}
        _convert([p for m in kept for p in m.parameters()], torch.float32, lambda d: True)
        rest = [p for p in module.parameters() if id(p) not in kept_ids]
        if precision == "bf16-true":
            _convert(rest, BF16, lambda d: True)
        else:
            _convert(rest, torch.float32, lambda d: d in (torch.bfloat16, torch.float16))


def apply_precision(
    root: nn.Module, block_names: Sequence[str], precision: str, *, fsdp: bool, last_stage: bool
) -> None:
    """Install ``precision``'s casts on a stage ``root`` (the whole model for the single-device
    reference) whose layer modules are ``block_names``. ``fsdp``: FSDP2 will shard it with
    :func:`fsdp_policy` (which then casts parameters and inputs for ``bf16-mixed``).
    ``last_stage``: the root's output feeds the loss (it is cast to fp32). Call
    :func:`prepare_parameters` first (before sharding), and this before activation checkpointing
    (``activation_checkpoint.py``) wraps the blocks' ``forward``."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return
    if precision == "bf16-mixed" and not fsdp:
        cast_parameters_in_forward(root, block_names, dtype)
    if precision == "bf16-true" or not fsdp:
        kept = {id(m) for m in fp32_modules(root, precision)}  # FSDP2 gives them no cast either
        for name in block_names:
            if id(root.get_submodule(name)) not in kept:
                cast_inputs(root.get_submodule(name), dtype)
        cast_inputs(root, dtype)
    if last_stage:
        cast_outputs(root, torch.float32)


def prepare_reference(model: nn.Module, block_names: Sequence[str], precision: str) -> nn.Module:
    """The single-device run of ``precision``: the same casts as a plan without FSDP, on the whole
    model (what ``nest_fx.testing`` compares every plan with). Returns ``model``."""
    prepare_parameters([model], precision)
    apply_precision(model, block_names, precision, fsdp=False, last_stage=True)
    return model
