"""CoPE (Golovneva et al. 2024, "Contextual Position Encoding: Learning to Count What's
Important"; reference facebookresearch/RAM ``projects/cope``): positions counted by gates,

    g_ij = sigmoid(q_i . k_j * scale),   p_ij = min(sum_{t = j}^{i} g_it, npos_max - 1)
    logit_ij = q_i . k_j * scale + ((1 - w) q_i . e[floor p_ij] + w q_i . e[ceil p_ij]) * scale,
    w = p_ij - floor p_ij

with the sums running over the allowed keys only; e is the encoding's raw embedding table.
"""

from __future__ import annotations

import math

import torch

from .attention import attention_from_weights
from .config import native_window


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def cope_row(q, keys_k, keys, i, table, npos_max, scale):
    """CoPE attention weights of query i over ``keys`` (ascending) for one head: softmax of q . k_j * scale plus the
    interpolated q . e[p_ij] * scale, p_ij = min(sum_{t in keys, t >= j} sigmoid(q . k_t * scale), npos_max - 1)."""
    raw = [float(q @ keys_k[j]) * scale for j in keys]
    gates = [sigmoid(x) for x in raw]
    out = []
    for a in range(len(keys)):
        p = min(sum(gates[a:]), npos_max - 1)
        lo, hi = math.floor(p), math.ceil(p)
        w = p - lo
        z = lambda n: float(q @ table[n])  # noqa: E731
        out.append(raw[a] + ((1 - w) * z(lo) + w * z(hi)) * scale)
    return torch.softmax(torch.tensor(out, dtype=torch.float64), 0).tolist()


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64, from loops over batch, query, head, key."""
    npos_max = params.get("npos_max", 64)
    tables = model.posenc.embeddings.detach().double()
    table = tables[0 if params.get("shared_across_layers", False) else layer_idx]
    scale = module.scaling  # the family's softmax scale (1/sqrt(d); Gemma 3: query_pre_attn_scalar**-0.5)

    def weights(b, i, keys, q, k):
        group = q.shape[2] // k.shape[2]
        return [
            cope_row(q[b, i, h], {j: k[b, j, h // group] for j in keys}, keys, i, table, npos_max, scale)
            for h in range(q.shape[2])
        ]

    return attention_from_weights(module, hidden, window=native_window(model, layer_idx), weights=weights)
