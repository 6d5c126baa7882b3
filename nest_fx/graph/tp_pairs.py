"""Find the column-parallel -> row-parallel pairs of each distinct block, and how to shard them.

Megatron-style tensor parallelism (Shoeybi et al. 2019) shards a linear A by output features
(column) and the next linear B by input features (row), so only B's output needs an
all-reduce. A and B form a pair when B's input is computed from A's output by ops that act on
A's features independently: elementwise ops, reshapes into heads, per-head norms, rotary
embeddings and attention. We find the pairs by walking backwards from every parameterised
matmul over floating-point data flow inside the block, stopping at other parameterised matmuls
(the columns) and at norms of the residual stream (whose width is the row's output width), which
mix all features and so end the sharded region; a norm module applied to the whole output of a
projection of the same attention (OLMo2's ``q_norm``: ``graph.tp_wide_norms``) does not end it.
Integer tensors (token indices, routing slots) are not followed: they carry no features.

A "parameterised matmul" is whatever the tracer saw multiply activations by a parameter:
``nn.Linear``, HF's ``Conv1D`` (``addmm`` with a [in, out] weight), ``x @ self.weight.T``,
grouped/batched matmuls against 3-D expert weights. Its unit is the module holding the weight
when that module holds nothing else (a linear-like module), else the parameter itself (experts
stored as 3-D tensors, whose module then runs on its local shards). ``graph.tp_flow`` then
follows the sharded features from the columns to the row and says which parameters to shard
along which dim (fused parts included), what else runs per head, and what cannot be sharded.

A router is a parameterised matmul whose output reaches ``topk`` within a few ops.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import networkx as nx

from nest_fx.graph.op_kinds import MATMUL_OPS, VIEW_OPS
from nest_fx.graph.opgraph import Block, BlockPattern, TPPair, TPParam
from nest_fx.graph.tp_flow import follow_pair
from nest_fx.graph.tp_inputs import is_float, shared_column_input
from nest_fx.graph.tp_regions import lowest_common_module
from nest_fx.graph.tp_wide_norms import projection_norms

NORM_OPS = {
    "layernorm",
    "layer_norm",
    "native_layer_norm",
    "rmsnorm",
    "rms_norm",
    "mean",
    "var",
    "var_mean",
    "groupnorm",
    "group_norm",
    "batchnorm",
    "batch_norm",
}
ATTENTION_OPS = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "softmax",
    "_softmax",
}
_STATISTICS = {"mean", "var", "var_mean"}  # what a hand-written norm reduces with
# ops a linear-like module may run besides its matmul: views of the weight or input, the bias add
_PROJECTION_OPS = MATMUL_OPS | VIEW_OPS | {"add", "add_", "view", "reshape", "_unsafe_view", "permute"}


def _rel(fqn: str, block: Block) -> str:
    return block.rel(fqn)


class _BlockParams:
    """The block's parameters by owning module (from the traced nodes)."""

    def __init__(self, graph: nx.DiGraph, block: Block):
        self.all: Set[str] = {p for n in block.nodes for p in graph.nodes[n].get("params", [])}
        self.shapes: Dict[str, List[int]] = {}
        for n in block.nodes:
            d = graph.nodes[n]
            for name, shape in zip(d.get("input_params") or [], d.get("in_shapes") or []):
                if name:
                    self.shapes.setdefault(name, shape)

    def under(self, module: str) -> Set[str]:
        return {p for p in self.all if p.startswith(module + ".")}


def _unit(graph: nx.DiGraph, node: str, params: _BlockParams) -> Tuple[str, bool]:
    """(unit FQN, is a module) of a parameterised matmul: its module when it holds only this
    weight (and a bias), else the weight parameter itself."""
    weight = graph.nodes[node]["weight"]
    module = weight.rpartition(".")[0]
    if weight.endswith(".weight") and params.under(module) <= {weight, module + ".bias"}:
        return module, True
    return weight, False


def find_pattern(graph: nx.DiGraph, block: Block) -> BlockPattern:
    """TP pairs and routers of one block (FQNs relative to the block)."""
    members: Set[str] = set(block.nodes)
    linears = [n for n in block.nodes if graph.nodes[n].get("weight")]
    params = _BlockParams(graph, block)
    routers = sorted({_rel(_unit(graph, n, params)[0], block) for n in linears if _reaches_topk(graph, n, members)})
    pairs: List[TPPair] = []
    wide = projection_norms(graph, block.nodes)
    for row in linears:
        columns, through_attention, stops = _columns_feeding(graph, row, members, wide)
        if not columns:
            continue
        pair = _make_pair(graph, block, params, columns, row, through_attention, bool(routers), stops, wide)
        if pair.row in routers or set(pair.column) & set(routers):
            continue
        pairs.append(pair)
    return BlockPattern(signature=block.signature, tp_pairs=_dedupe(pairs), routers=routers)


def _make_pair(
    graph: nx.DiGraph,
    block: Block,
    params: _BlockParams,
    columns: List[str],
    row: str,
    through_attention: bool,
    moe: bool,
    stops: List[str],
    wide: Set[str] = frozenset(),
) -> TPPair:
    units = {n: _unit(graph, n, params) for n in columns + [row]}
    col_names = sorted({_rel(units[c][0], block) for c in columns})
    row_name = _rel(units[row][0], block)
    if any("expert" in n or (moe and any(p.isdigit() for p in n.split("."))) for n in [row_name, *col_names]):
        kind = "expert"
    else:
        kind = "attention" if through_attention else "mlp"
    pair = TPPair(kind=kind, column=col_names, row=row_name)
    problem = _unit_problem(graph, block, params, units, columns, row)
    owners = [u if is_module else u.rpartition(".")[0] for u, is_module in units.values()]
    region = owners[0] if len(set(owners)) == 1 else lowest_common_module(owners)  # 3-D experts: their module
    layout = follow_pair(graph, block, columns, row, region, {u for u, is_module in units.values() if is_module}, wide)
    pair.problem = problem or layout.problem
    pair.input_module = _input_module(graph, block, columns, units, region)
    inside = [
        graph.nodes[n].get("module", "")
        for n in stops
        if graph.nodes[n].get("module", "").startswith(region + ".") and region
    ]
    if pair.problem and inside:
        pair.problem = (
            f"module {inside[0]} normalises over all the features of a projection between the pair's "
            "linears (e.g. a query norm over the whole projection); each rank would normalise its shard "
            f"alone ({pair.problem})"
        )
    pair.head_norms = {_rel(m, block): d for m, d in layout.head_norms.items()}
    pair.head_tables = sorted({_rel(m, block) for m in layout.head_tables})
    pair.head_inputs = layout.head_inputs
    # a per-head parameter of the region (Swin's relative_position_bias_table): sharded by heads
    pair.params += [TPParam(name=_rel(name, block), dim=dim, units=[1]) for name, dim in layout.head_params.items()]
    pair.wide_norms = sorted(_rel(m, block) for m in layout.wide_norms)
    pair.params += [TPParam(name=_rel(p, block), dim=dim) for p, dim in layout.wide_params.items()]
    for c in columns:
        pair.params += _column_params(
            graph, block, params, c, units[c], layout.parts.get(c, []), layout.whole.get(c, [])
        )
    d = graph.nodes[row]
    in_dim = (d.get("weight_dims") or [None, None])[1]
    pair.params.append(TPParam(name=_rel(d["weight"], block), dim=in_dim if in_dim is not None else -1))
    pair.params.sort(key=lambda p: p.name)
    return pair


def _input_module(
    graph: nx.DiGraph, block: Block, columns: List[str], units: Dict[str, Tuple[str, bool]], region: str
) -> str:
    """The module (relative to the block) whose input the runtime can prepare once for all the
    columns: the region, else the columns' own common module (BERT's ``attention.self``, whose
    region ``attention`` also adds its input to its output); a module below the layer only (the
    runtime's hook target), never a group of children's. "" when neither qualifies."""
    if block.members:
        return ""
    for candidate in (region, lowest_common_module([units[c][0] for c in columns])):
        if _rel(candidate, block) and shared_column_input(graph, columns, units, candidate):
            return _rel(candidate, block)
    return ""


def _column_params(
    graph: nx.DiGraph,
    block: Block,
    params: _BlockParams,
    node: str,
    unit: Tuple[str, bool],
    parts: List[Tuple[int, int, int]],
    whole: List[int] = (),
) -> List[TPParam]:
    d = graph.nodes[node]
    weight = d["weight"]
    out_dim = (d.get("weight_dims") or [None, None])[0]
    sizes = [size for _, size, _ in parts] if len(parts) > 1 else []
    units = [u for _, _, u in parts]
    whole = list(whole)
    found = [
        TPParam(
            name=_rel(weight, block), dim=out_dim if out_dim is not None else -1, parts=sizes, units=units, whole=whole
        )
    ]
    bias = unit[0] + ".bias" if unit[1] else weight + "_bias"
    if bias in params.all:
        ndim = len(params.shapes.get(weight, d.get("weight_shape") or []))
        found.append(TPParam(name=_rel(bias, block), dim=1 if ndim == 3 else 0, parts=sizes, units=units, whole=whole))
    return found


def _unit_problem(
    graph: nx.DiGraph,
    block: Block,
    params: _BlockParams,
    units: Dict[str, Tuple[str, bool]],
    columns: List[str],
    row: str,
) -> str:
    """Why the pair's linear-like modules or expert parameters cannot be sharded as units ("" = they can)."""
    members = block.nodes
    for node, (name, is_module) in units.items():
        caller = graph.nodes[node].get("module", "")
        if is_module and caller != name:
            # torchvision's Swin: F.linear(x, self.qkv.weight, ...) in the attention's forward; the
            # runtime shards a module through its own forward, which never runs here
            return (
                f"the weight of module {name} is used by op {graph.nodes[node].get('op')!r} in the forward of "
                f"{caller or '<root>'!r}, not by {name}'s own forward, which tensor parallelism shards it through; "
                f"it shards once the forward calls the module (`self.{name.rpartition('.')[2]}(x)`) instead of "
                "reading its weight"
            )
        if is_module:
            extra = sorted(
                {
                    graph.nodes[n].get("op")
                    for n in members
                    if graph.nodes[n].get("module") == name and graph.nodes[n].get("op") not in _PROJECTION_OPS
                }
            )
            if extra:
                return (
                    f"module {name} runs {extra} besides its projection; tensor parallelism shards modules that "
                    "only project (nn.Linear, Conv1D, x @ weight.T)"
                )
            continue
        owner = name.rpartition(".")[0]
        pair_params = {graph.nodes[n]["weight"] for n in units}
        others = params.under(owner) - pair_params - {p + "_bias" for p in pair_params if node != row}
        if others:
            return (
                f"module {owner} holds {sorted(others)} besides the sharded {sorted(pair_params)}; tensor "
                "parallelism runs such a module on its local shards only when it holds nothing else"
            )
        if name + "_bias" in params.all and node == row:
            return f"the row parameter {name} has a bias ({name}_bias); sharding it is not supported yet"
    owners = {u.rpartition(".")[0] for u, is_module in units.values() if not is_module}
    if len(owners) > 1 or (owners and any(is_module for _, is_module in units.values())):
        return (
            f"the pair's parameters live in different modules ({sorted(owners)}); tensor parallelism needs the "
            "3-D expert weights of one pair in one module"
        )
    return ""


def _columns_feeding(graph: nx.DiGraph, row: str, members: Set[str], wide: Set[str] = frozenset()):
    """Parameterised matmuls reached walking back from ``row``; whether attention lies between.
    Norms over as many features as the row reads (the residual stream a block's norm normalises)
    end the walk; norms over fewer (one head's features) are part of the region, and so are the
    candidate whole-width norms ``wide`` (modules, ``tp_wide_norms.projection_norms``)."""
    columns: List[str] = []
    stops: List[str] = []
    through_attention = False
    seen: Set[str] = set()
    d = graph.nodes[row]
    dims, shape = d.get("weight_dims") or [None, None], d.get("weight_shape") or []
    width = shape[dims[1]] if dims[1] is not None and shape else None  # features the row reads
    stack = [p for p in graph.predecessors(row) if is_float(graph.nodes[p])]
    while stack:
        node = stack.pop()
        if node in seen or node not in members:
            continue
        seen.add(node)
        data = graph.nodes[node]
        if data.get("weight"):
            columns.append(node)
            continue
        op = data.get("op", "")
        if data.get("module", "") in wide:
            pass  # a whole-width norm: tp_flow decides whether its statistic can be gathered
        elif (op in NORM_OPS and _last_dim(data) == width) or _normalises(graph, node, width, wide):
            stops.append(node)
            continue
        if op in ATTENTION_OPS or (op in MATMUL_OPS and not data.get("weight")):
            through_attention = True
        stack.extend(p for p in graph.predecessors(node) if is_float(graph.nodes[p]))
    return columns, through_attention, stops


def _last_dim(data: dict) -> Optional[int]:
    shapes = data.get("in_shapes") or []
    return shapes[0][-1] if shapes and shapes[0] else None


def _normalises(
    graph: nx.DiGraph, node: str, width: Optional[int], wide: Set[str] = frozenset(), depth: int = 6
) -> bool:
    """True when a reduction over the residual stream's features (mean/var/norm) lies a few ops
    upstream of ``node`` with no matmul in between, as in a hand-written RMSNorm
    ``(x * rsqrt(mean(x^2) + eps)) * w``. Per-head norms (over a head's features) do not count."""

    def floats(n):
        return {p for p in graph.predecessors(n) if is_float(graph.nodes[p])}

    frontier = floats(node)
    for _ in range(depth):
        if any(
            graph.nodes[n].get("op") in _STATISTICS
            and _last_dim(graph.nodes[n]) == width
            and graph.nodes[n].get("module", "") not in wide
            for n in frontier
        ):
            return True
        frontier = {
            p
            for n in frontier
            if not graph.nodes[n].get("weight") and graph.nodes[n].get("op") not in ATTENTION_OPS | MATMUL_OPS
            for p in floats(n)
        }
    return False


def _reaches_topk(graph: nx.DiGraph, start: str, members: Set[str], depth: int = 4) -> bool:
    frontier = {start}
    for _ in range(depth):
        frontier = {s for n in frontier for s in graph.successors(n) if s in members}
        if any(graph.nodes[n].get("op") == "topk" for n in frontier):
            return True
    return False


def _dedupe(pairs: List[TPPair]) -> List[TPPair]:
    out: Dict[tuple, TPPair] = {}
    for p in pairs:
        out.setdefault((p.kind, tuple(p.column), p.row), p)
    return list(out.values())


def find_patterns(graph: nx.DiGraph, blocks: List[Block]) -> Dict[str, BlockPattern]:
    """One pattern per distinct layer signature (computed on its first block)."""
    patterns: Dict[str, BlockPattern] = {}
    for block in blocks:
        if block.kind == "block" and block.signature not in patterns:
            patterns[block.signature] = find_pattern(graph, block)
    return patterns
