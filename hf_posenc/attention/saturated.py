"""The saturated backend: causal attention with a distance bias that is constant from a distance W
on (:class:`~hf_posenc.encodings.block_bias.SaturatingDistanceBias`, T5's last bucket), as one
fused causal call for the far pairs and an explicit band for the near ones, merged by log-sum-exp.

For queries and keys of one sequence (Tq = Tk = T, no padding mask) and the bias
``b_h(d) = near[h, d]`` for ``d = i - j < W``, ``c_h = tail[h]`` for ``d >= W``:

- far part, the pairs ``i - j >= W``: queries W .. T-1 over keys 0 .. T-W-1, which is plain causal
  attention with the query index shifted by W (``j <= i - W``: a square, top-left causal call).
  Its bias is the per-head constant c_h, which does not change its softmax: one call of torch's
  fused CPU flash-attention kernel with ``is_causal`` gives ``out_far`` and ``lse_far``, and the
  part's log-sum-exp with the bias is ``lse_far + c_h``;
- near band, the pairs ``0 <= i - j < W``: per block of :data:`BAND_BLOCK` queries ``[s, e)`` the keys
  ``s - W + 1 .. e - 1`` with the float mask ``near[h, i - j]`` inside the band, -inf outside.
  Key ``s - W + 1 + b`` of query ``s + a`` is at distance ``a - b + W - 1`` whatever ``s``, so one
  (Hq, block, block + W - 1) mask serves every block;

merged exactly: ``lse = log(exp(lse_near) + exp(lse_far + c))``, ``out = sum_p exp(lse_p - lse) out_p``
(queries below W have no far part).

Backward (FlashAttention-2's, Dao 2023, Algorithm 2, from the merged ``out`` and ``lse``): the far
part through the fused kernel's backward with ``lse - c_h`` (so its weights include the constant),
the band explicitly per block (``P = exp(S - lse)``, ``dS = P * (dO V^T - rowsum(dO * out))``),
its dS summed over blocks and batch into the mask's (Hq, block, block + W - 1) shape and then
along its diagonals: the gradient of ``near[h, d]``. The gradient of the far constant needs no
far-region sums: every row of dS sums to zero (``sum_j P_ij (dO_i . v_j - delta_i) = dO_i . out_i
- delta_i = 0``, as ``sum_j P_ij = 1`` and ``sum_j P_ij v_j = out_i``), so over a row the far
entries sum to minus the band's, and ``d c_h = - sum over the band of dS`` (rows below W, which
have no far keys, sum to zero over the band alone and are left out).

What is kept for backward is what a fused attention keeps: q, k, v, the merged output and its
log-sum-exp (all O(T)), and the O(Hq * W) bias values. Grouped-query heads: the band stacks the
query heads of one key head along the rows (:func:`~.softmax_parts.stack_groups`); the far call
repeats the key heads (its causal mask is by row index, which stacking would break).

Registered as backend ``saturated``: under ``backend="auto"``, ``"chunked"`` and ``"flex"``
(where FlexAttention does not serve) for calls with a SaturatingDistanceBias whose W is below
the length, of more than :data:`LONGER_THAN` queries (shorter ones measured faster on the chunked
backend's Toeplitz path), no padding mask, no cache (Tq = Tk), fp32/fp64 on CPU (the fused
kernel's dtypes), no dropout, no weights asked for, not under torch.compile. Every other call
(shorter ones, decoding, padding, packed documents, bf16, GPU) goes to the backends that read
the form as a DistanceBias.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..core.layout import expand_kv_heads
from ..core.underflow import exp_flushed
from ..encodings.block_bias import SaturatingDistanceBias
from . import chunked
from .backend import AUTO, AttentionCall, Backend, register_backend
from .softmax_parts import CPU_FLASH, CPU_FLASH_BACKWARD, cpu_flash_forward, stack_groups, unstack_groups

#: queries per band block (its keys: block + W - 1); a t5 training step (T = 2048, 8 heads of 32,
#: one thread, under load) measured 1.12x native at 64 against 1.16x at 128 and 1.21x at 32
BAND_BLOCK = 64
#: the backend serves calls of more than this many queries; shorter ones take the chunked
#: backend's Toeplitz path (:mod:`.toeplitz`: the table's Hankel view as the fused kernel's mask,
#: an explicit backward summing the table's gradient), which measured faster there: the bench's
#: t5 model (Llama, hidden 256, 8 heads of 32, 4 layers, vocab 256), native / this backend /
#: the Toeplitz path alternating in one process (2026-11-27, the 2-core AVX2 machine, idle,
#: torch's two threads), training step T = 512: 1.165x / 0.968x native, 2048: 1.11x / 1.021x,
#: 3072: 1.16x / 1.015x, 4096: 1.092x / 1.09x, 6144: 1.023x / 1.147x, 8192: 1.059x / 1.175x;
#: forward T = 4096: 1.061x / 1.032x, 6144: 1.014x / 1.011x, 8192: 1.076x / 1.085x (the band's
#: fixed O(T W) work and the merge weigh less as T grows, the explicit backward more). Repeat:
#: scripts/cpu_constant_ab.py --encoding t5 --mode train --length 2048 --native --constant
#: hf_posenc.attention.saturated:LONGER_THAN --values 0 4096 (0: this backend)
LONGER_THAN = 4096
DTYPES = (torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One call's shape: W, the scale, query heads per key head, the band's block."""

    window: int
    scale: float
    groups: int
    block: int

    def spans(self, length: int) -> list[tuple[int, int, int]]:
        """(start, stop, first key) of each band block: keys ``max(0, start - W + 1) .. stop - 1``."""
        return [
            (start, min(length, start + self.block), max(0, start - self.window + 1))
            for start in range(0, length, self.block)
        ]

    def band_distance(self, device: torch.device) -> torch.Tensor:
        """(block, block + W - 1) int64: the distance ``a - b + W - 1`` of a block's query a and band key b."""
        rows = torch.arange(self.block, device=device)
        keys = torch.arange(self.block + self.window - 1, device=device)
        return rows[:, None] - keys[None, :] + (self.window - 1)

    def band_mask(self, near: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """near (Hq, W) -> (Hq, block, block + W - 1) float mask: ``near[h, d]`` where ``0 <= d < W``, -inf elsewhere."""
        distance = self.band_distance(near.device)
        inside = (distance >= 0) & (distance < self.window)
        values = near.to(dtype)[:, distance.clamp(0, self.window - 1)]  # (Hq, block, block + W - 1)
        return values.masked_fill_(~inside, float("-inf"))

    def block_mask(self, mask: torch.Tensor, start: int, stop: int, first: int) -> torch.Tensor:
        """The band mask of block [start, stop) with keys from ``first``: (1, Hkv, G*rows, keys)."""
        cut = first - (start - self.window + 1)  # the band keys before key 0, dropped
        rows, keys = stop - start, stop - first
        block = mask[:, :rows, cut : cut + keys]  # (Hq, rows, keys)
        return block.reshape(1, -1, self.groups * rows, keys)

    def far_keys(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """k or v (B, Hkv, T, D) -> keys 0 .. T-W-1 of the far call, (B, Hq, T - W, D)."""
        return expand_kv_heads(x[:, :, : length - self.window], self.groups)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, near: torch.Tensor, tail: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B,Hq,T,D), k/v (B,Hkv,T,D) -> (out (B,Hq,T,D), lse (B,Hq,T))."""
        length, g, window = q.shape[-2], self.groups, self.window
        # laid out (B, T, Hq, D), as the caller reads it: the output projection's input is then a
        # view of the output kept for backward, not a second copy of it
        out = q.new_empty(q.shape[0], length, q.shape[1], q.shape[-1]).transpose(1, 2)  # (B, Hq, T, D)
        lse = q.new_empty(q.shape[:-1])
        mask = self.band_mask(near, q.dtype)
        for start, stop, first in self.spans(length):
            part_out, part_lse = cpu_flash_forward(
                stack_groups(q[:, :, start:stop], g),
                k[:, :, first:stop],
                v[:, :, first:stop],
                self.block_mask(mask, start, stop, first),
                self.scale,
            )
            out[:, :, start:stop] = unstack_groups(part_out, g)
            lse[:, :, start:stop] = unstack_groups(part_lse, g)
        if length > window:
            assert CPU_FLASH is not None  # the backend serves CPU calls only where torch has it
            far_out, far_lse = CPU_FLASH(
                q[:, :, window:],
                self.far_keys(k, length),
                self.far_keys(v, length),
                0.0,
                True,
                scale=self.scale,
            )  # (B, Hq, T - W, D), (B, Hq, T - W)
            far_lse = far_lse + tail.to(q.dtype)[:, None]
            near_lse = lse[:, :, window:]
            merged = torch.logaddexp(near_lse, far_lse)
            # in place in the output (two passes, no (B, Hq, T - W, D) temporaries)
            near_out = out[:, :, window:]
            near_out.mul_(torch.exp(near_lse - merged)[..., None])
            near_out.addcmul_(far_out, torch.exp(far_lse - merged)[..., None])
            lse[:, :, window:] = merged
        return out, lse

    def backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        near: torch.Tensor,
        tail: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        bias_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Gradients of q, k, v, near (Hq, W) and tail (Hq,) (None without ``bias_grad``)."""
        length, g, window, scale = q.shape[-2], self.groups, self.window, self.scale
        grad_out = grad_out.to(q.dtype)
        grad_q, grad_k, grad_v = (x.new_zeros(x.shape) for x in (q, k, v))  # contiguous
        if length > window:
            far_q, far_k, far_v = q[:, :, window:], self.far_keys(k, length), self.far_keys(v, length)
            assert CPU_FLASH_BACKWARD is not None
            dq, dk, dv = CPU_FLASH_BACKWARD(
                grad_out[:, :, window:],
                far_q,
                far_k,
                far_v,
                out[:, :, window:],
                lse[:, :, window:] - tail.to(q.dtype)[:, None],
                0.0,
                True,
                scale=scale,
            )
            batch, heads, rows, dim = dk.shape
            grad_q[:, :, window:] += dq
            grad_k[:, :, : length - window] += dk.view(batch, heads // g, g, rows, dim).sum(2)
            grad_v[:, :, : length - window] += dv.view(batch, heads // g, g, rows, dim).sum(2)
        mask = self.band_mask(near, q.dtype)
        delta = (grad_out * out).sum(-1)  # (B, Hq, T)
        summed = torch.zeros_like(mask) if bias_grad else None  # dS over blocks and batch, (Hq, block, keys)
        early = q.new_zeros(q.shape[1])  # dS summed over the band of the rows below W (no far keys)
        batch, kv_heads = k.shape[:2]
        flat = batch * kv_heads

        def rows3(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
            return x[:, :, start:stop].reshape(flat, -1, x.shape[-1])  # (B*Hkv, G*rows or keys, D)

        for start, stop, first in self.spans(length):
            rows = slice(start, stop)
            q_block = stack_groups(q[:, :, rows], g).reshape(flat, -1, q.shape[-1])  # (B*Hkv, G*rows, D)
            keys, values = rows3(k, first, stop), rows3(v, first, stop)  # (B*Hkv, keys, D)
            block_mask = self.block_mask(mask, start, stop, first).expand(batch, -1, -1, -1)
            # S = scale * Q K^T + mask
            scores = torch.baddbmm(
                block_mask.reshape(flat, *block_mask.shape[-2:]), q_block, keys.transpose(-1, -2), alpha=scale
            )
            block_lse = stack_groups(lse[:, :, rows, None], g).reshape(flat, -1, 1)
            # P = exp(S - lse), underflowing weights (masked: -inf) flushed to 0 on exp's fast path
            probs = exp_flushed(scores.sub_(block_lse))
            d_out = stack_groups(grad_out[:, :, rows], g).reshape(flat, -1, q.shape[-1])
            # a product into a new tensor, then added: baddbmm_ into this strided view (each head's
            # rows are a slice of its T rows) ran as one addmm_ per batch entry on CPU, 3x the time
            grad_v[:, :, first:stop].view(flat, -1, v.shape[-1]).add_(
                torch.bmm(probs.transpose(-1, -2), d_out)
            )
            block_delta = stack_groups(delta[:, :, rows, None], g).reshape(flat, -1, 1)
            d_scores = probs.mul_(torch.bmm(d_out, values.transpose(-1, -2)).sub_(block_delta))  # dS
            grad_q_rows = torch.bmm(d_scores, keys).mul_(scale).view(batch, kv_heads, -1, q.shape[-1])
            grad_q[:, :, rows] += unstack_groups(grad_q_rows, g)
            grad_k[:, :, first:stop].view(flat, -1, k.shape[-1]).add_(
                torch.bmm(d_scores.transpose(-1, -2), q_block), alpha=scale
            )
            if summed is not None:
                per_head = d_scores.view(batch, kv_heads * g, stop - start, -1).sum(0)  # (Hq, rows, keys)
                cut = first - (start - window + 1)
                summed[:, : stop - start, cut : cut + stop - first] += per_head
                if start < window:  # rows below W: no far keys, their band sums are taken out again
                    early += per_head[:, : window - start].sum(dim=(1, 2))
        if summed is None:
            return grad_q, grad_k, grad_v, None, None
        tail_grad = early - summed.sum(dim=(1, 2))
        distance = self.band_distance(q.device)
        inside = (distance >= 0) & (distance < window)
        near_grad = q.new_zeros(near.shape).index_add_(1, distance[inside], summed[:, inside])
        return grad_q, grad_k, grad_v, near_grad.to(near.dtype), tail_grad.to(tail.dtype)


class _SaturatedAttention(torch.autograd.Function):
    """The merged attention with the O(T) saved state of a fused kernel (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, q, k, v, near, tail) -> torch.Tensor:
        out, lse = plan.forward(q, k, v, near, tail)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, near, tail, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        bias_grad = ctx.needs_input_grad[4] or ctx.needs_input_grad[5]
        grads = ctx.plan.backward(grad_out, *ctx.saved_tensors, bias_grad)
        return (None, *grads)


def attend_saturated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: SaturatingDistanceBias,
    softmax_scale: float,
    block: int | None = None,
) -> torch.Tensor:
    """q (B,Hq,T,D), k/v (B,Hkv,T,D), causal (no mask, no cache), fp32/fp64 on CPU -> (B,T,Hq,D).

    Any W works (W >= T: the band alone); ``block``: queries per band block (default :data:`BAND_BLOCK`)."""
    plan = _Plan(bias.saturation, softmax_scale, q.shape[1] // k.shape[1], block or BAND_BLOCK)
    tensors = (q, k, v, bias.near, bias.tail)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        out = _SaturatedAttention.apply(plan, *tensors)
    else:
        out, _ = plan.forward(*tensors)
    return out.transpose(1, 2)  # (B, T, Hq, D)


def serves_call(
    bias: object,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
) -> bool:
    """Whether :func:`attend_saturated` computes this call (see the module docstring)."""
    return (
        isinstance(bias, SaturatingDistanceBias)
        and mask is None
        and dropout_p == 0.0
        and q.device.type == "cpu"
        and q.dtype in DTYPES
        and k.dtype == v.dtype == q.dtype
        and q.shape[-1] == v.shape[-1]  # the fused kernel's widths
        and q.shape[-2] == k.shape[-2] > max(chunked.FEW_QUERIES, bias.saturation)  # decoding: chunked
        and q.shape[-2] > LONGER_THAN
        and not torch.compiler.is_compiling()
    )


@register_backend
class SaturatedBackend(Backend):
    name = "saturated"
    priority = 45
    requests = frozenset({AUTO, "chunked", "flex"})

    def serves(self, call: AttentionCall) -> bool:
        return (
            not call.explicit
            and not call.want_weights
            and serves_call(call.bias, call.q, call.k, call.v, call.mask, call.dropout_p)
        )

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert isinstance(call.bias, SaturatingDistanceBias)
        out = attend_saturated(call.q, call.k, call.v, bias=call.bias, softmax_scale=call.softmax_scale)
        return out.to(call.v.dtype), None
