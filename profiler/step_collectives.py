"""The collectives a training step issues, counted by kind.

:class:`CollectiveCounter` is a ``TorchDispatchMode`` that counts every c10d collective
dispatched while it is active: the functional collectives DTensor issues
(``_c10d_functional.all_reduce`` ...) and the in-place ones of ``torch.distributed``
(``c10d.allreduce_`` ...), forward and backward alike (autograd runs the backward under the mode
of the thread that called it). It is how the tests and ``scripts/bench_tp_collectives.py``
check that the runtime runs the collectives the cost model prices
(``LayerCost.collective_counts``).
"""

from __future__ import annotations

from collections import Counter
from typing import Dict

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


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: step()`` -> ``c.counts`` ({kind: how many})."""

    def __init__(self):
        super().__init__()
        self._counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = collective_kind(str(func))
        if kind:
            self._counts[kind] += 1
        return func(*args, **(kwargs or {}))

    @property
    def counts(self) -> Dict[str, int]:
        """{collective kind: how many were dispatched}."""
        return dict(self._counts)
