"""Overlap of communication with compute as measured shares (docs/cost_model.md, "Overlap"):
TP, EP and CP collectives, FSDP's gradient traffic and pipeline sends."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nest_fx.cli import build_parser
from nest_fx.cluster import load_cluster
from nest_fx.cost.dp_sync import tail_terms
from nest_fx.cost.options import ASYNC_TP_OVERLAP, CostOptions
from nest_fx.cost.results import microbatch_time
from nest_fx.cost.step_time import exposed_comms, simulate
from nest_fx.plan import uniform_plan
from nest_fx.plan.constraints import Constraints
from nest_fx.plan.settings import OVERLAPS, default
from nest_fx.solver.constraints import cost_options
from nest_fx.workload import workload_for_model

GPT = "gpt:hidden=256,layers=4,heads=8,seq=256,vocab=4096"


def test_shares_default_to_what_the_runtime_does_and_are_declared_once():
    o = CostOptions()
    assert OVERLAPS == ("overlap_tp_comm", "overlap_ep_comm", "overlap_cp_comm", "overlap_grad_sync", "overlap_p2p")
    assert [getattr(o, n) for n in OVERLAPS] == [default(n) for n in OVERLAPS] == [0.0, 0.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="overlap_tp_comm"):
        CostOptions(overlap_tp_comm=1.5)


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
def test_exposed_collectives_keep_the_unhidden_share_and_share_one_compute_window(share):
    comms = {"tp": 4.0, "ep": 2.0, "cp": 1.0}
    o = CostOptions(overlap_tp_comm=share, overlap_ep_comm=share, overlap_cp_comm=share)
    plenty = exposed_comms(comms, 100.0, o)
    assert plenty == pytest.approx({k: v * (1 - share) for k, v in comms.items()})
    tight = exposed_comms(comms, 1.0, o)  # one second of compute hides at most one second, TP's first
    assert sum(tight.values()) == pytest.approx(sum(comms.values()) - min(share * 4.0, 1.0))
    arrays = exposed_comms({k: np.array([v, v]) for k, v in comms.items()}, np.array([100.0, 1.0]), o)
    assert [float(arrays[k][0]) for k in comms] == pytest.approx(list(plenty.values()))
    assert sum(float(arrays[k][1]) for k in comms) == pytest.approx(sum(tight.values()))


def test_pipeline_sends_between_waiting_and_full_overlap():
    work, p2p, v = 1.0, 0.2, 2
    assert microbatch_time(work, p2p, v, 0.0) == microbatch_time(work, p2p, v, False) == (1.8, 1.8)
    assert microbatch_time(work, p2p, v, 1.0) == pytest.approx((1.0, 1.8))
    t, s = microbatch_time(work, p2p, v, 0.5)
    assert 1.0 < t < 1.8 and s == pytest.approx(t + 0.4)


def test_grad_sync_share_exposes_the_rest_after_backward():
    cluster = load_cluster("dgx-h100:8")
    full = tail_terms(3.0, 5.0, 0.0, 0.0, 8, 3, cluster, CostOptions())[0]
    half = tail_terms(3.0, 5.0, 0.0, 0.0, 8, 3, cluster, CostOptions(overlap_grad_sync=0.5))[0]
    none = tail_terms(3.0, 5.0, 0.0, 0.0, 8, 3, cluster, CostOptions(overlap_grad_sync=0.0))[0]
    zero0 = tail_terms(3.0, 5.0, 0.0, 0.0, 8, 0, cluster, CostOptions())[0]  # the runtime syncs after backward
    assert (full, half, none, zero0) == pytest.approx((0.0, 1.5, 3.0, 3.0))


def test_tp_share_shortens_a_tp_plan_and_plan_files_carry_it():
    cluster = load_cluster("dgx-h100:8")
    work = workload_for_model(GPT, cluster)
    plan = uniform_plan(len(work), tp=8, dp=1, microbatch_size=4, num_microbatches=1, sequence_parallel=True)
    steps = [simulate(plan, work, cluster, CostOptions(overlap_tp_comm=f)).step_s for f in (0.0, ASYNC_TP_OVERLAP, 1.0)]
    assert steps[0] > steps[1] > steps[2]
    recorded = dataclasses.replace(plan, constraints=Constraints(overlap_tp_comm=ASYNC_TP_OVERLAP))
    assert simulate(recorded, work, cluster, cost_options(recorded.constraints)).step_s == steps[1]


def test_plan_and_simulate_take_the_overlap_flags():
    parser = build_parser()
    args = parser.parse_args(["simulate", "--plan", "p.json", "--overlap-tp-comm", "0.25", "--kernels", "fused"])
    assert (args.overlap_tp_comm, args.kernels) == ("0.25", "fused")
    args = parser.parse_args(["plan", "--model", "gpt2", "--cluster", "dgx-h100", "--overlap-ep-comm", "50%"])
    assert args.overlap_ep_comm == "50%"
