"""Independent pieces of work side by side on torch's threads (``attention/thread_split.py``):
every task runs once, on another thread where there are threads to spare, with single-threaded
tensor operations, the caller's grad mode and no autocast; the caller's thread count is back
afterwards, a task's exception reaches the caller after every task has finished, and a task that
splits again runs its pieces in place."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hf_posenc.attention import thread_split


@pytest.fixture
def three_threads():
    """torch at 3 intra-op threads for the test (put back after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


def test_every_task_runs_once_in_two_lanes_on_their_shares_of_the_threads(three_threads):
    """Seven tasks with torch at three threads: two lanes (``LANES``), each task once, the
    caller's lane (every other task from the first) on the caller's thread with two threads, the
    other on a worker with one; each with the caller's grad mode (off here) and no autocast; the
    caller has its three threads back."""
    assert thread_split.LANES == 2 and thread_split.parts() == 2
    seen: dict[int, tuple[int, int, bool, bool]] = {}

    def task(i: int):
        def run():
            assert i not in seen
            seen[i] = (
                threading.get_ident(),
                torch.get_num_threads(),
                torch.is_grad_enabled(),
                torch.is_autocast_enabled("cpu"),
            )

        return run

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        thread_split.side_by_side([task(i) for i in range(7)])
    assert sorted(seen) == list(range(7))
    caller = threading.get_ident()
    assert [seen[i][0] == caller for i in range(7)] == [i % 2 == 0 for i in range(7)]
    assert [seen[i][1] for i in range(7)] == [2 if i % 2 == 0 else 1 for i in range(7)]
    assert {tuple(rest) for _, _, *rest in seen.values()} == {(False, False)}
    assert torch.get_num_threads() == 3


def test_the_lanes_run_at_the_same_time(three_threads):
    """Two tasks that each wait for the other to start finish (run one after the other they
    would wait forever: the barrier's timeout fails them)."""
    barrier = threading.Barrier(2, timeout=10)
    thread_split.side_by_side([barrier.wait for _ in range(2)])


def test_an_exception_reaches_the_caller_after_every_task_has_finished(three_threads):
    """The first task raises at once; the others, slower, have still run to the end when the
    caller sees the exception, and the caller's thread count is back."""
    finished = []

    def slow(i):
        def run():
            time.sleep(0.05)
            finished.append(i)

        return run

    def fails():
        raise ValueError("bad piece")

    with pytest.raises(ValueError, match="bad piece"):
        thread_split.side_by_side([fails, slow(1), slow(2), slow(3)])
    assert sorted(finished) == [1, 2, 3]
    assert torch.get_num_threads() == 3


def test_a_task_that_splits_again_runs_its_pieces_in_place(three_threads):
    """Inside a task there is one part (no nested split): its own side_by_side runs its pieces
    on its thread, in order."""
    inner: list[tuple[int, int]] = []

    def outer(i):
        def run():
            assert thread_split.parts() == 1
            me = threading.get_ident()
            thread_split.side_by_side(
                [lambda j=j: inner.append((i, j, threading.get_ident() == me)) for j in range(3)]
            )

        return run

    thread_split.side_by_side([outer(i) for i in range(2)])
    assert sorted(inner) == [(i, j, True) for i in range(2) for j in range(3)]


def test_one_thread_runs_the_tasks_here_in_order():
    """With one intra-op thread the tasks run on the caller's thread, in order."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        order: list[tuple[int, bool]] = []
        me = threading.get_ident()
        thread_split.side_by_side(
            [lambda i=i: order.append((i, threading.get_ident() == me)) for i in range(4)]
        )
        assert order == [(i, True) for i in range(4)]
    finally:
        torch.set_num_threads(before)


def _split_in_child(queue) -> None:
    torch.set_num_threads(2)
    done: list[int] = []
    thread_split.side_by_side([lambda i=i: done.append(i) for i in range(4)])
    queue.put(sorted(done))


def test_a_forked_child_splits_with_workers_of_its_own(three_threads):
    """After the parent has made its workers, a child forked from it (a fork-started process)
    still runs a split to the end: the parent's worker threads do not exist there."""
    import multiprocessing

    thread_split.side_by_side([lambda: None for _ in range(3)])  # the parent's workers exist
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_split_in_child, args=(queue,))
    child.start()
    child.join(timeout=30)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "the child's split never finished"
    assert queue.get(timeout=5) == [0, 1, 2, 3]


def test_without_per_thread_counts_the_tasks_run_here(monkeypatch, three_threads):
    """Where torch's thread counts are one for the process (its native thread pool backend), no
    split: every task on the caller's thread, in order, the caller's threads untouched."""
    monkeypatch.setattr(thread_split, "thread_counts_per_caller", lambda: False)
    order: list[tuple[int, bool]] = []
    me = threading.get_ident()
    thread_split.side_by_side([lambda i=i: order.append((i, threading.get_ident() == me)) for i in range(4)])
    assert order == [(i, True) for i in range(4)] and torch.get_num_threads() == 3
