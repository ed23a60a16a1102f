"""The longest input a model can take, where something sets a hard limit."""

from __future__ import annotations

from torch import nn

from .interpolation import covered_positions
from .patch import MODULE_NAME, patch_info
from .registry import adapter_for_config


def position_limit(model: nn.Module) -> tuple[int, str] | None:
    """``(tokens, what sets it)`` for a model that cannot take longer inputs, else None.

    A model patched with ``learned`` stops at its table (``max_positions``); an unpatched
    model stops where its family says (``FamilyAdapter.native_position_limit``, e.g. a learned
    position table). Every other encoding accepts any length.
    """
    info = patch_info(model)
    if info is not None and info["encoding"] == "learned":
        encoding = getattr(model, MODULE_NAME)
        rows, factor = int(encoding.table.shape[0]), encoding.config.factor
        if factor == 1.0:
            return rows, "the learned position table (max_positions={})"
        return covered_positions(rows, factor), f"the learned position table (max_positions={rows}, " + (
            f"interpolated by {factor:g}: {{}} positions)"
        )
    config = getattr(model, "config", None)
    adapter = adapter_for_config(config)
    if info is None and adapter is not None:
        return adapter.native_position_limit(config)
    return None
