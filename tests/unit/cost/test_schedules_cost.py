"""The zero-bubble and V schedules in the plan, the cost model and the search.

The cost model's bubble and in-flight activations of ``interleaved-zb``, ``zbv`` and
``dualpipev`` (``nest_fx/cost/schedules.py``) are checked against torch's own action orders
(``torch.distributed.pipelining``: the order each rank runs, as the schedule class computes it),
event-simulated with forward = input gradient = weight gradient = 1 per chunk and free transfers.
"""

from __future__ import annotations

import types

import pytest
from conftest import tight_cluster
from torch.distributed.pipelining import schedules as S

from nest_fx.apply.checks import ApplyError, check_supported
from nest_fx.apply.pipeline import chunk_layout
from nest_fx.cost import inflight
from nest_fx.cost.step_time import pipeline_span, simulate
from nest_fx.plan import Plan, PlanError, uniform_plan
from nest_fx.plan.constraints import schedule_pairs
from nest_fx.plan.may_run import unrun_schedule
from nest_fx.plan.vocabulary import schedule_problem
from nest_fx.solver import NoFeasiblePlan, SolverOptions, solve
from nest_fx.solver.space import GlobalConfig, stage_counts
from nest_fx.workload import workload_for_model

CLASSES = {
    "interleaved": S.ScheduleInterleaved1F1B,
    "interleaved-zb": S.ScheduleInterleavedZeroBubble,
    "zbv": S.ScheduleZBVZeroBubble,
    "dualpipev": S.ScheduleDualPipeV,
}


def torch_orders(schedule: str, p: int, m: int, v: int) -> dict:
    """{rank: [compute actions]} as torch's schedule class orders them (its per-rank order
    function run on a stand-in holding the attributes it reads)."""
    cls = CLASSES[schedule]
    rounds = max(1, m // p)
    self = types.SimpleNamespace(
        pp_group_size=p,
        _n_microbatches=m,
        n_local_stages=v,
        num_stages=p * v,
        _num_stages=p * v,
        number_of_rounds=rounds,
        microbatches_per_round=m // rounds,
    )
    orders = {r: cls._calculate_single_rank_operations(self, r) for r in range(p)}
    if cls is S.ScheduleInterleavedZeroBubble:
        self.pipeline_order = orders
        orders = cls._add_bubbles_to_actions(self, p * v)
    out = {}
    for r, actions in orders.items():
        flat = []
        for a in actions:
            if a is not None:
                flat.extend(a.sub_actions if a.computation_type == S.OVERLAP_F_B else [a])
        out[r] = flat
    return out


def event_simulation(orders: dict, p: int, v: int):
    """(pipeline span, peak chunk-microbatches held per rank) with F = I = W = 1 (B = I + W = 2)
    and free transfers; a chunk's activations are held from its forward to its weight gradient."""
    n = p * v
    done, clock, held, peak, pos = {}, [0.0] * p, [0] * p, [0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
                if kind == S.F:
                    deps, length = ([] if s == 0 else [(s - 1, "F", mb)]), 1.0
                elif kind in (S.I, S.B):
                    deps = [(s, "F", mb)] + ([] if s == n - 1 else [(s + 1, "I", mb)])
                    length = 1.0 if kind == S.I else 2.0
                else:
                    deps, length = [(s, "I", mb)], 1.0
                if any(d not in done for d in deps):
                    break
                clock[r] = max([clock[r]] + [done[d] for d in deps]) + length
                for k in ("I", "W") if kind == S.B else (kind.value,):
                    done[(s, k, mb)] = clock[r]
                held[r] += 1 if kind == S.F else -1 if kind in (S.W, S.B) else 0
                peak[r] = max(peak[r], held[r])
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(orders[r]) for r in range(p)), "the order deadlocked"
    return max(clock), peak


CASES = [
    ("interleaved", 2, 4, 2),
    ("interleaved", 4, 8, 2),
    ("interleaved-zb", 2, 4, 2),
    ("interleaved-zb", 4, 8, 2),
    ("interleaved-zb", 4, 16, 4),
    ("interleaved-zb", 4, 12, 3),
    ("interleaved-zb", 8, 16, 2),
    ("zbv", 2, 4, 2),
    ("zbv", 4, 8, 2),
    ("zbv", 4, 16, 2),
    ("zbv", 8, 16, 2),
    ("dualpipev", 2, 4, 2),
    ("dualpipev", 4, 8, 2),
    ("dualpipev", 4, 12, 2),
    ("dualpipev", 8, 32, 2),
]


@pytest.mark.parametrize("schedule, p, m, v", CASES)
def test_bubble_and_memory_match_torchs_own_order(schedule, p, m, v):
    span, peak = event_simulation(torch_orders(schedule, p, m, v), p, v)
    t = 3.0 * v  # a device's forward + backward per microbatch: v chunks of F + I + W
    # equal stages, free transfers: max_i t_i = t, sum_i s_i = p t
    assert pipeline_span(t, p * t, m, schedule, v) == pytest.approx(span)
    if schedule != "interleaved":  # the interleaved counts are per chunk (inflight.interleaved_chunk_states)
        for rank in range(p):
            assert inflight.pipeline_inflight_microbatches(schedule, rank, p, m, v) == pytest.approx(peak[rank] / v)


def test_zero_bubble_schedules_leave_a_third_of_the_1f1b_bubble():
    # ZB-H1 (Qi et al.): (p - 1)(T_F + T_B - T_W) with T_F = T_B = T_W, against 1F1B's (p - 1)(T_F + T_B + T_W)
    base = pipeline_span(3.0, 12.0, 8, "1f1b") - 8 * 3.0
    assert pipeline_span(3.0, 12.0, 8, "interleaved-zb", 2) - 24.0 == pytest.approx(base / 6)
    assert pipeline_span(3.0, 12.0, 8, "zbv", 2) - 24.0 == pytest.approx(base / 6)
    assert pipeline_span(3.0, 12.0, 8, "interleaved", 2) - 24.0 == pytest.approx(base / 2)


def test_plan_rules_of_the_new_schedules():
    assert schedule_problem("interleaved-zb:3") == "" and schedule_problem("zbv") == ""
    assert "not a schedule" in schedule_problem("zbv:3")
    assert schedule_pairs(["zbv", "interleaved-zb:4", "dualpipev"], [0]) == [
        ("zbv", 2),
        ("interleaved-zb", 4),
        ("dualpipev", 2),
    ]
    uniform_plan(8, pp=2, schedule="zbv", virtual_stages=2, num_microbatches=4).validate()
    with pytest.raises(PlanError, match="2 model chunks per device, laid in a V; set virtual_stages to 2"):
        uniform_plan(8, pp=2, schedule="zbv", num_microbatches=4).validate()
    with pytest.raises(PlanError, match=r"at least 2 x pp = 4 microbatches"):
        uniform_plan(8, pp=2, schedule="dualpipev", virtual_stages=2, num_microbatches=3).validate()
    with pytest.raises(PlanError, match="has 1 layer"):
        uniform_plan(3, pp=2, schedule="zbv", virtual_stages=2, num_microbatches=4).validate()
    with pytest.raises(PlanError, match="multiple of the 2 stages for the interleaved-zb"):
        uniform_plan(8, pp=2, schedule="interleaved-zb", virtual_stages=2, num_microbatches=3).validate()


def test_v_layout_puts_the_first_and_last_chunk_on_device_0():
    plan = uniform_plan(9, pp=2, schedule="zbv", virtual_stages=2, num_microbatches=4)
    assert [(s.start, s.end) for s in plan.stages] == [(0, 4), (4, 9)]  # device 0: 4 layers, device 1: 5
    layout = chunk_layout(plan, 9)  # chain order: device 0, 1, then 1, 0
    assert layout[0] == ([(0, 2), (7, 9)], [0, 3])
    assert layout[1] == ([(2, 4), (4, 7)], [1, 2])
    inter = chunk_layout(Plan.from_dict({**plan.to_dict(), "schedule": "interleaved-zb"}), 9)  # 0, 1, 0, 1
    assert inter[0] == ([(0, 2), (4, 6)], [0, 2]) and inter[1] == ([(2, 4), (6, 9)], [1, 3])


def test_zero3_and_compile_are_refused_before_training_and_never_searched():
    plan = uniform_plan(8, pp=2, dp=2, schedule="zbv", virtual_stages=2, num_microbatches=4, zero=3)
    with pytest.raises(ApplyError, match="zbv with zero=3.*fix: zero <= 2"):
        check_supported(plan)
    assert "compile" in unrun_schedule("interleaved-zb", pp=2, zero=1, compile=True)
    assert unrun_schedule("zbv", pp=1, zero=3, compile=True) == ""  # no pipeline: no schedule runs
    cluster = tight_cluster(1.0)
    work = workload_for_model("llama:hidden=256,layers=4,heads=4,seq=128,vocab=512", cluster)
    options = SolverOptions(zero_stages=(3,))
    for schedule in ("interleaved-zb", "zbv", "dualpipev"):
        g = GlobalConfig(tp=1, dp=1, ep=1, microbatch_size=1, zero=3, schedule=schedule, virtual_stages=2)
        assert stage_counts(work, cluster, g, 16, options) == []
    g = GlobalConfig(tp=1, dp=1, ep=1, microbatch_size=1, zero=1, schedule="zbv", virtual_stages=2)
    # every depth p >= 2 whose devices each get 2 chunks of a layer or more
    assert stage_counts(work, cluster, g, 16, options) == list(range(2, len(work) // 2 + 1)) != []


def test_the_search_chooses_a_zero_bubble_schedule_and_prices_it_as_simulate_does():
    cluster = tight_cluster(4.0)
    work = workload_for_model("llama:hidden=512,layers=8,heads=8,seq=256,vocab=1024", cluster)
    space = dict(
        microbatch_sizes=(1,), tp_degrees=(1,), zero_stages=(1,), recompute=("none",), degree_bounds={"pp": (4, 4)}
    )
    plain = solve(work, cluster, 16, SolverOptions(schedules=(("1f1b", 1),), **space))
    found = solve(work, cluster, 16, SolverOptions(schedules=(("1f1b", 1), ("zbv", 2), ("dualpipev", 2)), **space))
    assert found.plan.schedule == "zbv" and found.plan.virtual_stages == 2  # dualpipev: zbv's time, more memory
    assert found.result.step_s < plain.result.step_s
    assert simulate(found.plan, work, cluster).step_s == pytest.approx(found.result.step_s, rel=1e-9)
    assert found.result.breakdown["bubble"] < plain.result.breakdown["bubble"] / 3


def test_selective_recompute_is_refused_and_never_planned_under_a_split_backward():
    plan = uniform_plan(8, pp=2, schedule="interleaved-zb", virtual_stages=2, num_microbatches=4, recompute="op")
    with pytest.raises(ApplyError, match="recompute=op: selective activation checkpointing.*fix: recompute none"):
        check_supported(plan)
    assert unrun_schedule("zbv", pp=2, recompute=("none", "every:2", "full")) == ""
    cluster = tight_cluster(4.0)
    work = workload_for_model("llama:hidden=512,layers=8,heads=8,seq=256,vocab=1024", cluster)
    space = dict(
        microbatch_sizes=(1,),
        tp_degrees=(1,),
        zero_stages=(1,),
        recompute=("selective", "full"),
        degree_bounds={"pp": (4, 4)},
    )
    plain = solve(work, cluster, 16, SolverOptions(schedules=(("1f1b", 1),), **space))
    assert {s.recompute for s in plain.plan.stages} == {"selective"}  # cheaper than full where it may run
    found = solve(work, cluster, 16, SolverOptions(schedules=(("zbv", 2),), **space))
    assert found.plan.schedule == "zbv" and {s.recompute for s in found.plan.stages} == {"full"}
    with pytest.raises(NoFeasiblePlan):  # nothing runs: zbv with selective recompute only
        solve(work, cluster, 16, SolverOptions(schedules=(("zbv", 2),), **{**space, "recompute": ("selective",)}))
