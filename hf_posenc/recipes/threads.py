"""How many threads torch uses in the recipes, and why.

torch's default is one thread per physical core. For a tiny model every matrix product is so
small that the threads spend their time waiting for each other at OpenMP barriers, and when other
jobs compete for the cores a waiting thread is descheduled and everybody waits for it: the
default study's model (about 1 M parameters) trained at 14.5 s/step with the default threads on a
busy 2-core machine and at 1.6-2.1 s/step with one thread (issue 24); the paired
``recipes/study/threads_benchmark.py`` measured one thread 5.5x faster per training step under
load (load average 6-9 on 2 cores). On the idle 2-core machine the same benchmark measured the
opposite: two threads 1.78x faster (0.117 vs 0.208 s per training step, 0.064 vs 0.113 s per
evaluation forward; load average 0.6). So the rule is about load, not model size.

Who decides, first match wins:

1. ``--threads N`` (the recipe's flag);
2. ``OMP_NUM_THREADS`` in the environment (torch already honours it; recorded as the reason);
3. one thread when the machine is busy (the 1-minute load average, read at start, is at least
   the number of cores);
4. otherwise torch's default (one per physical core).

The choice is recorded in every results file's provenance (:func:`current_choice`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..errors import InvalidParameterError


@dataclasses.dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"threads": self.threads, "reason": self.reason}


_CHOICE: ThreadChoice | None = None


def check_threads(requested: int | None, *, flag: str = "--threads") -> None:
    """A requested thread count is an integer >= 1 (checked before anything loads)."""
    if requested is not None and (
        isinstance(requested, bool) or not isinstance(requested, int) or requested < 1
    ):
        raise InvalidParameterError(f"{flag} {requested!r} is not allowed; allowed: an integer >= 1")


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # not on every platform
        return None


_FIRST_LOAD: list[float | None] = []


def _first_load_average() -> float | None:
    """The load average when the recipe first chose (later ones would count this run's own threads)."""
    if not _FIRST_LOAD:
        _FIRST_LOAD.append(_load_average())
    return _FIRST_LOAD[0]


def choose_threads(
    requested: int | None,
    parameters: int | None,
    *,
    environ: dict[str, str] | None = None,
    cores: int | None = None,
    default_threads: int | None = None,
    load_average: float | None = None,
) -> ThreadChoice:
    """The thread count for a model of ``parameters`` parameters (None: unknown), by the rule above.

    ``cores`` (default: ``os.cpu_count()``), ``default_threads`` (torch's default) and
    ``load_average`` (default: the 1-minute load average) are parameters for testing."""
    check_threads(requested)
    if requested is not None:
        return ThreadChoice(requested, "--threads")
    env = os.environ if environ is None else environ
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return ThreadChoice(int(omp), f"OMP_NUM_THREADS={omp}")
    cores = cores or os.cpu_count() or 1
    if default_threads is None:
        import torch

        default_threads = torch.get_num_threads()
    load = _first_load_average() if load_average is None else load_average
    if load is not None and cores > 1 and load >= cores:
        return ThreadChoice(1, f"busy machine (load average {load:.1f} >= {cores} cores)")
    return ThreadChoice(default_threads, f"torch default ({default_threads} for {cores} cores)")


def use_threads(requested: int | None, model: Any = None, *, parameters: int | None = None) -> ThreadChoice:
    """Choose the thread count for ``model`` (or a model of ``parameters`` parameters), set it in
    torch, print it once when it changes, and remember it for provenance."""
    import torch

    global _CHOICE
    if parameters is None and model is not None:
        parameters = sum(p.numel() for p in model.parameters())
    choice = choose_threads(requested, parameters)
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    if choice != _CHOICE:
        print(f"[threads] torch uses {choice.threads} thread(s): {choice.reason}", flush=True)
    _CHOICE = choice
    return choice


def current_choice() -> dict[str, Any] | None:
    """The thread count in use and why, for provenance (None before torch was imported)."""
    if _CHOICE is not None:
        return _CHOICE.as_dict()
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return {"threads": torch.get_num_threads(), "reason": "torch default"}
