"""The three objects a :class:`~nest_fx.apply.runtime.ParallelModule` is built from.

* :class:`ParallelLayout`: where this rank sits (the plan, its device mesh, the rank's
  coordinates, its device);
* :class:`BatchSchedule`: how ``train_step`` runs one global batch (its size, the microbatches,
  the loss, the pipeline schedule and stages, the context-parallel sequence split);
* :class:`LocalModel`: this rank's part of the model (its chunks, the trace, the whole model's
  tensor specs, how its gradients are synchronised, what was materialised).

``auto_parallelize`` fills them step by step (``nest_fx.apply.steps``); a ``ParallelModule``
exposes their fields as its attributes (``pm.plan``, ``pm.num_microbatches``, ``pm.chunks`` ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

from nest_fx.apply.mesh import RankInfo
from nest_fx.plan.plan import Plan


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits: the ``plan``, its ``mesh`` (DeviceMesh with dims pp/dp/tp, plus ep/cp/
    HSDP dims when the plan has them), the rank's coordinates ``rank_info`` and its ``device``."""

    plan: Plan
    mesh: Any
    rank_info: RankInfo
    device: torch.device


@dataclass
class BatchSchedule:
    """How one ``train_step`` runs: ``global_batch_size`` rows in ``num_microbatches`` microbatches,
    ``loss_fn`` (None: the model's own loss), the pipeline ``schedule`` over this rank's
    ``pipeline_stages`` (pp > 1) and ``context_parallel``, the rank's share of every sequence (cp > 1).
    ``loss_fn`` may be replaced (a test recording what the loss sees)."""

    global_batch_size: int
    num_microbatches: int
    loss_fn: Optional[Callable]
    schedule: Any = None
    pipeline_stages: Tuple[Any, ...] = ()
    context_parallel: Any = None


@dataclass
class LocalModel:
    """This rank's part of the model: its stage module ``chunks`` (several under the interleaved
    schedule), the model's ``graph``, ``model_specs`` (name -> (shape, dtype) of the whole model's
    tensors, recorded before the split), ``grad_sync`` (the gradient synchronisation after the
    backward: tied embeddings, replicated data parallel; None when FSDP or nothing does it),
    ``fsdp`` (FSDP2 shards the parameters) and ``materialized`` (tensors read / initialised, bytes
    this rank read; None when the model started with values). ``grad_sync`` may be replaced."""

    chunks: Tuple[nn.Module, ...]
    graph: Any
    model_specs: Optional[Dict[str, Any]]
    grad_sync: Optional[Callable[[], None]] = None
    fsdp: bool = False
    materialized: Optional[Dict[str, int]] = None


def field_of(part: str, name: str, settable: bool = False) -> property:
    """A ``ParallelModule`` attribute ``name`` read from (and, ``settable``, written to) its part ``part``."""

    def get(self):
        return getattr(getattr(self, part), name)

    def put(self, value) -> None:
        setattr(getattr(self, part), name, value)

    return property(get, put if settable else None, doc=f"``{part}.{name}`` (:mod:`nest_fx.apply.parts`)")
