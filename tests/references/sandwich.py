"""Sandwich (Chi et al. 2023, "Dissecting Transformer Length Extrapolation via the Lens of
Receptive Field Analysis"): the inner product of two sinusoidal embeddings of dimension d' as a
parameter-free relative bias, scaled per head,

    b_h(i, j) = (sum_{k=1}^{d'/2} cos((i - j) / 10000^(2k/d')) - d'/2) / (8h / H),  h = 1..H
"""

from __future__ import annotations

import math

from .attention import attention_layer
from .config import native_window, num_query_heads


def sandwich_bias(params: dict, heads: int):
    """Sandwich: (sum_{k=1}^{d'/2} cos((i-j)/10000^(2k/d')) - d'/2) / (8h/H), h = 1..H."""
    dim = params.get("dim", 128)

    def bias(h, i, j):
        kernel = sum(math.cos((i - j) / 10000 ** (2 * k / dim)) for k in range(1, dim // 2 + 1))
        return (kernel - dim / 2) / (8 * (h + 1) / heads)

    return bias


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64: softmax(q.k*scale + b_h(i, j)) v."""
    bias = sandwich_bias(params, num_query_heads(model))
    window = native_window(model, layer_idx)
    return attention_layer(module, hidden, softmax_scale=module.scaling, window=window, bias=bias)
