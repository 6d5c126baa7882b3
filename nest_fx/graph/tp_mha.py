"""``nn.MultiheadAttention`` under tensor parallelism: one traced op holding a whole attention pair.

fx keeps ``torch.nn`` modules as leaves, so the tracer sees a ``nn.MultiheadAttention`` call as one
op: no linears to pair, and the attention would run whole on every TP rank beside the sharded MLP.
:func:`add_multihead_pairs` gives each such call that tensor parallelism can shard by heads a
:class:`TPPair` of the module's own parameters: ``in_proj_weight`` / ``in_proj_bias`` as the column
(q, k and v each cut by heads: three fused parts of ``embed_dim`` features, ``head_dim`` per head),
``out_proj`` as the row, and ``pair.leaf`` naming the module. The runtime replaces that module's
forward by a head-sharded one computing the same thing (``apply.tp_mha``); the cost model prices
the call as a sharded region with one all-reduce of its output (``workload.block_facts``).

A call it cannot shard stays whole on every TP rank, reported with the reason
(:func:`multihead_problem`, ``OpGraph.replicated_attention``) and priced so.

torch's own forward (``F.multi_head_attention_forward``) cannot run on one rank's shard: it reads
the width of the whole projection from its input (``unflatten(-1, (3, E))``) and checks it against
``embed_dim``. :func:`head_sharded_forward` computes the same attention on one rank's heads
(Megatron's attention: inputs copied to the TP group, the output projection's partial sums reduced,
``out_proj.bias`` added once after). It covers the calls this module shards: packed q/k/v
projections, no appended key/value positions, the attention weights unused (returned as
``None``); batch-first or sequence-first, batched or not, an ``attn_mask`` (2-D, or 3-D per head:
each rank keeps its heads' masks) and a ``key_padding_mask``, boolean or additive, and dropout
(on its heads, from the random state the TP ranks share, as in the other regions). The runtime
(``apply.tp_styles.MultiheadShard``), the TP rehearsal and the profiler's one-rank copy all run it.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import networkx as nx
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from nest_fx.graph.opgraph import BlockPattern, TPPair, TPParam

MHA_OP = "multiheadattention"


def _weights_used(g: nx.DiGraph, node: str) -> bool:
    """True when the traced model reads the attention weights (the call's second output), or
    uses the output tuple in a way the trace does not tell apart."""
    d = g.nodes[node]
    if d.get("kwargs", {}).get("need_weights") is False:
        return False
    for user in g.successors(node):
        u = g.nodes[user]
        if u.get("op") != "getitem" or not isinstance((u.get("args") or [None, None])[1], int):
            return True
        if u["args"][1] != 0 and any(True for _ in g.successors(user)):
            return True
    return False


def multihead_problem(module: nn.Module, g: nx.DiGraph, node: str) -> str:
    """Why the traced ``nn.MultiheadAttention`` call ``node`` of ``module`` cannot be sharded by
    heads ("" when it can)."""
    if not getattr(module, "_qkv_same_embed_dim", False):
        return "its keys and values have their own widths (kdim/vdim: separate q/k/v projection weights)"
    if module.bias_k is not None or module.bias_v is not None or module.add_zero_attn:
        return "it appends learned or zero key/value positions (add_bias_kv / add_zero_attn)"
    if _weights_used(g, node):
        return (
            "the model reads the attention weights it returns (need_weights=True): they average all heads, "
            "which one rank does not hold; fix: call it with need_weights=False"
        )
    return ""


def multihead_pair(module: nn.Module, rel: str) -> TPPair:
    """The TP pair of an ``nn.MultiheadAttention`` at ``rel`` (relative to its block)."""
    embed, head_dim = module.embed_dim, module.head_dim
    fused = dict(dim=0, parts=[embed] * 3, units=[head_dim] * 3)
    params = [TPParam(name=f"{rel}.in_proj_weight", **fused)]
    if module.in_proj_bias is not None:
        params.append(TPParam(name=f"{rel}.in_proj_bias", **fused))
    params.append(TPParam(name=f"{rel}.out_proj.weight", dim=1))
    return TPPair(kind="attention", column=[f"{rel}.in_proj_weight"], row=f"{rel}.out_proj", params=params, leaf=rel)


def add_multihead_pairs(graph, model: nn.Module) -> Dict[str, str]:
    """Add to ``graph.patterns`` the pairs of the ``nn.MultiheadAttention`` calls in its layers that
    tensor parallelism shards by heads; returns {module FQN: why it stays whole} for the others
    (of every layer, as ``graph.replicated_attention``)."""
    g, whole, seen = graph.graph, {}, {}
    for block in graph.layer_blocks:
        first = block.signature not in seen
        seen.setdefault(block.signature, block)
        for node in block.nodes:
            d = g.nodes[node]
            fqn = d.get("module", "")
            if d.get("op") != MHA_OP or d.get("fx_op") != "call_module":
                continue
            module = model.get_submodule(fqn)
            if not isinstance(module, nn.MultiheadAttention):
                continue
            problem = multihead_problem(module, g, node)
            if problem:
                whole[fqn] = problem
            elif first:
                pattern = graph.patterns.setdefault(block.signature, BlockPattern(block.signature))
                pattern.tp_pairs.append(multihead_pair(module, block.rel(fqn)))
    graph.replicated_attention = whole
    return whole


def _local(p: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A parameter as this rank computes with it: its local shard (differentiable), or itself."""
    return p.to_local() if isinstance(p, DTensor) else p


def _additive(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A boolean mask (True: not attended, torch's MHA convention) as an additive float mask."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def _merged_mask(
    attn_mask,
    key_padding_mask,
    batch: int,
    heads: int,
    local_heads: int,
    rank: int,
    target: int,
    source: int,
    dtype: torch.dtype,
) -> Optional[torch.Tensor]:
    """One additive mask broadcasting against [batch, local heads, target, source]."""
    mask = _additive(attn_mask, dtype)
    if mask is not None and mask.dim() == 3:  # [batch * heads, L, S]: this rank's heads
        mask = mask.view(batch, heads, target, source).narrow(1, rank * local_heads, local_heads)
    padding = _additive(key_padding_mask, dtype)
    if padding is not None:
        padding = padding.view(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding
    return mask


def head_sharded_forward(
    module: nn.MultiheadAttention,
    rank: int,
    tp: int,
    comms: Optional[Tuple[Callable, Callable]],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: Optional[torch.Tensor] = None,
    need_weights: bool = True,
    attn_mask: Optional[torch.Tensor] = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> Tuple[torch.Tensor, None]:
    """``module``'s attention on TP rank ``rank``'s ``1/tp`` of its heads, its parameters already cut
    to that rank's shard (DTensors or plain tensors). ``comms``: (copy to TP, reduce from TP), the
    runtime's Megatron f and g (None: no collectives, for a copy shrunk to one rank's shapes, as the
    TP rehearsal and the profiler run it). The attention weights are not computed (the model does
    not read them: :func:`multihead_problem`). ``is_causal`` is torch's hint that ``attn_mask`` is
    the causal mask: the mask given is applied as it is."""
    del need_weights, average_attn_weights, is_causal
    entered: Dict[int, torch.Tensor] = {}

    def enter(t: torch.Tensor) -> torch.Tensor:  # each distinct input once: its gradient is summed over TP
        if id(t) not in entered:
            entered[id(t)] = comms[0](t) if comms is not None else t
        return entered[id(t)]

    query, key, value = enter(query), enter(key), enter(value)
    unbatched = query.dim() == 2
    if unbatched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
    if unbatched or not module.batch_first:  # [L, B, E] -> [B, L, E]
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    weights = _local(module.in_proj_weight).chunk(3)
    bias = _local(module.in_proj_bias)
    biases = bias.chunk(3) if bias is not None else (None, None, None)
    batch, target, source, head_dim = query.shape[0], query.shape[1], key.shape[1], module.head_dim

    def heads(x, w, b):
        return F.linear(x, w, b).view(x.shape[0], x.shape[1], -1, head_dim).transpose(1, 2)

    q, k, v = (
        heads(query, weights[0], biases[0]),
        heads(key, weights[1], biases[1]),
        heads(value, weights[2], biases[2]),
    )
    local_heads = q.shape[1]
    mask = _merged_mask(
        attn_mask, key_padding_mask, batch, local_heads * tp, local_heads, rank, target, source, q.dtype
    )
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=module.dropout if module.training else 0.0)
    out = F.linear(y.transpose(1, 2).reshape(batch, target, -1), _local(module.out_proj.weight))
    if comms is not None:
        out = comms[1](out)
    if module.out_proj.bias is not None:
        out = out + module.out_proj.bias
    if unbatched or not module.batch_first:
        out = out.transpose(0, 1)
    return (out.squeeze(1) if unbatched else out), None


def local_forward(
    module: nn.MultiheadAttention, rank: int, tp: int, comms: Optional[Tuple[Callable, Callable]] = None
) -> Callable:
    """:func:`head_sharded_forward` bound to ``module``: its forward once its parameters are cut."""
    return functools.partial(head_sharded_forward, module, rank, tp, comms)
