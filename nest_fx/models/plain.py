"""Plain PyTorch models as users write them: an ``nn.Sequential`` MLP and a small CNN with BatchNorm.

``mlp:in=32,hidden=64,layers=4,classes=8``: Linear/ReLU layers in one ``nn.Sequential``, input
``[batch, in]`` features, output ``[batch, classes]`` logits.

``cnn:channels=16,blocks=2,classes=10,image=16``: a stem convolution, ``blocks`` stages of
Conv-BatchNorm-ReLU, global average pooling and a linear classifier, in one ``nn.Sequential``;
input ``[batch, 3, image, image]``. Both train with class cross entropy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch
import torch.nn as nn

from nest_fx.common.errors import ModelError
from nest_fx.common.names import close_matches
from nest_fx.models.inputs import Example, InputSpec


@dataclass(frozen=True)
class PlainConfig:
    """Shape of a plain model (the fields its spec may set)."""

    kind: str
    classes: int = 8
    hidden: int = 64  # MLP width
    layers: int = 4  # MLP linears
    features: int = 32  # MLP input features
    channels: int = 16  # CNN width
    blocks: int = 2  # CNN conv stages
    image: int = 16  # CNN input size

    @property
    def name(self) -> str:
        return self.kind


_ALIASES = {"in": "features", "width": "hidden"}
_KEYS = {"mlp": ("features", "hidden", "layers", "classes"), "cnn": ("channels", "blocks", "classes", "image")}
KINDS = tuple(_KEYS)


def parse_plain(name: str) -> PlainConfig:
    """``mlp:...`` or ``cnn:...`` -> PlainConfig; ModelError naming a bad key or value."""
    kind, _, body = name.partition(":")
    if kind not in _KEYS:
        raise ModelError(f"unknown plain model {kind!r}{close_matches(kind, _KEYS)}: use one of {list(_KEYS)}")
    values: Dict[str, int] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, eq, raw = item.partition("=")
        key = _ALIASES.get(key.strip(), key.strip())
        if not eq or key not in _KEYS[kind]:
            raise ModelError(
                f"bad field {item!r} in {name!r}: expected key=value with key one of {sorted(_KEYS[kind])}"
            )
        try:
            values[key] = int(raw)
        except ValueError:
            raise ModelError(f"bad value in {item!r}: expected an integer") from None
        if values[key] <= 0:
            raise ModelError(f"bad value in {item!r}: must be positive")
    if kind == "mlp" and values.get("layers", 4) < 2:
        raise ModelError(f"{name}: an MLP needs layers >= 2 (input and output linears)")
    return PlainConfig(kind, **values)


def build_plain(cfg: PlainConfig) -> nn.Module:
    """The module of ``cfg`` on the current default device and dtype."""
    if cfg.kind == "mlp":
        mods = [nn.Linear(cfg.features, cfg.hidden), nn.ReLU()]
        for _ in range(cfg.layers - 2):
            mods += [nn.Linear(cfg.hidden, cfg.hidden), nn.ReLU()]
        return nn.Sequential(*mods, nn.Linear(cfg.hidden, cfg.classes))
    mods = [nn.Conv2d(3, cfg.channels, 3, padding=1), nn.BatchNorm2d(cfg.channels), nn.ReLU()]
    for _ in range(cfg.blocks):
        mods += [nn.Conv2d(cfg.channels, cfg.channels, 3, padding=1), nn.BatchNorm2d(cfg.channels), nn.ReLU()]
    return nn.Sequential(*mods, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cfg.channels, cfg.classes))


def plain_example(cfg: PlainConfig, batch: int, dtype: torch.dtype = torch.float32) -> Example:
    """Inputs and class targets of a plain model."""
    shape: Tuple[int, ...] = (batch, cfg.features) if cfg.kind == "mlp" else (batch, 3, cfg.image, cfg.image)
    return Example(
        [InputSpec("x", shape, dtype=dtype, positional=True)],
        "classify",
        target=InputSpec("target", (batch,), high=cfg.classes),
    )
