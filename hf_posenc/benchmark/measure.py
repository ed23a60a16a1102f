"""Timing and peak-memory probes: medians after warm-up, peak extra memory during a call.

CPU memory is the peak resident set size above the level before the call, sampled by a
background thread every millisecond; CUDA memory is ``torch.cuda.max_memory_allocated``
above the allocation before the call.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from collections.abc import Callable

import torch


class PeakMemory:
    """Context manager: ``extra`` is the peak bytes above the level at entry."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.extra = 0

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        import psutil

        self._process = psutil.Process()
        self._start = self._process.memory_info().rss
        self._peak = self._start
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self._peak = max(self._peak, self._process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.extra = torch.cuda.max_memory_allocated(self.device) - self._start
            return
        self._peak = max(self._peak, self._process.memory_info().rss)
        self._running = False
        self._thread.join()
        self.extra = max(0, self._peak - self._start)


def median_time(run: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall-clock seconds of ``run()`` over ``repeats`` calls after ``warmup`` calls."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
