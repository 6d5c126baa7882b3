"""``nest-fx trace``: table, JSON summary, user errors without tracebacks, the console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nest_fx.cli import main
from nest_fx.models import build_model

SPEC = "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=100"


def test_trace_prints_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "graph.json"
    assert main(["trace", SPEC, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "total" in out and "layers.0 .. 1" in out and "fc->proj" in out
    assert f"wrote {path}" in out
    data = json.loads(path.read_text())
    assert data["format"] == "nest-fx-opgraph/1"
    assert data["model"] == SPEC and data["method"] == "fx" and data["input_shapes"] == [[1, 32]]
    assert [b["kind"] for b in data["blocks"]] == ["head", "block", "block", "tail"]
    model, _ = build_model(SPEC)
    n = sum(p.numel() for p in model.parameters())
    assert data["totals"]["num_params"] == n
    assert data["totals"]["param_bytes"] == 2 * n  # bf16 by default
    assert data["totals"]["flops"] == sum(b["flops"] for b in data["blocks"]) > 0
    assert data["trace_seconds"] > 0
    assert len(data["patterns"]) == 1


def test_trace_options(capsys):
    assert main(["trace", SPEC, "--all-blocks", "--batch", "2", "--seq", "16", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.startswith("layers.0 ") for line in lines) and any(line.startswith("layers.1 ") for line in lines)
    assert "[[2, 16]]" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["trace", "no-such-model"], "unknown model 'no-such-model'"),
        (["trace", "gpt:hidden=64,heads=3"], "not divisible"),
        (["trace", "gpt:hiden=64"], "'hiden=64'"),
        (["trace", "gpt2-small", "--seq", "4096"], "learned positions"),
    ],
)
def test_user_errors_exit_2_without_traceback(argv, needle, capsys, monkeypatch):
    monkeypatch.delenv("NEST_FX_DEBUG", raising=False)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ")
    assert needle in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_bad_argument_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["trace", SPEC, "--batch", "0"])
    assert info.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


def test_console_script():
    script = Path(sys.executable).with_name("nest-fx")
    assert script.exists(), f"console script not installed next to {sys.executable}"
    env = dict(os.environ)
    env.pop("NEST_FX_DEBUG", None)
    proc = subprocess.run(
        [str(script), "trace", "gpt2-small", "--seq", "128"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpt2-small: ")
    assert "12 layers under 'layers', 1 distinct" in proc.stdout
    total = next(line for line in proc.stdout.splitlines() if line.startswith("total"))
    assert "124 M" in total


def test_trace_error_is_a_user_error(capsys, monkeypatch):
    import nest_fx.graph
    from nest_fx.graph import TraceError

    def fail(*args, **kwargs):
        raise TraceError("torch.fx.symbolic_trace could not trace module 'layers.0'")

    monkeypatch.setattr(nest_fx.graph, "trace", fail)  # the handler imports it when it runs
    monkeypatch.delenv("NEST_FX_DEBUG", raising=False)
    assert main(["trace", SPEC]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: torch.fx.symbolic_trace could not trace module 'layers.0'")
    assert "Traceback" not in err
