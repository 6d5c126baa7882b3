"""The type of one plan setting's declaration (:class:`Setting`): its value checks and the
dataclass fields made from it (:func:`fields_of`, :func:`add_fields`). The declarations
themselves are in ``nest_fx.plan.settings``.

Roles (:attr:`Setting.role`):

``degree``  an integer parallel degree the planner searches; constrained by ``fix``/``min``/``max``
``flag``    a boolean the planner decides or the user fixes (``fix``)
``choice``  a value the planner picks from a list the user may narrow (``Constraints.<allowed>``)
``option``  how the model is trained (precision, optimizer, memory headroom): one value, set by
            the user or defaulted per device, costed by the cost model and never relaxed
``record``  what the plan file records (sizes, names, the model it was made for)

Scopes: ``plan`` (a field of :class:`Plan`), ``stage`` (a field of each
:class:`~nest_fx.plan.plan.StagePlan`), ``derived`` (computed from the stages: ``pp``) and
``run`` (recorded in the plan's constraints only: optimizer, memory headroom).

Only the standard library and ``nest_fx.common`` are imported (the command line builds its
parser from the declarations before it imports torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

from nest_fx.common.fileio import brief
from nest_fx.common.limits import MAX_COUNT
from nest_fx.common.names import close_matches

ROLES = ("degree", "flag", "choice", "option", "record")
SCOPES = ("plan", "stage", "derived", "run")


class _Unsearched:
    """The :attr:`Setting.search` of a setting the planner's options have no field for."""

    def __repr__(self) -> str:
        return "UNSEARCHED"


UNSEARCHED = _Unsearched()


@dataclass(frozen=True)
class Setting:
    """One plan setting (module docstring). ``check(value)`` is '' when a value is allowed, else
    what is wrong (type, range, allowed values); ``allowed`` names the list of allowed values in
    :class:`Constraints` (``choice``) and ``entry_check`` checks an entry of it (a schedule list
    may say ``interleaved:4``)."""

    name: str
    type: type  # int, bool, str, float, list, dict
    default: Any
    doc: str
    role: str
    scope: str = "plan"
    values: Tuple[Any, ...] = ()  # the allowed values, when a fixed set ("" = not recorded is allowed too)
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    allowed: str = ""  # choice: the Constraints list of allowed values ("zero_stages")
    flag: str = ""  # the `nest-fx plan` flag (choices: a comma-separated list; options: the value)
    metavar: str = ""
    example_flag: str = ""  # the examples' flag that sets it (examples/_common.py)
    entry_check: Optional[Callable[[object], str]] = None
    factory: Optional[Callable[[], Any]] = None  # default_factory for mutable defaults
    optional: bool = False  # None is allowed (absent)
    annotation: str = ""  # the dataclass annotation, when not the type's name
    # what the planner tries unless told otherwise: the default of this setting's field of the
    # planner's options (SolverOptions, named by search_name()), in the planner's form. A degree's
    # candidate values (None: from the model, e.g. every divisor of the expert count); a choice's
    # list (schedules as (schedule, interleave factor) pairs); a flag's policy (True: wherever it
    # applies; None: wherever allowed, never slower; False: off unless the user sets it, then
    # costed, never searched); an option's value (None: the user's, else a default per device).
    # UNSEARCHED: no field (the search derives it: pp, dp, dp_shard; or it is a record)
    search: Any = UNSEARCHED

    def type_problem(self, value: object) -> str:
        """'' when ``value`` has this setting's type (and a count is within MAX_COUNT), else what
        is wrong, e.g. ``must be an integer, got 'two'``."""
        if value is None and self.optional:
            return ""
        if self.type is bool:
            return "" if isinstance(value, bool) else f"must be true or false, got {brief(value)}"
        if self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                return f"must be an integer, got {brief(value)}"
        if self.type is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return f"must be a number, got {brief(value)}"
        if self.type is str and not isinstance(value, str):
            return f"must be a string, got {brief(value)}"
        return ""

    def range_problem(self, value: object) -> str:
        """'' when ``value`` (of the right type) is allowed, else what is wrong, e.g. ``7, use 0,
        1, 2 or 3`` or ``must be >= 1, got 0``."""
        if value is None and self.optional:
            return ""
        if self.type is int and abs(value) > MAX_COUNT:
            return f"{brief(value)} is larger than nest-fx handles (at most {MAX_COUNT:,})"
        if self.values and value not in self.values:
            near = (
                close_matches(value, [v for v in self.values if isinstance(v, str) and v])
                if isinstance(value, str)
                else ""
            )
            return f"{brief(value)}{near}, use {_choices_text(self.values)}"
        if self.minimum is not None and value < self.minimum:
            return f"must be >= {self.minimum:g}, got {value}"
        if self.maximum is not None and value > self.maximum:
            return f"must be <= {self.maximum:g}, got {value}"
        if self.entry_check is not None and (self.role != "choice" or self.scope == "stage"):
            return self.entry_check(value)  # a stage's recompute policy is checked like a list entry
        return ""

    def check(self, value: object) -> str:
        """'' when ``value`` is an allowed value of this setting, else what is wrong (no name)."""
        return self.type_problem(value) or self.range_problem(value)

    def check_entry(self, value: object) -> str:
        """'' when ``value`` may be listed in this choice's allowed values, else what is wrong."""
        if self.entry_check is not None:
            return self.entry_check(value)
        return self.check(value)

    def dataclass_field(self) -> Tuple[str, str, Any]:
        """(name, annotation, dataclasses.field) for a generated dataclass."""
        ann = self.annotation or self.type.__name__
        if self.factory is not None:
            return self.name, ann, field(default_factory=self.factory)
        return self.name, ann, field(default=self.default)

    def search_name(self) -> str:
        """The planner's field of this setting: ``<name>_degrees`` for a degree (``tp_degrees``),
        the constraints' list for a choice (``zero_stages``), else the setting's name."""
        if self.role == "degree":
            return f"{self.name}_degrees"
        return self.allowed if self.role == "choice" else self.name

    def search_field(self) -> Tuple[str, str, Any]:
        """(name, annotation, dataclasses.field) of the planner's field, defaulting to :attr:`search`."""
        if self.role in ("degree", "choice"):
            entry = "Tuple[str, int]" if self.search and isinstance(self.search[0], tuple) else self.type.__name__
            ann = f"Sequence[{entry}]"
        else:
            ann = self.type.__name__
        return self.search_name(), ann if self.search is not None else f"Optional[{ann}]", field(default=self.search)


def _choices_text(values: Tuple[Any, ...]) -> str:
    shown = [v for v in values if v != ""]
    if all(isinstance(v, int) for v in shown):
        return ", ".join(str(v) for v in shown[:-1]) + f" or {shown[-1]}"
    return f"one of {tuple(shown)}"


def fields_of(settings: Tuple[Setting, ...]) -> List[Tuple[str, str, Any]]:
    """``dataclasses.make_dataclass`` field specs of ``settings``, in declaration order."""
    return [s.dataclass_field() for s in settings]


def add_fields(settings: Tuple[Setting, ...], search: bool = False):
    """Class decorator: the declared ``settings`` as annotated class attributes (after those the
    class body declares), ready for ``@dataclass``; ``search``: their planner fields instead
    (:meth:`Setting.search_field`: ``tp_degrees = (1, 2, 4, 8)``, ...)."""

    def wrap(cls):
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for name, annotation, f in [s.search_field() for s in settings] if search else fields_of(settings):
            annotations[name] = annotation
            setattr(cls, name, f)
        cls.__annotations__ = annotations
        return cls

    return wrap
