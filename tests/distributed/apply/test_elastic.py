"""Elastic re-plan (docs/runtime.md, "Elastic training"): two torchrun agents on this machine stand
for two nodes of 2 ranks (``--nnodes=1:2``). Once the job trains on 4 ranks, one agent and its
workers are killed (a lost node); the survivors' collectives fail, torchrun restarts them on 2
ranks, ``auto_parallelize(elastic=True)`` re-plans for 2 ranks with the same global batch and
``pm.resume`` loads the newest checkpoint. Every step's loss must equal the single-device run of
``examples/train_elastic.py`` (1e-5, the parity standard of tests/distributed/apply/test_apply_parallel.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Dict, List

import pytest

from nest_fx.apply.launch import free_port
from nest_fx.testing import ElasticAgents, elastic_command, kill_node, read_losses
from nest_fx.testing_faults import EtcdServer
from repo_root import ROOT

SCRIPT = os.path.join(ROOT, "examples", "train_elastic.py")
STEPS = 12
PARITY_TOL = 1e-5


def last_loss_per_step(records: List[dict]) -> Dict[int, float]:
    """A step trained again after a restart counts with its last loss."""
    return {r["step"]: r["loss"] for r in records}


def wait_for(predicate, timeout: float, what: str, agents: List[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if any(agent.poll() is not None for agent in agents):
            raise AssertionError(f"an agent exited while waiting for {what}: {[a.returncode for a in agents]}")
        time.sleep(0.2)


def _assert_resumed_on_survivors(log: str, killed_at: int, want) -> None:
    """Every step logged; 4 ranks up to the kill, 2 after the restart to the last step; each
    step's last loss equal to the single-process run's (``want``)."""
    records = read_losses(log)
    got = last_loss_per_step(records)
    assert sorted(got) == list(range(STEPS))
    assert {r["world"] for r in records if r["step"] <= killed_at} >= {4}
    after = [r for r in records if r["restart"] >= 1]
    assert after and all(r["world"] == 2 for r in after) and after[-1]["step"] == STEPS - 1
    worst = max(abs(got[s] - want[s]) for s in range(STEPS))
    assert worst <= PARITY_TOL, (worst, got, want)


def _single_device_losses(tmp_path) -> Dict[int, float]:
    """The last loss of each step of the same training script run on one device (the reference)."""
    ref_log = str(tmp_path / "single.jsonl")
    single = subprocess.run(
        [sys.executable, SCRIPT, "--ckpt", str(tmp_path / "single"), "--losses", ref_log, "--steps", str(STEPS)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    return last_loss_per_step(read_losses(ref_log))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_lost_node_means_replan_and_resume_on_the_survivors(tmp_path):
    want = _single_device_losses(tmp_path)

    log, ckpt = str(tmp_path / "elastic.jsonl"), str(tmp_path / "ckpt")
    cmd = elastic_command(
        SCRIPT,
        free_port(),
        ["--ckpt", ckpt, "--losses", log, "--steps", str(STEPS), "--pace", "0.3", "--timeout", "60"],
    )
    with ElasticAgents(cmd, str(tmp_path)) as job:
        first = job.start()
        time.sleep(0.5)
        second = job.start()
        wait_for(
            lambda: any(r["world"] == 4 and r["step"] >= 3 for r in read_losses(log)),
            240,
            "4 ranks at step 3",
            job.agents,
        )
        killed_at = max(r["step"] for r in read_losses(log))
        kill_node(second)
        assert first.wait(timeout=300) == 0, (tmp_path / "agent0.log").read_text()[-3000:]
    _assert_resumed_on_survivors(log, killed_at, want)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_with_an_etcd_rendezvous_losing_the_node_that_started_the_job_is_survived(tmp_path):
    """torchrun's etcd-v2 rendezvous keeps its state in etcd, outside the nodes: the agent that
    started the job (with the c10d backend, the host of the rendezvous store) is killed with its
    workers, and the other node re-plans for 2 ranks and resumes from the newest checkpoint.
    The test installs and starts what it needs (nest_fx.testing_faults.ensure_etcd, EtcdServer)."""
    want = _single_device_losses(tmp_path)

    log, ckpt = str(tmp_path / "elastic.jsonl"), str(tmp_path / "ckpt")
    with EtcdServer(str(tmp_path), free_port(), free_port()) as etcd:
        cmd = elastic_command(
            SCRIPT,
            etcd.port,
            ["--ckpt", ckpt, "--losses", log, "--steps", str(STEPS), "--pace", "0.3", "--timeout", "60"],
            backend="etcd-v2",
        )
        with ElasticAgents(cmd, str(tmp_path)) as job:
            first = job.start()
            time.sleep(0.5)
            second = job.start()
            wait_for(
                lambda: any(r["world"] == 4 and r["step"] >= 3 for r in read_losses(log)),
                300,
                "4 ranks at step 3",
                job.agents,
            )
            killed_at = max(r["step"] for r in read_losses(log))
            kill_node(first)  # the node that started the job
            assert second.wait(timeout=300) == 0, (tmp_path / "agent1.log").read_text()[-3000:]
    _assert_resumed_on_survivors(log, killed_at, want)
