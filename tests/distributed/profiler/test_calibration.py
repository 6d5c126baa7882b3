"""Collective calibration: the fit recovers known figures; a real 2-rank gloo run writes a cluster."""

import pytest

from nest_fx.cluster import Cluster
from profiler.collectives import KINDS, Sample, calibrate, fit_cluster, level_groups, model_time


def _synthetic(cluster: Cluster, world: int, noise=lambda i: 1.0):
    samples, i = [], 0
    for level, ranks in level_groups(cluster, world).items():
        for kind in KINDS:
            for nbytes in (4e3, 6.4e4, 1e6, 1.6e7, 2.6e8):
                samples.append(Sample(level, kind, ranks, nbytes, model_time(kind, cluster, ranks, nbytes) * noise(i)))
                i += 1
    return samples


def test_level_groups_cross_one_level_each():
    c = Cluster.preset("dgx-a100", 64)
    groups = level_groups(c, 64)
    assert groups[0] == list(range(8))
    inner = c.levels[0].group_size
    assert groups[1] == list(range(0, c.levels[1].group_size, inner))
    for level, ranks in groups.items():
        assert c.level_index_of_group(ranks) == level


def test_fit_recovers_known_levels():
    truth = Cluster.preset("dgx-a100", 64)
    start = Cluster.preset("dgx-a100", 64)
    for lv in start.levels:  # a wrong starting point
        lv.bandwidth, lv.latency = lv.bandwidth / 7, lv.latency * 3
    fitted, fits = fit_cluster(start, _synthetic(truth, 64))
    for got, want in zip(fitted.levels, truth.levels):
        if any(f.level == want.name for f in fits):
            assert got.bandwidth == pytest.approx(want.bandwidth, rel=1e-6)
            assert got.latency == pytest.approx(want.latency, rel=1e-6, abs=1e-12)
    assert all(f.mean_abs_error < 1e-6 for f in fits)


def test_fit_with_noise_stays_close():
    truth = Cluster.preset("cpu-gloo", 4)
    noisy = _synthetic(truth, 4, noise=lambda i: 1.1 if i % 2 else 0.9)
    fitted, fits = fit_cluster(truth, noisy)
    assert fitted.levels[0].bandwidth == pytest.approx(truth.levels[0].bandwidth, rel=0.15)
    assert fits[0].mean_abs_error < 0.15


@pytest.mark.dist
def test_calibrate_two_gloo_ranks(tmp_path):
    cluster = Cluster.preset("cpu-gloo", 2)
    fitted, fits, samples = calibrate(cluster, nproc=2, sizes=(2**12, 2**18, 2**21), repeats=2, timeout=120)
    assert {s.kind for s in samples} == set(KINDS) and len(samples) == 15
    assert all(s.seconds > 0 for s in samples)
    assert fits and fits[0].bandwidth > 0 and fits[0].latency >= 0
    path = tmp_path / "c.yaml"
    fitted.save(str(path))
    assert Cluster.load(str(path)).levels[0].bandwidth == pytest.approx(fits[0].bandwidth)


def test_pairwise_fit_recovers_known_pairs():
    from profiler.pairwise import PairSample, fit_pairs

    truth = {(0, 1): (40e9, 3e-6), (0, 2): (2e9, 2e-5)}
    sizes = (4e3, 6.4e4, 1e6, 1.6e7)
    samples = [PairSample(a, b, s, lat + s / bw) for (a, b), (bw, lat) in truth.items() for s in sizes]
    fits = {(f.src, f.dst): f for f in fit_pairs(samples)}
    for pair, (bw, lat) in truth.items():
        assert fits[pair].bandwidth == pytest.approx(bw, rel=1e-9)
        assert fits[pair].latency == pytest.approx(lat, rel=1e-9)
        assert fits[pair].samples == 4 and fits[pair].mean_abs_error < 1e-9
    flat = [PairSample(0, 1, s, 1e-3) for s in sizes]  # the same time at every size: no bandwidth to fit
    with pytest.raises(ValueError, match=r"pair \(0, 1\): no bandwidth term fits .* larger messages"):
        fit_pairs(flat)
