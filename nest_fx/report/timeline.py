"""Pipeline schedule events: when each stage runs each microbatch's forward and backward.

An event simulation of the schedules the cost model prices (GPipe, 1F1B, interleaved 1F1B).
Every device runs its operations in the schedule's fixed order; an operation starts when the
device is free and its dependency has finished:

    forward  of microbatch b on virtual stage s   after the forward  of b on stage s - 1
    backward of microbatch b on virtual stage s   after the backward of b on stage s + 1
                                                  (the last stage: after its own forward)

Virtual stage ``s = chunk * p + device`` (one chunk per device unless interleaved). Orders:

    gpipe        all forwards, then all backwards
    1f1b         ``p - i - 1`` warm-up forwards on device i, then forward/backward pairs, then
                 the remaining backwards (PipeDream-Flush)
    interleaved  ``2 (p - i - 1) + (v - 1) p`` warm-up chunk-forwards, then pairs; forwards go
                 through the chunks in groups of p microbatches, backwards through the chunks
                 in reverse (the order Megatron-LM uses; needs m to be a multiple of p)

Pipeline p2p: when the cost model overlaps sends with compute (``CostOptions.overlap_p2p``, the
runtime's behaviour), a transfer delays the dependent operation on the next device by ``P_i``
and keeps no device busy; otherwise it is part of the stage blocks (``t_i = W_i + 2 v P_i``
keeps the stage busy while it receives). Either way, with equal stage times the 1F1B and GPipe
makespan is :func:`nest_fx.cost.step_time.pipeline_time`'s span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

SCHEDULES = ("1f1b", "gpipe", "interleaved")


@dataclass(frozen=True)
class Event:
    """One block of the timeline: ``phase`` "F" or "B" of ``microbatch`` on device ``stage``."""

    stage: int
    microbatch: int
    phase: str
    start: float
    end: float
    chunk: int = 0


def virtual_stage(event: Event, num_stages: int) -> int:
    """Position of the event's model chunk in the pipeline: ``chunk * p + stage``."""
    return event.chunk * num_stages + event.stage


Op = Tuple[str, int, int]  # (phase, chunk, microbatch)


def device_order(schedule: str, device: int, p: int, m: int, v: int = 1) -> List[Op]:
    """The operations device ``device`` of ``p`` runs, in order (see module docstring)."""
    if schedule == "gpipe":
        return [("F", 0, b) for b in range(m)] + [("B", 0, b) for b in range(m)]
    if schedule == "1f1b" or v == 1:
        warm = min(p - device - 1, m)
        order: List[Op] = [("F", 0, b) for b in range(warm)]
        for k in range(m - warm):
            order += [("F", 0, warm + k), ("B", 0, k)]
        return order + [("B", 0, b) for b in range(m - warm, m)]
    total = m * v

    def op(phase: str, k: int) -> Op:
        chunk = (k % (p * v)) // p
        if phase == "B":
            chunk = v - 1 - chunk
        return phase, chunk, (k // (p * v)) * p + k % p

    warm = min(2 * (p - device - 1) + (v - 1) * p, total)
    order = [op("F", k) for k in range(warm)]
    for k in range(total - warm):
        order += [op("F", warm + k), op("B", k)]
    return order + [op("B", k) for k in range(total - warm, total)]


def _check(fwd: Sequence[float], bwd: Sequence[float], m: int, schedule: str, v: int) -> int:
    p = len(fwd)
    if p == 0 or len(bwd) != p:
        raise ValueError(f"fwd and bwd need one time per stage, got {len(fwd)} and {len(bwd)}")
    if any(t < 0 for t in (*fwd, *bwd)):
        raise ValueError("stage times must be >= 0")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: {schedule!r}, use one of {SCHEDULES}")
    if m < 1 or v < 1:
        raise ValueError(f"need m >= 1 and v >= 1, got m={m}, v={v}")
    if schedule == "interleaved" and v > 1 and m % p:
        raise ValueError(f"the interleaved schedule needs m ({m}) to be a multiple of the {p} stages")
    return p


def schedule_events(
    fwd: Sequence[float],
    bwd: Sequence[float],
    m: int,
    schedule: str = "1f1b",
    v: int = 1,
    delay: Optional[Sequence[float]] = None,
) -> List[Event]:
    """Events of one step: ``fwd[i]``/``bwd[i]`` are device i's seconds per microbatch over all
    its chunks (each chunk takes 1/v of them); ``m`` microbatches; ``v`` chunks per device
    (interleaved only); ``delay[i]``: seconds a transfer between device i - 1 and i takes when
    it does not keep the devices busy (activations forward, gradients backward). Sorted by
    start time."""
    p = _check(fwd, bwd, m, schedule, v)
    delay = list(delay) if delay is not None else [0.0] * p
    v = v if schedule == "interleaved" else 1
    last = p * v - 1
    orders = [device_order(schedule, i, p, m, v) for i in range(p)]
    done: Dict[Op, float] = {}  # keyed (phase, virtual stage, microbatch) -> end time
    free = [0.0] * p
    nxt = [0] * p
    events: List[Event] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(p):
            while nxt[i] < len(orders[i]):
                phase, chunk, b = orders[i][nxt[i]]
                s = chunk * p + i
                dep: Optional[Op]
                if phase == "F":
                    dep = ("F", s - 1, b) if s > 0 else None
                else:
                    dep = ("B", s + 1, b) if s < last else ("F", s, b)
                if dep is not None and dep not in done:
                    break
                crossing = 0.0
                if dep is not None and dep[1] % p != i:  # from another device
                    crossing = delay[i] if phase == "F" else delay[(i + 1) % p]
                start = max(free[i], done[dep] + crossing if dep is not None else 0.0)
                end = start + (fwd[i] if phase == "F" else bwd[i]) / v
                done[(phase, s, b)] = end
                free[i] = end
                events.append(Event(i, b, phase, start, end, chunk))
                nxt[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the orders above are deadlock-free
            raise RuntimeError(f"{schedule} schedule deadlocked (p={p}, m={m}, v={v})")
    events.sort(key=lambda e: (e.start, e.stage))
    return events


def makespan(events: Sequence[Event]) -> float:
    """End of the last event."""
    return max(e.end for e in events)


def stage_blocks(result, v: int = 1) -> Tuple[List[float], List[float]]:
    """Per-device forward and backward seconds per microbatch from a ``SimResult``.

    In-layer collectives are split between forward and backward in proportion to the compute
    (the cost model keeps only their sum); recomputation belongs to the backward; a p2p receive
    not overlapped (counted once per chunk) to both, an overlapped one where a link is slower than
    the stage (``t_i = max(W_i, v P_i)``). ``fwd[i] + bwd[i]`` is the cost model's t_i.
    """
    fwd, bwd = [], []
    for s in result.stages:
        comm = s.tp_comm + s.ep_comm + s.cp_comm
        compute = s.fwd_compute + s.bwd_compute
        share = s.fwd_compute / compute if compute > 0 else 0.5
        wait = (s.per_microbatch(v) - s.work) / 2  # the busy part of the transfers, per direction
        fwd.append(s.fwd_compute + comm * share + wait)
        bwd.append(s.bwd_compute + s.recompute_s + comm * (1 - share) + wait)
    return fwd, bwd


def stage_delays(result) -> List[float]:
    """Per device, the transfer seconds into it that delay the next operation without keeping a
    device busy: its incoming p2p when sends are overlapped (0 otherwise)."""
    return [s.p2p if s.overlap_p2p else 0.0 for s in result.stages]
