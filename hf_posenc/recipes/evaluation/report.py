"""Length-extrapolation results of several models: a text table, CSV, JSON and a PNG plot.

``results`` maps a label (model / encoding) to its :class:`LengthResult` list. The table
has one row per label and one "loss (ev=k)" column per multiple, like Table 1 of
Datseris et al. 2025; the plot draws loss against evaluation length in tokens (log2 axis),
one line per label, with a dashed vertical line at the training length.
"""

from __future__ import annotations

import csv
import json
import math
import tempfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .perplexity import LengthResult

Results = Mapping[str, Sequence["LengthResult"]]
CSV_FIELDS = ("label", "multiple", "length", "windows", "tokens", "loss", "perplexity")
FILE_NAMES = {
    "table": "results.txt",
    "csv": "results.csv",
    "json": "results.json",
    "png": "loss_vs_length.png",
}


def check_output_dir(path: str | Path) -> Path:
    """Create ``path`` (and parents) if needed and check that files can be written there.

    Raises ``NotADirectoryError`` if it (or a parent) is a file and ``PermissionError`` if
    it cannot be created or written to — meant to be called before any long work.
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"output path {str(directory)!r} exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:
        raise NotADirectoryError(
            f"cannot create output directory {str(directory)!r}: a parent path is a file ({error})"
        ) from error
    except OSError as error:
        raise PermissionError(
            f"cannot create output directory {str(directory)!r}: {error.strerror or error}"
        ) from error
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as error:
        raise PermissionError(
            f"output directory {str(directory)!r} is not writable ({error.strerror or error})"
        ) from error
    return directory


def _multiples(results: Results) -> list[int]:
    return sorted({r.multiple for rows in results.values() for r in rows})


def format_table(results: Results, *, perplexity: bool = False, digits: int = 3) -> str:
    """A fixed-width table: one row per label, a "loss (ev=k)" column per multiple.

    With ``perplexity=True`` a "ppl (ev=k)" column per multiple follows. A multiple a model
    was not evaluated at shows "-".
    """
    multiples = _multiples(results)
    header = ["model"] + [f"loss (ev={m})" for m in multiples]
    if perplexity:
        header += [f"ppl (ev={m})" for m in multiples]
    rows = []
    for label, entries in results.items():
        by_multiple = {r.multiple: r for r in entries}
        row = [label] + [f"{by_multiple[m].loss:.{digits}f}" if m in by_multiple else "-" for m in multiples]
        if perplexity:
            row += [_format_ppl(by_multiple[m].perplexity) if m in by_multiple else "-" for m in multiples]
        rows.append(row)
    widths = [max(len(str(cells[i])) for cells in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = f"{cells[0]:<{widths[0]}}"
        return "  ".join([first] + [f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:], strict=True)]).rstrip()

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def _format_ppl(value: float) -> str:
    if math.isinf(value):
        return "inf"
    return f"{value:.4g}" if value >= 1e4 else f"{value:.2f}"


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def write_csv(results: Results, path: str | Path) -> Path:
    """One row per (label, multiple): label, multiple, length, windows, tokens, loss, perplexity."""
    path = Path(path)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for label, entries in results.items():
            for r in entries:
                writer.writerow({"label": label, **r.to_dict()})
    return path


def write_json(
    results: Results,
    path: str | Path,
    *,
    train_length: int,
    title: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """``{"title", "train_length", "metadata", "results": {label: [row, ...]}}``."""
    document = {
        "title": title,
        "train_length": train_length,
        "metadata": dict(metadata or {}),
        "results": {
            label: [
                {k: _json_number(v) if isinstance(v, float) else v for k, v in r.to_dict().items()}
                for r in entries
            ]
            for label, entries in results.items()
        },
    }
    path = Path(path)
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return path


def line_styles(count: int) -> list[dict[str, Any]]:
    """Distinguishable styles for ``count`` lines: 10 colours, then dashed/dotted variants, distinct markers."""
    from matplotlib import colormaps

    tab10 = colormaps["tab10"]
    colours = [tab10(i) for i in range(tab10.N)]  # an integer indexes the 10 listed colours (RGBA)
    dashes = ["-", "--", "-.", ":"]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">"]
    return [
        {
            "color": colours[i % 10],
            "linestyle": dashes[(i // 10) % len(dashes)],
            "marker": markers[(i + i // 10) % len(markers)],
        }
        for i in range(count)
    ]


def _zoom_past_outliers(axes, changes: dict[str, list[float]]) -> None:
    """Limit the y-range to the lines that are not far out (max change > 3x the median line's), and
    name those off scale in the panel, so they do not flatten the rest."""
    spans = {label: max((abs(c) for c in values), default=0.0) for label, values in changes.items()}
    ordered = sorted(spans.values())
    if len(ordered) < 3 or ordered[len(ordered) // 2] <= 0:
        return
    limit = 3 * ordered[len(ordered) // 2]
    outliers = [label for label, span in spans.items() if span > limit]
    kept = [c for label, values in changes.items() if label not in outliers for c in values]
    if not outliers or not kept:
        return
    low, high = min(kept + [0.0]), max(kept + [0.0])
    margin = 0.1 * (high - low or 1.0)
    axes.set_ylim(low - margin, high + margin)
    note = "off scale: " + "; ".join(
        f"{label} (up to {max(changes[label], key=abs):+.3g})" for label in outliers
    )
    axes.text(0.02, 0.98, note, transform=axes.transAxes, va="top", fontsize="small", wrap=True)


def plot_losses(
    results: Results,
    path: str | Path,
    *,
    train_length: int,
    title: str | None = None,
    dashed: Collection[str] = (),
) -> Path:
    """PNG with two panels against evaluation length (log2 x-axis in tokens), one line per label:
    the loss, and its change relative to the shortest length (1x), so one model far above the
    others (e.g. sinusoidal past its training length) does not flatten every other line.
    Labels in ``dashed`` (e.g. evaluation-only rows) are drawn dashed with hollow markers.

    Draws on a bare Agg canvas (no pyplot, no display, the global backend untouched).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    figure = Figure(figsize=(13, 5), dpi=120)
    FigureCanvasAgg(figure)
    absolute, relative = figure.subplots(1, 2)
    lengths = sorted({r.length for rows in results.values() for r in rows} | {train_length})
    changes = {}
    for (label, entries), style in zip(results.items(), line_styles(len(results)), strict=True):
        if label in dashed:
            style = {**style, "linestyle": "--", "markerfacecolor": "none"}
        ordered = sorted(entries, key=lambda r: r.length)
        x = [r.length for r in ordered]
        absolute.plot(x, [r.loss for r in ordered], label=label, **style)
        if ordered:
            changes[label] = [r.loss - ordered[0].loss for r in ordered if math.isfinite(r.loss)]
            relative.plot(x, [r.loss - ordered[0].loss for r in ordered], label=label, **style)
    _zoom_past_outliers(relative, changes)
    for axes in (absolute, relative):
        axes.axvline(train_length, color="gray", linestyle="--", linewidth=1)
        axes.set_xscale("log", base=2)
        axes.xaxis.set_major_locator(FixedLocator(lengths))
        axes.xaxis.set_minor_locator(NullLocator())
        axes.set_xticklabels([str(n) for n in lengths])
        axes.set_xlabel("evaluation length (tokens, log2 scale; dashed: training length)")
        formatter = ScalarFormatter(useOffset=False)
        formatter.set_scientific(False)
        axes.yaxis.set_major_formatter(formatter)
        axes.grid(True, alpha=0.3)
    relative.axhline(0, color="black", linewidth=0.8)
    absolute.set_ylabel("loss (mean token NLL, nats)")
    relative.set_ylabel("loss minus loss at the shortest length (nats)")
    absolute.set_title("loss")
    relative.set_title("change relative to 1x")
    figure.suptitle(title or "Loss against evaluation length")
    handles, labels = absolute.get_legend_handles_labels()
    figure.legend(handles, labels, loc="center right", fontsize="small", frameon=False)
    figure.tight_layout(rect=(0, 0, 0.8, 1))
    path = Path(path)
    figure.savefig(path, format="png")
    return path


def write_report(
    results: Results,
    out_dir: str | Path,
    train_length: int,
    title: str | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
    perplexity: bool = True,
    dashed: Collection[str] = (),
) -> dict[str, Path]:
    """Write results.txt (the table), results.csv, results.json and loss_vs_length.png.

    Returns ``{"table": ..., "csv": ..., "json": ..., "png": ...}``.
    """
    directory = check_output_dir(out_dir)
    paths = {key: directory / name for key, name in FILE_NAMES.items()}
    table = format_table(results, perplexity=perplexity)
    heading = f"{title}\n" if title else ""
    paths["table"].write_text(f"{heading}training length {train_length}\n{table}\n", encoding="utf-8")
    write_csv(results, paths["csv"])
    write_json(results, paths["json"], train_length=train_length, title=title, metadata=metadata)
    plot_losses(results, paths["png"], train_length=train_length, title=title, dashed=dashed)
    return paths
