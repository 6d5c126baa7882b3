"""The receive buffers a pipelined stage holds (docs/cost_model.md, "Pipeline receive buffers").

torch's ``PipelineStage`` (nest-fx's runtime and torchtitan) allocates, the first time a schedule
runs, one receive buffer per microbatch and direction: each model chunk that is not the first
stage gets ``num_microbatches`` activation buffers (``_setup_forward_recv_info``), each that is
not the last ``num_microbatches`` gradient buffers (``_setup_backward_recv_info``), and keeps them
for the schedule's life. A buffer holds what crosses the boundary: one microbatch's hidden states,
the sequence shard under sequence parallelism. Counted on gloo ranks by
``tests/distributed/apply/test_pipeline_recv_buffers.py``.

A runtime that frees each stage output after its send (``stage_outputs="freed"``: Megatron-LM,
Meta's Llama 3 stack) allocates a receive buffer per transfer: one each way at a time.

The activation buffer of an in-flight microbatch is also the input the stage's first block keeps
for its backward, so up to the in-flight count of them are counted twice (under a block's
activations too): a few boundary tensors against the ``2 m`` counted here.
"""

from __future__ import annotations

from nest_fx.cost.arrays import Count
from nest_fx.cost.options import CostOptions
from nest_fx.plan.vocabulary import V_SCHEDULES


def _boundary_share(options: CostOptions, sp_degree: int) -> float:
    """The share of a boundary tensor a buffer holds: its sequence shard where sequence-parallel
    blocks hand on their shard (``stage_outputs="sharded"``), else all of it."""
    return 1.0 / sp_degree if options.stage_outputs == "sharded" else 1.0


def _receiving_directions(stage: int, pp: int, virtual_stages: int, schedule: str) -> int:
    """Chunk directions pipeline rank ``stage`` receives in: both for each of its chunks, less the
    first stage's activations and the last stage's gradients (a V schedule puts both on rank 0,
    so rank 0 always has the fewest)."""
    first = stage == 0
    last = stage == 0 if schedule in V_SCHEDULES else stage == pp - 1
    return 2 * virtual_stages - int(first) - int(last)


def recv_buffer_bytes(
    out_bytes: Count,
    in_bytes: Count,
    stage: int,
    pp: int,
    num_microbatches: int,
    virtual_stages: int,
    schedule: str,
    options: CostOptions,
    sp_degree: int = 1,
) -> Count:
    """Bytes of the receive buffers pipeline rank ``stage`` of ``pp`` holds: ``num_microbatches``
    per receiving chunk direction (:func:`_receiving_directions`), each the boundary tensor:
    ``in_bytes`` (what the layer before the stage hands on) on ranks after the first,
    ``out_bytes`` on the first; ``1 / sp_degree`` of it where sequence-parallel blocks hand on
    their shard (``stage_outputs="sharded"``). 0 without pipelining; ``2 out_bytes`` where the
    runtime frees stage outputs (one buffer each way)."""
    if pp == 1:
        return 0.0 * out_bytes
    if options.stage_outputs == "freed":
        return 2 * out_bytes
    boundary = out_bytes if stage == 0 else in_bytes
    directions = _receiving_directions(stage, pp, virtual_stages, schedule)
    return num_microbatches * directions * _boundary_share(options, sp_degree) * boundary


def least_recv_buffer_bytes(
    boundary: float,
    pp: int,
    num_microbatches: int,
    virtual_stages: int,
    schedule: str,
    options: CostOptions,
    sp_degree: int = 1,
) -> float:
    """A lower bound on :func:`recv_buffer_bytes` over the ranks of a pipeline whose boundary
    tensors are at least ``boundary`` bytes (the planner's memory floors): rank 0's receiving
    directions, the fewest; 0 without pipelining or where outputs are freed (one buffer each way,
    not bounded here)."""
    if options.stage_outputs == "freed":
        return 0.0
    return recv_buffer_bytes(boundary, boundary, 0, pp, num_microbatches, virtual_stages, schedule, options, sp_degree)
