"""nest-fx simulate: tables, JSON and user errors (exit code 2, no traceback)."""

import json

from nest_fx.cli import main
from nest_fx.plan import uniform_plan

MODEL = "llama:hidden=256,layers=4,heads=4,seq=128,vocab=512"


def write_plan(tmp_path, **kw):
    plan = uniform_plan(6, pp=2, tp=2, dp=2, num_microbatches=4, **kw)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    return str(path)


def test_simulate_prints_breakdown_and_memory(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = main(
        ["simulate", "--plan", write_plan(tmp_path), "--model", MODEL, "--cluster", "dgx-a100:8", "--json", str(out)]
    )
    text = capsys.readouterr().out
    assert rc == 0
    for word in ("bubble", "tp_comm", "dp_sync_exposed", "activations", "tokens/s", "feasible"):
        assert word in text
    data = json.loads(out.read_text())
    assert data["result"]["step_s"] > 0 and len(data["result"]["stages"]) == 2


def test_simulate_from_workload_table(tmp_path, capsys):
    from nest_fx.cluster import load_cluster
    from nest_fx.workload import save_workload, workload_for_model

    table = tmp_path / "w.json"
    save_workload(workload_for_model(MODEL, load_cluster("dgx-a100:8")), str(table), tps=(1, 2))
    rc = main(["simulate", "--plan", write_plan(tmp_path), "--workload", str(table), "--cluster", "dgx-a100:8"])
    assert rc == 0 and "step" in capsys.readouterr().out


def test_simulate_user_errors(tmp_path, capsys):
    plan = write_plan(tmp_path)
    cases = [
        (["--model", MODEL, "--cluster", "dgx-a100:2"], "world has 2"),
        (["--model", MODEL, "--cluster", "nope:8"], "unknown cluster preset"),
        (["--model", MODEL, "--cluster", "dgx-a100"], "needs a device count"),
        (["--cluster", "dgx-a100:8"], "the plan does not record its model: give --model NAME or --workload FILE"),
        (["--model", MODEL, "--workload", plan, "--cluster", "dgx-a100:8"], "not both"),
        (
            ["--model", "llama:hidden=256,layers=6,heads=4,seq=128,vocab=512", "--cluster", "dgx-a100:8"],
            "workload has 8 layers",
        ),
    ]
    for extra, message in cases:
        rc = main(["simulate", "--plan", plan, *extra])
        err = capsys.readouterr().err
        assert rc == 2, extra
        assert message in err and "Traceback" not in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["simulate", "--plan", str(bad), "--model", MODEL, "--cluster", "dgx-a100:8"]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_infeasible_plan_exits_1_and_names_term(tmp_path, capsys):
    plan = uniform_plan(34, pp=1, tp=1, dp=1, num_microbatches=1)
    path = tmp_path / "p.json"
    plan.save(str(path))
    rc = main(["simulate", "--plan", str(path), "--model", "llama2-7b", "--seq", "1024", "--cluster", "dgx-a100:8"])
    out = capsys.readouterr().out
    assert rc == 1 and "INFEASIBLE" in out and "optimizer" in out


def test_compile_and_float8_switches_cost_the_plan_without_changing_the_file(tmp_path, capsys):
    plan = write_plan(tmp_path)
    before = open(plan).read()
    steps = {}
    wide = "llama:hidden=4096,layers=4,heads=32,seq=2048,vocab=32000"  # GEMMs large enough for fp8 to pay
    for flags in ((), ("--compile",), ("--float8",)):
        out = tmp_path / "sim.json"
        assert (
            main(["simulate", "--plan", plan, "--model", wide, "--cluster", "dgx-h100:8", "--json", str(out), *flags])
            == 0
        )
        data = json.loads(out.read_text())
        assert data["plan"]["compile"] == ("--compile" in flags) and data["plan"]["float8"] == ("--float8" in flags)
        steps[flags] = data["result"]["step_s"]
    capsys.readouterr()
    assert steps[("--compile",)] < steps[()] and steps[("--float8",)] < steps[()]
    assert open(plan).read() == before
    rc = main(["simulate", "--plan", plan, "--model", MODEL, "--cluster", "dgx-a100:8", "--float8"])
    assert rc == 2 and "fp8" in capsys.readouterr().err  # an A100 has no fp8 tensor cores
