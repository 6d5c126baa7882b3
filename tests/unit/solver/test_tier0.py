"""Tier 0's array form (``candidates.tier0``) equals the bound it computes configuration by
configuration: the same pairs, the same bounds bit for bit, in the same order (ties in
enumeration order), and the lazy pairs build the same configurations."""

import numpy as np
import pytest

from nest_fx.cost import memory
from nest_fx.cost.dp_sync import tail_terms
from nest_fx.cost.schedules import bubble_factor
from nest_fx.cost.step_time import pipeline_span
from nest_fx.plan.vocabulary import CHUNKED_SCHEDULES
from nest_fx.solver.candidates import busiest_stage_floor, candidates, layer_floors, tier0
from nest_fx.solver.space import ANY_INTERLEAVE, SolverOptions, concrete, global_configs, stage_counts
from nest_fx.workload import workload_for_model

from test_stage_table import MODELS, toy_cluster

SPACES = {
    "small": SolverOptions(
        microbatch_sizes=(1, 2),
        tp_degrees=(1, 2),
        zero_stages=(0, 1, 2, 3),
        schedules=(("1f1b", 1), ("interleaved", 2), ("gpipe", 1), ("interleaved", ANY_INTERLEAVE)),
        placements=("stage-major", "replica-major"),
        max_stages=4,
    ),
    "default": SolverOptions(),
}


def _reference(work, cluster, batch, options):
    """The per-configuration tier 0: every (g, p) that passes the memory screen with its bound,
    in enumeration order, then sorted stably by bound."""
    options = options.priced()
    work = options.runtime_workload(work)
    capacity = memory.usable_bytes(cluster.device.memory_bytes, options.cost)
    out = []
    for g in global_configs(work, cluster, batch, options):
        depths = np.array(stage_counts(work, cluster, g, batch, options), dtype=np.intp)
        if not depths.size:
            continue
        costs = [work.cost(i, g.variant) for i in range(len(work))]
        total = sum(c.fwd_s + c.bwd_s for c in costs)
        params = sum(c.num_params for c in costs)
        fits = memory.model_states(params / depths, g.zero, g.shard, options.cost)["total"] <= capacity
        depths = depths[fits]
        t_opt = tail_terms(0.0, 0.0, 0.0, params / depths, g.shard, g.zero, cluster, options.cost)[1]
        max_t = np.maximum(total / depths, busiest_stage_floor(layer_floors(work, g.variant), depths))
        m = g.microbatches(batch)
        if g.virtual_stages == ANY_INTERLEAVE and g.schedule in CHUNKED_SCHEDULES:
            v = len(work) // depths
            lbs = m * max_t + (total - max_t) * bubble_factor(g.schedule, 1) / v + t_opt
        else:
            lbs = pipeline_span(max_t, total, m, g.schedule, g.virtual_stages) + t_opt
        out += [(lb, g, p) for lb, p in zip(lbs.tolist(), depths.tolist())]
    out.sort(key=lambda x: x[0])
    return out


@pytest.mark.parametrize("space", sorted(SPACES))
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("memory_gib", [0.05, 1.0])
def test_tier0_equals_per_configuration(model, space, memory_gib):
    cluster = toy_cluster(memory_gib)
    work = workload_for_model(MODELS[model], cluster)
    options = SPACES[space]
    want = _reference(work, cluster, 16, options)
    got = candidates(work, cluster, 16, options)
    assert got == want  # pairs, bounds (==) and order
    pairs = tier0(work, cluster, 16, options)
    assert len(pairs) == len(want) and pairs.tps == [g.tp for _, g, _ in want]
    assert pairs[len(pairs) - 1 :] == want[-1:]
    expanded = candidates(work, cluster, 16, options, expand=True)
    runtime = options.priced().runtime_workload(work)
    assert expanded == [(lb, h, p) for lb, g, p in want for h in concrete(g, runtime, p)]
    if memory_gib == 0.05 and space == "small":
        assert len(want) < len(_reference(work, toy_cluster(1.0), 16, options))  # the screen drops pairs here
