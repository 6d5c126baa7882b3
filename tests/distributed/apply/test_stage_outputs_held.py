"""The pipeline keeps each chunk's output until that chunk's backward (multi-process, gloo, CPU),
and the cost model prices it (``CostOptions.stage_outputs``, ``memory.held_per_microbatch``).

torch's ``PipelineStage`` caches every forward's output in ``fwd_cache`` until the backward of the
same microbatch pops it. PP2 on 2 ranks, 4 microbatches, fp32: the most output bytes a non-last
stage holds at once equal the schedule's in-flight chunk-microbatches
(``inflight.pipeline_inflight_microbatches`` for 1F1B; ``interleaved_chunk_states`` for the
interleaved schedule) times one chunk output, with loss, gradients and parameters at parity;
under sequence parallelism the output is each TP rank's sequence shard (nest-fx's stages hand on
their blocks' shard: ``stage_outputs="sharded"``, the cost model's default).
"""

from __future__ import annotations

import pytest

from nest_fx.cost.inflight import interleaved_chunk_states, pipeline_inflight_microbatches
from nest_fx.testing import equivalence
from parity_helpers import LAUNCH_S, LLAMA, run

M = 4
BATCH, SEQ, HIDDEN = 8, 16, 64

pytestmark = pytest.mark.dist


def _held_outputs(spec):
    """``equivalence`` with the largest output bytes a non-last pipeline stage of this rank held
    in ``fwd_cache`` at once (all its chunks together), and one chunk output's bytes."""
    from torch.distributed.pipelining import stage as stage_module

    seen = {"most": 0, "one": 0}
    stages = []
    original = stage_module._PipelineStageBase.forward_one_chunk

    def recording(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self not in stages:
            stages.append(self)
        held = [
            t.numel() * t.element_size()
            for s in stages
            if not s.is_last
            for outputs, _ in s.fwd_cache.values()
            for t in outputs
        ]
        if held:
            seen["most"] = max(seen["most"], sum(held))
            seen["one"] = max(held)
        return out

    stage_module._PipelineStageBase.forward_one_chunk = recording
    try:
        out = equivalence(spec)
    finally:
        stage_module._PipelineStageBase.forward_one_chunk = original
    out["held"] = dict(seen)
    return out


@pytest.mark.timeout(LAUNCH_S + 30)
@pytest.mark.parametrize(
    "schedule, v, tp",
    # the SP cell's 4 ranks: the same count, each output 1/tp of the sequence, the shard that
    # test_pipeline_sequence_shards.py's CI cell sends across PP2 x TP2 with SP
    [("1f1b", 1, 1), ("interleaved", 2, 1), pytest.param("1f1b", 1, 2, marks=pytest.mark.slow)],
    ids=["1f1b", "interleaved", "1f1b_tp2_sp"],
)
def test_a_stage_holds_its_in_flight_chunk_outputs(schedule, v, tp):
    plan = {"pp": 2, "microbatch_size": BATCH // M, "num_microbatches": M, "schedule": schedule, "virtual_stages": v}
    if tp > 1:
        plan.update(tp=tp, sequence_parallel=True)
    results = run(2 * tp, LLAMA, plan, batch=BATCH, seq=SEQ, fn=_held_outputs)
    rank0 = results[0]["held"]
    # one microbatch's hidden states, fp32; under sequence parallelism 1/tp of the sequence
    assert rank0["one"] == BATCH // M * (SEQ // tp) * HIDDEN * 4
    if v == 1:
        inflight = pipeline_inflight_microbatches(schedule, 0, 2, M, 1)
    else:
        inflight = max(spread for spread, _, _ in interleaved_chunk_states(0, 2, M, v)) * v
    assert rank0["most"] == inflight * rank0["one"]
