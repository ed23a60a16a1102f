"""Property: ``benchmark.peak_memory`` reads a training step's peak of allocated bytes from the
profiler's allocation events: the tensors it lists alive at a peak add up to at most that
peak, a longer step peaks higher, and with a (tokens x vocabulary) loss the step's peak holds
the logits (the largest tensor alive); bad lengths and devices are refused in one line."""

from __future__ import annotations

import json

import pytest

from hf_posenc.recipes.benchmark import peak_memory

FLAGS = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--vocab-size", "300"]
FLAGS += ["--lengths", "32", "64", "--loss", "full", "--min-bytes", "1"]


def test_peaks_and_what_is_alive_at_them(tmp_path, capsys):
    out = tmp_path / "peak.json"
    assert peak_memory.main([*FLAGS, "--encodings", "tape", "--detail", "--json", str(out)]) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"native", "tape"}
    for row in rows.values():
        assert 0 < row["short"]["peak"] < row["long"]["peak"]
        assert row["long"]["layers"] <= row["long"]["peak"]
        for key in ("peak", "layers"):
            listed = sum(g["count"] * g["bytes"] for g in row["long"]["alive"][key])
            assert listed <= row["long"][key]
        largest = max(row["long"]["alive"]["peak"], key=lambda g: g["bytes"])
        assert largest["bytes"] >= 64 * 300 * 4  # the (T x V) fp32 logits (or a copy of them)
    assert "| tape |" in capsys.readouterr().out


def test_inference_peaks_below_the_training_step_and_holds_the_logits(tmp_path):
    """--inference: one no-grad forward, whose peak holds at least its (T x V) fp32 logits and
    stays below the same model's training step (which keeps activations for backward)."""
    paths = {mode: tmp_path / f"{mode}.json" for mode in ("train", "inference")}
    for mode, path in paths.items():
        extra = ["--inference"] if mode == "inference" else []
        assert peak_memory.main([*FLAGS, *extra, "--encodings", "comrope", "--json", str(path)]) == 0
    rows = {mode: {r["row"]: r for r in json.loads(path.read_text())["rows"]} for mode, path in paths.items()}
    for name in ("native", "comrope"):
        inference, train = rows["inference"][name]["long"], rows["train"][name]["long"]
        assert 64 * 300 * 4 <= inference["peak"] < train["peak"]
        assert inference["layers"] == inference["peak"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--lengths", "64", "32"], "--lengths"),
        (["--device", "cuda"], "--device"),
        (["--inference", "--gradient-checkpointing"], "--gradient-checkpointing"),
    ],
)
def test_bad_settings_are_refused(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        peak_memory.main(flags)
    assert exit_info.value.code != 0
    assert named in capsys.readouterr().err
