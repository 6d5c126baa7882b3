"""train_step takes what the model takes; the model's own loss; BatchNorm under data parallelism
(single process: one-rank runs, the checks and the planner's choices)."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F

from nest_fx.apply import ApplyError, auto_parallelize, checks
from nest_fx.apply.launch import launch
from nest_fx.apply.runtime import microbatches
from nest_fx.cluster import Cluster
from nest_fx.graph import trace
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan
from nest_fx.plan.support import parallel_support
from nest_fx.solver.runtime_planner import planner_for

CNN = "cnn:channels=8,blocks=1,classes=4,image=8"


def test_microbatches_split_every_tensor_and_repeat_the_rest():
    x, mask = torch.arange(8).reshape(4, 2), torch.ones(4, 3)
    parts = list(microbatches((x,), {"mask": mask, "return_dict": True}, torch.arange(4), 2))
    assert len(parts) == 2
    (args, kwargs, target) = parts[1]
    assert torch.equal(args[0], x[2:]) and kwargs["mask"].shape == (2, 3) and kwargs["return_dict"] is True
    assert torch.equal(target, torch.tensor([2, 3]))


@pytest.mark.hf
def test_dict_inputs_and_the_models_own_loss_on_one_rank(single_rank):
    pytest.importorskip("transformers")
    model, cfg = build_seeded("hf:t5")
    model.eval()  # no dropout: the same numbers in both copies
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    batch = {
        name: torch.randint(0, cfg.vocab_size, (4, 8), generator=gen)
        for name in ("input_ids", "decoder_input_ids", "labels")
    }
    pm = auto_parallelize(
        model, batch, global_batch_size=4, plan=uniform_plan(4, microbatch_size=2, num_microbatches=2), verbose=False
    )
    loss = pm.train_step(batch)
    ref = reference(**batch).loss
    ref.backward()
    assert abs(float(loss) - float(ref.detach())) < 1e-5
    grads = pm.full_tensors(grads=True)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-6)
    with pytest.raises(ApplyError, match=r"targets given with keyword inputs and loss_fn=None"):
        pm.train_step(batch, batch["labels"])
    with pytest.raises(ApplyError, match=r"inputs\['decoder_input_ids'\] has 3 rows"):
        pm.train_step({**batch, "decoder_input_ids": batch["decoder_input_ids"][:3]})
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    with pytest.raises(ApplyError, match=r"holds no loss .*; fix: give the model its targets"):
        pm.train_step(no_labels)


def test_a_loss_fn_needs_targets(single_rank):
    model, cfg = build_seeded("mlp:in=8,hidden=16,layers=3,classes=4")
    x = torch.randn(4, 8)
    pm = auto_parallelize(model, x, global_batch_size=4, loss_fn=F.cross_entropy, verbose=False)
    with pytest.raises(ApplyError, match=r"loss_fn needs targets"):
        pm.train_step(x)
    assert float(pm.train_step(x, torch.tensor([0, 1, 2, 3]))) > 0


@pytest.mark.hf
def test_pipelines_take_several_inputs_and_the_models_own_loss():
    """Every stage gets all the model's inputs (labels and targets reach the last stage, whose own
    loss the schedule backpropagates), so several inputs are no refusal by themselves; T5's cuts
    pass the encoder's output beside the decoder's state (tests/distributed/apply/test_pipeline_side_values.py)."""
    pytest.importorskip("transformers")
    model, cfg = build_seeded("hf:t5")
    tokens = torch.randint(0, cfg.vocab_size, (4, 8))
    graph = trace(model, (), {"input_ids": tokens, "decoder_input_ids": tokens, "labels": tokens})
    assert parallel_support(model, graph).pp_problem(2) == ""
    checks.run_all(uniform_plan(len(graph.blocks), pp=2, num_microbatches=2), model, graph, 2, 2, model_loss=True)
    llama, llama_cfg = build_seeded("hf:llama")
    ids = torch.randint(0, llama_cfg.vocab_size, (2, 8))
    one = trace(llama, (), {"input_ids": ids, "labels": ids})
    assert parallel_support(llama, one).pp_problem(2) == ""
    checks.run_all(uniform_plan(len(one.blocks), pp=2, num_microbatches=2), llama, one, 2, 2, model_loss=True)


def test_batchnorm_with_several_microbatches_is_refused_and_not_planned():
    model, _ = build_seeded(CNN)
    graph = trace(model, (torch.randn(8, 3, 8, 8),))
    with pytest.raises(ApplyError, match=r"BatchNorm layers \(1, 4\) normalise with the statistics.*2 microbatches"):
        checks.run_all(uniform_plan(len(graph.blocks), dp=2, microbatch_size=2, num_microbatches=2), model, graph, 2, 8)
    checks.run_all(
        uniform_plan(len(graph.blocks), dp=2, microbatch_size=2, num_microbatches=2),
        model,
        graph,
        2,
        8,
        batch_statistics=False,
    )  # sync_batchnorm=False accepts per-microbatch statistics
    plan = planner_for(model)(graph, Cluster.preset("cpu-gloo", 4), 4, 8)
    assert plan.num_microbatches == 1 and plan.pp == 1 and plan.dp * plan.microbatch_size == 8


def _batchnorm_run(sync: bool) -> bytes:
    model, _ = build_seeded(CNN)
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = auto_parallelize(
            model,
            x,
            global_batch_size=8,
            loss_fn=F.cross_entropy,
            sync_batchnorm=sync,
            plan=uniform_plan(len(trace(model, (x,)).blocks), dp=2, microbatch_size=4),
            verbose=False,
        )
    loss = pm.train_step(x, y)
    out = {
        "loss": float(loss),
        "warnings": [str(w.message) for w in caught if "BatchNorm" in str(w.message)],
        "running_mean": dict(pm.named_buffers())["1.running_mean"].clone(),
        "kind": type(pm.module[1]).__name__,
    }
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.mark.dist
def test_batchnorm_statistics_over_the_data_parallel_batch_or_per_replica_with_a_warning():
    model, _ = build_seeded(CNN)
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(1))
    ref_loss = F.cross_entropy(model(x), y).detach()
    synced = [torch.load(io.BytesIO(r)) for r in launch(_batchnorm_run, 2, True, timeout=120)]
    local = [torch.load(io.BytesIO(r)) for r in launch(_batchnorm_run, 2, False, timeout=120)]
    assert synced[0]["kind"] == "DataParallelBatchNorm" and local[0]["kind"] == "BatchNorm2d"
    assert abs(synced[0]["loss"] - float(ref_loss)) < 1e-6
    for r in synced:
        torch.testing.assert_close(r["running_mean"], model[1].running_mean, rtol=0, atol=1e-6)
        assert not r["warnings"]
    assert abs(local[0]["loss"] - float(ref_loss)) > 1e-6  # per-replica statistics: another number
    assert not torch.equal(local[0]["running_mean"], local[1]["running_mean"])
    assert (
        "sync_batchnorm=False: BatchNorm layers ['1', '4'] normalise each microbatch of 4 samples on its own "
        "replica" in local[0]["warnings"][0]
    )


class _DictNet(torch.nn.Module):
    """A plain module with keyword inputs and a dict output (logits, and a loss when given labels)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, tokens, scale, labels=None):
        logits = self.head(self.embed(tokens) * scale)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


def test_dict_outputs_with_the_models_loss_or_a_loss_fn(single_rank):
    torch.manual_seed(0)
    model = _DictNet()
    reference = copy.deepcopy(model)
    tokens, scale = torch.randint(0, 16, (4, 5)), torch.rand(4, 5, 1)
    inputs = {"tokens": tokens, "scale": scale, "labels": tokens}
    pm = auto_parallelize(
        model, inputs, global_batch_size=4, verbose=False, plan=uniform_plan(1, microbatch_size=2, num_microbatches=2)
    )
    loss = pm.train_step(inputs)
    ref = reference(**inputs)["loss"]
    assert abs(float(loss) - float(ref.detach())) < 1e-6
    lm = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
    pm.loss_fn = lm  # the dict's "logits" go to a loss_fn
    assert abs(float(pm.train_step({"tokens": tokens, "scale": scale}, tokens)) - float(ref.detach())) < 1e-6
