"""Group OpGraph nodes into head, repeated layers and tail; find identical layers.

The layer container is the module path ``P`` for which nodes live under ``P.0``, ``P.1``, ...
(an ``nn.ModuleList``/``Sequential``/``ModuleDict`` of layers, the model itself when it is an
``nn.Sequential``), or under numbered layer names (``P.encoder_layer_0``, ``P.layer1``: an
OrderedDict ``Sequential``), and that carries the most FLOPs. Nodes before the first layer form the head,
nodes after the last layer the tail; nodes outside any layer that sit between layers (e.g. a
residual add written at the model's top level) belong to the layer before them. Two layers are
identical when their op sequences, relative module paths, shapes, dtypes and FLOPs match, which
lets later stages cost one layer and reuse it.

When the container's children are single modules (a flat ``nn.Sequential`` of ``Linear``,
``GELU``, ``Conv2d``, ...), one child is not a layer: the layers are the longest run of a
repeated unit of consecutive children (``Linear-GELU`` x 4, ``Conv-GroupNorm-ReLU`` x 4); the
children before the run form the head and those after it the tail. The unit is the shortest
repeat whose copies hold a whole tensor-parallel pair (``Linear-GELU-Linear-GELU``), when one
exists with at least two copies (a copy too few joins the tail), so both pipeline and tensor
parallelism apply; else the shortest repeat. Such a block lists its children in ``Block.members``.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from typing import Dict, List, Optional, Set, Tuple

import networkx as nx

from nest_fx.graph.opgraph import Block
from nest_fx.graph.tp_pairs import find_pattern


# a named layer: torchvision's ViT keeps encoder.layers.encoder_layer_0, ...; ResNet layer1..layer4
_NAMED_LAYER = re.compile(r"^(?P<stem>[A-Za-z_]*(?:layer|block|stage)[A-Za-z_]*?)_?(?P<index>\d+)$")


def layer_index(part: str) -> Optional[int]:
    """The index of a layer module's name: ``3`` (a list or Sequential entry) or a numbered layer
    name (``encoder_layer_3``, ``layer3``, ``block_3``); None for other names (``fc1``, ``norm2``)."""
    if part.isdigit():
        return int(part)
    match = _NAMED_LAYER.match(part)
    return int(match.group("index")) if match else None


def _layer_key(module: str, container: str) -> Optional[int]:
    """Index i when ``module`` is ``container.i`` (or ``container.<name>_i``) or below it, else None."""
    if not module.startswith(container + ".") and container:
        return None
    rest = module[len(container) + 1 :] if container else module
    return layer_index(rest.split(".", 1)[0])


def find_layer_container(graph: nx.DiGraph) -> Optional[str]:
    """Module path of the layer list: the indexed container with >= 2 layers and most FLOPs
    ("" for the model itself, None when there is none)."""
    flops: Dict[str, float] = defaultdict(float)
    indices: Dict[str, set] = defaultdict(set)
    for _, data in graph.nodes(data=True):
        parts = data.get("module", "").split(".") if data.get("module") else []
        for i, part in enumerate(parts):
            if layer_index(part) is not None:
                container = ".".join(parts[:i])
                indices[container].add(layer_index(part))
                flops[container] += data.get("flops", 0.0) + 1e-9 * data.get("out_bytes", 0.0)
                break  # only the outermost index: layers.3.experts.1 belongs to "layers"
    candidates = [c for c in indices if len(indices[c]) >= 2]
    if not candidates:
        return None
    return max(candidates, key=lambda c: (flops[c], -len(c)))


def detect_blocks(graph: nx.DiGraph) -> Tuple[str, List[Block]]:
    """Assign every node a block; return (layer container path, blocks in chain order)."""
    container = find_layer_container(graph)
    order = list(graph.nodes)  # insertion order = fx order, a topological order
    layer_of: Dict[str, Optional[int]] = {}
    for name in order:
        module = graph.nodes[name].get("module", "")
        layer_of[name] = _layer_key(module, container) if container is not None else None
    container = container or ""
    child_ids = sorted({i for i in layer_of.values() if i is not None})
    members: Dict[int, List[str]] = {}
    if child_ids and _leaf_children(graph, order, layer_of, container):
        layer_of, members = _group_children(graph, order, layer_of, child_ids, container)
    layer_ids = sorted({i for i in layer_of.values() if i is not None})
    if not layer_ids:
        blocks = [Block(index=0, name="head", kind="head", nodes=order)]
        _finish(graph, blocks, container)
        return container, blocks

    last = max((k for k, n in enumerate(order) if layer_of[n] is not None))
    head = Block(index=0, name="head", kind="head")
    child_names = _child_names(graph, order, layer_of, container)
    layers = {
        i: Block(
            index=k + 1,
            name=_group_name(members[i])
            if i in members
            else (f"{container}.{child_names[i]}" if container else child_names[i]),
            kind="block",
            members=members.get(i, []),
        )
        for k, i in enumerate(layer_ids)
    }
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
    blocks = _fold_empty_ends(graph, [head] + [layers[i] for i in layer_ids] + [tail])
    _finish(graph, blocks, container)
    return container, blocks


def _costless(graph: nx.DiGraph, nodes: List[str]) -> bool:
    """No FLOPs, parameters or saved activations: what the workload drops from its chain."""
    return not any(graph.nodes[n].get(k) for n in nodes for k in ("flops", "num_params", "saved_bytes"))


def _fold_empty_ends(graph: nx.DiGraph, blocks: List[Block]) -> List[Block]:
    """A forward that starts with the layer container (torchvision's ``self.features(x)``: its
    stem is ``features[0]``) leaves a head that computes nothing; the workload drops such a block
    while the runtime would count it, and a pipeline cut after it would pass no activation. Its
    first layer becomes the head instead (and likewise the last layer the tail of a forward that
    ends with the container), while a layer remains. Only a layer unlike its neighbour moves (a
    stem, a classifier); identical layers all stay layers."""
    head, layers, tail = blocks[0], blocks[1:-1], blocks[-1]

    def unlike(a: Block, b: Block) -> bool:  # the layers' own ops (root code between layers aside)
        def own(block: Block) -> List[str]:
            return [n for n in block.nodes if graph.nodes[n].get("module")]

        return _child_key(graph, own(a)) != _child_key(graph, own(b))

    if len(layers) >= 2 and _costless(graph, head.nodes) and unlike(layers[0], layers[1]):
        first = layers.pop(0)
        head.nodes = head.nodes + first.nodes
    if len(layers) >= 2 and _costless(graph, tail.nodes) and unlike(layers[-1], layers[-2]):
        last = layers.pop()
        tail.nodes = last.nodes + tail.nodes
    for k, b in enumerate([head] + layers + [tail]):
        b.index = k
    return [head] + layers + [tail]


def _child_names(
    graph: nx.DiGraph, order: List[str], layer_of: Dict[str, Optional[int]], container: str
) -> Dict[int, str]:
    """{layer index: the child module's own name} ("3", or "encoder_layer_3")."""
    names: Dict[int, str] = {}
    for n in order:
        if layer_of[n] is not None and layer_of[n] not in names:
            module = graph.nodes[n].get("module", "")
            rest = module[len(container) + 1 :] if container else module
            names[layer_of[n]] = rest.split(".", 1)[0]
    return names


def _child(container: str, index: int) -> str:
    return f"{container}.{index}" if container else str(index)


def _group_name(members: List[str]) -> str:
    return f"{members[0]}..{members[-1].rpartition('.')[2]}"


def _leaf_children(graph: nx.DiGraph, order: List[str], layer_of: Dict[str, Optional[int]], container: str) -> bool:
    """True when every child of the container is a single module (no submodule ran an op)."""
    return all(
        graph.nodes[n].get("module", "") == _child(container, layer_of[n]) for n in order if layer_of[n] is not None
    )


def _child_key(graph: nx.DiGraph, nodes: List[str]) -> tuple:
    return tuple(
        (
            graph.nodes[n].get("op"),
            graph.nodes[n].get("module_class"),
            repr(graph.nodes[n].get("out_shapes")),
            repr(graph.nodes[n].get("in_shapes")),
            graph.nodes[n].get("param_bytes"),
        )
        for n in nodes
    )


MAX_UNIT = 32  # children in a repeated unit (longer repeats are not looked for)


def _group_children(
    graph: nx.DiGraph, order: List[str], layer_of: Dict[str, Optional[int]], child_ids: List[int], container: str
) -> Tuple[Dict[str, Optional[int]], Dict[int, List[str]]]:
    """Group leaf children into layers: the longest run of a repeated unit (module docstring).
    Returns the new layer id of every node (None: head/tail) and each layer's member FQNs."""
    nodes_of: Dict[int, List[str]] = defaultdict(list)
    for n in order:
        if layer_of[n] is not None:
            nodes_of[layer_of[n]].append(n)
    keys = [_child_key(graph, nodes_of[i]) for i in child_ids]
    has_params = [any(graph.nodes[n].get("params") for n in nodes_of[i]) for i in child_ids]
    n = len(keys)
    best = None  # (covered, -unit, starts with parameters, -start), start, unit, copies
    for unit in range(1, min(MAX_UNIT, n // 2) + 1):
        for start in range(0, n - 2 * unit + 1):
            copies = 1
            while (
                start + (copies + 1) * unit <= n
                and keys[start + copies * unit : start + (copies + 1) * unit] == keys[start : start + unit]
            ):
                copies += 1
            if copies >= 2:
                rank = (unit * copies, -unit, has_params[start], -start)
                if best is None or rank > best[0]:
                    best = (rank, start, unit, copies)
    if best is None:
        return {k: None for k in layer_of}, {}
    _, start, unit, copies = best
    scale = next(
        (
            m
            for m in range(1, copies // 2 + 1)
            if _holds_pair(graph, [n for i in child_ids[start : start + m * unit] for n in nodes_of[i]])
        ),
        1,
    )
    size = unit * scale
    layer_of = {k: None for k in layer_of}
    members: Dict[int, List[str]] = {}
    for j in range(copies // scale):
        ids = child_ids[start + j * size : start + (j + 1) * size]
        members[j] = [_child(container, i) for i in ids]
        for i in ids:
            for node in nodes_of[i]:
                layer_of[node] = j
    return layer_of, members


def _holds_pair(graph: nx.DiGraph, nodes: List[str]) -> bool:
    """True when ``nodes`` hold a linear whose features reach another linear of them through
    per-feature ops only (a tensor-parallel pair that can be sharded exactly)."""
    pattern = find_pattern(graph, Block(index=-1, name="candidate", kind="block", nodes=list(nodes)))
    return any(not pair.problem for pair in pattern.tp_pairs)


def _finish(graph: nx.DiGraph, blocks: List[Block], container: str) -> None:
    """Fill per-block totals, boundary bytes and signatures."""
    owner = {}
    for b in blocks:
        for name in b.nodes:
            owner[name] = b.index
            graph.nodes[name]["block"] = b.index
    sent = _boundary_bytes(graph, len(blocks), owner)
    for b in blocks:
        data = [graph.nodes[n] for n in b.nodes]
        b.flops = float(sum(d.get("flops", 0.0) for d in data))
        b.param_bytes = float(sum(d.get("param_bytes", 0.0) for d in data))
        b.num_params = int(sum(d.get("num_params", 0) for d in data))
        b.saved_bytes = float(sum(d.get("saved_bytes", 0.0) for d in data))
        b.out_bytes = float(sent[b.index])
        b.is_moe = any(d.get("op") == "topk" for d in data)
        b.signature = _signature(graph, b, container)


def _parameter_derived(graph: nx.DiGraph) -> Set[str]:
    """Nodes whose value depends on a parameter (what a pipeline stage must receive rather than
    recompute from the model's inputs, as it does masks and rotary tables)."""
    derived: Set[str] = set()
    for name in nx.topological_sort(graph):
        d = graph.nodes[name]
        if d.get("params") or any(d.get("input_params") or ()) or any(p in derived for p in graph.predecessors(name)):
            derived.add(name)
    return derived


def _boundary_bytes(graph: nx.DiGraph, num_blocks: int, owner: Dict[str, int]) -> List[float]:
    """Per block, the bytes a stage boundary after it sends: its outputs consumed by later blocks,
    and the parameter-derived values of earlier blocks read after it (an encoder's output that
    every decoder layer reads, passed on from stage to stage)."""
    learned = _parameter_derived(graph)
    sent = [0.0] * num_blocks
    for name, d in graph.nodes(data=True):
        b = owner.get(name, -1)
        last = max((owner.get(s, -1) for s in graph.successors(name)), default=-1)
        if b < 0 or last <= b:
            continue
        for k in range(b, last if name in learned else b + 1):
            sent[k] += d.get("out_bytes", 0.0)
    return sent


def _signature(graph: nx.DiGraph, block: Block, container: str) -> str:
    h = hashlib.sha1()
    h.update(block.kind.encode())
    for name in block.nodes:
        d = graph.nodes[name]
        module = d.get("module", "")
        rel = block.rel(module)
        h.update(
            repr(
                (
                    d.get("op"),
                    rel,
                    d.get("out_shapes"),
                    d.get("out_dtypes"),
                    d.get("in_shapes"),
                    d.get("flops"),
                    d.get("param_bytes"),
                )
            ).encode()
        )
    return h.hexdigest()[:12]
