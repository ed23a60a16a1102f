"""Property: ``benchmark.saved_memory`` lists per token what a training step keeps for backward,
kind by kind: the kinds add up to the row's total, and the kinds whose size the model's shapes
give (native attention's rotated q and k, its output) read exactly that; bad lengths are refused
in one line."""

from __future__ import annotations

import json

import pytest

from hf_posenc.recipes.benchmark import saved_memory

LAYERS, HIDDEN, HEADS = 2, 64, 4
FLAGS = ["--hidden-size", str(HIDDEN), "--num-layers", str(LAYERS), "--num-heads", str(HEADS)]
FLAGS += ["--vocab-size", "300", "--lengths", "32", "64"]


def test_rows_list_what_is_kept_per_token(tmp_path, capsys):
    out = tmp_path / "saved.json"
    assert saved_memory.main([*FLAGS, "--encodings", "tape", "--json", str(out)]) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"native", "tape"}
    for row in rows.values():  # kinds under 1 byte per token are left out of the listing
        listed = sum(k["bytes_per_token"] for k in row["kinds"])
        assert abs(listed - row["bytes_per_token"]) <= len(row["kinds"]) + 8, row["row"]
    attention: dict[str, float] = {}
    for k in rows["native"]["kinds"]:
        if k["where"] == "layer":
            attention[k["made_by"]] = attention.get(k["made_by"], 0.0) + k["bytes_per_token"]
    fp32_heads = HIDDEN * 4  # H * D fp32 values per token and layer
    assert attention["ScaledDotProductFlashAttentionForCpuBackward0"] == LAYERS * fp32_heads  # the output
    assert attention["AddBackward0"] >= LAYERS * 2 * fp32_heads  # rotated q and k (and residual adds)
    assert "| tape |" in capsys.readouterr().out


@pytest.mark.parametrize("lengths", [["64", "32"], ["1", "8"]])
def test_bad_lengths_are_refused(lengths, capsys):
    with pytest.raises(SystemExit) as exit_info:
        saved_memory.main(["--lengths", *lengths])
    assert exit_info.value.code != 0
    assert "--lengths" in capsys.readouterr().err
