"""The longest input a model can take, where something sets a hard limit."""

from __future__ import annotations

from torch import nn

from .patch import PATCH_ATTRIBUTE, transformers_model
from .registry import adapter_for_config


def position_limit(model: nn.Module) -> tuple[int, str] | None:
    """``(tokens, what sets it)`` for a model that cannot take longer inputs, else None.

    A patched model stops at the shortest limit of its encodings (each says its own:
    ``Encoding.position_limit``, e.g. ``learned``'s table); an unpatched model stops where its
    family says (``FamilyAdapter.native_position_limit``, e.g. a learned position table). Every
    other model accepts any length.
    """
    record = getattr(transformers_model(model), PATCH_ATTRIBUTE, None)
    if record is not None:
        limits = [limit for part in record.parts if (limit := part.position_limit()) is not None]
        if not limits:
            return None
        shortest = min(limits, key=lambda limit: limit.tokens)
        return shortest.tokens, shortest.describe().replace("{", "{{").replace("}", "}}")
    config = getattr(model, "config", None)
    adapter = adapter_for_config(config)
    if adapter is not None:
        return adapter.native_position_limit(config)
    return None
