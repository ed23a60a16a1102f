"""Length-extrapolation results of several models: a text table, CSV, JSON and a PNG plot.

``results`` maps a label (model / encoding) to its :class:`LengthResult` list. The table
has one row per label and one "loss, nats (ev=k)" column per multiple (``loss ± standard error
(n=windows)``), like Table 1 of Datseris et al. 2025, then the loss increase from the shortest to
the longest length and its rank (:mod:`.ranking`); the picture is :mod:`.plot`. Every file carries
its units, the provenance and the warnings.
"""

from __future__ import annotations

import csv
import json
import math
import tempfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic import replacing, write_text
from .errors import EvaluationError
from .plot import line_styles, plot_losses
from .ranking import Results, ranking, result_warnings

if TYPE_CHECKING:
    from .perplexity import LengthResult

__all__ = ["line_styles", "plot_losses"]  # their home is .plot; kept importable from here
#: results.csv's columns; every numeric one names its unit
CSV_FIELDS = (
    "label",
    "row",
    "multiple",
    "length_tokens",
    "windows",
    "predicted_tokens",
    "loss_nats",
    "loss_stderr_nats",
    "perplexity",
)
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


def check_fresh_output(
    path: str | Path, result_file: str, *, overwrite: bool, flag: str = "--output"
) -> Path:
    """:func:`check_output_dir` of a folder that holds no earlier run's results (its
    ``result_file``), unless ``overwrite``: a second run into the same folder would replace them."""
    previous = Path(path) / result_file
    if previous.exists() and not overwrite:
        raise EvaluationError(
            f"{flag} {str(path)!r} holds another run's results ({result_file}); choose another folder or "
            "add --overwrite to replace them"
        )
    return check_output_dir(path)


def _multiples(results: Results) -> list[int]:
    return sorted({r.multiple for rows in results.values() for r in rows})


#: what the table's numbers are, printed under it
TABLE_NOTE = (
    "loss: mean next-token NLL in nats (lower is better), ± one standard error over the n evaluation "
    "windows; increase: loss at the longest length minus at the shortest (± its standard error); rank 1 "
    "= smallest increase (extrapolates best)"
)


def _loss_cell(r: LengthResult, digits: int) -> str:
    error = f" ± {r.stderr:.{digits}f}" if math.isfinite(r.stderr) else " ± n/a"
    return f"{r.loss:.{digits}f}{error} (n={r.windows})"


def format_table(
    results: Results,
    *,
    perplexity: bool = False,
    digits: int = 3,
    kinds: Mapping[str, str] | None = None,
    warnings: Sequence[str] = (),
) -> str:
    """A fixed-width table: one row per label; per multiple a "loss, nats (ev=k, L tokens)" column
    holding ``loss ± SE (n=windows)``; the loss increase from the shortest to the longest length
    and its rank (lower is better); the kind of row when ``kinds`` names any; with
    ``perplexity=True`` a "perplexity (ev=k)" column per multiple. A multiple a model was not
    evaluated at shows "-". A note on units and any ``warnings`` follow the table."""
    multiples = _multiples(results)
    lengths = {r.multiple: r.length for rows in results.values() for r in rows}
    ranked = {row["label"]: row for row in ranking(results, kinds)}
    header = ["model"]
    if kinds:
        header.append("row")
    header += [f"loss, nats (ev={m}, {lengths[m]} tok)" for m in multiples]
    header += ["increase, nats", "rank"]
    if perplexity:
        header += [f"perplexity (ev={m})" for m in multiples]
    rows = []
    for label, entries in results.items():
        by_multiple = {r.multiple: r for r in entries}
        row = [label]
        if kinds:
            row.append(kinds.get(label, "trained"))
        row += [_loss_cell(by_multiple[m], digits) if m in by_multiple else "-" for m in multiples]
        if label in ranked:
            increase, stderr = ranked[label]["increase_nats"], ranked[label]["increase_stderr_nats"]
            error = f" ± {stderr:.{digits}f}" if math.isfinite(stderr) else ""
            rank = ranked[label]["rank"]
            row += [f"{increase:+.{digits}f}{error}", "ref" if rank is None else str(rank)]
        else:
            row += ["-", "-"]
        if perplexity:
            row += [_format_ppl(by_multiple[m].perplexity) if m in by_multiple else "-" for m in multiples]
        rows.append(row)
    first_numeric = 2 if kinds else 1
    widths = [max(len(str(cells[i])) for cells in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        text = [f"{c:<{w}}" for c, w in zip(cells[:first_numeric], widths, strict=False)]
        text += [f"{c:>{w}}" for c, w in zip(cells[first_numeric:], widths[first_numeric:], strict=True)]
        return "  ".join(text).rstrip()

    rule = "-" * len(line(header))
    notes = [TABLE_NOTE] + [f"warning: {w}" for w in warnings]
    return "\n".join([line(header), rule, *(line(r) for r in rows), rule, *notes])


def _format_ppl(value: float) -> str:
    if math.isinf(value):
        return "inf"
    return f"{value:.4g}" if value >= 1e4 else f"{value:.2f}"


def _json_number(value: float) -> float | str | None:
    if math.isnan(value):
        return None
    return value if math.isfinite(value) else str(value)


def _provenance_lines(metadata: Mapping[str, Any] | None) -> list[str]:
    """``key: value`` lines of the provenance (date, commit, versions, command, threads)."""
    record = dict((metadata or {}).get("provenance") or {})
    if not record:
        return []
    versions = ", ".join(f"{k} {v}" for k, v in (record.get("versions") or {}).items())
    threads = record.get("threads") or {}
    lines = [
        f"date: {record.get('date')}",
        f"git commit: {record.get('git_commit') or 'not a git checkout'}",
        f"versions: {versions}",
        f"command: {record.get('command')}",
    ]
    if threads:
        lines.append(f"torch threads: {threads.get('threads')} ({threads.get('reason')})")
    return lines


def write_csv(
    results: Results,
    path: str | Path,
    *,
    metadata: Mapping[str, Any] | None = None,
    kinds: Mapping[str, str] | None = None,
    warnings: Sequence[str] = (),
) -> Path:
    """One row per (label, multiple), columns :data:`CSV_FIELDS` (units in their names), after ``#``
    comment lines with the provenance and warnings (``pandas.read_csv(path, comment="#")``)."""
    path = Path(path)
    with replacing(path) as partial, partial.open("w", newline="", encoding="utf-8") as handle:
        for line in [*_provenance_lines(metadata), *(f"warning: {w}" for w in warnings)]:
            handle.write(f"# {line}\n")
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for label, entries in results.items():
            for r in entries:
                record = {k: _csv_number(v) for k, v in r.to_record().items()}
                writer.writerow({"label": label, "row": (kinds or {}).get(label, "trained"), **record})
    return path


def _csv_number(value: Any) -> Any:
    return "" if isinstance(value, float) and math.isnan(value) else value


def write_json(
    results: Results,
    path: str | Path,
    *,
    train_length: int,
    title: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    kinds: Mapping[str, str] | None = None,
    warnings: Sequence[str] = (),
) -> Path:
    """``{"title", "train_length_tokens", "units", "metadata" (with provenance), "warnings", "row_kinds",
    "ranking", "results": {label: [row, ...]}}``; every numeric key names its unit."""
    metadata = dict(metadata or {})
    if "provenance" not in metadata:
        from ..provenance import provenance

        metadata["provenance"] = provenance()
    document = {
        "title": title,
        "train_length_tokens": train_length,
        "units": {
            "loss_nats": "mean next-token negative log-likelihood, natural log (nats); lower is better",
            "loss_stderr_nats": "standard error of loss_nats over the evaluation windows (null: one window)",
            "perplexity": "exp(loss_nats)",
            "increase_nats": "loss at the longest length minus at the shortest; lower extrapolates better",
        },
        "metadata": metadata,
        "warnings": list(warnings),
        "row_kinds": {label: (kinds or {}).get(label, "trained") for label in results},
        "ranking": [
            {k: _json_number(v) if isinstance(v, float) else v for k, v in row.items()}
            for row in ranking(results, kinds)
        ],
        "results": {
            label: [
                {k: _json_number(v) if isinstance(v, float) else v for k, v in r.to_record().items()}
                for r in entries
            ]
            for label, entries in results.items()
        },
    }
    return write_text(path, json.dumps(document, indent=2) + "\n")


def write_report(
    results: Results,
    out_dir: str | Path,
    train_length: int,
    title: str | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
    perplexity: bool = True,
    dashed: Collection[str] = (),
    kinds: Mapping[str, str] | None = None,
    warnings: Sequence[str] = (),
) -> dict[str, Path]:
    """Write results.txt (the table), results.csv, results.json and loss_vs_length.png, each with the
    provenance, the units and the warnings (``warnings`` given plus those of the results themselves,
    see :func:`~.ranking.result_warnings`). ``kinds`` maps labels to ``trained``/``base``/``eval-only``
    (``dashed``: the older spelling for evaluation-only rows).

    Returns ``{"table": ..., "csv": ..., "json": ..., "png": ...}``.
    """
    directory = check_output_dir(out_dir)
    paths = {key: directory / name for key, name in FILE_NAMES.items()}
    row_kinds = {**{label: "eval-only" for label in dashed}, **dict(kinds or {})}
    metadata = dict(metadata or {})
    if "provenance" not in metadata:
        from ..provenance import provenance

        metadata["provenance"] = provenance()
    all_warnings = [*warnings, *result_warnings(results)]
    table = format_table(results, perplexity=perplexity, kinds=row_kinds or None, warnings=all_warnings)
    heading = f"{title}\n" if title else ""
    provenance_text = "\n".join(_provenance_lines(metadata))
    write_text(
        paths["table"], f"{heading}training length {train_length} tokens\n{table}\n\n{provenance_text}\n"
    )
    write_csv(results, paths["csv"], metadata=metadata, kinds=row_kinds, warnings=all_warnings)
    write_json(
        results,
        paths["json"],
        train_length=train_length,
        title=title,
        metadata=metadata,
        kinds=row_kinds,
        warnings=all_warnings,
    )
    plot_losses(
        results, paths["png"], train_length=train_length, title=title, kinds=row_kinds, warnings=all_warnings
    )
    return paths
