"""What a model takes: the example inputs the tracer needs and the batches a training check feeds.

An :class:`Example` lists a model's inputs (:class:`InputSpec`: name, shape, dtype, id range)
and how it is trained: with a ``loss_fn(output, target)`` on a separate target (zoo LMs: token
cross entropy; plain classifiers: class cross entropy), or with the model's own loss computed
from a ``labels`` input (HuggingFace models, ``loss="model"``). The tracer and the planner use
the inputs without labels; :func:`make_batch` draws real tensors for them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

import torch

from nest_fx.common.errors import ModelError

DEFAULT_SEQ = 32  # tokens per example of an HF model without a sequence length (tests, tiny runs)
# Planning an HF model without --seq: its config's positions (max_position_embeddings), at most
# this many tokens; a long-context model (Llama 3: 131,072 positions) is planned at a typical
# training length, not at its longest. docs/plan_format.md
PLAN_SEQ_CAP = 4096


@dataclass(frozen=True)
class InputSpec:
    """One tensor input: integer ids in ``[0, high)`` when ``high`` > 0, else normal floats."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype = torch.long
    high: int = 0
    positional: bool = False  # passed positionally (zoo and plain models) rather than by keyword


@dataclass
class Example:
    """A model's inputs and its loss: ``"lm"`` (token cross entropy on ``target``), ``"classify"``
    (class cross entropy on ``target``) or ``"model"`` (the model's own loss from its ``labels``)."""

    inputs: List[InputSpec]
    loss: str
    target: Optional[InputSpec] = None
    labels: List[InputSpec] = field(default_factory=list)  # extra inputs of loss="model"


def make_tensor(spec: InputSpec, device: Any = "meta", generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A tensor for ``spec``: uninitialised on meta, random (ids or normals) elsewhere."""
    if torch.device(device).type == "meta":
        return torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    if spec.high:
        return torch.randint(0, spec.high, spec.shape, generator=generator, dtype=spec.dtype).to(device)
    return torch.randn(spec.shape, generator=generator, dtype=spec.dtype).to(device)


def make_batch(
    example: Example, device: Any = "cpu", generator: Optional[torch.Generator] = None, *, labels: bool = True
) -> Tuple[Dict[str, torch.Tensor], Optional[torch.Tensor]]:
    """(model inputs by name, target) of one batch; the labels inputs of ``loss="model"`` included
    when ``labels``. Names of positional inputs keep the forward's order."""
    specs = example.inputs + (example.labels if labels else [])
    inputs = {s.name: make_tensor(s, device, generator) for s in specs}
    target = make_tensor(example.target, device, generator) if example.target is not None else None
    return inputs, target


def call_args(example: Example, inputs: Dict[str, torch.Tensor]) -> Tuple[tuple, dict]:
    """``(args, kwargs)`` for ``model(*args, **kwargs)`` from named inputs."""
    positional = {s.name for s in example.inputs if s.positional}
    args = tuple(inputs[s.name] for s in example.inputs if s.positional)
    return args, {k: v for k, v in inputs.items() if k not in positional}


def token_example(batch: int, seq: int, vocab: int) -> Example:
    """A zoo language model: token ids in, token targets for the LM loss."""
    return Example(
        [InputSpec("tokens", (batch, seq), high=vocab, positional=True)],
        "lm",
        target=InputSpec("target", (batch, seq), high=vocab),
    )


def _max_positions(config) -> Optional[int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _image_shape(config) -> Tuple[int, int, int]:
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", 224)
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    return getattr(vision, "num_channels", 3), height, width


def hf_example(model: torch.nn.Module, batch: int, seq: Optional[int] = None, seq_cap: Optional[int] = None) -> Example:
    """The inputs a HuggingFace model takes (token ids, decoder ids, pixel values) and its labels.
    Without ``seq``: :data:`DEFAULT_SEQ` tokens, or with ``seq_cap`` the config's positions up to
    ``seq_cap`` (what the planner plans for)."""
    config = model.config
    params = inspect.signature(model.forward).parameters
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    limit = _max_positions(config)
    if seq is None:
        default = seq_cap or DEFAULT_SEQ
        seq = min(default, limit) if limit else default
    elif limit and seq > limit:
        raise ModelError(
            f"seq={seq} exceeds {type(model).__name__}'s {limit} positions: use --seq <= {limit} "
            f"or a larger max_position_embeddings=... in the name"
        )
    inputs: List[InputSpec] = []
    if "input_ids" in params and isinstance(vocab, int):
        inputs.append(InputSpec("input_ids", (batch, seq), high=vocab))
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            inputs.append(InputSpec("decoder_input_ids", (batch, seq), high=vocab))
    elif "pixel_values" in params:
        inputs.append(InputSpec("pixel_values", (batch, *_image_shape(config)), dtype=torch.float32))
    if not inputs:
        needs = [n for n in params if n not in ("self", "kwargs", "args")][:3]
        raise ModelError(
            f"{type(model).__name__} takes {needs}: nest-fx makes example inputs for token ids and "
            "images only; build the model yourself and pass example_inputs to auto_parallelize"
        )
    labels: List[InputSpec] = []
    if "labels" in params:
        name = type(model).__name__
        if name.endswith(("ForImageClassification", "ForSequenceClassification")):
            labels.append(InputSpec("labels", (batch,), high=getattr(config, "num_labels", 2)))
        elif "input_ids" in params and isinstance(vocab, int):
            labels.append(InputSpec("labels", (batch, seq), high=vocab))
    return Example(inputs, "model" if labels else "none", labels=labels)


def with_loss_fn(example: Example) -> Example:
    """A model-loss example trained with a ``loss_fn`` on the output instead: its labels become the
    target (token ids: the LM loss; one class per row: class cross entropy)."""
    if example.loss != "model" or len(example.labels) != 1:
        return example
    label = example.labels[0]
    return Example(example.inputs, "lm" if len(label.shape) == 2 else "classify", target=replace(label, name="target"))
