"""Which checkpoint a load takes (docs/runtime.md, "Which checkpoint"): never another step than the
newest one by itself. A damaged or incomplete newest step directory is refused naming it and the
newest complete one; ``fallback=True`` and ``resume`` take that one and say so on every rank."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import pytest
import torch

from nest_fx.apply.checkpoint import (
    CheckpointDamaged,
    CheckpointError,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from nest_fx.apply.distributed import init_distributed
from nest_fx.apply.launch import launch
from nest_fx.models import build_seeded

MODEL = "llama:hidden=32,layers=2,heads=4,seq=16,vocab=64"


def _model(shift: float = 0.0):
    model, _ = build_seeded(MODEL, seed=0)
    with torch.no_grad():
        next(model.parameters()).add_(shift)
    return model


def _three_steps(path: str):
    """Steps 1, 2, 3 of a model whose first parameter is shifted by the step."""
    for step in (1, 2, 3):
        save_checkpoint(_model(float(step)), path, step=step, keep=None)
    return os.path.join(path, "step-00000002"), os.path.join(path, "step-00000003")


def _loaded_step(path: str, **kwargs):
    """(step loaded, the shift of the first parameter, what went to stderr)."""
    model = _model()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        meta = load_checkpoint(model, path, **kwargs)
    shift = float(next(model.parameters()).detach().flatten()[0] - next(_model().parameters()).detach().flatten()[0])
    return meta["step"], round(shift), err.getvalue()


def test_a_newest_step_without_its_manifest_is_refused_naming_the_newest_complete_one(tmp_path):
    path = str(tmp_path / "ck")
    two, three = _three_steps(path)
    os.remove(os.path.join(three, "MANIFEST.json"))
    with pytest.raises(
        CheckpointDamaged,
        match=f"its newest checkpoint {three} cannot be loaded \\({three} is not a "
        f"complete nest-fx checkpoint \\(no MANIFEST.json.*the newest complete "
        f"checkpoint is {two}; fix: load it on purpose.*fallback=True",
    ):
        load_checkpoint(_model(), path)
    # on purpose: the older step directory by name, or fallback=True, which says so in one line
    assert _loaded_step(two)[:2] == (2, 2)
    step, shift, said = _loaded_step(path, fallback=True)
    assert (step, shift) == (2, 2)
    assert said.count("\n") == 1 and said.startswith(f"nest-fx rank 0: not loading {three} (")
    assert said.rstrip().endswith(f"loading {two}, the newest complete checkpoint before it")
    # a step directory named without its manifest is not taken for a checkpoint of the old format
    with pytest.raises(CheckpointDamaged, match="no MANIFEST.json"):
        load_checkpoint(_model(), three)


def test_a_damaged_shard_or_a_lost_latest_target_is_refused_too(tmp_path):
    path = str(tmp_path / "ck")
    two, three = _three_steps(path)
    shard = os.path.join(three, "__0_0.distcp")
    with open(shard, "r+b") as fh:
        fh.seek(100)
        fh.write(b"garbage")
    with pytest.raises(
        CheckpointDamaged, match=f"{shard} is damaged: its sha256 differs.*newest complete checkpoint is {two}"
    ):
        load_checkpoint(_model(), path)
    assert _loaded_step(path, fallback=True)[:2] == (2, 2)
    # the directory `latest` names is gone
    shutil.rmtree(three)
    with pytest.raises(
        CheckpointDamaged, match=f"{three} is missing \\(named by .*latest\\).*newest complete checkpoint is {two}"
    ):
        load_checkpoint(_model(), path)


def test_without_latest_a_damaged_step_saved_later_is_still_the_newest(tmp_path):
    path = str(tmp_path / "ck")
    two, three = _three_steps(path)
    os.remove(os.path.join(path, "latest"))
    os.remove(os.path.join(three, "MANIFEST.json"))  # its metadata still says sequence 3
    with pytest.raises(CheckpointDamaged, match=f"newest checkpoint {three} cannot be loaded.*is {two}"):
        load_checkpoint(_model(), path)
    # a damaged step saved before the newest complete one does not stand in the way
    os.remove(os.path.join(path, "step-00000001", "MANIFEST.json"))
    shutil.rmtree(three)
    assert _loaded_step(path)[:2] == (2, 2)


def test_resume_falls_back_and_the_next_save_replaces_the_damaged_step(tmp_path):
    path = str(tmp_path / "ck")
    two, three = _three_steps(path)
    os.remove(os.path.join(three, "MANIFEST.json"))
    model, err = _model(), io.StringIO()
    with contextlib.redirect_stderr(err):
        assert resume_checkpoint(model, path)["step"] == 2
    assert f"not loading {three}" in err.getvalue()
    save_checkpoint(model, path, step=3, keep=None)  # training goes on from step 2 and saves step 3 again
    assert _loaded_step(path) == (3, 2, "")


def test_resume_refuses_a_directory_whose_only_step_is_damaged(tmp_path):
    """Starting afresh next to a damaged checkpoint would silently throw the training away."""
    path = str(tmp_path / "ck")
    save_checkpoint(_model(1.0), path, step=1)
    os.remove(os.path.join(path, "step-00000001", "MANIFEST.json"))
    with pytest.raises(
        CheckpointDamaged,
        match="no MANIFEST.json.*holds no complete checkpoint before step-00000001; "
        "fix: restore the files, or remove that step directory",
    ):
        resume_checkpoint(_model(), path)


def _damaged_newest(path: str, fallback: bool) -> dict:
    init_distributed(timeout_s=60)
    model = _model()
    save_checkpoint(model, path, step=1)
    save_checkpoint(model, path, step=2)
    torch.distributed.barrier()
    rank = torch.distributed.get_rank()
    if rank == 0:  # rank 1 hashes the second shard: only it sees the damage
        manifest = json.load(open(os.path.join(path, "step-00000002", "MANIFEST.json")))
        shard = sorted(n for n in manifest["files"] if n.endswith(".distcp"))[1]
        with open(os.path.join(path, "step-00000002", shard), "r+b") as fh:
            fh.seek(10)
            fh.write(b"garbage")
    torch.distributed.barrier()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            step = load_checkpoint(model, path, fallback=fallback)["step"]
        return {"step": step, "said": err.getvalue()}
    except CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}"}


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_every_rank_refuses_or_falls_back_alike(tmp_path):
    refused = launch(_damaged_newest, 2, str(tmp_path / "a"), False, timeout=120)
    assert refused[0] == refused[1] and refused[0]["error"].startswith(
        f"CheckpointDamaged: {tmp_path / 'a'}: its newest checkpoint"
    )
    assert "sha256 differs" in refused[0]["error"] and "step-00000001" in refused[0]["error"]
    taken = launch(_damaged_newest, 2, str(tmp_path / "b"), True, timeout=120)
    assert [r["step"] for r in taken] == [1, 1]
    for rank, result in enumerate(taken):
        assert result["said"].count("\n") == 1 and result["said"].startswith(f"nest-fx rank {rank}: not loading ")
