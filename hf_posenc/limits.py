"""The longest input a model can take, where something sets a hard limit."""

from __future__ import annotations

from torch import nn

from .patch import MODULE_NAME, patch_info


def position_limit(model: nn.Module) -> tuple[int, str] | None:
    """``(tokens, what sets it)`` for a model that cannot take longer inputs, else None.

    A model patched with ``learned`` stops at its table (``max_positions``); a native
    (unpatched) GPT-2 stops at its ``wpe`` table (``n_positions``). Every other encoding
    accepts any length.
    """
    info = patch_info(model)
    if info is not None and info["encoding"] == "learned":
        return int(
            getattr(model, MODULE_NAME).table.shape[0]
        ), "the learned position table (max_positions={})"
    config = getattr(model, "config", None)
    if info is None and config is not None and getattr(config, "model_type", None) == "gpt2":
        return int(config.n_positions), "native GPT-2's wpe table (n_positions={})"
    return None
