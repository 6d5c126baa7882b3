"""Check a plan on a small model: train it in parallel and on one device, compare the numbers.

``equivalence(spec)`` (run on every rank, e.g. through :func:`nest_fx.apply.launch.launch`)
builds the model twice from the same seed, trains the parallel one through
:func:`~nest_fx.apply.auto_parallelize` and the reference one on the whole batch on this
process, with SGD for ``steps`` steps, and reports the largest loss, gradient and parameter
differences. Any model ``nest_fx.models.build_seeded`` builds works: zoo LMs (token cross
entropy), plain PyTorch classifiers (``mlp:``/``cnn:``, class cross entropy) and HuggingFace
models (``hf:<model_type>``: all their inputs, e.g. T5's ``input_ids`` and
``decoder_input_ids``, and the model's own loss from ``labels``). Dropout is switched off in
both copies: random masks are not part of what a plan must reproduce. The tests use it, and so
can anyone checking a plan on a small model. Nothing in the package below the command line
imports this module. For models outside the
named ones a spec may carry picklable callables (``build``, ``data``, ``loss``) or an explicit
HuggingFace config (``hf_config``): see :func:`equivalence`.

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
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor, Shard

from nest_fx.apply import auto_parallelize
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.pipeline import tensor_output
from nest_fx.apply.runtime import model_loss
from nest_fx.common.errors import NestFxError
from nest_fx.common.fileio import one_line
from nest_fx.graph import trace
from nest_fx.models import build_seeded
from nest_fx.models.build import model_example
from nest_fx.models.inputs import call_args, make_batch, with_loss_fn
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


LOSSES = {"lm": lm_loss, "classify": F.cross_entropy, "model": None}

# The coverage suite: tiny configs of transformers families and two plain PyTorch models, each
# trained under the plans of COVERAGE_PLANS on 4 ranks (scripts/bench_coverage.py; a few cells in
# tests/test_coverage.py). Values are the family's kind, for the table.
COVERAGE_MODELS: Dict[str, str] = {
    **{f"hf:{t}": "decoder" for t in ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt_neox",
                                      "opt", "bloom", "falcon", "olmo2", "starcoder2", "gptj")},
    **{f"hf:{t}": "encoder" for t in ("bert", "roberta", "distilbert", "electra", "deberta-v2")},
    **{f"hf:{t}": "encoder-decoder" for t in ("t5", "bart")},
    **{f"hf:{t}": "moe" for t in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")},
    # vision models whose fp32 run is reproducible to 1e-5 over the cells' 3 SGD steps (fp32_noise):
    # not hf:resnet (1e-4: BatchNorm over 8 images; the BatchNorm CNN below stands for it), hf:deit (7e-4)
    **{f"hf:{t}": "vision" for t in ("vit", "dinov2", "convnext")},
    "mlp": "plain", "cnn": "plain",
}
# plan name -> kwargs of uniform_plan ({}: the planner's choice); batch 8 on 4 ranks
COVERAGE_PLANS: Dict[str, Dict[str, Any]] = {
    "planner": {},
    "TP2xDP2": {"tp": 2, "dp": 2, "microbatch_size": 4},
    "PP2xDP2": {"pp": 2, "dp": 2, "microbatch_size": 2, "num_microbatches": 2},
    "TP2xPP2": {"tp": 2, "pp": 2, "microbatch_size": 4, "num_microbatches": 2},
    "EP2xDP2": {"dp": 4, "ep": 2, "microbatch_size": 2},  # MoE models only
}
COVERAGE_BATCH, COVERAGE_SEQ, COVERAGE_TOL = 8, 16, 1e-5
_DROPOUT_ATTRS = ("dropout", "dropout_p", "dropout_rate", "attention_dropout", "attn_dropout", "hidden_dropout",
                  "activation_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop",
                  "embd_pdrop", "attn_pdrop", "classifier_dropout", "drop_path_rate")


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability of ``model`` (modules, attributes read in forward, its config) to 0."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for attr in _DROPOUT_ATTRS:
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
        config = getattr(m, "config", None)
        for sub in [config] + [getattr(config, n, None) for n in ("text_config", "vision_config")]:
            for attr in _DROPOUT_ATTRS:
                if isinstance(getattr(sub, attr, None), float):
                    setattr(sub, attr, 0.0)


def _plan(spec_plan: Optional[dict], num_layers: int) -> Optional[Plan]:
    plan_spec = dict(spec_plan or {})
    if not plan_spec:  # let the planner choose (auto_parallelize's default)
        return None
    if "stages" in plan_spec:
        return Plan.from_dict({"format": "nest-fx-plan/1", **plan_spec})
    return uniform_plan(plan_spec.pop("num_layers", num_layers), **plan_spec)


def _call_args(example, inputs) -> tuple:
    """``(args, kwargs)`` of a model call: from named inputs, or one tensor when ``example`` is None
    (a spec with its own ``build``/``data``, or an ``hf_config``)."""
    return ((inputs,), {}) if example is None else call_args(example, inputs)


def _model_inputs(example, inputs):
    """What train_step and auto_parallelize take: the one positional tensor, or the keyword dict."""
    args, kwargs = _call_args(example, inputs)
    if args and not kwargs:
        return args[0] if len(args) == 1 else args
    return kwargs


def _setup_custom(spec: Dict[str, Any]):
    """:func:`_setup` for a spec with an ``hf_config`` or its own ``build(seed) -> (model, config)``
    (``config`` has ``vocab_size`` and ``seq_len``), ``data(generator, batch) -> (inputs, targets)``
    and ``loss(output, targets)`` (default: random tokens and ``lm_loss``; ``"model"``: the model's own
    loss, ``forward(inputs, targets) -> (output, loss)`` as nanoGPT's); dropout is left as built."""
    if "hf_config" in spec:
        model = hf_model_from_config(spec["hf_config"], spec.get("seed", 0))
        vocab, seq = model.config.vocab_size, spec["seq"]
    else:
        model, cfg = spec["build"](spec.get("seed", 0))
        vocab, seq = cfg.vocab_size, spec.get("seq", cfg.seq_len)
    gen = torch.Generator().manual_seed(1234)
    make = spec.get("data") or (lambda g, b: (torch.randint(0, vocab, (b, seq), generator=g),
                                             torch.randint(0, vocab, (b, seq), generator=g)))
    data = [make(gen, spec["batch"]) for _ in range(spec.get("steps", 3))]
    loss = spec.get("loss")
    return model, None, None if loss == "model" else (loss or lm_loss), data


def _setup(spec: Dict[str, Any]):
    """(model without dropout, example, loss_fn or None for the model's loss, the steps' batches)."""
    if "hf_config" in spec or "build" in spec:
        return _setup_custom(spec)
    model, cfg = build_seeded(spec["model"], spec.get("seed", 0))
    disable_dropout(model)
    example = model_example(spec["model"], model, cfg, batch=spec["batch"], seq=spec.get("seq"))
    if spec.get("loss", "auto") == "fn" or (spec.get("loss", "auto") == "auto" and len(example.inputs) == 1):
        example = with_loss_fn(example)
    gen = torch.Generator().manual_seed(1234)
    data = [make_batch(example, "cpu", gen) for _ in range(spec.get("steps", 3))]
    return model, example, LOSSES.get(example.loss), data


def _step_loss(model: nn.Module, example, loss_fn, inputs, target, dtype: torch.dtype) -> torch.Tensor:
    def cast(v: torch.Tensor) -> torch.Tensor:
        return v.to(dtype) if v.is_floating_point() else v
    args, kwargs = _call_args(example, cast(inputs) if example is None else {k: cast(v) for k, v in inputs.items()})
    if example is None and loss_fn is None:  # a custom model's own loss: forward(inputs, targets)
        args = args + (target,)
    out = model(*args, **kwargs)
    return model_loss(out) if loss_fn is None else loss_fn(tensor_output(out), target)


def fp32_noise(spec: Dict[str, Any]) -> Dict[str, Any]:
    """How far the single-device fp32 run of ``spec`` (the same steps, data and SGD as
    :func:`equivalence`) drifts from the same run in fp64: the rounding any reordering of its sums
    may show. A parallel run can only be held to a tolerance above it. ``{"error": ...}`` when the
    model does not run in fp64 (some kernels have no fp64 version)."""
    model, example, loss_fn, data = _setup(spec)
    wide = copy.deepcopy(model).double()
    if hasattr(wide, "set_experts_implementation") and getattr(wide.config, "_experts_implementation", None):
        wide.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel; the same sums per expert
    lr = spec.get("lr", 0.5)
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (model, wide)]
    out = {"grad": 0.0, "param": 0.0}
    try:
        for inputs, target in data:
            for m, dtype in ((model, torch.float32), (wide, torch.float64)):
                _step_loss(m, example, loss_fn, inputs, target, dtype).backward()
            out["grad"] = max([out["grad"]] + [float((p.grad.double() - q.grad).abs().max())
                                               for p, q in zip(model.parameters(), wide.parameters())
                                               if p.grad is not None])
            for opt in opts:
                opt.step()
                opt.zero_grad()
    except RuntimeError as exc:
        return {"error": one_line(str(exc))[:200]}
    out["param"] = max(float((p.double() - q).abs().max()) for p, q in zip(model.parameters(), wide.parameters()))
    return out


def equivalence(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Train ``spec['model']`` under ``spec['plan']`` (a Plan dict, kwargs for uniform_plan, or empty
    for the planner's choice) and compare with the single-device run. Keys: model, plan, batch, seq,
    steps, lr, local_batch (feed this rank's shard), seed, verbose, sync_batchnorm, loss: "model" (the
    model's own loss from its labels), "fn" (a loss_fn on its output: token or class cross entropy) or
    "auto" (the default: "fn" for models with one input, "model" for several). A spec with
    ``hf_config`` (:func:`hf_model_from_config`) or its own ``build``/``data``/``loss`` callables
    (:func:`_setup_custom`) trains that model instead (``model`` then only labels the run)."""
    model, example, loss_fn, data = _setup(spec)
    batch, lr = spec["batch"], spec.get("lr", 0.5)
    reference = copy.deepcopy(model)
    args, kwargs = _call_args(example, data[0][0])
    if example is None and loss_fn is None:  # the model's own loss from its targets: forward(inputs, targets)
        args = args + (data[0][1],)
    graph = trace(model, args, kwargs, name=spec["model"])
    plan = _plan(spec.get("plan"), len(graph.blocks))
    pm = auto_parallelize(model, args if example is None else _model_inputs(example, data[0][0]),
                          global_batch_size=batch, loss_fn=loss_fn, plan=plan, graph=graph,
                          verbose=spec.get("verbose", False), sync_batchnorm=spec.get("sync_batchnorm", True))
    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    ref_params = dict(reference.named_parameters())
    out = {"loss_diff": 0.0, "grad_diff": 0.0, "param_diff": 0.0, "buffer_diff": 0.0, "losses": [], "ref_losses": [],
           "rank": int(os.environ.get("RANK", 0)), "stage": pm.rank_info.stage, "num_params": 0,
           "plan": pm.plan.to_dict()}
    per = batch // pm.plan.dp
    lo = pm.rank_info.replica * per
    for inputs, target in data:
        fed, fed_target = inputs, target
        if spec.get("local_batch"):  # this rank's data-parallel shard, as a DistributedSampler would give
            fed = inputs[lo:lo + per] if example is None else {k: v[lo:lo + per] for k, v in inputs.items()}
            fed_target = target[lo:lo + per] if target is not None else None
        loss = pm.train_step(_model_inputs(example, fed), fed_target)
        ref_loss = _step_loss(reference, example, loss_fn, inputs, target, torch.float32)
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
    # running statistics (BatchNorm) and other float buffers this rank holds
    ref_buffers = dict(reference.named_buffers())
    for name, b in pm.named_buffers():
        ref = ref_buffers.get(name)
        if ref is not None and b.is_floating_point() and b.shape == ref.shape:
            out["buffer_diff"] = max(out["buffer_diff"], float((b - ref).abs().max()))
    out["sharded"] = sorted(name for name, p in pm.named_parameters()
                            if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements))
    return out


def coverage_cell(spec: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`equivalence` for one cell of the coverage matrix, on every rank: its result, or
    ``{"refused": message}`` when nest-fx refused the model or plan before training (a
    ``NestFxError``: the checks, the planner, the model builder)."""
    try:
        return equivalence(spec)
    except NestFxError as exc:
        return {"refused": f"{type(exc).__name__}: {one_line(str(exc))}"}


def cell_status(results, tol: float = COVERAGE_TOL) -> Dict[str, Any]:
    """Summary of a coverage cell from every rank's :func:`coverage_cell` result: ``ok`` (loss,
    gradients and parameters within ``tol`` of one device), ``mismatch`` or ``refused``."""
    refused = [r["refused"] for r in results if "refused" in r]
    if refused:
        return {"status": "refused", "reason": refused[0]}
    worst = {k: max(r[k] for r in results) for k in ("loss_diff", "grad_diff", "param_diff", "buffer_diff")}
    plan = results[0]["plan"]
    chosen = (f"pp={len(plan['stages'])} dp={plan['dp']} tp={plan['stages'][0]['tp']} ep={plan.get('ep', 1)} "
              f"zero={plan.get('zero', 0)} mbs={plan['microbatch_size']}")
    same = all(len({round(r["losses"][i], 6) for r in results}) == 1 for i in range(len(results[0]["losses"])))
    ok = all(v < tol for v in worst.values()) and same
    return {"status": "ok" if ok else "mismatch", **worst, "plan": chosen}


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
