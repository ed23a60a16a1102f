"""The evaluation recipes' error (no torch import, so the command line can name it cheaply)."""

from __future__ import annotations

from ...errors import PosencError


class EvaluationError(PosencError, ValueError):
    """The evaluation cannot run as asked (too few tokens, bad multiples, bad budget)."""
