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
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Set, Tuple

import networkx as nx
import torch
import torch.fx as fx
import torch.fx._pytree as fx_pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from nest_fx.graph.capture import clean_fqn
from nest_fx.graph.recompute_policies import ATTENTION_KERNELS, aten_kind

MATMUL_OPS = {
    "linear",
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "matmul",
    "_grouped_mm",
    "grouped_mm",
    "grouped_mm_fallback",
    "einsum",
}
# Ops that move or re-type a tensor without computing on it: a parameter seen through them is
# still "the weight" of the matmul that consumes it.
VIEW_OPS = {
    "view",
    "t",
    "transpose",
    "permute",
    "reshape",
    "expand",
    "contiguous",
    "to",
    "_to_copy",
    "unsqueeze",
    "squeeze",
    "select",
    "slice",
    "index",
    "getitem",
    "alias",
    "type_as",
    "float",
    "half",
    "bfloat16",
    "detach",
    "clone",
    "_unsafe_view",
    "chunk",
    "split",
    "unbind",
    "numpy_T",
    "mT",
    "adjoint",
    "lift_fresh_copy",
}
# Views that keep every dim of the parameter in place (dims follow through unchanged).
_SAME_DIMS = {
    "to",
    "_to_copy",
    "contiguous",
    "type_as",
    "float",
    "half",
    "bfloat16",
    "detach",
    "clone",
    "alias",
    "lift_fresh_copy",
}


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# FlopCounterMode has formulas for the CUDA attention kernels but not for the one SDPA picks for
# CPU tensors, which would count attention as 0 FLOPs when the model's parameters are on CPU
# (on meta or CUDA the same model counts them). Same formula as the CUDA kernels.
EXTRA_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop}


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """A grouped matmul of ``a [S, K]`` with ``b [G, K, N]`` (row groups by offsets; each row meets
    one group's matrix): 2*S*K*N. Other operand ranks (3-D x 3-D batched groups): 2 * the output
    numel * K."""
    k = a_shape[-1]
    out = 1
    for d in out_shape or [a_shape[0], b_shape[-1]]:
        out *= d
    return 2 * out * k


def flop_formulas() -> dict:
    """FLOP formulas FlopCounterMode lacks: the CPU SDPA kernel, grouped matmuls (``aten._grouped_mm``;
    HuggingFace MoE experts' ``transformers::grouped_mm_fallback``, registered once transformers'
    MoE integration is imported), so experts count the FLOPs of the tokens they really compute."""
    formulas = dict(EXTRA_FLOP_FORMULAS)
    formulas[torch.ops.aten._grouped_mm] = _grouped_mm_flop
    fallback = getattr(getattr(torch.ops, "transformers"), "grouped_mm_fallback", None)
    if fallback is not None:
        formulas[fallback] = _grouped_mm_flop
    return formulas


def op_kind(node: fx.Node, gm: fx.GraphModule) -> str:
    """Short, stable op name: module class for call_module, function/method name otherwise."""
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__.lower()
    if node.op in ("call_method", "get_attr", "placeholder", "output"):
        return str(node.target) if node.op == "call_method" else node.op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


def module_of(node: fx.Node) -> str:
    """FQN of the innermost module the node ran in."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return clean_fqn(path)


def module_class_of(node: fx.Node, gm: fx.GraphModule) -> str:
    """Qualified class name of the innermost module the node ran in ("" when unknown)."""
    if node.op == "call_module":
        cls = type(gm.get_submodule(node.target))
    else:
        stack = node.meta.get("nn_module_stack")
        cls = list(stack.values())[-1][1] if stack else None
    if isinstance(cls, str):
        return cls
    return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else ""


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


ATTENTION_CALLS = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
}
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
        with self.fake_mode, self.counter, torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
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
        weight = _weight_of(node, kind, gm, param_source, param_rank)
        if weight:
            attrs["weight"] = weight
            attrs["weight_dims"] = _weight_dims(node, kind, gm, param_source, param_dims, weight)
            attrs["weight_shape"] = param_shape.get(weight) or list(gm.get_parameter(weight).shape)
        # the parameter behind each entry of in_shapes (None for activations)
        attrs["input_params"] = [param_source.get(name) for name in rec.get("inputs", [])]
        if kind in VIEW_OPS:
            src = next((a for a in node.all_input_nodes if a.name in param_source), None)
            if src is not None:
                param_source[node.name] = param_source[src.name]
                param_dims[node.name] = _view_dims(kind, node, param_dims.get(src.name, []), rec)
        graph.add_node(node.name, **attrs)
        for arg in node.all_input_nodes:
            if arg.name in graph:
                graph.add_edge(arg.name, node.name)
    return graph


def _weight_of(
    node: fx.Node, kind: str, gm: fx.GraphModule, param_source: Dict[str, str], param_rank: Dict[str, int]
) -> str:
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), torch.nn.Linear):
        return f"{node.target}.weight"
    if kind in MATMUL_OPS:
        # The weight is the highest-rank parameter input (addmm(bias, x, weight) has two).
        sources = [param_source[a.name] for a in node.all_input_nodes if a.name in param_source]
        if sources:
            return max(sources, key=lambda s: param_rank.get(s, 0))
    return ""


def _view_dims(kind: str, node: fx.Node, dims: List[Optional[int]], rec: dict) -> List[Optional[int]]:
    """Which parameter dim each dim of a view of a parameter is (None: merged, split or unknown)."""
    in_shape = rec["in_shapes"][0] if rec.get("in_shapes") else []
    out_shape = rec["out_shapes"][0] if rec.get("out_shapes") else []
    n = len(dims)
    if kind in _SAME_DIMS or (kind in ("view", "reshape", "_unsafe_view", "expand") and in_shape == out_shape):
        return list(dims)
    if kind in ("t", "numpy_T"):
        return list(reversed(dims))
    if kind in ("mT", "adjoint") and n >= 2:
        return dims[:-2] + [dims[-1], dims[-2]]
    if kind == "transpose" and len(node.args) >= 3 and all(isinstance(a, int) for a in node.args[1:3]):
        a, b = (d % n for d in node.args[1:3])
        out = list(dims)
        out[a], out[b] = out[b], out[a]
        return out
    if kind == "permute" and len(node.args) >= 2 and isinstance(node.args[1], (list, tuple)):
        return [dims[d % n] for d in node.args[1]]
    if kind in ("select", "getitem", "index") and len(out_shape) == n - 1 and list(out_shape) == list(in_shape[1:]):
        return list(dims[1:])  # one expert's weight of a 3-D parameter
    if kind == "index" and len(out_shape) == n and list(out_shape[1:]) == list(in_shape[1:]):
        return [None] + list(dims[1:])  # a gather of experts along dim 0
    if kind == "unsqueeze" and len(node.args) >= 2 and isinstance(node.args[1], int):
        out = list(dims)
        out.insert(node.args[1] % (n + 1), None)
        return out
    return [None] * len(out_shape)


_OPERANDS = {"addmm": (1, 2), "baddbmm": (1, 2)}  # (A, B) of A @ B; other matmuls take them first


def _weight_dims(
    node: fx.Node,
    kind: str,
    gm: fx.GraphModule,
    param_source: Dict[str, str],
    param_dims: Dict[str, List[Optional[int]]],
    weight: str,
) -> List[Optional[int]]:
    """[output-feature dim, input-feature dim] of the parameter ``weight`` in this matmul (None
    when the tracer cannot tell): what tensor parallelism shards for a column and a row."""
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), torch.nn.Linear):
        return [0, 1]
    args = [a for a in node.args]
    if kind == "linear" and len(args) >= 2 and isinstance(args[1], fx.Node) and args[1].name in param_dims:
        dims = param_dims[args[1].name]
        return [dims[0], dims[1]] if len(dims) == 2 else [None, None]
    if kind not in MATMUL_OPS or kind in ("linear", "einsum"):
        return [None, None]
    first, second = _OPERANDS.get(kind, (0, 1))
    for position, (out_at, in_at) in ((second, (-1, -2)), (first, (-2, -1))):
        arg = args[position] if position < len(args) else None
        if isinstance(arg, fx.Node) and param_source.get(arg.name) == weight and arg.name in param_dims:
            dims = param_dims[arg.name]
            return [dims[out_at], dims[in_at]] if len(dims) >= 2 else [None, None]
    return [None, None]


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
