"""One run per output folder (issue 19 finding 4): a second ``hf-posenc train``, ``study``,
``perplexity``, ``longeval`` or ``bench`` into a folder another live process is writing is
refused at once, in one line naming the holder, before anything is changed; a holder killed
with ``kill -9`` leaves no stuck lock. An evaluation into a folder holding an earlier run's
results keeps them unless ``--overwrite`` is given."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from training_runs import base_workspace, error_lines, perplexity_argv

from hf_posenc.recipes import run_lock
from hf_posenc.recipes.study import StudyConfig, run_study
from hf_posenc.recipes.tokenizer import train_bpe_tokenizer

HOLD = (
    "import sys, time; from hf_posenc.recipes import run_lock; run_lock.acquire(sys.argv[1]); "
    "print('held', flush=True); time.sleep(300)"
)


def holder(folder: Path) -> subprocess.Popen:
    """Another process holding ``folder``'s lock (until killed)."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    return child


def test_another_process_holding_the_folder_is_named_and_kill_9_frees_it(tmp_path):
    child = holder(tmp_path)
    try:
        with pytest.raises(run_lock.FolderInUseError) as caught:
            run_lock.acquire(tmp_path, "train run")
        message = str(caught.value)
        assert "\n" not in message and f"pid {child.pid}" in message and str(tmp_path) in message, message
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    run_lock.acquire(tmp_path)  # the kernel dropped the dead process's lock: not stuck
    run_lock.release(tmp_path)


def test_the_process_holding_a_folder_may_take_it_again(tmp_path):
    run_lock.acquire(tmp_path)
    run_lock.acquire(tmp_path)  # e.g. a study's own steps, or a resume in the same interpreter
    run_lock.release(tmp_path)
    child = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(300)", "pass"), str(tmp_path)])
    assert child.returncode != 0  # still held once: another process cannot take it
    run_lock.release(tmp_path)
    assert (
        subprocess.run(
            [sys.executable, "-c", HOLD.replace("time.sleep(300)", "pass"), str(tmp_path)]
        ).returncode
        == 0
    )


def test_a_study_into_a_folder_in_use_is_refused_before_writing(tmp_path):
    child = holder(tmp_path)
    try:
        with pytest.raises(run_lock.FolderInUseError, match="in use by another hf-posenc study"):
            run_study(StudyConfig(output_dir=str(tmp_path), encodings=["rope"], steps=1))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert not (tmp_path / "study_config.json").exists()


@pytest.mark.slow  # two real training processes
def test_a_second_train_into_a_running_runs_folder_refuses_at_once(tmp_path):
    from hf_posenc.recipes.data import stdlib_documents
    from hf_posenc.recipes.tiny import tiny_model

    documents = list(stdlib_documents())[:10]
    tokenizer = train_bpe_tokenizer(documents, vocab_size=400)
    tiny_model("llama", vocab_size=len(tokenizer), max_positions=64).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    (tmp_path / "data.txt").write_text("\n\n".join(documents[:6]))
    command = [sys.executable, "-m", "hf_posenc", "train", "--model", str(tmp_path / "base")]
    command += ["--output-dir", str(tmp_path / "run"), "--data", str(tmp_path / "data.txt")]
    command += ["--seq-len", "32", "--batch-size", "2", "--save-every", "0", "--encoding", "alibi"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([*command, "--max-steps", "100000"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        lock_file = tmp_path / "run" / run_lock.LOCK_FILE
        deadline = time.monotonic() + 240
        while not (lock_file.exists() and lock_file.read_text()):
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took its folder"
            time.sleep(0.2)
        assert json.loads(lock_file.read_text())["pid"] == first.pid
        started = time.monotonic()
        second = subprocess.run(
            [*command, "--max-steps", "1"], env=env, capture_output=True, text=True, timeout=300
        )
        elapsed = time.monotonic() - started
        assert second.returncode == 2, second.stderr[-2000:]
        errors = [line for line in second.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and f"in use by another hf-posenc train run (pid {first.pid}" in errors[0], (
            second.stderr
        )
        assert "Loading weights" not in second.stderr  # refused before the model loads
        assert elapsed < 60, elapsed
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    run_lock.acquire(tmp_path / "run")  # kill -9 left no stuck lock
    run_lock.release(tmp_path / "run")


@pytest.mark.slow  # a 2-process accelerate launch
def test_every_process_of_a_two_process_launch_refuses_a_folder_in_use(tmp_path):
    """The main process finds the folder held; the other one learns it from the main one (a
    broadcast) instead of waiting for it forever: the launch ends with the one line."""
    recipes = Path(__file__).resolve().parents[2] / "recipes" / "accelerate"
    (tmp_path / "run").mkdir()
    child = holder(tmp_path / "run")
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("ACCELERATE_USE_CPU", None)
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
        command += [str(recipes / "cpu_2proc.yaml"), "--num_processes", "2", "-m", "hf_posenc", "train"]
        command += ["--output-dir", str(tmp_path / "run"), "--data", "builtin:stdlib", "--max-steps", "1"]
        command += ["--model", str(tmp_path / "base")]
        from hf_posenc.recipes.data import stdlib_documents
        from hf_posenc.recipes.tiny import tiny_model

        tokenizer = train_bpe_tokenizer(list(stdlib_documents())[:4], vocab_size=300)
        tiny_model("llama", vocab_size=len(tokenizer), max_positions=64).save_pretrained(tmp_path / "base")
        tokenizer.save_pretrained(tmp_path / "base")
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert completed.returncode != 0
    errors = [line for line in completed.stderr.splitlines() if "hf-posenc train: error:" in line]
    assert len(errors) == 2, completed.stderr[-3000:]  # one line from each process, the same
    assert all(f"in use by another hf-posenc train run (pid {child.pid}" in line for line in errors)


# -- the evaluation commands: perplexity, longeval, bench -----------------------------------------
@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return base_workspace(tmp_path_factory.mktemp("eval-lock"), max_positions=512)


def evaluation(command: str, root: Path, output: Path, *extra: str) -> list[str]:
    """The argv of a small ``command`` run on the base model into ``output``."""
    if command == "perplexity":
        return perplexity_argv(root, "base", output, "--encoding", "alibi", *extra)
    if command == "longeval":
        return ["longeval", "--model", str(root / "base"), "--encoding", "alibi", "--tasks", "passkey",
                "--lengths", "256", "--samples", "1", "--depths", "0.5", "--output", str(output), *extra]  # fmt: skip
    return ["bench", "--encodings", "alibi", "--modes", "forward", "--lengths", "16", "--repeats", "1",
            "--num-layers", "1", "--output-dir", str(output), *extra]  # fmt: skip


RESULT_FILES = {"perplexity": "results.json", "longeval": "results.json", "bench": "bench.json"}


@pytest.mark.parametrize("command", ["perplexity", "longeval", "bench"])
def test_an_evaluation_into_a_folder_in_use_is_refused_before_writing(base_model, tmp_path, capsys, command):
    from hf_posenc.recipes.cli import main

    child = holder(tmp_path)
    try:
        assert main(evaluation(command, base_model, tmp_path)) != 0
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and f"in use by another hf-posenc {command} run" in errors[0], errors
    assert not (tmp_path / RESULT_FILES[command]).exists()


@pytest.mark.slow  # three runs of each command
@pytest.mark.parametrize("command", ["perplexity", "longeval", "bench"])
def test_an_evaluation_keeps_an_earlier_runs_results_unless_told_to_replace_them(
    base_model, tmp_path, capsys, command
):
    """A second run into a folder with results is refused in one line, the results untouched;
    ``--overwrite`` replaces them (before, perplexity and bench replaced them silently)."""
    from hf_posenc.recipes.cli import main

    assert main(evaluation(command, base_model, tmp_path)) == 0
    first = (tmp_path / RESULT_FILES[command]).read_bytes()
    capsys.readouterr()
    assert main(evaluation(command, base_model, tmp_path)) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "holds another run's results" in errors[0] and "--overwrite" in errors[0], (
        errors
    )
    assert (tmp_path / RESULT_FILES[command]).read_bytes() == first
    assert main(evaluation(command, base_model, tmp_path, "--overwrite")) == 0
    assert json.loads((tmp_path / RESULT_FILES[command]).read_text())  # a whole new result file
