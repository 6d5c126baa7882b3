"""ParallelStyles for the layouts the ecosystem uses, driven by the traced ``TPParam`` s.

* :class:`ColumnShard` / :class:`RowShard`: ``ColwiseParallel`` / ``RowwiseParallel`` for any
  module that only projects (``nn.Linear``, HF ``Conv1D`` whose weight is ``[in, out]``, a module
  computing ``x @ self.weight.T``): each listed parameter is sharded along the dim the tracer
  found for it, fused parts each on their own (:mod:`nest_fx.apply.fused_params`). The module's
  own forward runs on DTensors, as with torch's styles, so any projection code DTensor supports
  works, and the input/output handling (replicated input, local or sequence-sharded output) is
  torch's.
* :class:`LocalShards`: a module holding a whole pair as raw parameters (HF experts stored as
  3-D ``gate_up_proj``/``down_proj`` tensors). Its parameters are DTensors between steps; during
  its forward they are swapped for their local shards, so its own code (grouped/batched matmuls,
  token gathers) runs unchanged on one rank's slice of every expert. Its floating-point inputs
  pass through :func:`copy_to_tp` (identity forward, gradient all-reduced over TP) and its
  output through :func:`reduce_from_tp` (all-reduce forward): Megatron's f and g.
* :class:`HeadParams`: per-head parameters of an attention region's own module (Swin's relative
  position bias table), sharded by heads and swapped for their local shards during its forward.
"""

from __future__ import annotations

import contextlib
import functools
from functools import partial
from typing import Dict, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from nest_fx.apply.fused_params import FusedLayout, register_layout
from nest_fx.graph.opgraph import TPParam
from nest_fx.graph.tp_mha import local_forward


def shard_parameter(module: nn.Module, name: str, spec: TPParam, mesh: DeviceMesh) -> None:
    """Replace ``module.<name>`` (identical on the TP ranks) by this rank's shard as a DTensor."""
    param = module.get_parameter(name)
    owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
    leaf = name.rpartition(".")[2]
    tp, rank = mesh.size(), mesh.get_local_rank()
    dim = spec.dim % param.dim()
    if len(spec.parts) > 1:
        layout = FusedLayout(dim=dim, parts=tuple(spec.parts), tp=tp, whole=tuple(spec.whole))
        local = layout.local(param.detach(), rank)
        register_layout(owner, leaf, layout)
    else:
        local = param.detach().chunk(tp, dim)[rank].contiguous()
    dist_param = nn.Parameter(
        DTensor.from_local(local, mesh, [Shard(dim)], run_check=False), requires_grad=param.requires_grad
    )
    owner.register_parameter(leaf, dist_param)


def _replicate_parameter(module: nn.Module, name: str, mesh: DeviceMesh) -> None:
    param = module.get_parameter(name)
    module.register_parameter(
        name,
        nn.Parameter(
            DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False), requires_grad=param.requires_grad
        ),
    )


class ColumnShard(ColwiseParallel):
    """``ColwiseParallel`` for any projecting module: shards ``params`` ({name: TPParam})."""

    def __init__(self, params: Dict[str, TPParam], **kwargs):
        super().__init__(**kwargs)
        self.params = params

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name == "":
            for pname, spec in self.params.items():
                shard_parameter(module, pname, spec, mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class RowShard(RowwiseParallel):
    """``RowwiseParallel`` for any projecting module: shards ``params`` along their input-feature
    dim; every other parameter (the bias, added once after the reduction) stays replicated."""

    def __init__(self, params: Dict[str, TPParam], **kwargs):
        super().__init__(**kwargs)
        self.params = params

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name != "":
            return
        for pname, _ in list(module.named_parameters()):
            if pname in self.params:
                shard_parameter(module, pname, self.params[pname], mesh)
            else:
                _replicate_parameter(module, pname, mesh)

    @staticmethod
    def _local_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        # the reduced output comes back as a view made inside an autograd Function, which autograd
        # forbids updating in place; blocks do (Falcon's parallel attention: mlp_output += attn_output)
        return out.clone() if use_local_output and out._is_view() else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._local_output_fn, self.output_layouts, self.use_local_output),
        )


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; the gradient is summed over the TP group (each rank's is partial)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of the TP ranks' partial results forward; the gradient passes through unchanged."""
    return _ReduceFromTP.apply(x, group)


@contextlib.contextmanager
def local_parameters(module: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Swap the DTensor parameters ``names`` of ``module`` for their local shards (differentiable:
    their gradients land in the DTensor parameters) while the block runs. The swap is undone in
    ``finally``, not in a forward hook: a non-reentrant activation checkpoint stops its
    recomputation with an exception once it has what it needs."""
    held = {n: module._parameters[n] for n in names}
    try:
        for n, p in held.items():
            module._parameters[n] = p.to_local() if isinstance(p, DTensor) else p
        yield
    finally:
        module._parameters.update(held)


class LocalShards(ParallelStyle):
    """Shard a module's own parameters (``params``) and run its forward on the local shards; its
    output is the sum of the ranks' partial outputs (see the module docstring)."""

    reduce = True  # the module holds a whole pair: its inputs are copied to, its output reduced over, TP

    def __init__(self, params: Dict[str, TPParam]):
        super().__init__()
        self.params = params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for pname, spec in self.params.items():
            shard_parameter(module, pname, spec, device_mesh)
        group = device_mesh.get_group()
        names = list(self.params)
        inner = module.forward

        def fix(value):
            if not self.reduce:
                return value
            return copy_to_tp(value, group) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            with local_parameters(module, names):
                output = inner(*(fix(a) for a in args), **{k: fix(v) for k, v in kwargs.items()})
            if not self.reduce:
                return output
            if not isinstance(output, torch.Tensor):
                raise TypeError(
                    f"{type(module).__name__} returned {type(output).__name__}; tensor parallelism on "
                    "local shards needs a module that returns one tensor"
                )
            return reduce_from_tp(output, group)

        module.forward = forward
        return module


class HeadParams(LocalShards):
    """Shard per-head parameters a TP region's own module holds (Swin's
    ``relative_position_bias_table``, [entries, heads]) by heads, and run the module's forward on
    its local shards: each rank looks up its own heads' entries. The module's projections are the
    pair's column and row linears (sharded by their own styles), so its inputs and output are
    left as they are; each shard's gradient comes from its own heads only, as a column's does."""

    reduce = False


class _SumWholeRows(torch.autograd.Function):
    """Identity forward; backward sums the gradient's ``rows`` (along ``dim``) over the TP group."""

    @staticmethod
    def forward(ctx, weight, dim, rows, group):
        ctx.dim, ctx.rows, ctx.group = dim, rows, group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        part = grad.index_select(ctx.dim, ctx.rows).contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad.index_copy_(ctx.dim, ctx.rows, part)
        return grad, None, None, None


class SharedHeadsColumn(ParallelStyle):
    """The column of a multi-query projection (Falcon's ``query_key_value``: query heads, then one
    key and one value head they all share; ``graph/tp_multi_query.py``). Its query rows are sharded
    by heads and its shared rows kept whole on every rank (``FusedLayout.whole``), and its own
    forward runs on the local shards: each rank computes its query heads and the whole key and
    value. The whole rows' gradient on a rank covers its own query heads only, so it is summed
    over the TP group; the input's gradient is too (Megatron's f), as a column's is."""

    def __init__(self, params: Dict[str, TPParam]):
        super().__init__()
        self.params = params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        rows: Dict[str, tuple] = {}
        for name, spec in self.params.items():
            shard_parameter(module, name, spec, device_mesh)
            layout = FusedLayout(
                dim=spec.dim % module.get_parameter(name).dim(),
                parts=tuple(spec.parts),
                tp=device_mesh.size(),
                whole=tuple(spec.whole),
            )
            rows[name] = (layout.dim, torch.tensor(layout.whole_rows(), dtype=torch.long))
        names = list(self.params)
        inner = module.forward

        def replicated(value):
            if isinstance(value, DTensor):  # sequence parallel: the region gathered its input
                return value.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return copy_to_tp(value, group)
            return value

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            with local_parameters(module, names):
                for name in names:
                    dim, index = rows[name]
                    local = module._parameters[name]
                    module._parameters[name] = _SumWholeRows.apply(local, dim, index.to(local.device), group)
                return inner(*(replicated(a) for a in args), **{k: replicated(v) for k, v in kwargs.items()})

        module.forward = forward
        return module


class MultiheadShard(ParallelStyle):
    """Shard an ``nn.MultiheadAttention`` by heads (``params``: {name: TPParam} relative to it: q, k
    and v of ``in_proj_*`` by heads, ``out_proj.weight`` by input features; ``out_proj.bias`` stays
    whole) and run ``graph.tp_mha.head_sharded_forward`` in place of its forward, with Megatron's
    f and g over the TP group (torch's own forward cannot run on a shard)."""

    def __init__(self, params: Dict[str, TPParam]):
        super().__init__()
        self.params = params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, spec in self.params.items():
            shard_parameter(module, name, spec, device_mesh)
        group = device_mesh.get_group()
        comms = (partial(copy_to_tp, group=group), partial(reduce_from_tp, group=group))
        module.forward = local_forward(module, device_mesh.get_local_rank(), device_mesh.size(), comms)
        return module
