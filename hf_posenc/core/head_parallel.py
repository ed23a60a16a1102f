"""Switch head-parallel attention (DeepSpeed Ulysses' layout) on and off for a patched model.

    torch.distributed.init_process_group(...)         # or a launched accelerate / DeepSpeed run
    hf_posenc.patch_model(model, "alibi")
    hf_posenc.enable_head_parallel(model, group)        # group: the sequence-parallel ranks (None: all)
    loss = model(input_ids=shard, position_ids=shard_positions, ...)   # each rank: its T/N tokens
    hf_posenc.disable_head_parallel(model)

Each rank passes its own T/N tokens of every sequence with their true position ids; attention
runs for the rank's Hq/N heads over all T tokens (:mod:`hf_posenc.attention.head_parallel`). The
setting lives on the patch's runtime and is neither copied, pickled nor saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..attention.head_parallel import HeadParallel, head_parallel_refusal
from ..errors import InvalidParameterError, NotPatchedError


def _record(model: nn.Module) -> Any:
    from .patch import PATCH_ATTRIBUTE, transformers_model

    record = getattr(transformers_model(model), PATCH_ATTRIBUTE, None)
    if record is None:
        raise NotPatchedError(
            f"{type(model).__name__} is not patched by hf_posenc; head-parallel attention runs in hf_posenc's "
            "attention: call hf_posenc.patch_model first (a native model gets Ulysses from DeepSpeed itself)"
        )
    return record


def enable_head_parallel(model: nn.Module, group: Any = None) -> nn.Module:
    """Attend ``model`` (patched) head-parallel over the ranks of ``group`` (a torch.distributed
    process group; None: the default group); returns it. Refused in one line: an encoding that
    cannot be split by heads (:func:`~hf_posenc.attention.head_parallel.head_parallel_refusal`),
    S2-Attn switched on, no process group."""
    record = _record(model)
    for part in record.runtime.parts:
        refusal = head_parallel_refusal(part.encoding)
        if refusal:
            raise InvalidParameterError(
                f"head-parallel attention cannot serve encoding {part.encoding.name!r}: {refusal}; allowed: "
                "encodings attending with SDPA, with or without a score bias"
            )
        if getattr(part, "s2", None) is not None:
            raise InvalidParameterError(
                "head-parallel attention with S2-Attn is not allowed; allowed: disable_s2_attn first"
            )
    exchange = HeadParallel.of(group)
    for part in record.runtime.parts:
        part.head_parallel = exchange
    return model


def disable_head_parallel(model: nn.Module) -> nn.Module:
    """Attend every head over the tokens a rank holds again; returns ``model``."""
    for part in _record(model).runtime.parts:
        part.head_parallel = None
    return model


@contextlib.contextmanager
def head_parallel(model: nn.Module, group: Any = None) -> Iterator[nn.Module]:
    """Context manager: :func:`enable_head_parallel` inside the block, off after it."""
    enable_head_parallel(model, group)
    try:
        yield model
    finally:
        disable_head_parallel(model)
