"""Prompts of exactly the requested length in the evaluated model's tokens.

A task renders its prompt from two integers: ``size``, how much haystack it holds (characters
of filler for the passkey and the noise haystacks, words for the word lists), and ``pad``, how
many characters of the task's padding text (e.g. extra single-occurrence words, which change
no answer) follow it. :func:`fit_prompt` searches the largest ``size`` whose prompt is not
longer than the target, then the ``pad`` that makes it exactly the target, counting with the
tokenizer itself (``len(tokenizer(text)["input_ids"])``, special tokens included as the
tokenizer adds them by default — what the model reads, and what lm-eval's ``HFLM`` feeds it).

Tokenisation is not additive (a merge can span the seam between two pieces), so the length is
always measured on the whole text; RULER searches its haystack size the same way, but stops at
"not longer than". The Landmark Attention passkey test cuts its filler in characters too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..evaluation.errors import EvaluationError

#: how far around the boundary the search looks for an exact length (a character can add 0 or 2 tokens)
SCAN = 24


class PromptLengthError(EvaluationError):
    """No prompt of the task has exactly the requested number of tokens (too short, or a tokenizer
    whose lengths jump over the target)."""


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """Number of tokens the model reads for a text (the tokenizer's default special tokens included)."""

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    return count


def _bracket(length: Callable[[int], int], target: int, shortest: int, start: int, what: str) -> int:
    """A size whose length is the target, or the largest size not longer than the target when the
    next size is longer. Interpolates from the lengths seen (one character or word adds about the
    same number of tokens everywhere), bisecting every other step, so a good ``start`` (the
    previous sample's size) takes a few tokenisations instead of a full bisection."""
    low, low_length = 0, shortest
    high, high_length = -1, -1
    probe = max(1, start)
    for step in range(200):
        value = length(probe)
        if value <= target:
            low, low_length = probe, value
        else:
            high, high_length = probe, value
        if low_length == target or 0 <= high <= low + 1:
            return low
        if high < 0:  # no upper bound yet: extrapolate past the target
            rate = (low_length - shortest) / low if low > 0 else 0.0
            jump = (target - low_length) / rate if rate > 0 else max(low, 1)
            probe = low + max(1, int(jump * 1.05) + 1)
        elif step % 2:
            probe = (low + high) // 2
        else:
            guess = low + int((target - low_length) * (high - low) / max(1, high_length - low_length))
            probe = min(max(guess, low + 1), high - 1)
        if probe > 1 << 40:  # pragma: no cover - render does not grow
            break
    raise PromptLengthError(f"{what}: the prompt does not grow to {target} tokens")


def fit_prompt(
    render: Callable[[int, int], str],
    count: Callable[[str], int],
    target: int,
    *,
    pad_limit: int = 0,
    hint: int | None = None,
    what: str = "prompt",
) -> tuple[int, int, str]:
    """``(size, pad, text)`` with ``count(text) == target`` where ``text = render(size, pad)``.

    ``render(size, pad)`` must grow (roughly) with ``size`` and with ``pad`` in ``[0, pad_limit]``;
    ``hint`` is a size to start from (the previous sample's). Raises :class:`PromptLengthError`
    when even ``size = 0`` is too long (the task's minimum) or no exact length is found.
    """
    cache: dict[tuple[int, int], int] = {}

    def length(size: int, pad: int = 0) -> int:
        if (size, pad) not in cache:
            cache[(size, pad)] = count(render(size, pad))
        return cache[(size, pad)]

    shortest = length(0)
    if shortest > target:
        raise PromptLengthError(
            f"{what}: {target} tokens is shorter than the task's minimum of {shortest} tokens for this tokenizer"
        )
    low = _bracket(length, target, shortest, hint if hint else target - shortest, what)
    if length(low) == target:
        return low, 0, render(low, 0)
    for size in (low, low - 1, low - 2):  # the padding text fills the gap to the next size
        if size < 0 or pad_limit <= 0 or length(size, pad_limit) < target:
            continue
        lo, hi = 0, pad_limit
        while hi - lo > 1:
            middle = (lo + hi) // 2
            if length(size, middle) <= target:
                lo = middle
            else:
                hi = middle
        for pad in [lo, *(p for d in range(1, SCAN) for p in (lo - d, lo + d) if 0 <= p <= pad_limit)]:
            if length(size, pad) == target:
                return size, pad, render(size, pad)
    for size in (s for d in range(1, SCAN) for s in (low - d, low + d) if s >= 0):  # lengths not monotone
        if length(size) == target:
            return size, 0, render(size, 0)
    below = max((n for n in cache.values() if n < target), default=shortest)
    above = min((n for n in cache.values() if n > target), default=target + 1)
    raise PromptLengthError(
        f"{what}: no prompt has exactly {target} tokens for this tokenizer (one character more jumps from "
        f"{below} to {above} tokens); use another length, e.g. {above}"
    )
