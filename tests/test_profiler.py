"""Profiler: timer, TP-local shapes, per-op profile, reuse, profile file, workload from a profile."""
import json
import math
import time

import pytest
import torch

from nest_fx.builders import load_cluster, workload_for_model
from nest_fx.models import build_any
from profiler import measure as measure_mod
from profiler.model_profile import ProfileOptions, distinct_depth, local_graph, profile_model
from profiler.profile_file import Profile, ProfileError, op_key
from profiler.timer import Timer

GPT = "gpt:hidden=256,layers=6,heads=4,seq=128,vocab=4096"
LLAMA = "llama:hidden=128,layers=3,heads=4,kv=2,seq=64,vocab=1024"


@pytest.fixture(scope="module")
def single_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # stable CPU timings on a shared 2-core machine
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def gpt_profile(single_thread):
    return profile_model(GPT, "cpu", ProfileOptions(tps=(1, 2), mbss=(2,), repeats=7, statistic="min",
                                                    check_step=False))


def test_timer_cpu_measures_sleep():
    timer = Timer("cpu", warmup=1, repeats=3, flush_bytes=0)
    t = timer.measure(lambda: time.sleep(0.02))
    assert 0.015 < t < 0.2
    with pytest.raises(ValueError, match="repeats"):
        Timer("cpu", repeats=0)
    with pytest.raises(ValueError, match="statistic"):
        Timer("cpu", statistic="mean")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU (CPU path tested above)")
def test_timer_cuda_events():
    timer = Timer("cuda", warmup=1, repeats=3)
    a = torch.randn(2048, 2048, device="cuda")
    t = timer.measure(lambda: a @ a)
    assert 0 < t < 0.1


def test_localised_shapes_halve_tp_regions():
    full, *_ = local_graph(GPT, 1, 2, seq=None, dtype=torch.float32, layers=2)
    half, model, *_ = local_graph(GPT, 2, 2, seq=None, dtype=torch.float32, layers=2)
    assert model.layers[0].attn.q_proj.out_features == 128
    assert model.layers[0].attn.o_proj.in_features == 128
    assert model.layers[0].mlp.fc.out_features == 512
    # every matmul FLOP of a block is TP-sharded: exactly half
    for bf, bh in zip(full.layer_blocks, half.layer_blocks):
        mm = lambda g, b: sum(g.graph.nodes[n]["flops"] for n in b.nodes if g.graph.nodes[n].get("weight"))
        assert mm(half, bh) == pytest.approx(mm(full, bf) / 2)


def test_distinct_depth():
    graph, *_ = local_graph(GPT, 1, 1, seq=None, dtype=torch.float32, layers=None)
    assert distinct_depth(graph) == 2  # one signature; two layers so blocks are detected


def test_profile_covers_every_costly_node(gpt_profile):
    prof, stats = gpt_profile
    assert stats.nodes_timed > 0 and not stats.skipped
    for tp in (1, 2):
        graph, *_ = local_graph(GPT, tp, 2, seq=None, dtype=torch.float32, layers=2)
        for n, d in graph.graph.nodes(data=True):
            if d["fx_op"] in ("placeholder", "output"):
                continue
            entry = prof.lookup(op_key(d))
            assert entry is not None, f"tp={tp}: no profile entry for {n} ({d['op']})"
            if d.get("flops", 0) > 1e6:
                assert entry.fwd_s > 0 and entry.bwd_s > 0
    wl = workload_for_model(GPT, load_cluster("cpu-gloo:2"), dtype=torch.float32, profile=prof)
    assert wl.source.coverage(1, 2) == pytest.approx(1.0)
    assert wl.source.coverage(2, 2) == pytest.approx(1.0)
    assert wl.source.coverage(1, 4) < 0.01  # mbs 4 was not profiled: analytical but for shape-free ops


def test_per_op_sum_matches_whole_step(gpt_profile):
    """Acceptance: the profile-costed model (sum over all layers of per-op fwd+bwd, plus the
    cross-entropy loss the workload adds to the tail) is within 20% of a measured eager
    training step of the full 6-layer model with that loss."""
    prof, _ = gpt_profile
    wl = workload_for_model(GPT, load_cluster("cpu-gloo:2"), dtype=torch.float32, profile=prof)
    predicted = sum(wl.cost(i, tp=1, mbs=2).fwd_s + wl.cost(i, tp=1, mbs=2).bwd_s for i in range(len(wl)))
    torch.manual_seed(0)
    model, _, args, kwargs = build_any(GPT, batch=2, device="cpu", dtype=torch.float32)
    eager = measure_mod.measure_step(model, args, kwargs, Timer("cpu", warmup=2, repeats=7, statistic="min"),
                                     loss="cross_entropy")
    assert abs(predicted / eager - 1) <= 0.20, (predicted, eager)


def test_reuse_times_fewer_ops(single_thread):
    opts = dict(tps=(1,), mbss=(1,), repeats=1, warmup=0, check_step=False)
    _, reused = profile_model(GPT, "cpu", ProfileOptions(**opts))
    _, naive = profile_model(GPT, "cpu", ProfileOptions(reuse=False, **opts))
    assert reused.nodes_timed * 3 < naive.nodes_timed  # 6 identical blocks timed once
    # a second model sharing the op shapes reuses the first one's entries
    prof, _ = profile_model(GPT, "cpu", ProfileOptions(**opts))
    _, again = profile_model(GPT, "cpu", ProfileOptions(**opts), profile=prof)
    assert again.nodes_timed == 0


def test_oom_op_is_skipped_and_modelled(monkeypatch, single_thread):
    real = measure_mod._MeasuringInterpreter._measure_with

    def flaky(self, n, args, kwargs, cuda, copy_inputs):
        if "fc" in n.name:
            raise RuntimeError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real(self, n, args, kwargs, cuda, copy_inputs)
    monkeypatch.setattr(measure_mod._MeasuringInterpreter, "_measure_with", flaky)
    with pytest.warns(UserWarning, match="oom"):
        prof, stats = profile_model(GPT, "cpu", ProfileOptions(repeats=1, warmup=0, check_step=False))
    skipped = [e for e in prof.ops.values() if e.skipped]
    assert skipped and all(e.skipped == "oom" for e in skipped)
    wl = workload_for_model(GPT, load_cluster("cpu-gloo:2"), dtype=torch.float32, profile=prof)
    assert 0.0 < wl.source.coverage(1, 1) < 1.0  # the fc linears fall back to the roofline
    assert all(math.isfinite(wl.cost(i).fwd_s) for i in range(len(wl)))


def test_variant_that_does_not_divide_is_skipped(single_thread):
    with pytest.warns(UserWarning, match="tp=3"):
        prof, stats = profile_model(LLAMA, "cpu", ProfileOptions(tps=(3,), repeats=1, warmup=0, check_step=False))
    assert stats.skipped and not prof.ops


def test_llama_gqa_profile_and_tp(single_thread):
    prof, stats = profile_model(LLAMA, "cpu", ProfileOptions(tps=(1, 2), repeats=1, warmup=0, check_step=False))
    assert not stats.skipped
    wl = workload_for_model(LLAMA, load_cluster("cpu-gloo:2"), dtype=torch.float32, profile=prof)
    assert wl.source.coverage(2, 1) == pytest.approx(1.0)


def test_profile_file_roundtrip_and_errors(tmp_path, gpt_profile):
    prof, _ = gpt_profile
    path = tmp_path / "p.json"
    prof.save(str(path))
    back = Profile.load(str(path))
    assert back.ops.keys() == prof.ops.keys() and back.device_name == prof.device_name
    data = json.loads(path.read_text())
    for mutate, match in [(lambda d: d.update(format="x"), "format"),
                          (lambda d: d.pop("dtype"), "dtype"),
                          (lambda d: d.update(ops=[1]), "ops"),
                          (lambda d: next(iter(d["ops"].values())).pop("fwd_s"), "fwd_s"),
                          (lambda d: next(iter(d["ops"].values())).update(bwd_s="fast"), "numbers")]:
        bad = json.loads(json.dumps(data))
        mutate(bad)
        with pytest.raises(ProfileError, match=match):
            Profile.from_dict(bad)
    with pytest.raises(ValueError, match="bf16"):
        workload_for_model(GPT, load_cluster("cpu-gloo:2"), dtype=torch.bfloat16, profile=prof)
