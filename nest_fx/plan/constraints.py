"""What a user fixes or bounds when planning: :class:`Constraints` (``nest-fx plan`` options,
``auto_parallelize(constraints=...)``, the ``constraints`` field of a plan file).

Vocabulary (every entry optional; an empty set of constraints is the planner's full space):

==================  =====================================  ==================================================
entry               values                                 meaning
==================  =====================================  ==================================================
``fix``             ``{degree: int}`` or ``{flag: bool}``  the plan has exactly this value
``min``, ``max``    ``{degree: int}``                      bounds on a degree (inclusive)
``schedules``       ``1f1b``, ``gpipe``, ``interleaved``,  pipeline schedules allowed (``interleaved`` alone:
                    ``interleaved:V``, ``interleaved-zb``, the planner's interleave factors; ``:V`` one)
                    ``interleaved-zb:V``, ``zbv``,
                    ``dualpipev``
``recompute``       recompute policies (plan forms)        per-stage recompute modes allowed
``microbatch_sizes`` integers >= 1                         microbatch sizes allowed
``zero_stages``     0..3                                   ZeRO stages allowed
``placements``      ``stage-major``, ``replica-major``     rank placements allowed
``memory_headroom`` fraction in [0, 1)                     device memory left unused (default 0.05: the CUDA
                                                           context and allocator fragmentation)
``optimizer``       ``adam``, ``adamw``, ``sgd``,          the optimizer the plan is costed for
                    ``sgd-momentum``
``optimizer_kernel`` ``for-loop``, ``foreach``, ``fused``   how torch.optim runs its step (absent: torch's
                                                           default on the device)
``precision``       ``fp32``, ``bf16-mixed``, ``bf16-true`` the precision the plan trains and is costed in
==================  =====================================  ==================================================

The entries are made from the declarations of ``nest_fx.plan.settings``: ``fix``/``min``/``max``
take its degrees and flags, each ``choice`` setting gives one list (``Setting.allowed``) and
each ``option`` setting one value.

Degrees: :data:`DEGREES` (``tp``, ``pp``, ``dp``, ``ep``, ``cp``, ``dp_shard``); flags:
:data:`FLAGS` (``sequence_parallel``, ``loss_parallel``, ``compile``, ``float8``). They are the
plan's own fields, so a constraint on a parallelism the planner does not search yet (context
parallelism, HSDP, loss parallel, compile, Float8) is written the same way and refused by the
solver with that reason until it is searched (``nest_fx.solver.constraints``). This module
checks the form; whether a set can be met on a model and cluster is the solver's question.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union  # noqa: F401 (generated annotations)

from nest_fx.common.errors import NestFxError
from nest_fx.common.fileio import brief
from nest_fx.common.limits import MAX_COUNT
from nest_fx.common.names import close_matches
from nest_fx.plan.settings import CHOICES, DEGREES, FLAGS, OPTIONS, setting
from nest_fx.plan.vocabulary import CHUNKED_SCHEDULES, SCHEDULES, model_chunks, schedule_problem  # noqa: F401  (schedule_problem: re-exported)

DEFAULT_MEMORY_HEADROOM = setting("memory_headroom").default
_LISTS = tuple(s.allowed for s in CHOICES)  # schedules, recompute, microbatch_sizes, ... (from the declarations)
_CHOICE_OF = {s.allowed: s for s in CHOICES}


class ConstraintError(NestFxError, ValueError):
    """A malformed constraint, or a set of constraints no plan can meet; names the constraint."""


def _vocabulary(cls):
    """Class decorator: one Optional field per ``choice`` setting (its list of allowed values,
    named by ``Setting.allowed``) and per ``option`` setting (its value); None = not constrained."""
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    for s in CHOICES:
        annotations[s.allowed] = "Optional[List[Any]]"
        setattr(cls, s.allowed, None)
    for s in OPTIONS:
        annotations[s.name] = f"Optional[{s.type.__name__}]"
        setattr(cls, s.name, None)
    cls.__annotations__ = annotations
    return cls


@dataclass
@_vocabulary
class Constraints:
    """User constraints on a plan (see the module docstring for the vocabulary): ``fix`` /
    ``min`` / ``max`` of the degrees and flags, then one list of allowed values per choice
    setting and one value per option setting, made from ``nest_fx.plan.settings``."""

    fix: Dict[str, Union[int, bool]] = field(default_factory=dict)
    min: Dict[str, int] = field(default_factory=dict)
    max: Dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # -- form ------------------------------------------------------------------------------
    def validate(self) -> None:
        """ConstraintError naming the first malformed entry (its path, e.g. ``fix.tp``)."""
        for key, value in self.fix.items():
            if key in FLAGS:
                if not isinstance(value, bool):
                    raise ConstraintError(f"fix.{key}: {brief(value)} is not true or false")
            else:
                _degree(key, value, "fix")
        for kind in ("min", "max"):
            for key, value in getattr(self, kind).items():
                _degree(key, value, kind)
        for key in set(self.min) & set(self.max):
            if self.min[key] > self.max[key]:
                raise ConstraintError(f"min.{key}={self.min[key]} is above max.{key}={self.max[key]}")
        for key in set(self.fix) & (set(self.min) | set(self.max)):
            lo, hi = self.min.get(key, 1), self.max.get(key, MAX_COUNT)
            if not lo <= self.fix[key] <= hi:
                raise ConstraintError(f"fix.{key}={self.fix[key]} is outside min.{key}..max.{key} ({lo}..{hi})")
        for name in _LISTS:
            values = getattr(self, name)
            if values is None:
                continue
            if not isinstance(values, list) or not values:
                raise ConstraintError(f"{name}: must be a non-empty list, got {brief(values)}")
            for value in values:
                problem = _CHOICE_OF[name].check_entry(value)
                if problem:
                    raise ConstraintError(f"{name}: {problem}")
        for s in OPTIONS:
            value = getattr(self, s.name)
            if value is None:
                continue
            shown = [v for v in s.values if v != ""]
            if shown and value not in shown:
                raise ConstraintError(
                    f"{s.name}: must be one of {shown}, got {brief(value)}"
                    f"{close_matches(value, [str(v) for v in shown])}"
                )
            problem = s.check(value)
            if problem:
                raise ConstraintError(f"{s.name}: {problem}")

    # -- reading ---------------------------------------------------------------------------
    def bounds(self, degree: str) -> Tuple[int, int]:
        """(lowest, highest) value ``degree`` may take: ``fix`` or ``min``/``max`` (1..MAX_COUNT)."""
        if degree in self.fix:
            return int(self.fix[degree]), int(self.fix[degree])
        return self.min.get(degree, 1), self.max.get(degree, MAX_COUNT)

    def items(self) -> List[Tuple[str, str]]:
        """Each constraint set, as (key, text): the key names it for :meth:`without`, the text as
        the command line writes it (``--fix tp=8``, ``--memory-headroom 0.1``)."""
        out = [(f"fix.{k}", f"--fix {k}={_text(v)}") for k, v in self.fix.items()]
        out += [(f"{kind}.{k}", f"--{kind} {k}={v}") for kind in ("min", "max") for k, v in getattr(self, kind).items()]
        for s in CHOICES:
            values = getattr(self, s.allowed)
            if values is not None:
                out.append((s.allowed, f"{s.flag} {','.join(str(v) for v in values)}"))
        for s in OPTIONS:
            value = getattr(self, s.name)
            if value is not None:
                out.append((s.name, f"{s.flag} {value:g}" if s.type is float else f"{s.flag} {value}"))
        return out

    def without(self, key: str) -> "Constraints":
        """A copy without the constraint ``key`` (a key of :meth:`items`)."""
        data = self.to_dict()
        kind, _, name = key.partition(".")
        if name:
            data[kind] = {k: v for k, v in data[kind].items() if k != name}
        else:
            data.pop(kind, None)
        return Constraints.from_dict(data)

    def describe(self) -> str:
        """One line for the plan's printout: 'tp = 8, pp <= 4, schedule 1f1b, ...' ('none')."""
        parts = [f"{k} = {_text(v)}" for k, v in self.fix.items()]
        for k in DEGREES:
            lo, hi = self.min.get(k), self.max.get(k)
            if lo is not None and hi is not None:
                parts.append(f"{lo} <= {k} <= {hi}")
            elif lo is not None:
                parts.append(f"{k} >= {lo}")
            elif hi is not None:
                parts.append(f"{k} <= {hi}")
        for s in CHOICES:
            values = getattr(self, s.allowed)
            if values is not None:
                parts.append(f"{s.flag.lstrip('-')} {'|'.join(str(v) for v in values)}")
        for s in OPTIONS:
            value = getattr(self, s.name)
            if value is not None:
                shown = f"{100 * value:g}%" if s.type is float else value
                parts.append(f"{s.name.replace('_', ' ')} {shown}")
        return ", ".join(parts) or "none"

    def __bool__(self) -> bool:
        return bool(self.items())

    # -- file form -------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """The set entries only (the plan file's ``constraints`` field)."""
        out: Dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value != {}:
                out[f.name] = (
                    dict(value) if isinstance(value, dict) else (list(value) if isinstance(value, list) else value)
                )
        return out

    @classmethod
    def from_dict(cls, data: object, where: str = "constraints") -> "Constraints":
        """Build and validate from the file form; errors start with ``where`` and the entry's path
        (``constraints.fix.tp: ...``)."""
        if not isinstance(data, Mapping):
            raise ConstraintError(f"{where}: must be a mapping of constraints, got {brief(data)}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known), key=str)
        if unknown:
            raise ConstraintError(
                f"{where}: unknown key(s) {unknown}{close_matches(unknown[0], known)}; known: {known}"
            )
        for kind in ("fix", "min", "max"):
            if kind in data and not isinstance(data[kind], Mapping):
                raise ConstraintError(f"{where}.{kind}: must map degrees to values, got {brief(data[kind])}")
        try:
            return cls(**{k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()})
        except ConstraintError as exc:
            raise ConstraintError(f"{where}.{exc}") from None


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _degree(key: object, value: object, kind: str) -> None:
    if key not in DEGREES:
        known = list(DEGREES) + (list(FLAGS) if kind == "fix" else [])
        raise ConstraintError(f"{kind}: unknown degree {brief(key)}{close_matches(key, known)}; known: {known}")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise ConstraintError(f"{kind}.{key}: must be an integer >= 1, got {brief(value)}")


def schedule_pairs(names: Sequence[str], interleave_factors: Sequence[int]) -> List[Tuple[str, int]]:
    """``(schedule, v)`` pairs of schedule names: ``interleaved`` (``interleaved-zb``) takes each of
    ``interleave_factors``, ``interleaved:V`` the one V, the others their ``model_chunks`` (2 for
    the V schedules, else 1)."""
    out: List[Tuple[str, int]] = []
    for name in names:
        base, _, v = name.partition(":")
        for pair in (
            [(base, int(v))]
            if v
            else [(base, f) for f in interleave_factors]
            if base in CHUNKED_SCHEDULES
            else [(base, model_chunks(base, 1))]
        ):
            if pair not in out:
                out.append(pair)
    return out


# -- the command line's text forms ----------------------------------------------------------


def parse_assignments(text: str, kind: str) -> Dict[str, Union[int, bool]]:
    """``"tp=8,pp=16"`` -> ``{"tp": 8, "pp": 16}`` (``fix`` also takes flags: ``compile=false``);
    ConstraintError naming the bad part."""
    out: Dict[str, Union[int, bool]] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, eq, raw = part.partition("=")
        key, raw = key.strip().replace("-", "_"), raw.strip()
        if not eq or not key or not raw:
            raise ConstraintError(f"--{kind} {text}: {part!r} is not NAME=VALUE (e.g. --{kind} tp=8,pp=4)")
        if kind == "fix" and key in FLAGS:
            if raw.lower() not in ("true", "false", "on", "off", "1", "0"):
                raise ConstraintError(f"--fix {key}={raw}: a flag is true or false")
            out[key] = raw.lower() in ("true", "on", "1")
            continue
        if not raw.isdigit():
            raise ConstraintError(f"--{kind} {key}={raw}: {key} takes a positive integer")
        out[key] = int(raw)
    return out


def parse_list(text: str, what: str, integers: bool = False) -> List[Union[str, int]]:
    """``"1f1b,interleaved:4"`` -> a list; integers for microbatch sizes and ZeRO stages."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ConstraintError(f"{what}: give at least one value")
    if integers:
        if not all(p.isdigit() for p in parts):
            raise ConstraintError(f"{what} {text}: expected comma-separated integers")
        return [int(p) for p in parts]
    return parts


def parse_fraction(text: str, what: str = "--memory-headroom") -> float:
    """``"0.1"`` or ``"10%"`` -> 0.1."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ConstraintError(f"{what} {text}: expected a fraction such as 0.1 or a percentage such as 10%") from None
    return value
