"""The pipeline receive buffers' formula (nest_fx.cost.recv_buffers; counted against the runtime
on gloo ranks in tests/distributed/apply/test_pipeline_recv_buffers.py) and the planner's floor."""

from __future__ import annotations

import pytest

from nest_fx.cost.options import CostOptions
from nest_fx.cost.recv_buffers import least_recv_buffer_bytes, recv_buffer_bytes


@pytest.mark.parametrize(
    "pp, v, schedule", [(2, 1, "1f1b"), (4, 1, "gpipe"), (4, 2, "interleaved"), (4, 3, "interleaved-zb"), (4, 2, "zbv")]
)
@pytest.mark.parametrize("outputs", ["sharded", "full"])
def test_the_floor_is_the_least_rank_s_buffers(pp, v, schedule, outputs):
    options, m, b = CostOptions(stage_outputs=outputs), 8, 1000.0
    per_rank = [recv_buffer_bytes(b, b, i, pp, m, v, schedule, options, sp_degree=2) for i in range(pp)]
    assert least_recv_buffer_bytes(b, pp, m, v, schedule, options, sp_degree=2) == min(per_rank)
    share = 0.5 if outputs == "sharded" else 1.0
    middle = m * 2 * v * share * b  # a rank holding neither end receives both ways on every chunk
    assert max(per_rank) == (middle if pp > 2 else middle * (2 * v - 1) / (2 * v))


def test_without_a_pipeline_nothing_and_freed_outputs_one_buffer_each_way():
    assert recv_buffer_bytes(1000.0, 1000.0, 0, 1, 8, 1, "1f1b", CostOptions()) == 0.0
    freed = CostOptions(stage_outputs="freed")
    assert recv_buffer_bytes(1000.0, 500.0, 1, 4, 64, 2, "interleaved", freed) == 2000.0
    assert least_recv_buffer_bytes(1000.0, 4, 64, 2, "interleaved", freed) == 0.0
