"""The length-extrapolation report (``format_table``, ``write_report``, ``check_output_dir``): a
table with a row per model and a loss column per multiple of the training length, CSV, JSON and a
PNG chart; output folders that cannot be written are refused before any work.
"""

from __future__ import annotations

import csv
import json
import math
import os

import pytest

from hf_posenc.recipes.evaluation import (
    LengthResult,
    check_output_dir,
    format_table,
    write_report,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# -- report ----------------------------------------------------------------------------------
def _result(multiple: int, loss: float, stderr: float = 0.0625) -> LengthResult:
    return LengthResult(multiple, 8 * multiple, 2, 2 * (8 * multiple - 1), loss, math.exp(loss), stderr)


REPORT = {
    "rope": [_result(1, 2.5), _result(2, 3.75)],
    "expe": [_result(1, 2.25), _result(2, 2.125), _result(4, 2.0)],
}


def test_table_has_a_row_per_model_a_loss_column_per_multiple_with_units_errors_and_counts():
    """Each cell is loss ± standard error (n=windows), the header names nats and the length; the
    increase from the shortest to the longest length ranks the rows (lower first); a note says what
    the numbers are and any warning follows."""
    table = format_table(REPORT, perplexity=True, warnings=["look out"]).splitlines()
    header = " ".join(table[0].split())
    for m, length in ((1, 8), (2, 16), (4, 32)):
        assert f"loss, nats (ev={m}, {length} tok)" in header and f"perplexity (ev={m})" in header
    assert "increase, nats" in header and "rank" in header
    rope, expe = table[2], table[3]
    assert rope.startswith("rope") and "2.500 ± 0.062 (n=2)" in rope and "3.750 ± 0.062 (n=2)" in rope
    assert expe.startswith("expe") and "2.000 ± 0.062 (n=2)" in expe and f"{math.exp(2.25):.2f}" in expe
    # rope rises 3.75 - 2.5 = +1.25 (rank 2), expe 2.0 - 2.25 = -0.25 (rank 1); SE sqrt(2) * 0.0625
    assert f"+1.250 ± {math.sqrt(2) * 0.0625:.3f}" in rope and rope.split()[-4] == "2"
    assert "-0.250" in expe and expe.split()[-4] == "1"
    assert "nats" in table[-2] and "lower is better" in table[-2]
    assert table[-1] == "warning: look out"


def test_write_report_writes_csv_json_and_a_png(tmp_path):
    import matplotlib.image

    paths = write_report(REPORT, tmp_path / "out", train_length=8, title="demo", metadata={"data": ["x"]})
    lines = paths["csv"].read_text().splitlines()
    comments = [line for line in lines if line.startswith("#")]
    assert any(line.startswith("# date: ") for line in comments)
    assert any(line.startswith("# versions: ") and "torch" in line for line in comments)
    assert any("too few windows" in line for line in comments)  # 2 windows per length
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert [(r["label"], int(r["length_tokens"]), float(r["loss_nats"])) for r in rows] == [
        ("rope", 8, 2.5), ("rope", 16, 3.75), ("expe", 8, 2.25), ("expe", 16, 2.125), ("expe", 32, 2.0)
    ]  # fmt: skip
    assert {float(r["loss_stderr_nats"]) for r in rows} == {0.0625} and {r["windows"] for r in rows} == {"2"}
    document = json.loads(paths["json"].read_text())
    assert document["train_length_tokens"] == 8 and document["metadata"]["data"] == ["x"]
    assert document["metadata"]["provenance"]["date"] and "loss_nats" in document["units"]
    assert document["results"]["expe"][2] == {
        "multiple": 4, "length_tokens": 32, "windows": 2, "predicted_tokens": 62,
        "loss_nats": 2.0, "loss_stderr_nats": 0.0625, "perplexity": math.exp(2.0),
    }  # fmt: skip
    assert [row["label"] for row in document["ranking"]] == ["expe", "rope"]
    assert any("too few windows" in w for w in document["warnings"])
    assert paths["png"].read_bytes()[:8] == PNG_SIGNATURE
    assert matplotlib.image.imread(paths["png"]).shape[2] in (3, 4)
    assert "expe" in paths["table"].read_text()


def test_output_dir_that_is_a_file_or_under_a_file_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        check_output_dir(afile)
    with pytest.raises(NotADirectoryError, match="a parent path is a file"):
        check_output_dir(afile / "sub")
    assert check_output_dir(tmp_path / "new" / "dir").is_dir()


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="chmod cannot make a directory unwritable for root (CI runs as root); test_output_dir_where_files_cannot_be_created_is_refused covers the same path",
)
def test_unwritable_output_dir_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(PermissionError, match="is not writable"):
        check_output_dir(locked)


def test_output_dir_where_files_cannot_be_created_is_refused(tmp_path, monkeypatch):
    """(Simulated, for root) a failing test write becomes a PermissionError naming the directory."""
    import hf_posenc.recipes.evaluation.report as report

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(report.tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(PermissionError, match=r"'.*out' is not writable \(Permission denied\)"):
        check_output_dir(tmp_path / "out")
