"""The local shard of a model under tensor parallelism, as a plain single-device module.

To time what one TP rank computes we do not need a process group: each column linear of a
traced TP pair keeps ``out/tp`` output features, each row linear ``in/tp`` input features,
attention modules see ``heads/tp`` heads, and the embedding and LM head keep ``ceil(vocab/tp)``
rows (vocabulary parallelism; the largest shard of an uneven split, as ``Shard(0)`` makes it,
since the slowest rank sets the pace). The ops between the linears then run on exactly the shapes a TP rank
runs; the collectives are costed separately by the network model.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch
import torch.nn as nn

from nest_fx.common.errors import NestFxError
from nest_fx.graph import trace
from nest_fx.graph.tp_regions import block_regions, localise_head_counts
from nest_fx.models import build_any


class LocaliseError(NestFxError, ValueError):
    """The model has a TP pair this module cannot shard locally (names the module)."""


def _shard_linear(model: nn.Module, fqn: str, tp: int, dim: int, uneven: bool = False) -> None:
    parent_name, _, attr = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    if not isinstance(old, nn.Linear):
        raise LocaliseError(f"{fqn} is a {type(old).__name__}, not nn.Linear: profile it with --tp 1")
    size = old.out_features if dim == 0 else old.in_features
    if size % tp and not uneven:
        raise LocaliseError(f"{fqn}: {size} features are not divisible by tp={tp}")
    local = -(-size // tp)
    out_f, in_f = (local, old.in_features) if dim == 0 else (old.out_features, local)
    keep_bias = old.bias is not None
    new = nn.Linear(in_f, out_f, bias=keep_bias, device=old.weight.device, dtype=old.weight.dtype)
    setattr(parent, attr, new)


def _shard_embedding(model: nn.Module, fqn: str, tp: int) -> None:
    parent_name, _, attr = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    setattr(parent, attr, nn.Embedding(local_vocab(old.num_embeddings, tp), old.embedding_dim,
                                       device=old.weight.device, dtype=old.weight.dtype))


def localise_tp(model: nn.Module, graph, tp: int, vocab_size: int) -> nn.Module:
    """Shrink ``model`` in place to one TP rank's shard (see module docstring); returns it.

    ``graph`` is the model's OpGraph (its TP pairs and blocks). In the head and tail, the
    embeddings with ``vocab_size`` rows and the linears with ``vocab_size`` outputs are sharded
    over the vocabulary, as the rewriter's vocabulary-parallel head/tail would be.
    """
    if tp == 1:
        return model
    for block in graph.blocks:
        if block.kind == "block":
            for region, _, pairs in block_regions(graph.pattern_of(block)):
                for pair in pairs:
                    for col in pair.column:
                        _shard_linear(model, f"{block.name}.{col}", tp, dim=0)
                    _shard_linear(model, f"{block.name}.{pair.row}", tp, dim=1)
                localise_head_counts(model.get_submodule(f"{block.name}.{region}" if region else block.name), tp)
            continue
        for fqn in _call_modules(graph.graph, block.nodes):
            module = model.get_submodule(fqn)
            if isinstance(module, nn.Embedding) and module.num_embeddings == vocab_size:
                _shard_embedding(model, fqn, tp)
            elif isinstance(module, nn.Linear) and module.out_features == vocab_size:
                _shard_linear(model, fqn, tp, dim=0, uneven=True)
    return model


def local_vocab(vocab_size: int, tp: int) -> int:
    """Rows of the largest vocabulary shard on ``tp`` ranks."""
    return -(-vocab_size // tp)


def _call_modules(g, nodes: Iterable[str]):
    seen = set()
    for n in nodes:
        d = g.nodes[n]
        if d.get("fx_op") == "call_module" and d["target"] not in seen:
            seen.add(d["target"])
            yield d["target"]


def distinct_depth(graph) -> Optional[int]:
    """Layers needed so every distinct block signature of ``graph`` appears once (at least two:
    block detection needs a repeat); None when the model has no repeated blocks."""
    blocks = graph.layer_blocks
    first: Dict[str, int] = {}
    for k, b in enumerate(blocks):
        first.setdefault(b.signature, k)
    if not first:
        return None
    return min(len(blocks), max(2, max(first.values()) + 1))


def local_graph(name: str, tp: int, mbs: int, *, seq: Optional[int], dtype: torch.dtype, layers: Optional[int],
                device="meta"):
    """Build ``name`` (``layers`` deep) on ``device``, shrink it to a TP rank's shard, and trace it.

    Returns (OpGraph, model, args, kwargs); the token ids fit the local vocabulary shard."""
    model, cfg, args, kwargs = build_any(name, batch=mbs, seq=seq, device=device, dtype=dtype, layers=layers)
    if tp > 1:
        localise_tp(model, trace(model, args, kwargs, name=name), tp, cfg.vocab_size)
        if torch.device(device).type != "meta":
            vocab = local_vocab(cfg.vocab_size, tp)
            args = tuple(torch.randint(0, vocab, a.shape, device=device) if isinstance(a, torch.Tensor) else a
                         for a in args)
            kwargs = {k: torch.randint(0, vocab, v.shape, device=device) if isinstance(v, torch.Tensor) else v
                      for k, v in kwargs.items()}
    return trace(model, args, kwargs, name=name), model, args, kwargs
