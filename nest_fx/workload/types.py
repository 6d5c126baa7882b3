"""Workload: the chain of layers the solver consumes, with per-variant costs.

A workload is a list of layers (head, repeated blocks, tail). For a *variant* (:class:`Variant`:
tensor-parallel degree ``tp``, expert-parallel degree ``ep``, ``microbatch_size`` (sequences),
``sequence_parallel``, context-parallel degree ``cp`` and ``loss_parallel``) each layer has
a :class:`LayerCost`: forward/backward seconds on one device, parameter count and bytes held per
device, saved-activation bytes and recompute seconds per microbatch for each recompute policy
(``nest_fx.graph.recompute_policies.LAYER_POLICIES``), the bytes it hands to the next layer (a
pipeline boundary) and the collectives it issues inside itself. ``Workload.for_runtime`` gives
the same chain costed with ``torch.compile`` and/or Float8 linears.

Costs come from a *source*:
    TracedSource   an OpGraph plus a per-op timing model (the analytical roofline now, a
                   measured profile later); every variant is derived from the traced nodes
                   (how TP/EP shard each node follows from the TP pairs the tracer found).
    TableSource    a user-supplied per-layer table (``format: nest-fx-workload/1``, SI units;
                   see docs/workload_format.md).
Identical layers (same signature) share one cost entry, so costing is O(distinct layers); under
sequence parallelism the first block and the tail (the ends of the sequence-parallel span:
``sequence_edges``) add their slice's and gather's collectives to it.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Iterable, List, Optional, Tuple

from nest_fx.common.errors import NestFxError
from nest_fx.graph.recompute_policies import LAYER_POLICIES
from nest_fx.workload.kernels import kernel_backend
from nest_fx.workload.roofline import DEFAULT_ATTENTION_KERNEL
from nest_fx.workload.layer_classes import layer_costs
from nest_fx.workload.sequence_edges import GATHER, SLICE, edge_collectives, sequence_edge
from nest_fx.workload.variant import Variant, sized_variant

WORKLOAD_FORMAT = "nest-fx-workload/1"
DTYPE_WIDTH = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per element of the dtypes a workload is costed in
RECOMPUTE_MODES = ("none", "selective", "full")  # the policies every layer table has (defaults for the others)
COMM_GROUPS = ("tp", "ep", "cp")


class WorkloadError(NestFxError, ValueError):
    """A malformed workload file or an impossible variant; the message names the field."""


@dataclass(frozen=True)
class Comm:
    """A collective issued inside a layer per microbatch: ``count`` times ``nbytes`` over ``group``."""

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all
    group: str  # "tp" | "ep" | "cp"
    nbytes: float
    phase: str  # "fwd" | "bwd"
    count: int = 1
    # of ``count``, the block's last forward collective when no op of the block saves what it
    # feeds: activation checkpointing never re-runs it (torch's non-reentrant checkpoint stops
    # once the saved tensors are rebuilt): stage_terms.repeated_share
    unrecomputed: int = 0
    # an expert all-to-all's (dispatch, routing, bytes) for each setting (workload.expert_dispatch)
    dispatched: Tuple[Tuple[str, str, float], ...] = ()


@dataclass
class LayerCost:
    """Cost of one layer for one variant, per microbatch and per device (SI units)."""

    fwd_s: float
    bwd_s: float
    num_params: float  # parameters held per device
    param_bytes: float  # their bytes in the training dtype
    act_bytes: Dict[str, float]  # recompute policy (LAYER_POLICIES) -> saved bytes per microbatch
    recompute_s: Dict[str, float]  # recompute policy -> extra backward seconds per microbatch
    out_bytes: float  # activation bytes sent to the next layer per microbatch (full tensor)
    comms: List[Comm] = field(default_factory=list)
    expert_params: float = 0.0  # of num_params, those sharded over ep (reduced over dp/ep)
    block: bool = True  # a repeated block (its own FSDP unit); False for the head and tail (the stage root)
    bwd_scratch: float = 0.0  # bytes its backward allocates beyond its saved activations, per microbatch
    fp8_params: float = 0.0  # of num_params, those in Float8 linears (FSDP all-gathers them in fp8)
    tied_params: float = 0.0  # of num_params, those tied to another layer (the embedding an LM head shares)

    def collective_counts(self, group: str = "tp") -> Dict[str, int]:
        """{collective kind: how many} the layer issues over ``group`` per microbatch, forward and
        backward together: the count the cost model prices (checked against the runtime's)."""
        counts: Dict[str, int] = {}
        for c in self.comms:
            if c.group == group:
                counts[c.kind] = counts.get(c.kind, 0) + c.count
        return counts

    def to_dict(self) -> dict:
        """The cost as a workload table records it (``block`` comes from the layer's kind)."""
        d = asdict(self)
        d.pop("block")
        d["comms"] = [asdict(c) for c in self.comms]
        return d


@dataclass
class Layer:
    """One element of the chain."""

    name: str
    kind: str  # head | block | tail
    signature: str
    num_params: float  # unsharded
    flops_per_sample: float  # forward FLOPs per sequence, unsharded
    is_moe: bool = False


@dataclass
class ModelDims:
    """Shapes the solver needs to check divisibility and count model FLOPs."""

    seq_len: int  # tokens per sequence; the widths below are 0 when unknown (no constraint)
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0  # key/value heads (grouped-query attention)
    ffn_hidden: int = 0
    num_experts: int = 0
    vocab_size: int = 0
    dtype_bytes: int = 2

    def tp_problem(self, tp: int) -> str:
        """'' when ``tp`` divides heads, kv heads and FFN width (Megatron's constraint; 0 = unknown,
        no constraint), else which one it does not divide."""
        for n, what in (
            (self.heads, "attention heads"),
            (self.kv_heads, "key/value heads"),
            (self.ffn_hidden, "FFN width"),
        ):
            if n and n % tp:
                return f"tp={tp} does not divide the model's {n} {what}"
        return ""

    def cp_problem(self, cp: int) -> str:
        """'' when ``cp`` is 1 or ``2 cp`` divides the sequence (each context-parallel rank holds
        two of ``2 cp`` equal chunks: causal load balancing), else why not."""
        if cp == 1 or self.seq_len % (2 * cp) == 0:
            return ""
        return (
            f"cp={cp} does not divide the sequence: {self.seq_len} tokens are not a multiple of 2 x cp = "
            f"{2 * cp} (each context-parallel rank holds two of 2 x cp equal chunks)"
        )

    def ep_problem(self, ep: int) -> str:
        """'' when ``ep`` is 1 or divides the expert count, else why not."""
        if ep == 1 or (self.num_experts > 0 and self.num_experts % ep == 0):
            return ""
        if not self.num_experts:
            return f"ep={ep} but the model has no experts"
        return f"ep={ep} does not divide the model's {self.num_experts} experts"

    def tp_ok(self, tp: int) -> bool:
        return not self.tp_problem(tp)

    def ep_ok(self, ep: int) -> bool:
        return not self.ep_problem(ep)


class Workload:
    """Layer chain + a cost source; ``cost(i, variant)`` is cached per signature."""

    def __init__(self, model: str, layers: List[Layer], dims: ModelDims, source, *, provenance: str = ""):
        self.model = model
        self.layers = layers
        self.dims = dims
        self.source = source
        self.provenance = provenance
        self._cache: Dict[Tuple, LayerCost] = {}
        self._edges: Optional[List[Tuple[str, ...]]] = None  # sequence_edge of each layer
        self._by_index: Dict[Tuple[int, Variant], LayerCost] = {}  # cost(index, Variant): what it returned
        self._problems: Dict[Tuple[int, int, bool], str] = {}
        self._prefix: Dict[Tuple, Tuple[List[LayerCost], List[List[int]], List[int]]] = {}
        self._policies: Dict[Tuple, Tuple[str, ...]] = {}
        self._runtime: Dict[Tuple[str, bool, Optional[str], str, str, str, str], "Workload"] = {}
        self.compile = False  # costed with torch.compile on every block (for_runtime)
        self.kernels = "eager"  # the kernel backend it is costed with (for_runtime; nest_fx.workload.kernels)
        self.attention_kernel = ""  # SDPA's attention kernel it is costed with ('' = the default; for_runtime)
        self.norm_kernel = ""  # how its RMSNorms run: '' = F.rms_norm (fused), "model" = the model's code (for_runtime)
        self.loss_kernel = ""  # '' = as given (in place under loss parallel), eager, compile (for_runtime)
        self.cp_mode = ""  # '' = attention under CP as traced (all-gather), "ring": chunked (for_runtime)
        self.float8 = False  # costed with Float8 linears (for_runtime)
        self.dtype: Optional[str] = None  # the dtype its costs are for ("bf16", "fp32"); None: unknown (a layer table)
        self.base: Optional["Workload"] = None  # the workload this one was derived from (for_runtime)

    def __len__(self) -> int:
        return len(self.layers)

    def cost(self, index: int, *variant, **names) -> LayerCost:
        """The cost of layer ``index`` in a :class:`Variant` (given as one, or as its values:
        :meth:`Variant.of`): :meth:`own_cost`, plus under sequence parallelism the collectives at
        the ends of the sequence-parallel span that this layer's stage runs (``sequence_edges``:
        the first block's slice, the gather before the tail); cached per distinct layer and edge."""
        if len(variant) == 1 and not names and type(variant[0]) is Variant:  # the solver's form: asked most
            hit = self._by_index.get((index, variant[0]))
            if hit is not None:
                return hit
        v = Variant.of(*variant, **names)
        out = self._by_index[(index, v)] = self._edged_cost(index, v)
        return out

    def _edged_cost(self, index: int, v: Variant) -> LayerCost:
        """:meth:`cost` of a :class:`Variant`, not memoised per index."""
        own = self.own_cost(index, v)
        if not (v.sequence_parallel and v.tp > 1):
            return own
        if self._edges is None:  # by position in the chain, once
            kinds, params = [x.kind for x in self.layers], [x.num_params for x in self.layers]
            self._edges = [sequence_edge(kinds, params, k) for k in range(len(self.layers))]
        edges = self._edges[index]
        if not edges:
            return own
        entering = self.own_cost(index - 1, v).out_bytes / v.cp if SLICE in edges else 0.0
        before = index - 1 if self.layers[index].kind != "block" else index
        gathered = self.own_cost(before, v).out_bytes / v.cp if GATHER in edges else 0.0
        key = (id(own), edges, entering, gathered)  # own is held by the cache: its id stays its own
        if key not in self._cache:
            added = [
                Comm(kind, "tp", nbytes, phase, 1, unrecomputed)
                for kind, phase, nbytes, unrecomputed in edge_collectives(edges, entering, gathered, own.block)
            ]
            self._cache[key] = replace(own, comms=[*own.comms, *added])
        return self._cache[key]

    def own_cost(self, index: int, *variant, **names) -> LayerCost:
        """The cost of layer ``index`` as its source gives it, shared by every layer of its
        signature (what a layer table holds); cached per distinct layer. Loss parallelism changes
        only the tail (where the loss is), expert parallelism only MoE layers."""
        v = Variant.of(*variant, **names)
        layer = self.layers[index]
        ep, lp = (v.ep if layer.is_moe else 1), (v.loss_parallel and layer.kind == "tail")
        key = (layer.signature, layer.kind, v.tp, ep, v.microbatch_size, v.sequence_parallel, v.cp, lp)
        if key not in self._cache:
            c = self.source.cost(layer, v.tp, ep, v.microbatch_size, v.sequence_parallel, cp=v.cp, lp=lp)
            self._cache[key] = c if c.block == (layer.kind == "block") else replace(c, block=layer.kind == "block")
        return self._cache[key]

    def variant_problem(self, *variant, **names) -> str:
        """'' when every layer has a cost for this variant (its microbatch size aside), else why
        not: the model's shapes do not divide by ``tp``/``ep``/``cp`` (:class:`ModelDims`), or
        the cost source lacks it (a layer table lists only some variants; a traced source derives
        every one it can run). Positional values: tp, ep, sequence_parallel, cp, loss_parallel."""
        v = sized_variant(variant, names)
        key = (v.tp, v.ep, v.sequence_parallel, v.cp, v.loss_parallel)
        if key not in self._problems:
            self._problems[key] = self._find_problem(*key)
        return self._problems[key]

    def _find_problem(self, tp: int, ep: int, sp: bool, cp: int, lp: bool) -> str:
        problem = self.dims.tp_problem(tp) or self.dims.ep_problem(ep) or self.dims.cp_problem(cp)
        if problem:
            return problem
        if cp > 1 and hasattr(self.source, "cp_problem"):
            problem = self.source.cp_problem(cp)
            if problem:
                return problem
        if lp and tp > 1 and hasattr(self.source, "loss_parallel_problem"):
            problem = self.source.loss_parallel_problem()
            if problem:
                return problem
        missing = getattr(self.source, "missing", None)
        if missing is not None:
            for i in self.distinct():
                layer = self.layers[i]
                problem = missing(layer, tp, ep if layer.is_moe else 1, sp, cp=cp, lp=lp and layer.kind == "tail")
                if problem:
                    return problem
        return ""

    def supports(self, *variant, **names) -> bool:
        """Whether every layer has a cost for this variant (see :meth:`variant_problem`); the
        planner searches only these."""
        return not self.variant_problem(*variant, **names)

    def recompute_policies(self, *variant, **names) -> Tuple[str, ...]:
        """The per-layer recompute policies (``LAYER_POLICIES``) every layer of a variant has a
        cost for: all of them for a traced model; a layer table may give only some."""
        key = Variant.of(*variant, **names)
        if key not in self._policies:
            have = set(LAYER_POLICIES)
            for c in self.variant_costs(key)[0]:
                have &= set(c.act_bytes)
            self._policies[key] = tuple(p for p in LAYER_POLICIES if p in have)
        return self._policies[key]

    def for_runtime(
        self,
        compile: bool = False,
        float8: bool = False,
        dtype: Optional[str] = None,
        kernels: str = "",
        attention_kernel: str = "",
        norm_kernel: str = "",
        loss_kernel: str = "",
        cp_mode: str = "",
    ) -> "Workload":
        """This chain costed as the runtime runs it: with the kernel backend ``kernels`` (eager,
        compile, fused; '' = compile when ``compile`` is set, else eager:
        ``nest_fx.workload.kernels``), SDPA's fused attention kernel ``attention_kernel`` (cudnn,
        flash; '' = the default: ``roofline.SDPA_ATTENTION``), the model's RMSNorms as PyTorch's fused
        ``F.rms_norm`` (``norm_kernel`` '' or fused), as its own code (``model``) or keeping their
        output for backward (``memory-efficient``; ``workload/fused_norms.py``), the loss on full
        logits as given or torch.compile'd (``loss_kernel`` '' or eager, compile), Float8 linears
        (``docs/cost_model.md``), context parallelism's attention as ``cp_mode`` runs it (``ring``:
        chunk-pair calls at their chunk's rate, ``attention_share.fused_call_keys``; '' or allgather: as traced), and computing in
        ``dtype`` ("fp32", "bf16": the device's rate for it, activations of its width; None or a
        workload of unknown dtype: as built); ``self`` when nothing changes. WorkloadError when
        the cost source cannot derive them (a layer table holds what was measured; a profile, the
        dtype it was measured in)."""
        dtype = dtype if dtype and self.dtype else self.dtype
        backend = kernel_backend(kernels, compile).name
        attention = "" if attention_kernel == DEFAULT_ATTENTION_KERNEL else attention_kernel
        norm = "" if norm_kernel in ("", "fused") else norm_kernel
        loss = loss_kernel  # eager is '' without loss parallelism; under it, the op-by-op vocabulary-parallel loss
        ring = "ring" if cp_mode == "ring" else ""
        now = (
            self.kernels,
            self.float8,
            self.dtype,
            self.attention_kernel,
            self.norm_kernel,
            self.loss_kernel,
            self.cp_mode,
        )
        if (backend, float8, dtype, attention, norm, loss, ring) == now:
            return self
        if self.base is not None:
            return self.base.for_runtime(False, float8, dtype, backend, attention, norm, loss, ring)
        key = (backend, float8, dtype, attention, norm, loss, ring)
        if key not in self._runtime:
            derive = getattr(self.source, "for_runtime", None)
            settings = (
                ("kernels=" + backend, backend != "eager"),
                ("float8", float8),
                ("attention_kernel=" + attention, bool(attention)),
                ("norm_kernel=" + norm, bool(norm)),
                ("loss_kernel=" + loss, bool(loss) and loss != "eager"),
                ("cp_mode=ring", bool(ring)),
            )
            named = [n for n, on in settings if on]
            if derive is None and not named and dtype == self.dtype:
                return self  # a layer table with loss_kernel=eager: its loss as measured
            if derive is None:
                raise WorkloadError(
                    f"{self.model}: the layer table's costs are what was measured; nest-fx cannot "
                    f"derive them under {' and '.join(named)} (plan with --model, or without these "
                    "options)"
                )
            changes = [
                n
                for n, on in (
                    ({"compile": "torch.compile", "fused": "fused kernels"}.get(backend, ""), backend != "eager"),
                    ("Float8", float8),
                    (f"{attention} attention", bool(attention)),
                    (
                        "memory-efficient RMSNorms" if norm == "memory-efficient" else "the model's own RMSNorm code",
                        bool(norm),
                    ),
                    ({"compile": "the compiled loss", "eager": "the loss op by op"}.get(loss, ""), bool(loss)),
                    ("ring attention under CP", bool(ring)),
                )
                if on
            ]
            dims, kwargs = self.dims, {}
            if dtype != self.dtype:
                try:
                    kwargs = dict(
                        timing=self.source.timing.in_dtype(dtype),
                        byte_scale=DTYPE_WIDTH[dtype] / DTYPE_WIDTH[self.dtype],
                    )
                except (AttributeError, KeyError, ValueError) as exc:
                    raise WorkloadError(
                        f"{self.model}: cannot re-cost the workload from {self.dtype} in {dtype} ({exc})"
                    ) from None
                dims = replace(dims, dtype_bytes=DTYPE_WIDTH[dtype])
                changes.append(f"in {dtype}")
            kwargs.update(
                float8=float8,
                kernels=backend,
                attention_kernel=attention,
                norm_kernel=norm,
                loss_kernel=loss,
                cp_mode=ring,
            )
            w = Workload(
                self.model,
                self.layers,
                dims,
                derive(**kwargs),
                provenance=f"{self.provenance}; " + " + ".join(changes),
            )
            w.kernels, w.float8, w.dtype, w.base = backend, float8, dtype, self
            w.attention_kernel, w.norm_kernel, w.loss_kernel, w.cp_mode = attention, norm, loss, ring
            w.compile = backend == "compile"
            self._runtime[key] = w
        return self._runtime[key]

    def variant_costs(self, *variant, **names) -> Tuple[List[LayerCost], List[List[int]], List[int]]:
        """The distinct layer costs of a :class:`Variant` (in order of first appearance), per
        distinct cost the prefix counts (``counts[j][i]``: layers before i with cost j) and each
        layer's index into the distinct costs; computed once per variant."""
        key = Variant.of(*variant, **names)
        table = self._prefix.get(key)
        if table is None:
            ids: Dict[int, int] = {}
            costs: List[LayerCost] = []
            index: List[int] = []
            for c in layer_costs(self, key):  # self.cost(i, key) of every layer i
                k = ids.setdefault(id(c), len(costs))
                if k == len(costs):
                    costs.append(c)
                index.append(k)
            counts = [[0] * (len(self.layers) + 1) for _ in costs]
            for i, k in enumerate(index):
                for j, row in enumerate(counts):
                    row[i + 1] = row[i] + (1 if j == k else 0)
            table = self._prefix[key] = (costs, counts, index)
        return table

    def range_costs(self, start: int, end: int, *variant, **names) -> List[Tuple[LayerCost, int]]:
        """The distinct layer costs of layers [start, end) of a :class:`Variant` with how many
        layers share each.

        O(distinct layers) per call through per-variant prefix counts, so a pipeline stage of
        80 identical blocks costs as much to evaluate as a stage of one."""
        costs, counts, _ = self.variant_costs(*variant, **names)
        return [(c, row[end] - row[start]) for c, row in zip(costs, counts) if row[end] - row[start]]

    @property
    def flops_per_sample(self) -> float:
        """Forward FLOPs per sequence of the whole model (for model FLOP/s)."""
        return sum(layer.flops_per_sample for layer in self.layers)

    @property
    def num_params(self) -> float:
        return sum(layer.num_params for layer in self.layers)

    @property
    def is_moe(self) -> bool:
        return any(layer.is_moe for layer in self.layers)

    @property
    def fingerprint(self) -> str:
        """Hash of the layer chain (kinds and parameter counts) that a plan records and is checked
        against (``Plan.check_model``)."""
        return chain_fingerprint((layer.kind, layer.num_params) for layer in self.layers)

    def distinct(self) -> List[int]:
        """Index of the first layer of each distinct (kind, signature)."""
        seen, out = set(), []
        for i, layer in enumerate(self.layers):
            if (layer.kind, layer.signature) not in seen:
                seen.add((layer.kind, layer.signature))
                out.append(i)
        return out


def chain_fingerprint(layers: Iterable[Tuple[str, float]]) -> str:
    """Short hash of a layer chain given as (kind, parameter count) per layer: the same for a
    model whatever its batch, sequence length or dtype, different for another architecture with
    the same number of layers (other widths, vocabulary or expert count)."""
    text = ";".join(f"{kind}:{int(round(params))}" for kind, params in layers)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def dims_from_config(cfg, *, seq_len: int, dtype_bytes: int = 2) -> ModelDims:
    """ModelDims from a zoo ``TransformerConfig`` or a HuggingFace config (either's field names);
    fields the config lacks are 0, which means "no constraint"."""

    def get(*names: str) -> int:
        return next((int(getattr(cfg, n)) for n in names if getattr(cfg, n, None)), 0)

    return ModelDims(
        seq_len=seq_len,
        hidden=get("hidden", "hidden_size", "n_embd"),
        heads=get("heads", "num_attention_heads", "n_head"),
        kv_heads=get("kv_heads", "num_key_value_heads", "heads", "num_attention_heads", "n_head"),
        ffn_hidden=get("ffn_hidden", "intermediate_size", "n_inner"),
        num_experts=get("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
        vocab_size=get("padded_vocab", "vocab_size"),
        dtype_bytes=dtype_bytes,
    )
