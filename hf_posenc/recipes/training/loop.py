"""Continued pretraining of a (patched) causal LM with accelerate.

Works on one CPU, and under ``accelerate launch`` on N processes (DDP, FSDP): each process
takes its slice of the same global batch (see :mod:`.batches`), so a 2-process run with
half the per-process batch follows the same trajectory as one process.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ...core.limits import position_limit
from ...core.loading import load_model
from ...core.patch import patch_info, patch_model
from ...errors import InvalidParameterError
from ..data import check_sources
from ..preflight import check_encoding, check_model_path, check_tokenizer_path
from .batches import BatchOrder
from .checkpoints import intact_checkpoint, read_state, save_checkpoint
from .config import TrainConfig
from .corpus import training_blocks
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
from .outputs import write_final

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


def preflight(config: TrainConfig, *, model: nn.Module | None = None, tokenizer: Any = None) -> None:
    """Every check that needs no model: paths, tokenizer, data sources, encoding and parameters."""
    saved = None
    if model is None:
        saved = check_model_path(config.model, need_tokenizer=tokenizer is None and config.tokenizer is None)
    if config.tokenizer is not None and tokenizer is None:
        check_tokenizer_path(config.tokenizer)
    check_sources(config.data)
    if model is None or patch_info(model) is None:
        check_encoding(config.encoding, config.encoding_params, saved)


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

    return Accelerator(
        gradient_accumulation_steps=config.grad_accum,
        mixed_precision=config.mixed_precision,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=config.ddp_timeout))],
        log_with=list(config.report_to) or None,
        project_dir=str(output_dir),
    )


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
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    output_dir = Path(config.output_dir)
    preflight(config, model=model, tokenizer=tokenizer)
    on_cpu = use_cpu_for_a_gpu_launch()
    accelerator = _accelerator(config, output_dir)
    check_world(accelerator)
    if accelerator.is_main_process:
        for note in launch_notes(accelerator, on_cpu):
            print(note)
    check_output_dir(output_dir, resume=resume, overwrite=overwrite, is_main=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    checkpoint = None
    if resume:
        warn = print if accelerator.is_main_process else (lambda _: None)
        checkpoint = intact_checkpoint(output_dir, warn=warn)
        if checkpoint is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint (none intact) in {str(output_dir)!r}")
        changed = resume_differences(read_state(checkpoint)["config"], dataclasses.asdict(config))
        if changed:
            raise InvalidParameterError(
                f"--resume: settings differ from the run in {str(output_dir)!r}: " + ", ".join(changed)
            )

    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)

    with accelerator.main_process_first():
        blocks = training_blocks(
            config.data,
            tokenizer,
            config.seq_len,
            text_field=config.text_field,
            split=config.split,
            limit=config.max_documents,
            cache_dir=config.data_cache or output_dir / "data-cache",
            num_proc=config.num_proc,
        )
    order = BatchOrder(
        blocks, config.batch_size, accelerator.num_processes, accelerator.process_index, config.seed
    )
    set_seed(config.seed)
    model = prepare_model(config, model)  # the data is ready (or its error known) before the model loads
    _check_positions(model, config.seq_len)

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
    if checkpoint is not None:
        try:
            accelerator.load_state(str(checkpoint))
        except Exception as error:  # a file that passed its checksum but does not load
            raise InvalidParameterError(f"--resume: cannot load {checkpoint}: {error}") from error
        state = read_state(checkpoint)
        start, losses = state["step"], [tuple(x) for x in state["losses"]]
        if accelerator.is_main_process:
            print(f"[train] resuming from {checkpoint} (step {start})")
    if accelerator.is_main_process:
        (output_dir / "train_config.json").write_text(config.to_json())
    if config.report_to:
        accelerator.init_trackers("hf-posenc", config=_tracker_config(config))

    def save(step: int) -> None:
        check_finite_weights(accelerator, model, step)
        state = {"step": step, "losses": losses, "config": dataclasses.asdict(config)}
        path = save_checkpoint(accelerator, output_dir, step, state, config.keep_checkpoints)
        if accelerator.is_main_process:
            bar.write(f"[train] checkpoint {path}")

    bar = tqdm(
        total=config.max_steps,
        initial=start,
        desc="train",
        disable=not (progress and accelerator.is_main_process),
    )
    try:
        with StopRequest(enabled=accelerator.num_processes == 1) as stop:
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
                check_finite_loss(mean_loss, step + 1)
                losses.append((step + 1, mean_loss))
                logs = {"loss": mean_loss, "lr": scheduler.get_last_lr()[0]}
                bar.update(1)
                bar.set_postfix(loss=f"{mean_loss:.4f}")
                if accelerator.is_main_process and (step + 1) % config.log_every == 0:
                    bar.write(json.dumps({"step": step + 1, **logs}))
                if config.report_to:
                    accelerator.log(logs, step=step + 1)
                if stop.requested and step + 1 < config.max_steps:
                    save(step + 1)
                    raise KeyboardInterrupt(f"interrupted after step {step + 1}; checkpoint saved")
                if config.save_every and (step + 1) % config.save_every == 0 and step + 1 < config.max_steps:
                    save(step + 1)
                for callback in callbacks:
                    callback(step + 1, logs)
    except RuntimeError as error:
        if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
            raise
        raise TrainingError(
            f"another process did not answer within --ddp-timeout {config.ddp_timeout} s (stuck or dead); "
            f"stopped at step {len(losses)}, the last checkpoint is the resume point "
            f"({str(error).splitlines()[0][-120:]})"
        ) from error
    finally:
        bar.close()  # an error message starts on its own line

    check_finite_weights(accelerator, model, config.max_steps)
    final_dir = output_dir / "final"
    accelerator.wait_for_everyone()
    # every process takes part in gathering a sharded (FSDP) state dict; the main one writes it
    state_dict = None if config.lora else accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        final = accelerator.unwrap_model(model)
        if config.lora:
            final = merge_lora(final)
        write_final(
            final, tokenizer, output_dir, config, losses, blocks, accelerator.num_processes, state_dict
        )
    accelerator.wait_for_everyone()
    if config.report_to:
        accelerator.end_training()
    return TrainResult(final_dir, config.max_steps, losses, accelerator.is_main_process)
