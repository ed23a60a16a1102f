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


def sample_count(results: Mapping[str, Any], task: str) -> int | None:
    """How many examples of ``task`` were scored (lm-eval's ``n-samples``: ``effective``, after --limit);
    for a group (mmlu) the sum over its subtasks (``group_subtasks``)."""
    counts = results.get("n-samples", {}).get(task)
    if isinstance(counts, Mapping):
        value = counts.get("effective", counts.get("original"))
        return value if isinstance(value, int) else None
    subtasks = results.get("group_subtasks", {}).get(task)
    if not subtasks:
        return None
    found = [sample_count(results, name) for name in subtasks if name != task]
    known = [n for n in found if n is not None]
    return sum(known) if known and len(known) == len(found) else None


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else ("-" if value is None else str(value))


def comparison_rows(
    runs: Sequence[tuple[str, Mapping[str, Any]]], tasks: Mapping[str, int]
) -> tuple[list[str], list[list[str]]]:
    """Headers and rows for ``runs`` = [(model label, lm-eval results), ...] on ``tasks`` = {name: shots}.

    One model: columns task, n-shot, metric, value, ± stderr, n (examples scored). Several: one
    ``value ± stderr (n=N)`` column per model. Values are lm-eval's (accuracies are fractions
    of 1; stderr is lm-eval's standard error of the mean over the n examples).
    """
    single = len(runs) == 1
    headers = ["task", "n-shot", "metric"]
    headers += ["value", "± stderr", "n"] if single else [f"{label}: value ± stderr (n)" for label, _ in runs]
    rows = []
    for task, shots in tasks.items():
        per_model = [task_metrics(results, task) for _, results in runs]
        counts = [sample_count(results, task) for _, results in runs]
        metrics = list(dict.fromkeys(m for found in per_model for m in found))
        for metric in metrics:
            cells = [task, str(shots), metric]
            for found, count in zip(per_model, counts, strict=True):
                value, stderr = found.get(metric, (None, None))
                n = "-" if count is None else str(count)
                if single:
                    cells += [_number(value), _number(stderr), n]
                else:
                    cells.append("-" if value is None else f"{_number(value)} ± {_number(stderr)} (n={n})")
            rows.append(cells)
    return headers, rows


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table with aligned columns (readable in a terminal too)."""
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])
