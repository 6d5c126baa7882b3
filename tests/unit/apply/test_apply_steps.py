"""``auto_parallelize`` as a list of named steps, and the three objects a ``ParallelModule`` is
built from (``nest_fx/apply/api.py``, ``steps.py``, ``prepare.py``, ``parts.py``)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re

import pytest
import torch
import torch.nn.functional as F

import nest_fx.apply.api as api
from nest_fx.apply import auto_parallelize
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.parts import BatchSchedule, LocalModel, ParallelLayout
from nest_fx.apply.runtime import ParallelModule
from nest_fx.graph import trace
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan

LLAMA = "llama:hidden=64,layers=4,heads=4,seq=32,vocab=128"
STEP_MODULES = ("nest_fx.apply.prepare", "nest_fx.apply.steps")


def _called_steps() -> list:
    """The functions of ``prepare``/``steps`` that ``auto_parallelize`` calls, in source order."""
    tree = ast.parse(inspect.getsource(api.auto_parallelize))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    calls.sort(key=lambda node: (node.lineno, node.col_offset))
    step_names = {
        name for name, value in vars(api).items() if inspect.isfunction(value) and value.__module__ in STEP_MODULES
    }
    return [
        f"{getattr(api, c.func.id).__module__.rsplit('.', 1)[1]}.{c.func.id}"
        for c in calls
        if c.func.id in step_names and c.func.id != "fsdp_applied"
    ]


def test_auto_parallelize_calls_the_steps_its_docstring_lists_in_that_order():
    documented = re.findall(r"``((?:prepare|steps)\.\w+)``", api.__doc__)
    assert documented[0] == "prepare.prepare" and "steps.pipeline_schedule" in documented
    assert _called_steps() == documented


def test_every_step_is_documented():
    import nest_fx.apply.steps as steps

    public = [
        f
        for name, f in vars(steps).items()
        if inspect.isfunction(f) and f.__module__ == steps.__name__ and not name.startswith("_")
    ]
    assert len(public) >= 12
    assert all(f.__doc__ and f.__doc__.strip() for f in public), [f.__name__ for f in public if not f.__doc__]


def test_parallel_module_is_built_from_three_parts(single_rank):
    model, cfg = build_seeded(LLAMA)
    x, y = torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32))
    plan = uniform_plan(6, microbatch_size=2, num_microbatches=2)
    pm = auto_parallelize(model, x, global_batch_size=4, loss_fn=lm_loss, plan=plan, verbose=False)
    assert list(inspect.signature(ParallelModule).parameters) == ["layout", "batching", "local"]
    assert isinstance(pm.layout, ParallelLayout) and isinstance(pm.batching, BatchSchedule)
    assert isinstance(pm.local, LocalModel)
    assert pm.plan is pm.layout.plan is plan and pm.rank_info.stage == 0 and pm.device == torch.device("cpu")
    assert (pm.global_batch_size, pm.num_microbatches, pm.loss_fn) == (4, 2, lm_loss)
    assert pm.schedule is None and pm.pipeline_stages == () and pm.context_parallel is None
    assert pm.module is pm.chunks[0] is model and pm.graph is not None and not pm.fsdp
    assert pm.materialized is None and pm.grad_sync is None and "embed.tok.weight" in pm.model_specs
    with pytest.raises(dataclasses.FrozenInstanceError):
        pm.layout.plan = None
    with pytest.raises(AttributeError):
        pm.plan = None  # read-only: the layout is the one place it lives

    seen = []

    def recording(out, target):
        seen.append(tuple(out.shape))
        return lm_loss(out, target)

    pm.loss_fn = recording  # the two settable attributes write through to their part
    pm.grad_sync = lambda: seen.append("sync")
    assert pm.batching.loss_fn is recording and pm.local.grad_sync is pm.grad_sync
    pm.train_step(x, y)
    assert seen == [(2, 32, 128), (2, 32, 128), "sync"] and pm.step == 1


def test_a_setup_warning_names_the_line_that_called_auto_parallelize(single_rank):
    """The warnings of the prepare step point at the caller's line, as when they were raised inline."""
    model, _ = build_seeded("cnn:channels=8,blocks=1,classes=4,image=8")
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    plan = uniform_plan(len(trace(model, (x,)).blocks), microbatch_size=4, num_microbatches=2)
    with pytest.warns(UserWarning, match="sync_batchnorm=False: BatchNorm layers") as caught:
        auto_parallelize(
            model, x, global_batch_size=8, loss_fn=F.cross_entropy, plan=plan, sync_batchnorm=False, verbose=False
        )
    assert {w.filename for w in caught if "BatchNorm" in str(w.message)} == {__file__}
