"""Reports of a long-context retrieval run: the table, results.json, results.md and the pictures.

``results`` maps a model label to its :class:`.runner.Cell` list. The table has a row per model
and task and a column per length (accuracy over every depth, in %). Pictures (drawn on a bare
Agg canvas, no pyplot):

- ``heatmap_<model>.png`` per model: for each task that places a needle by depth, the
  depth x length grid needle-in-a-haystack made familiar (rows: depth from the start of the
  text, columns: prompt length in tokens; green = found, red = missed, the accuracy written in
  each cell; the training length's column is marked);
- ``accuracy_vs_length.png``: one panel per task, one line per model, accuracy against prompt
  length (log2 axis), each model's training length dashed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..atomic import replacing, write_text
from .runner import Cell
from .tasks import TASKS

Results = Mapping[str, Sequence[Cell]]
FILE_NAMES = {"json": "results.json", "markdown": "results.md", "chart": "accuracy_vs_length.png"}


def heatmap_name(label: str) -> str:
    """``heatmap_<label with anything but letters, digits, '.', '-' turned into '_'>.png``."""
    return "heatmap_" + re.sub(r"[^A-Za-z0-9.-]+", "_", label).strip("_") + ".png"


def _overall(cells: Sequence[Cell]) -> dict[tuple[str, int], Cell]:
    return {(c.task, c.length): c for c in cells if c.depth is None}


def _tasks(results: Results) -> list[str]:
    present = {c.task for cells in results.values() for c in cells}
    return [name for name in TASKS if name in present]


def _lengths(results: Results) -> list[int]:
    return sorted({c.length for cells in results.values() for c in cells})


def table_rows(results: Results) -> tuple[list[str], list[list[str]]]:
    """(header, rows): a row per model and task, a column per length, accuracy over all depths in %."""
    lengths = _lengths(results)
    header = ["model", "task", *map(str, lengths)]
    rows = []
    for label, cells in results.items():
        overall = _overall(cells)
        for task in _tasks(results):
            row = [label, task]
            row += [
                f"{100 * overall[(task, n)].accuracy:.0f}" if (task, n) in overall else "-" for n in lengths
            ]
            rows.append(row)
    return header, rows


def format_table(results: Results) -> str:
    """Fixed-width text table (accuracy in %, "-" where not evaluated)."""
    header, rows = table_rows(results)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        left = [f"{c:<{w}}" for c, w in zip(cells[:2], widths[:2], strict=True)]
        right = [f"{c:>{w}}" for c, w in zip(cells[2:], widths[2:], strict=True)]
        return "  ".join(left + right).rstrip()

    return "\n".join([line(header), "-" * len(line(header)), *(line(r) for r in rows)])


def markdown_table(results: Results) -> str:
    header, rows = table_rows(results)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def results_document(
    results: Results, *, settings: Mapping[str, Any], metadata: Mapping[str, Any]
) -> dict[str, Any]:
    """The content of results.json: the settings, what each task is, provenance, and per model a list of
    cells (task, length, depth — null for the mean over depths —, accuracy in [0, 1], samples, prompt_tokens)."""
    return {
        "settings": dict(settings),
        "tasks": {
            name: {
                "description": TASKS[name].description,
                "citation": TASKS[name].citation,
                "metric": TASKS[name].metric,
                "max_new_tokens": TASKS[name].max_new_tokens,
                "uses_depth": TASKS[name].uses_depth,
            }
            for name in _tasks(results)
        },
        "metadata": dict(metadata),
        "results": {label: [c.to_dict() for c in cells] for label, cells in results.items()},
    }


def write_json(
    path: Path, results: Results, *, settings: Mapping[str, Any], metadata: Mapping[str, Any]
) -> Path:
    return write_text(
        path, json.dumps(results_document(results, settings=settings, metadata=metadata), indent=2) + "\n"
    )


def write_markdown(
    path: Path,
    results: Results,
    *,
    title: str,
    train_lengths: Mapping[str, int | None],
    pictures: Sequence[str],
) -> Path:
    lines = [
        f"# {title}",
        "",
        "Accuracy in % over every depth (rows: model and task; columns: prompt length in tokens).",
        "",
    ]
    lines += [markdown_table(results), "", "Training lengths: "]
    lines[-1] += ", ".join(f"{label}: {n if n else 'not known'}" for label, n in train_lengths.items()) + "."
    lines += ["", "| task | what the model must do | scoring | source |", "|---|---|---|---|"]
    for name in _tasks(results):
        task = TASKS[name]
        lines.append(f"| `{name}` | {task.description} | {task.metric} | {task.citation} |")
    lines += [""] + [f"![{picture}]({picture})" for picture in pictures]
    return write_text(path, "\n".join(lines) + "\n")


def _canvas(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_heatmap(path: Path, label: str, cells: Sequence[Cell], train_length: int | None) -> Path | None:
    """Depth x length grid per depth task of one model (None when it ran no such task)."""
    tasks = [t for t in TASKS if TASKS[t].uses_depth and any(c.task == t for c in cells)]
    if not tasks:
        return None
    lengths = sorted({c.length for c in cells if c.task in tasks})
    depths = sorted({c.depth for c in cells if c.task in tasks and c.depth is not None})
    columns = min(len(tasks), 3)
    rows = -(-len(tasks) // columns)
    figure = _canvas(
        max(7.0, 1.6 + (0.8 + 0.75 * len(lengths)) * columns), 1.2 + (1.0 + 0.42 * len(depths)) * rows
    )
    grid = figure.subplots(rows, columns, squeeze=False)
    image = None
    for axes, task in zip(grid.flat, tasks, strict=False):
        by_key = {(c.depth, c.length): c.accuracy for c in cells if c.task == task and c.depth is not None}
        values = [[by_key.get((d, n), float("nan")) for n in lengths] for d in depths]
        image = _draw_cells(axes, values, fontsize="small")
        axes.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        axes.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        axes.set_xlabel("prompt length (tokens)")
        if axes in grid[:, 0]:
            axes.set_ylabel("needle depth (0% = start)")
        axes.set_title(task)
        if train_length is not None:
            _mark_training_length(axes, lengths, train_length)
    trained = f"; trained at {train_length} tokens (black line)" if train_length else ""
    suptitle = f"{label}\nneedle found (green) or missed (red), accuracy in %{trained}"
    return _finish_heatmaps(path, figure, grid, len(tasks), image, suptitle, colorbar_fraction=0.05)


def _draw_cells(axes, values: Sequence[Sequence[float]], *, fontsize: str):
    """A depth (rows) x length (columns) grid of accuracies on the RdYlGn scale, each cell's value in %
    written on it (missing cells, NaN, left blank); returns the image for the colour bar."""
    from matplotlib import colormaps

    image = axes.imshow(values, cmap=colormaps["RdYlGn"], vmin=0, vmax=1, aspect="auto")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            if value == value:
                axes.text(
                    j, i, f"{100 * value:.0f}", ha="center", va="center", fontsize=fontsize, color=_ink(value)
                )
    return image


def _finish_heatmaps(
    path: Path, figure, grid, used: int, image, suptitle: str, *, colorbar_fraction: float
) -> Path:
    """Hide the panels past the first ``used``, add the title and one colour bar, write the PNG."""
    for axes in list(grid.flat)[used:]:
        axes.set_visible(False)
    figure.suptitle(suptitle, fontsize="medium")
    if image is not None:
        figure.colorbar(image, ax=list(grid.flat), shrink=0.9, label="accuracy", fraction=colorbar_fraction)
    with replacing(path) as partial:
        figure.savefig(partial, format="png")
    return path


def _ink(accuracy: float) -> str:
    """Text colour readable on the RdYlGn cell of ``accuracy`` (white on dark red and dark green)."""
    return "white" if accuracy < 0.2 or accuracy > 0.85 else "black"


def _mark_training_length(axes, lengths: Sequence[int], train_length: int) -> None:
    """A vertical line after the last column not longer than the training length."""
    within = [i for i, n in enumerate(lengths) if n <= train_length]
    if within and within[-1] < len(lengths) - 1:
        axes.axvline(within[-1] + 0.5, color="black", linewidth=2)


def plot_accuracy(path: Path, results: Results, train_lengths: Mapping[str, int | None], title: str) -> Path:
    """Accuracy (over every depth) against prompt length: a panel per task, a line per model."""
    from matplotlib.ticker import FixedLocator, NullLocator

    from ..evaluation.report import line_styles

    tasks, lengths = _tasks(results), _lengths(results)
    columns = min(len(tasks), 3)
    rows = -(-len(tasks) // columns)
    figure = _canvas(4.2 * columns + 2.4, 3.2 * rows + 0.6)
    grid = figure.subplots(rows, columns, squeeze=False)
    styles = dict(zip(results, line_styles(len(results)), strict=True))
    shared = set(train_lengths.values())
    one_length = shared.pop() if len(shared) == 1 else None
    for axes, task in zip(grid.flat, tasks, strict=False):
        for label, cells in results.items():
            points = sorted((c.length, 100 * c.accuracy) for c in cells if c.task == task and c.depth is None)
            if points:
                axes.plot(*zip(*points, strict=True), label=label, **styles[label])
            trained = train_lengths.get(label)
            if trained and one_length is None:
                axes.axvline(trained, color=styles[label]["color"], linestyle="--", linewidth=1)
        if one_length:
            axes.axvline(one_length, color="gray", linestyle="--", linewidth=1.2)
        axes.set_xscale("log", base=2)
        axes.xaxis.set_major_locator(FixedLocator(lengths))
        axes.xaxis.set_minor_locator(NullLocator())
        axes.set_xticklabels([str(n) for n in lengths])
        axes.set_ylim(-5, 105)
        axes.set_title(task)
        axes.set_xlabel("prompt length (tokens, log2)")
        axes.set_ylabel("accuracy (%)")
        axes.grid(True, alpha=0.3)
    for axes in list(grid.flat)[len(tasks) :]:
        axes.set_visible(False)
    marked = f"dashed: training length {one_length}" if one_length else "dashed: each model's training length"
    figure.suptitle(f"{title} ({marked})" if any(train_lengths.values()) else title)
    handles, labels = grid.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside right center", fontsize="small", frameon=False)
    with replacing(path) as partial:
        figure.savefig(partial, format="png")
    return path


def plot_heatmap_grid(path: Path, results: Results, task: str, train_length: int | None, title: str) -> Path:
    """One depth x length panel of ``task`` per model (e.g. one per encoding of a study), one colour scale."""
    labels = [
        label
        for label, cells in results.items()
        if any(c.task == task and c.depth is not None for c in cells)
    ]
    if not labels:
        raise ValueError(f"no depth results of {task!r} to draw")
    lengths = sorted({c.length for label in labels for c in results[label] if c.task == task})
    depths = sorted(
        {c.depth for label in labels for c in results[label] if c.task == task and c.depth is not None}
    )
    columns = min(len(labels), 4)
    rows = -(-len(labels) // columns)
    figure = _canvas(
        max(7.0, 1.6 + (0.6 + 0.6 * len(lengths)) * columns), 1.2 + (1.0 + 0.38 * len(depths)) * rows
    )
    grid = figure.subplots(rows, columns, squeeze=False)
    image = None
    for axes, label in zip(grid.flat, labels, strict=False):
        by_key = {
            (c.depth, c.length): c.accuracy for c in results[label] if c.task == task and c.depth is not None
        }
        values = [[by_key.get((d, n), float("nan")) for n in lengths] for d in depths]
        image = _draw_cells(axes, values, fontsize="x-small")
        axes.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize="small")
        axes.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize="small")
        axes.set_title(label, fontsize="medium")
        if axes in grid[-1, :] or axes is grid.flat[len(labels) - 1]:
            axes.set_xlabel("prompt length (tokens)")
        if axes in grid[:, 0]:
            axes.set_ylabel("needle depth")
        if train_length is not None:
            _mark_training_length(axes, lengths, train_length)
    trained = f"; black line: training length {train_length}" if train_length else ""
    suptitle = f"{title}\n{task}: needle found (green) or missed (red), accuracy in %{trained}"
    return _finish_heatmaps(path, figure, grid, len(labels), image, suptitle, colorbar_fraction=0.04)
