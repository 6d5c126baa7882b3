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
Devices past ``dp * P`` are idle. ``device_order`` (optional) places the plan ranks on the
cluster: plan rank r runs on cluster rank ``device_order[r]`` (absent = identity; chosen by the
planner on graph topologies). See docs/plan_format.md.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from nest_fx.common.errors import NestFxError
from nest_fx.common.fileio import brief, read_json
from nest_fx.common.limits import MAX_COUNT
from nest_fx.plan.constraints import ConstraintError, Constraints
from nest_fx.plan.settings import PLAN_SETTINGS, STAGE_SETTINGS, add_fields

# the plan's names live in vocabulary.py (shared with constraints.py); imported here too so that
# `from nest_fx.plan.plan import SCHEDULES, recompute_problem, ...` keeps working
from nest_fx.plan.vocabulary import (  # noqa: F401
    CHUNKED_SCHEDULES,
    PLACEMENTS,
    PRECISIONS,
    RECOMPUTE_FORMS,
    SCHEDULES,
    V_SCHEDULES,
    recompute_problem,
)

PLAN_FORMAT = "nest-fx-plan/1"


class PlanError(NestFxError, ValueError):
    """A malformed plan, or a plan that does not match the model/cluster; names the field."""


def interleave_problem(stages: List["StagePlan"], virtual_stages: int) -> str:
    """'' when every stage can be cut into ``virtual_stages`` model chunks of at least one layer
    each (the interleaved schedule's rule; the runtime cuts a stage of n layers into v near-equal
    chunks, ``nest_fx.apply.pipeline.interleaved_ranges``), else what is wrong and the fix."""
    for i, s in enumerate(stages):
        if s.end - s.start < virtual_stages:
            return (
                f"stages[{i}] has {s.end - s.start} layer(s), fewer than virtual_stages={virtual_stages} "
                "(the interleaved schedules run v chunks of at least one layer on every device); fix: "
                f"lower virtual_stages to at most {min(st.end - st.start for st in stages)} or give every "
                "stage more layers"
            )
    return ""


@dataclass
@add_fields(STAGE_SETTINGS)
class StagePlan:
    """Layers [start, end) of the workload chain on ``tp`` devices per replica, with a recompute
    policy (``recompute_problem``: none | selective | full | op[:policy] | every:k). The fields
    after ``end`` are the stage-level settings of ``nest_fx.plan.settings``."""

    start: int
    end: int

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass
@add_fields(PLAN_SETTINGS)
class Plan:
    """A hybrid-parallel training plan (see module docstring for the rank layout). Its fields
    after ``stages`` are the plan-level settings declared in ``nest_fx.plan.settings`` (name,
    type, default, allowed values, doc), in that order."""

    stages: List[StagePlan]

    # -- derived --------------------------------------------------------------------------
    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def devices_per_replica(self) -> int:
        return sum(s.tp * self.cp for s in self.stages)

    @property
    def shard_degree(self) -> int:
        """Replicas one ZeRO/FSDP group shards over: ``dp_shard`` (HSDP), or all of ``dp``."""
        return self.dp_shard or self.dp

    @property
    def replicate_degree(self) -> int:
        """HSDP replication: groups of ``shard_degree`` replicas that hold the same shards."""
        return self.dp // self.shard_degree

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
            return sum(s.tp * self.cp * self.dp for s in self.stages[:i])
        return sum(s.tp * self.cp for s in self.stages[:i])

    def rank(self, stage: int, replica: int, tp_rank: int, cp_rank: int = 0) -> int:
        """Global rank of (stage, replica, TP rank, CP rank) under this plan's placement: inside a
        stage replica TP is innermost, then CP (``cp_rank * tp + tp_rank``)."""
        inner = cp_rank * self.stages[stage].tp + tp_rank
        if self.placement == "stage-major":
            return self.stage_offset(stage) + replica * self.stages[stage].tp * self.cp + inner
        return replica * self.devices_per_replica + self.stage_offset(stage) + inner

    def _replica_ranks(self, stage: int, replicas: range, tp_rank: int, cp_rank: int = 0) -> List[int]:
        """The ranks of consecutive ``replicas`` at one position: an arithmetic progression, since
        :meth:`rank` is affine in the replica under both placements (groups of thousands of ranks
        are built without a call per rank)."""
        if not replicas:
            return []
        first = self.rank(stage, replicas[0], tp_rank, cp_rank)
        step = self.rank(stage, replicas[0] + 1, tp_rank, cp_rank) - first
        return list(range(first, first + step * len(replicas), step))

    def tp_group(self, stage: int, replica: int = 0, cp_rank: int = 0) -> List[int]:
        first = self.rank(stage, replica, 0, cp_rank)
        return list(range(first, first + self.stages[stage].tp))

    def cp_group(self, stage: int, replica: int = 0, tp_rank: int = 0) -> List[int]:
        """The ranks that split one replica's sequence at stage ``stage`` (same TP rank)."""
        return [self.rank(stage, replica, tp_rank, c) for c in range(self.cp)]

    def dp_group(self, stage: int, tp_rank: int = 0, cp_rank: int = 0) -> List[int]:
        return self._replica_ranks(stage, range(self.dp), tp_rank, cp_rank)

    def ep_group(self, stage: int, replica: int = 0, tp_rank: int = 0, cp_rank: int = 0) -> List[int]:
        first = (replica // self.ep) * self.ep
        return self._replica_ranks(stage, range(first, first + self.ep), tp_rank, cp_rank)

    def shard_group(self, stage: int, replica: int = 0, tp_rank: int = 0, cp_rank: int = 0) -> List[int]:
        """HSDP: the replicas ZeRO/FSDP shards over, with ``replica`` (all of dp without HSDP)."""
        first = (replica // self.shard_degree) * self.shard_degree
        return self._replica_ranks(stage, range(first, first + self.shard_degree), tp_rank, cp_rank)

    def mesh(self) -> Optional[Dict[str, object]]:
        """DeviceMesh shape (pp, dp, [cp,] tp) when TP is uniform, else None (not a regular mesh)."""
        tp = self.uniform_tp
        if tp is None:
            return None
        inner = (["cp", "tp"], [self.cp, tp]) if self.cp > 1 else (["tp"], [tp])
        if self.placement == "stage-major":
            return {"dims": ["pp", "dp"] + inner[0], "shape": [self.pp, self.dp] + inner[1]}
        return {"dims": ["dp", "pp"] + inner[0], "shape": [self.dp, self.pp] + inner[1]}

    # -- validation -----------------------------------------------------------------------
    def validate(self, num_layers: Optional[int] = None, world_size: Optional[int] = None) -> None:
        """Structural checks; raises PlanError naming the field and the fix."""
        n = num_layers if num_layers is not None else self.num_layers
        if not self.stages:
            raise PlanError("stages: a plan needs at least one stage")
        expect = 0
        for i, s in enumerate(self.stages):
            if s.start != expect:
                raise PlanError(
                    f"stages[{i}].start: expected {expect} (stages must cover the layers contiguously), got {s.start}"
                )
            if s.end <= s.start:
                raise PlanError(f"stages[{i}]: empty layer range [{s.start}, {s.end})")
            for setting in STAGE_SETTINGS:
                problem = setting.range_problem(getattr(s, setting.name))
                if problem:
                    raise PlanError(f"stages[{i}].{setting.name}: {problem}")
            expect = s.end
        if n and expect != n:
            whose = "the workload has" if num_layers is not None else "num_layers is"
            made_for = f"the plan was made for {brief(self.model)}: " if self.model else ""
            raise PlanError(
                f"stages: cover layers [0, {expect}) but {whose} {n} layers ({made_for}a plan for another model?)"
            )
        for setting in PLAN_SETTINGS:
            if setting.type in (int, str):
                problem = setting.range_problem(getattr(self, setting.name))
                if problem:
                    raise PlanError(f"{setting.name}: {problem}")
        if self.dp % self.ep:
            raise PlanError(f"ep={self.ep} must divide dp={self.dp} (expert groups are carved from replicas)")
        if self.dp_shard and self.dp % self.dp_shard:
            raise PlanError(
                f"dp_shard={self.dp_shard} must divide dp={self.dp} (HSDP shards over groups of dp_shard "
                "consecutive replicas and replicates across them; 0 = shard over all of dp)"
            )
        if self.dp_shard not in (0, self.dp) and self.zero == 0:
            raise PlanError(
                f"dp_shard={self.dp_shard} needs zero >= 1 (HSDP shards parameters, gradients or "
                "optimizer states; with zero=0 nothing is sharded): set zero or drop dp_shard"
            )
        if self.schedule in CHUNKED_SCHEDULES:
            if self.virtual_stages < 2:
                raise PlanError(f"virtual_stages: the {self.schedule} schedule needs >= 2 chunks per device")
            if self.num_microbatches % self.pp:
                raise PlanError(
                    f"num_microbatches={self.num_microbatches} must be a multiple of the "
                    f"{self.pp} stages for the {self.schedule} schedule"
                )
            short = interleave_problem(self.stages, self.virtual_stages)
            if short:
                raise PlanError(short)
        elif self.schedule in V_SCHEDULES:
            if self.virtual_stages != 2:
                raise PlanError(
                    f"virtual_stages={self.virtual_stages}: the {self.schedule} schedule runs 2 model chunks "
                    "per device, laid in a V; set virtual_stages to 2"
                )
            if self.num_microbatches < 2 * self.pp:
                raise PlanError(
                    f"num_microbatches={self.num_microbatches}: the {self.schedule} schedule needs at least "
                    f"2 x pp = {2 * self.pp} microbatches (one per model chunk) to fill its V; fix: raise "
                    "num_microbatches or use the 1f1b schedule"
                )
            short = [i for i, st in enumerate(self.stages) if st.end - st.start < 2]
            if short:
                raise PlanError(
                    f"stages[{short[0]}] has 1 layer: the {self.schedule} schedule cuts every device's "
                    "layers into 2 model chunks; fix: give every stage 2 layers or more, or use 1f1b"
                )
        elif self.virtual_stages != 1:
            raise PlanError(
                f"virtual_stages={self.virtual_stages}: model chunks per device belong to the "
                f"{', '.join(CHUNKED_SCHEDULES + V_SCHEDULES)} schedules; with schedule "
                f"{self.schedule!r} set virtual_stages to 1"
            )
        ws = world_size if world_size is not None else self.world_size
        if ws and self.devices_used > ws:
            raise PlanError(
                f"the plan uses {self.devices_used} devices (dp={self.dp} x {self.devices_per_replica} "
                f"per replica) but the world has {ws}"
            )
        if self.device_order is not None:
            check_device_order(self.device_order, ws or len(self.device_order), self.devices_used)

    def check_model(self, fingerprint: str, what: str = "this model") -> None:
        """PlanError when the plan records a layer-chain fingerprint and ``fingerprint`` (the model
        it is about to be used with) differs: a plan for another model with the same layer count."""
        if self.model_fingerprint and fingerprint and self.model_fingerprint != fingerprint:
            made_for = brief(self.model) if self.model else "another model"
            raise PlanError(
                f"model_fingerprint: the plan was made for {made_for} (layer chain {self.model_fingerprint}) but "
                f"{what}'s layer chain is {fingerprint}: the layers' kinds or parameter counts differ; fix: plan for "
                "this model (nest-fx plan --model ...), or delete model_fingerprint from a plan you edited on purpose"
            )

    # -- io -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        if d["device_order"] is None:  # absent means identity: files of unplaced plans stay as they were
            del d["device_order"]
        if self.constraints:  # only what was set; absent when planned without constraints
            d["constraints"] = self.constraints.to_dict()
        else:
            del d["constraints"]
        d = {"format": PLAN_FORMAT, **d}
        d["mesh"] = self.mesh()
        d["derived"] = {"pp": self.pp, "devices_used": self.devices_used, "global_batch": self.global_batch}
        return d

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2)

    @classmethod
    def from_dict(cls, data: dict, where: str = "plan") -> "Plan":
        """Build and validate a plan from its file form (see docs/plan_format.md): the format
        version is checked first, every field's type next, then :meth:`validate`. Errors are
        :class:`PlanError` starting with ``where`` (e.g. the file name) and naming the field."""
        try:
            plan = cls(**_plan_fields(data))
            plan.validate()
        except PlanError as exc:
            raise PlanError(f"{where}: {exc}") from None
        return plan

    @classmethod
    def load(cls, path: str) -> "Plan":
        return cls.from_dict(read_json(path, PlanError, "plan"), where=path)


def _int_field(value: object, name: str) -> int:
    """``value`` when it is an integer (not a bool) of at most MAX_COUNT in size, else PlanError
    naming ``name`` (the range is :meth:`Plan.validate`'s to check)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name} must be an integer, got {brief(value)}")
    if abs(value) > MAX_COUNT:
        raise PlanError(f"{name}: {brief(value)} is larger than nest-fx handles (at most {MAX_COUNT:,})")
    return value


def _stage_fields(raw: object, i: int) -> StagePlan:
    if not isinstance(raw, dict) or "start" not in raw or "end" not in raw:
        raise PlanError(f"stages[{i}] needs 'start' and 'end' (layer indices), got {brief(raw)}")
    bad = set(raw) - set(StagePlan.__dataclass_fields__)
    if bad:
        raise PlanError(
            f"stages[{i}] has unknown field(s) {sorted(bad, key=str)}; known: {sorted(StagePlan.__dataclass_fields__)}"
        )
    recompute = raw.get("recompute", "none")
    if not isinstance(recompute, str):
        raise PlanError(f"stages[{i}].recompute: {recompute_problem(recompute)}")
    values = {name: _int_field(raw[name], f"stages[{i}].{name}") for name in ("start", "end")}
    for setting in STAGE_SETTINGS:
        if setting.name in raw:
            problem = setting.type_problem(raw[setting.name])
            if problem:
                raise PlanError(f"stages[{i}].{setting.name} {problem}")
            values[setting.name] = raw[setting.name]
    return StagePlan(**values)


def _plan_fields(data: object) -> dict:
    """The keyword arguments of :class:`Plan` from its file form, every field type-checked
    (values are checked by :meth:`Plan.validate`)."""
    if not isinstance(data, dict):
        raise PlanError(f"expected a JSON object with format {PLAN_FORMAT!r}, got {type(data).__name__}")
    fmt = data.get("format")
    if fmt != PLAN_FORMAT:
        raise PlanError(
            f"format is {brief(fmt)}; this version reads {PLAN_FORMAT!r} "
            "(re-plan with this nest-fx, or fix the file's format field)"
        )
    known = set(Plan.__dataclass_fields__)
    unknown = set(data) - known - {"format", "mesh", "derived"}
    if unknown:
        raise PlanError(f"unknown field(s) {sorted(unknown, key=str)}; known: {sorted(known)}")
    raw_stages = data.get("stages", [])
    if not isinstance(raw_stages, list):
        raise PlanError(f"stages must be a list of {{start, end, tp, recompute}} objects, got {brief(raw_stages)}")
    kwargs = {k: v for k, v in data.items() if k in known and k != "stages"}
    kwargs["stages"] = [_stage_fields(s, i) for i, s in enumerate(raw_stages)]
    for setting in PLAN_SETTINGS:  # each field's type, from its declaration (values: Plan.validate)
        if setting.name in kwargs and setting.type in (int, str, bool):
            problem = setting.type_problem(kwargs[setting.name])
            if problem:
                raise PlanError(f"{setting.name} {problem}")
    if kwargs.get("constraints") is not None:
        try:
            kwargs["constraints"] = Constraints.from_dict(kwargs["constraints"])
        except ConstraintError as exc:
            raise PlanError(str(exc)) from None
    predicted = kwargs.get("predicted", {})
    if not isinstance(predicted, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in predicted.items()
    ):
        raise PlanError(f"predicted must map names to numbers (what the planner predicted), got {brief(predicted)}")
    return kwargs


def check_device_order(order: object, world_size: int, devices_used: int = 0) -> List[int]:
    """``order`` as a list when it is a permutation of ``range(world_size)`` (plan rank r runs on
    cluster rank ``order[r]``), else PlanError naming the problem."""
    fix = (
        f"list each rank 0..{world_size - 1} exactly once (plan rank r runs on device_order[r]), "
        "or leave device_order out for the identity"
    )
    if not isinstance(order, (list, tuple)):
        raise PlanError(f"device_order: must be a list of ranks, got {type(order).__name__}; {fix}")
    bad = [x for x in order if isinstance(x, bool) or not isinstance(x, int)]
    if bad:  # a list, not next(..., None): a None entry is itself the bad one
        raise PlanError(f"device_order: entries must be integers, got {bad[0]!r}; {fix}")
    if len(order) != world_size:
        raise PlanError(f"device_order: has {len(order)} entries but the world has {world_size} ranks; {fix}")
    if world_size < devices_used:
        raise PlanError(f"device_order: has {len(order)} entries but the plan uses {devices_used} devices")
    seen = set()
    for r, d in enumerate(order):
        if not 0 <= d < world_size:
            raise PlanError(f"device_order[{r}]: {d} is out of range 0..{world_size - 1}; {fix}")
        if d in seen:
            raise PlanError(f"device_order[{r}]: rank {d} appears twice; {fix}")
        seen.add(d)
    return list(order)


def uniform_plan(num_layers: int, *, pp: int = 1, tp: int = 1, dp: int = 1, **kwargs) -> Plan:
    """Megatron-style plan: ``pp`` stages with near-equal layer counts, the same TP everywhere."""
    if pp > num_layers:
        raise PlanError(f"pp={pp} exceeds the {num_layers} layers")
    bounds = [i * num_layers // pp for i in range(pp + 1)]
    recompute = kwargs.pop("recompute", "none")
    stages = [StagePlan(bounds[i], bounds[i + 1], tp, recompute) for i in range(pp)]
    return Plan(stages=stages, dp=dp, num_layers=num_layers, **kwargs)
