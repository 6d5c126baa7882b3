"""Float8 with tensor parallelism: the plan the cost model prices is one the runtime runs.

Float8 needs fp8 tensor cores and torchao: on this CPU machine the runtime refuses it before
training (``apply/float8.py``), with or without TP. The numbers are checked on CPU through
torch's CPU ``_scaled_mm`` (``$NEST_FX_FLOAT8_EMULATE=1``) when torchao is installed: the TP
ranks cast their shards with the global tensorwise scales, so one step of TP2 (and TP2 with
sequence parallelism) equals the single-device Float8 step within 1e-5. Over several steps a
1e-7 difference in a weight can move an fp8 rounding by one fp8 step, so later steps are not
compared to 1e-5 (no parallel Float8 run is: data parallelism scales each replica's activations
by its own amax)."""

from __future__ import annotations

import os
from typing import Dict, List

import pytest

from nest_fx.apply import ApplyError, checks
from nest_fx.apply.float8 import EMULATE_ENV
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.cluster import load_cluster
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan
from nest_fx.plan.constraints import Constraints
from nest_fx.plan.may_run import unrun_fields
from nest_fx.solver import SolverOptions
from nest_fx.solver.constraints import solve_constrained
from nest_fx.testing import equivalence
from nest_fx.workload import workload_for_model

LLAMA2 = "llama:hidden=64,layers=2,heads=4,seq=32,vocab=128"


def test_float8_with_tp_is_planned_and_refused_only_by_the_device():
    assert unrun_fields(uniform_plan(4, tp=2, float8=True, sequence_parallel=True)) == []
    cluster = load_cluster("dgx-h100:8")  # fp8 tensor cores: the planner is not held to tp = 1
    work = workload_for_model("llama:hidden=256,layers=4,heads=8,seq=256,vocab=1024", cluster)
    options = SolverOptions(microbatch_sizes=(1, 2), tp_degrees=(1, 2), cp_degrees=(1,))
    plan = solve_constrained(work, cluster, 16, Constraints(fix={"float8": True, "tp": 2}), options).plan
    assert plan.float8 and {s.tp for s in plan.stages} == {2}


def test_float8_with_tp_is_refused_on_cpu_before_training(monkeypatch):
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    model, _ = build_seeded(LLAMA2)
    with pytest.raises(ApplyError, match="no CUDA device.*fix: .*float8=false"):
        checks.check_runtime_options(uniform_plan(4, tp=2, float8=True), model, None, lm_loss, "cpu")


def _float8_equivalences(cases: List[Dict]) -> List[Dict]:
    os.environ[EMULATE_ENV] = "1"
    return [equivalence({"batch": 8, "seq": 32, "steps": 1, "lr": 0.5, **case}) for case in cases]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_float8_tp2_step_equals_the_single_device_float8_step():
    pytest.importorskip("torchao")
    cases = [
        {"model": LLAMA2, "plan": {"tp": 2, "float8": True, "microbatch_size": 8}},
        {"model": LLAMA2, "plan": {"tp": 2, "float8": True, "microbatch_size": 8, "sequence_parallel": True}},
    ]
    per_rank = launch(_float8_equivalences, 2, cases, timeout=570)
    for k, case in enumerate(cases):
        for r in (rank[k] for rank in per_rank):
            assert r["num_grads"] > 0 and r["plan"]["float8"], case
            assert max(r["loss_diff"], r["grad_diff"], r["param_diff"]) < 1e-5, (case, r)
