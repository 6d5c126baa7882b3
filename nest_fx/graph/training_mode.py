"""HuggingFace models as users load them, made ready to trace and train.

``from_pretrained`` and ``from_config`` give a causal LM whose config has ``use_cache=True``:
its forward then builds and returns a key/value cache (``DynamicCache``), which torch.export
cannot return and which training never reads. :func:`training_config` turns caching off in
the model's config and every sub-config (text, decoder), as ``model.train()`` users expect
from a trainer, and says so once per process. ``return_dict=False`` (tuple outputs) and the
``sdpa`` and ``eager`` attention implementations need nothing: the tracer and the runtime
read tuples (``tensor_output``, ``model_loss``) and both kernels trace.
"""

from __future__ import annotations

import warnings
from typing import List

import torch.nn as nn

_SUBCONFIGS = ("text_config", "decoder", "encoder", "language_config")
_TOLD: List[bool] = [False]


def _configs(model: nn.Module) -> list:
    """The configs of ``model`` and of its HF sub-models (deduplicated)."""
    found: dict = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            continue
        found[id(config)] = config
        for name in _SUBCONFIGS:
            sub = getattr(config, name, None)
            if sub is not None and hasattr(sub, "to_dict"):
                found[id(sub)] = sub
    return list(found.values())


def training_config(model: nn.Module) -> bool:
    """Turn the key/value cache of a HF model off for training (module docstring); returns
    whether anything changed. A warning says so the first time in a process."""
    changed = False
    for config in _configs(model):
        if getattr(config, "use_cache", False):
            config.use_cache = False
            changed = True
    if changed and not _TOLD[0]:
        _TOLD[0] = True
        warnings.warn(
            f"{type(model).__name__}: use_cache=True in its config; nest-fx turned the key/value cache "
            "off for training (config.use_cache=False): a training step never reads it",
            stacklevel=3,
        )
    return changed
