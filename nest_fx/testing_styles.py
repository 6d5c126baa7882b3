"""Tiny models written in the styles people bring from outside HuggingFace (our own code).

Each mirrors how a common codebase writes its model, not its weights or sizes: the module names,
containers and the ops of its attention, because that is what tracing, block detection and tensor
parallelism read. Used by the style part of the coverage matrix (``scripts/bench_coverage.py
--suite styles``) and ``tests/distributed/apply/test_styles.py``:

=================  =============================================================================
name               what it stands for
=================  =============================================================================
``nanogpt``        nanoGPT's GPT: fused ``c_attn`` split with ``.split(self.n_embd, dim=2)``,
                   ``forward(idx, targets=None) -> (logits, loss)`` trained on its own loss, tied
                   ``wte``/``lm_head``, blocks in ``transformer.h``
``nanogpt-views``  the same with its head views sized ``view(B, T, n_head, -1)`` and
                   ``view(B, T, -1)`` (no size read from the input's width)
``timm-vit``       timm's VisionTransformer: ``qkv(x).reshape(B, N, 3, H, hd).permute(2, 0, 3, 1,
                   4).unbind(0)``, ``cls_token``/``pos_embed`` root parameters, ``blocks`` Sequential
``timm-vit-views`` the same, its heads merged with ``reshape(B, N, -1)`` instead of ``(B, N, C)``
``deit``           DeiT: the timm ViT with a distillation token and a second head
``tv-vit``         torchvision's ViT: ``encoder.layers.encoder_layer_0`` (an OrderedDict Sequential),
                   ``nn.MultiheadAttention``, ``class_token`` root parameter, forward starts with
                   ``self._process_input``
``tv-cnn``         a torchvision CNN (MobileNet-like): ``features[i]`` Sequential stages of residual
                   blocks, forward starting with ``self.features(x)``
``meta-llama``     Meta's reference Llama: separate ``wq``/``wk``/``wv``/``wo``, complex RoPE
                   (``view_as_complex``/``view_as_real``), explicit causal mask and matmul attention
``titan-llama3``   torchtitan's Llama 3: layers in a ``ModuleDict`` keyed "0", "1", GQA with
                   ``repeat_kv``, complex RoPE, SDPA
``swin``           Swin: window attention with a relative position bias table, shifted windows
                   (``torch.roll``), ``layers.i.blocks.j``, patch merging between stages
``swin-views``     the same in timm's current spelling: ``reshape(B_, N, 3, heads, -1)``,
                   ``unbind(0)``, heads merged with ``reshape(B_, N, -1)``
``mixer``          MLP-Mixer: token-mixing MLP over the transposed patch dim
``convnext``       ConvNeXt: ``stages[i]`` Sequential blocks, depthwise conv, channels-last
                   LayerNorm and Linear, layer scale ``gamma``, downsample layers
=================  =============================================================================

``style_spec(name, plan)`` is the :func:`nest_fx.testing.equivalence` spec of one cell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from nest_fx.testing_vision_styles import CLASSES, IMAGE, ConvNeXt, Mixer, Swin, TimmViT, TvCNN, TvViT

DIM, HEADS, DEPTH, VOCAB, SEQ = 32, 4, 2, 64, 16


@dataclass
class StyleConfig:
    """What the harness reads of a built model: ``vocab_size`` and ``seq_len`` (token models)."""

    vocab_size: int = VOCAB
    seq_len: int = SEQ


# -- nanoGPT ---------------------------------------------------------------------------------------


class GPTAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, 0.0

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class LocalViewsAttention(GPTAttention):
    """nanoGPT's attention with its head views sized by ``-1`` instead of the input's width: the
    sizes it reads (``n_embd``, ``n_head``) are attributes tensor parallelism localises."""

    def forward(self, x):
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class GPTMLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), GPTAttention(n_embd, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), GPTMLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(
        self,
        vocab: int = VOCAB,
        block_size: int = SEQ,
        n_embd: int = DIM,
        n_head: int = HEADS,
        n_layer: int = DEPTH,
        local_views: bool = False,
    ):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList([GPTBlock(n_embd, n_head) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        if local_views:
            for block in self.transformer.h:
                block.attn = LocalViewsAttention(n_embd, n_head)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss


# -- Llama: Meta's reference and torchtitan's ------------------------------------------------------


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LlamaAttention(nn.Module):
    """``sdpa=False``: Meta's reference (scores, mask, softmax); ``True``: torchtitan's."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, sdpa: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.n_rep, self.sdpa = n_heads // n_kv_heads, sdpa
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis, mask: Optional[torch.Tensor] = None):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        if self.sdpa:
            output = F.scaled_dot_product_attention(xq, keys, values, is_causal=True)
        else:
            scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
            scores = F.softmax((scores + mask).float(), dim=-1).type_as(xq)
            output = torch.matmul(scores, values)
        return self.wo(output.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class LlamaFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, sdpa: bool):
        super().__init__()
        self.attention = LlamaAttention(dim, n_heads, n_kv_heads, sdpa)
        self.feed_forward = LlamaFeedForward(dim, 3 * dim)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, freqs_cis, mask=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class MetaLlama(nn.Module):
    """Meta's reference layout: ``layers`` ModuleList, mask built in forward, freqs sliced per call."""

    def __init__(self, dim: int = DIM, n_layers: int = DEPTH, n_heads: int = HEADS, vocab: int = VOCAB):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([LlamaBlock(dim, n_heads, n_heads, sdpa=False) for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, SEQ * 2), persistent=False)

    def forward(self, tokens):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:seqlen]
        mask = torch.triu(torch.full((seqlen, seqlen), float("-inf"), device=tokens.device), diagonal=1)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        return self.output(self.norm(h)).float()


class TitanLlama3(nn.Module):
    """torchtitan's layout: ``layers`` ModuleDict keyed by layer id, GQA, SDPA, ``freqs_cis`` buffer."""

    def __init__(
        self, dim: int = DIM, n_layers: int = DEPTH, n_heads: int = HEADS, n_kv_heads: int = 2, vocab: int = VOCAB
    ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, SEQ), persistent=False)
        self.layers = nn.ModuleDict({str(i): LlamaBlock(dim, n_heads, n_kv_heads, sdpa=True) for i in range(n_layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


# -- the suite -------------------------------------------------------------------------------------


def token_data(gen: torch.Generator, batch: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets."""
    return (torch.randint(0, VOCAB, (batch, SEQ), generator=gen), torch.randint(0, VOCAB, (batch, SEQ), generator=gen))


def image_data(gen: torch.Generator, batch: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random images and class labels."""
    return torch.randn(batch, 3, IMAGE, IMAGE, generator=gen), torch.randint(0, CLASSES, (batch,), generator=gen)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token cross entropy."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


STYLE_MODELS: Dict[str, Tuple[str, Callable[[], nn.Module], str]] = {
    # name: (kind, constructor, loss: "model" (its own, from the targets) | "tokens" | "classes")
    "nanogpt": ("decoder", NanoGPT, "model"),
    "nanogpt-views": ("decoder", lambda: NanoGPT(local_views=True), "model"),
    "meta-llama": ("decoder", MetaLlama, "tokens"),
    "titan-llama3": ("decoder", TitanLlama3, "tokens"),
    "timm-vit": ("vision", TimmViT, "classes"),
    "timm-vit-views": ("vision", lambda: TimmViT(local_views=True), "classes"),
    "deit": ("vision", lambda: TimmViT(distilled=True), "classes"),
    "tv-vit": ("vision", TvViT, "classes"),
    "tv-cnn": ("vision", TvCNN, "classes"),
    "swin": ("vision", Swin, "classes"),
    "swin-views": ("vision", lambda: Swin(local_views=True), "classes"),
    "mixer": ("vision", Mixer, "classes"),
    "convnext": ("vision", ConvNeXt, "classes"),
}


def build_style(name: str, seed: int = 0) -> Tuple[nn.Module, StyleConfig]:
    """``STYLE_MODELS[name]`` built from ``seed`` on the CPU in fp32."""
    torch.manual_seed(seed)
    return STYLE_MODELS[name][1](), StyleConfig()


class _Builder:
    """A picklable ``build(seed)`` of one style model (specs cross process boundaries)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, seed: int = 0):
        return build_style(self.name, seed)


def style_spec(name: str, plan: Dict[str, Any], *, batch: int = 8, steps: int = 3, lr: float = 0.5) -> Dict[str, Any]:
    """The :func:`nest_fx.testing.equivalence` spec of ``name`` under ``plan`` (kwargs of
    ``uniform_plan``; ``{}``: the planner's choice)."""
    kind, _, loss = STYLE_MODELS[name]
    spec: Dict[str, Any] = {
        "model": name,
        "build": _Builder(name),
        "plan": dict(plan),
        "batch": batch,
        "steps": steps,
        "lr": lr,
        "seq": SEQ,
        "data": token_data if kind == "decoder" else image_data,
    }
    spec["loss"] = {"model": "model", "tokens": token_loss, "classes": F.cross_entropy}[loss]
    return spec
