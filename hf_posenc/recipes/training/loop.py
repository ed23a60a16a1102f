"""Continued pretraining of a (patched) causal LM with accelerate.

Works on one CPU, and under ``accelerate launch`` on N processes (DDP, FSDP): each process
takes its slice of the same global batch (see :mod:`.batches`), so a 2-process run with
half the per-process batch follows the same trajectory as one process. Under DeepSpeed Ulysses
(``--sequence-parallel N``) each group of N processes takes one slice and splits its sequences
(:mod:`.ulysses`).

This module holds the steps (micro-batches, optimizer step, loss record, checkpoints, the final
model); the model, optimizer and schedule are set up in :mod:`.model_setup`, the accelerator,
output folder and resume point in :mod:`.world`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...core.patch import patch_info
from .. import run_lock
from ..threads import use_threads
from .batches import BatchOrder
from .checkpoints import save_checkpoint
from .config import TrainConfig, preflight
from .corpus import run_blocks
from .feed import Feed
from .guards import TrainingError, check_finite_loss, check_finite_weights
from .interrupt import StopRequest
from .lora import merge_lora
from .loss import LossFunction, loss_function
from .model_setup import prepare_for_accelerate, trainable_model
from .outputs import write_final
from .parallelism import context_parallel_shards, launch_degrees
from .ulysses import check_zero_stage, configure_deepspeed, enable_sequence_parallel, ulysses_layout
from .world import check_resumed_data, data_fingerprint, open_accelerator, restore_state, resume_point

StepCallback = Callable[[int, dict[str, float]], None]


@dataclasses.dataclass
class TrainResult:
    final_dir: Path
    steps: int
    losses: list[tuple[int, float]]
    is_main_process: bool = True


def _tracker_config(config: TrainConfig) -> dict[str, Any]:
    """The config with lists and dicts as JSON text (trackers take scalars only)."""
    return {
        k: v if v is None or isinstance(v, (bool, int, float, str)) else json.dumps(v)
        for k, v in dataclasses.asdict(config).items()
    }


@dataclasses.dataclass
class _Run:
    """What the steps of one run share: the accelerator, the prepared objects and the history."""

    config: TrainConfig
    output_dir: Path
    accelerator: Any
    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    feed: Feed
    losses: list[tuple[int, float]]
    loss: LossFunction
    bar: Any = None
    sequence_parallel: int = 1  # Ulysses degree: each rank's loss is a part of its group's
    head_parallel_group: Any = None  # DeepSpeed's sequence-parallel group a patched model attends over


def _load_blocks(config: TrainConfig, tokenizer: Any, accelerator, output_dir: Path):
    """Tokenised training blocks (the main process tokenises first, the others reuse its cache)."""
    with accelerator.main_process_first():
        return run_blocks(config, tokenizer, output_dir)


def _save(run: _Run, step: int) -> None:
    check_finite_weights(run.accelerator, run.model, step)
    state = {
        "step": step,
        "losses": run.losses,
        "config": dataclasses.asdict(run.config),
        "data": data_fingerprint(run.feed.blocks),  # what the steps trained on: checked on resume
    }
    path = save_checkpoint(run.accelerator, run.output_dir, step, state, run.config.keep_checkpoints)
    if run.accelerator.is_main_process:
        run.bar.write(f"[train] checkpoint {path}")


def _optimizer_step(run: _Run, step: int) -> float:
    """One optimizer step over ``grad_accum`` micro-batches; the loss averaged over processes."""
    config, accelerator, model = run.config, run.accelerator, run.model
    step_loss = torch.zeros((), device=accelerator.device)
    for micro in range(config.grad_accum):
        inputs = run.feed.inputs(step * config.grad_accum + micro, accelerator.device)
        with accelerator.accumulate(model), context_parallel_shards(accelerator, inputs):
            loss = run.loss(model, inputs)
            accelerator.backward(loss)
            if accelerator.sync_gradients and config.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            run.optimizer.step()
            run.optimizer.zero_grad()
        step_loss += loss.detach() / config.grad_accum
    run.scheduler.step()
    losses = accelerator.gather(step_loss[None])  # (processes,)
    if run.sequence_parallel > 1:  # the ranks of a group hold parts of one loss: sum them (ulysses.py)
        return (losses.sum() / (losses.numel() // run.sequence_parallel)).item()
    return losses.mean().item()


def _record_step(run: _Run, step: int, mean_loss: float) -> dict[str, float]:
    """Check and keep the loss, update the bar, log (console every log_every, trackers every step)."""
    check_finite_loss(mean_loss, step)
    run.losses.append((step, mean_loss))
    logs = {"loss": mean_loss, "lr": float(run.scheduler.get_last_lr()[0])}
    run.bar.update(1)
    run.bar.set_postfix(loss=f"{mean_loss:.4f}")
    if run.accelerator.is_main_process and step % run.config.log_every == 0:
        run.bar.write(json.dumps({"step": step, **logs}))
    if run.config.report_to:
        run.accelerator.log(logs, step=step)
    return logs


def _checkpoint_if_due(run: _Run, step: int, stop: StopRequest) -> None:
    """Save on a stop request (then stop) or every save_every steps; never after the last step."""
    config = run.config
    if stop.requested and step < config.max_steps:
        _save(run, step)
        raise KeyboardInterrupt(f"interrupted after step {step}; checkpoint saved")
    if config.save_every and step % config.save_every == 0 and step < config.max_steps:
        _save(run, step)


def _run_steps(run: _Run, start: int, callbacks: Sequence[StepCallback]) -> None:
    """Steps ``start+1 .. max_steps``; a collective that times out becomes one TrainingError."""
    config = run.config
    try:
        with StopRequest(enabled=run.accelerator.num_processes == 1) as stop:
            for step in range(start, config.max_steps):
                logs = _record_step(run, step + 1, _optimizer_step(run, step))
                _checkpoint_if_due(run, step + 1, stop)
                for callback in callbacks:
                    callback(step + 1, logs)
    except RuntimeError as error:
        if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
            raise
        raise TrainingError(
            f"another process did not answer within --ddp-timeout {config.ddp_timeout} s (stuck or dead); "
            f"stopped at step {len(run.losses)}, the last checkpoint is the resume point "
            f"({str(error).splitlines()[0][-120:]})"
        ) from error
    finally:
        run.bar.close()  # an error message starts on its own line


def _write_final_model(run: _Run, tokenizer: Any, blocks: Any) -> Path:
    """Gather the (possibly sharded) weights on every process; the main process writes final/."""
    config, accelerator = run.config, run.accelerator
    check_finite_weights(accelerator, run.model, config.max_steps)
    final_dir = run.output_dir / "final"
    accelerator.wait_for_everyone()
    # every process takes part in gathering a sharded (FSDP) state dict; the main one writes it
    state_dict = None if config.lora else accelerator.get_state_dict(run.model)
    if accelerator.is_main_process:
        final = accelerator.unwrap_model(run.model)
        if config.lora:
            final = merge_lora(final)
        write_final(
            final,
            tokenizer,
            run.output_dir,
            config,
            run.losses,
            blocks,
            accelerator.num_processes,
            state_dict,
        )
    accelerator.wait_for_everyone()
    return final_dir


def train(
    config: TrainConfig,
    *,
    model: nn.Module | None = None,
    tokenizer: Any = None,
    resume: bool = False,
    overwrite: bool = False,
    callbacks: Sequence[StepCallback] = (),
    progress: bool = True,
) -> TrainResult:
    """Run (or ``resume``) continued pretraining; returns where the final model was saved.

    Raises before loading anything on a bad path, data source, encoding or parameter, on an
    existing run (unless ``resume`` or ``overwrite``), and on a launch whose processes do not
    form one world. A non-finite loss stops training with :class:`TrainingError` and no final/.
    """
    output_dir = Path(config.output_dir)
    preflight(config, model=model, tokenizer=tokenizer)
    accelerator = open_accelerator(config, output_dir, resume=resume, overwrite=overwrite)
    try:
        return _train_held(config, accelerator, output_dir, model, tokenizer, resume, callbacks, progress)
    finally:
        if accelerator.is_main_process:
            run_lock.release(output_dir)


def _train_held(
    config: TrainConfig,
    accelerator,
    output_dir: Path,
    model: nn.Module | None,
    tokenizer: Any,
    resume: bool,
    callbacks: Sequence[StepCallback],
    progress: bool,
) -> TrainResult:
    """:func:`train` once the output folder is held: resume point, data, model, steps, final model."""
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    sequence_parallel = launch_degrees(config.context_parallel, config.sequence_parallel)[1]
    if sequence_parallel > 1:
        check_zero_stage(accelerator, sequence_parallel)
    checkpoint = resume_point(config, accelerator, output_dir) if resume else None
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    blocks = _load_blocks(config, tokenizer, accelerator, output_dir)
    if checkpoint is not None:
        check_resumed_data(checkpoint, data_fingerprint(blocks))  # before the model loads
    # under Ulysses the batch order is the data-parallel group's: its ranks share each batch
    groups, group, shard = (
        ulysses_layout(accelerator.process_index, accelerator.num_processes, sequence_parallel)
        if sequence_parallel > 1
        else (accelerator.num_processes, accelerator.process_index, 0)
    )
    order = BatchOrder(blocks, config.batch_size, groups, group, config.seed)
    set_seed(config.seed)
    model = trainable_model(config, model)
    if sequence_parallel > 1:
        configure_deepspeed(accelerator, config, model, patched=patch_info(model) is not None)
    model, optimizer, scheduler = prepare_for_accelerate(config, model, accelerator)
    head_parallel_group = (
        enable_sequence_parallel(accelerator, model, sequence_parallel) if sequence_parallel > 1 else None
    )
    use_threads(config.threads, model)
    start, losses = restore_state(accelerator, checkpoint) if checkpoint is not None else (0, [])
    if accelerator.is_main_process:
        (output_dir / "train_config.json").write_text(config.to_json())
    if config.report_to:
        accelerator.init_trackers("hf-posenc", config=_tracker_config(config))
    feed = Feed(
        blocks,
        order,
        packing=config.packing,
        grad_accum=config.grad_accum,
        sampling=config.position_sampling,
        target_length=config.target_length,
        seed=config.seed,
        shard=(shard, sequence_parallel) if sequence_parallel > 1 else None,
    )
    loss = loss_function(config.loss, accelerator.unwrap_model(model))
    run = _Run(config, output_dir, accelerator, model, optimizer, scheduler, feed, losses, loss)
    run.sequence_parallel, run.head_parallel_group = sequence_parallel, head_parallel_group
    run.bar = tqdm(
        total=config.max_steps,
        initial=start,
        desc="train",
        disable=not (progress and accelerator.is_main_process),
    )
    if config.eval_every:
        from .validation import validation_callback

        callbacks = [*callbacks, validation_callback(run, tokenizer)]
    _run_steps(run, start, callbacks)
    final_dir = _write_final_model(run, tokenizer, blocks)
    if config.report_to:
        accelerator.end_training()
    return TrainResult(final_dir, config.max_steps, run.losses, accelerator.is_main_process)
