"""Check a plan on a small model: train it in parallel and on one device, compare the numbers.

``equivalence(spec)`` (run on every rank, e.g. through :func:`nest_fx.apply.launch.launch`)
builds the model twice from the same seed, trains the parallel one through
:func:`~nest_fx.apply.auto_parallelize` and the reference one on the whole batch on this
process, with SGD for ``steps`` steps, and reports the largest loss, gradient and parameter
differences. The tests use it, and so can anyone checking a plan on a small model. Nothing in
the package below the command line imports this module.

Fault probes (tests/test_apply_failures.py, tests/test_checkpoint.py, scripts/bench_faults.py):
:func:`fault_run` trains a small model under TP2 x DP2 on 4 ranks and makes rank 3 stop
(SIGSTOP: hangs without dying) or die (SIGKILL) inside a TP collective, the DP gradient
all-reduce or a checkpoint save; every other rank writes what it raised and when
(:func:`fault_reports`).

Elastic runs on one machine (tests/test_elastic.py, scripts/bench_faults.py): two torchrun agents
of ``examples/train_elastic.py`` stand for two nodes (:func:`elastic_command`,
:func:`elastic_env`, :class:`ElasticAgents`); :func:`kill_node` kills an agent and its workers
like a lost node; :func:`read_losses` reads the JSON lines rank 0 writes.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor, Shard

from nest_fx.apply import auto_parallelize
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.pipeline import tensor_output
from nest_fx.models import build_seeded
from nest_fx.plan import Plan, uniform_plan


def hf_model_from_config(hf_config: Dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """A HuggingFace model from an explicit config, on the CPU in fp32, its weights drawn from
    ``seed``: ``{"model_type": "qwen2", "task": "causal-lm" | "masked-lm", "attn_implementation":
    "sdpa" | "eager", **config fields}`` (no download)."""
    import transformers  # the optional 'hf' extra

    fields = dict(hf_config)
    model_type = fields.pop("model_type")
    task = fields.pop("task", "causal-lm")
    attn = fields.pop("attn_implementation", "sdpa")
    auto = {"causal-lm": transformers.AutoModelForCausalLM, "masked-lm": transformers.AutoModelForMaskedLM}[task]
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    return auto.from_config(config, attn_implementation=attn, dtype=torch.float32)


def equivalence(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Train ``spec['model']`` under ``spec['plan']`` (a Plan dict or kwargs for uniform_plan) and
    compare with the single-device run. Keys: model, plan, batch, seq, steps, lr, local_batch;
    ``hf_config`` (see :func:`hf_model_from_config`) builds that HuggingFace model instead of the
    ``model`` name (which then only labels the run).

    For models that are not zoo or ``hf:`` names, or not language models, these optional keys are
    picklable callables: ``build(seed) -> (model, config)`` (``config`` has ``vocab_size``,
    ``seq_len`` and ``layers``), ``data(generator, batch) -> (inputs, targets)`` and
    ``loss(output, targets)`` (default: random tokens and ``lm_loss``)."""
    if "hf_config" in spec:
        model = hf_model_from_config(spec["hf_config"], spec.get("seed", 0))
        vocab, seq = model.config.vocab_size, spec["seq"]
        num_layers = model.config.num_hidden_layers + 2
    else:
        build = spec.get("build") or (lambda seed: build_seeded(spec["model"], seed))
        model, cfg = build(spec.get("seed", 0))
        vocab, seq, num_layers = cfg.vocab_size, spec.get("seq", cfg.seq_len), cfg.layers + 2
    batch, steps, lr = spec["batch"], spec.get("steps", 3), spec.get("lr", 0.5)
    loss_fn = spec.get("loss") or lm_loss
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1234)
    make = spec.get("data") or (lambda g, b: (torch.randint(0, vocab, (b, seq), generator=g),
                                             torch.randint(0, vocab, (b, seq), generator=g)))
    data = [make(gen, batch) for _ in range(steps)]
    plan_spec = dict(spec["plan"] or {})
    if not plan_spec:  # let the planner choose (auto_parallelize's default)
        plan = None
    elif "stages" in plan_spec:
        plan = Plan.from_dict({"format": "nest-fx-plan/1", **plan_spec})
    else:
        plan = uniform_plan(plan_spec.pop("num_layers", num_layers), **plan_spec)
    example = data[0][0]
    pm = auto_parallelize(model, example, global_batch_size=batch, loss_fn=loss_fn, plan=plan,
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
        ref_loss = loss_fn(tensor_output(reference(x)), y)
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
    out["param_names"] = sorted(params)
    out["sharded"] = sorted(name for name, p in pm.named_parameters()
                            if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements))
    return out


# -- fault probes -------------------------------------------------------------------------------

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


# -- elastic runs on one machine ------------------------------------------------------------------

def elastic_command(script: str, port: int, script_args: List[str], *, nproc: int = 2, max_restarts: int = 5,
                    last_call_s: int = 2) -> List[str]:
    """A torchrun agent of ``script`` for a job of 1 or 2 such agents ("nodes") on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", f"--nproc_per_node={nproc}",
            f"--max_restarts={max_restarts}", "--monitor_interval=0.5", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=localhost:{port}", "--rdzv_id=nest-fx-elastic", f"--rdzv_conf=last_call_timeout={last_call_s}",
            script, *script_args]


def elastic_env() -> Dict[str, str]:
    """The environment docs/runtime.md ("Elastic training") asks for, one thread per rank."""
    return dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", TORCH_ELASTIC_WORKER_IDENTICAL="1",
                OMP_NUM_THREADS="1")


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
        self.agents.append(subprocess.Popen(self.command, env=elastic_env(), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))
        return self.agents[-1]

    def __enter__(self) -> "ElasticAgents":
        return self

    def __exit__(self, *exc) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                kill_node(agent)
        for log in self._logs:
            log.close()


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
