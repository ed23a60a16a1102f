"""Checks the recipes' settings dataclasses share (``train``'s TrainConfig, ``study``'s StudySpec):
each names the command, the field and its value, and what is allowed, in one line."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import InvalidParameterError


def check_positive_integers(
    command: str, settings: Any, names: Iterable[str], *, optional: Iterable[str] = ()
) -> None:
    """Each field ``names`` of ``settings`` is an integer >= 1 (not a bool); those in ``optional``
    may also be None (their default: no limit)."""
    may_be_none = set(optional)
    for name in names:
        value = getattr(settings, name)
        if value is None and name in may_be_none:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidParameterError(
                f"{command}: {name}={value!r} is not allowed; allowed: an integer >= 1"
            )
