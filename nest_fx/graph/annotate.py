"""Run a captured graph on fake tensors and record per-node shapes, FLOPs and memory.

Nothing is allocated: parameters and inputs become FakeTensors (shape, dtype and device with
no storage, so device-specific constants baked in by torch.export still match), FLOPs come from
``torch.utils.flop_counter.FlopCounterMode`` read before and after each node, and the bytes
saved for backward come from ``torch.autograd.graph.saved_tensors_hooks`` (deduplicated by
storage, parameters and buffers excluded), so they are what autograd would really keep.

Each node also records the aten ops it ran (``aten_ops``: kind, whether it mutates an input, the
storages its outputs live in) and the storages it created (``created``: storage -> bytes), so the
cost model can tell what an op-level recompute policy keeps (``recompute_policies.kept_storages``).
An attention call counts as one fused kernel whose outputs are the attention output and its fp32
log-sum-exp, whatever kernel the trace's device picks (on meta tensors SDPA runs the math path).
Op names: ``op_kinds``; the FLOP formulas FlopCounterMode lacks: ``flop_formulas``; a matmul's
weight and its feature dims: ``matmul_weights``.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Set, Tuple

import networkx as nx
import torch
import torch.fx as fx
import torch.fx._pytree as fx_pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from nest_fx.graph.flop_formulas import flop_formulas
from nest_fx.graph.matmul_weights import view_dims, weight_dims, weight_of
from nest_fx.graph.op_kinds import (
    ATTENTION_CALLS,
    VIEW_OPS,
    module_class_of,
    module_of,
    op_kind,
)
from nest_fx.graph.recompute_policies import ATTENTION_KERNELS, aten_kind


def _tensors(value: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


LSE_BYTES = 4  # the fused kernels' log-sum-exp is fp32, one value per query row and head


class _AtenRecorder(TorchDispatchMode):
    """Hands every aten op the traced model runs to ``interp.record_op``."""

    def __init__(self, interp: "_FakeInterpreter"):
        super().__init__()
        self.interp = interp

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.interp.record_op(func, out)
        return out


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    return t


class _FakeInterpreter(fx.Interpreter):
    """Interpreter over fake copies of the module's state; records per-node facts."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.meta_of: Dict[int, torch.Tensor] = {}
        self.state_keys: Set[int] = set()
        for t in list(gm.parameters()) + list(gm.buffers()):
            fake = self.fake_mode.from_tensor(t.detach()).requires_grad_(t.requires_grad)
            self.meta_of[id(t)] = fake
            self.state_keys.add(_storage_key(fake))
        self.records: Dict[str, dict] = {}
        self.current: Optional[str] = None
        self.saved_seen: Set[int] = set()
        self.counter = FlopCounterMode(display=False, custom_mapping=flop_formulas())
        self.seen_params: Set[int] = set()
        self.param_fqn: Dict[int, str] = {}
        for name, p in gm.named_parameters(remove_duplicate=True):
            self.param_fqn[id(p)] = name
        # storage identities for the aten records; the storages are held until the run ends so
        # an address is never reused by a later storage (fake storages hold no memory)
        self.storage_ids: Dict[int, int] = {}
        self.held: List[Any] = []
        self.in_attention = False

    # -- state substitution ---------------------------------------------------------------
    def fetch_attr(self, target: str):
        value = super().fetch_attr(target)
        if isinstance(value, torch.Tensor):
            return self.meta_of.get(id(value), value)
        return value

    def call_module(self, target, args, kwargs):
        mod = self.module.get_submodule(target)
        state = {
            k: self.meta_of[id(v)]
            for k, v in list(mod.named_parameters(remove_duplicate=False))
            + list(mod.named_buffers(remove_duplicate=False))
        }
        return functional_call(mod, state, tuple(args), dict(kwargs), tie_weights=False)

    # -- recording ------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key not in self.state_keys and key not in self.saved_seen and self.current is not None:
            self.saved_seen.add(key)
            self.records[self.current]["saved_bytes"] += _storage_bytes(t)
        return t

    def storage_id(self, t: torch.Tensor, created_here: bool) -> int:
        """A stable id of ``t``'s storage; a storage first seen as an op output of the current
        node is recorded as created by it (with its bytes)."""
        storage = t.untyped_storage()
        key = storage._cdata
        sid = self.storage_ids.get(key)
        if sid is None:
            sid = self.storage_ids[key] = len(self.held)
            self.held.append(storage)
            if created_here and self.current is not None and key not in self.state_keys:
                self.records[self.current]["created"][sid] = float(_storage_bytes(t))
        return sid

    def record_op(self, func, out: Any) -> None:
        """Record one aten op of the current node (see the module docstring)."""
        if self.current is None or self.in_attention or not isinstance(func, torch._ops.OpOverload):
            return
        tensors = _tensors(out)
        if not tensors:
            return
        outputs = tuple(self.storage_id(t, created_here=True) for t in tensors)
        self.records[self.current]["aten_ops"].append((aten_kind(func), bool(func._schema.is_mutable), outputs))

    def _record_attention(self, result: Any) -> None:
        """An attention call as one fused kernel: its output and an fp32 log-sum-exp."""
        rec = self.records[self.current]
        outs = _tensors(result)
        outputs = [self.storage_id(t, created_here=True) for t in outs]
        if outs and outs[0].dim() >= 2:
            lse = len(self.held)
            self.held.append(None)
            rec["created"][lse] = float(outs[0].numel() // max(outs[0].shape[-1], 1) * LSE_BYTES)
            outputs.append(lse)
        rec["aten_ops"].append((ATTENTION_KERNELS[0], False, tuple(outputs)))

    def _params_of(self, node: fx.Node) -> List[Tuple[str, torch.Tensor]]:
        """(FQN, tensor) of parameters this node uses directly."""
        found = []
        if node.op == "call_module":
            mod = self.module.get_submodule(node.target)
            for name, p in mod.named_parameters(remove_duplicate=False):
                found.append((f"{node.target}.{name}", p))
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                value = super().fetch_attr(arg.target)
                if isinstance(value, torch.nn.Parameter):
                    found.append((str(arg.target), value))
        return found

    def run_node(self, n: fx.Node):
        if n.op in ("get_attr",):
            return super().run_node(n)
        rec = {"saved_bytes": 0, "aten_ops": [], "created": {}}
        self.records[n.name] = rec
        self.current = n.name
        self.in_attention = op_kind(n, self.module) in ATTENTION_CALLS
        before = self.counter.get_total_flops()
        try:
            result = super().run_node(n)
        except Exception as exc:
            exc.fx_node = n  # tells trace() which node and module failed
            raise
        if self.in_attention:
            self.in_attention = False
            self._record_attention(result)
        rec["out_storages"] = tuple(self.storage_id(t, created_here=False) for t in _tensors(result))
        self.current = None
        rec["flops"] = float(self.counter.get_total_flops() - before)
        inputs = [self.env[a] for a in n.all_input_nodes if a in self.env]
        in_t = _tensors(inputs)
        out_t = _tensors(result)
        rec["in_shapes"] = [list(t.shape) for t in in_t]
        rec["in_dtypes"] = [_dtype_name(t.dtype) for t in in_t]
        rec["out_shapes"] = [list(t.shape) for t in out_t]
        rec["out_dtypes"] = [_dtype_name(t.dtype) for t in out_t]
        rec["out_bytes"] = float(sum(t.numel() * t.element_size() for t in out_t))
        rec["consts"] = _literal_args(n)
        rec["args"] = [_literal(a) for a in n.args]
        rec["kwargs"] = {k: _literal(v) for k, v in n.kwargs.items()}
        # the input node of each entry of in_shapes (a tuple-valued input gives several)
        rec["inputs"] = [a.name for a in n.all_input_nodes if a in self.env for _ in _tensors(self.env[a])]
        pbytes, pnames, pcount, numels = 0, [], 0, []
        for name, p in self._params_of(n):
            if id(p) in self.seen_params:
                continue
            self.seen_params.add(id(p))
            pbytes += p.numel() * p.element_size()
            pcount += p.numel()
            pnames.append(self.param_fqn.get(id(p), name))
            numels.append(p.numel())
        rec["param_bytes"], rec["params"], rec["num_params"] = float(pbytes), pnames, pcount
        rec["param_numels"] = numels  # aligned with params
        return result

    def fake(self, value: Any) -> Any:
        """Fake copies (same shape, dtype, device) of the tensors in a nested structure."""
        return tree_map(lambda t: self.fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, value)

    def execute(self, *args):
        # every tensor autograd saves keeps its pack hook alive; a hook holding this interpreter
        # would close a cycle through the (C++) autograd graph that Python's collector cannot see,
        # leaking the traced module and the model's parameters it shares (measured: 2.6 GiB on a GPU
        # per auto_parallelize call). The hook reaches the interpreter weakly.
        pack_method = weakref.WeakMethod(self._pack)

        def pack(t: torch.Tensor) -> torch.Tensor:
            method = pack_method()
            return method(t) if method is not None else t

        with self.fake_mode, self.counter, torch.autograd.graph.saved_tensors_hooks(pack, _unpacked):
            with torch.enable_grad(), _AtenRecorder(self):
                try:
                    return self.run(*args)
                finally:
                    self.held.clear()


def annotate(gm: fx.GraphModule, args: Tuple, kwargs: Optional[Dict[str, Any]] = None) -> nx.DiGraph:
    """Execute ``gm`` on fake copies of the inputs; return the OpGraph's DiGraph with node attributes."""
    interp = _FakeInterpreter(gm)
    args, kwargs = interp.fake(tuple(args)), interp.fake(dict(kwargs or {}))
    in_spec = getattr(gm, "_in_spec", None)
    flat_args = fx_pytree.tree_flatten_spec((args, kwargs), in_spec) if in_spec is not None else args
    interp.execute(*flat_args)
    graph = nx.DiGraph()
    param_source: Dict[str, str] = {}
    param_rank: Dict[str, int] = {}
    param_dims: Dict[str, List[Optional[int]]] = {}  # view of a parameter: its dims -> the parameter's dims
    param_shape: Dict[str, List[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = fx.Interpreter.fetch_attr(interp, node.target)
            if isinstance(value, torch.nn.Parameter):
                fqn = interp.param_fqn.get(id(value), str(node.target))
                param_source[node.name], param_rank[fqn] = fqn, value.dim()
                param_dims[node.name] = list(range(value.dim()))
                param_shape[fqn] = list(value.shape)
            continue
        rec = interp.records.get(node.name)
        if rec is None or (node.op == "call_module" and str(node.target).startswith("_guards")):
            continue
        kind = op_kind(node, gm)
        attrs = dict(
            rec,
            op=kind,
            target=_target_str(node),
            module=module_of(node),
            fx_op=node.op,
            module_class=module_class_of(node, gm),
        )
        weight = weight_of(node, kind, gm, param_source, param_rank)
        if weight:
            attrs["weight"] = weight
            attrs["weight_dims"] = weight_dims(node, kind, gm, param_source, param_dims, weight)
            attrs["weight_shape"] = param_shape.get(weight) or list(gm.get_parameter(weight).shape)
        # the parameter behind each entry of in_shapes (None for activations)
        attrs["input_params"] = [param_source.get(name) for name in rec.get("inputs", [])]
        if kind in VIEW_OPS:
            src = next((a for a in node.all_input_nodes if a.name in param_source), None)
            if src is not None:
                param_source[node.name] = param_source[src.name]
                param_dims[node.name] = view_dims(kind, node, param_dims.get(src.name, []), rec)
        graph.add_node(node.name, **attrs)
        for arg in node.all_input_nodes:
            if arg.name in graph:
                graph.add_edge(arg.name, node.name)
    return graph


def _literal(value: Any) -> Any:
    """A node argument as plain data: numbers, strings, tuples of them, ``("slice", start, stop,
    step)`` and ``"..."``; None for tensors."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_literal(v) for v in value)
    if isinstance(value, slice):
        return ("slice", _literal(value.start), _literal(value.stop), _literal(value.step))
    if value is Ellipsis:
        return "..."
    return None


def _literal_args(node: fx.Node) -> str:
    """The node's literal (non-tensor) arguments, e.g. ``is_causal=True``: with the shapes they
    decide what an op computes, so they are part of a profile entry's key."""

    def lit(v: Any) -> Any:
        if isinstance(v, (bool, int, float, str)) or v is None:
            return v
        if isinstance(v, (tuple, list)):
            items = [lit(x) for x in v]
            return tuple(items) if all(x is not _SKIP for x in items) else _SKIP
        if isinstance(v, torch.dtype):
            return _dtype_name(v)
        return _SKIP

    parts = [repr(a) for a in map(lit, node.args) if a is not _SKIP]
    parts += [f"{k}={a!r}" for k, a in ((k, lit(v)) for k, v in node.kwargs.items()) if a is not _SKIP]
    return ",".join(parts)[:200]


_SKIP = object()


def _target_str(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__qualname__", None) or str(t)
