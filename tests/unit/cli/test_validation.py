"""Bad input from users: each failure is one clear error naming the problem (regressions of the
crashes ``scripts/bench_fuzz.py`` found), and the CLI turns it into one ``error:`` line, exit 2."""

from __future__ import annotations

import json

import pytest

from nest_fx.cli import main
from nest_fx.cluster import MAX_DEVICES, Cluster, ClusterError
from nest_fx.cost.step_time import simulate
from nest_fx.common.fileio import MAX_DEPTH, brief
from nest_fx.models.zoo import parse_spec
from nest_fx.plan import Plan, PlanError, uniform_plan
from nest_fx.solver import NoFeasiblePlan, SolverOptions, solve
from nest_fx.solver.space import divisors
from nest_fx.workload import WorkloadError, load_workload, workload_from_table

MODEL = "llama:hidden=64,layers=2,heads=4,seq=32,vocab=128"
LOADERS = [
    (Cluster.load, ClusterError, ".yaml"),
    (Cluster.load, ClusterError, ".json"),
    (Plan.load, PlanError, ".json"),
    (load_workload, WorkloadError, ".json"),
]


def _variant(tp: int) -> dict:
    return {
        "tp": tp,
        "fwd_s": 1e-3 / tp,
        "bwd_s": 2e-3 / tp,
        "num_params": 1e6 / tp,
        "param_bytes": 2e6 / tp,
        "act_bytes": 4e6 / tp,
        "out_bytes": 1e5,
    }


def table(tps=(1, 2), heads: int = 4) -> dict:
    """A 4-layer layer table (head, 2 blocks, tail) with costs for the given TP degrees."""
    layers = [
        {"name": "head", "kind": "head", "signature": "e"},
        *({"name": f"layers.{i}", "kind": "block", "signature": "d"} for i in range(2)),
        {"name": "tail", "kind": "tail", "signature": "t"},
    ]
    return {
        "format": "nest-fx-workload/1",
        "model": "toy",
        "dims": {"seq_len": 32, "heads": heads},
        "layers": layers,
        "costs": {k: [_variant(tp) for tp in tps] for k in ("head:e", "block:d", "tail:t")},
    }


def run_cli(argv, capsys, monkeypatch):
    """(exit code, stdout, stderr) of ``nest-fx ARGV`` with tracebacks off."""
    monkeypatch.delenv("NEST_FX_DEBUG", raising=False)
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_one_error_line(err: str, *needles: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# -- files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("load, error, ext", LOADERS)
def test_non_utf8_file_names_the_byte(tmp_path, load, error, ext):
    path = tmp_path / f"f{ext}"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(error, match=r"not a UTF-8 text file \(byte 0xff at offset 7\)"):
        load(str(path))


@pytest.mark.parametrize("load, error, ext", LOADERS)
def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path, load, error, ext):
    path = tmp_path / f"f{ext}"
    path.write_text("[" * 5000)
    with pytest.raises(error, match="nested too deeply"):
        load(str(path))
    path.write_text("[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5))  # parses, but deeper than any of ours
    with pytest.raises(error, match=f"nested more than {MAX_DEPTH} levels"):
        load(str(path))


@pytest.mark.parametrize("load, error, ext", LOADERS)
def test_integer_past_the_digit_limit(tmp_path, load, error, ext):
    path = tmp_path / f"f{ext}"
    path.write_text("format: " + "9" * 5000 if ext == ".yaml" else '{"format": ' + "9" * 5000 + "}")
    with pytest.raises(error, match="digits"):
        load(str(path))


def test_yaml_syntax_error_is_one_line_with_position(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nlevels: [1\n")
    with pytest.raises(ClusterError) as info:
        Cluster.load(str(path))
    message = str(info.value)
    assert "\n" not in message
    assert "not valid YAML (expected ',' or ']'" in message and "at line 3, column 1" in message


def test_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "p.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(uniform_plan(4).to_dict()).encode())
    assert Plan.load(str(path)).pp == 1


def test_yaml_alias_bomb_is_quoted_briefly(tmp_path):
    levels = ["&a [x, x, x, x, x, x, x, x, x]"] + [
        f"&{k} [{', '.join(['*' + p] * 9)}]" for p, k in zip("abcdefgh", "bcdefghi")
    ]
    doc = Cluster.preset("cpu-gloo", 2).to_dict()
    del doc["name"]
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(doc)[:-1] + f', "name": [{", ".join(levels)}]}}')  # 9**9 leaves if expanded
    with pytest.raises(ClusterError) as info:
        Cluster.load(str(path))
    assert "name: must be a non-empty string, got [[" in str(info.value) and len(str(info.value)) < 300


def test_brief_cuts_long_and_nested_values():
    assert brief("x" * 1000).count("x") < 70
    assert brief(10**5000) == "<int>"  # more digits than Python prints
    nested: list = []
    nested.append(nested)
    assert brief(nested).startswith("[[") and "..." in brief(nested) and len(brief(nested)) < 20
    assert "\n" not in brief("a\nb")
    assert len(brief([[str(i)] * 50 for i in range(50)])) <= 120


# -- documents -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(stages=3), "stages must be a list"),
        (lambda d: d.update(stages=[{"start": 0, "end": 1.5}]), r"stages\[0\].end must be an integer, got 1.5"),
        (lambda d: d["stages"][0].update(tp=True), r"stages\[0\].tp must be an integer, got True"),
        (lambda d: d["stages"][0].update(start=float("inf")), r"stages\[0\].start must be an integer"),
        (lambda d: d["stages"][0].update(recompute=["full"]), r"stages\[0\].recompute"),
        (lambda d: d.update(dp=True), "dp must be an integer, got True"),
        (lambda d: d.update(world_size=-8), "world_size: must be >= 0"),
        (lambda d: d.update(sequence_parallel="yes"), "sequence_parallel must be true or false"),
        (lambda d: d.update(schedule=None), "schedule must be a string"),
        (lambda d: d.update(predicted=[1]), "predicted must map names to numbers"),
        (lambda d: d.update(num_layers=6), r"cover layers \[0, 4\) but num_layers is 6"),
        (lambda d: d.update(num_microbatches=10**400), "num_microbatches: 1000.* is larger than nest-fx handles"),
    ],
)
def test_plan_fields_are_type_checked(edit, message):
    data = uniform_plan(4, pp=2, dp=2, num_microbatches=4).to_dict()
    edit(data)
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(data, where="p.json")


def test_plan_errors_start_with_the_file(tmp_path):
    path = tmp_path / "p.json"
    data = uniform_plan(4).to_dict()
    data["zero"] = 7
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"^.*p\.json: zero: 7, use 0, 1, 2 or 3$"):
        Plan.load(str(path))


def test_plan_format_version_is_checked_first():
    with pytest.raises(PlanError, match=r"format is 'nest-fx-plan/2'; this version reads 'nest-fx-plan/1'"):
        Plan.from_dict({"format": "nest-fx-plan/2", "stages": "anything"})


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["costs"]["head:e"][0].update(fwd_s=10**400), r"fwd_s: must be a finite number"),
        (lambda d: d["costs"]["head:e"][0].update(bwd_s=float("nan")), r"bwd_s: must be a finite number, got nan"),
        (lambda d: d["costs"]["head:e"][0].update(comms=5), r"comms: expected a list"),
        (lambda d: d["costs"]["head:e"][0].update(sp="no"), r"\.sp: expected true or false"),
        (lambda d: d["dims"].update(heads=4.5), r"dims\.heads: expected an integer >= 0, got 4.5"),
        (lambda d: d["dims"].update(seq_len=0), r"dims\.seq_len: expected a positive integer, got 0"),
        (lambda d: d["layers"][0].update(is_moe="false"), r"layers\[0\]\.is_moe: expected true or false"),
        (lambda d: d["layers"][0].update(name=7), r"layers\[0\]\.name: expected a non-empty string"),
        (lambda d: d.update(model=["x"]), r"workload\.model: expected a string"),
        (lambda d: d["costs"]["head:e"][0].update(act_bytes=1e300), r"act_bytes\.none: must be at most 1e\+30"),
        (lambda d: d["costs"]["head:e"][0].update(tp=2**40), r"\.tp: 1099511627776 is larger than nest-fx handles"),
        (
            lambda d: d["costs"]["head:e"][0].update(expert_params=2e6),
            r"expert_params: 2e\+06 exceeds num_params=1e\+06",
        ),
    ],
)
def test_workload_values_are_checked(edit, message):
    data = table()
    edit(data)
    with pytest.raises(WorkloadError, match=message):
        workload_from_table(data)


def test_absurd_device_counts_are_refused():
    with pytest.raises(ClusterError, match=f"more devices than nest-fx plans for \\(at most {MAX_DEVICES:,}\\)"):
        Cluster.preset("dgx-a100", 10**20)
    data = Cluster.preset("cpu-gloo", 2).to_dict()
    data.update(num_devices=MAX_DEVICES + 1)
    data["levels"][0]["group_size"] = MAX_DEVICES + 1
    with pytest.raises(ClusterError, match="num_devices: .* more devices than nest-fx plans for"):
        Cluster.from_dict(data)
    data["device"]["memory_bytes"] = 10**400  # an int past the float range
    with pytest.raises(ClusterError, match="memory_bytes: must be finite"):
        Cluster.from_dict(data)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("bandwidth", 1e-300, r"levels\[0\]\.bandwidth: must be at least 1 \(SI units"),
        ("bandwidth", "1e40B/s", r"levels\[0\]\.bandwidth: must be at most 1e\+30"),
        ("latency", 1e31, r"levels\[0\]\.latency: must be at most 1e\+30"),
    ],
)
def test_cluster_quantities_have_a_range(field, value, message):
    data = Cluster.preset("cpu-gloo", 2).to_dict()
    data["levels"][0][field] = value
    with pytest.raises(ClusterError, match=message):
        Cluster.from_dict(data)


def test_model_spec_with_zero_kv_heads_names_it():
    with pytest.raises(ValueError, match="kv_heads must be positive, got 0"):
        parse_spec("llama:hidden=64,layers=2,heads=4,kv=0")
    with pytest.raises(ValueError, match="norm_eps must be a finite number >= 0, got nan"):
        parse_spec("llama:norm_eps=nan")


def test_divisors_match_brute_force_and_are_fast():
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(0, 300))
    assert divisors(2**40) == [2**k for k in range(41)]


# -- the planner on a table with some variants only -----------------------------------------


def test_solver_keeps_to_the_variants_a_table_has():
    cluster = Cluster.preset("dgx-a100", 8)
    only_tp1 = workload_from_table(table(tps=(1,)))
    assert only_tp1.supports(1) and not only_tp1.supports(2)
    assert "has no cost for tp=2" in only_tp1.variant_problem(2)
    found = solve(only_tp1, cluster, 8, SolverOptions(time_budget=5))
    assert {s.tp for s in found.plan.stages} == {1}
    only_tp2 = workload_from_table(table(tps=(2,)))
    found = solve(only_tp2, cluster, 8, SolverOptions(time_budget=5))
    assert {s.tp for s in found.plan.stages} == {2}


def test_solver_explains_when_no_variant_is_allowed():
    only_tp2 = workload_from_table(table(tps=(2,)))
    with pytest.raises(NoFeasiblePlan, match="no tensor-parallel degree in \\[1\\]"):
        solve(only_tp2, Cluster.preset("dgx-a100", 8), 8, SolverOptions(tp_degrees=(1,)))


def test_time_budget_bounds_the_megatron_incumbent_too(fake_clock):
    """The incumbent's own search (hundreds of shapes when memory is tight) stops at the deadline
    (on a clock of 1 ms per reading)."""
    from nest_fx.solver.recipes import megatron

    heavy = dict(table(tps=(1, 2, 4, 8), heads=64))
    heavy["layers"] = [{"name": f"layers.{i}", "kind": "block", "signature": "d"} for i in range(80)]
    heavy["costs"] = {
        "block:d": [dict(_variant(tp), num_params=1.5e9 / tp, param_bytes=3e9 / tp) for tp in (1, 2, 4, 8)]
    }
    work, cluster = workload_from_table(heavy), Cluster.preset("h100-spine-leaf", 1024)
    cluster.device.memory_bytes = 4 * 2**30
    assert megatron(work, cluster, 4096).evaluations > 30  # nothing fits: every shape is tried
    clock = fake_clock(1e-3)
    stopped = megatron(work, cluster, 4096, deadline=clock())
    assert stopped.plan is None and stopped.evaluations == 0
    start = clock()
    try:
        found = solve(work, cluster, 4096, SolverOptions(time_budget=0.5))
        assert found.result.feasible
    except NoFeasiblePlan as exc:
        assert "within the time budget of 0.5 s" in str(exc)
    assert clock.now - start < 0.5 + 0.02


def test_simulate_refuses_a_variant_the_workload_lacks():
    cluster = Cluster.preset("dgx-a100", 8)
    with pytest.raises(PlanError, match=r"stages\[0\]: layer 'head' has no cost for tp=2"):
        simulate(uniform_plan(4, tp=2), workload_from_table(table(tps=(1,))), cluster)
    with pytest.raises(PlanError, match=r"stages\[0\]: tp=8 does not divide the model's 4 attention heads"):
        simulate(uniform_plan(4, tp=8), workload_from_table(table(tps=(1, 8))), cluster)


# -- the command line ----------------------------------------------------------------------


def test_cli_plans_a_tp1_only_table_with_tp1(tmp_path, capsys, monkeypatch):
    path, out = tmp_path / "w.json", tmp_path / "plan.json"
    path.write_text(json.dumps(table(tps=(1,))))
    rc, _, err = run_cli(
        [
            "plan",
            "--workload",
            str(path),
            "--cluster",
            "dgx-a100:8",
            "--global-batch",
            "8",
            "--time-budget",
            "5",
            "--no-baselines",
            "--quiet",
            "--json",
            str(out),
        ],
        capsys,
        monkeypatch,
    )
    assert rc == 0 and err == ""
    assert {s.tp for s in Plan.load(str(out)).stages} == {1}


@pytest.mark.parametrize(
    "cluster, needle",
    [
        ("dgx-a100:99999999999999999999", "more devices than nest-fx plans for"),
        ("dgx-a100:1e3", "expected NAME:DEVICES with an integer device count"),
        ("nope:8", "unknown cluster preset 'nope'"),
    ],
)
def test_cli_refuses_bad_cluster_specs_in_one_line(tmp_path, capsys, monkeypatch, cluster, needle):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(table()))
    rc, _, err = run_cli(
        ["plan", "--workload", str(path), "--cluster", cluster, "--no-baselines", "--quiet"], capsys, monkeypatch
    )
    assert rc == 2
    assert_one_error_line(err, needle)


def test_cli_yaml_error_is_one_line(tmp_path, capsys, monkeypatch):
    cluster, work = tmp_path / "c.yaml", tmp_path / "w.json"
    cluster.write_text("format: nest-fx-cluster/1\nlevels: [1\n")
    work.write_text(json.dumps(table()))
    rc, _, err = run_cli(["plan", "--workload", str(work), "--cluster", str(cluster)], capsys, monkeypatch)
    assert rc == 2
    assert_one_error_line(err, "c.yaml: not valid YAML", "line 3, column 1")


def test_cli_multi_line_error_is_collapsed(capsys, monkeypatch):
    import nest_fx.graph
    from nest_fx.graph import TraceError

    def fail(*args, **kwargs):
        raise TraceError("running it on fake tensors failed\n  fix: give the op a meta kernel")

    monkeypatch.setattr(nest_fx.graph, "trace", fail)  # the trace handler imports it when it runs
    rc, _, err = run_cli(["trace", MODEL], capsys, monkeypatch)
    assert rc == 2
    assert_one_error_line(err, "failed fix: give the op a meta kernel")


@pytest.mark.parametrize(
    "plan, work, needle",
    [
        (uniform_plan(4, tp=2), table(tps=(1,)), "has no cost for tp=2, ep=1; the table has (tp, ep) in [(1, 1)]"),
        (uniform_plan(4, tp=8), table(tps=(1, 8)), "tp=8 does not divide the model's 4 attention heads"),
        (uniform_plan(6, pp=2), table(), "stages: cover layers [0, 6) but the workload has 4 layers"),
        (uniform_plan(4, dp=16), table(), "the plan uses 16 devices (dp=16 x 1 per replica) but the world has 8"),
    ],
)
def test_cli_simulate_refuses_a_plan_for_another_model_or_world(tmp_path, capsys, monkeypatch, plan, work, needle):
    plan_path, work_path = tmp_path / "p.json", tmp_path / "w.json"
    plan.save(str(plan_path))
    work_path.write_text(json.dumps(work))
    rc, _, err = run_cli(
        ["simulate", "--plan", str(plan_path), "--workload", str(work_path), "--cluster", "dgx-a100:8"],
        capsys,
        monkeypatch,
    )
    assert rc == 2
    assert_one_error_line(err, str(plan_path), needle)


def test_cli_unwritable_output_is_a_user_error(tmp_path, capsys, monkeypatch):
    plan_path, work_path = tmp_path / "p.json", tmp_path / "w.json"
    uniform_plan(4).save(str(plan_path))
    work_path.write_text(json.dumps(table()))
    out = tmp_path / "no" / "such" / "dir.json"
    rc, _, err = run_cli(
        [
            "simulate",
            "--plan",
            str(plan_path),
            "--workload",
            str(work_path),
            "--cluster",
            "dgx-a100:8",
            "--json",
            str(out),
        ],
        capsys,
        monkeypatch,
    )
    assert rc == 2
    assert_one_error_line(err, f"cannot write {str(out)!r}: No such file or directory")


@pytest.mark.parametrize(
    "flag, value, needle",
    [
        ("--time-budget", "0", "expected a finite number of seconds > 0"),
        ("--time-budget", "nan", "expected a finite number of seconds > 0"),
        ("--global-batch", "99999999999999999999", "larger than nest-fx handles"),
        ("--seq", "0", "expected a positive integer"),
    ],
)
def test_cli_argument_ranges(tmp_path, capsys, flag, value, needle):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", MODEL, "--cluster", "dgx-a100:8", flag, value])
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_fake_tensor_failure_is_one_trace_error_without_torch_log_records(caplog):
    """An op that fails on fake tensors becomes a TraceError; FakeTensorMode's own log record
    (a traceback on stderr) is muted, so the CLI prints only its one ``error:`` line."""
    import logging

    from nest_fx.graph import TraceError, trace
    from nest_fx.models import build_any

    model, _, args, kwargs = build_any(MODEL, seq=2**31 - 1, device="meta")  # scores overflow the storage size
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(TraceError, match="Storage size calculation overflowed"):
            trace(model, args, kwargs)
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]


def test_cli_simulate_json_of_a_zero3_plan(tmp_path, capsys, monkeypatch):
    """``simulate --json`` writes plain JSON for every plan (a ZeRO-3 stage once made ``fits`` a
    numpy bool, which ``json`` cannot write)."""
    plan_path, out = tmp_path / "p.json", tmp_path / "sim.json"
    uniform_plan(4, tp=2, dp=4, zero=3, recompute="full", sequence_parallel=True).save(str(plan_path))
    rc, _, err = run_cli(
        ["simulate", "--plan", str(plan_path), "--model", MODEL, "--cluster", "dgx-a100:8", "--json", str(out)],
        capsys,
        monkeypatch,
    )
    assert rc == 0 and err == ""
    stages = json.loads(out.read_text())["result"]["stages"]
    assert [s["fits"] for s in stages] == [True]
