"""The collectives a training step issues, counted by kind.

:class:`CollectiveCounter` is a ``TorchDispatchMode`` that counts every c10d collective
dispatched while it is active: the functional collectives DTensor issues
(``_c10d_functional.all_reduce`` ...) and the in-place ones of ``torch.distributed``
(``c10d.allreduce_`` ...), forward and backward alike (autograd runs the backward under the mode
of the thread that called it). It is how the tests and ``scripts/bench_tp_collectives.py``
check that the runtime runs the collectives the cost model prices
(``LayerCost.collective_counts``), and with each call's phase and bytes the ``Comm``s it prices
(``CollectiveCounter.calls``). It also records the bytes of each point-to-point send and
receive (``c10d.send`` / ``c10d.recv_``: the pipeline's stage boundaries), which
``cost.step_time.boundary_bytes`` prices.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# substrings of c10d op names -> the cost model's collective kinds (workload.types.Comm.kind)
_KINDS = (
    ("reduce_scatter", "reduce_scatter"),
    ("all_gather", "all_gather"),
    ("allgather", "all_gather"),
    ("all_reduce", "all_reduce"),
    ("allreduce", "all_reduce"),
    ("all_to_all", "all_to_all"),
    ("alltoall", "all_to_all"),
)
# waits and other bookkeeping ops of the functional collectives carry no data of their own
_IGNORED = ("wait_tensor", "coalesced")


def collective_kind(op_name: str) -> str:
    """The collective kind of a dispatched op's name ('' when it is not a collective)."""
    if not (op_name.startswith("c10d.") or op_name.startswith("_c10d_functional.")):
        return ""
    if any(word in op_name for word in _IGNORED):
        return ""
    return next((kind for word, kind in _KINDS if word in op_name), "")


def _nbytes(value) -> int:
    """Bytes of a tensor, or of the tensors of a (nested) list or tuple; 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: step()`` -> ``c.counts`` ({kind: how many}), ``c.calls``
    ({(kind, phase, bytes): how many}) and ``c.sent`` / ``c.received`` (the bytes of each
    point-to-point send / receive: the pipeline's stage boundaries).

    A call's bytes are its whole buffer, as ``workload.types.Comm.nbytes`` counts them: the
    largest of its arguments and its result (an all-gather's gathered output, a reduce-scatter's
    input); its phase is "bwd" when autograd's engine runs it (a backward node, including the
    forward a checkpoint re-runs there), else "fwd"."""

    def __init__(self):
        super().__init__()
        self._counts: Counter = Counter()
        self._calls: Counter = Counter()
        self.sent: List[int] = []
        self.received: List[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        kind = collective_kind(name)
        out = func(*args, **(kwargs or {}))
        if kind:
            self._counts[kind] += 1
            phase = "bwd" if torch._C._current_autograd_node() is not None else "fwd"
            self._calls[kind, phase, max([_nbytes(a) for a in args] + [_nbytes(out)])] += 1
        elif name.startswith("c10d.send") or name.startswith("c10d.recv"):
            into = self.sent if name.startswith("c10d.send") else self.received
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            into.append(sum(t.numel() * t.element_size() for t in tensors))
        return out

    @property
    def counts(self) -> Dict[str, int]:
        """{collective kind: how many were dispatched}."""
        return dict(self._counts)

    @property
    def calls(self) -> Dict[Tuple[str, str, int], int]:
        """{(collective kind, "fwd" | "bwd", bytes): how many were dispatched}."""
        return dict(self._calls)
