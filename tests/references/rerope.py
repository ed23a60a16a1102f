"""ReRoPE and Leaky ReRoPE (Su 2023, "Rectified Rotary Position Embeddings"; reference
bojone/rerope): relative positions clipped at the window w, or growing with slope 1/k past it,

    rerope:        i - j < w: (i, j)   else: (w, 0)
    leaky_rerope:  i - j < w: (i, j)   else: (i / k + w - w / k, j / k)
"""

from __future__ import annotations

from .window_split import default_window, split_layer_reference


def position_map(name: str, params: dict, window: int):
    leak = params.get("leak", 16.0)

    def positions(i: int, j: int) -> tuple[float, float]:
        if i - j < window:
            return i, j
        if name == "rerope":
            return window, 0
        return i / leak + window - window / leak, j / leak

    return positions


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer in fp64 with the position map of the patched variant (rerope or leaky_rerope)."""
    positions = position_map(model.posenc.config.encoding, params, default_window(params, model))
    return split_layer_reference(params, module, hidden, model, layer_idx, positions)
