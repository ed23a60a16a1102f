"""What a length-extrapolation report ranks by, and what it warns about.

The question the study asks is "who extrapolates best", so rows are ranked by the **loss
increase** from the shortest evaluation length (1x the training length) to the longest: lower
is better. Its standard error combines the two lengths' standard errors over evaluation windows
as if they were independent, ``sqrt(SE_1^2 + SE_N^2)`` (conservative: both lengths read the
same text, which correlates them positively). Two rows whose 95% intervals
(``increase ± 1.96 SE``) overlap are not distinguishable at this sample size.

Warnings name what makes a comparison unreliable: fewer than :data:`MIN_WINDOWS` evaluation
windows at some length (a standard error from a handful of windows is itself rough; one window
has none), and whatever the caller adds (e.g. the study: runs too short to compare).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .perplexity import LengthResult

Results = Mapping[str, Sequence["LengthResult"]]

#: fewer evaluation windows than this at a length: its standard error is too rough to compare rows
MIN_WINDOWS = 8
#: half-width of a 95% interval in standard errors (normal approximation)
Z95 = 1.96
#: the kinds of rows a report distinguishes; unnamed rows are "trained"
ROW_KINDS = {
    "trained": "trained (continued pretraining)",
    "base": "untrained base (no further training)",
    "eval-only": "evaluation only (parameters changed, no training)",
}
#: a study's run shorter than this many steps per encoding is flagged as too short to compare
MIN_STUDY_STEPS = 100


def loss_increase(entries: Sequence[LengthResult]) -> tuple[float, float] | None:
    """``(increase, standard error)`` of the loss from the shortest to the longest length evaluated,
    in nats; None for fewer than two finite lengths."""
    finite = sorted((r for r in entries if math.isfinite(r.loss)), key=lambda r: r.length)
    if len(finite) < 2:
        return None
    first, last = finite[0], finite[-1]
    stderr = math.sqrt(first.stderr**2 + last.stderr**2)  # NaN when either has no standard error
    return last.loss - first.loss, stderr


def ranking(results: Results, kinds: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Rows sorted by loss increase (lower is better): ``label, increase_nats, increase_stderr_nats,
    rank, from_length_tokens, to_length_tokens``; rows with no increase are left out.

    The untrained base (``kinds[label] == "base"``) is the model every row was switched from, not
    a contender: it is listed after the ranked rows with ``rank`` None (a reference, shown apart),
    so a base that barely moved never reads as "extrapolates best"."""
    rows: list[dict[str, Any]] = []
    for label, entries in results.items():
        increase = loss_increase(entries)
        if increase is None:
            continue
        lengths = sorted(r.length for r in entries if math.isfinite(r.loss))
        rows.append(
            {
                "label": label,
                "increase_nats": increase[0],
                "increase_stderr_nats": increase[1],
                "from_length_tokens": lengths[0],
                "to_length_tokens": lengths[-1],
            }
        )
    is_reference = {label: (kinds or {}).get(label) == "base" for label in results}
    rows.sort(key=lambda row: (is_reference[row["label"]], row["increase_nats"]))
    rank = 0
    for row in rows:
        if is_reference[row["label"]]:
            row["rank"] = None
        else:
            rank += 1
            row["rank"] = rank
    return rows


def result_warnings(results: Results) -> list[str]:
    """One line per length evaluated on fewer than :data:`MIN_WINDOWS` windows (by any row)."""
    fewest: dict[int, tuple[int, int]] = {}  # multiple -> (windows, length)
    for entries in results.values():
        for r in entries:
            if r.multiple not in fewest or r.windows < fewest[r.multiple][0]:
                fewest[r.multiple] = (r.windows, r.length)
    lines = []
    for multiple in sorted(fewest):
        windows, length = fewest[multiple]
        if windows < MIN_WINDOWS:
            what = "no standard error" if windows < 2 else "rough standard errors"
            lines.append(
                f"too few windows: ev={multiple} ({length} tokens) has {windows} evaluation window(s) "
                f"(fewer than {MIN_WINDOWS}): {what}; evaluate on more text to compare rows there"
            )
    return lines


def study_warnings(steps: int, pretrain_steps: int | None) -> list[str]:
    """The study's own warnings: runs too short for their differences to mean much."""
    lines = []
    if steps < MIN_STUDY_STEPS:
        lines.append(
            f"too short: {steps} continued-pretraining steps per encoding (fewer than {MIN_STUDY_STEPS}): "
            "the rows show the switch more than the encodings; use --steps to compare them"
        )
    if pretrain_steps is not None and pretrain_steps < MIN_STUDY_STEPS:
        lines.append(
            f"too short: the base model was pretrained {pretrain_steps} steps (fewer than "
            f"{MIN_STUDY_STEPS}); use --pretrain-steps for a base worth switching from"
        )
    return lines


def not_distinguishable(first: Mapping[str, Any], second: Mapping[str, Any]) -> bool:
    """True when two ranking rows' 95% intervals overlap (or either has no standard error)."""
    a, b = first["increase_stderr_nats"], second["increase_stderr_nats"]
    if not (math.isfinite(a) and math.isfinite(b)):
        return True
    return abs(first["increase_nats"] - second["increase_nats"]) <= Z95 * (a + b)
