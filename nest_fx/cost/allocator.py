"""What PyTorch's CUDA caching allocator reserves beyond the live tensors, per segment mode.

``torch.cuda.max_memory_reserved`` exceeds ``max_memory_allocated`` by the blocks the allocator
keeps cached and the gaps between them. Measured on one H100 (torch 2.11, nest-fx's runtime
training the zoo Llama with Llama 3 8B's layer shape, 8,192 tokens a microbatch, bf16-mixed,
AdamW; ``scripts/bench_gpu_runtime.py``, ``results/gpu/bench_gpu_runtime_h100*.json``); ``lp``
is the cost model's largest one-layer backward working set of the run (``layer_peak``: the
loss's logits gradients, 1.95 GiB with a 32,000-token vocabulary, 7.83 GiB with 128,256):

==========================================  =========  ====  ==============  ===================
run                                         allocated  lp    fixed: excess   expandable: excess
==========================================  =========  ====  ==============  ===================
2 blocks                                    14.68 GiB  1.95  +2.27 (15.5%)   +0.82 (5.6%)
2 blocks, fused AdamW                       14.68      1.95  +1.00 (6.8%)    +0.85 (5.8%)
6 blocks                                    31.47      1.95  +2.80 (8.9%)    +0.79 (2.5%)
10 blocks                                   48.26      1.95  +3.27 (6.8%)    +0.82 (1.7%)
6 blocks, 128,256-token vocabulary          49.83      7.83  +8.32 (16.7%)   +3.01 (6.0%)
the same, full recompute                    44.03      7.83  +11.79 (26.8%)  +0.08 (0.2%)
6 blocks, 4 microbatches accumulated        37.32      1.95  +1.47 (3.9%)    +0.78 (2.1%)
==========================================  =========  ====  ==============  ===================

The excess is not a share of the live bytes: under expandable segments it stays at 0.8 GiB from
15 to 48 GiB allocated and grows 3.7x with the vocabulary (4x the logits). It follows the
largest transient working set, ``lp``: at most 0.44 of it under expandable segments (0.38-0.44
in six runs; 0.01 under full recompute, where the peak comes before anything is freed); under
fixed segments at most 3.0% of the live bytes plus 1.34 ``lp`` (the recompute run; the others
need 0.2-0.95). The cost model takes these upper envelopes, so that a plan it calls feasible
fits the allocator it runs (it over-reserves the recompute run by 3.4 GiB under expandable
segments). Reserved = ``(allocated + peak_share x lp) x (1 + ratio)``: ``peak_share`` is the
envelope over ``1 + ratio`` (``memory.reserved_bytes``).

The live bytes of these runs are priced within 1.8% (``memory.held_grad_bytes``: fp32 gradients on
the master weights; ``memory.stage_memory`` with ``options.master_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from nest_fx.cost.arg_checks import require_choice


@dataclass(frozen=True)
class AllocatorSlack:
    """The allocator's excess over the live bytes of one segment mode (module docstring)."""

    ratio: float  # reserved grows by this share of everything priced live
    peak_share: float  # plus this share of the stage's largest one-layer backward working set


# peak_share: the measured envelope over (1 + ratio) (module docstring): expandable 0.44 / 1.0,
# fixed 1.34 / 1.03
ALLOCATOR_SLACK: Dict[str, AllocatorSlack] = {
    "expandable": AllocatorSlack(ratio=0.0, peak_share=0.44),
    "fixed": AllocatorSlack(ratio=0.030, peak_share=1.30),
}


def allocator_slack(segments: object) -> AllocatorSlack:
    """The slack of segment mode ``segments``; ValueError naming the modes otherwise."""
    hint = "expandable is PyTorch's expandable_segments:True, fixed its default"
    return ALLOCATOR_SLACK[require_choice(segments, "allocator_segments", tuple(ALLOCATOR_SLACK), hint)]
