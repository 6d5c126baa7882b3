"""The vision models of :mod:`nest_fx.testing_styles` (our own code, in the styles of timm,
torchvision, Swin, MLP-Mixer and ConvNeXt; see that module for what each stands for)."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, DEPTH, CLASSES, IMAGE = 32, 4, 2, 10, 16


# -- timm ViT and DeiT -----------------------------------------------------------------------------


class TimmAttention(nn.Module):
    """``local_views``: the output merged with ``reshape(B, N, -1)`` instead of timm's ``(B, N, C)``."""

    def __init__(self, dim: int, num_heads: int, local_views: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.local_views = num_heads, dim // num_heads, local_views
        self.scale = self.head_dim**-0.5
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

    def __init__(
        self,
        dim: int = DIM,
        depth: int = DEPTH,
        heads: int = HEADS,
        patch: int = 4,
        distilled: bool = False,
        local_views: bool = False,
    ):
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
        self.layers = nn.Sequential(
            OrderedDict((f"encoder_layer_{i}", TvEncoderBlock(heads, dim, hidden)) for i in range(layers))
        )
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
        self.conv = nn.Sequential(
            nn.Conv2d(channels, hidden, 1),
            nn.ReLU6(),
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden),
            nn.ReLU6(),
            nn.Conv2d(hidden, channels, 1),
        )

    def forward(self, x):
        return x + self.conv(x)


class TvCNN(nn.Module):
    def __init__(self, channels: int = 16, stages: int = 3):
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, channels, 3, stride=2, padding=1), nn.ReLU6()),
            *[nn.Sequential(InvertedResidual(channels), InvertedResidual(channels)) for _ in range(stages)],
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(channels, CLASSES))

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        return self.classifier(torch.flatten(x, 1))


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
    """The original Swin's window attention (``reshape(B_, N, 3, heads, C // heads)``, ``qkv[i]``,
    ``reshape(B_, N, C)``); ``local_views``: timm's current spelling, its views sized with -1 and
    ``qkv.unbind(0)``."""

    def __init__(self, dim: int, window: int, num_heads: int, local_views: bool = False):
        super().__init__()
        self.window, self.num_heads, self.local_views = window, num_heads, local_views
        self.scale = (dim // num_heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, num_heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer(
            "relative_position_index", rel[:, :, 0] * (2 * window - 1) + rel[:, :, 1], persistent=False
        )
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)

    def forward(self, x):
        B_, N, C = x.shape
        if self.local_views:
            q, k, v = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(N, N, -1)
        attn = (attn + bias.permute(2, 0, 1).contiguous().unsqueeze(0)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B_, N, -1 if self.local_views else C))


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, resolution: int, window: int, shift: int, local_views: bool = False):
        super().__init__()
        self.resolution, self.window, self.shift = resolution, window, shift
        self.norm1, self.attn = nn.LayerNorm(dim), WindowAttention(dim, window, heads, local_views)
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
    def __init__(self, dim: int, heads: int, resolution: int, depth: int, merge: bool, local_views: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(
            [SwinBlock(dim, heads, resolution, 4, 0 if i % 2 == 0 else 2, local_views) for i in range(depth)]
        )
        self.downsample = PatchMerging(dim, resolution) if merge else None

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.downsample(x) if self.downsample is not None else x


class Swin(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2, local_views: bool = False):
        super().__init__()
        self.patch_embed = PatchEmbed(2, dim)
        self.layers = nn.ModuleList(
            [
                SwinStage(dim, heads, IMAGE // 2, 2, merge=True, local_views=local_views),
                SwinStage(2 * dim, 2 * heads, IMAGE // 4, 2, merge=False, local_views=local_views),
            ]
        )
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
        self.downsample_layers = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), ChannelsFirstNorm(dims[0]))]
        )
        for i in range(len(dims) - 1):
            self.downsample_layers.append(
                nn.Sequential(ChannelsFirstNorm(dims[i]), nn.Conv2d(dims[i], dims[i + 1], 2, stride=2))
            )
        self.stages = nn.ModuleList(
            [nn.Sequential(*[ConvNeXtBlock(d) for _ in range(n)]) for d, n in zip(dims, depths)]
        )
        self.norm, self.head = nn.LayerNorm(dims[-1], eps=1e-6), nn.Linear(dims[-1], CLASSES)

    def forward(self, x):
        for down, stage in zip(self.downsample_layers, self.stages):
            x = stage(down(x))
        return self.head(self.norm(x.mean([-2, -1])))
