"""A zoo model started on meta (issue 24 item 1): materialised per rank from a torch state dict,
a nest-fx checkpoint, or its own initialisation; each rank allocates and reads only its share;
a weights file that does not fit is refused on every rank before the first collective."""

from __future__ import annotations

import io

import pytest
import torch

from nest_fx.apply.checks import ApplyError
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.materialize import materialize, module_seed, prepare_weights
from nest_fx.models import build_model

MODEL = "gpt:hidden=32,layers=2,heads=4,seq=16,vocab=64"
LLAMA = "llama:hidden=32,layers=2,heads=4,kv=2,seq=16,vocab=64"
BATCH, STEPS, LR, TOL = 8, 2, 0.5, 1e-5


def _data():
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 64, (BATCH, 16), generator=gen), torch.randint(0, 64, (BATCH, 16), generator=gen))
        for _ in range(STEPS)
    ]


def _train(model_or_pm, opt, step):
    losses = []
    for x, y in _data():
        losses.append(float(step(x, y)))
        opt.step()
        opt.zero_grad()
    return losses


def _reference(model):
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(x, y):
        loss = lm_loss(model(x), y)
        loss.backward()
        return loss.detach()

    return _train(model, opt, step), {n: p.detach() for n, p in model.named_parameters()}


def _meta_reference(spec: str, seed: int):
    """The one-device meta start: the model materialised on the CPU by the same initialisation."""
    model, _ = build_model(spec, device="meta")
    import copy

    skeleton = copy.deepcopy(model)
    materialize([model], skeleton, torch.device("cpu"), None, seed)
    return model


def _ranks(spec: str, plan_kwargs: dict, weights, save_to=None, init_seed: int = 0, device: str = "meta"):
    from torch.distributed.tensor import DTensor

    from nest_fx.apply import auto_parallelize
    from nest_fx.plan import uniform_plan

    model, _ = build_model(spec, device=device)
    x = _data()[0][0]
    pm = auto_parallelize(
        model,
        x,
        global_batch_size=BATCH,
        loss_fn=lm_loss,
        plan=uniform_plan(4, **plan_kwargs),
        weights=weights,
        init_seed=init_seed,
        verbose=False,
    )
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in pm.parameters())
    start = pm.full_tensors()
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses = _train(pm, opt, pm.train_step)
    if save_to:
        pm.save(save_to)
    out = {
        "losses": losses,
        "start": start,
        "params": pm.full_tensors(),
        "local_numel": local,
        "materialized": pm.materialized,
    }
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _run(*args):
    return [torch.load(io.BytesIO(r)) for r in launch(_ranks, 4, *args, timeout=300)]


@pytest.mark.dist
def test_zoo_gpt_on_meta_tp2_dp2_from_a_state_dict_then_zero3_from_its_checkpoint(tmp_path):
    torch.manual_seed(1)
    eager, _ = build_model(MODEL, device="cpu")
    path = str(tmp_path / "gpt.pt")
    torch.save(eager.state_dict(), path)
    ref_losses, ref_params = _reference(eager)
    ckpt = str(tmp_path / "ckpt")
    results = _run(MODEL, {"tp": 2, "dp": 2, "microbatch_size": 4}, path, ckpt)
    for r in results:  # was: RuntimeError: Tensor on device meta is not on the expected device cpu!
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) < TOL
        for name, p in r["params"].items():
            torch.testing.assert_close(p, ref_params[name], rtol=0, atol=TOL)
    # the trained checkpoint as weights=, under another plan: each rank loads its ZeRO-3 shard
    again = _run(MODEL, {"dp": 4, "zero": 3, "microbatch_size": 2}, ckpt)
    total = sum(p.numel() for p in ref_params.values())
    for r in again:
        for name, p in r["start"].items():
            assert torch.equal(p, results[0]["params"][name]), name
        assert r["local_numel"] <= total // 4 + 64  # a quarter of every parameter (plus row padding)


@pytest.mark.dist
def test_a_model_with_values_takes_the_files_values_under_pp2_dp2(tmp_path):
    torch.manual_seed(5)
    eager, _ = build_model(MODEL, device="cpu")
    path = str(tmp_path / "gpt.pt")
    torch.save(eager.state_dict(), path)
    ref_losses, _ = _reference(eager)
    plan = {"pp": 2, "dp": 2, "microbatch_size": 2, "num_microbatches": 2}
    for r in _run(MODEL, plan, path, None, 0, "cpu"):  # built on the CPU from another seed, then loaded
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) < TOL


@pytest.mark.dist
def test_zero3_ranks_read_and_hold_a_quarter_of_a_safetensors_file(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(2)
    eager, _ = build_model(LLAMA, device="cpu")
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in eager.state_dict().items()}, path)
    file_bytes = sum(v.numel() * v.element_size() for v in eager.state_dict().values())
    total = sum(p.numel() for p in eager.parameters())
    ref_losses, _ = _reference(eager)
    results = _run(LLAMA, {"dp": 4, "zero": 3, "microbatch_size": 2}, path)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) < TOL
        assert r["local_numel"] <= total // 4 + 64
    # FSDP shards every parameter over the 4 ranks: together they read the file exactly once
    assert sum(r["materialized"]["bytes_read"] for r in results) == file_bytes


@pytest.mark.dist
def test_without_weights_every_plan_initialises_the_same_values_as_one_device():
    ref_losses, ref_params = _reference(_meta_reference(LLAMA, seed=7))
    for plan in (
        {"tp": 2, "dp": 2, "microbatch_size": 4},
        {"pp": 2, "dp": 2, "microbatch_size": 2, "num_microbatches": 2},
    ):
        for r in _run(LLAMA, plan, None, None, 7):
            assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) < TOL
            for name, p in r["params"].items():
                torch.testing.assert_close(p, ref_params[name], rtol=0, atol=TOL)


def test_the_meta_start_is_deterministic_and_draws_like_an_eager_build():
    a, b = _meta_reference(LLAMA, seed=3), _meta_reference(LLAMA, seed=3)
    c = _meta_reference(LLAMA, seed=4)
    eager, _ = build_model(LLAMA, device="cpu")
    for (name, p), q, r, e in zip(a.named_parameters(), b.parameters(), c.parameters(), eager.parameters()):
        assert torch.equal(p, q), name
        if p.numel() > 64 and name.endswith("proj.weight"):
            assert not torch.equal(p, r), name
            # same initialisation (normal, std 0.02): the spread matches the eager build's
            assert abs(float(p.detach().std()) - float(e.detach().std())) < 0.005, name
    # deterministic tensors equal the eager build's exactly: norms (ones) and the rotary tables
    eager_buffers = dict(eager.named_buffers())
    for name, buf in a.named_buffers():
        assert torch.equal(buf, eager_buffers[name]), name
    assert torch.equal(a.norm.weight, eager.norm.weight)
    assert module_seed(3, "layers.0.attn.q_proj") != module_seed(3, "layers.0.attn.k_proj")


def test_a_weights_file_that_does_not_fit_is_refused_listing_every_problem(tmp_path):
    eager, _ = build_model(MODEL, device="cpu")
    state = eager.state_dict()
    state.pop("layers.0.attn.q_proj.weight")  # missing
    state["layers.0.mlp.fc.weight"] = torch.zeros(3, 3)  # wrong shape
    state["layers.9.extra.weight"] = torch.zeros(2)  # unexpected
    path = str(tmp_path / "bad.pt")
    torch.save(state, path)
    model, _ = build_model(MODEL, device="meta")
    with pytest.raises(ApplyError) as info:
        prepare_weights(path, model)
    text = str(info.value)
    assert "missing from the file: layers.0.attn.q_proj.weight" in text
    assert "in the file but not in the model: layers.9.extra.weight" in text
    assert "wrong shape: layers.0.mlp.fc.weight: file [3, 3], model [128, 32]" in text
    with pytest.raises(ApplyError, match="no such file"):
        prepare_weights(str(tmp_path / "nothing"), model)


def _refused(path: str):
    from nest_fx.apply import auto_parallelize
    from nest_fx.plan import uniform_plan

    model, _ = build_model(MODEL, device="meta")
    try:
        auto_parallelize(
            model,
            _data()[0][0],
            global_batch_size=BATCH,
            loss_fn=lm_loss,
            plan=uniform_plan(4, tp=2, dp=2, microbatch_size=4),
            weights=path,
            verbose=False,
        )
    except ApplyError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.dist
def test_every_rank_refuses_a_misfit_file_before_any_collective(tmp_path):
    eager, _ = build_model(MODEL, device="cpu")
    state = eager.state_dict()
    state["lm_head.weight"] = torch.zeros(64, 31)
    path = str(tmp_path / "bad.pt")
    torch.save(state, path)
    messages = launch(_refused, 4, path, timeout=120)
    assert len(set(messages)) == 1 and "wrong shape: lm_head.weight" in messages[0]


class _Scale(torch.nn.Module):
    """A parameter no initialisation sets (no reset_parameters, no root _init_weights)."""

    def __init__(self, dim: int):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.gain


def _uninitialised():
    import torch.nn.functional as F

    from nest_fx.apply import auto_parallelize

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Scale(8), torch.nn.Linear(8, 4))
    try:
        auto_parallelize(model, torch.randn(4, 8), global_batch_size=4, loss_fn=F.cross_entropy, verbose=False)
    except ApplyError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.dist
def test_a_tensor_no_initialisation_sets_is_refused_on_every_rank():
    messages = launch(_uninitialised, 2, timeout=120)
    assert all("1.gain is not set by the model's initialisation" in m for m in messages), messages


@pytest.mark.hf
def test_build_model_takes_every_name_and_builds_on_meta_by_default():
    pytest.importorskip("transformers")
    model, _ = build_model("hf:qwen2")
    assert type(model).__name__ == "Qwen2ForCausalLM" and next(model.parameters()).device.type == "meta"
    model, _ = build_model("hf:qwen2", device="cpu")
    assert next(model.parameters()).device.type == "cpu"
    model, cfg = build_model("mlp", device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    model, cfg = build_model(MODEL, seq_len=32)
    assert cfg.seq_len == 32
    with pytest.raises(Exception, match="apply to zoo models only"):
        build_model("hf:qwen2", seq_len=32)


@pytest.mark.dist
@pytest.mark.slow
def test_interleaved_pipeline_under_zero3_on_meta_from_a_state_dict(tmp_path):
    torch.manual_seed(1)
    eager, _ = build_model(LLAMA, device="cpu")
    path = str(tmp_path / "llama.pt")
    torch.save(eager.state_dict(), path)
    ref_losses, ref_params = _reference(eager)
    plan = {
        "pp": 2,
        "dp": 2,
        "microbatch_size": 1,
        "num_microbatches": 4,
        "schedule": "interleaved",
        "virtual_stages": 2,
        "zero": 3,
    }
    for r in _run(LLAMA, plan, path):  # two chunks per rank, each materialised and loaded
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) < TOL
        for name, p in r["params"].items():
            torch.testing.assert_close(p, ref_params[name], rtol=0, atol=TOL)


@pytest.mark.dist
@pytest.mark.slow
def test_zoo_moe_ep2_zero1_on_meta_from_a_state_dict(tmp_path):
    spec = "moe:hidden=32,layers=2,heads=4,seq=16,vocab=64,experts=4"
    torch.manual_seed(1)
    eager, _ = build_model(spec, device="cpu")
    path = str(tmp_path / "moe.pt")
    torch.save(eager.state_dict(), path)
    ref_losses, _ = _reference(eager)
    for r in _run(spec, {"dp": 4, "ep": 2, "zero": 1, "microbatch_size": 2}, path):  # experts kept by index
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) < TOL
