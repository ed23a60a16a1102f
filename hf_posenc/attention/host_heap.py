"""Return the freed pages of the C heap to the operating system (glibc's ``malloc_trim``).

Torch's CPU allocator is the C library's ``malloc``. glibc serves blocks below its mmap
threshold (128 KiB, raised up to 32 MiB as larger blocks are freed) from the heap and keeps
freed heap memory resident; a tensor that outlives a burst of score-sized temporaries (a layer's
activations after the blocks of a query-blocked attention call) pins the holes below it. Over
a training step on CPU these holes were most of what CoPE, SBA and CAPE held beyond the native
model: the peak of live tensors was the native model's, the peak resident set hundreds of
MiB above it. ``malloc_trim(0)`` releases the whole free pages of every heap (``madvise``) and
costs well under a millisecond when there is little to release. Neither torch nor Python call
it, hence this shim; a C library without it (musl, macOS) makes this a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def trim_host_heap() -> None:
    """Hand the C heap's free pages back to the operating system (where the C library can)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
