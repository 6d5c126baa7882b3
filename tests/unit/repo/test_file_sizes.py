"""Small modules with one job: no Python file of the package, the profiler, the scripts, the
examples or the tests is over :data:`MAX_LINES` lines (docs/architecture.md, "Files")."""

from __future__ import annotations

import os
from typing import Dict

from repo_root import ROOT

FOLDERS = ("nest_fx", "profiler", "scripts", "examples", "tests")
MAX_LINES = 500


def _line_counts() -> Dict[str, int]:
    out = {}
    for folder in FOLDERS:
        for path, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    full = os.path.join(path, name)
                    with open(full, encoding="utf-8") as fh:
                        out[os.path.relpath(full, ROOT)] = sum(1 for _ in fh)
    return out


def test_the_walk_sees_every_folder():
    counts = _line_counts()
    for folder in FOLDERS:
        assert any(path.startswith(folder + os.sep) for path in counts), folder
    assert os.path.join("nest_fx", "solver", "stage_table.py") in counts
    assert os.path.join("tests", "unit", "repo", "test_file_sizes.py") in counts


def test_no_python_file_is_over_the_limit():
    over = sorted((n, path) for path, n in _line_counts().items() if n > MAX_LINES)
    assert not over, f"over {MAX_LINES} lines (split the file by its jobs, docs/architecture.md): " + ", ".join(
        f"{path} ({n})" for n, path in reversed(over)
    )
