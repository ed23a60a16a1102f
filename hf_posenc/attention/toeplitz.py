"""Causal attention with a Toeplitz bias ``table[h, i - j]`` (T5, KERPLE, Sandwich, FIRE's rows
below its threshold) over query blocks, with the table's gradient, keeping O(T) for backward.

Layout. Over the queries in reverse order (reversed row ``a`` holds query ``n - 1 - a`` of the
``n`` handled), bias-plus-causal-mask of row ``a`` and key ``j`` depends on ``a + j`` only (a
Hankel matrix), so each block's float mask is an ``as_strided`` view (row and column stride 1)
of one (Hq, L) ``line``: ``line[h, p] = table[h, D0 - p]`` for the distances ``D0 = n - 1 + Tk - Tq``
down to 0, then the dtype's minimum (the future). Reversing the queries (O(n D) once per call)
rather than the keys keeps every block's keys and values plain prefixes ``k[:, :, :K]`` of the
layer's own tensors: nothing is copied per block.

Forward (:class:`ToeplitzAttention`): per block of reversed rows (the chunked backend's), torch's
fused CPU flash-attention kernel with the view as its mask (any other device: SDPA), which also
returns the rows' log-sum-exp. Kept for backward: q, k, v, the output, the log-sum-exp and the
line: O(T).

Backward: :mod:`.toeplitz_backward` (FlashAttention-2's gradients from the kept statistics,
the table's as anti-diagonal sums of dS), or torch's fused backward for tables without gradient
whose exponents stay on its fast path; key windows for those tables: :mod:`.toeplitz_windows`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.layout import hankel_view
from .softmax_parts import CPU_FLASH
from .toeplitz_backward import fused_gradients, toeplitz_gradients
from .toeplitz_layout import (
    CPU_FLASH_DTYPES,
    ToeplitzView,
    blocks,
    fused_backward_runs,
    toeplitz_line,
)
from .toeplitz_windows import HeadPlan, head_groups, head_plan

#: reversed rows per backward step: the block's (B, H, R, K + R) buffer stays small
BACKWARD_BLOCK = 128


def _fused(q, k, v, mask, scale):
    """One block's (out, lse): the fused CPU kernel where it runs, else SDPA and lse explicitly."""
    if CPU_FLASH is not None and q.device.type == "cpu" and q.dtype in CPU_FLASH_DTYPES:
        out, lse = CPU_FLASH(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale).add_(mask.float())
    return out, torch.logsumexp(scores, dim=-1)


class ToeplitzAttention(torch.autograd.Function):
    """q (B, H, n, D) — the first n queries of Tq —, k/v (B, H, Tk, D), the line of
    :func:`toeplitz_line` -> the output (B, H, n, D); gradients of q, k, v and the line."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        line,
        scale: float,
        q_len: int,
        block: int,
        backward_block: int,
        buffers: dict,
        plan: HeadPlan | None,
    ):
        batch, heads, rows, dim = q.shape
        k_len = k.shape[2]
        q_rev = q.flip(2)  # (B, H, n, D): reversed row a is query n - 1 - a
        # the output in query order, laid out (B, n, H, D) as the caller's output projection reads
        # it (a view there, not a copy beside the one kept here)
        out = torch.empty(batch, rows, heads, dim, dtype=q.dtype, device=q.device).transpose(1, 2)
        lse: torch.Tensor | None = None  # (B, H, n) in reversed order, in the kernel's dtype
        for r0, count, keys in blocks(rows, q_len, k_len, block):
            # per group of heads, the keys from its window's first on (all of them without windows)
            for h0, h1, first in head_groups(None if plan is None else plan.windows, heads, count, keys):
                mask = hankel_view(line[h0:h1], r0 + first, count, keys - first)  # (1, H', R, K')
                part, part_lse = _fused(
                    q_rev[:, h0:h1, r0 : r0 + count],
                    k[:, h0:h1, first:keys],
                    v[:, h0:h1, first:keys],
                    mask,
                    scale,
                )
                out[:, h0:h1, rows - r0 - count : rows - r0] = part.flip(2)
                if lse is None:
                    lse = part_lse.new_empty(batch, heads, rows)
                lse[:, h0:h1, r0 : r0 + count] = part_lse
        ctx.save_for_backward(q, k, v, line, out, lse)
        ctx.scale, ctx.q_len, ctx.block, ctx.backward_block, ctx.buffers, ctx.plan = (
            scale,
            q_len,
            block,
            backward_block,
            buffers,
            plan,
        )
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, line, out, lse = ctx.saved_tensors
        plan: HeadPlan | None = ctx.plan
        line_grad = ctx.needs_input_grad[3]
        if plan is None or line_grad:  # a learned table: every head explicitly over every key
            grads = toeplitz_gradients(
                q,
                k,
                v,
                line,
                out,
                lse,
                grad_out,
                ctx.scale,
                ctx.q_len,
                ctx.backward_block,
                line_grad,
                ctx.buffers,
            )
            return (*grads, None, None, None, None, None, None)
        # a table without gradient (ALiBi, Sandwich, a frozen table): per run of neighbouring heads,
        # torch's fused backward where its exp stays fast, else the explicit one, each head over
        # the keys of its window
        parts: list[tuple[torch.Tensor | None, ...]] = []  # (dq, dk, dv, None) per run of heads
        for h0, h1, fused in plan.runs():
            part = slice(h0, h1)
            inputs = (
                q[:, part],
                k[:, part],
                v[:, part],
                line[part],
                out[:, part],
                lse[:, part],
                grad_out[:, part],
            )
            if fused:
                window = max(plan.windows[h0:h1])
                parts.append(fused_gradients(*inputs, ctx.scale, ctx.q_len, ctx.block, window))
            else:
                windows = plan.windows[h0:h1]
                parts.append(
                    toeplitz_gradients(
                        *inputs, ctx.scale, ctx.q_len, ctx.backward_block, False, ctx.buffers, windows
                    )
                )
        by_input = [
            torch.cat(found, dim=1) if len(parts) > 1 else found[0]
            for found in list(zip(*parts, strict=True))[:3]
        ]
        return (*by_input, None, None, None, None, None, None, None)


def attend_toeplitz(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    q_len: int,
    scale: float,
    block: int,
    dropout_p: float = 0.0,
    buffers: dict | None = None,
) -> torch.Tensor:
    """The first n queries q (B, H, n, D) of ``q_len`` (bottom-right aligned to the Tk keys of
    k/v (B, H, Tk, D)) with the bias ``table[h, i - j]`` (table (H, >= n + Tk - q_len)) and the
    causal mask -> (B, H, n, D), in forward blocks of ``block`` reversed rows. With dropout (or
    under torch.compile) each block is a plain SDPA call on the same views (SDPA's own backward).

    ``buffers``: a dict shared by the calls of one forward (the layers; the chunked backend's
    memo), where backward keeps its two (B, H, R, K)-sized work buffers for the next layer's
    backward: one allocation per backward pass instead of per layer (on CPU a fresh buffer of
    megabytes page-faults on first touch, each time where glibc maps it anew)."""
    backward_block = BACKWARD_BLOCK
    rows, k_len = q.shape[2], k.shape[2]
    # (H, D0 + the longer block): what the forward's and backward's blocks read
    line = toeplitz_line(table, rows, q_len, k_len, max(block, backward_block), q.dtype)
    if dropout_p == 0.0 and not torch.compiler.is_compiling():
        shared = {} if buffers is None else buffers
        # a table without gradient attends each head's window only (ALiBi's steep heads)
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        plan = (
            None
            if line.requires_grad
            else head_plan(q, k, line, rows + k_len - q_len, scale, backward, fused_backward_runs(q))
        )
        return ToeplitzAttention.apply(q, k, v, line, scale, q_len, block, backward_block, shared, plan)
    q_rev = q.flip(2)
    outs = [
        F.scaled_dot_product_attention(
            q_rev[:, :, r0 : r0 + count],
            k[:, :, :keys],
            v[:, :, :keys],
            attn_mask=ToeplitzView.apply(line, r0, count, keys),
            dropout_p=dropout_p,
            scale=scale,
        )
        for r0, count, keys in blocks(rows, q_len, k_len, block)
    ]
    return torch.cat(outs, dim=2).flip(2)
