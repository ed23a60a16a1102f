"""ALiBi (Press et al. 2022): a fixed linear penalty per head, bias(h, i, j) = -m_h (i - j), with
the geometric slopes m_h of the paper's reference ``get_slopes``.
"""

from __future__ import annotations

import math

from .attention import attention_layer
from .config import native_window, num_query_heads


def alibi_slopes(n: int) -> list[float]:
    """Press et al.'s reference ``get_slopes`` (recursive form)."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: n - closest]


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64: softmax(q.k*scale - m_h (i - j)) v."""
    slopes = alibi_slopes(num_query_heads(model))
    return attention_layer(
        module,
        hidden,
        softmax_scale=module.scaling,
        window=native_window(model, layer_idx),
        bias=lambda h, i, j: -slopes[h] * (i - j),
    )
