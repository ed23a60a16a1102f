"""The model, optimizer and learning-rate schedule of a training run: the model loaded (or the
caller's) and patched, checked against the training length and the sequence engine, with
activation checkpointing or LoRA; AdamW with the encoding's own learning rate; warm-up then
cosine decay; all wrapped by accelerate. Used by :mod:`.loop`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ...attention.shifted import DEFAULT_GROUP_RATIO
from ...core.limits import position_limit
from ...core.loading import load_model
from ...core.patch import patch_info, patch_model
from ...core.shifted_sparse import enable_s2_attn
from ...errors import InvalidParameterError
from .config import TrainConfig
from .lora import apply_lora
from .parallelism import (
    engine_refusal,
    launch_degrees,
    model_encodings,
    model_forms,
    sequence_parallel_refusal,
)
from .sampling import check_encoding_reads_positions

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def lr_schedule(config: TrainConfig) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to ``end_lr_ratio`` of the peak (the ExPE paper's schedule)."""
    warmup = int(config.warmup_ratio * config.max_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, config.max_steps - warmup))
        return config.end_lr_ratio + (1 - config.end_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def is_encoding_parameter(name: str) -> bool:
    return name.startswith("posenc.") or ".posenc." in name  # also under a peft wrapper


def full_shape(parameter: nn.Parameter) -> torch.Size:
    """A parameter's own shape, also where DeepSpeed ZeRO-3 has partitioned it: the process then holds
    an empty (0,) placeholder and the shape is kept as ``ds_shape`` (reading ``parameter.dim()`` there
    put every matrix in the group without weight decay)."""
    return getattr(parameter, "ds_shape", None) or parameter.shape


def refuse_encoding_lr(encoding_lr: float) -> None:
    """``encoding_lr`` for a patched model whose encoding has no trainable parameters: one line."""
    raise InvalidParameterError(
        f"train: encoding_lr={encoding_lr!r} would be ignored: the patched model's encoding has no "
        "trainable parameters of its own; allowed: an encoding that learns some (a bias table or network, "
        "learned frequencies), or drop --encoding-lr"
    )


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only; the encoding's parameters at ``encoding_lr``, no decay."""
    decay, no_decay, own = [], [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if is_encoding_parameter(name):
            own.append(parameter)
        elif len(full_shape(parameter)) >= 2:
            decay.append(parameter)
        else:
            no_decay.append(parameter)
    if config.encoding_lr is not None and not own:  # (its own rate for parameters there are none of)
        refuse_encoding_lr(config.encoding_lr)
    # (encoding_lr 0 freezes them: not `encoding_lr or lr`, which took 0 for "not given")
    own_lr = config.lr if config.encoding_lr is None else config.encoding_lr
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": own, "weight_decay": 0.0, "lr": own_lr},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=config.lr, betas=(config.beta1, config.beta2)
    )


def check_positions(model: nn.Module, seq_len: int) -> None:
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


def trainable_model(config: TrainConfig, model: nn.Module | None) -> nn.Module:
    """The model loaded or patched, checked against seq_len, with checkpointing/LoRA, in train mode."""
    model = prepare_model(config, model)  # the data is ready (or its error known) before the model loads
    check_positions(model, max(config.seq_len, config.target_length or 0))
    check_encoding_reads_positions(config.position_sampling, getattr(model, "posenc", None))
    cp, sp = launch_degrees(config.context_parallel, config.sequence_parallel)
    if cp > 1 or sp > 1:  # the loaded model's own encodings (a checkpoint's native scaling included)
        if cp > 1:
            refusal = engine_refusal("context_parallel", model_forms(model))
        else:
            refusal = sequence_parallel_refusal(model_encodings(model))
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
            trainable=config.lora_trainable,
        )
    if config.s2_attn:  # LongLoRA's shifted sparse attention in training forwards (full in eval)
        enable_s2_attn(model, config.s2_group_size or DEFAULT_GROUP_RATIO, wrap=config.s2_wrap)
    model.train()
    return model


def prepare_for_accelerate(config: TrainConfig, model: nn.Module, accelerator):
    """Model and optimizer wrapped by accelerate; the scheduler registered for checkpoints."""
    optimizer = build_optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(config))
    # the scheduler is stepped by hand, once per optimizer step, whatever the process count
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    return model, optimizer, scheduler
