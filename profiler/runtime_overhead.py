"""Host work the runtime adds around each collective: what ``CostOptions.tp_call_overhead`` and
``CostOptions.fsdp_call_overhead`` stand for, measured on the ranks.

The cost model charges a collective its network time (``nest_fx.cost.collectives``, from the
cluster's fitted levels) and a layer its profiled compute. The runtime also does work that
neither sees:

* tensor parallelism runs its linears through DTensor (sharding propagation, ``from_local`` /
  ``to_local``, the redistribute that issues each all-reduce, copies);
* FSDP2 copies parameters into and out of flat buffers around each unit's all-gather and
  reduce-scatter, and does its bookkeeping in Python.

On a GPU the host runs ahead of the device and most of this is hidden; on CPU ranks it is not.
Both are measured on the model itself, on the spawned ranks, one thread each, as what a
one-microbatch training step under the runtime takes beyond the cost model's own terms:

* TP (tp = ranks): the step under ``auto_parallelize``, minus the same step of the model's
  local TP shard on one rank (``nest_fx.workload.localise``), minus the cost model's TP collectives
  (the workload's comms on the cluster); divided by the number of TP collective calls. Taken at
  two microbatch sizes and fitted as ``a + b * bytes`` per call (non-negative least squares;
  ``bytes`` the mean buffer of a call).
* FSDP (ZeRO-3, dp = ranks): the step under ``auto_parallelize``, minus the plain step of the
  whole model on one rank, minus the cost model's two all-gathers and one reduce-scatter per
  FSDP unit; divided by the bytes those collectives move (the work is copies: per byte).

Times are medians of ``repeats`` steps after ``warmup`` steps, slowest rank.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Sequence, Tuple

import torch
import torch.distributed as dist

from nest_fx.apply import auto_parallelize
from nest_fx.apply.distributed import init_distributed
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.cluster import Cluster
from nest_fx.cost.collectives import collective_time
from nest_fx.graph import trace
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan
from nest_fx.workload import workload_for_model
from nest_fx.workload.localise import localise_tp
from profiler.collectives import CalibrationError, nonnegative_lstsq


@dataclass
class OverheadSample:
    """One measurement: the runtime's seconds beyond the cost model's terms, and per unit."""

    path: str  # "tp" | "fsdp"
    microbatch: int
    calls: int  # collective calls in the step
    nbytes: float  # mean bytes per call
    measured_s: float  # the step under the runtime
    local_s: float  # the same work on one rank without the runtime's parallelism
    network_s: float  # the cost model's collectives
    extra_s: float  # measured - local - network (>= 0)


@dataclass
class RuntimeOverheads:
    """Fitted ``(seconds per call, seconds per byte)`` per path, and the samples behind them."""

    tp_call_overhead: Tuple[float, float]
    fsdp_call_overhead: Tuple[float, float]
    samples: List[OverheadSample]

    def to_dict(self) -> dict:
        return {
            "tp_call_overhead": list(self.tp_call_overhead),
            "fsdp_call_overhead": list(self.fsdp_call_overhead),
            "samples": [asdict(s) for s in self.samples],
        }


def _median_time(fn: Callable[[], None], warmup: int, repeats: int, sync: bool = True) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` runs; with ``sync`` every rank starts
    together and the slowest rank's median is returned (a collective ends with its last rank)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    if not sync:
        return median
    slowest = torch.tensor([median], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def _tokens(cfg, mbs: int, vocab: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one microbatch, ids below ``vocab`` (default: the model's)."""
    gen = torch.Generator().manual_seed(0)
    vocab = vocab or cfg.vocab_size
    x = torch.randint(0, vocab, (mbs, cfg.seq_len), generator=gen)
    return x, torch.randint(0, vocab, (mbs, cfg.seq_len), generator=gen)


def _runtime_step(model_name: str, plan_kwargs: dict, mbs: int, warmup: int, repeats: int) -> float:
    """Median seconds of forward + backward of one microbatch under ``auto_parallelize``."""
    model, cfg = build_seeded(model_name, seed=0)
    x, y = _tokens(cfg, mbs)
    world = dist.get_world_size()
    plan = uniform_plan(cfg.layers + 2, microbatch_size=mbs, num_microbatches=1, **plan_kwargs)
    batch = mbs * plan.dp
    pm = auto_parallelize(model, x, global_batch_size=batch, loss_fn=lm_loss, plan=plan, verbose=False)
    xs, ys = x.repeat(batch // mbs, 1), y.repeat(batch // mbs, 1)
    assert plan.devices_used == world, (plan.devices_used, world)

    def step() -> None:
        pm.train_step(xs, ys)
        for p in pm.parameters():
            p.grad = None

    return _median_time(step, warmup, repeats)


def _local_step(model: torch.nn.Module, cfg, mbs: int, warmup: int, repeats: int, vocab: int = 0) -> float:
    x, y = _tokens(cfg, mbs, vocab)  # a TP shard's embedding holds vocab / tp rows

    def step() -> None:
        lm_loss(model(x), y).backward()
        model.zero_grad(set_to_none=True)

    return _median_time(step, warmup, repeats, sync=False)


def measure_tp(
    model_name: str, workload, cluster: Cluster, microbatches: Sequence[int], warmup: int = 2, repeats: int = 5
) -> List[OverheadSample]:
    """TP samples on the initialised default group (every rank calls it; tp = world size)."""
    world = dist.get_world_size()
    ranks = list(range(world))
    out = []
    for mbs in microbatches:
        measured = _runtime_step(model_name, {"tp": world}, mbs, warmup, repeats)
        model, cfg = build_seeded(model_name, seed=0)
        graph = trace(model, _tokens(cfg, mbs)[:1])
        local = _local_step(
            localise_tp(model, graph, world, cfg.vocab_size), cfg, mbs, warmup, repeats, vocab=cfg.vocab_size // world
        )
        comms = [c for i in range(len(workload)) for c in workload.cost(i, world, 1, mbs, False).comms]
        calls = sum(c.count for c in comms)
        network = sum(c.count * collective_time(c.kind, cluster, ranks, c.nbytes) for c in comms)
        nbytes = sum(c.count * c.nbytes for c in comms) / max(calls, 1)
        out.append(
            OverheadSample("tp", mbs, calls, nbytes, measured, local, network, max(measured - local - network, 0.0))
        )
    return out


def measure_fsdp(
    model_name: str, workload, cluster: Cluster, mbs: int = 1, warmup: int = 2, repeats: int = 5
) -> OverheadSample:
    """The FSDP sample on the initialised default group (every rank calls it; dp = world size)."""
    world = dist.get_world_size()
    ranks = list(range(world))
    measured = _runtime_step(model_name, {"dp": world, "zero": 3}, mbs, warmup, repeats)
    model, cfg = build_seeded(model_name, seed=0)
    local = _local_step(model, cfg, mbs, warmup, repeats)
    param_bytes = [workload.cost(i, 1, 1, mbs, False).num_params * 4 for i in range(len(workload))]
    units = [b for i, b in enumerate(param_bytes) if workload.layers[i].kind == "block"]
    units.append(sum(b for i, b in enumerate(param_bytes) if workload.layers[i].kind != "block"))
    network = sum(
        2 * collective_time("all_gather", cluster, ranks, b) + collective_time("reduce_scatter", cluster, ranks, b)
        for b in units
    )
    calls = 3 * len(units)
    return OverheadSample(
        "fsdp", mbs, calls, 3 * sum(units) / calls, measured, local, network, max(measured - local - network, 0.0)
    )


def fit_tp(samples: Sequence[OverheadSample]) -> Tuple[float, float]:
    """(seconds per call, seconds per byte) >= 0 with ``extra_s / calls = a + b * nbytes``."""
    if not samples:
        return 0.0, 0.0
    return nonnegative_lstsq(
        [1.0] * len(samples), [s.nbytes for s in samples], [s.extra_s / max(s.calls, 1) for s in samples]
    )


def fit_fsdp(sample: OverheadSample) -> Tuple[float, float]:
    """(0, seconds per byte moved by the FSDP collectives)."""
    moved = sample.nbytes * sample.calls
    return 0.0, (sample.extra_s / moved if moved else 0.0)


def _measure_rank(model_name: str, cluster_dict: dict, microbatches: List[int]) -> List[dict]:
    init_distributed()
    torch.set_num_threads(1)
    cluster = Cluster.from_dict(cluster_dict)
    workload = workload_for_model(model_name, cluster, dtype=torch.float32, attention="traced")
    samples = measure_tp(model_name, workload, cluster, microbatches) + [measure_fsdp(model_name, workload, cluster)]
    return [asdict(s) for s in samples]


def measure_runtime_overheads(
    model_name: str, cluster: Cluster, *, nproc: int = 2, microbatches: Sequence[int] = (1, 4), timeout: float = 600.0
) -> RuntimeOverheads:
    """Measure and fit both overheads for ``model_name`` (fp32) on ``nproc`` spawned local ranks
    (CPU, gloo), against ``cluster``'s collective model: calibrate the cluster first, the
    overhead is what its network model leaves unexplained."""
    if nproc < 2:
        raise CalibrationError(f"nproc={nproc}: measuring collective overheads needs at least 2 ranks")
    rows = launch(_measure_rank, nproc, model_name, cluster.to_dict(), list(microbatches), timeout=timeout)[0]
    samples = [OverheadSample(**r) for r in rows]
    tp = [s for s in samples if s.path == "tp"]
    fsdp = next(s for s in samples if s.path == "fsdp")
    return RuntimeOverheads(fit_tp(tp), fit_fsdp(fsdp), samples)
