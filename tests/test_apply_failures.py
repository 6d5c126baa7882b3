"""Failures end runs instead of hanging them (docs/runtime.md, "Failures and timeouts").

* one rank failing before the first collective fails the launch quickly with that rank's error;
* ``auto_parallelize``'s checks run before any collective, so every rank raises the same
  ``ApplyError``;
* the process-group timeout (``NEST_FX_TIMEOUT_S``) turns a collective whose peer never comes
  into an error on the waiting rank.
"""
from __future__ import annotations

import time

import pytest

from nest_fx.apply.launch import launch

MODEL = "llama:hidden=32,layers=2,heads=4,seq=16,vocab=64"
COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_object", "broadcast_object_list",
               "all_to_all_single", "reduce_scatter_tensor", "barrier", "new_group", "send", "recv")


def _parallelize(global_batch: int):
    import torch

    from nest_fx.apply import auto_parallelize
    from nest_fx.apply.losses import lm_loss
    from nest_fx.models import build_seeded
    from nest_fx.plan import uniform_plan

    model, cfg = build_seeded(MODEL)
    plan = uniform_plan(cfg.layers + 2, dp=2, microbatch_size=2, num_microbatches=2)
    tokens = torch.zeros(global_batch, cfg.seq_len, dtype=torch.long)
    return auto_parallelize(model, tokens, global_batch_size=global_batch, loss_fn=lm_loss, plan=plan,
                            verbose=False)


def _one_rank_gets_a_bad_batch():
    import os

    rank = int(os.environ["RANK"])
    _parallelize(6 if rank == 1 else 8)  # rank 1 fails its check; rank 0 goes on into collectives


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_one_rank_failing_before_the_first_collective_fails_the_launch_fast():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*ApplyError: global batch 6 is not divisible"):
        launch(_one_rank_gets_a_bad_batch, 2, timeout=50)
    assert time.monotonic() - start < 30


class _Reached(Exception):
    """Raised by a probe standing in for a collective."""


def _count_collectives_then_parallelize():
    import torch.distributed as dist

    import nest_fx.apply.api as api
    from nest_fx.apply import ApplyError, init_distributed

    init_distributed()  # the rendezvous itself; every later collective is a probe
    calls = []

    def probe(name):
        def reached(*args, **kwargs):
            calls.append(name)
            raise _Reached(name)
        return reached

    for name in COLLECTIVES:
        setattr(dist, name, probe(name))
    api.build_mesh = probe("build_mesh")  # the first step that communicates (device mesh groups)
    error = None
    try:
        _parallelize(6)  # 6 rows do not split into dp=2 x 2 microbatches x 2 rows
    except ApplyError as e:
        error = str(e)
    before = list(calls)
    try:
        _parallelize(8)  # control: a valid batch does reach the probes
    except _Reached:
        pass
    return {"error": error, "before": before, "control": calls[len(before):]}


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_checks_fail_every_rank_identically_before_any_collective():
    results = launch(_count_collectives_then_parallelize, 2, timeout=50)
    assert [r["before"] for r in results] == [[], []]
    assert [r["control"] for r in results] == [["build_mesh"], ["build_mesh"]]
    assert results[0]["error"] and results[0]["error"] == results[1]["error"]
    assert "fix:" in results[0]["error"]


def _rank_one_is_late():
    import os

    import torch.distributed as dist

    from nest_fx.apply import init_distributed

    os.environ["NEST_FX_TIMEOUT_S"] = "2"
    _, rank = init_distributed()
    if rank == 1:
        time.sleep(5)  # joins after rank 0's 2 s timeout
        return "late"
    dist.barrier()


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_collective_timeout_from_the_environment():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)rank 0 failed.*(?i:timed out)"):
        launch(_rank_one_is_late, 2, timeout=50)
    assert time.monotonic() - start < 20


def test_timeout_setting(monkeypatch):
    from nest_fx.apply.distributed import collective_timeout_s

    monkeypatch.delenv("NEST_FX_TIMEOUT_S", raising=False)
    assert collective_timeout_s() == 600.0
    assert collective_timeout_s(30) == 30.0
    monkeypatch.setenv("NEST_FX_TIMEOUT_S", "45")
    assert collective_timeout_s() == 45.0
    monkeypatch.setenv("NEST_FX_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="NEST_FX_TIMEOUT_S='soon' is not a number"):
        collective_timeout_s()
    with pytest.raises(ValueError, match="must be positive"):
        collective_timeout_s(0)
