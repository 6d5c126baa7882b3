"""Rewriter and runtime: apply a Plan to a model and train it under torchrun.

    from nest_fx.apply import auto_parallelize
    pm = auto_parallelize(model, tokens, global_batch_size=32, loss_fn=loss_fn, plan=plan)
    loss = pm.train_step(tokens, targets); opt.step(); opt.zero_grad()

Modules: ``distributed`` (the default process group and the job's timeout on every group),
``mesh`` (DeviceMesh from a plan), ``checks`` (errors before any collective), ``agreement``
(settings compared across ranks), ``collective_errors`` (a failed collective names its group),
``pipeline`` (stage ranges and schedules; the stage modules are ``nest_fx.graph.stage_modules``),
``tied_weights`` (tied embeddings on the first and last stage), ``tensor_parallel`` (TP/SP from
traced TP pairs), ``expert_parallel`` (all_to_all experts), ``context_parallel`` (sequence
chunks, K/V all-gather), ``loss_parallel`` (vocabulary-parallel cross-entropy),
``data_parallel`` (replication, FSDP2 or HSDP), ``activation_checkpoint`` (recompute policies),
``compile`` and ``float8`` (runtime options), ``checkpoint`` (saving and resuming training state
under any plan; ``checkpoint_load``: which checkpoint, verified; ``checkpoint_state``: what is in
it; ``checkpoint_files``: manifests, rotation; ``train_state``: data position, scheduler, scaler,
RNG; ``fingerprint``: the model's tensors), ``peers`` (ending stopped ranks of this host),
``runtime`` (ParallelModule; ``parts``: the objects it is built from), ``api`` (auto_parallelize:
its steps in order; ``prepare``: plan, checks and agreement before the mesh; ``steps``: the
rewrites), ``launch`` (N local ranks without torchrun), ``losses``. See docs/runtime.md.
"""

from nest_fx.apply.agreement import AgreementError
from nest_fx.apply.api import auto_parallelize
from nest_fx.apply.checkpoint import (
    CheckpointDamaged,
    CheckpointError,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from nest_fx.apply.checks import ApplyError
from nest_fx.apply.collective_errors import CollectiveError
from nest_fx.apply.distributed import collective_timeout_s, init_distributed, plan_rank_of
from nest_fx.apply.expert_parallel import all_to_all
from nest_fx.apply.mesh import build_mesh, locate
from nest_fx.apply.prepare import default_plan
from nest_fx.apply.runtime import ParallelModule
from nest_fx.apply.train_state import EpochBatches
from nest_fx.plan.summary import plan_summary

__all__ = [
    "auto_parallelize",
    "ParallelModule",
    "ApplyError",
    "build_mesh",
    "locate",
    "default_plan",
    "collective_timeout_s",
    "init_distributed",
    "plan_rank_of",
    "plan_summary",
    "all_to_all",
    "CheckpointError",
    "CheckpointDamaged",
    "save_checkpoint",
    "load_checkpoint",
    "resume_checkpoint",
    "AgreementError",
    "CollectiveError",
    "EpochBatches",
]
