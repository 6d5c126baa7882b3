"""Which parameter a traced matmul multiplies by, and which of that parameter's dims are the
matmul's output and input features, followed through the views of the parameter (transposes,
permutes, an expert's slice): what tensor parallelism shards for a column and a row."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.fx as fx

from nest_fx.graph.op_kinds import MATMUL_OPS

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


def weight_of(
    node: fx.Node, kind: str, gm: fx.GraphModule, param_source: Dict[str, str], param_rank: Dict[str, int]
) -> str:
    """FQN of the parameter a matmul node multiplies by ("" when it is not a matmul or uses
    none); ``param_source``: node name -> the parameter it is (a view of), ``param_rank``: FQN ->
    its number of dims."""
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), torch.nn.Linear):
        return f"{node.target}.weight"
    if kind in MATMUL_OPS:
        # The weight is the highest-rank parameter input (addmm(bias, x, weight) has two).
        sources = [param_source[a.name] for a in node.all_input_nodes if a.name in param_source]
        if sources:
            return max(sources, key=lambda s: param_rank.get(s, 0))
    return ""


def view_dims(kind: str, node: fx.Node, dims: List[Optional[int]], rec: dict) -> List[Optional[int]]:
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


def weight_dims(
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
