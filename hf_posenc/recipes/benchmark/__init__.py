"""``hf-posenc bench``: each encoding's cost as a ratio to the native model, in one run.

``BenchConfig`` imports nothing heavy; the suite (torch) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import BenchConfig

if TYPE_CHECKING:
    from .suite import Measurement, ratio_table, run_suite, write_results

__all__ = ["BenchConfig", "Measurement", "ratio_table", "run_suite", "write_results"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import suite

        return getattr(suite, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
