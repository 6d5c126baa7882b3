"""The runtime turns on the CUDA allocator's segment mode the plan was costed with
(nest_fx/apply/allocator.py); its CPU path and its decisions are tested here, the CUDA call by
scripts/bench_gpu_runtime.py on a GPU (results/gpu/bench_gpu_runtime_h100_runtime_default.json:
reserved as under expandable segments without PYTORCH_CUDA_ALLOC_CONF)."""

from __future__ import annotations

import pytest

import nest_fx.apply.allocator as allocator
from nest_fx.apply.checks import ApplyError
from nest_fx.plan import uniform_plan
from nest_fx.plan.constraints import Constraints


def _plan(segments=None):
    plan = uniform_plan(4, dp=2)
    if segments:
        plan.constraints = Constraints(allocator_segments=segments)
    return plan


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(allocator, "_set_allocator_settings", seen.append)
    return seen


@pytest.mark.parametrize(
    "conf, expected",
    [
        ({}, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:False"}, False),
    ],
)
def test_the_users_configuration_is_read(conf, expected):
    assert allocator.configured_expandable(conf) is expected


def test_off_cuda_nothing_is_set(calls):
    assert allocator.use_costed_segments(_plan(), "cpu", environ={}) == "" and calls == []


@pytest.mark.parametrize("segments, text", [(None, "expandable_segments:True"), ("fixed", "expandable_segments:False")])
def test_on_cuda_the_costed_mode_is_turned_on(calls, segments, text):
    assert allocator.use_costed_segments(_plan(segments), "cuda", environ={}) == text
    assert calls == [text]


def test_a_users_matching_choice_is_kept(calls):
    conf = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert allocator.use_costed_segments(_plan(), "cuda", environ=conf) == "" and calls == []


def test_a_contradicting_configuration_is_refused_naming_the_fix(calls):
    conf = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    with pytest.raises(ApplyError, match="--allocator-segments fixed"):
        allocator.use_costed_segments(_plan(), "cuda", environ=conf)
    assert calls == []


def test_the_setter_exists_in_this_torch():
    import torch

    assert callable(getattr(torch._C, "_accelerator_setAllocatorSettings", None)) or callable(
        getattr(torch.cuda.memory, "_set_allocator_settings", None)
    )
