"""What an optimizer costs: state bytes, and per implementation of its step (``optimizer_kernel``:
torch's for-loop, foreach or fused code path) the update traffic, scratch and kernel launches.

The figures count fp32 optimizer math (the fp32 master copy of the weights in mixed precision,
or the fp32 parameters themselves) at torch's default hyperparameters (Adam without weight decay,
AdamW with it, SGD without weight decay), in the steady state (after the first step, which
creates the states). Each is counted from the code path of torch 2.13's ``torch.optim``
(``adam.py``: ``_single_tensor_adam``, ``_multi_tensor_adam``, ``_fused_adam``, which ``AdamW``
runs with ``decoupled_weight_decay``; ``sgd.py``: ``_single_tensor_sgd``, ``_multi_tensor_sgd``,
``_fused_sgd``) and, for the fused kernels, PyTorch's CUDA sources
(``aten/src/ATen/native/cuda/fused_adam_utils.cuh``: ``FusedAdamMathFunctor`` loads param,
grad, exp_avg, exp_avg_sq and stores param, exp_avg, exp_avg_sq, the grad only under a
``GradScaler``; ``FusedSgdKernel.cu``: ``FusedSgdMathFunctor`` loads param, grad, the momentum
buffer and stores param and the buffer). One pass of an elementwise op moves each tensor it
reads and writes once (4 B per element each; ``addcmul_(v, g, g)`` reads ``g`` once).

Update bytes per parameter (read + write):

================  ========================================================  ==========  ==========  =====
optimizer         passes of the for-loop and foreach paths (the same ops)   for-loop    foreach     fused
================  ========================================================  ==========  ==========  =====
``adam``          ``lerp_(m, g)`` 12, ``v.mul_`` 8, ``v.addcmul_(g, g)``    72          72          28
                  12, ``sqrt(v)`` 8 (new), ``div_`` 8, ``add_(eps)`` 8,
                  ``p.addcdiv_(m, denom)`` 16
``adamw``         Adam's + ``p.mul_(1 - lr wd)`` 8 (decoupled decay)         80          80          28
``sgd-momentum``  ``buf.mul_`` 8, ``buf.add_(g)`` 12, ``p.add_(buf)`` 12    32          32          20
``sgd``           ``p.add_(g)`` 12                                          12          12          12
================  ========================================================  ==========  ==========  =====

fused: one kernel per step over all tensors (``torch._fused_adam_`` / ``_fused_adamw_``: read
grad, param, m, v, write param, m, v = 16 + 12; AdamW's decay is applied in registers;
``_fused_sgd_``: grad, param, buffer read, param and buffer written = 12 + 8; without
momentum 8 + 4).

Scratch (allocated by the step, freed after it):

* foreach Adam(W): ``torch._foreach_sqrt(exp_avg_sqs)`` makes a new fp32 tensor for every
  parameter at once (then divided and shifted in place): 4 B per updated parameter;
* for-loop Adam(W): per tensor, ``(exp_avg_sq.sqrt() / bias_correction2_sqrt)`` holds two
  temporaries of that tensor at once (the square root and the quotient) while the previous
  tensor's ``denom`` is still referenced by the loop's variable: at most 3 x 4 = 12 B per element
  of the largest tensor (exact when two tensors of that size follow each other, as a block's
  projections do; the allocator reuses the blocks for the next tensors);
* SGD (any path) and every fused kernel update in place: 0.

Kernel launches: the for-loop launches one kernel per op per parameter tensor (Adam 7, AdamW 8,
SGD with momentum 3, SGD 1); foreach and fused launch a few per step whatever the tensor count.
The workload does not record a stage's tensor count, so the launches are listed
(``launches_per_tensor``), not priced: the for-loop is priced by its bytes, a lower bound of its
time on a GPU (torch's default there is foreach).

``optimizer_kernel`` '' is torch's own default (``torch.optim.optimizer._default_to_fused_or_foreach``
with ``use_fused=False``: foreach when every parameter is on a foreach device such as CUDA, else the
for-loop): priced as foreach on GPU devices and as the for-loop on a device named ``cpu``
(:func:`resolved_kernel`).

``states``: bytes of optimizer state tensors (the ZeRO paper's K without the master copy,
Rajbhandari et al. 2020 sec. 3.1: Adam's m and v are 4 + 4; SGD's momentum buffer 4; PyTorch's
SGD default, momentum 0, keeps none). Time: the step is memory-bound,
``T_opt = params * update B / (W * efficiency)`` (``CostOptions.optimizer_mem_efficiency``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from nest_fx.cost.arg_checks import require_choice
from nest_fx.plan.vocabulary import OPTIMIZER_KERNELS
from nest_fx.workload.roofline import DECOMPOSED_NORM_DEVICE

# a device named so runs torch's CPU backend (the roofline's rule), where torch's default step is the for-loop
CPU_DEVICE = DECOMPOSED_NORM_DEVICE
FP32 = 4  # bytes per element of the optimizer's math


@dataclass(frozen=True)
class KernelCost:
    """Per-parameter costs of one implementation of one optimizer's step (module docstring)."""

    update_bytes: float  # memory traffic of one step per updated parameter
    scratch_bytes: float = 0.0  # allocated at once per updated parameter (foreach's temporaries)
    tensor_scratch_bytes: float = 0.0  # per element of the largest tensor (the for-loop's temporaries, at most)
    launches_per_tensor: int = 0  # kernels per parameter tensor (for-loop); 0: a few per step


@dataclass(frozen=True)
class OptimizerCost:
    """Per-parameter costs of one optimizer: its states and each implementation of its step."""

    state_bytes: float  # optimizer state tensors, without the master copy
    kernels: Mapping[str, KernelCost]

    def kernel(self, name: str) -> KernelCost:
        """The costs of implementation ``name`` (``for-loop``, ``foreach``, ``fused``)."""
        return self.kernels[name]


def _passes(*ops: int) -> float:
    """Bytes of elementwise passes, each given as the number of fp32 tensors it reads and writes."""
    return float(FP32 * sum(ops))


# Adam's for-loop / foreach passes (module docstring): lerp_ 3, mul_ 2, addcmul_ 3, sqrt 2, div_ 2, add_ 2, addcdiv_ 4
_ADAM = _passes(3, 2, 3, 2, 2, 2, 4)  # 72
_DECAY = _passes(2)  # AdamW's p.mul_(1 - lr wd): 8
_SGD_MOMENTUM = _passes(2, 3, 3)  # buf.mul_, buf.add_(g), p.add_(buf): 32
_SGD = _passes(3)  # p.add_(g): 12

OPTIMIZERS: Dict[str, OptimizerCost] = {
    "adam": OptimizerCost(
        state_bytes=8,
        kernels={
            "for-loop": KernelCost(_ADAM, tensor_scratch_bytes=3 * FP32, launches_per_tensor=7),
            "foreach": KernelCost(_ADAM, scratch_bytes=FP32),
            "fused": KernelCost(_passes(4 + 3)),  # 28
        },
    ),
    "adamw": OptimizerCost(
        state_bytes=8,
        kernels={
            "for-loop": KernelCost(_ADAM + _DECAY, tensor_scratch_bytes=3 * FP32, launches_per_tensor=8),
            "foreach": KernelCost(_ADAM + _DECAY, scratch_bytes=FP32),
            "fused": KernelCost(_passes(4 + 3)),  # 28: the decay in registers
        },
    ),
    "sgd-momentum": OptimizerCost(
        state_bytes=4,
        kernels={
            "for-loop": KernelCost(_SGD_MOMENTUM, launches_per_tensor=3),
            "foreach": KernelCost(_SGD_MOMENTUM),
            "fused": KernelCost(_passes(3 + 2)),  # 20
        },
    ),
    "sgd": OptimizerCost(
        state_bytes=0,
        kernels={
            "for-loop": KernelCost(_SGD, launches_per_tensor=1),
            "foreach": KernelCost(_SGD),
            "fused": KernelCost(_passes(2 + 1)),  # 12
        },
    ),
}
MASTER_WEIGHT_BYTES = 4  # the fp32 copy of bf16/fp16 weights the optimizer updates


def optimizer_cost(name: object) -> OptimizerCost:
    """The costs of optimizer ``name``; ValueError listing the known names otherwise."""
    hint = "sgd is PyTorch's default SGD without momentum; sgd-momentum keeps a momentum buffer"
    return OPTIMIZERS[require_choice(name, "optimizer", tuple(OPTIMIZERS), hint)]


def kernel_value_problem(kernel: object) -> str:
    """'' when ``kernel`` is an ``optimizer_kernel`` value ('' or one of ``OPTIMIZER_KERNELS``), else why not."""
    if kernel == "" or kernel in OPTIMIZER_KERNELS:
        return ""
    return f"optimizer_kernel: must be '' (torch's default) or one of {list(OPTIMIZER_KERNELS)}, got {kernel!r}"


def resolved_kernel(kernel: str, device: Optional[object] = None) -> str:
    """The implementation ``optimizer_kernel`` ``kernel`` runs on ``device`` (a ``DeviceSpec``):
    itself when named; '' is torch's default, the for-loop on a CPU device and foreach elsewhere
    (also when no device is known: the GPU's)."""
    if kernel:
        return kernel
    name = str(getattr(device, "name", "")).lower()
    return "for-loop" if name.startswith(CPU_DEVICE) else "foreach"


def step_cost(optimizer: str, kernel: str = "", device: Optional[object] = None) -> KernelCost:
    """The per-parameter costs of ``optimizer``'s step as ``kernel`` runs it on ``device``."""
    return optimizer_cost(optimizer).kernel(resolved_kernel(kernel, device))
