"""FIRE's normalised distance x = psi(i - j) / psi(max(L, i)) of one block of queries over its keys,
from one line of features and the rows' normalisers, with its own backward
(:class:`DistanceRatio`; Li et al. 2023, "Functional Interpolation for Relative Positions
Improves Long Context Transformers", arXiv:2310.04418)."""

from __future__ import annotations

import torch


def distance_ratio(
    feature: torch.Tensor, normalizer: torch.Tensor, first: int, keys: int, reverse: bool
) -> torch.Tensor:
    """feature (Tk,), the rows' normalizer (B|1, rows) -> x (B|1, rows, keys) fp32 with x[b, a,
    b'] = feature[max(0, first + a + b')] / normalizer[b, a] over the keys in reverse order (b'),
    flipped back unless ``reverse``: a strided view (stride 1 along both) of one line of
    features, divided, one rounding to fp32."""
    rows = normalizer.shape[1]
    positions = torch.arange(first, first + rows + keys - 1, device=feature.device).clamp_(min=0)
    line = feature[positions]  # (rows + keys - 1,)
    reversed_x = torch.empty(normalizer.shape[0], rows, keys, dtype=torch.float32, device=feature.device)
    torch.div(line.as_strided((rows, keys), (1, 1)), normalizer[:, :, None], out=reversed_x)
    return reversed_x if reverse else reversed_x.flip(-1)


class DistanceRatio(torch.autograd.Function):
    """(feature (Tk,), normalizer (B|1, Tq), first, start, stop, keys, reverse) -> :func:`distance_ratio`
    of queries ``start .. stop-1``, differentiable in both tensors; keeps only them (O(T)).

    Backward in the tensors' dtype (FIRE: fp64, where c's gradient needs it), from the
    gradient g over the keys in reverse order, y = g / normalizer:
    d normalizer[b, a] = -sum_b' y[b, a, b'] feature[d] / normalizer[b, a] (a row sum), and
    d feature[d] = the sum of y over the anti-diagonal a + b' = d - first (summed over the
    batch; distances clamped to 0 land on d = 0), read from y skewed into a (rows, rows + keys)
    buffer — no (rows, keys) distance index and no scattered accumulation."""

    @staticmethod
    def forward(ctx, feature, normalizer, first: int, start: int, stop: int, keys: int, reverse: bool):
        ctx.save_for_backward(feature, normalizer)
        ctx.first, ctx.start, ctx.stop, ctx.keys, ctx.reverse = first, start, stop, keys, reverse
        return distance_ratio(feature, normalizer[:, start:stop], first, keys, reverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        feature, normalizer = ctx.saved_tensors
        first, start, stop, keys = ctx.first, ctx.start, ctx.stop, ctx.keys
        rows, width = stop - start, stop - start + keys - 1
        rows_normalizer = normalizer[:, start:stop, None]  # (B|1, rows, 1)
        reversed_grad = grad if ctx.reverse else grad.flip(-1)  # (B|1, rows, keys) over reversed keys
        y = torch.div(reversed_grad, rows_normalizer)  # (B|1, rows, keys) in the normaliser's dtype
        positions = torch.arange(first, first + width, device=feature.device).clamp_(min=0)
        line = feature[positions]  # (rows + keys - 1,)
        grad_feature = grad_normalizer = None
        if ctx.needs_input_grad[1]:
            grad_normalizer = torch.zeros_like(normalizer)
            dot = (y * line.as_strided((rows, keys), (1, 1))).sum(-1)  # (B|1, rows)
            grad_normalizer[:, start:stop] = -dot / rows_normalizer[..., 0]
        if ctx.needs_input_grad[0]:
            summed = y.sum(0) if y.shape[0] > 1 else y[0]  # (rows, keys)
            skewed = y.new_zeros(rows, width)  # skewed[a, a + b'] = summed[a, b']
            skewed.as_strided((rows, keys), (width + 1, 1)).copy_(summed)
            grad_feature = torch.zeros_like(feature).index_add_(0, positions, skewed.sum(0))
        return grad_feature, grad_normalizer, None, None, None, None, None
