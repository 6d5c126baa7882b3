"""Memory limits and measurements of one process, for ``scripts/bench_big_model.py``.

* :func:`join_cgroup`: move this process into a child memory cgroup (v1 or v2) it cannot exceed
  (the kernel reclaims page cache, then kills the process). Memory the process touched before
  joining stays charged where it was: the rank's bound is the limit plus its RSS at the join.
* :class:`Sampler`: the peak anonymous and file-backed resident memory per named phase.
* :func:`status_kib`, :func:`reset_peak`: ``/proc/self/status`` fields, ``VmHWM`` reset.
* :func:`io_counters`: ``/proc/self/io`` (``rchar``: bytes the process asked ``read`` calls for;
  ``read_bytes``: bytes it made the kernel fetch from storage, readahead included).
* :func:`baseline_rank`: an empty rank (torch, transformers and nest-fx imported, a gloo group,
  one all-reduce): what every process has before any model.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Dict, Optional

MiB = 2**20


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (0 when absent)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def io_counters() -> Dict[str, int]:
    """``/proc/self/io`` as ints ({} where unreadable)."""
    try:
        with open("/proc/self/io") as fh:
            return {k: int(v) for k, v in (line.split(":") for line in fh if ":" in line)}
    except OSError:
        return {}


def own_memory_cgroup() -> Optional[str]:
    """The directory of this process's memory cgroup (v1 ``memory`` controller, or v2)."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return "/sys/fs/cgroup/memory" + path
    for line in lines:
        if line.startswith("0::"):
            return "/sys/fs/cgroup" + line[3:]
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def join_cgroup(name: str, limit: int) -> str:
    """Move this process into a new child cgroup limited to ``limit`` bytes (swap included)."""
    base = own_memory_cgroup()
    if base is None or not os.path.isdir(base):
        raise OSError("no memory cgroup found")
    path = os.path.join(base, name)
    os.makedirs(path, exist_ok=True)
    if os.path.exists(os.path.join(path, "memory.limit_in_bytes")):  # cgroup v1
        _write(os.path.join(path, "memory.limit_in_bytes"), str(limit))
        if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
            _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(limit))
    else:  # cgroup v2
        _write(os.path.join(path, "memory.max"), str(limit))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            _write(os.path.join(path, "memory.swap.max"), "0")
    _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
    return path


def remove_cgroup(name: str) -> None:
    """Remove the child cgroup ``name`` of this process's cgroup (no error when gone)."""
    base = own_memory_cgroup()
    if base is not None:
        try:
            os.rmdir(os.path.join(base, name))
        except OSError:
            pass


def cgroup_stat(path: Optional[str]) -> Dict[str, int]:
    """The cgroup's usage and its anonymous (rss) and page-cache parts, MiB (v1 names; {} if none)."""
    out: Dict[str, int] = {}
    if path is None:
        return out
    try:
        with open(os.path.join(path, "memory.usage_in_bytes")) as fh:
            out["usage"] = int(fh.read()) // MiB
        with open(os.path.join(path, "memory.stat")) as fh:
            for line in fh:
                key, value = line.split()
                if key in ("rss", "cache", "mapped_file"):
                    out[key] = int(value) // MiB
    except OSError:
        pass
    return out


def cgroup_peak(path: Optional[str]) -> Optional[int]:
    """The cgroup's peak usage (v1 ``max_usage_in_bytes``, v2 ``peak``); it counts page cache too."""
    if path is None:
        return None
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        try:
            with open(os.path.join(path, name)) as fh:
                return int(fh.read().strip())
        except OSError:
            continue
    return None


class Sampler:
    """Peak anonymous (heap: tensors, allocator) and file-backed (mapped files: libraries)
    resident memory of this process per phase, sampled every ``period`` s."""

    def __init__(self, period: float = 0.01, progress: Optional[str] = None, cgroup: Optional[str] = None):
        self.phase, self.peaks, self.cgroup = "start", {}, cgroup
        self.progress = progress  # a file the current phase and peaks are written to twice a second
        threading.Thread(target=self._run, args=(period,), daemon=True).start()

    def _run(self, period: float) -> None:
        last = 0.0
        while True:
            anon, file = status_kib("RssAnon") * 1024, status_kib("RssFile") * 1024
            peak = self.peaks.setdefault(self.phase, [0, 0])
            peak[0], peak[1] = max(peak[0], anon), max(peak[1], file)
            if self.progress and time.monotonic() - last > 0.5:
                last = time.monotonic()
                with open(self.progress, "w") as fh:  # what is left of a rank the kernel killed
                    fh.write(
                        f"phase {self.phase}: anon {anon / MiB:.0f} MiB, file {file / MiB:.0f} MiB; peaks "
                        + ", ".join(f"{k} {v[0] / MiB:.0f}+{v[1] / MiB:.0f}" for k, v in self.peaks.items())
                        + f"; cgroup {cgroup_stat(self.cgroup)}"
                    )
            time.sleep(period)

    def report(self) -> Dict[str, Dict[str, int]]:
        return {k: {"anon_bytes": v[0], "file_bytes": v[1]} for k, v in self.peaks.items()}


def watchdog(limit: int, period: float = 0.005) -> None:
    """Kill this process when its RSS passes ``limit`` (polled every ``period`` s)."""
    page = os.sysconf("SC_PAGE_SIZE")

    def run() -> None:
        while True:
            with open("/proc/self/statm") as fh:
                rss = int(fh.read().split()[1]) * page
            if rss > limit:
                print(f"watchdog: RSS {rss / MiB:.0f} MiB > limit {limit / MiB:.0f} MiB: killing rank", flush=True)
                os._exit(137)
            time.sleep(period)

    threading.Thread(target=run, daemon=True).start()


def set_mmap_threshold(nbytes: int) -> bool:
    """glibc ``mallopt(M_MMAP_THRESHOLD, nbytes)``: every allocation of at least ``nbytes`` gets
    its own mapping, returned to the kernel when freed, and the threshold stops adapting (by
    default glibc raises it to the size of each large block freed, up to 32 MiB, after which
    gradients and activations share the heap and their freed gaps stay resident)."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, int(nbytes)))  # M_MMAP_THRESHOLD = -3
    except OSError:
        return False


def memory_now() -> Dict[str, int]:
    """RSS, its anonymous and file-backed parts and the high-water mark, in bytes."""
    return {
        "rss": status_kib("VmRSS") * 1024,
        "anon": status_kib("RssAnon") * 1024,
        "file": status_kib("RssFile") * 1024,
        "hwm": status_kib("VmHWM") * 1024,
    }


def baseline_rank() -> Dict[str, int]:
    """An empty rank as the benchmark's ranks start: libraries imported, a gloo group, one
    all-reduce of 1 MiB and a barrier. Returns :func:`memory_now` before and after the group."""
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401 - part of every rank of the benchmark

    import nest_fx.apply.api  # noqa: F401

    before = memory_now()
    dist.init_process_group("gloo")
    t = torch.ones(MiB // 4)
    dist.all_reduce(t)
    dist.barrier()
    del t
    after = memory_now()
    return {"start": before, "gloo": after}
