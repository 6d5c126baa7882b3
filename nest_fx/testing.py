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
HuggingFace config (``hf_config``): see :func:`equivalence`. Under a ``bf16-mixed`` or
``bf16-true`` plan the reference runs in that precision too (``apply/precision.py``'s casts on
the whole model); :func:`precision_noise` gives the scale of its rounding for the tolerance.

The fault probes and the two-agent elastic harness live in :mod:`nest_fx.testing_faults` and are
re-exported here under their old names (``fault_run``, ``fault_reports``, ``ElasticAgents``, ...).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from nest_fx.apply import auto_parallelize
from nest_fx.apply.float8 import apply_float8
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.optimizers import build_optimizer, implementation, plan_optimizer
from nest_fx.apply.pipeline import stage_blocks, tensor_output
from nest_fx.apply.precision import prepare_reference
from nest_fx.apply.runtime import model_loss
from nest_fx.common.errors import NestFxError
from nest_fx.common.fileio import one_line
from nest_fx.graph import trace
from nest_fx.models import build_model, build_seeded
from nest_fx.models.build import model_example
from nest_fx.models.inputs import call_args, make_batch, with_loss_fn
from nest_fx.plan import Plan, uniform_plan
from nest_fx.plan.constraints import Constraints
from nest_fx.testing_faults import (  # noqa: F401
    FAULT_MODEL,
    FAULT_RANK,
    ElasticAgents,
    elastic_command,
    elastic_env,
    fault_reports,
    fault_run,
    kill_node,
    process_tree,
    read_losses,
)


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
# tests/distributed/apply/test_coverage.py). Values are the family's kind, for the table.
COVERAGE_MODELS: Dict[str, str] = {
    **{
        f"hf:{t}": "decoder"
        for t in (
            "gpt2",
            "llama",
            "mistral",
            "qwen2",
            "qwen3",
            "gemma2",
            "phi3",
            "gpt_neox",
            "opt",
            "bloom",
            "falcon",
            "olmo2",
            "starcoder2",
            "gptj",
        )
    },
    **{f"hf:{t}": "encoder" for t in ("bert", "roberta", "distilbert", "electra", "deberta-v2")},
    **{f"hf:{t}": "encoder-decoder" for t in ("t5", "bart")},
    **{f"hf:{t}": "moe" for t in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")},
    # vision models whose fp32 run is reproducible to 1e-5 over the cells' 3 SGD steps (fp32_noise):
    # not hf:resnet (1e-4: BatchNorm over 8 images; the BatchNorm CNN below stands for it), hf:deit (7e-4)
    **{f"hf:{t}": "vision" for t in ("vit", "dinov2", "convnext")},
    "mlp": "plain",
    "cnn": "plain",
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
# fp32 tolerance as torch.testing.assert_close defines it for float32: |a - b| <= atol + rtol |b|
# with atol = COVERAGE_TOL and this rtol; a gradient of size 10 summed in another order differs by
# more than 1e-5 from rounding alone (docs/runtime.md, "What parity means")
FP32_RTOL = 1.3e-6
_DROPOUT_ATTRS = (
    "dropout",
    "dropout_p",
    "dropout_rate",
    "attention_dropout",
    "attn_dropout",
    "hidden_dropout",
    "activation_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "classifier_dropout",
    "drop_path_rate",
)


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


def _plan(spec_plan: Optional[dict], num_layers: int, precision: Optional[str] = None) -> Optional[Plan]:
    plan_spec = dict(spec_plan or {})
    if not plan_spec:  # let the planner choose (auto_parallelize's default)
        if precision is not None:
            raise ValueError("spec['precision'] needs an explicit spec['plan'] (the planner chooses its own)")
        return None
    if precision is not None:
        plan_spec["precision"] = precision
    if "stages" in plan_spec:
        return Plan.from_dict({"format": "nest-fx-plan/1", **plan_spec})
    return uniform_plan(plan_spec.pop("num_layers", num_layers), **plan_spec)


def _reference(model: nn.Module, graph, precision: str, float8: bool = False) -> nn.Module:
    """``model`` (a copy made before tracing) set to train on one device in ``precision``
    (``apply/precision.py``), with the plan's Float8 linears when ``float8``."""
    blocks = stage_blocks(graph, 0, len(graph.blocks))
    if float8:
        apply_float8(model, blocks)
    return prepare_reference(model, blocks, precision)


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
    make = spec.get("data") or (
        lambda g, b: (torch.randint(0, vocab, (b, seq), generator=g), torch.randint(0, vocab, (b, seq), generator=g))
    )
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
            out["grad"] = max(
                [out["grad"]]
                + [
                    float((p.grad.double() - q.grad).abs().max())
                    for p, q in zip(model.parameters(), wide.parameters())
                    if p.grad is not None
                ]
            )
            for opt in opts:
                opt.step()
                opt.zero_grad()
    except RuntimeError as exc:
        return {"error": one_line(str(exc))[:200]}
    out["param"] = max(float((p.double() - q).abs().max()) for p, q in zip(model.parameters(), wide.parameters()))
    return out


def precision_noise(spec: Dict[str, Any], precision: str) -> Dict[str, float]:
    """How far the single-device ``precision`` run of ``spec`` (the reference :func:`equivalence`
    compares a plan with: same steps, data and SGD) is from the single-device fp32 run: the effect
    of all its bf16 roundings, ``{"loss", "grad", "param"}`` (largest absolute differences). The
    scale of the bf16 tolerance (docs/runtime.md, "Precision")."""
    model, example, loss_fn, data = _setup(spec)
    low = copy.deepcopy(model)
    args, kwargs = _call_args(example, data[0][0])
    graph = trace(model, args, kwargs, name=spec["model"])
    low = _reference(low, graph, precision)
    lr = spec.get("lr", 0.5)
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (model, low)]
    out = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for inputs, target in data:
        losses = [_step_loss(m, example, loss_fn, inputs, target, torch.float32) for m in (model, low)]
        for loss in losses:
            loss.backward()
        out["loss"] = max(out["loss"], abs(float(losses[0].detach()) - float(losses[1].detach())))
        out["grad"] = max(
            [out["grad"]]
            + [
                float((p.grad - q.grad.float()).abs().max())
                for p, q in zip(model.parameters(), low.parameters())
                if p.grad is not None
            ]
        )
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out["param"] = max(
        float((p.detach() - q.detach().float()).abs().max()) for p, q in zip(model.parameters(), low.parameters())
    )
    return out


def equivalence(spec: Dict[str, Any], progress: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Train ``spec['model']`` under ``spec['plan']`` (a Plan dict, kwargs for uniform_plan, or empty
    for the planner's choice) and compare with the single-device run. Keys: model, plan, batch, seq,
    steps, lr, local_batch (feed this rank's shard), seed, verbose, sync_batchnorm, loss: "model" (the
    model's own loss from its labels), "fn" (a loss_fn on its output: token or class cross entropy) or
    "auto" (the default: "fn" for models with one input, "model" for several). A spec with
    ``hf_config`` (:func:`hf_model_from_config`) or its own ``build``/``data``/``loss`` callables
    (:func:`_setup_custom`) trains that model instead (``model`` then only labels the run).
    ``precision`` (default: the plan's): sets the plan's precision; the single-device reference
    always runs in the parallel plan's precision. ``optimizer`` (a dict of the plan's run options
    ``optimizer``, ``optimizer_kernel``): both sides train with ``build_optimizer`` instead of SGD.
    ``weights`` (a file of the seeded model's values, e.g. its state dict as safetensors): the
    parallel run builds the model on ``meta`` and starts from that file (``auto_parallelize(...,
    weights=)``); the reference is the seeded model.
    ``progress`` (a dict) gets ``phase = "training"`` once ``auto_parallelize`` has returned
    (:func:`coverage_cell` tells a refusal from a crash by it)."""
    model, example, loss_fn, data = _setup(spec)
    batch, lr = spec["batch"], spec.get("lr", 0.5)
    reference = copy.deepcopy(model)
    args, kwargs = _call_args(example, data[0][0])
    if example is None and loss_fn is None:  # the model's own loss from its targets: forward(inputs, targets)
        args = args + (data[0][1],)
    graph = trace(model, args, kwargs, name=spec["model"])
    plan = _plan(spec.get("plan"), len(graph.blocks), spec.get("precision"))
    if spec.get("optimizer"):  # {"optimizer": "adamw", "optimizer_kernel": "fused"}: the plan's run options
        plan = dataclasses.replace(plan, constraints=Constraints.from_dict(spec["optimizer"]))
    if spec.get("weights"):  # the model built on meta takes the values of the weights file
        model = build_model(spec["model"], device="meta")[0]
        disable_dropout(model)
    pm = auto_parallelize(
        model,
        args if example is None else _model_inputs(example, data[0][0]),
        global_batch_size=batch,
        loss_fn=loss_fn,
        plan=plan,
        graph=None if spec.get("weights") else graph,
        verbose=spec.get("verbose", False),
        sync_batchnorm=spec.get("sync_batchnorm", True),
        weights=spec.get("weights"),
    )
    reference = _reference(reference, graph, pm.plan.precision, pm.plan.float8)  # the planner's, when it chose the plan
    if spec.get("optimizer"):  # the plan's optimizer and implementation, on both sides
        opt = pm.build_optimizer(lr=lr)
        ref_opt = build_optimizer(reference.parameters(), *plan_optimizer(pm.plan), lr=lr)
    else:
        opt = torch.optim.SGD(pm.parameters(), lr=lr)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    ref_params = dict(reference.named_parameters())
    out = {
        "loss_diff": 0.0,
        "grad_diff": 0.0,
        "param_diff": 0.0,
        "buffer_diff": 0.0,
        "grad_excess": 0.0,
        "param_excess": 0.0,
        "losses": [],
        "ref_losses": [],
        "rank": int(os.environ.get("RANK", 0)),
        "stage": pm.rank_info.stage,
        "num_params": 0,
        "plan": pm.plan.to_dict(),
        "optimizer_implementation": implementation(opt),
    }
    per = batch // pm.plan.dp
    lo = pm.rank_info.replica * per
    if progress is not None:
        progress["phase"] = "training"
    for inputs, target in data:
        fed, fed_target = inputs, target
        if spec.get("local_batch"):  # this rank's data-parallel shard, as a DistributedSampler would give
            fed = inputs[lo : lo + per] if example is None else {k: v[lo : lo + per] for k, v in inputs.items()}
            fed_target = target[lo : lo + per] if target is not None else None
        loss = pm.train_step(_model_inputs(example, fed), fed_target)
        ref_loss = _step_loss(reference, example, loss_fn, inputs, target, torch.float32)
        ref_loss.backward()
        out["losses"].append(float(loss))
        out["ref_losses"].append(float(ref_loss.detach()))
        out["loss_diff"] = max(out["loss_diff"], abs(float(loss) - float(ref_loss.detach())))
        grads = pm.full_tensors(grads=True)
        for name, g in grads.items():
            _compare(out, "grad", g, ref_params[name].grad)
        out["num_grads"] = len(grads)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    params = pm.full_tensors()
    for name, p in params.items():
        _compare(out, "param", p, ref_params[name].detach())
    out["num_params"] = len(params)
    out["param_names"] = sorted(params)
    out["num_microbatches"] = pm.num_microbatches
    # running statistics (BatchNorm) and other float buffers this rank holds
    ref_buffers = dict(reference.named_buffers())
    for name, b in pm.named_buffers():
        ref = ref_buffers.get(name)
        if ref is not None and b.is_floating_point() and b.shape == ref.shape:
            out["buffer_diff"] = max(out["buffer_diff"], float((b - ref).abs().max()))
    out["sharded"] = sorted(
        name
        for name, p in pm.named_parameters()
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)
    )
    return out


def _compare(out: Dict[str, Any], what: str, value: torch.Tensor, ref: torch.Tensor) -> None:
    """Raise ``out[what + "_diff"]`` to the largest |value - ref| and ``out[what + "_excess"]`` to
    the largest amount by which it exceeds ``FP32_RTOL * |ref|`` (what an fp32 comparison allows
    beyond ``COVERAGE_TOL``)."""
    diff = (value.float() - ref.float()).abs()
    out[f"{what}_diff"] = max(out[f"{what}_diff"], float(diff.max()))
    out[f"{what}_excess"] = max(out[f"{what}_excess"], float((diff - FP32_RTOL * ref.float().abs()).max()))


class CellFailure(RuntimeError):
    """A coverage cell that ended neither at parity nor in a refusal before the first collective.
    Its message starts with the outcome (:data:`FAILURES`) and where: ``crash (training, after 12
    collectives): <error>``."""


# outcomes that break the coverage rule, besides "mismatch" and "timeout": a failure once training
# started; a NestFxError raised after the ranks' first collective (a refusal must come before it);
# any other exception while setting up
FAILURES = ("crash", "late-refusal", "error")


def collectives_run() -> int:
    """Collectives the default process group has run so far (its sequence number; 0 before the first,
    or without a group; -1 when the backend does not count)."""
    if not dist.is_initialized():
        return 0
    try:
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return -1


def coverage_cell(spec: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`equivalence` for one cell of the coverage matrix, on every rank: its result, or
    ``{"refused": message}`` when nest-fx refused the model or plan before the ranks' first
    collective (a ``NestFxError``: the checks, the planner, the model builder). Any other failure
    raises :class:`CellFailure` naming the outcome: ``crash`` once training started (the rule's
    worst break), ``late-refusal`` (a NestFxError after the first collective), ``error`` (another
    exception while setting up)."""
    progress = {"phase": "setup"}
    try:
        return equivalence(spec, progress)
    except Exception as exc:  # noqa: BLE001 - every failure is classified, the original chained
        collectives = collectives_run()
        refusal = isinstance(exc, NestFxError)
        if refusal and progress["phase"] == "setup" and collectives == 0:
            return {"refused": f"{type(exc).__name__}: {one_line(str(exc))}"}
        outcome = "crash" if progress["phase"] == "training" else "late-refusal" if refusal else "error"
        raise CellFailure(
            f"{outcome} ({progress['phase']}, after {collectives} collectives): "
            f"{type(exc).__name__}: {one_line(str(exc))}"
        ) from exc


def cell_status(results, tol: float = COVERAGE_TOL) -> Dict[str, Any]:
    """Summary of a coverage cell from every rank's :func:`coverage_cell` result: ``ok`` (loss,
    gradients and parameters equal to one device's to fp32 tolerance: ``|a - b| <= tol + FP32_RTOL
    |b|`` elementwise, the loss within ``tol``), ``mismatch`` or ``refused``."""
    refused = [r["refused"] for r in results if "refused" in r]
    if refused:
        return {"status": "refused", "reason": refused[0]}
    worst = {
        k: max(r[k] for r in results)
        for k in ("loss_diff", "grad_diff", "param_diff", "buffer_diff", "grad_excess", "param_excess")
    }
    plan = results[0]["plan"]
    chosen = (
        f"pp={len(plan['stages'])} dp={plan['dp']} tp={plan['stages'][0]['tp']} ep={plan.get('ep', 1)} "
        f"zero={plan.get('zero', 0)} mbs={plan['microbatch_size']}"
    )
    same = all(len({round(r["losses"][i], 6) for r in results}) == 1 for i in range(len(results[0]["losses"])))
    checked = ("loss_diff", "buffer_diff", "grad_excess", "param_excess")  # the raw diffs are reported
    ok = all(worst[k] < tol for k in checked) and same
    return {"status": "ok" if ok else "mismatch", **worst, "plan": chosen}


# -- fault probes -------------------------------------------------------------------------------
