"""Falcon's default multi-query layout under tensor parallelism, across processes (gloo, 4 ranks).

HF Falcon with ``multi_query=True`` fuses the query heads and ONE shared key and value head in
``query_key_value`` (graph/tp_multi_query.py): the query rows are sharded by heads, the shared rows
kept whole on every rank with their gradient summed over TP (apply.tp_styles.SharedHeadsColumn).
The runs equal one device to fp32 tolerance, and the checkpoint holds ``query_key_value.weight``
(and its AdamW state) in HF's own layout, loadable on one device and back under TP.
"""

from __future__ import annotations

import io

import pytest
import torch

from nest_fx.apply.launch import launch
from nest_fx.models import build_model, build_seeded
from nest_fx.testing import equivalence
from checkpoint_helpers import model_layout_state_bytes, plain_state

pytestmark = [pytest.mark.hf, pytest.mark.dist]
TOL = 1e-5
LAUNCH_S = 300
QKV = "transformer.h.1.self_attention.query_key_value.weight"


def _many(specs):
    return [equivalence(spec) for spec in specs]


def _spec(plan: dict) -> dict:
    return {"model": "hf:falcon", "plan": plan, "batch": 8, "seq": 16, "steps": 3, "lr": 0.5}


def _check(results, names):
    for i, name in enumerate(names):
        ranks = [r[i] for r in results]
        worst = {k: max(r[k] for r in ranks) for k in ("loss_diff", "grad_diff", "param_diff")}
        print(f"{name}: " + ", ".join(f"{k}={v:.1e}" for k, v in worst.items()))
        assert all(v < TOL for v in worst.values()), (name, worst)
        assert all(r["num_grads"] > 0 for r in ranks)
        assert QKV in ranks[0]["sharded"], name


@pytest.mark.timeout(LAUNCH_S + 60)
def test_multi_query_falcon_tp2_dp2_equals_one_device():
    pytest.importorskip("transformers")
    _check(launch(_many, 4, [_spec({"tp": 2, "dp": 2, "microbatch_size": 4})], timeout=LAUNCH_S), ["tp2 dp2"])


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 60)
def test_multi_query_falcon_under_zero1_sequence_parallel_and_tp4():
    pytest.importorskip("transformers")
    specs = [
        _spec({"tp": 2, "dp": 2, "microbatch_size": 2, "num_microbatches": 2, "zero": 1}),
        _spec({"tp": 2, "dp": 2, "microbatch_size": 4, "sequence_parallel": True}),
        _spec({"tp": 4, "microbatch_size": 4, "num_microbatches": 2}),
    ]
    results = launch(_many, 4, specs, timeout=LAUNCH_S)
    _check(results, ["tp2 dp2 zero1", "tp2 dp2 sp", "tp4"])
    plans = [results[0][i]["plan"] for i in range(3)]
    assert plans[0]["zero"] == 1 and plans[1]["sequence_parallel"] and plans[2]["stages"][0]["tp"] == 4


def _checkpoint_worker(spec):
    """TP2 x DP2 save and HF export of multi-query Falcon with AdamW state (or, with ``load``, load a
    one-device checkpoint; with ``weights``, start on meta from an HF directory); returns the full state
    in the model's own layout and the local shape of the fused weight."""
    from nest_fx.apply import auto_parallelize
    from nest_fx.apply.losses import lm_loss
    from nest_fx.plan import uniform_plan

    model, cfg = build_model("hf:falcon", device="meta") if spec.get("weights") else build_seeded("hf:falcon", seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    pm = auto_parallelize(
        model,
        tokens,
        global_batch_size=4,
        loss_fn=lm_loss,
        verbose=False,
        plan=uniform_plan(cfg.num_hidden_layers + 2, tp=2, dp=2, microbatch_size=2),
        weights=spec.get("weights"),
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    if spec.get("load"):
        pm.load(spec["load"], opt)
    elif spec.get("save"):
        pm.train_step(tokens, tokens)
        opt.step()
        pm.save(spec["save"], opt, step=1)
        pm.save_pretrained(spec["hf"])
    return model_layout_state_bytes(pm, opt), tuple(dict(pm.named_parameters())[QKV].to_local().shape)


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_S)
def test_multi_query_checkpoint_holds_the_fused_weight_in_hf_layout(tmp_path):
    """TP2 x DP2 -> one device (checkpoint and HF export) and one device -> TP2 x DP2: bit-identical
    parameters and AdamW state."""
    transformers = pytest.importorskip("transformers")
    from nest_fx.apply.checkpoint import load_checkpoint, save_checkpoint

    hf = str(tmp_path / "hf")
    saved = launch(_checkpoint_worker, 4, {"save": str(tmp_path / "tp2"), "hf": hf}, timeout=LAUNCH_S)
    state = torch.load(io.BytesIO(saved[0][0]))
    assert [s[1] for s in saved] == [(64, 64)] * 4  # 2 of the 4 query heads + the key and value head, of 16
    model, _ = build_seeded("hf:falcon", seed=7)
    assert tuple(model.get_parameter(QKV).shape) == (96, 64)  # (4 + 2) heads of 16: HF's layout
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_checkpoint(model, str(tmp_path / "tp2"), opt)
    plain = plain_state(model, opt)
    assert sorted(plain) == sorted(state)
    assert not [k for k in state if not torch.equal(plain[k], state[k])]

    # the HF export holds the fused weight in HF's layout, and starts a TP2 x DP2 run on meta exactly
    exported = transformers.FalconForCausalLM.from_pretrained(hf)
    assert all(torch.equal(p, state[f"{n}.param"]) for n, p in exported.named_parameters())
    started = launch(_checkpoint_worker, 4, {"weights": hf}, timeout=LAUNCH_S)
    for blob, _ in started:
        got = torch.load(io.BytesIO(blob))
        assert not [n for n, p in exported.named_parameters() if not torch.equal(got[f"{n}.param"], p)]

    opt.step()  # a different state, saved on one device and loaded under TP2 x DP2
    save_checkpoint(model, str(tmp_path / "one"), opt, step=2)
    loaded = launch(_checkpoint_worker, 4, {"load": str(tmp_path / "one")}, timeout=LAUNCH_S)
    want = plain_state(model, opt)
    for blob, _ in loaded:
        got = torch.load(io.BytesIO(blob))
        assert sorted(got) == sorted(want) and not [k for k in want if not torch.equal(got[k], want[k])]
