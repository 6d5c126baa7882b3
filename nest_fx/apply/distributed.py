"""The default process group: created from the torchrun environment, with the job's timeout, and
numbered for a plan's device order; the same timeout on every group the runtime creates.

``init_distributed`` runs first in :func:`nest_fx.apply.auto_parallelize` (and in any script
that measures the launched world), gloo on CPU and NCCL on CUDA; ``collective_timeout_s`` is
the one place the collective timeout is read (``timeout_s`` or ``$NEST_FX_TIMEOUT_S``).
PyTorch gives every group created later (``new_group``, DeviceMesh dims, flattened dims) its
own default of 30 minutes (10 for NCCL) whatever the default group has, so
:func:`apply_job_timeout` sets the default group's timeout on each of them.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout, _world
from torch.distributed.rendezvous import _create_c10d_store

from nest_fx.apply.checks import ApplyError
from nest_fx.apply.peers import register_peers
from nest_fx.cluster.ordered import is_identity
from nest_fx.plan.plan import check_device_order

DEFAULT_TIMEOUT_S = 600.0
MIN_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer is a hang, and C++ millisecond counters stay far from overflow

TIMEOUT_ENV = "NEST_FX_TIMEOUT_S"

FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
FLIGHT_RECORDER_ENTRIES = 2000  # the last collectives of each rank, read when one fails (collective_errors)


def collective_timeout_s(timeout_s: Optional[float] = None) -> float:
    """The process-group timeout: ``timeout_s`` if given, else ``$NEST_FX_TIMEOUT_S``, else 600 s.

    A collective that waits longer (a peer died, hung or never joined) raises on the waiting
    rank instead of hanging the job. The value must be a finite number of seconds between
    :data:`MIN_TIMEOUT_S` and :data:`MAX_TIMEOUT_S` (:class:`ApplyError` otherwise).
    """
    source = "timeout_s"
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT_S
        source = f"{TIMEOUT_ENV}={raw!r}"
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ApplyError(f"{source} is not a number of seconds; fix: e.g. {TIMEOUT_ENV}=600") from None
    try:
        value = float(timeout_s)
    except (TypeError, ValueError):
        raise ApplyError(f"timeout_s={timeout_s!r} is not a number of seconds; fix: e.g. timeout_s=600") from None
    if not (math.isfinite(value) and MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S):
        raise ApplyError(
            f"{source}: the collective timeout must be a finite number of seconds between "
            f"{MIN_TIMEOUT_S:g} and {MAX_TIMEOUT_S:g} (a week), got {value:g}; fix: e.g. "
            f"{TIMEOUT_ENV}=600"
        )
    return value


def job_timeout() -> Optional[timedelta]:
    """The default group's timeout: the one every group of the job gets (:func:`apply_job_timeout`)."""
    return group_timeout(dist.group.WORLD)


def group_timeout(group) -> Optional[timedelta]:
    """The timeout a process group's backend applies to its collectives (None for a backend
    without one, such as the fake process group that checks plans without devices)."""
    device = torch.device("cuda") if torch.device("cuda") in group._device_types else torch.device("cpu")
    options = getattr(group._get_backend(device), "options", None)
    return getattr(options, "_timeout", None)


def member_groups() -> Dict[str, "dist.ProcessGroup"]:
    """{group name: group} of every process group this rank belongs to (default group included)."""
    return {
        pg.group_name: pg
        for pg in _world.pg_map
        if pg is not None
        and pg != dist.GroupMember.NON_GROUP_MEMBER
        and dist.get_rank() in dist.get_process_group_ranks(pg)
    }


def with_job_timeout(obj):
    """``obj`` (a DeviceMesh, a group) after :func:`apply_job_timeout`: for ``return with_job_timeout(mesh)``."""
    apply_job_timeout()
    return obj


def apply_job_timeout() -> int:
    """Give every group this rank belongs to the default group's timeout; returns how many
    groups were changed. Cheap and local (no collective): call it after creating groups."""
    timeout, changed = job_timeout(), 0
    if timeout is None:
        return 0
    for group in member_groups().values():
        if group_timeout(group) not in (None, timeout):
            _set_pg_timeout(timeout, group)
            changed += 1
    return changed


_NUMBERED_FOR: list = [None]  # (device order, default group id) of the group init_distributed numbered


def rank_device(mesh_device: str) -> torch.device:
    """The device this rank trains on: its CUDA device (``init_distributed`` set it) when the mesh
    is on ``cuda``, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if mesh_device == "cuda" else torch.device("cpu")


def plan_rank_of(device_order: Optional[Sequence[int]], launched_rank: int) -> int:
    """The plan rank the process launched as global rank ``launched_rank`` plays: r such that
    ``device_order[r] == launched_rank`` (the rank itself without an order)."""
    if is_identity(device_order):
        return launched_rank
    try:
        return list(device_order).index(launched_rank)
    except ValueError:
        raise ApplyError(
            f"device_order: rank {launched_rank} is not in the plan's device order "
            f"({len(device_order)} entries); re-plan for this world"
        ) from None


RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK")


def check_rendezvous_env(world: int) -> None:
    """ApplyError with the fix when ``WORLD_SIZE`` says several ranks but the variables that tell
    a rank where to meet the others are missing (PyTorch only says ``MASTER_ADDR expected``)."""
    missing = [name for name in RENDEZVOUS_ENV if name not in os.environ]
    if missing:
        raise ApplyError(
            f"WORLD_SIZE={world} asks for {world} ranks, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set, so this process cannot find the others; fix: launch "
            f"with torchrun (e.g. torchrun --nproc_per_node={world} script.py), which sets them for every rank, or "
            "unset WORLD_SIZE to run as one process, or set MASTER_ADDR, MASTER_PORT and RANK on every rank"
        )


def init_distributed(
    timeout_s: Optional[float] = None, device_order: Optional[Sequence[int]] = None
) -> Tuple[int, int]:
    """Initialise the default process group from the torchrun environment if needed.

    Reads WORLD_SIZE / RANK / LOCAL_RANK; gloo on CPU, nccl on CUDA. Without a launcher (no
    WORLD_SIZE) a one-rank group on an in-memory store is created, so the same script runs
    as a plain ``python`` process. Collectives time out after :func:`collective_timeout_s`
    (``timeout_s``, ``$NEST_FX_TIMEOUT_S`` or 600 s); a group initialised by the caller keeps
    its own timeout, which the runtime's groups then take. Returns (world_size, rank).

    ``device_order`` (a plan's, ``Plan.device_order``): the process launched as global rank
    ``device_order[r]`` joins the group as rank r (:func:`plan_rank_of`); it keeps its device
    (``LOCAL_RANK``). The runtime works on plan ranks throughout, so renumbering the group is
    all it takes to run plan rank r on that device. Permuting the DeviceMesh instead would be
    unsafe: ``new_group`` sorts a group's ranks, so along a permuted mesh dim the group rank
    would differ from the mesh coordinate that DTensor, FSDP and PipelineStage index by. A group
    initialised by the caller cannot be renumbered: with a non-identity order that is an
    :class:`~nest_fx.apply.ApplyError`.
    """
    # the flight recorder keeps each rank's last collectives, so a failed one can name its group
    os.environ.setdefault(FLIGHT_RECORDER_ENV, str(FLIGHT_RECORDER_ENTRIES))
    if dist.is_initialized():
        if not is_identity(device_order) and _NUMBERED_FOR[0] != (tuple(device_order), id(dist.group.WORLD)):
            raise ApplyError(
                "device_order: the plan places its ranks on other devices, which the runtime does by numbering the "
                "default process group, but the group was initialised before auto_parallelize; fix: let "
                "auto_parallelize initialise it, or call nest_fx.apply.init_distributed(device_order="
                "plan.device_order) first (or init_process_group with rank=plan_rank_of(plan.device_order, RANK))"
            )
        register_peers(collective_timeout_s(timeout_s))
        return dist.get_world_size(), dist.get_rank()
    timeout = timedelta(seconds=collective_timeout_s(timeout_s))
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ApplyError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number of ranks; fix: launch with "
            "torchrun, which sets it, or unset it to run as one process"
        ) from None
    if world > 1:
        check_rendezvous_env(world)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif not is_identity(device_order):
        if len(device_order) != world:
            raise ApplyError(
                f"device_order: lists {len(device_order)} ranks but WORLD_SIZE is {world}; launch "
                f"{len(device_order)} processes or re-plan for {world} devices"
            )
        check_device_order(device_order, world)
        launched = int(os.environ.get("RANK", "0"))
        # the launcher's rendezvous store, hosted as the launcher arranged it (torchrun's agent, or
        # the process launched as rank 0 on MASTER_ADDR), not by whichever process plays plan rank 0
        store = _create_c10d_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), launched, world, timeout)
        dist.init_process_group(
            backend, store=store, rank=plan_rank_of(device_order, launched), world_size=world, timeout=timeout
        )
        _NUMBERED_FOR[0] = (tuple(device_order), id(dist.group.WORLD))
    else:
        dist.init_process_group(backend, timeout=timeout)
    register_peers(timeout.total_seconds())
    return dist.get_world_size(), dist.get_rank()
