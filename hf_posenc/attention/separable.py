"""A separable bias ``u_i - w_j`` (FoX's c_i - c_j) on the chunked backend: one more feature of q and k.

The query term is constant along each softmax row, so it changes no weight: a block of
queries adds ``r - w_j`` to its scores, with ``r`` the query term of its last query (so the
added values stay small where the weights are; for FoX ``r - w_j`` is the log-forgetting
between key j and the block's end, <= 0). That term rides in the scores as

    q' = (q, 1),   k' = (k, (r - w_j) / scale),   v' = (v, 0)

and each block of queries is one fused SDPA call whose mask is only the causal/padding one,
(B|1, 1, rows, keys) instead of a (B, Hq, rows, keys) bias. Without a padding mask the keys go
in reverse order (reversed key b holds key Tk-1-b), so the causal mask is a strided view of
one line (the dtype's minimum, then zeros). All blocks share one (B, Hq, Tk, D+1) copy of the
keys, each writing its own feature column before its call.

Training on CPU (:func:`_forward`, :func:`_backward`): forward keeps each block's log-sum-exp
from SDPA's fused CPU kernel, and backward calls that kernel's backward per block with the
block's feature column written again: nothing (B, Hq, rows, keys) is kept, q, k, v, the terms
and the output are O(T) (what native SDPA keeps: q, k, v, output, log-sum-exp), and no block's
forward runs twice (activation checkpointing ran each twice, 1.3x the CPU training time). The
pair runs as one :func:`~hf_posenc.core.recompute.kernel`: a q, k or v made by an encoding's
recomputed step (FoX Pro's token shift and QK-norm) is kept as that step's inputs and rebuilt
before the kernel's backward, not the whole attention run again in backward
(:func:`~.backend.dispatch_chained`, which cost FoX Pro one more forward of every attention
per training step). The gradient
of the feature column gives the bias terms' gradients: d w_j = -d k'_j[D] / scale, and
d r = sum_j d k'_j[D] / scale. Elsewhere (other devices, dropout, torch.compile) each block is
recomputed in backward (activation checkpointing). fp32/fp64 only (in bf16/fp16 the key term
would be rounded to 8/11 bits).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..core.layout import causal_keys, expand_kv_heads
from ..core.recompute import kernel
from ..encodings.block_bias import SeparableBias
from .softmax_parts import CPU_FLASH, CPU_FLASH_BACKWARD

_CPU_FORWARD, _CPU_BACKWARD = CPU_FLASH, CPU_FLASH_BACKWARD


class _Blocks:
    """The per-call layout shared by forward and backward: keys/values with the extra feature
    (reversed without a padding mask), each block's keys and its additive causal/padding mask."""

    def __init__(
        self,
        q_len: int,
        k_len: int,
        mask: torch.Tensor | None,
        spans: list[tuple[int, int]],
        firsts: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.q_len, self.k_len, self.mask, self.spans, self.firsts = q_len, k_len, mask, spans, firsts
        self.dtype, self.device = dtype, device
        self.minimum = torch.finfo(dtype).min
        self.longest = max(stop - start for start, stop in spans)
        self.reversed = mask is None
        # one line for every block's causal mask over the reversed keys: minimum, then zeros
        self.causal_line = torch.cat(
            (
                torch.full((self.longest - 1,), self.minimum, dtype=dtype, device=device),
                torch.zeros(k_len, dtype=dtype, device=device),
            )
        )

    def keys(self, index: int) -> slice:
        """The keys (in the stored order) block ``index`` may attend."""
        start, stop = self.spans[index]
        if self.reversed:
            return slice(self.q_len - stop, self.k_len)  # reversed keys first .. Tk-1
        return slice(self.firsts[index], causal_keys(self.q_len, self.k_len, stop))

    def additive(self, index: int) -> torch.Tensor:
        """(B|1, 1, rows, keys) float mask of block ``index``."""
        start, stop = self.spans[index]
        rows, keys = stop - start, self.keys(index)
        if self.mask is None:  # query a may attend reversed key b iff a + b >= rows - 1
            width = keys.stop - keys.start
            return self.causal_line.as_strided((1, 1, rows, width), (0, 0, 1, 1), self.longest - rows)
        allowed = self.mask[..., start:stop, keys]
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(
            ~allowed, self.minimum
        )

    def write_column(
        self, index: int, keys: torch.Tensor, query_term: torch.Tensor, key_term: torch.Tensor, scale: float
    ) -> None:
        """Block ``index``'s feature (r - w_j) / scale into the last column of ``keys`` (B, Hq, Tk, D+1)."""
        stop = self.spans[index][1]
        reference = query_term[..., stop - 1, None]  # (B, Hq, 1)
        span = self.keys(index)
        keys[:, :, span, -1] = ((reference - key_term[..., span]) / scale).to(keys.dtype)


def _feature_keys_values(
    k: torch.Tensor, v: torch.Tensor, blocks: _Blocks, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v (B, Hkv, Tk, D) -> the kernel pair's keys and values (B, Hq, Tk, D+1), stored order."""
    return _with_feature(expand_kv_heads(k, groups), blocks), _with_feature(
        expand_kv_heads(v, groups), blocks
    )


def _ordered(x: torch.Tensor, blocks: _Blocks, dim: int) -> torch.Tensor:
    return x.flip(dim) if blocks.reversed else x


def _with_feature(x: torch.Tensor, blocks: _Blocks, value: float = 0.0) -> torch.Tensor:
    """(B, H, T, D) -> (B, H, T, D+1) in the stored key order, the extra feature ``value``."""
    out = x.new_full((*x.shape[:-1], x.shape[-1] + 1), value)
    out[..., :-1] = _ordered(x, blocks, 2)
    return out


def kernel_serves(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether a call takes the fused CPU kernel forward and backward (:func:`_forward`,
    :func:`_backward` through :func:`~hf_posenc.core.recompute.kernel`): with gradients, on CPU,
    without dropout, where this torch has the fused kernel and its backward, not under
    torch.compile."""
    return (
        torch.is_grad_enabled()
        and q.device.type == "cpu"
        and dropout_p == 0.0
        and _CPU_FORWARD is not None
        and _CPU_BACKWARD is not None
        and not torch.compiler.is_compiling()
    )


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_term: torch.Tensor,
    key_term: torch.Tensor,
    *,
    blocks: _Blocks,
    scale: float,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Blocks of SDPA's fused CPU kernel with the separable bias as a feature: q (B, Hq, Tq, D),
    k/v (B, Hkv, Tk, D), query_term (B, Hq, Tq), key_term (B, Hq, Tk) -> ((B, Hq, Tq, D) laid out
    as (B, Tq, Hq, D), which o_proj reads without a copy; kept for backward: that output and each
    block's log-sum-exp, (B, Hq, rows) fp32)."""
    assert _CPU_FORWARD is not None
    groups = q.shape[1] // k.shape[1]
    keys, values = _feature_keys_values(k, v, blocks, groups)  # (B, Hq, Tk, D+1), stored order
    ordered_key_term = _ordered(key_term, blocks, -1)
    batch, heads, q_len, dim = q.shape
    out = q.new_empty(batch, q_len, heads, dim).transpose(1, 2)  # (B, Hq, Tq, D)
    lse = []
    for index, (start, stop) in enumerate(blocks.spans):
        span = blocks.keys(index)
        blocks.write_column(index, keys, query_term, ordered_key_term, scale)
        q_block = F.pad(q[:, :, start:stop], (0, 1), value=1.0)  # (B, Hq, rows, D+1)
        out_block, lse_block = _CPU_FORWARD(
            q_block,
            keys[:, :, span],
            values[:, :, span],
            0.0,
            False,
            attn_mask=blocks.additive(index),
            scale=scale,
        )
        out[:, :, start:stop] = out_block[..., :-1]
        lse.append(lse_block)  # (B, Hq, rows) fp32
    return out, (out, *lse)


def _backward(
    inputs: list[torch.Tensor],
    saved: tuple[torch.Tensor, ...],
    grad_out: torch.Tensor,
    *,
    blocks: _Blocks,
    scale: float,
) -> tuple[torch.Tensor, ...]:
    """The gradients of q, k, v and the two terms: per block the fused kernel's backward from the
    kept output and log-sum-exp, the block's feature column written again into the (D+1)-wide
    copies built here once more (two O(T) copies)."""
    assert _CPU_BACKWARD is not None
    q, k, v, query_term, key_term = inputs
    out, *lse = saved
    groups = q.shape[1] // k.shape[1]
    keys, values = _feature_keys_values(k, v, blocks, groups)  # (B, Hq, Tk, D+1), stored order
    ordered_key_term = _ordered(key_term, blocks, -1)
    grad_q = torch.zeros_like(q)
    grad_keys = torch.zeros_like(keys)
    grad_values = torch.zeros_like(values)
    grad_query_term = torch.zeros_like(query_term)
    pad = (0, 1)
    for index, (start, stop) in enumerate(blocks.spans):
        span = blocks.keys(index)
        blocks.write_column(index, keys, query_term, ordered_key_term, scale)
        dq, dk, dv = _CPU_BACKWARD(
            F.pad(grad_out[:, :, start:stop], pad),
            F.pad(q[:, :, start:stop], pad, value=1.0),
            keys[:, :, span],
            values[:, :, span],
            F.pad(out[:, :, start:stop], pad),
            lse[index],
            0.0,
            False,
            attn_mask=blocks.additive(index),
            scale=scale,
        )
        grad_q[:, :, start:stop] = dq[..., :-1]
        grad_keys[:, :, span] += dk
        grad_values[:, :, span] += dv
        # the column is (r - w_j) / scale, r the query term of the block's last query
        grad_query_term[..., stop - 1] += dk[..., -1].sum(-1).to(query_term.dtype) / scale
    grad_key_term = -grad_keys[..., -1].to(key_term.dtype) / scale  # (B, Hq, Tk), stored order
    grad_k, grad_v = (_ordered(g[..., :-1], blocks, 2) for g in (grad_keys, grad_values))  # (B, Hq, Tk, D)
    if groups > 1:  # a KV head's query heads summed
        grad_k, grad_v = (g.unflatten(1, (-1, groups)).sum(2) for g in (grad_k, grad_v))
    return grad_q, grad_k, grad_v, grad_query_term, _ordered(grad_key_term, blocks, -1)


def attend_separable(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: SeparableBias,
    mask: torch.Tensor | None,
    softmax_scale: float,
    dropout_p: float,
    spans: list[tuple[int, int]],
    firsts: list[int],
) -> torch.Tensor:
    """Attention with a separable bias ``u_i - w_j`` as one more feature of q and k (see the
    module docstring). q (B, Hq, T, D), k, v (B, Hkv, T, D), a causal/padding ``mask`` (B|1, 1,
    Tq, Tk) bool or None, query blocks ``spans`` with their first keys ``firsts`` -> (B, Tq, Hq, D)."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    blocks = _Blocks(q_len, k_len, mask, spans, firsts, q.dtype, q.device)
    if kernel_serves(q, dropout_p):
        forward = functools.partial(_forward, blocks=blocks, scale=softmax_scale)
        backward = functools.partial(_backward, blocks=blocks, scale=softmax_scale)
        return kernel(forward, backward, q, k, v, bias.query_term, bias.key_term).transpose(1, 2)
    grad = torch.is_grad_enabled()
    groups = q.shape[1] // k.shape[1]
    k, v = expand_kv_heads(k, groups), expand_kv_heads(v, groups)  # (B, Hq, Tk, D)

    key_term = _ordered(bias.key_term, blocks, -1)
    # without gradients every block writes its feature into one (B, Hq, Tk, D+1) copy of the keys
    # and reads one padded copy of the values; with gradients (off CPU, or with dropout) each
    # block builds its own and is recomputed in backward (activation checkpointing): SDPA would
    # otherwise keep every block's (B, Hq, keys, D+1) keys, O(Tq * Tk / block) values per layer,
    # and with a padding mask every block's additive mask, O(Tq * Tk)
    shared = None if grad else (_with_feature(k, blocks), _with_feature(v, blocks))
    k, v = _ordered(k, blocks, 2), _ordered(v, blocks, 2)

    def one_block(q_block: torch.Tensor, index: int) -> torch.Tensor:
        span = blocks.keys(index)
        if shared is not None:
            keys, values = shared
            blocks.write_column(index, keys, bias.query_term, key_term, softmax_scale)
            keys, values = keys[:, :, span], values[:, :, span]
        else:
            stop = blocks.spans[index][1]
            reference = bias.query_term[..., stop - 1, None]  # (B, Hq, 1)
            column = ((reference - key_term[..., span]) / softmax_scale).to(q.dtype)  # (B, Hq, keys)
            keys = torch.cat((k[:, :, span], column[..., None]), dim=-1)  # (B, Hq, keys, D+1)
            values = F.pad(v[:, :, span], (0, 1))
        out = F.scaled_dot_product_attention(
            F.pad(q_block, (0, 1), value=1.0),  # (B, Hq, rows, D+1)
            keys,
            values,
            attn_mask=blocks.additive(index),
            dropout_p=dropout_p,
            scale=softmax_scale,
        )  # (B, Hq, rows, D+1)
        return out[..., :-1]

    recompute = grad and len(spans) > 1
    outputs = []
    for index, (start, stop) in enumerate(spans):
        q_block = q[:, :, start:stop]
        if recompute:
            outputs.append(checkpoint(one_block, q_block, index, use_reentrant=False))
        else:
            outputs.append(one_block(q_block, index))
    return torch.cat(outputs, dim=2).transpose(1, 2)
