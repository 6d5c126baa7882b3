"""The runtime's host work per collective: the fits, and the records of a real run on 2 gloo ranks."""

import math

import pytest

from nest_fx.cluster import load_cluster
from profiler.runtime_overhead import OverheadSample, fit_fsdp, fit_tp, measure_runtime_overheads

MODEL = "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=128"


def _sample(path, calls, nbytes, extra):
    return OverheadSample(path, 1, calls, nbytes, measured_s=extra + 1.0, local_s=0.9, network_s=0.1, extra_s=extra)


def test_tp_fit_recovers_per_call_and_per_byte_terms():
    a, b = 3e-3, 2e-9
    samples = [_sample("tp", 20, n, 20 * (a + b * n)) for n in (4e5, 1.6e6)]
    fa, fb = fit_tp(samples)
    assert fa == pytest.approx(a) and fb == pytest.approx(b)
    # never negative: a step that was no slower than the model gives 0
    assert fit_tp([_sample("tp", 10, 1e5, 0.0)]) == (0.0, 0.0)


def test_fsdp_fit_is_per_byte_moved():
    assert fit_fsdp(_sample("fsdp", 15, 1e7, 0.3)) == (0.0, pytest.approx(0.3 / 1.5e8))


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_measured_on_two_gloo_ranks():
    found = measure_runtime_overheads(MODEL, load_cluster("cpu-gloo:2"), nproc=2, microbatches=(1, 2))
    assert [s.path for s in found.samples] == ["tp", "tp", "fsdp"]
    for s in found.samples:
        assert s.calls > 0 and s.nbytes > 0 and s.measured_s > 0 and s.local_s > 0
        assert s.extra_s == pytest.approx(max(s.measured_s - s.local_s - s.network_s, 0.0))
    for a, b in (found.tp_call_overhead, found.fsdp_call_overhead):
        assert math.isfinite(a) and math.isfinite(b) and a >= 0 and b >= 0
    # how much longer the TP step takes than its shard alone (DTensor's host work) is a measurement:
    # scripts/validate_cpu.py reports it (runtime_overheads)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        measure_runtime_overheads(MODEL, load_cluster("cpu-gloo:2"), nproc=1)
