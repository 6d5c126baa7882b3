"""Package re-exports loaded on first use (PEP 562), so importing a package costs only what is used.

``nest_fx`` re-exports the runtime (which imports torch) and ``nest_fx.plan`` the workload's
fingerprint; with eager imports ``import nest_fx.cli`` would load torch before ``nest-fx --help``
could answer. A package declares ``{name: module}`` and gets a module ``__getattr__`` that
imports ``module`` when ``name`` is first asked for (``from nest_fx import Plan`` included).
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Dict, List, Tuple


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[Callable[[str], object], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for ``package``'s namespace: ``exports`` maps each re-exported
    name to the module that defines it; the value is cached in the package once imported."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> List[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
