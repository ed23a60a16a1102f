"""Timing and peak-memory probes: paired medians after warm-up, peak extra memory of a call.

Times are taken in pairs: the native model and the patched one run alternately, so slow
drift of a noisy machine (other processes, frequency scaling) reaches both alike.

CPU memory is the peak resident set size above the level before the call, sampled by a
background thread every millisecond. glibc would otherwise keep freed memory resident and
hand it out again, so a second call would look free: :func:`return_freed_memory_to_os`
makes every allocation of 64 KiB or more its own ``mmap`` (returned to the OS on free), so
the resident set follows the live tensors. That setting is for the memory readings only: each
such allocation page-faults on first touch, which slowed the native model's forward at T=4096
from ~360 ms to ~520 ms (2-core CPU) and moved the ratios, so the timed calls run under
:func:`allocator_for_timing`, glibc's settled defaults (its dynamic mmap threshold rises to at
most 32 MiB as large blocks are freed, its trim threshold to twice that), as a training process
sees them. CUDA memory is ``torch.cuda.max_memory_allocated`` above the allocation before the
call.
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

from ...attention.host_heap import trim_host_heap

M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 1024


#: glibc's settled defaults on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX; the trim threshold follows at 2x)
TIMING_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(
            libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)
        )
    except (OSError, AttributeError):
        return False


def return_freed_memory_to_os() -> bool:
    """Make glibc serve allocations >= 64 KiB by ``mmap`` and trim the heap (for memory readings),
    releasing the heap's free pages now: True on success."""
    done = _mallopt(MMAP_THRESHOLD_BYTES, 0)
    if done:
        trim_host_heap()  # holes left by calls timed under the other setting would hide growth
    return done


def allocator_for_timing() -> bool:
    """glibc's settled defaults for timed calls (blocks up to 32 MiB from the heap, kept): True on success."""
    return _mallopt(TIMING_MMAP_THRESHOLD_BYTES, 2 * TIMING_MMAP_THRESHOLD_BYTES)


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
