"""The benchmark suite runs every requested encoding and mode against the native model in
one run and reports ratios (no timing is asserted: the machine is noisy)."""

from __future__ import annotations

import json

from hf_posenc.cli import main


def test_bench_reports_ratios_to_native_for_each_encoding_mode_and_length(tmp_path, capsys):
    code = main(
        [
            "bench",
            "--encodings",
            "alibi",
            "expe",
            "--lengths",
            "32",
            "64",
            "--hidden-size",
            "32",
            "--num-layers",
            "1",
            "--num-heads",
            "2",
            "--repeats",
            "1",
            "--decode-prompt",
            "16",
            "--decode-tokens",
            "2",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    table = (tmp_path / "bench.md").read_text()
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    # native + 2 encodings, each with forward/train at 2 lengths and one decode row
    assert len(rows) == 3 * (2 + 2 + 1)
    assert all(row.split("|")[5].strip() == "1.00x" for row in rows if row.startswith("| native"))
    data = json.loads((tmp_path / "bench.json").read_text())
    assert {r["encoding"] for r in data["results"]} == {"native", "alibi", "expe"}
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    assert "time / native" in capsys.readouterr().out
