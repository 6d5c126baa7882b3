"""Activations a pipeline stage holds in flight: the microbatches each schedule keeps alive on a
stage at its peak (GPipe, 1F1B, interleaved 1F1B per model chunk, the zero-bubble schedules),
and the activation bytes that makes.

Pure functions on numbers (bytes). Sources:
    Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
        Megatron-LM" (SC'21) -- pipeline schedules (GPipe, 1F1B, interleaved 1F1B).
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
        (MLSys'23) -- sec. 4.2.3, the first stage's in-flight factor.
"""

from __future__ import annotations

import functools
from typing import Tuple

import numpy as np

from nest_fx.cost.arg_checks import require_choice, require_int, require_number
from nest_fx.cost.arrays import Count
from nest_fx.cost.schedules import zero_bubble_inflight
from nest_fx.plan.vocabulary import SCHEDULES, SPLIT_BACKWARD_SCHEDULES


def pipeline_inflight_microbatches(
    schedule: str, stage: int, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """Microbatches whose activations pipeline stage ``stage`` (0-based) holds at its peak.

    The unit is one microbatch's activations of *all* the layers on the stage's device, so
    stage activation memory = this x per-microbatch activations of those layers. With p =
    ``num_stages``, m = ``num_microbatches``, v = ``virtual_stages``:

        gpipe        m                     all forwards run before any backward (Huang et al.
                                           2019, as described in Narayanan et al. 2021 sec. 2.2.1)
        1f1b         min(p - stage, m)     PipeDream-Flush warm-up depth + 1 (Narayanan 2021 sec. 2.2.1)
        interleaved  min(2(p - stage - 1) + (v - 1) p + 1, m v) / v
                                           v model chunks per device, each 1/v of its layers
                                           (Narayanan 2021 sec. 2.2.2): the warm-up runs
                                           2(p - stage - 1) + (v - 1) p chunk-forwards, plus
                                           one in steady state. For stage 0 this is
                                           p (1 + (p-1)/(p v)), the factor Korthikanti et al.
                                           2022 sec. 4.2.3 give for the first stage.

        interleaved-zb, zbv, dualpipev   ``cost.schedules.zero_bubble_inflight``

    ``interleaved`` with v = 1 is plain 1F1B. The counts never exceed GPipe's m.
    """
    require_choice(schedule, "schedule", SCHEDULES)
    p = require_int(num_stages, "num_stages", 1)
    m = require_int(num_microbatches, "num_microbatches", 1)
    v = require_int(virtual_stages, "virtual_stages", 1)
    require_int(stage, "stage", 0)
    if stage >= p:
        raise ValueError(f"stage: must be < num_stages ({p}), got {stage}")
    if schedule == "gpipe":
        return float(m)
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        return zero_bubble_inflight(schedule, p, m)
    if schedule == "1f1b" or v == 1:
        return float(min(p - stage, m))
    chunks = min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
    return chunks / v


@functools.lru_cache(maxsize=65536)
def interleaved_chunk_states(
    stage: int, num_stages: int, num_microbatches: int, virtual_stages: int
) -> Tuple[Tuple[float, float, float], ...]:
    """The in-flight microbatches of device ``stage``'s model chunks over its interleaved 1F1B
    schedule, as torch's ``ScheduleInterleaved1F1B`` orders it: warm-up of
    ``min((v - 1) r + 2 (p - 1 - stage), m v)`` chunk-forwards (``r`` microbatches per round, p
    when p divides m), then one forward and one backward, then the cool-down; forwards walk the
    chunks 0, 1, ... in groups of ``r`` microbatches, backwards v - 1, v - 2, .... Returns the
    distinct ``(all chunks / v, chunk 0, chunk v - 1)`` counts after each forward (the peaks).

    Chunk 0 of device 0 holds the head and chunk ``v - 1`` of the last device the tail (the
    runtime lays chunks round-robin along the chain: ``apply.pipeline.interleaved_ranges``). The
    output layer and the loss run their backward right after their forward, so the last device
    holds them for about one microbatch, not the ``(2(p - 1 - stage) + (v - 1) p + 1) / v`` of
    the stage's blocks (:func:`pipeline_inflight_microbatches`, the largest first entry here).
    """
    p = require_int(num_stages, "num_stages", 1)
    m = require_int(num_microbatches, "num_microbatches", 1)
    v = require_int(virtual_stages, "virtual_stages", 1)
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - stage), m * v)
    held = [0] * v
    total = 0
    states = set()
    # after the warm-up the forwards' and the backwards' chunks both repeat every v r ops and
    # each chunk gains and loses r microbatches per period: the states repeat with that period
    steady_end = min(m * v, warmup + v * per_round)
    for op in range(steady_end):
        held[(op // per_round) % v] += 1
        total += 1
        states.add((total / v, float(held[0]), float(held[v - 1])))
        if op >= warmup:
            held[v - 1 - ((op - warmup) // per_round) % v] -= 1
            total -= 1
    return tuple(sorted(states))


def held_activation_bytes(
    act: Count,
    act_root: Count,
    schedule: str,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
) -> Count:
    """Activation bytes a pipeline stage holds at its peak: per-microbatch bytes ``act`` of its
    layers (``act_root`` of them the head's and tail's) times the in-flight microbatches of the
    schedule. GPipe and 1F1B hold every layer equally (:func:`pipeline_inflight_microbatches`);
    the interleaved schedule counts each chunk's own (:func:`interleaved_chunk_states`): the
    blocks spread evenly over the chunks, the head in chunk 0 of the first device, the tail in
    the last chunk of the last device. Numbers or arrays (the solver's stage tables)."""
    if schedule != "interleaved" or virtual_stages == 1 or num_stages == 1:
        return act * pipeline_inflight_microbatches(schedule, stage, num_stages, num_microbatches, virtual_stages)
    best: Count = 0.0
    for spread, root in _chunk_peaks(stage, num_stages, num_microbatches, virtual_stages):
        held = (act - act_root) * spread + act_root * root
        best = np.maximum(best, held) if isinstance(held, np.ndarray) else max(best, held)
    return best


@functools.lru_cache(maxsize=65536)
def _chunk_peaks(
    stage: int, num_stages: int, num_microbatches: int, virtual_stages: int
) -> Tuple[Tuple[float, float], ...]:
    """The (all chunks / v, the root's chunk) in-flight counts of :func:`interleaved_chunk_states`
    that can be a peak: held bytes grow with both (``act >= act_root >= 0``), so a state another
    matches or exceeds in both is never the maximum and is dropped."""
    edge = 1 if stage == 0 else (2 if stage == num_stages - 1 else 0)
    pairs = {
        (spread, (first, last)[edge - 1] if edge else spread)
        for spread, first, last in interleaved_chunk_states(stage, num_stages, num_microbatches, virtual_stages)
    }
    return tuple(sorted(p for p in pairs if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in pairs)))


def stage_activation_bytes(
    per_microbatch_bytes: float,
    schedule: str,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
) -> float:
    """Peak activation bytes of a pipeline stage: per-microbatch activations of its layers x
    :func:`pipeline_inflight_microbatches` (Narayanan et al. 2021; Korthikanti et al. 2022 sec. 4.2.3)."""
    per_mb = require_number(per_microbatch_bytes, "per_microbatch_bytes")
    return per_mb * pipeline_inflight_microbatches(schedule, stage, num_stages, num_microbatches, virtual_stages)
