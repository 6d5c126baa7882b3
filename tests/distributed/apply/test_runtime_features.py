"""Multi-process (gloo, CPU) parity of the runtime features: context parallelism, loss parallel,
HSDP (with TP, CP and EP), recompute policies and torch.compile. Each launch runs several plans one after the other on
the same ranks (one process group, one start-up) and compares every plan with the single-device
run of the same weights and data: losses of all 3 SGD steps, full gradients of every step and
the parameters after the last step within 1e-5 (``nest_fx.testing.equivalence``)."""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import pytest

from nest_fx.apply.launch import launch
from nest_fx.testing import equivalence

TOL = 1e-5
LAUNCH_S = 240
LLAMA = "llama:hidden=64,layers=4,heads=4,seq=32,vocab=128"
LLAMA2 = "llama:hidden=64,layers=2,heads=4,seq=32,vocab=128"
MOE = "moe:hidden=64,layers=2,heads=4,seq=32,vocab=128,experts=4,top_k=2,capacity_factor=2.0"
HF_LLAMA = "hf:llama:hidden=64,layers=2,heads=4,kv=2,seq=32,vocab=128"

# one cell per kind of parallelism runs by default; the other cells are `slow` (pytest -m "")
pytestmark = pytest.mark.dist


def _equivalences(cases: List[Dict], compile_backend: Optional[str] = None) -> List[Dict]:
    """Every case's equivalence on this rank, in order (runs on each launched rank)."""
    if compile_backend:
        os.environ["NEST_FX_COMPILE_BACKEND"] = compile_backend
    return [equivalence({"batch": 8, "seq": 32, "steps": 3, "lr": 0.5, **case}) for case in cases]


def run(
    world: int, cases: List[Dict], compile_backend: Optional[str] = None, timeout: float = LAUNCH_S
) -> List[List[Dict]]:
    """Launch ``world`` ranks over ``cases``; assert parity for each; per case, the ranks' results."""
    per_rank = launch(_equivalences, world, cases, compile_backend, timeout=timeout)
    per_case = [[rank[k] for rank in per_rank] for k in range(len(cases))]
    for case, results in zip(cases, per_case):
        worst = {k: max(r[k] for r in results) for k in ("loss_diff", "grad_diff", "param_diff")}
        print(f"\n{case['model']} {case['plan']}: " + ", ".join(f"{k}={v:.2e}" for k, v in worst.items()))
        assert all(r["num_grads"] > 0 and r["num_params"] > 0 and len(r["losses"]) == 3 for r in results), case
        assert max(worst.values()) < TOL, (case, worst)
        for step in range(3):  # every rank reports the same global loss
            assert len({round(r["losses"][step], 6) for r in results}) == 1, case
    return per_case


@pytest.mark.timeout(LAUNCH_S + 30)
def test_two_ranks_cp_loss_parallel_and_recompute_policies():
    cases = [
        {"model": LLAMA, "plan": {"cp": 2, "microbatch_size": 4, "num_microbatches": 2}},
        # ring attention (apply/ring_attention.py): K/V blocks passed around the CP ring
        {"model": LLAMA, "plan": {"cp": 2, "cp_mode": "ring", "microbatch_size": 4, "num_microbatches": 2}},
        # learned positions (embed.pos) instead of rotary tables
        {"model": "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=128", "plan": {"cp": 2, "microbatch_size": 8}},
        # vocabulary not divisible by tp: shards of 64 and 63 rows
        {
            "model": "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=127",
            "plan": {"tp": 2, "microbatch_size": 4, "num_microbatches": 2, "loss_parallel": True},
        },
        # the vocabulary-parallel loss's op-by-op backward (loss_kernel=eager) instead of the in-place one
        {
            "model": "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=127",
            "plan": {"tp": 2, "microbatch_size": 4, "loss_parallel": True, "loss_kernel": "eager"},
        },
        {"model": LLAMA, "plan": {"dp": 2, "microbatch_size": 2, "num_microbatches": 2, "recompute": "op"}},
        {"model": LLAMA, "plan": {"dp": 2, "microbatch_size": 4, "recompute": "op:matmuls"}},
        {"model": LLAMA, "plan": {"dp": 2, "microbatch_size": 4, "recompute": "op:attention"}},
        {"model": LLAMA, "plan": {"dp": 2, "microbatch_size": 4, "recompute": "every:2"}},
    ]
    run(2, cases)


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.timeout(LAUNCH_S + 30)
def test_cp2_hf_llama():
    pytest.importorskip("transformers")
    run(2, [{"model": HF_LLAMA, "plan": {"cp": 2, "microbatch_size": 4, "num_microbatches": 2}}])


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.timeout(LAUNCH_S + 30)
def test_hsdp_with_ep_on_hf_stacked_experts():
    """HSDP x EP where the experts are HF stacked-expert modules (DTensor on the ep dim)."""
    pytest.importorskip("transformers")
    run(
        4,
        [
            {
                "model": "hf:mixtral",
                "seq": 16,
                "plan": {"dp": 4, "ep": 2, "dp_shard": 2, "zero": 3, "microbatch_size": 2},
            },
            {
                "model": "hf:qwen3_moe",
                "seq": 16,
                "plan": {"dp": 4, "ep": 2, "dp_shard": 2, "zero": 2, "microbatch_size": 2},
            },
        ],
    )


@pytest.mark.timeout(LAUNCH_S + 30)
def test_four_ranks_cp_with_tp_pp_dp_ep_and_loss_parallel_and_hsdp():
    cases = [
        {
            "model": LLAMA,
            "plan": {"cp": 2, "tp": 2, "microbatch_size": 4, "num_microbatches": 2, "sequence_parallel": True},
        },
        {"model": LLAMA, "plan": {"cp": 2, "pp": 2, "microbatch_size": 2, "num_microbatches": 4}},
        {"model": LLAMA, "plan": {"cp": 2, "dp": 2, "zero": 3, "microbatch_size": 2, "num_microbatches": 2}},
        {
            "model": MOE,
            "plan": {"cp": 2, "dp": 2, "ep": 2, "microbatch_size": 2, "num_microbatches": 2, "recompute": "op"},
        },
        {
            "model": "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=127",
            "plan": {"tp": 2, "dp": 2, "microbatch_size": 2, "num_microbatches": 2, "loss_parallel": True},
        },
        {"model": LLAMA, "plan": {"dp": 4, "dp_shard": 2, "zero": 2, "microbatch_size": 1, "num_microbatches": 2}},
        {"model": LLAMA, "plan": {"dp": 4, "dp_shard": 2, "zero": 3, "microbatch_size": 1, "num_microbatches": 2}},
        # HSDP x EP: experts on the (dp_replicate, edp_shard) mesh, here (2, 1): replicated, not scattered
        {
            "model": MOE,
            "plan": {"dp": 4, "ep": 2, "dp_shard": 2, "zero": 3, "microbatch_size": 1, "num_microbatches": 2},
        },
    ]
    per_case = run(4, cases)
    for r in per_case[4]:  # loss parallel: the LM head is sharded by vocabulary
        assert "lm_head.weight" in r["sharded"]


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_four_ranks_ring_attention():
    """Ring CP with four ranks in the ring (two distinct neighbours), under TP with SP, and compiled."""
    run(
        4,
        [
            {"model": LLAMA, "plan": {"cp": 4, "cp_mode": "ring", "microbatch_size": 4, "num_microbatches": 2}},
            {
                "model": LLAMA,
                "plan": {
                    "cp": 2,
                    "tp": 2,
                    "cp_mode": "ring",
                    "microbatch_size": 4,
                    "num_microbatches": 2,
                    "sequence_parallel": True,
                },
            },
            {
                "model": LLAMA,
                "plan": {
                    "cp": 2,
                    "dp": 2,
                    "zero": 3,
                    "compile": True,
                    "cp_mode": "ring",
                    "microbatch_size": 2,
                    "num_microbatches": 2,
                },
            },
        ],
        compile_backend="aot_eager",
    )


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_S + 30)
def test_eight_ranks_hsdp_with_tp_and_with_cp_and_ep():
    run(
        8,
        [
            {
                "model": LLAMA2,
                "plan": {"dp": 4, "tp": 2, "dp_shard": 2, "zero": 3, "microbatch_size": 1, "num_microbatches": 2},
            },
            {
                "model": LLAMA2,
                "plan": {"dp": 4, "cp": 2, "dp_shard": 2, "zero": 2, "microbatch_size": 1, "num_microbatches": 2},
            },
            # HSDP x EP: experts sharded over edp_shard (2 replicas; with CP, x cp) and replicated across
            {
                "model": MOE,
                "plan": {"dp": 8, "ep": 2, "dp_shard": 4, "zero": 3, "microbatch_size": 1, "num_microbatches": 1},
            },
            {
                "model": MOE,
                "plan": {
                    "dp": 4,
                    "cp": 2,
                    "ep": 2,
                    "dp_shard": 2,
                    "zero": 2,
                    "microbatch_size": 1,
                    "num_microbatches": 2,
                },
            },
            {
                "model": MOE,
                "plan": {
                    "dp": 4,
                    "tp": 2,
                    "ep": 2,
                    "dp_shard": 2,
                    "zero": 3,
                    "microbatch_size": 1,
                    "num_microbatches": 2,
                },
            },
        ],
        timeout=2 * LAUNCH_S,
    )


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_compiled_blocks_under_fsdp_and_full_recompute():
    """plan.compile on two ranks; the graphs run through aot_eager here (inductor's C++ code
    generation is tested in one process: tests/unit/apply/test_loss_parallel.py)."""
    run(
        2,
        [{"model": LLAMA2, "plan": {"dp": 2, "zero": 3, "compile": True, "microbatch_size": 4, "recompute": "full"}}],
        compile_backend="aot_eager",
    )
