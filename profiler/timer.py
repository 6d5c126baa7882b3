"""One timer interface for every device: CUDA events on GPUs, ``time.perf_counter`` on CPU.

``timer.measure(fn)`` runs ``fn`` ``warmup`` times untimed, then ``repeats`` times timed, and
returns the median seconds (the median resists the outliers a shared machine produces;
``statistic="min"`` gives the least-disturbed run, for comparisons on a loaded machine). On
CUDA each repeat is bracketed by a pair of events recorded on the current stream, so the
figure is device time, not Python time; the CPU path times the whole call.

Before each timed repeat the timer overwrites a scratch buffer larger than the device's
last-level cache (``flush_bytes``; 0 turns it off). An op repeated on the same inputs would
otherwise find its inputs and weights in cache, which it never does inside a training step
(the ops in between evict them), and the per-op sum would undershoot the step.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional

import torch


class Timer:
    """Median wall (CPU) or device (CUDA) seconds of a callable."""

    def __init__(self, device: torch.device, warmup: int = 2, repeats: int = 5, flush_bytes: Optional[int] = None,
                 statistic: str = "median"):
        if warmup < 0 or repeats < 1:
            raise ValueError(f"warmup={warmup}, repeats={repeats}: need warmup >= 0 and repeats >= 1")
        if statistic not in ("median", "min"):
            raise ValueError(f"statistic={statistic!r}: use 'median' or 'min'")
        self.statistic = statistic
        self.device = torch.device(device)
        self.warmup = warmup
        self.repeats = repeats
        if flush_bytes is None:  # above an H100's 50 MB L2; above a CPU core's L2
            flush_bytes = 256 * 2**20 if self.device.type == "cuda" else 8 * 2**20
        self._scratch = torch.empty(flush_bytes // 4, dtype=torch.float32, device=self.device) if flush_bytes else None

    def flush(self) -> None:
        """Evict caches by rewriting the scratch buffer (not timed)."""
        if self._scratch is not None:
            self._scratch.fill_(1.0)

    def samples(self, fn: Callable[[], object]) -> List[float]:
        """Seconds of each timed repeat."""
        for _ in range(self.warmup):
            fn()
        if self.device.type == "cuda":
            return self._cuda_samples(fn)
        out = []
        for _ in range(self.repeats):
            self.flush()
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return out

    def _cuda_samples(self, fn: Callable[[], object]) -> List[float]:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.repeats)]
        torch.cuda.synchronize(self.device)
        for start, end in events:
            self.flush()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]

    def measure(self, fn: Callable[[], object]) -> float:
        """Median (or minimum) seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
        samples = self.samples(fn)
        return min(samples) if self.statistic == "min" else statistics.median(samples)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
