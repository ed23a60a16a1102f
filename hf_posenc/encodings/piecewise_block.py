"""One chunked block of a piecewise-linear distance bias (FIRE's, Li et al. 2023, "Functional
Interpolation for Relative Positions Improves Long Context Transformers", arXiv:2310.04418)
from its linear pieces, mask folded in (:meth:`.piecewise_bias.PiecewiseDistanceBias.folded`):

    bias[b, h, a, j] = slopes[h, s] * x + intercepts[h, s],   s = #{k : points[k] <= x}

:func:`monotone_segments` finds the pieces of rows along which x is monotone (one search per
row and breakpoint and a cumulative sum, not a search per score); :class:`PiecewiseBlock`
writes the block from them and sums its gradient per piece.
"""

from __future__ import annotations

import torch


def monotone_segments(
    x: torch.Tensor, points: torch.Tensor, future: torch.Tensor | None = None, shift: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, rows, keys), non-increasing along the keys; points (K,) sorted -> the number of
    points <= x, (B, rows, keys) int32, plus ``shift`` from key ``future[row]`` on (rows,) when
    given; and the run ends E (B * rows, K) int64: piece m covers keys E[m] .. E[m-1]-1 of a row
    (E[-1] = keys, E[K] = 0) before the shift.

    Along a row the keys with x >= p_k are a prefix (of length E_k, one ``searchsorted`` per row
    and point), so the count is K minus the number of prefixes that ended: a cumulative sum of
    ones scattered at the E_k (and of -shift at ``future``). (Where rounding made x not
    monotone, the piece of an x within an ulp of a breakpoint may be its neighbour: f is
    continuous there, so the bias is unchanged to fp32 rounding.)
    """
    batch, rows, keys = x.shape
    flat = x.reshape(-1, keys)  # (B * rows, keys)
    count = points.shape[0]
    ends = torch.searchsorted(flat.neg(), points.neg().expand(flat.shape[0], count).contiguous(), right=True)
    ended = torch.zeros(flat.shape[0], keys + 1, dtype=torch.int32, device=x.device)
    ended.scatter_add_(
        1, ends, torch.ones(ends.shape, dtype=torch.int32, device=x.device)
    )  # (B * rows, keys + 1)
    if future is not None:
        rows_future = future.clamp(0, keys).repeat(batch)[:, None]  # (B * rows, 1)
        ended.scatter_add_(
            1, rows_future, torch.full(rows_future.shape, -shift, dtype=torch.int32, device=x.device)
        )
    pieces = count - ended.cumsum(1, dtype=torch.int32)[:, :-1]
    return pieces.reshape(x.shape), ends


class PiecewiseBlock(torch.autograd.Function):
    """(x (B|1, rows, keys), piece (B', rows, keys) int32, run ends E (B|1 * rows, K), slopes,
    intercepts (Hq, P), out (B', Hq, rows, keys) or None) -> ``slopes[h, piece] * x +
    intercepts[h, piece]`` (B', Hq, rows, keys) fp32, written into ``out`` when given (a
    buffer that is reused, so only without gradients). Pieces past K are masked keys: they pass
    no gradient.

    Forward: per (batch row, head) two gathers from (P,) vectors into one output block and a
    multiply-add, no (Hq, rows, keys) temporaries. Backward: the gradient of slopes and
    intercepts summed per piece — the pieces of a row are runs of keys (E), so a run's sum is a
    difference of the row's cumulative sums at its two ends — and of x summed over the heads.
    """

    @staticmethod
    def forward(ctx, x, piece, ends, slopes, intercepts, out=None):
        batch, heads = piece.shape[0], slopes.shape[0]
        if out is None:
            out = x.new_empty(batch, heads, *piece.shape[1:])  # (B', Hq, rows, keys)
        gathered = x.new_empty(piece[0].numel())
        for b in range(batch):
            index, values = piece[b].reshape(-1), x[b if x.shape[0] > 1 else 0].reshape(-1)
            for h in range(heads):
                block = out[b, h].view(-1)
                torch.index_select(intercepts[h], 0, index, out=block)
                torch.index_select(slopes[h], 0, index, out=gathered)
                block.addcmul_(gathered, values)
        ctx.save_for_backward(x, piece, ends, slopes)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, piece, ends, slopes = ctx.saved_tensors
        (batch, rows, keys), heads, count = piece.shape, slopes.shape[0], ends.shape[-1]
        grad = grad.float().masked_fill(piece[:, None] > count, 0.0)  # (B', Hq, rows, keys)
        # run m of a row is keys E[m] .. E[m-1]-1: its sum is prefix(E[m-1]) - prefix(E[m])
        full = ends.new_full((ends.shape[0], 1), keys)
        bounds = torch.cat((full, ends, torch.zeros_like(full)), dim=-1).view(-1, rows, count + 2)
        bounds = bounds.expand(batch, rows, count + 2)[:, None].expand(batch, heads, rows, count + 2)
        before = (bounds - 1).clamp(min=0)  # prefix(e) = cumsum[e - 1], prefix(0) = 0

        def run_sums(values: torch.Tensor) -> torch.Tensor:  # (B', Hq, rows, keys) -> (Hq, K+1)
            prefix = values.cumsum(-1).gather(-1, before).masked_fill_(bounds == 0, 0.0)
            return (prefix[..., :-1] - prefix[..., 1:]).sum(dim=(0, 2))

        grad_slopes, grad_intercepts = torch.zeros_like(slopes), torch.zeros_like(slopes)
        grad_intercepts[:, : count + 1] = run_sums(grad)
        grad_slopes[:, : count + 1] = run_sums(grad * x[:, None])
        grad_x = torch.zeros(batch, piece[0].numel(), dtype=torch.float32, device=x.device)
        for b in range(batch):
            index = piece[b].reshape(-1)
            for h in range(heads):
                grad_x[b].addcmul_(grad[b, h].reshape(-1), slopes[h].index_select(0, index))
        grad_x = grad_x.view(piece.shape).sum_to_size(x.shape)
        return grad_x, None, None, grad_slopes, grad_intercepts, None
