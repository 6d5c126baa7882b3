"""nest-fx explain: schedule events, rank-layout descriptions, the text report, the PNG and the CLI."""

import itertools
import json

import pytest

from nest_fx.report import timeline
from nest_fx.cli import main
from nest_fx.cost.inflight import pipeline_inflight_microbatches
from nest_fx.cost.step_time import pipeline_time, simulate
from nest_fx.report.layout import fmt_ranks, group_lines, level_map_lines
from nest_fx.plan import Plan, uniform_plan

MODEL = "llama:hidden=256,layers=4,heads=4,seq=128,vocab=512"  # 6 layers: head, 4 blocks, tail

CASES = (
    [("1f1b", 1, p, m) for p, m in ((1, 3), (2, 2), (3, 7), (4, 16))]
    + [("gpipe", 1, p, m) for p, m in ((1, 2), (3, 5), (4, 8))]
    + [("interleaved", v, p, m) for v, p, m in ((2, 2, 4), (2, 3, 6), (3, 4, 8), (2, 4, 16))]
)


# -- schedule events ---------------------------------------------------------------------------


@pytest.mark.parametrize("schedule,v,p,m", CASES)
def test_equal_stages_makespan_is_the_cost_model_pipeline_time(schedule, v, p, m):
    f, b = 1.0, 2.5
    events = timeline.schedule_events([f] * p, [b] * p, m, schedule, v)
    expected, _ = pipeline_time([f + b] * p, m, schedule, v)
    assert timeline.makespan(events) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("schedule,v,p,m", CASES)
def test_event_ordering_invariants(schedule, v, p, m):
    fwd = [0.5 + 0.3 * i for i in range(p)]  # unequal stages
    bwd = [2 * x + 0.1 for x in fwd]
    events = timeline.schedule_events(fwd, bwd, m, schedule, v)
    chunks = v if schedule == "interleaved" else 1
    assert len(events) == 2 * p * chunks * m
    at = {(e.phase, timeline.virtual_stage(e, p), e.microbatch): e for e in events}
    assert len(at) == len(events)  # every block exactly once
    last = p * chunks - 1
    for s, mb in itertools.product(range(last + 1), range(m)):
        f_, b_ = at[("F", s, mb)], at[("B", s, mb)]
        if s > 0:  # forward flows down the pipeline
            assert f_.start >= at[("F", s - 1, mb)].end - 1e-12
        if s < last:  # backward flows back up
            assert b_.start >= at[("B", s + 1, mb)].end - 1e-12
        assert b_.start >= f_.end - 1e-12
    for i in range(p):  # a device runs one block at a time
        mine = sorted((e for e in events if e.stage == i), key=lambda e: e.start)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))
        assert sum(e.end - e.start for e in mine) == pytest.approx(m * (fwd[i] + bwd[i]))


@pytest.mark.parametrize("schedule,p,m", [("1f1b", 4, 10), ("gpipe", 3, 5), ("1f1b", 4, 2)])
def test_in_flight_microbatches_match_the_memory_model(schedule, p, m):
    events = timeline.schedule_events([1.0] * p, [2.0] * p, m, schedule)
    for i in range(p):
        depth = peak = 0
        for e in sorted((e for e in events if e.stage == i), key=lambda e: e.start):
            depth += 1 if e.phase == "F" else -1
            peak = max(peak, depth)
        assert peak == pipeline_inflight_microbatches(schedule, i, p, m)


def test_schedule_errors():
    with pytest.raises(ValueError, match="multiple"):
        timeline.schedule_events([1.0] * 3, [1.0] * 3, 4, "interleaved", 2)
    with pytest.raises(ValueError, match="one time per stage"):
        timeline.schedule_events([1.0, 1.0], [1.0], 4)
    with pytest.raises(ValueError, match="schedule"):
        timeline.schedule_events([1.0], [1.0], 4, "zigzag")


# -- layout -------------------------------------------------------------------------------------


def test_fmt_ranks():
    assert fmt_ranks([3, 0, 1, 2]) == "0-3"
    assert fmt_ranks([0, 8, 16, 24]) == "0, 8, .., 24 (stride 8)"
    assert fmt_ranks([0, 1, 4, 5]) == "0-1, 4-5"
    assert fmt_ranks([7]) == "7"


def test_group_descriptions_name_the_network_level():
    from nest_fx.cluster import Cluster

    cluster = Cluster.preset("dgx-a100", 16)  # node 8, rack 32
    stage_major = uniform_plan(6, pp=2, tp=4, dp=2, num_microbatches=4)
    lines = "\n".join(group_lines(stage_major, cluster))
    assert "TP groups (all stages): 2 x 4 ranks per stage (4 in all), inside one node" in lines
    assert "DP groups (all stages): 4 x 2 ranks per stage (8 in all), inside one node" in lines
    assert "PP boundary 0->1: across nodes, over the rack level (24 GB/s)" in lines
    assert "e.g. ranks 0 -> 8" in lines
    replica_major = uniform_plan(6, pp=2, tp=4, dp=2, num_microbatches=4, placement="replica-major")
    lines = "\n".join(group_lines(replica_major, cluster))
    assert "DP groups (all stages): 4 x 2 ranks per stage (8 in all), across nodes, over the rack level" in lines
    assert "PP boundary 0->1: inside one node" in lines
    assert level_map_lines(stage_major, cluster)[0] == "node 0 of 2 (ranks 0-7): stage 0, replica 0-1, TP rank 0-3"


def test_expert_groups_listed():
    from nest_fx.cluster import Cluster

    plan = Plan(stages=uniform_plan(6, pp=1).stages, dp=16, ep=8, num_microbatches=1, num_layers=6)
    lines = "\n".join(group_lines(plan, Cluster.preset("dgx-a100", 16)))
    assert "EP groups (the stage): 2 x 8 ranks, inside one node" in lines
    assert "expert-DP groups (the stage): 8 x 2 ranks, across nodes" in lines


# -- report, PNG, CLI -----------------------------------------------------------------------------


def _workload_and_cluster():
    from nest_fx.cluster import load_cluster
    from nest_fx.workload import workload_for_model

    cluster = load_cluster("dgx-a100:8")
    return workload_for_model(MODEL, cluster), cluster


def test_stage_blocks_sum_to_the_cost_model_stage_time():
    workload, cluster = _workload_and_cluster()
    plan = uniform_plan(6, pp=3, tp=2, num_microbatches=6, schedule="interleaved", virtual_stages=2)
    result = simulate(plan, workload, cluster)
    fwd, bwd = timeline.stage_blocks(result, 2)
    for f, b, s in zip(fwd, bwd, result.stages):
        assert f + b == pytest.approx(s.per_microbatch(2))


def write_plan(tmp_path, name="plan.json", **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("cluster", "dgx-a100:8")
    plan = uniform_plan(6, pp=2, tp=2, dp=2, num_microbatches=4, **kw)
    path = tmp_path / name
    plan.save(str(path))
    return str(path)


def test_explain_prints_every_section(tmp_path, capsys):
    rc = main(["explain", write_plan(tmp_path)])  # model and cluster come from the plan file
    out = capsys.readouterr().out
    assert rc == 0
    for text in (
        "Mesh and rank layout",
        "mesh (pp, dp, tp) = (2, 2, 2)",
        "TP groups",
        "inside one node",
        "PP boundary 0->1",
        "Stages",
        "Memory per device",
        "optimizer states",
        "activations",
        "/80 GiB",
        "█",
        "Step time",
        "TP comm",
        "PP p2p",
        "pipeline bubble",
        "DP sync (exposed)",
        "Pipeline timeline",
        "event simulation of the schedule",
        "(+0.0% vs the cost model)",
    ):
        assert text in out, text


def test_explain_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    plan = write_plan(tmp_path, schedule="interleaved", virtual_stages=2, cluster="")
    rc = main(["explain", plan, "--cluster", "dgx-a100:8", "--png", str(png)])
    assert rc == 0 and "wrote" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_explain_png_without_matplotlib(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    rc = main(["explain", write_plan(tmp_path), "--png", str(tmp_path / "t.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "nest-fx[plot]" in err and "Traceback" not in err


def test_explain_preset_without_count_takes_the_plans_world_size(tmp_path, capsys):
    plan = write_plan(tmp_path, cluster="", world_size=8)
    assert main(["explain", plan, "--cluster", "dgx-a100"]) == 0
    assert "cluster dgx-a100: 8 x" in capsys.readouterr().out


def test_explain_user_errors(tmp_path, capsys):
    cases = [
        ([write_plan(tmp_path, "a.json", cluster="")], "does not record its cluster"),
        ([write_plan(tmp_path, "b.json", model="my-net")], "the plan's model 'my-net' cannot be built here"),
        ([write_plan(tmp_path, "c.json"), "--cluster", "dgx-a100:2"], "world has 2"),
        (
            [write_plan(tmp_path, "d.json"), "--model", "llama:hidden=256,layers=6,heads=4,seq=128,vocab=512"],
            "workload has 8 layers",
        ),
        ([str(tmp_path / "missing.json")], "missing.json"),
    ]
    for argv, message in cases:
        rc = main(["explain", *argv])
        err = capsys.readouterr().err
        assert rc == 2, argv
        assert message in err and "Traceback" not in err, err


def test_infeasible_plan_is_explained_and_exits_1(tmp_path, capsys):
    plan = uniform_plan(34, pp=1, tp=1, dp=1, num_microbatches=1, model="llama2-7b", cluster="dgx-a100:8")
    path = tmp_path / "p.json"
    plan.save(str(path))
    rc = main(["explain", str(path), "--seq", "1024"])
    out = capsys.readouterr().out
    assert rc == 1 and "DOES NOT FIT" in out and "!" in out


def test_plan_records_its_cluster(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "plan",
                "--model",
                MODEL,
                "--cluster",
                "dgx-a100",
                "--devices",
                "8",
                "--no-baselines",
                "--quiet",
                "--global-batch",
                "8",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    capsys.readouterr()
    data = json.loads(out.read_text())
    assert data["cluster"] == "dgx-a100:8"
    assert Plan.load(str(out)).cluster == "dgx-a100:8"


def test_interleaved_gantt_gives_each_chunk_its_own_hue_and_marks_backwards(tmp_path):
    """Every model chunk a distinct hue (none the tails' grey or green), the backward a hatched tint of
    its chunk's hue; the PNG is written."""
    pytest.importorskip("matplotlib")
    from nest_fx.report import gantt

    faces = [gantt._face("F", c, True) for c in range(len(gantt.CHUNK_COLORS))]
    hues = [f[0] for f in faces]
    assert len(set(hues)) == len(hues) and not {gantt.SYNC_COLOR, gantt.OPT_COLOR} & set(hues)
    for c, hue in enumerate(hues):
        back, edge, hatch = gantt._face("B", c, True)
        assert back != hue and edge == hue and hatch  # the same hue, lighter and hatched
        assert gantt._text_color(back) == "black"  # labels readable on the light tint
    assert gantt._face("F", 0, False)[0] != gantt._face("B", 0, False)[0]
    png = tmp_path / "interleaved.png"
    events = timeline.schedule_events([1.0] * 4, [2.0] * 4, 8, "interleaved", 3)
    gantt.draw_gantt(events, str(png), num_stages=4, title="p=4 v=3", tails=[(0.5, 0.3)] * 4)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
