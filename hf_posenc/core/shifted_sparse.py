"""Switch LongLoRA's shifted sparse attention (S2-Attn) on and off for a patched model's training.

    hf_posenc.patch_model(model, "rope")            # the checkpoint's own RoPE (or any encoding S2 can wrap)
    hf_posenc.enable_s2_attn(model, group_size=0.25) # a quarter of the length, as LongLoRA
    model.train(); ...                               # training forwards attend in shifted groups
    model.eval(); ...                                # full attention, unchanged
    hf_posenc.disable_s2_attn(model)
    with hf_posenc.s2_attn(model, group_size=2048): ...

The pattern itself is :mod:`hf_posenc.attention.shifted`. The setting lives on the patch's runtime
(it is copied with ``copy.deepcopy``, dropped by ``unpatch_model``) and is not saved: a trained
model attends in full.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..attention.shifted import DEFAULT_GROUP_RATIO, ShiftedSparse, s2_refusal
from ..errors import InvalidParameterError, NotPatchedError
from .registry import adapter_for


def _record(model: nn.Module) -> Any:
    from .patch import PATCH_ATTRIBUTE, transformers_model

    target = transformers_model(model)
    record = getattr(target, PATCH_ATTRIBUTE, None)
    if record is None:
        raise NotPatchedError(
            f"{type(model).__name__} is not patched by hf_posenc; S2-Attn runs in hf_posenc's attention: call "
            "hf_posenc.patch_model first (a RoPE checkpoint patched with its own RoPE keeps its positions)"
        )
    return target, record


def enable_s2_attn(
    model: nn.Module, group_size: int | float | str = DEFAULT_GROUP_RATIO, *, wrap: bool = False
) -> nn.Module:
    """Train ``model`` (patched) with S2-Attn; returns it. Inference (``model.eval()``) stays full attention.

    ``group_size``: tokens per group (even, dividing every training length) or a fraction of the
    length in (0, 1) (LongLoRA: 1/4). ``wrap=True`` rolls the shifted heads' tokens as the paper's
    Algorithm 1 (the first half-group then sees the last one); the default partitions them without
    wrapping, as LongLoRA's flash-attention training code. Refused in one line: an encoding whose
    attention adds a bias or rewrites the scores, an odd number of attention heads."""
    settings = ShiftedSparse.of(group_size, wrap=wrap)
    target, record = _record(model)
    for part in record.parts:
        refusal = s2_refusal(part)
        if refusal:
            raise InvalidParameterError(refusal)
    heads = adapter_for(target).geometry(target.config).num_heads
    if heads % 2:
        raise InvalidParameterError(
            f"S2-Attn: {type(target).__name__} has {heads} attention heads; allowed: an even head count "
            "(half the heads attend in shifted groups)"
        )
    for runtime in record.runtime.parts:
        runtime.s2 = settings
    return model


def disable_s2_attn(model: nn.Module) -> nn.Module:
    """Full attention in training again; returns ``model``."""
    _, record = _record(model)
    for runtime in record.runtime.parts:
        runtime.s2 = None
    return model


def s2_attn_settings(model: nn.Module) -> ShiftedSparse | None:
    """The S2-Attn settings of a patched ``model``, or None when it trains with full attention."""
    _, record = _record(model)
    return getattr(record.runtime.parts[0], "s2", None)


@contextlib.contextmanager
def s2_attn(
    model: nn.Module, group_size: int | float | str = DEFAULT_GROUP_RATIO, *, wrap: bool = False
) -> Iterator[nn.Module]:
    """Context manager: :func:`enable_s2_attn` inside the block, the previous setting after it."""
    previous = s2_attn_settings(model)
    enable_s2_attn(model, group_size, wrap=wrap)
    try:
        yield model
    finally:
        _, record = _record(model)
        for runtime in record.runtime.parts:
            runtime.s2 = previous
