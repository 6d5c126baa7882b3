"""``plan.compile``: ``torch.compile`` on each block's forward.

Each block of the stage gets ``block.forward = torch.compile(block.forward)`` after TP, CP and
activation checkpointing have been applied and before FSDP: the compiled region is the block's
own computation (with its checkpoint policy, which dynamo traces), while the hooks that TP,
FSDP and sequence parallelism put on the block stay outside it, in eager mode. Parameter names
do not change (no ``OptimizedModule`` wrapper).

Backend: ``inductor``, torch's default, which generates C++ on CPU (it needs a C++ compiler:
``$CXX`` or ``g++``/``c++``/``clang++`` on the PATH) and Triton kernels on CUDA (it needs
``triton``). What is missing is named before training (:func:`compile_problem`).
``$NEST_FX_COMPILE_BACKEND`` picks another ``torch.compile`` backend (``aot_eager`` captures and
runs the same graphs without generating code: for debugging, and for the multi-rank tests, where
inductor's code generation would take most of the test time). Compiling happens on the first
``train_step`` (forward and backward graphs of each distinct block shape), and again when the
input shapes change: measured on this project's 2-core CPU machine, inductor takes about 30 s for
one small block's forward and backward, ``aot_eager`` about 2.5 s.

Under tensor (and sequence) parallelism the compiled region holds the TP styles' hooks of the
linears inside the block (``DTensor.from_local`` / ``redistribute`` / ``to_local``: dynamo
traces DTensor code into the graph), while the hooks on the block itself (sequence parallelism's
slice on the first block, gather on the last) run in eager mode before and after it. One thing
breaks at that boundary on torch 2.13: a block input that is a *view made inside a custom
autograd Function* (``DTensor.to_local`` returns ``local.view_as(local)``: the vocabulary-parallel
embedding's output, sequence parallelism's slice) gets no gradient from the compiled backward
(AOT autograd regenerates the view from its base and sends the gradient there), so the layers
before the block silently stop learning. :func:`compile_blocks` hands the compiled forward a
copy of such an input (one activation copy per step, at the stage's first block only).
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

BACKEND = "inductor"
BACKEND_ENV = "NEST_FX_COMPILE_BACKEND"
_CPU_COMPILERS = ("g++", "c++", "clang++")


def compile_backend() -> str:
    """The ``torch.compile`` backend: ``$NEST_FX_COMPILE_BACKEND`` or inductor."""
    return os.environ.get(BACKEND_ENV) or BACKEND


def compile_problem(device_type: str) -> str:
    """'' when ``torch.compile`` (inductor) can build kernels for ``device_type``, else what is missing."""
    if compile_backend() != "inductor":
        return ""
    if device_type == "cuda":
        from torch.utils._triton import has_triton  # torch's own probe; imported here: CUDA only

        if not has_triton():
            return "compile: torch.compile on CUDA needs triton (pip install triton), or set compile=false"
        return ""
    wanted = os.environ.get("CXX")
    if (wanted and shutil.which(wanted)) or any(shutil.which(c) for c in _CPU_COMPILERS):
        return ""
    return (
        "compile: torch.compile (inductor) on CPU needs a C++ compiler and none was found "
        f"({'$CXX=' + wanted + ', ' if wanted else ''}{', '.join(_CPU_COMPILERS)} not on the PATH); "
        "fix: install gcc (e.g. apt-get install g++) or set compile=false"
    )


def compile_blocks(module: nn.Module, block_names: Sequence[str], backend: Optional[str] = None) -> int:
    """Compile the forward of each named block of ``module`` (``backend``: :func:`compile_backend`
    when None); returns how many. Resets dynamo first (``torch._dynamo.reset``: code compiled
    earlier in this process, the user's included, is compiled again on its next call)."""
    backend = backend or compile_backend()
    # forget code compiled for an earlier model of this process: dynamo's cache is per code object
    # (the block class's forward), and recompiling it under another plan's guards failed on torch
    # 2.13 (CP x TP x SP after a TP model: a recursion without end building the graph)
    torch._dynamo.reset()
    for name in block_names:
        block = module.get_submodule(name)
        block.forward = _compiled(block.forward, backend)
    return len(block_names)


def compiled_loss(loss_fn: Callable, backend: Optional[str] = None) -> Callable:
    """``loss_fn`` compiled (``plan.loss_kernel=compile``; ``backend``: :func:`compile_backend`
    when None): inductor fuses a cross entropy into one kernel each way, which keeps the logits
    instead of fp32 log-probabilities (``nest_fx.workload.loss_terms``). Its inputs are owned as
    a block's are (module docstring)."""
    return _compiled(loss_fn, backend or compile_backend())


def _compiled(forward, backend: str):
    """``torch.compile(forward)`` that owns its tensor inputs (module docstring: views made by
    ``DTensor.to_local`` would lose their gradient)."""
    compiled = torch.compile(forward, backend=backend)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return compiled(*(_owned(a) for a in args), **{k: _owned(v) for k, v in kwargs.items()})

    return run


def _owned(value):
    """``value``, or a copy of it when it is a view that needs a gradient."""
    if isinstance(value, torch.Tensor) and value.requires_grad and value._is_view():
        return value.clone()
    return value
