"""Scoring of the generated text, as the task sources define it.

- ``first_integer`` (passkey, YaRN's ``eval/passkey.py``): 1 when the first integer in the output
  (``re.search(r"\\d+", output)``) equals the pass key, else 0.
- ``all`` (RULER ``string_match_all``, every synthetic task): the share of the expected strings
  that occur in the output, case-insensitively.
- ``part`` (RULER ``string_match_part``, its QA tasks): 1 when any expected string occurs.

The output is first cleaned as RULER's ``postprocess_pred`` does (control characters become
newlines, surrounding whitespace is stripped). A task's accuracy is the mean score of its samples.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(output: str) -> str:
    """RULER's ``postprocess_pred``."""
    return CONTROL.sub("\n", output.strip()).strip()


def first_integer(output: str, answers: Sequence[str]) -> float:
    found = re.search(r"\d+", output)
    return 1.0 if found is not None and found.group() == answers[0] else 0.0


def string_match_all(output: str, answers: Sequence[str]) -> float:
    lowered = output.lower()
    return sum(answer.lower() in lowered for answer in answers) / len(answers)


def string_match_part(output: str, answers: Sequence[str]) -> float:
    lowered = output.lower()
    return max(float(answer.lower() in lowered) for answer in answers)


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "first_integer": first_integer,
    "all": string_match_all,
    "part": string_match_part,
}


def score(metric: str, output: str, answers: Sequence[str]) -> float:
    """The score in [0, 1] of one generated ``output`` under ``metric``."""
    return METRICS[metric](postprocess(output), answers)
