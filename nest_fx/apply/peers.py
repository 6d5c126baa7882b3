"""The job's processes on this host, and ending the ones that are stopped when a collective fails.

A rank stopped with SIGSTOP (a hung host, a frozen driver, a ``kill -STOP``) makes its peers'
collectives time out, and they exit with a :class:`~nest_fx.apply.collective_errors.CollectiveError`.
torchrun then sends the remaining workers SIGTERM, which a stopped process cannot act on, and waits
30 s before SIGKILL (``LocalElasticAgent._stop_workers`` ignores ``--shutdown-timeout``). So the
ranks end their stopped peers themselves: at start-up (:func:`register_peers`, from
``init_distributed``) every rank writes its host name, pid and process start time into the default
group's store under its node and local rank, and reads those of the other ranks of its node; when a
collective fails (:func:`end_stopped_peers`, from ``named_collective_failures``) a rank SIGKILLs
every peer of its host that is in the stopped state (``T`` in ``/proc/<pid>/stat``), after checking
that the pid still belongs to the same process (its start time). A process stopped by a debugger
(``t``, tracing stop) is left alone, and so is any process that is not a rank of this job.
``NEST_FX_END_STOPPED_PEERS=0`` turns this off (e.g. to attach to a stopped rank on purpose).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

SWITCH_ENV = "NEST_FX_END_STOPPED_PEERS"
STALE_WAIT_S = 30.0  # how long start-up waits for the entries of a previous round to be replaced

Peer = Tuple[str, int, int]  # (host name, pid, start time in clock ticks since boot)

_PEERS: Dict[int, Peer] = {}  # rank -> its process, for the ranks of this node
_REGISTERED: List[Optional[int]] = [None]  # id of the default group the table belongs to


def process_start(pid: int) -> Optional[int]:
    """The start time of process ``pid`` (clock ticks since boot), or None when there is none."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def process_state(pid: int) -> Optional[str]:
    """The state letter of process ``pid`` (``R``, ``S``, ``D``, ``T`` stopped, ``t`` traced, ``Z``), or None."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def _stat_fields(pid: int) -> Optional[List[str]]:
    """``/proc/<pid>/stat`` after the command name (whose parentheses may hold anything)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _prefix() -> str:
    env = os.environ
    return (
        f"nest_fx/peers/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        f"{env.get('MASTER_PORT', '')}/{env.get('GROUP_RANK', '0')}"
    )


def register_peers(timeout_s: float = 60.0) -> int:
    """Exchange (host, pid, start time) with the other ranks of this node through the default
    group's store; returns how many peers of this host are known. Does nothing (returns 0)
    without a TCP rendezvous (a one-rank group, the fake group of plan checks)."""
    if not dist.is_initialized():
        return 0
    group_id = id(dist.group.WORLD)
    if _REGISTERED[0] == group_id:
        return len(_PEERS)
    _PEERS.clear()
    _REGISTERED[0] = group_id
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if (
        dist.get_world_size() == 1
        or local_world <= 1
        or "MASTER_ADDR" not in os.environ
        or dist.get_backend() == "fake"
    ):
        return 0
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # no store: nothing to exchange
        return 0
    me = (socket.gethostname(), os.getpid(), process_start(os.getpid()) or 0)
    prefix, local_rank = _prefix(), int(os.environ.get("LOCAL_RANK", "0"))
    store.set(f"{prefix}/{local_rank}", json.dumps([dist.get_rank(), *me]))
    keys = [f"{prefix}/{r}" for r in range(local_world)]
    store.wait(keys, timedelta(seconds=timeout_s))
    # a store kept across torchrun rounds may still hold a previous round's entry of a rank that
    # has not written yet: such an entry names a process that is gone, so read again
    deadline = time.monotonic() + min(timeout_s, STALE_WAIT_S)
    while True:
        entries = [json.loads(store.get(key)) for key in keys]
        stale = [e for e in entries if e[1] == me[0] and process_start(int(e[2])) != int(e[3])]
        if not stale or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for rank, host, pid, start in entries:
        if host == me[0] and pid != me[1] and process_start(int(pid)) == int(start):
            _PEERS[int(rank)] = (host, int(pid), int(start))
    return len(_PEERS)


def known_peers() -> Dict[int, Peer]:
    """{rank: (host, pid, start time)} of this node's other ranks (after :func:`register_peers`)."""
    return dict(_PEERS)


def end_stopped_peers() -> List[int]:
    """SIGKILL every rank of this host that is stopped (``T``) and is still the process that
    registered; returns their ranks. Safe to call at any time; never signals another process."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return []
    ended = []
    for rank, (_, pid, start) in sorted(_PEERS.items()):
        if process_state(pid) == "T" and process_start(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
                ended.append(rank)
            except OSError:  # it exited meanwhile, or is not ours to signal
                continue
    return ended
