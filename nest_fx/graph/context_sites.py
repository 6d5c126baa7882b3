"""Where a model mixes tokens and reads positions: what context parallelism must rewrite.

Context parallelism gives each rank a part of every sequence; everything per token runs
unchanged, so only two things must change: attention (each query needs the keys and values of
earlier tokens held by other ranks) and positions (a rank's tokens are not at positions
``0 .. S/cp - 1``). This module finds both in a model and its traced :class:`OpGraph`:

* :func:`attention_sites`: every ``scaled_dot_product_attention`` call, with the module that
  makes it and how it masks (``is_causal``, an explicit mask, neither);
* :func:`position_sites`: the modules that turn positions into numbers: zoo rotary tables
  (``rope_tables`` takes the first ``seq`` rows of cos/sin buffers), HuggingFace rotary
  embeddings (``forward(x, position_ids)``), and learned position embeddings (an
  ``nn.Embedding`` whose indices come from an ``arange``);
* :func:`unknown_position_embeddings`: embeddings indexed by something that is neither the
  model input nor an ``arange`` (a position buffer, token types...), which CP cannot remap.

``nest_fx.plan.support.ParallelSupport.cp_problem`` turns what it finds into a verdict;
``nest_fx.apply.context_parallel`` rewrites the sites.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import List, Optional

import networkx as nx
import torch.nn as nn

from nest_fx.graph.opgraph import OpGraph

SDPA = "scaled_dot_product_attention"
_INDEX_PASSTHROUGH = {
    "add",
    "sub",
    "unsqueeze",
    "expand",
    "view",
    "reshape",
    "to",
    "alias",
    "slice",
    "getitem",
    "_assert_tensor_metadata",
    "clone",
    "contiguous",
}


@dataclass
class AttentionSite:
    """One SDPA call: ``module`` makes it inside layer ``block``."""

    module: str
    block: str
    causal: bool  # is_causal=True
    mask: bool  # an attn_mask tensor is passed


@dataclass
class PositionSite:
    """A module that reads positions: ``kind`` is "rope-table", "rope-position-ids" or "learned"."""

    module: str
    kind: str


def attention_sites(graph: OpGraph) -> List[AttentionSite]:
    """Every SDPA call of the graph, in order."""
    out = []
    for block in graph.blocks:
        for node in block.nodes:
            d = graph.graph.nodes[node]
            if d.get("op") == SDPA:
                consts = d.get("consts", "")
                out.append(
                    AttentionSite(
                        module=d.get("module", ""),
                        block=block.name,
                        causal="is_causal=True" in consts,
                        mask=len(d.get("in_shapes", [])) >= 4,
                    )
                )
    return out


def blocks_without_attention(graph: OpGraph) -> List[str]:
    """Layer blocks with no SDPA call (their token mixing, if any, is unknown to CP)."""
    with_attention = {s.block for s in attention_sites(graph)}
    return [b.name for b in graph.blocks if b.kind == "block" and b.name not in with_attention]


def _index_source(g: nx.DiGraph, node: str, depth: int = 8) -> Optional[str]:
    """The op that the indices of an embedding node come from: "placeholder", "arange" or another
    op kind, following index arithmetic and views back from its last tensor input."""
    preds = list(g.predecessors(node))
    current = preds[-1] if preds else None
    for _ in range(depth):
        if current is None:
            return None
        op = g.nodes[current].get("op")
        if op not in _INDEX_PASSTHROUGH:
            return "placeholder" if g.nodes[current].get("fx_op") == "placeholder" else op
        inner = list(g.predecessors(current))
        current = inner[0] if inner else None
    return None


def _embedding_nodes(graph: OpGraph):
    for node, d in graph.graph.nodes(data=True):
        if d.get("op") == "embedding" and d.get("module"):
            yield node, d["module"]


def position_sites(model: nn.Module, graph: OpGraph) -> List[PositionSite]:
    """The modules of ``model`` that turn positions into numbers (see the module docstring)."""
    modules = dict(model.named_modules())
    found: List[PositionSite] = []
    seen = set()

    def add(path: str, kind: str) -> None:
        if path not in seen and path in modules:
            seen.add(path)
            found.append(PositionSite(path, kind))

    for _, d in graph.graph.nodes(data=True):
        if d.get("op") == "rope_tables":
            add(d.get("module", ""), "rope-table")
    for path, module in modules.items():
        if type(module).__name__.endswith("RotaryEmbedding"):
            params = inspect.signature(module.forward).parameters
            if "position_ids" in params:
                add(path, "rope-position-ids")
    for node, path in _embedding_nodes(graph):
        if _index_source(graph.graph, node) == "arange":
            add(path, "learned")
    return found


def unknown_position_embeddings(graph: OpGraph) -> List[str]:
    """Embedding modules indexed by neither the model input nor an ``arange``."""
    out = []
    for node, path in _embedding_nodes(graph):
        source = _index_source(graph.graph, node)
        if source not in ("placeholder", "arange") and path not in out:
            out.append(path)
    return out
