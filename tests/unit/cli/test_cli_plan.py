"""nest-fx plan: the chosen plan, baselines with speedups, the plan file, clear failures."""

import json

from nest_fx.cli import main
from nest_fx.plan import Plan

MODEL = "llama:hidden=512,layers=4,heads=8,seq=256,vocab=2048"


def test_plan_prints_plan_baselines_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        [
            "plan",
            "--model",
            MODEL,
            "--cluster",
            "dgx-a100:16",
            "--global-batch",
            "64",
            "--json",
            str(out),
            "--mcmc-evals",
            "50",
            "--quiet",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    for word in ("plan: pp=", "stage", "megatron", "phaze", "mcmc", "nest-fx speedup", "tokens/s"):
        assert word in text
    data = json.loads(out.read_text())
    assert data["format"] == "nest-fx-plan/1"
    plan = Plan.load(str(out))
    assert plan.global_batch == 64 and plan.world_size == 16
    # the written plan simulates to what the planner predicted
    rc = main(["simulate", "--plan", str(out), "--model", MODEL, "--cluster", "dgx-a100:16"])
    assert rc == 0


def test_plan_that_cannot_fit_is_a_user_error(capsys):
    rc = main(
        [
            "plan",
            "--model",
            "llama2-7b",
            "--seq",
            "256",
            "--cluster",
            "cpu-gloo:1",
            "--global-batch",
            "8",
            "--no-baselines",
            "--quiet",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "no plan fits" in err and "binding constraint" in err and "Traceback" not in err


def test_async_tp_flag_plans_tp_with_sequence_parallel_and_compile(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        [
            "plan",
            "--model",
            MODEL,
            "--cluster",
            "dgx-h100:8",
            "--global-batch",
            "16",
            "--json",
            str(out),
            "--no-baselines",
            "--quiet",
            "--compile",
            "--float8",
            "--async-tp",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    plan = Plan.load(str(out))
    assert plan.async_tp and plan.compile and plan.float8 and plan.sequence_parallel and plan.stages[0].tp > 1
    rc = main(
        [
            "plan",
            "--model",
            MODEL,
            "--cluster",
            "dgx-h100:8",
            "--global-batch",
            "16",
            "--no-baselines",
            "--quiet",
            "--async-tp",
        ]
    )
    assert rc == 2 and "async_tp needs compile=true" in capsys.readouterr().err


def test_compile_and_float8_flags_are_recorded_in_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        [
            "plan",
            "--model",
            MODEL,
            "--cluster",
            "dgx-h100:8",
            "--global-batch",
            "16",
            "--json",
            str(out),
            "--no-baselines",
            "--quiet",
            "--compile",
            "--float8",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "compile = true, float8 = true" in text  # the constraints line names them
    plan = Plan.load(str(out))
    assert plan.compile and plan.float8
    rc = main(
        [
            "plan",
            "--model",
            MODEL,
            "--cluster",
            "dgx-a100:8",
            "--global-batch",
            "16",
            "--no-baselines",
            "--quiet",
            "--float8",
        ]
    )
    assert rc == 2 and "no fp8 rate" in capsys.readouterr().err
