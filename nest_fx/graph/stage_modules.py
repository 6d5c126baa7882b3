"""Pipeline stage modules that compute exactly what the whole model computes.

A stage owns a contiguous range ``[start, end)`` of the layer chain ``[head, <container>.0, ...,
tail]``. Its module is the model itself (a parameter-free copy of its skeleton per chunk under
the interleaved schedule) in which

* the modules the stage's blocks use stay (``nest_fx.graph.stage_layout``: its layers, or all
  the children of its groups of ``nn.Sequential`` children, and the parameterised head/tail
  modules such as ``model.embed_tokens``, ``model.norm``, ``lm_head``);
* every other such module is a :class:`~nest_fx.graph.stand_in.StandIn`: it computes nothing
  and returns NaN tensors of the real output's shape;
* the layer container keeps its full length, so the model's forward still sees layer ``i`` at
  position ``i`` (HF picks each layer's mask by ``config.layer_types[i]``);

and the stage runs **the model's own forward** on the model's inputs (every stage gets them),
so root-forward code runs where the model put it: masks, rotary tables and position ids are
recomputed on every stage, Gemma's final logit soft-capping runs once, on the last stage. Two
hooks route the activation:

* **in** (every stage but the first): the input of the stage's first layer (a group's first
  child) is replaced by the activation received from the previous stage (for a stage that owns
  only the tail: the output of the stand-in of the last layer, or of its group's last child);
* **out** (every stage but the last): the forward stops at the input of the first layer (first
  child) after the range (or at the output of the last layer, or of its group's last child,
  when the next stage owns only the tail), and
  that tensor is the stage's output. Root code between two layers therefore runs on the stage of
  the layer before it, as the tracer's block assignment says.

Values that cross a cut beside the activation (``StageLayout.side_values``: an encoder's output,
T5's position biases) travel with it as ``(activation, *side values)``: a forward hook on the
module they are outputs of keeps them on the sending stage and, on the receiving one (where that
module is a stand-in), puts the received tensors in place of its NaN outputs.

Everything a stage computes before its "in" point runs on NaN stand-in values and is discarded;
``nest_fx.graph.stage_layout`` refuses models where such a value would be needed after a cut.
Parameter names are the whole model's (a tied weight that a stage uses through one module is
also registered on the stand-ins of its other holders, so the first name wins as in the whole
model), so TP, FSDP2, activation checkpointing, expert parallelism and checkpoints work on the
stage as on the whole model.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_unflatten

from nest_fx.graph.stand_in import OutputShapes, SplitError, StandIn, meta_copy, run_on_fake
from nest_fx.graph.stage_layout import StageLayout, stage_layout
from nest_fx.graph.stage_sides import ContiguousGrad, passed_on, same_shape, sent_sides, side_groups, side_hook

INPUT_PREFIX = "_nest_fx_in_"


def tensor_output(output):
    """The tensor a model output stands for: itself, ``.logits``, ``.last_hidden_state`` or the first element."""
    if isinstance(output, torch.Tensor):
        return output
    for attr in ("logits", "last_hidden_state"):
        value = output.get(attr) if isinstance(output, dict) else getattr(output, attr, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find the output tensor in a {type(output).__name__}")


def pack_inputs(args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The model's call as keyword arguments, the form a pipeline schedule gives every stage."""
    packed = {f"{INPUT_PREFIX}{i}": a for i, a in enumerate(args)}
    packed.update({f"{INPUT_PREFIX}{k}": v for k, v in kwargs.items()})
    return packed


def unpack_inputs(packed: Dict[str, Any]) -> Tuple[tuple, Dict[str, Any]]:
    """Inverse of :func:`pack_inputs`."""
    args, kwargs = [], {}
    for key, value in packed.items():
        if not key.startswith(INPUT_PREFIX):
            raise SplitError(
                f"pipeline stage: unexpected keyword {key!r}; stages take the model's inputs packed by pack_inputs"
            )
        name = key[len(INPUT_PREFIX) :]
        if name.isdigit():
            args.append((int(name), value))
        else:
            kwargs[name] = value
    return tuple(v for _, v in sorted(args)), kwargs


class _StageExit(Exception):
    """Stops the model's forward at the stage's "out" point, carrying the activation."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


@dataclass
class StageRoute:
    """Where one stage takes its activation in and leaves the model's forward."""

    start: int
    end: int
    first: bool
    last: bool
    exit_after: str = ""  # a layer whose *output* ends the stage (armed after TP/FSDP hooks)
    armed: bool = False
    # what the last stage passes to the schedule's loss function, from the model's output
    last_output: Callable[[Any], torch.Tensor] = tensor_output
    received: Optional[torch.Tensor] = None
    # the activation arrives as one rank's part of its sequence (dim 1) split this many ways: the
    # previous stage's sequence-parallel blocks handed on their shard (apply.tensor_parallel)
    seq_shards: int = 1
    # the module outputs passed beside the activation (StageLayout.side_values), in the order they
    # are sent: (module, number of its output tensors passed) at the stage's first and end cut
    side_in: Tuple[Tuple[str, int], ...] = ()
    side_out: Tuple[Tuple[str, int], ...] = ()
    side_passed: Tuple[str, ...] = ()  # modules of side_out that return values they were given
    side_layers: Tuple[str, ...] = ()  # those of them that are layers (their first output is the activation)
    side_received: Dict[str, List[torch.Tensor]] = field(default_factory=dict)
    side_captured: Dict[str, List[torch.Tensor]] = field(default_factory=dict)

    def take(self, where: str) -> torch.Tensor:
        if self.received is None:
            raise SplitError(
                f"pipeline stage [{self.start}, {self.end}): {where} was reached twice or without an "
                "activation; the model calls it more than once per forward. fix: use pp=1"
            )
        value, self.received = self.received, None
        return value


def _hidden_argument(args: tuple, kwargs: dict, path: str) -> Tuple[str, Any, torch.Tensor]:
    """Where a layer's hidden-state input is: its first positional tensor, or ``hidden_states=``."""
    if args and isinstance(args[0], torch.Tensor):
        return "arg", 0, args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "kw", "hidden_states", kwargs["hidden_states"]
    raise SplitError(
        f"pipeline: {path} is called without a tensor as its first argument or hidden_states=; "
        "the stage cannot tell which input is the activation. fix: use pp=1"
    )


def _first_tensor(value, path: str) -> torch.Tensor:
    found = tensor_output(value) if isinstance(value, (torch.Tensor, tuple, list)) else None
    if found is None:
        raise SplitError(
            f"pipeline: {path} returns a {type(value).__name__}, not a tensor or a tuple starting "
            "with one; the stage cannot pass it on. fix: use pp=1"
        )
    return found


def _inject_input(route: StageRoute, path: str):
    def hook(module, args, kwargs):
        where, key, old = _hidden_argument(args, kwargs, path)
        new = route.take(f"the input of {path}")
        same_shape(old, new, path, route.seq_shards)
        if where == "arg":
            return (new, *args[1:]), kwargs
        return args, {**kwargs, key: new}

    return hook


def _inject_output(route: StageRoute, path: str):
    def hook(module, args, output):
        old = _first_tensor(output, path)
        new = route.take(f"the output of {path}")
        same_shape(old, new, path, route.seq_shards)
        if isinstance(output, torch.Tensor):
            return new
        return type(output)([new, *output[1:]])

    return hook


def _exit_at_input(path: str):
    def hook(module, args, kwargs):
        raise _StageExit(_hidden_argument(args, kwargs, path)[2])

    return hook


def _exit_at_output(path: str):
    def hook(module, args, output):
        raise _StageExit(_first_tensor(output, path))

    return hook


def _stage_forward(route: StageRoute, forward: Callable) -> Callable:
    """The stage's forward: ``stage(*received, **pack_inputs(args, kwargs))``."""

    def run(*received, **packed):
        args, kwargs = unpack_inputs(packed)
        expected = 0 if route.first else 1 + sum(n for _, n in route.side_in)
        if len(received) != expected:
            raise SplitError(
                f"pipeline stage [{route.start}, {route.end}) got {len(received)} activations; expected {expected}"
            )
        received = tuple(ContiguousGrad.apply(r) for r in received)
        route.received = received[0] if received else None
        at = 1
        for path, n in route.side_in:
            route.side_received[path] = list(received[at : at + n])
            at += n
        route.side_captured = {}
        try:
            output = forward(*args, **kwargs)
        except _StageExit as stop:
            if route.last:
                raise SplitError(f"pipeline stage [{route.start}, {route.end}) stopped before the model's end")
            # sent to the next stage: point-to-point sends take contiguous tensors (ConvNeXt's
            # channels-last permutes are not)
            output = stop.hidden.contiguous()
            if route.side_out:
                output = (output, *sent_sides(route))
        else:
            if not route.last:
                raise SplitError(
                    f"pipeline stage [{route.start}, {route.end}) ran to the model's end without "
                    "reaching the next stage's first layer. fix: use pp=1"
                )
            output = route.last_output(output)
        finally:
            pending, route.received = route.received, None
            unused, route.side_received, route.side_captured = route.side_received, {}, {}
        if pending is not None or unused:
            raise SplitError(
                f"pipeline stage [{route.start}, {route.end}): the received activation was never used "
                f"(the stage's first layer{' or ' + ', '.join(unused) if unused else ''} did not run). fix: use pp=1"
            )
        return output

    return run


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, module)


def stage_route(module: nn.Module) -> StageRoute:
    """The route of a stage module made by :func:`split_stages`."""
    return module.__dict__["_nest_fx_route"]


def split_stages(
    model: nn.Module, graph, ranges: Sequence[Tuple[int, int]], layout: Optional[StageLayout] = None
) -> List[nn.Module]:
    """One stage module per block range ``[start, end)`` of the layer chain (see the module docstring).

    With one range the model becomes the stage in place; with several (interleaved chunks on one
    rank) each chunk is a copy of the model's parameter-free skeleton holding its own modules.
    Call :func:`arm_stages` once the stage's other hooks (TP, FSDP) are installed.
    """
    layout = layout or stage_layout(model, graph)
    problem = layout.problem or next(
        (layout.cut_problems[c] for r in ranges for c in r if c in layout.cut_problems), ""
    )
    if problem:
        raise SplitError(problem)
    n = layout.num_blocks
    paths = list(layout.owned) + layout.layer_modules()
    layer_paths = set(layout.layer_modules())
    originals = {p: model.get_submodule(p) for p in paths}
    shapes = _output_shapes(graph, layout, originals)
    if len(ranges) == 1:
        bases = [model]
    else:
        for p in paths:
            _set_submodule(model, p, nn.Module())
        bases = [copy.deepcopy(model) for _ in ranges]
    for base, (start, end) in zip(bases, ranges):
        keep = set(layout.modules_in(start, end))
        kept = {id(q) for p in keep for q in originals[p].parameters()}
        for p in paths:
            if p in keep:
                _set_submodule(base, p, originals[p])
                continue
            stand_in = StandIn(shapes[p], p)
            for name, q in originals[p].named_parameters(remove_duplicate=False):
                if id(q) in kept:
                    stand_in.register_shared(name, q)
            _set_submodule(base, p, stand_in)
        for name, block in layout.root_params.items():
            if not start <= block < end:
                _stand_in_parameter(base, name)
        route = StageRoute(start, end, first=start == 0, last=end == n)
        route.side_in = () if route.first else side_groups(layout, start)
        route.side_out = () if route.last else side_groups(layout, end)
        route.side_passed = () if route.last else passed_on(layout, end)
        route.side_layers = tuple(p for p, _ in route.side_in + route.side_out if p in layer_paths)
        kept_sides = [p for p, _ in route.side_in if p in keep]
        if kept_sides:
            raise SplitError(
                f"pipeline stage [{start}, {end}) holds {kept_sides[0]}, whose output it also receives from the "
                "stage before it. fix: use pp=1"
            )
        _install_route(base, route, layout)
    return bases


def _stand_in_parameter(base: nn.Module, name: str) -> None:
    """Replace the root-code parameter ``name`` of a stage that does not own it by a NaN buffer of
    its shape (not saved, not trained): the root forward code still runs there, on values the
    stage then replaces by the activation it receives."""
    owner_path, _, leaf = name.rpartition(".")
    owner = base.get_submodule(owner_path) if owner_path else base
    param = owner._parameters.pop(leaf)
    owner.register_buffer(leaf, torch.full_like(param.detach(), math.nan), persistent=False)


def _output_shapes(graph, layout: StageLayout, originals: Dict[str, nn.Module]) -> Dict[str, OutputShapes]:
    """The :class:`OutputShapes` of every module a stand-in may replace. The modules at the same
    place in identical layer blocks (same signature, same position in a group) share one."""
    shapes = {p: OutputShapes(originals[p], p) for p in layout.owned}
    shared: Dict[Tuple[str, int], OutputShapes] = {}
    for b, modules in layout.modules.items():
        for position, p in enumerate(modules):
            key = (graph.blocks[b].signature, position)
            if key not in shared:
                shared[key] = OutputShapes(originals[p], p)
            shapes[p] = shared[key]
    return shapes


def _install_route(base: nn.Module, route: StageRoute, layout: StageLayout) -> None:
    """The "in" and "out" hooks of one stage (module docstring), at the first module of its first
    layer block and of the next stage's, or at the last layer block's last module."""
    layers = layout.layers
    last_layer = layout.exit_module(max(layers))
    if not route.first:
        if route.start in layers:
            path = layout.entry_module(route.start)
            base.get_submodule(path).register_forward_pre_hook(
                _inject_input(route, path), with_kwargs=True, prepend=True
            )
        else:  # the stage owns only the tail: the last layer's stand-in returns the activation
            base.get_submodule(last_layer).register_forward_hook(_inject_output(route, last_layer))
    if not route.last:
        if route.end in layers:
            path = layout.entry_module(route.end)
            base.get_submodule(path).register_forward_pre_hook(_exit_at_input(path), with_kwargs=True)
        else:  # the next stage owns only the tail
            route.exit_after = last_layer
    base.__dict__["_nest_fx_route"] = route
    base.forward = _stage_forward(route, base.forward)


def arm_stages(stages: Sequence[nn.Module], last_output: Optional[Callable[[Any], torch.Tensor]] = None) -> None:
    """Install the "out" hooks that stop a stage at a layer's *output*. They must run after every
    other forward hook of that layer (sequence-parallel gather, FSDP's post-forward), so this is
    the last step of building a stage; calling it again does nothing. ``last_output``: what the
    last stage returns of the model's output (default :func:`tensor_output`; the runtime's
    ``model_loss`` for a model computing its own loss)."""
    for stage in stages:
        route = stage_route(stage)
        if last_output is not None:
            route.last_output = last_output
        if not route.armed:
            side_in, side_out = dict(route.side_in), dict(route.side_out)
            for path in dict.fromkeys([*side_in, *side_out]):
                layer_exit = path in route.side_layers
                hook = side_hook(route, path, side_in.get(path, 0), side_out.get(path, 0), layer_exit)
                stage.get_submodule(path).register_forward_hook(hook, with_kwargs=True)
        if route.exit_after and not route.armed:
            stage.get_submodule(route.exit_after).register_forward_hook(_exit_at_output(route.exit_after))
        route.armed = True


def run_stages(stages: Sequence[nn.Module], args: tuple, kwargs: Dict[str, Any]) -> torch.Tensor:
    """Run stage modules one after another on one process: what the pipeline computes."""
    packed = pack_inputs(args, kwargs)
    received: tuple = ()
    for stage in stages:
        out = stage(*received, **packed)
        received = out if isinstance(out, tuple) else (out,)
    return received[0]


def rehearse_split(
    model: nn.Module,
    graph,
    ranges: Sequence[Tuple[int, int]],
    args: tuple,
    kwargs: Dict[str, Any],
    layout: Optional[StageLayout] = None,
) -> torch.Size:
    """Run the stages of a split, in order, on a meta copy of ``model`` and fake inputs (no memory,
    no values): each must hand the next an activation of the shape it expects. Returns the last
    stage's output shape; raises :class:`SplitError` naming the stage and module. The model
    itself is not touched."""
    layout = layout or stage_layout(model, graph)
    with torch.no_grad():
        stages = split_stages(meta_copy(model), graph, ranges, layout)
        arm_stages(stages)
        return _on_fake(lambda *a, **k: run_stages(stages, a, k).shape, args, kwargs, ranges)


def _on_fake(fn: Callable, args: tuple, kwargs: Dict[str, Any], ranges) -> Any:
    try:
        return run_on_fake(fn, args, kwargs)
    except SplitError:
        raise
    except Exception as exc:  # noqa: BLE001 - report which split failed, not a raw trace
        raise SplitError(
            f"pipeline: running the stages {list(ranges)} on fake tensors failed: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
            "fix: use pp=1"
        ) from exc


def traced_inputs(graph) -> Optional[Tuple[tuple, Dict[str, Any]]]:
    """The inputs ``graph`` (an OpGraph) was traced with, as meta tensors: ``(args, kwargs)``, or
    None when the graph does not record them (a non-tensor input, no captured module)."""
    leaves = []
    for _, d in graph.graph.nodes(data=True):
        if d.get("fx_op") != "placeholder":
            continue
        if len(d.get("out_shapes") or ()) != 1:
            return None
        leaves.append(torch.empty(d["out_shapes"][0], dtype=getattr(torch, d["out_dtypes"][0]), device="meta"))
    module = getattr(graph, "module", None)
    if module is None:
        return None
    spec = getattr(module, "_in_spec", None)
    return (tuple(leaves), {}) if spec is None else tree_unflatten(leaves, spec)


def representative_cuts(graph) -> List[int]:
    """Cut indices (``c``: between blocks ``c-1`` and ``c``) that cover every kind of boundary: the
    first cut with each pair of neighbouring block signatures, and the last cut (before the
    tail). Cuts between two blocks of the same signatures run the same code."""
    blocks = graph.blocks
    seen, cuts = set(), []
    for c in range(1, len(blocks)):
        pair = (blocks[c - 1].signature, blocks[c].signature)
        if pair not in seen or c == len(blocks) - 1:
            seen.add(pair)
            cuts.append(c)
    return cuts


def rehearsal_problem(model: nn.Module, graph, layout: Optional[StageLayout] = None) -> str:
    """Why the runtime could not build and run a one-block stage at each of the
    :func:`representative_cuts` of ``model`` (fed the traced activation's shape, on a meta copy
    and fake tensors), or "". With the layout's own problems this is the pipeline verdict of
    ``ParallelSupport.pp_problem``: it catches what the graph cannot show (a layer called without
    its activation as first argument, a module that cannot run on fake tensors)."""
    inputs = traced_inputs(graph)
    layout = layout or stage_layout(model, graph)
    if inputs is None:
        return ""
    starts = [0] + representative_cuts(graph)
    ranges = [(c, c + 1) for c in starts]
    try:
        with torch.no_grad():
            stages = split_stages(meta_copy(model), graph, ranges, layout)
            arm_stages(stages)
            for (start, end), stage in zip(ranges, stages):
                _probe(stage, start, end, layout, inputs)
    except SplitError as exc:
        return str(exc).removeprefix("pipeline: ")
    return ""


def _probe(stage: nn.Module, start: int, end: int, layout: StageLayout, inputs) -> None:
    """Run one stage on fake tensors, fed an activation of the traced shape at its first cut."""

    def run(*args, **kwargs):
        received = ()
        if start > 0:
            shape, dtype = layout.activations[start]
            sides = [s[1:3] for s in layout.side_values.get(start, ())]
            received = tuple(
                torch.empty(s, dtype=getattr(torch, d), device="meta") for s, d in [(shape, dtype), *sides]
            )
        out = stage(*received, **pack_inputs(args, kwargs))
        out = out[0] if isinstance(out, tuple) else out
        if end in layout.activations and tuple(out.shape) != layout.activations[end][0]:
            raise SplitError(
                f"pipeline: stage [{start}, {end}) hands on shape {tuple(out.shape)}, but the "
                f"activation the model passes there has shape {layout.activations[end][0]}. "
                "fix: use pp=1"
            )

    _on_fake(run, inputs[0], inputs[1], [(start, end)])
