"""Stick-breaking attention (Tan et al. 2024, "Scaling Stick-Breaking Attention"; reference
shawntan/stickbreaking-attention ``sb_ref.py``): the softmax is replaced by a stick broken
backwards from the query,

    beta_ij = sigmoid(q_i . k_j * scale),   A_ij = beta_ij prod_{j < k <= i on the stick} (1 - beta_ik)

the stick excludes key i unless ``attend_current``; the leftover mass 1 - sum_j A_ij goes to key
i (``remainder="current"``) or is dropped.
"""

from __future__ import annotations

import math

from .attention import attention_from_weights
from .config import native_window
from .cope import sigmoid


def sba_row(q, keys_k, keys, i, scale, attend_current, remainder):
    """Stick-breaking weights of query i: beta_j * prod_{k > j on the stick} (1 - beta_k); the
    stick excludes key i unless ``attend_current``; the leftover mass goes to key i or is dropped."""
    stick = [j for j in keys if attend_current or j != i]
    beta = {j: sigmoid(float(q @ keys_k[j]) * scale) for j in stick}
    weights = {j: 0.0 for j in keys}
    for j in stick:
        weights[j] = beta[j] * math.prod(1 - beta[k] for k in stick if k > j)
    if remainder == "current":
        weights[i] += 1 - sum(weights.values())
    return [weights[j] for j in keys]


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64, from loops over batch, query, head, key."""
    attend_current, remainder = params.get("attend_current", False), params.get("remainder", "current")

    def weights(b, i, keys, q, k):
        group = q.shape[2] // k.shape[2]
        return [
            sba_row(
                q[b, i, h],
                {j: k[b, j, h // group] for j in keys},
                keys,
                i,
                module.scaling,
                attend_current,
                remainder,
            )
            for h in range(q.shape[2])
        ]

    return attention_from_weights(module, hidden, window=native_window(model, layer_idx), weights=weights)
