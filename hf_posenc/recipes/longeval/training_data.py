"""Retrieval documents to train on: a task's prompt followed by its answer, about ``length`` tokens.

A model pretrained on ordinary text never retrieves a pass key, so the classic "train short, test
long" retrieval experiment mixes such documents into (continued) pretraining at the training
length and then scores the tasks at 1x-16x that length. The documents come from the same
generators as the evaluation, with values drawn from a different seed stream (``("train",
seed)``), so no evaluation prompt is trained on, and the needle at a uniformly random depth.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from .fit import PromptLengthError, token_counter
from .task import Task, build_sample

#: draws in a row that no prompt fits before a length is refused
SKIP_LIMIT = 32


def answer_text(task: Task, answers: tuple[str, ...]) -> str:
    """How a model should continue the prompt: ``" 12345."`` for the passkey (Landmark's key line),
    the expected strings joined by ``", "`` for RULER's tasks."""
    if task.metric == "first_integer":
        return f" {answers[0]}."
    return " " + ", ".join(answers) + "."


def training_documents(task: Task, tokenizer: Any, length: int, count: int, seed: int) -> Iterator[str]:
    """``count`` documents of ``task``: a prompt fitted to ``length`` minus the answer's tokens, then the
    answer (the whole document is ``length`` tokens up to a token where prompt and answer meet).

    A draw (key, depth) whose prompt no filler size fits exactly (one character more adds two
    tokens there) is skipped and the next index drawn, so every document has the asked length;
    after ``SKIP_LIMIT`` such draws in a row the length is refused (:class:`.fit.PromptLengthError`)."""
    count_tokens = token_counter(tokenizer)
    depths = random.Random(f"depths|{seed}|{task.name}")
    hint = None
    index = made = skipped = 0
    while made < count:
        depth = depths.random() if task.uses_depth else None
        try:
            probe = build_sample(task, count_tokens, length, depth, index, hash_seed(seed), hint=hint)
            answer = answer_text(task, probe.answers)
            answer_tokens = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
            sample = build_sample(
                task, count_tokens, length - answer_tokens, depth, index, hash_seed(seed), hint=hint
            )
        except PromptLengthError:
            skipped += 1
            if skipped >= SKIP_LIMIT:
                raise
            index += 1
            continue
        skipped = 0
        index += 1
        made += 1
        hint = sample.haystack_size
        joined = answer.lstrip() if sample.prompt.endswith(" ") else answer  # vt's answer prefix ends in " "
        yield sample.prompt + joined


def hash_seed(seed: int) -> int:
    """The training documents' seed stream, apart from the evaluation's (whose seed is ``seed``)."""
    return random.Random(f"train|{seed}").getrandbits(48)
