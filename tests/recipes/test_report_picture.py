"""What the length-extrapolation report shows (issue 24): rows ranked by the loss increase from
the shortest to the longest length with standard errors over evaluation windows; warnings when
windows are too few or runs too short; outliers shown on the frame's edge with their value, not
drawn through it; one meaning per line style (the kind of row), named in the legend."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hf_posenc.recipes.evaluation.perplexity import LengthResult, standard_error
from hf_posenc.recipes.evaluation.plot import KIND_LINESTYLE, draw_losses
from hf_posenc.recipes.evaluation.ranking import (
    MIN_WINDOWS,
    ROW_KINDS,
    loss_increase,
    ranking,
    result_warnings,
    study_warnings,
)

finite = st.floats(-50, 50, allow_nan=False, allow_infinity=False)


@given(st.lists(finite, min_size=2, max_size=40))
def test_standard_error_is_the_sample_standard_deviation_over_root_n(values):
    expected = statistics.stdev(values) / math.sqrt(len(values))
    assert standard_error(values) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_one_window_has_no_standard_error():
    assert math.isnan(standard_error([3.0]))


def row(multiple: int, loss: float, stderr: float = 0.01, windows: int = 64) -> LengthResult:
    length = 128 * multiple
    return LengthResult(multiple, length, windows, windows * (length - 1), loss, math.exp(loss), stderr)


@given(st.lists(st.tuples(finite, finite, st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=12))
def test_ranking_sorts_by_the_increase_with_the_combined_standard_error(pairs):
    results = {f"r{i}": [row(1, a, sa), row(16, b, sb)] for i, (a, b, sa, sb) in enumerate(pairs)}
    ranked = ranking(results)
    assert [r["rank"] for r in ranked] == list(range(1, len(pairs) + 1))
    increases = [r["increase_nats"] for r in ranked]
    assert increases == sorted(increases)
    for r in ranked:
        a, b, sa, sb = pairs[int(r["label"][1:])]
        assert r["increase_nats"] == pytest.approx(b - a)
        assert r["increase_stderr_nats"] == pytest.approx(math.hypot(sa, sb))
        assert (r["from_length_tokens"], r["to_length_tokens"]) == (128, 2048)


def test_a_row_with_one_length_has_no_increase():
    assert loss_increase([row(1, 2.0)]) is None
    assert ranking({"one": [row(1, 2.0)], "two": [row(1, 2.0), row(2, 2.5)]})[0]["label"] == "two"


@pytest.mark.parametrize(("windows", "warned"), [(1, True), (MIN_WINDOWS - 1, True), (MIN_WINDOWS, False)])
def test_too_few_windows_are_warned_about(windows, warned):
    results = {"a": [row(1, 2.0), row(16, 2.5, windows=windows)], "b": [row(1, 2.0), row(16, 2.4)]}
    lines = result_warnings(results)
    assert bool(lines) == warned
    if warned:
        assert "ev=16 (2048 tokens)" in lines[0] and f"{windows} evaluation window" in lines[0]


def test_short_study_runs_are_warned_about():
    assert study_warnings(300, 1000) == []
    assert (
        len(study_warnings(10, 1000)) == 1 and "10 continued-pretraining steps" in study_warnings(10, 1000)[0]
    )
    assert len(study_warnings(10, 5)) == 2
    assert study_warnings(300, None) == []  # a given base model was not pretrained here


def _study_like() -> dict[str, list[LengthResult]]:
    """Rows close together, one far above them at long lengths (sinusoidal in the default study)."""
    results = {
        name: [row(m, 3.7 + slope * math.log2(m)) for m in (1, 2, 4, 8, 16)]
        for name, slope in (("rope", 0.18), ("alibi", 0.0), ("t5", 0.1), ("expe", 0.07), ("base", 0.15))
    }
    results["sinusoidal"] = [
        row(m, value) for m, value in zip((1, 2, 4, 8, 16), (4.5, 5.6, 6.6, 7.1, 7.2), strict=True)
    ]
    results["expe (x0.5 at eval)"] = [row(m, 3.72 + 0.08 * math.log2(m)) for m in (1, 2, 4, 8, 16)]
    return results


@pytest.mark.slow  # draws a figure (seconds)
def test_outliers_sit_on_the_frame_edge_with_their_value_and_no_line_crosses_the_frame():
    figure = draw_losses(
        _study_like(), train_length=128, kinds={"base": "base", "expe (x0.5 at eval)": "eval-only"}
    )
    curves, ranked = figure.axes[:2]
    low, high = curves.get_ylim()
    for line in curves.get_lines():
        ys = [y for y in line.get_ydata() if math.isfinite(y)]
        assert all(low - 1e-9 <= y <= high + 1e-9 for y in ys), (line.get_label(), ys, high)
    triangles = [
        line for line in curves.get_lines() if line.get_marker() == "^" and line.get_label().startswith("_")
    ]
    assert len(triangles) >= 3  # 6.6, 7.1 and 7.2 are far above every other row
    texts = {t.get_text() for t in curves.texts}
    assert {"6.60", "7.10", "7.20"} <= texts
    # the ranking panel clips the sinusoidal bar at its edge and prints its value
    assert any(t.get_text().startswith("+2.70") for t in ranked.texts)
    assert ranked.get_xlim()[1] < 2.7


@pytest.mark.slow  # draws a figure (seconds)
def test_each_line_style_means_one_kind_of_row_and_the_legend_names_it():
    kinds = {"base": "base", "expe (x0.5 at eval)": "eval-only"}
    figure = draw_losses(_study_like(), train_length=128, kinds=kinds)
    curves = figure.axes[0]
    styles = {}
    for container in curves.containers:  # one errorbar container per row
        styles[container.get_label()] = container.lines[0].get_linestyle()
    assert set(styles) == set(_study_like())
    for label, style in styles.items():
        assert style == KIND_LINESTYLE[kinds.get(label, "trained")], label
    legend_texts = {t.get_text() for t in figure.legends[0].get_texts()}
    assert {"line style: " + ROW_KINDS[kind] for kind in ("trained", "base", "eval-only")} <= legend_texts
    assert set(_study_like()) <= legend_texts
    # the training length is a shaded span, not another dashed line
    assert all(
        line.get_linestyle() in KIND_LINESTYLE.values() or line.get_linestyle() == "None"
        for line in curves.get_lines()
    )


@pytest.mark.slow  # draws a figure (seconds)
def test_lower_is_better_and_warnings_are_written_on_the_figure():
    figure = draw_losses(_study_like(), train_length=128, warnings=["too short: 4 steps"])
    ranked = figure.axes[1]
    assert "lower is better" in ranked.get_xlabel() and "lower is better" in figure.axes[0].get_ylabel()
    assert any("too short: 4 steps" in t.get_text() for t in figure.texts)


def test_the_untrained_base_is_a_reference_below_the_ranked_rows_never_ranked():
    """The base barely moves when it never learned the longer lengths' positions: ranking it would
    make "no training" look like the best extrapolator. It comes last, with rank None; the other
    rows are ranked 1..n by increase."""
    results = {
        "base": [row(1, 7.0), row(2, 7.0)],  # increase 0: would be first
        "rope": [row(1, 5.0), row(2, 5.4)],
        "alibi": [row(1, 5.0), row(2, 5.1)],
    }
    ranked = ranking(results, {"base": "base"})
    assert [(r["label"], r["rank"]) for r in ranked] == [("alibi", 1), ("rope", 2), ("base", None)]
    assert [r["rank"] for r in ranking(results)] == [1, 2, 3]  # without kinds every row competes


@pytest.mark.slow  # draws a figure (seconds)
def test_every_ranking_interval_lies_inside_the_panel_on_both_sides_of_zero():
    """Negative increases with wide intervals: each bar's whole 95% interval (increase ± 1.96 SE)
    is in view, so no error bar is cut off at the panel's edge; the base is labelled a reference."""
    results = {
        "base": [row(1, 7.27, 0.02), row(2, 7.271, 0.03)],
        "rope": [row(1, 7.113, 0.035), row(2, 7.110, 0.053)],
        "alibi": [row(1, 7.112, 0.037), row(2, 7.107, 0.056)],
    }
    figure = draw_losses(results, train_length=128, kinds={"base": "base"})
    ranked = figure.axes[1]
    low, high = ranked.get_xlim()
    for entry in ranking(results, {"base": "base"}):
        half = 1.96 * entry["increase_stderr_nats"]
        assert low < entry["increase_nats"] - half and entry["increase_nats"] + half < high, entry
    labels = [t.get_text() for t in ranked.get_yticklabels()]
    assert "base (reference)" in labels and "1. alibi" in labels
