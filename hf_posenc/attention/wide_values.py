"""Attention whose values are wider than its queries and keys, forward and backward in explicit
blocks of query rows from the rows' log-sum-exp: TAPE's values beside its positional stream, on
CPU (:mod:`.stream_flash`).

For one query block (rows R, the keys K its rows may see, a KV head's G query heads stacked
along the rows so that no key is copied per query head):

    forward:   S = s Q K^T (masked),  lse = log sum_j exp(S),  out = exp(S - lse) V
    backward:  P = exp(S - lse),  dV += P^T dO,  dS = P * (dO V^T - rowsum(dO * out)),
               dQ = s dS K,  dK += s dS^T Q

(FlashAttention-2, Dao 2023, Algorithms 1 and 2: the row statistics are all the backward needs,
so nothing of size rows x keys outlives its block). The exponents are taken in base 2 (log2(e)
folded into the scale) with weights below 2^FLUSH flushed to 0 (no subnormals, each ~100x in exp2
and BLAS); a row with no allowed key gives 0 (and lse -inf), as SDPA gives.

Why by hand: torch's fused CPU flash kernel takes q, k and v of one width ("Q/K/V should have the
same head size"), so TAPE's values [v | stream] (W = Dv + S) made it pad q and k with zeros to W
and compute every score's product and every dq/dk at twice the width. Here the score products
stay at q's width D and only the value products are W wide. One layer of 8 heads of D = 32, W =
64, T = 2048, causal, on the 2-vCPU VM of 2026-11-28 (``python scripts/tape_value_width_cost.py
--rounds 8 --by-state``, medians, fast / slow state): forward 23.8 / 24.8 ms here against 27.7 /
29.0 for the fused kernel at W (native's width-32 call 15.7 / 17.2), backward 58.4 / 59.6 against
71.4 / 71.9 (native 41.8 / 44.7). One-off runs of the same comparison (best of 5, fast state):
16 heads of D = 64 backward 191-221 against 262-277 ms, 32 heads of D = 128 825-832 against
1086-1107 (forward 87 / 104 and 397 / 436).

The backward's heads are split over torch's threads, each half's operations single-threaded
(:mod:`.thread_split`): with every operation on both threads instead it read 56.9 / 73.4 ms (one
wait for the threads per operation, ~100 us each in the slow state). The forward's operations
stay on all threads: split by heads it ran slower (30-31 against 24-26 ms in both states).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from ..core.memo import ForwardMemo
from . import thread_split
from .toeplitz_layout import FLUSH, LOG2E

#: query rows of a forward block per query head, for head widths up to 32 (twice this above)
FORWARD_ROWS = 64
#: query rows of a backward block per query head
BACKWARD_ROWS = 128
#: query heads whose scores one batched product computes (the threads split them; 4 heads of 64
#: rows ran ~1.5x slower than 8 at D = 32 with torch's two threads in each product)
HEADS = 8
#: bytes of one product's scores (and of its dP in backward) at most: fewer rows per block where
#: T is long (the forward's 64 rows of 8 heads reach it at T = 4096, where its peak by the
#: profiler's count is 53 MiB against native's 41 in the bench's model, 45 with the fused kernel
#: before; 32 rows there ran ~5 % slower, 91 against 86.5 ms a layer)
BLOCK_BYTES = 8 * 2**20


def _layout(heads: int, kv_heads: int, keys: int, itemsize: int, rows: int) -> tuple[int, int]:
    """(KV heads per product, rows per block) for ``heads`` query heads over ``keys`` keys in
    blocks of ``rows`` rows, fewer where one block's scores would pass :data:`BLOCK_BYTES`."""
    groups = heads // kv_heads
    per_product = max(1, min(kv_heads, HEADS // groups))
    return per_product, min(rows, max(16, BLOCK_BYTES // max(1, per_product * groups * keys * itemsize)))


def key_spans(
    allowed: torch.Tensor | None, q_len: int, k_len: int, rows: int
) -> list[tuple[int, int, int, int]]:
    """(first row, end row, first key, end key) of each block of ``rows`` queries: the keys any of
    its rows may see. ``allowed`` (B|1, 1, Tq|1, Tk) bool, or None: causal, bottom-right aligned."""
    spans = []
    if allowed is None:
        offset = k_len - q_len
        for start in range(0, q_len, rows):
            end = min(start + rows, q_len)
            spans.append((start, end, 0, min(k_len, end + offset)))
        return spans
    seen = allowed.any(0)[0].to(torch.uint8)  # (Tq|1, Tk): allowed for some batch row (one byte each)
    sees = seen.amax(-1).bool()  # (Tq|1,)
    # first and last allowed key per row by argmax (the first maximum) over the keys and over them
    # reversed: no (Tq, Tk) index tensor
    first = torch.where(sees, seen.argmax(-1), k_len).expand(q_len)  # (Tq,): k_len where none
    last = torch.where(sees, k_len - seen.flip(-1).argmax(-1), 0).expand(q_len)  # (Tq,): 0 there
    for start in range(0, q_len, rows):
        end = min(start + rows, q_len)
        spans.append((start, end, int(first[start:end].min()), int(last[start:end].max())))
    return spans


class _Blocks:
    """The blocks of one call: q (B, Hq, Tq, D), k (B, Hkv, Tk, D)."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        allowed: torch.Tensor | None,
        scale: float,
        rows: int,
        memo: ForwardMemo | None,
    ) -> None:
        self.batch, heads, self.q_len, self.dim = q.shape
        self.kv_heads, self.k_len = k.shape[1], k.shape[2]
        self.groups = heads // self.kv_heads
        self.per_product, self.rows = _layout(heads, self.kv_heads, self.k_len, q.element_size(), rows)
        self.spans = (
            key_spans(allowed, self.q_len, self.k_len, self.rows)
            if allowed is None or memo is None  # (a mask is every layer's: read once per forward)
            else memo.get(
                ("wide_values.key_spans", id(allowed), self.q_len, self.k_len, self.rows),
                lambda: key_spans(allowed, self.q_len, self.k_len, self.rows),
            )
        )
        # (B|1, 1, Tq|1, Tk): a mask over keys only stays one row, read by every block
        self.blocked = None if allowed is None else ~allowed
        self.causal_offset = self.k_len - self.q_len
        self.exponent_scale = scale * LOG2E
        # the future keys of a causal block's last rows: key > row + offset
        self.future = torch.ones(self.rows, self.rows, dtype=torch.bool, device=q.device).triu(1)

    def pieces(self, parts: int) -> list[tuple[int, slice]]:
        """(batch row, KV heads) of each piece of work: every batch row's KV heads cut into
        ``parts`` ranges (fewer where there are fewer heads)."""
        size = -(-self.kv_heads // min(parts, self.kv_heads))
        ranges = [slice(h, min(h + size, self.kv_heads)) for h in range(0, self.kv_heads, size)]
        return [(b, heads) for b in range(self.batch) for heads in ranges]

    def product_rows(self, heads: slice) -> int:
        """Rows of the largest product over the KV heads ``heads``: query heads x block rows."""
        return min(self.per_product, heads.stop - heads.start) * self.groups * self.rows

    def products(self, heads: slice) -> list[slice]:
        """The KV heads ``heads`` in groups of at most ``per_product``: one batched product each."""
        step = self.per_product
        return [slice(h, min(h + step, heads.stop)) for h in range(heads.start, heads.stop, step)]

    def stacked(self, x: torch.Tensor, b: int, kv: slice, start: int, end: int) -> torch.Tensor:
        """Query-head rows (B, Hq, Tq, X) of batch row ``b``, the KV heads ``kv``' query heads ->
        (h, G*R, X), the G query heads of a KV head stacked along the rows (a copy for G > 1)."""
        g = self.groups
        return x[b, kv.start * g : kv.stop * g, start:end].reshape(kv.stop - kv.start, g * (end - start), -1)

    def mask(self, scores: torch.Tensor, b: int, span: tuple[int, int, int, int]) -> None:
        """-inf into ``scores`` (h, G*R, K) where the block's rows may not see a key."""
        start, end, first, last = span
        grouped = scores.view(scores.shape[0], self.groups, end - start, last - first)
        if self.blocked is None:  # causal: only the keys past a row's own position, the last R columns
            diagonal = start + self.causal_offset
            if diagonal < last:
                size = min(end, last - self.causal_offset) - start
                grouped[..., diagonal - first : diagonal - first + size].masked_fill_(
                    self.future[: end - start, :size], -math.inf
                )
        else:
            mask = self.blocked[b if self.blocked.shape[0] > 1 else 0, 0]  # (Tq|1, Tk)
            rows = slice(start, end) if mask.shape[0] > 1 else slice(None)
            grouped.masked_fill_(mask[rows, first:last], -math.inf)  # (R|1, K) over (h, G, R, K)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    values: Sequence[torch.Tensor],
    allowed: torch.Tensor | None,
    scale: float,
    outputs: Sequence[torch.Tensor],
    memo: ForwardMemo | None = None,
) -> torch.Tensor:
    """softmax(scale q k^T, masked) times each of ``values``, written into ``outputs`` -> lse
    (B, Hq, Tq).

    q (B, Hq, Tq, D); k (B, Hkv, Tk, D); ``values`` (B, Hkv, Tk, X_i), attended with the same
    weights (W = sum X_i wide together); ``outputs`` (B, Hq, Tq, X_i) views, any strides;
    ``allowed`` (B|1, 1, Tq|1, Tk) bool or None (causal, bottom-right aligned); ``memo``: the
    forward's, where the blocks' key spans of a mask are kept for the other layers."""
    block_rows = FORWARD_ROWS if q.shape[-1] <= 32 else 2 * FORWARD_ROWS
    blocks = _Blocks(q, k, allowed, scale, block_rows, memo)
    g = blocks.groups
    lse = q.new_empty(blocks.batch, q.shape[1], blocks.q_len)
    widths = [x.shape[-1] for x in values]
    # side by side; a column of ones beside them (the weights' sums from the same product, no pass
    # of their own) made the product N = W + 1 wide: the bench's TAPE forward 1.40x native against
    # 1.31x-1.33x
    together = torch.cat(tuple(values), dim=-1) if len(values) > 1 else values[0]  # (B, Hkv, Tk, W)
    tiny, lowest = torch.finfo(q.dtype).tiny, torch.finfo(q.dtype).min

    def piece(b: int, heads: slice) -> None:
        buffer = q.new_empty(blocks.product_rows(heads) * blocks.k_len)
        for kv in blocks.products(heads):
            count, query_heads = kv.stop - kv.start, slice(kv.start * g, kv.stop * g)
            for span in blocks.spans:
                start, end, first, last = span
                rows = g * (end - start)
                if last <= first:  # no row of the block sees a key
                    lse[b, query_heads, start:end] = -math.inf
                    for out in outputs:
                        out[b, query_heads, start:end] = 0
                    continue
                scores = buffer[: count * rows * (last - first)].view(count, rows, last - first)
                queries = blocks.stacked(q, b, kv, start, end)  # (h, G*R, D)
                # log2(e) s q k^T, (h, G*R, K)
                torch.baddbmm(
                    scores, queries, k[b, kv, first:last].transpose(1, 2), beta=0.0,
                    alpha=blocks.exponent_scale, out=scores,
                )  # fmt: skip
                blocks.mask(scores, b, span)
                top = scores.amax(-1, keepdim=True).clamp_min_(lowest)  # (h, G*R, 1)
                torch.threshold_(scores.sub_(top), FLUSH, -math.inf).exp2_()
                total = scores.sum(-1)  # (h, G*R)
                attended = torch.bmm(scores, together[b, kv, first:last])  # (h, G*R, W)
                attended.div_(total.clamp_min(tiny)[..., None])
                lse[b, query_heads, start:end] = ((top[..., 0] + total.log2()) / LOG2E).view(-1, end - start)
                attended = attended.view(count * g, end - start, -1)  # (hq, R, W)
                for out, part in zip(outputs, attended.split(widths, dim=-1), strict=True):
                    out[b, query_heads, start:end] = part

    # each operation on torch's threads: split by heads over the threads instead (as the backward
    # is), it ran slower (30-31 against 24-26 ms a layer, see the module's docstring)
    for b, heads in blocks.pieces(1):
        piece(b, heads)
    return lse


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    values: Sequence[torch.Tensor],
    allowed: torch.Tensor | None,
    scale: float,
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    lse: torch.Tensor,
    memo: ForwardMemo | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The gradients (dq, dk, [dvalues_i]) of :func:`forward`'s outputs from its ``lse``
    (B, Hq, Tq), its ``outputs`` and their gradients ``grads`` (B, Hq, Tq, X_i) views; the rest
    as :func:`forward`'s (same blocks, same mask)."""
    blocks = _Blocks(q, k, allowed, scale, BACKWARD_ROWS, memo)
    (batch, kv_heads, k_len, _), g = k.shape, blocks.groups
    widths = [x.shape[-1] for x in values]
    width = sum(widths)
    # dO V^T - rowsum(dO * out) as one product: dO with -rowsum(dO * out) as one more column, V
    # with a column of ones
    grad_aug = q.new_empty(batch, q.shape[1], blocks.q_len, width + 1)  # (B, Hq, Tq, W + 1)
    grad_aug[..., width].zero_()
    column = 0
    for out, grad in zip(outputs, grads, strict=True):
        grad_aug[..., column : column + grad.shape[-1]] = grad
        grad_aug[..., width].sub_((grad * out).sum(-1))
        column += grad.shape[-1]
    values_aug = torch.cat((*values, values[0].new_ones(batch, kv_heads, k_len, 1)), dim=-1)
    # lse -inf (a row that sees no key): +inf, so that its weights exp2(S - lse) are 0, not NaN
    shift = lse.masked_fill(lse == -math.inf, math.inf).mul_(-LOG2E)[..., None]  # (B, Hq, Tq, 1)
    grad_q = torch.zeros_like(q)
    # dk and dvalues transposed, (B, Hkv, D | W, Tk): Q^T dS and dO^T P, products whose output rows
    # are contiguous (as rebuilt_flash's chain, where they ran ~20 % faster than dS^T Q and P^T dO)
    grad_k = q.new_zeros(batch, kv_heads, blocks.dim, k_len)
    grad_values = q.new_zeros(batch, kv_heads, width, k_len)

    def piece(b: int, heads: slice) -> None:
        size = blocks.product_rows(heads) * k_len
        buffer, work = q.new_empty(size), q.new_empty(size)
        for kv in blocks.products(heads):
            count, query_heads = kv.stop - kv.start, slice(kv.start * g, kv.stop * g)
            for span in blocks.spans:
                start, end, first, last = span
                if last <= first:
                    continue
                rows, keys = g * (end - start), last - first
                weights = buffer[: count * rows * keys].view(count, rows, keys)
                queries = blocks.stacked(q, b, kv, start, end)  # (h, G*R, D)
                grad_rows = blocks.stacked(grad_aug, b, kv, start, end)  # (h, G*R, W + 1)
                key_block = k[b, kv, first:last]  # (h, K, D)
                # log2(e) (s q k^T - lse), (h, G*R, K)
                weights.copy_(blocks.stacked(shift, b, kv, start, end).expand(-1, -1, keys))
                weights.baddbmm_(queries, key_block.transpose(1, 2), alpha=blocks.exponent_scale)
                blocks.mask(weights, b, span)
                torch.threshold_(weights, FLUSH, -math.inf).exp2_()  # P
                # (P^T dO)^T = dO^T P, (h, W, K)
                grad_values[b, kv, :, first:last].baddbmm_(grad_rows[..., :width].transpose(1, 2), weights)
                grad_p = work[: count * rows * keys].view(count, rows, keys)
                torch.bmm(grad_rows, values_aug[b, kv, first:last].transpose(1, 2), out=grad_p)
                weights.mul_(grad_p)  # dS = P * (dO V^T - delta)
                grad_q[b, query_heads, start:end] = torch.bmm(weights, key_block).view(
                    count * g, end - start, -1
                )
                grad_k[b, kv, :, first:last].baddbmm_(queries.transpose(1, 2), weights)  # Q^T dS

    # the heads split over torch's threads, each piece's operations single-threaded (see thread_split)
    pieces = blocks.pieces(thread_split.parts())
    thread_split.side_by_side([functools.partial(piece, b, heads) for b, heads in pieces])
    return (
        grad_q.mul_(scale),
        grad_k.mul_(scale).transpose(-1, -2).contiguous(),
        list(grad_values.transpose(-1, -2).contiguous().split(widths, dim=-1)),
    )
