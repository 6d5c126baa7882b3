"""``nest-fx`` command line: trace, profile, plan, simulate, explain, export.

User errors (bad names, bad files, shapes that do not fit) print one line ``error: ...`` and
exit with code 2; no traceback. ``NEST_FX_DEBUG=1`` shows the traceback.

Start-up time: ``--help`` (of every command), argument errors and missing or unreadable input
files are answered before torch is imported (in a fraction of a second rather than the seconds
torch takes to import; scripts/bench_cli.py). So the command line's modules import only
torch-free modules at their top, and each command handler imports the rest when it runs.

This module: :func:`main` (parse, check the input files, run the handler, print user errors).
The parser is ``cli_parser``, the handlers ``cli_commands`` and ``cli_profile``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from nest_fx.cli_parser import build_parser  # build_parser is also imported from here (tests)
from nest_fx.common.errors import NestFxError, UserError
from nest_fx.common.fileio import check_readable, one_line

INPUT_FILES = (("plan", "plan"), ("workload", "workload"), ("profile", "profile"))  # (argument, what) read first


def _check_inputs(args: argparse.Namespace) -> None:
    """The input files the command names exist and are readable regular files (the readers'
    own messages), checked before any handler imports torch."""
    for name, what in INPUT_FILES:
        path = getattr(args, name, None)
        if isinstance(path, str):
            check_readable(path, UserError, what)


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``nest-fx`` on ``argv`` (default: the process's arguments); the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_inputs(args)
        return args.func(args)
    except NestFxError as exc:
        if os.environ.get("NEST_FX_DEBUG"):
            raise
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
