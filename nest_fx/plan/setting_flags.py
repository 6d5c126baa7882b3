"""The command-line flags made from the plan settings' declarations (``nest_fx.plan.settings``):
the constraint flags of ``nest-fx plan`` (:func:`add_constraint_flags`) and their conversion into
constraints (:func:`constraints_data`), an option's flag on another command
(:func:`add_option_flag`), and the plan flags of ``examples/_common.py`` (:func:`example_flags`).

Only the standard library and the declarations are imported: the command line builds its
parser from this module before it imports torch.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, Mapping

from nest_fx.plan.setting import Setting
from nest_fx.plan.settings import DEGREES, FLAGS, PRICED_ONLY_OPTIONS, SETTINGS, default, setting


def _help(s: Setting) -> str:
    text = s.doc.replace("%", "%%")  # argparse formats help with %
    if s.role == "choice":
        return f"allowed values, comma-separated: {text}"
    if s.role == "flag":
        return f"{text}; shorthand for --fix {s.name}=true"
    return text


def _option_default(s: Setting) -> Any:
    """An option's flag default: its declared default when it is one of a closed set (the
    optimizer, always recorded), else None (given only: the precision defaults per device, and
    the options that price another system, whose default is what the runtime runs)."""
    if s.name in PRICED_ONLY_OPTIONS:
        return None
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
