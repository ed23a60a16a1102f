"""The one attention core: softmax(q k^T * scale + bias, masked) v, and its backends.

``eager``    the reference: explicit fp32 scores, bias, mask and softmax (returns weights).
``sdpa``     ``torch.nn.functional.scaled_dot_product_attention`` with the whole bias folded
             into a float mask (or ``is_causal`` when there is no bias and no padding).
``chunked``  SDPA over query blocks, causal keys only, the bias built per block
             (``chunked.py``) — for encodings that give their bias as a ``BlockBias``.
``flex``     FlexAttention ``score_mod`` (``flex.py``), for the same encodings.
``auto``     (default) ``chunked`` on CPU, fused kernels (``kernels.py``) / ``flex`` first on CUDA, for
             encodings with a ``BlockBias``; ``sdpa`` for every other encoding.

Masks follow transformers' sdpa convention: a boolean (B,1,Tq,Tk) tensor where True means
"may attend", or ``None`` for a plain causal mask. Query ``i`` of ``Tq`` sits at key index
``Tk - Tq + i`` (bottom-right aligned), which is how a KV cache lays them out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "sdpa", "chunked", "flex", "eager")


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, T, D) -> (B, Hkv*groups, T, D), each KV head serving ``groups`` query heads."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """(1, 1, Tq, Tk) bool, bottom-right aligned causal mask."""
    q_index = torch.arange(k_len - q_len, k_len, device=device)
    return (torch.arange(k_len, device=device)[None, :] <= q_index[:, None])[None, None]


def fold_mask(
    bias: torch.Tensor, mask: torch.Tensor | None, q_len: int, k_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """The float SDPA mask: ``bias`` where a key may be attended, the dtype's minimum elsewhere."""
    if mask is None:
        mask = causal_mask(q_len, k_len, bias.device)
    return bias.to(dtype).masked_fill(~mask, torch.finfo(dtype).min)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    scaling: float,
    logits: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "sdpa",
    transform: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
    normalize: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    folded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B,Hq,Tq,D), k/v (B,Hkv,Tk,D), bias broadcastable to (B,Hq,Tq,Tk) -> (B,Tq,Hq,D).

    ``folded`` is a precomputed :func:`fold_mask` (then ``mask`` and ``bias`` are ignored).
    ``logits`` (B,Hq,Tq,Tk), when given, replaces q.k^T. ``transform(scores, allowed)`` rewrites
    the scaled scores plus bias before masking (``allowed``: the mask applied next, None when
    every key is allowed); ``normalize(scores, allowed)`` replaces the softmax. Any of the
    three needs explicit scores, so the eager path runs.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    q_len, k_len = q.shape[-2], k.shape[-2]
    if folded is not None:  # bias and mask already combined by fold_mask (sdpa only)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=folded, dropout_p=dropout_p, scale=scaling)
        return out.transpose(1, 2), None
    explicit = backend == "eager" or logits is not None or transform is not None or normalize is not None
    if mask is None and (q_len > 1 or normalize is not None):
        if bias is None and not explicit and q_len == k_len:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scaling)
            return out.transpose(1, 2), None
        mask = causal_mask(q_len, k_len, q.device)

    if explicit:
        if logits is None:
            logits = torch.matmul(q, k.transpose(-1, -2)).float()
        scores = logits * scaling  # (B, Hq, Tq, Tk)
        if bias is not None:
            scores = scores + bias
        if transform is not None:
            scores = transform(scores, mask)
        if normalize is not None:
            weights = normalize(scores, mask).to(q.dtype)
        else:
            if mask is not None:
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            weights = torch.softmax(scores, dim=-1).to(q.dtype)
        weights = F.dropout(weights, p=dropout_p, training=dropout_p > 0)
        return torch.matmul(weights, v).transpose(1, 2), weights

    attn_mask = mask
    if bias is not None:
        attn_mask = bias.to(q.dtype)
        if mask is not None:
            attn_mask = attn_mask.masked_fill(~mask, torch.finfo(q.dtype).min)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scaling)
    return out.transpose(1, 2), None
