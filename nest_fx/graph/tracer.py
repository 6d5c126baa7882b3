"""``trace(model, example_inputs) -> OpGraph``: capture, annotate, group into blocks, find TP pairs."""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from torch.utils._pytree import tree_map

from nest_fx.graph.annotate import annotate
from nest_fx.graph.blocks import detect_blocks
from nest_fx.graph.capture import IN_PLACE_META, TraceError, capture
from nest_fx.graph.moe_modules import expert_module_paths
from nest_fx.graph.op_kinds import module_of
from nest_fx.graph.opgraph import OpGraph
from nest_fx.graph.rms_norms import rms_norm_modules
from nest_fx.graph.tp_pairs import find_patterns
from nest_fx.graph.tp_mha import add_multihead_pairs
from nest_fx.graph.training_mode import training_config


def trace(
    model: torch.nn.Module,
    example_inputs: Union[torch.Tensor, Sequence[Any]] = (),
    example_kwargs: Optional[Dict[str, Any]] = None,
    *,
    method: str = "auto",
    leaf_modules: Sequence[Any] = (),
    name: str = "",
) -> OpGraph:
    """Trace ``model`` on meta tensors into an :class:`OpGraph`.

    ``example_inputs`` (a tensor or a tuple) and ``example_kwargs`` only provide shapes and
    dtypes. Nothing is computed: the graph runs on fake tensors, so a 175B-parameter model
    built on ``torch.device("meta")`` traces on a laptop. Inputs are moved (as empty tensors
    when they are meta) to the model's device, since torch.export bakes that device in.

    ``method``: "fx" (torch.fx.symbolic_trace), "export" (non-strict torch.export, for
    ``**kwargs`` forwards and data-dependent Python control flow), or "auto" (fx, then export).
    ``leaf_modules``: module FQNs or classes that fx should keep as single ops.
    Raises :class:`TraceError` naming the module and op that broke both tracers. A HF model
    with ``use_cache=True`` has its cache turned off first (``graph.training_mode``).
    """
    training_config(model)  # HF: no key/value cache in a training graph
    args: Tuple = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    args, kwargs = on_device(args, device), on_device(dict(example_kwargs or {}), device)
    gm, used = capture(model, args, kwargs, method=method, leaf_modules=leaf_modules)
    try:
        with _fake_tensor_log_muted():  # a failing op is reported below as a TraceError, not logged twice
            graph = annotate(gm, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - report the failing op, not a raw interpreter trace
        node = getattr(exc, "fx_node", None)
        where = f" at node {node.name!r} (op {node.target}, module {module_of(node) or '<root>'!r})" if node else ""
        raise TraceError(
            f"captured the model with {used} but running it on fake tensors failed{where}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n"
            "  fix: the op needs real data (data-dependent shape or value); rewrite it with "
            "static shapes, or give the op a meta/fake kernel"
        ) from exc
    mark_rms_norms(graph, rms_norm_modules(model))
    mark_augmented_assignments(graph, gm)
    shapes = [list(t.shape) for t in args if isinstance(t, torch.Tensor)]
    shapes += [list(t.shape) for t in kwargs.values() if isinstance(t, torch.Tensor)]
    opgraph = OpGraph(graph, model_name=name or type(model).__name__, method=used, input_shapes=shapes)
    opgraph.block_container, opgraph.blocks = detect_blocks(graph)
    opgraph.patterns = find_patterns(graph, opgraph.blocks)
    opgraph.module = gm  # the captured GraphModule: the profiler runs it node by node
    opgraph.input_names = input_names(model, args, kwargs)
    opgraph.expert_modules = expert_module_paths(model)
    add_multihead_pairs(opgraph, model)
    return opgraph


def mark_rms_norms(graph, norms: Dict[str, str]) -> None:
    """Tag every node that ran inside an RMSNorm ``F.rms_norm`` computes (``graph.rms_norms``:
    {module FQN: "native" | "model"}) with ``rms_norm`` = that kind: the cost model prices the
    nodes of such a module as one fused op (``workload/fused_norms.py``)."""
    for _, d in graph.nodes(data=True):
        kind = norms.get(d.get("module", ""))
        if kind:
            d["rms_norm"] = kind


def mark_augmented_assignments(graph, gm: torch.fx.GraphModule) -> None:
    """Tag a node fx recorded for an augmented assignment (``out += x``: ``capture.IN_PLACE_META``)
    with ``in_place_on`` = the node whose value eager mutates in place (the graph keeps ``out + x``)."""
    for node in gm.graph.nodes:
        target = node.args[0] if node.args else None
        if node.meta.get(IN_PLACE_META) and isinstance(target, torch.fx.Node) and node.name in graph:
            graph.nodes[node.name]["in_place_on"] = target.name


def input_names(model: torch.nn.Module, args: Tuple, kwargs: Dict[str, Any]) -> List[str]:
    """Names of the tensor inputs given to ``model``: forward's parameter names for positional
    arguments (``arg<i>`` where it has none), then the keywords."""
    try:
        params = [
            p.name
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    names = [params[i] if i < len(params) else f"arg{i}" for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    return names + [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]


@contextlib.contextmanager
def _fake_tensor_log_muted():
    """Silence FakeTensorMode's own "failed while attempting to run meta" log records (with their
    traceback) while the graph runs on fake tensors."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = disabled


def on_device(value: Any, device: torch.device) -> Any:
    """Inputs on ``device``: meta tensors become empty (uninitialised) tensors of that shape."""

    def move(t):
        if not isinstance(t, torch.Tensor) or t.device == device:
            return t
        if t.device.type == "meta":
            return torch.zeros(t.shape, dtype=t.dtype, device=device)
        return t.to(device)

    return tree_map(move, value)
