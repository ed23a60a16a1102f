"""``hf-posenc bench``: each encoding's cost as a ratio to the native model, in one run."""

from .suite import BenchConfig, Measurement, ratio_table, run_suite, write_results

__all__ = ["BenchConfig", "Measurement", "ratio_table", "run_suite", "write_results"]
