"""The names of what a traced node runs: its op kind, the module it ran in and that module's
class, and the op kinds the tracer and the workload single out (matmuls, views of a parameter,
attention calls)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from nest_fx.graph.capture import clean_fqn

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
ATTENTION_CALLS = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
}


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


def is_weight_view(d: dict) -> bool:
    """Whether a traced node is a view of a parameter that allocates nothing (HF's stacked experts
    hand ``weight.transpose(-2, -1)`` and a no-op ``.to(dtype)`` to ``grouped_mm``): no kernel runs
    and the matmul reading it reads the weight once, so it moves no bytes. Views of activations
    keep their in + out bytes, as the eager rows of docs/cost_model.md were checked with."""
    return d.get("op") in VIEW_OPS and not d.get("created") and any(d.get("input_params") or ())
