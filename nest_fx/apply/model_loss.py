"""The loss a model computes itself (``loss_fn=None``): HF's ``output.loss`` from its labels,
nanoGPT's ``(logits, loss)`` from its targets. The runtime's steps and the pipeline's last stage
read it the same way."""

from __future__ import annotations

import torch

from nest_fx.apply.checks import ApplyError


def model_loss(output) -> torch.Tensor:
    """The loss a model computed itself: ``output.loss`` (HF ``ModelOutput``), ``output["loss"]``, or
    the one scalar of a returned tuple (nanoGPT's ``(logits, loss)``); ApplyError when it returned
    none (no labels or targets given)."""
    if isinstance(output, (tuple, list)):
        scalars = [v for v in output if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()]
        loss = scalars[0] if len(scalars) == 1 else None
    else:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ApplyError(
            f"loss_fn=None trains on the model's own loss, but its {type(output).__name__} output holds "
            "no loss (one scalar tensor); fix: give the model its targets (train_step(inputs, targets) "
            "passes them as forward's next argument, e.g. nanoGPT's forward(idx, targets); HF: "
            "inputs['labels']) or give auto_parallelize a loss_fn"
        )
    return loss
