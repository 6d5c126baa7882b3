"""One timer interface for every device: CUDA events on GPUs, ``time.perf_counter`` on CPU.

``timer.measure(fn)`` runs ``fn`` ``warmup`` times untimed, then ``repeats`` times timed, and
returns the median seconds (the median resists the outliers a shared machine produces;
``statistic="min"`` gives the least-disturbed run, for comparisons on a loaded machine). On a
GPU, figures the host's speed decides (dispatch times, whole steps) always take the minimum:
the host's noise there is one-sided.

What one repeat of an *op* costs (``measure``):

* CPU: the wall time of the call.
* CUDA: ``max(kernel time, host dispatch time)`` (``measure_split`` gives both). Eager
  PyTorch is a producer/consumer pair: the host enqueues kernels while the GPU runs earlier
  ones, so an op costs its kernel time when the GPU is the bottleneck and its dispatch time
  (Python, autograd, launches) when the host is. The kernel time is read from a pair of CUDA
  events recorded after a ``torch.cuda._sleep`` that holds the GPU until the host has
  enqueued every kernel of the op, so the events see the kernels back to back and none of
  the host's gaps. The dispatch time is ``perf_counter`` around the call on an idle GPU, in a
  second pass; an op that synchronises with the GPU (``.item()``, data-dependent shapes)
  waits out its kernels there, so its host time covers them.

``cpu_offset`` is subtracted from the host side of each repeat: a fixed per-call cost the op
pays in isolation but not inside a model (the start-up of ``torch.autograd.grad``).

``measure_step(fn)`` times a whole step as it runs: synchronised wall time per repeat. This is
the reference the per-op sums are checked against.

Before each timed repeat the timer overwrites a scratch buffer larger than the device's
last-level cache (``flush_bytes``; 0 turns it off). An op repeated on the same inputs would
otherwise find its inputs and weights in cache, which it never does inside a training step
(the ops in between evict them), and the per-op sum would undershoot the step.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional, Tuple

import torch

from nest_fx.workload.profile_file import ProfileError

_MAX_HOLD_S = 0.05  # longest GPU hold per repeat; an op dispatching for longer is host-bound anyway


class Timer:
    """Median (or minimum) seconds of a callable on a CPU or CUDA device."""

    def __init__(
        self,
        device: torch.device,
        warmup: int = 2,
        repeats: int = 5,
        flush_bytes: Optional[int] = None,
        statistic: str = "median",
    ):
        if warmup < 0 or repeats < 1:
            raise ProfileError(f"warmup={warmup}, repeats={repeats}: need warmup >= 0 and repeats >= 1")
        if statistic not in ("median", "min"):
            raise ProfileError(f"statistic={statistic!r}: use 'median' or 'min'")
        self.statistic = statistic
        self.device = torch.device(device)
        self.warmup = warmup
        self.repeats = repeats
        if flush_bytes is None:  # above an H100's 50 MB L2; above a CPU core's L2
            flush_bytes = 256 * 2**20 if self.device.type == "cuda" else 8 * 2**20
        self._scratch = torch.empty(flush_bytes // 4, dtype=torch.float32, device=self.device) if flush_bytes else None
        self._cycles_per_s: Optional[float] = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def flush(self) -> None:
        """Evict caches by rewriting the scratch buffer (not timed)."""
        if self._scratch is not None:
            self._scratch.fill_(1.0)

    def samples(self, fn: Callable[[], object], cpu_offset: float = 0.0) -> List[Tuple[float, float]]:
        """(device seconds, host seconds) of each timed repeat of an op (see the module docstring);
        on CPU both are the wall time."""
        self._warm_up(fn)
        if self.cuda:
            return self._cuda_samples(fn, cpu_offset)
        return [(wall, wall) for wall in self._wall_samples(fn, wait=False, cpu_offset=cpu_offset)]

    def _warm_up(self, fn: Callable[[], object]) -> None:
        for _ in range(self.warmup):
            fn()

    def _wall_samples(self, fn: Callable[[], object], wait: bool, cpu_offset: float = 0.0) -> List[float]:
        """Host seconds of each repeat, each started on a flushed, idle device: until ``fn``
        returns (``wait=False``: what the host spends dispatching it) or until the device has
        finished its work too (``wait=True``), less ``cpu_offset``."""
        out = []
        for _ in range(self.repeats):
            self.flush()
            self.synchronize()
            start = time.perf_counter()
            fn()
            if wait:
                self.synchronize()
            out.append(max(time.perf_counter() - start - cpu_offset, 0.0))
        self.synchronize()
        return out

    def _cuda_samples(self, fn: Callable[[], object], cpu_offset: float) -> List[Tuple[float, float]]:
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        fn()
        dispatch = time.perf_counter() - t0
        hold = int(min(2 * dispatch + 1e-4, _MAX_HOLD_S) * self._sleep_rate())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        kernels = []
        for _ in range(self.repeats):
            self.flush()
            torch.cuda._sleep(hold)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            kernels.append(start.elapsed_time(end) / 1e3)
        # Host dispatch on an idle GPU: launching while a kernel runs is slower on some nodes
        # (3x on a virtualised H100), and an op that synchronises waits out its own kernels here.
        return list(zip(kernels, self._wall_samples(fn, wait=False, cpu_offset=cpu_offset)))

    def _sleep_rate(self) -> float:
        """GPU clock cycles per second of ``torch.cuda._sleep`` (measured once)."""
        if self._cycles_per_s is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cycles = 2_000_000
            torch.cuda._sleep(cycles)  # wake the clocks up
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            torch.cuda.synchronize(self.device)
            self._cycles_per_s = cycles / max(start.elapsed_time(end) / 1e3, 1e-6)
        return self._cycles_per_s

    def _reduce(self, samples: List[float], host: bool = False) -> float:
        # A host's timing noise on a GPU node is one-sided (the thread gets preempted, the VM
        # descheduled): its least-disturbed repeat is the dispatch cost. Kernel times are steady.
        if self.statistic == "min" or (host and self.cuda):
            return min(samples)
        return statistics.median(samples)

    def measure(self, fn: Callable[[], object], cpu_offset: float = 0.0) -> float:
        """Median (or minimum) seconds of the op ``fn()`` over ``repeats`` runs after ``warmup`` runs:
        per repeat the larger of its device and host time."""
        return max(self.measure_split(fn, cpu_offset))

    def measure_split(self, fn: Callable[[], object], cpu_offset: float = 0.0) -> Tuple[float, float]:
        """Median (or minimum) (device seconds, host seconds) of the op ``fn()``: what it keeps the
        GPU busy for, and what it keeps the host busy for (equal on CPU)."""
        samples = self.samples(fn, cpu_offset)
        return self._reduce([d for d, _ in samples]), self._reduce([h for _, h in samples], host=True)

    def measure_host(self, fn: Callable[[], object]) -> float:
        """Median (or minimum) host seconds of ``fn()``: on CUDA the time to enqueue it, not to run it."""
        self._warm_up(fn)  # flushed like the ops whose host time this may be subtracted from
        return self._reduce(self._wall_samples(fn, wait=False), host=True)

    def measure_step(self, fn: Callable[[], object]) -> float:
        """Median (or minimum) synchronised wall seconds of a whole step ``fn()``."""
        self._warm_up(fn)
        # small models' steps are host-bound (one-sided noise); big ones are steady either way
        return self._reduce(self._wall_samples(fn, wait=True), host=True)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
