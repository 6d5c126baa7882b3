#!/usr/bin/env python
"""Fault probes for long jobs: what each fault does to a run, and how long until it is noticed.

    python scripts/bench_faults.py                          # every probe (about 4 minutes on 2 cores)
    python scripts/bench_faults.py --probes hang-tp,corrupt # some of them
    python scripts/bench_faults.py --timeout 10             # the job's collective timeout (default 5 s)

Every probe runs CPU ranks under gloo (``nest_fx.apply.launch.launch``, or torchrun for the node
loss) on the small models of the tests:

==================  ============================================================================
kill                TP2 x DP2 on 4 ranks; rank 3 is SIGKILLed before its TP all-reduce
hang-tp / hang-dp   the same, rank 3 is SIGSTOPped (hangs without dying) before its TP all-reduce
                    / the gradient all-reduce; the others must end within the timeout + 5 s, the
                    waiting peer naming the group
kill-during-save    rank 3 is SIGKILLed halfway through writing its shard of the second
                    checkpoint; the first must stay loadable and nothing of the second remain
stop-torchrun       the job under torchrun (``--max_restarts=0``): rank 3 SIGSTOPped before its TP
                    all-reduce / halfway through writing its shard of the second checkpoint
                    (stop-during-save); torchrun must return within the timeout + 5 s and
                    nothing of the second checkpoint remain. Each is run twice: as shipped (the
                    ranks that detect the failure SIGKILL their stopped peers) and with
                    NEST_FX_END_STOPPED_PEERS=0 (torchrun alone: SIGTERM, 30 s, SIGKILL)
fallback            the newest of three step directories loses its MANIFEST.json: load must
                    refuse it naming it and the newest complete one; fallback=True loads
                    that one and says so in one line
load-after-full     a save that ran out of space (ENOSPC writer), then a restarted job's load
                    while the disk is still full: refused before training
corrupt             1 KiB of garbage inside one tensor's bytes of a 250 MB checkpoint (model +
                    AdamW); loading must refuse it naming the file. Also reported: the time of
                    the sha256 check (hashing every file, one rank) next to a load without it
full-disk           a tmpfs with room for 1.5 checkpoints, mounted in a private mount namespace
                    (``unshare --mount``; ``unshare --user --map-root-user --mount`` when not
                    root); where mounting is not allowed, a writer raising OSError(ENOSPC) stands
                    in and the row says "simulated". resume's pre-flight check must refuse it
                    before training, and a save that runs out of space must leave nothing
                    behind and the previous checkpoint intact
wrong-model         a 6-layer model's checkpoint loaded into a 4-layer model
rank-mismatch       2 ranks, one with 10x the learning rate / another global batch
inputs              --plan /dev/zero, a FIFO named x.yaml, a 100 MB cluster file,
                    NEST_FX_TIMEOUT_S=inf and 1e-9, a NaN time in a profile, a key given twice
                    in a plan file, ``nest-fx trace gpt:...,layers=20000``, plain ``python``
                    with WORLD_SIZE=4 and no MASTER_ADDR
node-loss           two torchrun agents (``--nnodes=1:2``, 2 ranks each) of
                    examples/train_elastic.py; one is killed with its workers at step >= 4,
                    later started again; the run must go on on 2 ranks, grow back to 4, and
                    every step's loss equal the single-device run's (1e-5). Three runs: the
                    second agent lost (c10d rendezvous); the first agent lost, the one whose host
                    holds the c10d rendezvous store (the job ends: the documented limit); the
                    first agent lost with the etcd-v2 rendezvous (an etcd server the probe
                    installs with apt-get/pip where missing and starts: it survives)
==================  ============================================================================

The probes without a process group are in ``fault_probes.py``, those of settings and inputs in
``fault_input_probes.py``. Writes ``results/bench_faults.json`` and prints the table; exit status 1
when a probe fails.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
from torch.distributed.checkpoint import FileSystemWriter

import nest_fx.apply.checkpoint_files as checkpoint_files
from nest_fx.apply.checkpoint import load_checkpoint, resume_checkpoint, save_checkpoint
from nest_fx.apply.launch import free_port, launch
from nest_fx.models import build_seeded
from nest_fx.testing import FAULT_MODEL, fault_reports, fault_run
from nest_fx.testing_faults import EtcdServer, elastic_node_loss, torchrun_fault

from _bench_common import table as github_table, write_json
from fault_probes import (
    probe_corrupt,
    probe_fallback,
    probe_load_after_full,  # next to this script
    probe_wrong_model,
    row,
    timed,
    trained,
)
from fault_input_probes import probe_inputs, probe_mismatch  # next to this script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ELASTIC_SCRIPT = os.path.join(ROOT, "examples", "train_elastic.py")
SLACK_S = 5.0  # "the timeout + a few seconds"


# -- collectives -----------------------------------------------------------------------------------


def probe_signal(name: str, signal_name: str, where: str, timeout_s: float, work: str) -> Dict[str, Any]:
    out = os.path.join(work, name)
    os.makedirs(out)
    spec = {
        "signal": signal_name,
        "where": where,
        "out": out,
        "timeout_s": timeout_s,
        "ckpt": os.path.join(out, "ckpt"),
    }
    start = time.monotonic()
    try:
        launch(fault_run, 4, spec, timeout=120 + timeout_s)
        ended = "every rank finished (no failure seen)"
    except (RuntimeError, TimeoutError) as e:
        ended = str(e).splitlines()[0]
    total = time.monotonic() - start
    reports = fault_reports(out)["ranks"]
    detect = max((r["after_s"] for r in reports.values()), default=None)
    named = {r: rep["message"].split(" (during")[0] for r, rep in reports.items()}
    ok = sorted(reports) == [0, 1, 2] and all(rep["type"] == "CollectiveError" for rep in reports.values())
    ok = ok and detect is not None and detect <= timeout_s + SLACK_S
    peer = {"tp": 2, "dp": 1}.get(where)
    outcome = f"ranks 0-2 ended with CollectiveError; launch ended after {total:.1f} s"
    if peer is not None and peer in named:
        outcome += f"; rank {peer}: '{named[peer][len(f'rank {peer}: ') :]}'"
        group = {"tp": "tp group (ranks 2, 3)", "dp": "dp group (ranks 1, 3)"}[where]
        ok = ok and group in named[peer]
    extra: Dict[str, Any] = {}
    if where == "save":
        ckpt = spec["ckpt"]
        left = sorted(os.listdir(ckpt))
        model, _ = build_seeded(FAULT_MODEL, seed=7)
        step = load_checkpoint(model, ckpt)["step"]
        ok = ok and left == ["latest", "step-00000001"] and step == 1
        outcome += f"; checkpoint directory: {left}, loads step {step}"
        extra["left"] = left
    return row(
        name,
        f"rank 3 {signal_name} at {where}",
        outcome,
        detect,
        ok,
        launch_s=total,
        messages=named,
        launch_error=ended,
        **extra,
    )


def probe_stop_torchrun(name: str, where: str, timeout_s: float, work: str, end_peers: bool) -> Dict[str, Any]:
    """Rank 3 SIGSTOPped under torchrun; seconds from the fault until torchrun returned."""
    out = os.path.join(work, f"{name}-{'shipped' if end_peers else 'torchrun-alone'}")
    os.makedirs(out)
    result = torchrun_fault(out, where, timeout_s, env=None if end_peers else {"NEST_FX_END_STOPPED_PEERS": "0"})
    after = result["after_s"]
    ended = [r for r, rep in result["ranks"].items() if "ended the stopped rank 3" in rep["message"]]
    ok = result["code"] != 0 and after <= timeout_s + SLACK_S
    how = f"rank {ended[0]} SIGKILLed the stopped rank 3" if ended else "torchrun: SIGTERM, 30 s grace, SIGKILL"
    outcome = f"torchrun returned {after:.1f} s after the fault ({how})"
    extra: Dict[str, Any] = {}
    if where == "save":
        left = sorted(os.listdir(os.path.join(out, "ckpt")))
        model, _ = build_seeded(FAULT_MODEL, seed=7)
        step = load_checkpoint(model, os.path.join(out, "ckpt"))["step"]
        ok = ok and left == ["latest", "step-00000001"] and step == 1
        outcome += f"; checkpoint directory: {left}, loads step {step}"
        extra["left"] = left
    fault = f"rank 3 SIGSTOP at {where} under torchrun" + ("" if end_peers else " (NEST_FX_END_STOPPED_PEERS=0)")
    return row(name, fault, outcome, after, ok if end_peers else True, end_peers=end_peers, **extra)


# -- checkpoints -----------------------------------------------------------------------------------


def full_disk_inner(directory: str) -> Dict[str, Any]:
    """Inside a private mount namespace: a tmpfs with room for 1.5 checkpoints at ``directory``."""
    model, opt = trained(FAULT_MODEL)
    probe = tempfile.mkdtemp()
    one = sum(
        os.path.getsize(os.path.join(d, n))
        for d, _, names in os.walk(save_checkpoint(model, probe, opt, step=0))
        for n in names
    )
    shutil.rmtree(probe)
    size_kib = max(64, int(1.5 * one / 1024))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", directory], check=True)
    return disk_outcomes(directory, model, opt, f"tmpfs of {size_kib} KiB, a checkpoint is {one / 1024:.0f} KiB")


def disk_outcomes(directory: str, model, opt, setup: str) -> Dict[str, Any]:
    """After one checkpoint: resume's pre-flight refusal (no room for two), then a save that runs
    out of space (for real, or ENOSPC simulated by the caller)."""
    ckpt = os.path.join(directory, "ckpt")
    save_checkpoint(model, ckpt, opt, step=1)
    preflight_s, preflight = timed(lambda: resume_checkpoint(model, ckpt, opt))
    save_s, failed = timed(lambda: save_checkpoint(model, ckpt, opt, step=2))
    left = sorted(os.listdir(ckpt))
    fresh, _ = build_seeded(FAULT_MODEL, seed=7)
    step = load_checkpoint(fresh, ckpt, torch.optim.AdamW(fresh.parameters()))["step"]
    return {
        "setup": setup,
        "preflight_s": preflight_s,
        "preflight": str(preflight),
        "save_s": save_s,
        "save_error": str(failed),
        "left": left,
        "loads_step": step,
    }


def probe_full_disk(work: str, mount: bool = True) -> Dict[str, Any]:
    directory = os.path.join(work, "full-disk")
    os.makedirs(directory)
    result_path = os.path.join(work, "full-disk.json")
    prefixes = [["unshare", "--mount", "--propagation", "private"]] if os.geteuid() == 0 else []
    prefixes = (prefixes + [["unshare", "--user", "--map-root-user", "--mount"]]) if mount else []
    result = None
    for prefix in prefixes if shutil.which("unshare") else []:
        done = subprocess.run(
            prefix + [sys.executable, __file__, "--full-disk-inner", directory, result_path],
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            with open(result_path) as fh:
                result = json.load(fh)
            break
    if result is None:
        result = simulated_full_disk(directory)
    ok = (
        "two checkpoints need" in result["preflight"]
        and "nothing was left behind" in result["save_error"]
        and ("No space left on device" in result["save_error"] or "disk full?" in result["save_error"])
        and result["left"] == ["latest", "step-00000001"]
        and result["loads_step"] == 1
    )
    outcome = (
        f"{result['setup']}: resume refused before training ('{result['preflight'].split('; fix')[0]}'); "
        f"the save on the full disk failed in {result['save_s']:.2f} s "
        f"('{result['save_error'].split(';')[0].split(' failed')[1].strip()}'), left {result['left']}, step 1 loads"
    )
    return row("full-disk", "disk full", outcome, result["preflight_s"], ok, **result)


def simulated_full_disk(directory: str) -> Dict[str, Any]:
    """No mount allowed: ENOSPC from the writer, and a disk_usage that reports no room."""
    model, opt = trained(FAULT_MODEL)
    real_usage, real_write = checkpoint_files.shutil.disk_usage, FileSystemWriter.write_data
    calls = {"n": 0}

    def no_room(path):
        return shutil._ntuple_diskusage(1 << 20, (1 << 20) - 4096, 4096)

    def second_save_fails(self, plan, planner):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, plan, planner)

    checkpoint_files.shutil.disk_usage, FileSystemWriter.write_data = no_room, second_save_fails
    try:
        return disk_outcomes(directory, model, opt, "simulated (ENOSPC writer, no free space reported)")
    finally:
        checkpoint_files.shutil.disk_usage, FileSystemWriter.write_data = real_usage, real_write


# -- node loss ------------------------------------------------------------------------------------------


def probe_node_loss(work: str, backend: str = "c10d", victim: int = 1) -> Dict[str, Any]:
    """Two torchrun agents (2 ranks each); agent ``victim`` is killed with its workers at step >= 4
    (0: the one that started the job, with c10d the host of the rendezvous store), later started again."""
    os.makedirs(work, exist_ok=True)
    if backend == "etcd-v2":
        with EtcdServer(work, free_port(), free_port()) as etcd:
            got = elastic_node_loss(work, ELASTIC_SCRIPT, etcd.port, backend, victim)
    else:
        got = elastic_node_loss(work, ELASTIC_SCRIPT, free_port(), backend, victim)
    which = "the node that started the job" if victim == 0 else "the other node"
    fault = f"{which} killed ({backend} rendezvous), later back"
    if got["ended"]:
        return row(
            "node-loss",
            fault,
            f"the job ended: the surviving agent exited with code {got['codes'][0]} "
            f"{got['ended_s']:.1f} s after the kill (the rendezvous store was on the lost node)",
            got["ended_s"],
            backend == "c10d" and victim == 0,
            **got,
        )
    worst = got["worst_loss_diff"]
    ok = got["codes"] == [0, 0] and worst <= 1e-5 and 2 in got["worlds"] and got["worlds"][-1] == 4
    outcome = (
        f"4 -> 2 ranks: training again {got['resume_s']:.1f} s after the kill (re-planned, resumed from the "
        f"newest checkpoint); 2 -> 4 ranks {got['grow_s']:.1f} s after the node came back; "
        f"{got['redone_steps']} steps trained twice; worst loss difference to one device {worst:.1e}"
    )
    return row("node-loss", fault, outcome, got["resume_s"], ok, **got)


# -- main -------------------------------------------------------------------------------------------------

PROBES = [
    "kill",
    "hang-tp",
    "hang-dp",
    "kill-during-save",
    "stop-torchrun",
    "corrupt",
    "full-disk",
    "fallback",
    "load-after-full",
    "wrong-model",
    "rank-mismatch",
    "inputs",
    "node-loss",
]


def run_probe(name: str, work: str, timeout_s: float, mount: bool = True) -> List[Dict[str, Any]]:
    if name == "kill":
        return [probe_signal("kill", "SIGKILL", "tp", timeout_s, work)]
    if name in ("hang-tp", "hang-dp"):
        return [probe_signal(name, "SIGSTOP", name.split("-")[1], timeout_s, work)]
    if name == "kill-during-save":
        return [probe_signal(name, "SIGKILL", "save", timeout_s, work)]
    if name == "stop-torchrun":
        return [
            probe_stop_torchrun(n, where, timeout_s, work, end)
            for n, where in (("stop-torchrun", "tp"), ("stop-during-save", "save"))
            for end in (False, True)
        ]
    if name == "fallback":
        return probe_fallback(work)
    if name == "load-after-full":
        return [probe_load_after_full(work)]
    if name == "rank-mismatch":
        return [probe_mismatch("lr"), probe_mismatch("batch")]
    if name == "inputs":
        return probe_inputs(work)
    if name == "full-disk":
        return [probe_full_disk(work, mount)]
    if name == "node-loss":
        return [
            probe_node_loss(os.path.join(work, "c10d-other")),
            probe_node_loss(os.path.join(work, "c10d-first"), "c10d", victim=0),
            probe_node_loss(os.path.join(work, "etcd-first"), "etcd-v2", victim=0),
        ]
    return [{"corrupt": probe_corrupt, "wrong-model": probe_wrong_model}[name](work)]


def table(rows: List[Dict[str, Any]]) -> str:
    return github_table(
        [
            [
                r["probe"],
                r["fault"],
                r["outcome"],
                "-" if r["detect_s"] is None else f"{r['detect_s']:.2f} s",
                "yes" if r["ok"] else "NO",
            ]
            for r in rows
        ],
        headers=["probe", "fault", "outcome", "detected in", "ok"],
        maxcolwidths=[None, 30, 90],
    )


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probes", default=",".join(PROBES), help=f"comma-separated, of {', '.join(PROBES)}")
    p.add_argument("--timeout", type=float, default=5.0, help="the job's collective timeout in seconds")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_faults.json"))
    p.add_argument("--work", metavar="DIR", help="keep the probes' files (logs, checkpoints) in DIR")
    p.add_argument("--no-mount", action="store_true", help="full-disk: simulate ENOSPC instead of mounting a tmpfs")
    p.add_argument("--full-disk-inner", nargs=2, metavar=("DIR", "RESULT"), help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.full_disk_inner:
        directory, result = opts.full_disk_inner
        with open(result, "w") as fh:
            json.dump(full_disk_inner(directory), fh)
        return 0
    names = [n.strip() for n in opts.probes.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PROBES))
    if unknown:
        p.error(f"unknown probe(s) {unknown}; choose from {PROBES}")
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_faults-") as scratch:
        work = opts.work or scratch
        for name in names:
            print(f"probe {name} ...", flush=True)
            start = time.monotonic()
            os.makedirs(os.path.join(work, name))
            rows += run_probe(name, os.path.join(work, name), opts.timeout, mount=not opts.no_mount)
            print(f"  {time.monotonic() - start:.1f} s", flush=True)
    print(table(rows))
    write_json(opts.out, {"timeout_s": opts.timeout, "rows": rows}, default=str)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
