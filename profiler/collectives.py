"""Measure collectives per network level and fit the cluster's bandwidth and latency to them.

Under ``torch.distributed`` (torchrun, or ranks spawned by :func:`calibrate`), for each network
level ``L`` of the cluster that the world reaches, the ranks form one group that crosses ``L``
and nothing above it: one rank per level-``(L-1)`` domain (``[0, g, 2g, ...]`` with ``g`` the
inner level's group size), or the first ranks for the innermost level. Every rank joins every
call (a rank outside the group just waits at the barriers). Each (kind, size) is timed as the
mean of ``repeats`` back-to-back calls after ``warmup`` calls, and the slowest rank's figure is
kept (a collective ends when its last rank does). p2p is a ping-pong between the group's first
two ranks (half the round trip).

The fit never restates a formula: :func:`nest_fx.cost.collectives.collective_time` is linear in
one level's latency and inverse bandwidth when the others are fixed, so its coefficients are
read off by evaluating it with unit values (latency 1 and infinite bandwidth, then latency 0
and bandwidth 1). Inner levels are fitted first and their share is subtracted from the outer
levels' samples. The fit minimises relative error (weighted least squares), so small and large
messages count alike.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from nest_fx.apply.distributed import init_distributed
from nest_fx.apply.launch import launch
from nest_fx.cluster import Cluster
from nest_fx.cluster.hierarchical_collectives import path_bandwidth
from nest_fx.common.errors import NestFxError
from nest_fx.cost.collectives import collective_time, p2p

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
_HUGE_BW = 1e30


class CalibrationError(NestFxError, ValueError):
    """Collectives cannot be measured or fitted as asked (too few ranks, no level to fit, a
    sample set no alpha-beta model fits); the message names the fix."""


@dataclass
class Sample:
    """One measured collective: ``seconds`` for ``kind`` over ``ranks`` on ``nbytes`` (full buffer)."""

    level: int
    kind: str
    ranks: List[int]
    nbytes: float
    seconds: float


def level_groups(cluster: Cluster, world: int) -> Dict[int, List[int]]:
    """{level index: ranks} of the group that measures each level reachable with ``world`` ranks."""
    groups: Dict[int, List[int]] = {}
    for i, level in enumerate(cluster.levels):
        inner = cluster.levels[i - 1].group_size if i else 1
        size = min(level.group_size, world)
        ranks = list(range(0, size, inner))
        if len(ranks) >= 2:
            groups[i] = ranks
    return groups


def _run(kind: str, buf: torch.Tensor, out: torch.Tensor, group, ranks: List[int], rank: int) -> None:
    if kind == "all_reduce":
        dist.all_reduce(buf, group=group)
    elif kind == "all_gather":
        dist.all_gather_single(out, buf, group=group)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_single(out, buf, group=group)
    elif kind == "all_to_all":
        dist.all_to_all_single(out, buf, group=group)
    elif kind == "p2p":
        a, b = ranks[0], ranks[1]
        if rank == a:
            dist.send(buf, b)
            dist.recv(buf, b)
        elif rank == b:
            dist.recv(buf, a)
            dist.send(buf, a)
    else:
        raise CalibrationError(f"unknown collective {kind!r}; use one of {KINDS}")


def _buffers(kind: str, nbytes: int, n: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(input, output) for a collective whose *full* buffer is ``nbytes`` (the cost model's S)."""
    elems = max(n, int(nbytes) // 4 // n * n)
    if kind == "all_gather":
        return torch.ones(elems // n, device=device), torch.empty(elems, device=device)
    if kind == "reduce_scatter":
        return torch.ones(elems, device=device), torch.empty(elems // n, device=device)
    return torch.ones(elems, device=device), torch.empty(elems, device=device)


def measure_collectives(
    cluster: Cluster, sizes: Sequence[int], kinds: Sequence[str] = KINDS, *, warmup: int = 2, repeats: int = 5
) -> List[Sample]:
    """Time every (level, kind, size) on the initialised default process group; every rank must
    call it, and every rank gets the same samples. ``sizes`` in bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    samples: List[Sample] = []
    for level, ranks in level_groups(cluster, world).items():
        group = dist.new_group(ranks)
        member = rank in ranks
        for kind in kinds:
            for nbytes in sizes:
                buf, out = _buffers(kind, nbytes, len(ranks), device)
                real_bytes = buf.numel() * 4 * (len(ranks) if kind == "all_gather" else 1)
                dist.barrier()
                elapsed = 0.0
                if member:
                    for _ in range(warmup):
                        _run(kind, buf, out, group, ranks, rank)
                    _sync(device)
                    start = time.perf_counter()
                    for _ in range(repeats):
                        _run(kind, buf, out, group, ranks, rank)
                    _sync(device)
                    elapsed = (time.perf_counter() - start) / repeats
                if kind == "p2p":
                    elapsed /= 2  # a ping-pong is two transfers
                slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                samples.append(Sample(level, kind, list(ranks), float(real_bytes), float(slowest.item())))
        dist.barrier()
    return samples


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class LevelFit:
    """Fitted figures of one level and how well they reproduce the samples."""

    level: str
    bandwidth: float  # bytes/s
    latency: float  # s
    samples: int
    mean_abs_error: float  # relative, over the samples of this level


def model_time(kind: str, cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """The cost model's seconds for a sample (p2p: from the group's first rank to its second)."""
    if kind == "p2p":
        return p2p(cluster, ranks[0], ranks[1], nbytes)
    return collective_time(kind, cluster, ranks, nbytes)


def _with_level(
    cluster: Cluster, index: int, latency: float, bandwidth: float, zero_levels: Sequence[int] = ()
) -> Cluster:
    c = copy.deepcopy(cluster)
    c.levels[index].latency, c.levels[index].bandwidth = latency, bandwidth
    for j in zero_levels:
        c.levels[j].latency, c.levels[j].bandwidth = 0.0, _HUGE_BW
    return c


def fit_cluster(cluster: Cluster, samples: Sequence[Sample]) -> Tuple[Cluster, List[LevelFit]]:
    """A copy of ``cluster`` whose measured levels carry fitted bandwidth and latency."""
    fitted = copy.deepcopy(cluster)
    fits: List[LevelFit] = []
    for index in sorted({s.level for s in samples}):
        rows = [s for s in samples if s.level == index and s.seconds > 0]
        if not rows:
            continue
        a, b, y = [], [], []
        # The model is linear in this level's 1/B while the level is its paths' bottleneck
        # (hierarchical_collectives.path_bandwidth): the rest of a sample's time is read at
        # B = the inner levels' path bandwidth, minus this level's share there.
        reference = path_bandwidth(fitted.levels, index - 1) if index else _HUGE_BW
        for s in rows:
            kind = s.kind
            c_lat = model_time(kind, _with_level(fitted, index, 1.0, _HUGE_BW, range(index)), s.ranks, s.nbytes)
            c_inv_bw = model_time(kind, _with_level(fitted, index, 0.0, 1.0, range(index)), s.ranks, s.nbytes)
            inner = (
                model_time(kind, _with_level(fitted, index, 0.0, reference), s.ranks, s.nbytes) - c_inv_bw / reference
            )
            a.append(c_lat / s.seconds)
            b.append(c_inv_bw / s.seconds)
            y.append(1.0 - inner / s.seconds)
        latency, inv_bw = nonnegative_lstsq(a, b, y)
        bandwidth = 1.0 / inv_bw if inv_bw > 0 else fitted.levels[index].bandwidth
        fitted.levels[index].latency, fitted.levels[index].bandwidth = latency, bandwidth
        errors = [abs(model_time(s.kind, fitted, s.ranks, s.nbytes) - s.seconds) / s.seconds for s in rows]
        fits.append(LevelFit(fitted.levels[index].name, bandwidth, latency, len(rows), sum(errors) / len(errors)))
    fitted.validate()
    return fitted, fits


def nonnegative_lstsq(a: List[float], b: List[float], y: List[float]) -> Tuple[float, float]:
    """argmin ||x1*a + x2*b - y|| over x1, x2 >= 0 (two unknowns: check the interior, then the edges)."""
    saa = sum(v * v for v in a)
    sbb = sum(v * v for v in b)
    sab = sum(u * v for u, v in zip(a, b))
    say = sum(u * v for u, v in zip(a, y))
    sby = sum(u * v for u, v in zip(b, y))
    det = saa * sbb - sab * sab
    candidates = []
    if det > 0:
        x1, x2 = (say * sbb - sby * sab) / det, (sby * saa - say * sab) / det
        if x1 >= 0 and x2 >= 0:
            candidates.append((x1, x2))
    candidates.append((max(say / saa, 0.0) if saa else 0.0, 0.0))
    candidates.append((0.0, max(sby / sbb, 0.0) if sbb else 0.0))

    def loss(x):
        return sum((x[0] * u + x[1] * v - t) ** 2 for u, v, t in zip(a, b, y))

    return min(candidates, key=loss)


def _calibrate_rank(cluster_dict: dict, sizes: List[int], kinds: List[str], warmup: int, repeats: int) -> List[dict]:
    init_distributed()
    cluster = Cluster.from_dict(cluster_dict)
    return [asdict(s) for s in measure_collectives(cluster, sizes, kinds, warmup=warmup, repeats=repeats)]


def calibrate(
    cluster: Cluster,
    *,
    nproc: int = 2,
    sizes: Sequence[int] = (2**12, 2**16, 2**20, 2**22, 2**24),
    kinds: Sequence[str] = KINDS,
    warmup: int = 2,
    repeats: int = 5,
    timeout: float = 600.0,
) -> Tuple[Cluster, List[LevelFit], List[Sample]]:
    """Measure collectives and fit ``cluster``'s levels. Under torchrun (the default group is
    initialised) the world measures itself; otherwise ``nproc`` local gloo ranks are spawned."""
    if dist.is_available() and dist.is_initialized():
        samples = measure_collectives(cluster, sizes, kinds, warmup=warmup, repeats=repeats)
    else:
        if nproc < 2:
            raise CalibrationError(f"--nproc {nproc}: calibration needs at least 2 ranks")
        rows = launch(
            _calibrate_rank, nproc, cluster.to_dict(), list(sizes), list(kinds), warmup, repeats, timeout=timeout
        )[0]
        samples = [Sample(**r) for r in rows]
    if not samples:
        raise CalibrationError(f"{nproc} ranks reach no network level of {cluster.name} with two or more ranks")
    fitted, fits = fit_cluster(cluster, samples)
    return fitted, fits, samples
