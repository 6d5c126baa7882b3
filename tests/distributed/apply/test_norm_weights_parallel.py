"""plan.norm_kernel=memory-efficient with ``weights=`` on 2 gloo ranks (nest_fx/apply/norm_weights.py):
a safetensors file with a zero entry in a norm weight is refused on both ranks with the same
error naming the module and the file, before any collective (no rank waits in one: the launch has
a timeout), also under a pipeline where only the last stage holds that norm; the same file
without the zero, read by a model built on meta, trains to the single-device run of the seeded
model (the parity harness: losses, gradients, parameters to fp32 tolerance); a checkpoint holding
a zero in a norm held by one pipeline stage is refused on both ranks at the load."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.output_saving_norm import ZeroNormWeightError
from nest_fx.models import build_model, build_seeded
from nest_fx.plan import uniform_plan
from norm_helpers import NormCalls
from parity_helpers import LLAMA, run

pytestmark = pytest.mark.dist
ME = {"norm_kernel": "memory-efficient"}
BLOCKS = 6  # the parity Llama's 4 layers, its embedding and its head


def _write(tmp_path, zero_norm=None) -> str:
    """The parity Llama as ``build_seeded`` draws it (seed 0), as safetensors; ``zero_norm``'s weight
    zero at entries 2 and 40."""
    model, _ = build_seeded(LLAMA)
    if zero_norm:
        with torch.no_grad():
            model.get_submodule(zero_norm).weight[[2, 40]] = 0.0
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path


def _refusal(path: str, plan_kwargs: dict) -> str:
    """What ``auto_parallelize`` raised on this rank, with every collective forbidden."""
    import torch.distributed as dist

    from nest_fx.apply import auto_parallelize
    from nest_fx.apply import prepare

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective was reached")

    prepare.agree = no_collective  # this process only: the launch spawns it
    dist.all_gather_object = dist.barrier = no_collective
    model, _ = build_model(LLAMA, device="meta")
    tokens = torch.zeros(8, 32, dtype=torch.long)
    try:
        auto_parallelize(
            model, tokens, global_batch_size=8, loss_fn=lm_loss, plan=uniform_plan(BLOCKS, **plan_kwargs), weights=path
        )
    except ZeroNormWeightError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize(
    "norm, plan",
    [
        ("norm", {"pp": 2, "num_microbatches": 2, "microbatch_size": 4, **ME}),  # held by the last stage only
        ("layers.1.attn_norm", {"dp": 2, "zero": 3, "microbatch_size": 4, **ME}),  # sharded by FSDP after
    ],
    ids=["pp2-final-norm", "zero3-block-norm"],
)
def test_every_rank_refuses_a_zero_norm_entry_in_weights_before_any_collective(tmp_path, norm, plan):
    path = _write(tmp_path, zero_norm=norm)
    messages = launch(_refusal, 2, path, plan, timeout=120)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith(f"{norm}: norm_kernel=memory-efficient recovers the norm's input"), messages[0]
    assert f"in weights={path} (tensor {norm}.weight of model.safetensors) has zero entries (2 of 64)" in messages[0]


def _counted(spec):
    from nest_fx.testing import equivalence

    calls = NormCalls()
    with calls:
        out = equivalence(spec)
    out["output_saving_calls"] = calls.output_saving
    return out


def test_clean_weights_on_meta_keep_parity_under_zero3(tmp_path):
    """FSDP shards the norm weights read from the file; the 9 norms (4 blocks x 2 + the final one)
    run as output-saving norms in each of the 3 steps on both ranks."""
    results = run(2, LLAMA, {"dp": 2, "zero": 3, "microbatch_size": 4, **ME}, fn=_counted, weights=_write(tmp_path))
    assert all(r["output_saving_calls"] == 9 * 3 for r in results), [r["output_saving_calls"] for r in results]


def _load_refusal(ckpt: str) -> str:
    """A PP2 run (no step taken) whose last stage sets 2 entries of the final norm's weight to 0 and
    saves; then every rank loads that checkpoint: what each raised."""
    from nest_fx.apply import auto_parallelize

    plan = uniform_plan(BLOCKS, pp=2, num_microbatches=2, microbatch_size=4, **ME)
    tokens = torch.zeros(8, 32, dtype=torch.long)
    model, _ = build_seeded(LLAMA)
    pm = auto_parallelize(model, tokens, global_batch_size=8, loss_fn=lm_loss, plan=plan, verbose=False)
    params = dict(pm.named_parameters())
    if "norm.weight" in params:  # the last stage only
        with torch.no_grad():
            params["norm.weight"][[2, 40]] = 0.0
    step_dir = pm.save(ckpt)
    try:
        pm.load(ckpt)
    except ZeroNormWeightError as exc:
        return f"{step_dir}|{exc}"
    return "accepted"


def test_every_rank_refuses_a_zero_norm_entry_loaded_from_a_checkpoint(tmp_path):
    """Only the last stage holds the final norm; both ranks raise after the load (one all-gather)."""
    out = launch(_load_refusal, 2, str(tmp_path / "ckpt"), timeout=120)
    step_dir = out[0].split("|")[0]
    messages = [o.split("|", 1)[1] for o in out]
    own = (
        "norm: norm_kernel=memory-efficient recovers the norm's input from its output divided by the "
        f"weight, and the weight loaded from {step_dir} has zero entries (2 of 64)"
    )
    assert messages[1].startswith(own), messages
    assert messages[0].startswith(f"rank 1 failed: ZeroNormWeightError: {own}"), messages
