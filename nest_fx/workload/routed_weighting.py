"""Where a traced MoE layer weights its expert outputs by the router, and what that keeps.

A MoE layer sums each token's expert outputs weighted by the router's top-k weights. Traced
(the zoo's ``MoE.combine``, HuggingFace's per-expert loops), the weighting is one multiply of the
expert outputs ``[..., H]`` by the weights ``[..., 1]`` outside the experts, and autograd keeps
both factors: the weights' gradient needs the expert outputs, ``k`` rows of ``H`` per token.

Megatron-Core's experts multiply the weights into their activation instead (``TEGroupedMLP`` and
``GroupedMLP``: ``activation_func_with_probs(fc1_output, permuted_probs)``, before ``fc2``), so
the gradient of the weights comes from the activation's own saved input and the sum of the
expert outputs keeps nothing of them. The weighting multiply is found as a product of ``[..., H]``
rows by ``[..., 1]`` weights in the module that runs the router's top-k (an RMSNorm's
``x * rsqrt(...)`` has that shape too, in its own module). The ``fused`` kernel backend prices that layer
(``kernels.KernelBackend.expert_probs_in_activation``): :func:`routed_weighting_bytes` is what
the traced multiply keeps that Megatron-Core's layer does not.
"""

from __future__ import annotations

from typing import List, Sequence

from nest_fx.workload.block_facts import tensor_bytes


def _weights_expert_rows(shapes) -> int:
    """Index of the ``[..., H]`` factor when ``shapes`` are a product of expert rows by one
    weight per row (two tensors, equal but for the last dimension, which is 1 in the other);
    -1 otherwise."""
    if not shapes or len(shapes) != 2:
        return -1
    a, b = (list(s) for s in shapes)
    if len(a) != len(b) or len(a) < 2 or a[:-1] != b[:-1]:
        return -1
    if a[-1] > 1 and b[-1] == 1:
        return 0
    if b[-1] > 1 and a[-1] == 1:
        return 1
    return -1


def routed_weighting_bytes(g, names: Sequence[str], is_moe: bool) -> List[float]:
    """Per node of a block (``names`` in the traced graph ``g``): the bytes of expert outputs a
    router-weighting multiply keeps for the weights' gradient (at most what the node saved; 0
    for every other node and in a block without a router)."""
    out = [0.0] * len(names)
    routers = {g.nodes[n].get("module", "") for n in names if g.nodes[n].get("op") == "topk"} if is_moe else set()
    for k, name in enumerate(names):
        d = g.nodes[name]
        if d.get("op") != "mul" or d.get("module", "") not in routers:
            continue
        shapes, dtypes = d.get("in_shapes"), d.get("in_dtypes")
        wide = _weights_expert_rows(shapes)
        if wide < 0 or not dtypes or len(dtypes) != 2:
            continue
        out[k] = min(float(d.get("saved_bytes", 0.0)), tensor_bytes([shapes[wide]], [dtypes[wide]]))
    return out
