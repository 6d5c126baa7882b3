"""Collective times: hand-computed alpha-beta values, hierarchical cases, invariants, errors."""

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nest_fx.cluster import Cluster, ClusterError, NetworkLevel
from nest_fx.cluster import hierarchical_collectives as C
from nest_fx.cluster.hierarchical_collectives import (
    COLLECTIVES,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    collective_time,
    p2p,
    reduce_scatter,
)

S = 1e9  # bytes


@pytest.fixture
def host4():
    return Cluster.preset("cpu-gloo", 4)  # one level: 2e9 B/s, 5e-5 s


@pytest.fixture
def dgx64():
    """A DGX A100's hierarchy at its link rates (the preset carries NCCL's figures): node
    300e9/5e-6, rack 25e9/1e-5, spine 25e9/1.5e-5; the formulas below are written on these."""
    levels = [
        NetworkLevel("node", 8, 300e9, 5e-6),
        NetworkLevel("rack", 32, 25e9, 1e-5),
        NetworkLevel("spine", 64, 25e9, 1.5e-5),
    ]
    return Cluster("dgx-a100-link-rates", Cluster.preset("dgx-a100", 64).device, 64, levels)


# -- one level (ring formulas) -------------------------------------------------------------


def test_ring_formulas_on_one_level(host4):
    ranks = [0, 1, 2, 3]
    B, a = 2e9, 5e-5
    # all-reduce: 2(n-1)/n S/B + 2(n-1) alpha = 2*3/4*1e9/2e9 + 6*5e-5 = 0.75 + 3e-4
    assert all_reduce(host4, ranks, S) == pytest.approx(0.75 + 3e-4)
    # all-gather / reduce-scatter: (n-1)/n S/B + (n-1) alpha = 0.375 + 1.5e-4
    assert all_gather(host4, ranks, S) == pytest.approx(0.375 + 1.5e-4)
    assert reduce_scatter(host4, ranks, S) == pytest.approx(0.375 + 1.5e-4)
    # all-to-all, S per rank: (n-1)/n S/B + (n-1) alpha = 0.375 + 1.5e-4
    assert all_to_all(host4, ranks, S) == pytest.approx(0.375 + 1.5e-4)
    # broadcast: 2(n-1)/n S/B + (ceil(log2 4) + 3) alpha = 0.75 + 5 * 5e-5
    assert broadcast(host4, ranks, S) == pytest.approx(0.75 + 2.5e-4)
    assert 3 * a == pytest.approx(1.5e-4) and S / B == 0.5  # the arithmetic above


def test_two_ranks_on_one_level(host4):
    # n = 2: all-reduce = 2 * 1/2 * 1e9/2e9 + 2 * 5e-5 = 0.5 + 1e-4
    assert all_reduce(host4, [1, 3], S) == pytest.approx(0.5 + 1e-4)


def test_p2p(dgx64):
    # innermost common level: alpha + S/B
    assert p2p(dgx64, 0, 7, S) == pytest.approx(5e-6 + 1e9 / 300e9)
    assert p2p(dgx64, 0, 8, S) == pytest.approx(1e-5 + 1e9 / 25e9)
    assert p2p(dgx64, 0, 40, S) == pytest.approx(1.5e-5 + 1e9 / 25e9)
    assert p2p(dgx64, 3, 3, S) == 0.0
    assert p2p(dgx64, 0, 1, 0) == 0.0


# -- hierarchical --------------------------------------------------------------------------


def test_hierarchical_reduce_scatter_two_nodes(dgx64):
    # ranks 0..15: node fan-out 8 then rack fan-out 2 on the 1/8 shard.
    node = 7 / 8 * S / 300e9 + 7 * 5e-6
    rack = 1 / 2 * (S / 8) / 25e9 + 1 * 1e-5
    assert reduce_scatter(dgx64, range(16), S) == pytest.approx(node + rack)
    assert all_gather(dgx64, range(16), S) == pytest.approx(node + rack)
    assert all_reduce(dgx64, range(16), S) == pytest.approx(2 * (node + rack))


def test_hierarchical_three_levels(dgx64):
    # all 64: node 8 on S, rack 4 on S/8, spine 2 on S/32
    node = 7 / 8 * S / 300e9 + 7 * 5e-6
    rack = 3 / 4 * (S / 8) / 25e9 + 3 * 1e-5
    spine = 1 / 2 * (S / 32) / 25e9 + 1 * 1.5e-5
    assert all_reduce(dgx64, range(64), S) == pytest.approx(2 * (node + rack + spine))


def test_strided_group_skips_the_node_level(dgx64):
    # {0,8,16,24}: one rank per node, so only the rack ring of 4 runs, on the full buffer.
    assert all_reduce(dgx64, [0, 8, 16, 24], S) == pytest.approx(2 * (3 / 4 * S / 25e9 + 3 * 1e-5))


def test_unbalanced_group_uses_the_largest_shard(dgx64):
    # {0,1,2,8}: a ring of 3 in node 0; rank 8 is alone in node 1 and still holds all S, so the
    # rack ring of 2 runs on S (not S/3).
    expected = (2 / 3 * S / 300e9 + 2 * 5e-6) + (1 / 2 * S / 25e9 + 1e-5)
    assert reduce_scatter(dgx64, [0, 1, 2, 8], S) == pytest.approx(expected)


def test_hierarchical_all_to_all(dgx64):
    # 16 ranks in 2 nodes, S sent per rank. Node level: everything leaving the device,
    # (1 - 1/16) S at 300e9, 7 peers; rack level: what leaves the node, (1 - 8/16) S at 25e9,
    # 8 peers.
    expected = (15 / 16 * S / 300e9 + 7 * 5e-6) + (8 / 16 * S / 25e9 + 8 * 1e-5)
    assert all_to_all(dgx64, range(16), S) == pytest.approx(expected)
    # one rank per node: only the rack level, (1 - 1/4) S, 3 peers
    assert all_to_all(dgx64, [0, 8, 16, 24], S) == pytest.approx(3 / 4 * S / 25e9 + 3 * 1e-5)


def test_hierarchical_broadcast(dgx64):
    # 16 ranks: spine-free; rack level f=2 then node level f=8, full S at each.
    rack = 2 * 1 / 2 * S / 25e9 + (1 + 1) * 1e-5
    node = 2 * 7 / 8 * S / 300e9 + (3 + 7) * 5e-6
    assert broadcast(dgx64, range(16), S) == pytest.approx(rack + node)


# -- paths: a transfer crossing level i is as fast as the slowest level it traverses ---------


@pytest.fixture
def slow_leaf():
    return Cluster.preset("h100-spine-leaf", 128)  # node 900e9/5e-6, rack 12.5e9/1e-5, spine 50e9/1.5e-5


def test_cross_spine_p2p_runs_at_the_slower_leaf(slow_leaf):
    # ranks 0 and 40 meet at the spine, but the message leaves rack 0 through its 12.5 GB/s leaf
    assert p2p(slow_leaf, 0, 40, S) == pytest.approx(1.5e-5 + S / 12.5e9)
    assert p2p(slow_leaf, 0, 8, S) == pytest.approx(1e-5 + S / 12.5e9)
    assert p2p(slow_leaf, 0, 7, S) == pytest.approx(5e-6 + S / 900e9)
    assert C.path_bandwidth(slow_leaf.levels, 2) == 12.5e9 and C.path_bandwidth(slow_leaf.levels, 0) == 900e9


def test_collective_steps_across_the_spine_use_the_path_bandwidth(slow_leaf):
    # one rank per rack on 4 racks: a single spine step of 4, at the leaf's 12.5 GB/s
    heads = [0, 32, 64, 96]
    assert reduce_scatter(slow_leaf, heads, S) == pytest.approx(3 / 4 * S / 12.5e9 + 3 * 1.5e-5)
    assert all_to_all(slow_leaf, heads, S) == pytest.approx(3 / 4 * S / 12.5e9 + 3 * 1.5e-5)
    assert broadcast(slow_leaf, heads, S) == pytest.approx(2 * 3 / 4 * S / 12.5e9 + (2 + 3) * 1.5e-5)
    # all 64 ranks of racks 0-1: node 8 on S, rack 4 on S/8, spine 2 on S/32 (spine step at 12.5 GB/s)
    expected = (7 / 8 * S / 900e9 + 7 * 5e-6) + (3 / 4 * S / 8 / 12.5e9 + 3 * 1e-5) + (1 / 2 * S / 32 / 12.5e9 + 1.5e-5)
    assert all_gather(slow_leaf, range(64), S) == pytest.approx(expected)


@given(ranks=st.sets(st.integers(0, 127), min_size=2, max_size=64).map(sorted), nbytes=st.floats(1, 1e10))
@settings(max_examples=40, deadline=None)
def test_a_faster_outer_level_never_beats_its_inner_path(ranks, nbytes):
    # raising the spine above the leaf changes nothing: the leaf is on every cross-spine path
    c = Cluster.preset("h100-spine-leaf", 128)
    faster_spine = replace(c, levels=[*c.levels[:2], replace(c.levels[2], bandwidth=1e15)])
    for kind in COLLECTIVES:
        assert collective_time(kind, faster_spine, ranks, nbytes) == collective_time(kind, c, ranks, nbytes)
    assert p2p(faster_spine, ranks[0], ranks[-1], nbytes) == p2p(c, ranks[0], ranks[-1], nbytes)


def _uniform(bandwidth, latency, sizes=(8, 32, 128)):
    levels = [NetworkLevel(f"l{i}", s, bandwidth, latency) for i, s in enumerate(sizes)]
    return Cluster("uniform", Cluster.preset("dgx-a100", 8).device, sizes[-1], levels)


@pytest.mark.parametrize("n", [2, 8, 16, 32, 64, 128])
def test_hierarchy_with_equal_levels_is_the_flat_ring(n):
    # With one bandwidth everywhere, sum_i (f_i-1)/f_i * S/prod_{j<i} f_j telescopes to (n-1)/n S:
    # the hierarchical algorithm moves exactly the flat ring's bytes.
    c = _uniform(10e9, 0.0)
    assert reduce_scatter(c, range(n), S) == pytest.approx((n - 1) / n * S / 10e9)
    assert all_reduce(c, range(n), S) == pytest.approx(2 * (n - 1) / n * S / 10e9)


def test_hierarchical_beats_a_flat_ring_over_the_slow_links(dgx64):
    flat = 2 * 15 / 16 * S / 25e9 + 2 * 15 * 1e-5  # a ring of 16 at IB speed
    assert all_reduce(dgx64, range(16), S) < flat


# -- edge cases and errors -----------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(COLLECTIVES))
def test_single_rank_and_empty_buffer_cost_nothing(dgx64, kind):
    assert collective_time(kind, dgx64, [5], S) == 0.0
    assert collective_time(kind, dgx64, range(16), 0) == 0.0


@pytest.mark.parametrize("nbytes", [-1, float("nan"), float("inf"), "1GB", True])
def test_bad_nbytes(dgx64, nbytes):
    with pytest.raises(ValueError, match="nbytes"):
        all_reduce(dgx64, [0, 1], nbytes)
    with pytest.raises(ValueError, match="nbytes"):
        p2p(dgx64, 0, 1, nbytes)


@pytest.mark.parametrize("ranks", [[], [0, 64], [2, 2]])
def test_bad_ranks(dgx64, ranks):
    with pytest.raises(ClusterError, match="ranks"):
        all_gather(dgx64, ranks, S)


def test_p2p_bad_rank(dgx64):
    with pytest.raises(ClusterError, match="ranks"):
        p2p(dgx64, 0, 99, S)


def test_unknown_kind_lists_the_kinds(dgx64):
    with pytest.raises(ValueError, match=r"allreduce.*all_gather.*all_reduce.*all_to_all"):
        collective_time("allreduce", dgx64, [0, 1], S)


def test_dispatch_matches_the_functions(dgx64):
    for kind, fn in [
        ("all_reduce", all_reduce),
        ("all_gather", all_gather),
        ("reduce_scatter", reduce_scatter),
        ("all_to_all", all_to_all),
        ("broadcast", broadcast),
    ]:
        assert collective_time(kind, dgx64, range(12), S) == fn(dgx64, range(12), S)


# -- invariants ----------------------------------------------------------------------------

rank_sets = st.sets(st.integers(0, 63), min_size=1, max_size=64).map(sorted)
sizes = st.floats(min_value=0, max_value=1e11, allow_nan=False)


def _faster(cluster, factor):
    return replace(cluster, levels=[replace(lv, bandwidth=lv.bandwidth * factor) for lv in cluster.levels])


@pytest.mark.parametrize("preset", ["dgx-a100", "h100-spine-leaf", "tpuv4-fat-tree"])
@given(ranks=rank_sets, nbytes=sizes, factor=st.floats(1, 100))
@settings(max_examples=40, deadline=None)
def test_more_bandwidth_is_never_slower(preset, ranks, nbytes, factor):
    c = Cluster.preset(preset, 64)
    fast = _faster(c, factor)
    for kind in COLLECTIVES:
        assert collective_time(kind, fast, ranks, nbytes) <= collective_time(kind, c, ranks, nbytes) * (1 + 1e-12)


@given(ranks=rank_sets, a=sizes, b=sizes)
@settings(max_examples=60, deadline=None)
def test_monotone_in_bytes(ranks, a, b):
    c = Cluster.preset("h100-spine-leaf", 64)
    lo, hi = min(a, b), max(a, b)
    for kind in COLLECTIVES:
        assert collective_time(kind, c, ranks, lo) <= collective_time(kind, c, ranks, hi)


@given(ranks=rank_sets, nbytes=sizes)
@settings(max_examples=60, deadline=None)
def test_all_reduce_is_reduce_scatter_plus_all_gather(ranks, nbytes):
    c = Cluster.preset("dgx-h100", 64)
    rs, ag = reduce_scatter(c, ranks, nbytes), all_gather(c, ranks, nbytes)
    assert all_reduce(c, ranks, nbytes) == pytest.approx(rs + ag)
    assert all(math.isfinite(x) and x >= 0 for x in (rs, ag))


@given(n=st.integers(2, 8), nbytes=st.floats(1, 1e10))
@settings(max_examples=30, deadline=None)
def test_within_a_node_the_hierarchy_is_the_ring(n, nbytes):
    c = Cluster.preset("dgx-a100", 64)
    lv = c.levels[0]
    assert all_reduce(c, range(n), nbytes) == pytest.approx(
        2 * (n - 1) / n * nbytes / lv.bandwidth + 2 * (n - 1) * lv.latency
    )
    assert C.ring_pass(n, nbytes, lv) == pytest.approx(reduce_scatter(c, range(n), nbytes))
