"""The planner is never predicted slower than a published configuration costed by the same model
(issue 26): torchtitan's 405B long-context runs (TP x PP x CP x FSDP, Table 6 of its H100
benchmark) and Llama 3's CP 16 on 131,072-token sequences, shrunk to a small model on 64
devices. The published plan must lie in the search space (CP 16 included: ``long_context_cp``)
and ``solve`` must return a plan no slower than ``simulate`` gives it."""

import pytest

from nest_fx.cost.step_time import simulate
from nest_fx.plan import Plan, StagePlan
from nest_fx.solver import SolverOptions, solve
from nest_fx.solver.space import LONG_CONTEXT_TOKENS, in_space
from nest_fx.workload import workload_for_model
from cluster_fixtures import h100ish


def _published(work, tp: int, pp: int, cp: int, dp: int, microbatches: int, recompute: str) -> Plan:
    """TP x PP x CP x FSDP as torchtitan writes it: the layers evenly over the stages."""
    n = len(work)
    bounds = [k * n // pp for k in range(pp + 1)]
    return Plan(
        stages=[StagePlan(a, b, tp, recompute) for a, b in zip(bounds, bounds[1:])],
        num_layers=n,
        dp=dp,
        cp=cp,
        zero=1,
        microbatch_size=1,
        num_microbatches=microbatches,
        schedule="1f1b",
        sequence_parallel=tp > 1,
        loss_parallel=tp > 1,
        placement="stage-major",
        seq_len=work.dims.seq_len,
    )


@pytest.mark.parametrize(
    "seq, tp, pp, cp, dp",
    [
        (32768, 8, 2, 2, 2),  # torchtitan t6.2-like: TP 8, PP, CP 2, FSDP
        (65536, 2, 2, 8, 2),  # t6.4-like: CP 8
        (16 * LONG_CONTEXT_TOKENS, 2, 2, 16, 1),  # Llama 3's long-context stage: CP 16
    ],
)
def test_planner_never_slower_than_the_published_configuration(seq, tp, pp, cp, dp):
    cluster = h100ish(tp * pp * cp * dp)
    work = workload_for_model(f"llama:hidden=1024,layers=4,heads=16,kv=8,seq={seq},vocab=8192", cluster)
    options = SolverOptions(time_budget=None, use_all_devices=True, precision="bf16-mixed")
    plan = _published(work, tp, pp, cp, dp, microbatches=4, recompute="full")
    plan.precision = "bf16-mixed"
    published = simulate(plan, work, cluster, options.priced().cost)
    assert published.feasible
    assert in_space(plan, options, cluster)  # so the exact search can never do worse
    found = solve(work, cluster, dp * 4, options)
    assert found.complete
    assert found.result.step_s <= published.step_s * (1 + 1e-9)


def test_long_context_cp_degrees():
    options = SolverOptions()
    assert options.cp_searched(8192) == (1, 2, 4, 8)
    assert options.cp_searched(0) == (1, 2, 4, 8)  # unknown length: what was asked
    assert options.cp_searched(131072) == (1, 2, 4, 8, 16)
    assert options.cp_searched(262144) == (1, 2, 4, 8, 16, 32)
    assert SolverOptions(long_context_cp=False).cp_searched(262144) == (1, 2, 4, 8)
    assert SolverOptions(cp_degrees=(1, 2)).cp_searched(65536) == (1, 2, 4, 8)
