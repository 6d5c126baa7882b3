"""Run a plan on N local processes (gloo) and compare it with the single-device model.

``launch(fn, world_size, *args)`` spawns ``world_size`` processes with the torchrun
environment variables set, calls ``fn(*args)`` on each, and returns their return values in
rank order; a rank that raises fails the launch with its traceback, and a launch that runs
past ``timeout`` kills every rank (a hung collective fails instead of hanging).

``equivalence(spec)`` (run on every rank) builds the model twice from the same seed, trains the
parallel one through :func:`auto_parallelize` and the reference one on the whole batch on this
process, with SGD for ``steps`` steps, and reports the largest loss, gradient and parameter
differences. Used by the tests and by anyone checking a plan on a small model.
"""
from __future__ import annotations

import copy
import os
import socket
import traceback
from typing import Any, Callable, Dict, List

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        result = fn(*args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # flush the report before tearing the group down: peers see the teardown as their own
        # failure, and the parent should hear about the first failure first
        queue.close()
        queue.join_thread()
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


_PRELOAD = ["torch", "torch.distributed", "nest_fx.apply", "nest_fx.graph", "nest_fx.models"]


def _context():
    """A forkserver context that imports torch and nest-fx once: each rank then starts in well
    under a second instead of re-importing everything (2 cores, up to 8 ranks in tests). The
    server process never runs torch ops, so forking it is safe; falls back to spawn."""
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    except ValueError:
        return mp.get_context("spawn")


def launch(fn: Callable, world_size: int, *args, timeout: float = 120.0) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; results in rank order."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    errors: Dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    grace = False
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                if errors:
                    first = next(iter(errors))
                    raise RuntimeError(f"rank {first} failed (rank(s) {missing} then hung and were "
                                       f"killed):\n{errors[first]}")
                raise TimeoutError(f"launch: rank(s) {missing} did not finish in {timeout:.0f}s; killed")
            if errors and not grace:  # one rank failed: the others may hang in a collective
                grace = True
                deadline = min(deadline, time.monotonic() + 5.0)
            try:
                rank, status, value = queue.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                # a rank that died without reporting (killed, os._exit, a native crash) counts as
                # failed, so the others get the grace period instead of the whole timeout
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results and r not in errors]
                if dead and queue.empty():
                    for r in dead:
                        errors[r] = (f"rank {r} exited with code {procs[r].exitcode} without reporting "
                                     "(killed, os._exit or a crash in native code)\n")
                    continue
                if all(not p.is_alive() for p in procs) and queue.empty():
                    missing = sorted(set(range(world_size)) - set(results) - set(errors))
                    if missing:
                        raise RuntimeError(f"launch: rank(s) {missing} exited without a result (exit codes "
                                           f"{[p.exitcode for p in procs]})")
                continue
            (results if status == "ok" else errors)[rank] = value
        if errors:
            first = next(iter(errors))  # the first failure; later ones are usually its consequence
            others = sorted(set(errors) - {first})
            tails = "".join(f"\nrank {r}: {errors[r].strip().splitlines()[-1]}" for r in others)
            raise RuntimeError(f"rank {first} failed" + (f" (then rank(s) {others})" if others else "")
                               + f":\n{errors[first]}" + tails)
    finally:
        for p in procs:
            p.join(timeout=0.5 if (errors or len(results) < world_size) else 2.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    return [results[r] for r in range(world_size)]


# -- equivalence check ------------------------------------------------------------------------

def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-mean cross entropy of [B, S, V] logits against [B, S] targets."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build(name: str, seed: int = 0):
    """(model, config) of a zoo spec or ``hf:`` name on CPU in fp32, from ``seed``."""
    torch.manual_seed(seed)
    if name.startswith("hf:"):
        from nest_fx.models.hf import build_hf_model

        model, cfg = build_hf_model(name, device="cpu", dtype=torch.float32)
        model.config._attn_implementation = "sdpa"
    else:
        from nest_fx.models import build_model

        model, cfg = build_model(name, device="cpu", dtype=torch.float32)
    return model, cfg


def equivalence(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Train ``spec['model']`` under ``spec['plan']`` (a Plan dict or kwargs for uniform_plan) and
    compare with the single-device run. Keys: model, plan, batch, seq, steps, lr, local_batch."""
    from nest_fx.apply import auto_parallelize
    from nest_fx.apply.pipeline import tensor_output
    from nest_fx.plan import Plan, uniform_plan

    model, cfg = build(spec["model"], spec.get("seed", 0))
    vocab, seq = cfg.vocab_size, spec.get("seq", cfg.seq_len)
    batch, steps, lr = spec["batch"], spec.get("steps", 3), spec.get("lr", 0.5)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1234)
    data = [(torch.randint(0, vocab, (batch, seq), generator=gen), torch.randint(0, vocab, (batch, seq), generator=gen))
            for _ in range(steps)]
    plan_spec = dict(spec["plan"] or {})
    if not plan_spec:  # let the planner choose (auto_parallelize's default)
        plan = None
    elif "stages" in plan_spec:
        plan = Plan.from_dict({"format": "nest-fx-plan/1", **plan_spec})
    else:
        plan = uniform_plan(plan_spec.pop("num_layers", cfg.layers + 2), **plan_spec)
    example = data[0][0]
    pm = auto_parallelize(model, example, global_batch_size=batch, loss_fn=lm_loss, plan=plan,
                          verbose=spec.get("verbose", False))
    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    ref_params = dict(reference.named_parameters())
    out = {"loss_diff": 0.0, "grad_diff": 0.0, "param_diff": 0.0, "losses": [], "ref_losses": [],
           "rank": int(os.environ.get("RANK", 0)), "stage": pm.rank_info.stage, "num_params": 0}
    plan = pm.plan
    per = batch // plan.dp
    lo = pm.rank_info.replica * per
    for step, (x, y) in enumerate(data):
        # "local_batch": feed this rank's data-parallel shard, as a DistributedSampler would
        loss = pm.train_step(x[lo:lo + per], y[lo:lo + per]) if spec.get("local_batch") else pm.train_step(x, y)
        ref_loss = lm_loss(tensor_output(reference(x)), y)
        ref_loss.backward()
        out["losses"].append(float(loss))
        out["ref_losses"].append(float(ref_loss.detach()))
        out["loss_diff"] = max(out["loss_diff"], abs(float(loss) - float(ref_loss.detach())))
        grads = pm.full_tensors(grads=True)
        for name, g in grads.items():
            out["grad_diff"] = max(out["grad_diff"], float((g - ref_params[name].grad).abs().max()))
        out["num_grads"] = len(grads)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    params = pm.full_tensors()
    for name, p in params.items():
        out["param_diff"] = max(out["param_diff"], float((p - ref_params[name].detach()).abs().max()))
    out["num_params"] = len(params)
    from torch.distributed.tensor import DTensor, Shard

    out["sharded"] = sorted(name for name, p in pm.named_parameters()
                            if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements))
    return out
