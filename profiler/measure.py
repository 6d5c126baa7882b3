"""Run a captured graph node by node on real tensors and time each node's forward and backward.

An ``fx.Interpreter`` executes the graph once for real (so every node sees inputs of the exact
shapes and values the model produces). For each node picked for timing it then:

* times the forward call on those inputs: device and host seconds (``Timer.measure_split``);
* detaches the floating-point inputs, marks them (and the node's parameters) as requiring
  grad, runs the node once under autograd and times ``torch.autograd.grad`` of its floating
  outputs with random output gradients, ``retain_graph=True`` so each repeat replays the same
  backward;
* subtracts the fixed host cost of one ``autograd.grad`` call (measured on a one-element
  tensor), which a whole-model backward pays once rather than per node;
* records memory: the allocator's peak over the forward and backward on CUDA, and tensor byte
  accounting (outputs plus what autograd saved for backward) on CPU.

An op that raises out-of-memory is recorded as skipped, the cache is emptied and the run goes on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set

import torch
import torch.fx as fx
import torch.fx._pytree as fx_pytree
from torch.utils._pytree import tree_flatten, tree_map

from nest_fx.workload.profile_file import ProfileError
from profiler.timer import Timer


@dataclass
class NodeMeasurement:
    """What one node cost on the device, per call (SI units)."""

    fwd_s: float  # device seconds (CPU: wall)
    bwd_s: float
    peak_bytes: float  # CUDA allocator peak over fwd+bwd above the baseline; CPU: outputs + saved
    skipped: str = ""  # why it was not measured ("oom", ...)
    fwd_host_s: float = math.nan  # host (dispatch) seconds; CPU: wall
    bwd_host_s: float = math.nan


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _float_tensors(value: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _MeasuringInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, timer: Timer, nodes: Optional[Set[str]], progress=None):
        super().__init__(gm, garbage_collect_values=True)
        self.timer = timer
        self.nodes = nodes
        self.results: Dict[str, NodeMeasurement] = {}
        self.progress = progress
        self.grad_overhead = _grad_call_overhead(timer)

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        if n.op in ("call_function", "call_method", "call_module") and (self.nodes is None or n.name in self.nodes):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            self.results[n.name] = self._measure(n, args, kwargs)
            if self.progress:
                self.progress(n.name)
        return result

    def _call(self, n: fx.Node, args, kwargs):
        if n.op == "call_module":
            return self.call_module(n.target, args, kwargs)
        if n.op == "call_method":
            return self.call_method(n.target, args, kwargs)
        return self.call_function(n.target, args, kwargs)

    def _params(self, n: fx.Node) -> List[torch.Tensor]:
        params = []
        if n.op == "call_module":
            params += [p for p in self.module.get_submodule(n.target).parameters() if p.requires_grad]
        return params

    def _measure(self, n: fx.Node, args, kwargs) -> NodeMeasurement:
        cuda = self.timer.device.type == "cuda"
        try:
            try:
                return self._measure_with(n, args, kwargs, cuda, copy_inputs=False)
            except RuntimeError as exc:
                if "in-place" not in str(exc):
                    raise
                # An in-place op cannot run on a leaf that requires grad: feed it a copy.
                return self._measure_with(n, args, kwargs, cuda, copy_inputs=True)
        except RuntimeError as exc:
            if not _is_oom(exc):
                raise
            if cuda:
                torch.cuda.empty_cache()
            return NodeMeasurement(fwd_s=math.nan, bwd_s=math.nan, peak_bytes=math.nan, skipped="oom")

    def _measure_with(self, n: fx.Node, args, kwargs, cuda: bool, copy_inputs: bool) -> NodeMeasurement:
        """Forward as in training (autograd recording), then the backward of that forward."""

        def leaf(t):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return t.detach().requires_grad_(True)
            return t

        args_g, kwargs_g = tree_map(leaf, args), tree_map(leaf, kwargs)
        inputs = _float_tensors((args_g, kwargs_g)) + self._params(n)

        def call():
            if copy_inputs:
                a, k = tree_map(
                    lambda t: t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t, (args_g, kwargs_g)
                )
                return self._call(n, a, k)
            return self._call(n, args_g, kwargs_g)

        with torch.enable_grad():
            fwd, fwd_host = self.timer.measure_split(call)
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        base = 0
        if cuda:
            torch.cuda.synchronize(self.timer.device)
            torch.cuda.reset_peak_memory_stats(self.timer.device)
            base = torch.cuda.memory_allocated(self.timer.device)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call()
        outs = [t for t in _float_tensors(out) if t.requires_grad]
        bwd = bwd_host = 0.0
        if outs and inputs:
            grads = [torch.randn_like(t) for t in outs]
            bwd, bwd_host = self.timer.measure_split(
                lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True),
                cpu_offset=self.grad_overhead,
            )
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.timer.device) - base
        else:
            peak = sum(t.numel() * t.element_size() for t in _float_tensors(out)) + saved[0]
        return NodeMeasurement(fwd_s=fwd, bwd_s=bwd, peak_bytes=float(peak), fwd_host_s=fwd_host, bwd_host_s=bwd_host)


def _grad_call_overhead(timer: Timer) -> float:
    """Host seconds one ``torch.autograd.grad`` call costs on a one-element tensor: the engine
    start-up each per-node backward timing pays but a whole-model backward pays once; subtracted
    from the host side of every node's backward (tens of microseconds, which add up over ~70
    small ops per transformer block)."""
    x = torch.zeros(1, device=timer.device, requires_grad=True)
    y = x * 1.0
    g = torch.ones_like(y)
    return timer.measure_host(lambda: torch.autograd.grad(y, x, g, retain_graph=True))


def measure_nodes(
    gm: fx.GraphModule,
    args: tuple,
    kwargs: Optional[dict],
    timer: Timer,
    nodes: Optional[Set[str]] = None,
    progress=None,
) -> Dict[str, NodeMeasurement]:
    """Time forward and backward of each node of ``gm`` named in ``nodes`` (all ops when None).

    ``args``/``kwargs`` are real inputs on the timer's device; ``gm``'s parameters must be there
    too. Returns {node name: NodeMeasurement}.
    """
    interp = _MeasuringInterpreter(gm, timer, nodes, progress)
    in_spec = getattr(gm, "_in_spec", None)
    flat = fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs or {})), in_spec) if in_spec is not None else args
    with torch.no_grad():
        interp.run(*flat)
    return interp.results


def measure_step(model: torch.nn.Module, args: tuple, kwargs: Optional[dict], timer: Timer, loss: str = "sum") -> float:
    """Median seconds of one eager forward + backward of the whole model: the figure per-op sums
    are checked against. ``loss="sum"``: the sum of its float outputs (next to nothing), for a
    sum over the traced ops; ``"cross_entropy"``: token-level cross entropy of its logits in fp32
    against random targets, the training step a Workload costs (it adds that loss to the tail)."""
    if loss not in ("sum", "cross_entropy"):
        raise ProfileError(f"loss={loss!r}: use 'sum' or 'cross_entropy'")

    def objective(out) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out
        if loss == "cross_entropy" and isinstance(logits, torch.Tensor) and logits.dim() >= 2:
            flat = logits.reshape(-1, logits.size(-1)).float()
            targets = torch.randint(0, logits.size(-1), (flat.size(0),), device=flat.device)
            return torch.nn.functional.cross_entropy(flat, targets)
        return sum(t.float().sum() for t in _float_tensors(logits))

    def step():
        out = model(*args, **(kwargs or {}))
        objective(out).backward()
        for p in model.parameters():
            p.grad = None

    return timer.measure_step(step)
