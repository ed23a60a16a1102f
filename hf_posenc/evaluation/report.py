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
from collections.abc import Mapping, Sequence
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


def plot_losses(results: Results, path: str | Path, *, train_length: int, title: str | None = None) -> Path:
    """PNG of loss against evaluation length (log2 x-axis in tokens), one line per label.

    Draws on a bare Agg canvas (no pyplot, no display, the global backend untouched).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    figure = Figure(figsize=(7, 4.5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for label, entries in results.items():
        ordered = sorted(entries, key=lambda r: r.length)
        axes.plot([r.length for r in ordered], [r.loss for r in ordered], marker="o", label=label)
    axes.axvline(
        train_length, color="gray", linestyle="--", linewidth=1, label=f"training length ({train_length})"
    )
    lengths = sorted({r.length for rows in results.values() for r in rows} | {train_length})
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_locator(FixedLocator(lengths))
    axes.xaxis.set_minor_locator(NullLocator())
    axes.set_xticklabels([str(n) for n in lengths])
    axes.set_xlabel("evaluation length (tokens, log2 scale)")
    axes.set_ylabel("loss (mean token NLL, nats)")
    axes.set_title(title or "Loss against evaluation length")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
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
    plot_losses(results, paths["png"], train_length=train_length, title=title)
    return paths
