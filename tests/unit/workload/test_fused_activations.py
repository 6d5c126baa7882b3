"""What a fused runtime keeps of the attention output: one tensor, measured with autograd on CPU.

The ``fused`` kernel backend (``nest_fx.workload.kernels``) counts the attention output once: a
fused runtime's attention kernel writes it as ``[batch, seq, heads x head_dim]`` and the output
projection reads that tensor in place, so the projection's saved input is the kernel's saved
output. The reference block here runs fused RMSNorm and SwiGLU (``tests/unit/workload/test_kernels.py``) and an
attention Function that keeps what FlashAttention keeps (q, k, v, the output, the per-row
log-sum-exp) and returns its output in that layout; the predicted bytes (flash attention costed,
fp32, so nothing is rounded) equal what autograd keeps, and the same block with the output
returned head-major (the projection's reshape then copies it) keeps exactly the projection's input
more, the term the fused backend drops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nest_fx.cluster import load_cluster
from nest_fx.models import build_seeded
from nest_fx.models import layers as model_layers
from nest_fx.workload import workload_for_model
from profiler.recompute_memory import kept_bytes
from test_kernels import LLAMA, _fused_block

B, S, H = 2, 32, 64


class _FlashLikeFn(torch.autograd.Function):
    """Causal attention keeping q, k, v, its output and the fp32 log-sum-exp per row (what
    FlashAttention saves); the output's storage is ``[b, s, heads, d]`` (``seq_major``) or
    ``[b, heads, s, d]``. Backward recomputes the scores (as FlashAttention does)."""

    @staticmethod
    def forward(ctx, q, k, v, seq_major):
        with torch.no_grad():
            scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5
            mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            lse = torch.logsumexp(scores.float(), dim=-1)
            out = torch.softmax(scores, dim=-1) @ v
        if seq_major:
            out = out.transpose(1, 2).contiguous().transpose(1, 2)  # [b, s, h, d] storage, [b, h, s, d] view
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, _, _ = ctx.saved_tensors
        with torch.enable_grad():
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            return (*torch.autograd.grad(out, (qq, kk, vv), dout), None)


def _kept(seq_major: bool, monkeypatch) -> int:
    def attend(q, k, v, causal, window, gqa):
        assert causal and not window and not gqa
        return _FlashLikeFn.apply(q, k, v, seq_major)

    model, _ = build_seeded(LLAMA)
    block = _fused_block(model.layers[0])
    x = torch.randn(B, S, H)
    with monkeypatch.context() as m:
        m.setattr(model_layers, "attend", attend)
        return kept_bytes(block, [x], "none") + x.numel() * x.element_size()


def test_reference_flash_attention_computes_sdpas_gradients(monkeypatch):
    q, k, v = (torch.randn(B, 4, S, 16, requires_grad=True) for _ in range(3))
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum(), (q, k, v))
    got = torch.autograd.grad(_FlashLikeFn.apply(q, k, v, True).square().sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_backend_keeps_what_a_fused_block_keeps(monkeypatch):
    work = workload_for_model(LLAMA, load_cluster("cpu-gloo:1"), dtype=torch.float32, attention="flash")
    predicted = {k: work.for_runtime(kernels=k).cost(1, mbs=B).act_bytes["none"] for k in ("compile", "fused")}
    in_place, copied = _kept(True, monkeypatch), _kept(False, monkeypatch)
    projection_input = B * S * H * 4  # fp32
    assert copied - in_place == projection_input
    assert predicted["fused"] == pytest.approx(in_place, rel=0.01)  # the log-sum-exp rows: within 512 bytes
    # compile keeps the projection's own copy (no fused attention layout is assumed there)
    assert predicted["compile"] - predicted["fused"] == pytest.approx(projection_input)
