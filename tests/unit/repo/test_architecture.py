"""The package layout of docs/architecture.md, checked on the source (ast, nothing imported).

* no import cycle among the modules of ``nest_fx`` and ``profiler`` (imports under
  ``if TYPE_CHECKING:`` are for type checkers only and are not followed);
* each pipeline package imports only packages before it in :data:`LAYERS`;
* nothing in ``nest_fx`` but the command line imports ``profiler`` (the measuring tool sits on
  top), and no production module imports the test helpers of ``nest_fx.testing``;
* a function-local import is an optional dependency or says why beside it, or sits in a
  command-line module (:data:`STARTUP`), whose docstring says why once: start-up time;
* nothing the command line imports at module level imports torch (``nest-fx --help`` answers
  before torch loads), parent packages' ``__init__`` included;
* scripts and examples import the installed package (no ``sys.path`` edits).
"""

from __future__ import annotations

import ast
import os
from typing import Dict, Iterator, List, Set, Tuple

import networkx as nx
import pytest

from repo_root import ROOT

PACKAGES = ("nest_fx", "profiler")
# the data flow of shared/DESIGN.md: a package may import the packages before it, never after
LAYERS = ["common", "models", "graph", "workload", "cluster", "plan", "cost", "solver", "apply", "report"]
TEST_HELPERS = {
    "nest_fx.testing",
    "nest_fx.testing_faults",
    "nest_fx.testing_styles",
    "nest_fx.testing_vision_styles",
    "nest_fx.testing_coverage",
}
# the command line: its handlers import torch and the pipeline when they run (start-up time, the
# module docstrings say so), so `nest-fx --help` and argument errors answer before torch loads
STARTUP = {"nest_fx.cli", "nest_fx.cli_parser", "nest_fx.cli_commands", "nest_fx.cli_profile"}
TOP_LEVEL = {"nest_fx", "nest_fx.__main__"} | STARTUP | TEST_HELPERS  # may import any layer
OPTIONAL = {"matplotlib", "transformers", "torchao"}  # extras: imported where used, inside functions
HEAVY = {"torch", "transformers", "matplotlib", "torchao", "networkx", "numpy", "tqdm", "tabulate"}


def _modules() -> Dict[str, str]:
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[module[: -len(".__init__")] if module.endswith(".__init__") else module] = path
    return out


MODULES = _modules()


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.Module) -> Iterator[Tuple[ast.stmt, bool]]:
    """(import statement, at module level) of a module, skipping TYPE_CHECKING blocks."""

    def walk(node: ast.AST, top: bool) -> Iterator[Tuple[ast.stmt, bool]]:
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, top
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            yield from walk(child, inner)

    yield from walk(tree, True)


def _targets(module: str, node: ast.stmt) -> List[str]:
    """The project modules an import statement names (a submodule when ``from pkg import sub``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            is_package = MODULES[module].endswith("__init__.py")
            parts = parts[: len(parts) - node.level + (1 if is_package else 0)]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    out = []
    for name in names:
        while name and name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES:
            out.append(name)
    return out


def _graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node, _ in _imports(tree):
            for target in _targets(module, node):
                if target != module:
                    graph.add_edge(module, target)
    return graph


GRAPH = _graph()


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "nest_fx" and len(parts) > 1 and module not in TOP_LEVEL else module


def test_the_walk_sees_the_package():
    assert {"nest_fx.cli", "nest_fx.cost.step_time", "nest_fx.apply.api", "profiler.timer"} <= set(MODULES)
    assert GRAPH.has_edge("nest_fx.cost.step_time", "nest_fx.cost.memory")
    assert GRAPH.has_edge("nest_fx.cli_profile", "profiler.model_profile")  # inside the handler


def test_no_import_cycle():
    cycles = [sorted(c) for c in nx.strongly_connected_components(GRAPH) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_packages_import_only_earlier_layers():
    wrong = []
    for a, b in GRAPH.edges:
        la, lb = _layer(a), _layer(b)
        if a.startswith("profiler") or la == lb:
            continue
        if b.startswith("profiler"):
            continue  # checked below
        if la in TOP_LEVEL:
            continue
        if lb in TOP_LEVEL or LAYERS.index(lb) > LAYERS.index(la):
            wrong.append(f"{a} -> {b}")
    assert not wrong, "imports against the data flow (docs/architecture.md):\n" + "\n".join(sorted(wrong))


def test_only_the_command_line_imports_the_profiler():
    offenders = sorted(
        f"{a} -> {b}"
        for a, b in GRAPH.edges
        if a.startswith("nest_fx") and b.startswith("profiler") and a not in STARTUP
    )
    assert not offenders, offenders


def test_production_code_does_not_import_the_test_helpers():
    offenders = sorted(a for a, b in GRAPH.edges if b in TEST_HELPERS and a not in TEST_HELPERS)
    assert not offenders, offenders


def test_function_local_imports_are_optional_or_explained():
    unexplained = []
    for module, path in MODULES.items():
        if module in STARTUP:
            continue
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        lines = text.splitlines()
        for node, top in _imports(ast.parse(text)):
            if top:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if all(n.split(".")[0] in OPTIONAL for n in names):
                continue
            here, above = lines[node.lineno - 1], lines[node.lineno - 2] if node.lineno > 1 else ""
            if "#" not in here and not above.strip().startswith("#"):
                unexplained.append(f"{path}:{node.lineno}: {here.strip()}")
    assert not unexplained, "function-local imports without a reason:\n" + "\n".join(unexplained)


def _module_level_imports(module: str) -> Tuple[Set[str], Set[str]]:
    """(project modules, top-level external packages) importing ``module`` executes at module
    level: its own imports and those of every parent package's ``__init__``, transitively."""
    seen: Set[str] = set()
    external: Set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:k]) for k in range(1, len(parts)) if ".".join(parts[:k]) in MODULES)
        with open(MODULES[name], encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node, top in _imports(tree):
            if not top:
                continue
            targets = _targets(name, node)
            todo.extend(targets)
            if not targets and not getattr(node, "level", 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                external.update(n.split(".")[0] for n in names)
    return seen, external


@pytest.mark.parametrize("module", sorted(STARTUP | {"nest_fx.__main__", "nest_fx.plan.plan"}))
def test_the_command_line_imports_nothing_heavy_at_start(module):
    modules, external = _module_level_imports(module)
    assert not external & HEAVY, (
        f"{module} imports {sorted(external & HEAVY)} at module level through "
        f"{sorted(m for m in modules if _module_level_imports(m)[1] & external & HEAVY)}: import it in the handler"
    )


def test_the_startup_check_sees_heavy_imports():
    assert "torch" in _module_level_imports("nest_fx.workload.build")[1]
    assert "torch" in _module_level_imports("nest_fx.plan.support")[1]  # through its own imports
    assert "nest_fx.plan" in _module_level_imports("nest_fx.plan.plan")[0]  # parent packages run first


@pytest.mark.parametrize("folder", ["scripts", "examples"])
def test_scripts_use_the_installed_package(folder):
    edits = []
    for name in sorted(os.listdir(os.path.join(ROOT, folder))):
        if name.endswith(".py"):
            with open(os.path.join(ROOT, folder, name), encoding="utf-8") as fh:
                if "sys.path" in fh.read():
                    edits.append(name)
    assert not edits, f"{folder}/ edits sys.path in {edits}: import the installed nest_fx instead"


def test_every_error_shares_the_base_class():
    from nest_fx.common.errors import NestFxError

    found: Set[str] = set()
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error") and node.name != "NestFxError":
                found.add(f"{module}.{node.name}")
    assert len(found) >= 10
    import importlib

    for qualified in sorted(found):
        module, name = qualified.rsplit(".", 1)
        assert issubclass(getattr(importlib.import_module(module), name), NestFxError), qualified
