"""Evaluation: loss/perplexity at multiples of the training length, and reports of it.

``evaluate_lengths`` is in :mod:`.perplexity`; tables, CSV, JSON and plots in :mod:`.report`
(matplotlib is imported only when a plot is drawn). Attributes are imported on first use, so
``EvaluationError`` costs no torch import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import EvaluationError

if TYPE_CHECKING:
    from .perplexity import LengthResult, check_model_length, evaluate_lengths, token_budget  # noqa: F401
    from .report import check_output_dir, format_table, plot_losses, write_csv, write_json, write_report  # noqa: F401

_PERPLEXITY = ("LengthResult", "check_model_length", "evaluate_lengths", "token_budget")
_REPORT = ("check_output_dir", "format_table", "plot_losses", "write_csv", "write_json", "write_report")
__all__ = ["EvaluationError", *_PERPLEXITY, *_REPORT]


def __getattr__(name: str) -> Any:
    if name in _PERPLEXITY:
        from . import perplexity

        return getattr(perplexity, name)
    if name in _REPORT:
        from . import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
