"""``plan.async_tp``: PyTorch's micro-pipelined tensor parallelism on CUDA.

Under sequence parallelism each TP region all-gathers its input before its column matmuls and
reduce-scatters the row matmul's output. Async TP (Wang et al. 2022, "Overlap communication with
dependent computation via decomposition"; PyTorch's ``_micro_pipeline_tp``) has inductor rewrite
those ``all_gather -> mm`` and ``mm -> reduce_scatter`` pairs of each compiled block into fused
ops that split the matmul into per-rank pieces and move each piece over CUDA symmetric memory
while the next one computes. The numbers are those of the unfused pair (the same matmul, summed
in the same order per output element), so the parity of ``compile`` x TP x SP on CPU
(``tests/distributed/apply/test_compile_parallel.py``) is the parity of its arithmetic.

What it needs (``nest_fx.plan.may_run.unrun_combination`` and :func:`async_tp_problem`, before
training): ``tp > 1``, ``sequence_parallel`` (without it TP all-reduces, which the pass does not
fuse), ``compile`` with inductor (the rewrite is an inductor pass) and CUDA with symmetric
memory (NCCL ranks on GPUs). On CPU it is refused: gloo has no symmetric memory, and a plan
that asks for overlap must not run without it silently. The cost model prices it as
``CostOptions.overlap_tp_comm`` (the TP collectives under the stage's compute).
"""

from __future__ import annotations

import torch
from torch._inductor import config as inductor_config
from torch.distributed._symmetric_memory import enable_symm_mem_for_group
from torch.distributed.device_mesh import DeviceMesh

from nest_fx.apply.compile import BACKEND, compile_backend


def async_tp_problem(device_type: str) -> str:
    """'' when async TP can run on ``device_type`` with this compile backend, else what is missing."""
    missing = []
    if device_type != "cuda" or not torch.cuda.is_available():
        missing.append("no CUDA device (the runtime runs on CPU; gloo has no symmetric memory)")
    if compile_backend() != BACKEND:
        missing.append(f"the compile backend is {compile_backend()!r}, not inductor (whose pass fuses the collectives)")
    if not missing:
        return ""
    return (
        f"async_tp: micro-pipelined TP needs CUDA GPUs with symmetric memory and torch.compile's inductor; here: "
        f"{'; '.join(missing)}. fix: run on NCCL GPU ranks, or set async_tp=false (the same TP, collectives "
        "not overlapped)"
    )


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Switch on inductor's micro-pipeline TP pass and symmetric memory for ``tp_mesh``'s group
    (before the first compiled forward)."""
    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
