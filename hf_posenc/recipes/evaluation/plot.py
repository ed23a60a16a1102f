"""The picture of a length-extrapolation report: who extrapolates best, at a glance.

Two panels on a bare Agg canvas (no pyplot, no display, the global backend untouched):

* **left, loss against evaluation length** (log2 axis in tokens), one line per row with an
  error bar of its 95% interval (``± 1.96`` standard errors over evaluation windows). Line style
  means one thing, the kind of row: solid trained, dashed evaluation-only, dotted the untrained
  base. The training length is a grey shaded bar, not a line style. Points far above the rest
  are not drawn through the frame: each shows as a triangle on the top edge with its value.
* **right, the ranking**: the loss increase from 1x to the longest length, one bar per row,
  sorted, lower is better (said on the axis), with 95% error bars (the numbers beside them give
  ± one standard error, as the table does); evaluation-only bars are hatched; the untrained base
  is grey, unranked and set apart below the ranked rows (it is what every row was switched from,
  not a contender). A bar far beyond the rest is clipped at the edge with its value.

Warnings (too few windows, too short runs) are printed under the panels.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..atomic import replacing
from .ranking import ROW_KINDS, Z95, Results, ranking

#: line style of each kind of row (and nothing else)
KIND_LINESTYLE = {"trained": "-", "eval-only": "--", "base": ":"}


def line_styles(count: int) -> list[dict[str, Any]]:
    """Distinguishable styles for ``count`` lines: 10 colours, then distinct markers (the line style
    is left to the caller, who gives it one meaning)."""
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


#: a value is never called off scale for being less than this many nats beyond the typical row
MIN_OUTLIER_MARGIN = 0.5


def _upper_limit(values_by_row: Mapping[str, Sequence[float]], floor: float) -> float | None:
    """A y (or x) limit above which a value is an outlier: the median row's largest value plus 1.5
    times its distance from ``floor`` (at least :data:`MIN_OUTLIER_MARGIN` nats); None when nothing
    exceeds it (or too few rows to tell)."""
    tops = sorted(max(v) for v in values_by_row.values() if v)
    if len(tops) < 3:
        return None
    typical = tops[len(tops) // 2]
    limit = typical + max(1.5 * (typical - floor), MIN_OUTLIER_MARGIN)
    return limit if tops[-1] > limit else None


def _row_kinds(
    labels: Sequence[str], kinds: Mapping[str, str] | None, dashed: Collection[str]
) -> dict[str, str]:
    given = dict(kinds or {})
    for label in dashed:
        given.setdefault(label, "eval-only")
    return {label: given.get(label, "trained") for label in labels}


def _loss_panel(axes, results: Results, styles: dict[str, dict[str, Any]], train_length: int) -> None:
    finite = {label: [r.loss for r in rows if math.isfinite(r.loss)] for label, rows in results.items()}
    floor = min((v for values in finite.values() for v in values), default=0.0)
    limit = _upper_limit(finite, floor)
    count = len(results)
    for number, (label, entries) in enumerate(results.items()):
        style = styles[label]
        ordered = sorted((r for r in entries if math.isfinite(r.loss)), key=lambda r: r.length)
        shown = [r for r in ordered if limit is None or r.loss <= limit]
        dodge = 1 + 0.012 * (number - (count - 1) / 2)  # error bars side by side, not on top of each other
        x = [r.length * dodge for r in shown]
        y = [r.loss for r in shown]
        errors = [Z95 * r.stderr if math.isfinite(r.stderr) else 0.0 for r in shown]
        axes.errorbar(x, y, yerr=errors, label=label, capsize=2, elinewidth=0.8, markersize=5, **style)
        for r in ordered:
            if limit is not None and r.loss > limit:  # off scale: a triangle on the edge, its value beside
                axes.plot([r.length], [limit], marker="^", color=style["color"], markersize=9, clip_on=False)
                axes.annotate(
                    f"{r.loss:.2f}",
                    (r.length, limit),
                    textcoords="offset points",
                    xytext=(6, -10),
                    color=style["color"],
                    fontsize="small",
                )
    if limit is not None:
        low = floor - 0.05 * (limit - floor)
        axes.set_ylim(low, limit)
    _length_axis(axes, results, train_length)
    if limit is not None:
        axes.set_xlabel(axes.get_xlabel() + "\n▲ on the top edge: value off scale (the number beside it)")
    axes.set_ylabel("loss (mean next-token NLL, nats) — lower is better")
    axes.set_title("loss against evaluation length (error bars: 95% interval)")


def _length_axis(axes, results: Results, train_length: int) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    lengths = sorted({r.length for rows in results.values() for r in rows} | {train_length})
    axes.axvspan(train_length / 1.06, train_length * 1.06, color="gray", alpha=0.25, linewidth=0)
    axes.text(
        train_length * 1.08,
        0.98,
        "training length",
        transform=axes.get_xaxis_transform(),
        fontsize="x-small",
        color="dimgray",
        rotation=90,
        va="top",
    )
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_locator(FixedLocator(lengths))
    axes.xaxis.set_minor_locator(NullLocator())
    axes.set_xticklabels([str(n) for n in lengths])
    axes.set_xlabel("evaluation length (tokens, log2 scale)")
    formatter = ScalarFormatter(useOffset=False)
    formatter.set_scientific(False)
    axes.yaxis.set_major_formatter(formatter)
    axes.grid(True, alpha=0.3)


def _ranking_panel(axes, results: Results, styles: dict[str, dict[str, Any]], kinds: dict[str, str]) -> None:
    rows = ranking(results, kinds)
    if not rows:
        axes.set_axis_off()
        axes.text(0.5, 0.5, "one length only: nothing to rank", ha="center", va="center")
        return
    values = {row["label"]: [row["increase_nats"]] for row in rows}
    floor = min(0.0, *(row["increase_nats"] for row in rows))
    limit = _upper_limit(values, floor)
    positions = list(range(len(rows)))[::-1]  # best (lowest) at the top
    for position, row in zip(positions, rows, strict=True):
        label, value, stderr = row["label"], row["increase_nats"], row["increase_stderr_nats"]
        kind = kinds[label]
        colour = "lightgray" if kind == "base" else styles[label]["color"]
        shown = value if limit is None else min(value, limit)
        axes.barh(
            position,
            shown,
            color=colour,
            alpha=0.8,
            hatch="///" if kind == "eval-only" else None,
            edgecolor="dimgray" if kind != "trained" else colour,
        )
        if math.isfinite(stderr) and (limit is None or value <= limit):
            axes.errorbar(shown, position, xerr=Z95 * stderr, color="black", capsize=3, linewidth=1)
        if limit is not None and value > limit:
            axes.annotate(
                f"{value:+.2f} ▶",
                (limit, position),
                textcoords="offset points",
                xytext=(-4, 0),
                ha="right",
                va="center",
                fontsize="small",
                color="white",
                fontweight="bold",
            )
        else:
            text = f"{value:+.3f}" + (f" ± {stderr:.3f} SE" if math.isfinite(stderr) else "")
            axes.annotate(
                text,
                (max(shown, 0, shown + Z95 * _finite(stderr)), position),
                textcoords="offset points",
                xytext=(4, 0),
                va="center",
                fontsize="x-small",
            )
    names = [
        f"{row['label']} (reference)" if row["rank"] is None else f"{row['rank']}. {row['label']}"
        for row in rows
    ]
    axes.set_yticks(positions, names, fontsize="small")
    references = [position for position, row in zip(positions, rows, strict=True) if row["rank"] is None]
    if references and len(references) < len(rows):  # the untrained base apart from the ranked rows
        axes.axhline(max(references) + 0.5, color="dimgray", linewidth=0.8, linestyle=(0, (1, 3)))
    # the whole 95% interval of every row in view, on both sides of zero
    left = min([0.0] + [row["increase_nats"] - Z95 * _finite(row["increase_stderr_nats"]) for row in rows])
    right = max(row["increase_nats"] + Z95 * _finite(row["increase_stderr_nats"]) for row in rows)
    if limit is not None:
        right = limit
    span = (max(right, 0.0) - left) or 1.0
    axes.set_xlim(left - 0.05 * span, max(right, 0.0) + (0.05 if limit is not None else 0.45) * span)
    axes.axvline(0, color="black", linewidth=0.8)
    first, last = rows[0]["from_length_tokens"], rows[0]["to_length_tokens"]
    axes.set_xlabel(f"loss increase from {first} to {last} tokens (nats) — lower is better")
    axes.set_title("who extrapolates best\n(bars: 95% interval; numbers: ± 1 SE, as in the table)")
    axes.grid(True, axis="x", alpha=0.3)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def _legend(figure, axes, kinds: dict[str, str], bottom: float) -> int:
    """The rows and the line-style key in a legend across the figure's foot, above ``bottom``
    (beside the panels it crowded the ranking's numbers); returns its number of text rows."""
    from matplotlib.lines import Line2D

    handles, labels = axes.get_legend_handles_labels()
    present = [kind for kind in ROW_KINDS if kind in kinds.values()]
    if len(present) > 1 or present != ["trained"]:
        for kind in present:
            handles.append(Line2D([], [], color="black", linestyle=KIND_LINESTYLE[kind]))  # type: ignore[arg-type]
            labels.append("line style: " + ROW_KINDS[kind])
    columns = 3
    figure.legend(
        handles,
        labels,
        loc="lower center",
        bbox_to_anchor=(0.5, bottom),
        ncol=columns,
        fontsize="small",
        frameon=False,
    )
    return -(-len(labels) // columns)


def plot_losses(
    results: Results,
    path: str | Path,
    *,
    train_length: int,
    title: str | None = None,
    dashed: Collection[str] = (),
    kinds: Mapping[str, str] | None = None,
    warnings: Sequence[str] = (),
) -> Path:
    """Write the picture described in the module docstring to ``path`` (PNG).

    ``kinds`` maps labels to ``trained`` (default), ``base`` or ``eval-only``; ``dashed`` (older
    spelling) marks evaluation-only rows. ``warnings`` are printed under the panels."""
    figure = draw_losses(
        results, train_length=train_length, title=title, dashed=dashed, kinds=kinds, warnings=warnings
    )
    path = Path(path)
    with replacing(path) as partial:
        figure.savefig(partial, format="png")
    return path


def draw_losses(
    results: Results,
    *,
    train_length: int,
    title: str | None = None,
    dashed: Collection[str] = (),
    kinds: Mapping[str, str] | None = None,
    warnings: Sequence[str] = (),
) -> Any:
    """The figure :func:`plot_losses` saves (a matplotlib ``Figure`` on an Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    row_kinds = _row_kinds(list(results), kinds, dashed)
    legend_rows = -(-(len(results) + len(set(row_kinds.values()))) // 3)
    height = 6 + 0.25 * len(warnings) + 0.22 * legend_rows
    figure = Figure(figsize=(15, height), dpi=110)
    FigureCanvasAgg(figure)
    curves, ranked = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1]})
    styles = {}
    for label, style in zip(results, line_styles(len(results)), strict=True):
        kind = row_kinds[label]
        styles[label] = {**style, "linestyle": KIND_LINESTYLE[kind]}
        if kind == "base":
            styles[label].update(color="dimgray", marker="o", markerfacecolor="white")
        elif kind == "eval-only":
            styles[label]["markerfacecolor"] = "none"
    _loss_panel(curves, results, styles, train_length)
    _ranking_panel(ranked, results, styles, row_kinds)
    figure.suptitle(title or "Loss against evaluation length")
    line_height = 0.24 / height  # one line of small text, as a fraction of the figure's height
    bottom = 0.01 + line_height * len(warnings)
    for number, line in enumerate(warnings):
        figure.text(0.01, bottom - line_height * (number + 1), "⚠ " + line, color="darkred", fontsize="small")
    rows = _legend(figure, curves, row_kinds, bottom)
    figure.tight_layout(rect=(0, bottom + line_height * (rows + 0.5), 1, 0.96))
    return figure
