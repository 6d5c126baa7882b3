"""Pairwise p2p calibration: bandwidth and latency between every pair of ranks, as a graph topology.

Under ``torch.distributed`` (torchrun, or ranks spawned by :func:`calibrate_pairwise`) every
unordered pair of ranks (i, j), i < j, in turn runs a ping-pong of ``nbytes`` (i sends, j sends
back) for each message size: ``warmup`` untimed round trips, then the median of ``repeats`` timed
ones, halved (one transfer); the median, because one descheduled trip on a shared machine would
make a small message look slower than a large one. Every rank joins every barrier; the figure is shared with an
all-reduce, so every rank gets the same samples. Directions are assumed symmetric (a ping-pong
cannot tell them apart); the sample is recorded for (i, j) and
:func:`nest_fx.cluster.topology.calibrate` uses it both ways.

The fit never restates the cost formula: :func:`nest_fx.cluster.topology.p2p_time` on a one-link
topology is evaluated with unit latency (and no bandwidth limit) and with unit inverse
bandwidth (and no latency) to read off the coefficients of latency and 1/bandwidth for each
size; the two are fitted per pair by non-negative least squares on the relative error
(``profiler.collectives.nonnegative_lstsq``), so small and large messages count alike.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from nest_fx.apply.distributed import init_distributed
from nest_fx.apply.launch import launch
from nest_fx.cluster import DeviceSpec
from nest_fx.cluster.topology import Link, Topology, calibrate, p2p_time
from profiler.collectives import CalibrationError, nonnegative_lstsq

DEFAULT_SIZES = (2**12, 2**16, 2**20, 2**22)
_HUGE_BW = 1e30
_UNIT_DEVICE = DeviceSpec("unit", 1, {"fp32": 1.0}, 1.0)


@dataclass
class PairSample:
    """One measured transfer: ``seconds`` to move ``nbytes`` between ranks ``src`` and ``dst``."""

    src: int
    dst: int
    nbytes: float
    seconds: float


@dataclass
class PairFit:
    """Fitted figures of one pair and how well they reproduce its samples."""

    src: int
    dst: int
    bandwidth: float  # bytes/s
    latency: float  # s
    samples: int
    mean_abs_error: float  # relative


def measure_pairs(
    sizes: Sequence[int], *, warmup: int = 2, repeats: int = 5, pairs: Optional[Sequence[Tuple[int, int]]] = None
) -> List[PairSample]:
    """Ping-pong every pair (default: all i < j of the world) at every size (bytes) on the
    initialised default group; every rank must call it and gets the same samples."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    pairs = list(pairs) if pairs is not None else list(itertools.combinations(range(world), 2))
    samples: List[PairSample] = []
    for a, b in pairs:
        for nbytes in sizes:
            buf = torch.ones(max(1, int(nbytes) // 4), device=device)
            dist.barrier()
            elapsed = 0.0
            if rank in (a, b):
                peer = b if rank == a else a
                trips = []
                for i in range(warmup + repeats):
                    _sync(device)
                    start = time.perf_counter()
                    if rank == a:
                        dist.send(buf, peer)
                        dist.recv(buf, peer)
                    else:
                        dist.recv(buf, peer)
                        dist.send(buf, peer)
                    _sync(device)
                    if i >= warmup:
                        trips.append(time.perf_counter() - start)
                # the median round trip: one descheduled trip on a shared machine would otherwise make a
                # small message look slower than a large one; a round trip is two transfers
                elapsed = statistics.median(trips) / 2
            shared = torch.tensor([elapsed], dtype=torch.float64, device=device)
            dist.all_reduce(shared, op=dist.ReduceOp.MAX)
            samples.append(PairSample(a, b, float(buf.numel() * 4), float(shared.item())))
    dist.barrier()
    return samples


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model_seconds(nbytes: float, bandwidth: float, latency: float) -> float:
    """The graph model's p2p seconds over one link of these figures."""
    link = Topology("pair", _UNIT_DEVICE, 2, [], [Link(0, 1, bandwidth, latency)])
    return p2p_time(link, 0, 1, nbytes)


def fit_pairs(samples: Sequence[PairSample]) -> List[PairFit]:
    """Per measured pair, the (bandwidth, latency) that reproduce its samples best."""
    by_pair: Dict[Tuple[int, int], List[PairSample]] = {}
    for s in samples:
        if s.seconds > 0:
            by_pair.setdefault((s.src, s.dst), []).append(s)
    fits = []
    for (src, dst), rows in sorted(by_pair.items()):
        a = [_model_seconds(s.nbytes, _HUGE_BW, 1.0) / s.seconds for s in rows]  # latency coefficient
        b = [_model_seconds(s.nbytes, 1.0, 0.0) / s.seconds for s in rows]  # 1/bandwidth coefficient
        latency, inv_bw = nonnegative_lstsq(a, b, [1.0] * len(rows))
        if inv_bw <= 0:  # every size took the same time: the pair is latency-bound at these sizes
            raise CalibrationError(
                f"pair ({src}, {dst}): no bandwidth term fits the samples; measure larger messages "
                f"(--sizes-kib up to 16384 or more)"
            )
        bandwidth = 1.0 / inv_bw
        errors = [abs(_model_seconds(s.nbytes, bandwidth, latency) - s.seconds) / s.seconds for s in rows]
        fits.append(PairFit(src, dst, bandwidth, latency, len(rows), sum(errors) / len(errors)))
    return fits


def _pairwise_rank(sizes: List[int], warmup: int, repeats: int) -> List[dict]:
    init_distributed()
    return [asdict(s) for s in measure_pairs(sizes, warmup=warmup, repeats=repeats)]


def calibrate_pairwise(
    *,
    nproc: int = 2,
    sizes: Sequence[int] = DEFAULT_SIZES,
    base: Optional[Topology] = None,
    device: Optional[DeviceSpec] = None,
    warmup: int = 2,
    repeats: int = 5,
    timeout: float = 600.0,
    name: Optional[str] = None,
) -> Tuple[Topology, List[PairFit], List[PairSample]]:
    """Measure every pair of ranks and build a topology from the fits
    (:func:`nest_fx.cluster.topology.calibrate`): with ``base``, its routes derated to the measured
    figures; without, direct links between the measured ranks (``device`` required). Under
    torchrun (the default group initialised) the world measures itself; otherwise ``nproc``
    local gloo ranks are spawned."""
    if base is None and device is None:
        raise CalibrationError("calibrate_pairwise: give the base topology or the device spec of the measured ranks")
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        samples = measure_pairs(sizes, warmup=warmup, repeats=repeats)
    else:
        if nproc < 2:
            raise CalibrationError(f"--nproc {nproc}: pairwise calibration needs at least 2 ranks")
        world = nproc
        rows = launch(_pairwise_rank, nproc, list(sizes), warmup, repeats, timeout=timeout)[0]
        samples = [PairSample(**r) for r in rows]
    if base is not None and base.num_devices < world:
        raise CalibrationError(
            f"the base topology has {base.num_devices} devices but {world} ranks were measured: "
            f"give a topology with at least {world} devices"
        )
    fits = fit_pairs(samples)
    measured = {(f.src, f.dst): (f.bandwidth, f.latency) for f in fits}
    topo = calibrate(
        measured, base, device=device, name=name or (f"{base.name}+measured" if base else f"measured-{world}-ranks")
    )
    return topo, fits, samples
