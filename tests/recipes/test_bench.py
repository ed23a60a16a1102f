"""The benchmark suite runs every requested encoding and mode against the native model in
one run and reports ratios (no timing is asserted: the machine is noisy)."""

from __future__ import annotations

import json

import pytest

from hf_posenc.recipes.cli import main


@pytest.mark.slow  # multi-second (process launches, waits, full runs): CI runs it
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


@pytest.mark.slow  # multi-second; CI runs it
def test_bench_plots_only_the_modes_that_ran_and_records_provenance(tmp_path):
    import torch

    from hf_posenc.recipes.benchmark import BenchConfig, run_suite, write_results
    from hf_posenc.recipes.benchmark.suite import _panels

    config = BenchConfig(
        encodings=["alibi"],
        lengths=[32],
        modes=["decode", "forward"],
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        repeats=1,
        decode_prompt=16,
        decode_tokens=2,
    )
    results = run_suite(config, progress=False)
    assert _panels(results) == [("forward", "seconds"), ("decode", "seconds"), ("forward", "peak_bytes")]
    paths = write_results(results, config, tmp_path)
    record = json.loads(paths["json"].read_text())["provenance"]
    assert record["versions"]["torch"] == torch.__version__ and record["command"] and record["date"]
    assert paths["png"].read_bytes().startswith(b"\x89PNG")


def test_train_lengths_measure_forward_and_training_at_their_own_lengths():
    """--lengths 48 --train-lengths 32: forward rows at 48, forward+backward rows at 32 (the
    held-out ratio benchmark, forward at 4096 and training at 2048, is one command)."""
    from hf_posenc.recipes.benchmark import BenchConfig, run_suite

    config = BenchConfig(
        encodings=["t5"],
        lengths=[48],
        train_lengths=[32],
        modes=["forward", "train"],
        vocab_size=64,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        repeats=1,
        warmup=0,
    )
    rows = {(m.encoding, m.mode, m.length) for m in run_suite(config, progress=False)}
    assert rows == {(e, mode, n) for e in ("native", "t5") for mode, n in (("forward", 48), ("train", 32))}


def test_bad_train_length_is_one_line(capsys):
    assert main(["bench", "--train-lengths", "1"]) != 0
    assert "--train-lengths 1 is not allowed; allowed: integers >= 2" in capsys.readouterr().err


def test_freeze_encoding_trains_without_the_encodings_own_gradients(monkeypatch):
    """--freeze-encoding: the train rows run with the encoding's parameters frozen (no gradient
    reaches T5's bucket table) while the model's own weights still get theirs."""
    import hf_posenc.recipes.benchmark.suite as suite
    from hf_posenc.recipes.benchmark import BenchConfig, run_suite

    seen = []
    original = suite._train_step

    def recording(model, ids):
        original(model, ids)
        if hasattr(model, "posenc"):
            own = [p.grad for p in model.posenc.parameters()]
            seen.append((all(g is None for g in own), model.lm_head.weight.grad is not None))

    monkeypatch.setattr(suite, "_train_step", recording)
    config = BenchConfig(
        encodings=["t5"], lengths=[16], modes=["train"], vocab_size=64, hidden_size=16,
        num_layers=1, num_heads=2, repeats=1, warmup=0, freeze_encoding=True,
    )  # fmt: skip
    run_suite(config, progress=False)
    assert seen and all(frozen and trained for frozen, trained in seen)


def test_timed_calls_run_under_the_timing_allocator_and_memory_readings_under_the_memory_one(monkeypatch):
    """On CPU the memory readings need glibc's mmap threshold at 64 KiB (the resident set then follows
    the live tensors), but timing under it page-faults every large allocation (the native forward at
    4096 tokens took ~520 ms instead of ~360 ms): every timed call must follow allocator_for_timing,
    every memory reading return_freed_memory_to_os, whatever the order of the rows."""
    from hf_posenc.recipes.benchmark import BenchConfig, measure, run_suite, suite

    events: list[str] = []
    monkeypatch.setattr(suite, "allocator_for_timing", lambda: events.append("timing") or True)
    monkeypatch.setattr(suite, "return_freed_memory_to_os", lambda: events.append("memory") or True)
    real_elapsed, real_enter = measure.elapsed, measure.PeakMemory.__enter__

    def timed(run, device):
        events.append("timed call")
        return real_elapsed(run, device)

    def reading(self):
        events.append("memory reading")
        return real_enter(self)

    monkeypatch.setattr(measure, "elapsed", timed)
    monkeypatch.setattr(measure.PeakMemory, "__enter__", reading)
    config = BenchConfig(
        encodings=["alibi", "t5"],
        lengths=[32],
        modes=["forward", "train"],
        vocab_size=64,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        repeats=2,
        warmup=0,
    )
    run_suite(config, progress=False)
    setting = None
    for event in events:
        if event in ("timing", "memory"):
            setting = event
        elif event == "timed call":
            assert setting == "timing", events
        else:
            assert setting == "memory", events
    assert events.count("timed call") == 2 * 2 * 2 * 2  # (alibi, t5) x (forward, train) x repeats x pair
    # each row reads native then the model (the same allocator state) MEMORY_READINGS times, plus
    # native's first reading per mode
    assert events.count("memory reading") == 2 * 2 * 2 * suite.MEMORY_READINGS + 2


def test_a_rows_memory_is_the_median_of_alternating_readings(monkeypatch):
    """Each row's peak memory and its native's are the medians of MEMORY_READINGS readings taken in
    native/model pairs: a first reading that is off (the allocator switching settings) does not
    decide the row."""
    from hf_posenc.recipes.benchmark import BenchConfig, run_suite, suite

    monkeypatch.setattr(suite, "MEMORY_READINGS", 3)
    order: list[str] = []
    values = {"native": iter([100, 1000, 40, 41, 42, 43, 44]), "model": iter([900, 50, 52, 51])}

    def peak(self, model, mode, ids):
        who = "native" if model is self.native else "model"
        order.append(who)
        return next(values[who])

    monkeypatch.setattr(suite._Bench, "peak", peak)
    config = BenchConfig(
        encodings=["alibi"], lengths=[16], modes=["forward"], vocab_size=64,
        hidden_size=16, num_layers=1, num_heads=2, repeats=1, warmup=0,
    )  # fmt: skip
    rows = [row for row in run_suite(config, progress=False) if row.encoding == "alibi"]
    assert order == ["native", "native", "model", "native", "model", "native", "model"]
    assert (rows[0].native_peak_bytes, rows[0].peak_bytes) == (
        41,
        52,
    )  # medians of (1000, 40, 41), (900, 50, 52)


def test_the_two_allocator_settings_are_accepted_by_glibc():
    """Both mallopt settings take effect on Linux/glibc (the CI machine); elsewhere they report False."""
    import sys

    from hf_posenc.recipes.benchmark import measure

    expected = sys.platform.startswith("linux")
    try:
        assert measure.allocator_for_timing() is expected
        assert measure.return_freed_memory_to_os() is expected
    finally:
        measure.allocator_for_timing()
