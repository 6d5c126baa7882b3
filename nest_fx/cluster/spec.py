"""Cluster description: one device type and a hierarchy of network levels (``format: nest-fx-cluster/1``).

The hierarchy follows NEST (Wang et al., "NEST: Network- and Memory-Aware Device Placement for
Distributed Deep Learning"): levels are listed innermost first (e.g. node, rack, spine); a
level's ``group_size`` is the cumulative number of devices in one group at that level, so with
``node=8, rack=32`` a rack holds 4 nodes. Rank ``r`` is device ``r`` of the hierarchy: at level
``i`` it belongs to group ``r // levels[i].group_size``.

Units are SI throughout: bytes, seconds, bytes/s, FLOP/s. ``bandwidth`` is bytes/s per device
per direction through that level's fabric; ``latency`` is the per-message start-up time (the
alpha of the alpha-beta model). File values may be numbers or strings such as ``"80GiB"``,
``"300GB/s"``, ``"200Gb/s"``, ``"5us"`` or ``"312TFLOPS"`` (see :func:`parse_quantity`).
See docs/cluster_format.md.

This module: :class:`Cluster` (the hierarchy, where rank sets sit on it, its network model and
its file form); its parts are in ``hardware`` and the field checks in ``fields``.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Sequence, Tuple

import numpy as np
import yaml

from nest_fx.cluster import hierarchical_collectives
from nest_fx.cluster.errors import ClusterError
from nest_fx.cluster.fields import check_keys, check_name, check_positive_int, prefixed
from nest_fx.cluster.hardware import DeviceSpec, NetworkLevel  # the parts of a Cluster; imported from here too
from nest_fx.cluster.kernel_rates import KernelRates
from nest_fx.cluster.quantities import parse_quantity
from nest_fx.common.fileio import brief, read_document
from nest_fx.common.limits import MAX_COUNT
from nest_fx.common.names import close_matches

CLUSTER_FORMAT = "nest-fx-cluster/1"
GiB = 2**30
MAX_DEVICES = MAX_COUNT  # 16.7 M devices: far past any cluster built, small enough to plan for

SPAN_MEMO_LIMIT = 65_536  # rank sets whose span a cluster keeps
SMALL_GROUP = 64  # rank sets up to this size are resolved in Python, larger ones with numpy

PRESETS: Dict[str, Callable[[int], "Cluster"]] = {}
"""Named clusters by their builder (``devices -> Cluster``); ``nest_fx.cluster.presets`` fills it."""


class LevelSpan(NamedTuple):
    """How a rank set spreads over one level (see :meth:`Cluster.span`).

    ``fanout``: the most distinct level-(i-1) groups found inside one level-i group that holds
    ranks of the set. ``max_ranks``/``min_ranks``: the most/fewest ranks of the set inside one
    such level-i group.
    """

    level: NetworkLevel
    fanout: int
    max_ranks: int
    min_ranks: int


@dataclass
class Cluster:
    """``num_devices`` identical devices on a hierarchy of network levels (innermost first)."""

    name: str
    device: DeviceSpec
    num_devices: int
    levels: List[NetworkLevel]

    def __post_init__(self) -> None:
        self.validate()
        self._span_memo: Dict[tuple, List[LevelSpan]] = {}

    def validate(self) -> None:
        """Check fields and the hierarchy: group sizes strictly increasing, each dividing the next,
        the outermost one >= num_devices. Errors name the field path."""
        check_name(self.name, "name")
        if not isinstance(self.device, DeviceSpec):
            raise ClusterError(f"device: must be a DeviceSpec, got {type(self.device).__name__}")
        self.device.validate("device.")
        check_positive_int(self.num_devices, "num_devices", MAX_DEVICES)
        if not isinstance(self.levels, list) or not self.levels:
            raise ClusterError("levels: must be a non-empty list of network levels, innermost first")
        for i, level in enumerate(self.levels):
            if not isinstance(level, NetworkLevel):
                raise ClusterError(f"levels[{i}]: must be a NetworkLevel, got {type(level).__name__}")
            level.validate(f"levels[{i}].")
        for i in range(1, len(self.levels)):
            inner, outer = self.levels[i - 1].group_size, self.levels[i].group_size
            if outer <= inner:
                raise ClusterError(
                    f"levels[{i}].group_size: must be greater than levels[{i - 1}].group_size "
                    f"({inner}), got {outer} (group sizes are cumulative device counts)"
                )
            if outer % inner:
                raise ClusterError(
                    f"levels[{i}].group_size: must be a multiple of levels[{i - 1}].group_size ({inner}), got {outer}"
                )
        top = len(self.levels) - 1
        if self.levels[top].group_size < self.num_devices:
            raise ClusterError(
                f"levels[{top}].group_size: the outermost level must hold all "
                f"{self.num_devices} devices (num_devices), got {self.levels[top].group_size}"
            )

    # -- placement -------------------------------------------------------------------------
    def _rank_array(self, ranks: Sequence[int]) -> np.ndarray:
        """:meth:`_check_ranks` as an int64 array; groups of integers are checked in one pass of
        numpy (planning at 65,536 devices resolves DP groups of thousands of ranks)."""
        arr = np.asarray(ranks) if not isinstance(ranks, np.ndarray) else ranks
        if arr.ndim == 1 and arr.size and arr.dtype.kind in "iu":
            arr = arr.astype(np.int64, copy=False)
            if (
                arr.min() >= 0
                and arr.max() < self.num_devices
                and (
                    bool((arr[1:] > arr[:-1]).all())  # ascending (what placements give): distinct, no sort
                    or np.unique(arr).size == arr.size
                )
            ):
                return arr
        return np.array(self._check_ranks(ranks), dtype=np.int64)  # the per-rank path names the bad one

    def _check_ranks(self, ranks: Sequence[int]) -> List[int]:
        """The ranks as a list of ints in [0, num_devices), distinct and non-empty (ClusterError otherwise)."""
        rs: List[int] = []
        for r in ranks:
            try:
                if isinstance(r, bool):
                    raise TypeError
                rs.append(operator.index(r))  # accepts numpy integers too
            except TypeError:
                raise ClusterError(f"ranks: {brief(r)} is not a rank (an integer 0..{self.num_devices - 1})") from None
        if not rs:
            raise ClusterError("ranks: must be a non-empty sequence of device ranks")
        for r in rs:
            if not 0 <= r < self.num_devices:
                raise ClusterError(
                    f"ranks: {brief(r)} is not a rank of this cluster (integers 0..{self.num_devices - 1})"
                )
        if len(set(rs)) != len(rs):
            raise ClusterError(f"ranks: duplicate rank(s) in {rs}")
        return rs

    def level_index_of_group(self, ranks: Sequence[int]) -> int:
        """Index of the innermost level one of whose groups holds all ``ranks``.

        Rank r belongs to group ``r // levels[i].group_size`` at level i; a single rank is
        inside the innermost level (index 0).
        """
        rs = self._rank_array(ranks)
        for i, level in enumerate(self.levels):
            if rs.min() // level.group_size == rs.max() // level.group_size:
                return i
        raise AssertionError("unreachable: the outermost level holds every rank (validated)")

    def span(self, ranks: Sequence[int]) -> List[LevelSpan]:
        """Per-level spread of ``ranks``, for levels 0 .. :meth:`level_index_of_group` inclusive.

        Let ``g_i(r) = r // levels[i].group_size`` and ``g_{-1}(r) = r`` (each device its own
        group). For level i, consider each level-i group G holding ranks of the set; its fan-out
        is the number of distinct ``g_{i-1}`` values among those ranks. ``fanout`` is the largest
        fan-out over such G; ``max_ranks``/``min_ranks`` are the largest/smallest number of ranks
        of the set in one such G. For a *balanced* set (every group at a level holds the same
        number of ranks, as in the plan placements when degrees divide the group sizes)
        ``max_ranks == min_ranks`` and the product of fan-outs up to level i is ``max_ranks``.

        Memoised per rank set up to a shift by whole groups of the outermost level it spans (the
        collective model asks for the same group at every message size, and for the same shape
        of group in every node and rack; resolving a group of thousands of ranks takes
        milliseconds).
        """
        figures = tuple((lv.group_size, lv.bandwidth, lv.latency) for lv in self.levels)
        exact = (tuple(ranks), self.num_devices, figures)
        spans = self._span_memo.get(exact)
        if spans is None:
            rs = self._rank_array(ranks)
            top = self.level_index_of_group(rs)
            outer = self.levels[top].group_size  # every inner group size divides it: the shift keeps the spans
            shifted = rs - (int(rs.min()) // outer) * outer
            key = (shifted.tobytes(), self.num_devices, figures)
            spans = self._span_memo.get(key)
            if len(self._span_memo) >= SPAN_MEMO_LIMIT:
                self._span_memo.clear()
            if spans is None:
                spans = self._span_memo[key] = self._span(shifted, top)
            self._span_memo[exact] = spans
        return list(spans)

    def shift_class(self, lo: int, hi: int, shift: int) -> Tuple[int, int]:
        """Which shifts of one rank set the network cannot tell apart: for a set whose least and
        largest ranks are ``lo`` and ``hi``, the set moved by ``shift`` ranks has class ``(t,
        shift mod levels[t - 1].group_size)`` (``t``: the moved set's :meth:`level_index_of_group`;
        mod 1 for t = 0). Two shifts of one set with the same class have the same :meth:`span`
        (at levels below t every group index moves by the same whole number, since the inner
        group sizes divide ``levels[t - 1].group_size``; at level t both sets sit in one group and
        fan out over as many level-(t-1) groups), hence the same collective and point-to-point
        costs. The solver uses it to cost one stage of each class (a data-parallel group of
        thousands of ranks is otherwise resolved once per stage)."""
        a, b = lo + shift, hi + shift
        for t, level in enumerate(self.levels):
            if a // level.group_size == b // level.group_size:
                return t, shift % (self.levels[t - 1].group_size if t else 1)
        raise AssertionError("unreachable: the outermost level holds every rank (validated)")

    def _span(self, rs: np.ndarray, top: int) -> List[LevelSpan]:
        if rs.size <= SMALL_GROUP:
            return self._small_span(rs.tolist(), top)
        spans: List[LevelSpan] = []
        inner_size = 1  # g_{-1}(r) = r // 1 = r
        # ascending ranks (what placements give) have ascending group indices and pairs: their
        # distinct values are runs, counted without np.unique's sort
        ascending = bool((rs[1:] > rs[:-1]).all())
        for level in self.levels[: top + 1]:
            groups = rs // level.group_size
            # distinct (level-i group, level-(i-1) group) pairs, counted per level-i group
            pairs = groups * self.num_devices + rs // inner_size
            if ascending:
                sizes = _run_lengths(groups)
                pairs = pairs[_run_starts(pairs)]
                fanouts = _run_lengths(pairs // self.num_devices)
            else:
                _, sizes = np.unique(groups, return_counts=True)
                _, fanouts = np.unique(np.unique(pairs) // self.num_devices, return_counts=True)
            spans.append(LevelSpan(level, int(fanouts.max()), int(sizes.max()), int(sizes.min())))
            inner_size = level.group_size
        return spans

    def _small_span(self, rs: List[int], top: int) -> List[LevelSpan]:
        """:meth:`_span` one rank at a time: faster than numpy's sorting for a few ranks."""
        spans: List[LevelSpan] = []
        inner_size = 1
        for level in self.levels[: top + 1]:
            members: Dict[int, set] = {}
            counts: Dict[int, int] = {}
            for r in rs:
                g = r // level.group_size
                members.setdefault(g, set()).add(r // inner_size)
                counts[g] = counts.get(g, 0) + 1
            spans.append(
                LevelSpan(level, max(len(m) for m in members.values()), max(counts.values()), min(counts.values()))
            )
            inner_size = level.group_size
        return spans

    def levels_spanned(self, ranks: Sequence[int]) -> List[Tuple[NetworkLevel, int]]:
        """``(level, fan-out)`` for levels 0 .. :meth:`level_index_of_group`, innermost first.

        The fan-out at level i is the number of distinct level-(i-1) groups (devices, for i = 0)
        that the ranks occupy inside one level-i group, maximised over the level-i groups the
        ranks touch (the bottleneck group; see :meth:`span`). Examples on a node=8/rack=32
        hierarchy: ranks 0..15 -> node 8, rack 2; ranks {0, 8, 16, 24} -> node 1, rack 4. A
        hierarchical collective runs one step per level with that many participants; levels
        with fan-out 1 cost nothing.
        """
        return [(s.level, s.fanout) for s in self.span(ranks)]

    # -- network model (the ClusterModel protocol, nest_fx.cluster.protocol) -------------------
    @property
    def cost_key(self) -> str:
        """What the cost model's collective memo is keyed on: the device count and every level's
        figures as they are now (a cluster is mutable; a changed figure gives a new key)."""
        figures = tuple((lv.group_size, float(lv.bandwidth), float(lv.latency)) for lv in self.levels)
        state = (self.num_devices, figures)
        memo = self.__dict__.get("_cost_key_memo")
        if memo is None or memo[0] != state:  # formatting the figures is the costly part: once per state
            memo = self.__dict__["_cost_key_memo"] = (state, f"levels:{self.num_devices}:{list(figures)!r}")
        return memo[1]

    def collective_time(self, kind: str, ranks: Sequence[int], nbytes: float) -> float:
        """Seconds of collective ``kind`` over ``ranks`` on an ``nbytes`` buffer (hierarchical
        ring algorithms, :mod:`nest_fx.cluster.hierarchical_collectives`)."""
        return hierarchical_collectives.collective_time(kind, self, ranks, nbytes)

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds of a send of ``nbytes`` from rank ``src`` to rank ``dst``."""
        return hierarchical_collectives.p2p(self, src, dst, nbytes)

    def collective_coefficients(self, kind: str, ranks: Sequence[int]) -> Tuple[float, float]:
        """(alpha, beta): collective ``kind`` over ``ranks`` costs ``alpha + beta * S`` seconds
        on S > 0 bytes (the hierarchical algorithms are affine in the size)."""
        return hierarchical_collectives.coefficients(kind, self, ranks)

    def p2p_coefficients(self, src: int, dst: int) -> Tuple[float, float]:
        """(alpha, beta) of a send from ``src`` to ``dst`` (see :meth:`collective_coefficients`)."""
        return hierarchical_collectives.p2p_coefficients(self, src, dst)

    # -- presets ---------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, devices: int) -> "Cluster":
        """A named cluster of ``devices`` devices; ValueError listing the names when unknown.

        GPU presets use NEST's hierarchy: 8 devices per node, 4 nodes (32 devices) per rack, and a
        spine level spanning all racks (``group_size`` = devices rounded up to a multiple of
        32). The spine level is omitted when ``devices <= 32`` (it would equal the rack).
        Hardware figures are in :data:`PRESETS`' builders; see docs/cluster_format.md.
        """
        try:
            build = PRESETS[name]
        except KeyError:
            raise ClusterError(
                f"unknown cluster preset {brief(name)}{close_matches(name, PRESETS)}; valid names: {sorted(PRESETS)}"
            ) from None
        check_positive_int(devices, "devices", MAX_DEVICES)
        return build(devices)

    # -- io --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The file form (``format: nest-fx-cluster/1``), numbers in SI units."""
        return {
            "format": CLUSTER_FORMAT,
            "name": self.name,
            "num_devices": self.num_devices,
            "device": self.device.to_dict(),
            "levels": [
                {"name": lv.name, "group_size": lv.group_size, "bandwidth": lv.bandwidth, "latency": lv.latency}
                for lv in self.levels
            ],
        }

    @classmethod
    def from_dict(cls, data: dict, where: str = "") -> "Cluster":
        """Build from the file form; quantities may be strings (see :func:`parse_quantity`).

        ``where`` (e.g. a file name) prefixes error messages.
        """
        pre = f"{where}: " if where else ""
        return prefixed(pre, lambda: _cluster_from_dict(data))

    @classmethod
    def load(cls, path: str) -> "Cluster":
        """Read a cluster file: YAML for .yaml/.yml, JSON for .json."""
        return cls.from_dict(read_document(path, ClusterError, "cluster"), where=path)

    def save(self, path: str) -> None:
        """Write :meth:`to_dict` as YAML (.yaml/.yml) or JSON (.json)."""
        if path.endswith((".yaml", ".yml")):
            text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        elif path.endswith(".json"):
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        else:
            raise ClusterError(f"{path}: cluster files must end in .yaml, .yml or .json")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)


def _cluster_from_dict(data: object) -> Cluster:
    d = check_keys(data, "", ("format", "name", "num_devices", "device", "levels"))
    if d["format"] != CLUSTER_FORMAT:
        raise ClusterError(f"format: must be {CLUSTER_FORMAT!r}, got {brief(d['format'])}")
    dev = check_keys(d["device"], "device", ("name", "memory_bytes", "peak_flops", "mem_bandwidth"), ("kernel_rates",))
    flops = dev["peak_flops"]
    if not isinstance(flops, dict) or not flops:
        raise ClusterError(f"device.peak_flops: must be a non-empty mapping dtype -> FLOP/s, got {brief(flops)}")
    device = prefixed(
        "device.",
        lambda: DeviceSpec(
            name=dev["name"],
            memory_bytes=parse_quantity(dev["memory_bytes"], "B", "memory_bytes"),
            peak_flops={str(k): parse_quantity(v, "FLOP/s", f"peak_flops.{k}") for k, v in flops.items()},
            mem_bandwidth=parse_quantity(dev["mem_bandwidth"], "B/s", "mem_bandwidth"),
        ),
    )
    if "kernel_rates" in dev:
        device.kernel_rates = KernelRates.from_dict(dev["kernel_rates"], "device.kernel_rates")
    if not isinstance(d["levels"], list) or not d["levels"]:
        raise ClusterError("levels: must be a non-empty list of network levels, innermost first")
    levels = []
    for i, raw in enumerate(d["levels"]):
        lv = check_keys(raw, f"levels[{i}]", ("name", "group_size", "bandwidth", "latency"))
        levels.append(
            prefixed(
                f"levels[{i}].",
                lambda lv=lv: NetworkLevel(
                    name=lv["name"],
                    group_size=lv["group_size"],
                    bandwidth=parse_quantity(lv["bandwidth"], "B/s", "bandwidth"),
                    latency=parse_quantity(lv["latency"], "s", "latency"),
                ),
            )
        )
    return Cluster(name=d["name"], device=device, num_devices=d["num_devices"], levels=levels)


class DeviceMappedView:
    """``span`` and co. for a cluster view whose plan ranks run on other devices: the rank set is
    mapped to devices (``devices_of``), then placed on the hierarchy of those devices
    (``device_hierarchy``). :class:`~nest_fx.cluster.ordered.OrderedCluster` and
    :class:`~nest_fx.cluster.topology.GraphCluster` are such views."""

    def devices_of(self, ranks: Sequence[int]) -> List[int]:
        raise NotImplementedError

    def device_hierarchy(self) -> Cluster:
        raise NotImplementedError

    def span(self, ranks: Sequence[int]) -> List[LevelSpan]:
        """:meth:`Cluster.span` of the devices ``ranks`` run on."""
        return self.device_hierarchy().span(self.devices_of(ranks))

    def levels_spanned(self, ranks: Sequence[int]) -> List[Tuple[NetworkLevel, int]]:
        """:meth:`Cluster.levels_spanned` of the devices ``ranks`` run on."""
        return self.device_hierarchy().levels_spanned(self.devices_of(ranks))

    def level_index_of_group(self, ranks: Sequence[int]) -> int:
        """:meth:`Cluster.level_index_of_group` of the devices ``ranks`` run on."""
        return self.device_hierarchy().level_index_of_group(self.devices_of(ranks))


def _run_starts(a: np.ndarray) -> np.ndarray:
    """Where each run of equal values of a non-decreasing array starts."""
    return np.flatnonzero(np.concatenate(([True], a[1:] != a[:-1])))


def _run_lengths(a: np.ndarray) -> np.ndarray:
    """The length of each run of equal values of a non-decreasing array (``np.unique``'s counts)."""
    return np.diff(np.append(_run_starts(a), a.size))
