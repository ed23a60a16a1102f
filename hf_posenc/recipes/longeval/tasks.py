"""The task registry, the checks of a task request, and the samples of a whole evaluation."""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence
from typing import Any

from ..evaluation.errors import EvaluationError
from .common_words import CommonWords
from .fit import token_counter
from .frequent_words import FrequentWords
from .niah import NIAH_TASKS
from .passkey import Passkey
from .task import Sample, Task, build_sample
from .variable_tracking import VariableTracking
from .words import sample_rng

#: every task by name, in the order tables list them
TASKS: dict[str, Task] = {
    task.name: task
    for task in [
        Passkey(),
        *(cls() for cls in NIAH_TASKS),
        VariableTracking(),
        CommonWords(),
        FrequentWords(),
    ]
}
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def check_tasks(names: Sequence[str]) -> list[Task]:
    """The tasks named (each once), or one line naming the unknown one, a close match and the list."""
    tasks = []
    for name in names:
        if name not in TASKS:
            close = difflib.get_close_matches(name, list(TASKS), n=2, cutoff=0.5)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise EvaluationError(f"unknown task {name!r}.{hint} Allowed: {', '.join(TASKS)}")
        if TASKS[name] not in tasks:
            tasks.append(TASKS[name])
    if not tasks:
        raise EvaluationError(f"no tasks given; allowed: {', '.join(TASKS)}")
    return tasks


def check_depths(depths: Sequence[float]) -> list[float]:
    values = list(depths)
    if not values:
        raise EvaluationError(
            "--depths is empty; allowed: one or more fractions in [0, 1], e.g. 0 0.25 0.5 0.75 1"
        )
    for depth in values:
        if not 0.0 <= depth <= 1.0:
            raise EvaluationError(
                f"depth {depth!r} is not allowed; allowed: fractions in [0, 1] (0 = start, 1 = end)"
            )
    return list(dict.fromkeys(values))


def check_lengths(lengths: Sequence[int]) -> list[int]:
    values = list(lengths)
    if not values:
        raise EvaluationError("--lengths is empty; allowed: one or more token counts, e.g. 512 1024 2048")
    for length in values:
        if length < 1:
            raise EvaluationError(f"length {length!r} is not allowed; allowed: token counts >= 1")
    return sorted(dict.fromkeys(values))


def check_samples(samples: int) -> int:
    if samples < 1:
        raise EvaluationError(
            f"--samples {samples} is not allowed; allowed: >= 1 sample per task, length and depth"
        )
    return samples


def minimum_length(task: Task, tokenizer: Any, length: int, samples: int = 1, seed: int = 0) -> int:
    """The shortest prompt any of the first ``samples`` samples of ``task`` can have for ``tokenizer``
    in the setting the task uses at ``length`` (the instruction, needles and question with no
    haystack; the least words of the word tasks)."""
    count = token_counter(tokenizer)
    return max(
        count(task.instance(sample_rng(seed, task.name, index), length, 0.5).render(0, 0))
        for index in range(samples)
    )


def check_tokenizer(task: Task, tokenizer: Any, where: str, seed: int = 0) -> None:
    """Refuse a tokenizer that cannot write the task's answers (e.g. a character vocabulary without
    digits would turn every pass key into unknown tokens)."""
    instance = task.instance(sample_rng(seed, task.name, 0), 4096, 0.5)
    for answer in instance.answers:
        ids = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        if answer not in decoded:
            raise EvaluationError(
                f"{where}: the tokenizer cannot express {task.name}'s answers: {answer!r} comes back as "
                f"{decoded.strip()!r} (its vocabulary lacks some of these characters); use a model whose "
                "tokenizer covers digits and letters"
            )


def task_samples(
    task: Task, tokenizer: Any, length: int, depths: Sequence[float], samples: int, seed: int
) -> Iterator[Sample]:
    """Every sample of ``task`` at ``length``: ``samples`` per depth (one set when the task ignores depth).

    Sample ``i`` has the same key, needles or words at every length and depth (drawn from
    ``(seed, task, i)``); prompts are exactly ``length`` tokens of ``tokenizer``."""
    count = token_counter(tokenizer)
    hint = None
    for depth in depths if task.uses_depth else [None]:
        for index in range(samples):
            sample = build_sample(task, count, length, depth, index, seed, hint=hint)
            hint = sample.haystack_size
            yield sample
