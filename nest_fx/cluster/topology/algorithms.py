"""Collective and point-to-point times on a graph topology, with contention between groups.

A collective is a *schedule*: a list of steps, each a list of tasks that run at the same time.
A task is a set of flows (``(src, dst)`` device pairs) and a time formula of their rates ``r``
(bytes/s, :mod:`nest_fx.cluster.topology.contention`) and route latencies ``a`` (s):

    ring pass (reduce-scatter / all-gather of an S-byte buffer over n devices, ring order):
        (n-1)/n * S / min r + (n-1) * max a                      (Thakur et al. 2005)
    ring broadcast (binomial scatter + ring all-gather):
        2(n-1)/n * S / min r + (ceil(log2 n) + n-1) * max a      (Thakur et al. 2005, sec. 4.1)
    exchange (one sender, s bytes to each of its peers):
        max_p s / r_p + sum_p a_p

A group's step time is its slowest task; its time is the sum of its steps. Groups given
together run their step k at the same time (lock-step), so all their step-k flows share links.

Algorithms, on a group partitioned by the topology's hierarchy (:meth:`Topology.hierarchy`;
device ``d`` is in block ``d // group_size`` of a level):

* reduce-scatter / all-gather: the cheaper (by the slowest group) of a flat ring over the
  devices in ascending order and the hierarchical ring: at level i, inside each block, ring j
  joins the j-th device of every sub-block on the shard ``S / m_{i-1}`` (``m`` = fewest group
  devices in one block of the level below). All-reduce is twice the reduce-scatter. On a
  :func:`~nest_fx.cluster.topology.generators.from_cluster` graph the hierarchical ring reproduces
  :mod:`nest_fx.cost.collectives` exactly.
* all-to-all (``S`` sent per device): ``"staged"`` (default) mirrors the hierarchical model: at
  each level with fan-out > 1 a device sends the ``(1 - m_{i-1}/n) S`` bytes that leave its
  sub-block, split evenly over its peers in the block outside its sub-block; ``"pairwise"``
  sends ``S/n`` to every other device at once (one step); ``"best"`` takes the cheaper.
* broadcast: per level, outermost first, a ring broadcast among the first device of every
  sub-block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Sequence, Tuple, Union

from nest_fx.cluster.topology.contention import concurrent_flows
from nest_fx.cluster.topology.routing import router_of
from nest_fx.cluster.topology.model import Topology, TopologyError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
ALL_TO_ALL = ("staged", "pairwise", "best")
Flow = Tuple[int, int]
Figures = Sequence[Tuple[float, float]]  # (rate bytes/s, latency s) per flow of a task


@dataclass(frozen=True)
class RingPass:
    """One ring reduce-scatter or all-gather of ``nbytes`` (full buffer) over ``members``."""

    members: Tuple[int, ...]
    nbytes: float

    def flows(self) -> List[Flow]:
        m, n = self.members, len(self.members)
        return [(m[k], m[(k + 1) % n]) for k in range(n)]

    def terms(self, figs: Figures) -> Tuple[float, float]:
        """(latency seconds, transfer seconds of ``nbytes``) given the flows' figures."""
        n = len(self.members)
        rate, lat = min(f[0] for f in figs), max(f[1] for f in figs)
        return (n - 1) * lat, (n - 1) / n * self.nbytes / rate

    def time(self, figs: Figures) -> float:
        lat, transfer = self.terms(figs)
        return transfer + lat


@dataclass(frozen=True)
class RingBroadcast(RingPass):
    """Scatter + ring all-gather of ``nbytes`` from ``members[0]`` (van de Geijn)."""

    def terms(self, figs: Figures) -> Tuple[float, float]:
        n = len(self.members)
        rate, lat = min(f[0] for f in figs), max(f[1] for f in figs)
        return (math.ceil(math.log2(n)) + n - 1) * lat, 2 * (n - 1) / n * self.nbytes / rate


@dataclass(frozen=True)
class Exchange:
    """``sender`` sends ``nbytes`` to each of ``peers`` at once."""

    sender: int
    peers: Tuple[int, ...]
    nbytes: float

    def flows(self) -> List[Flow]:
        return [(self.sender, p) for p in self.peers]

    def terms(self, figs: Figures) -> Tuple[float, float]:
        """(latency seconds, transfer seconds of ``nbytes``) given the flows' figures."""
        return sum(f[1] for f in figs), max(self.nbytes / f[0] for f in figs)

    def time(self, figs: Figures) -> float:
        lat, transfer = self.terms(figs)
        return transfer + lat


Task = Union[RingPass, Exchange]
Schedule = List[List[Task]]


class LevelSplit(NamedTuple):
    """A group seen at one hierarchy level: its blocks, each a list of sub-blocks (sorted)."""

    blocks: List[List[List[int]]]
    fanout: int  # most sub-blocks in one block
    min_members: int  # fewest group devices in one block


def split_by_levels(devices: Sequence[int], sizes: Sequence[int]) -> List[LevelSplit]:
    """Per level (innermost first, up to the first level holding the whole group) the group's
    blocks and sub-blocks; ``sizes`` are the cumulative group sizes of the hierarchy."""
    out: List[LevelSplit] = []
    inner = 1
    for size in sizes:
        blocks: Dict[int, Dict[int, List[int]]] = {}
        for d in sorted(devices):
            blocks.setdefault(d // size, {}).setdefault(d // inner, []).append(d)
        subs = [list(b.values()) for _, b in sorted(blocks.items())]
        out.append(LevelSplit(subs, max(len(b) for b in subs), min(sum(map(len, b)) for b in subs)))
        if len(blocks) == 1:
            break
        inner = size
    return out


def ring_schedule(devices: Sequence[int], nbytes: float, sizes: Sequence[int]) -> Schedule:
    """Hierarchical ring reduce-scatter (or, mirrored, all-gather): one step per spanned level."""
    steps: Schedule = []
    shard = nbytes
    for level in split_by_levels(devices, sizes):
        rings: List[Task] = []
        for block in level.blocks:
            for j in range(max(map(len, block))):
                ring = tuple(sub[j] for sub in block if j < len(sub))
                if len(ring) > 1:
                    rings.append(RingPass(ring, shard))
        if rings:
            steps.append(rings)
        shard = nbytes / level.min_members
    return steps


def staged_all_to_all(devices: Sequence[int], nbytes: float, sizes: Sequence[int]) -> Schedule:
    """All-to-all charged like the hierarchical model (see module docstring)."""
    n = len(devices)
    steps: Schedule = []
    inner_min = 1
    for level in split_by_levels(devices, sizes):
        if level.fanout > 1:
            leaving = (1 - inner_min / n) * nbytes
            tasks: List[Task] = []
            for block in level.blocks:
                for k, sub in enumerate(block):
                    others = tuple(d for k2, s2 in enumerate(block) if k2 != k for d in s2)
                    tasks.extend(Exchange(x, others, leaving / len(others)) for x in sub if others)
            steps.append(tasks)
        inner_min = level.min_members
    return steps


def pairwise_all_to_all(devices: Sequence[int], nbytes: float) -> Schedule:
    """Every device sends ``nbytes / n`` to every other device, all at once."""
    ds = sorted(devices)
    n = len(ds)
    return [[Exchange(x, tuple(d for d in ds if d != x), nbytes / n) for x in ds]]


def broadcast_schedule(devices: Sequence[int], nbytes: float, sizes: Sequence[int]) -> Schedule:
    """Hierarchical broadcast, outermost level first, among the first device of each sub-block."""
    steps: Schedule = []
    for level in reversed(split_by_levels(devices, sizes)):
        rings: List[Task] = [
            RingBroadcast(tuple(sub[0] for sub in block), nbytes) for block in level.blocks if len(block) > 1
        ]
        if rings:
            steps.append(rings)
    return steps


def run_schedules(topo: Topology, schedules: Sequence[Schedule]) -> List[float]:
    """Seconds of each schedule when all run together in lock-step (step k with step k)."""
    totals = [0.0] * len(schedules)
    for k in range(max((len(s) for s in schedules), default=0)):
        tasks = [(g, t, t.flows()) for g, s in enumerate(schedules) if k < len(s) for t in s[k]]
        figs = concurrent_flows(router_of(topo), [f for _, _, flows in tasks for f in flows])
        step = [0.0] * len(schedules)
        pos = 0
        for g, task, flows in tasks:
            step[g] = max(step[g], task.time(figs[pos : pos + len(flows)]))
            pos += len(flows)
        totals = [a + b for a, b in zip(totals, step)]
    return totals


def _check_bytes(nbytes: object, path: str) -> float:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise TopologyError(f"{path}: must be a finite number of bytes >= 0, got {nbytes!r}")
    return float(nbytes)


def _candidates(kind: str, devices: List[int], nbytes: float, sizes: List[int], all_to_all: str) -> List[Schedule]:
    """The algorithms to try for one group, each as a schedule ([] = nothing to do)."""
    if len(devices) <= 1 or nbytes == 0:
        return [[]]
    if kind == "all_to_all":
        staged = [staged_all_to_all(devices, nbytes, sizes)] if all_to_all != "pairwise" else []
        pairwise = [pairwise_all_to_all(devices, nbytes)] if all_to_all != "staged" else []
        return staged + pairwise
    if kind == "broadcast":
        return [broadcast_schedule(devices, nbytes, sizes)]
    hier = ring_schedule(devices, nbytes, sizes)
    if len(hier) <= 1:  # one spanned level: the hierarchical ring is the flat ring
        return [hier]
    return [hier, [[RingPass(tuple(sorted(devices)), nbytes)]]]


def concurrent_times(
    kind: str,
    topo: Topology,
    groups: Sequence[Sequence[int]],
    nbytes: Union[float, Sequence[float]],
    *,
    all_to_all: str = "staged",
) -> List[float]:
    """Seconds of collective ``kind`` for each device group when all groups run at once.

    ``nbytes`` is one size for every group or one per group (the full buffer for
    reduce-scatter/all-gather/all-reduce/broadcast, the per-device send buffer for all-to-all).
    Every group uses the same algorithm; the one with the smallest slowest-group time is kept.
    """
    if kind not in KINDS:
        raise TopologyError(f"unknown collective kind {kind!r}; expected one of {sorted(KINDS)}")
    if all_to_all not in ALL_TO_ALL:
        raise TopologyError(f"all_to_all: {all_to_all!r}, use one of {ALL_TO_ALL}")
    sizes_per_group = [nbytes] * len(groups) if not isinstance(nbytes, Sequence) else list(nbytes)
    if len(sizes_per_group) != len(groups):
        raise TopologyError(f"nbytes: {len(sizes_per_group)} sizes for {len(groups)} groups")
    seen: set = set()
    cands = []
    sizes = [lv.group_size for lv in topo.hierarchy()]
    for i, (group, size) in enumerate(zip(groups, sizes_per_group)):
        devices = topo.check_devices(group, f"groups[{i}]")
        if seen.intersection(devices):
            raise TopologyError(
                f"groups[{i}]: shares devices with an earlier group; concurrent groups must be disjoint"
            )
        seen.update(devices)
        cands.append(_candidates(kind, devices, _check_bytes(size, f"nbytes[{i}]"), sizes, all_to_all))
    best: List[float] = [0.0] * len(groups)
    for a in range(max((len(c) for c in cands), default=0)):
        times = run_schedules(topo, [c[min(a, len(c) - 1)] for c in cands])
        if a == 0 or max(times) < max(best):
            best = times
    return [2 * t for t in best] if kind == "all_reduce" else best


def concurrent_collective_time(
    kind: str,
    topo: Topology,
    groups: Sequence[Sequence[int]],
    nbytes: Union[float, Sequence[float]],
    *,
    all_to_all: str = "staged",
) -> float:
    """Seconds until the last of ``groups`` finishes collective ``kind``, all started together."""
    return max(concurrent_times(kind, topo, groups, nbytes, all_to_all=all_to_all), default=0.0)


class CostCurve:
    """Seconds of one collective over one group alone, as a function of the buffer size S.

    Every task of a schedule moves a fixed fraction of S and its time is
    ``latency terms + transfer terms`` with the transfer linear in its bytes (``terms`` of the
    task classes), so a schedule costs ``sum over steps of max over tasks (a + b * S)``. The
    routes and rates (the expensive part) are resolved once, when the curve is built; a size
    then costs O(distinct task figures). All-reduce is twice the reduce-scatter curve.
    """

    __slots__ = ("schedules", "factor")

    def __init__(self, schedules: Sequence[Sequence[Sequence[Tuple[float, float]]]], factor: float = 1.0) -> None:
        self.schedules = [[_undominated(step) for step in steps] for steps in schedules]
        self.factor = factor

    def __call__(self, nbytes: float) -> float:
        nbytes = _check_bytes(nbytes, "nbytes")
        if nbytes == 0 or not self.schedules:
            return 0.0
        best = min(sum(max(a + b * nbytes for a, b in step) for step in steps) for steps in self.schedules)
        return self.factor * best


def _undominated(pieces: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The (a, b) pieces that can be the largest for some S >= 0: a piece with a <= a' and
    b <= b' for another piece (a', b') never is, and is dropped (the max is unchanged)."""
    out: List[Tuple[float, float]] = []
    for a, b in sorted(set(pieces), reverse=True):  # a descending: dominated iff an earlier piece has b' >= b
        if not out or b > out[-1][1]:  # the kept pieces' b increase, the last is the largest
            out.append((a, b))
    return out


def collective_curve(kind: str, topo: Topology, devices: Sequence[int], *, all_to_all: str = "staged") -> CostCurve:
    """The :class:`CostCurve` of collective ``kind`` over ``devices`` alone on the topology."""
    if kind not in KINDS:
        raise TopologyError(f"unknown collective kind {kind!r}; expected one of {sorted(KINDS)}")
    if all_to_all not in ALL_TO_ALL:
        raise TopologyError(f"all_to_all: {all_to_all!r}, use one of {ALL_TO_ALL}")
    members = topo.check_devices(devices, "groups[0]")
    if len(members) <= 1:
        return CostCurve([])
    sizes = [lv.group_size for lv in topo.hierarchy()]
    schedules = []
    for schedule in _candidates(kind, members, 1.0, sizes, all_to_all):  # tasks move fractions of 1 byte
        steps = []
        for step in schedule:
            figs = concurrent_flows(router_of(topo), [f for task in step for f in task.flows()])
            pieces, pos = [], 0
            for task in step:
                n = len(task.flows())
                pieces.append(task.terms(figs[pos : pos + n]))
                pos += n
            steps.append(pieces)
        schedules.append(steps)
    return CostCurve(schedules, 2.0 if kind == "all_reduce" else 1.0)


def collective_time(
    kind: str, topo: Topology, devices: Sequence[int], nbytes: float, *, all_to_all: str = "staged"
) -> float:
    """Seconds of collective ``kind`` over ``devices`` alone on the topology."""
    nbytes = _check_bytes(nbytes, "nbytes")
    return collective_curve(kind, topo, devices, all_to_all=all_to_all)(nbytes)


def p2p_time(topo: Topology, src: int, dst: int, nbytes: float) -> float:
    """``latency + nbytes / bandwidth`` of the route src -> dst; 0 when src == dst or no bytes."""
    ends = topo.check_devices([src] if src == dst else [src, dst], "p2p ranks")
    nbytes = _check_bytes(nbytes, "nbytes")
    if len(ends) == 1 or nbytes == 0:
        return 0.0
    src, dst = ends
    route = router_of(topo).route(src, dst)
    return route.latency + nbytes / route.bandwidth
