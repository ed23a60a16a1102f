"""One causal block of FIRE's bias over its keys in reverse order, built along distances where
its ReLU network is linear (Li et al. 2023, "Functional Interpolation for Relative Positions
Improves Long Context Transformers", arXiv:2310.04418, whose f_theta is a one-input ReLU
network):

    bias[h, a, j'] = f_h(x),   x = near[d] * inv[a],   d = a + j' - (rows - 1)
    f_h(x) = b2[h] + sum_k w2[h, k] relu(w1_k x + b1_k)

Seen along the distance d instead of the reversed key j', the block (Hq, rows, keys) holds the
(Hq, rows, keys - 1) view V[h, a, d] = block[h, a, rows - 1 - a + d]: row stride keys - 1, so
V is one contiguous stretch of the block's memory from its (row 0, key rows - 1) on. Row a's
own keys are V's d <= keys - rows + a; past that its row of V runs on into row a + 1's future
(the first rows - 2 - a reversed keys of row a + 1), which is written last. Only the last row's
farthest key (distance keys - 1) lies outside V. Along d, x crosses unit k's breakpoint p_k =
-b1_k / w1_k at about the same distance in every row: the crossing moves only with the rows'
normalisers, so the distances where some rows are below p_k and others above form a narrow
*zone* [lo_k, hi_k) (its ends from the rows with the largest and the smallest inv, widened by
:data:`ZONE_MARGIN`). Outside its zone the unit is linear or off for all rows, so with each
distance's sum over the units that are on,

    V[h, a, d] = C[h, d] + E[h, d] * inv[a],   C = b2 + sum_on w2 b1,   E = (sum_on w2 w1) * near[d]

(one ``addcmul`` per head over contiguous memory), and in each unit's zone w2[:, k] relu(w1_k x
+ b1_k) is added (its ReLU over the zone's x and one broadcast multiply-add). The split only
decides the speed: in its zone a unit gets its exact ReLU whatever side each row is on, and
outside it the only rows it could misplace lie within rounding of p_k, where its ReLU is within
rounding of 0. C and E change only where a unit enters or leaves its zone, so they are gathered
per distance from at most 2K + 1 bands. The future (the first rows - 1 - a keys of row a) is
fp32's minimum, added after V over the (rows, rows) corner of every row
(:func:`.network_block.future_minimum`, as the network's blocks add it). With gradients (:class:`BandedBlock`)
the backward works in the same bands and gives the network's gradients by hand (no autograd
graph through the bands' coefficients).

Before (to 2026-11-27), V stopped at the distances every row holds (keys - rows + 1) and the
farthest keys of the later rows were a (rows, rows) square written, and differentiated, through
Toeplitz views of a second set of coefficients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .network_block import future_minimum

#: causal blocks of at least twice as many keys as rows are built in bands of distances; False:
#: from the network's products (:mod:`.network_block`; tests compare the two, so does
#: ``scripts/cpu_constant_ab.py``)
BANDS = True
#: a zone is widened by this many distances on each side (the crossing estimated by a
#: quotient, the x by a product; the values never depend on it, see the module's docstring)
ZONE_MARGIN = 2

Network = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Units = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # w1, b1, w2


@dataclasses.dataclass
class BandPlan:
    """How one batch row's block is split: each unit's zone (distances [lo, hi)), the bands of
    distances between the zones' ends (``band_of`` (keys,) each distance's band, ``on`` (I, K)
    whether unit k is linear for every row in band i) and the per-distance coefficients (2, Hq,
    keys) = (C, slope) of V (E = slope * near), without gradients."""

    zones: list[tuple[int, int]]
    band_of: torch.Tensor
    on: torch.Tensor
    coefficients: torch.Tensor


def plan_bands(near: torch.Tensor, inverse: torch.Tensor, network: Network) -> BandPlan:
    """The :class:`BandPlan` of one batch row: ``near`` (keys,) fp32 = feature[d] for d = 0 ..
    keys-1 (non-decreasing), ``inverse`` (rows,) fp32 the rows' 1 / normaliser, the network (w1
    (K,), b1 (K,), w2 (Hq, K), b2 (Hq,)) fp32."""
    w1, b1, _, _ = network
    with torch.no_grad():
        smallest, largest = torch.aminmax(inverse)
        zones = _zones(near, float(smallest), float(largest), w1.tolist(), b1.tolist())  # [(lo, hi)] per unit
        band_of, on, coefficients = _coefficients(near, zones, network)
    return BandPlan(zones, band_of, on, coefficients)


def line_and_inverse(feature: torch.Tensor, normalizer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(near, inverse) in fp32 from ``feature`` (keys,) and ``normalizer`` (..., rows) in any
    float dtype: near = feature rounded once, inverse = 1 / normaliser rounded once (x = near *
    inverse, as :func:`.network_block.reversed_network_block` forms it)."""
    return feature.float(), normalizer.reciprocal().float()


def serves(first: int, rows: int, keys: int) -> bool:
    """Whether the bands build a block of ``rows`` queries whose (row 0, reversed key 0) is at
    distance ``first`` over ``keys`` keys: a causal block (first = 1 - rows) of at least twice as
    many keys as rows."""
    return BANDS and first == 1 - rows and keys >= 2 * rows


def banded_block(
    feature: torch.Tensor, normalizer: torch.Tensor, network: Network, scratch: torch.Tensor | None
) -> torch.Tensor:
    """Without gradients, the causal block of every batch row over keys in reverse order, (B|1,
    Hq, rows, keys) fp32 in ``scratch`` when it is large enough (fp32), keys >= 2 rows, its
    last row's first key at distance 0, the future at fp32's minimum; ``feature`` (keys,)
    = feature[d] for d = 0 .. keys-1 and ``normalizer`` (B|1, rows) in any float dtype (x =
    near[d] * inverse[a], rounded once, with near = feature.float(), inverse =
    normalizer.reciprocal().float())."""
    heads = network[2].shape[0]
    return next(banded_head_blocks(feature, normalizer, network, scratch, heads))[1]


def banded_head_blocks(
    feature: torch.Tensor,
    normalizer: torch.Tensor,
    network: Network,
    scratch: torch.Tensor | None,
    group: int,
) -> Iterator[tuple[slice, torch.Tensor]]:
    """:func:`banded_block` ``group`` heads at a time: (heads, their block (B|1, g, rows, keys))
    for consecutive slices of at most ``group`` heads, each block written into ``scratch`` (when
    large enough) as the iterator reaches it, so the previous one must be used before the next
    is asked for. The plans and the zones' ReLUs are made once, for all heads."""
    (batch, rows), keys, heads = normalizer.shape, feature.shape[0], network[2].shape[0]
    with torch.no_grad():  # (not around the yield: the caller would run without gradients)
        near, inverse = line_and_inverse(feature, normalizer)
        rows_of_batch = [_Banded.of(near, row_inverse, network) for row_inverse in inverse]
    views: tuple[tuple[int, torch.Size], list[_BlockViews]] | None = None  # of the last block written
    for first in range(0, heads, group):
        chosen = slice(first, min(heads, first + group))
        size = batch * (chosen.stop - first) * rows * keys
        if scratch is not None and scratch.dtype == torch.float32 and scratch.numel() >= size:
            out = scratch[:size].view(batch, -1, rows, keys)
        else:
            out = feature.new_empty(batch, chosen.stop - first, rows, keys, dtype=torch.float32)
        # the groups of one block written into one buffer share their views (taking them is a
        # good part of a group's cost: ~35 indexing operations per head at 256 rows)
        if views is None or views[0] != (out.data_ptr(), out.shape):
            views = (
                (out.data_ptr(), out.shape),
                [
                    _BlockViews.of(row_block, banded.spans)
                    for banded, row_block in zip(rows_of_batch, out, strict=True)
                ],
            )
        with torch.no_grad():
            for banded, row_views in zip(rows_of_batch, views[1], strict=True):
                banded.write(row_views, chosen)
        yield chosen, out


def banded_rows(feature: torch.Tensor, normalizer: torch.Tensor, network: Network) -> torch.Tensor:
    """The causal block of every batch row, (B|1, Hq, rows, keys) fp32 over keys in reverse order,
    as :func:`banded_block` writes it from near = feature.float() and inverse =
    normalizer.reciprocal().float(); ``feature`` (keys,) = feature[d] for d = 0 .. keys-1 and
    ``normalizer`` (B|1, rows) in any float dtype (FIRE: fp64), differentiable in them and the
    network (:class:`BandedBlock`)."""
    with torch.no_grad():
        near, inverse = line_and_inverse(feature, normalizer)
    blocks = [
        BandedBlock.apply(feature, row_normalizer, *network, plan_bands(near, row_inverse, network))
        for row_normalizer, row_inverse in zip(normalizer, inverse, strict=True)
    ]  # (1, Hq, rows, keys) each
    # one row's block is the function's own output, not a view of it: the chunked backend writes
    # its scores into the block in backward (in place), and a view's gradient would then be
    # rebuilt as an as_strided one (a zero-filled block and a scatter, ~2 ms per block)
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


@dataclasses.dataclass
class _Banded:
    """One batch row's block made ready for :meth:`write` to write any of its heads: per head C[h]
    and E[h] over V's distances (keys - 1,), the zones' ReLUs over V (relu(w1_k x + b1_k), (rows,
    hi - lo) per zone [lo, hi) of unit k, shared by the heads), w2, and the last row's farthest
    key (Hq,), outside V."""

    constants: list[torch.Tensor]
    slopes: list[torch.Tensor]
    inverse: torch.Tensor  # (rows, 1)
    spans: list[tuple[int, int]]
    relus: list[tuple[int, torch.Tensor]]
    weights: list[list[float]]  # (Hq, K) w2 as numbers
    out_columns: torch.Tensor  # (K, Hq, 1, 1) w2
    farthest: torch.Tensor
    corner: torch.Tensor  # (rows, rows): the future's minimum over the first rows reversed keys

    @classmethod
    def of(
        cls, near: torch.Tensor, inverse: torch.Tensor, network: Network, plan: BandPlan | None = None
    ) -> _Banded:
        plan = plan_bands(near, inverse, network) if plan is None else plan
        w1, b1, w2, b2 = network
        width = near.shape[0] - 1
        constant, slope = plan.coefficients  # (Hq, keys) each
        # the last row's farthest key (distance keys - 1) from the network itself: one value per head
        farthest = torch.addmv(b2, w2, torch.relu(w1 * (near[width] * inverse[-1]) + b1))  # (Hq,)
        zones = _zone_units(near[:width], inverse, plan.zones, network[:3])
        return cls(
            list(constant[:, :width]),
            list(slope[:, :width] * near[:width]),
            inverse[:, None],
            [(lo, hi) for _, lo, hi, _ in zones],
            [(k, relu) for k, _, _, relu in zones],
            w2.tolist(),
            w2.t()[:, :, None, None],
            farthest,
            future_minimum(inverse.shape[0], inverse.shape[0], near.device),
        )

    def write(self, views: _BlockViews, heads: slice) -> None:
        """Write ``heads`` of the block into the block ``views`` shows (g, rows, keys) (see the
        module's docstring)."""
        first = heads.start
        # one pass per head (two broadcast passes over all heads: ~30 % slower)
        for h, line in enumerate(views.lines):
            torch.addcmul(self.constants[first + h], self.slopes[first + h], self.inverse, out=line)
        if len(views.lines) == 1:  # one head: its w2 as numbers
            weights = self.weights[first]
            for (k, relu), columns in zip(self.relus, views.zones, strict=True):
                columns.add_(relu, alpha=weights[k])
        else:
            out_columns = self.out_columns[:, heads]  # (K, g, 1, 1)
            for (k, relu), columns in zip(self.relus, views.zones, strict=True):
                columns.addcmul_(out_columns[k], relu)
        views.farthest.copy_(self.farthest[heads])
        # the future of each row (reversed keys j' < rows - 1 - a), where V ran on: the minimum added,
        # as the network's blocks add it (V's values there are lines and ReLUs of real distances, and
        # value + minimum rounds to the minimum; a masked_fill_ measured ~10x slower)
        views.row_zero_future.zero_()  # row 0's future: before V, never written
        views.corner.add_(self.corner)


@dataclasses.dataclass
class _BlockViews:
    """The views of one block (g, rows, keys) over reversed keys that :meth:`_Banded.write` writes:
    each head's V (rows, keys - 1), each zone's columns of V (g, rows, hi - lo), the last row's
    farthest key (g,), row 0's future (g, rows - 1) and the (g, rows, rows) corner of every row's
    future."""

    lines: list[torch.Tensor]
    zones: list[torch.Tensor]
    farthest: torch.Tensor
    row_zero_future: torch.Tensor
    corner: torch.Tensor

    @classmethod
    def of(cls, block: torch.Tensor, spans: list[tuple[int, int]]) -> _BlockViews:
        _, rows, keys = block.shape
        view = _distance_view(block)  # (g, rows, keys - 1) V, contiguous per head
        return cls(
            list(view),
            [view[:, :, lo:hi] for lo, hi in spans],
            block[:, rows - 1, keys - 1],
            block[:, 0, : rows - 1],
            block[:, :, :rows],
        )


class BandedBlock(torch.autograd.Function):
    """(near (keys,), inverse (rows,), w1, b1, w2, b2, the :class:`BandPlan`) -> one batch row's
    block (1, Hq, rows, keys) as :func:`banded_block` writes it. Backward, from the block's gradient G
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
    def forward(ctx, feature, normalizer, w1, b1, w2, b2, plan):
        near, inverse = line_and_inverse(feature, normalizer)  # (keys,), (rows,)
        block = near.new_empty(1, w2.shape[0], inverse.shape[0], near.shape[0])
        banded = _Banded.of(near, inverse, (w1, b1, w2, b2), plan)
        banded.write(_BlockViews.of(block[0], banded.spans), slice(0, w2.shape[0]))
        ctx.save_for_backward(feature, normalizer, w1, b1, w2, b2)
        ctx.plan = plan
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
            (_distance_view(grad), slice(0, width), slice(0, rows), plan.zones),
            (
                grad[:, rows - 1 :, width:],
                slice(width, keys),
                slice(rows - 1, rows),
                _shifted(plan.zones, width),
            ),
        )
        for view, columns, part_rows, zones in parts:
            part_near, part_inverse = near[columns], inverse[part_rows]
            torch.sum(view, 1, out=grad_lines[0, :, columns])  # S0
            torch.mul(torch.matmul(part_inverse, view), part_near, out=grad_lines[1, :, columns])  # S1 near
            # dx (rows, n) = sum_h G slope (+ the zones' ReLUs), to near and inv in fp64 below (FIRE's
            # c sums dx times dx/dc, whose two terms nearly cancel: fp32 sums of each lose ~1e-4)
            dx = view[0] * slopes[0, columns]
            for h in range(1, heads):
                dx.addcmul_(view[h], slopes[h, columns])
            _zones_gradient(view, part_near, part_inverse, zones, unit, dx)
            dx64 = dx.double()
            grad_near[columns] += (inverse64[part_rows] @ dx64).to(feature.dtype)
            grad_inverse[part_rows] += dx64 @ near64[columns]
        grad_b2 = _lines_gradient(grad_lines, plan, unit)
        # inverse = 1 / normaliser
        grad_normalizer = (-grad_inverse / normalizer.double() ** 2).to(normalizer.dtype)
        return grad_near, grad_normalizer, grad_w1, grad_b1, grad_w2, grad_b2, None


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
) -> None:
    """Every zone's share of V's gradient ``grad`` (Hq, rows, D) at x = near[d] * inverse[a]
    (``near`` (D,)), zones clipped to 0 .. D: added to the units' w2 columns, b1 and w1 (in
    ``unit`` = (w1, b1, w2, grad_w1, grad_b1, grad_w2)) and to ``dx`` (rows, D). All zones at
    once: their columns gathered into one (Hq, rows, n) copy, each column with its unit's
    parameters, the per-unit sums by ``index_add_`` (zones of two units may share columns: both
    are added), so a block costs a few passes over its zones' columns (one per head) instead of
    ten small operations per zone."""
    w1, b1, w2, grad_w1, grad_b1, grad_w2 = unit
    spans = _clipped_spans(zones, grad.shape[-1])
    if not spans:
        return
    given = torch.tensor(spans, device=grad.device).t()  # (3, zones): unit, lo, hi
    widths = given[2] - given[1]
    owner = torch.repeat_interleave(given[0], widths)  # (n,) each gathered column's unit
    # and its distance: lo of its zone plus its place in the zone
    columns = torch.arange(owner.shape[0], device=grad.device)
    columns += torch.repeat_interleave(given[1] - (torch.cumsum(widths, 0) - widths), widths)
    gathered = torch.cat([grad[:, :, lo:hi] for _, lo, hi in spans], dim=2)  # (Hq, rows, n) G
    x = near[columns] * inverse[:, None]  # (rows, n)
    unit_weight = w1[owner]  # (n,)
    hidden = torch.addcmul(b1[owner], x, unit_weight).clamp_(min=0)  # (rows, n) r
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


def _distance_view(block: torch.Tensor) -> torch.Tensor:
    """(Hq, rows, keys) over reversed keys -> the (Hq, rows, keys - 1) view V[h, a, d] =
    block[h, a, rows - 1 - a + d] (row stride keys - 1: contiguous per head)."""
    heads, rows, keys = block.shape
    return block.as_strided(
        (heads, rows, keys - 1),
        (block.stride(0), block.stride(1) - 1, 1),
        block.storage_offset() + rows - 1,
    )


def _shifted(zones: list[tuple[int, int]], start: int) -> list[tuple[int, int]]:
    """The zones as distances from ``start`` (for a part of the block that begins there)."""
    return [(lo - start, hi - start) for lo, hi in zones]


def _zones(
    near: torch.Tensor, smallest: float, largest: float, weights: list[float], biases: list[float]
) -> list[tuple[int, int]]:
    """Per unit, the distances [lo, hi) where x = near[d] * inv crosses its breakpoint for some
    rows (inv in [smallest, largest]), widened by :data:`ZONE_MARGIN`; lo = hi where it crosses
    none (all rows below it before lo, above it from there; w1 = 0: lo = hi = 0)."""
    keys = near.shape[0]
    points = [-b / w if w != 0.0 else float("-inf") for w, b in zip(weights, biases, strict=True)]
    values = torch.tensor(points, dtype=near.dtype, device=near.device)  # (K,)
    # the row with the largest inv crosses first, the one with the smallest last
    first = torch.searchsorted(near, values / largest).tolist()
    last = torch.searchsorted(near, values / smallest, right=True).tolist()
    return [
        (max(0, lo - ZONE_MARGIN), min(keys, hi + ZONE_MARGIN)) if hi > lo else (lo, lo)
        for lo, hi in zip(first, last, strict=True)
    ]


def _coefficients(
    near: torch.Tensor, zones: list[tuple[int, int]], network: Network
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (band_of (keys,), on (I, K), coefficients (2, Hq, keys)): the bands of distances between
    the zones' ends, which units are linear in each for every row (outside their zone, before it
    when w1 < 0, after it when w1 > 0; w1 = 0: relu(b1), on when b1 > 0), and C[h, d] = b2 + sum
    w2 b1, slope[h, d] = sum w2 w1 over those units."""
    w1, b1, w2, b2 = network
    keys, count, device = near.shape[0], len(zones), near.device
    edges = sorted({0, keys, *(lo for lo, _ in zones), *(hi for _, hi in zones)})
    widths = [stop - start for start, stop in zip(edges[:-1], edges[1:], strict=True)]
    given = torch.tensor(
        [*(lo for lo, _ in zones), *(hi for _, hi in zones), *edges[:-1], *widths], device=device
    )  # one transfer: lo (K,), hi (K,), the bands' starts (I,) and widths (I,)
    lo, hi = given[:count], given[count : 2 * count]
    starts, widths_tensor = given[2 * count :].view(2, -1)
    on = torch.where(w1 > 0, starts[:, None] >= hi, starts[:, None] < lo)  # (I, K) linear there
    on |= (w1 == 0) & (b1 > 0)
    lines = torch.where(on, torch.stack((b1, w1))[:, None, :], 0.0) @ w2.t()  # (2, I, Hq)
    lines[0] += b2
    band_of = torch.repeat_interleave(widths_tensor)  # (keys,) each distance's band
    # gathered as rows of Hq values, then laid out head-major: each head's pass over the block
    # reads its C and E contiguous (strided reads measured ~4x slower), and this gather ~5x
    # faster than one over the last dim of the (2, Hq, I) view
    return band_of, on, lines.index_select(1, band_of).transpose(1, 2).contiguous()


def _clipped_spans(zones: list[tuple[int, int]], width: int) -> list[tuple[int, int, int]]:
    """(unit, lo, hi) of each unit's zone clipped to 0 .. ``width``, the empty ones left out."""
    return [
        (k, max(lo, 0), min(hi, width)) for k, (lo, hi) in enumerate(zones) if min(hi, width) > max(lo, 0)
    ]


def _zone_units(
    near: torch.Tensor, inverse: torch.Tensor, zones: list[tuple[int, int]], units: Units
) -> list[tuple[int, int, int, torch.Tensor]]:
    """(unit k, lo, hi, relu(w1_k x + b1_k) (rows, hi - lo)) of each zone clipped to 0 .. n, x =
    near[lo:hi] * inverse[a] with ``near`` (n,)."""
    w1, b1, _ = units
    relus = []
    for k, lo, hi in _clipped_spans(zones, near.shape[0]):
        x = near[lo:hi] * inverse[:, None]  # (rows, hi - lo)
        relus.append((k, lo, hi, torch.addcmul(b1[k], x, w1[k]).clamp_(min=0)))
    return relus
