"""The rows expert parallelism's all-to-alls send, per MoE layout and routing (docs/cost_model.md,
"Expert dispatch").

The trace prices a block's expert all-to-all at what its experts output on one rank, ``a2a_bytes``:
one row per routed (token, choice) pair, or per capacity slot for the zoo MoE's fixed buffer
``[B, E, C, H]``. The runtime (``apply.expert_parallel``) sends:

* the zoo MoE's capacity buffer whole, slot by slot (``slots``): the traced bytes;
* HuggingFace stacked experts once per (token, owner rank) (``per-rank``): a token whose k experts
  live on r distinct ranks goes to each of them once, and each rank returns one row, its experts'
  weighted sum, as DeepEP's dispatch and combine do.

To price another system's dispatch, the ``expert_dispatch`` setting names it (``slots``: one row per
routed pair or slot, as Megatron-LM's all-to-all dispatcher; ``per-rank``: DeepEP's); nest-fx's
runtime refuses a plan priced so (``plan.may_run.unrun_constraints``).

How many ranks r a token reaches depends on the routing (the ``expert_routing`` setting), with k
of E experts per token and L = E / e experts on each of e ranks:

* ``uniform``: the k experts anywhere (a learned router). A rank owns none of them with
  probability C(E - L, k) / C(E, k), so r = e (1 - C(E - L, k) / C(E, k)): Qwen3-30B-A3B (E = 128,
  k = 8) at e = 8, r = 5.30, 66% of the pairs.
* ``contiguous``: k consecutive experts from a multiple of k (token t takes experts kt ... kt + k - 1
  mod E: NeMo AutoModel's balanced benchmark gate, ``FakeBalancedGate`` without noise): r = the
  rank blocks that run covers, averaged over t; Qwen3-30B-A3B at e = 8: 1.

``per-rank`` sends r rows per token (r / k of the pairs' rows; the zoo's slots hold ``capacity_factor``
times the pairs). The k expert ids and weights each row carries (under 3% of a row at 2,048 hidden
units) are not priced.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from math import comb, gcd
from typing import TYPE_CHECKING, Iterable, Tuple

if TYPE_CHECKING:
    from nest_fx.workload.types import Comm

# the settings' values (the plan's vocabulary lists the same names: plan.vocabulary)
EXPERT_ROUTINGS = ("uniform", "contiguous")
DISPATCHES = ("slots", "per-rank")


@lru_cache(maxsize=None)
def owner_ranks_per_token(experts: int, top_k: int, ep: int, routing: str = "uniform") -> float:
    """Expected number of distinct ranks owning a token's ``top_k`` experts when ``ep`` ranks hold
    ``experts / ep`` each, under ``routing`` (one of ``EXPERT_ROUTINGS``; '' = uniform)."""
    routing = routing or EXPERT_ROUTINGS[0]
    if routing not in EXPERT_ROUTINGS:
        raise ValueError(f"unknown expert routing {routing!r}; use one of {', '.join(EXPERT_ROUTINGS)}")
    if ep <= 1 or experts <= 0 or top_k <= 0:
        return 1.0
    local = experts // ep
    k = min(top_k, experts)
    if routing == "uniform":
        return ep * (1.0 - comb(experts - local, k) / comb(experts, k))
    starts = [k * t % experts for t in range(experts // gcd(k, experts))]  # one period of the gate
    return sum(len({(s + j) % experts // local for j in range(k)}) for s in starts) / len(starts)


def dispatch_bytes(
    slot_bytes: float, token_bytes: float, runtime: str, experts: int, top_k: int, ep: int
) -> Tuple[float, Tuple[Tuple[str, str, float], ...]]:
    """(bytes as the runtime sends them under the default routing, ((dispatch, routing, bytes) for
    every dispatch and routing, dispatch '' being the runtime's ``runtime``)) of an expert all-to-all:
    ``slots`` sends ``slot_bytes`` (the traced pairs or capacity slots), ``per-rank`` the tokens'
    ``token_bytes`` times :func:`owner_ranks_per_token` (the slots when the routing is unknown).
    What a ``Comm`` carries as ``nbytes`` and ``dispatched``."""

    def sent(dispatch: str, routing: str) -> float:
        if dispatch == "slots" or top_k <= 0 or experts <= 0:
            return slot_bytes
        return token_bytes * owner_ranks_per_token(experts, top_k, ep, routing)

    out = tuple(
        (name, routing, sent(dispatch, routing))
        for name, dispatch in (("", runtime),) + tuple((d, d) for d in DISPATCHES)
        for routing in EXPERT_ROUTINGS
    )
    return out[0][2], out


def dispatched_comm(comm: "Comm", dispatch: str = "", routing: str = "") -> "Comm":
    """``comm`` with the bytes it sends under ``dispatch`` ('' = the runtime's) and ``routing``
    ('' = uniform) (``Comm.dispatched``); a collective that depends on neither: as it is."""
    routing = routing or EXPERT_ROUTINGS[0]
    if not comm.dispatched or (not dispatch and routing == EXPERT_ROUTINGS[0]):  # nbytes is that one
        return comm
    for name, how, nbytes in comm.dispatched:
        if (name, how) == (dispatch, routing):
            return dataclasses.replace(comm, nbytes=nbytes, dispatched=())
    return comm


def routed_top_k(g, nodes: Iterable[str]) -> int:
    """The ``k`` of the first ``topk`` call among a block's traced ``nodes`` (the router's; 0 when
    there is none or its ``k`` was not a constant)."""
    for n in nodes:
        d = g.nodes[n]
        args = d.get("args") or []
        if d.get("op") == "topk" and len(args) > 1 and isinstance(args[1], int):
            return args[1]
    return 0
