"""FIRE's banded blocks with gradients (:mod:`.network_bands` builds them without): the block of
each batch row through :class:`BandedBlock`, whose backward works in the same bands of distances
and gives the network's gradients by hand (no autograd graph through the bands' coefficients),
and the gradients of near = psi(d) and of the rows' normalisers, which pass on to FIRE's c and L;
or a group of heads at a time without a graph (:class:`RebuiltHeads`), the same gradients
added by hand (:class:`BandGradients`) (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context
Transformers", arXiv:2310.04418)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

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
    written_groups,
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
    block (1, Hq, rows, keys) as :func:`.network_bands.banded_block` writes it; backward by
    :class:`BandGradients`, every head at once. near and inv pass theirs on to FIRE's c and L."""

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
        gradients = BandGradients(feature, normalizer, (w1, b1, w2, b2), ctx.plan, ctx.columns)
        gradients.add(slice(0, w2.shape[0]), grad[0].float().contiguous())
        return *gradients.result(), None, None


class RebuiltHeads:
    """One causal block (the batch's one row of normalisers) rebuilt in backward a group of heads
    at a time, with its gradients by hand instead of an autograd graph: :meth:`blocks` writes
    each group's block (1, g, rows, keys) over reversed keys into one buffer as it is asked for,
    exactly as :func:`.network_bands.banded_block` writes it; :meth:`add_gradient` takes the
    group's dS (:class:`BandGradients`) before the next group is written; :meth:`result` gives
    the gradients (d feature, d normaliser (1, rows), d w1, d b1, d w2, d b2). The chunked
    backend's training blocks then hold one group's block, not every head's (2x less at
    ``rebuilt_flash.REBUILT_HEADS = 4`` with 8 heads), while it is hot for the attention's backward chain."""

    def __init__(
        self, feature: torch.Tensor, normalizer: torch.Tensor, network: Network, plan: BandPlan | None = None
    ) -> None:
        # no graph (its caller may run with gradients on): the gradients come by hand
        with torch.no_grad():
            near, inverse = line_and_inverse(feature, normalizer[0])
            # the forward's plan of this block where it was kept (the same near, inverse and network)
            plan = plan_bands(near, inverse, network) if plan is None else plan
            self.banded = Banded.of(near, inverse, network, plan)
            self.gradients = BandGradients(feature, normalizer[0], network, plan, self.banded.columns)
        self.heads = network[2].shape[0]

    def blocks(self, group: int, buffer: torch.Tensor | None) -> Iterator[tuple[slice, torch.Tensor]]:
        """(heads, their block (1, g, rows, keys) fp32) for consecutive groups of at most
        ``group`` heads, each written into ``buffer`` (a flat fp32 one, when large enough)."""
        return written_groups([self.banded], self.heads, group, buffer)

    def add_gradient(self, heads: slice, grad: torch.Tensor) -> None:
        """dS (1, g, rows, keys) fp32 of the block's ``heads`` (its future entries set to 0 here)."""
        self.gradients.add(heads, grad[0])

    def result(self) -> tuple[torch.Tensor, ...]:
        grad_near, grad_normalizer, *network = self.gradients.result()
        return grad_near, grad_normalizer[None], *network


class BandGradients:
    """The gradients of one batch row's banded block (:class:`BandedBlock`) to near = psi(d), the
    rows' normaliser and the network (w1, b1, w2, b2), from the block's gradient G given a group
    of heads at a time (:meth:`add`, in any order, each head once; then :meth:`result`). In the
    same bands as the block was built:

    - V's lines: dC[h, d] = S0[h, d] = sum_a G[h, a, d], dslope[h, d] = near[d] S1[h, d] with
      S1 = sum_a G inv[a] (one product over V's rows), and dx[a, d] = sum_h G[h] slope[h] (the
      zones' ReLUs add theirs), from which d near[d] += sum_a inv[a] dx and d inv[a] += sum_d
      dx near[d]; the same for the last row's farthest key;
    - each zone: with r = relu(w1 x + b1), d w2[:, k] += sum G r, g = sum_h w2[h, k] G where r > 0,
      d b1_k += sum g, d w1_k += sum g x, and dx += w1_k g;
    - the lines to the network (:func:`_lines_gradient`): dC and dslope summed per band, then
      through C = b2 + sum_on w2 b1 and slope = sum_on w2 w1.

    dx and the zones' sum over heads g are accumulated over the groups (one (rows, n) each per
    part of the block) and summed once, in :meth:`result`: its sums to near and inv in fp64 from
    the same rounded dx, as c's two gradient paths (through psi(d) and through the normaliser)
    nearly cancel and only one shared dx keeps them cancelling (two separate fp32 sums lose
    ~1e-4 of either path's size). O(rows x keys) work per head, no matrix products over features."""

    def __init__(
        self,
        feature: torch.Tensor,
        normalizer: torch.Tensor,
        network: Network,
        plan: BandPlan,
        columns: ZoneColumns | None,
    ) -> None:
        w1, b1, w2, _ = network
        self.feature, self.normalizer, self.network, self.plan = feature, normalizer, network, plan
        self.near, self.inverse = line_and_inverse(feature, normalizer)  # (keys,), (rows,)
        rows, keys = self.inverse.shape[0], self.near.shape[0]
        self.rows, self.keys = rows, keys
        self.grad_w1, self.grad_b1, self.grad_w2 = (
            torch.zeros_like(w1),
            torch.zeros_like(b1),
            torch.zeros_like(w2),
        )
        self.grad_lines = torch.empty_like(plan.coefficients)  # (2, Hq, keys) dC, dslope
        self.future = future_minimum(rows, rows, feature.device) == 0
        width = keys - 1
        # V (distances 0 .. keys - 2), then the last row's farthest key (keys - 1)
        self.parts = (
            _Part.of(self, slice(0, width), slice(0, rows), plan.zones, columns),
            _Part.of(self, slice(width, keys), slice(rows - 1, rows), shifted(plan.zones, width), None),
        )

    @torch.no_grad()
    def add(self, heads: slice, grad: torch.Tensor) -> None:
        """The gradient ``grad`` (g, rows, keys) fp32, contiguous, of the block's ``heads``; its
        future entries (which a softmax's dS holds as exact zeros) are set to 0 in place (V reads
        them as row a - 1's farthest distances)."""
        rows, width = self.rows, self.keys - 1
        grad[:, :, :rows].mul_(self.future)
        views = (distance_view(grad), grad[:, rows - 1 :, width:])  # (g, rows, keys - 1), (g, 1, 1)
        for part, view in zip(self.parts, views, strict=True):
            # a few operations per head (each is ~5 us of dispatch beside its work: a step of the
            # bench's FIRE model at T=2048 ran ~40,000 of them here)
            # (g, rows, n'): the zones' columns side by side, copied a zone's contiguous distances at a
            # time (index_select over the last dim of this strided view read ~8x slower: 0.32 against
            # 0.04 ms for 4 heads x 256 rows x 400 columns)
            gathered = (
                None
                if part.columns is None
                else torch.cat([view[:, :, lo:hi] for _, lo, hi in part.spans], dim=2)
            )
            for i, head in enumerate(range(heads.start, heads.stop)):
                head_view = view[i]  # (rows, n)
                torch.mm(part.row_weights, head_view, out=part.sums[head])  # S0, S1 (2, n)
                # dx (rows, n) += G slope
                if part.dx is None:
                    part.dx = head_view * part.slopes[head]
                else:
                    part.dx.addcmul_(head_view, part.slopes[head])
                if gathered is not None:
                    _zones_add(gathered[i], part, head)

    @torch.no_grad()
    def result(self) -> tuple[torch.Tensor, ...]:
        """(d feature, d normaliser, d w1, d b1, d w2, d b2), every head added."""
        w1, b1, w2, _ = self.network
        grad_near = torch.zeros_like(self.feature)
        grad_inverse = torch.zeros(self.rows, dtype=torch.float64, device=self.feature.device)
        # near and inv unrounded (fp64) for dx's sums to them: their two paths to c nearly cancel, so
        # each must be as exact as dx (with near, inv rounded to fp32 c's gradient was off by ~1e-5 of
        # either path's size: rows=1, keys=3, c=1, L=1 read 3.996e-6 against 4.143e-6)
        near64, inverse64 = self.feature.double(), self.normalizer.double().reciprocal()
        for part in self.parts:
            if part.dx is None:
                continue
            self.grad_lines[0, :, part.distances] = part.sums[:, 0]  # S0
            torch.mul(part.sums[:, 1], self.near[part.distances], out=self.grad_lines[1, :, part.distances])
            if part.columns is not None:
                self.grad_w2.index_add_(1, part.columns[1], part.per_column)
            _zones_finish(part, w1, self.grad_w1, self.grad_b1)
            dx64 = part.dx.double()
            grad_near[part.distances] += (inverse64[part.rows] @ dx64).to(self.feature.dtype)
            grad_inverse[part.rows] += dx64 @ near64[part.distances]
        grad_b2 = _lines_gradient(
            self.grad_lines, self.plan, (w1, b1, w2, self.grad_w1, self.grad_b1, self.grad_w2)
        )
        # inverse = 1 / normaliser
        grad_normalizer = (-grad_inverse / self.normalizer.double() ** 2).to(self.normalizer.dtype)
        return grad_near, grad_normalizer, self.grad_w1, self.grad_b1, self.grad_w2, grad_b2


@dataclasses.dataclass
class _Part:
    """One part of a block's gradient (V, or the last row's farthest key): its distances and rows,
    its zones' (unit, lo, hi) clipped to it and their columns (:func:`.network_bands.zone_columns`,
    None without zones), and what the heads add up."""

    distances: slice
    rows: slice
    spans: list[tuple[int, int, int]]
    columns: ZoneColumns | None
    row_weights: torch.Tensor  # (2, rows): ones and the rows' inverse
    sums: torch.Tensor  # (Hq, 2, n): per head their products with G (S0, S1)
    slopes: torch.Tensor  # (Hq, n) each distance's slope
    zone_weights: torch.Tensor  # (Hq, n') w2 of each zone column's unit (n' = 0 without zones)
    per_column: torch.Tensor  # (Hq, n') sum over rows of G r
    dx: torch.Tensor | None = None  # (rows, n) sum_h G slope, the zones' g w1 added last
    through: torch.Tensor | None = None  # (rows, n') the zones' g = sum_h w2[h, k] G

    @classmethod
    def of(
        cls,
        gradients: BandGradients,
        distances: slice,
        rows: slice,
        zones: list[tuple[int, int]],
        columns: ZoneColumns | None,
    ) -> _Part:
        """The part of ``gradients``' block at ``distances`` and ``rows``, its ``zones`` as distances
        from the part's start; ``columns``: the zones' columns where the block's build made them."""
        w1, b1, w2, _ = gradients.network
        heads, width = w2.shape[0], distances.stop - distances.start
        near, inverse = gradients.near[distances], gradients.inverse[rows]
        spans = clipped_spans(zones, width)
        if not spans:
            columns = None
        elif columns is None:
            columns = zone_columns(near, inverse, spans, (w1, b1, w2))
        owner = columns[1] if columns is not None else torch.zeros(0, dtype=torch.long, device=w2.device)
        return cls(
            distances,
            rows,
            spans,
            columns,
            torch.stack((torch.ones_like(inverse), inverse)),
            inverse.new_empty(heads, 2, width),
            gradients.plan.coefficients[1, :, distances].contiguous(),
            w2[:, owner].contiguous(),
            w2.new_empty(heads, owner.shape[0]),
        )


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


def _zones_add(gathered: torch.Tensor, part: _Part, head: int) -> None:
    """Head ``head``'s share of the zones' gradient, from its G at the zones' columns ``gathered``
    (rows, n'), each column with its unit's parameters (zones of two units may share columns:
    both are added in :meth:`BandGradients.result`): the column's sum over rows of G r (r its
    unit's ReLU) for w2, and g = sum_h w2[h, k] G added to ``part.through`` (finished in
    :func:`_zones_finish`). A few passes over the zones' columns per head instead of ten small
    operations per zone."""
    assert part.columns is not None
    hidden = part.columns[3]  # (rows, n')
    torch.sum(gathered * hidden, 0, out=part.per_column[head])
    if part.through is None:
        part.through = gathered * part.zone_weights[head]  # (rows, n')
    else:
        part.through.addcmul_(gathered, part.zone_weights[head])


def _zones_finish(part: _Part, w1: torch.Tensor, grad_w1: torch.Tensor, grad_b1: torch.Tensor) -> None:
    """Every head's g (``part.through``) where its unit is on, to b1, w1 and ``part.dx``."""
    if part.columns is None or part.through is None:
        return
    columns, owner, x, hidden = part.columns
    assert part.dx is not None
    through = part.through.mul_(hidden > 0)  # g where the unit is on
    grad_b1.index_add_(0, owner, through.sum(0))
    grad_w1.index_add_(0, owner, (through * x).sum(0))
    part.dx.index_add_(1, columns, through.mul_(w1[owner]))
