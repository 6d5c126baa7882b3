"""What a Float8 linear keeps of its input for the weight gradient, per kernel backend.

torchao's Float8 linears (nest-fx's runtime) keep the high-precision input and quantize it again
in backward, so their saved bytes are the traced ones. Transformer Engine's ``Linear`` keeps the
FP8 tensor it multiplied, one byte an element (the ``fused`` backend:
``KernelBackend.fp8_saved_inputs``); Megatron-Core runs a MoE router's linear unquantized, so it
keeps its input's width there.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from nest_fx.workload.block_facts import DTYPE_BYTES
from nest_fx.workload.runtime_costs import FP8_BYTES, RuntimeCosts


def fp8_input_shares(
    g, block, nodes: Sequence, runtime: RuntimeCosts, byte_scale: float, num_experts: int
) -> List[Optional[float]]:
    """Per node of ``block`` (``nodes``: its ``NodeCost``, in the order of ``block.nodes`` in the
    traced graph ``g``): the share of its saved bytes kept when ``runtime``'s backend keeps
    Float8 linear inputs quantized; None for every other node, and for every node of another
    backend or without Float8. ``byte_scale``: the run's activation width over the trace's (the
    traced input's dtype gives its width); ``num_experts``: the MoE layers' experts (a linear with
    an output per expert in a MoE block is the router)."""
    if not (runtime.backend.fp8_saved_inputs and runtime.float8):
        return [None] * len(nodes)
    out: List[Optional[float]] = []
    for name, n in zip(block.nodes, nodes):
        dtypes = g.nodes[name].get("in_dtypes") or []
        width = DTYPE_BYTES.get(dtypes[0], 2) * byte_scale if dtypes else 0.0
        router = block.is_moe and n.linear_dims[2] == num_experts > 0
        fp8 = width > 0 and not router and runtime.float8_node(block.kind, n)
        out.append(min(1.0, FP8_BYTES / width) if fp8 else None)
    return out
