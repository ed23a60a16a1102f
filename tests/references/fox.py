"""FoX and FoX (Pro) (Lin et al. 2025, "Forgetting Transformer: Softmax Attention with a Forget
Gate"; reference zhixuan-lin/forgetting-transformer, ``ForgettingAttentionLayer`` and
``ShiftLinear``), written with loops in fp64 from the model's weights and the encoding's raw
parameters:

    shift   k_t <- a_t k_{t-1} + (1-a_t) k_t, a_t = sigmoid(w_a . x_t + b_a) per KV head, k_{-1} = 0
    norm    q, k <- q / rms(q) * g  (per head, eps 1e-5)
    attend  softmax_j(q_i . k_j * scaling + sum_{l=j+1}^{i} log sigmoid(w_f . x_l + b_f)) over
            j <= i (and i - j < window), per query head h (KV head h // groups)
    output  o <- o / rms(o) * g_o (per head, eps 1e-6), then o * sigmoid(W_g x_i + b_g)

FoX is the attend step alone; FoX (Pro) switches each other step on (its parameters turn them off).
"""

from __future__ import annotations

import math

import torch

from .attention import output_projection, projections
from .config import native_window
from .cope import sigmoid

#: FoX (Pro)'s parts; plain FoX has none of them
PRO_PARTS = ("qk_norm", "k_shift", "v_shift", "output_norm", "output_gate")


def rms(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return x / math.sqrt(float((x * x).mean()) + eps) * gain


@torch.no_grad()
def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer by the formulas above, fp64."""
    posenc, layer, window = model.posenc, layer_idx, native_window(model, layer_idx)
    on = posenc.config.encoding == "fox_pro"
    pro = {part: params.get(part, True) if on else False for part in PRO_PARTS}
    x = hidden.double()
    batch, length, _ = x.shape
    q, k, v = projections(module, x, x)  # (B, T, H, D)
    heads, kv_heads = q.shape[2], k.shape[2]
    groups = heads // kv_heads
    w_f, b_f = posenc.forget[layer].weight.double(), posenc.forget[layer].bias.double()

    def shift(tensor, linear):
        w, b = linear.weight.double(), linear.bias.double()
        out = tensor.clone()
        for bb in range(batch):
            for t in range(length):
                for g in range(kv_heads):
                    a = sigmoid(float(w[g] @ x[bb, t] + b[g]))
                    previous = tensor[bb, t - 1, g] if t > 0 else torch.zeros_like(tensor[bb, t, g])
                    out[bb, t, g] = a * previous + (1 - a) * tensor[bb, t, g]
        return out

    def norm_heads(tensor, gains):  # (B, T, heads, D), per-head RMS norm with gain gains[head]
        return torch.stack(
            [
                torch.stack(
                    [
                        torch.stack([rms(tensor[b, t, h], gains[h], 1e-5) for h in range(tensor.shape[2])])
                        for t in range(length)
                    ]
                )
                for b in range(batch)
            ]
        )

    if pro["k_shift"]:
        k = shift(k, posenc.k_shift[layer])
    if pro["v_shift"]:
        v = shift(v, posenc.v_shift[layer])
    if pro["qk_norm"]:
        q = norm_heads(q, posenc.q_norm[layer].double())
        k = norm_heads(k, posenc.k_norm[layer].double())
    out = torch.zeros(batch, length, heads, q.shape[-1], dtype=torch.float64)
    for b in range(batch):
        log_f = [
            [math.log(sigmoid(float(w_f[h] @ x[b, t] + b_f[h]))) for t in range(length)] for h in range(heads)
        ]
        for h in range(heads):
            g = h // groups
            for i in range(length):
                keys = [j for j in range(i + 1) if window is None or i - j < window]
                scores = [
                    float(q[b, i, h] @ k[b, j, g]) * module.scaling + sum(log_f[h][j + 1 : i + 1])
                    for j in keys
                ]
                weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0)
                out[b, i, h] = sum(w * v[b, j, g] for w, j in zip(weights, keys, strict=True))
                if pro["output_norm"]:
                    out[b, i, h] = rms(out[b, i, h], posenc.output_norm[layer][h].double(), 1e-6)
    merged = out.reshape(batch, length, -1)
    if pro["output_gate"]:
        gate = posenc.output_gate[layer]
        merged = merged * torch.sigmoid(x @ gate.weight.double().T + gate.bias.double())
    return output_projection(module, merged)
