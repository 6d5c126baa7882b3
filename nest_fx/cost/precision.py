"""What a plan's ``precision`` costs (the ``precision`` setting of ``nest_fx.plan.settings``).

=============  ========  ======  =====  ======  ======  ========================================
precision      compute   params  grads  reduce  master  optimizer states
=============  ========  ======  =====  ======  ======  ========================================
``fp32``       fp32      4       4      4       no      fp32 (Adam: 8 bytes/param)
``bf16-mixed`` bf16      2       2      4       fp32    fp32 (Adam: 8 + 4 master = 12)
``bf16-true``  bf16      2       2      2       no      bf16 (Adam: 4)
=============  ========  ======  =====  ======  ======  ========================================

``compute``: the dtype of the forward and backward (activation bytes: 4 or 2 per element;
matmul rate: the device's ``peak_flops`` for that dtype, ``Workload.for_runtime(dtype=...)``);
``params``: bytes per parameter held for compute; ``grads``: bytes per gradient held;
``reduce``: bytes per gradient element the data-parallel reduction moves (bf16-mixed reduces in
fp32, as FSDP2's ``MixedPrecisionPolicy(reduce_dtype=torch.float32)`` and Megatron's
``accumulate_allreduce_grads_in_fp32`` do); ``master``: the fp32 copy of the weights the
optimizer updates (the ZeRO paper's 2 + 2 + 12 bytes/param; fp32 training has 4 + 4 + 8, the
same 16 bytes with no second copy). A plan that records no precision (``""``) is costed as the
cost options say (their defaults are ``bf16-mixed``'s memory with bf16 gradient reduction, the
figures before precision was a setting) on the workload as it was built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional

from nest_fx.cost.options import CostOptions
from nest_fx.plan.vocabulary import DTYPE_OF_PRECISION


@dataclass(frozen=True)
class PrecisionCost:
    """The dtypes one precision trains in, as the cost model prices them (module docstring)."""

    compute_dtype: str  # "fp32" or "bf16": activations and forward/backward math
    param_bytes: int
    grad_bytes: int
    reduce_bytes: int
    master_weights: bool
    state_bytes: int  # optimizer state tensors


PRECISION_COSTS: Dict[str, PrecisionCost] = {
    "fp32": PrecisionCost(
        DTYPE_OF_PRECISION["fp32"], param_bytes=4, grad_bytes=4, reduce_bytes=4, master_weights=False, state_bytes=4
    ),
    "bf16-mixed": PrecisionCost(
        DTYPE_OF_PRECISION["bf16-mixed"],
        param_bytes=2,
        grad_bytes=2,
        reduce_bytes=4,
        master_weights=True,
        state_bytes=4,
    ),
    "bf16-true": PrecisionCost(
        DTYPE_OF_PRECISION["bf16-true"],
        param_bytes=2,
        grad_bytes=2,
        reduce_bytes=2,
        master_weights=False,
        state_bytes=2,
    ),
}


def precision_cost(precision: str) -> Optional[PrecisionCost]:
    """The dtypes of ``precision``; None for ``""`` (not recorded: the options and workload as given)."""
    if not precision:
        return None
    try:
        return PRECISION_COSTS[precision]
    except KeyError:
        raise ValueError(f"precision: {precision!r}, use one of {sorted(PRECISION_COSTS)}") from None


def priced_options(precision: str, options: CostOptions) -> CostOptions:
    """``options`` with the parameter, gradient, reduction and optimizer-state bytes of
    ``precision`` (``options`` itself when the precision is not recorded)."""
    p = precision_cost(precision)
    if p is None:
        return options
    return dataclasses.replace(
        options,
        param_bytes=p.param_bytes,
        grad_bytes=p.grad_bytes,
        reduce_bytes=p.reduce_bytes,
        master_weights=p.master_weights,
        state_bytes=p.state_bytes,
    )


def compute_dtype(precision: str) -> Optional[str]:
    """The dtype the forward and backward run in under ``precision``; None when not recorded."""
    p = precision_cost(precision)
    return p.compute_dtype if p else None


def default_precision(device) -> str:
    """The planner's precision on a ``DeviceSpec``: ``bf16-mixed`` where bf16 matrix units make
    bf16 faster than fp32 (every GPU preset) or fp32 has no rate (TPUs), ``fp32`` elsewhere (the
    ``cpu-gloo`` preset lists bf16 at the fp32 rate: no bf16 units, and fp32 keeps runs exact)."""
    bf16 = float(device.peak_flops.get("bf16", 0.0))
    fp32 = float(device.peak_flops.get("fp32", 0.0))
    return "bf16-mixed" if bf16 > fp32 else "fp32"
