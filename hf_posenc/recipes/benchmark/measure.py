"""Timing and peak-memory probes: paired medians after warm-up, peak extra memory of a call.

Times are taken in pairs: the native model and the patched one run alternately, so slow
drift of a noisy machine (other processes, frequency scaling) reaches both alike.

CPU memory is the peak resident set size above the level before the call, sampled by a
background thread every millisecond. glibc would otherwise keep freed memory resident and
hand it out again, so a second call would look free: :func:`return_freed_memory_to_os`
makes every allocation of 64 KiB or more its own ``mmap`` (returned to the OS on free), so
the resident set follows the live tensors. CUDA memory is ``torch.cuda.max_memory_allocated``
above the allocation before the call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
import threading
import time
from collections.abc import Callable

import torch

M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 1024


def return_freed_memory_to_os() -> bool:
    """Make glibc serve allocations >= 64 KiB by ``mmap`` (and trim the heap): True on success."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, 0)
        )
    except (OSError, AttributeError):
        return False


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed(run: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of one ``run()``."""
    _sync(device)
    start = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - start


def paired_times(
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    device: torch.device,
    repeats: int,
    warmup: int,
) -> tuple[list[float], list[float]]:
    """Seconds of ``repeats`` calls of each, alternating baseline/candidate, after ``warmup`` of each."""
    for _ in range(warmup):
        baseline()
        candidate()
    base, cand = [], []
    for _ in range(repeats):
        base.append(elapsed(baseline, device))
        cand.append(elapsed(candidate, device))
    return base, cand
