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

Backward, per block of :data:`BACKWARD_BLOCK` rows (R rows, K keys, W = K + R - 1), the
FlashAttention-2 gradients from the kept statistics (Dao 2023, Algorithm 2):

    P = exp(s Q K^T + bias - lse),  dV = P^T dO,  dS = P * (dO V^T - rowsum(dO * O)),
    dQ = s dS K,  dK = s dS^T Q,  dline[h, r0 + n'] += sum_{a + j = n'} dS[h, a, j]

computed in one (B, H, R, W + 1) buffer per call (reused by every block) whose (R, K) view has
row stride W + 1: S is written there (bias - lse, then ``baddbmm_``), exponentiated (exp2 of
log2(e) times it; weights below 2^:data:`FLUSH` set to 0 first, so nothing is subnormal), multiplied
by dP in place, and the same memory read with row stride W holds dS[a, j] at column a + j, so
the anti-diagonal sums are one ``sum`` over the rows once the R entries between the view's rows
(one strided (R, R) fill) are zero. No softmax (the statistics are kept), no zero-filled skew
buffer or ``new_zeros`` per block, no per-block slice gradients (dQ, dK, dV written into one
tensor each; dO V^T - rowsum(dO * O) as one product of dO and V widened by one column,
-rowsum(dO * O) and ones). Computed in fp32 for bf16/fp16 inputs, in their own dtype for fp32/fp64.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..core.layout import causal_keys
from .softmax_parts import CPU_FLASH, CPU_FLASH_BACKWARD

LOG2E = math.log2(math.e)
#: base-2 exponent below which a recomputed attention weight is taken as 0 (2^-100 ~ 8e-31)
FLUSH = -100.0
#: reversed rows per backward step: the block's (B, H, R, K + R) buffer stays small
BACKWARD_BLOCK = 128
#: a key whose bias lies more than 2 B + CUTOFF below the bias of distance 0 (B >= |s q_i . k_j|
#: over the call) is left out of a table without gradient (:func:`head_plan`): its weight is below
#: e^-CUTOFF < 2^-150 times the diagonal key's, under half of fp32's smallest subnormal relative to
#: the row's sum (the fused kernel itself rounds it to 0)
CUTOFF = 104.0
#: heads per call of the explicit backward when the heads have key windows (a table without
#: gradient: ALiBi's steep heads), so each head reads only its own window. A learned table (no
#: windows) takes all heads per call: the bench's kerple training step (T=2048, vocab 256, 8 heads
#: of 32, idle, torch's two threads, medians of 6 alternating steps in one process) read 1.49x
#: native one head at a time, 1.41x two, 1.33x four, 1.28x all eight (one thread: 1.18x / 1.16x
#: for one / eight); ALiBi's read 1.21x / 1.20x / 1.24x / 1.25x
EXPLICIT_HEADS = 1
#: a head's first key in a block is rounded down to a multiple of this, so that neighbouring heads
#: with about the same window share one kernel call
KEY_ALIGN = 64
#: torch's exp (in its fused CPU backward too) leaves its fast path for inputs below about -87.3
#: (fp32's smallest normal number, e^-87.3): a head whose exponents are bounded above -FAST_EXP
#: takes the fused backward
FAST_EXP = 80.0

_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def toeplitz_line(
    table: torch.Tensor, rows: int, q_len: int, k_len: int, block: int, dtype: torch.dtype
) -> torch.Tensor:
    """table (Hq, >= D0 + 1) over distances 0.. -> the line (Hq, D0 + block) in ``dtype``:
    ``line[h, p] = table[h, D0 - p]`` for p <= D0 = rows - 1 + k_len - q_len, the dtype's
    minimum after (the future keys a block of up to ``block`` reversed rows reaches)."""
    distances = rows + k_len - q_len  # D0 + 1
    future = torch.full((table.shape[0], block - 1), torch.finfo(dtype).min, dtype=dtype, device=table.device)
    return torch.cat((table[:, :distances].flip(1).to(dtype), future), dim=1)


def hankel_view(line: torch.Tensor, first: int, rows: int, keys: int) -> torch.Tensor:
    """line (H, L) -> the (1, H, rows, keys) view ``out[0, h, a, j] = line[h, first + a + j]``."""
    offset = line.storage_offset() + first
    return line.as_strided((1, line.shape[0], rows, keys), (0, line.stride(0), 1, 1), offset)


class ToeplitzView(torch.autograd.Function):
    """:func:`hankel_view` with a backward that sums the incoming gradient along its
    anti-diagonals (skewing it into a (H, rows, keys + rows) buffer), much cheaper than
    autograd's generic backward of an overlapping ``as_strided`` view (the SDPA path's mask)."""

    @staticmethod
    def forward(ctx, line: torch.Tensor, first: int, rows: int, keys: int) -> torch.Tensor:
        ctx.first, ctx.shape = first, line.shape
        return hankel_view(line, first, rows, keys)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _, heads, rows, keys = grad.shape
        width = keys + rows
        skewed = grad.new_zeros(heads, rows, width)  # skewed[h, a, a + b] = grad[0, h, a, b]
        skewed.as_strided((heads, rows, keys), (rows * width, width + 1, 1)).copy_(grad[0])
        sums = skewed.sum(dim=1)[:, : width - 1]  # (H, rows + keys - 1): the sum over a + b = n
        grad_line = grad.new_zeros(ctx.shape)
        grad_line[:, ctx.first : ctx.first + width - 1] = sums
        return grad_line, None, None, None


def _blocks(rows: int, q_len: int, k_len: int, block: int) -> list[tuple[int, int, int]]:
    """(first reversed row, rows, keys) of each block of ``block`` reversed rows: the block of
    reversed rows [r0, r0 + R) holds queries n - r0 - R .. n - 1 - r0 and attends the keys
    ``0 .. causal_keys(stop) - 1`` of its latest query."""
    return [(r0, min(block, rows - r0), causal_keys(q_len, k_len, rows - r0)) for r0 in range(0, rows, block)]


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """Per head of a call with a table without gradient: ``windows[h]`` = D_h, the distances
    ``0 .. D_h - 1`` whose keys can change the result, and ``fused[h]``, whether torch's fused
    backward keeps every exponent of the head's window on aten's fast path."""

    windows: list[int]
    fused: list[bool]

    def runs(self) -> list[tuple[int, int, bool]]:
        """(first head, stop head, fused) of the runs of neighbouring heads with the same backward."""
        found: list[tuple[int, int, bool]] = []
        for head, fused in enumerate(self.fused):
            if found and found[-1][2] == fused:
                found[-1] = (found[-1][0], head + 1, fused)
            else:
                found.append((head, head + 1, fused))
        return found


def head_plan(
    q: torch.Tensor, k: torch.Tensor, line: torch.Tensor, distances: int, scale: float, backward: bool = True
) -> HeadPlan:
    """The :class:`HeadPlan` of q (B, H, n, D), k (B, H, Tk, D) and the line of :func:`toeplitz_line`
    over ``distances`` (= D0 + 1). O(B H T D) for the norms, O(H T) for the table, one host read.

    Windows: with ``B_h = scale * max_i |q_i| * max_j |k_j|`` over the batch (Cauchy-Schwarz: each
    score ``s_ij = scale q_i . k_j + b_h(i - j)`` is within B_h of its bias), the diagonal key's
    score is at least ``b_h(0) - B_h`` and that of a key at distance d at most ``b_h(d) + B_h``, so
    from the first distance ``D_h`` past which ``b_h(d) < b_h(0) - 2 B_h - CUTOFF`` (the suffix
    maximum of the table: any table) every key's weight is below e^-CUTOFF < 2^-150 times the
    diagonal key's. Fused: ``s_ij - lse_i >= -(spread + 2 B_h + log K)`` with ``spread`` the
    range of the head's biases inside its window and K its keys; above -:data:`FAST_EXP` aten's
    exp stays on its fast path (NaN or infinite values: every key kept, the explicit backward).

    Without ``backward`` (no gradient will be asked for) a table whose every head stays within
    CUTOFF of its distance-0 bias has no window whatever B is, and the norms are not computed."""
    values = line[:, :distances].float()  # (H, D0 + 1): distance D0 - p at position p
    heads = values.shape[0]
    with torch.no_grad():
        if not backward and float((values[:, -1] - values.amin(dim=1)).max()) <= CUTOFF:
            return HeadPlan([distances] * heads, [False] * heads)
        q_norm = torch.linalg.vector_norm(q.float(), dim=-1).amax(dim=(0, 2))  # (H,)
        k_norm = torch.linalg.vector_norm(k.float(), dim=-1).amax(dim=(0, 2))
        # margins for the rounding of the norms, the table and the kernel's scores
        bound = (q_norm * k_norm * scale) * (1 + 2**-10) + 2**-10
        threshold = values[:, -1] - 2 * bound - CUTOFF  # (H,)
        # position p's running maximum is the largest bias at distances >= D0 - p
        suffix = torch.cummax(values, dim=1).values
        counts = (suffix >= threshold[:, None]).sum(dim=1)  # D_h
        finite = torch.isfinite(threshold) & torch.isfinite(values).all(dim=1)
        counts = torch.where(finite, counts, distances)
        # the biases inside each head's window, the distances 0 .. D_h - 1: the running extremes
        # over the distances in increasing order, read at D_h - 1
        by_distance = values.flip(1)  # (H, D0 + 1)
        last = (counts - 1).clamp(min=0)[:, None]
        top = torch.cummax(by_distance, dim=1).values.gather(1, last)[:, 0]
        low = torch.cummin(by_distance, dim=1).values.gather(1, last)[:, 0]
        reach = top - low + 2 * bound + math.log(max(distances, 1))
        fused = finite & (reach <= FAST_EXP)
    return HeadPlan(counts.tolist(), fused.tolist() if _fused_backward_runs(q) else [False] * len(fused))


def _head_groups(windows: list[int] | None, heads: int, count: int, keys: int) -> list[tuple[int, int, int]]:
    """(first head, stop head, first key) of the kernel calls of a block of ``count`` reversed rows
    over keys ``0 .. keys - 1``: each head's first key (:func:`_first_key`) rounded down to
    :data:`KEY_ALIGN`; neighbouring heads with the same first key share a call."""
    if windows is None:
        return [(0, heads, 0)]
    firsts = [_first_key(window, count, keys) // KEY_ALIGN * KEY_ALIGN for window in windows]
    groups: list[tuple[int, int, int]] = []
    for head, first in enumerate(firsts):
        if groups and groups[-1][2] == first:
            groups[-1] = (groups[-1][0], head + 1, first)
        else:
            groups.append((head, head + 1, first))
    return groups


def _first_key(window: int | None, count: int, keys: int) -> int:
    """The first key a block of ``count`` reversed rows over keys ``0 .. keys - 1`` needs with a
    ``window`` of distances (its earliest query is at key position keys - count); 0 without one."""
    return 0 if window is None else max(0, keys - count - window + 1)


def _fused(q, k, v, mask, scale):
    """One block's (out, lse): the fused CPU kernel where it runs, else SDPA and lse explicitly."""
    if CPU_FLASH is not None and q.device.type == "cpu" and q.dtype in _CPU_FLASH_DTYPES:
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
        for r0, count, keys in _blocks(rows, q_len, k_len, block):
            # per group of heads, the keys from its window's first on (all of them without windows)
            for h0, h1, first in _head_groups(None if plan is None else plan.windows, heads, count, keys):
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


def _fused_backward_runs(q: torch.Tensor) -> bool:
    return CPU_FLASH_BACKWARD is not None and q.device.type == "cpu" and q.dtype in _CPU_FLASH_DTYPES


def fused_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    line: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    scale: float,
    q_len: int,
    block: int,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """dq, dk, dv of :class:`ToeplitzAttention` by torch's fused CPU flash-attention backward, one
    call per forward block with the same Hankel mask (the line gets no gradient); with a
    ``window`` (:func:`head_plan`, the largest of these heads'), over the keys it reaches."""
    assert CPU_FLASH_BACKWARD is not None
    rows, k_len = q.shape[2], k.shape[2]
    q_rev, grad_rev, out_rev = q.flip(2), grad_out.flip(2), out.flip(2)  # (B, H, n, D), reversed rows
    grad_q = torch.empty_like(q_rev)
    grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
    for r0, count, keys in _blocks(rows, q_len, k_len, block):
        part, first = slice(r0, r0 + count), _first_key(window, count, keys)
        dq, dk, dv = CPU_FLASH_BACKWARD(
            grad_rev[:, :, part],
            q_rev[:, :, part],
            k[:, :, first:keys],
            v[:, :, first:keys],
            out_rev[:, :, part],
            lse[:, :, part],
            0.0,
            False,
            attn_mask=hankel_view(line, r0 + first, count, keys - first),
            scale=scale,
        )
        grad_q[:, :, part] = dq
        grad_k[:, :, first:keys] += dk
        grad_v[:, :, first:keys] += dv
    return grad_q.flip(2), grad_k, grad_v, None


def toeplitz_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    line: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    scale: float,
    q_len: int,
    block: int,
    line_grad: bool = True,
    buffers: dict | None = None,
    windows: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dq, dk, dv (their inputs' dtypes) and dline (``line``'s dtype, None unless ``line_grad``)
    of :class:`ToeplitzAttention` (formulas in the module's docstring); ``lse`` in reversed row
    order; with ``windows`` (per head, :func:`head_plan`) each head over the keys its window reaches.

    With ``windows``, :data:`EXPLICIT_HEADS` heads at a time, each through every block (without,
    all heads at once): the work tensors are laid out head-major ((H * B, ...), row h * B + b), so
    a head's rows are one contiguous range."""
    dtype = q.dtype
    work = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    batch, heads, rows, dim = q.shape
    k_len = k.shape[2]
    hb = heads * batch

    def head_major(x: torch.Tensor) -> torch.Tensor:  # (B, H, m, D) -> (H * B, m, D), a view where it can
        return x.transpose(0, 1).to(work).reshape(hb, x.shape[2], x.shape[3])

    # (HB, n|Tk, D) in the working dtype, rows reversed (temporaries of backward only)
    q3, k3 = head_major(q.flip(2)), head_major(k)
    # dO V^T - rowsum(dO * O) as one product: dO with -rowsum(dO * O) as one more column
    # (HB, n, D+1), V with ones (HB, Tk, D+1) (no (R, K) pass filling the -delta in)
    grad_aug = torch.empty(hb, rows, dim + 1, dtype=work, device=q.device)
    grad_aug[..., :dim].copy_(head_major(grad_out.flip(2)))
    delta = (grad_out.to(work) * out.to(work)).sum(-1).flip(2)  # (B, H, n), reversed rows
    torch.neg(delta.transpose(0, 1).reshape(hb, rows), out=grad_aug[..., dim])
    grad3 = grad_aug[..., :dim]
    v_aug = torch.ones(hb, k_len, dim + 1, dtype=work, device=q.device)
    v_aug[..., :dim].copy_(head_major(v))
    # the exponent in base 2 (P = 2^(log2(e) (S - lse))): torch's exp2 has no slow path for the
    # masked keys' -inf and huge negatives, its exp does (measured ~100x per element)
    line2 = line.to(work) * LOG2E  # (H, L), the future at -inf
    lse2 = (lse.to(work) * LOG2E).transpose(0, 1).unsqueeze(-1)  # (H, B, n, 1)
    grad_q = torch.empty_like(q3)
    # dK^T and dV^T (HB, D, Tk): each block's (D, K) products accumulate in place (beta = 1)
    grad_kt = torch.zeros(hb, dim, k_len, dtype=work, device=q.device)
    grad_vt = torch.zeros(hb, dim, k_len, dtype=work, device=q.device)
    grad_line = torch.zeros(line.shape, dtype=work, device=line.device) if line_grad else None

    spans = _blocks(rows, q_len, k_len, block)
    longest = max(count for _, count, _ in spans)
    widest = max(count * (keys + count) for _, count, keys in spans)
    step = heads if windows is None else max(1, min(EXPLICIT_HEADS, heads))
    buffer = _buffer(buffers, "buffer", step * batch * widest, work, q.device)
    scratch = _buffer(buffers, "scratch", step * batch * longest * k_len, work, q.device)
    for h0 in range(0, heads, step):
        h1 = min(heads, h0 + step)
        group, flat = h1 - h0, slice(h0 * batch, h1 * batch)  # heads, and their (H * B) rows
        count_bh = group * batch
        window = None if windows is None else max(windows[h0:h1])
        q_g, grad_g, aug_g, k_g, v_g = q3[flat], grad3[flat], grad_aug[flat], k3[flat], v_aug[flat]
        dq_g, dkt_g, dvt_g = grad_q[flat], grad_kt[flat], grad_vt[flat]
        line_g, lse_g = line2[h0:h1], lse2[h0:h1]
        for r0, count, keys in spans:
            first = _first_key(window, count, keys)
            span = keys - first  # K: the block's keys first .. keys - 1
            width = span + count - 1  # W: the anti-diagonals a + j of an (R, K) block
            size = count * (width + 1)  # per (head, batch): R rows of stride W + 1
            # (H', B, R, K) and (H'B, R, K) views of the buffer with row stride W + 1
            s4 = buffer.as_strided((group, batch, count, span), (batch * size, size, width + 1, 1))
            s3 = buffer.as_strided((count_bh, count, span), (size, width + 1, 1))
            rows_q, rows_grad = q_g[:, r0 : r0 + count], grad_g[:, r0 : r0 + count]
            k_block = k_g[:, first:keys]
            bias = hankel_view(line_g, r0 + first, count, span).transpose(0, 1)  # (H', 1, R, K)
            torch.sub(bias, lse_g[:, :, r0 : r0 + count], out=s4)
            s3.baddbmm_(rows_q, k_block.transpose(1, 2), alpha=scale * LOG2E)  # log2(e) (S - lse)
            # weights below 2^FLUSH are 0: no subnormal P or dS (each costs ~100x in exp2, mul and
            # BLAS), an absolute change below 2^FLUSH per weight
            torch.threshold_(s3, FLUSH, -math.inf).exp2_()  # P
            dvt_g[:, :, first:keys].baddbmm_(rows_grad.transpose(1, 2), s3)  # += dO^T P
            grad_p = scratch[: count_bh * count * span].view(count_bh, count, span)
            # dO V^T - delta
            torch.bmm(aug_g[:, r0 : r0 + count], v_g[:, first:keys].transpose(1, 2), out=grad_p)
            s3.mul_(grad_p)  # dS
            torch.bmm(s3, k_block, out=dq_g[:, r0 : r0 + count])
            dkt_g[:, :, first:keys].baddbmm_(rows_q.transpose(1, 2), s3)  # += Q^T dS
            if grad_line is not None:
                # the R entries after each row of the view, zeroed: read with row stride W, row a
                # holds dS[a, j] at column a + j and zeros elsewhere
                buffer.as_strided((count_bh, count, count), (size, width + 1, 1), span).zero_()
                diagonal = buffer.as_strided((group, batch, count, width), (batch * size, size, width, 1))
                grad_line[h0:h1, r0 + first : r0 + first + width].add_(diagonal.sum(dim=(1, 2)))
    grad_q = grad_q.mul_(scale).view(heads, batch, rows, dim).transpose(0, 1).flip(2).to(dtype)
    grad_k = grad_kt.mul_(scale).view(heads, batch, dim, k_len).permute(1, 0, 3, 2).to(k.dtype)
    grad_v = grad_vt.view(heads, batch, dim, k_len).permute(1, 0, 3, 2).to(v.dtype)
    return grad_q, grad_k, grad_v, None if grad_line is None else grad_line.to(line.dtype)


def _buffer(
    buffers: dict | None, name: str, size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A flat work buffer of at least ``size`` values, kept in ``buffers`` for the next call."""
    key = (name, dtype, device)
    found = None if buffers is None else buffers.get(key)
    if found is None or found.numel() < size:
        found = torch.empty(size, dtype=dtype, device=device)
        if buffers is not None:
            buffers[key] = found
    return found


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
        plan = None if line.requires_grad else head_plan(q, k, line, rows + k_len - q_len, scale, backward)
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
        for r0, count, keys in _blocks(rows, q_len, k_len, block)
    ]
    return torch.cat(outs, dim=2).flip(2)
