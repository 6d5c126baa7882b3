"""Probes of scripts/bench_faults.py for what a user gives the job: ranks that disagree on a
setting (``rank-mismatch``: another learning rate or global batch on one rank) and bad inputs
(``inputs``: unreadable plan and cluster files, bad environment values, a NaN profile, a key given
twice, a too-deep model, a rendezvous without MASTER_ADDR). Run them through
``python scripts/bench_faults.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from nest_fx.apply import AgreementError, auto_parallelize
from nest_fx.apply.distributed import collective_timeout_s, init_distributed
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.cluster import load_cluster
from nest_fx.common.limits import MAX_LAYERS
from nest_fx.models import build_seeded
from nest_fx.models.build import build_any
from nest_fx.plan import Plan, uniform_plan
from nest_fx.testing import FAULT_MODEL
from nest_fx.workload.profile_file import Profile

from fault_probes import row, timed  # next to this script


def mismatch_run(kind: str) -> Dict[str, Any]:
    """2 ranks; rank 1 differs in ``kind`` ("lr": 10x the learning rate; "batch": another global batch)."""
    rank = int(os.environ["RANK"])
    model, cfg = build_seeded(FAULT_MODEL)
    plan = uniform_plan(cfg.layers + 2, dp=2, microbatch_size=2, num_microbatches=2)
    batch = 16 if kind == "batch" and rank == 1 else 8
    x = torch.zeros(batch, cfg.seq_len, dtype=torch.long)
    start = time.perf_counter()
    try:
        pm = auto_parallelize(model, x, global_batch_size=batch, loss_fn=lm_loss, plan=plan, verbose=False)
        opt = torch.optim.AdamW(pm.parameters(), lr=0.01 if rank == 1 else 0.001)
        pm.train_step(x, x)
        start = time.perf_counter()
        opt.step()
    except AgreementError as e:
        return {"error": str(e), "detect_s": time.perf_counter() - start, "world": dist.get_world_size()}
    return {"error": None, "detect_s": None}


def probe_mismatch(kind: str) -> Dict[str, Any]:
    results = launch(mismatch_run, 2, kind, timeout=120)
    error = results[0]["error"] or ""
    field = {"lr": "optimizer default lr", "batch": "global_batch_size"}[kind]
    ok = all(r["error"] == error for r in results) and error.startswith(f"ranks disagree on {field}")
    fault = {"lr": "rank 1 with 10x the learning rate", "batch": "rank 1 with another global batch"}[kind]
    return row(
        f"rank-mismatch-{kind}",
        fault,
        f"both ranks refused: '{error.split(' (')[0]}'",
        max(r["detect_s"] or 0 for r in results),
        ok,
    )


def probe_inputs(work: str) -> List[Dict[str, Any]]:
    fifo = os.path.join(work, "x.yaml")
    os.mkfifo(fifo)
    big = os.path.join(work, "big.yaml")
    with open(big, "w") as fh:
        fh.write("levels:\n" + "  - {name: l, size: 2, bandwidth: 1e9, latency: 1e-6}\n" * 1_800_000)
    profile = {
        "format": "nest-fx-profile/1",
        "device": "cpu",
        "device_name": "x",
        "dtype": "float32",
        "torch_version": "2",
        "ops": {"k": {"op": "mm", "fwd_s": float("nan"), "bwd_s": 1e-3, "peak_bytes": 0}},
    }
    cases = [
        ("--plan /dev/zero", lambda: Plan.load("/dev/zero")),
        ("a FIFO named x.yaml as --cluster", lambda: load_cluster(fifo)),
        (f"a {os.path.getsize(big) / 1e6:.0f} MB cluster file", lambda: load_cluster(big)),
        ("NEST_FX_TIMEOUT_S=inf", lambda: env_timeout("inf")),
        ("NEST_FX_TIMEOUT_S=1e-9", lambda: env_timeout("1e-9")),
        ("a NaN time in a profile", lambda: Profile.from_dict(profile)),
    ]
    rows = []
    for fault, fn in cases:
        detect, error = timed(fn)
        rows.append(
            row(
                "inputs",
                fault,
                f"refused: '{str(error)}'" if error else "accepted",
                detect,
                error is not None and detect < 1.0,
            )
        )
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "nest_fx",
            "simulate",
            "--plan",
            "/dev/zero",
            "--model",
            "gpt2-small",
            "--cluster",
            "dgx-a100:8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows.append(
        row(
            "inputs",
            "nest-fx simulate --plan /dev/zero",
            f"exit {cli.returncode}: {cli.stderr.strip()}",
            None,
            cli.returncode == 2 and cli.stderr.startswith("error: ") and len(cli.stderr.splitlines()) == 1,
        )
    )
    twice = os.path.join(work, "twice.json")
    with open(twice, "w") as fh:
        fh.write('{"format": "nest-fx-plan/1", "stages": [{"tp": 2, "tp": 4}]}')
    detect, error = timed(lambda: Plan.load(twice))
    rows.append(
        row(
            "inputs",
            "a plan file with a key given twice",
            f"refused: '{error}'" if error else "accepted",
            detect,
            error is not None and "'tp' appears twice" in str(error),
        )
    )
    deep = "gpt:hidden=64,layers=20000,heads=4,seq=16,vocab=100"
    for fault, argv, env, want, in_process in [
        (
            "nest-fx trace gpt:hidden=64,layers=20000,...",
            ["-m", "nest_fx", "trace", deep],
            {},
            f"above the limit of {MAX_LAYERS}",
            lambda: build_any(deep),
        ),
        (
            "plain python, WORLD_SIZE=4, no MASTER_ADDR",
            ["-c", "from nest_fx.apply.distributed import init_distributed; init_distributed()"],
            {"WORLD_SIZE": "4"},
            "fix: launch with torchrun",
            lambda: without_rendezvous(init_distributed),
        ),
    ]:
        start = time.perf_counter()
        env = {k: v for k, v in dict(os.environ, **env).items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK")}
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, env=env)
        took = time.perf_counter() - start
        detect, _ = timed(in_process)
        last = (done.stderr.strip().splitlines() or [""])[-1]
        rows.append(
            row(
                "inputs",
                fault,
                f"exit {done.returncode} ({took:.1f} s with the process start): '{last[:300]}'",
                detect,
                done.returncode != 0 and want in last,
            )
        )
    return rows


def without_rendezvous(fn) -> None:
    """``fn()`` with WORLD_SIZE=4 and no MASTER_ADDR/MASTER_PORT/RANK in the environment."""
    saved = {k: os.environ.pop(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k in os.environ}
    os.environ["WORLD_SIZE"] = "4"
    try:
        fn()
    finally:
        del os.environ["WORLD_SIZE"]
        os.environ.update(saved)


def env_timeout(value: str) -> None:
    os.environ["NEST_FX_TIMEOUT_S"] = value
    try:
        collective_timeout_s()
    finally:
        del os.environ["NEST_FX_TIMEOUT_S"]
