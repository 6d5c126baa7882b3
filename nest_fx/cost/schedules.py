"""The pipeline schedules' bubble and in-flight activations: one row per schedule.

With p stages, m microbatches, v model chunks per device (``plan.vocabulary.model_chunks``),
t_i / s_i a stage's per-microbatch time and its share of fill and drain
(``results.microbatch_time``), the pipeline takes

    T_pipe = m max_i t_i + bubble_factor(schedule, v) (sum_i s_i - max_i t_i)

    schedule        bubble_factor   source
    gpipe, 1f1b     1               Narayanan et al. 2021 eq. 1: (p - 1) t for equal stages
    interleaved     1 / v           Narayanan et al. 2021 sec. 2.2.2
    interleaved-zb  (1 - 2w) / v    Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (ICLR),
                                    ZB-H1: (p - 1)(T_F + T_B - T_W) per chunk, where the backward
                                    is split into the input gradient T_B and the weight gradient
                                    T_W that fills the bubble
    zbv, dualpipev  (1 - 2w) / 2    ZB-V (Qi et al. sec. 6) and DualPipeV (DeepSeek-AI 2024,
                                    "DeepSeek-V3 Technical Report" sec. 3.2.1, the V-shaped
                                    DualPipe): 2 chunks per device laid in a V

w = ``WEIGHT_GRAD_SHARE`` is the weight gradient's share of a chunk's forward + backward time:
1/3, the balanced case the zero-bubble papers design for (a linear layer's backward is two
matmuls of the forward's size, one for the input gradient and one for the weight gradient).
For zbv and dualpipev the row is torch's own action order (``torch.distributed.pipelining``
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) event-simulated with T_F = T_B = T_W: its
bubble is (p - 1) T_F per chunk, a third of the chunk time, for m >= 2p
(``tests/unit/cost/test_schedules_cost.py`` checks every row against that simulation). torch runs
DualPipeV's overlapped forward-backward pairs one after the other (no custom overlap
function), so the F&B overlap of the DeepSeek report is not priced.

In-flight activations at the peak, in microbatches of all the device's layers (a chunk holds
its activations from its forward to its weight gradient):

    interleaved-zb  min(p, m)            v p chunk-microbatches (min(p, m) v): 1F1B's first stage
    zbv             min(p, m)            2p chunk-microbatches on every device (ZB-V's "same
                                         memory as 1F1B")
    dualpipev       min(2p + 1, 2m) / 2  2p + 1 chunk-microbatches (DualPipe's PP + 1)

(counted on torch's orders as above). 1F1B, GPipe and interleaved are in
``inflight.pipeline_inflight_microbatches``.
"""

from __future__ import annotations

from nest_fx.plan.vocabulary import SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES

WEIGHT_GRAD_SHARE = 1.0 / 3.0


def bubble_factor(schedule: str, v: int = 1) -> float:
    """The share of (sum_i s_i - max_i t_i) the schedule leaves idle (module docstring)."""
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        chunks = 2 if schedule in V_SCHEDULES else max(v, 1)
        return (1.0 - 2.0 * WEIGHT_GRAD_SHARE) / chunks
    if schedule == "interleaved" and v > 1:
        return 1.0 / v
    return 1.0


def zero_bubble_inflight(schedule: str, num_stages: int, num_microbatches: int) -> float:
    """Microbatches of a device's activations a split-backward schedule holds at its peak
    (module docstring); the same on every device."""
    p, m = num_stages, num_microbatches
    if schedule == "dualpipev":
        return min(2 * p + 1, 2 * m) / 2
    return float(min(p, m))
