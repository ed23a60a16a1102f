"""Attention over values and a stream with the same weights, on torch's fused CPU flash kernel,
forward and backward, without running the forward twice: TAPE's training path on CPU.

With weights ``a = softmax(q k^T * scale + mask)`` (per query head, keys of its KV head) the
call gives ``(a v, a s)`` for the values ``v`` (width Dv) and the stream ``s`` (width S). The fused
kernel wants q, k and its values of one width, so the values are ``[v | s]`` (W = Dv + S) and q,
k are zero-padded to W: every score is the same sum (the added products are exact zeros). Its
backward operator takes the forward's output and log-sum-exp (FlashAttention-2's backward, Dao
2023: ``dS = P * (dO [v|s]^T - rowsum(dO * out))``, one softmax for both), so the backward is
one fused call too, not a second forward (as :func:`~hf_posenc.core.recompute.recomputed` would
run) followed by the backward.

What is kept for backward: q, k, v, the stream (or, for a rotated q / k, what the rotation
rebuilds them from: :func:`~hf_posenc.core.recompute.kernel`), the output and the log-sum-exp
(B, Hq, Tq). The padded q, k and the widened values are rebuilt in backward. The output is laid
out per token as every head's values, then every head's stream (B, Tq, Hq*Dv + Hq*S): both
halves are then views that the layer keeps anyway (the output projection's input, the attended
stream), so keeping the output costs no memory of its own.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ..core.layout import causal_mask, causal_mask_or_none, expand_kv_heads
from ..core.recompute import kernel
from .softmax_parts import CPU_FLASH, CPU_FLASH_BACKWARD

if TYPE_CHECKING:
    from .backend import AttentionCall

#: kernel calls per layer (fewer where there are fewer KV heads): see :func:`_head_chunks`
HEAD_CHUNKS = 4


def serves(call: AttentionCall) -> bool:
    """Whether the fused CPU kernel computes this call: a ``backend=`` choice under which SDPA
    serves (not ``eager``), CPU, fp32/fp64, no bias or explicit-score stage, no dropout, no
    weights asked for, not under ``torch.compile``. Without gradients too: its forward writes
    the output in place, a quarter of the heads at a time (the whole-width SDPA call and the
    copy into this layout held about twice the memory at T=4096)."""
    from .core import SdpaBackend  # here: core imports the backend module, which imports this one

    return (
        call.requested in SdpaBackend.requests
        and CPU_FLASH is not None
        and CPU_FLASH_BACKWARD is not None
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
    q_len, k_len = call.q.shape[-2], call.k.shape[-2]
    inputs = (call.q, call.k, call.v, stream.to(call.v.dtype))
    if q_len <= FEW_QUERIES and not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        with torch.no_grad():
            return _few_queries(*inputs, allowed=call.mask, scale=call.softmax_scale)
    causal = call.mask is None and q_len == k_len  # (the kernel's is_causal is top-left aligned)
    allowed = (
        None if causal else (causal_mask(q_len, k_len, call.q.device) if call.mask is None else call.mask)
    )
    forward = functools.partial(_forward, allowed=allowed, scale=call.softmax_scale)
    backward = functools.partial(_backward, allowed=allowed, scale=call.softmax_scale)
    return kernel(forward, backward, *inputs)


#: calls of at most this many queries without gradients (decoding steps) attend explicitly: the
#: fused kernel's widened copies (the cached keys padded to W, [v | s]) cost a pass over the whole
#: cache per step, where the few queries' scores are small
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
    times v and times the stream; a row with no allowed key gives 0, as the fused kernel does.
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


def _additive(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """(B|1, 1, Tq, Tk) bool -> 0 where allowed, -inf elsewhere (SDPA's own reading of a boolean
    mask: a row with no allowed key gives a zero output)."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def _widened(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stream: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's inputs of one width W = max(D, Dv + S): q (B,Hq,Tq,W), k and [v | s] (B,Hq,Tk,W)."""
    groups = q.shape[1] // k.shape[1]
    width = max(q.shape[-1], v.shape[-1] + stream.shape[-1])
    values = torch.cat((v, stream), dim=-1) if stream.shape[-1] else v  # (B, Hkv, Tk, Dv + S)
    q, k, values = (_padded(x, width) if x.shape[-1] < width else x for x in (q, k, values))
    return q, expand_kv_heads(k, groups), expand_kv_heads(values, groups)


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (..., D) -> (..., width), zeros past D: only the padding is zero-filled (``F.pad`` fills
    the whole output, then copies x over it)."""
    out = x.new_empty(*x.shape[:-1], width)
    out[..., : x.shape[-1]] = x
    out[..., x.shape[-1] :].zero_()
    return out


def _head_chunks(kv_heads: int, groups: int) -> list[tuple[slice, slice]]:
    """(query heads, KV heads) of each kernel call: whole KV heads with their query heads, in
    :data:`HEAD_CHUNKS` calls, so the widened copies of one call (padded q and k, [v | s], and
    in backward the widened output, its gradient and the kernel's three gradients, all W wide)
    are a fraction of one layer's heads, not all of them at once (the peak of a training step
    is one layer's backward beside what the step keeps)."""
    size = -(-kv_heads // HEAD_CHUNKS)
    return [
        (slice(h * groups, min(h + size, kv_heads) * groups), slice(h, min(h + size, kv_heads)))
        for h in range(0, kv_heads, size)
    ]


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stream: torch.Tensor,
    *,
    allowed: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    assert CPU_FLASH is not None
    b, heads, q_len, _ = q.shape
    dv, s = v.shape[-1], stream.shape[-1]
    mask = _additive(allowed, q.dtype)
    flat = q.new_empty(b, q_len, heads * (dv + s))  # (B, Tq, Hq*Dv + Hq*S)
    values_of = flat[..., : heads * dv].unflatten(-1, (heads, dv))  # (B, Tq, Hq, Dv), views
    stream_of = flat[..., heads * dv :].unflatten(-1, (heads, s))  # (B, Tq, Hq, S)
    lse = q.new_empty(b, heads, q_len)
    for qh, kh in _head_chunks(k.shape[1], heads // k.shape[1]):
        wide_q, wide_k, values = _widened(q[:, qh], k[:, kh], v[:, kh], stream[:, kh])
        out, lse[:, qh] = CPU_FLASH(wide_q, wide_k, values, 0.0, allowed is None, attn_mask=mask, scale=scale)
        values_of[:, :, qh] = out[..., :dv].transpose(1, 2)  # (B, Tq, h, Dv)
        stream_of[:, :, qh] = out[..., dv : dv + s].transpose(1, 2)
        # freed before the next chunk's widened copies are made, not held beside them
        del wide_q, wide_k, values, out
    return flat, (flat, lse)


def _backward(
    inputs: list[torch.Tensor],
    saved: tuple[torch.Tensor, ...],
    grad: torch.Tensor,
    *,
    allowed: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, ...]:
    assert CPU_FLASH_BACKWARD is not None
    q, k, v, stream = inputs
    flat, lse = saved
    d, dv, s = q.shape[-1], v.shape[-1], stream.shape[-1]
    heads, kv_heads = q.shape[1], k.shape[1]
    groups = heads // kv_heads
    mask = _additive(allowed, q.dtype)
    dq, dk, dvv, ds = (torch.empty_like(x) for x in (q, k, v, stream))
    for qh, kh in _head_chunks(kv_heads, groups):
        wide_q, wide_k, values = _widened(q[:, qh], k[:, kh], v[:, kh], stream[:, kh])
        width, count = wide_q.shape[-1], qh.stop - qh.start
        out, grad_out = (_unflattened(x, heads, qh, dv, s, width) for x in (flat, grad))  # (B, h, Tq, W)
        dq_h, dk_h, dvalues = CPU_FLASH_BACKWARD(
            grad_out,
            wide_q,
            wide_k,
            values,
            out,
            lse[:, qh],
            0.0,
            allowed is None,
            attn_mask=mask,
            scale=scale,
        )
        del out, grad_out, wide_q, wide_k, values
        if groups > 1:  # (B, h, Tk, W) -> (B, h / groups, Tk, W): a KV head's query heads summed
            dk_h, dvalues = (x.unflatten(1, (count // groups, groups)).sum(2) for x in (dk_h, dvalues))
        dq[:, qh], dk[:, kh] = dq_h[..., :d], dk_h[..., :d]
        dvv[:, kh], ds[:, kh] = dvalues[..., :dv], dvalues[..., dv : dv + s]
    return dq, dk, dvv, ds


def _unflattened(x: torch.Tensor, heads: int, qh: slice, dv: int, s: int, width: int) -> torch.Tensor:
    """The query heads ``qh`` of (B, Tq, Hq*Dv + Hq*S) -> (B, h, Tq, W) (zero past Dv + S), laid
    out as (B, Tq, h, W)."""
    b, q_len, _ = x.shape
    count = qh.stop - qh.start
    make = x.new_zeros if width > dv + s else x.new_empty
    wide = make(b, q_len, count, width)
    wide[..., :dv] = x[..., : heads * dv].unflatten(-1, (heads, dv))[:, :, qh]
    wide[..., dv : dv + s] = x[..., heads * dv :].unflatten(-1, (heads, s))[:, :, qh]
    return wide.transpose(1, 2)
