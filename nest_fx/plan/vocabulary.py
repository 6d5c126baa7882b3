"""The names a plan is written in: schedules, placements, recompute policy forms, optimizers,
and the checks of one value a setting or a constraint's list may hold (``*_problem``).

Shared by the plan (``plan.py``) and the user constraints on it (``constraints.py``).
"""

from __future__ import annotations

import math
import re

from nest_fx.common.fileio import brief
from nest_fx.common.limits import MAX_COUNT
from nest_fx.common.names import close_matches

SCHEDULES = ("1f1b", "interleaved", "gpipe", "interleaved-zb", "zbv", "dualpipev")
# v model chunks per device laid round-robin along the chain (v >= 2, ``interleaved:V``)
CHUNKED_SCHEDULES = ("interleaved", "interleaved-zb")
# two chunks per device laid in a V: device i holds chunks i and 2p - 1 - i (torch's style="v")
V_SCHEDULES = ("zbv", "dualpipev")
# the backward split into an input-gradient and a weight-gradient pass (zero-bubble schedules)
SPLIT_BACKWARD_SCHEDULES = ("interleaved-zb", "zbv", "dualpipev")
PLACEMENTS = ("stage-major", "replica-major")
# (schedule, ANY_INTERLEAVE) in the planner's schedules: every interleave factor from 2 to the layers of the
# shortest stage (the search expands it)
ANY_INTERLEAVE = 0
PRECISIONS = ("fp32", "bf16-mixed", "bf16-true")  # see Plan.precision and docs/plan_format.md
# the training dtype a precision computes in (activations, matmul rate): simulate rebuilds the
# workload of a plan file in it
DTYPE_OF_PRECISION = {"fp32": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16"}
# kernel backends a plan is costed with (nest_fx.workload.kernels.KERNEL_BACKENDS, the same names)
KERNELS = ("eager", "compile", "fused")
# the fused attention kernels of PyTorch's SDPA a plan may pin (nest_fx.workload.roofline.SDPA_ATTENTION)
ATTENTION_KERNELS = ("cudnn", "flash")
# how the runtime runs the RMSNorms F.rms_norm computes (nest_fx.graph.rms_norms): PyTorch's fused op, the
# model's code, or keeping the norm's output for backward instead of its input (nest_fx.apply.fused_norms)
NORM_KERNELS = ("fused", "model", "memory-efficient")
# how the runtime runs the loss on full logits: the loss function as given, or torch.compile'd (its fused
# cross entropy keeps the logits instead of fp32 log-probabilities; nest_fx.apply.compile.compile_loss)
LOSS_KERNELS = ("eager", "compile")
# the CUDA caching allocator's segment modes (costed in nest_fx.cost.allocator, set by apply/allocator.py)
ALLOCATOR_SEGMENTS = ("expandable", "fixed")
# how a token's k experts spread over the experts (costed in nest_fx.workload.expert_dispatch)
EXPERT_ROUTINGS = ("uniform", "contiguous")
# what an expert all-to-all sends (nest_fx.workload.expert_dispatch): a row per routed pair or
# capacity slot, or a token once per rank owning one of its experts (DeepEP's)
EXPERT_DISPATCHES = ("slots", "per-rank")
# what a pipelined runtime keeps of each chunk's output until its backward (costed in nest_fx.cost.memory):
# all of it, its sequence shard under sequence parallelism (nest-fx, torchtitan), or nothing (Megatron-LM)
STAGE_OUTPUTS = ("full", "sharded", "freed")
# how data parallelism holds the model states it shards (costed in nest_fx.cost.memory): FSDP2's units
# (nest-fx, torchtitan) or Megatron-LM's distributed optimizer (whole bf16 buffers, sharded fp32 states)
STATE_BUFFERS = ("fsdp", "distributed-optimizer")
OPTIMIZER_NAMES = ("adam", "adamw", "sgd", "sgd-momentum")  # costed in nest_fx.cost.optimizers.OPTIMIZERS
# how torch.optim runs the optimizer's step (its foreach= / fused= arguments; torchtitan's names):
# costed in nest_fx.cost.optimizers.KERNEL_FIGURES
OPTIMIZER_KERNELS = ("for-loop", "foreach", "fused")
RECOMPUTE_FORMS = "none, selective, full, op (or op:<policy>) or every:<k> (k >= 2)"
RECOMPUTE_NAMES = ("none", "selective", "full", "op", "every")  # for close matches
_RECOMPUTE = re.compile(r"^(none|selective|full|op|op:[a-z0-9_-]+|every:([2-9]|[1-9][0-9]+))$")


def recompute_problem(value: object) -> str:
    """'' when ``value`` is a recompute policy name a plan may hold, else what is wrong.

    ``none``; ``full`` (every block recomputed); ``selective`` (the attention core, Korthikanti
    et al. 2022); ``op`` / ``op:<policy>`` (op-level selective checkpointing under a named policy
    over op kinds; ``op`` is the default policy); ``every:<k>`` (every k-th block of the stage
    fully recomputed). Whether a policy name is known is the cost model's and the runtime's to
    check; this checks the form.
    """
    if isinstance(value, str) and _RECOMPUTE.match(value):
        return ""
    return f"{brief(value)} is not a recompute policy{close_matches(value, RECOMPUTE_NAMES)}; use {RECOMPUTE_FORMS}"


def model_chunks(schedule: str, virtual_stages: int) -> int:
    """Model chunks each device runs under ``schedule``: ``virtual_stages`` for the chunked
    schedules, 2 for the V schedules, else 1."""
    if schedule in CHUNKED_SCHEDULES:
        return virtual_stages
    return 2 if schedule in V_SCHEDULES else 1


def schedule_problem(value: object) -> str:
    """'' when ``value`` names a schedule (``interleaved:V`` / ``interleaved-zb:V`` with V >= 2
    for a fixed interleave factor), else what is wrong."""
    if isinstance(value, str):
        name, _, v = value.partition(":")
        if name in SCHEDULES and not v:
            return ""
        if name in CHUNKED_SCHEDULES and v.isdigit() and 2 <= int(v) <= MAX_COUNT:
            return ""
    return (
        f"{brief(value)} is not a schedule{close_matches(value, SCHEDULES)}; use {', '.join(SCHEDULES)}, "
        "interleaved:V or interleaved-zb:V (V >= 2 model chunks)"
    )


def placement_problem(value: object) -> str:
    """'' when ``value`` names a placement, else what is wrong."""
    return "" if value in PLACEMENTS else f"{brief(value)} is not a placement; use one of {list(PLACEMENTS)}"


def zero_problem(value: object) -> str:
    """'' when ``value`` is a ZeRO stage (0..3), else what is wrong."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3
    return "" if ok else f"{brief(value)} is not a ZeRO stage; use 0, 1, 2 or 3"


def microbatch_size_problem(value: object) -> str:
    """'' when ``value`` is a microbatch size (an integer 1..MAX_COUNT), else what is wrong."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_COUNT
    return "" if ok else f"{brief(value)} is not a microbatch size (an integer >= 1)"


def fraction_problem(value: object) -> str:
    """'' when ``value`` is a fraction of device memory in [0, 1), else what is wrong."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value < 1
    return (
        "" if ok else (f"must be a fraction of device memory in [0, 1) (e.g. 0.1 keeps 10% free), got {brief(value)}")
    )
