"""Evaluation: loss/perplexity at multiples of the training length, and reports of it.

``evaluate_lengths`` is in :mod:`.perplexity`; tables, CSV, JSON and plots in :mod:`.report`
(matplotlib is imported only when a plot is drawn).
"""

from .perplexity import EvaluationError, LengthResult, check_model_length, evaluate_lengths, token_budget
from .report import check_output_dir, format_table, plot_losses, write_csv, write_json, write_report

__all__ = [
    "EvaluationError",
    "LengthResult",
    "check_model_length",
    "check_output_dir",
    "evaluate_lengths",
    "format_table",
    "plot_losses",
    "token_budget",
    "write_csv",
    "write_json",
    "write_report",
]
