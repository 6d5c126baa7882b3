"""The receive buffers torch's PipelineStage allocates under nest-fx's runtime (2 gloo ranks),
counted against what the cost model prices (``nest_fx.cost.recv_buffers``): one per microbatch,
direction and receiving chunk, each a microbatch's hidden states, kept after the step."""

from __future__ import annotations

import pytest
import torch

from nest_fx.apply.launch import launch
from nest_fx.cost.options import CostOptions
from nest_fx.cost.recv_buffers import recv_buffer_bytes

HIDDEN, SEQ, LAYERS = 64, 32, 4
MODEL = f"llama:hidden={HIDDEN},layers={LAYERS},heads=4,seq={SEQ},vocab=128"


def _worker(plan_kwargs: dict):
    from nest_fx.apply import auto_parallelize
    from nest_fx.apply.losses import lm_loss
    from nest_fx.models import build_seeded
    from nest_fx.plan import uniform_plan

    m = plan_kwargs["num_microbatches"]
    model, _ = build_seeded(MODEL, seed=0)
    x, y = torch.randint(0, 128, (m, SEQ)), torch.randint(0, 128, (m, SEQ))
    plan = uniform_plan(LAYERS + 2, pp=2, microbatch_size=1, **plan_kwargs)
    pm = auto_parallelize(model, {"tokens": x}, global_batch_size=m, loss_fn=lm_loss, verbose=False, plan=plan)
    for _ in range(2):  # the buffers outlive a step
        pm.train_step({"tokens": x}, y)
    seen, nbytes = set(), 0
    for stage in pm.pipeline_stages:
        for infos in list(stage.args_recv_info.values()) + list(stage.grad_recv_info.values()):
            for info in infos:
                t = info.buffer
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    nbytes += t.numel() * t.element_size()
    return {"buffers": len(seen), "bytes": nbytes}


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "plan_kwargs",
    [
        {"num_microbatches": 8},  # 1F1B: rank 0 receives gradients, rank 1 activations
        {"num_microbatches": 4, "schedule": "interleaved", "virtual_stages": 2},
    ],
)
def test_each_receiving_chunk_holds_a_buffer_per_microbatch_as_priced(plan_kwargs):
    m, v = plan_kwargs["num_microbatches"], plan_kwargs.get("virtual_stages", 1)
    boundary = SEQ * HIDDEN * 4  # one microbatch's fp32 hidden states
    results = launch(_worker, 2, plan_kwargs, timeout=150)
    for rank, r in enumerate(results):
        priced = recv_buffer_bytes(
            boundary, boundary, rank, 2, m, v, plan_kwargs.get("schedule", "1f1b"), CostOptions()
        )
        assert r["bytes"] == priced, (rank, r, priced)
        assert r["buffers"] == m * (2 * v - 1)  # every chunk both ways, less the first's and the last's
    # the runtime's buffers are what the cost model priced as one each way before (2 x boundary) only at m = 1
    assert results[0]["bytes"] > 2 * boundary
