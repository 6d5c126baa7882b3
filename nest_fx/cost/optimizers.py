"""What an optimizer costs: state bytes, update traffic and step scratch per parameter.

The figures count fp32 optimizer math (the fp32 master copy of the weights in mixed precision,
or the fp32 parameters themselves), as PyTorch's ``torch.optim`` and Megatron's distributed
optimizer run it. Per parameter:

========================  ======  ===========  =======  ==================================================
optimizer                 states  update B     scratch  update passes (read + write, fp32)
========================  ======  ===========  =======  ==================================================
``adam``                  8       36           4        one pass over grad, param, m, v (4 + 8 + 8 + 8 = 28)
                                                        + the ``sqrt(v) + eps`` denominator written and
                                                        read once (8)
``adamw``                 8       44           4        Adam + the decoupled weight decay, a separate
                                                        multiply of the parameters (8) in the foreach
                                                        implementation
``sgd-momentum``          4       20           0        one pass over grad, param, momentum (4 + 8 + 8)
``sgd``                   0       12           0        ``param -= lr * grad``: grad, param (4 + 8);
                                                        PyTorch's SGD default (momentum 0) keeps no state
========================  ======  ===========  =======  ==================================================

``states``: bytes of optimizer state tensors (the ZeRO paper's K without the master copy,
Rajbhandari et al. 2020 sec. 3.1: Adam's m and v are 4 + 4); ``update B``: bytes the step moves
through device memory (it is memory-bound: ``T_opt = params * update B / (W * efficiency)``);
``scratch``: bytes the foreach step allocates at once (Adam's fp32 denominator for all
parameters). The Adam figure is the cost model's earlier constant (36 B/param); the others
follow the same accounting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class OptimizerCost:
    """Per-parameter costs of one optimizer (see the module docstring)."""

    state_bytes: float  # optimizer state tensors, without the master copy
    update_bytes: float  # memory traffic of one step
    scratch_bytes: float  # temporary allocation of one foreach step


OPTIMIZERS: Dict[str, OptimizerCost] = {
    "adam": OptimizerCost(state_bytes=8, update_bytes=36, scratch_bytes=4),
    "adamw": OptimizerCost(state_bytes=8, update_bytes=44, scratch_bytes=4),
    "sgd-momentum": OptimizerCost(state_bytes=4, update_bytes=20, scratch_bytes=0),
    "sgd": OptimizerCost(state_bytes=0, update_bytes=12, scratch_bytes=0),
}
MASTER_WEIGHT_BYTES = 4  # the fp32 copy of bf16/fp16 weights the optimizer updates


def optimizer_cost(name: object) -> OptimizerCost:
    """The costs of optimizer ``name``; ValueError listing the known names otherwise."""
    if not isinstance(name, str) or name not in OPTIMIZERS:
        raise ValueError(
            f"optimizer: must be one of {list(OPTIMIZERS)}, got {name!r} (sgd is PyTorch's default "
            "SGD without momentum; sgd-momentum keeps a momentum buffer)"
        )
    return OPTIMIZERS[name]
