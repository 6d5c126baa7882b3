"""``plan.float8``: Float8 training of the blocks' linears through torchao.

Float8 matmuls need an NVIDIA GPU with fp8 tensor cores (compute capability 8.9 or higher:
H100/H200, L4/L40, RTX 40xx) and torchao (``pip install 'nest-fx[float8]'``). Before training,
:func:`float8_problem` names everything that is missing (no CUDA device, a GPU without fp8
tensor cores, no torchao) and the runtime refuses the plan with it; nothing falls back to
bf16 silently.

What is converted (:func:`float8_linear_filter`): the ``nn.Linear`` layers inside the blocks
whose input and output sizes are multiples of 16 (the fp8 GEMM's alignment); the embedding, the
LM head and everything outside the blocks stay in their dtype (torchtitan does the same for the
output layer). Conversion uses ``torchao.float8.convert_to_float8_training`` with its default
(tensorwise dynamic scaling) recipe, before tensor parallelism, activation checkpointing,
torch.compile and FSDP2; FSDP2 all-gathers the high-precision weights.

With tensor parallelism (as torchtitan runs it without its float8 all-gather option): the TP
styles shard the Float8 linears' weights like any linear's, each rank casts its shards and
inputs to fp8 with the *global* tensorwise scale (torchao reduces the amax of a DTensor over
its mesh) and runs the fp8 matmul on its shard; the collectives carry the high-precision
activations, as the cost model prices them. torchao's ``Float8ColwiseParallel`` /
``Float8RowwiseParallel`` (fp8 all-gathers under sequence parallelism) are not used.

``$NEST_FX_FLOAT8_EMULATE=1`` lets Float8 run on CPU through torch's CPU ``_scaled_mm`` (fp8
values, fp32 accumulation, no fp8 units: slow): for the multi-rank parity tests only.
"""

from __future__ import annotations

import importlib.util
import os
from typing import List, Sequence

import torch
import torch.nn as nn

FP8_CAPABILITY = (8, 9)
EMULATE_ENV = "NEST_FX_FLOAT8_EMULATE"


def float8_problem(device_type: str) -> str:
    """'' when Float8 training can run here, else everything that is missing, in one sentence."""
    missing = []
    if device_type != "cuda" and os.environ.get(EMULATE_ENV) == "1":
        pass  # emulated on CPU (module docstring): tests only
    elif device_type != "cuda" or not torch.cuda.is_available():
        missing.append("no CUDA device (the runtime runs on CPU)")
    else:
        capability = torch.cuda.get_device_capability()
        if capability < FP8_CAPABILITY:
            missing.append(
                f"the GPU {torch.cuda.get_device_name()} (compute capability "
                f"{capability[0]}.{capability[1]}) has no fp8 tensor cores (needs 8.9 or higher)"
            )
    if importlib.util.find_spec("torchao") is None:
        missing.append("torchao is not installed (pip install 'nest-fx[float8]')")
    if not missing:
        return ""
    return (
        "float8: Float8 linears need an NVIDIA GPU with fp8 tensor cores (H100, L40, RTX 4090) and torchao; "
        f"here: {'; '.join(missing)}. fix: run on such a GPU with nest-fx[float8], or set float8=false"
    )


def float8_linear_filter(module: nn.Module, fqn: str) -> bool:
    """Whether the linear ``module`` at ``fqn`` is converted: both sizes multiples of 16."""
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(module: nn.Module, block_names: Sequence[str]) -> List[str]:
    """Convert the eligible linears of the named blocks to torchao Float8 linears; returns their paths."""
    from torchao.float8 import convert_to_float8_training  # optional extra (nest-fx[float8])

    converted: List[str] = []
    for name in block_names:
        block = module.get_submodule(name)
        eligible = [f"{name}.{p}" for p, m in block.named_modules() if p and float8_linear_filter(m, p)]
        convert_to_float8_training(block, module_filter_fn=float8_linear_filter)
        converted.extend(eligible)
    return converted
