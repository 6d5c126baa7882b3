"""The optimizer's implementation as a cost input (``optimizer_kernel``, ``nest_fx/cost/optimizers.py``):
the figures counted again from the ops torch's own code paths dispatch, '' resolved per device, and
the prices of a plan under each implementation."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nest_fx.cluster import load_cluster
from nest_fx.cost.memory import optimizer_step_bytes
from nest_fx.cost.optimizers import OPTIMIZERS, resolved_kernel, step_cost
from nest_fx.cost.options import CostOptions
from nest_fx.cost.step_time import simulate
from nest_fx.plan import uniform_plan
from nest_fx.plan.constraints import Constraints
from nest_fx.plan.vocabulary import OPTIMIZER_KERNELS
from nest_fx.solver.constraints import cost_options
from nest_fx.workload import workload_for_model

NUMEL = 60  # every parameter this size: the tensors the step moves are told from scalars by it
TORCH = {
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "sgd": (torch.optim.SGD, {}),
}
ARGUMENTS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


class Traffic(TorchDispatchMode):
    """Counts what each dispatched op moves of parameter-sized fp32 tensors: every distinct tensor
    it reads once, every one whose values it changes once more, every new one it returns (fresh
    allocations counted apart too)."""

    def __init__(self):
        super().__init__()
        self.moved = self.fresh = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.data_ptr(): t for t in tree_leaves((args, kwargs)) if _sized(t)}
        before = {ptr: t.clone() for ptr, t in inputs.items()}
        out = func(*args, **kwargs)
        written = sum(not torch.equal(before[ptr], t) for ptr, t in inputs.items())
        fresh = sum(1 for t in tree_leaves(out) if _sized(t) and t.data_ptr() not in inputs)
        if inputs or fresh:
            self.ops += 1
        self.moved += 4 * NUMEL * (len(inputs) + written + fresh)
        self.fresh += 4 * NUMEL * fresh
        return out


def _sized(t) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() == NUMEL


def _measured(optimizer: str, kernel: str, tensors: int = 3) -> Traffic:
    """The traffic of the second step (the steady state: states exist) of ``optimizer`` run as ``kernel``."""
    torch.manual_seed(0)
    cls, hyper = TORCH[optimizer]
    params = [torch.nn.Parameter(torch.randn(6, 10)) for _ in range(tensors)]
    opt = cls(params, lr=1e-3, **hyper, **ARGUMENTS[kernel])
    for step in range(2):
        for p in params:
            # small gradients: every pass changes some value (Adam's + eps too), so writes are seen
            p.grad = 1e-3 * torch.randn_like(p)
        if step == 0:
            opt.step()
    with Traffic() as traffic:
        opt.step()
    return traffic


@pytest.mark.parametrize("kernel", OPTIMIZER_KERNELS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_update_bytes_and_scratch_are_what_torchs_code_path_moves(optimizer, kernel):
    cost = step_cost(optimizer, kernel)
    traffic = _measured(optimizer, kernel)
    assert traffic.moved / (3 * NUMEL) == cost.update_bytes
    # allocated in all: Adam's for-loop two temporaries of each tensor (8 B per element), foreach one
    # of every parameter (its scratch), the others none
    adam_loop = kernel == "for-loop" and optimizer in ("adam", "adamw")
    assert traffic.fresh / (3 * NUMEL) == (8 if adam_loop else cost.scratch_bytes)
    if kernel == "for-loop":
        assert traffic.ops == 3 * cost.launches_per_tensor
    else:  # foreach and fused: the same ops whatever the tensor count
        assert cost.launches_per_tensor == 0 and _measured(optimizer, kernel, tensors=5).ops == traffic.ops


class LiveScratch(TorchDispatchMode):
    """The most bytes of tensors the step allocated (not its inputs) alive at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.data_ptr() for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > 1 and t.data_ptr() not in inputs:
                self.live += t.nbytes
                weakref.finalize(t, self._free, t.nbytes)
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def _peak_scratch(optimizer: str, kernel: str, sizes) -> int:
    cls, hyper = TORCH[optimizer]
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = cls(params, lr=1e-3, **hyper, **ARGUMENTS[kernel])
    for step in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        if step == 0:
            opt.step()
    with LiveScratch() as scratch:
        opt.step()
    return scratch.peak


@pytest.mark.parametrize("kernel", OPTIMIZER_KERNELS)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum"])
def test_the_scratch_alive_at_once_is_what_memory_prices(optimizer, kernel):
    """foreach: one temporary of every parameter; the for-loop: two of the tensor it updates and
    the previous tensor's denominator (still held by the loop's variable), so 12 B per element of
    the largest tensor when two of that size follow each other, less otherwise."""
    priced = optimizer_step_bytes(2200, optimizer, kernel, largest_tensor=1000)
    assert _peak_scratch(optimizer, kernel, (1000, 1000, 200)) == priced
    assert _peak_scratch(optimizer, kernel, (300, 1000, 200)) <= priced
    if kernel == "for-loop" and optimizer == "adamw":
        assert _peak_scratch(optimizer, kernel, (300, 1000, 200)) == 4 * (300 + 2 * 1000)


def test_the_figures_of_each_implementation():
    update = {(o, k): step_cost(o, k).update_bytes for o in OPTIMIZERS for k in OPTIMIZER_KERNELS}
    assert update == {
        **{("adam", k): 72 for k in ("for-loop", "foreach")},
        **{("adamw", k): 80 for k in ("for-loop", "foreach")},
        **{("sgd-momentum", k): 32 for k in ("for-loop", "foreach")},
        **{("sgd", k): 12 for k in OPTIMIZER_KERNELS},
        ("adam", "fused"): 28,
        ("adamw", "fused"): 28,
        ("sgd-momentum", "fused"): 20,
    }
    assert optimizer_step_bytes(1e6, "adamw", "foreach") == 4e6
    assert optimizer_step_bytes(1e6, "adamw", "for-loop", largest_tensor=1e5) == 12e5
    assert optimizer_step_bytes(1e6, "adamw", "fused", largest_tensor=1e5) == 0
    assert optimizer_step_bytes(1e6, "sgd-momentum", "for-loop", largest_tensor=1e5) == 0


def test_torchs_default_is_foreach_on_a_gpu_and_the_for_loop_on_a_cpu():
    assert resolved_kernel("", load_cluster("dgx-h100:8").device) == "foreach"
    assert resolved_kernel("", load_cluster("cpu-gloo:2").device) == "for-loop"
    assert resolved_kernel("", None) == "foreach"
    assert resolved_kernel("fused", load_cluster("cpu-gloo:2").device) == "fused"
    with pytest.raises(ValueError, match="optimizer_kernel"):
        CostOptions(optimizer_kernel="apex")


@pytest.fixture(scope="module")
def gpu():
    cluster = load_cluster("dgx-h100:8")
    return cluster, workload_for_model("llama:hidden=512,layers=4,heads=8,seq=256,vocab=1024", cluster)


def _priced(plan, work, cluster, **options):
    return simulate(plan, work, cluster, CostOptions(optimizer="adamw", **options))


def test_a_gpu_plan_without_a_setting_is_priced_as_foreach(gpu):
    cluster, work = gpu
    plan = uniform_plan(len(work), dp=8, zero=1, num_microbatches=2)
    default, foreach = (_priced(plan, work, cluster, optimizer_kernel=k) for k in ("", "foreach"))
    assert default.step_s == foreach.step_s and default.stages[0].memory == foreach.stages[0].memory
    fused = _priced(plan, work, cluster, optimizer_kernel="fused")
    assert fused.breakdown["optimizer"] == pytest.approx(foreach.breakdown["optimizer"] * 28 / 80)
    assert fused.stages[0].memory["optimizer_step"] <= foreach.stages[0].memory["optimizer_step"]


def test_a_cpu_plan_without_a_setting_is_priced_as_the_for_loop():
    cluster = load_cluster("cpu-gloo:2")
    work = workload_for_model("llama:hidden=64,layers=2,heads=4,seq=32,vocab=128", cluster, dtype=torch.float32)
    plan = uniform_plan(len(work), dp=2, num_microbatches=1)
    priced = {k: _priced(plan, work, cluster, optimizer_kernel=k) for k in ("", "for-loop", "foreach")}
    assert priced[""].stages[0].memory == priced["for-loop"].stages[0].memory
    assert priced["for-loop"].stages[0].memory != priced["foreach"].stages[0].memory


def test_a_plan_files_constraints_carry_the_setting_into_the_cost_options():
    c = Constraints.from_dict({"optimizer": "adamw", "optimizer_kernel": "fused"})
    assert (cost_options(c).optimizer, cost_options(c).optimizer_kernel) == ("adamw", "fused")
    assert cost_options(dataclasses.replace(c, optimizer_kernel=None)).optimizer_kernel == ""
