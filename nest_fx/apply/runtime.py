"""ParallelModule: the local part of a parallelised model and its training step.

``train_step(inputs, targets)`` runs one optimizer step's forward and backward for the global
batch: on a pipeline it drives the PipelineStage schedule (loss on the last stage), otherwise
it loops over the microbatches with gradient accumulation. It then synchronises data-parallel
gradients (zero=0; FSDP does it inside backward) and returns the global-batch mean loss, the
same number on every rank and equal to the single-device loss of the whole batch (for a
``loss_fn`` that averages over its microbatch, since all microbatches have the same size).

``inputs`` are what ``model(...)`` takes (a tensor, a tuple, or a dict of keyword tensors such
as HF's ``input_ids``/``decoder_input_ids``/``labels``); ``targets`` are ``loss_fn``'s second
argument, or None when ``loss_fn`` is None and the model computes its own loss (``.loss``).
Every tensor is either the global batch (every rank passes the same tensors, as with a seeded
synthetic loader) or this rank's data-parallel shard of it (``global_batch / dp`` rows, what a
DistributedSampler would give); each is split into the step's microbatches along dim 0. The caller owns the optimizer:
``opt = pm.build_optimizer(lr=3e-4)`` (the plan's optimizer and implementation) or
``opt = torch.optim.AdamW(pm.parameters())``; ``pm.train_step(x, y); opt.step(); opt.zero_grad()``.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from nest_fx.apply.agreement import SCOPE_SEP, agree
from nest_fx.apply.checkpoint import DEFAULT_KEEP, load_checkpoint, resume_checkpoint, save_checkpoint
from nest_fx.apply.checks import ApplyError
from nest_fx.apply.collective_errors import named_collective_failures
from nest_fx.apply.export_hf import save_pretrained
from nest_fx.apply.fused_params import fused_layouts, original_layout
from nest_fx.apply.parts import BatchSchedule, LocalModel, ParallelLayout, field_of
from nest_fx.apply.model_loss import model_loss
from nest_fx.apply.optimizers import build_optimizer, check_kernel, implementation, plan_optimizer
from nest_fx.apply.pipeline import schedule_step, tensor_output
from nest_fx.apply.sdpa_kernel import pinned_attention


def _counted_step(method: Callable) -> Callable:
    """``train_step`` inside :func:`named_collective_failures` (a collective that fails, because a
    peer stopped, hung or died, raises a ``CollectiveError`` naming its group and the step), and
    ``self.step`` counted."""

    @functools.wraps(method)
    def step(self, *args, **kwargs):
        with named_collective_failures(f"train_step at step {self.step}"):
            out = method(self, *args, **kwargs)
        self.step += 1
        return out

    return step


def microbatches(args: tuple, kwargs: dict, target: Optional[torch.Tensor], n: int):
    """``n`` (args, kwargs, target) microbatches: every tensor split in dim 0, other values repeated."""

    def split(value):
        return value.chunk(n) if isinstance(value, torch.Tensor) else [value] * n

    arg_parts = [split(a) for a in args]
    kw_parts = {k: split(v) for k, v in kwargs.items()}
    target_parts = split(target)
    for i in range(n):
        yield (tuple(p[i] for p in arg_parts), {k: p[i] for k, p in kw_parts.items()}, target_parts[i])


def _with_targets(inputs, targets: torch.Tensor) -> tuple:
    """The model's positional inputs followed by ``targets`` (a model computing its own loss from
    them, ``forward(idx, targets)``)."""
    if isinstance(inputs, dict):
        raise ApplyError(
            "train_step: targets given with keyword inputs and loss_fn=None; fix: pass the labels "
            "among the inputs (HF: inputs['labels']), positional inputs (forward(idx, targets) takes "
            "the targets as its next argument), or give auto_parallelize a loss_fn"
        )
    return (inputs, targets) if isinstance(inputs, torch.Tensor) else tuple(inputs) + (targets,)


class ParallelModule:
    """What :func:`nest_fx.apply.auto_parallelize` returns (see the module docstring), built from
    three objects (:mod:`nest_fx.apply.parts`): ``layout`` (:class:`ParallelLayout`), ``batching``
    (:class:`BatchSchedule`) and ``local`` (:class:`LocalModel`), whose fields are its attributes.

    Attributes: ``plan``; ``module`` (this rank's stage module, or an ``nn.ModuleList`` of its
    chunks under the interleaved schedule; parameter names are the original model's);
    ``mesh`` (DeviceMesh with dims pp/dp/tp); ``rank_info`` (stage, replica, TP rank); ``device``;
    ``num_microbatches``; ``global_batch_size``; ``loss_fn``; ``schedule`` and ``pipeline_stages``
    (pp > 1); ``context_parallel`` (cp > 1); ``chunks``; ``graph``; ``grad_sync``; ``fsdp``;
    ``materialized``; ``step`` (optimizer steps taken: the loaded checkpoint's step plus one per
    ``train_step``); ``model_specs`` (name -> (shape, dtype) of the whole model's tensors,
    recorded before the split; checkpoints fingerprint it).
    """

    plan = field_of("layout", "plan")
    mesh = field_of("layout", "mesh")
    rank_info = field_of("layout", "rank_info")
    device = field_of("layout", "device")
    global_batch_size = field_of("batching", "global_batch_size")
    num_microbatches = field_of("batching", "num_microbatches")
    loss_fn = field_of("batching", "loss_fn", settable=True)
    schedule = field_of("batching", "schedule")
    pipeline_stages = field_of("batching", "pipeline_stages")
    context_parallel = field_of("batching", "context_parallel")  # ContextParallel when plan.cp > 1
    chunks = field_of("local", "chunks")
    graph = field_of("local", "graph")
    model_specs = field_of("local", "model_specs")
    grad_sync = field_of("local", "grad_sync", settable=True)
    fsdp = field_of("local", "fsdp")
    materialized = field_of("local", "materialized")

    def __init__(self, layout: ParallelLayout, batching: BatchSchedule, local: LocalModel):
        self.layout = layout
        self.batching = batching
        self.local = local
        self.module = local.chunks[0] if len(local.chunks) == 1 else nn.ModuleList(local.chunks)
        self.step = 0
        self._agreed_optimizers: "weakref.WeakSet" = weakref.WeakSet()
        weakref.finalize(self, register_optimizer_step_pre_hook(_first_step_check(self)).remove)

    # -- parameters ------------------------------------------------------------------------
    def _named(self, kind: str) -> Iterator[Tuple[str, torch.Tensor]]:
        seen = set()
        for chunk in self.chunks:
            for name, t in getattr(chunk, kind)():
                if id(t) not in seen:
                    seen.add(id(t))
                    yield name, t

    def named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        """Local parameters under the original model's names (DTensors when sharded)."""
        return self._named("named_parameters")

    def named_buffers(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Local buffers (running statistics, position tables) under the original model's names."""
        return self._named("named_buffers")

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def full_tensors(self, grads: bool = False) -> Dict[str, torch.Tensor]:
        """{name: full (unsharded) parameter or gradient} of this rank's stage.

        A collective over the stage's TP and DP groups when parameters are DTensors: every rank
        of the stage must call it. Expert parameters are those this rank holds. Fused projections
        sharded by heads come back in the model's own layout (``apply/fused_params.py``).
        """
        out: Dict[str, torch.Tensor] = {}
        layouts = fused_layouts(self.chunks)
        for name, p in sorted(self.named_parameters(), key=lambda kv: kv[0]):
            t = p.grad if grads else p.detach()
            if t is None:
                continue
            out[name] = original_layout(t.full_tensor(), layouts.get(name)) if isinstance(t, DTensor) else t
        return out

    # -- checkpoints -----------------------------------------------------------------------
    def save(
        self,
        path: str,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        step: Optional[int] = None,
        scheduler=None,
        data=None,
        keep: Optional[int] = DEFAULT_KEEP,
        require_finite: bool = True,
        loss=None,
        scaler=None,
    ) -> str:
        """Save parameters, ``optimizer`` state, ``scheduler``, ``data`` position, gradient ``scaler`` and RNG states as a
        new step directory of the checkpoint directory ``path`` (default step: ``self.step``),
        keeping the newest ``keep``; loadable under any plan. Every rank must call it. Returns the
        step directory. See :mod:`nest_fx.apply.checkpoint`."""
        if optimizer is not None:
            self.check_optimizer(optimizer)
        return save_checkpoint(
            self,
            path,
            optimizer,
            step=self.step if step is None else step,
            scheduler=scheduler,
            data=data,
            keep=keep,
            require_finite=require_finite,
            loss=loss,
            scaler=scaler,
        )

    def load(
        self,
        path: str,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        scheduler=None,
        data=None,
        verify: bool = True,
        scaler=None,
        fallback: bool = False,
    ) -> dict:
        """Load the newest checkpoint of ``path`` (or the step directory ``path``), saved under any
        plan, into this rank's parameters (and ``optimizer``, ``scheduler``, ``data``, ``scaler``);
        returns its metadata (``step``, ``plan_summary``, ``directory``). A damaged newest
        checkpoint is refused naming the newest complete one, which ``fallback=True`` loads
        instead (saying so). Every rank must call it."""
        if optimizer is not None:
            self.check_optimizer(optimizer)
        meta = load_checkpoint(
            self, path, optimizer, scheduler=scheduler, data=data, verify=verify, scaler=scaler, fallback=fallback
        )
        self.step = int(meta.get("step") or 0)
        return meta

    def resume(
        self, path: str, optimizer: Optional[torch.optim.Optimizer] = None, *, scheduler=None, data=None, scaler=None
    ) -> int:
        """Before training: check the checkpoint directory ``path`` (writable, room for two
        checkpoints, leftovers of crashed saves removed) and load its newest checkpoint if it
        has one. Returns the step to continue from (0 for a fresh start). Every rank must call it."""
        if optimizer is not None:
            self.check_optimizer(optimizer)
        meta = resume_checkpoint(self, path, optimizer, scheduler=scheduler, data=data, scaler=scaler)
        if meta is not None:
            self.step = int(meta.get("step") or 0)
        return self.step

    def save_pretrained(
        self, directory: str, max_shard_size="5GB", *, overwrite: bool = False, dtype: Optional[torch.dtype] = None
    ) -> str:
        """Write the model in the HuggingFace format (safetensors shards of at most
        ``max_shard_size``, their index, ``config.json`` for HF models) to ``directory``, which
        ``transformers`` ``from_pretrained`` loads. Any plan; no rank holds more than one output
        file's tensors. A non-empty ``directory`` is refused unless ``overwrite=True`` (which
        replaces it as a whole); the files appear by one rename when all are written. Every rank
        must call it. See :mod:`nest_fx.apply.export_hf`."""
        return save_pretrained(self, directory, max_shard_size, overwrite=overwrite, dtype=dtype)

    def build_optimizer(self, **hyperparameters: Any) -> torch.optim.Optimizer:
        """The plan's optimizer (its constraints' ``optimizer``: adam, adamw, sgd, sgd-momentum;
        default adam) over this rank's parameters, run as its ``optimizer_kernel`` (for-loop,
        foreach, fused; '' = torch's default), with ``hyperparameters`` (``lr``, ``betas``,
        ``weight_decay``, ``momentum``...). See :mod:`nest_fx.apply.optimizers`."""
        return build_optimizer(self.parameters(), *plan_optimizer(self.plan), **hyperparameters)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer whose implementation contradicts the plan's explicit
        ``optimizer_kernel`` (:class:`~nest_fx.apply.optimizers.OptimizerError`, before any
        collective: every rank resolves it alike), then compare its type, implementation and
        hyperparameters across ranks (one all-gather):
        :class:`~nest_fx.apply.agreement.AgreementError` naming the field and the ranks when they
        differ. Runs by itself before the first ``optimizer.step()``, and in ``save``/``load``/
        ``resume``; once per optimizer."""
        if optimizer in self._agreed_optimizers:
            return
        check_kernel(optimizer, self.plan)
        with named_collective_failures("comparing the optimizer's settings across ranks"):
            agree(self._optimizer_fields(optimizer), what="the optimizer, before its first step")
        self._agreed_optimizers.add(optimizer)

    def _optimizer_fields(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """Type and defaults (every rank); each param group's hyperparameters, compared between the
        ranks holding the same parameters (replicas and TP shards of a stage)."""
        names = {id(p): n for n, p in self.named_parameters()}
        fields: Dict[str, Any] = {"optimizer": type(optimizer).__name__}
        runs = implementation(optimizer)
        if runs != "":  # '' runs nothing here (no parameter of this rank's): compared among the others
            fields["optimizer implementation"] = runs
        fields.update({f"optimizer default {k}": v for k, v in sorted(optimizer.defaults.items())})
        for i, group in enumerate(optimizer.param_groups):
            members = sorted(names.get(id(p), "?") for p in group["params"])
            scope = hashlib.sha256("\n".join(members).encode()).hexdigest()[:12]
            label = f"optimizer param_groups[{i}] (with {members[0] if members else 'no parameters'})"
            fields.update({f"{label} {k}{SCOPE_SEP}{scope}": v for k, v in sorted(group.items()) if k != "params"})
        return fields

    # -- training ------------------------------------------------------------------------
    def _shard(self, t: torch.Tensor, name: str = "inputs") -> torch.Tensor:
        g, dp = self.global_batch_size, self.plan.dp
        if t.dim() and t.size(0) == g and dp > 1:
            per = g // dp
            r = self.rank_info.replica
            return t[r * per : (r + 1) * per]
        if not t.dim() or t.size(0) != g // dp:
            rows = t.size(0) if t.dim() else "no"
            raise ApplyError(
                f"train_step: {name} has {rows} rows (shape {list(t.shape)}); expected the global batch "
                f"({g}) or this rank's data-parallel shard ({g // dp}) in dim 0; fix: pass "
                "global_batch_size rows in every tensor input"
            )
        return t

    def _batch(self, inputs) -> Tuple[tuple, dict]:
        """(args, kwargs) of this rank's rows: a tensor, a tuple/list of positional inputs, or a dict
        of keyword inputs (every tensor sharded by batch; other values passed as they are)."""
        if isinstance(inputs, torch.Tensor):
            args, kwargs = (inputs,), {}
        elif isinstance(inputs, (tuple, list)):
            args, kwargs = tuple(inputs), {}
        elif isinstance(inputs, dict):
            args, kwargs = (), dict(inputs)
        else:
            raise ApplyError(
                f"train_step: inputs must be a tensor, a tuple of model inputs or a dict of keyword "
                f"inputs, got {type(inputs).__name__}"
            )

        def local(value, name):
            return self._shard(value, name).to(self.device) if isinstance(value, torch.Tensor) else value

        return (
            tuple(local(a, f"inputs[{i}]") for i, a in enumerate(args)),
            {k: local(v, f"inputs[{k!r}]") for k, v in kwargs.items()},
        )

    def _loss(self, output, target: Optional[torch.Tensor]) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(tensor_output(output), target)
        return model_loss(output)

    @_counted_step
    def train_step(self, inputs, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward + backward of one global batch; returns the global mean loss (detached).

        ``inputs``: what ``model(...)`` takes: one tensor, a tuple of positional tensors, or a dict of
        keyword inputs (HF: ``{"input_ids": ..., "decoder_input_ids": ..., "labels": ...}``); every
        tensor holds the global batch (or this rank's data-parallel shard) in dim 0. ``targets``: the
        second argument of ``loss_fn``; with ``loss_fn=None`` the model's own loss is used (its
        ``.loss`` or the scalar of its output tuple) and ``targets``, when given, is forward's next
        positional argument (nanoGPT's ``forward(idx, targets) -> (logits, loss)``)."""
        if self.loss_fn is None and targets is not None:
            inputs, targets = _with_targets(inputs, targets), None
        if self.loss_fn is not None and targets is None:
            raise ApplyError(
                "train_step: loss_fn needs targets; fix: call train_step(inputs, targets), or "
                "auto_parallelize(..., loss_fn=None) to train on the model's own loss"
            )
        args, kwargs = self._batch(inputs)
        y = self._shard(targets, "targets").to(self.device) if targets is not None else None
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + [
            v for v in kwargs.values() if isinstance(v, torch.Tensor)
        ]
        if self.context_parallel is not None:
            if len(tensors) != 1 or y is None:
                raise ApplyError(
                    f"train_step: context parallelism splits one token tensor and its targets by "
                    f"sequence, got {len(tensors)} input tensors{'' if y is not None else ' and no targets'}; "
                    "fix: pass the token ids alone with a loss_fn, or plan with cp=1"
                )
            args, kwargs = (self.context_parallel.shard(tensors[0]),), {}
            y = self.context_parallel.shard(y)
        with pinned_attention(self.plan.attention_kernel, self.device):
            local, is_last = self._forward_backward(args, kwargs, y)
        if self.grad_sync is not None:
            self.grad_sync()
        return self._global_loss(local if is_last else None)

    def _forward_backward(self, args: tuple, kwargs: dict, y: Optional[torch.Tensor]):
        """Forward and backward of every microbatch: (this rank's mean loss or None, whether it
        holds the loss: off the last pipeline stage it does not)."""
        nmb = self.num_microbatches
        if self.schedule is not None:
            local = schedule_step(self.schedule, self.pipeline_stages, args, kwargs, y, nmb)
            return local, local is not None
        module = self.module
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for k, (mb_args, mb_kwargs, ys) in enumerate(microbatches(args, kwargs, y, nmb)):
            if self.fsdp:
                # ZeRO-1 accumulates unsharded gradients and reduce-scatters once; ZeRO-2/3
                # keep only sharded gradients, so they reduce-scatter every microbatch.
                # ZeRO-1/2 keep the gathered parameters until the last backward (one
                # all-gather per step); ZeRO-3 gathers them for every forward and backward.
                last = k == nmb - 1
                module.set_requires_gradient_sync(last or self.plan.zero >= 2)
                if self.plan.zero <= 2:
                    module.set_reshard_after_backward(last)
            loss = self._loss(module(*mb_args, **mb_kwargs), ys)
            (loss / nmb).backward()
            total += loss.detach().float()
        return total / nmb, True

    def _global_loss(self, local: Optional[torch.Tensor]) -> torch.Tensor:
        """Mean over replicas (and CP ranks) of the last stage's loss, broadcast to every rank
        (one all-reduce)."""
        value = torch.zeros((), dtype=torch.float32, device=self.device) if local is None else local.clone()
        world = dist.get_world_size()
        if world > 1:
            dist.all_reduce(value)
            tp = self.plan.stages[-1].tp
            value /= self.plan.dp * self.plan.cp * tp
        return value

    def __call__(self, *args, **kwargs):
        if self.schedule is not None:
            raise ApplyError(
                "a pipelined ParallelModule runs through train_step (the schedule); calling "
                "the local stage module directly runs one stage only: use pm.module"
            )
        if self.context_parallel is not None:
            raise ApplyError(
                "a context-parallel ParallelModule runs through train_step, which gives each rank its "
                "part of every sequence; calling it on whole sequences would read wrong positions. "
                "fix: use train_step, or a plan with cp=1 for inference"
            )
        with pinned_attention(self.plan.attention_kernel, self.device):
            return tensor_output(self.module(*args, **kwargs))

    def __repr__(self) -> str:
        i = self.rank_info
        return (
            f"ParallelModule(rank={i.rank}, stage={i.stage}/{self.plan.pp}, replica={i.replica}/{self.plan.dp}, "
            f"tp_rank={i.tp_rank}/{self.plan.stages[i.stage].tp}, ep={self.plan.ep}, zero={self.plan.zero}, "
            f"microbatches={self.num_microbatches})"
        )


def _first_step_check(pm: ParallelModule) -> Callable:
    """A global optimizer pre-step hook that runs ``pm.check_optimizer`` before the first step of
    an optimizer holding ``pm``'s parameters (weakly referenced: it dies with ``pm``)."""
    ref = weakref.ref(pm)
    param_ids = {id(p) for p in pm.parameters()}

    def hook(optimizer, args, kwargs) -> None:
        owner = ref()
        if owner is None or optimizer in owner._agreed_optimizers:
            return
        if any(id(p) in param_ids for group in optimizer.param_groups for p in group["params"]):
            owner.check_optimizer(optimizer)

    return hook
