"""The comparison table of an lm-eval run: one row per (task, metric), one column per model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: keys of an lm-eval result entry that are not metrics
_NOT_METRICS = ("alias", "name", "sample_len", "sample_count", "samples")


def task_metrics(results: Mapping[str, Any], task: str) -> dict[str, tuple[Any, Any]]:
    """``{metric: (value, stderr)}`` of ``task`` in lm-eval's results dict (filter ``none`` dropped)."""
    entry = results.get("results", {}).get(task, {})
    out: dict[str, tuple[Any, Any]] = {}
    for key, value in entry.items():
        if key in _NOT_METRICS or "," not in key or "_stderr," in key:
            continue
        metric, filter_name = key.split(",", 1)
        label = metric if filter_name == "none" else f"{metric} ({filter_name})"
        out[label] = (value, entry.get(f"{metric}_stderr,{filter_name}"))
    return out


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else ("-" if value is None else str(value))


def comparison_rows(
    runs: Sequence[tuple[str, Mapping[str, Any]]], tasks: Mapping[str, int]
) -> tuple[list[str], list[list[str]]]:
    """Headers and rows for ``runs`` = [(model label, lm-eval results), ...] on ``tasks`` = {name: shots}.

    One model: columns task, n-shot, metric, value, stderr. Several: one ``value ± stderr``
    column per model.
    """
    single = len(runs) == 1
    headers = ["task", "n-shot", "metric"] + (["value", "stderr"] if single else [label for label, _ in runs])
    rows = []
    for task, shots in tasks.items():
        per_model = [task_metrics(results, task) for _, results in runs]
        metrics = list(dict.fromkeys(m for found in per_model for m in found))
        for metric in metrics:
            cells = [task, str(shots), metric]
            for found in per_model:
                value, stderr = found.get(metric, (None, None))
                if single:
                    cells += [_number(value), _number(stderr)]
                else:
                    cells.append("-" if value is None else f"{_number(value)} ± {_number(stderr)}")
            rows.append(cells)
    return headers, rows


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table with aligned columns (readable in a terminal too)."""
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])
