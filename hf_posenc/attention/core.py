"""The full-matrix attention core: softmax(q k^T * scale + bias, masked) v, and its two backends.

``eager``    the reference: explicit fp32 scores, bias, mask and softmax (returns weights);
             serves every call (the last resort of :func:`~.backend.dispatch`), and the only
             one for ``output_attentions`` and encodings with explicit-score stages unless a
             block backend (``rows.py``) takes them.
``sdpa``     ``torch.nn.functional.scaled_dot_product_attention`` with the whole bias folded
             into a float mask (or ``is_causal`` when there is no bias and no padding).

Masks follow transformers' sdpa convention: a boolean (B,1,Tq,Tk) tensor where True means
"may attend", or ``None`` for a plain causal mask. Query ``i`` of ``Tq`` sits at key index
``Tk - Tq + i`` (bottom-right aligned), which is how a KV cache lays them out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..core.layout import causal_mask, expand_kv_heads, fold_mask
from ..encodings.call import ScoreCall
from .backend import AUTO, AttentionCall, Backend, register_backend


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    softmax_scale: float,
    logits: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "sdpa",
    transform: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
    normalize: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
    folded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B,Hq,Tq,D), k/v (B,Hkv,Tk,D), bias broadcastable to (B,Hq,Tq,Tk) -> (B,Tq,Hq,D).

    ``folded`` is a precomputed float mask (:func:`float_mask`; then ``mask`` and ``bias`` are ignored).
    ``logits`` (B,Hq,Tq,Tk), when given, replaces q.k^T. ``transform(scores, allowed)`` rewrites
    the scaled scores plus bias before masking (``allowed``: the mask applied next, None when
    every key is allowed); ``normalize(scores, allowed)`` replaces the softmax. Any of the
    three needs explicit scores, so the eager path runs.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = expand_kv_heads(k, groups), expand_kv_heads(v, groups)  # (B, Hq, Tk, D)
    q_len, k_len = q.shape[-2], k.shape[-2]
    if folded is not None:  # bias and mask already combined by float_mask (sdpa only)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=folded, dropout_p=dropout_p, scale=softmax_scale
        )
        return out.transpose(1, 2), None
    explicit = backend == "eager" or logits is not None or transform is not None or normalize is not None
    if mask is None and (q_len > 1 or normalize is not None):
        if bias is None and not explicit and q_len == k_len:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True, scale=softmax_scale
            )
            return out.transpose(1, 2), None
        mask = causal_mask(q_len, k_len, q.device)

    if explicit:
        if logits is None:  # a product of its own: scaled in place (its backward reads q and k, not it)
            # in fp32 (fp64 for fp64 inputs): a bf16 product rounded to fp32, an fp64 one kept
            scores = torch.matmul(q, k.transpose(-1, -2))  # (B, Hq, Tq, Tk)
            scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).mul_(softmax_scale)
        else:
            scores = logits * softmax_scale
        if bias is not None:
            scores = scores + bias
        if transform is not None:
            scores = transform(scores, mask)
        if normalize is not None:
            weights = normalize(scores, mask).to(q.dtype)
        else:
            weights = torch.softmax(fold_mask(scores, mask), dim=-1).to(q.dtype)
        weights = F.dropout(weights, p=dropout_p, training=dropout_p > 0)
        return torch.matmul(weights, v).transpose(1, 2), weights

    attn_mask = mask if bias is None else fold_mask(bias.to(q.dtype), mask)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=softmax_scale
    )
    return out.transpose(1, 2), None


def float_mask(bias: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The float SDPA mask of a (B|1, Hq, Tq, Tk) ``bias``: the bias where a key may be attended
    (``mask``, or causal when None), the dtype's minimum elsewhere."""
    q_len, k_len = bias.shape[-2], bias.shape[-1]
    allowed = causal_mask(q_len, k_len, bias.device) if mask is None else mask
    return fold_mask(bias.to(dtype), allowed)


def attend_explicit(
    call: AttentionCall,
    score: ScoreCall,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    backend: str = "eager",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The core over ``score``'s queries and keys with the encoding's score stages: ``logits``
    replacing q.k^T, ``transform_scores`` and ``normalize`` (each given the call with its mask)."""
    encoding, stages = call.encoding, call.stages
    logits = encoding.logits(score) if "logits" in stages else None  # (B, Hq, Tq, Tk)

    def transform(scores: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        return encoding.transform_scores(score.with_allowed(allowed), scores)

    def normalize(scores: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        return encoding.normalize(score.with_allowed(allowed), scores)

    return attend(
        score.q,
        score.k,
        v,
        mask=mask,
        bias=bias,
        logits=logits,
        softmax_scale=call.softmax_scale,
        dropout_p=call.dropout_p,
        backend=backend,
        transform=transform if "transform_scores" in stages else None,
        normalize=normalize if "normalize" in stages else None,
    )


def dense_bias(call: AttentionCall) -> torch.Tensor | None:
    """The call's score bias as one (B|1, Hq, Tq, Tk) matrix (once per forward when every layer shares it)."""
    bias, memo = call.bias, call.score.memo
    if bias is None:
        return None
    if memo.holds(bias):  # a memoised bias (alibi, sandwich) is shared by every layer
        return memo.get(("dense_bias", id(bias)), bias.full)
    return bias.full()


@register_backend
class EagerBackend(Backend):
    """Explicit fp32 scores: serves every call."""

    name = "eager"
    priority = 0
    requests = frozenset({AUTO, "sdpa", "chunked", "flex", "eager"})
    selectable = True

    def serves(self, call: AttentionCall) -> bool:
        return True

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        return attend_explicit(call, call.score, call.v, call.mask, dense_bias(call))


@register_backend
class SdpaBackend(Backend):
    """One SDPA call with the whole bias folded into a float mask: calls without explicit scores."""

    name = "sdpa"
    priority = 10
    requests = frozenset({AUTO, "sdpa", "chunked", "flex"})
    selectable = True

    def serves(self, call: AttentionCall) -> bool:
        return not call.explicit and not call.want_weights

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias, memo, mask, dtype = dense_bias(call), call.score.memo, call.mask, call.q.dtype
        folded = None
        if bias is not None and memo.holds(bias) and not bias.requires_grad:
            # a memoised grad-free bias is shared by every layer: fold it with the mask once
            key = ("folded_mask", id(bias), id(mask), dtype)
            folded = memo.get(key, lambda: float_mask(bias, mask, dtype))
        return attend(
            call.q,
            call.k,
            call.v,
            mask=mask,
            bias=bias,
            softmax_scale=call.softmax_scale,
            dropout_p=call.dropout_p,
            backend="sdpa",
            folded=folded,
        )
