"""The stage tables' shared layouts (``table_cache._shared_layout``): a middle stage's rank
groups are stage 1's moved by whole stage offsets, and a stage that shares an earlier stage's
groups (``Cluster.shift_class``) has groups the network costs exactly as its own: the same
span for every collective group, the same level for every point-to-point pair."""

import itertools
import random
from dataclasses import fields, replace

import pytest

from nest_fx.cluster import Cluster, load_cluster
from nest_fx.cost.stage_terms import stage_groups
from nest_fx.plan import StagePlan
from nest_fx.solver.table_cache import _LayoutPlan, _distinct, _shared_layout

LAYOUTS = [  # (devices, tp, dp, ep, cp, dp_shard, p, placement)
    (1024, 8, 16, 1, 1, 0, 8, "stage-major"),
    (1024, 4, 32, 4, 1, 0, 8, "stage-major"),
    (1024, 2, 16, 2, 2, 8, 16, "replica-major"),
    (1024, 1, 64, 8, 1, 16, 16, "replica-major"),
    (768, 4, 12, 1, 2, 0, 8, "stage-major"),
    (65536, 8, 512, 8, 1, 64, 16, "stage-major"),
    (65536, 4, 1024, 1, 2, 0, 8, "replica-major"),
    (96, 2, 3, 1, 1, 0, 16, "replica-major"),
]


def _plan(tp, dp, ep, cp, dp_shard, p, placement):
    return _LayoutPlan(
        stages=[StagePlan(k, k + 1, tp) for k in range(p)],
        dp=dp,
        ep=ep,
        cp=cp,
        dp_shard=dp_shard,
        zero=1 if dp_shard else 0,
        placement=placement,
        num_layers=p,
    )


def _moved(groups, shift):
    """``groups`` with every rank moved by ``shift``."""

    def move(value):
        if value and isinstance(value[0], tuple):
            return tuple(tuple(r + shift for r in grp) for grp in value)
        return tuple(r + shift for r in value)

    return replace(groups, **{f.name: move(getattr(groups, f.name)) for f in fields(groups)})


def _cost_shape(cluster, groups):
    """What the hierarchical network model reads of a stage's groups: each collective group's
    span, each pair's level."""
    out = []
    for f in fields(groups):
        value = getattr(groups, f.name)
        many = value and isinstance(value[0], tuple)
        for grp in value if many else ([value] if value else []):
            if f.name in ("p2p", "tied"):
                out.append((f.name, cluster.level_index_of_group(sorted(grp))))
            else:
                out.append((f.name, tuple(cluster.span(grp))))
    return out


@pytest.mark.parametrize("devices,tp,dp,ep,cp,dp_shard,p,placement", LAYOUTS)
def test_middle_stages_are_stage_one_moved(devices, tp, dp, ep, cp, dp_shard, p, placement):
    plan = _plan(tp, dp, ep, cp, dp_shard, p, placement)
    step = plan.stage_offset(1)
    first = stage_groups(plan, 1)
    for i in range(2, p - 1):
        assert stage_groups(plan, i) == _moved(first, (i - 1) * step)


@pytest.mark.parametrize("preset", ["h100-spine-leaf", "tpuv4-fat-tree"])
@pytest.mark.parametrize("devices,tp,dp,ep,cp,dp_shard,p,placement", LAYOUTS)
def test_shared_stages_cost_as_their_own(preset, devices, tp, dp, ep, cp, dp_shard, p, placement):
    cluster = load_cluster(f"{preset}:{devices}")
    plan = _plan(tp, dp, ep, cp, dp_shard, p, placement)
    layout = _shared_layout(plan, p, cluster.shift_class)
    own = [stage_groups(plan, i) for i in range(p)]
    assert len(layout) == p
    for i in range(p):
        if layout[i] is not own[i]:
            assert _cost_shape(cluster, layout[i]) == _cost_shape(cluster, own[i]), i
    for i in (0, 1, p - 1):
        assert layout[i] == own[i]  # the ends and the first middle stage are always their own
    assert _shared_layout(plan, p, None) == own  # no classes: every stage its own


def test_stage_major_data_parallel_layout_shares_its_middle_stages():
    """The case the sharing is for: DP groups spanning the spine, one class for all middle stages."""
    cluster = load_cluster("h100-spine-leaf:65536")
    plan = _plan(8, 512, 1, 1, 0, 16, "stage-major")
    objs, where = _distinct(_shared_layout(plan, 16, cluster.shift_class))
    assert len(objs) == 3 and where == [0] + [1] * 14 + [2]


@pytest.mark.parametrize("preset,devices", [("h100-spine-leaf", 1024), ("tpuv4-fat-tree", 4096)])
def test_shifts_of_one_class_have_one_span(preset, devices):
    cluster: Cluster = load_cluster(f"{preset}:{devices}")
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        size = rng.choice([2, 3, 8, 40, 300])
        lo = rng.randrange(devices // 4)
        stride = rng.choice([1, 2, 3, 8, 24, 32, 64])
        ranks = sorted({min(lo + stride * k + rng.choice([0, 0, 1]), devices - 1) for k in range(size)})
        hi = ranks[-1]
        low, high = -ranks[0], devices - 1 - hi  # the moves that keep the set on the cluster
        if high - low < 64:
            continue
        # moves by whole nodes and racks too (the classes that repeat), then any
        shifts = [q * -(-low // q) + q * rng.randrange((high - low) // q) for q in (1, 8, 32) for _ in range(4)]
        for a, b in itertools.combinations(shifts, 2):
            if cluster.shift_class(ranks[0], hi, a) == cluster.shift_class(ranks[0], hi, b):
                checked += 1
                assert cluster.span([r + a for r in ranks]) == cluster.span([r + b for r in ranks])
    assert checked > 100  # the property is exercised, not vacuous
