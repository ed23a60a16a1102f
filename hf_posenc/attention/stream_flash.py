"""Attention over values and a stream with the same weights, forward and backward, without
running the forward twice: TAPE's training path on CPU.

With weights ``a = softmax(q k^T * scale + mask)`` (per query head, keys of its KV head) the
call gives ``(a v, a s)`` for the values ``v`` (width Dv) and the stream ``s`` (width S): one
attention over the values ``[v | s]`` (W = Dv + S) in explicit blocks of query rows
(:mod:`.wide_values`), whose score products stay at q's width (torch's fused CPU kernel takes
one width for q, k and v, so it would need q and k zero-padded to W). Its backward takes the
forward's output and log-sum-exp (FlashAttention-2's backward, Dao 2023:
``dS = P * (dO [v|s]^T - rowsum(dO * out))``, one softmax for both), so it is not a second
forward (as :func:`~hf_posenc.core.recompute.recomputed` would run) followed by the backward.

What is kept for backward: q, k, v, the stream (or, for a rotated q / k, what the rotation
rebuilds them from: :func:`~hf_posenc.core.recompute.kernel`), the output and the log-sum-exp
(B, Hq, Tq). The values ``[v | s]`` are rebuilt in backward. The output is laid out per token as
every head's values, then every head's stream (B, Tq, Hq*Dv + Hq*S): both halves are then views
that the layer keeps anyway (the output projection's input, the attended stream), so keeping the
output costs no memory of its own.

Before (to 2026-11-28), the fused CPU flash kernel computed it at width W, q and k zero-padded,
four calls of a quarter of the heads per layer: one layer of the bench's TAPE (8 heads of 32,
T = 2048) 28 ms forward and 72 ms backward there against 23-25 and 58-60 here (:mod:`.wide_values`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ..core.layout import causal_mask_or_none
from ..core.recompute import kernel
from . import wide_values

if TYPE_CHECKING:
    from ..core.memo import ForwardMemo
    from .backend import AttentionCall


def serves(call: AttentionCall) -> bool:
    """Whether the blocked CPU path computes this call: a ``backend=`` choice under which SDPA
    serves (not ``eager``), CPU, fp32/fp64, no bias or explicit-score stage, no dropout, no
    weights asked for, not under ``torch.compile``. Without gradients too: its forward writes
    the output in place, a block of rows at a time (the whole-width SDPA call and the copy into
    this layout held about twice the memory at T=4096)."""
    from .core import SdpaBackend  # here: core imports the backend module, which imports this one

    return (
        call.requested in SdpaBackend.requests
        and call.q.device.type == "cpu"
        and call.q.dtype in (torch.float32, torch.float64)
        and call.bias is None
        and not call.explicit
        and call.dropout_p == 0.0
        and not call.want_weights
        and not torch.compiler.is_compiling()
    )


def attend_with_stream(call: AttentionCall, stream: torch.Tensor) -> torch.Tensor:
    """``(a v, a stream)`` of ``call`` -> (B, Tq, Hq*Dv + Hq*S): per token every head's attended
    values, then every head's attended stream. ``stream`` (B, Hkv, Tk, S)."""
    q_len = call.q.shape[-2]
    inputs = (call.q, call.k, call.v, stream.to(call.v.dtype))
    if q_len <= FEW_QUERIES and not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        with torch.no_grad():
            return _few_queries(*inputs, allowed=call.mask, scale=call.softmax_scale)
    allowed, scale, memo = call.mask, call.softmax_scale, call.score.memo  # mask None: causal, bottom-right
    forward = functools.partial(_forward, allowed=allowed, scale=scale, memo=memo)
    backward = functools.partial(_backward, allowed=allowed, scale=scale, memo=memo)
    return kernel(forward, backward, *inputs)


#: calls of at most this many queries without gradients (decoding steps) attend explicitly: the
#: blocked path's values [v | s] are a copy of the whole cache per step, where the few queries'
#: scores are small
FEW_QUERIES = 16


def _few_queries(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stream: torch.Tensor,
    *,
    allowed: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The same (B, Tq, Hq*Dv + Hq*S) as :func:`_forward`, from explicit scores, the query heads of
    a KV head as a group dimension (no expanded copy of the keys): softmax(q k^T * scale, masked)
    times v and times the stream; a row with no allowed key gives 0, as the blocked path does.
    ``allowed`` (B|1, 1, Tq, Tk) bool, or None: causal, bottom-right aligned. Not the eager core (``core.attend``): it takes one value tensor, so v and the stream would be
    concatenated over the whole cache, the copy this path is for avoiding."""
    b, heads, q_len, d = q.shape
    kv_heads, groups = k.shape[1], heads // k.shape[1]
    grouped = q.view(b, kv_heads, groups, q_len, d)  # (B, Hkv, G, Tq, D)
    scores = torch.matmul(grouped, k[:, :, None].transpose(-1, -2)) * scale  # (B, Hkv, G, Tq, Tk)
    if allowed is None:  # causal, bottom-right aligned: nothing to mask for one query
        allowed = causal_mask_or_none(q_len, k.shape[-2], q.device)
    if allowed is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))  # (B|1, 1, 1, Tq, Tk) broadcast
        weights = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # fully masked rows: 0, not NaN
    parts = [torch.matmul(weights, x[:, :, None]) for x in (v, stream)]  # (B, Hkv, G, Tq, Dv | S)
    # (B, Hkv, G, Tq, X) -> (B, Tq, Hq * X): every head's values, then every head's stream
    flat = [part.flatten(1, 2).transpose(1, 2).flatten(2) for part in parts]
    return torch.cat(flat, dim=-1)


def _parts(flat: torch.Tensor, heads: int, dv: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Tq, Hq*Dv + Hq*S) -> its values and stream parts, (B, Hq, Tq, Dv) and (B, Hq, Tq, S) views."""
    values = flat[..., : heads * dv].unflatten(-1, (heads, dv)).transpose(1, 2)
    stream = flat[..., heads * dv :].unflatten(-1, (heads, s)).transpose(1, 2)
    return values, stream


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stream: torch.Tensor,
    *,
    allowed: torch.Tensor | None,
    scale: float,
    memo: ForwardMemo | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    b, heads, q_len, _ = q.shape
    dv, s = v.shape[-1], stream.shape[-1]
    flat = q.new_empty(b, q_len, heads * (dv + s))  # (B, Tq, Hq*Dv + Hq*S)
    lse = wide_values.forward(q, k, (v, stream), allowed, scale, _parts(flat, heads, dv, s), memo)
    return flat, (flat, lse)


def _backward(
    inputs: list[torch.Tensor],
    saved: tuple[torch.Tensor, ...],
    grad: torch.Tensor,
    *,
    allowed: torch.Tensor | None,
    scale: float,
    memo: ForwardMemo | None = None,
) -> tuple[torch.Tensor, ...]:
    q, k, v, stream = inputs
    flat, lse = saved
    heads, dv, s = q.shape[1], v.shape[-1], stream.shape[-1]
    outputs, grads = _parts(flat, heads, dv, s), _parts(grad.contiguous(), heads, dv, s)
    grad_q, grad_k, (grad_v, grad_stream) = wide_values.backward(
        q, k, (v, stream), allowed, scale, outputs, grads, lse, memo
    )
    return grad_q, grad_k, grad_v, grad_stream
