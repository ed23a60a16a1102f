"""LieRE (Ostmeier et al. 2024, "LieRE: Generalizing Rotary Position Encodings"; reference
StanfordMIMI/LieRE): q and k of token t are mapped by R(t) = exp(t A), A = U - U^T a learned
skew-symmetric, block-diagonal generator per layer and KV head, as an explicit (D, D) matrix
built from the raw generators' strict upper triangles.
"""

from __future__ import annotations

import functools

import torch

from .attention import attention_with_matrices
from .config import native_window


def liere_matrices(posenc, layer: int, head_dim: int):
    """LieRE: R(t) = exp(t A), A = U - U^T from the raw generators' strict upper triangle; block n's
    local index a is pair (n*b + a) // 2 of the Llama layout, member (n*b + a) % 2 -> dim i or i + d/2."""
    cfg = posenc.config
    rot = int(head_dim * cfg.partial_rotary_factor)
    b = cfg.block_size
    raw = posenc.generators.detach().double()[0 if cfg.shared_across_layers else layer]  # (H, 1, nb, b, b)

    def original(index: int) -> int:
        return index // 2 + (index % 2) * (rot // 2)

    @functools.cache
    def matrix(g: int, t: int) -> torch.Tensor:
        blocks = raw[0 if cfg.shared_across_heads else g, 0]
        generator = torch.zeros(head_dim, head_dim, dtype=torch.float64)
        for n in range(rot // b):
            for a in range(b):
                for c in range(a + 1, b):
                    x, y = original(n * b + a), original(n * b + c)
                    generator[x, y] += float(blocks[n, a, c])
                    generator[y, x] -= float(blocks[n, a, c])
        return torch.linalg.matrix_exp(t * generator)

    return matrix


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64: softmax((R(i) q_i).(R(j) k_j) * scale) v with explicit matrices."""
    matrix = liere_matrices(model.posenc, layer_idx, module.head_dim)
    return attention_with_matrices(
        module, hidden, window=native_window(model, layer_idx), matrix=lambda b, g, t: matrix(g, t)
    )
