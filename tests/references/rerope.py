"""ReRoPE and Leaky ReRoPE (Su 2023, "Rectified Rotary Position Embeddings"; reference
bojone/rerope): relative positions clipped at the window w, or growing with slope 1/k past it,

    rerope:        i - j < w: (i, j)   else: (w, 0)
    leaky_rerope:  i - j < w: (i, j)   else: (i / k + w - w / k, j / k)

With ``logn``, every query is first multiplied by max(1, log(i + 1) / log(L)), L the trained length
(``query_states *= ((position_ids + 1).log() / np.log(training_length)).clip(1)`` in both patches).
"""

from __future__ import annotations

import math

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
    trained = model.config.max_position_embeddings
    scale = (lambda i: max(1.0, math.log(i + 1) / math.log(trained))) if params.get("logn") else None
    rope_params = {k: v for k, v in params.items() if k != "logn"}
    return split_layer_reference(rope_params, module, hidden, model, layer_idx, positions, scale)
