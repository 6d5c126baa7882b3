"""Where a plan's communication groups sit on the network: TP/DP/EP groups, pipeline
boundaries and the contents of each network level, as readable lines.

A group "lies at" the innermost level one of whose groups holds all its ranks
(:meth:`Cluster.level_index_of_group`): level 0 means inside one node, level k > 0 that the
traffic crosses level-(k-1) groups and runs over level k's links.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from nest_fx.cluster.hierarchical_collectives import path_bandwidth
from nest_fx.cluster.ordered import OrderedCluster, placed
from nest_fx.cluster.topology import GraphCluster, device_islands
from nest_fx.report import tables as report


def fmt_ranks(ranks: Sequence[int], limit: int = 6) -> str:
    """Compact rank list: ``0-7``, ``0, 8, .., 248 (stride 8)``, ``0-3, 8-11``."""
    rs = sorted(ranks)
    if not rs:
        return "-"
    if len(rs) == 1:
        return str(rs[0])
    steps = {b - a for a, b in zip(rs, rs[1:])}
    if steps == {1}:
        return f"{rs[0]}-{rs[-1]}"
    if len(steps) == 1 and len(rs) > 3:
        return f"{rs[0]}, {rs[1]}, .., {rs[-1]} (stride {steps.pop()})"
    runs: List[Tuple[int, int]] = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return ", ".join(parts[:limit]) + (f", .. ({len(rs)} ranks)" if len(parts) > limit else "")


def level_phrase(cluster, k: int) -> str:
    """'inside one node (900 GB/s)' or 'across nodes, over the rack level (100 GB/s)'; the rate is
    the path's, the slowest level a transfer across level k traverses (``path_bandwidth``)."""
    lv = cluster.levels[k]
    rate = report.fmt_si(path_bandwidth(cluster.levels, k), "B/s")
    if k == 0:
        return f"inside one {lv.name} ({rate})"
    return f"across {cluster.levels[k - 1].name}s, over the {lv.name} level ({rate})"


def fanout_phrase(cluster, ranks: Sequence[int]) -> str:
    """How a group spreads, outermost first: '4 racks x 2 nodes x 1 device'."""
    spans = cluster.span(ranks)
    parts = []
    for k in range(len(spans) - 1, -1, -1):
        unit = "device" if k == 0 else cluster.levels[k - 1].name
        n = spans[k].fanout
        parts.append(f"{n} {unit}{'s' if n != 1 else ''}")
    return " x ".join(parts)


@dataclass
class GroupSet:
    """All groups of one kind for a run of stages with the same shape and network levels."""

    kind: str  # TP | DP | EP | expert-DP | PP
    stages: Tuple[int, int]  # first, last stage (PP: boundaries into these stages)
    count: int
    size: int
    levels: Dict[int, int]  # level index -> number of groups at that level
    example: List[int]

    def where(self, cluster) -> str:
        """Network level(s) of the groups in words."""
        if len(self.levels) == 1:
            k = next(iter(self.levels))
            text = level_phrase(cluster, k)
            if k > 0 and self.kind != "PP":
                text += f"; spread {fanout_phrase(cluster, self.example)}"
            return text
        return "; ".join(f"{n} {level_phrase(cluster, k)}" for k, n in sorted(self.levels.items()))


def _level_counts(cluster, groups: List[List[int]]) -> Dict[int, int]:
    return dict(Counter(cluster.level_index_of_group(g) for g in groups))


def _stage_groups(plan, i: int) -> Dict[str, List[List[int]]]:
    tp = plan.stages[i].tp
    out = {"TP": [plan.tp_group(i, r) for r in range(plan.dp)], "DP": [plan.dp_group(i, j) for j in range(tp)]}
    if plan.ep > 1:
        out["EP"] = [plan.ep_group(i, r, j) for r in range(0, plan.dp, plan.ep) for j in range(tp)]
        if plan.dp > plan.ep:  # expert gradients are reduced over the replicas holding the same experts
            out["expert-DP"] = [plan.dp_group(i, j)[k :: plan.ep] for k in range(plan.ep) for j in range(tp)]
    return out


def group_sets(plan, cluster) -> List[GroupSet]:
    """TP, DP, EP and expert-DP groups (runs of equal stages merged), then one PP set per stage
    boundary."""
    raw: List[GroupSet] = []
    for i in range(plan.pp):
        for kind, groups in _stage_groups(plan, i).items():
            raw.append(GroupSet(kind, (i, i), len(groups), len(groups[0]), _level_counts(cluster, groups), groups[0]))
        if i > 0:
            pairs = [[plan.rank(i - 1, r, 0), plan.rank(i, r, 0)] for r in range(plan.dp)]
            raw.append(GroupSet("PP", (i, i), len(pairs), 2, _level_counts(cluster, pairs), pairs[0]))
    merged: List[GroupSet] = []
    for kind in ("TP", "DP", "EP", "expert-DP"):
        for g in (g for g in raw if g.kind == kind):
            prev = merged[-1] if merged and merged[-1].kind == kind else None
            if (
                prev
                and prev.stages[1] == g.stages[0] - 1
                and (prev.size, prev.levels) == (g.size, g.levels)
                and prev.count == g.count
            ):
                prev.stages = (prev.stages[0], g.stages[1])
            else:
                merged.append(g)
    return merged + [g for g in raw if g.kind == "PP"]


def _stage_label(g: GroupSet, pp: int) -> str:
    a, b = g.stages
    if pp == 1 or (a, b) == (0, pp - 1):
        return "all stages" if pp > 1 else "the stage"
    return f"stage {a}" if a == b else f"stages {a}-{b}"


def group_lines(plan, cluster) -> List[str]:
    """One line per group set: count x size, network level, an example group."""
    lines = []
    sets = group_sets(plan, cluster)
    for g in sets:
        if g.kind == "PP":
            continue
        label = _stage_label(g, plan.pp)
        if g.size == 1:
            lines.append(f"{g.kind} ({label}): none ({g.kind.lower()}=1)")
        else:
            per_stage = g.count
            span = g.stages[1] - g.stages[0] + 1
            count = f"{per_stage} x {g.size} ranks" + (f" per stage ({per_stage * span} in all)" if span > 1 else "")
            lines.append(f"{g.kind} groups ({label}): {count}, {g.where(cluster)}; e.g. ranks {fmt_ranks(g.example)}")
    return lines + _pp_lines([g for g in sets if g.kind == "PP"], cluster, plan.dp)


def _pp_lines(boundaries: List[GroupSet], cluster, dp: int) -> List[str]:
    """Pipeline boundaries grouped by the network level(s) their replicas' p2p crosses."""
    by_levels: Dict[Tuple[Tuple[int, int], ...], List[GroupSet]] = {}
    for g in boundaries:
        by_levels.setdefault(tuple(sorted(g.levels.items())), []).append(g)
    lines = []
    for group in sorted(by_levels.values(), key=lambda gs: gs[0].stages[0]):
        names = ", ".join(f"{g.stages[0] - 1}->{g.stages[0]}" for g in group[:8])
        more = f", .. ({len(group)} in all)" if len(group) > 8 else ""
        first = group[0]
        noun = "boundary" if len(group) == 1 else "boundaries"
        lines.append(
            f"PP {noun} {names}{more}: {first.where(cluster)}; {dp} replica(s) each; "
            f"e.g. ranks {first.example[0]} -> {first.example[1]}"
        )
    return lines


def owners(plan) -> Dict[int, Tuple[int, int, int]]:
    """cluster rank -> (stage, replica, TP rank) for every rank the plan uses (plan rank r runs on
    cluster rank ``plan.device_order[r]``; the identity without one)."""
    order = plan.device_order
    out = {}
    for i, s in enumerate(plan.stages):
        for r in range(plan.dp):
            for j in range(s.tp):
                rank = plan.rank(i, r, j)
                out[order[rank] if order is not None else rank] = (i, r, j)
    return out


def placement_lines(plan, cluster, name: str = "", searched: Sequence[str] = ()) -> List[str]:
    """The plan's device order in words: its name, what the first island (node) of devices runs
    and the first DP group's devices. ``cluster`` is the cluster the plan is for (its order not
    yet applied); graph topologies give islands and device numbers, others their first level."""
    view = placed(cluster, plan.device_order)
    devices_of = view.devices_of if isinstance(view, (OrderedCluster, GraphCluster)) else list
    if isinstance(cluster, GraphCluster):
        island, unit = device_islands(cluster.topology)[0], "island"
    else:
        island, unit = list(range(min(cluster.levels[0].group_size, cluster.num_devices))), cluster.levels[0].name
    label = name or ("identity" if plan.device_order is None else "the plan's device_order")
    others = f" (best of {len(searched)}: {', '.join(searched)})" if len(searched) > 1 else ""
    lines = [f"device order: {label}{others}"]
    inside = set(island)
    held = []
    for i in range(plan.pp):
        for r in range(plan.dp):
            group = devices_of(plan.tp_group(i, r))
            if inside.intersection(group):
                held.append(f"stage {i} replica {r} on {fmt_ranks(group)}")
    shown = "; ".join(held[:4]) + (f"; .. ({len(held)} groups)" if len(held) > 4 else "")
    lines.append(f"  {unit} 0 (devices {fmt_ranks(island)}) runs TP groups: {shown or 'none (idle)'}")
    if plan.dp > 1:
        lines.append(f"  DP group of stage 0, TP rank 0: devices {fmt_ranks(devices_of(plan.dp_group(0, 0)))}")
    return lines


def level_map_lines(plan, cluster) -> List[str]:
    """What the first group of every network level holds: stages, replicas, TP ranks."""
    own = owners(plan)
    lines = []
    for k, lv in enumerate(cluster.levels):
        size = min(lv.group_size, cluster.num_devices)
        count = -(-cluster.num_devices // lv.group_size)
        held = [own[r] for r in range(size) if r in own]
        idle = size - len(held)
        if not held:
            lines.append(f"{lv.name} 0 of {count} (ranks 0-{size - 1}): idle")
            continue
        stages = fmt_ranks(sorted({h[0] for h in held}))
        replicas = fmt_ranks(sorted({h[1] for h in held}))
        tps = fmt_ranks(sorted({h[2] for h in held}))
        text = f"{lv.name} 0 of {count} (ranks 0-{size - 1}): stage {stages}, replica {replicas}, TP rank {tps}"
        lines.append(text + (f"; {idle} idle" if idle else ""))
    return lines
