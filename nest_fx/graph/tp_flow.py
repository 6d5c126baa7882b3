"""Follow what tensor parallelism shards through one TP pair, from its columns to its row.

A column's output features are cut into ``tp`` contiguous chunks; the row's input features are
cut the same way. In between, the block's own code reshapes those features into heads, splits
fused projections (q/k/v, gate/up), normalises per head and mixes in tensors from elsewhere
(ALiBi slopes, a position bias). Sharding is exact only if every op between the linears acts on
each chunk alone. This module checks that on the traced graph, op by op, by carrying a
:class:`Flow` (which dim holds the sharded units, how many, how far apart) from the columns
forward, and collects what the runtime must do besides sharding the linears:

* the *parts* of a fused column: the feature ranges its output is split into before each is
  viewed as heads (q, k, v) or used alone (gate, up). Each part is sharded on its own, so a
  rank keeps whole heads of every part (GQA included);
* per-head norms: a norm whose weight is applied to every head (Qwen3's ``q_norm``); its weight
  stays replicated and its gradient is summed over the TP ranks;
* per-head tables: an embedding with one column per head (T5's relative position bias);
* per-head inputs: tensors entering the region with a heads dim (ALiBi), sliced on entry;
* whole-width norms: a norm over a whole projection's features (OLMo2's ``q_norm``), its
  statistic all-reduced over the TP ranks and its weight sharded like the projection
  (:mod:`nest_fx.graph.tp_wide_norms`).

Anything it cannot follow (an op it does not know acting on the sharded dim, a norm over all
features of a projection that is not a whole-width norm module, a per-head tensor built inside
the region from the global head count) becomes the pair's ``problem``: the runtime then refuses
that TP degree instead of guessing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Set, Tuple

import networkx as nx

from nest_fx.graph.opgraph import Block, HeadInput
from nest_fx.graph.tp_flow_ops import (
    ACTIVATION_MODULES,
    ATTENTION,
    BATCHED_MATMULS,
    COMPLEX_VIEWS,
    ELEMENTWISE,
    IGNORED,
    KEEP_FUSED,
    NORMS,
    REDUCTIONS,
    RESHAPES,
    SELECTS,
    SPLITS,
    Flow,
    PairLayout,
    ShapeRules,
    _arg,
    _float,
    _normalises_last,
    _prod,
    _Stop,
)
from nest_fx.graph.tp_flow_attention import AttentionRules
from nest_fx.graph.tp_multi_query import MultiQueryRules
from nest_fx.graph.tp_wide_norms import WideNormRules


class _Follower(ShapeRules, WideNormRules, MultiQueryRules, AttentionRules):
    def __init__(
        self,
        graph: nx.DiGraph,
        block: Block,
        columns: List[str],
        row: str,
        region: str,
        units: Set[str],
        wide: Set[str] = frozenset(),
    ):
        self.g = graph
        self.wide = wide  # candidate whole-width norm modules (tp_wide_norms.projection_norms)
        self.units = units  # the pair's linear-like modules (absolute FQNs)
        self.block = block
        self.columns = columns
        self.row = row
        self.region = region  # module FQN of the region (absolute)
        self.flows: Dict[str, List[Optional[Flow]]] = {}
        self.layout = PairLayout()
        self.head_counts: Set[int] = set()
        self.ranges: Dict[str, Set[Tuple[int, int, int]]] = {c: set() for c in columns}

    # -- helpers ------------------------------------------------------------------------
    def where(self, node: str) -> str:
        d = self.g.nodes[node]
        return f"op {d.get('op')!r} in module {d.get('module') or '<root>'!r}"

    def inside(self, node: str) -> bool:
        module = self.g.nodes[node].get("module", "")
        return module == self.region or module.startswith(self.region + ".") if self.region else True

    def input_flows(self, node: str) -> List[Optional[Flow]]:
        d = self.g.nodes[node]
        seen: Dict[str, int] = {}
        out = []
        for name in d.get("inputs", []):
            k = seen.get(name, 0)
            seen[name] = k + 1
            flows = self.flows.get(name)
            out.append(flows[k] if flows is not None and k < len(flows) else None)
        return out

    def terminal(self, flow: Flow, unit: int, node: str) -> None:
        """The feature range of ``flow`` is used as one part (viewed as heads of ``unit``
        features, or used whole): record it against its column."""
        if flow.source is None:
            return
        column, start, size = flow.source
        if flow.inner != 1 or flow.count != size:
            raise _Stop(
                f"{self.where(node)} uses the features of {self.g.nodes[column].get('weight')} in a way "
                "tensor parallelism cannot follow"
            )
        self.ranges[column].add((start, size, unit))

    # -- the walk -----------------------------------------------------------------------
    def run(self) -> PairLayout:
        g, members = self.g, set(self.block.nodes)
        cols = set(self.columns)
        down = set().union(*(nx.descendants(g, c) for c in cols)) & members
        up = nx.ancestors(g, self.row) & members
        core = (down & up) | cols
        order = [n for n in self.block.nodes if n in core or (n in up and self.inside(n))]
        try:
            for node in order:
                self.visit(node, core)
            self.check_row()
            self.finish_parts(self.finish_multi_query())
            self.check_wide_norms()
            self.check_contained(core, members)
            self.check_head_params()
        except _Stop as stop:
            self.layout.problem = str(stop)
        return self.layout

    def check_contained(self, core: Set[str], members: Set[str]) -> None:
        """Sharded data must reach the row only: a use elsewhere (outside the pair, still
        feeding the block's output) would see one rank's shard."""
        exits = [n for n in members if any(s not in members for s in self.g.successors(n))]
        live = set(exits).union(*(nx.ancestors(self.g, n) for n in exits)) if exits else set()
        for node in core:
            for user in self.g.successors(node):
                if user not in core and user != self.row and (user not in members or user in live):
                    raise _Stop(
                        f"the sharded output of {self.where(node)} is also used by {self.where(user)}, "
                        "outside the pair's region"
                    )

    def check_head_params(self) -> None:
        """A per-head parameter is sharded only when every use of it in the block carries its heads
        to the pair (a use elsewhere would see one rank's heads), and only inside the forward of its
        own module (the runtime swaps in its shard there: ``apply.tp_styles.HeadParams``)."""
        for param in self.layout.head_params:
            owner = param.rpartition(".")[0]
            for node in self.block.nodes:
                d = self.g.nodes[node]
                if param not in (d.get("input_params") or []):
                    continue
                module = d.get("module", "")
                if not (module == owner or module.startswith(owner + ".")):
                    raise _Stop(
                        f"parameter {param} is read outside the forward of its module {owner!r} "
                        f"({self.where(node)}); tensor parallelism shards such a per-head table only "
                        "where its own module reads it"
                    )
                if not any(self.flows.get(node) or []):
                    raise _Stop(
                        f"parameter {param} has one entry per sharded head and is also used by "
                        f"{self.where(node)}, which does not carry its heads to the pair"
                    )

    def visit(self, node: str, core: Set[str]) -> None:
        d = self.g.nodes[node]
        op = d.get("op", "")
        n_out = len(d.get("out_shapes") or [])
        if node in self.columns:
            self.flows[node] = [self.column_flow(node)]
            return
        if op in IGNORED or n_out == 0:
            return
        ins = self.input_flows(node)
        if not any(ins):
            self.flows[node] = self.source_flows(node)
            return
        if node not in core and not self.inside(node):
            return
        self.flows[node] = self.propagate(node, op, ins)

    def column_flow(self, node: str) -> Flow:
        d = self.g.nodes[node]
        dims, shape = d.get("weight_dims") or [None, None], d.get("weight_shape") or []
        out = (d.get("out_shapes") or [[]])[0]
        if dims[0] is None or not shape or not out:
            raise _Stop(f"cannot tell which dim of {d.get('weight')} holds its output features ({self.where(node)})")
        features = shape[dims[0]]
        dim = len(out) - 1 if out[-1] == features else (len(out) - 2 if len(out) > 1 and out[-2] == features else None)
        if dim is None:
            raise _Stop(f"cannot find the output features of {d.get('weight')} in {self.where(node)}")
        return Flow(dim=dim, count=features, source=(node, 0, features))

    def source_flows(self, node: str) -> List[Optional[Flow]]:
        """An embedding inside the region with one output column per head is a per-head table; so
        is a 2-D parameter of [entries, heads] indexed by an integer tensor (Swin's
        ``relative_position_bias_table[relative_position_index]``)."""
        d = self.g.nodes[node]
        n_out = len(d.get("out_shapes") or [])
        params = [p for p in d.get("input_params", []) if p]
        if d.get("op") == "embedding" and params and self.inside(node):
            shape = d["in_shapes"][d["input_params"].index(params[0])]
            if len(shape) == 2 and shape[1] in self.head_counts:
                out = d["out_shapes"][0]
                self.layout.head_tables.append(d.get("module", ""))
                return [Flow(dim=len(out) - 1, count=shape[1], heads=True)]
        table = self.indexed_table(node)
        if table:
            out = d["out_shapes"][0]
            self.layout.head_params[table] = 1
            return [Flow(dim=len(out) - 1, count=out[-1], heads=True)]
        return [None] * n_out

    def indexed_table(self, node: str) -> str:
        """The parameter ``node`` looks up rows of when it is ``param[index]`` with ``param`` a
        [entries, heads] table of this pair's head count and ``index`` an integer tensor (the output
        keeps the heads as its last dim), else ""."""
        d = self.g.nodes[node]
        names, shapes, dtypes = d.get("input_params") or [], d.get("in_shapes") or [], d.get("in_dtypes") or []
        if (
            d.get("op") not in ("getitem", "index")
            or len(names) < 2
            or len(shapes) < 2
            or len(dtypes) < 2
            or not self.inside(node)
        ):
            return ""
        table, shape, out = names[0], shapes[0], (d.get("out_shapes") or [[]])[0]
        if (
            not table
            or names[1]
            or len(shape) != 2
            or shape[1] not in self.head_counts
            or not out
            or out[-1] != shape[1]
            or not str(dtypes[1]).startswith("int")
        ):
            return ""
        return table

    # -- per-op rules ---------------------------------------------------------------------
    def propagate(self, node: str, op: str, ins: List[Optional[Flow]]) -> List[Optional[Flow]]:
        flows = self.rule(node, op, ins)
        if op in KEEP_FUSED or op in RESHAPES:  # a reshape's flow is fused only when it made the view
            return flows
        return [replace(f, fused=None) if f is not None and f.fused else f for f in flows]

    def rule(self, node: str, op: str, ins: List[Optional[Flow]]) -> List[Optional[Flow]]:
        d = self.g.nodes[node]
        source = (d.get("inputs") or [None])[0]
        if op == "getitem" and isinstance(_arg(d, 1), int) and len(self.g.nodes[source].get("out_shapes") or []) > 1:
            k = _arg(d, 1)  # an item of a tuple (split, attention outputs); an index into a tensor is a select
            flows = [f for f in ins if f is not None]
            return [self.flows[d["inputs"][0]][k]] if d.get("inputs") and self.flows.get(d["inputs"][0]) else flows[:1]
        if op in REDUCTIONS or op in NORMS or _normalises_last(op):
            gathered = self.wide_statistic(node, op, ins)
            if gathered is not None:
                return gathered
        if op in ELEMENTWISE or (d.get("fx_op") == "call_module" and op in ACTIVATION_MODULES):
            return [self.elementwise(node, ins)]
        if op in RESHAPES:
            return [self.reshape(node, ins)]
        if op in ("transpose", "swapaxes", "permute", "t", "numpy_T", "unsqueeze", "squeeze"):
            return [self.move_dims(node, op, ins)]
        if op in COMPLEX_VIEWS:
            return [self.complex_view(node, op, ins)]
        if op in SELECTS or op in ("index", "getitem"):
            return [self.select(node, op, ins)]
        if op in SPLITS:
            return self.split(node, op, ins)
        if op in ("cat", "concat", "stack"):
            return [self.concat(node, op, ins)]
        if op in REDUCTIONS:
            return [self.reduce(node, ins)]
        if op in NORMS or _normalises_last(op):
            return [self.norm(node, ins)]
        if op in ATTENTION:
            return self.attention(node, ins)
        if op in BATCHED_MATMULS:
            return [self.batched_matmul(node, op, ins)]
        raise _Stop(f"tensor parallelism cannot follow the sharded heads/features through {self.where(node)}")

    def single(self, node: str, ins: List[Optional[Flow]]) -> Tuple[int, Flow]:
        sharded = [(i, f) for i, f in enumerate(ins) if f is not None]
        first = sharded[0]
        for _, f in sharded[1:]:
            if f != first[1]:
                raise _Stop(f"{self.where(node)} combines tensors sharded differently")
        return first

    def check_unsharded(self, node: str, flow_out: Flow, out_ndim: int, skip: Set[int] = frozenset()) -> None:
        """Inputs without a flow that broadcast against the sharded dim must be per-head inputs
        (sliced on entry to the region) or per-head parameters (not supported); parameters that
        meet the sharded data elsewhere make their module a per-head norm."""
        d = self.g.nodes[node]
        ins = self.input_flows(node)
        for i, (name, shape) in enumerate(zip(d.get("inputs", []), d.get("in_shapes", []))):
            if ins[i] is not None or i in skip:
                continue
            param = (d.get("input_params") or [None] * (i + 1))[i]
            if param and param.rpartition(".")[0] in self.units:
                continue  # a column's own bias: sharded with its weight
            at = flow_out.dim - (out_ndim - len(shape))
            carries = 0 <= at < len(shape) and shape[at] != 1
            if param:
                if self.wide_param(node, param, at, carries):
                    continue
                if carries:
                    raise _Stop(
                        f"parameter {param} has one entry per sharded head/feature ({self.where(node)}); "
                        "tensor parallelism does not shard such parameters yet"
                    )
                self.head_norm(node, param, flow_out.dim)
                continue
            if not carries or name not in self.g or not _float(self.g.nodes[name]):
                continue
            for source, source_shape, dim in self.per_head_sources(name, at):
                if source_shape[dim] % flow_out.extent:
                    raise _Stop(
                        f"{self.where(node)} broadcasts a tensor of shape {source_shape} against the sharded dim"
                    )
                found = HeadInput(shape=list(source_shape), dim=dim, count=flow_out.count, inner=flow_out.inner)
                if found not in self.layout.head_inputs:
                    self.layout.head_inputs.append(found)

    def external(self, node: str) -> bool:
        return node not in self.block.nodes or not self.inside(node)

    def per_head_sources(self, node: str, at: int) -> List[Tuple[str, List[int], int]]:
        """The region inputs that give ``node``'s dim ``at`` (a dim that meets the sharded heads)
        its size: ``node`` itself when it is a region input, else the inputs it is computed from by
        elementwise ops. A per-head dim created inside the region cannot be sliced: a problem,
        unless it is one value everywhere, built per rank from its head count (``local_fill``)."""
        d = self.g.nodes[node]
        shape = d["out_shapes"][0]
        if self.external(node):
            return [(node, shape, at)]
        if self.local_fill(node, at):
            return []  # built per rank from the localised head count: nothing to slice
        first = (d.get("in_shapes") or [[]])[0]
        if d.get("op") in SELECTS | {"getitem", "index"} and len(first) == len(shape) and first[at] == shape[at]:
            return self.per_head_sources(d["inputs"][0], at)  # a slice along other dims (MPT's ALiBi)
        if d.get("op") not in ELEMENTWISE:
            raise _Stop(
                f"{self.where(node)} builds a per-head tensor from the global head count inside the "
                "region; tensor parallelism cannot shard it"
            )
        found, local = [], False
        for name, in_shape in zip(d.get("inputs", []), d.get("in_shapes", [])):
            dim = at - (len(shape) - len(in_shape))
            if name in self.g and 0 <= dim < len(in_shape) and in_shape[dim] != 1 and _float(self.g.nodes[name]):
                local = local or self.local_fill(name, dim)
                found += self.per_head_sources(name, dim)
        if not found and not local:
            raise _Stop(
                f"{self.where(node)} builds a per-head tensor from the global head count inside the "
                "region; tensor parallelism cannot shard it"
            )
        return found

    def head_norm(self, node: str, param: str, dim: int) -> None:
        module = param.rpartition(".")[0]
        if module == self.region or not module:
            raise _Stop(
                f"parameter {param} is applied to the sharded data by the region module itself "
                f"({self.where(node)}); tensor parallelism needs it in its own module (e.g. a norm)"
            )
        self.layout.head_norms[module] = dim

    def elementwise(self, node: str, ins: List[Optional[Flow]]) -> Flow:
        d = self.g.nodes[node]
        out = d["out_shapes"][0]
        aligned: List[Flow] = []
        for f, shape in zip(ins, d.get("in_shapes", [])):
            if f is None:
                continue
            dim = f.dim + len(out) - len(shape)
            if out[dim] != shape[f.dim]:
                raise _Stop(f"{self.where(node)} changes the size of the sharded dim")
            aligned.append(replace(f, dim=dim))
        first = aligned[0]
        for f in aligned[1:]:
            if not f.same_split(first):
                raise _Stop(f"{self.where(node)} combines tensors sharded differently")
        if len({f.source for f in aligned}) > 1:
            for f in aligned:  # gate * up: each range is a part of its own
                self.terminal(f, 1, node)
            first = replace(first, source=None)
        self.check_unsharded(node, first, len(out))
        return first

    def reshape(self, node: str, ins: List[Optional[Flow]]) -> Flow:
        d = self.g.nodes[node]
        _, f = self.single(node, ins)
        shape, out = d["in_shapes"][0], d["out_shapes"][0]
        stride = f.inner * _prod(shape[f.dim + 1 :])
        extent = f.count * stride
        suffix = 1
        for dim in range(len(out) - 1, -1, -1):
            outer = suffix * out[dim]
            if suffix <= stride and stride % suffix == 0 and extent <= outer and outer % extent == 0:
                return replace(f, dim=dim, inner=stride // suffix, fused=None)
            suffix = outer
        if f.heads or f.inner != 1:
            raise _Stop(f"{self.where(node)} reshapes across the sharded heads")
        return self.head_view(node, f, out, stride)

    def head_view(self, node: str, f: Flow, out: List[int], stride: int) -> Flow:
        """Features [.., F] viewed as [.., heads, (groups,) head_dim]: the outermost new dim holds
        the heads (or the key/value groups of a grouped layout), sharded contiguously."""
        suffix, dims = 1, []
        for dim in range(len(out) - 1, -1, -1):
            if suffix * out[dim] > stride * f.count:
                break
            suffix *= out[dim]
            if suffix > stride:
                dims.append(dim)
        if not dims or suffix != stride * f.count:
            raise _Stop(f"{self.where(node)} reshapes the sharded features in a way tensor parallelism cannot follow")
        heads_dim = dims[-1]
        count = out[heads_dim]
        self.terminal(f, f.count // count, node)
        self.head_counts.add(count)
        fused = None
        if len(dims) == 3 and count in (2, 3) and f.source is not None and stride == 1:
            fused = f.source + (dims[-2], out[dims[-2]])  # [.., P, H, hd]: maybe P fused parts (kv, qkv)
        view = (f.source[0], f.source[1], f.count // count) if f.source is not None and stride == 1 else None
        return Flow(dim=heads_dim, count=count, heads=True, fused=fused, view=view)

    # -- the row and the parts ------------------------------------------------------------
    def check_row(self) -> None:
        d = self.g.nodes[self.row]
        flows = [(i, f) for i, f in enumerate(self.input_flows(self.row)) if f is not None]
        if len(flows) != 1:
            raise _Stop(f"the input of {d.get('weight')} is not one sharded tensor ({self.where(self.row)})")
        i, f = flows[0]
        shape = d["in_shapes"][i]
        dims, wshape = d.get("weight_dims") or [None, None], d.get("weight_shape") or []
        if dims[1] is None or not wshape:
            raise _Stop(f"cannot tell which dim of {d.get('weight')} holds its input features")
        features = wshape[dims[1]]
        contracted = len(shape) - 1 if shape[-1] == features else len(shape) - 2
        if f.dim != contracted or f.extent != features:
            raise _Stop(
                f"{d.get('weight')} does not take the sharded features as its input features ({self.where(self.row)})"
            )
        if not f.heads:
            self.terminal(f, 1, self.row)

    def finish_parts(self, whole: Dict[str, set]) -> None:
        for column, ranges in self.ranges.items():
            d = self.g.nodes[column]
            features = self.column_flow(column).count
            ordered = sorted(ranges)
            pos, parts = 0, []
            for start, size, unit in ordered:
                if start != pos:
                    raise _Stop(
                        f"the output features of {d.get('weight')} are used in overlapping or missing "
                        "ranges; tensor parallelism cannot tell how to shard them"
                    )
                parts.append((start, size, unit))
                pos = start + size
            if pos != features:
                raise _Stop(
                    f"only {pos} of the {features} output features of {d.get('weight')} reach the row as whole parts"
                )
            self.layout.parts[column] = parts
            if column in whole:  # multi-query: the shared key/value heads (graph.tp_multi_query)
                self.layout.whole[column] = [i for i, (start, _, _) in enumerate(parts) if start in whole[column]]


def follow_pair(
    graph: nx.DiGraph,
    block: Block,
    columns: List[str],
    row: str,
    region: str,
    units: Set[str] = frozenset(),
    wide: Set[str] = frozenset(),
) -> PairLayout:
    """Follow the sharded features of ``columns`` (node names) to ``row`` (node name) inside the
    region module ``region`` (an absolute module FQN); ``units``: the pair's linear-like modules,
    whose own parameters are sharded with them; ``wide``: the block's candidate whole-width norm
    modules. See the module docstring."""
    return _Follower(graph, block, columns, row, region, set(units), set(wide)).run()
