"""The tests folder mirrors the packages (README, "Tests"; docs/architecture.md, "Tests"):

* every test file is ``tests/<kind>/<part>/test_<name>.py``: ``kind`` is ``distributed`` for a file with a
  multi-process test (one marked ``@pytest.mark.dist``), ``unit`` for a file without one; ``part``
  is the code it tests: a package of ``nest_fx`` (:data:`PACKAGES`), ``cli`` (``nest_fx/cli*.py``),
  ``profiler``, ``scripts``, or ``repo`` (rules over the whole repository);
* the shared helpers (``conftest.py``, ``tiny_models.py``, ``parity_helpers.py``, ...) sit in
  ``tests/`` itself, on the import path pytest.ini gives every test folder, and nowhere else;
* no two test files share a name (pytest imports each under its bare name);
* every ``tests/...py`` path the README, docs/ and the code name exists (the layout moved them).

A misplaced file fails with a ``git mv`` that places it: its kind from its ``dist`` mark, its part
the one its name starts with (``test_cli_trace.py``: cli), else the package it imports most (ties:
the later layer, whose tests build their inputs from the earlier ones), else ``repo``. That is a
suggestion: a file that tests something else goes under that part instead.
"""

from __future__ import annotations

import ast
import collections
import fnmatch
import os
import re
from typing import Dict, List

from repo_root import ROOT
from test_architecture import LAYERS  # the package order of docs/architecture.md

TESTS = os.path.join(ROOT, "tests")
KINDS = ("unit", "distributed")  # not "dist": pytest does not collect, and .gitignore ignores, dist/
PACKAGES = tuple(
    sorted(
        name
        for name in os.listdir(os.path.join(ROOT, "nest_fx"))
        if os.path.isfile(os.path.join(ROOT, "nest_fx", name, "__init__.py"))
    )
)
PARTS = PACKAGES + ("cli", "profiler", "scripts", "repo")
ORDER = LAYERS + ["cli", "profiler"]  # tie-break of suggest(): the later part wins
NAMED = re.compile(r"\btests/[\w/]+\.py\b")  # a test path in prose (a glob such as test_apply_*.py is not one)
NAMING = ("README.md", "docs", "nest_fx", "profiler", "scripts", "examples", "tests", ".ci")


def _tree(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as fh:
        return ast.parse(fh.read(), filename=path)


def has_dist_mark(tree: ast.Module) -> bool:
    """Whether the file marks a test (or itself) ``pytest.mark.dist``."""
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "dist"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        for node in ast.walk(tree)
    )


def _part_of(module: str) -> str:
    """The layout part a module imported by a test belongs to ('' for none)."""
    parts = module.split(".")
    if parts[0] == "profiler":
        return "profiler"
    if parts[0] != "nest_fx" or len(parts) < 2:
        return ""
    if parts[1] in PACKAGES:
        return parts[1]
    return "cli" if parts[1].startswith("cli") or parts[1] == "__main__" else ""


def suggest(path: str) -> str:
    """Where the test file at ``path`` belongs, relative to the repository root."""
    tree = _tree(path)
    counts: Dict[str, int] = collections.Counter()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            counts[_part_of(node.module)] += 1
        elif isinstance(node, ast.Import):
            for alias in node.names:
                counts[_part_of(alias.name)] += 1
    counts.pop("", None)
    stem = os.path.basename(path)[len("test_") : -len(".py")]
    named = [p for p in PARTS if stem == p or stem.startswith(p + "_")]
    if named:
        part = named[0]
    else:
        part = max(counts, key=lambda p: (counts[p], ORDER.index(p))) if counts else "repo"
    kind = "distributed" if has_dist_mark(tree) else "unit"
    return os.path.join("tests", kind, part, os.path.basename(path))


def _python_files() -> List[str]:
    out = []
    for folder, dirs, files in os.walk(TESTS):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        out += [os.path.join(folder, name) for name in sorted(files) if name.endswith(".py")]
    return out


def _misplaced(path: str) -> str:
    """Why the Python file at ``path`` breaks the layout, with the fix ('' when it does not)."""
    rel = os.path.relpath(path, ROOT)
    pieces = rel.split(os.sep)
    name = pieces[-1]
    if not name.startswith("test_"):
        return "" if len(pieces) == 2 else f"{rel}: a shared helper sits in tests/ itself (git mv {rel} tests/{name})"
    fix = f"suggested: git mv {rel} {suggest(path)}"
    if len(pieces) != 4 or pieces[1] not in KINDS or pieces[2] not in PARTS:
        return f"{rel}: not in tests/<unit|distributed>/<{'|'.join(PARTS)}>/ ({fix})"
    if (pieces[1] == "distributed") != has_dist_mark(_tree(path)):
        has = "has" if pieces[1] == "unit" else "has no"
        return f"{rel}: {has} a multi-process test (@pytest.mark.dist) ({fix})"
    return ""


def test_every_test_file_sits_in_the_layout():
    problems = [why for why in map(_misplaced, _python_files()) if why]
    assert not problems, 'tests/ mirrors the packages (docs/architecture.md, "Tests"):\n' + "\n".join(problems)


def test_test_file_names_are_unique():
    seen = collections.defaultdict(list)
    for path in _python_files():
        seen[os.path.basename(path)].append(os.path.relpath(path, ROOT))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, f"pytest imports test files by their bare name; rename one of each: {twice}"


def test_the_walk_sees_both_kinds_and_the_helpers():
    rels = {os.path.relpath(p, TESTS) for p in _python_files()}
    assert os.path.join("unit", "repo", "test_layout.py") in rels
    assert os.path.join("distributed", "apply", "test_apply_parallel.py") in rels
    assert {"conftest.py", "tiny_models.py", "repo_root.py", "parity_helpers.py"} <= rels


def test_pytest_and_git_see_both_kinds(pytestconfig):
    """A folder named like ``dist`` is skipped by pytest's ``norecursedirs`` and git's .gitignore."""
    skipped = pytestconfig.getini("norecursedirs")
    with open(os.path.join(ROOT, ".gitignore"), encoding="utf-8") as fh:
        ignored = [line.strip().rstrip("/") for line in fh if line.strip() and not line.startswith("#")]
    for kind in KINDS:
        assert not any(fnmatch.fnmatch(kind, pattern) for pattern in skipped + ignored), kind


def test_a_flat_file_is_told_its_place(tmp_path):
    """The failure message of a file added flat in tests/ names its destination."""
    flat = tmp_path / "test_new.py"
    flat.write_text(
        "import pytest\nfrom nest_fx.plan import Plan\nfrom nest_fx.solver import solve\n"
        "from nest_fx.solver.space import SolverOptions\n\n@pytest.mark.dist\ndef test_x():\n    pass\n"
    )
    assert suggest(str(flat)) == os.path.join("tests", "distributed", "solver", "test_new.py")
    flat.write_text("from nest_fx.plan import Plan\nfrom nest_fx.apply import checks\n\ndef test_x():\n    pass\n")
    assert suggest(str(flat)) == os.path.join("tests", "unit", "apply", "test_new.py")  # tie: the later layer
    flat.write_text("import os\n\ndef test_x():\n    pass\n")
    assert suggest(str(flat)) == os.path.join("tests", "unit", "repo", "test_new.py")
    named = tmp_path / "test_cli_new.py"  # the name's part wins over the imports
    named.write_text("from nest_fx.graph import trace\nfrom nest_fx.graph.tracer import x\n\ndef test_x():\n    pass\n")
    assert suggest(str(named)) == os.path.join("tests", "unit", "cli", "test_cli_new.py")


def _named_paths() -> Dict[str, List[str]]:
    """The ``tests/...py`` paths named in the repository's text: path -> where."""
    found = collections.defaultdict(list)
    for top in NAMING:
        start = os.path.join(ROOT, top)
        walk = [(ROOT, [], [top])] if os.path.isfile(start) else os.walk(start)
        for folder, dirs, files in walk:
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith((".py", ".md", ".sh")) or top == ".ci":
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as fh:
                        for named in NAMED.findall(fh.read()):
                            found[named].append(os.path.relpath(path, ROOT))
    return found


def test_test_paths_named_in_the_repository_exist():
    named = _named_paths()
    assert "tests/distributed/apply/test_apply_parallel.py" in named  # README's parity row: the scan reads
    where = {os.path.basename(p): os.path.relpath(p, ROOT) for p in _python_files()}
    stale = [
        f"{path} (in {', '.join(sorted(set(files)))}; now {where.get(os.path.basename(path), 'gone')})"
        for path, files in sorted(named.items())
        if not os.path.isfile(os.path.join(ROOT, path))
    ]
    assert not stale, "test paths that do not exist:\n" + "\n".join(stale)
