"""Where tensor parallelism cuts a block: the *regions* of its TP pairs.

A TP pair (column linears feeding a row linear, found by ``tp_pairs``) runs sharded between
its linears; the module that holds the whole pair (the lowest common ancestor of its linears,
e.g. ``attn`` or ``mlp``) is the pair's region. The runtime shards by region and the profiler
shrinks a model to one TP rank's shapes by region, so both read them here.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch.nn as nn

HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "heads", "kv_heads", "n_head",
                    "n_heads", "n_kv_heads", "hidden_size")


def _lca(names: Sequence[str]) -> str:
    """Lowest common ancestor module of dotted linear paths ('' = the block itself)."""
    parts = [n.split(".") for n in set(names)]
    if len(parts) == 1:
        return ".".join(parts[0][:-1])
    out: List[str] = []
    for group in zip(*parts):
        if len(set(group)) != 1:
            break
        out.append(group[0])
    return ".".join(out)


def block_regions(pattern, routers: Sequence[str] = ()) -> List[Tuple[str, str, List]]:
    """(region path, kind, pairs) of a block pattern, regions relative to the block.

    Attention/MLP pairs: the region is the lowest common ancestor of the pair's linears.
    Expert pairs: one region for the whole MoE (ancestor of the router and all experts).
    """
    regions: Dict[str, Tuple[str, List]] = {}
    experts = [p for p in pattern.tp_pairs if p.kind == "expert"]
    for pair in pattern.tp_pairs:
        if pair.kind == "expert":
            continue
        region = _lca(list(pair.column) + [pair.row])
        regions.setdefault(region, (pair.kind, []))[1].append(pair)
    if experts:
        names = [n for p in experts for n in (*p.column, p.row)] + list(pattern.routers or routers)
        region = _lca(names)
        # the common ancestor of experts.0.up and experts.1.up is "moe.experts"; the router lifts it
        regions.setdefault(region, ("expert", []))[1].extend(experts)
    return [(path, kind, pairs) for path, (kind, pairs) in regions.items()]


def localise_head_counts(module: nn.Module, tp: int) -> None:
    """Divide head-count attributes of an attention module by ``tp`` (older HF reshapes read them)."""
    for attr in HEAD_COUNT_ATTRS:
        value = module.__dict__.get(attr)
        if isinstance(value, int) and value > 0 and value % tp == 0:
            setattr(module, attr, value // tp)
