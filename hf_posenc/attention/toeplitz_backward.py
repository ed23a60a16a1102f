"""Backward of the Toeplitz path (:mod:`.toeplitz`).

Backward, per block of :data:`BACKWARD_BLOCK` rows (R rows, K keys, W = K + R - 1), the
FlashAttention-2 gradients from the kept statistics (Dao 2023, Algorithm 2):

    P = exp(s Q K^T + bias - lse),  dV = P^T dO,  dS = P * (dO V^T - rowsum(dO * O)),
    dQ = s dS K,  dK = s dS^T Q,  dline[h, r0 + n'] += sum_{a + j = n'} dS[h, a, j]

computed in one contiguous (B, H, R, W + 1) buffer per call (reused by every block): each row's
K scores, then R gap columns. bias - lse is written into the (R, K) view and -inf into the gaps,
then one ``baddbmm_`` adds s Q K^T over all W + 1 columns (k followed by R more rows: a product
into contiguous rows, where one into the strided (R, K) view runs a matrix at a time: the
attention's forward+backward at T=2048 read 1.24x-1.61x native with that, 1.20x-1.34x with this,
``scripts/toeplitz_attention_cost.py --baseline``), exponentiated (exp2 of log2(e) times it; weights
below 2^:data:`FLUSH` set to 0 first, so nothing is subnormal; the gaps become 0), multiplied by
dP in place, and the same memory read with row stride W holds dS[a, j] at column a + j and the
gaps' zeros elsewhere, so the anti-diagonal sums are one ``sum`` over the rows. dK and dV
accumulate in (B * H, Tk, D): each block's product adds into contiguous rows. No softmax (the
statistics are kept), no zero-filled skew buffer or ``new_zeros`` per block, no per-block slice
gradients (dQ, dK, dV written into one tensor each; dO V^T - rowsum(dO * O) as one product of dO
and V widened by one column, -rowsum(dO * O) and ones). Computed in fp32 for bf16/fp16 inputs,
in their own dtype for fp32/fp64.
"""

from __future__ import annotations

import math

import torch

from ..core.layout import hankel_view
from .softmax_parts import CPU_FLASH_BACKWARD
from .toeplitz_layout import FLUSH, LOG2E, blocks, work_buffer
from .toeplitz_windows import first_key

#: heads per call of the explicit backward when the heads have key windows (a table without
#: gradient: ALiBi's steep heads), so each head reads only its own window. A learned table (no
#: windows) takes all heads per call: the bench's kerple training step (T=2048, vocab 256, 8 heads
#: of 32, idle, torch's two threads, medians of 6 alternating steps in one process) read 1.49x
#: native one head at a time, 1.41x two, 1.33x four, 1.28x all eight (one thread: 1.18x / 1.16x
#: for one / eight); ALiBi's read 1.21x / 1.20x / 1.24x / 1.25x
EXPLICIT_HEADS = 1


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
    for r0, count, keys in blocks(rows, q_len, k_len, block):
        part, first = slice(r0, r0 + count), first_key(window, count, keys)
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

    spans = blocks(rows, q_len, k_len, block)
    longest = max(count for _, count, _ in spans)
    widest = max(count * (keys + count) for _, count, keys in spans)
    # (HB, n, D) and (HB, Tk + longest, D) in the working dtype, rows reversed (temporaries of
    # backward only): k with `longest` rows after its last (zeros), so a block's S product can run
    # over all W + 1 columns of its rows (the R gap columns' scores are -inf whatever they hold)
    q3 = head_major(q.flip(2))
    k3 = torch.zeros(hb, k_len + longest, dim, dtype=work, device=q.device)
    k3[:, :k_len].copy_(head_major(k))
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
    # dK and dV (HB, Tk, D): each block's (K, D) products accumulate in place (beta = 1) into
    # rows that are one contiguous range per matrix
    grad_k3 = torch.zeros(hb, k_len, dim, dtype=work, device=q.device)
    grad_v3 = torch.zeros(hb, k_len, dim, dtype=work, device=q.device)
    grad_line = torch.zeros(line.shape, dtype=work, device=line.device) if line_grad else None

    step = heads if windows is None else max(1, min(EXPLICIT_HEADS, heads))
    buffer = work_buffer(buffers, "buffer", step * batch * widest, work, q.device)
    scratch = work_buffer(buffers, "scratch", step * batch * longest * k_len, work, q.device)
    for h0 in range(0, heads, step):
        h1 = min(heads, h0 + step)
        group, flat = h1 - h0, slice(h0 * batch, h1 * batch)  # heads, and their (H * B) rows
        count_bh = group * batch
        window = None if windows is None else max(windows[h0:h1])
        q_g, grad_g, aug_g, k_g, v_g = q3[flat], grad3[flat], grad_aug[flat], k3[flat], v_aug[flat]
        dq_g, dk_g, dv_g = grad_q[flat], grad_k3[flat], grad_v3[flat]
        line_g, lse_g = line2[h0:h1], lse2[h0:h1]
        for r0, count, keys in spans:
            first = first_key(window, count, keys)
            span = keys - first  # K: the block's keys first .. keys - 1
            width = span + count - 1  # W: the anti-diagonals a + j of an (R, K) block
            size = count * (width + 1)  # per (head, batch): R contiguous rows of W + 1
            # (H'B, R, W + 1) contiguous: each row's K scores, then R gap columns at -inf (their
            # weights 0), so the same memory read with row stride W holds dS[a, j] at column a + j
            full = buffer[: count_bh * size].view(count_bh, count, width + 1)
            s3 = full[:, :, :span]  # (H'B, R, K)
            s4 = full.view(group, batch, count, width + 1)[..., :span]  # (H', B, R, K)
            rows_q, rows_grad = q_g[:, r0 : r0 + count], grad_g[:, r0 : r0 + count]
            k_block = k_g[:, first:keys]
            bias = hankel_view(line_g, r0 + first, count, span).transpose(0, 1)  # (H', 1, R, K)
            torch.sub(bias, lse_g[:, :, r0 : r0 + count], out=s4)
            full[:, :, span:].fill_(-math.inf)
            # log2(e) (S - lse) over the W + 1 columns: one product into contiguous rows (see the
            # module's docstring)
            full.baddbmm_(rows_q, k_g[:, first : first + width + 1].transpose(1, 2), alpha=scale * LOG2E)
            # weights below 2^FLUSH are 0: no subnormal P or dS (each costs ~100x in exp2, mul and
            # BLAS), an absolute change below 2^FLUSH per weight; the gap columns become 0
            torch.threshold_(full, FLUSH, -math.inf).exp2_()  # P
            dv_g[:, first:keys].baddbmm_(s3.transpose(1, 2), rows_grad)  # += P^T dO
            grad_p = scratch[: count_bh * count * span].view(count_bh, count, span)
            # dO V^T - delta
            torch.bmm(aug_g[:, r0 : r0 + count], v_g[:, first:keys].transpose(1, 2), out=grad_p)
            s3.mul_(grad_p)  # dS
            torch.bmm(s3, k_block, out=dq_g[:, r0 : r0 + count])
            dk_g[:, first:keys].baddbmm_(s3.transpose(1, 2), rows_q)  # += dS^T Q
            if grad_line is not None:
                # read with row stride W: row a holds dS[a, j] at column a + j, the gap's zeros
                # elsewhere
                diagonal = buffer.as_strided((group, batch, count, width), (batch * size, size, width, 1))
                grad_line[h0:h1, r0 + first : r0 + first + width].add_(diagonal.sum(dim=(1, 2)))
    grad_q = grad_q.mul_(scale).view(heads, batch, rows, dim).transpose(0, 1).flip(2).to(dtype)
    grad_k = grad_k3.mul_(scale).view(heads, batch, k_len, dim).transpose(0, 1).to(k.dtype)
    grad_v = grad_v3.view(heads, batch, k_len, dim).transpose(0, 1).to(v.dtype)
    return grad_q, grad_k, grad_v, None if grad_line is None else grad_line.to(line.dtype)
