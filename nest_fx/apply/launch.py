"""Run a function on N local processes with the torchrun environment (gloo on CPU).

``launch(fn, world_size, *args)`` spawns ``world_size`` processes with MASTER_ADDR/PORT,
WORLD_SIZE, RANK and LOCAL_RANK set, calls ``fn(*args)`` on each, and returns their return
values in rank order; a rank that raises fails the launch with its traceback, and a launch that
runs past ``timeout`` kills every rank (a hung collective fails instead of hanging). The
profiler's collective calibration uses it outside torchrun; the tests and benchmarks use it to
run plans on CPU ranks.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on the loopback interface that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        result = fn(*args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # flush the report before tearing the group down: peers see the teardown as their own
        # failure, and the parent should hear about the first failure first
        queue.close()
        queue.join_thread()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


_PRELOAD = ["torch", "torch.distributed", "nest_fx.apply", "nest_fx.graph", "nest_fx.models"]


def _context():
    """A forkserver context that imports torch and nest-fx once: each rank then starts in well
    under a second instead of re-importing everything (2 cores, up to 8 ranks in tests). The
    server process never runs torch ops, so forking it is safe; falls back to spawn."""
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    except ValueError:
        return mp.get_context("spawn")


def launch(fn: Callable, world_size: int, *args, timeout: float = 120.0) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; results in rank order."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=True) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    errors: Dict[int, str] = {}
    deadline = time.monotonic() + timeout
    grace = False
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                if errors:
                    first = next(iter(errors))
                    raise RuntimeError(
                        f"rank {first} failed (rank(s) {missing} then hung and were killed):\n{errors[first]}"
                    )
                raise TimeoutError(f"launch: rank(s) {missing} did not finish in {timeout:.0f}s; killed")
            if errors and not grace:  # one rank failed: the others may hang in a collective
                grace = True
                deadline = min(deadline, time.monotonic() + 5.0)
            try:
                rank, status, value = queue.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                # a rank that died without reporting (killed, os._exit, a native crash) counts as
                # failed, so the others get the grace period instead of the whole timeout
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results and r not in errors
                ]
                if dead and queue.empty():
                    for r in dead:
                        errors[r] = (
                            f"rank {r} exited with code {procs[r].exitcode} without reporting "
                            "(killed, os._exit or a crash in native code)\n"
                        )
                    continue
                if all(not p.is_alive() for p in procs) and queue.empty():
                    missing = sorted(set(range(world_size)) - set(results) - set(errors))
                    if missing:
                        raise RuntimeError(
                            f"launch: rank(s) {missing} exited without a result (exit codes "
                            f"{[p.exitcode for p in procs]})"
                        )
                continue
            (results if status == "ok" else errors)[rank] = value
        if errors:
            first = next(iter(errors))  # the first failure; later ones are usually its consequence
            others = sorted(set(errors) - {first})
            tails = "".join(f"\nrank {r}: {errors[r].strip().splitlines()[-1]}" for r in others)
            raise RuntimeError(
                f"rank {first} failed" + (f" (then rank(s) {others})" if others else "") + f":\n{errors[first]}" + tails
            )
    finally:
        for p in procs:
            p.join(timeout=0.5 if (errors or len(results) < world_size) else 2.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    return [results[r] for r in range(world_size)]
