"""Memory model: ZeRO model states, Korthikanti activations, pipeline in-flight factor, fit check."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nest_fx.cost.inflight import pipeline_inflight_microbatches, stage_activation_bytes
from nest_fx.cost.memory import (
    check_fits,
    effective_zero_stage,
    fsdp_unsharded_bytes,
    optimizer_step_bytes,
    korthikanti_activation_bytes,
    model_state_bytes,
    optimizer_bytes_per_param,
)

# -- model states --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stage, weights, grads, optimizer",
    [
        # psi = 1e9 params, dp = 8, mixed-precision Adam: 2 + 2 + 12 bytes/param
        (0, 2e9, 2e9, 12e9),
        (1, 2e9, 2e9, 12e9 / 8),  # optimizer sharded: 1.5e9
        (2, 2e9, 2e9 / 8, 12e9 / 8),  # + grads: 0.25e9
        (3, 2e9 / 8, 2e9 / 8, 12e9 / 8),  # + weights
    ],
)
def test_zero_stages_hand_values(stage, weights, grads, optimizer):
    m = model_state_bytes(1e9, zero_stage=stage, dp=8)
    assert (m["weights"], m["grads"], m["optimizer"]) == pytest.approx((weights, grads, optimizer))
    assert m["total"] == pytest.approx(weights + grads + optimizer)


def test_zero_paper_figure_1():
    # Rajbhandari et al. 2020, Figure 1: psi = 7.5B, K = 12, N_d = 64 -> per-device model states
    # 120 GB (baseline), 31.4 GB (P_os), 16.6 GB (P_os+g), 1.9 GB (P_os+g+p), GB = 1e9 bytes.
    #   (2+2+12)*7.5 = 120;  (2+2)*7.5 + 12*7.5/64 = 31.406;  2*7.5 + 14*7.5/64 = 16.64;  16*7.5/64 = 1.875
    published = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in published.items():
        total = model_state_bytes(7.5e9, zero_stage=stage, dp=64)["total"] / 1e9
        assert round(total, 1) == gb


def test_fp32_adam_and_sgd():
    # fp32 Adam without master copy: weights 4, grads 4, m + v 8 bytes/param
    m = model_state_bytes(10, zero_stage=0, dp=1, param_dtype_bytes=4, grad_dtype_bytes=4, master_weights=False)
    assert (m["weights"], m["grads"], m["optimizer"], m["total"]) == (40, 40, 80, 160)
    # SGD with momentum, mixed precision: master 4 + momentum 4 = 8
    assert optimizer_bytes_per_param("sgd-momentum") == 8
    assert optimizer_bytes_per_param("sgd-momentum", master_weights=False) == 4
    assert optimizer_bytes_per_param("adam") == optimizer_bytes_per_param("adamw") == 12
    assert model_state_bytes(10, zero_stage=0, dp=1, optimizer="sgd-momentum")["total"] == 10 * (2 + 2 + 8)
    # PyTorch's default SGD (momentum 0) keeps no state: the master copy alone, nothing in fp32
    assert optimizer_bytes_per_param("sgd") == 4
    assert optimizer_bytes_per_param("sgd", master_weights=False) == 0
    assert (
        model_state_bytes(
            10, zero_stage=0, dp=1, optimizer="sgd", param_dtype_bytes=4, grad_dtype_bytes=4, master_weights=False
        )["optimizer"]
        == 0
    )


@given(psi=st.floats(0, 1e12), dp=st.integers(1, 4096), opt=st.sampled_from(["adam", "adamw", "sgd", "sgd-momentum"]))
@settings(max_examples=100, deadline=None)
def test_zero_never_increases_memory(psi, dp, opt):
    totals = [model_state_bytes(psi, zero_stage=z, dp=dp, optimizer=opt)["total"] for z in range(4)]
    assert totals[3] <= totals[2] <= totals[1] <= totals[0]


def test_dp_one_makes_zero_a_no_op():
    base = model_state_bytes(3e9, zero_stage=0, dp=1)
    for z in (1, 2, 3):
        assert model_state_bytes(3e9, zero_stage=z, dp=1) == base


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(zero_stage=4), "zero_stage"),
        (dict(zero_stage=-1), "zero_stage"),
        (dict(zero_stage=True), "zero_stage"),
        (dict(dp=0), "dp"),
        (dict(dp=2.0), "dp"),
        (dict(optimizer="lamb"), "optimizer"),
        (dict(num_params=-1), "num_params"),
        (dict(num_params=float("nan")), "num_params"),
        (dict(param_dtype_bytes=0), "param_dtype_bytes"),
        (dict(grad_dtype_bytes=-2), "grad_dtype_bytes"),
    ],
)
def test_model_state_validation_names_the_argument(kwargs, message):
    args = dict(num_params=1e9, zero_stage=1, dp=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        model_state_bytes(args.pop("num_params"), **args)


# -- activations (Korthikanti et al. 2022, Table 2) -----------------------------------------

# A small shape whose terms are easy by hand: s=8, b=2, h=16, a=4 -> sbh = 256, 5as/h = 10.
SMALL = dict(seq=8, microbatch=2, hidden=16, heads=4)


@pytest.mark.parametrize(
    "tp, sp, recompute, expected",
    [
        (1, False, "none", 256 * (34 + 10)),  # sbh(34 + 5as/h)
        (4, False, "none", 256 * (10 + 24 / 4 + 10 / 4)),  # sbh(10 + 24/t + 5as/(ht))
        (4, True, "none", 256 / 4 * (34 + 10)),  # sbh/t (34 + 5as/h)
        (4, False, "selective", 256 * (10 + 24 / 4)),  # sbh(10 + 24/t)
        (4, True, "selective", 256 * 34 / 4),  # sbh 34/t
        (1, False, "selective", 256 * 34),
        (4, False, "full", 2 * 256),  # 2sbh
        (4, True, "full", 2 * 256 / 4),  # 2sbh/t
    ],
)
def test_korthikanti_table_2(tp, sp, recompute, expected):
    got = korthikanti_activation_bytes(**SMALL, tp=tp, sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(expected)


def test_dtype_scaling():
    two = korthikanti_activation_bytes(**SMALL, tp=2)
    assert korthikanti_activation_bytes(**SMALL, tp=2, dtype_bytes=4) == pytest.approx(2 * two)
    assert korthikanti_activation_bytes(**SMALL, tp=2, dtype_bytes=1) == pytest.approx(two / 2)


GPT3 = dict(seq=2048, microbatch=1, hidden=12288, heads=96)  # GPT-3 175B, Table 3
MTNLG = dict(seq=2048, microbatch=1, hidden=20480, heads=128)  # MT-NLG 530B, Table 3


def test_korthikanti_gpt3_175b_published_figures():
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    # Section 5 (selective recomputation): for GPT-3, 5as/h = 5*96*2048/12288 = 80, and storing
    # only the 34 term saves 80/(34+80) = 70% of the activation memory ("70% reduction" in the
    # paper; 65% for MT-NLG where 5as/h = 5*128*2048/20480 = 64 and 64/98 = 65%).
    assert 5 * a * s / h == 80
    none = korthikanti_activation_bytes(**GPT3)
    selective = korthikanti_activation_bytes(**GPT3, recompute="selective")
    assert none == sbh * (34 + 80)
    assert round(1 - selective / none, 2) == 0.70
    mt_none = korthikanti_activation_bytes(**MTNLG)
    mt_sel = korthikanti_activation_bytes(**MTNLG, recompute="selective")
    assert round(1 - mt_sel / mt_none, 2) == 0.65
    # TP8 + SP + selective, per layer: sbh * 34/t = 2048 * 12288 * 34 / 8 = 106,954,752 bytes
    # (~107 MB; x 96 layers ~ 10.3 GB). This is the paper's formula evaluated by hand: the
    # paper states it symbolically (Table 2, "34 sbh/t") rather than as a per-layer byte count.
    per_layer = korthikanti_activation_bytes(**GPT3, tp=8, sequence_parallel=True, recompute="selective")
    assert per_layer == 2048 * 12288 * 34 / 8 == 106_954_752
    assert per_layer * 96 == pytest.approx(10.27e9, rel=1e-3)


@pytest.mark.parametrize("shape", [GPT3, MTNLG])
def test_korthikanti_about_5x_reduction(shape):
    # Abstract: sequence parallelism + selective recomputation "reduces activation memory by 5x"
    # relative to tensor parallelism alone. t = 8 for both models (Table 3):
    #   GPT-3:  (10 + 24/8 + 80/8) / (34/8) = 23 / 4.25 = 5.4
    #   MT-NLG: (10 + 24/8 + 64/8) / (34/8) = 21 / 4.25 = 4.9
    baseline = korthikanti_activation_bytes(**shape, tp=8)
    ours = korthikanti_activation_bytes(**shape, tp=8, sequence_parallel=True, recompute="selective")
    assert 4.5 < baseline / ours < 6.0


@given(
    s=st.integers(1, 8192),
    b=st.integers(1, 16),
    h=st.integers(1, 32768),
    a=st.integers(1, 256),
    t=st.integers(1, 64),
    sp=st.booleans(),
)
@settings(max_examples=100, deadline=None)
def test_recompute_ordering(s, b, h, a, t, sp):
    kw = dict(tp=t, sequence_parallel=sp)
    full = korthikanti_activation_bytes(s, b, h, a, recompute="full", **kw)
    sel = korthikanti_activation_bytes(s, b, h, a, recompute="selective", **kw)
    none = korthikanti_activation_bytes(s, b, h, a, recompute="none", **kw)
    assert full <= sel <= none
    # sequence parallelism never needs more memory than tensor parallelism alone
    for mode in ("none", "selective", "full"):
        with_sp = korthikanti_activation_bytes(s, b, h, a, tp=t, sequence_parallel=True, recompute=mode)
        without = korthikanti_activation_bytes(s, b, h, a, tp=t, sequence_parallel=False, recompute=mode)
        assert with_sp <= without * (1 + 1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seq=0), "seq"),
        (dict(microbatch=-1), "microbatch"),
        (dict(hidden=1.5), "hidden"),
        (dict(heads=0), "heads"),
        (dict(tp=0), "tp"),
        (dict(recompute="partial"), "recompute"),
        (dict(dtype_bytes=0), "dtype_bytes"),
    ],
)
def test_activation_validation_names_the_argument(kwargs, message):
    args = dict(SMALL)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        korthikanti_activation_bytes(**args)


# -- pipeline schedules --------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule, p, m, v, expected",
    [
        ("gpipe", 4, 8, 1, [8, 8, 8, 8]),  # all m microbatches
        ("1f1b", 4, 8, 1, [4, 3, 2, 1]),  # p - stage
        ("1f1b", 4, 2, 1, [2, 2, 2, 1]),  # capped at m
        # interleaved, p=4, v=2: (2(p-stage-1) + (v-1)p + 1) / v = (2*3+4+1)/2, (2*2+5)/2, (2+5)/2, 5/2
        ("interleaved", 4, 8, 2, [5.5, 4.5, 3.5, 2.5]),
        ("interleaved", 4, 2, 2, [2, 2, 2, 2]),  # capped at m*v = 4 chunks: 4/2 = 2
        ("interleaved", 4, 8, 1, [4, 3, 2, 1]),  # v = 1 is plain 1F1B
    ],
)
def test_inflight_hand_values(schedule, p, m, v, expected):
    got = [pipeline_inflight_microbatches(schedule, i, p, m, v) for i in range(p)]
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (8, 4), (16, 3)])
def test_interleaved_first_stage_matches_korthikanti(p, v):
    # Korthikanti et al. 2022 sec. 4.2.3: the first stage stores p microbatches' worth of its
    # layers times (1 + (p-1)/(p v)) under the interleaved schedule (m large enough).
    assert pipeline_inflight_microbatches("interleaved", 0, p, 64, v) == pytest.approx(p * (1 + (p - 1) / (p * v)))


@given(p=st.integers(1, 32), m=st.integers(1, 128), v=st.integers(1, 8), data=st.data())
@settings(max_examples=100, deadline=None)
def test_inflight_never_exceeds_gpipe(p, m, v, data):
    stage = data.draw(st.integers(0, p - 1))
    gpipe = pipeline_inflight_microbatches("gpipe", stage, p, m, v)
    one_f = pipeline_inflight_microbatches("1f1b", stage, p, m)
    inter = pipeline_inflight_microbatches("interleaved", stage, p, m, v)
    assert 0 < one_f <= gpipe == m
    assert 0 < inter <= gpipe
    assert pipeline_inflight_microbatches("1f1b", 0, p, m) >= one_f  # the first stage holds the most


def test_stage_activation_bytes_multiplies():
    assert stage_activation_bytes(1e6, "1f1b", 1, 4, 8) == 3e6
    assert stage_activation_bytes(1e6, "interleaved", 0, 4, 8, 2) == 5.5e6
    assert stage_activation_bytes(1e6, "gpipe", 3, 4, 8) == 8e6


@pytest.mark.parametrize(
    "args, message",
    [
        (("zb-v", 0, 4, 8, 1), "schedule"),
        (("1f1b", 4, 4, 8, 1), "stage"),
        (("1f1b", -1, 4, 8, 1), "stage"),
        (("1f1b", 0, 0, 8, 1), "num_stages"),
        (("1f1b", 0, 4, 0, 1), "num_microbatches"),
        (("interleaved", 0, 4, 8, 0), "virtual_stages"),
    ],
)
def test_pipeline_validation_names_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        pipeline_inflight_microbatches(*args)


def test_stage_activation_bytes_rejects_negative():
    with pytest.raises(ValueError, match="per_microbatch_bytes"):
        stage_activation_bytes(-1, "1f1b", 0, 4, 8)


# -- fit check -----------------------------------------------------------------------------


def test_check_fits():
    breakdown = {"weights": 10.0, "grads": 10.0, "optimizer": 60.0, "activations": 30.0}
    assert check_fits(breakdown, 110.0) == (True, None)
    assert check_fits(breakdown, 109.0) == (False, "optimizer")
    assert check_fits({**breakdown, "activations": 100.0}, 150.0) == (False, "activations")


def test_check_fits_with_model_state_breakdown():
    states = model_state_bytes(7.5e9, zero_stage=0, dp=64)  # 120 GB incl. a "total" entry
    assert check_fits(states, 80 * 2**30) == (False, "optimizer")
    assert check_fits(model_state_bytes(7.5e9, zero_stage=3, dp=64), 80 * 2**30) == (True, None)


def test_check_fits_rejects_a_stale_total():
    with pytest.raises(ValueError, match="total"):
        check_fits({"weights": 1.0, "total": 5.0}, 10.0)
    with pytest.raises(ValueError, match="at least one term"):
        check_fits({"total": 5.0}, 10.0)
    with pytest.raises(ValueError, match="capacity_bytes"):
        check_fits({"weights": 1.0}, -1)


# -- runtime working sets (FSDP2, foreach optimizers) ----------------------------------------


def test_fsdp_unsharded_hand_values():
    # psi = 100 params per device, root (embedding + LM head) 30, largest block 10, dp = 4,
    # fp32 weights and grads (4 bytes): (gathered parameter bytes, unsharded gradient bytes)
    kw = dict(dp=4, param_dtype_bytes=4, grad_dtype_bytes=4)
    assert fsdp_unsharded_bytes(100, 30, 10, zero_stage=0, **kw) == (0, 0)
    assert fsdp_unsharded_bytes(100, 30, 10, zero_stage=1, **kw) == (100 * 4 / 4, 0)  # the local shard
    # unsharded gradients of the root and one block, plus the reduce-scatter's flat copy of the larger
    assert fsdp_unsharded_bytes(100, 30, 10, zero_stage=2, **kw) == (100, (30 + 10 + 30) * 4)
    assert fsdp_unsharded_bytes(100, 30, 10, zero_stage=3, **kw) == ((30 + 2 * 10) * 4, (30 + 10 + 30) * 4)
    # nothing is sharded on one rank
    assert fsdp_unsharded_bytes(100, 30, 10, zero_stage=3, dp=1) == (0, 0)


def test_fsdp_unsharded_accepts_arrays_like_the_solver_tables():
    import numpy as np

    params, grads = fsdp_unsharded_bytes(
        np.array([100.0, 50.0]),
        np.array([30.0, 0.0]),
        np.array([10.0, 10.0]),
        zero_stage=3,
        dp=4,
        param_dtype_bytes=2,
        grad_dtype_bytes=2,
    )
    assert params.tolist() == [(30 + 20) * 2, 20 * 2] and grads.tolist() == [70 * 2, 20 * 2]
    with pytest.raises(ValueError, match="root_params"):
        fsdp_unsharded_bytes(np.array([1.0]), np.array([-1.0]), np.array([1.0]), zero_stage=3, dp=2)


def test_pipelined_zero_runs_as_zero_one():
    assert [effective_zero_stage(z, 1) for z in range(4)] == [0, 1, 2, 3]
    assert [effective_zero_stage(z, 4) for z in range(4)] == [0, 1, 1, 1]


def test_optimizer_step_scratch_is_one_fp32_copy_for_adam_none_for_sgd():
    assert optimizer_step_bytes(1e6, "adamw") == 4e6
    assert optimizer_step_bytes(1e6, "adam") == 4e6
    assert optimizer_step_bytes(1e6, "sgd") == 0
    assert optimizer_step_bytes(1e6, "sgd-momentum") == 0
