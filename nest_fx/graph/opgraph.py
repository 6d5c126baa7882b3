"""OpGraph: the operator graph the rest of nest-fx consumes.

A ``networkx.DiGraph`` whose nodes are fx node names with these attributes (SI units):

    op            op kind: "linear", "scaled_dot_product_attention", "add", "mm", ...
    target        the fx target as a string
    module        fully-qualified name of the innermost module the op ran in ("" = root)
    in_shapes     list of input tensor shapes;  in_dtypes: list of dtype names
    out_shapes    list of output tensor shapes; out_dtypes: list of dtype names
    flops         forward FLOPs (torch.utils.flop_counter)
    param_bytes   bytes of parameters first used by this node
    params        FQNs of those parameters
    weight        FQN of the weight when the node is a parameterised matmul (linear-like)
    out_bytes     bytes of the outputs
    saved_bytes   bytes this node saved for backward that no earlier node saved (activations
                  only; parameters are excluded)
    block         index into ``OpGraph.blocks``

Edges follow data flow (producer -> consumer).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional

import networkx as nx

SUMMARY_FORMAT = "nest-fx-opgraph/1"


@dataclass
class Block:
    """A contiguous group of nodes: the head, one repeated layer, or the tail."""

    index: int
    name: str  # "head", "layers.0", ..., "tail"
    kind: str  # "head" | "block" | "tail"
    nodes: List[str] = field(default_factory=list)
    signature: str = ""  # equal signatures = identical blocks (cost one, reuse)
    flops: float = 0.0
    param_bytes: float = 0.0
    num_params: int = 0
    saved_bytes: float = 0.0
    out_bytes: float = 0.0  # bytes leaving this block for later blocks (stage boundary)
    is_moe: bool = False
    # A group of consecutive children of the layer container (a repeated unit of a flat
    # nn.Sequential, e.g. Linear-GELU): their FQNs. Empty when the block is the one module ``name``.
    members: List[str] = field(default_factory=list)

    def _group(self):
        prefix, _, first = self.members[0].rpartition(".")
        return prefix, int(first)

    def rel(self, fqn: str) -> str:
        """``fqn`` relative to this block: below the layer module (``attn.q_proj``), or for a group
        the child index counted from the group's first child (``1.weight``: its second child)."""
        if self.kind != "block":
            return fqn
        if self.members:
            prefix, start = self._group()
            rest = fqn[len(prefix) + 1 :] if prefix and fqn.startswith(prefix + ".") else ("" if fqn == prefix else fqn)
            head, dot, tail = rest.partition(".")
            return f"{int(head) - start}{dot}{tail}" if head.isdigit() else fqn
        if fqn.startswith(self.name + "."):
            return fqn[len(self.name) + 1 :]
        return "" if fqn == self.name else fqn

    def fqn(self, rel: str) -> str:
        """The module path of ``rel`` (as :meth:`rel` gives it) in the model."""
        if self.kind != "block":
            return rel
        if self.members:
            prefix, start = self._group()
            if not rel:
                return prefix
            head, dot, tail = rel.partition(".")
            return f"{prefix + '.' if prefix else ''}{start + int(head)}{dot}{tail}"
        return f"{self.name}.{rel}" if rel else self.name

    @property
    def modules(self) -> List[str]:
        """The modules this block consists of: its members, or its own module for a layer."""
        return list(self.members) or [self.name]


@dataclass
class TPParam:
    """A parameter tensor parallelism shards along ``dim``. ``parts`` (sizes along ``dim``) is set
    when the parameter fuses several projections there (q/k/v, gate/up): each part is cut into
    ``tp`` contiguous chunks on its own, so a rank keeps whole heads of each (docs/runtime.md)."""

    name: str  # relative to the block
    dim: int
    parts: List[int] = field(default_factory=list)
    units: List[int] = field(default_factory=list)  # per part: features per head (1 for an MLP): tp divides size/unit
    # indices of parts every rank keeps whole (a multi-query projection's shared key/value heads,
    # graph/tp_multi_query.py): not divided by tp, their gradient summed over the TP group
    whole: List[int] = field(default_factory=list)

    def whole_size(self) -> int:
        """Entries along ``dim`` every rank keeps whole (0 when the parameter is sharded evenly)."""
        return sum(self.parts[i] for i in self.whole)


@dataclass
class HeadInput:
    """A tensor with one entry per attention head that the region receives as an input (ALiBi
    slopes, a position bias computed by an earlier layer): each rank slices its heads on entry.
    ``dim`` holds ``outer x count x inner`` elements with the heads as the middle factor."""

    shape: List[int]  # as traced (dims of size 1 stay 1)
    dim: int
    count: int
    inner: int = 1


@dataclass
class TPPair:
    """Linears that tensor parallelism shards together: columns then one row linear.

    ``kind`` is "attention", "mlp" or "expert"; FQNs are relative to the block module, so one
    pair describes every identical block. ``column``/``row`` name modules (a linear, a HF
    ``Conv1D``, any module whose weight enters a matmul) or, for experts stored as 3-D tensors, the
    parameters themselves. The remaining fields say how the runtime shards the pair exactly:
    ``params`` (every sharded parameter), ``head_norms`` (norms applied per head inside the region,
    module -> the heads dim of their input; weights stay replicated), ``head_tables`` (embeddings
    with one column per head, sharded with the heads), ``head_inputs`` (see :class:`HeadInput`);
    ``problem`` is why the pair cannot be sharded exactly ("" when it can). ``leaf``: the module
    (relative to the block) whose one traced call holds the whole pair (``nn.MultiheadAttention``:
    ``graph.tp_mha``); the runtime replaces its forward by a head-sharded one ("" for other pairs).
    ``input_module``: the module (relative to the block; the region, else the columns' own common
    module) whose input every column module reads and nothing else inside it reads
    (``graph.tp_inputs``), so the runtime prepares that input once for all the columns (one
    backward all-reduce, Megatron's f); "" when there is none.
    """

    kind: str
    column: List[str]
    row: str
    params: List[TPParam] = field(default_factory=list)
    head_norms: Dict[str, int] = field(default_factory=dict)
    head_tables: List[str] = field(default_factory=list)
    head_inputs: List[HeadInput] = field(default_factory=list)
    wide_norms: List[str] = field(default_factory=list)  # whole-width norms (graph.tp_wide_norms); params in ``params``
    problem: str = ""
    leaf: str = ""
    input_module: str = ""


@dataclass
class BlockPattern:
    """Tensor-parallel structure shared by all blocks of one signature. ``tp_problem``: why
    tensor parallelism cannot shard this block exactly, beyond its pairs' own problems ("" = none)."""

    signature: str
    tp_pairs: List[TPPair] = field(default_factory=list)
    routers: List[str] = field(default_factory=list)
    tp_problem: str = ""


class OpGraph:
    """Operator graph plus blocks and tensor-parallel patterns (see module docstring)."""

    def __init__(
        self,
        graph: nx.DiGraph,
        *,
        model_name: str = "",
        method: str = "",
        input_shapes: Optional[List[list]] = None,
        block_container: str = "",
    ):
        self.graph = graph
        self.model_name = model_name
        self.method = method
        self.input_shapes = input_shapes or []
        self.block_container = block_container
        self.blocks: List[Block] = []
        self.patterns: Dict[str, BlockPattern] = {}
        self.module = None  # the captured torch.fx.GraphModule, when traced in this process
        self.input_names: List[str] = []  # the model's inputs given to the trace (forward argument names)
        self.expert_modules: Optional[List[str]] = None  # FQNs holding expert weights (None: not recorded)
        # attention modules TP leaves whole on every rank -> why (graph.tp_mha; None: not recorded)
        self.replicated_attention: Optional[Dict[str, str]] = None

    # -- access ---------------------------------------------------------------------------
    def nodes(self, block: Optional[int] = None) -> Iterable[dict]:
        """Node attribute dicts in topological order, optionally of one block."""
        names = self.blocks[block].nodes if block is not None else list(self.graph.nodes)
        for name in names:
            yield dict(self.graph.nodes[name], name=name)

    def __len__(self) -> int:
        return self.graph.number_of_nodes()

    @property
    def layer_blocks(self) -> List[Block]:
        return [b for b in self.blocks if b.kind == "block"]

    def total(self, key: str) -> float:
        return float(sum(d.get(key, 0) for _, d in self.graph.nodes(data=True)))

    @property
    def total_flops(self) -> float:
        return self.total("flops")

    @property
    def total_param_bytes(self) -> float:
        return self.total("param_bytes")

    @property
    def num_params(self) -> int:
        return int(sum(b.num_params for b in self.blocks))

    def pattern_of(self, block: Block) -> BlockPattern:
        return self.patterns.get(block.signature, BlockPattern(block.signature))

    def distinct_blocks(self) -> Dict[str, List[int]]:
        """Signature -> indices of the layer blocks that share it."""
        out: Dict[str, List[int]] = {}
        for b in self.layer_blocks:
            out.setdefault(b.signature, []).append(b.index)
        return out

    # -- export ---------------------------------------------------------------------------
    def summary(self) -> dict:
        """JSON-ready summary: totals, blocks (without node lists) and TP patterns."""
        blocks = []
        for b in self.blocks:
            d = asdict(b)
            d["num_nodes"] = len(d.pop("nodes"))
            blocks.append(d)
        return {
            "format": SUMMARY_FORMAT,
            "model": self.model_name,
            "method": self.method,
            "input_shapes": self.input_shapes,
            "block_container": self.block_container,
            "num_nodes": len(self),
            "totals": {
                "flops": self.total_flops,
                "param_bytes": self.total_param_bytes,
                "num_params": self.num_params,
                "saved_bytes": self.total("saved_bytes"),
            },
            "blocks": blocks,
            "patterns": {sig: asdict(p) for sig, p in self.patterns.items()},
        }
