"""Independent pieces of CPU work side by side in two lanes, each running its tensor operations
on its share of torch's intra-op threads (:func:`side_by_side`; with two threads, one each).

Why by hand: a loop of many small tensor operations (the blocks of an attention computed in
explicit products, :mod:`.wide_values`) opens one OpenMP parallel region per operation, and
every region waits for all of torch's threads to arrive. On the 2-vCPU VM of 2026-11-28 that wait
was ~100 us per region in some stretches of minutes (the machine's slow state, where a product
split over the two threads ran no faster than on one: ``scripts/split_product_probe.py``): one
layer's backward of TAPE's values (8 heads, T = 2048, ~350 regions) took 73-95 ms there against
57-60 ms in the fast state. Given to the threads as two halves of the heads, each half's
operations single-threaded, the same work waits once per call: 55-60 ms in the slow state
(``python scripts/tape_value_width_cost.py --by-state``). torch's inter-op pool
(``torch.jit.fork``) was not tried: its tasks' operations would still each open a region on the
intra-op threads.

How: at most :data:`LANES` lanes, the caller's and a worker's, each with its share of the
threads (``torch.set_num_threads``: OpenMP's and MKL's thread counts are per calling thread under
torch's OpenMP backend; under its other backends nothing is split: :func:`parts`), the caller's
count restored after; a forked child makes workers of its own. Tasks run with the
caller's grad mode and without autocast (in their tensors' own dtypes), as torch's thread-local
states do not follow work to another thread.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence

import torch

from ..compat import thread_counts_per_caller

#: lanes of work at most, however many threads torch has: measured with two threads only (the
#: 2-vCPU VM); with more, each lane's operations take its share of the threads (not measured).
#: Python threads share one interpreter lock between operations, so more lanes of many small
#: operations each would mostly wait for it
LANES = 2

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_state = threading.local()  # .inside: this thread runs a task of side_by_side (no nested split)


def _forget_workers() -> None:
    """In a forked child: the parent's worker threads do not exist there (a pool that still
    counted them would never run a task), so the next call makes its own."""
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_workers)


def _start_worker() -> None:
    _state.inside = True


def _workers() -> concurrent.futures.ThreadPoolExecutor:
    """The process's worker threads, one per lane but the caller's (made on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=LANES - 1, thread_name_prefix="hf_posenc-split", initializer=_start_worker
            )
        return _pool


def parts() -> int:
    """How many lanes :func:`side_by_side` runs at once here: torch's intra-op threads, at most
    :data:`LANES`; 1 inside one of its tasks, or where torch's thread counts are not per thread
    (not its OpenMP backend: :func:`~hf_posenc.compat.thread_counts_per_caller`)."""
    if getattr(_state, "inside", False) or not thread_counts_per_caller():
        return 1
    return min(LANES, torch.get_num_threads())


def side_by_side(tasks: Sequence[Callable[[], None]]) -> None:
    """Run ``tasks`` (independent: no two write the same memory) to completion, in at most
    :func:`parts` lanes at once, each lane's tensor operations on its share of torch's threads
    (one each with two threads); every task runs, and the first exception one raised is raised
    after all have finished. One task, or one lane: run here, in order, as they are."""
    count = min(parts(), len(tasks))
    if count < 2:
        for task in tasks:
            task()
        return
    grad = torch.is_grad_enabled()
    caller_threads = torch.get_num_threads()
    share = max(1, caller_threads // count)  # each worker lane's threads; the caller keeps the rest

    def run(lane: list[Callable[[], None]], threads: int | None) -> BaseException | None:
        """Every task of ``lane`` -> the first exception one raised, or None; on ``threads``
        threads (None: as this thread has them)."""
        if threads is not None:
            torch.set_num_threads(threads)
        first = None
        with torch.set_grad_enabled(grad), torch.autocast("cpu", enabled=False):
            for task in lane:
                try:
                    task()
                except BaseException as caught:
                    first = first or caught
        return first

    pool = _workers()
    torch.set_num_threads(max(1, caller_threads - share * (count - 1)))
    _state.inside = True
    try:
        # the caller takes every count-th task from the first, the workers the others in turn
        lanes = [list(tasks[lane::count]) for lane in range(count)]
        futures = [pool.submit(run, lane, share) for lane in lanes[1:]]
        errors = [run(lanes[0], None)] + [future.result() for future in futures]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error
    finally:
        _state.inside = False
        torch.set_num_threads(caller_threads)
