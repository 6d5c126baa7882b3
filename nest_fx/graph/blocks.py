"""Group OpGraph nodes into head, repeated layers and tail; find identical layers.

The layer container is the module path ``P`` for which nodes live under ``P.0``, ``P.1``, ...
(an ``nn.ModuleList``/``Sequential`` of layers) and that carries the most FLOPs. Nodes before
the first layer form the head, nodes after the last layer the tail; nodes outside any layer
that sit between layers (e.g. a residual add written at the model's top level) belong to the
layer before them. Two layers are identical when their op sequences, relative module paths,
shapes, dtypes and FLOPs match, which lets later stages cost one layer and reuse it.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import networkx as nx

from nest_fx.graph.opgraph import Block


def _layer_key(module: str, container: str) -> Optional[int]:
    """Index i when ``module`` is ``container.i`` or below it, else None."""
    if not module.startswith(container + ".") and container:
        return None
    rest = module[len(container) + 1:] if container else module
    head = rest.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def find_layer_container(graph: nx.DiGraph) -> str:
    """Module path of the layer list: the indexed container with >= 2 layers and most FLOPs."""
    flops: Dict[str, float] = defaultdict(float)
    indices: Dict[str, set] = defaultdict(set)
    for _, data in graph.nodes(data=True):
        parts = data.get("module", "").split(".") if data.get("module") else []
        for i, part in enumerate(parts):
            if part.isdigit():
                container = ".".join(parts[:i])
                indices[container].add(int(part))
                flops[container] += data.get("flops", 0.0) + 1e-9 * data.get("out_bytes", 0.0)
                break  # only the outermost index: layers.3.experts.1 belongs to "layers"
    candidates = [c for c in indices if len(indices[c]) >= 2]
    if not candidates:
        return ""
    return max(candidates, key=lambda c: (flops[c], -len(c)))


def detect_blocks(graph: nx.DiGraph) -> Tuple[str, List[Block]]:
    """Assign every node a block; return (layer container path, blocks in chain order)."""
    container = find_layer_container(graph)
    order = list(graph.nodes)  # insertion order = fx order, a topological order
    layer_of: Dict[str, Optional[int]] = {}
    for name in order:
        module = graph.nodes[name].get("module", "")
        layer_of[name] = _layer_key(module, container) if container else None
    layer_ids = sorted({i for i in layer_of.values() if i is not None})
    if not layer_ids:
        blocks = [Block(index=0, name="head", kind="head", nodes=order)]
        _finish(graph, blocks, container)
        return container, blocks

    last = max((k for k, n in enumerate(order) if layer_of[n] is not None))
    head = Block(index=0, name="head", kind="head")
    layers = {i: Block(index=k + 1, name=f"{container}.{i}" if container else str(i), kind="block")
              for k, i in enumerate(layer_ids)}
    tail = Block(index=len(layer_ids) + 1, name="tail", kind="tail")
    current: Optional[Block] = None
    for k, name in enumerate(order):
        idx = layer_of[name]
        if idx is not None:
            current = layers[idx]
        elif k > last:
            current = tail
        elif current is None:
            current = head
        current.nodes.append(name)
    blocks = [head] + [layers[i] for i in layer_ids] + [tail]
    _finish(graph, blocks, container)
    return container, blocks


def _finish(graph: nx.DiGraph, blocks: List[Block], container: str) -> None:
    """Fill per-block totals, boundary bytes and signatures."""
    owner = {}
    for b in blocks:
        for name in b.nodes:
            owner[name] = b.index
            graph.nodes[name]["block"] = b.index
    for b in blocks:
        data = [graph.nodes[n] for n in b.nodes]
        b.flops = float(sum(d.get("flops", 0.0) for d in data))
        b.param_bytes = float(sum(d.get("param_bytes", 0.0) for d in data))
        b.num_params = int(sum(d.get("num_params", 0) for d in data))
        b.saved_bytes = float(sum(d.get("saved_bytes", 0.0) for d in data))
        b.out_bytes = float(_boundary_bytes(graph, b, owner))
        b.is_moe = any(d.get("op") == "topk" for d in data)
        b.signature = _signature(graph, b, container)


def _boundary_bytes(graph: nx.DiGraph, block: Block, owner: Dict[str, int]) -> float:
    """Bytes of this block's outputs consumed by later blocks (what a stage boundary sends)."""
    total = 0.0
    for name in block.nodes:
        if any(owner.get(s, -1) > block.index for s in graph.successors(name)):
            total += graph.nodes[name].get("out_bytes", 0.0)
    return total


def _signature(graph: nx.DiGraph, block: Block, container: str) -> str:
    prefix = f"{block.name}." if block.kind == "block" else ""
    h = hashlib.sha1()
    h.update(block.kind.encode())
    for name in block.nodes:
        d = graph.nodes[name]
        module = d.get("module", "")
        rel = module[len(prefix):] if prefix and module.startswith(prefix) else ("" if module == block.name else module)
        h.update(repr((d.get("op"), rel, d.get("out_shapes"), d.get("out_dtypes"), d.get("in_shapes"),
                       d.get("flops"), d.get("param_bytes"))).encode())
    return h.hexdigest()[:12]
