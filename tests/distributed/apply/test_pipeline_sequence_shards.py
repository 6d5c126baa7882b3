"""Pipeline stage boundaries under sequence parallelism carry each TP rank's sequence shard, and
the cost model prices what crosses them (4 gloo ranks, PP2 x TP2, fp32).

A stage whose last block hands on to another stage's first block keeps its shard
(``apply.tensor_parallel.sharded_cut``): each TP rank sends ``1/t`` of the sequence to its peer
and no collective runs at the boundary; a cut after the head carries the full embedding output,
and a stage holding only the tail gathers what it receives. Each cell trains the zoo Llama for 3
SGD steps against one device (``parity_helpers.run``, 1e-5), then counts one more step's
collectives and point-to-point bytes (``profiler.step_collectives.CollectiveCounter``) on every
rank and compares them with the price: the layers' TP collectives (``LayerCost.comms``) per
microbatch, the sequence-parallel slice after the head (its backward all-gathers the embedding
output's gradient) and gather before the tail included (``workload.sequence_edges``, on the
device holding the first block and the tail), a block's forward ones again where its recompute
re-runs them (``stage_terms.repeated_share``), plus the reported loss's all-reduce (not part of
training), and per boundary crossing ``cost.step_time.boundary_bytes``. Without sequence
parallelism each rank sends the whole tensor.
"""

from __future__ import annotations

import pytest
import torch

from nest_fx.apply.pipeline import chunk_layout
from nest_fx.cluster import Cluster
from nest_fx.cost.stage_terms import repeated_share
from nest_fx.cost.step_time import boundary_bytes
from nest_fx.plan import Plan, uniform_plan
from nest_fx.testing import equivalence
from nest_fx.workload import analytical_workload, dims_from_config
from nest_fx.workload.build import trace_model
from parity_helpers import LAUNCH_S, LLAMA, MOE, run

BATCH, SEQ, M, TP = 8, 32, 4, 2
BLOCKS = 6  # LLAMA's chain: head, 4 layers, tail
BASE = {"pp": 2, "tp": TP, "microbatch_size": BATCH // M, "num_microbatches": M}

pytestmark = pytest.mark.dist


def _plan(plan: dict, num_layers: int) -> Plan:
    plan = dict(plan)
    if "stages" in plan:
        return Plan.from_dict({"format": "nest-fx-plan/1", "num_layers": num_layers, **plan})
    return uniform_plan(num_layers, **plan)


def _parity_and_counts(spec):
    """``equivalence`` of the cell, then this rank's collectives and p2p bytes of one step (after
    a first one: PipelineStage infers its shapes then)."""
    from nest_fx.apply import auto_parallelize
    from nest_fx.apply.losses import lm_loss
    from nest_fx.models import build_model
    from profiler.step_collectives import CollectiveCounter

    out = equivalence(spec)
    torch.manual_seed(0)
    model, _ = build_model(spec["model"])
    tokens = torch.randint(0, 128, (BATCH, SEQ))
    plan = _plan(spec["plan"], BLOCKS)
    pm = auto_parallelize(model, tokens, global_batch_size=BATCH, loss_fn=lm_loss, plan=plan, verbose=False)
    pm.train_step(tokens, tokens)
    with CollectiveCounter() as counter:
        pm.train_step(tokens, tokens)
    out.update(counts=counter.counts, calls=counter.calls, sent=sorted(counter.sent), received=sorted(counter.received))
    return out


def _priced(plan: Plan):
    """Per pipeline device: ({collective kind: count} of one step, {(kind, phase, bytes): count}
    of its calls, sorted bytes it sends, sorted bytes it receives) as the cost model prices them
    (the calls without recompute: its re-run forward collectives run in the backward pass)."""
    graph, cfg = trace_model(LLAMA, seq=SEQ, dtype=torch.float32)
    work = analytical_workload(graph, dims_from_config(cfg, seq_len=SEQ), Cluster.preset("cpu-gloo", 4), torch.float32)
    n, sp, m = len(work), plan.sequence_parallel, plan.num_microbatches
    costs = [
        work.cost(
            k, tp=TP, microbatch_size=plan.microbatch_size, sequence_parallel=sp, loss_parallel=plan.loss_parallel
        )
        for k in range(n)
    ]

    def crossing(cut: int) -> float:  # what each TP rank sends across cut (between layers cut-1 and cut)
        return boundary_bytes(costs[cut - 1].out_bytes, TP, sp and costs[cut - 1].block)

    layout = chunk_layout(plan, n)
    owner = {stage: device for device, (_, indices) in enumerate(layout) for stage in indices}
    last = len(owner) - 1
    out = []
    for device, (ranges, indices) in enumerate(layout):
        counts = {"all_reduce": 1}  # the reported loss, over the world (one fp32 scalar)
        calls = {("all_reduce", "fwd", 4): 1}
        sent, received = [], []
        for (start, end), stage in zip(ranges, indices):
            for k in range(start, end):  # the slice after the head and the gather before the tail included
                for comm in costs[k].comms:
                    if comm.group == "tp":
                        again = repeated_share(comm, plan.stages[device].recompute) if costs[k].block else 0.0
                        counts[comm.kind] = counts.get(comm.kind, 0) + comm.count * (1 + again) * m
                        key = (comm.kind, comm.phase, comm.nbytes)
                        calls[key] = calls.get(key, 0) + comm.count * m
            if stage < last and owner[stage + 1] != device:  # activations out, their gradients back
                sent += [crossing(end)] * m
                received += [crossing(end)] * m
            if stage > 0 and owner[stage - 1] != device:
                received += [crossing(start)] * m
                sent += [crossing(start)] * m
        out.append((counts, calls, sorted(sent), sorted(received)))
    return out


def _check(plan: dict):
    results = run(4, LLAMA, plan, batch=BATCH, seq=SEQ, fn=_parity_and_counts)
    full = _plan(plan, BLOCKS)
    priced = _priced(full)
    for rank, r in enumerate(results):
        counts, calls, sent, received = priced[rank // TP]  # stage-major: ranks 0, 1 hold device 0's chunks
        assert r["counts"] == counts, (rank, r["counts"], counts)
        if full.stages[0].recompute == "none":
            assert r["calls"] == calls, (rank, r["calls"], calls)
        assert r["sent"] == sent and r["received"] == received, (rank, r["sent"], sent)
    return results


@pytest.mark.timeout(2 * LAUNCH_S + 60)
def test_sp_1f1b_stages_hand_on_shards_and_run_what_is_priced():
    results = _check({**BASE, "sequence_parallel": True})
    # one microbatch's hidden states, half the sequence per TP rank, fp32: the old gather sent all of it
    assert results[0]["sent"] == results[0]["received"] == [BATCH // M * SEQ // TP * 64 * 4] * M


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_S + 60)
@pytest.mark.parametrize(
    "extra",
    [
        {"sequence_parallel": True, "schedule": "interleaved", "virtual_stages": 2},  # a head-only chunk too
        {"sequence_parallel": True, "schedule": "zbv", "virtual_stages": 2},  # V: chunks 1 and 2 pass on one rank
        {"sequence_parallel": True, "loss_parallel": True},
        {"sequence_parallel": True, "recompute": "full"},  # the slice and the gather are not re-run
        {"sequence_parallel": False},  # plain TP: the whole replicated tensor from every rank
        {"sequence_parallel": False, "loss_parallel": True, "schedule": "interleaved", "virtual_stages": 2},
        {
            "sequence_parallel": True,
            "stages": [{"start": 0, "end": 5, "tp": TP}, {"start": 5, "end": 6, "tp": TP}],
        },  # a stage holding only the tail gathers the shard it receives
    ],
    ids=[
        "sp_interleaved",
        "sp_zbv",
        "sp_loss_parallel",
        "sp_full_recompute",
        "tp_1f1b",
        "tp_loss_parallel_interleaved",
        "sp_tail_stage",
    ],
)
def test_pipelined_tp_runs_what_is_priced(extra):
    plan = {**BASE, **extra}
    if "stages" in plan:
        plan.pop("pp")
        plan.pop("tp")
    _check(plan)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 60)
@pytest.mark.parametrize(
    "model, extra",
    [
        ("hf:gpt2:hidden=64,layers=4,heads=4,seq=32,vocab=128", {"schedule": "interleaved", "virtual_stages": 2}),
        (MOE, {}),  # an MoE region gathers, routes and slices inside the stage
        (LLAMA, {"recompute": "full", "schedule": "dualpipev", "virtual_stages": 2}),
    ],
    ids=["hf_gpt2_interleaved", "moe", "full_recompute_dualpipev"],
)
def test_sequence_shards_cross_other_models_and_schedules(model, extra):
    run(4, model, {**BASE, "sequence_parallel": True, **extra}, batch=BATCH, seq=SEQ)
