"""Fault probes and elastic runs on one machine (tests and scripts only; re-exported by
:mod:`nest_fx.testing`).

Fault probes (tests/distributed/apply/test_apply_failures.py, tests/distributed/apply/test_checkpoint_dist.py,
scripts/bench_faults.py):
:func:`fault_run` trains a small model under TP2 x DP2 on 4 ranks and makes rank 3 stop
(SIGSTOP: hangs without dying) or die (SIGKILL) inside a TP collective, the DP gradient
all-reduce or a checkpoint save; every other rank writes what it raised and when
(:func:`fault_reports`). It runs under :func:`nest_fx.apply.launch.launch` or under torchrun:
``torchrun --nproc_per_node=4 -m nest_fx.testing_faults SPEC.json`` (:func:`main`).

Elastic runs on one machine (tests/distributed/apply/test_elastic.py, scripts/bench_faults.py): two torchrun agents
of ``examples/train_elastic.py`` stand for two nodes (:func:`elastic_command`,
:func:`elastic_env`, :class:`ElasticAgents`); :func:`kill_node` kills an agent and its workers
like a lost node; :func:`read_losses` reads the JSON lines rank 0 writes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from nest_fx.apply import auto_parallelize
from nest_fx.apply.launch import free_port
from nest_fx.apply.losses import lm_loss
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan

FAULT_MODEL = "llama:hidden=32,layers=2,heads=4,seq=16,vocab=64"
FAULT_RANK = 3


def fault_run(spec: Dict[str, Any]) -> None:
    """Run on 4 ranks (``launch(fault_run, 4, spec)``): TP2 x DP2 of :data:`FAULT_MODEL`, one
    AdamW step, then rank 3 receives ``spec["signal"]`` ("SIGSTOP" or "SIGKILL") at
    ``spec["where"]`` during the next step: "tp" (before layer 0's row-parallel linear: its TP
    peer waits in the TP all-reduce), "dp" (before the gradient all-reduce) or "save" (halfway
    through writing its shard of a checkpoint to ``spec["ckpt"]``, after a complete one was
    saved). ``spec["timeout_s"]`` is the job's collective timeout. Rank 3 writes the time of the
    fault to ``<out>/fault``; every other rank writes ``<out>/rank<r>.json`` with the error it
    raised and when, then re-raises it."""
    os.environ["NEST_FX_TIMEOUT_S"] = str(spec.get("timeout_s", 5))
    model, cfg = build_seeded(FAULT_MODEL)
    plan = uniform_plan(cfg.layers + 2, tp=2, dp=2, microbatch_size=2, num_microbatches=2)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    pm = auto_parallelize(model, x, global_batch_size=8, loss_fn=lm_loss, plan=plan, verbose=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm.train_step(x, x)
    opt.step()
    if spec["where"] == "save":
        pm.save(spec["ckpt"], opt)
    rank, out = dist.get_rank(), spec["out"]

    def fault(*_):
        with open(os.path.join(out, "fault"), "w") as fh:
            fh.write(repr(time.time()))
        os.kill(os.getpid(), getattr(signal, spec["signal"]))

    def half_a_shard(writer, *_):
        with open(os.path.join(writer.path, f"__{rank}_0.distcp"), "wb") as fh:
            fh.write(b"half a shard")
        fault()

    if rank == FAULT_RANK:
        if spec["where"] == "tp":
            pm.module.layers[0].attn.o_proj.register_forward_pre_hook(fault)
        elif spec["where"] == "dp":
            pm.grad_sync.__class__.__call__ = fault
        else:
            FileSystemWriter.write_data = half_a_shard
    try:
        pm.train_step(x, x)
        opt.step()
        if spec["where"] == "save":
            pm.save(spec["ckpt"], opt)
    except Exception as e:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump({"time": time.time(), "type": type(e).__name__, "message": str(e)}, fh)
        raise


def fault_reports(out: str, world: int = 4) -> Dict[str, Any]:
    """``{"fault": time, "ranks": {rank: {"time", "type", "message", "after_s"}}}`` of a :func:`fault_run`."""
    with open(os.path.join(out, "fault")) as fh:
        at = float(fh.read())
    ranks = {}
    for rank in range(world):
        path = os.path.join(out, f"rank{rank}.json")
        if rank != FAULT_RANK and os.path.exists(path):
            with open(path) as fh:
                report = json.load(fh)
            ranks[rank] = dict(report, after_s=report["time"] - at)
    return {"fault": at, "ranks": ranks}


def torchrun_fault(
    out: str, where: str, timeout_s: float, signal_name: str = "SIGSTOP", env=None, limit_s: float = 300
) -> Dict[str, Any]:
    """:func:`fault_run` on 4 ranks under torchrun (``--max_restarts=0``), writing into ``out``:
    ``{"code": torchrun's exit status, "after_s": seconds from the fault until torchrun returned,
    "ranks": the reports}``. ``env``: extra environment variables."""
    spec = {
        "signal": signal_name,
        "where": where,
        "out": out,
        "timeout_s": timeout_s,
        "ckpt": os.path.join(out, "ckpt"),
    }
    with open(os.path.join(out, "spec.json"), "w", encoding="utf-8") as fh:
        json.dump(spec, fh)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        "--max_restarts=0",
        "--monitor_interval=0.5",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=localhost:{free_port()}",
        "-m",
        "nest_fx.testing_faults",
        os.path.join(out, "spec.json"),
    ]
    with open(os.path.join(out, "torchrun.log"), "w", encoding="utf-8") as log:
        done = subprocess.run(
            cmd,
            env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=limit_s,
        )
    ended = time.time()
    reports = fault_reports(out)
    return {"code": done.returncode, "after_s": ended - reports["fault"], "ranks": reports["ranks"]}


# -- elastic runs on one machine ------------------------------------------------------------------


def elastic_command(
    script: str,
    port: int,
    script_args: List[str],
    *,
    nproc: int = 2,
    max_restarts: int = 5,
    last_call_s: int = 2,
    backend: str = "c10d",
) -> List[str]:
    """A torchrun agent of ``script`` for a job of 1 or 2 such agents ("nodes") on this machine.
    ``backend``: ``c10d`` (the rendezvous store lives in the agent on ``localhost:port``) or
    ``etcd-v2`` (an etcd server on ``localhost:port``, :class:`EtcdServer`)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        f"--nproc_per_node={nproc}",
        f"--max_restarts={max_restarts}",
        "--monitor_interval=0.5",
        f"--rdzv_backend={backend}",
        f"--rdzv_endpoint=localhost:{port}",
        "--rdzv_id=nest-fx-elastic",
        f"--rdzv_conf=last_call_timeout={last_call_s}",
        script,
        *script_args,
    ]


ETCD_PACKAGE = "etcd-server"  # Debian's etcd (3.4 in bookworm): serves the v2 API with --enable-v2
ETCD_CLIENT = "python-etcd"  # the v2 client torch's etcd rendezvous imports (``import etcd``): the 'etcd' extra


def ensure_etcd() -> str:
    """The path of the ``etcd`` binary and the ``etcd`` Python client, installing what is missing:
    ``apt-get install etcd-server`` (as root) and ``pip install python-etcd``. RuntimeError saying
    what to install where that is not possible."""
    if importlib.util.find_spec("etcd") is None:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", ETCD_CLIENT], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"pip install {ETCD_CLIENT} failed: {done.stderr.strip()[-500:]}; fix: pip install -e '.[etcd]'"
            )
        importlib.invalidate_caches()
    binary = shutil.which("etcd")
    if binary is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env)
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", ETCD_PACKAGE], capture_output=True, env=env
        )
        binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError(
            f"no etcd server; fix: apt-get install {ETCD_PACKAGE} (Debian/Ubuntu), or put an etcd >= 3.4 binary on PATH"
        )
    return binary


class EtcdServer:
    """A throw-away etcd server (v2 API enabled) on ``localhost:port`` with its data in ``directory``;
    stopped and its data removed when the ``with`` block ends. It stands for the etcd cluster that
    runs outside the training nodes, so that no node's loss ends the rendezvous."""

    def __init__(self, directory: str, port: int, peer_port: int):
        self.directory, self.port, self.peer_port = directory, port, peer_port
        self.process: Optional[subprocess.Popen] = None

    def __enter__(self) -> "EtcdServer":
        url, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        log = open(os.path.join(self.directory, "etcd.log"), "w")
        self.process = subprocess.Popen(
            [
                ensure_etcd(),
                "--enable-v2",
                "--name",
                "nest-fx",
                "--data-dir",
                os.path.join(self.directory, "etcd-data"),
                "--listen-client-urls",
                url,
                "--advertise-client-urls",
                url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"nest-fx={peer}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 60
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"etcd did not start; see {self.directory}/etcd.log")
            time.sleep(0.2)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/keys/", timeout=1) as reply:
                return reply.status == 200
        except OSError:
            return False

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        shutil.rmtree(os.path.join(self.directory, "etcd-data"), ignore_errors=True)


def elastic_env() -> Dict[str, str]:
    """The environment docs/runtime.md ("Elastic training") asks for, one thread per rank."""
    return dict(
        os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", TORCH_ELASTIC_WORKER_IDENTICAL="1", OMP_NUM_THREADS="1"
    )


def process_tree(pid: int) -> List[int]:
    """``pid`` and its descendants (torchrun starts its workers in their own sessions)."""
    out = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            children = [int(c) for c in fh.read().split()]
    except OSError:
        return out
    for child in children:
        out += process_tree(child)
    return out


def kill_node(agent: subprocess.Popen) -> None:
    """A lost node: SIGKILL an agent and every worker it started, at once."""
    for pid in process_tree(agent.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=30)


class ElasticAgents:
    """The torchrun agents of one job on this machine, one per "node", started with
    :func:`elastic_env` and their output in ``<log_dir>/agent<i>.log``; on leaving the ``with``
    block every agent still running is killed with its workers and the logs are closed."""

    def __init__(self, command: List[str], log_dir: str):
        self.command, self.log_dir = command, log_dir
        self.agents: List[subprocess.Popen] = []
        self._logs: list = []

    def start(self) -> subprocess.Popen:
        """One more agent (a node joining)."""
        log = open(os.path.join(self.log_dir, f"agent{len(self.agents)}.log"), "w")
        self._logs.append(log)
        self.agents.append(
            subprocess.Popen(
                self.command, env=elastic_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        return self.agents[-1]

    def __enter__(self) -> "ElasticAgents":
        return self

    def __exit__(self, *exc) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                kill_node(agent)
        for log in self._logs:
            log.close()


def elastic_node_loss(
    work: str, script: str, port: int, backend: str = "c10d", victim: int = 1, steps: int = 40, pace: float = 0.25
) -> Dict[str, Any]:
    """Two agents of ``script`` (examples/train_elastic.py) train on 4 ranks; agent ``victim`` is
    killed with its workers at step >= 4, and once the survivor trains again (or has exited) the
    lost node is started again. Returns the timings (``resume_s``, ``grow_s``, or ``ended``/
    ``ended_s`` when the survivor exited instead), exit codes, worlds and the worst loss difference
    to the single-device run."""
    ref = os.path.join(work, "single.jsonl")
    subprocess.run(
        [sys.executable, script, "--ckpt", os.path.join(work, "single"), "--losses", ref, "--steps", str(steps)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        check=True,
        capture_output=True,
        timeout=600,
    )
    want = {r["step"]: r["loss"] for r in read_losses(ref)}
    log = os.path.join(work, "elastic.jsonl")
    cmd = elastic_command(
        script,
        port,
        [
            "--ckpt",
            os.path.join(work, "ckpt"),
            "--losses",
            log,
            "--steps",
            str(steps),
            "--pace",
            str(pace),
            "--timeout",
            "60",
        ],
        max_restarts=10,
        backend=backend,
    )
    with ElasticAgents(cmd, work) as job:
        agents = job.agents

        def wait(predicate, timeout: float, what: str, watch: subprocess.Popen) -> List[dict]:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and watch.poll() is None:
                records = read_losses(log)
                if predicate(records):
                    return records
                time.sleep(0.1)
            if watch.poll() is not None:
                return []
            raise RuntimeError(f"node-loss: no {what} (agent exit codes {[a.poll() for a in agents]}; logs in {work})")

        job.start()
        time.sleep(0.5)
        job.start()
        wait(lambda rs: any(r["world"] == 4 and r["step"] >= 4 for r in rs), 300, "step 4 on 4 ranks", agents[0])
        survivor = agents[1 - victim]
        killed = time.time()
        kill_node(agents[victim])
        records = wait(lambda rs: any(r["restart"] >= 1 for r in rs), 300, "step after the restart", survivor)
        if not records:
            return {"ended": True, "ended_s": time.time() - killed, "codes": [survivor.poll()]}
        shrunk = min(r["time"] for r in records if r["restart"] >= 1)
        rejoin = time.time()
        job.start()
        records = wait(
            lambda rs: any(r["world"] == 4 and r["time"] > rejoin for r in rs), 300, "step on 4 ranks again", survivor
        )
        grown = min(r["time"] for r in records if r["world"] == 4 and r["time"] > rejoin)
        codes = [survivor.wait(timeout=600), agents[2].wait(timeout=600)]
    records = read_losses(log)
    got = {r["step"]: r["loss"] for r in records}
    worst = max(abs(got[s] - want[s]) for s in range(steps)) if sorted(got) == list(range(steps)) else float("inf")
    return {
        "ended": False,
        "resume_s": shrunk - killed,
        "grow_s": grown - rejoin,
        "codes": codes,
        "worst_loss_diff": worst,
        "steps": steps,
        "redone_steps": len(records) - steps,
        "worlds": [r["world"] for r in records],
    }


def read_losses(path: str) -> List[dict]:
    """The JSON lines rank 0 of ``examples/train_elastic.py --losses`` wrote (a line cut by a kill
    is skipped)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def main(argv: List[str] = None) -> int:
    """``torchrun ... -m nest_fx.testing_faults SPEC.json``: :func:`fault_run` of the spec in the file."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0], encoding="utf-8") as fh:
        fault_run(json.load(fh))
    return 0


if __name__ == "__main__":
    sys.exit(main())
