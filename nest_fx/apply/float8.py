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
(tensorwise dynamic scaling) recipe, before activation checkpointing, torch.compile and FSDP2;
FSDP2 all-gathers the high-precision weights. With ``tp > 1`` the TP styles would need torchao's
float8 variants: refused for now (``nest_fx.plan.may_run.unrun_fields``).
"""
from __future__ import annotations

import importlib.util
from typing import List, Sequence

import torch
import torch.nn as nn

FP8_CAPABILITY = (8, 9)


def float8_problem(device_type: str) -> str:
    """'' when Float8 training can run here, else everything that is missing, in one sentence."""
    missing = []
    if device_type != "cuda" or not torch.cuda.is_available():
        missing.append("no CUDA device (the runtime runs on CPU)")
    else:
        capability = torch.cuda.get_device_capability()
        if capability < FP8_CAPABILITY:
            missing.append(f"the GPU {torch.cuda.get_device_name()} (compute capability "
                           f"{capability[0]}.{capability[1]}) has no fp8 tensor cores (needs 8.9 or higher)")
    if importlib.util.find_spec("torchao") is None:
        missing.append("torchao is not installed (pip install 'nest-fx[float8]')")
    if not missing:
        return ""
    return ("float8: Float8 linears need an NVIDIA GPU with fp8 tensor cores (H100, L40, RTX 4090) and torchao; "
            f"here: {'; '.join(missing)}. fix: run on such a GPU with nest-fx[float8], or set float8=false")


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
