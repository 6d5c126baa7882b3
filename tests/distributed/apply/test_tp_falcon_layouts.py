"""Falcon's fused ``query_key_value`` under tensor parallelism, per layout (tiny configs, no download):
the classic layout (``[heads, 3, head_dim]``) and the new decoder architecture with key/value groups
divisible by tp run at parity (the latter in tests/distributed/apply/test_tp_layouts_dist.py); the multi-query layout
(one key/value head sliced off the heads dim, ``qkv[..., :-2, :]``) and a single key/value group are
refused before training, naming the module, the reason and the fix."""

from __future__ import annotations

import pytest
import torch

from nest_fx.apply.launch import launch
from nest_fx.graph import trace
from nest_fx.models import build_seeded
from nest_fx.plan.may_run import may_run
from nest_fx.testing import equivalence

pytestmark = pytest.mark.hf
LAUNCH_S = 300


def _tp2_problem(name: str) -> str:
    pytest.importorskip("transformers")
    model, cfg = build_seeded(name)
    graph = trace(model, (torch.randint(0, cfg.vocab_size, (2, 8)),))
    return may_run(model, graph).degree_problem("tp", 2)


def test_multi_query_falcon_is_refused_naming_the_module_the_layout_and_the_fix():
    problem = _tp2_problem("hf:falcon")  # multi_query=True: 4 query heads, one key and one value head
    assert problem.startswith("tp=2 cannot shard transformer.h.0: attention pair ['self_attention.query_key_value']")
    assert (
        "op 'slice' in module 'transformer.h.0.self_attention' slices the sharded heads: it takes 4 of the 6 heads "
        "a fused projection is viewed as"
    ) in problem
    assert "this one has a single group every rank would need" in problem
    assert "new_decoder_architecture with num_kv_heads divisible by tp runs" in problem
    assert problem.endswith("fix: use tp=1 for this model")


def test_falcon_layouts_with_groups_tp_can_divide_are_accepted():
    assert _tp2_problem("hf:falcon:multi_query=False") == ""
    assert _tp2_problem("hf:falcon:new_decoder_architecture=True,num_kv_heads=2") == ""
    one_group = _tp2_problem("hf:falcon:new_decoder_architecture=True,num_kv_heads=1")
    assert "does not divide transformer.h.0.self_attention.query_key_value.weight: 1 heads" in one_group, one_group


def _many(specs):
    return [equivalence(spec) for spec in specs]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 60)
def test_classic_falcon_tp2_dp2_equals_one_device():
    pytest.importorskip("transformers")
    spec = {
        "model": "hf:falcon:multi_query=False",
        "plan": {"tp": 2, "dp": 2, "microbatch_size": 4},
        "batch": 8,
        "seq": 16,
        "steps": 3,
        "lr": 0.5,
    }
    ranks = [r[0] for r in launch(_many, 4, [spec], timeout=LAUNCH_S)]
    worst = {k: max(r[k] for r in ranks) for k in ("loss_diff", "grad_diff", "param_diff")}
    print(worst)
    assert all(v < 1e-5 for v in worst.values()), worst
    assert "transformer.h.1.self_attention.query_key_value.weight" in ranks[0]["sharded"]
