"""FIRE's banded blocks with gradients (:mod:`.network_bands` builds them without): the block of
each batch row through :class:`BandedBlock`, whose backward works in the same bands of distances
and gives the network's gradients by hand (no autograd graph through the bands' coefficients),
and the gradients of near = psi(d) and of the rows' normalisers, which pass on to FIRE's c and L
(Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context
Transformers", arXiv:2310.04418)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .network_bands import (
    Banded,
    BandPlan,
    BlockViews,
    Network,
    ZoneColumns,
    clipped_spans,
    distance_view,
    line_and_inverse,
    plan_bands,
    shifted,
    zone_columns,
)
from .network_block import future_minimum


def banded_rows(
    feature: torch.Tensor, normalizer: torch.Tensor, network: Network, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """The causal block of every batch row, (B|1, Hq, rows, keys) fp32 over keys in reverse order,
    as :func:`.network_bands.banded_block` writes it from near = feature.float() and inverse =
    normalizer.reciprocal().float(); ``feature`` (keys,) = feature[d] for d = 0 .. keys-1 and
    ``normalizer`` (B|1, rows) in any float dtype (FIRE: fp64), differentiable in them and the
    network (:class:`BandedBlock`). One row's block goes into ``scratch`` (a flat fp32 buffer,
    overwritten) where it is large enough: the training blocks' backward rebuilds each block
    into the forward's bias buffer, alive until then anyway, instead of a new block-sized tensor
    per block (each a fresh mapping, paid in page faults, beside that buffer at the step's peak)."""
    with torch.no_grad():
        near, inverse = line_and_inverse(feature, normalizer)
    if normalizer.shape[0] != 1:
        scratch = None  # the rows' blocks are concatenated: each its own tensor
    blocks = [
        BandedBlock.apply(feature, row_normalizer, *network, plan_bands(near, row_inverse, network), scratch)
        for row_normalizer, row_inverse in zip(normalizer, inverse, strict=True)
    ]  # (1, Hq, rows, keys) each
    # one row's block is the function's own output, not a view of it: the chunked backend writes
    # its scores into the block in backward (in place), and a view's gradient would then be
    # rebuilt as an as_strided one (a zero-filled block and a scatter, ~2 ms per block)
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


class BandedBlock(torch.autograd.Function):
    """(near (keys,), inverse (rows,), w1, b1, w2, b2, the :class:`BandPlan`) -> one batch row's
    block (1, Hq, rows, keys) as :func:`.network_bands.banded_block` writes it. Backward, from the block's gradient G
    (its future entries, which a softmax's dS holds as exact zeros, are set to 0 in place: V
    reads them), in the same bands:

    - V's lines: dC[h, d] = S0[h, d] = sum_a G[h, a, d], dslope[h, d] = near[d] S1[h, d] with
      S1 = sum_a G inv[a] (one product over V's rows), d near[d] += sum_h slope S1, d inv[a] +=
      sum_h (G[h] @ E[h])[a] (E = slope * near); the same for the last row's farthest key;
    - each zone: with r = relu(w1 x + b1), d w2[:, k] += sum G r, g = sum_h w2[h, k] G where r > 0,
      d b1_k += sum g, d w1_k += sum g x, and dx = w1_k g to near and inv;
    - the lines to the network (:func:`_lines_gradient`): dC and dslope summed per band, then
      through C = b2 + sum_on w2 b1 and slope = sum_on w2 w1.

    near and inv pass theirs on to FIRE's c and L. O(rows x keys) work per head, no matrix
    products over features."""

    @staticmethod
    def forward(ctx, feature, normalizer, w1, b1, w2, b2, plan, scratch=None):
        near, inverse = line_and_inverse(feature, normalizer)  # (keys,), (rows,)
        shape = (1, w2.shape[0], inverse.shape[0], near.shape[0])
        if scratch is not None and scratch.dtype == torch.float32 and scratch.numel() >= math.prod(shape):
            # the block in the scratch's memory as a tensor of its own, not a view of the scratch
            # (autograd refuses a custom function's view output that is then changed in place)
            block = near.new_empty(0).set_(scratch.untyped_storage(), scratch.storage_offset(), shape)
        else:
            block = near.new_empty(shape)
        banded = Banded.of(near, inverse, (w1, b1, w2, b2), plan)
        banded.write(BlockViews.of(block[0], banded.spans), slice(0, w2.shape[0]))
        ctx.save_for_backward(feature, normalizer, w1, b1, w2, b2)
        # V's zone columns (x and the ReLUs) for the zones' gradient: this block is rebuilt in the
        # attention's backward and its own backward runs right after, so they live that long only
        ctx.plan, ctx.columns = plan, banded.columns
        return block

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        feature, normalizer, w1, b1, w2, b2 = ctx.saved_tensors
        plan: BandPlan = ctx.plan
        near, inverse = line_and_inverse(feature, normalizer)
        grad = grad[0].float().contiguous()  # (Hq, rows, keys): the distance view reads its memory
        heads, rows, keys = grad.shape
        width = keys - 1
        # the future at 0: V reads it as row a - 1's farthest distances
        grad[:, :, :rows].mul_(future_minimum(rows, rows, grad.device) == 0)
        grad_w1, grad_b1, grad_w2 = torch.zeros_like(w1), torch.zeros_like(b1), torch.zeros_like(w2)
        unit = (w1, b1, w2, grad_w1, grad_b1, grad_w2)
        slopes = plan.coefficients[1]  # (Hq, keys)
        grad_lines = torch.empty_like(plan.coefficients)  # (2, Hq, keys) dC, dslope
        grad_near = torch.zeros_like(feature)
        grad_inverse = torch.zeros(rows, dtype=torch.float64, device=grad.device)
        # near and inv unrounded (fp64) for dx's sums to them: their two paths to c nearly cancel, so
        # each must be as exact as dx (with near, inv rounded to fp32 c's gradient was off by ~1e-5 of
        # either path's size: rows=1, keys=3, c=1, L=1 read 3.996e-6 against 4.143e-6)
        near64, inverse64 = feature.double(), normalizer.double().reciprocal()
        # V (distances 0 .. keys - 2), then the last row's farthest key (keys - 1), in its own (Hq, 1, 1)
        parts = (
            (distance_view(grad), slice(0, width), slice(0, rows), plan.zones, ctx.columns),
            (
                grad[:, rows - 1 :, width:],
                slice(width, keys),
                slice(rows - 1, rows),
                shifted(plan.zones, width),
                None,
            ),
        )
        for view, columns, part_rows, zones, made in parts:
            part_near, part_inverse = near[columns], inverse[part_rows]
            torch.sum(view, 1, out=grad_lines[0, :, columns])  # S0
            torch.mul(torch.matmul(part_inverse, view), part_near, out=grad_lines[1, :, columns])  # S1 near
            # dx (rows, n) = sum_h G slope (+ the zones' ReLUs), to near and inv in fp64 below (FIRE's
            # c sums dx times dx/dc, whose two terms nearly cancel: fp32 sums of each lose ~1e-4)
            dx = view[0] * slopes[0, columns]
            for h in range(1, heads):
                dx.addcmul_(view[h], slopes[h, columns])
            _zones_gradient(view, part_near, part_inverse, zones, unit, dx, made)
            dx64 = dx.double()
            grad_near[columns] += (inverse64[part_rows] @ dx64).to(feature.dtype)
            grad_inverse[part_rows] += dx64 @ near64[columns]
        grad_b2 = _lines_gradient(grad_lines, plan, unit)
        # inverse = 1 / normaliser
        grad_normalizer = (-grad_inverse / normalizer.double() ** 2).to(normalizer.dtype)
        return grad_near, grad_normalizer, grad_w1, grad_b1, grad_w2, grad_b2, None, None


def _lines_gradient(grad_lines: torch.Tensor, plan: BandPlan, unit: tuple) -> torch.Tensor:
    """The per-distance gradients of C and slope (2, Hq, keys) to the network: added to w2, b1
    and w1 (in ``unit`` = (w1, b1, w2, grad_w1, grad_b1, grad_w2)); -> the gradient of b2 (Hq,).
    Per band i (C, slope constant there): C_i = b2 + sum_k on[i, k] w2[:, k] b1_k, slope_i =
    sum_k on[i, k] w2[:, k] w1_k."""
    w1, b1, w2, grad_w1, grad_b1, grad_w2 = unit
    member = F.one_hot(plan.band_of, plan.on.shape[0]).to(grad_lines.dtype)  # (keys, I)
    per_band = grad_lines @ member  # (2, Hq, I) dC, dslope summed over each band's distances
    on = plan.on.to(per_band.dtype)  # (I, K)
    through_constant, through_slope = per_band @ on  # (Hq, K) each: sum over the bands where k is on
    grad_w2 += through_constant * b1 + through_slope * w1
    grad_b1 += (through_constant * w2).sum(0)
    grad_w1 += (through_slope * w2).sum(0)
    return per_band[0].sum(1)


def _zones_gradient(
    grad: torch.Tensor,
    near: torch.Tensor,
    inverse: torch.Tensor,
    zones: list[tuple[int, int]],
    unit: tuple,
    dx: torch.Tensor,
    made: ZoneColumns | None = None,
) -> None:
    """Every zone's share of V's gradient ``grad`` (Hq, rows, D) at x = near[d] * inverse[a]
    (``near`` (D,)), zones clipped to 0 .. D: added to the units' w2 columns, b1 and w1 (in
    ``unit`` = (w1, b1, w2, grad_w1, grad_b1, grad_w2)) and to ``dx`` (rows, D); ``made``: these
    zones' :func:`~.network_bands.zone_columns` where the block's build made them. All zones at
    once: their columns gathered into one (Hq, rows, n) copy, each column with its unit's
    parameters, the per-unit sums by ``index_add_`` (zones of two units may share columns: both
    are added), so a block costs a few passes over its zones' columns (one per head) instead of
    ten small operations per zone."""
    w1, b1, w2, grad_w1, grad_b1, grad_w2 = unit
    spans = clipped_spans(zones, grad.shape[-1])
    if not spans:
        return
    # x, r (rows, n)
    columns, owner, x, hidden = zone_columns(near, inverse, spans, (w1, b1, w2)) if made is None else made
    gathered = torch.cat([grad[:, :, lo:hi] for _, lo, hi in spans], dim=2)  # (Hq, rows, n) G
    unit_weight = w1[owner]  # (n,)
    # head by head (no (Hq, rows, n) temporaries: ~20 % faster): the sums over rows of G r per
    # column, and g = sum_h w2[h, k] G
    weights = w2[:, owner]  # (Hq, n)
    per_column = torch.empty_like(weights)  # (Hq, n)
    through = gathered[0] * weights[0]  # (rows, n)
    for h in range(gathered.shape[0]):
        torch.sum(gathered[h] * hidden, 0, out=per_column[h])
        if h:
            through.addcmul_(gathered[h], weights[h])
    grad_w2.index_add_(1, owner, per_column)
    through.mul_(hidden > 0)  # g where the unit is on
    grad_b1.index_add_(0, owner, through.sum(0))
    grad_w1.index_add_(0, owner, (through * x).sum(0))
    dx.index_add_(1, columns, through.mul_(unit_weight))
