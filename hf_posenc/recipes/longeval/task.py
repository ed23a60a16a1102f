"""What every long-context retrieval task is: an instance renders prompts of any haystack size,
and a sample is the instance fitted to exactly the requested number of tokens.

A task (one module per family: :mod:`.passkey`, :mod:`.niah`, :mod:`.variable_tracking`,
:mod:`.common_words`, :mod:`.frequent_words`) draws the random values of sample ``index`` from
``(seed, task, index)`` alone — the same pass key, needles and words at every length and depth,
so a column of the results differs only in length — and places them by ``depth`` and the
haystack size. :func:`build_sample` fits the instance to the length with :func:`.fit.fit_prompt`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import ClassVar

from .fit import fit_prompt
from .words import sample_rng


@dataclasses.dataclass
class Instance:
    """One sample's prompt as a function of the haystack size (and padding characters), and its answers.

    ``render(size, pad)`` returns the whole prompt, ending with the answer prefix the model
    continues; ``pad_limit`` is the most padding characters ``render`` takes (0: none).
    """

    render: Callable[[int, int], str]
    answers: tuple[str, ...]
    pad_limit: int = 0


@dataclasses.dataclass(frozen=True)
class Sample:
    """A prompt of exactly ``tokens == length`` tokens for the tokenizer it was built with."""

    task: str
    length: int
    depth: float | None
    index: int
    prompt: str
    answers: tuple[str, ...]
    tokens: int
    haystack_size: int


class Task:
    """A task family. Subclasses set the class attributes and implement :meth:`instance`."""

    #: the name on the command line (``passkey``, ``niah_single``, ...)
    name: ClassVar[str]
    #: one line: what the model must do
    description: ClassVar[str]
    #: the paper and repository the definition follows
    citation: ClassVar[str]
    #: how a prediction is scored (:data:`.scoring.METRICS`)
    metric: ClassVar[str]
    #: greedy tokens generated after the prompt (the source's budget)
    max_new_tokens: ClassVar[int]
    #: whether ``depth`` places the needle (tasks whose facts are spread over the text ignore it)
    uses_depth: ClassVar[bool] = True

    def instance(self, rng: random.Random, length: int, depth: float) -> Instance:
        """The sample drawn from ``rng`` (keyed by seed, task and index) for a ``length``-token prompt."""
        raise NotImplementedError


def build_sample(
    task: Task,
    count: Callable[[str], int],
    length: int,
    depth: float | None,
    index: int,
    seed: int,
    *,
    hint: int | None = None,
) -> Sample:
    """Sample ``index`` of ``task`` at exactly ``length`` tokens (``count``: the tokenizer's length)."""
    where = 0.5 if depth is None else depth
    instance = task.instance(sample_rng(seed, task.name, index), length, where)
    size, _, prompt = fit_prompt(
        instance.render,
        count,
        length,
        pad_limit=instance.pad_limit,
        hint=hint,
        what=f"{task.name} at length {length}",
    )
    return Sample(
        task.name, length, depth if task.uses_depth else None, index, prompt, instance.answers, length, size
    )


def lines_with_inserts(lines: list[str], inserts: list[tuple[float, str]]) -> list[str]:
    """``lines`` with each ``(fraction, text)`` inserted before line ``round(fraction * len(lines))``;
    inserts at the same place keep their order (0: before the first line, 1: after the last)."""
    placed = sorted(
        ((round(fraction * len(lines)), order, text) for order, (fraction, text) in enumerate(inserts)),
        key=lambda item: (item[0], item[1]),
    )
    result: list[str] = []
    cursor = 0
    for position, _, text in placed:
        result.extend(lines[cursor:position])
        cursor = max(cursor, position)
        result.append(text)
    result.extend(lines[cursor:])
    return result


def repeated_text(unit: str, characters: int, separator: str) -> str:
    """The first ``characters`` characters of ``unit`` repeated, joined by ``separator``."""
    copies = characters // (len(unit) + len(separator)) + 2
    return separator.join([unit] * copies)[:characters]
