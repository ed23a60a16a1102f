"""Validation loss during training: ``--eval-every N`` on held-out text.

Every N optimizer steps the model's mean next-token loss (nats) on a fixed set of held-out
``seq_len`` blocks — the first ``eval_tokens`` tokens of ``--eval-data`` (default: the
``validation`` split of ``--data`` where the source has splits) — is printed, logged to the same
accelerate trackers as the training loss (``eval_loss``), and appended to ``OUTPUT/eval_losses.json``.
Every process evaluates the same blocks (a DDP forward is a collective), under ``torch.no_grad``
in eval mode; the training mode is restored afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...errors import InvalidParameterError

if TYPE_CHECKING:  # config.py asks this module for its check: a type only, no import circle
    from .config import TrainConfig


def check_validation(config: TrainConfig) -> None:
    """``--eval-every`` needs held-out text: ``--eval-data``, or sources that have a validation split."""
    if not config.eval_every:
        return
    from ..data import is_local

    # (a local file is one text: it has no validation split)
    if config.eval_data is None and any(is_local(s) for s in config.data):
        raise InvalidParameterError(
            f"train: --eval-every {config.eval_every} needs held-out text; allowed: --eval-data SRC, or --data "
            "sources with a validation split (builtin:stdlib, hf:NAME); local files have none"
        )


def eval_blocks(config: TrainConfig, tokenizer: Any):
    """The held-out ``(blocks, seq_len)`` token tensor every evaluation reads."""
    from ..data import read_documents, tokenize_documents

    sources = config.eval_data or config.data
    split = config.eval_split if config.eval_data is None else config.split
    documents = read_documents(sources, text_field=config.text_field, split=split)
    tokens = tokenize_documents(documents, tokenizer, max_tokens=max(config.eval_tokens, config.seq_len))
    count = max(1, min(tokens.numel(), config.eval_tokens) // config.seq_len)
    if tokens.numel() < config.seq_len:
        raise InvalidParameterError(
            f"train: the held-out text has {tokens.numel()} tokens, fewer than one --seq-len block "
            f"({config.seq_len}); give more --eval-data"
        )
    return tokens[: count * config.seq_len].view(count, config.seq_len)


def validation_callback(run: Any, tokenizer: Any) -> Callable[[int, dict[str, float]], None]:
    """A step callback of :func:`hf_posenc.recipes.training.train` that evaluates every ``eval_every`` steps."""
    import torch

    from .ulysses import whole_sequences

    config: TrainConfig = run.config
    blocks = eval_blocks(config, tokenizer)
    history: list[dict[str, Any]] = []
    path = run.output_dir / "eval_losses.json"
    if path.is_file():  # a resumed run keeps the evaluations it made
        history = json.loads(path.read_text())

    def evaluate(step: int, logs: dict[str, float]) -> None:
        if step % config.eval_every and step != config.max_steps:
            return
        model = run.model
        was_training = model.training
        model.eval()
        total = 0.0
        try:
            with torch.no_grad(), whole_sequences(run.accelerator, model, run.head_parallel_group):
                device = run.accelerator.device
                for start in range(0, blocks.shape[0], config.batch_size):
                    batch = blocks[start : start + config.batch_size].to(device)  # (B, seq_len)
                    loss = model(input_ids=batch, labels=batch).loss  # mean over B * (seq_len - 1)
                    total += loss.float().item() * batch.shape[0]
        finally:
            model.train(was_training)
        value = total / blocks.shape[0]
        record = {
            "step": step,
            "eval_loss_nats": value,
            "blocks": int(blocks.shape[0]),
            "seq_len": config.seq_len,
        }
        history[:] = [h for h in history if h["step"] < step] + [record]
        if config.report_to:
            run.accelerator.log({"eval_loss": value}, step=step)
        if run.accelerator.is_main_process:
            path.write_text(json.dumps(history, indent=2) + "\n")
            print(
                f"step {step}: eval_loss {value:.4f} nats ({blocks.shape[0]} held-out blocks of {config.seq_len})",
                flush=True,
            )

    return evaluate
