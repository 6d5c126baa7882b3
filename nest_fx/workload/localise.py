"""The local shard of a model under tensor parallelism, as a plain single-device module.

To time what one TP rank computes we do not need a process group: each column of a traced TP
pair keeps ``out/tp`` output features, each row ``in/tp`` input features (whatever module holds
them: ``nn.Linear``, HF ``Conv1D``, 3-D expert weights; a fused projection keeps 1/tp of each
part), attention modules see ``heads/tp`` heads, and the embedding and LM head keep ``ceil(vocab/tp)``
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
from nest_fx.graph.tp_mha import local_forward
from nest_fx.graph.tp_regions import (
    block_regions,
    head_input_hook,
    localise_head_counts,
    localise_wide_norm,
    shrink_param,
)
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
    setattr(
        parent,
        attr,
        nn.Embedding(
            local_vocab(old.num_embeddings, tp), old.embedding_dim, device=old.weight.device, dtype=old.weight.dtype
        ),
    )


def _shard(model: nn.Module, fqn: str, dim: int, tp: int, whole: int = 0) -> None:
    try:
        shrink_param(model, fqn, dim, tp, whole)
    except ValueError as exc:
        raise LocaliseError(str(exc)) from None


def localise_tp(model: nn.Module, graph, tp: int, vocab_size: int) -> nn.Module:
    """Shrink ``model`` in place to one TP rank's shard (see module docstring); returns it.

    ``graph`` is the model's OpGraph (its TP pairs and blocks). Every parameter a pair shards
    shrinks along its traced dim (fused parts together: the rank keeps 1/tp of each), per-head
    tables along their heads, attention modules count local heads, and per-head inputs (ALiBi)
    are sliced to rank 0's heads on entry, as the runtime does. In the head and tail, the
    embeddings with ``vocab_size`` rows and the linears with ``vocab_size`` outputs are sharded
    over the vocabulary, as the rewriter's vocabulary-parallel head/tail would be.
    """
    if tp == 1:
        return model
    for block in graph.blocks:
        if block.kind == "block":
            for region, kind, pairs in block_regions(graph.pattern_of(block)):
                for pair in pairs:
                    if pair.problem:
                        raise LocaliseError(f"{block.name}: {pair.problem}; profile it with --tp 1")
                    for spec in pair.params:
                        _shard(model, block.fqn(spec.name), spec.dim, tp, spec.whole_size())
                    for table in pair.head_tables:
                        _shard(model, block.fqn(table) + ".weight", 1, tp)
                    for norm in pair.wide_norms:
                        localise_wide_norm(model.get_submodule(block.fqn(norm)), tp)
                target = model.get_submodule(block.fqn(region))
                if kind == "attention":
                    localise_head_counts(target, tp)
                for pair in pairs:
                    if pair.leaf:  # nn.MultiheadAttention: the head-sharded forward the runtime runs
                        leaf = model.get_submodule(block.fqn(pair.leaf))
                        leaf.forward = local_forward(leaf, 0, tp)
                heads = [h for pair in pairs for h in pair.head_inputs]
                if heads:
                    target.register_forward_pre_hook(head_input_hook(heads, tp, 0), with_kwargs=True)
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


def local_graph(
    name: str, tp: int, mbs: int, *, seq: Optional[int], dtype: torch.dtype, layers: Optional[int], device="meta"
):
    """Build ``name`` (``layers`` deep) on ``device``, shrink it to a TP rank's shard, and trace it.

    Returns (OpGraph, model, args, kwargs); the token ids fit the local vocabulary shard."""
    model, cfg, args, kwargs = build_any(name, batch=mbs, seq=seq, device=device, dtype=dtype, layers=layers)
    if tp > 1:
        rows = getattr(cfg, "padded_vocab", cfg.vocab_size)  # the embedding's rows (zoo: padded)
        localise_tp(model, trace(model, args, kwargs, name=name), tp, rows)
        if torch.device(device).type != "meta":
            vocab = local_vocab(rows, tp)
            args = tuple(
                torch.randint(0, vocab, a.shape, device=device) if isinstance(a, torch.Tensor) else a for a in args
            )
            kwargs = {
                k: torch.randint(0, vocab, v.shape, device=device) if isinstance(v, torch.Tensor) else v
                for k, v in kwargs.items()
            }
    return trace(model, args, kwargs, name=name), model, args, kwargs
