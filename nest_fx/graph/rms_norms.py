"""Which modules of a model are RMSNorms that ``F.rms_norm`` computes (:func:`rms_norm_modules`).

PyTorch ships RMSNorm as one op, ``F.rms_norm``; on CUDA it runs ``aten._fused_rms_norm``, one
kernel forward and one backward, whose autograd keeps the input, the weight and one fp32
reciprocal root mean square per row (torch's ``derivatives.yaml``; ``FusedRmsNormBackward0``
saves ``input``, ``weight`` and ``result1``). Models written like HF's ``LlamaRMSNorm`` or Meta's
reference compute the same function op by op in fp32 (``x.float()``, ``pow``, ``mean``,
``rsqrt``, ``mul``, cast back, ``* weight``): several kernels and fp32 copies kept for backward.
nest-fx's runtime runs the modules found here with ``F.rms_norm`` (``apply/fused_norms.py``,
``plan.norm_kernel``) and the cost model prices them as one fused op (``workload/fused_norms.py``).

A module is taken when

1. its structure is a norm's: one 1-D parameter ``weight``, no other parameters, no buffers, no
   submodules, and a float epsilon in ``eps`` or ``variance_epsilon`` (``None`` only for
   ``torch.nn.RMSNorm``: ``F.rms_norm``'s default); and
2. the forward of a deep copy of it (its hooks left out: the swap replaces the forward only),
   given a random weight and random fp32 rows at three scales (mean squares near 1, 1e-4 and
   1e-6, so the epsilon shows), returns ``F.rms_norm(x, (d,), weight, eps)`` to fp32 rounding.
   A norm computing anything else (Gemma's ``x * (1 + weight)``, a mean subtracted, another
   epsilon, a cast to another dtype) fails the probe and keeps its own code.

``torch.nn.RMSNorm`` calls ``F.rms_norm`` itself: it is :data:`NATIVE` (fused whatever the plan
says); a recognised module of the model's own code is :data:`MODEL`.
"""

from __future__ import annotations

import copy
from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

NATIVE = "native"  # torch.nn.RMSNorm: its forward is F.rms_norm already
MODEL = "model"  # the model's own code computes F.rms_norm's function: the runtime may swap it
EPS_NAMES = ("eps", "variance_epsilon")
# the probe: rows at three scales, fp32, compared to fp32 rounding
PROBE_SCALES = (1.0, 1e-2, 1e-3)
PROBE_ROWS = 4
PROBE_RTOL = 1e-5
PROBE_ATOL = 1e-6
_UNSET = object()


def rms_norm_eps(module: nn.Module):
    """The epsilon of a module shaped like an RMSNorm (one 1-D ``weight``, nothing else, a float
    ``eps``/``variance_epsilon``), else :data:`_UNSET`. ``None`` only for ``torch.nn.RMSNorm``."""
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if set(params) != {"weight"} or weight is None or weight.dim() != 1:
        return _UNSET
    if any(True for _ in module.buffers()) or any(True for _ in module.children()):
        return _UNSET
    for name in EPS_NAMES:
        eps = getattr(module, name, _UNSET)
        if isinstance(eps, float) and not isinstance(eps, bool):
            return eps
        if eps is None and isinstance(module, nn.RMSNorm):
            return None
    return _UNSET


def computes_rms_norm(module: nn.Module, eps: Optional[float]) -> bool:
    """Whether ``module`` returns ``F.rms_norm(x, (d,), weight, eps)`` on the probe (module
    docstring), run on a CPU deep copy with a random weight (the module itself is not touched)."""
    weight = module.weight
    d = int(weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    try:
        probe = copy.deepcopy(module)
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.is_meta:
            probe = probe.to_empty(device="cpu").float()
        with torch.no_grad():
            probe.weight.copy_(torch.rand(d, generator=gen) + 0.5)
            x = torch.randn(len(PROBE_SCALES), PROBE_ROWS, d, generator=gen)
            x = x * torch.tensor(PROBE_SCALES).view(-1, 1, 1)
            got = probe.forward(x)  # what the swap replaces: the forward, not the hooks around it
            want = F.rms_norm(x, (d,), probe.weight, eps)
    except Exception:  # noqa: BLE001 - a module the probe cannot run is not one we can swap
        return False
    return (
        isinstance(got, torch.Tensor)
        and got.shape == want.shape
        and got.dtype == want.dtype
        and bool(torch.allclose(got, want, rtol=PROBE_RTOL, atol=PROBE_ATOL))
    )


def rms_norm_kind(module: nn.Module) -> str:
    """:data:`NATIVE` for a ``torch.nn.RMSNorm`` with a weight, :data:`MODEL` for a module whose
    own forward computes ``F.rms_norm`` (module docstring), else ''."""
    eps = rms_norm_eps(module)
    if eps is _UNSET:
        return ""
    if type(module) is nn.RMSNorm:
        return NATIVE
    return MODEL if computes_rms_norm(module, eps) else ""


def rms_norm_modules(model: nn.Module) -> Dict[str, str]:
    """{module FQN: :data:`NATIVE` | :data:`MODEL`} of the RMSNorms in ``model`` (each probed)."""
    out: Dict[str, str] = {}
    for name, module in model.named_modules():
        kind = rms_norm_kind(module)
        if kind:
            out[name] = kind
    return out


def module_eps(module: nn.Module) -> Optional[float]:
    """The epsilon ``F.rms_norm`` runs a recognised module with (``rms_norm_eps``)."""
    eps = rms_norm_eps(module)
    if eps is _UNSET:
        raise ValueError(f"{type(module).__name__} is not an RMSNorm-shaped module")
    return eps
