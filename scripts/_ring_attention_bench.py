"""The ``ring`` section of ``bench_gpu_kernels.py``: one context-parallel rank's ring attention
(the load-balanced layout torch's and nest-fx's ring runs: rank i holds chunks i and 2cp-1-i) on
one GPU without communication, timed against the same kernel over the whole sequence / cp."""

from __future__ import annotations

import torch


def _flash_with_lse(q, k, v, causal: bool):
    """Attention output and per-row log-sum-exp (fp32), differentiable in both."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=causal)[:2]
    return out, lse


def _attend(q, k, v, causal: bool, with_lse: bool):
    if with_lse:
        return _flash_with_lse(q, k, v, causal)
    # CPU smoke path: plain attention and its log-sum-exp in fp32
    scores = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores.softmax(-1) @ v.float()).to(q.dtype), lse


def _merge(out, lse, new_out, new_lse):
    """Online-softmax merge of two partial attentions (fp32), as a ring step does."""
    top = torch.maximum(lse, new_lse)
    a, b = torch.exp(lse - top), torch.exp(new_lse - top)
    total = a + b
    merged = (out.float() * (a / total).unsqueeze(-1) + new_out.float() * (b / total).unsqueeze(-1)).to(out.dtype)
    return merged, top + torch.log(total)


def ring_rank_work(q, k, v, cp: int, rank: int, with_lse: bool):
    """One CP rank's attention (its two load-balanced chunks as ``q``/``k``/``v`` of S/cp tokens):
    step 0 causal over its own block, then per other rank's block one non-causal call (earlier
    ranks: all queries x the block's first chunk; later ranks: the second query chunk x the whole
    block) merged into the running output."""
    half = q.shape[-2] // 2
    out, lse = _attend(q, k, v, True, with_lse)
    for other in range(cp):
        if other == rank:
            continue
        if other < rank:
            new_out, new_lse = _attend(q, k[..., :half, :], v[..., :half, :], False, with_lse)
            out, lse = _merge(out, lse, new_out, new_lse)
        else:
            new_out, new_lse = _attend(q[..., half:, :], k, v, False, with_lse)
            tail, tail_lse = _merge(out[..., half:, :], lse[..., half:], new_out, new_lse)
            out = torch.cat([out[..., :half, :], tail], dim=-2)
            lse = torch.cat([lse[..., :half], tail_lse], dim=-1)
    return out


def ring(ctx) -> dict:
    """A CP rank's chunked attention time against the whole causal attention / cp, both through
    the same kernel (FlashAttention-2, the one the ring steps call), so the ratio is the cost of
    the split alone. (Until 2026-11-27 the whole attention went through ``F.scaled_dot_product_attention``,
    which picks cuDNN on torch 2.11: the committed H100/H200 runs' ``efficiency_*`` mix the two
    kernels; ``bench_gpu_vs_model.py`` compares their ring times with the ``sdpa`` section's
    FlashAttention-2 row instead.)"""
    rows = []
    with_lse = ctx.device.type == "cuda"
    h, d = ctx.heads, 128 if not ctx.smoke else 16
    for s in ctx.ring_seqs:
        full = [torch.randn(1, h, s, d, device=ctx.device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        ideal_f = ctx.timer(lambda: _attend(*full, True, with_lse)[0], repeats=ctx.long_repeats)
        g = torch.randn_like(full[0])
        ideal_fb = ctx.timer(
            lambda: torch.autograd.backward(_attend(*full, True, with_lse)[0], g),
            repeats=ctx.long_repeats,
        )
        for cp in ctx.ring_cps:
            local = s // cp
            qkv = [
                torch.randn(1, h, local, d, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            ]
            g = torch.randn_like(qkv[0])
            for rank in (0, cp - 1):
                fwd = ctx.timer(lambda: ring_rank_work(*qkv, cp, rank, with_lse), repeats=ctx.long_repeats)
                fb = ctx.timer(
                    lambda: torch.autograd.backward(ring_rank_work(*qkv, cp, rank, with_lse), g),
                    repeats=ctx.long_repeats,
                )
                rows.append(
                    dict(
                        seq=s,
                        cp=cp,
                        rank=rank,
                        heads=h,
                        fwd_s=fwd,
                        fwd_bwd_s=fb,
                        ideal_fwd_s=ideal_f / cp,
                        ideal_fwd_bwd_s=ideal_fb / cp,
                        efficiency_fwd=ideal_f / cp / fwd,
                        efficiency_fwd_bwd=ideal_fb / cp / fb,
                    )
                )
    return {"rows": rows}
