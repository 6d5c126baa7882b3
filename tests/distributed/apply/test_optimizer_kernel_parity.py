"""A plan's optimizer implementation at run time (``optimizer_kernel``): 2 gloo ranks of data
parallelism training with the plan's fused AdamW (``pm.build_optimizer``) match the single-device
fused AdamW to fp32 tolerance (``tests/parity_helpers.py``)."""

from __future__ import annotations

import pytest

from parity_helpers import LLAMA, run

FUSED_ADAMW = {"optimizer": "adamw", "optimizer_kernel": "fused"}


@pytest.mark.dist
@pytest.mark.parametrize("zero", [0, 3])  # 3: the fused kernel updates FSDP2's DTensor shards
def test_data_parallel_fused_adamw_matches_one_device(zero):
    results = run(2, LLAMA, {"dp": 2, "zero": zero, "microbatch_size": 4}, lr=1e-3, optimizer=FUSED_ADAMW)
    assert [r["optimizer_implementation"] for r in results] == ["fused", "fused"]
