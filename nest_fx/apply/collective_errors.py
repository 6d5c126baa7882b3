"""A failed collective becomes one error that names the group it was stuck in.

When a peer stops (SIGSTOP, a hung kernel, a deadlock) the waiting ranks' collectives time out
after the job's timeout; when a peer dies its connections close and they fail at once. Either
way gloo and NCCL raise a ``RuntimeError`` whose text names a C++ file and no group, so the
runtime's entry points (``train_step``, checkpoint save/load, the setup in ``auto_parallelize``)
run inside :func:`named_collective_failures`, which turns such an error into a
:class:`CollectiveError` saying which collective on which group (``tp``, ``dp``, ``pp``, ...,
with its ranks) this rank was waiting in and for how long. The group comes from PyTorch's flight
recorder (``$TORCH_FR_BUFFER_SIZE``, which ``init_distributed`` turns on): the newest collective
whose work has not been retired, else the last collective this rank started. Before raising, the
rank ends the peers of its host that are stopped (:func:`nest_fx.apply.peers.end_stopped_peers`):
torchrun's SIGTERM cannot end a stopped process, and it waits 30 s before SIGKILL.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist

from nest_fx.apply.distributed import group_timeout, member_groups
from nest_fx.apply.peers import end_stopped_peers
from nest_fx.common.errors import NestFxError

_TRANSPORT_MARKERS = (
    "gloo/transport",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "NCCL error",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
)
_TIMEOUT_MARKERS = ("timed out", "timeout")


class CollectiveError(NestFxError, RuntimeError):
    """A collective did not complete (a peer stopped, hung or died); the message names the group,
    its ranks and what this rank was doing."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a communication failure (not a mistake in the model or the inputs)."""
    if isinstance(exc, NestFxError):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _TRANSPORT_MARKERS)


def group_label(desc: str, name: str) -> str:
    """``mesh_tp`` -> ``tp group``; the default group; else the group's description or name."""
    if desc.startswith("mesh_"):
        return f"{desc[len('mesh_') :]} group"
    if desc in ("default_pg", "") and name in ("0", ""):
        return "default group"
    return f"group {desc or name}"


def _flight_record() -> Optional[dict]:
    try:
        return json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, True))
    except Exception:  # noqa: BLE001 - no recorder (disabled, another backend): the message says less
        return None


def stuck_collective() -> Optional[dict]:
    """``{"op", "group", "ranks", "timeout_s"}`` of the collective this rank was waiting in, from the
    flight recorder: the newest collective whose work has not been retired, else the newest
    collective recorded; None without a record."""
    record = _flight_record()
    entries: List[dict] = (record or {}).get("entries") or []
    if not entries:
        return None
    # gloo's per-group completion counters lag (pg_status); an entry's own "retired" flag does not
    candidates = [e for e in entries if not e.get("retired")] or entries
    entry = max(candidates, key=lambda e: e.get("record_id", 0))
    name, desc = (list(entry.get("process_group") or []) + ["", ""])[:2]
    group = member_groups().get(name)
    ranks = dist.get_process_group_ranks(group) if group is not None else []
    timeout = group_timeout(group) if group is not None else None
    timeout = timeout.total_seconds() if timeout is not None else entry.get("timeout_ms", 0) / 1e3
    op = str(entry.get("profiling_name", "a collective")).split(":")[-1]
    return {"op": op, "group": group_label(desc, name), "ranks": ranks, "timeout_s": timeout}


def describe_failure(exc: BaseException, what: str) -> str:
    """One message: this rank, what it was doing, the stuck collective and group, and the fix."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    text = " ".join(str(exc).split())
    timed_out = any(marker in text.lower() for marker in _TIMEOUT_MARKERS)
    stuck = stuck_collective() if dist.is_initialized() else None
    if stuck is None:
        where = "a collective"
        timeout = ""
    else:
        where = f"{stuck['op']} on the {stuck['group']} (ranks {', '.join(map(str, stuck['ranks']))})"
        timeout = f" within the {stuck['timeout_s']:g} s timeout"
    if timed_out:
        happened = f"did not complete{timeout}: a rank of that group stopped or hung"
    else:
        happened = "failed: a rank of that group died or closed its connection"
    return (
        f"rank {rank}: {where} {happened} (during {what}); the job cannot continue. fix: find the rank that "
        f"stopped in the logs; restart the job from its latest checkpoint (torchrun --max_restarts does it, "
        f"docs/runtime.md 'Failures and timeouts'). [{text[:300]}]"
    )


@contextmanager
def named_collective_failures(what: str) -> Iterator[None]:
    """Re-raise a communication failure inside the block as a :class:`CollectiveError` naming the
    stuck group (:func:`describe_failure`); other errors pass through unchanged."""
    try:
        yield
    except Exception as exc:
        if is_collective_failure(exc):
            message = describe_failure(exc, what)
            ended = end_stopped_peers()  # they cannot act on torchrun's SIGTERM (peers.py)
            if ended:
                message += (
                    f" This rank ended the stopped {rank_word(ended)} {', '.join(map(str, ended))} of its host "
                    "with SIGKILL, so that the job ends now."
                )
            raise CollectiveError(message) from exc
        raise


def rank_word(ranks) -> str:
    """``rank`` or ``ranks``."""
    return "rank" if len(ranks) == 1 else "ranks"
