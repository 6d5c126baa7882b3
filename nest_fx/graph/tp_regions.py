"""Where tensor parallelism cuts a block: the *regions* of its TP pairs, and what a region's
module needs to run on one rank's heads.

A TP pair (column linears feeding a row linear, found by ``tp_pairs``) runs sharded between
its linears; the module that holds the whole pair (the lowest common ancestor of its linears,
e.g. ``attn`` or ``mlp``) is the pair's region. The runtime shards by region and the profiler
shrinks a model to one TP rank's shapes by region, so both read them here, and both use
:func:`localise_head_counts` and :func:`slice_head_inputs` to make a region module compute on
``heads / tp`` heads.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from nest_fx.graph.opgraph import HeadInput
from nest_fx.graph.tp_mha import MHA_OP

# Attributes of an attention module (and of its config) that count heads or their features; a
# rank's copy of the module sees them divided by tp. split_size: GPT-2's split of its fused qkv;
# n_embd: nanoGPT's (``c_attn(x).split(self.n_embd, dim=2)``).
HEAD_COUNT_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "heads",
    "kv_heads",
    "n_head",
    "n_heads",
    "n_kv_heads",
    "num_kv_heads",
    "hidden_size",
    "split_size",
    "n_embd",
)
CONFIG_HEAD_ATTRS = (
    "num_attention_heads",
    "num_key_value_heads",
    "n_head",
    "num_heads",
    "n_heads",
    "num_kv_heads",
    "n_kv_heads",
)


def lowest_common_module(names: Sequence[str]) -> str:
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
        region = lowest_common_module(list(pair.column) + [pair.row])
        regions.setdefault(region, (pair.kind, []))[1].append(pair)
    if experts:
        names = [n for p in experts for n in (*p.column, p.row)] + list(pattern.routers or routers)
        region = lowest_common_module(names)
        # the common ancestor of experts.0.up and experts.1.up is "moe.experts"; the router lifts it
        regions.setdefault(region, ("expert", []))[1].extend(experts)
    return [(path, kind, pairs) for path, (kind, pairs) in regions.items()]


ATTENTION_CORES = {"scaled_dot_product_attention", MHA_OP, "multi_head_attention_forward"}


def unsharded_attention(graph) -> List[str]:
    """Module FQNs of attention calls in the layers that no TP region holds (an
    ``nn.MultiheadAttention`` call ``graph.tp_mha`` cannot shard: ``graph.replicated_attention``
    says why): under a TP plan they run whole on every TP rank while the pairs beside them (the
    MLP) are sharded. The cost model prices them so (it divides the regions' nodes only); the
    runtime reports them."""
    found: List[str] = []
    for block in graph.layer_blocks:
        pattern = graph.pattern_of(block)
        regions = [block.fqn(r) for r, kind, _ in block_regions(pattern) if kind != "expert"]
        leaves = {block.fqn(p.leaf) for p in pattern.tp_pairs if p.leaf}
        for node in block.nodes:
            d = graph.graph.nodes[node]
            module, op = d.get("module", ""), d.get("op")
            if op not in ATTENTION_CORES or module in found:
                continue
            if op == MHA_OP and d.get("fx_op") == "call_module":  # sharded only as a pair of its own
                held = module in leaves
            else:
                held = any(r == "" or module == r or module.startswith(r + ".") for r in regions)
            if not held:
                found.append(module)
    return found


def localise_head_counts(module: nn.Module, tp: int) -> None:
    """Make an attention region count ``heads / tp`` heads: on the region's module and every module
    inside it (DeBERTa keeps its head count on ``attention.self`` while the region is
    ``attention``), divide the head-count attributes by ``tp`` and give each its own copy of a HF
    ``config`` with the head counts divided (HF Phi-3 slices its fused qkv with
    ``config.num_attention_heads``)."""
    for sub in module.modules():
        _localise_own_head_counts(sub, tp)


def _localise_own_head_counts(module: nn.Module, tp: int) -> None:
    for attr in HEAD_COUNT_ATTRS:
        value = module.__dict__.get(attr)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % tp == 0:
            setattr(module, attr, value // tp)
    config = module.__dict__.get("config")
    if config is not None and any(isinstance(getattr(config, a, None), int) for a in CONFIG_HEAD_ATTRS):
        local = copy.copy(config)
        for attr in CONFIG_HEAD_ATTRS:
            value = getattr(config, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % tp == 0:
                setattr(local, attr, value // tp)
        module.config = local


def shrink_param(model: nn.Module, fqn: str, dim: int, tp: int, whole: int = 0) -> None:
    """Replace parameter ``fqn`` of ``model`` by one of rank-local size along ``dim`` (values do not
    matter: the profiler times it, the TP rehearsal runs it on fake tensors) and keep the owning
    module's size attributes in line with it; ``whole`` entries along ``dim`` stay on every rank
    (``TPParam.whole_size``); ValueError when ``tp`` does not divide the rest."""
    owner_name, _, leaf = fqn.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    old = owner.get_parameter(leaf)
    shape = list(old.shape)
    if (shape[dim] - whole) % tp:
        raise ValueError(f"{fqn}: {shape[dim] - whole} entries along dim {dim} are not divisible by tp={tp}")
    shape[dim] = (shape[dim] - whole) // tp + whole
    new = torch.empty(shape, dtype=old.dtype, device=old.device)
    if new.device.type != "meta":
        nn.init.normal_(new, std=0.02)
    owner.register_parameter(leaf, nn.Parameter(new, requires_grad=old.requires_grad))
    weight = getattr(owner, "weight", None)
    if leaf == "weight" and isinstance(owner, nn.Linear):
        owner.out_features, owner.in_features = weight.shape
    elif leaf == "weight" and isinstance(owner, nn.Embedding):
        owner.num_embeddings, owner.embedding_dim = weight.shape
    elif leaf == "weight" and isinstance(getattr(owner, "nf", None), int) and weight.dim() == 2:
        owner.nf = weight.shape[1]  # HF Conv1D: weight [in, out], forward reads nf
    elif leaf == "weight":
        localise_normalized_shape(owner, weight.shape[-1])


def localise_normalized_shape(module: nn.Module, features: int) -> None:
    """A norm over one dim (``nn.LayerNorm``, ``nn.RMSNorm``) sharded by features (a whole-width
    norm under tensor parallelism: ``graph.tp_wide_norms``) normalises ``features`` per rank."""
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, tuple) and len(shape) == 1:
        module.normalized_shape = (features,)


def localise_wide_norm(module: nn.Module, tp: int) -> None:
    """A whole-width norm without a weight (``elementwise_affine=False``; :func:`shrink_param`
    localises the others with their weight) normalises ``1/tp`` of its features per rank."""
    shape = getattr(module, "normalized_shape", None)
    if getattr(module, "weight", None) is None and isinstance(shape, tuple) and len(shape) == 1:
        localise_normalized_shape(module, shape[0] // tp)


PLAIN_EMBEDDING = "torch.nn.modules.sparse.Embedding"


def vocab_parallel_lookup(data: dict) -> bool:
    """True for a traced embedding lookup that vocabulary parallelism shards by rows: a plain
    ``nn.Embedding``. A subclass with its own forward (OPT's learned positions add an offset to
    the position ids) stays replicated: a row-sharded lookup would see its other arguments."""
    return data.get("op") == "embedding" and data.get("module_class") == PLAIN_EMBEDDING


def _matches(t: torch.Tensor, spec: HeadInput) -> bool:
    if t.dim() != len(spec.shape) or not t.is_floating_point():
        return False
    if any(size == 1 and t.shape[i] != 1 for i, size in enumerate(spec.shape)):
        return False
    return t.shape[spec.dim] % (spec.count * spec.inner) == 0


def slice_heads(t: torch.Tensor, spec: HeadInput, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s heads of a per-head tensor (heads: the middle factor of ``spec.dim``)."""
    outer = t.shape[spec.dim] // (spec.count * spec.inner)
    per = spec.count // tp
    split = t.unflatten(spec.dim, (outer, spec.count, spec.inner))
    return split.narrow(spec.dim + 1, rank * per, per).flatten(spec.dim, spec.dim + 2)


def slice_head_inputs(args: tuple, kwargs: dict, specs: Sequence[HeadInput], tp: int, rank: int):
    """``(args, kwargs)`` of a region module with every per-head input (:class:`HeadInput`)
    sliced to rank ``rank``'s heads; inputs already holding ``heads / tp`` heads are left alone."""

    def fix(value):
        if isinstance(value, torch.Tensor):
            for spec in specs:
                if _matches(value, spec):
                    return slice_heads(value, spec, tp, rank)
        return value

    return tuple(fix(a) for a in args), {k: fix(v) for k, v in kwargs.items()}


def head_input_hook(specs: Sequence[HeadInput], tp: int, rank: int):
    """A forward pre-hook (``with_kwargs=True``) applying :func:`slice_head_inputs`."""

    def hook(module, args, kwargs):
        return slice_head_inputs(args, kwargs, specs, tp, rank)

    return hook
