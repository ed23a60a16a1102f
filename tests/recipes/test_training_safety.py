"""A run is never lost or corrupted: finished runs are not overwritten, divergence stops without
a final model, --resume refuses changed settings, damaged checkpoints are detected by their
checksums and the previous intact one is used, bad data names its file and line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from training_runs import Interrupt, base_workspace, interrupt_at, run_config

import hf_posenc
from hf_posenc.recipes.cli import main
from hf_posenc.recipes.data import DataError, read_documents
from hf_posenc.recipes.training import TrainConfig, train
from hf_posenc.recipes.training.checkpoints import STATE_FILE


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return base_workspace(tmp_path_factory.mktemp("safety"))


def settings(workspace: Path, name: str, **overrides) -> TrainConfig:
    values = dict(
        data=[str(workspace / "data.txt")],
        encoding="t5",
        seq_len=32,
        batch_size=2,
        max_steps=6,
        save_every=2,
        data_cache=str(workspace / "cache"),
    )
    return run_config(workspace, name, **{**values, **overrides})


def test_a_finished_run_is_never_overwritten_unless_asked(workspace):
    first = train(settings(workspace, "done", save_every=0, max_steps=2), progress=False)
    weights = (first.final_dir / "model.safetensors").read_bytes()
    with pytest.raises(hf_posenc.InvalidParameterError, match="finished run"):
        train(settings(workspace, "done", save_every=0, max_steps=3), progress=False)
    with pytest.raises(hf_posenc.InvalidParameterError, match="nothing to resume"):
        train(settings(workspace, "done", save_every=0, max_steps=2), resume=True, progress=False)
    assert (first.final_dir / "model.safetensors").read_bytes() == weights
    again = train(settings(workspace, "done", save_every=0, max_steps=3), overwrite=True, progress=False)
    assert [step for step, _ in again.losses] == [1, 2, 3]
    assert json.loads((again.final_dir / "training_run.json").read_text())["config"]["max_steps"] == 3


def test_divergence_stops_training_without_a_final_model(workspace, capsys):
    """An absurd learning rate makes weights overflow: a clear error, exit code 2, no final/."""
    run = workspace / "diverged"
    argv = ["train", "--model", str(workspace / "base"), "--output-dir", str(run)]
    argv += ["--data", str(workspace / "data.txt"), "--seq-len", "32", "--batch-size", "2"]
    argv += ["--max-steps", "5", "--lr", "1e30", "--max-grad-norm", "0", "--warmup-ratio", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("hf-posenc train: error:")]
    assert len(errors) == 1 and "diverged" in errors[0], err[-2000:]
    assert not (run / "final").exists() and not (run / "final.tmp").exists()


def test_pure_fp16_training_is_refused_before_loading(workspace, capsys):
    with pytest.raises(hf_posenc.InvalidParameterError, match="pure fp16"):
        settings(workspace, "fp16", dtype="float16")
    argv = ["train", "--model", str(workspace / "base"), "--output-dir", str(workspace / "fp16")]
    assert main([*argv, "--dtype", "float16"]) == 2
    assert "pure fp16" in capsys.readouterr().err
    assert main([*argv, "--lr", "inf"]) == 2
    assert "lr=inf" in capsys.readouterr().err


def test_resume_refuses_any_change_of_the_encoding_or_its_parameters(workspace):
    with pytest.raises(Interrupt):
        train(settings(workspace, "changed"), callbacks=[interrupt_at(3)], progress=False)
    for overrides, message in [
        ({"encoding_params": {"max_distance": 20}}, "encoding_params={'max_distance': 20} \\(was {}\\)"),
        ({"encoding_params": {"num_buckets": 8}}, "num_buckets"),
        ({"encoding": "alibi"}, "encoding='alibi' \\(was 't5'\\)"),
        ({"lr": 1e-3}, "lr=0.001"),
    ]:
        with pytest.raises(hf_posenc.InvalidParameterError, match=message):
            train(settings(workspace, "changed", **overrides), resume=True, progress=False)
    # an alias of the same encoding, and a different checkpoint cadence, are the same run
    resumed = train(settings(workspace, "changed", encoding="T5", save_every=3), resume=True, progress=False)
    assert len(resumed.losses) == 6


@pytest.fixture(scope="module")
def straight(workspace):
    """The uninterrupted run every resumed run is compared with."""
    return train(settings(workspace, "straight"), progress=False)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "file"),
    [
        (_truncate, "model.safetensors"),
        (_flip_a_bit, "model.safetensors"),
        (lambda p: p.write_bytes(b""), "optimizer.bin"),
        (lambda p: p.write_text("{garbage"), STATE_FILE),
    ],
    ids=["truncated-weights", "bit-flip", "empty-optimizer", "garbage-state"],
)
def test_a_damaged_latest_checkpoint_is_reported_and_the_previous_one_resumes_exactly(
    workspace, straight, damage, file, capsys
):
    """Reference: the uninterrupted run. The resumed run starts from checkpoint-2 (checkpoint-4 is
    damaged), says so naming the file, and still reaches the same losses."""
    name = f"damaged-{file}-{damage.__name__}"
    with pytest.raises(Interrupt):
        train(settings(workspace, name), callbacks=[interrupt_at(5)], progress=False)
    damage(workspace / name / "checkpoint-4" / file)
    capsys.readouterr()
    resumed = train(settings(workspace, name), resume=True, progress=False)
    out = capsys.readouterr().out
    assert f"skipping damaged checkpoint {workspace / name / 'checkpoint-4'}" in out
    assert "resuming from" in out and "checkpoint-2 (step 2)" in out
    assert resumed.losses == straight.losses


def test_checkpoints_record_the_checksum_of_every_file(workspace):
    import hashlib

    with pytest.raises(Interrupt):
        train(settings(workspace, "sums"), callbacks=[interrupt_at(3)], progress=False)
    checkpoint = workspace / "sums" / "checkpoint-2"
    recorded = json.loads((checkpoint / STATE_FILE).read_text())["files"]
    on_disk = {p.name for p in checkpoint.iterdir() if p.name != STATE_FILE}
    assert set(recorded) == on_disk and "model.safetensors" in on_disk
    for name, entry in recorded.items():
        assert entry["sha256"] == hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("latin1.txt", "caf\xe9\n".encode("latin-1"), "latin1.txt:1: bytes b'\\xe9\\n' are not UTF-8"),
        ("rows.jsonl", b'{"text": "a"}\n\n"just a string"\n', "rows.jsonl:3: the row is a JSON str"),
        ("rows.jsonl", b'{"text": "a"}\n{"text": 5}\n', "rows.jsonl:2: field 'text' is a JSON int"),
        ("rows.jsonl", b'{"text": ["a"]}\n', "rows.jsonl:1: field 'text' is a JSON list"),
        ("rows.jsonl", b'{"text": "a"}\n{"text": "b"\n', "rows.jsonl:2: not a JSON value"),
        ("rows.jsonl", b'{"body": "a"}\n', "rows.jsonl:1: the row has no field 'text' (fields: body)"),
        ("bad.jsonl", b'{"text": "a"}\n{"text": "\xff"}\n', "bad.jsonl:2: bytes"),
        ("array.json", b'  \n [{"text": "a"}, 7]', "array.json:row 2: the row is a JSON int"),
        ("broken.json", b'[{"text": "a"},\n {"text": }]', "broken.json:2: not valid JSON"),
    ],
)
def test_every_data_error_names_the_file_and_line(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError) as caught:
        list(read_documents([str(tmp_path / name)]))
    assert f"{tmp_path / name}:" in str(caught.value) and message in str(caught.value)


def test_a_json_array_with_leading_whitespace_is_read_as_an_array(tmp_path):
    (tmp_path / "a.json").write_text('\n   [{"text": "one"}, {"text": "two"}]\n')
    assert list(read_documents([str(tmp_path / "a.json")])) == ["one", "two"]


def test_bad_data_fails_in_one_line_before_training(workspace, tmp_path, capsys):
    (tmp_path / "rows.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    argv = ["train", "--model", str(workspace / "base"), "--output-dir", str(tmp_path / "run")]
    assert main([*argv, "--data", str(tmp_path / "rows.jsonl"), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "rows.jsonl:2: the row is a JSON list" in errors[0], err
    assert "Loading weights" not in err  # the model was never loaded
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.slow  # multi-second (process launches, waits, full runs): CI runs it
def test_a_launch_whose_processes_do_not_join_stops_before_writing_anything(workspace, tmp_path):
    """torchrun-style environment (WORLD_SIZE=2) but accelerate told to ignore it: every process
    would be the main one. The run stops with one clear line, exit code 2, nothing written."""
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "ACCELERATE_USE_CPU": "false"}
    command = [sys.executable, "-m", "hf_posenc", "train", "--model", str(workspace / "base")]
    command += ["--output-dir", str(tmp_path / "run"), "--data", str(workspace / "data.txt")]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2, completed.stderr[-2000:]
    assert "started 2 processes" in completed.stderr and "accelerate joined 1" in completed.stderr
    assert not (tmp_path / "run").exists()


def test_ddp_timeout_reaches_the_process_group_settings(workspace):
    from hf_posenc.recipes.training.world import make_accelerator

    accelerator = make_accelerator(settings(workspace, "timeout", ddp_timeout=42), workspace / "timeout")
    assert accelerator.init_handler.timeout.total_seconds() == 42


def test_final_folder_has_a_model_card_and_provenance(workspace):
    result = train(settings(workspace, "card", save_every=0, max_steps=2), progress=False)
    card = (result.final_dir / "README.md").read_text()
    record = json.loads((result.final_dir / "training_run.json").read_text())
    assert "hf_posenc.from_pretrained" in card and "`t5`" in card and str(workspace / "base") in card
    assert f"{result.losses[-1][1]:.4f} at step 2" in card
    assert record["provenance"]["versions"]["torch"] == torch.__version__
    assert record["provenance"]["versions"]["transformers"] and record["provenance"]["date"]
    assert record["provenance"]["command"]


def test_report_to_tensorboard_logs_every_step_loss(workspace):
    """--report-to goes through accelerate's trackers: the TensorBoard event file holds the
    same per-step losses as losses.json."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = train(
        settings(workspace, "tracked", save_every=0, max_steps=3, report_to=["tensorboard"]), progress=False
    )
    events = sorted(
        (workspace / "tracked" / "hf-posenc").glob("events.out.tfevents.*")
    )  # hparams: a subfolder
    assert events, sorted(p.name for p in (workspace / "tracked").rglob("*"))
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    logged = [(e.step, e.value) for e in accumulator.Scalars("loss")]
    assert [step for step, _ in logged] == [1, 2, 3]
    for (step, value), (expected_step, expected) in zip(logged, result.losses, strict=True):
        assert step == expected_step and value == pytest.approx(expected, rel=1e-6)
