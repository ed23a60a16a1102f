"""Continued pretraining of a (patched) causal LM with accelerate.

Works on one CPU, and under ``accelerate launch`` on N processes (DDP, FSDP): each process
takes its slice of the same global batch (see :mod:`.batches`), so a 2-process run with
half the per-process batch follows the same trajectory as one process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data import check_sources, pack_blocks, read_documents, tokenize_documents
from ..errors import InvalidParameterError
from ..limits import position_limit
from ..loading import load_model
from ..patch import patch_info, patch_model
from .batches import BatchOrder
from .checkpoints import latest_checkpoint, read_state, save_checkpoint
from .config import TrainConfig
from .lora import apply_lora, merge_lora

StepCallback = Callable[[int, dict[str, float]], None]
#: settings a resumed run must share with the run it continues
RESUME_KEYS = (
    "data",
    "seq_len",
    "batch_size",
    "grad_accum",
    "seed",
    "max_steps",
    "encoding",
    "lora",
    "model",
)


@dataclasses.dataclass
class TrainResult:
    final_dir: Path
    steps: int
    losses: list[tuple[int, float]]


def check_output_dir(output_dir: Path, resume: bool) -> None:
    """Create ``output_dir`` if needed and refuse to overwrite another run's checkpoints."""
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"output path {str(output_dir)!r} exists and is not a directory")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise PermissionError(f"output directory {str(output_dir)!r} is not writable: {error}") from error
    if not resume and latest_checkpoint(output_dir) is not None:
        raise InvalidParameterError(
            f"{str(output_dir)!r} already holds checkpoints of a run; pass --resume to continue it, "
            "or choose another --output-dir (nothing is overwritten)"
        )


def _schedule(config: TrainConfig) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to ``end_lr_ratio`` of the peak (the ExPE paper's schedule)."""
    warmup = int(config.warmup_ratio * config.max_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, config.max_steps - warmup))
        return config.end_lr_ratio + (1 - config.end_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _is_encoding_parameter(name: str) -> bool:
    return name.startswith("posenc.") or ".posenc." in name  # also under a peft wrapper


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only; the encoding's parameters at ``encoding_lr``, no decay."""
    decay, no_decay, own = [], [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if _is_encoding_parameter(name):
            own.append(parameter)
        elif parameter.dim() >= 2:
            decay.append(parameter)
        else:
            no_decay.append(parameter)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": own, "weight_decay": 0.0, "lr": config.encoding_lr or config.lr},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=config.lr, betas=(config.beta1, config.beta2)
    )


def _check_positions(model: nn.Module, seq_len: int) -> None:
    limit = position_limit(model)
    if limit is not None and seq_len > limit[0]:
        raise InvalidParameterError(
            f"seq_len={seq_len} is longer than {limit[1].format(limit[0])}; "
            "lower --seq-len or patch with an encoding (or max_positions) that allows it"
        )


def prepare_model(config: TrainConfig, model: nn.Module | None) -> nn.Module:
    dtype = getattr(torch, config.dtype)
    if model is None:
        return load_model(config.model, config.encoding, config.encoding_params or None, dtype=dtype)
    if config.encoding and patch_info(model) is None:
        patch_model(model, config.encoding, **config.encoding_params)
    return model.to(dtype)


def train(
    config: TrainConfig,
    *,
    model: nn.Module | None = None,
    tokenizer: Any = None,
    resume: bool = False,
    callbacks: Sequence[StepCallback] = (),
    progress: bool = True,
) -> TrainResult:
    """Run (or ``resume``) continued pretraining; returns where the final model was saved."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    output_dir = Path(config.output_dir)
    check_output_dir(output_dir, resume)
    check_sources(config.data)
    if resume:
        checkpoint = latest_checkpoint(output_dir)
        if checkpoint is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {str(output_dir)!r}")
        saved = read_state(checkpoint)["config"]
        changed = [k for k in RESUME_KEYS if saved.get(k) != getattr(config, k)]
        if changed:
            raise InvalidParameterError(
                "--resume: settings differ from the interrupted run: "
                + ", ".join(f"{k}={getattr(config, k)!r} (was {saved.get(k)!r})" for k in changed)
            )

    accelerator = Accelerator(
        gradient_accumulation_steps=config.grad_accum, mixed_precision=config.mixed_precision
    )
    set_seed(config.seed)
    model = prepare_model(config, model)
    _check_positions(model, config.seq_len)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)

    documents = read_documents(
        config.data, text_field=config.text_field, split=config.split, limit=config.max_documents
    )
    blocks = pack_blocks(tokenize_documents(documents, tokenizer), config.seq_len)
    order = BatchOrder(
        blocks, config.batch_size, accelerator.num_processes, accelerator.process_index, config.seed
    )

    if config.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if config.lora:
        model = apply_lora(
            model,
            r=config.lora_r,
            alpha=config.lora_alpha,
            dropout=config.lora_dropout,
            targets=config.lora_targets,
        )
    model.train()
    optimizer = _optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
    # the scheduler is stepped by hand, once per optimizer step, whatever the process count
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)

    start, losses = 0, []
    if resume:
        accelerator.load_state(str(checkpoint))
        state = read_state(checkpoint)
        start, losses = state["step"], [tuple(x) for x in state["losses"]]
    if accelerator.is_main_process:
        (output_dir / "train_config.json").write_text(config.to_json())

    bar = tqdm(
        total=config.max_steps,
        initial=start,
        desc="train",
        disable=not (progress and accelerator.is_main_process),
    )
    for step in range(start, config.max_steps):
        step_loss = torch.zeros((), device=accelerator.device)
        for micro in range(config.grad_accum):
            batch = order.micro_batch(step * config.grad_accum + micro).to(accelerator.device)
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and config.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            step_loss += loss.detach() / config.grad_accum
        scheduler.step()
        mean_loss = accelerator.gather(step_loss[None]).mean().item()
        losses.append((step + 1, mean_loss))
        logs = {"loss": mean_loss, "lr": scheduler.get_last_lr()[0]}
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.4f}")
        if accelerator.is_main_process and (step + 1) % config.log_every == 0:
            bar.write(json.dumps({"step": step + 1, **logs}))
        if config.save_every and (step + 1) % config.save_every == 0 and step + 1 < config.max_steps:
            state = {"step": step + 1, "losses": losses, "config": dataclasses.asdict(config)}
            save_checkpoint(accelerator, output_dir, step + 1, state, config.keep_checkpoints)
        for callback in callbacks:
            callback(step + 1, logs)
    bar.close()

    final_dir = output_dir / "final"
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final = accelerator.unwrap_model(model)
        if config.lora:
            final = merge_lora(final)
        partial = output_dir / "final.tmp"
        final.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / "losses.json").write_text(json.dumps(losses))
        if final_dir.exists():
            os.replace(final_dir, output_dir / "final.old")
        os.replace(partial, final_dir)
        old = output_dir / "final.old"
        if old.exists():
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return TrainResult(final_dir=final_dir, steps=config.max_steps, losses=losses)
