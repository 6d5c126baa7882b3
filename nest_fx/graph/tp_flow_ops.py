"""The data and the per-op shape rules of :mod:`nest_fx.graph.tp_flow` (which follows what tensor
parallelism shards through one TP pair): the op names it knows, the :class:`Flow` it carries
from op to op, what it reports (:class:`PairLayout`), and :class:`ShapeRules`, how the sharded dim
moves through ops that rearrange dims (transpose, permute, complex views), select or split them,
join tensors, reduce or normalise.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Set, Tuple

from nest_fx.graph.opgraph import HeadInput

ELEMENTWISE = {
    "add",
    "add_",
    "sub",
    "sub_",
    "mul",
    "mul_",
    "div",
    "div_",
    "true_divide",
    "neg",
    "pow",
    "rsqrt",
    "sqrt",
    "exp",
    "log",
    "tanh",
    "sigmoid",
    "silu",
    "gelu",
    "relu",
    "softmax",
    "_softmax",
    "log_softmax",
    "dropout",
    "native_dropout",
    "to",
    "_to_copy",
    "type_as",
    "contiguous",
    "clone",
    "alias",
    "float",
    "half",
    "bfloat16",
    "detach",
    "where",
    "masked_fill",
    "masked_fill_",
    "clamp",
    "abs",
    "erf",
    "square",
    "reciprocal",
    "lift_fresh_copy",
    "expand",
    "broadcast_to",
    "expand_as",
    "identity",
    "newgeluactivation",
    "geluactivation",
    "iadd",
    "imul",
    "truediv",
    "floordiv",
    "scaled_dot_product_attention_mask",
}
ACTIVATION_MODULES = {
    "gelu",
    "relu",
    "silu",
    "tanh",
    "sigmoid",
    "dropout",
    "identity",
    "newgeluactivation",
    "geluactivation",
    "gelupytorchtanh",
    "siluactivation",
}
RESHAPES = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as", "reshape_as"}
REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "logsumexp", "norm"}
NORMS = {"layer_norm", "native_layer_norm", "rms_norm", "layernorm", "rmsnorm", "fused_rms_norm"}
SPLITS = {"split", "split_with_sizes", "chunk", "unsafe_split", "unbind", "tensor_split"}
SELECTS = {"select", "slice", "narrow"}
ATTENTION = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
}
BATCHED_MATMULS = {"bmm", "matmul", "baddbmm"}
IGNORED = {"_assert_tensor_metadata", "size", "sym_size", "dim"}
COMPLEX_VIEWS = {"view_as_complex", "view_as_real"}
# factories of a tensor of one value everywhere (T5's zero position bias of a cross-attention)
FILLS = {"zeros", "ones", "full", "new_zeros", "new_ones", "new_full"}
# ops that keep a flow's fused parts (they move or take the dims; any other op forgets them)
KEEP_FUSED = {
    "transpose",
    "swapaxes",
    "permute",
    "t",
    "numpy_T",
    "contiguous",
    "clone",
    "to",
    "_to_copy",
    "alias",
    "detach",
}


@dataclass(frozen=True)
class Flow:
    """Where a tensor carries the sharded units: ``count`` units along ``dim``, each ``inner``
    elements of that dim apart (dims merged inside it). Before the features are viewed as heads
    (``heads=False``) ``source`` is the feature range (column node, start, size) they came from."""

    dim: int
    count: int
    inner: int = 1
    heads: bool = False
    source: Optional[Tuple[str, int, int]] = None
    # features viewed as [.., P, H, hd] (timm's ``reshape(B, N, 3, H, hd)``): ``dim`` holds P (taken
    # for the heads until an op selects or unbinds along it); ``fused`` = (column, start, size,
    # the dim holding H, H): then each of the P parts is a projection of H heads, sharded by heads
    fused: Optional[Tuple[str, int, int, int, int]] = None
    # heads viewed straight from a column's features: (column, start, features per head); a
    # multi-query layout slices its query heads off them and picks the shared key/value heads
    view: Optional[Tuple[str, int, int]] = None

    @property
    def extent(self) -> int:
        return self.count * self.inner

    def same_split(self, other: "Flow") -> bool:
        """Sharded alike: same dim and extent; a rank's chunk of one is its chunk of the other
        (q heads against their GQA key/value groups included)."""
        return self.dim == other.dim and self.extent == other.extent


@dataclass
class PairLayout:
    """What :func:`follow_pair` found (see the module docstring)."""

    parts: Dict[str, List[Tuple[int, int, int]]] = field(default_factory=dict)  # column -> (start, size, unit)
    head_norms: Dict[str, int] = field(default_factory=dict)  # module FQN -> heads dim of its input
    head_tables: List[str] = field(default_factory=list)  # module FQNs
    head_params: Dict[str, int] = field(default_factory=dict)  # per-head parameter FQN -> its heads dim
    head_inputs: List[HeadInput] = field(default_factory=list)
    wide_norms: Dict[str, Tuple[str, int, int]] = field(default_factory=dict)  # module -> (column, start, size)
    wide_params: Dict[str, int] = field(default_factory=dict)  # their parameters -> the dim sharded
    whole: Dict[str, List[int]] = field(default_factory=dict)  # column -> indices of parts every rank keeps whole
    problem: str = ""


class _Stop(Exception):
    """The sharded dim cannot be followed through an op (the message says where and why)."""


def _norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _arg(d: dict, i: int, default=None):
    args = d.get("args") or []
    return args[i] if i < len(args) and args[i] is not None else default


def _float(d: dict) -> bool:
    return any(str(t).startswith(("float", "bfloat16", "half")) for t in d.get("out_dtypes") or [])


def _normalises_last(op: str) -> bool:
    return op.endswith("rmsnorm") or op.endswith("layernorm")


def _indexed_dims(d: dict, op: str, ndim: int):
    """(removed dims, {dim: (start, size)} of sliced dims) of a select/slice/getitem, or None for a
    tensor index. A strided slice is reported with start -1 (it cannot cut the sharded dim)."""
    out = d["out_shapes"][0]
    shape = d["in_shapes"][0]
    if op == "select":
        return {_norm_dim(_arg(d, 1, 0), ndim)}, {}
    if op in ("slice", "narrow"):
        dim = _norm_dim(_arg(d, 1, 0), ndim)
        step = _arg(d, 4, 1) if op == "slice" else 1
        if out[dim] == shape[dim]:
            return set(), {}
        if step != 1:
            return set(), {dim: (-1, out[dim])}
        start = _arg(d, 2, 0) or 0
        return set(), {dim: (start + shape[dim] if start < 0 else start, out[dim])}
    if op != "getitem":
        return None
    index = _arg(d, 1)
    items = list(index) if isinstance(index, tuple) else [index]
    if "..." in items:
        at = items.index("...")
        items = items[:at] + [("slice", None, None, None)] * (ndim - len(items) + 1) + items[at + 1 :]
    removed, sliced = set(), {}
    for dim, item in enumerate(items):
        if isinstance(item, int):
            removed.add(dim)
        elif isinstance(item, tuple) and item and item[0] == "slice":
            begin, stop, step = item[1], item[2], item[3]
            if (begin, stop, step) in ((None, None, None), (None, None, 1), (0, None, None)):
                continue
            if step not in (None, 1) or not isinstance(begin or 0, int) or not isinstance(stop or 0, int):
                sliced[dim] = (-1, -1)
                continue
            begin = (begin or 0) + (shape[dim] if (begin or 0) < 0 else 0)
            end = shape[dim] if stop is None else min(stop + (shape[dim] if stop < 0 else 0), shape[dim])
            sliced[dim] = (begin, end - begin)
        else:  # None (a new axis) or a tensor index
            return None
    return removed, sliced


class ShapeRules:
    """Per-op rules of the follower that only move, cut or check the sharded dim (mixed into
    ``tp_flow._Follower``, which provides ``g``, ``where``, ``single``, ``check_unsharded`` and
    ``head_norm``)."""

    def move_dims(self, node: str, op: str, ins: List[Optional[Flow]]) -> Flow:
        d = self.g.nodes[node]
        _, f = self.single(node, ins)
        shape, out = d["in_shapes"][0], d["out_shapes"][0]
        n = len(shape)
        if op in ("transpose", "swapaxes"):
            a, b = (_norm_dim(x, n) for x in (_arg(d, 1, 0), _arg(d, 2, 1)))
            dim = b if f.dim == a else (a if f.dim == b else f.dim)
        elif op == "permute":
            order = _arg(d, 1)
            order = list(order) if isinstance(order, (tuple, list)) else [a for a in d.get("args", [])[1:]]
            dim = [_norm_dim(x, n) for x in order].index(f.dim)
        elif op in ("t", "numpy_T"):
            dim = n - 1 - f.dim
        elif op == "unsqueeze":
            at = _norm_dim(_arg(d, 1, 0), n + 1)
            dim = f.dim + 1 if at <= f.dim else f.dim
        else:  # squeeze: drop size-1 dims
            kept = [i for i in range(n) if not (shape[i] == 1 and len(out) < n)]
            dim = kept.index(f.dim) if f.dim in kept else None
            if dim is None:
                raise _Stop(f"{self.where(node)} squeezes the sharded dim")
        if out[dim] != shape[f.dim]:
            raise _Stop(f"{self.where(node)} changes the sharded dim")
        fused = None
        if f.fused is not None and op in ("transpose", "swapaxes", "permute", "t", "numpy_T"):
            sub = f.fused[3]
            if op == "permute":
                moved = [_norm_dim(x, n) for x in order].index(sub)
            elif op in ("t", "numpy_T"):
                moved = n - 1 - sub
            else:
                moved = b if sub == a else (a if sub == b else sub)
            fused = f.fused[:3] + (moved, f.fused[4])
        return replace(f, dim=dim, fused=fused)

    def take_part(self, f: Flow, removed: Set[int]) -> Flow:
        """An op removes the dim of the P fused parts (``unbind(0)``, ``qkv[0]``): each part is a
        projection of H heads; the column's range becomes P parts of whole heads."""
        column, start, size, sub, heads = f.fused
        parts = f.count
        ranges = self.ranges[column]
        ranges.discard((start, size, size // parts))
        for k in range(parts):
            ranges.add((start + k * size // parts, size // parts, size // parts // heads))
        self.head_counts.add(heads)
        return Flow(dim=sub - sum(1 for r in removed if r < sub), count=heads, heads=True)

    def complex_view(self, node: str, op: str, ins: List[Optional[Flow]]) -> Flow:
        """Complex RoPE: ``view_as_complex`` folds the last dim (pairs of reals) into one complex
        number, ``view_as_real`` unfolds it; the sharded heads dim before it is untouched."""
        _, f = self.single(node, ins)
        ndim = len(self.g.nodes[node]["in_shapes"][0])
        if op == "view_as_complex" and f.dim >= ndim - 1:
            raise _Stop(f"{self.where(node)} folds the sharded dim into complex numbers")
        return f

    def select(self, node: str, op: str, ins: List[Optional[Flow]]) -> Flow:
        d = self.g.nodes[node]
        i, f = self.single(node, ins)
        shape, out = d["in_shapes"][i], d["out_shapes"][0]
        dims = _indexed_dims(d, op, len(shape))
        if dims is None:  # a tensor index: only the dims after the sharded one may change
            if len(out) == len(shape) and out[: f.dim + 1] == shape[: f.dim + 1]:
                self.check_unsharded(node, f, len(out), skip={j for j in range(len(ins)) if j != i})
                return f
            if (
                f.view is not None
                and len(out) == len(shape)
                and out[f.dim] == 1
                and f.inner == 1
                and out[: f.dim] == shape[: f.dim]
                and out[f.dim + 1 :] == shape[f.dim + 1 :]
            ):
                return self.shared_head(node, f)
            raise _Stop(f"{self.where(node)} indexes the sharded dim")
        removed, sliced = dims
        if f.dim in removed and f.fused is not None and f.fused[3] not in removed:
            return self.take_part(f, removed)
        if f.dim in removed:
            raise _Stop(f"{self.where(node)} selects along the sharded heads/features")
        if f.dim in sliced:
            start, size = sliced[f.dim]
            if f.heads and start == 0 and f.inner == 1 and f.view is not None and not removed:
                return self.query_heads(node, f, size)
            if f.heads and start >= 0 and f.inner == 1:
                raise _Stop(
                    f"{self.where(node)} slices the sharded heads: it takes {size} of the {f.count} heads a fused "
                    "projection is viewed as (as a multi-query layout does, e.g. Falcon's `qkv[..., :-2, :]`: "
                    "the query heads, then one key and one value head they all share); tensor parallelism "
                    "shards a fused projection by whole key/value groups, and this one has a single group "
                    "every rank would need (kept whole on every rank only when the query heads are sliced "
                    "off first and each shared head is taken by index, as Falcon's multi_query layout does; "
                    "Falcon's new_decoder_architecture with num_kv_heads divisible by tp runs)"
                )
            if f.heads or f.source is None or f.inner != 1 or start < 0:
                raise _Stop(f"{self.where(node)} slices the sharded heads")
            column, base, _ = f.source
            return Flow(
                dim=f.dim - sum(1 for r in removed if r < f.dim), count=size, source=(column, base + start, size)
            )
        return replace(f, dim=f.dim - sum(1 for r in removed if r < f.dim))

    def split(self, node: str, op: str, ins: List[Optional[Flow]]) -> List[Optional[Flow]]:
        d = self.g.nodes[node]
        _, f = self.single(node, ins)
        shape, outs = d["in_shapes"][0], d["out_shapes"]
        dim = _norm_dim(_arg(d, 2 if op != "unbind" else 1, d.get("kwargs", {}).get("dim", 0)), len(shape))
        if op == "unbind":
            if dim == f.dim and f.fused is not None:
                return [self.take_part(f, {dim}) for _ in outs]
            if dim == f.dim:
                raise _Stop(f"{self.where(node)} unbinds the sharded dim")
            return [replace(f, dim=f.dim - (1 if dim < f.dim else 0)) for _ in outs]
        if dim != f.dim:
            return [f for _ in outs]
        if f.heads or f.source is None or f.inner != 1:
            raise _Stop(f"{self.where(node)} splits the sharded heads")
        column, base, _ = f.source
        flows, start = [], 0
        for o in outs:
            flows.append(Flow(dim=f.dim, count=o[dim], source=(column, base + start, o[dim])))
            start += o[dim]
        return flows

    def concat(self, node: str, op: str, ins: List[Optional[Flow]]) -> Flow:
        d = self.g.nodes[node]
        if not all(ins):
            raise _Stop(f"{self.where(node)} joins sharded and unsharded tensors")
        _, f = self.single(node, ins)
        out = d["out_shapes"][0]
        dim = _norm_dim(_arg(d, 1, d.get("kwargs", {}).get("dim", 0)), len(out))
        if op == "stack":
            return replace(f, dim=f.dim + 1 if dim <= f.dim else f.dim)
        if dim == f.dim:
            raise _Stop(f"{self.where(node)} concatenates along the sharded dim")
        return f

    def reduce(self, node: str, ins: List[Optional[Flow]]) -> Flow:
        d = self.g.nodes[node]
        _, f = self.single(node, ins)
        shape, out = d["in_shapes"][0], d["out_shapes"][0]
        dims = _arg(d, 1, None)
        dims = list(range(len(shape))) if dims is None else ([dims] if isinstance(dims, int) else list(dims))
        dims = [_norm_dim(x, len(shape)) for x in dims]
        if f.dim in dims:
            what = "heads" if f.heads else "features"
            raise _Stop(
                f"{self.where(node)} reduces over all the sharded {what} (e.g. a norm over the whole "
                "projection); each rank would reduce over its shard alone"
            )
        if len(out) == len(shape):
            return f
        return replace(f, dim=f.dim - sum(1 for x in dims if x < f.dim))

    def norm(self, node: str, ins: List[Optional[Flow]]) -> Flow:
        d = self.g.nodes[node]
        _, f = self.single(node, ins)
        shape = d["in_shapes"][0]
        normalized = _arg(d, 1, None)
        count = len(normalized) if isinstance(normalized, (tuple, list)) else 1
        if f.dim >= len(shape) - count:
            raise _Stop(
                f"{self.where(node)} normalises over all the sharded features (a norm over the whole "
                "projection); each rank would normalise its shard alone"
            )
        if d.get("fx_op") == "call_module" and d.get("params"):
            self.head_norm(node, d["params"][0], f.dim)
        self.check_unsharded(node, f, len(d["out_shapes"][0]))
        return f
