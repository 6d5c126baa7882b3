"""What the scripts in scripts/ share: the environment a result was measured in, writing the
result as JSON (with that environment), and printing a table.

Scripts run as ``python scripts/NAME.py``, so this sibling module is importable as
``_bench_common`` as it is, like the installed package::

    from _bench_common import print_table, write_json

    print_table(rows, headers=["model", "step s"])
    write_json("results/bench_x.json", {"cases": rows})   # adds "environment"; prints "wrote ..."
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import sys
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

from tabulate import tabulate


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> Dict[str, Any]:
    """Where and with what a result was measured: the command, the time (UTC), the versions of
    Python, torch and transformers, the machine (processor, CPUs, GPU) and its load average."""
    import torch  # every script has imported it by now; here only for the GPU's name

    return {
        "command": "python " + " ".join(sys.argv),
        "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def environment_line() -> str:
    """One line for a script's log: versions, CPUs, GPU and load."""
    env = environment()
    load = env["load_average"]
    return (
        f"torch {env['torch']}, python {env['python']}, {env['machine']}"
        + (f", {env['gpu']}" if env["gpu"] else "")
        + (f", load {load[0]:.1f}" if load else "")
    )


def write_json(
    path: str,
    payload: Dict[str, Any],
    *,
    indent: int = 1,
    quiet: bool = False,
    default: Optional[Callable[[Any], Any]] = None,
) -> str:
    """Write ``payload`` and its ``environment`` to ``path`` (folders created); prints where.
    ``default``: as for ``json.dump`` (``str`` for values JSON has no type for)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({**payload, "environment": environment()}, fh, indent=indent, default=default)
    if not quiet:
        print(f"wrote {path}")
    return path


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str], **kwargs: Any) -> str:
    """A GitHub-markdown table (what the README and docs paste)."""
    return tabulate(list(rows), headers=list(headers), tablefmt=kwargs.pop("tablefmt", "github"), **kwargs)


def print_table(rows: Iterable[Sequence[Any]], headers: Sequence[str], **kwargs: Any) -> None:
    """Print :func:`table`."""
    print(table(rows, headers, **kwargs))


def add_search_case_arguments(ap, models: Sequence[str], clusters: Sequence[str]) -> None:
    """The planner-search benchmarks' case arguments (``bench_search_time.py``,
    ``search_trace_digest.py``): models, clusters, device counts and the global batch."""
    ap.add_argument("--models", nargs="+", default=list(models))
    ap.add_argument("--clusters", nargs="+", default=list(clusters))
    ap.add_argument("--devices", nargs="+", type=int, default=[1024, 65536])
    ap.add_argument("--global-batch", type=int, default=4096)
