"""Plan: what the solver chooses and the rewriter applies (``format: nest-fx-plan/1``).

Rank layout (placement). A plan has ``dp`` pipeline replicas of ``len(stages)`` stages; stage
``i`` uses ``stages[i].tp`` devices per replica. ``placement`` says how those devices sit on the
cluster's rank order (rank r is device r of the hierarchy, innermost level first):

    "stage-major"    ranks [off_i, off_i + tp_i * dp) hold stage i; inside, TP is innermost:
                     replica r, TP rank j of stage i is ``off_i + r * tp_i + j``. DP groups of
                     a stage are contiguous (DP sync stays low in the hierarchy); pipeline
                     neighbours are ``tp_i * dp`` ranks apart.
    "replica-major"  replica r holds ranks [r * P, (r + 1) * P) with P = sum(tp_i); stage i of
                     replica r, TP rank j is ``r * P + off_i + j`` (off_i = sum of earlier tp).
                     Pipeline neighbours are adjacent; DP groups stride over replicas.

Expert parallelism groups ``ep`` consecutive replicas (``ep`` divides ``dp``): the expert
all-to-all of stage i, TP rank j runs over the same (i, j) position in those replicas.
Devices past ``dp * P`` are idle. See docs/plan_format.md.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from nest_fx.fileio import read_json

PLAN_FORMAT = "nest-fx-plan/1"
SCHEDULES = ("1f1b", "interleaved", "gpipe")
PLACEMENTS = ("stage-major", "replica-major")


class PlanError(ValueError):
    """A malformed plan, or a plan that does not match the model/cluster; names the field."""


@dataclass
class StagePlan:
    """Layers [start, end) of the workload chain on ``tp`` devices per replica."""

    start: int
    end: int
    tp: int = 1
    recompute: str = "none"  # none | selective | full

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass
class Plan:
    """A hybrid-parallel training plan (see module docstring for the rank layout)."""

    stages: List[StagePlan]
    dp: int = 1
    ep: int = 1
    zero: int = 0
    microbatch_size: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    placement: str = "stage-major"
    model: str = ""
    num_layers: int = 0  # length of the workload chain the ranges index
    world_size: int = 0
    cluster: str = ""  # the cluster it was planned for: preset NAME:DEVICES or a cluster file path
    predicted: Dict[str, float] = field(default_factory=dict)
    notes: str = ""

    # -- derived --------------------------------------------------------------------------
    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def devices_per_replica(self) -> int:
        return sum(s.tp for s in self.stages)

    @property
    def devices_used(self) -> int:
        return self.dp * self.devices_per_replica

    @property
    def global_batch(self) -> int:
        return self.dp * self.microbatch_size * self.num_microbatches

    @property
    def uniform_tp(self) -> Optional[int]:
        tps = {s.tp for s in self.stages}
        return tps.pop() if len(tps) == 1 else None

    def stage_offset(self, i: int) -> int:
        """First rank of stage i (stage-major) or its offset inside a replica (replica-major)."""
        if self.placement == "stage-major":
            return sum(s.tp * self.dp for s in self.stages[:i])
        return sum(s.tp for s in self.stages[:i])

    def rank(self, stage: int, replica: int, tp_rank: int) -> int:
        """Global rank of (stage, replica, TP rank) under this plan's placement."""
        if self.placement == "stage-major":
            return self.stage_offset(stage) + replica * self.stages[stage].tp + tp_rank
        return replica * self.devices_per_replica + self.stage_offset(stage) + tp_rank

    def _replica_ranks(self, stage: int, replicas, tp_rank: int) -> List[int]:
        off, tp = self.stage_offset(stage), self.stages[stage].tp
        stride = tp if self.placement == "stage-major" else self.devices_per_replica
        return [off + r * stride + tp_rank for r in replicas]

    def tp_group(self, stage: int, replica: int = 0) -> List[int]:
        first = self.rank(stage, replica, 0)
        return list(range(first, first + self.stages[stage].tp))

    def dp_group(self, stage: int, tp_rank: int = 0) -> List[int]:
        return self._replica_ranks(stage, range(self.dp), tp_rank)

    def ep_group(self, stage: int, replica: int = 0, tp_rank: int = 0) -> List[int]:
        first = (replica // self.ep) * self.ep
        return self._replica_ranks(stage, range(first, first + self.ep), tp_rank)

    def mesh(self) -> Optional[Dict[str, object]]:
        """DeviceMesh shape (pp, dp, tp) when TP is uniform, else None (not a regular mesh)."""
        tp = self.uniform_tp
        if tp is None:
            return None
        if self.placement == "stage-major":
            return {"dims": ["pp", "dp", "tp"], "shape": [self.pp, self.dp, tp]}
        return {"dims": ["dp", "pp", "tp"], "shape": [self.dp, self.pp, tp]}

    # -- validation -----------------------------------------------------------------------
    def validate(self, num_layers: Optional[int] = None, world_size: Optional[int] = None) -> None:
        """Structural checks; raises PlanError naming the field and the fix."""
        n = num_layers if num_layers is not None else self.num_layers
        if not self.stages:
            raise PlanError("stages: a plan needs at least one stage")
        expect = 0
        for i, s in enumerate(self.stages):
            if s.start != expect:
                raise PlanError(f"stages[{i}].start: expected {expect} (stages must cover the layers "
                                f"contiguously), got {s.start}")
            if s.end <= s.start:
                raise PlanError(f"stages[{i}]: empty layer range [{s.start}, {s.end})")
            if s.tp < 1:
                raise PlanError(f"stages[{i}].tp: must be >= 1, got {s.tp}")
            if s.recompute not in ("none", "selective", "full"):
                raise PlanError(f"stages[{i}].recompute: {s.recompute!r}, use none/selective/full")
            expect = s.end
        if n and expect != n:
            raise PlanError(f"stages: cover layers [0, {expect}) but the workload has {n} layers "
                            f"(a plan for another model?)")
        for name in ("dp", "ep", "microbatch_size", "num_microbatches", "virtual_stages"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.dp % self.ep:
            raise PlanError(f"ep={self.ep} must divide dp={self.dp} (expert groups are carved from replicas)")
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"zero: {self.zero}, use 0, 1, 2 or 3")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule: {self.schedule!r}, use one of {SCHEDULES}")
        if self.placement not in PLACEMENTS:
            raise PlanError(f"placement: {self.placement!r}, use one of {PLACEMENTS}")
        if self.schedule == "interleaved":
            if self.virtual_stages < 2:
                raise PlanError("virtual_stages: the interleaved schedule needs >= 2 chunks per device")
            if self.num_microbatches % self.pp:
                raise PlanError(f"num_microbatches={self.num_microbatches} must be a multiple of the "
                                f"{self.pp} stages for the interleaved schedule")
        ws = world_size if world_size is not None else self.world_size
        if ws and self.devices_used > ws:
            raise PlanError(f"the plan uses {self.devices_used} devices (dp={self.dp} x {self.devices_per_replica} "
                            f"per replica) but the world has {ws}")

    # -- io -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d = {"format": PLAN_FORMAT, **d}
        d["mesh"] = self.mesh()
        d["derived"] = {"pp": self.pp, "devices_used": self.devices_used, "global_batch": self.global_batch}
        return d

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2)

    @classmethod
    def from_dict(cls, data: dict, where: str = "plan") -> "Plan":
        if not isinstance(data, dict):
            raise PlanError(f"{where}: expected a JSON object")
        fmt = data.get("format")
        if fmt != PLAN_FORMAT:
            raise PlanError(f"{where}: format is {fmt!r}; this version reads {PLAN_FORMAT!r}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known - {"format", "mesh", "derived"}
        if unknown:
            raise PlanError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        stages = []
        for i, s in enumerate(data.get("stages") or []):
            if not isinstance(s, dict) or "start" not in s or "end" not in s:
                raise PlanError(f"{where}: stages[{i}] needs 'start' and 'end' (layer indices)")
            bad = set(s) - set(StagePlan.__dataclass_fields__)
            if bad:
                raise PlanError(f"{where}: stages[{i}] has unknown field(s) {sorted(bad)}")
            try:
                stages.append(StagePlan(start=int(s["start"]), end=int(s["end"]), tp=int(s.get("tp", 1)),
                                        recompute=str(s.get("recompute", "none"))))
            except (TypeError, ValueError):
                raise PlanError(f"{where}: stages[{i}]: start/end/tp must be integers") from None
        kwargs = {k: v for k, v in data.items() if k in known and k != "stages"}
        for k in ("dp", "ep", "zero", "microbatch_size", "num_microbatches", "virtual_stages", "num_layers",
                  "world_size"):
            if k in kwargs and not isinstance(kwargs[k], int):
                raise PlanError(f"{where}: {k} must be an integer, got {kwargs[k]!r}")
        if not isinstance(kwargs.get("cluster", ""), str):
            raise PlanError(f"{where}: cluster must be a string (NAME:DEVICES or a file), got {kwargs['cluster']!r}")
        plan = cls(stages=stages, **kwargs)
        plan.validate()
        return plan

    @classmethod
    def load(cls, path: str) -> "Plan":
        return cls.from_dict(read_json(path, PlanError, "plan"), where=path)


def uniform_plan(num_layers: int, *, pp: int = 1, tp: int = 1, dp: int = 1, **kwargs) -> Plan:
    """Megatron-style plan: ``pp`` stages with near-equal layer counts, the same TP everywhere."""
    if pp > num_layers:
        raise PlanError(f"pp={pp} exceeds the {num_layers} layers")
    bounds = [i * num_layers // pp for i in range(pp + 1)]
    recompute = kwargs.pop("recompute", "none")
    stages = [StagePlan(bounds[i], bounds[i + 1], tp, recompute) for i in range(pp)]
    return Plan(stages=stages, dp=dp, num_layers=num_layers, **kwargs)


def stage_ranges(plan: Plan) -> List[Tuple[int, int]]:
    return [(s.start, s.end) for s in plan.stages]
