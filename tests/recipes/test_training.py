"""Continued pretraining: exact resume, atomic checkpoints, multi-process equivalence, LoRA,
and early errors — all offline on a tiny Llama with a locally trained tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from training_runs import Interrupt, interrupt_at, run_config, save_base_model

import hf_posenc
from hf_posenc.recipes.cli import main
from hf_posenc.recipes.data import stdlib_documents
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.training import TrainConfig, train


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A saved tiny Llama + tokenizer and two small data files (.txt and .jsonl)."""
    root = tmp_path_factory.mktemp("train")
    documents = list(stdlib_documents())[:12]
    save_base_model(root, documents, vocab_size=512, max_positions=128)
    (root / "data.txt").write_text("\n\n".join(documents[:4]))
    with open(root / "data.jsonl", "w") as handle:
        for document in documents[4:8]:
            handle.write(json.dumps({"text": document}) + "\n")
    return root


def config(workspace: Path, name: str, **overrides) -> TrainConfig:
    values = dict(
        data=[str(workspace / "data.txt"), str(workspace / "data.jsonl")],
        encoding="t5",
        seq_len=64,
        batch_size=4,
        max_steps=6,
        save_every=2,
    )
    return run_config(workspace, name, **{**values, **overrides})


def final_state(result) -> dict[str, torch.Tensor]:
    return hf_posenc.from_pretrained(str(result.final_dir)).state_dict()


@pytest.mark.slow  # multi-second; CI runs it
def test_resume_after_interruption_reaches_the_same_weights(workspace):
    """A run killed after step 5 and resumed (from its step-4 checkpoint) ends with exactly the
    weights and loss history of an uninterrupted run: same data order, optimizer, scheduler."""
    uninterrupted = train(config(workspace, "straight"), progress=False)
    with pytest.raises(Interrupt):
        train(config(workspace, "interrupted"), callbacks=[interrupt_at(5)], progress=False)
    assert sorted(p.name for p in (workspace / "interrupted").glob("checkpoint-*")) == [
        "checkpoint-2",
        "checkpoint-4",
    ]
    resumed = train(config(workspace, "interrupted"), resume=True, progress=False)
    assert resumed.losses == uninterrupted.losses
    expected, got = final_state(uninterrupted), final_state(resumed)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


@pytest.mark.slow  # multi-second; CI runs it
def test_a_save_killed_midway_resumes_from_the_previous_checkpoint(workspace):
    """Leftovers of an interrupted save (a .tmp directory, a directory without its state file)
    are never resumed from: the run continues from the last complete checkpoint."""
    straight = train(config(workspace, "straight2"), progress=False)
    with pytest.raises(Interrupt):
        train(config(workspace, "killed-save"), callbacks=[interrupt_at(5)], progress=False)
    run = workspace / "killed-save"
    shutil.copytree(run / "checkpoint-4", run / "checkpoint-6.tmp")  # a save killed before its rename
    (run / "checkpoint-4" / "trainer_state.json").unlink()  # a checkpoint whose save never completed
    resumed = train(config(workspace, "killed-save"), resume=True, progress=False)
    assert resumed.losses == straight.losses
    assert not list(run.glob("*.tmp"))


@pytest.mark.slow  # multi-second; CI runs it
def test_lora_trains_adapters_and_the_encoding_and_the_result_reloads(workspace):
    """--lora: base weights move only through the adapters, the t5 bias trains fully, and the
    merged result reloads with hf_posenc.from_pretrained to the same logits."""
    result = train(config(workspace, "lora", lora=True, lora_r=4, save_every=0, max_steps=4), progress=False)
    reloaded = hf_posenc.from_pretrained(str(result.final_dir)).eval()
    base = tiny_model("llama", vocab_size=reloaded.config.vocab_size, max_positions=128)
    base.load_state_dict(hf_posenc.load_model(str(workspace / "base")).state_dict())
    assert reloaded.posenc.tables[0].weight.abs().sum() > 0  # zero-initialised bias was trained
    q_before = base.model.layers[0].self_attn.q_proj.weight
    q_after = reloaded.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_before, q_after)  # merged LoRA delta
    assert torch.equal(
        base.model.embed_tokens.weight, reloaded.model.embed_tokens.weight
    )  # not a LoRA target
    ids = torch.randint(3, 500, (1, 20))
    again = hf_posenc.from_pretrained(str(result.final_dir)).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, again(ids).logits)


RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "accelerate"


@pytest.fixture(scope="module")
def one_process(workspace):
    return train(
        config(workspace, "one-process", batch_size=4, save_every=0, max_steps=4, encoding="alibi"),
        progress=False,
    )


@pytest.mark.slow  # multi-second (process launches, waits, full runs): CI runs it
@pytest.mark.parametrize("recipe", ["cpu_2proc", "ddp", "fsdp"])
def test_two_cpu_processes_from_each_recipe_config_reach_the_same_losses_as_one(
    workspace, one_process, recipe
):
    """`accelerate launch --config_file recipes/accelerate/X.yaml --num_processes 2` on a machine
    without GPUs: two real ranks (gloo), half the per-process batch, the 1-process losses; one
    final model written by the main process only."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ACCELERATE_USE_CPU", None)
    output = workspace / f"two-processes-{recipe}"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(RECIPES / f"{recipe}.yaml"),
    ]
    command += ["--num_processes", "2", "-m", "hf_posenc", "train", "--model", str(workspace / "base")]
    command += [
        "--output-dir",
        str(output),
        "--data",
        str(workspace / "data.txt"),
        str(workspace / "data.jsonl"),
    ]
    command += [
        "--encoding",
        "alibi",
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--max-steps",
        "4",
        "--lr",
        "3e-3",
    ]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "2 launched processes train on the CPU" in completed.stdout
    assert completed.stdout.count("final model:") == 1  # printed by the main process only
    record = json.loads((output / "final" / "training_run.json").read_text())
    assert record["num_processes"] == 2
    losses = json.loads((output / "final" / "losses.json").read_text())
    assert len(losses) == len(one_process.losses) == 4
    for (step_a, loss_a), (step_b, loss_b) in zip(one_process.losses, losses, strict=True):
        assert step_a == step_b and abs(loss_a - loss_b) < 1e-4, (one_process.losses, losses)


def test_cli_train_end_to_end(workspace, capsys):
    code = main(
        [
            "train",
            "--model",
            str(workspace / "base"),
            "--output-dir",
            str(workspace / "cli"),
            "--data",
            str(workspace / "data.txt"),
            "--encoding",
            "rope",
            "--encoding-param",
            'scaling={"type": "linear", "factor": 2.0}',
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--max-steps",
            "2",
        ]
    )
    assert code == 0
    assert "final model" in capsys.readouterr().out
    model = hf_posenc.from_pretrained(str(workspace / "cli" / "final"))
    assert hf_posenc.patch_info(model)["params"]["scaling"]["factor"] == 2.0


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"data": ["missing.txt"]}, FileNotFoundError, "missing.txt"),
        (
            {"encoding": "learned", "encoding_params": {"max_positions": 16}},
            hf_posenc.InvalidParameterError,
            "max_positions=16",
        ),
        ({"encoding": "alibbi"}, hf_posenc.UnknownEncodingError, "alibi"),
    ],
)
def test_bad_input_fails_before_training(workspace, overrides, error, message):
    with pytest.raises(error, match=message):
        train(config(workspace, "bad", **overrides), progress=False)
    assert not (workspace / "bad" / "final").exists()


def test_output_path_that_is_a_file_is_refused(workspace):
    (workspace / "a-file").write_text("x")
    with pytest.raises(NotADirectoryError, match="a-file"):
        train(config(workspace, "a-file"), progress=False)


def test_existing_run_is_never_overwritten_and_resume_checks_settings(workspace):
    with pytest.raises(Interrupt):
        train(config(workspace, "guarded"), callbacks=[interrupt_at(3)], progress=False)
    with pytest.raises(hf_posenc.InvalidParameterError, match="--resume"):
        train(config(workspace, "guarded"), progress=False)
    with pytest.raises(hf_posenc.InvalidParameterError, match="seq_len=32 \\(was 64\\)"):
        train(config(workspace, "guarded", seq_len=32), resume=True, progress=False)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        train(config(workspace, "fresh"), resume=True, progress=False)


@pytest.mark.slow  # multi-second (process launches, waits, full runs): CI runs it
def test_a_stopped_rank_makes_the_other_fail_after_the_ddp_timeout(workspace):
    """SIGSTOP on rank 1 of a 2-process run: rank 0 stops with a one-line error within
    --ddp-timeout (5 s) plus slack, instead of waiting for the 30-minute default; no final/."""
    import signal
    import time

    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    output = workspace / "stopped-rank"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(RECIPES / "cpu_2proc.yaml"),
    ]
    command += ["-m", "hf_posenc", "train", "--model", str(workspace / "base"), "--output-dir", str(output)]
    command += ["--data", str(workspace / "data.txt"), "--seq-len", "32", "--batch-size", "2"]
    command += ["--max-steps", "100000", "--log-every", "1", "--ddp-timeout", "5"]
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in launcher.stdout:  # wait until both ranks train
            if '"step": 3' in line:
                break
        ranks = {}
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                ranks[child.environ().get("RANK")] = child
            except psutil.Error:
                continue
        ranks["1"].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        ranks["0"].wait(timeout=120)
        waited = time.monotonic() - stopped
        # the launcher (torchrun) gives a failed run's other ranks 30 s to answer SIGTERM, which a
        # stopped process never does: ended here, the test does not wait those 30 s
        ranks["1"].kill()
        _, err = launcher.communicate(timeout=120)
    finally:
        for child in psutil.Process(launcher.pid).children(recursive=True) if launcher.poll() is None else []:
            child.kill()
        launcher.kill()
    assert launcher.returncode != 0
    assert "did not answer within --ddp-timeout 5 s" in err, err[-3000:]
    assert waited < 60
    assert not (output / "final").exists()


@pytest.mark.slow  # multi-second; CI runs it
def test_continuing_a_trained_checkpoint_at_a_new_scaling_keeps_its_tensors(workspace):
    """Position-interpolation fine-tuning: ``train`` from a saved t5 run with only
    ``encoding_params={"scaling": ...}`` (no encoding name) starts from that run's bucket table
    (with lr 0 the continued run ends bit-identical to it) and saves the new factor with it."""
    first = train(config(workspace, "pi-first", max_steps=2, save_every=0), progress=False)
    scaling = {"type": "linear", "factor": 2.0}
    second = train(
        config(
            workspace, "pi-second", model=str(first.final_dir), encoding=None,
            encoding_params={"scaling": scaling}, max_steps=2, save_every=0, lr=0.0,
        ),
        progress=False,
    )  # fmt: skip
    saved = json.loads((second.final_dir / "config.json").read_text())["posenc"]
    before = json.loads((first.final_dir / "config.json").read_text())["posenc"]
    assert saved["params"] == {**before["params"], "scaling": scaling}
    first_state, second_state = final_state(first), final_state(second)
    assert sorted(first_state) == sorted(second_state)
    assert all(torch.equal(first_state[k], second_state[k]) for k in first_state)
