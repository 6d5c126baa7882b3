"""The command line answers at once: ``--help``, argument errors and missing or unreadable input
files are refused before torch is imported (the times are scripts/bench_cli.py's, not a test's).
"""

import json
import os
import subprocess
import sys

import pytest

from nest_fx.cli import main
from repo_root import ROOT

MODEL = "llama:hidden=256,layers=4,heads=4,seq=128,vocab=512"

# Runs each argument list through main() in one fresh interpreter and reports, after each, its
# exit code and whether torch (or the heavy parts of nest_fx) had been imported by then.
PROBE = """
import json, sys
from nest_fx.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    heavy = sorted(m for m in ("torch", "nest_fx.workload", "nest_fx.apply", "nest_fx.models") if m in sys.modules)
    out.append({"argv": argv, "rc": rc, "heavy": heavy})
print("PROBE" + json.dumps(out))
"""


def _probe(cases, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(cases)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("PROBE"))
    return json.loads(line[len("PROBE") :]), done.stderr


def test_help_argument_errors_and_missing_files_do_not_import_torch(tmp_path):
    missing = str(tmp_path / "missing.json")
    cases = [
        ["--help"],
        ["plan", "--help"],
        ["simulate", "--help"],
        ["explain", "--help"],
        ["trace", "--help"],
        ["profile", "--help"],
        ["plna", "--model", MODEL],  # a typo in the command
        ["plan", "--model", MODEL, "--cluster", "dgx-a100:8", "--global-batch", "zero"],  # a bad value
        ["plan", "--model", MODEL, "--cluster", "dgx-a100:8", "--dtype", "fp8"],
        ["plan", "--model", MODEL],  # a missing required option
        ["simulate", "--plan", missing],
        ["explain", missing],
        ["explain", str(tmp_path)],  # a directory, not a file
        ["plan", "--workload", missing, "--cluster", "dgx-a100:8"],
        ["plan", "--model", MODEL, "--cluster", "dgx-a100:8", "--profile", missing],
        ["plan", "--model", MODEL, "--cluster", "nope:8"],  # an unknown cluster preset
        ["plan", "--model", MODEL, "--cluster", str(tmp_path / "missing.yaml")],  # a missing cluster file
        ["plan", "--model", MODEL, "--workload", missing, "--cluster", "dgx-a100:8"],  # conflicting options
        ["plan", "--model", MODEL, "--cluster", "dgx-a100:8", "--fix", "tp=banana"],  # a bad constraint
    ]
    results, stderr = _probe(cases, str(tmp_path))
    assert [r["argv"] for r in results] == cases
    for r in results:
        expected = 0 if "--help" in r["argv"] else 2
        assert r["rc"] == expected, r
        assert r["heavy"] == [], f"{r['argv']} imported {r['heavy']} before answering"
    assert "Traceback" not in stderr
    assert f"cannot read plan file {missing!r}: No such file or directory" in stderr
    assert f"cannot read workload file {missing!r}" in stderr and f"cannot read profile file {missing!r}" in stderr
    assert "is a directory, not a regular file" in stderr
    assert "invalid choice: 'plna'" in stderr and "unknown cluster preset 'nope'" in stderr
    assert f"cannot read cluster file {str(tmp_path / 'missing.yaml')!r}" in stderr


def test_the_probe_sees_torch_when_a_command_needs_it(tmp_path):
    results, _ = _probe([["trace", MODEL]], str(tmp_path))
    assert results[0]["rc"] == 0 and "torch" in results[0]["heavy"]


def test_the_precheck_gives_the_readers_own_message(tmp_path, capsys):
    """The early check and the reader it runs ahead of word a failure the same way."""
    from nest_fx.plan.plan import Plan, PlanError

    missing = str(tmp_path / "nope.json")
    with pytest.raises(PlanError) as exc:
        Plan.load(missing)
    assert main(["simulate", "--plan", missing]) == 2
    assert str(exc.value) in capsys.readouterr().err


def test_an_impossible_request_is_refused_before_the_trace(monkeypatch, capsys):
    """gpt3-175b on two CPU ranks: the states bound refuses it from the parameter count, so the
    tracer is never entered (nor the search)."""
    import nest_fx.workload.build as build

    def no_trace(*args, **kwargs):
        raise AssertionError("traced a model the cluster cannot hold")

    monkeypatch.setattr(build, "trace", no_trace)
    rc = main(["plan", "--model", "gpt3-175b", "--cluster", "cpu-gloo:2", "--no-baselines", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "no plan fits: binding constraint: model states" in err, err
    assert "over all 2 devices" in err and "at least" in err and "Traceback" not in err


def test_package_re_exports_load_on_first_use(tmp_path):
    """`import nest_fx` and `nest_fx.plan` load no torch; their names still import (PEP 562)."""
    code = (
        "import sys, nest_fx, nest_fx.plan\n"
        "assert 'torch' not in sys.modules, 'import nest_fx loaded torch'\n"
        "from nest_fx.plan import Plan, uniform_plan\n"
        "assert 'torch' not in sys.modules, 'nest_fx.plan.Plan loaded torch'\n"
        "from nest_fx import auto_parallelize, trace, solve, simulate, Cluster, Constraints, OpGraph\n"
        "assert nest_fx.Plan is Plan and 'auto_parallelize' in dir(nest_fx)\n"
        "try:\n    nest_fx.no_such_name\nexcept AttributeError as e:\n    print('ok', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "ok module 'nest_fx' has no attribute 'no_such_name'" in done.stdout


@pytest.mark.parametrize("package", ["nest_fx", "nest_fx.plan"])
def test_every_re_export_resolves(package):
    import importlib

    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(module._EXPORTS)
    for name in module.__all__:
        assert getattr(module, name) is getattr(importlib.import_module(module._EXPORTS[name]), name)
