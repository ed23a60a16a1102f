"""``hf-posenc train --sequence-parallel N`` (DeepSpeed Ulysses through accelerate, issue 22 item 3).

Without DeepSpeed (CI): the batch each rank trains on, its shard of the sequence, and the loss
arithmetic, against references written from the definitions (next-token targets, the mean
cross-entropy over a step's targets, DeepSpeed's grouping of consecutive ranks); the refusals.
With DeepSpeed installed (``DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed``; CI lacks
it): two CPU processes under ``accelerate launch --config_file recipes/accelerate/ulysses.yaml``
train like one process, and a run killed with SIGKILL resumes bit-exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from training_runs import one_error, run_config, save_base_model

from hf_posenc.recipes.cli import main
from hf_posenc.recipes.data import stdlib_documents
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.training import parallelism, train
from hf_posenc.recipes.training.batches import BatchOrder
from hf_posenc.recipes.training.loss import loss_function
from hf_posenc.recipes.training.ulysses import check_zero_stage, sequence_shard, ulysses_layout

ROOT = Path(__file__).resolve().parents[2]


# -- the shards, against the definitions ------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    chunk=st.integers(1, 5),
    size=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_the_shards_put_back_together_are_the_sequence_with_its_next_tokens(batch, chunk, size, seed):
    """Rank r holds tokens r*T/N .. (r+1)*T/N-1 with their true positions and, as targets, the token
    that follows each of them in the whole sequence (none after the last token)."""
    length = chunk * size
    ids = torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(seed))
    shards = [sequence_shard({"input_ids": ids, "labels": ids}, rank, size) for rank in range(size)]
    for rank, shard in enumerate(shards):
        for b in range(batch):
            for j in range(chunk):
                t = rank * chunk + j  # the token's place in the whole sequence
                assert shard["input_ids"][b, j] == ids[b, t]
                assert shard["position_ids"][b, j] == t
                expected = ids[b, t + 1] if t + 1 < length else -100
                assert shard["shift_labels"][b, j] == expected
        assert shard["labels"] is shard["shift_labels"]
        assert shard["num_items_in_batch"] == batch * (length - 1)  # the whole micro-batch's targets


def test_a_length_the_degree_does_not_cut_is_refused():
    ids = torch.zeros(1, 7, dtype=torch.long)
    with pytest.raises(Exception, match="multiple of 2"):
        sequence_shard({"input_ids": ids, "labels": ids}, 0, 2)


def test_the_ranks_of_a_group_train_on_one_batch_and_the_groups_on_the_global_batch():
    """DeepSpeed groups consecutive ranks (ranks g*N .. g*N+N-1 form group g); every rank of a group
    gets the group's blocks, and the groups together the one-process global batch."""
    blocks = torch.arange(40 * 4).reshape(40, 4)
    processes, degree, per_group = 6, 3, 2
    one = BatchOrder(blocks, per_group * 2, 1, 0, seed=5)  # one process, the whole global batch
    for micro in range(5):
        seen = {}
        for process in range(processes):
            groups, group, rank = ulysses_layout(process, processes, degree)
            assert (groups, group, rank) == (2, process // 3, process % 3)
            seen[process] = BatchOrder(blocks, per_group, groups, group, seed=5).indices(micro)
        assert torch.equal(seen[0], seen[1]) and torch.equal(seen[1], seen[2])
        assert torch.equal(seen[3], seen[5]) and not torch.equal(seen[0], seen[3])
        assert torch.equal(torch.cat([seen[0], seen[3]]), one.indices(micro))
    with pytest.raises(Exception, match="dividing the number of processes"):
        ulysses_layout(0, 3, 2)


def test_the_ranks_losses_give_the_mean_over_the_steps_targets():
    """Each rank's loss (its summed cross-entropy over its micro-batch's targets) divided by the
    accumulation steps (DeepSpeed's backward) and summed over ranks / groups (the gradient
    all-reduce, divided by the groups) is the mean cross-entropy over all the step's targets, computed
    here from the unsharded logits. 2 groups, 2 ranks each, 2 micro-batches."""
    generator = torch.Generator().manual_seed(0)
    vocab, length, accumulation, groups, degree = 11, 8, 2, 2, 2
    batches = [
        torch.randint(0, vocab, (3, length), generator=generator) for _ in range(accumulation * groups)
    ]
    logits = [torch.randn(3, length, vocab, generator=generator) for _ in batches]
    reference = F.cross_entropy(
        torch.cat([x[:, :-1].reshape(-1, vocab) for x in logits]),
        torch.cat([b[:, 1:].reshape(-1) for b in batches]),
    )
    from transformers.loss.loss_utils import ForCausalLMLoss

    reduced = torch.zeros(())
    for ids, scores in zip(batches, logits, strict=True):  # (micro-batch, group) pairs
        for rank in range(degree):
            shard = sequence_shard({"input_ids": ids, "labels": ids}, rank, degree)
            own = scores[:, rank * length // degree : (rank + 1) * length // degree].contiguous()
            loss = ForCausalLMLoss(
                own,
                shard["labels"],
                vocab,
                num_items_in_batch=shard["num_items_in_batch"],
                shift_labels=shard["shift_labels"],
            )
            reduced += loss / accumulation / groups
    assert torch.allclose(reduced, reference, atol=1e-6)


@pytest.mark.parametrize("kind", ["full", "chunked"])
def test_a_whole_sequence_shard_gives_the_models_own_loss(kind):
    """With labels shifted before sharding (``shift_labels``) the full and chunked losses are the
    model's mean next-token loss (one rank holding the whole sequence)."""
    model = tiny_model("llama", vocab_size=50, max_positions=32)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    reference = model(input_ids=ids, labels=ids).loss
    shard = sequence_shard({"input_ids": ids, "labels": ids}, 0, 1)
    assert torch.allclose(loss_function(kind, model)(model, shard), reference, atol=1e-6)


class _Plugin:
    def __init__(self, stage: int) -> None:
        self.zero_stage = stage
        self.deepspeed_config = {"zero_optimization": {"stage": stage}}


class _Accelerator:
    def __init__(self, stage: int) -> None:
        self.state = type("State", (), {"deepspeed_plugin": _Plugin(stage)})()


def test_zero_stage_3_is_refused_in_one_line():
    for stage in (0, 1, 2):
        check_zero_stage(_Accelerator(stage), 2)
    with pytest.raises(Exception, match="ZeRO stage 3") as refused:
        check_zero_stage(_Accelerator(3), 2)
    assert "\n" not in str(refused.value) and "allowed:" in str(refused.value)


# -- refusals through the CLI, before any model loads ----------------------------------------------
@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ulysses")
    documents = list(stdlib_documents())[:8]
    save_base_model(root, documents, vocab_size=300, max_positions=128)
    with open(root / "data.jsonl", "w") as handle:
        for document in documents[:6]:
            handle.write(json.dumps({"text": document}) + "\n")
    return root


def _refused(workspace: Path, tmp_path: Path, capsys, *extra: str) -> str:
    argv = ["train", "--model", str(workspace / "base"), "--data", str(workspace / "data.jsonl")]
    argv += ["--output-dir", str(tmp_path / "run"), "--seq-len", "32", "--max-steps", "1"]
    assert main([*argv, "--sequence-parallel", "2", *extra]) == 2
    assert not (tmp_path / "run").exists()
    return one_error(capsys)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--packing"], ["--packing", "restart"]),
        (
            ["--encoding", "rope", "--position-sampling", "pose", "--target-length", "64"],
            ["--position-sampling pose", "0, 1, 2"],
        ),
        (["--encoding", "cape"], ["'cape'", "allowed:"]),  # its MLP mixes the heads
    ],
)
def test_what_ulysses_cannot_train_exactly_is_one_line(workspace, tmp_path, capsys, extra, expected):
    line = _refused(workspace, tmp_path, capsys, "--encoding", "alibi", *extra)
    assert all(part in line for part in expected), line


def test_the_launch_is_checked_before_anything_loads(workspace, tmp_path, capsys, monkeypatch):
    """No DeepSpeed installed; installed but not a DeepSpeed launch; a launch whose process count the
    degree does not divide: each one line naming what to do."""
    monkeypatch.setattr(parallelism, "_deepspeed_installed", lambda: False)
    assert "needs DeepSpeed" in _refused(workspace, tmp_path, capsys, "--encoding", "rope")
    monkeypatch.setattr(parallelism, "_deepspeed_installed", lambda: True)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert "ulysses.yaml" in _refused(workspace, tmp_path, capsys, "--encoding", "rope")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("WORLD_SIZE", "3")
    line = _refused(workspace, tmp_path, capsys, "--encoding", "rope")
    assert "3 launched processes" in line and "multiple of 2" in line, line


# -- DeepSpeed on two CPU processes (where DeepSpeed is installed) ---------------------------------
def _launch(workspace: Path, name: str, *extra: str, zero_stage: int = 2, processes: int = 2) -> list[str]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    command += [str(ROOT / "recipes/accelerate/ulysses.yaml"), "--num_processes", str(processes)]
    command += ["--mixed_precision", "no", "--zero_stage", str(zero_stage), "-m", "hf_posenc", "train"]
    command += ["--model", str(workspace / "base"), "--data", str(workspace / "data.jsonl")]
    command += ["--output-dir", str(workspace / name), "--seq-len", "32", "--batch-size", "2"]
    return [*command, "--lr", "3e-3", "--sequence-parallel", "2", *extra]


def _environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("ACCELERATE_USE_CPU", None)
    return env


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "final" / "model.safetensors"))


#: (encoding or None for the native model, ZeRO stage, TrainConfig settings beyond the common ones)
EQUIVALENCE_CASES = [
    ("alibi", 0, {}),
    ("t5", 1, {"grad_accum": 2, "eval_every": 2}),
    ("fox", 2, {}),
    ("rope", 2, {"loss": "chunked", "grad_accum": 2}),
    (None, 2, {"gradient_checkpointing": True, "eval_every": 2}),  # DeepSpeed's own Ulysses attention
    ("alibi", 2, {"lora": True}),
]


def _flags(settings: dict) -> list[str]:
    """The hf-posenc train flags of TrainConfig settings."""
    flags = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, *map(str, value if isinstance(value, list) else [value])]
    return flags


@pytest.mark.slow
@pytest.mark.parametrize(
    ("encoding", "zero_stage", "settings"),
    EQUIVALENCE_CASES,
    ids=[f"{e or 'native'}-zero{z}-{'-'.join(s) or 'plain'}" for e, z, s in EQUIVALENCE_CASES],
)
def test_two_processes_of_one_ulysses_group_train_like_one_process(workspace, encoding, zero_stage, settings):
    """`accelerate launch --config_file recipes/accelerate/ulysses.yaml --num_processes 2 ...
    --sequence-parallel 2`: both ranks train on the same batch, each on half of every sequence with
    head-parallel attention (a native model: DeepSpeed's Ulysses attention); the per-step losses, the
    held-out losses (--eval-every: whole sequences on every rank) and the final weights are the
    one-process run's (fp32). ZeRO stages 0, 1 and 2, with and without gradient accumulation, the
    chunked loss, activation checkpointing and LoRA."""
    pytest.importorskip("deepspeed")
    name = f"{encoding or 'native'}-{zero_stage}-{'-'.join(settings)}"
    data = [str(workspace / "data.jsonl")]
    if settings.get("eval_every"):  # held-out loss: every rank evaluates whole sequences
        settings = {**settings, "eval_data": data}
    common = dict(encoding=encoding, seq_len=32, batch_size=2, max_steps=3, **settings)
    one = train(run_config(workspace, f"one-{name}", data=data, **common), progress=False)
    extra = [*(["--encoding", encoding] if encoding else []), "--max-steps", "3", *_flags(settings)]
    done = subprocess.run(
        _launch(workspace, f"two-{name}", *extra, zero_stage=zero_stage),
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("final model:") == 1  # written by the main process only
    losses = json.loads((workspace / f"two-{name}" / "final" / "losses.json").read_text())
    assert [s for s, _ in losses] == [s for s, _ in one.losses] == [1, 2, 3]
    for (_, a), (_, b) in zip(one.losses, losses, strict=True):
        assert abs(a - b) <= 1e-5, (one.losses, losses)
    if settings.get("eval_every"):
        read = lambda run: json.loads((workspace / run / "eval_losses.json").read_text())  # noqa: E731
        evaluations = read(f"one-{name}")
        assert [e["step"] for e in evaluations] == [e["step"] for e in read(f"two-{name}")] == [2, 3]
        for a, b in zip(evaluations, read(f"two-{name}"), strict=True):
            assert abs(a["eval_loss_nats"] - b["eval_loss_nats"]) <= 1e-5, (a, b)
    expected, got = _weights(workspace / f"one-{name}"), _weights(workspace / f"two-{name}")
    assert expected.keys() == got.keys()
    for key in expected:
        if expected[key].is_floating_point():
            assert torch.allclose(expected[key], got[key], atol=5e-5, rtol=0), key


@pytest.mark.slow
def test_two_ulysses_groups_of_two_processes_train_like_one_process(workspace):
    """4 processes, --sequence-parallel 2: two groups, each its own half of the global batch (the batch
    order keyed by the group), each rank half of every sequence; the one-process run with the whole
    global batch (2 x 2 blocks) gets the same losses and weights."""
    pytest.importorskip("deepspeed")
    data = [str(workspace / "data.jsonl")]
    settings = dict(encoding="alibi", seq_len=32, max_steps=3, data=data)
    one = train(run_config(workspace, "one-groups", batch_size=4, **settings), progress=False)
    extra = ["--encoding", "alibi", "--max-steps", "3"]
    done = subprocess.run(
        _launch(workspace, "four-groups", *extra, processes=4),
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    losses = json.loads((workspace / "four-groups" / "final" / "losses.json").read_text())
    assert [s for s, _ in losses] == [1, 2, 3]
    for (_, a), (_, b) in zip(one.losses, losses, strict=True):
        assert abs(a - b) <= 1e-5, (one.losses, losses)
    expected, got = _weights(workspace / "one-groups"), _weights(workspace / "four-groups")
    for key in expected:
        assert torch.allclose(expected[key], got[key], atol=5e-5, rtol=0), key


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


@pytest.mark.slow
def test_a_ulysses_run_killed_with_sigkill_resumes_bit_exactly(workspace):
    """A 2-process Ulysses run (ZeRO-2, gradient accumulation) killed with SIGKILL once its first
    checkpoint is complete, then resumed with --resume, ends with exactly the losses and weights of
    the uninterrupted run."""
    pytest.importorskip("deepspeed")
    extra = ["--encoding", "t5", "--max-steps", "6", "--save-every", "2", "--grad-accum", "2"]
    straight = subprocess.run(
        _launch(workspace, "sp-straight", *extra),
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert straight.returncode == 0, straight.stderr[-4000:]
    killed = workspace / "sp-killed"
    launcher = subprocess.Popen(
        _launch(workspace, "sp-killed", *extra),
        env=_environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while not (killed / "checkpoint-2" / "trainer_state.json").exists() and launcher.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
    finally:  # SIGKILL to the launcher and every process under it (torch's agent starts the ranks apart)
        tree = [launcher.pid, *(child.pid for child in psutil.Process(launcher.pid).children(recursive=True))]
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=60)
        psutil.wait_procs([p for p in map(_process, tree) if p is not None], timeout=60)
    if (
        killed / "final"
    ).exists():  # the run outran the kill: drop its end, as a kill after the last checkpoint
        import shutil

        shutil.rmtree(killed / "final")
    resumed = subprocess.run(
        _launch(workspace, "sp-killed", *extra, "--resume"),
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming from" in resumed.stdout
    read = lambda name: json.loads((workspace / name / "final" / "losses.json").read_text())  # noqa: E731
    assert read("sp-killed") == read("sp-straight")
    expected, got = _weights(workspace / "sp-straight"), _weights(killed)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
