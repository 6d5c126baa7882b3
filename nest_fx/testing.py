"""Check a plan on a small model: train it in parallel and on one device, compare the numbers.

``equivalence(spec)`` (run on every rank, e.g. through :func:`nest_fx.apply.launch.launch`)
builds the model twice from the same seed, trains the parallel one through
:func:`~nest_fx.apply.auto_parallelize` and the reference one on the whole batch on this
process, with SGD for ``steps`` steps, and reports the largest loss, gradient and parameter
differences. The tests use it, and so can anyone checking a plan on a small model. Nothing in
the package below the command line imports this module.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict

import torch
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
