"""Sinusoidal absolute positions (Vaswani et al. 2017), added to the token embeddings:

    P[n, 2i] = sin(n / base^(2i/d)),  P[n, 2i+1] = cos(n / base^(2i/d))

Attention itself is left as it is: a layer's output is plain attention over its (position-carrying) input.
"""

from __future__ import annotations

import math

from .attention import attention_layer
from .config import native_window


def sinusoidal_vector(n: float, d: int, base: float = 10000.0) -> list[float]:
    """P[n] as a list of d floats, by the formula above."""
    out = []
    for k in range(d):
        i = k // 2
        angle = n / base ** (2 * i / d)
        out.append(math.sin(angle) if k % 2 == 0 else math.cos(angle))
    return out


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64: plain causal attention (the positions are already in ``hidden``)."""
    return attention_layer(
        module, hidden, softmax_scale=module.scaling, window=native_window(model, layer_idx)
    )
