"""SelfExtend (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without
Tuning"): neighbours keep their positions, far keys are grouped by floor division with group G,

    i - j < w:  (i, j)      else:  (i // G + w - w // G, j // G)
"""

from __future__ import annotations

from .window_split import default_window, split_layer_reference


def position_map(params: dict, window: int):
    group = params.get("group_size", 8)

    def positions(i: int, j: int) -> tuple[float, float]:
        if i - j < window:
            return i, j
        return i // group + window - window // group, j // group

    return positions


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer in fp64 with SelfExtend's position map."""
    positions = position_map(params, default_window(params, model))
    return split_layer_reference(params, module, hidden, model, layer_idx, positions)
