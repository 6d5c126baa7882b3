"""scripts/_bench_common.py: one place for a benchmark's environment, its JSON and its tables."""

import importlib.util
import json
import os
import re

import pytest

from repo_root import ROOT

SCRIPTS = os.path.join(ROOT, "scripts")


@pytest.fixture(scope="module")
def common():
    spec = importlib.util.spec_from_file_location("_bench_common", os.path.join(SCRIPTS, "_bench_common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_write_json_adds_the_environment_and_creates_the_folder(common, tmp_path, capsys):
    path = str(tmp_path / "deeper" / "bench.json")
    assert common.write_json(path, {"cases": [1, 2]}) == path
    assert capsys.readouterr().out == f"wrote {path}\n"
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    assert data["cases"] == [1, 2]
    env = data["environment"]
    import torch

    assert env["torch"] == torch.__version__ and env["command"].startswith("python ")
    assert re.fullmatch(r".+, \d+ CPUs", env["machine"]) and re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", env["utc"]
    )
    common.write_json(path, {"when": object()}, default=str, quiet=True)  # what JSON has no type for
    assert capsys.readouterr().out == ""


def test_tables_are_github_markdown(common):
    text = common.table([["a", 1.5]], ["name", "value"])
    assert text.splitlines()[0].startswith("| name") and text.splitlines()[1].startswith("|---")
    assert "torch " in common.environment_line()


def test_no_script_builds_its_own_environment_header():
    own = []
    for name in sorted(os.listdir(SCRIPTS)):
        if name.endswith(".py") and name != "_bench_common.py":
            with open(os.path.join(SCRIPTS, name), encoding="utf-8") as fh:
                text = fh.read()
            if re.search(
                r"torch\.__version__|platform\.(machine|processor|node|python_version)\(|os\.getloadavg", text
            ):
                own.append(name)
    assert not own, f"use _bench_common.environment() instead in {own}"
