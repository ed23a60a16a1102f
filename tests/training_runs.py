"""Shared test helper for the training tests: a saved tiny Llama with a BPE tokenizer trained on
local text (nothing downloaded), a :class:`TrainConfig` of a run on it, and a step callback that
kills a run between steps (as a crash or Ctrl-C would)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.tokenizer import train_bpe_tokenizer
from hf_posenc.recipes.training import TrainConfig


def save_base_model(root: Path, documents: Sequence[str], *, vocab_size: int, max_positions: int) -> Path:
    """A tiny Llama and a BPE tokenizer trained on ``documents``, saved together in ``root/base``."""
    tokenizer = train_bpe_tokenizer(list(documents), vocab_size=vocab_size)
    model = tiny_model("llama", vocab_size=len(tokenizer), max_positions=max_positions)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    return root / "base"


def base_workspace(root: Path, *, max_positions: int = 64) -> Path:
    """``root`` with a saved tiny Llama and tokenizer in ``root/base`` (vocabulary 400, trained on
    ten standard-library documents) and six of them in ``root/data.txt``."""
    from hf_posenc.recipes.data import stdlib_documents

    documents = list(stdlib_documents())[:10]
    save_base_model(root, documents, vocab_size=400, max_positions=max_positions)
    (root / "data.txt").write_text("\n\n".join(documents[:6]))
    return root


def train_argv(workspace: Path, model: str, output: Path, *extra: str) -> list[str]:
    """``hf-posenc train`` of ``workspace/model`` on ``workspace/data.txt`` into ``output``: one
    step of two 32-token sequences, then ``extra``."""
    argv = ["train", "--model", str(workspace / model), "--output-dir", str(output)]
    argv += [
        "--data",
        str(workspace / "data.txt"),
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--max-steps",
        "1",
    ]
    return [*argv, *extra]


def perplexity_argv(workspace: Path, model: str, output: Path, *extra: str) -> list[str]:
    """``hf-posenc perplexity`` of ``workspace/model`` on 256 tokens of ``workspace/data.txt`` at
    1x and 2x a 16-token training length, into ``output``, then ``extra``."""
    argv = ["perplexity", "--model", str(workspace / model), "--data", str(workspace / "data.txt")]
    argv += ["--train-length", "16", "--multiples", "1", "2", "--max-tokens", "256", "--output", str(output)]
    return [*argv, *extra]


def error_lines(err: str) -> list[str]:
    """The ``error:`` lines of a command's standard error."""
    return [line for line in err.splitlines() if "error:" in line]


def run_config(workspace: Path, name: str, **values: Any) -> TrainConfig:
    """A run of ``workspace/base`` (unless ``values`` name another ``model``) into ``workspace/name``:
    quiet logging, a learning rate that moves a tiny model within a few steps, and ``values``
    (data, encoding, lengths, steps, ...)."""
    base = {
        "model": str(workspace / "base"),
        "output_dir": str(workspace / name),
        "log_every": 100,
        "lr": 3e-3,
    }
    return TrainConfig(**{**base, **values})


class Interrupt(Exception):
    """A run killed between steps (raised by :func:`interrupt_at`)."""


def interrupt_at(step_to_fail: int) -> Callable[[int, dict[str, float]], None]:
    """A step callback raising :class:`Interrupt` once step ``step_to_fail`` is done."""

    def callback(step: int, logs: dict[str, float]) -> None:
        if step == step_to_fail:
            raise Interrupt(f"killed at step {step}")

    return callback


def one_error(capsys) -> str:
    """The one error line a refused command printed (and no traceback, no model loaded)."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert "Traceback" not in err and "Loading weights" not in err, err  # no model was loaded
    return errors[0]
