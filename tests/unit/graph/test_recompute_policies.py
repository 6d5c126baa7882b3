"""Recompute policies: their definitions (nest_fx.graph.recompute_policies), how the runtime
applies them (nest_fx.apply.activation_checkpoint) and the bytes they keep per block
(profiler.recompute_memory), in one process."""

from __future__ import annotations

import copy

import pytest
import torch

from nest_fx.apply import ApplyError, checks
from nest_fx.apply.activation_checkpoint import apply_checkpointing
from nest_fx.apply.losses import lm_loss
from nest_fx.graph.recompute_policies import OP_POLICIES, kept_op_kinds, parse_recompute, recompute_policy_problem
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan
from profiler.recompute_memory import kept_bytes, packed_bytes

LLAMA = "llama:hidden=64,layers=4,heads=4,seq=32,vocab=128"
BLOCKS = [f"layers.{i}" for i in range(4)]


def test_forms_and_names():
    assert parse_recompute("op").policy is OP_POLICIES["default"]
    assert parse_recompute("op:matmuls").policy.matmul_period == 1
    assert parse_recompute("every:3").every == 3
    assert recompute_policy_problem("op:attention") == ""
    assert "unknown op policy 'fancy'; known: op:default, op:matmuls, op:attention" in recompute_policy_problem(
        "op:fancy"
    )
    assert "k >= 2" in recompute_policy_problem("every:1")
    with pytest.raises(ApplyError, match="unknown op policy 'fancy'"):
        checks.check_supported(uniform_plan(6, recompute="op:fancy"))


def test_default_op_policy_is_torchtitans_save_list_with_every_other_matmul():
    policy = OP_POLICIES["default"]
    kinds = [
        "mm",
        "mm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "mm",
        "addmm",
        "mm",
        "silu",
        "mul",
        "_c10d_functional.reduce_scatter_tensor",
        "max",
    ]
    # matmuls 1, 3, 5 kept (1st, 3rd, ...); attention, reduce-scatter and amax kept; elementwise ops recomputed
    assert kept_op_kinds(policy, kinds) == [True, False, True, True, False, True, False, False, True, True]
    assert kept_op_kinds(OP_POLICIES["matmuls"], ["mm", "mm", "silu"]) == [True, True, False]
    assert kept_op_kinds(OP_POLICIES["attention"], ["mm", "_scaled_dot_product_efficient_attention"]) == [False, True]


def test_every_k_counts_blocks_through_the_stage():
    assert parse_recompute("every:2").recomputed_blocks(5) == [1, 3]
    assert parse_recompute("full").recomputed_blocks(3) == [0, 1, 2]
    assert parse_recompute("none").recomputed_blocks(3) == []
    model, _ = build_seeded(LLAMA)
    assert apply_checkpointing(model, BLOCKS[:1], "every:2") == 0
    assert apply_checkpointing(model, BLOCKS[1:], "every:2", first_index=1) == 2  # interleaved: a later chunk
    assert [getattr(model.layers[i], "_nest_fx_recompute", None) for i in range(4)] == [None, "full", None, "full"]


@pytest.mark.parametrize("recompute", ["op", "op:matmuls", "op:attention", "every:2"])
def test_every_policy_keeps_the_gradients(recompute):
    model, cfg = build_seeded(LLAMA)
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.randint(0, cfg.vocab_size, (2, 16))
    apply_checkpointing(model, BLOCKS, recompute)
    for m in (model, ref):
        lm_loss(m(tokens), targets).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-7, msg=name)


def test_measured_bytes_tell_the_policies_apart():
    model, _ = build_seeded(LLAMA)
    block, x = model.layers[0], torch.randn(2, 32, 64)
    kept = {r: kept_bytes(block, [x], r) for r in ("none", "op:matmuls", "op", "op:attention", "full")}
    assert kept["none"] == packed_bytes(block, [x])  # the storage census agrees with saved-tensor hooks
    assert kept["none"] > kept["op:matmuls"] > kept["op"] > kept["op:attention"] > kept["full"] == 0
    # op:attention keeps the attention output and its logsumexp: [2, 4, 32, 16] + [2, 4, 32] fp32
    assert kept["op:attention"] == (2 * 4 * 32 * 16 + 2 * 4 * 32) * 4


def test_every_k_counts_a_group_of_sequential_children_as_one_block():
    import torch.nn as nn

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    groups = [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]  # four layers of two children each
    wrapped = apply_checkpointing(model, groups, "every:2")
    marked = [name for name, m in model.named_children() if getattr(m, "_nest_fx_recompute", None)]
    assert wrapped == 2 and len(marked) == 4  # two of the four layers, both children of each
    assert {tuple(g) for g in groups if set(g) <= set(marked)} == {tuple(g) for g in groups if set(g) & set(marked)}
