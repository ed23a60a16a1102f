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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ...core.limits import position_limit
from ...core.loading import load_model
from ...core.patch import patch_info, patch_model
from ...errors import InvalidParameterError
from .. import run_lock
from ..threads import use_threads
from .batches import BatchOrder
from .checkpoints import intact_checkpoint, read_state, save_checkpoint
from .config import TrainConfig, preflight
from .corpus import training_blocks
from .feed import Feed
from .guards import (
    TrainingError,
    check_finite_loss,
    check_finite_weights,
    check_output_dir,
    check_world,
    launch_notes,
    resume_differences,
    use_cpu_for_a_gpu_launch,
)
from .interrupt import StopRequest
from .lora import apply_lora, merge_lora
from .loss import LossFunction, loss_function
from .outputs import write_final
from .parallelism import context_parallel_shards, engine_refusal, launch_degrees, model_forms
from .sampling import check_encoding_reads_positions

StepCallback = Callable[[int, dict[str, float]], None]

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclasses.dataclass
class TrainResult:
    final_dir: Path
    steps: int
    losses: list[tuple[int, float]]
    is_main_process: bool = True


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


def prepare_model(config: TrainConfig, model: nn.Module | None) -> PreTrainedModel:
    """The causal LM to train (training needs a transformers model: loaded, or the caller's)."""
    dtype = getattr(torch, config.dtype)
    if model is None:
        return load_model(config.model, config.encoding, config.encoding_params or None, dtype=dtype)
    if config.encoding and patch_info(model) is None:
        patch_model(model, config.encoding, **config.encoding_params)
    return cast("PreTrainedModel", model.to(dtype))


def _tracker_config(config: TrainConfig) -> dict[str, Any]:
    """The config with lists and dicts as JSON text (trackers take scalars only)."""
    return {
        k: v if v is None or isinstance(v, (bool, int, float, str)) else json.dumps(v)
        for k, v in dataclasses.asdict(config).items()
    }


def _accelerator(config: TrainConfig, output_dir: Path):
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from .parallelism import parallelism_config

    # the world size from the launcher's environment: asking accelerate's state would start the
    # process group before the Accelerator below, without its timeout
    sequence_engine = parallelism_config(
        *launch_degrees(config.context_parallel, config.sequence_parallel),
        int(os.environ.get("WORLD_SIZE", "1")),
    )
    return Accelerator(
        parallelism_config=sequence_engine,
        gradient_accumulation_steps=config.grad_accum,
        mixed_precision=config.mixed_precision,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=config.ddp_timeout))],
        log_with=list(config.report_to) or None,
        project_dir=str(output_dir),
    )


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


def _open_accelerator(config: TrainConfig, output_dir: Path, *, resume: bool, overwrite: bool):
    """The accelerator of one world of processes, after the output directory is checked."""
    on_cpu = use_cpu_for_a_gpu_launch()
    accelerator = _accelerator(config, output_dir)
    check_world(accelerator)
    if accelerator.is_main_process:
        for note in launch_notes(accelerator, on_cpu):
            print(note)
    _hold_output_dir(accelerator, output_dir)  # before --overwrite may remove anything
    check_output_dir(output_dir, resume=resume, overwrite=overwrite, is_main=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    return accelerator


def _hold_output_dir(accelerator, output_dir: Path) -> None:
    """The main process takes the output folder's lock; every process of the launch raises the
    same one-line :class:`FolderInUseError` when another run holds it."""
    refusal = None
    if accelerator.is_main_process:
        try:
            run_lock.acquire(output_dir, "train run")
        except run_lock.FolderInUseError as error:
            refusal = str(error)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        refusal = broadcast_object_list([refusal])[0]
    if refusal is not None:
        raise run_lock.FolderInUseError(refusal)


def _resume_point(config: TrainConfig, accelerator, output_dir: Path) -> Path:
    """The newest intact checkpoint of the run in ``output_dir``, whose settings must be ours."""
    warn = print if accelerator.is_main_process else (lambda _: None)
    checkpoint = intact_checkpoint(output_dir, warn=warn)
    if checkpoint is None:
        raise FileNotFoundError(
            f"--resume: no complete checkpoint (none intact) in {str(output_dir)!r}; each damaged one is named "
            "above: restore it from a copy, or start the run again with --overwrite"
        )
    changed = resume_differences(read_state(checkpoint)["config"], dataclasses.asdict(config))
    if changed:
        raise InvalidParameterError(
            f"--resume: settings differ from the run in {str(output_dir)!r}: " + ", ".join(changed)
        )
    return checkpoint


def _load_blocks(config: TrainConfig, tokenizer: Any, accelerator, output_dir: Path):
    """Tokenised training blocks (the main process tokenises first, the others reuse its cache)."""
    with accelerator.main_process_first():
        return training_blocks(
            config.data,
            tokenizer,
            config.seq_len,
            text_field=config.text_field,
            split=config.split,
            limit=config.max_documents,
            cache_dir=config.data_cache or output_dir / "data-cache",
            num_proc=config.num_proc,
        )


def _trainable_model(config: TrainConfig, model: nn.Module | None) -> nn.Module:
    """The model loaded or patched, checked against seq_len, with checkpointing/LoRA, in train mode."""
    model = prepare_model(config, model)  # the data is ready (or its error known) before the model loads
    _check_positions(model, max(config.seq_len, config.target_length or 0))
    check_encoding_reads_positions(config.position_sampling, getattr(model, "posenc", None))
    cp, sp = launch_degrees(config.context_parallel, config.sequence_parallel)
    if cp > 1 or sp > 1:  # the loaded model's own encodings (a checkpoint's native scaling included)
        engine = "context_parallel" if cp > 1 else "sequence_parallel"
        refusal = engine_refusal(engine, model_forms(model))
        if refusal:
            raise InvalidParameterError(refusal)
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
    return model


def _prepared(config: TrainConfig, model: nn.Module, accelerator):
    """Model and optimizer wrapped by accelerate; the scheduler registered for checkpoints."""
    optimizer = _optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
    # the scheduler is stepped by hand, once per optimizer step, whatever the process count
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    return model, optimizer, scheduler


def _restore(accelerator, checkpoint: Path) -> tuple[int, list[tuple[int, float]]]:
    """Load model, optimizer, scheduler and RNG states; the step and loss history to go on from."""
    try:
        accelerator.load_state(str(checkpoint))
    except Exception as error:  # a file that passed its checksum but does not load
        raise InvalidParameterError(f"--resume: cannot load {checkpoint}: {error}") from error
    state = read_state(checkpoint)
    if accelerator.is_main_process:
        print(f"[train] resuming from {checkpoint} (step {state['step']})")
    return state["step"], [tuple(x) for x in state["losses"]]


def _save(run: _Run, step: int) -> None:
    check_finite_weights(run.accelerator, run.model, step)
    state = {"step": step, "losses": run.losses, "config": dataclasses.asdict(run.config)}
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
    return accelerator.gather(step_loss[None]).mean().item()


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
    accelerator = _open_accelerator(config, output_dir, resume=resume, overwrite=overwrite)
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

    checkpoint = _resume_point(config, accelerator, output_dir) if resume else None
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    blocks = _load_blocks(config, tokenizer, accelerator, output_dir)
    order = BatchOrder(
        blocks, config.batch_size, accelerator.num_processes, accelerator.process_index, config.seed
    )
    set_seed(config.seed)
    model, optimizer, scheduler = _prepared(config, _trainable_model(config, model), accelerator)
    use_threads(config.threads, model)
    start, losses = _restore(accelerator, checkpoint) if checkpoint is not None else (0, [])
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
    )
    loss = loss_function(config.loss, accelerator.unwrap_model(model))
    run = _Run(config, output_dir, accelerator, model, optimizer, scheduler, feed, losses, loss)
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
