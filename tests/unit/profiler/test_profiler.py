"""Profiler: timer, TP-local shapes, per-op profile, reuse, profile file, workload from a profile."""

import json
import math
import re
from dataclasses import replace

import pytest
import torch

from nest_fx.cluster import load_cluster
from nest_fx.workload import workload_for_model
from profiler import measure as measure_mod
from profiler.model_profile import ProfileOptions, distinct_depth, local_graph, profile_model
from nest_fx.workload.profile_file import Profile, ProfileError, op_key
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
    return profile_model(
        GPT, "cpu", ProfileOptions(tps=(1, 2), mbss=(2,), repeats=7, statistic="min", check_step=False)
    )


def test_timer_cpu_takes_the_median_or_the_minimum(fake_clock):
    clock = fake_clock(0.0)
    durations = iter([9.0, 0.05, 0.01, 0.02, 0.05, 0.01, 0.02])  # the warm-up call is not timed

    def call():
        clock.advance(next(durations))

    assert Timer("cpu", warmup=1, repeats=3, flush_bytes=0).measure(call) == pytest.approx(0.02)
    assert Timer("cpu", warmup=0, repeats=3, flush_bytes=0, statistic="min").measure(call) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="repeats"):
        Timer("cpu", repeats=0)
    with pytest.raises(ValueError, match="statistic"):
        Timer("cpu", statistic="mean")


def test_timer_cpu_offset_host_and_step(fake_clock):
    clock = fake_clock(0.0)
    timer = Timer("cpu", warmup=0, repeats=3, flush_bytes=0, statistic="min")
    t = timer.measure(lambda: clock.advance(0.03), cpu_offset=0.02)
    assert t == pytest.approx(0.01)  # the offset comes off the host side of each repeat
    assert timer.measure(lambda: None, cpu_offset=1.0) == 0.0  # never negative
    assert timer.measure_host(lambda: clock.advance(0.03)) == pytest.approx(0.03)
    assert timer.measure_step(lambda: clock.advance(0.03)) == pytest.approx(0.03)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU (CPU path tested above)")
def test_timer_cuda_events():
    timer = Timer("cuda", warmup=2, repeats=5)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    kernel = timer.measure(lambda: a @ a)
    step = timer.measure_step(lambda: a @ a)
    assert 0 < kernel < 0.01 and kernel <= step * 1.05  # the event span holds the kernel only
    x = torch.ones(1, device="cuda")

    def host_bound():  # 200 launches of nothing: the host is the bottleneck
        for _ in range(200):
            x.add_(1.0)

    host = timer.measure_host(host_bound)
    assert timer.measure(host_bound) >= 0.8 * host  # the dispatch time counts when it dominates
    y = torch.zeros(1, device="cuda")
    synced = timer.measure(lambda: (a @ a, y.add_(1).item()))  # a synchronising op: its span counts
    assert kernel * 0.8 <= synced < 0.05


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


def test_uneven_vocabulary_takes_the_largest_shard():
    """gpt2's 50257-token vocabulary on TP2: the embedding and LM head keep ceil(V/tp) rows, as
    the runtime's vocabulary-parallel Shard(0) gives the first rank."""
    graph, model, args, _ = local_graph(
        "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=257", 2, 1, seq=None, dtype=torch.float32, layers=2, device="cpu"
    )
    assert model.embed.tok.num_embeddings == 129 and model.lm_head.out_features == 129
    assert int(args[0].max()) < 129
    prof, stats = profile_model(
        "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=257",
        "cpu",
        ProfileOptions(tps=(2,), repeats=1, warmup=0, check_step=False),
    )
    assert not stats.skipped and prof.ops


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


def test_per_op_sum_counts_every_op_of_the_whole_step_once(gpt_profile):
    """The profile-costed model sums, over all 6 layers, each op's entry (timed once per distinct
    block and reused): with every entry set to 1 s forward and 2 s backward, the sum is the number
    of ops of the full-depth model, plus the cross-entropy tail the workload costs analytically.
    (How close measured per-op sums come to a measured eager step: scripts/bench_profiler.py.)"""
    prof, _ = gpt_profile
    unit = Profile.from_dict(prof.to_dict())
    for key, e in unit.ops.items():
        unit.ops[key] = replace(e, fwd_s=1.0, bwd_s=2.0, fwd_host_s=None, bwd_host_s=None)
    wl = workload_for_model(GPT, load_cluster("cpu-gloo:2"), dtype=torch.float32, profile=unit)
    fwd = sum(wl.cost(i, tp=1, mbs=2).fwd_s for i in range(len(wl)))
    bwd = sum(wl.cost(i, tp=1, mbs=2).bwd_s for i in range(len(wl)))
    full, *_ = local_graph(GPT, 1, 2, seq=None, dtype=torch.float32, layers=None)
    ops = [d for _, d in full.graph.nodes(data=True) if d["fx_op"] not in ("placeholder", "output", "get_attr")]
    assert all(unit.lookup(op_key(d)) is not None for d in ops)
    assert len(unit.ops) < len(ops) // 3  # reused: far fewer entries than ops
    assert len(ops) <= fwd < len(ops) + 0.01, (fwd, len(ops))
    assert 2 * len(ops) <= bwd < 2 * len(ops) + 0.02, (bwd, len(ops))


def test_block_pace_is_the_slower_of_device_and_host(gpt_profile):
    """On a GPU the host may dispatch small ops slower than their kernels run: a block then
    costs its host time. Entries with host figures 3x the device's triple the block costs;
    entries without host figures (older files) cost their device time."""
    from nest_fx.workload.profile_file import OpEntry, block_seconds

    assert block_seconds([(1.0, 2.0), (1.0, 2.0)], [(3.0, 1.0), (0.5, 1.0)]) == (3.5, 4.0)
    assert OpEntry(op="x", fwd_s=1.0, bwd_s=2.0, peak_bytes=0.0).host == (1.0, 2.0)
    prof, _ = gpt_profile
    slow = Profile.from_dict(prof.to_dict())
    slow.ops = {k: replace(e, fwd_host_s=3 * e.fwd_s, bwd_host_s=3 * e.bwd_s) for k, e in prof.ops.items()}
    assert Profile.from_dict(slow.to_dict()).ops.keys() == slow.ops.keys()  # host fields round-trip
    base = workload_for_model(GPT, load_cluster("cpu-gloo:2"), dtype=torch.float32, profile=prof)
    paced = workload_for_model(GPT, load_cluster("cpu-gloo:2"), dtype=torch.float32, profile=slow)
    for i in range(1, len(base) - 1):  # blocks; the tail adds the analytical loss
        for tp in (1, 2):
            b, p = base.cost(i, tp=tp, mbs=2), paced.cost(i, tp=tp, mbs=2)
            assert p.fwd_s == pytest.approx(3 * b.fwd_s) and p.bwd_s == pytest.approx(3 * b.bwd_s)
            assert p.recompute_s["selective"] == pytest.approx(3 * b.recompute_s["selective"])


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
    for mutate, match in [
        (lambda d: d.update(format="x"), "format"),
        (lambda d: d.pop("dtype"), "dtype"),
        (lambda d: d.update(ops=[1]), "ops"),
        (lambda d: next(iter(d["ops"].values())).pop("fwd_s"), "fwd_s"),
        (lambda d: next(iter(d["ops"].values())).update(bwd_s="fast"), "numbers"),
    ]:
        bad = json.loads(json.dumps(data))
        mutate(bad)
        with pytest.raises(ProfileError, match=match):
            Profile.from_dict(bad)
    with pytest.raises(ValueError, match="bf16"):
        workload_for_model(GPT, load_cluster("cpu-gloo:2"), dtype=torch.bfloat16, profile=prof)


def test_a_profile_flags_its_own_outliers(gpt_profile):
    """An entry 20x slower than a larger entry of the same structure is flagged, in the profile's
    warnings (saved with it) and as a warning; a re-check replaces the flags of the earlier one."""
    from profiler.outliers import find_outliers, flag_outliers

    prof = Profile.from_dict(gpt_profile[0].to_dict())
    for key, e in prof.ops.items():  # times that grow with the work: nothing to flag
        work = e.flops or e.peak_bytes
        prof.ops[key] = replace(e, fwd_s=1e-6 + work * 1e-12, bwd_s=2e-6 + work * 2e-12)
    clean = Profile.from_dict(prof.to_dict())
    assert find_outliers(prof) == []
    linears = sorted((e.flops, k) for k, e in prof.ops.items() if e.op == "linear" and e.usable)
    small, big = linears[0][1], linears[-1][1]
    prof.ops[small] = replace(prof.ops[small], bwd_s=20 * prof.ops[big].bwd_s)
    with pytest.warns(UserWarning, match="outlier: linear"):
        found = flag_outliers(prof)
    assert len(found) == 1 and found[0].startswith(f"outlier: {small} bwd")
    assert float(re.search(r" is ([0-9.]+)x the ", found[0]).group(1)) >= 20
    assert found[0] in Profile.from_dict(prof.to_dict()).warnings
    prof.ops[small] = clean.ops[small]  # re-measured
    assert flag_outliers(prof) == [] and not any(w.startswith("outlier:") for w in prof.warnings)
