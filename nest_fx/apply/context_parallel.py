"""Context parallelism: each stage replica's sequences split over ``cp`` ranks, K/V all-gathered
(``plan.cp_mode = "allgather"``, below) or passed around a ring (``"ring"``: ``ring_attention.py``,
the same layout and positions, only the attention call differs).

Layout (causal load balancing). A sequence of ``S`` tokens is cut into ``2 cp`` chunks of
``c = S / (2 cp)``; CP rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` (in that order), so
every rank has one early and one late chunk and the same causal attention work
(:func:`load_balanced_indices`). ``ParallelModule.train_step`` gives each rank its tokens and
targets (:meth:`ContextParallel.shard`); everything per token (embeddings, norms, MLPs, experts,
the LM head, a token-mean loss) then runs unchanged on ``S / cp`` tokens.

Attention (the all-gather form of the Llama 3 report, Dubey et al. 2024): in every module that
calls ``F.scaled_dot_product_attention`` (``nest_fx.graph.context_sites.attention_sites``) the
call is intercepted (a ``TorchFunctionMode`` active only inside that module's forward). The
rank's K and V (after rotary) are all-gathered over the CP group (one collective for both; the
backward reduce-scatters their gradients) and put in sequence order; each of the rank's two
query chunks ``g`` then attends to keys ``[0, (g + 1) c)`` under a lower-right causal mask
(query ``g c + r`` sees keys ``<= g c + r``). Each rank computes ``(2 cp + 1) c^2`` scores:
balanced. GQA, ``scale`` and ``dropout_p`` pass through. The intercept accepts exactly the
calls a causal model makes on its own tokens: ``is_causal=True`` without a mask, or a mask
equal to the lower-triangular causal mask of the local tokens (HF may build one); anything
else raises :class:`~nest_fx.apply.checks.ApplyError` naming the module (models are checked
before training by ``ParallelSupport.cp_problem``, so this is a safety net).

Positions (``context_sites.position_sites``): a rank's ``j``-th token sits at position
``load_balanced_indices(S, cp, i)[j]``. Forward pre-hooks remap what position readers see:
zoo rotary tables (the cos/sin buffers are replaced by their rows at the rank's positions, as
torch's ``context_parallel`` shards ``freqs_cis``), HuggingFace rotary embeddings
(``position_ids -> positions[position_ids]``), and learned position embeddings fed by an
``arange`` (the indices likewise).

Gradients: CP ranks hold the same parameters and each computes the gradient of its tokens'
mean loss, so gradients are averaged over ``dp x cp`` (``mesh.data_parallel_mesh``).

On CUDA the same path runs (masked SDPA picks the memory-efficient kernel); torch's
``context_parallel`` (ring attention over DTensor) has no CPU SDPA sharding, and one code
path keeps the CPU parity tests meaningful for GPUs.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from nest_fx.apply.checks import ApplyError
from nest_fx.apply.ring_attention import Ring, ring_causal_attention
from nest_fx.graph.context_sites import attention_sites, position_sites

_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


def load_balanced_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of CP rank ``rank``'s tokens: chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``."""
    if seq_len % (2 * cp):
        raise ApplyError(
            f"context parallelism: sequence length {seq_len} is not divisible by 2 x cp = {2 * cp} "
            f"(each CP rank holds two of 2 x cp equal chunks); fix: a sequence length that is a "
            f"multiple of {2 * cp}"
        )
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat([first, second])


def gathered_order(local_len: int, cp: int) -> torch.Tensor:
    """Index into the all-gathered sequence (rank-major: rank r's ``local_len`` tokens at
    ``[r * local_len, (r + 1) * local_len)``) that puts it in position order."""
    c = local_len // 2
    order = []
    for g in range(2 * cp):
        r, half = (g, 0) if g < cp else (2 * cp - 1 - g, 1)
        order.append(torch.arange(r * local_len + half * c, r * local_len + (half + 1) * c))
    return torch.cat(order)


def local_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rank: int, cp: int, **sdpa_kwargs
) -> torch.Tensor:
    """Causal attention of CP rank ``rank``'s queries (its two chunks, [..., S/cp, D]) over the
    whole sequence's ``keys``/``values`` in position order ([..., S, D]): chunk ``g`` sees keys
    ``[0, (g + 1) c)`` under a lower-right causal mask."""
    c = query.size(-2) // 2
    outs = []
    for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        q = query[..., half * c : (half + 1) * c, :]
        visible = (chunk + 1) * c
        mask = torch.ones(c, visible, dtype=torch.bool, device=query.device).tril(visible - c)
        outs.append(
            F.scaled_dot_product_attention(
                q, keys[..., :visible, :], values[..., :visible, :], attn_mask=mask, **sdpa_kwargs
            )
        )
    return torch.cat(outs, dim=-2)


class _GatherSequence(torch.autograd.Function):
    """All-gather over the CP group along a new leading dim; the backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((size * x.size(0), *x.shape[1:]))  # gloo wants the ranks' tensors concatenated on dim 0
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(out, grad.flatten(0, 1), group=ctx.group)
        return out, None, None


class ContextParallel:
    """The CP group of one rank and what it needs: its token shard, positions and attention."""

    def __init__(self, group, cp: int, rank: int, mode: str = "allgather"):
        self.group, self.cp, self.rank, self.mode = group, cp, rank, mode
        self.ring = Ring(group, cp, rank) if mode == "ring" else None
        self._positions: Dict[tuple, torch.Tensor] = {}
        self._orders: Dict[tuple, torch.Tensor] = {}

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a batch ``t`` (full sequences along ``dim``)."""
        index = load_balanced_indices(t.size(dim), self.cp, self.rank).to(t.device)
        return t.index_select(dim, index)

    def positions(self, local_len: int, device) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens."""
        key = (local_len, str(device))
        if key not in self._positions:
            self._positions[key] = load_balanced_indices(local_len * self.cp, self.cp, self.rank).to(device)
        return self._positions[key]

    def attention(
        self,
        where: str,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: Optional[float] = None,
        enable_gqa: bool = False,
    ):
        """Causal SDPA of this rank's queries over the whole sequence's keys/values (module docstring)."""
        local = query.size(-2)
        self._check_causal(where, local, attn_mask, is_causal, query.device)
        kw = dict(dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
        if query.device.type == "meta":  # shape propagation only (fake process groups)
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, **kw)
        if self.ring is not None:
            return ring_causal_attention(query, key, value, self.ring, **kw)
        if key.shape == value.shape:
            both = _GatherSequence.apply(torch.stack([key, value]), self.group, self.cp)  # [cp, 2, B, H, S_l, D]
            keys, values = self._in_order(both[:, 0]), self._in_order(both[:, 1])
        else:
            keys = self._in_order(_GatherSequence.apply(key, self.group, self.cp))
            values = self._in_order(_GatherSequence.apply(value, self.group, self.cp))
        return local_causal_attention(query, keys, values, self.rank, self.cp, **kw)

    def _in_order(self, gathered: torch.Tensor) -> torch.Tensor:
        """[cp, B, H, S_l, D] in rank order -> [B, H, cp * S_l, D] in position order."""
        cp, rest = gathered.size(0), gathered.shape[1:]
        local = rest[-2]
        flat = gathered.movedim(0, -3).reshape(*rest[:-2], cp * local, rest[-1])
        key = (local, str(gathered.device))
        if key not in self._orders:
            self._orders[key] = gathered_order(local, cp).to(gathered.device)
        return flat.index_select(-2, self._orders[key])

    @staticmethod
    def _check_causal(where: str, local: int, attn_mask, is_causal: bool, device) -> None:
        if attn_mask is None and is_causal:
            return
        if (
            attn_mask is not None
            and not is_causal
            and attn_mask.dtype == torch.bool
            and attn_mask.shape[-2:] == (local, local)
        ):
            causal = torch.ones(local, local, dtype=torch.bool, device=device).tril()
            if bool((attn_mask == causal).all()):
                return
        what = "a mask that is not the causal mask of its tokens" if attn_mask is not None else "is_causal=False"
        raise ApplyError(
            f"context parallelism: {where} calls scaled_dot_product_attention with {what}; the CP path "
            "runs causal attention only (a padding, sliding-window or custom mask would be computed "
            "wrongly). fix: use cp=1 for this model"
        )


class _AttentionIntercept(TorchFunctionMode):
    """Routes SDPA calls made inside one attention module to :meth:`ContextParallel.attention`."""

    def __init__(self, cp: ContextParallel, where: str):
        super().__init__()
        self.cp, self.where = cp, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SDPA:
            return self.cp.attention(self.where, *args, **kwargs)
        return func(*args, **kwargs)


def _intercept_attention(module: nn.Module, cp: ContextParallel, where: str) -> None:
    inner = module.forward

    def intercepted(*args, **kwargs):
        with _AttentionIntercept(cp, where):
            return inner(*args, **kwargs)

    # dynamo cannot trace the intercept over DTensor inputs (sequence parallelism hands the
    # attention region a gathered DTensor; torch 2.13 recurses without end building the graph):
    # under torch.compile such a call runs eagerly, between two compiled graphs
    eager = torch.compiler.disable(intercepted)

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        # the ring's transfers (P2P work handles) are not traced either
        if cp.ring is not None or any(isinstance(a, DTensor) for a in (*args, *kwargs.values())):
            return eager(*args, **kwargs)
        return intercepted(*args, **kwargs)

    module.forward = forward


def _rope_table_hook(cp: ContextParallel, tables: Dict[str, torch.Tensor]):
    """Zoo rotary: the cos/sin rows the module slices (``[:seq]``) become the rank's positions' rows."""

    def hook(module, args):
        x = args[0]
        positions = cp.positions(x.size(-2), x.device)
        for name, full in tables.items():
            module._buffers[name] = full.index_select(0, positions)

    return hook


def _position_ids_hook(cp: ContextParallel):
    """HF rotary: ``position_ids`` (0 .. S_l-1 for a rank's tokens) -> the tokens' positions."""

    def hook(module, args, kwargs):
        if "position_ids" in kwargs:
            ids = kwargs["position_ids"]
            kwargs = {**kwargs, "position_ids": _remap(cp, ids, module)}
        else:
            ids = args[1]
            args = (args[0], _remap(cp, ids, module), *args[2:])
        return args, kwargs

    return hook


def _embedding_hook(cp: ContextParallel):
    """Learned positions: arange indices -> the rank's positions."""

    def hook(module, args):
        return (_remap(cp, args[0], module), *args[1:])

    return hook


def _remap(cp: ContextParallel, ids: torch.Tensor, module: nn.Module) -> torch.Tensor:
    local = ids.size(-1)
    if ids.numel() and int(ids.max()) >= local:
        raise ApplyError(
            f"context parallelism: {type(module).__name__} got position ids up to {int(ids.max())} for "
            f"{local} local tokens; the CP path remaps positions 0..{local - 1} of a rank's tokens only "
            "(no KV cache or offsets in training). fix: use cp=1"
        )
    return cp.positions(local, ids.device)[ids]


def apply_context_parallel(module: nn.Module, graph, cp: ContextParallel) -> Dict[str, List[str]]:
    """Rewrite the attention and position sites of ``module`` (one stage chunk) for ``cp``.
    Returns ``{"attention": [...], "positions": [...]}``: the module paths rewritten."""
    present = dict(module.named_modules())
    done: Dict[str, List[str]] = {"attention": [], "positions": []}
    for site in attention_sites(graph):
        target = present.get(site.module)
        if target is not None and site.module not in done["attention"]:
            _intercept_attention(target, cp, site.module)
            done["attention"].append(site.module)
    for site in position_sites(module, graph):
        target = present[site.module]
        if site.kind == "rope-table":
            tables = {n: b for n, b in target.named_buffers(recurse=False) if b.is_floating_point()}
            target.register_forward_pre_hook(_rope_table_hook(cp, tables))
        elif site.kind == "rope-position-ids":
            target.register_forward_pre_hook(_position_ids_hook(cp), with_kwargs=True)
        else:
            # before TP's input hook (vocabulary parallelism turns the indices into a DTensor)
            target.register_forward_pre_hook(_embedding_hook(cp), prepend=True)
        done["positions"].append(site.module)
    return done
