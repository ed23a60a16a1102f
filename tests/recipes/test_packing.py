"""``hf-posenc train --packing``: positions restart at every document, the loss of a step is the
per-token mean over its documents computed one at a time — with gradient accumulation, after a
resume, and on 2 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from training_runs import Interrupt, interrupt_at, run_config, save_base_model

import hf_posenc
from hf_posenc.recipes.data import stdlib_documents
from hf_posenc.recipes.training import TrainConfig, train
from hf_posenc.recipes.training.batches import BatchOrder
from hf_posenc.recipes.training.corpus import TOKEN_COLUMN, TokenBlocks, training_blocks

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "accelerate"


def token_dataset(lengths: list[int], parts: int):
    """A token dataset of documents with the given lengths (token t of the stream is t), split
    into ``parts`` Arrow chunks."""
    from datasets import Dataset, Features, Sequence, Value, concatenate_datasets

    features = Features({TOKEN_COLUMN: Sequence(Value("int32"))})
    rows, start = [], 0
    for n in lengths:
        rows.append(list(range(start, start + n)))
        start += n
    cut = [round(i * len(rows) / parts) for i in range(parts + 1)]
    pieces = [
        Dataset.from_dict({TOKEN_COLUMN: rows[a:b]}, features=features) for a, b in pairwise(cut) if b > a
    ]
    return pieces[0] if len(pieces) == 1 else concatenate_datasets(pieces)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=12),
    length=st.integers(2, 9),
    parts=st.integers(1, 3),
)
def test_block_positions_restart_at_every_document_and_block(lengths, length, parts):
    """Position of token g = g minus the start of its document, or minus the block's start when
    the document began in an earlier block (a continued document starts again at 0)."""
    if sum(lengths) < length:
        return
    blocks = TokenBlocks(token_dataset(lengths, min(parts, len(lengths))), length)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for index in range(len(blocks)):
        block_start = index * length
        expected = []
        for g in range(block_start, block_start + length):
            document_start = max(s for s in starts if s <= g)
            expected.append(g - max(document_start, block_start))
        assert blocks.positions(index).tolist() == expected
        assert blocks[[index]][0].tolist() == list(range(block_start, block_start + length))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A saved tiny Llama + tokenizer and documents of very different lengths."""
    root = tmp_path_factory.mktemp("packing")
    documents = list(stdlib_documents())[:16]
    save_base_model(root, documents, vocab_size=512, max_positions=128)
    short = [" ".join(d.split()[: 3 + 5 * i]) for i, d in enumerate(documents)]  # 3 .. 78 words
    with open(root / "data.jsonl", "w") as handle:
        for document in short:
            handle.write(json.dumps({"text": document}) + "\n")
    return root


def config(workspace: Path, name: str, **overrides) -> TrainConfig:
    values = dict(
        data=[str(workspace / "data.jsonl")],
        encoding="alibi",
        seq_len=32,
        batch_size=4,
        max_steps=4,
        save_every=0,
        packing=True,
    )
    return run_config(workspace, name, **{**values, **overrides})


def per_document_loss(workspace: Path, cfg: TrainConfig) -> float:
    """Step 1's loss written from the definition: every document piece of the step's global batch
    run alone through the untrained patched model, token losses summed, divided by their count."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    blocks = training_blocks(cfg.data, tokenizer, cfg.seq_len, cache_dir=workspace / "reference-cache")
    global_batch = cfg.batch_size * cfg.grad_accum
    order = BatchOrder(blocks, global_batch, 1, 0, cfg.seed)
    model = hf_posenc.load_model(cfg.model, cfg.encoding).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for index in order.indices(0).tolist():
            ids, positions = blocks[[index]][0], blocks.positions(index).tolist()
            starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
            for a, b in pairwise(starts):
                if b - a > 1:
                    piece = ids[a:b][None]
                    total += model(input_ids=piece, labels=piece, use_cache=False).loss.item() * (b - a - 1)
                    count += b - a - 1
    return total / count


@pytest.mark.slow  # multi-second (3 short runs); CI runs it
def test_packed_step_loss_is_the_per_document_loss_with_and_without_accumulation(workspace):
    """One micro-batch of 4 and 2 accumulated micro-batches of 2 give the same losses and weights;
    step 1's loss is the per-token mean over the documents computed one at a time."""
    whole = train(config(workspace, "whole"), progress=False)
    accumulated = train(config(workspace, "accumulated", batch_size=2, grad_accum=2), progress=False)
    reference = per_document_loss(workspace, config(workspace, "whole"))
    assert abs(whole.losses[0][1] - reference) < 1e-5, (whole.losses[0], reference)
    for (step_a, a), (step_b, b) in zip(whole.losses, accumulated.losses, strict=True):
        assert step_a == step_b and abs(a - b) < 1e-5, (whole.losses, accumulated.losses)
    one = hf_posenc.from_pretrained(str(whole.final_dir)).state_dict()
    two = hf_posenc.from_pretrained(str(accumulated.final_dir)).state_dict()
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-5), key


@pytest.mark.slow  # multi-second; CI runs it
def test_packed_run_resumes_bit_exactly(workspace):
    """Killed after step 3 and resumed from checkpoint-2: the losses and weights of a straight run."""
    straight = train(config(workspace, "packed-straight", save_every=2, grad_accum=2), progress=False)
    with pytest.raises(Interrupt):
        train(
            config(workspace, "packed-killed", save_every=2, grad_accum=2),
            callbacks=[interrupt_at(3)],
            progress=False,
        )
    resumed = train(
        config(workspace, "packed-killed", save_every=2, grad_accum=2), resume=True, progress=False
    )
    assert resumed.losses == straight.losses
    expected = hf_posenc.from_pretrained(str(straight.final_dir)).state_dict()
    got = hf_posenc.from_pretrained(str(resumed.final_dir)).state_dict()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


@pytest.mark.slow  # multi-second (process launches, full runs): CI runs it
@pytest.mark.parametrize("loss", ["full", "chunked"])
def test_two_processes_pack_like_one(workspace, loss):
    """`accelerate launch --num_processes 2 ... --packing` with half the per-process batch: the
    1-process losses (labels counted over both processes' blocks); with --loss chunked too (the
    LM head's weight is used after the DDP forward, and its gradient is still reduced)."""
    one = train(config(workspace, f"packed-one-{loss}", loss=loss), progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ACCELERATE_USE_CPU", None)
    output = workspace / f"packed-two-{loss}"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    command += [str(RECIPES / "cpu_2proc.yaml"), "--num_processes", "2", "-m", "hf_posenc", "train"]
    command += ["--model", str(workspace / "base"), "--output-dir", str(output)]
    command += ["--data", str(workspace / "data.jsonl"), "--encoding", "alibi", "--seq-len", "32"]
    command += ["--batch-size", "2", "--max-steps", "4", "--lr", "3e-3", "--packing", "--loss", loss]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    losses = json.loads((output / "final" / "losses.json").read_text())
    assert len(losses) == len(one.losses) == 4
    for (step_a, a), (step_b, b) in zip(one.losses, losses, strict=True):
        assert step_a == step_b and abs(a - b) < 1e-4, (one.losses, losses)


def test_cli_packing_reaches_the_config():
    from hf_posenc.recipes.cli import build_parser
    from hf_posenc.recipes.cli.train import config_from_args

    args = build_parser().parse_args(["train", "--model", "m", "--output-dir", "o", "--packing"])
    assert config_from_args(args).packing is True
    args = build_parser().parse_args(["train", "--model", "m", "--output-dir", "o"])
    assert config_from_args(args).packing is False


@pytest.mark.slow  # a few seconds: three modes of training steps; CI runs it
def test_packing_throughput_benchmark_runs_on_a_tiny_model(workspace, capsys):
    """The lead's throughput command runs end to end and reports the three modes and their ratios."""
    from hf_posenc.recipes.benchmark import packing

    argv = [
        "--model",
        str(workspace / "base"),
        "--data",
        str(workspace / "data.jsonl"),
        "--encoding",
        "alibi",
    ]
    argv += [
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--steps",
        "2",
        "--cache-dir",
        str(workspace / "bench-cache"),
    ]
    assert packing.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [json.loads(line) for line in lines[:3]]
    assert [row["mode"] for row in rows] == ["blocks", "packing", "padding"]
    assert all(row["steps"] == 2 and row["real_tokens_per_s"] > 0 for row in rows)
    assert lines[3].startswith("packing/padding ")


@pytest.mark.slow  # multi-second (2 short runs); CI runs it
def test_chunked_loss_trains_like_the_full_loss(workspace):
    """--loss chunked (no (tokens x vocabulary) logits) follows --loss full's trajectory, packed."""
    from hf_posenc.recipes.training import loss as loss_module

    full = train(config(workspace, "loss-full", grad_accum=2, batch_size=2), progress=False)
    small_chunks = pytest.MonkeyPatch()
    small_chunks.setattr(loss_module, "CHUNK_ELEMENTS", 5 * 512)  # 5 tokens of the 512-token vocabulary
    try:
        chunked = train(
            config(workspace, "loss-chunked", grad_accum=2, batch_size=2, loss="chunked"), progress=False
        )
    finally:
        small_chunks.undo()
    for (step_a, a), (step_b, b) in zip(full.losses, chunked.losses, strict=True):
        assert step_a == step_b and abs(a - b) < 1e-5, (full.losses, chunked.losses)


@pytest.mark.slow  # multi-second; CI runs it
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "blocks"])
@pytest.mark.parametrize("sampling", ["pose", "randomized"])
def test_a_run_with_position_sampling_resumes_bit_exactly(workspace, sampling, packing):
    """--position-sampling, with and without --packing: killed after step 3, resumed from checkpoint-2, the
    losses and weights of a straight run (the sampled ids depend on seed and sequence index only)."""
    settings = dict(
        save_every=2, encoding="rope", position_sampling=sampling, target_length=96, packing=packing
    )
    name = f"{sampling}-{'packed' if packing else 'blocks'}"
    straight = train(config(workspace, f"{name}-straight", **settings), progress=False)
    with pytest.raises(Interrupt):
        train(config(workspace, f"{name}-killed", **settings), callbacks=[interrupt_at(3)], progress=False)
    resumed = train(config(workspace, f"{name}-killed", **settings), resume=True, progress=False)
    assert resumed.losses == straight.losses
    plain = train(config(workspace, f"{name}-none", encoding="rope", packing=packing), progress=False)
    assert plain.losses[0] != straight.losses[0]  # the sampled ids reach the model
    expected = hf_posenc.from_pretrained(str(straight.final_dir)).state_dict()
    got = hf_posenc.from_pretrained(str(resumed.final_dir)).state_dict()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
