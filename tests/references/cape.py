"""CAPE / DAPE (Zheng et al. 2024, "DAPE: Data-Adaptive Positional Encoding for Length
Extrapolation"; reference chuanyang-Zheng/DAPE ``CAPE.py``): the logits of all heads and a base
bias B (ALiBi, KERPLE or FIRE) are mixed across heads by a per-layer MLP,

    A_ij = x_ij + B_ij + W2 leaky_relu(W1 [x_ij ; B_ij] + b1, 0.01) + b2,   x_ij = q_i . k_j * scale

(one vector over heads per (i, j)); softmax over the allowed keys as usual.
"""

from __future__ import annotations

import torch

from .alibi import alibi_slopes
from .attention import attention_from_weights
from .config import native_window, num_query_heads
from .fire import fire_bias
from .kerple import kerple_bias


def base_bias(params: dict, model, layer_idx: int):
    """B(h, i, j) of the base encoding, by its own reference, from the base's raw parameters."""
    base, base_params = params.get("base", "alibi"), params.get("base_params") or {}
    if base == "kerple":
        return kerple_bias(base_params, model.posenc.base, layer_idx)
    if base == "fire":
        return fire_bias(base_params, model.posenc.base, layer_idx)
    slopes = alibi_slopes(num_query_heads(model))
    return lambda h, i, j: -slopes[h] * (i - j)


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64, from loops over batch, query, key (all heads at once: f mixes heads)."""
    base = base_bias(params, model, layer_idx)
    mixer = model.posenc.mixers[layer_idx]
    w1, b1 = mixer.inner.weight.detach().double(), mixer.inner.bias.detach().double()
    w2, b2 = mixer.outer.weight.detach().double(), mixer.outer.bias.detach().double()
    scale = module.scaling

    def weights(b, i, keys, q, k):
        heads, group = q.shape[2], q.shape[2] // k.shape[2]
        x = [[float(q[b, i, h] @ k[b, j, h // group]) * scale for j in keys] for h in range(heads)]
        bias = [[base(h, i, j) for j in keys] for h in range(heads)]
        logits = [[0.0] * len(keys) for _ in range(heads)]
        for a in range(len(keys)):
            u = torch.tensor([x[h][a] for h in range(heads)] + [bias[h][a] for h in range(heads)])
            f = w2 @ torch.nn.functional.leaky_relu(w1 @ u.double() + b1, 0.01) + b2
            for h in range(heads):
                logits[h][a] = x[h][a] + bias[h][a] + float(f[h])
        return [torch.softmax(torch.tensor(row, dtype=torch.float64), 0).tolist() for row in logits]

    return attention_from_weights(module, hidden, window=native_window(model, layer_idx), weights=weights)
