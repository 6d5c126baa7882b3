"""The weights ``norm_kernel=memory-efficient`` norms train from, refused with zero entries on every rank.

The output-saving norm (``apply/output_saving_norm.py``) recovers its input as ``y / weight``: a
weight entry exactly 0 would give NaN gradients from the first step. Where the values come from
decides where they are checked (docs/runtime.md, "Norms that keep their output"):

* the model's values as built (no ``weights=``): the weight as it is, in ``prepare``;
* ``weights=`` (safetensors, a torch state dict): the whole weight of every norm read from the
  file (one 1-D tensor per norm: kilobytes), in ``prepare``, before anything is materialised;
* a model started on ``meta`` without ``weights=`` (or a norm weight the file does not hold): the
  weight as ``materialize`` will initialise it, computed whole on the rank's device under the same
  seeded generators (:func:`~nest_fx.apply.materialize.initial_value`), so the values checked
  are the values trained;
* a nest-fx checkpoint (``weights=CKPT``, ``ParallelModule.load`` / ``resume``): its values come
  through DCP after the model is built, each rank its own shard; :func:`check_loaded_weights`
  checks each rank's swapped norms after the load and the ranks agree (one small all-gather).

The first three run in ``prepare`` before the first collective, on every rank, over every norm
of the whole model (not only the rank's stage or shard): every rank reads the same file or draws
the same values, so every rank takes the same decision without communicating.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import torch.nn as nn

from nest_fx.apply.agreement import agree
from nest_fx.apply.fused_norms import MEMORY_EFFICIENT, memory_efficient_norms, output_saving_norms
from nest_fx.apply.hf_names import Direct, read_box
from nest_fx.apply.materialize import LoadedWeights, clean_name, initial_value
from nest_fx.apply.output_saving_norm import ZeroNormWeightError, zero_weight_problem


def check_start_weights(
    model: nn.Module,
    norm_kernel: str,
    *,
    loaded: Optional[LoadedWeights],
    skeleton: Optional[nn.Module],
    device: torch.device,
    init_seed: int,
) -> None:
    """Under ``memory-efficient``: :class:`ZeroNormWeightError` naming the first norm of ``model``
    the swap would take whose starting weight has zero entries, and where the values come from
    (module docstring). ``loaded``: ``weights=`` opened (``materialize.prepare_weights``);
    ``skeleton``: the model started on meta (None: it has values); ``device``: where the rank
    materialises (the initialisation's values depend on the kind of device)."""
    for name, norm in memory_efficient_norms(model, norm_kernel):
        value, where = _start_value(f"{name}.weight", norm, loaded, skeleton, device, init_seed)
        problem = zero_weight_problem(name, value, where)
        if problem:
            raise ZeroNormWeightError(problem)


def _start_value(
    param: str,
    norm: nn.Module,
    loaded: Optional[LoadedWeights],
    skeleton: Optional[nn.Module],
    device: torch.device,
    init_seed: int,
) -> Tuple[Optional[torch.Tensor], str]:
    """(the values the norm weight ``param`` starts training from, where they come from), the
    choice ``materialize`` makes: the file, else (a meta start) the initialisation, else the
    model's. (None, '') for a nest-fx checkpoint: :func:`check_loaded_weights` checks after the load."""
    if loaded is not None and loaded.checkpoint:
        return None, ""
    source = loaded.resolution.source(param) if loaded is not None else None
    if source is not None:
        value = read_box(loaded.reader, source, [0] * len(source.shape), list(source.shape))
        where = f" in weights={loaded.path}"
        if isinstance(source, Direct):
            where += f" (tensor {source.key} of {os.path.basename(loaded.reader.file_of(source.key))})"
        return value, where
    if skeleton is not None:
        return initial_value(skeleton, param, device, init_seed), (
            f" the model's initialisation gives (started on meta, init_seed={init_seed})"
        )
    return norm.weight, ""


def check_loaded_weights(target, source: str) -> None:
    """After a checkpoint was loaded into ``target`` (a ``ParallelModule``) whose plan has
    ``norm_kernel=memory-efficient``: :class:`ZeroNormWeightError` on every rank when the loaded
    weight of a swapped norm has zero entries on any rank (each rank checks its own stage and
    shard; one all-gather on the default group decides). Nothing (no collective) under other plans."""
    plan = getattr(target, "plan", None)
    if plan is None or (plan.norm_kernel or "") != MEMORY_EFFICIENT:
        return
    problem = ""
    for chunk in target.chunks:
        for name, norm in output_saving_norms(chunk):
            problem = problem or zero_weight_problem(clean_name(name), norm.weight, f" loaded from {source}")
    error = ZeroNormWeightError(problem) if problem else None
    agree({}, what=f"checking the norm weights loaded from {source}", error=error, error_cls=ZeroNormWeightError)
