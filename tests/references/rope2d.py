"""Axial RoPE over N-D coordinates (Heo et al. 2024, "Rotary Position Embedding for Vision
Transformer", the axial baseline): the rotary pairs are split across the N axes, pair p turning by
the coordinate on its own axis,

    angle_p(x) = x[p mod N] * theta^(-2 floor(p / N) / (d_rot / N))

Text (no coordinates) sits at x = (t, 0, ..., 0).
"""

from __future__ import annotations

import torch

from .attention import attention_with_matrices
from .config import native_window


def rope2d_matrix(x: list[float], head_dim: int, rotary: int, theta: float) -> torch.Tensor:
    """Axial RoPE: pair p = (p, p + rotary/2) turns by x[p mod N] * theta^(-2 floor(p/N) / (rotary/N))."""
    axes, half = len(x), rotary // 2
    matrix = torch.eye(head_dim, dtype=torch.float64)
    for p in range(half):
        angle = x[p % axes] * theta ** (-2 * (p // axes) / (rotary / axes))
        c, s = (
            torch.cos(torch.tensor(angle, dtype=torch.float64)),
            torch.sin(torch.tensor(angle, dtype=torch.float64)),
        )
        matrix[p, p], matrix[p, p + half] = c, -s
        matrix[p + half, p], matrix[p + half, p + half] = s, c
    return matrix


def point(coords, axes: int, b: int, t: int) -> list[float]:
    """The coordinates of token t of row b: the caller's ``coords`` (B, T, N), or (t, 0, ..., 0)."""
    return [float(v) for v in coords[b, t]] if coords is not None else [float(t)] + [0.0] * (axes - 1)


def layer_reference(params: dict, module, hidden, model, layer_idx: int, coords=None):
    """One attention layer by the formula in fp64: rotations R(x) of the text positions
    x = (t, 0, ..., 0), or of the caller's ``coords`` (B, T, N)."""
    axes = params.get("axes", 2)
    cfg = model.posenc.config
    head_dim = model.posenc.geometry.head_dim
    rotary = int(head_dim * cfg.partial_rotary_factor)
    cache: dict = {}

    def matrix(b, g, t):
        if (b, t) not in cache:
            cache[b, t] = rope2d_matrix(point(coords, axes, b, t), head_dim, rotary, cfg.theta)
        return cache[b, t]

    return attention_with_matrices(module, hidden, window=native_window(model, layer_idx), matrix=matrix)
