"""Box reads of safetensors files straight into tensors (nest_fx/apply/safetensors_read.py)."""

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nest_fx.apply import safetensors_read
from nest_fx.apply.checks import ApplyError
from nest_fx.apply.safetensors_read import box_runs
from nest_fx.apply.weights_in import open_weights


@pytest.fixture
def weights(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(37, 11, 5, generator=gen),
        "b": torch.randn(13, generator=gen).to(torch.bfloat16),
        "s": torch.tensor(3.5),
        "i": torch.arange(24, dtype=torch.int64).reshape(4, 6),
    }
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    return path, tensors


def test_box_runs_cover_exactly_the_box_in_row_major_order():
    shape, offsets, sizes = (4, 6, 3), (1, 2, 0), (2, 3, 3)
    run, starts = box_runs(shape, offsets, sizes)
    flat = torch.arange(4 * 6 * 3).reshape(shape)
    got = torch.cat([torch.arange(s, s + run) for s in starts])
    want = flat[1:3, 2:5, 0:3].reshape(-1)
    assert run == 9 and torch.equal(got, want)
    run, starts = box_runs(shape, (0, 0, 0), shape)
    assert run == 72 and list(starts) == [0]


@pytest.mark.parametrize(
    "box",
    [
        ((0, 0, 0), (37, 11, 5)),
        ((3, 0, 0), (20, 11, 5)),
        ((0, 4, 0), (37, 3, 5)),
        ((5, 1, 2), (7, 9, 2)),
        ((36, 10, 4), (1, 1, 1)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_read_into_equals_a_safe_open_slice_converted(weights, box, dtype, monkeypatch):
    monkeypatch.setattr(safetensors_read, "STAGING_BYTES", 200)  # several pieces per box
    path, _ = weights
    offsets, sizes = box
    reader = open_weights(path)
    with safe_open(path, "pt") as fh:
        want = fh.get_slice("w")[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].to(dtype)
    out = torch.full(sizes, float("nan"), dtype=dtype)
    reader.read_into("w", offsets, sizes, out)
    assert torch.equal(out, want)
    assert reader.bytes_read == want.numel() * 4
    # a non-contiguous destination (a column slice of a bigger tensor) is filled in place
    bigger = torch.zeros(sizes[0], sizes[1] + 3, sizes[2], dtype=dtype)
    reader.read_into("w", offsets, sizes, bigger[:, 2 : 2 + sizes[1]])
    assert (
        torch.equal(bigger[:, 2 : 2 + sizes[1]], want)
        and not bigger[:, :2].any()
        and not bigger[:, 2 + sizes[1] :].any()
    )


def test_read_whole_tensors_of_every_kind(weights):
    path, tensors = weights
    reader = open_weights(path)
    for name, t in tensors.items():
        got = reader.read(name, [0] * t.dim(), list(t.shape))
        assert got.dtype == t.dtype and torch.equal(got, t), name
    assert reader.specs()["b"] == ((13,), torch.bfloat16)
    reader.close()
    assert torch.equal(reader.read("i", [1, 2], [2, 3]), tensors["i"][1:3, 2:5])  # reopens after close


def test_a_box_outside_the_tensor_is_refused(weights):
    reader = open_weights(weights[0])
    with pytest.raises(ValueError, match="box"):
        reader.read_into("w", [30, 0, 0], [8, 11, 5], torch.empty(8, 11, 5))


def test_a_truncated_file_is_an_apply_error(weights, tmp_path):
    path, _ = weights
    data = open(path, "rb").read()
    bad = str(tmp_path / "bad.safetensors")
    with open(bad, "wb") as fh:
        fh.write(data[:-40])
    with pytest.raises(ApplyError, match="not a readable safetensors file"):
        open_weights(bad)
    assert os.path.exists(bad)


def test_materialize_reads_into_bf16_parameters_without_mapping_the_file(tmp_path, monkeypatch):
    """A meta model whose parameters are bf16 (``bf16-true``), filled from an fp32 safetensors
    file: the values are the file's converted, read straight into the parameters (the reader
    never calls safe_open, which would map the file), and only the file's bytes are read."""
    import copy

    import safetensors

    from nest_fx.apply.materialize import materialize, prepare_weights
    from nest_fx.apply.precision import prepare_parameters
    from nest_fx.models import build_model

    spec = "llama:hidden=32,layers=2,heads=4,kv=2,seq=16,vocab=64"
    source, _ = build_model(spec, device="cpu")
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, path)
    model, _ = build_model(spec, device="meta")
    skeleton = copy.deepcopy(model)
    loaded = prepare_weights(path, model)
    prepare_parameters([model], "bf16-true")

    def no_mapping(*args, **kwargs):
        raise AssertionError("safe_open maps the file")

    monkeypatch.setattr(safetensors, "safe_open", no_mapping)
    counts = materialize([model], skeleton, torch.device("cpu"), loaded)
    want = source.state_dict()
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), want[name].to(torch.bfloat16)), name
    assert counts["bytes_read"] == sum(t.numel() * 4 for t in want.values() if t.is_floating_point())
