"""T5's relative position bias (Raffel et al. 2020, seed 001): a learned scalar per head and
bucket of the causal distance n = i - j, added to the scores:

    bucket(n) = n                                                   n < B/2
              = min(B - 1, B/2 + floor(log(n / (B/2)) / log(D / (B/2)) * B/2))   otherwise
              = B - 1                                               n >= D
"""

from __future__ import annotations

import math

from .attention import attention_layer
from .config import native_window


def t5_bucket(n: int, num_buckets: int, max_distance: int) -> int:
    """Seed 001's bucket(n) for the causal distance n = i - j (future keys: bucket 0)."""
    n = max(n, 0)
    half = num_buckets // 2
    if n < half:
        return n
    if n >= max_distance:
        return num_buckets - 1
    return min(num_buckets - 1, half + math.floor(math.log(n / half) / math.log(max_distance / half) * half))


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64: softmax(q.k*scale + table[bucket(i - j), h]) v."""
    shared = params.get("shared_across_layers", True)
    table = model.posenc.tables[0 if shared else layer_idx].weight.double()  # (buckets, heads)
    buckets, distance = params.get("num_buckets", 32), params.get("max_distance", 128)
    return attention_layer(
        module,
        hidden,
        softmax_scale=module.scaling,
        window=native_window(model, layer_idx),
        bias=lambda h, i, j: float(table[t5_bucket(i - j, buckets, distance), h]),
    )
