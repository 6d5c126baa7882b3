"""Every plan setting, declared once: name, type, allowed values, default, doc, flag and role.

Made from these declarations (nothing else lists the settings):

* :class:`nest_fx.plan.Plan`'s fields, their defaults and the type and value checks of a plan
  file (``Plan.from_dict``, ``Plan.validate``);
* the vocabulary of :class:`nest_fx.plan.constraints.Constraints` (``fix``/``min``/``max`` of the
  degrees and flags, the lists of allowed values, the training options);
* the constraint flags of ``nest-fx plan`` (:func:`add_constraint_flags`) and their conversion
  into constraints (:func:`constraints_data`), and the plan flags of ``examples/_common.py``;
* the search space: the planner's options (``SolverOptions``: one field per setting with a
  :attr:`Setting.search`, e.g. ``tp_degrees``, ``zero_stages``, ``compile``, ``precision``) and
  its per-configuration settings (``GlobalConfig``), both in ``nest_fx.solver.space``.

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

Only the standard library and ``nest_fx.common`` are imported: the command line builds its
parser from this module before it imports torch. Adding a setting: docs/architecture.md,
"Adding a setting".
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from nest_fx.common.fileio import brief
from nest_fx.common.limits import MAX_COUNT
from nest_fx.common.names import close_matches
from nest_fx.plan.vocabulary import (
    ANY_INTERLEAVE,
    KERNELS,
    OPTIMIZER_NAMES,
    PLACEMENTS,
    PRECISIONS,
    SCHEDULES,
    recompute_problem,
    schedule_problem,
)

ROLES = ("degree", "flag", "choice", "option", "record")
SCOPES = ("plan", "stage", "derived", "run")


class _Unsearched:
    """The :attr:`Setting.search` of a setting the planner's options have no field for."""

    def __repr__(self) -> str:
        return "UNSEARCHED"


UNSEARCHED = _Unsearched()
# every per-layer policy and a ladder of layer intervals; the search drops those another policy
# beats in both time and memory (solver.range_classes.undominated_modes)
SEARCHED_RECOMPUTE = ("none", "op:matmuls", "op", "op:attention", "selective", "full", "every:2", "every:3", "every:4")


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


def _fraction_check(value: object) -> str:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value < 1
    return (
        "" if ok else (f"must be a fraction of device memory in [0, 1) (e.g. 0.1 keeps 10% free), got {brief(value)}")
    )


def _zero_check(value: object) -> str:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3
    return "" if ok else f"{brief(value)} is not a ZeRO stage; use 0, 1, 2 or 3"


def _size_check(value: object) -> str:
    ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_COUNT
    return "" if ok else f"{brief(value)} is not a microbatch size (an integer >= 1)"


def _placement_check(value: object) -> str:
    return "" if value in PLACEMENTS else f"{brief(value)} is not a placement; use one of {list(PLACEMENTS)}"


def _recompute_check(value: object) -> str:
    return recompute_problem(value)


SETTINGS: Tuple[Setting, ...] = (
    # -- degrees (searched; Constraints fix/min/max) ------------------------------------------
    Setting(
        "tp",
        int,
        1,
        "tensor-parallel degree of a stage",
        "degree",
        scope="stage",
        minimum=1,
        example_flag="--tp",
        search=(1, 2, 4, 8),
    ),
    Setting(
        "pp",
        int,
        1,
        "pipeline stages (the number of stages)",
        "degree",
        scope="derived",
        minimum=1,
        example_flag="--pp",
    ),
    Setting("dp", int, 1, "data-parallel replicas of the pipeline", "degree", minimum=1),
    Setting(
        "ep",
        int,
        1,
        "expert-parallel degree: ep consecutive replicas split the experts (divides dp)",
        "degree",
        minimum=1,
        example_flag="--ep",
        search=None,
    ),
    Setting(
        "cp",
        int,
        1,
        "context parallel: each stage replica's sequence is split over cp x tp devices",
        "degree",
        minimum=1,
        example_flag="--cp",
        search=(1, 2, 4, 8),
    ),
    Setting(
        "zero",
        int,
        0,
        "ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters (FSDP2; e.g. 3)",
        "choice",
        values=(0, 1, 2, 3),
        allowed="zero_stages",
        flag="--zero",
        metavar="Z[,Z]",
        entry_check=_zero_check,
        example_flag="--zero",
        search=(0, 1, 2, 3),
    ),
    Setting(
        "cp_mode",
        str,
        "allgather",
        "how context parallelism exchanges K/V: allgather (gathered before "
        "attention) or ring (blocks passed around the CP ring, each transfer under the previous block's "
        "attention); the planner keeps allgather",
        "record",
        values=("allgather", "ring"),
    ),
    Setting(
        "dp_shard",
        int,
        0,
        "HSDP: shard over groups of dp_shard consecutive replicas, replicate across; 0 = all of dp",
        "degree",
        minimum=0,
        example_flag="--dp-shard",
    ),
    # -- flags (Constraints fix) ---------------------------------------------------------------
    Setting(
        "loss_parallel",
        bool,
        False,
        "vocabulary-parallel cross-entropy over the last stage's TP group",
        "flag",
        example_flag="--loss-parallel",
        search=None,
    ),
    Setting(
        "compile",
        bool,
        False,
        "torch.compile each block (costed: fused elementwise ops, fewer launches; docs/cost_model.md)",
        "flag",
        flag="--compile",
        example_flag="--compile",
        search=False,
    ),
    Setting(
        "float8",
        bool,
        False,
        "Float8 linears (torchao) on devices with fp8 tensor cores (costed: fp8 GEMM "
        "rate, casts, fp8 weight all-gathers; docs/cost_model.md)",
        "flag",
        flag="--float8",
        search=False,
    ),
    Setting(
        "async_tp",
        bool,
        False,
        "async TP: PyTorch's micro-pipelined TP (inductor fuses sequence parallelism's "
        "all-gather / reduce-scatter with the matmuls over symmetric memory); needs tp > 1, sequence_parallel, "
        "compile and CUDA (costed: TP collectives under the stage's compute; docs/cost_model.md)",
        "flag",
        flag="--async-tp",
        search=False,
    ),
    # -- training options (costed, never relaxed) ----------------------------------------------
    Setting(
        "precision",
        str,
        "",
        "fp32 | bf16-mixed (bf16 parameters and compute, fp32 master weights, "
        "optimizer states and gradient reduction) | bf16-true (everything bf16); '' = not recorded (costed "
        "as the cost options say; the runtime keeps the model's dtype). Planner default: bf16-mixed on "
        "devices with bf16 matrix units, fp32 elsewhere",
        "option",
        values=("",) + PRECISIONS,
        flag="--precision",
        example_flag="--precision",
        search=None,
    ),
    Setting(
        "kernels",
        str,
        "",
        "the kernel backend the plan is costed with: eager (PyTorch ops one kernel each: "
        "nest-fx's runtime), compile (torch.compile per block: the runtime with compile), fused (Transformer "
        "Engine / Megatron-LM fused norm, RoPE, SwiGLU and FlashAttention-3 attention: to predict those "
        "systems); '' = compile when compile is set, else eager (docs/cost_model.md, Kernel backends)",
        "option",
        values=("",) + KERNELS,
        flag="--kernels",
        search=None,
    ),
    Setting("seq_len", int, 0, "the sequence length the plan was made for; 0 = not recorded", "record", minimum=0),
    # -- choices (Constraints lists of allowed values) -----------------------------------------
    Setting(
        "microbatch_size",
        int,
        1,
        "sequences per microbatch (e.g. 2)",
        "choice",
        minimum=1,
        allowed="microbatch_sizes",
        flag="--microbatch",
        metavar="B[,B]",
        entry_check=_size_check,
        search=(1, 2, 4, 8),
    ),
    Setting(
        "num_microbatches",
        int,
        1,
        "microbatches per step and replica",
        "record",
        minimum=1,
        example_flag="--microbatches",
    ),
    Setting(
        "schedule",
        str,
        "1f1b",
        "pipeline schedule: 1f1b, gpipe, interleaved or interleaved-zb (the "
        "planner's interleave factors), interleaved:V, interleaved-zb:V, zbv or dualpipev",
        "choice",
        values=SCHEDULES,
        allowed="schedules",
        flag="--schedule",
        metavar="S[,S]",
        entry_check=schedule_problem,
        example_flag="--schedule",
        # dualpipev is searched when named (--schedule): torch runs its paired forward and backward one
        # after the other, so it costs zbv's time with more memory (cost/schedules.py), never better
        search=(("1f1b", 1), ("interleaved", ANY_INTERLEAVE), ("interleaved-zb", ANY_INTERLEAVE), ("zbv", 2)),
    ),
    Setting(
        "virtual_stages",
        int,
        1,
        "model chunks per device (the interleaved schedules' v; 2 for zbv and dualpipev)",
        "record",
        minimum=1,
    ),
    Setting(
        "sequence_parallel",
        bool,
        False,
        "shard TP activations on the sequence dim between regions",
        "flag",
        example_flag="--sequence-parallel",
        search=True,
    ),
    Setting(
        "placement",
        str,
        "stage-major",
        "how stages and replicas sit on the rank order",
        "choice",
        values=PLACEMENTS,
        allowed="placements",
        flag="--placement",
        metavar="P[,P]",
        entry_check=_placement_check,
        search=PLACEMENTS,
    ),
    Setting(
        "recompute",
        str,
        "none",
        "activation recomputation of a stage: none, full, every:K (every K-th "
        "block), op (torchtitan's op-level selective checkpointing), op:POLICY, selective (attention core "
        "only); the planner tries all, dropping those never better in time and memory",
        "choice",
        scope="stage",
        allowed="recompute",
        flag="--recompute",
        metavar="R[,R]",
        entry_check=_recompute_check,
        example_flag="--recompute",
        search=SEARCHED_RECOMPUTE,
    ),
    # -- records -------------------------------------------------------------------------------
    Setting("model", str, "", "the model the plan was made for", "record"),
    Setting("model_fingerprint", str, "", "chain_fingerprint of the model's layer chain; '' = not recorded", "record"),
    Setting(
        "num_layers",
        int,
        0,
        "length of the workload chain the stage ranges index; 0 = not recorded",
        "record",
        minimum=0,
    ),
    Setting("world_size", int, 0, "devices of the cluster it was planned for; 0 = not recorded", "record", minimum=0),
    Setting("cluster", str, "", "the cluster it was planned for: preset NAME:DEVICES or a cluster file path", "record"),
    Setting(
        "device_order",
        list,
        None,
        "plan rank r runs on cluster rank device_order[r]; absent = identity",
        "record",
        optional=True,
        annotation="Optional[List[int]]",
    ),
    Setting(
        "constraints",
        dict,
        None,
        "what the user fixed or bounded when planning (absent: nothing)",
        "record",
        optional=True,
        annotation="Optional[Constraints]",
    ),
    Setting(
        "predicted",
        dict,
        None,
        "what the planner predicted (step time, memory, ...)",
        "record",
        factory=dict,
        annotation="Dict[str, float]",
    ),
    Setting("notes", str, "", "free text", "record"),
    # -- options recorded in the constraints only ----------------------------------------------
    Setting(
        "memory_headroom",
        float,
        0.05,
        "device memory to leave unused, a fraction in [0, 1) or a percentage "
        "(default 0.05: the CUDA context and allocator fragmentation), e.g. 0.1 or 10%",
        "option",
        scope="run",
        entry_check=_fraction_check,
        flag="--memory-headroom",
        metavar="F",
    ),
    # overlap of communication with compute, as measured fractions (docs/cost_model.md, "Overlap")
    Setting(
        "overlap_tp_comm",
        float,
        0.0,
        "share of the TP collectives hidden under the stage's compute, 0..1 "
        "(0: DTensor TP, the runtime; 0.25: torchtitan's async TP, measured; 1: all)",
        "option",
        scope="run",
        minimum=0.0,
        maximum=1.0,
        flag="--overlap-tp-comm",
        metavar="F",
    ),
    Setting(
        "overlap_ep_comm",
        float,
        0.0,
        "share of the expert all-to-alls hidden under compute, 0..1 (0: the runtime, which waits for them)",
        "option",
        scope="run",
        minimum=0.0,
        maximum=1.0,
        flag="--overlap-ep-comm",
        metavar="F",
    ),
    Setting(
        "overlap_cp_comm",
        float,
        0.0,
        "share of the context-parallel key/value exchange hidden under "
        "attention, 0..1 (0: the runtime's all-gather before attention)",
        "option",
        scope="run",
        minimum=0.0,
        maximum=1.0,
        flag="--overlap-cp-comm",
        metavar="F",
    ),
    Setting(
        "overlap_grad_sync",
        float,
        1.0,
        "share of the FSDP/ZeRO gradient and parameter traffic that may run "
        "under the backward (FSDP2's prefetch and asynchronous reduce-scatter: 1), 0..1",
        "option",
        scope="run",
        minimum=0.0,
        maximum=1.0,
        flag="--overlap-grad-sync",
        metavar="F",
    ),
    Setting(
        "overlap_p2p",
        float,
        1.0,
        "share of the pipeline sends run under compute (the runtime's asynchronous sends: 1), 0..1",
        "option",
        scope="run",
        minimum=0.0,
        maximum=1.0,
        flag="--overlap-p2p",
        metavar="F",
    ),
    Setting(
        "optimizer",
        str,
        "adam",
        "the optimizer trained with: its state bytes and update traffic are costed "
        "(sgd is PyTorch's SGD without momentum)",
        "option",
        scope="run",
        values=OPTIMIZER_NAMES,
        flag="--optimizer",
    ),
)

BY_NAME: Dict[str, Setting] = {s.name: s for s in SETTINGS}
PLAN_SETTINGS = tuple(s for s in SETTINGS if s.scope == "plan")
STAGE_SETTINGS = tuple(s for s in SETTINGS if s.scope == "stage")
DEGREES = tuple(s.name for s in SETTINGS if s.role == "degree")  # tp, pp, dp, ep, cp, dp_shard
FLAGS = tuple(
    s.name for s in SETTINGS if s.role == "flag"
)  # loss_parallel, compile, float8, async_tp, sequence_parallel
CHOICES = tuple(s for s in SETTINGS if s.role == "choice")  # each with its Constraints list
OPTIONS = tuple(s for s in SETTINGS if s.role == "option")  # precision, kernels, optimizer, memory_headroom, overlap_*
# the overlap shares (CostOptions fields of the same names; docs/cost_model.md, "Overlap")
OVERLAPS = tuple(s.name for s in SETTINGS if s.name.startswith("overlap_"))
SEARCHED = tuple(s for s in SETTINGS if s.search is not UNSEARCHED)  # each a field of the planner's options
# flags the planner never turns on: the user's choice of how to train, costed when set (compile, float8, async_tp)
COSTED_FLAGS = tuple(s.name for s in SEARCHED if s.role == "flag" and s.search is False)


def setting(name: str) -> Setting:
    """The declaration of ``name``; KeyError naming the known settings."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown setting {name!r}; known: {sorted(BY_NAME)}") from None


def default(name: str) -> Any:
    """The declared default of setting ``name``."""
    s = setting(name)
    return s.factory() if s.factory is not None else s.default


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


def value_problem(name: str, value: object) -> str:
    """'' when ``value`` is an allowed value of setting ``name``, else ``"<name>: <what is wrong>"``."""
    problem = setting(name).check(value)
    return f"{name}: {problem}" if problem else ""


# -- the command line -------------------------------------------------------------------------


def _help(s: Setting) -> str:
    text = s.doc.replace("%", "%%")  # argparse formats help with %
    if s.role == "choice":
        return f"allowed values, comma-separated: {text}"
    if s.role == "flag":
        return f"{text}; shorthand for --fix {s.name}=true"
    return text


def _option_default(s: Setting) -> Any:
    """An option's flag default: its declared default when it is one of a closed set (the
    optimizer, always recorded), else None (given only: the precision defaults per device)."""
    return s.default if s.values and s.default not in ("", None) else None


def add_constraint_flags(group: argparse._ActionsContainer) -> None:
    """The constraint flags of ``nest-fx plan``: ``--fix/--min/--max`` (degrees and flags), one
    flag per choice (its allowed values) and per option (its value), each from its declaration."""
    group.add_argument(
        "--fix",
        metavar="K=V[,K=V]",
        help=f"fix degrees or flags: {', '.join(DEGREES)}; "
        f"{', '.join(FLAGS)} (e.g. --fix tp=8,pp=16; --fix pp=1: no pipeline)",
    )
    group.add_argument("--min", metavar="K=V[,K=V]", help="lower bounds on degrees (e.g. --min dp=8)")
    group.add_argument("--max", metavar="K=V[,K=V]", help="upper bounds on degrees (e.g. --max tp=4,pp=8)")
    group.add_argument("--max-tp", type=int, help="shorthand for --max tp=N")
    group.add_argument("--max-pp", type=int, help="shorthand for --max pp=N")
    for s in SETTINGS:
        if not s.flag:
            continue
        if s.role == "flag":
            group.add_argument(s.flag, action="store_true", help=_help(s))
        elif s.role == "option":
            add_option_flag(group, s.name)
        else:
            group.add_argument(s.flag, metavar=s.metavar, help=_help(s))


def add_option_flag(parser: argparse._ActionsContainer, name: str, help_prefix: str = "") -> None:
    """One option's flag (``--precision``), also on other commands (``simulate``)."""
    s = setting(name)
    shown = _option_default(s)
    parser.add_argument(
        s.flag,
        metavar=s.metavar or None,
        choices=[v for v in s.values if v != ""] or None,
        default=shown,
        help=f"{help_prefix}{_help(s)}" + (f" (default {shown})" if shown else ""),
    )


def dest(s: Setting) -> str:
    """The argparse attribute of a setting's flag."""
    return s.flag.lstrip("-").replace("-", "_")


def constraints_data(
    args: argparse.Namespace,
    parse_assignments: Callable[[str, str], dict],
    parse_list: Callable[..., list],
    parse_fraction: Callable[[str], float],
) -> Dict[str, Any]:
    """The file form of the constraints the command line gave (``Constraints.from_dict`` builds
    them): ``--fix/--min/--max``, the flag shorthands, each choice's list and each option's value."""
    data: Dict[str, Any] = {kind: parse_assignments(getattr(args, kind) or "", kind) for kind in ("fix", "min", "max")}
    for degree in ("tp", "pp"):
        value = getattr(args, f"max_{degree}", None)
        if value is not None:
            data["max"][degree] = value
    for s in SETTINGS:
        if not s.flag or getattr(args, dest(s), None) in (None, False):
            continue
        raw = getattr(args, dest(s))
        if s.role == "flag":
            data["fix"][s.name] = True
        elif s.role == "choice":
            data[s.allowed] = parse_list(raw, s.flag, integers=s.type is int)
        elif s.type is float:
            data[s.name] = parse_fraction(raw, s.flag)
        else:
            data[s.name] = raw
    return data


def example_flags(parser: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    """The plan flags of the examples (``examples/_common.py``): one per setting that names an
    ``example_flag``, defaulting to ``defaults`` or the declaration."""
    for s in SETTINGS:
        if not s.example_flag:
            continue
        value = defaults.get(s.name, default(s.name) if s.scope != "derived" else 1)
        if s.type is bool:
            parser.add_argument(s.example_flag, action="store_true", help=s.doc)
        elif s.values:
            parser.add_argument(
                s.example_flag, type=s.type, default=value, choices=[v for v in s.values if v != ""] or None, help=s.doc
            )
        else:
            parser.add_argument(s.example_flag, type=s.type, default=value, help=s.doc)


def example_values(args: argparse.Namespace) -> Dict[str, Any]:
    """The value each example flag gave its setting, by setting name."""
    return {s.name: getattr(args, s.example_flag.lstrip("-").replace("-", "_")) for s in SETTINGS if s.example_flag}
