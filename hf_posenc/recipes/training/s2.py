"""LongLoRA in ``hf-posenc train``: ``--s2-attn`` (shifted sparse attention while training, full
attention after) and ``--lora-trainable embed,norm`` (the embeddings and normalisation layers
trained fully beside the LoRA adapters, as LongLoRA's ``--trainable_params embed,norm``).

Every check here runs before the model or data loads; the attention pattern itself is the
library's (:mod:`hf_posenc.attention.shifted`, :func:`hf_posenc.enable_s2_attn`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...errors import InvalidParameterError

if TYPE_CHECKING:
    from .config import TrainConfig

#: what ``--lora-trainable`` takes
LORA_TRAINABLE = ("embed", "norm")


def check_lora_trainable(lora: bool, trainable: list[str] | None) -> None:
    """``--lora-trainable``: a non-empty subset of :data:`LORA_TRAINABLE`, and only with ``--lora``."""
    if trainable is None:
        return
    if not lora:
        raise InvalidParameterError(
            f"train: lora_trainable={trainable!r} without lora would be ignored (without LoRA every weight "
            "trains); allowed: add --lora, or drop --lora-trainable"
        )
    bad = [t for t in trainable if t not in LORA_TRAINABLE] if isinstance(trainable, list) else [trainable]
    if not trainable or bad:
        raise InvalidParameterError(
            f"train: lora_trainable={trainable!r} is not allowed; allowed: any of {', '.join(LORA_TRAINABLE)} "
            "(e.g. --lora-trainable embed,norm)"
        )


def check_s2_settings(
    s2_attn: bool, group_size: Any, wrap: bool, *, seq_len: int, packing: bool
) -> int | float | None:
    """The group size in canonical form (tokens, or a fraction of ``seq_len``), or None without
    ``--s2-attn``; refuses a group that does not cut ``seq_len`` (or settings that would be ignored)."""
    if not s2_attn:
        if group_size is not None or wrap:
            raise InvalidParameterError(
                f"train: s2_group_size={group_size!r} / s2_wrap={wrap!r} without s2_attn would be ignored; "
                "allowed: add --s2-attn, or drop them"
            )
        return None
    from ...attention.shifted import DEFAULT_GROUP_RATIO, ShiftedSparse

    settings = ShiftedSparse.of(DEFAULT_GROUP_RATIO if group_size is None else group_size, wrap=wrap)
    settings.group(seq_len)
    if wrap and packing:
        raise InvalidParameterError(
            "train: --s2-wrap with --packing is not allowed: the paper's rolled groups join the last and first "
            "tokens of a block, across its documents; allowed: --s2-attn without --s2-wrap (LongLoRA's unrolled "
            "groups honour document masks)"
        )
    return settings.group_size if settings.group_size is not None else settings.group_ratio


def _odd_heads(model_config: Mapping[str, Any] | None) -> int | None:
    for key in ("num_attention_heads", "n_head"):
        heads = (model_config or {}).get(key)
        if isinstance(heads, int):
            return heads if heads % 2 else None
    return None


def check_s2_request(config: TrainConfig, saved: Mapping[str, Any] | None) -> None:
    """``--s2-attn`` against the encoding, the checkpoint and the sequence engine, before loading."""
    from ...attention.shifted import s2_refusal
    from .parallelism import launch_degrees, probe_encodings

    if max(launch_degrees(config.context_parallel, config.sequence_parallel)) > 1:
        raise InvalidParameterError(
            "train: --s2-attn with --context-parallel / --sequence-parallel is not allowed: the sequence "
            "engines split attention themselves; allowed: one of them"
        )
    encoding = config.encoding or (saved or {}).get("posenc")
    if (
        not encoding and saved is None
    ):  # a hub id, or the caller's model: enable_s2_attn checks it once loaded
        return
    if not encoding:
        raise InvalidParameterError(
            f"train: --s2-attn needs an hf_posenc encoding, and {config.model!r} is a native checkpoint with no "
            "--encoding; allowed: add --encoding (e.g. --encoding rope keeps a RoPE checkpoint's own positions)"
        )
    for instance in probe_encodings(encoding, config.encoding_params if config.encoding else None):
        refusal = s2_refusal(instance)
        if refusal:
            raise InvalidParameterError(f"train: --s2-attn: {refusal}")
    window = (saved or {}).get("sliding_window")
    sliding = (
        isinstance(window, int) and window < config.seq_len and (saved or {}).get("use_sliding_window", True)
    )
    if config.s2_wrap and sliding:
        raise InvalidParameterError(
            f"train: --s2-wrap is not allowed on {config.model!r}: its sliding window ({window} < --seq-len "
            f"{config.seq_len}) is an attention mask, which the paper's rolled groups cannot follow; allowed: --s2-attn without --s2-wrap"
        )
    heads = _odd_heads(saved)
    if heads:
        raise InvalidParameterError(
            f"train: --s2-attn is not allowed: {config.model!r} has {heads} attention heads; allowed: a model "
            "with an even head count (half the heads attend in shifted groups)"
        )
