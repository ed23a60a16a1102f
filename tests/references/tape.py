"""TAPE (Zhu et al. 2025, "Rethinking Addressing in Language Models via Contextualized
Equivariant Positional Encoding"; reference VITA-Group/TAPE ``adape``): every token carries a
positional stream E_t, per stream head g (one per KV head), updated from layer to layer,

    (1) init        C^0_t = cos(t w),  S^0_t = sin(t w),   w_f = theta^(-2f/D)
    (2) attention   q~_t = q_t rotated pairwise by (C, S)_t, the same for k~; a_tj = softmax_j(q~_t . k~_j * scale)
    (3) stream mix  E^{l+1/2}_t = E^l_t + gamma_l[g] * mean_{h in group g} sum_j a^h_tj E^l_j
    (4) PE layer    E^{l+1}_t   = E^{l+1/2}_t + W_down_l (silu(W_x_l x_t) * (W_up_l E^{l+1/2}_t))

written with loops in fp64 from the encoding's raw parameters (W = raw / sqrt(fan_in)) and the
model's weights. The stream runs across layers, so this reference gives every layer's output at
once (:func:`model_reference`) instead of one layer's.
"""

from __future__ import annotations

import math

import torch

from .attention import output_projection, projections
from .config import native_window, num_query_heads


def silu(x: float) -> float:
    return x / (1.0 + math.exp(-x))


@torch.no_grad()
def row_reference(model, attention, records, row: int) -> list[torch.Tensor]:
    """Equations (1)-(4) with loops: the attention output of every layer, (T, hidden) fp64, for
    batch row ``row`` of the captured layer inputs ``records[layer][0]`` (B, T, hidden)."""
    enc = model.posenc
    length = records[0][0].shape[1]
    theta = enc.config.theta
    first = attention[0]
    d = first.head_dim
    heads = num_query_heads(model)
    kv_heads = getattr(model.config, "num_key_value_heads", None) or heads
    groups = heads // kv_heads
    half = d // 2
    window = native_window(model)
    freqs = [theta ** (-2 * f / d) for f in range(half)]
    # (1): stream[g][t] = [cos(t w_f)]_f + [sin(t w_f)]_f
    stream = [[[math.cos(t * w) for w in freqs] + [math.sin(t * w) for w in freqs] for t in range(length)]]
    stream = [stream[0] for _ in range(kv_heads)]
    outputs = []
    for layer, module in enumerate(attention):
        hidden = records[layer][0][row].double()  # (T, hidden)
        if layer > 0:  # (4) with the previous step's parameters
            # W = raw / sqrt(fan_in): fan-ins are the stream heads, the hidden size and P
            up = enc.up[layer - 1].double() / math.sqrt(kv_heads)
            wx = enc.x_proj[layer - 1].double() / math.sqrt(hidden.shape[-1])
            down = enc.down[layer - 1].double() / math.sqrt(enc.up.shape[1])
            stream = _pe_layer(stream, hidden, up, wx, down, kv_heads, length, d)
        q, k, v = projections(module, hidden[None], hidden[None])
        q, k, v = q[0], k[0], v[0]  # (T, H, D)

        def rotation(e):  # (2) as a D x D matrix on the (f, f + D/2) pairs
            m = torch.zeros(d, d, dtype=torch.float64)
            for f in range(half):
                c, s = e[f], e[half + f]
                m[f, f], m[f, f + half], m[f + half, f], m[f + half, f + half] = c, -s, s, c
            return m

        out = torch.zeros(length, heads, d, dtype=torch.float64)
        attended = [[[0.0] * d for _ in range(length)] for _ in range(heads)]
        for h in range(heads):
            g = h // groups
            for i in range(length):
                keys = [j for j in range(i + 1) if window is None or i - j < window]
                qi = rotation(stream[g][i]) @ q[i, h]
                scores = [float(qi @ (rotation(stream[g][j]) @ k[j, g])) * module.scaling for j in keys]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for j, w in zip(keys, weights, strict=True):
                    out[i, h] += w / total * v[j, g]
                    for e in range(d):
                        attended[h][i][e] += w / total * stream[g][j][e]
        outputs.append(output_projection(module, out.reshape(length, -1)))
        if layer < enc.gamma.shape[0]:  # (3)
            gamma = enc.gamma[layer].double()
            stream = [
                [
                    [
                        stream[g][t][e]
                        + float(gamma[g])
                        * sum(attended[h][t][e] for h in range(g * groups, (g + 1) * groups))
                        / groups
                        for e in range(d)
                    ]
                    for t in range(length)
                ]
                for g in range(kv_heads)
            ]
    return outputs


def _pe_layer(stream, hidden, up, wx, down, kv_heads, length, d):
    """(4): E_t + W_down (silu(W_x x_t) * (W_up E_t)), loops over heads, channels, features."""
    size = up.shape[0]
    new = []
    for g in range(kv_heads):
        rows = []
        for t in range(length):
            gate = [silu(float(wx[p] @ hidden[t])) for p in range(size)]
            row = []
            for e in range(d):
                total = stream[g][t][e]
                for p in range(size):
                    mixed = sum(float(up[p, h]) * stream[h][t][e] for h in range(kv_heads))
                    total += float(down[g, p]) * gate[p] * mixed
                row.append(total)
            rows.append(row)
        new.append(rows)
    return new


def model_reference(params: dict, model, attention, records) -> list[torch.Tensor]:
    """Every layer's attention output (B, T, hidden) fp64, from the captured inputs
    ``records[layer] = (hidden, output)``: each batch row by (1)-(4)."""
    rows = [row_reference(model, attention, records, b) for b in range(records[0][0].shape[0])]
    return [torch.stack([layers[layer] for layers in rows]) for layer in range(len(attention))]
