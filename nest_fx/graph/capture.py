"""Capture an fx graph from a module: symbolic_trace first, torch.export as the fallback."""

from __future__ import annotations

import inspect
import operator
import re
import traceback
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from nest_fx.common.errors import NestFxError


class TraceError(NestFxError, RuntimeError):
    """Neither tracer could capture the model; the message names the module and op."""


_FX_HINT = (
    "mark the module as a leaf so tracing treats it as one op: "
    "trace(model, inputs, leaf_modules=['{fqn}']) or `--leaf {fqn}` on the CLI"
)


# fx traces an augmented assignment on a tensor (``out += identity``) as ``out = out + identity``:
# its Proxy has no ``__iadd__``. The graph keeps that out-of-place op (what the cost model and the
# tensor-parallel flows read), but eager runs ``add_`` on ``out``, which selective activation
# checkpointing must know of (``graph.recompute_mutations``): the node is marked with this meta key.
IN_PLACE_META = "nest_fx_in_place"
_AUGMENTED = {
    "iadd": operator.add,
    "isub": operator.sub,
    "imul": operator.mul,
    "itruediv": operator.truediv,
    "ifloordiv": operator.floordiv,
    "imod": operator.mod,
    "ipow": operator.pow,
    "iand": operator.and_,
    "ior": operator.or_,
    "ixor": operator.xor,
    "ilshift": operator.lshift,
    "irshift": operator.rshift,
}


class _AugmentedProxy(fx.Proxy):
    """An fx Proxy whose augmented assignments record the out-of-place op marked :data:`IN_PLACE_META`."""


def _augmented(fn):
    def method(self, other):
        out = self.tracer.create_proxy("call_function", fn, (self, other), {})
        out.node.meta[IN_PLACE_META] = True
        return out

    return method


for _name, _fn in _AUGMENTED.items():
    setattr(_AugmentedProxy, f"__{_name}__", _augmented(_fn))


class _LeafTracer(fx.Tracer):
    """fx tracer that also treats user-named module FQNs or classes as leaves, and marks
    augmented assignments (:data:`IN_PLACE_META`)."""

    def __init__(self, leaf_modules: Sequence[Any] = ()):
        super().__init__()
        self.leaf_names = {m for m in leaf_modules if isinstance(m, str)}
        self.leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _AugmentedProxy(node, self)

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if qualname in self.leaf_names or (self.leaf_types and isinstance(m, self.leaf_types)):
            return True
        return super().is_leaf_module(m, qualname)


def absent_optional_args(model: torch.nn.Module, num_args: int, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """forward's parameters the call leaves at a default of None (nanoGPT's ``targets=None``):
    fx must trace them as None, or ``if targets is not None`` takes the branch the call does not."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    out = {}
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            break
        if i >= num_args and p.name not in kwargs and p.default is None:
            out[p.name] = None
    return out


def symbolic(
    model: torch.nn.Module, leaf_modules: Sequence[Any] = (), concrete_args: Optional[Dict[str, Any]] = None
) -> fx.GraphModule:
    """torch.fx.symbolic_trace with extra leaf modules and ``concrete_args``; raises the tracer's own error."""
    tracer = _LeafTracer(leaf_modules)
    graph = tracer.trace(model, concrete_args=concrete_args or None)
    return fx.GraphModule(tracer.root, graph, model.__class__.__name__)


def export(model: torch.nn.Module, args: Tuple, kwargs: Dict[str, Any]) -> fx.GraphModule:
    """Non-strict torch.export; returns the unlifted GraphModule (parameters as attributes)."""
    program = torch.export.export(model, args, kwargs, strict=False)
    return program.module()


def capture(
    model: torch.nn.Module, args: Tuple, kwargs: Dict[str, Any], method: str = "auto", leaf_modules: Sequence[Any] = ()
) -> Tuple[fx.GraphModule, str]:
    """Return (graph module, method used). ``method`` is "auto", "fx" or "export"."""
    if method not in ("auto", "fx", "export"):
        raise ValueError(f"trace method {method!r}: use 'auto', 'fx' or 'export'")
    fx_error: Optional[BaseException] = None
    if method in ("auto", "fx") and not kwargs:
        try:
            return symbolic(model, leaf_modules, absent_optional_args(model, len(args), kwargs)), "fx"
        except Exception as exc:  # noqa: BLE001 - any tracer failure falls back to export
            fx_error = exc
            if method == "fx":
                raise TraceError(describe_failure(model, exc, "torch.fx.symbolic_trace")) from exc
    try:
        return export(model, args, kwargs), "export"
    except Exception as exc:  # noqa: BLE001
        msg = describe_failure(model, exc, "torch.export (non-strict)")
        if fx_error is not None:
            msg = describe_failure(model, fx_error, "torch.fx.symbolic_trace") + "\n" + msg
        raise TraceError(msg) from exc


def describe_failure(model: torch.nn.Module, exc: BaseException, tracer: str) -> str:
    """Name the module and the source line/op where tracing broke, and how to fix it."""
    fqn, where = _innermost_module_frame(model, exc)
    op = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    fqn_text = fqn if fqn else "<root>"
    lines = [f"{tracer} could not trace module '{fqn_text}' ({type(exc).__name__}: {op[:300]})"]
    if where:
        lines.append(f"  at {where}")
    lines.append(
        "  fix: "
        + _FX_HINT.format(fqn=fqn or "<module fqn>")
        + ", or remove the data-dependent Python control flow from its forward()."
    )
    return "\n".join(lines)


def _innermost_module_frame(model: torch.nn.Module, exc: BaseException) -> Tuple[str, str]:
    """Walk the traceback for the deepest frame whose ``self`` is a submodule of ``model``."""
    by_id = {id(m): name for name, m in model.named_modules()}
    fqn, where = "", ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        code = frame.f_code
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if owner is not None and id(owner) in by_id and "forward" in frame.f_code.co_name:
            fqn = by_id[id(owner)]
            where = f"{frame.f_code.co_filename}:{lineno} in {type(owner).__name__}.{frame.f_code.co_name}"
    return fqn, where


_PREFIX = re.compile(r"^(L\['self'\]\.|L\[\"self\"\]\.|self\.)")


def clean_fqn(name: str) -> str:
    """Normalise module paths from nn_module_stack (export prefixes, getattr syntax)."""
    name = _PREFIX.sub("", name)
    name = re.sub(r"\._modules\['([^']+)'\]", r".\1", name)
    name = re.sub(r"\[(\d+)\]", r".\1", name)
    return "" if name in ("L['self']", "self") else name
