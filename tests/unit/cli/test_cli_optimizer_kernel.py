"""``--optimizer-kernel`` on the command line: ``plan`` records it in the plan's constraints and
prices it, ``simulate`` costs a plan file under another implementation, ``explain`` names the one priced."""

import json

import pytest

from nest_fx.cli import main
from nest_fx.plan import Plan

MODEL = "llama:hidden=256,layers=4,heads=4,seq=128,vocab=512"


@pytest.fixture(scope="module")
def fused_plan(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fused") / "plan.json")
    args = ["plan", "--model", MODEL, "--cluster", "dgx-a100:8", "--global-batch", "32", "--optimizer", "adamw"]
    assert main(args + ["--optimizer-kernel", "fused", "--no-baselines", "--quiet", "--json", path]) == 0
    return path


def _optimizer_seconds(path, tmp_path, *flags):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--plan", path, "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())["result"]["breakdown"]["optimizer"]


def test_plan_records_the_kernel_and_simulate_prices_another(fused_plan, tmp_path, capsys):
    plan = Plan.load(fused_plan)
    assert (plan.constraints.optimizer, plan.constraints.optimizer_kernel) == ("adamw", "fused")
    fused = _optimizer_seconds(fused_plan, tmp_path)
    foreach = _optimizer_seconds(fused_plan, tmp_path, "--optimizer-kernel", "foreach")
    assert fused > 0 and fused / foreach == pytest.approx(28 / 80)  # update bytes per parameter (cost/optimizers.py)
    assert Plan.load(fused_plan).constraints.optimizer_kernel == "fused"  # the file is not changed
    capsys.readouterr()
    assert main(["explain", fused_plan]) == 0
    assert "optimizer adamw, fused\n" in capsys.readouterr().out


def test_an_unknown_kernel_is_one_error_line(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", MODEL, "--cluster", "dgx-a100:8", "--optimizer-kernel", "apex"])
    assert "--optimizer-kernel" in capsys.readouterr().err
