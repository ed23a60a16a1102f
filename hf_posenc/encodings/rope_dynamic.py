"""Causal dynamic NTK RoPE: each query uses the frequencies for its own length.

Dynamic NTK (``scaling={'type': 'dynamic'}``) stretches the RoPE base once a sequence
outgrows the original context L0:

    theta(L) = theta * (factor * L / L0 - (factor - 1))^(d/(d-2))   for L > L0, else theta

Here L = p + 1 for the query at position p, so a token's representation never depends on
later tokens and decoding with a KV cache (raw keys cached, rotated per step) is exact.
For a query at p with frequencies omega(p), the rotary logit with the key at position s is

    <R(p, omega(p)) q, R(s, omega(p)) k>

which is plain RoPE for every query with p + 1 <= L0. Those rows use one rotation and a
matmul; only queries past L0 need a per-query rotation of the keys, done in chunks.
"""

from __future__ import annotations

import torch

from ..core.layout import expand_kv_heads
from .rope_scaling import base_inv_freq

QUERY_CHUNK = 16


def _rotate_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2*F dims of x (..., D) by angles (..., F), Llama pair layout (i, i+F)."""
    half = angles.shape[-1]
    cos, sin = angles.cos(), angles.sin()
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def _inv_freq_for_lengths(
    lengths: torch.Tensor, theta: float, dim: int, factor: float, original: int
) -> torch.Tensor:
    """lengths (N,) -> inv_freq (N, dim/2) fp32: theta(L)^(-2i/dim) per row."""
    stretch = (factor * lengths.double() / original - (factor - 1)).clamp(min=1.0)
    bases = theta * stretch ** (dim / (dim - 2))  # (N,)
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=lengths.device) / dim  # (dim/2,)
    return 1.0 / (bases[:, None] ** exponents)


def causal_dynamic_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    *,
    theta: float,
    dim: int,
    factor: float,
    original: int,
) -> torch.Tensor:
    """q (B,Hq,Tq,D), k (B,Hkv,Tk,D) un-rotated, positions (B,Tq), (B,Tk) -> logits (B,Hq,Tq,Tk).

    Computed in fp32 (fp64 for an fp64 model)."""
    groups = q.shape[1] // k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k = q.to(dtype), k.to(dtype)
    k = expand_kv_heads(k, groups)  # (B, Hq, Tk, D)

    inv_freq = base_inv_freq(dim, theta, q.device).to(dtype)  # (dim/2,)
    q_plain = _rotate_pairs(q, q_positions[:, None, :, None].to(dtype) * inv_freq)
    k_plain = _rotate_pairs(k, k_positions[:, None, :, None].to(dtype) * inv_freq)
    logits = torch.matmul(q_plain, k_plain.transpose(-1, -2))  # (B, Hq, Tq, Tk)

    if torch.compiler.is_compiling():  # nonzero's count is data-dependent: every query, then chosen
        return _all_queries_dynamic(q, k, q_positions, k_positions, logits, theta, dim, factor, original)
    rows, cols = torch.nonzero(q_positions + 1 > original, as_tuple=True)  # queries past L0
    for start in range(0, rows.numel(), QUERY_CHUNK):
        b, i = rows[start : start + QUERY_CHUNK], cols[start : start + QUERY_CHUNK]  # (N,)
        freqs = _inv_freq_for_lengths(q_positions[b, i] + 1, theta, dim, factor, original)  # (N, dim/2) fp64
        q_rows = _rotate_pairs(q[b, :, i], (q_positions[b, i, None] * freqs).to(dtype)[:, None])  # (N, Hq, D)
        key_angles = (k_positions[b][:, :, None] * freqs[:, None, :]).to(dtype)  # (N, Tk, dim/2)
        k_rows = _rotate_pairs(k[b], key_angles[:, None])  # (N, Hq, Tk, D)
        logits[b, :, i] = torch.einsum("nhd,nhkd->nhk", q_rows, k_rows)
    return logits


def _all_queries_dynamic(
    q: torch.Tensor,
    k: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    plain: torch.Tensor,
    theta: float,
    dim: int,
    factor: float,
    original: int,
) -> torch.Tensor:
    """:func:`causal_dynamic_logits` with fixed shapes (torch.compile): every query's logits with
    the frequencies of its own length, kept where the query is past L0 (``plain`` elsewhere).
    q (B,Hq,Tq,D), k (B,Hq,Tk,D) expanded, ``plain`` (B,Hq,Tq,Tk) -> (B,Hq,Tq,Tk)."""
    batch, _, q_len, _ = q.shape
    dtype = plain.dtype
    blocks = []
    for start in range(0, q_len, QUERY_CHUNK):  # q_len is static: a fixed number of blocks
        positions = q_positions[:, start : start + QUERY_CHUNK]  # (B, n)
        n = positions.shape[1]
        freqs = _inv_freq_for_lengths((positions + 1).reshape(-1), theta, dim, factor, original)
        freqs = freqs.view(batch, n, -1)  # (B, n, dim/2) fp64
        q_rows = _rotate_pairs(q[:, :, start : start + n], (positions[..., None] * freqs).to(dtype)[:, None])
        key_angles = (k_positions[:, None, :, None] * freqs[:, :, None, :]).to(dtype)  # (B, n, Tk, dim/2)
        k_rows = _rotate_pairs(k[:, None], key_angles[:, :, None])  # (B, n, Hq, Tk, D)
        blocks.append(torch.einsum("bhnd,bnhkd->bhnk", q_rows, k_rows))  # (B, Hq, n, Tk)
    dynamic = torch.cat(blocks, dim=2)
    past_original = (q_positions + 1 > original)[:, None, :, None]  # (B, 1, Tq, 1)
    return torch.where(past_original, dynamic, plain)
