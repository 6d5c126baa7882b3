"""What the search shares across variants, layouts and rank sets for speed (round 8) returns, bit
for bit, what the plain computation does: the layer costs of a variant asked once per class of
layers (``workload.layer_classes``), a rank set's span counted by runs instead of ``np.unique``
(``Cluster._span`` on ascending ranks), the tail floor's DP sync once per ``dp_sync.sync_signature``
across layouts, and its optimizer steps once per (parameters, shard, ZeRO)."""

import itertools
import math
import random

import numpy as np
import pytest

from nest_fx.cluster import load_cluster
from nest_fx.cost import memory
from nest_fx.cost.dp_sync import dp_sync_time, sync_signature
from nest_fx.cost.options import CostOptions
from nest_fx.cost.stage_terms import stage_groups
from nest_fx.solver.candidates import _replica_work, layer_floors, layer_prefix
from nest_fx.solver.table_cache import TableCache, _distinct
from nest_fx.workload import Variant, workload_for_model
from nest_fx.workload.layer_classes import cost_classes, layer_costs

from test_layout_classes import LAYOUTS, _plan
from test_search_stacked import _setup
from test_stage_reach import OPTIONS
from test_stage_table import MODELS

VARIANTS = [
    Variant(tp, ep, mbs, sp, cp, lp)
    for tp, ep, mbs, sp, cp, lp in itertools.product((1, 2, 4), (1, 2), (1, 2), (False, True), (1, 2), (False, True))
]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_layer_costs_per_class_are_every_layers_own(model):
    """``layer_costs`` gives each layer the object ``Workload.cost`` gives it (asked first or
    after), equal to a fresh workload's plain per-layer costs; the solver's sums over them
    (tier 0's replica work, the layer floors and prefix sums) equal the plain ones."""
    cluster = load_cluster("h100-spine-leaf:64")
    work, plain = workload_for_model(MODELS[model], cluster), workload_for_model(MODELS[model], cluster)
    reps, of = cost_classes(work)
    assert len(reps) < len(work) and len(of) == len(work)
    checked = 0
    for v in VARIANTS:
        if not work.supports(v):
            continue
        got = layer_costs(work, v)
        fresh = [plain.cost(i, v) for i in range(len(plain))]
        assert got == fresh
        assert all(c is work.cost(i, v) for i, c in enumerate(got))
        times = [c.fwd_s + c.bwd_s for c in fresh]
        work_s, params, floors = _replica_work(work, v)
        assert work_s == sum(times) and params == sum(c.num_params for c in fresh)
        assert np.array_equal(floors, np.concatenate([[0.0], np.cumsum(np.sort(np.asarray(times)))]))
        assert np.array_equal(layer_floors(work, v), floors)
        assert layer_prefix(work, v) == np.concatenate([[0.0], np.cumsum(times)]).tolist()
        costs, counts, index = work.variant_costs(v)
        assert [costs[k] for k in index] == fresh
        checked += 1
    assert checked > 20


def test_layer_classes_follow_the_chain():
    """A chain changed in place (another layer's signature) is classed afresh."""
    work = workload_for_model(MODELS["uniform"], load_cluster("h100-spine-leaf:64"))
    reps, _ = cost_classes(work)
    layer = work.layers[2]
    layer.signature, old = layer.signature + "-changed", layer.signature
    try:
        assert len(cost_classes(work)[0]) == len(reps) + 1
    finally:
        layer.signature = old
    assert cost_classes(work)[0] == reps


def _unique_span(cluster, rs, top):
    """``Cluster._span`` as ``np.unique`` gives it (the per-level fan-out and group sizes)."""
    out, inner = [], 1
    for level in cluster.levels[: top + 1]:
        groups = rs // level.group_size
        _, sizes = np.unique(groups, return_counts=True)
        pairs = np.unique(groups * cluster.num_devices + rs // inner)
        _, fanouts = np.unique(pairs // cluster.num_devices, return_counts=True)
        out.append((int(fanouts.max()), int(sizes.max()), int(sizes.min())))
        inner = level.group_size
    return out


@pytest.mark.parametrize(
    "preset,devices", [("h100-spine-leaf", 1024), ("tpuv4-fat-tree", 4096), ("h100-spine-leaf", 65536)]
)
def test_span_by_runs_equals_unique(preset, devices):
    """Ascending rank sets (progressions, unions of them, random subsets) counted by runs, and
    shuffled ones (``np.unique``), give the spans ``np.unique`` gives."""
    cluster = load_cluster(f"{preset}:{devices}")
    rng = random.Random(devices)
    sets = []
    for _ in range(60):
        step, count = rng.choice([1, 2, 3, 8, 24, 32, 64, 96]), rng.randrange(65, 600)
        first = rng.randrange(0, max(1, devices - step * count))
        sets.append(list(range(first, min(devices, first + step * count), step)))
        sets.append(sorted(rng.sample(range(devices), rng.randrange(65, 700))))
        shuffled = sorted(rng.sample(range(devices), rng.randrange(65, 300)))
        rng.shuffle(shuffled)
        sets.append(shuffled)
    checked = 0
    for ranks in sets:
        if len(ranks) <= 64:
            continue
        rs = np.array(ranks, dtype=np.int64)
        top = cluster.level_index_of_group(rs)
        got = [(s.fanout, s.max_ranks, s.min_ranks) for s in cluster._span(rs, top)]
        assert got == _unique_span(cluster, rs, top)
        checked += 1
    assert checked > 100


def _layout_groups(cluster):
    """Every stage's groups of :data:`test_layout_classes.LAYOUTS` that fit ``cluster``."""
    out = []
    for devices, tp, dp, ep, cp, dp_shard, p, placement in LAYOUTS:
        if devices == cluster.num_devices:
            plan = _plan(tp, dp, ep, cp, dp_shard, p, placement)
            out += [(dp * cp, ep, stage_groups(plan, i)) for i in range(p)]
    return out


@pytest.mark.parametrize("devices", [1024, 65536])
def test_equal_sync_signatures_give_equal_dp_sync(devices):
    """Stage groups whose ``sync_signature`` is equal cost the same DP sync (``dp_sync_time``
    with ``collective_fn``) for every size, ZeRO stage and microbatch count; the signature
    sets groups apart that cost differently."""
    cluster = load_cluster(f"h100-spine-leaf:{devices}")
    options = CostOptions()
    groups = _layout_groups(cluster)
    assert groups
    shared = differ = 0
    for zero in (0, 1, 2, 3):
        for (dp, ep, a), (_, _, b) in itertools.combinations(groups, 2):  # both at a's degrees
            for experts in (False, True):
                sa, sb = (sync_signature(cluster, x, zero, experts) for x in (a, b))
                assert sa is not None
                for d, e, m in ((3.0e9, 0.0, 4), (1.0e9, 5.0e8, 16)):
                    if dp // ep > 1 and e and not experts:
                        continue  # the expert groups are read: the dense signature does not say
                    ya, yb = (dp_sync_time(cluster, x, d, e, dp, ep, zero, m, options, 0.0, 0.0) for x in (a, b))
                    if sa == sb:
                        assert ya == yb
                        shared += 1
                    elif ya != yb:
                        differ += 1
    assert shared and differ


@pytest.mark.parametrize("model", sorted(MODELS))
def test_tail_floor_shared_across_layouts_equals_a_fresh_cache(model):
    """The tail floor (and its DP syncs) of one cache asked pair after pair, its memos by
    signature and optimizer step filling, equals a fresh cache's for each pair."""
    cluster, work, pairs = _setup(model, count=80)
    shared = TableCache(work, cluster, CostOptions(), OPTIONS.recompute)
    finite = 0
    for g, p in pairs:
        m = g.microbatches(16)
        fresh = TableCache(work, cluster, CostOptions(), OPTIONS.recompute)
        got = shared.tail_floor(g, p, m)
        assert got == fresh.tail_floor(g, p, m)
        zero = memory.effective_zero_stage(g.zero, p, g.pp_shard_grads)
        for d, e in ((3.0e6, 0.0), (0.0, 2.5e6)):
            assert shared._stage_syncs(g, p, m, zero, d, e) == fresh._stage_syncs(g, p, m, zero, d, e)
        finite += math.isfinite(got) and got > 0
    assert finite
    assert shared._sync_values and len(shared._sync_values) < sum(
        len(_distinct(shared.layout(g, p))[0]) for g, p in pairs
    )
