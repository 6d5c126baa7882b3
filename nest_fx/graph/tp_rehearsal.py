"""Rehearse tensor parallelism: run each TP region on one rank's shard, on fake tensors, before training.

``tp_flow`` follows the sharded features through the traced ops, but the runtime runs the
model's *own* forward on the local shards, and that code may read a size tensor parallelism
divides from somewhere nest-fx does not localise: the input's shape (nanoGPT's ``B, T, C =
x.size()`` then ``y.view(B, T, C)``, timm's ``reshape(B, N, C)``) or an attribute outside the
head counts (``self.embed_dim``). Such a region crashes inside the user's code after training
started (``not enough values to unpack``), or, where the shapes happen to fit, would compute
something else.

:func:`tp_rehearsal_problem` catches that before any collective, with no memory and no data: on a
meta copy of the model it records the inputs each region module receives (one block per distinct
signature; the forward stops once all are seen), then runs a copy of each region with its pair's
parameters shrunk to one rank's shard, its head counts localised and its per-head inputs sliced
(what ``apply.tensor_parallel`` does), on fake tensors. A region that fails, or returns another
shape than the whole region, makes that TP degree a refusal naming the module and the error.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from nest_fx.graph.stage_modules import traced_inputs
from nest_fx.graph.stand_in import meta_copy, run_on_fake
from nest_fx.graph.tp_mha import local_forward
from nest_fx.graph.tp_regions import (
    HEAD_COUNT_ATTRS,
    block_regions,
    head_input_hook,
    localise_head_counts,
    localise_wide_norm,
    shrink_param,
)


class _AllSeen(Exception):
    """Every region's inputs are recorded: the rest of the forward is not needed."""


def _regions(graph) -> List[Tuple[str, str, Any, list]]:
    """(module FQN, kind, block, pairs) of the non-expert TP regions of one block per signature."""
    out, seen = [], set()
    for block in graph.layer_blocks:
        if block.signature in seen:
            continue
        seen.add(block.signature)
        for region, kind, pairs in block_regions(graph.pattern_of(block)):
            if kind != "expert" and pairs and not any(p.problem for p in pairs):
                out.append((block.fqn(region), kind, block, pairs))
    return out


def _spec(value: Any) -> Any:
    """Shapes and dtypes of a call's tensors (meta tensors), other values as they are."""
    return tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), value)


def _first_shape(output: Any):
    if isinstance(output, torch.Tensor):
        return tuple(output.shape)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return tuple(output[0].shape)
    return None


def _record_calls(meta: nn.Module, graph, paths: List[str]) -> Dict[str, Tuple[tuple, dict, Any]]:
    """{region FQN: (args, kwargs, output shape)} of each region's first call in a fake forward of
    ``meta`` (a meta copy of the model) fed the traced inputs; regions not reached are missing."""
    inputs = traced_inputs(graph)
    if inputs is None:
        return {}
    calls: Dict[str, Tuple[tuple, dict, Any]] = {}
    handles = []
    for path in paths:
        try:
            module = meta.get_submodule(path)
        except AttributeError:
            continue

        def pre(mod, args, kwargs, path=path):
            if path not in calls:
                calls[path] = (_spec(args), _spec(kwargs), None)

        def post(mod, args, kwargs, output, path=path):
            args_, kwargs_, shape = calls[path]
            if shape is None:
                calls[path] = (args_, kwargs_, _first_shape(output))
            if all(p in calls and calls[p][2] is not None for p in paths):
                raise _AllSeen

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            run_on_fake(meta, *inputs)
    except _AllSeen:
        pass
    except Exception:  # noqa: BLE001 - a model that does not run on fake tensors is not judged here
        pass
    finally:
        for h in handles:
            h.remove()
    return {p: c for p, c in calls.items() if c[2] is not None}


def _local_copy(region: nn.Module, path: str, kind: str, block, pairs, tp: int) -> nn.Module:
    """A copy of ``region`` as one TP rank holds it (rank 0's heads)."""
    local = copy.deepcopy(region)
    prefix = path + "." if path else ""
    for pair in pairs:
        for spec in pair.params:
            shrink_param(local, block.fqn(spec.name)[len(prefix) :], spec.dim, tp, spec.whole_size())
        for table in pair.head_tables:
            shrink_param(local, block.fqn(table)[len(prefix) :] + ".weight", 1, tp)
        for norm in pair.wide_norms:
            localise_wide_norm(local.get_submodule(block.fqn(norm)[len(prefix) :]), tp)
    if kind == "attention":
        localise_head_counts(local, tp)
    for pair in pairs:
        if pair.leaf:  # nn.MultiheadAttention runs nest-fx's head-sharded forward, as the runtime runs it
            leaf = local.get_submodule(block.fqn(pair.leaf)[len(prefix) :])
            leaf.forward = local_forward(leaf, 0, tp)
    heads = [h for pair in pairs for h in pair.head_inputs]
    if heads:
        local.register_forward_pre_hook(head_input_hook(heads, tp, 0), with_kwargs=True)
    return local


def tp_rehearsal_problem(model: nn.Module, graph, tp: int) -> str:
    """Why a TP region of ``model`` (traced as ``graph``) does not run on one rank's shard at degree
    ``tp`` (see the module docstring), or "" (also when it cannot tell: no recorded inputs)."""
    cache = graph.__dict__.setdefault("_tp_rehearsals", {})  # the planner and the checks ask per degree
    key = (id(model), tp)
    if key not in cache:
        cache[key] = _rehearse(model, graph, tp)
    return cache[key]


def _rehearse(model: nn.Module, graph, tp: int) -> str:
    regions = _regions(graph)
    if not regions:
        return ""
    meta = meta_copy(model)
    calls = _record_calls(meta, graph, [r[0] for r in regions])
    for path, kind, block, pairs in regions:
        if path not in calls:
            continue
        args, kwargs, shape = calls[path]
        try:
            local = _local_copy(meta.get_submodule(path), path, kind, block, pairs, tp)
            with torch.no_grad():
                out = _first_shape(run_on_fake(local, args, kwargs))
            error = "" if out == shape else f"it returns shape {list(out or [])} instead of {list(shape)}"
        except ValueError as exc:  # shrink_param: a degree that does not divide a parameter
            return f"tp={tp} cannot shard {path}: {exc}"
        except Exception as exc:  # noqa: BLE001 - the user's code failing on local shapes is the finding
            lines = str(exc).strip().splitlines()
            error = f"it fails with {type(exc).__name__}: {lines[0][:200] if lines else ''}"
        if error:
            return (
                f"tp={tp} cannot shard {path} ({type(meta.get_submodule(path)).__name__}): run on one rank's shard "
                f"(its linears cut to 1/{tp}, head counts divided) {error}. Its forward reads a size tensor "
                "parallelism divides from where nest-fx does not localise it: the input's shape (e.g. "
                "`B, T, C = x.size()` then `view(B, T, C)`) or an attribute other than the head counts "
                f"({', '.join(HEAD_COUNT_ATTRS)}); fix: size the views of the heads from those "
                "attributes or -1 (e.g. `y.view(B, T, -1)`), or use tp=1"
            )
    return ""
