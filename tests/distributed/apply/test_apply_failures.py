"""Failures end runs instead of hanging them (docs/runtime.md, "Failures and timeouts").

* one rank failing before the first collective fails the launch quickly with that rank's error;
* ``auto_parallelize``'s checks run before any collective, so every rank raises the same
  ``ApplyError``; the ranks then compare their settings before the mesh is built;
* the process-group timeout (``NEST_FX_TIMEOUT_S``) reaches every group the runtime creates, and a
  rank that stops (SIGSTOP) during a TP or a DP collective ends every other rank within the timeout
  plus a few seconds, each with a message naming the group it was stuck in;
* one rank with another learning rate fails before the first optimizer step;
* timeout values are checked.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from nest_fx.apply import peers
from nest_fx.apply.launch import launch
from nest_fx.testing import fault_reports, fault_run
from nest_fx.testing_faults import torchrun_fault

MODEL = "llama:hidden=32,layers=2,heads=4,seq=16,vocab=64"
MOE = "moe:hidden=32,layers=2,heads=4,seq=16,vocab=64,experts=4,top_k=2,capacity_factor=2.0"
COLLECTIVES = (
    "broadcast",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast_object_list",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "barrier",
    "new_group",
    "send",
    "recv",
)
HANG_TIMEOUT_S = 3  # the job's collective timeout in the SIGSTOP test
DETECT_SLACK_S = 5  # "timeout + a few seconds"


def _parallelize(global_batch: int, model: str = MODEL, **plan):
    import torch

    from nest_fx.apply import auto_parallelize
    from nest_fx.apply.losses import lm_loss
    from nest_fx.models import build_seeded
    from nest_fx.plan import uniform_plan

    net, cfg = build_seeded(model)
    plan = uniform_plan(cfg.layers + 2, **(plan or {"dp": 2, "microbatch_size": 2, "num_microbatches": 2}))
    tokens = torch.zeros(global_batch, cfg.seq_len, dtype=torch.long)
    return auto_parallelize(net, tokens, global_batch_size=global_batch, loss_fn=lm_loss, plan=plan, verbose=False)


def _one_rank_gets_a_bad_batch():
    rank = int(os.environ["RANK"])
    _parallelize(6 if rank == 1 else 8)  # rank 1 fails its check; rank 0 goes on into collectives


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_one_rank_failing_before_the_first_collective_fails_the_launch_fast():
    # the launch's own timeout lies beyond the test's (60 s): only the fast failure path ends it in time
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*ApplyError: global batch 6 is not divisible"):
        launch(_one_rank_gets_a_bad_batch, 2, timeout=300)


class _Reached(Exception):
    """Raised by a probe standing in for a collective."""


def _count_collectives_then_parallelize():
    import torch.distributed as dist

    import nest_fx.apply.steps as steps
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
    steps.build_mesh = probe("build_mesh")  # the first step that communicates (device mesh groups)
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
    return {"error": error, "before": before, "control": calls[len(before) :]}


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_checks_fail_every_rank_identically_before_any_collective():
    results = launch(_count_collectives_then_parallelize, 2, timeout=50)
    assert [r["before"] for r in results] == [[], []]
    # the first collective of a valid setup is the ranks' agreement, before the mesh
    assert [r["control"] for r in results] == [["all_gather_object"], ["all_gather_object"]]
    assert results[0]["error"] and results[0]["error"] == results[1]["error"]
    assert "fix:" in results[0]["error"]


def _rank_one_is_late():
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
    # the launch's own timeout lies beyond the test's (60 s): only the 2 s collective timeout ends it in time
    with pytest.raises(RuntimeError, match="(?s)rank 0 failed.*(?i:timed out)"):
        launch(_rank_one_is_late, 2, timeout=300)


# -- every group gets the job's timeout ------------------------------------------------------------


def _group_timeouts():
    from nest_fx.apply.distributed import group_timeout, member_groups

    os.environ["NEST_FX_TIMEOUT_S"] = "7"
    pm = _parallelize(8, MOE, pp=2, dp=2, ep=2, microbatch_size=1, num_microbatches=4)
    return {
        f"{getattr(g, 'group_desc', '')}:{name}": group_timeout(g).total_seconds()
        for name, g in member_groups().items()
    }, pm.plan.ep


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_every_group_of_the_runtime_gets_the_job_timeout():
    """PP2 x (EDP1 x EP2): mesh dims pp/edp/ep/tp, the flattened dp dim, the stage group."""
    results = launch(_group_timeouts, 4, timeout=80)
    for timeouts, ep in results:
        assert ep == 2
        descs = {k.split(":")[0] for k in timeouts}
        assert {"mesh_pp", "mesh_ep", "mesh_dp"} <= descs, descs
        assert set(timeouts.values()) == {7.0}, timeouts


# -- a rank that stops (hangs without dying) --------------------------------------------------------


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where, stuck", [("tp", {2: "tp group (ranks 2, 3)"}), ("dp", {1: "dp group (ranks 1, 3)"})])
def test_a_stopped_rank_ends_every_rank_within_the_timeout(tmp_path, where, stuck):
    """TP2 x DP2; rank 3 stops (SIGSTOP) before its row-parallel linear (its TP peer, rank 2, waits
    in the TP all-reduce) or before the gradient all-reduce (its DP peer, rank 1, waits there)."""
    spec = {"signal": "SIGSTOP", "where": where, "out": str(tmp_path), "timeout_s": HANG_TIMEOUT_S}
    # the launch's own timeout lies beyond the test's (120 s): the launcher must kill the stopped rank once
    # the others have failed (its 5 s grace period)
    with pytest.raises(RuntimeError, match="CollectiveError"):
        launch(fault_run, 4, spec, timeout=600)
    reports = fault_reports(str(tmp_path))["ranks"]
    assert sorted(reports) == [0, 1, 2]
    for rank, report in reports.items():
        assert report["type"] == "CollectiveError", report
        assert report["after_s"] <= HANG_TIMEOUT_S + DETECT_SLACK_S, (rank, report["after_s"])
        assert report["message"].startswith(f"rank {rank}: ") and "fix:" in report["message"]
        if rank in stuck:
            assert (
                f"all_reduce on the {stuck[rank]} did not complete within the {HANG_TIMEOUT_S} s timeout"
                in report["message"]
            ), report["message"]


# -- ranks started with different settings ---------------------------------------------------------


def _different_settings():
    import torch
    import torch.distributed as dist

    from nest_fx.apply import AgreementError

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    out = {}
    try:  # rank 1 passes another global batch: both are valid for the plan, the microbatch counts differ
        _parallelize(16 if rank == 1 else 8)
    except AgreementError as e:
        out["batch"] = str(e)
    pm = _parallelize(8)
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    opt = torch.optim.AdamW(pm.parameters(), lr=0.01 if rank == 1 else 0.001)
    x = torch.zeros(8, 16, dtype=torch.long)
    pm.train_step(x, x)
    try:
        opt.step()
    except AgreementError as e:
        out["lr"] = str(e)
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in pm.named_parameters())
    return out


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_ranks_with_different_settings_fail_before_training():
    results = launch(_different_settings, 2, timeout=80)
    assert results[0] == results[1]
    batch = results[0]["batch"]
    assert batch.startswith("ranks disagree on global_batch_size: rank 0 8; rank 1 16") or batch.startswith(
        "ranks disagree on num_microbatches"
    ), batch
    assert "before building the device mesh" in batch and "fix:" in batch
    assert results[0]["lr"].startswith("ranks disagree on optimizer default lr: rank 0 0.001; rank 1 0.01")
    assert results[0]["unchanged"]  # refused before the step changed anything


def test_agreement_names_the_field_and_the_ranks():
    from nest_fx.apply.agreement import SCOPE_SEP, first_difference, rank_list

    assert rank_list([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8" and rank_list([3]) == "rank 3"
    same = {"a": 1, "b": [2, 3]}
    assert first_difference([same, dict(same), dict(same)]) is None
    assert first_difference([same, same, {"a": 1, "b": [2, 4]}, same]) == "b: ranks 0-1, 3 [2, 3]; rank 2 [2, 4]"
    # a scoped field is compared only between the ranks that send it
    scoped = [{f"lr{SCOPE_SEP}x": 1}, {f"lr{SCOPE_SEP}y": 2}, {f"lr{SCOPE_SEP}x": 1}]
    assert first_difference(scoped) is None
    assert first_difference([{f"lr{SCOPE_SEP}x": 1}, {f"lr{SCOPE_SEP}x": 2}]) == "lr: rank 0 1; rank 1 2"


# -- timeout values ----------------------------------------------------------------------------------


def test_timeout_setting(monkeypatch):
    from nest_fx.apply import ApplyError
    from nest_fx.apply.distributed import collective_timeout_s

    monkeypatch.delenv("NEST_FX_TIMEOUT_S", raising=False)
    assert collective_timeout_s() == 600.0
    assert collective_timeout_s(30) == 30.0 and collective_timeout_s(1) == 1.0
    monkeypatch.setenv("NEST_FX_TIMEOUT_S", "45")
    assert collective_timeout_s() == 45.0
    for raw, problem in [
        ("soon", "is not a number of seconds"),
        ("inf", "got inf"),
        ("nan", "got nan"),
        ("1e-9", "got 1e-09"),
        ("0.5", "got 0.5"),
        ("-3", "got -3"),
        ("1e300", "got 1e+300"),
    ]:
        monkeypatch.setenv("NEST_FX_TIMEOUT_S", raw)
        with pytest.raises(ApplyError, match=f"NEST_FX_TIMEOUT_S=.{raw}..*{re.escape(problem)}"):
            collective_timeout_s()
    for bad in (0, math.inf, 1e-9, 8 * 24 * 3600):
        with pytest.raises(ApplyError, match="between 1 and 604800"):
            collective_timeout_s(bad)
    with pytest.raises(ApplyError, match="timeout_s='x' is not a number"):
        collective_timeout_s("x")
    assert issubclass(ApplyError, ValueError)


# -- a stopped rank under torchrun --------------------------------------------------------------


def _stopped_child():
    """A process of ours, stopped like a hung rank."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    deadline = time.monotonic() + 10
    while peers.process_start(child.pid) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return child


def test_only_stopped_registered_peers_are_ended(monkeypatch):
    stopped, running, reused = _stopped_child(), _stopped_child(), _stopped_child()
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        os.kill(reused.pid, signal.SIGSTOP)
        while peers.process_state(stopped.pid) != "T" or peers.process_state(reused.pid) != "T":
            time.sleep(0.01)
        host = socket.gethostname()
        monkeypatch.setattr(
            peers,
            "_PEERS",
            {
                1: (host, stopped.pid, peers.process_start(stopped.pid)),
                2: (host, running.pid, peers.process_start(running.pid)),
                3: (host, reused.pid, peers.process_start(reused.pid) + 1),
            },
        )  # the pid now names another process
        monkeypatch.setenv(peers.SWITCH_ENV, "0")
        assert peers.end_stopped_peers() == []  # switched off
        monkeypatch.delenv(peers.SWITCH_ENV)
        assert peers.end_stopped_peers() == [1]
        assert stopped.wait(timeout=10) == -signal.SIGKILL
        assert running.poll() is None and reused.poll() is None
    finally:
        for child in (stopped, running, reused):
            child.kill()
            child.wait()


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["tp", "save"])
def test_a_stopped_rank_ends_the_torchrun_job_within_the_timeout(tmp_path, where):
    """torchrun's SIGTERM cannot end a stopped process and it waits 30 s before SIGKILL: the peers
    that detect the failure end it. Inside a checkpoint write nothing of the new step is left."""
    result = torchrun_fault(str(tmp_path), where, HANG_TIMEOUT_S)
    assert result["code"] != 0
    assert result["after_s"] <= HANG_TIMEOUT_S + DETECT_SLACK_S, result
    messages = [r["message"] for r in result["ranks"].values()]
    assert any("ended the stopped rank 3 of its host with SIGKILL" in m for m in messages), messages
    if where == "save":
        from nest_fx.apply.checkpoint import load_checkpoint
        from nest_fx.models import build_seeded

        assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step-00000001"]
        assert load_checkpoint(build_seeded(MODEL)[0], str(tmp_path / "ckpt"))["step"] == 1


def test_several_ranks_without_a_rendezvous_address_are_explained(monkeypatch):
    from nest_fx.apply import ApplyError
    from nest_fx.apply.distributed import init_distributed

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(
        ApplyError,
        match=r"WORLD_SIZE=4 asks for 4 ranks, but MASTER_ADDR, MASTER_PORT, RANK are not "
        r"set.*fix: launch with torchrun \(e.g. torchrun --nproc_per_node=4",
    ):
        init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ApplyError, match="WORLD_SIZE='four' is not a number of ranks"):
        init_distributed()
