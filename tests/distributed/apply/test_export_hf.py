"""Export to the HuggingFace format (nest_fx/apply/export_hf.py, hf_format.py).

Each cell trains a tiny HF model (built from its config, no download) one SGD step under a plan
on 4 gloo ranks, exports it with ``pm.save_pretrained`` in several shards and saves a nest-fx
checkpoint. Then, in the test process: ``transformers`` ``from_pretrained(DIR)`` must hold
exactly (bit for bit) the parameters the parallel model holds, give the parallel model's loss on
a new batch (1e-5, fp32), and equal the single-device run of the same step (1e-5); the files
hold the tensors, names and config ``transformers``' own ``save_pretrained`` writes for that
model; ``nest-fx export CKPT --to hf`` writes the same tensors from the checkpoint.
Then the destination rules (refusals) and the single-process export from a checkpoint.
"""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

from nest_fx.apply.checkpoint import save_checkpoint
from nest_fx.apply.export_hf import export_checkpoint
from nest_fx.apply.hf_format import INDEX_NAME, ExportError, parse_size
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.cli import main
from nest_fx.models import build_seeded
from nest_fx.testing import disable_dropout

pytestmark = [pytest.mark.hf]
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

BATCH, SEQ, VOCAB, LR, TOL = 8, 16, 128, 0.5, 1e-5
SHARD = "40KB"  # several files for every tiny model
LAUNCH_S = 240
MODELS = {"llama": "hf:llama", "qwen2": "hf:qwen2:tie_word_embeddings=true", "mixtral": "hf:mixtral", "gpt2": "hf:gpt2"}
PLANS = {
    "TP2xDP2": {"tp": 2, "dp": 2, "microbatch_size": 4},
    "PP2xDP2": {"pp": 2, "dp": 2, "microbatch_size": 2, "num_microbatches": 2},
    "ZeRO3-DP4": {"dp": 4, "zero": 3, "microbatch_size": 2},
    "EP2xDP4": {"dp": 4, "ep": 2, "microbatch_size": 2},
    "CP2xDP2": {"cp": 2, "dp": 2, "microbatch_size": 4},
    "HSDP-2x2": {"dp": 4, "zero": 3, "dp_shard": 2, "microbatch_size": 2},
}


def _data(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))


def _portable(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _train_and_export(spec: dict) -> bytes:
    """One rank: train one step under the plan, export, checkpoint, then the loss on a new batch."""
    from nest_fx.apply import auto_parallelize
    from nest_fx.plan import uniform_plan

    model, _ = build_seeded(spec["model"], seed=3)
    disable_dropout(model)  # random masks are not part of what a plan must reproduce
    x, y = _data(0)
    plan = uniform_plan(4, model=spec["model"], **spec["plan"])
    pm = auto_parallelize(model, {"input_ids": x}, global_batch_size=BATCH, loss_fn=lm_loss, plan=plan, verbose=False)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    pm.train_step({"input_ids": x}, y)
    opt.step()
    opt.zero_grad()
    pm.save_pretrained(spec["hf"], max_shard_size=SHARD)
    pm.save(spec["ckpt"])
    params = pm.full_tensors()
    x2, y2 = _data(1)
    loss = float(pm.train_step({"input_ids": x2}, y2))
    return _portable({"params": params, "loss": loss})


def _files(directory: str) -> dict:
    """{name: tensor} of every safetensors file in ``directory``."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(safetensors_torch.load_file(os.path.join(directory, name)))
    return out


def _reference(spec: str):
    """The single-device run of the same step."""
    model, _ = build_seeded(spec, seed=3)
    disable_dropout(model)
    x, y = _data(0)
    lm_loss(model(input_ids=x).logits, y).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return model


def _check_cell(tmp_path, family: str, plan: str) -> None:
    spec = MODELS[family]
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    results = [
        torch.load(io.BytesIO(r))
        for r in launch(
            _train_and_export, 4, {"model": spec, "plan": PLANS[plan], "hf": hf_dir, "ckpt": ckpt}, timeout=LAUNCH_S
        )
    ]
    trained = {}
    for r in results:
        trained.update(r["params"])

    # the directory: several shards, their index, the config; nothing else left behind
    names = sorted(os.listdir(hf_dir))
    assert INDEX_NAME in names and "config.json" in names, names
    assert sum(n.endswith(".safetensors") for n in names) > 1
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".hf")], os.listdir(tmp_path)

    # from_pretrained holds exactly the trained parameters and gives the parallel model's loss
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    got = dict(loaded.named_parameters())
    assert sorted(got) == sorted(trained)
    bad = [n for n in trained if not torch.equal(got[n].detach(), trained[n])]
    assert not bad, f"not bit-identical after the round trip: {bad[:4]}"
    x2, y2 = _data(1)
    with torch.no_grad():
        loss = float(lm_loss(loaded(input_ids=x2).logits, y2))
    assert all(abs(r["loss"] - loss) <= TOL for r in results), ([r["loss"] for r in results], loss)

    # ... which is the single-device run of the same step
    reference = _reference(spec)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name].detach(), p.detach(), rtol=0, atol=TOL)

    # the files hold what transformers' own save_pretrained writes for that model (names, tensors)
    ref_dir = str(tmp_path / "reference")
    loaded.save_pretrained(ref_dir, max_shard_size=SHARD)
    ours, theirs = _files(hf_dir), _files(ref_dir)
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    with open(os.path.join(hf_dir, INDEX_NAME)) as fh:
        index = json.load(fh)
    assert set(index["weight_map"]) == set(ours)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.values())

    # the command line writes the same tensors from the checkpoint (model spec from the plan it recorded)
    cli_dir = str(tmp_path / "from-ckpt")
    assert main(["export", ckpt, "--to", "hf", cli_dir, "--max-shard-size", SHARD]) == 0
    from_ckpt = _files(cli_dir)
    assert sorted(from_ckpt) == sorted(ours) and all(torch.equal(from_ckpt[k], ours[k]) for k in ours)


@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S + 60)
def test_tied_qwen2_under_pp2_dp2_exports_what_from_pretrained_loads(tmp_path):
    """Tied embeddings held by the first and the last stage: written once, under HF's name."""
    _check_cell(tmp_path, "qwen2", "PP2xDP2")


SLOW_CELLS = [
    ("llama", "TP2xDP2"),
    ("qwen2", "TP2xDP2"),
    ("gpt2", "TP2xDP2"),
    ("llama", "PP2xDP2"),
    ("gpt2", "PP2xDP2"),
    ("llama", "ZeRO3-DP4"),
    ("qwen2", "ZeRO3-DP4"),
    ("mixtral", "EP2xDP4"),
    ("mixtral", "ZeRO3-DP4"),
    ("llama", "CP2xDP2"),
    ("llama", "HSDP-2x2"),
]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 60)
@pytest.mark.parametrize("family,plan", SLOW_CELLS, ids=[f"{f}-{p}" for f, p in SLOW_CELLS])
def test_export_under_plan(tmp_path, family, plan):
    _check_cell(tmp_path, family, plan)


# -- single process: from a checkpoint, the destination rules ---------------------------------------


def _checkpointed(tmp_path, spec: str = MODELS["mixtral"]):
    model, _ = build_seeded(spec, seed=1)
    path = save_checkpoint(model, str(tmp_path / "ckpt"), step=1)
    return model, path


def test_export_from_a_checkpoint_loads_exactly_with_hf_names(tmp_path):
    """Mixtral's stacked experts go out as HF saves them (block_sparse_moe.experts.<e>.w1/w2/w3)."""
    model, path = _checkpointed(tmp_path)
    out = export_checkpoint(path, str(tmp_path / "hf"), model, max_shard_size=SHARD)
    names = set(_files(out))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert not [n for n in names if "gate_up_proj" in n]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    own = dict(model.named_parameters())
    assert sorted(dict(loaded.named_parameters())) == sorted(own)
    assert all(torch.equal(p.detach(), own[n].detach()) for n, p in loaded.named_parameters())


def test_a_single_file_has_no_index_and_dtype_converts(tmp_path):
    model, path = _checkpointed(tmp_path, MODELS["llama"])
    out = export_checkpoint(path, str(tmp_path / "hf"), model, dtype=torch.bfloat16)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    tensors = _files(out)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    own = dict(model.named_parameters())
    assert all(torch.equal(t, own[n].detach().to(torch.bfloat16)) for n, t in tensors.items())
    with open(os.path.join(out, "config.json")) as fh:
        config = json.load(fh)
    assert config["dtype"] == "bfloat16"
    assert config["use_cache"] is True and model.config.use_cache is False  # turned off for training only


def test_a_non_empty_directory_is_refused_and_kept(tmp_path):
    model, path = _checkpointed(tmp_path, MODELS["llama"])
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="non-empty directory.*overwrite"):
        export_checkpoint(path, str(target), model)
    assert os.listdir(target) == ["notes.txt"] and (target / "notes.txt").read_text() == "keep me"
    assert not [n for n in os.listdir(tmp_path) if ".tmp-export-" in n]
    # overwrite=True replaces it as a whole, by one rename
    export_checkpoint(path, str(target), model, overwrite=True)
    assert "notes.txt" not in os.listdir(target) and "model.safetensors" in os.listdir(target)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".mine")]
    # an empty directory is used as it is
    empty = tmp_path / "empty"
    empty.mkdir()
    export_checkpoint(path, str(empty), model)
    assert "model.safetensors" in os.listdir(empty)


def test_a_failed_export_leaves_the_destination_as_it_was(tmp_path, monkeypatch):
    import nest_fx.apply.export_hf as export_hf

    model, path = _checkpointed(tmp_path, MODELS["llama"])

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_hf, "write_config", full_disk)
    with pytest.raises(OSError):
        export_checkpoint(path, str(tmp_path / "hf"), model, max_shard_size=SHARD)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_bad_arguments_are_refused(tmp_path):
    model, path = _checkpointed(tmp_path, MODELS["llama"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        export_checkpoint(path, str(tmp_path / "file"), model)
    with pytest.raises(ExportError, match="max_shard_size"):
        export_checkpoint(path, str(tmp_path / "a"), model, max_shard_size="five gigs")
    other, _ = build_seeded("hf:llama:num_hidden_layers=3", seed=1)
    with pytest.raises(ExportError, match="another model"):
        export_checkpoint(path, str(tmp_path / "b"), other)
    assert (parse_size("5GB"), parse_size("2MiB"), parse_size(123)) == (5 * 10**9, 2 << 20, 123)


def test_cli_needs_a_model_spec_when_the_checkpoint_has_none(tmp_path, capsys):
    _, path = _checkpointed(tmp_path, MODELS["llama"])
    assert main(["export", path, "--to", "hf", str(tmp_path / "hf")]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["export", path, "--to", "hf", str(tmp_path / "hf"), "--model", MODELS["llama"]]) == 0
    assert "model.safetensors" in os.listdir(tmp_path / "hf")
    assert main(["export", path, "--to", "hf", str(tmp_path / "hf"), "--model", MODELS["llama"]]) == 2
    assert "non-empty" in capsys.readouterr().err


def _load_exported(spec: dict) -> bytes:
    """One rank: build on meta, start from the exported directory (weights=), the full tensors."""
    from nest_fx.apply import auto_parallelize
    from nest_fx.models import build_model
    from nest_fx.plan import uniform_plan

    model, _ = build_model(spec["model"], device="meta")
    x, _ = _data(0)
    pm = auto_parallelize(
        model,
        {"input_ids": x},
        global_batch_size=BATCH,
        loss_fn=lm_loss,
        verbose=False,
        plan=uniform_plan(4, **spec["plan"]),
        weights=spec["weights"],
    )
    return _portable(pm.full_tensors())


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 60)
def test_an_export_starts_a_run_on_meta_exactly(tmp_path):
    """Mixtral exported under HF's per-expert names comes back into stacked experts sharded by EP."""
    model, path = _checkpointed(tmp_path)
    out = export_checkpoint(path, str(tmp_path / "hf"), model, max_shard_size=SHARD)
    results = launch(
        _load_exported, 4, {"model": MODELS["mixtral"], "weights": out, "plan": PLANS["EP2xDP4"]}, timeout=LAUNCH_S
    )
    own = {n: p.detach() for n, p in model.named_parameters()}
    for r in results:
        got = torch.load(io.BytesIO(r))
        assert sorted(got) == sorted(own)
        assert all(torch.equal(got[n], own[n]) for n in own)
