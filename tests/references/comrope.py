"""ComRoPE (Yu et al. 2025, "ComRoPE: Scalable and Robust Rotary Position Embedding
Parameterized by Trainable Commuting Angle Matrices"; Longin-Yu/ComRoPE): a token at
coordinates x rotates q and k by

    R(x) = exp(sum_a x_a A_a),   A_a block-diagonal, block j = c_aj (P_j - P_j^T)

with c_aj = [j mod N == a] (AP: each block on one axis) or a trainable scale s_aj (LD); the
full (D, D) generators are built from the raw parameters and exponentiated as one matrix.
Text (no coordinates) sits at x = (t, 0, ..., 0).
"""

from __future__ import annotations

import torch

from .attention import attention_with_matrices
from .config import native_window
from .rope2d import point


def comrope_generators(posenc, layer: int, kv_head: int) -> torch.Tensor:
    """(N, D, D) fp64 generators A_a: block j on dims (j, j+m, ..), B_aj = c_aj (P_j - P_j^T),
    c_aj = [j mod N == a] for ap, the trainable scale s_aj for ld."""
    cfg, d = posenc.config, posenc.geometry.head_dim
    b, axes = cfg.block_size, cfg.axes
    rotary = int(d * cfg.partial_rotary_factor)
    m = rotary // b
    P = posenc.generator[layer, kv_head].double()  # noqa: N806  (m, b, b)
    out = torch.zeros(axes, d, d, dtype=torch.float64)
    for a in range(axes):
        for j in range(m):
            coef = (
                float(posenc.axis_scale[layer, a, j].detach())
                if cfg.variant == "ld"
                else float(j % axes == a)
            )
            skew = P[j] - P[j].T
            for r in range(b):
                for c in range(b):
                    out[a, j + r * m, j + c * m] = coef * skew[r, c]
    return out


def comrope_matrix(posenc, layer: int, kv_head: int, x: list[float]) -> torch.Tensor:
    """R(x) = exp(sum_a x_a A_a) as one (D, D) fp64 matrix exponential."""
    gens = comrope_generators(posenc, layer, kv_head)
    return torch.linalg.matrix_exp(sum(xa * g for xa, g in zip(x, gens, strict=True)))


def layer_reference(params: dict, module, hidden, model, layer_idx: int, coords=None):
    """One attention layer by the formula in fp64: rotations R(x) of the text positions
    x = (t, 0, ..., 0), or of the caller's ``coords`` (B, T, N)."""
    axes = params.get("axes", 1)
    cache: dict = {}

    def matrix(b, g, t):
        if (b, t, g) not in cache:
            cache[b, t, g] = comrope_matrix(model.posenc, layer_idx, g, point(coords, axes, b, t))
        return cache[b, t, g]

    return attention_with_matrices(module, hidden, window=native_window(model, layer_idx), matrix=matrix)
