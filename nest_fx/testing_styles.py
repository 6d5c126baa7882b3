"""Tiny models written in the styles people bring from outside HuggingFace (our own code).

Each mirrors how a common codebase writes its model, not its weights or sizes: the module names,
containers and the ops of its attention, because that is what tracing, block detection and tensor
parallelism read. Used by the style part of the coverage matrix (``scripts/bench_coverage.py
--suite styles``) and ``tests/test_styles.py``:

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
``mixer``          MLP-Mixer: token-mixing MLP over the transposed patch dim
``convnext``       ConvNeXt: ``stages[i]`` Sequential blocks, depthwise conv, channels-last
                   LayerNorm and Linear, layer scale ``gamma``, downsample layers
=================  =============================================================================

``style_spec(name, plan)`` is the :func:`nest_fx.testing.equivalence` spec of one cell.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, DEPTH, VOCAB, SEQ, CLASSES, IMAGE = 32, 4, 2, 64, 16, 10, 16


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
    def __init__(self, vocab: int = VOCAB, block_size: int = SEQ, n_embd: int = DIM, n_head: int = HEADS,
                 n_layer: int = DEPTH, local_views: bool = False):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([GPTBlock(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
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


# -- timm ViT and DeiT -----------------------------------------------------------------------------

class TimmAttention(nn.Module):
    """``local_views``: the output merged with ``reshape(B, N, -1)`` instead of timm's ``(B, N, C)``."""

    def __init__(self, dim: int, num_heads: int, local_views: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.local_views = num_heads, dim // num_heads, local_views
        self.scale = self.head_dim ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, -1 if self.local_views else C))


class TimmMlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TimmBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, local_views: bool = False):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), TimmAttention(dim, num_heads, local_views)
        self.norm2, self.mlp = nn.LayerNorm(dim), TimmMlp(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class TimmViT(nn.Module):
    """timm's layout; ``distilled=True`` adds DeiT's distillation token and head."""

    def __init__(self, dim: int = DIM, depth: int = DEPTH, heads: int = HEADS, patch: int = 4, distilled: bool = False,
                 local_views: bool = False):
        super().__init__()
        tokens = (IMAGE // patch) ** 2
        prefix = 2 if distilled else 1
        self.patch_embed = PatchEmbed(patch, dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.dist_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02) if distilled else None
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + prefix, dim) * 0.02)
        self.blocks = nn.Sequential(*[TimmBlock(dim, heads, local_views) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)
        self.head_dist = nn.Linear(dim, CLASSES) if distilled else None

    def forward(self, x):
        x = self.patch_embed(x)
        prefix = [self.cls_token.expand(x.shape[0], -1, -1)]
        if self.dist_token is not None:
            prefix.append(self.dist_token.expand(x.shape[0], -1, -1))
        x = torch.cat(prefix + [x], dim=1) + self.pos_embed
        x = self.blocks(x)
        x = self.norm(x)
        if self.head_dist is None:
            return self.head(x[:, 0])
        return (self.head(x[:, 0]) + self.head_dist(x[:, 1])) / 2  # DeiT's inference: the heads averaged


# -- torchvision ViT -------------------------------------------------------------------------------

class TvMLPBlock(nn.Sequential):
    def __init__(self, dim: int, hidden: int):
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(0.0), nn.Linear(hidden, dim), nn.Dropout(0.0))


class TvEncoderBlock(nn.Module):
    def __init__(self, heads: int, dim: int, hidden: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.self_attention = nn.MultiheadAttention(dim, heads, dropout=0.0, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2, self.mlp = nn.LayerNorm(dim), TvMLPBlock(dim, hidden)

    def forward(self, input):
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x) + input
        return x + self.mlp(self.ln_2(x))


class TvEncoder(nn.Module):
    def __init__(self, seq: int, layers: int, heads: int, dim: int, hidden: int):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(OrderedDict(
            (f"encoder_layer_{i}", TvEncoderBlock(heads, dim, hidden)) for i in range(layers)))
        self.ln = nn.LayerNorm(dim)

    def forward(self, input):
        return self.ln(self.layers(self.dropout(input + self.pos_embedding)))


class TvViT(nn.Module):
    def __init__(self, patch: int = 4, dim: int = DIM, heads: int = HEADS, layers: int = DEPTH):
        super().__init__()
        self.patch_size, self.hidden_dim = patch, dim
        self.conv_proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.encoder = TvEncoder((IMAGE // patch) ** 2 + 1, layers, heads, dim, 4 * dim)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(dim, CLASSES)))

    def _process_input(self, x):
        n, _, h, w = x.shape
        p = self.patch_size
        x = self.conv_proj(x).reshape(n, self.hidden_dim, (h // p) * (w // p))
        return x.permute(0, 2, 1)

    def forward(self, x):
        x = self._process_input(x)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.encoder(x)
        return self.heads(x[:, 0])


# -- torchvision CNN with nested stages ------------------------------------------------------------

class InvertedResidual(nn.Module):
    def __init__(self, channels: int, expand: int = 2):
        super().__init__()
        hidden = channels * expand
        self.conv = nn.Sequential(nn.Conv2d(channels, hidden, 1), nn.ReLU6(),
                                  nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden), nn.ReLU6(),
                                  nn.Conv2d(hidden, channels, 1))

    def forward(self, x):
        return x + self.conv(x)


class TvCNN(nn.Module):
    def __init__(self, channels: int = 16, stages: int = 3):
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, channels, 3, stride=2, padding=1), nn.ReLU6()),
            *[nn.Sequential(InvertedResidual(channels), InvertedResidual(channels)) for _ in range(stages)])
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(channels, CLASSES))

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        return self.classifier(torch.flatten(x, 1))


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
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep,
                                                                                     head_dim)


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

    def __init__(self, dim: int = DIM, n_layers: int = DEPTH, n_heads: int = HEADS, n_kv_heads: int = 2,
                 vocab: int = VOCAB):
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


# -- Swin ------------------------------------------------------------------------------------------

def window_partition(x: torch.Tensor, w: int) -> torch.Tensor:
    B, H, W, C = x.shape
    x = x.view(B, H // w, w, W // w, w, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, w * w, C)


def window_reverse(windows: torch.Tensor, w: int, H: int, W: int) -> torch.Tensor:
    C = windows.shape[-1]
    x = windows.view(-1, H // w, W // w, w, w, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, H, W, C)


class WindowAttention(nn.Module):
    def __init__(self, dim: int, window: int, num_heads: int):
        super().__init__()
        self.window, self.num_heads = window, num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, num_heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("relative_position_index", rel[:, :, 0] * (2 * window - 1) + rel[:, :, 1],
                             persistent=False)
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)

    def forward(self, x):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(N, N, -1)
        attn = (attn + bias.permute(2, 0, 1).contiguous().unsqueeze(0)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B_, N, C))


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, resolution: int, window: int, shift: int):
        super().__init__()
        self.resolution, self.window, self.shift = resolution, window, shift
        self.norm1, self.attn = nn.LayerNorm(dim), WindowAttention(dim, window, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), TimmMlp(dim, 4 * dim)

    def forward(self, x):
        H = W = self.resolution
        B, L, C = x.shape
        shortcut = x
        x = self.norm1(x).view(B, H, W, C)
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        x = window_reverse(self.attn(window_partition(x, self.window)), self.window, H, W)
        if self.shift:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        x = shortcut + x.view(B, H * W, C)
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, dim: int, resolution: int):
        super().__init__()
        self.resolution = resolution
        self.norm, self.reduction = nn.LayerNorm(4 * dim), nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):
        B, L, C = x.shape
        x = x.view(B, self.resolution, self.resolution, C)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x.view(B, -1, 4 * C)))


class SwinStage(nn.Module):
    def __init__(self, dim: int, heads: int, resolution: int, depth: int, merge: bool):
        super().__init__()
        self.blocks = nn.ModuleList([SwinBlock(dim, heads, resolution, 4, 0 if i % 2 == 0 else 2)
                                     for i in range(depth)])
        self.downsample = PatchMerging(dim, resolution) if merge else None

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.downsample(x) if self.downsample is not None else x


class Swin(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.patch_embed = PatchEmbed(2, dim)
        self.layers = nn.ModuleList([SwinStage(dim, heads, IMAGE // 2, 2, merge=True),
                                     SwinStage(2 * dim, 2 * heads, IMAGE // 4, 2, merge=False)])
        self.norm, self.head = nn.LayerNorm(2 * dim), nn.Linear(2 * dim, CLASSES)

    def forward(self, x):
        x = self.patch_embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(1))


# -- MLP-Mixer and ConvNeXt ------------------------------------------------------------------------

class MixerBlock(nn.Module):
    def __init__(self, dim: int, tokens: int):
        super().__init__()
        self.norm1, self.mlp_tokens = nn.LayerNorm(dim), TimmMlp(tokens, 2 * tokens)
        self.norm2, self.mlp_channels = nn.LayerNorm(dim), TimmMlp(dim, 4 * dim)

    def forward(self, x):
        x = x + self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.mlp_channels(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, dim: int = DIM, depth: int = DEPTH, patch: int = 4):
        super().__init__()
        self.stem = PatchEmbed(patch, dim)
        self.blocks = nn.Sequential(*[MixerBlock(dim, (IMAGE // patch) ** 2) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, CLASSES)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.stem(x))).mean(dim=1))


class ChannelsFirstNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.weight.shape, self.weight, self.bias, 1e-6).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1, self.act, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-1 * torch.ones(dim))

    def forward(self, x):
        shortcut = x
        x = self.dwconv(x).permute(0, 2, 3, 1)
        x = self.gamma * self.pwconv2(self.act(self.pwconv1(self.norm(x))))
        return shortcut + x.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, dims=(16, 32), depths=(2, 2)):
        super().__init__()
        self.downsample_layers = nn.ModuleList([nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4),
                                                              ChannelsFirstNorm(dims[0]))])
        for i in range(len(dims) - 1):
            self.downsample_layers.append(nn.Sequential(ChannelsFirstNorm(dims[i]),
                                                        nn.Conv2d(dims[i], dims[i + 1], 2, stride=2)))
        self.stages = nn.ModuleList([nn.Sequential(*[ConvNeXtBlock(d) for _ in range(n)])
                                     for d, n in zip(dims, depths)])
        self.norm, self.head = nn.LayerNorm(dims[-1], eps=1e-6), nn.Linear(dims[-1], CLASSES)

    def forward(self, x):
        for down, stage in zip(self.downsample_layers, self.stages):
            x = stage(down(x))
        return self.head(self.norm(x.mean([-2, -1])))


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
    spec: Dict[str, Any] = {"model": name, "build": _Builder(name), "plan": dict(plan), "batch": batch,
                            "steps": steps, "lr": lr, "seq": SEQ,
                            "data": token_data if kind == "decoder" else image_data}
    spec["loss"] = {"model": "model", "tokens": token_loss, "classes": F.cross_entropy}[loss]
    return spec
