"""FoPE (Hua et al. 2024, "Fourier Position Embedding: Enhancing Attention's Periodic Extension
for Length Generalization"; reference yiju-zhao/Fourier-Position-Embedding): each rotary pair m
becomes a Fourier series over a grid of frequencies w_j = theta^(-2j / (k d)),

    [[c, -s], [s, c]],  c = sum_j C[j, m] cos(w_j t),  s = sum_j S[j, m] sin(w_j t)

with frequencies below 2 pi / L dropped (clipping) and a pair whose own frequency w_{k m} is
dropped left as the identity; C and S are the encoding's raw coefficients.
"""

from __future__ import annotations

import functools
import math

import torch

from .attention import attention_with_matrices
from .config import native_window


def fope_matrices(posenc, layer: int, head_dim: int):
    """FoPE: pair m maps (x_m, x_{m+d/2}) by [[c, -s], [s, c]] with c = sum_j C[j,m] cos(w_j t),
    s = sum_j S[j,m] sin(w_j t), w_j = theta^(-2j/(k d)), w_j < 2 pi / L dropped (clip); a pair whose
    own frequency w_{k m} is dropped is the identity."""
    cfg = posenc.config
    rot, per = int(head_dim * cfg.partial_rotary_factor), cfg.frequencies_per_dim
    half = rot // 2
    floor = 2 * math.pi / cfg.train_length if cfg.clip else 0.0
    freqs = [cfg.theta ** (-2 * j / (per * rot)) for j in range(per * half)]
    live = [w >= floor for w in freqs]
    index = 0 if cfg.shared_across_layers else layer
    cos_coef = posenc.cos_coef.detach().double()[index]  # (H, n_in, pairs)
    sin_coef = posenc.sin_coef.detach().double()[index]

    @functools.cache
    def matrix(g: int, t: int) -> torch.Tensor:
        head = 0 if cfg.shared_across_heads else g
        out = torch.eye(head_dim, dtype=torch.float64)
        for m in range(half):
            if not live[per * m]:
                continue
            c = sum(float(cos_coef[head, j, m]) * math.cos(w * t) for j, w in enumerate(freqs) if live[j])
            s = sum(float(sin_coef[head, j, m]) * math.sin(w * t) for j, w in enumerate(freqs) if live[j])
            out[m, m], out[m, m + half], out[m + half, m], out[m + half, m + half] = c, -s, s, c
        return out

    return matrix


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64: softmax((M(i) q_i).(M(j) k_j) * scale) v with explicit matrices."""
    matrix = fope_matrices(model.posenc, layer_idx, module.head_dim)
    return attention_with_matrices(
        module, hidden, window=native_window(model, layer_idx), matrix=lambda b, g, t: matrix(g, t)
    )
