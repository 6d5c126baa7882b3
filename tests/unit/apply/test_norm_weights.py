"""plan.norm_kernel=memory-efficient: the weights the output-saving norms start from are refused
with zero entries before the first collective wherever they come from (nest_fx/apply/norm_weights.py):
a ``weights=`` file (read in ``prepare``, the file's values winning over the model's), the
initialisation of a model started on meta (the values ``materialize`` then writes), and a nest-fx
checkpoint (checked after the load). Clean weights train to the loss of the model they came from."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file

from nest_fx.apply import auto_parallelize, prepare
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.materialize import initial_value
from nest_fx.apply.output_saving_norm import ZeroNormWeightError
from nest_fx.models import build_model, build_seeded
from nest_fx.models.layers import RMSNorm
from nest_fx.plan import uniform_plan
from norm_helpers import LLAMA, NormCalls

ME = "memory-efficient"
NORM = "layers.1.mlp_norm"  # a block norm of the tiny Llama (hidden 64)
TOKENS = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))


def _plan(norm_kernel: str = ME):
    return uniform_plan(4, norm_kernel=norm_kernel)


def _no_collective(*args, **kwargs):
    raise AssertionError("the first collective was reached")


def _safetensors(tmp_path, zero_at=(), name="model.safetensors"):
    """The seeded tiny Llama and its state dict written as safetensors, ``NORM``'s weight zero at ``zero_at``."""
    model, _ = build_seeded(LLAMA)
    with torch.no_grad():
        model.get_submodule(NORM).weight[list(zero_at)] = 0.0
    path = str(tmp_path / name)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return model, path


def _refused(model, monkeypatch, **kwargs) -> str:
    """The ZeroNormWeightError ``auto_parallelize`` raises, with the first collective forbidden."""
    monkeypatch.setattr(prepare, "agree", _no_collective)
    with pytest.raises(ZeroNormWeightError) as err:
        auto_parallelize(model, TOKENS, global_batch_size=2, loss_fn=lm_loss, plan=_plan(), verbose=False, **kwargs)
    monkeypatch.undo()
    assert not any("_nest_fx_model_forward" in m.__dict__ for m in model.modules())  # nothing swapped
    return str(err.value)


def _trains_like(pm, reference) -> None:
    calls = NormCalls()
    with calls:
        loss = pm.train_step(TOKENS, TOKENS)
    assert calls.output_saving == 5 * pm.num_microbatches  # 2 blocks x 2 norms + the final norm
    torch.testing.assert_close(torch.as_tensor(float(loss)), lm_loss(reference(TOKENS), TOKENS).detach())


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_zero_norm_entry_in_weights_is_refused_before_the_first_collective(
    single_rank, monkeypatch, tmp_path, device
):
    _, path = _safetensors(tmp_path, zero_at=(5, 9))
    model, _ = build_model(LLAMA, device=device)  # on the CPU its own norms are ones: the file's values count
    text = _refused(model, monkeypatch, weights=path)
    assert "\n" not in text
    assert text.startswith(f"{NORM}: norm_kernel=memory-efficient recovers the norm's input")
    assert f"the weight in weights={path} (tensor {NORM}.weight of model.safetensors)" in text
    assert text.endswith("has zero entries (2 of 64); fix: norm_kernel '' (fused)")


def test_the_files_values_are_checked_not_the_models(single_rank, tmp_path):
    """A model with values whose own norm has a zero trains from a file without one (the file's
    values are the ones trained); under the fused norm a zero in the file is no problem."""
    reference, path = _safetensors(tmp_path)
    model, _ = build_model(LLAMA, device="cpu")
    with torch.no_grad():
        model.get_submodule(NORM).weight[0] = 0.0
    pm = auto_parallelize(
        model, TOKENS, global_batch_size=2, loss_fn=lm_loss, plan=_plan(), weights=path, verbose=False
    )
    _trains_like(pm, reference)


def test_fused_norms_take_a_file_with_zero_norm_entries(single_rank, tmp_path):
    reference, path = _safetensors(tmp_path, zero_at=(1,))
    model, _ = build_model(LLAMA, device="meta")
    pm = auto_parallelize(model, TOKENS, global_batch_size=2, loss_fn=lm_loss, plan=_plan("fused"), weights=path)
    loss = pm.train_step(TOKENS, TOKENS)
    torch.testing.assert_close(torch.as_tensor(float(loss)), lm_loss(reference(TOKENS), TOKENS).detach())


def test_clean_weights_on_meta_train_to_the_loss_of_the_model_saved(single_rank, tmp_path):
    reference, path = _safetensors(tmp_path)
    model, _ = build_model(LLAMA, device="meta")
    pm = auto_parallelize(
        model, TOKENS, global_batch_size=2, loss_fn=lm_loss, plan=_plan(), weights=path, verbose=False
    )
    assert pm.materialized["read"] == len(reference.state_dict())
    _trains_like(pm, reference)


class _ZeroStartNorm(RMSNorm):
    """An RMSNorm whose initialisation leaves one entry at 0."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0)
        self.weight[3] = 0.0


class _DrawnNorm(RMSNorm):
    """An RMSNorm initialised at random from the generator it is given: ``low`` 0 draws integers
    in [0, 3) (zero entries), else uniform in [0.5, 1.5)."""

    low = 0.5

    @torch.no_grad()
    def reset_parameters(self) -> None:
        drawn = torch.randint(0, 3, self.weight.shape) if self.low == 0 else torch.rand(self.weight.shape) + self.low
        self.weight.copy_(drawn)


def _on_meta_with(norm_cls):
    model, _ = build_model(LLAMA, device="meta")
    with torch.device("meta"):
        model.get_submodule("layers.1").mlp_norm = norm_cls(64)
    return model


def test_a_meta_start_whose_initialisation_gives_a_zero_is_refused_before_the_first_collective(
    single_rank, monkeypatch
):
    text = _refused(_on_meta_with(_ZeroStartNorm), monkeypatch)
    assert text.startswith(f"{NORM}: norm_kernel=memory-efficient")
    assert "the weight the model's initialisation gives (started on meta, init_seed=0) has zero entries (1 of 64)" in (
        text
    )


def test_the_values_checked_are_the_values_a_meta_start_trains_from(single_rank, monkeypatch):
    """``initial_value`` (what ``prepare`` checks) draws what ``materialize`` writes, for a random
    initialisation too; a random one that gives zeros is refused; the other trains."""

    class _Zeros(_DrawnNorm):
        low = 0

    _refused(_on_meta_with(_Zeros), monkeypatch, init_seed=3)
    model = _on_meta_with(_DrawnNorm)
    skeleton = copy.deepcopy(model)
    checked = initial_value(skeleton, f"{NORM}.weight", torch.device("cpu"), 3)
    assert torch.all(checked >= 0.5) and torch.unique(checked).numel() > 32  # drawn, not a constant
    pm = auto_parallelize(model, TOKENS, global_batch_size=2, loss_fn=lm_loss, plan=_plan(), init_seed=3, verbose=False)
    assert torch.equal(dict(pm.named_parameters())[f"{NORM}.weight"].detach(), checked)
    calls = NormCalls()
    with calls:
        pm.train_step(TOKENS, TOKENS)
    assert calls.output_saving == 5 * pm.num_microbatches


def test_a_zero_norm_entry_loaded_from_a_checkpoint_is_refused_on_load(single_rank, tmp_path):
    """Saved (a zero is finite), then loaded by ``load`` and as ``weights=``: refused after the load."""
    model, _ = build_seeded(LLAMA)
    pm = auto_parallelize(model, TOKENS, global_batch_size=2, loss_fn=lm_loss, plan=_plan(), verbose=False)
    with torch.no_grad():
        dict(pm.named_parameters())[f"{NORM}.weight"][[0, 1, 2]] = 0.0
    ckpt = str(tmp_path / "ckpt")
    step_dir = pm.save(ckpt)
    fresh, _ = build_seeded(LLAMA)
    fresh_pm = auto_parallelize(fresh, TOKENS, global_batch_size=2, loss_fn=lm_loss, plan=_plan(), verbose=False)
    with pytest.raises(ZeroNormWeightError) as err:
        fresh_pm.load(ckpt)
    text = str(err.value)
    assert text.startswith(f"{NORM}: norm_kernel=memory-efficient")
    assert f"the weight loaded from {step_dir} has zero entries (3 of 64)" in text
    meta_model, _ = build_model(LLAMA, device="meta")
    with pytest.raises(ZeroNormWeightError, match=f"^{NORM}: .* loaded from {step_dir} has zero entries"):
        auto_parallelize(meta_model, TOKENS, global_batch_size=2, loss_fn=lm_loss, plan=_plan(), weights=ckpt)
    fused, _ = build_seeded(LLAMA)  # the fused norm keeps its input: the same checkpoint loads
    fused_pm = auto_parallelize(fused, TOKENS, global_batch_size=2, loss_fn=lm_loss, plan=_plan("fused"))
    assert fused_pm.load(ckpt)["directory"] == step_dir
