"""Every Python name the README and docs/ tell a user to import still imports (``from x import y``
lines in code blocks, and dotted ``nest_fx.`` / ``profiler.`` names in backquotes)."""

import glob
import importlib
import os
import re

import pytest

from repo_root import ROOT

DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FROM_IMPORT = re.compile(r"^\s*from ((?:nest_fx|profiler)[\w.]*) import ([\w, ]+)", re.M)
DOTTED = re.compile(r"`((?:nest_fx|profiler)(?:\.\w+)+)`")


def _names():
    found = set()
    for path in DOCS:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        for module, names in FROM_IMPORT.findall(text):
            found.update((module, n.strip()) for n in names.split(",") if n.strip())
        for dotted in DOTTED.findall(text):
            found.add((dotted, ""))
    return sorted(found)


def _resolve(dotted: str):
    """The object a dotted name denotes: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        for attr in parts[k:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_docs_name_something():
    assert len(_names()) >= 15


@pytest.mark.parametrize("module,name", _names())
def test_documented_name_imports(module, name):
    obj = _resolve(module)
    if name:
        assert hasattr(obj, name) or importlib.import_module(f"{module}.{name}"), f"{module}.{name}"
