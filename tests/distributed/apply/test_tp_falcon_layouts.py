"""Falcon's fused ``query_key_value`` under tensor parallelism, per layout (tiny configs, no download):
the classic layout (``[heads, 3, head_dim]``), the new decoder architecture with key/value groups
divisible by tp (tests/distributed/apply/test_tp_layouts_dist.py) and the default multi-query layout
(query heads, then one key and one value head every query head shares, sliced off the heads dim:
tests/distributed/apply/test_tp_falcon_multi_query.py) are accepted; a single key/value group of the
new decoder architecture is refused before training, naming the module, the reason and the fix."""

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


def _tp_problem(name: str, tp: int = 2) -> str:
    pytest.importorskip("transformers")
    model, cfg = build_seeded(name)
    graph = trace(model, (torch.randint(0, cfg.vocab_size, (2, 8)),))
    return may_run(model, graph).degree_problem("tp", tp)


def test_falcon_layouts_with_groups_tp_can_divide_or_shared_heads_are_accepted():
    assert _tp_problem("hf:falcon") == ""  # multi_query=True: 4 query heads, one shared key and value head
    assert _tp_problem("hf:falcon", 4) == ""
    assert _tp_problem("hf:falcon:multi_query=False") == ""
    assert _tp_problem("hf:falcon:new_decoder_architecture=True,num_kv_heads=2") == ""


def test_multi_query_falcon_beyond_its_query_heads_is_refused():
    problem = _tp_problem("hf:falcon", 8)  # the shared key/value head does not count: 4 query heads
    assert problem.startswith("tp=8 does not divide the model's 4 attention heads"), problem
    assert problem.endswith("fix: use tp in [1, 2, 4]"), problem


def test_a_single_key_value_group_is_refused():
    one_group = _tp_problem("hf:falcon:new_decoder_architecture=True,num_kv_heads=1")
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
