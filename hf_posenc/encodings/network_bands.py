"""One causal block of FIRE's bias over its keys in reverse order, built along distances where
its ReLU network is linear (Li et al. 2023, "Functional Interpolation for Relative Positions
Improves Long Context Transformers", arXiv:2310.04418, whose f_theta is a one-input ReLU
network):

    bias[h, a, j'] = f_h(x),   x = near[d] * inv[a],   d = a + j' - (rows - 1)
    f_h(x) = b2[h] + sum_k w2[h, k] relu(w1_k x + b1_k)

Seen along the distance d instead of the reversed key j', the block's keys at d <= keys - rows
(held by every row) are a (Hq, rows, keys - rows + 1) strided view V of it (row stride keys -
1). Along d, x crosses unit k's breakpoint p_k = -b1_k / w1_k at about the same distance in
every row: the crossing moves only with the rows' normalisers, so the distances where some
rows are below p_k and others above form a narrow *zone* [lo_k, hi_k) (its ends from the rows
with the largest and the smallest inv, widened by :data:`ZONE_MARGIN`). Outside its zone the
unit is linear or off for all rows, so with each distance's sum over the units that are on,

    V[h, a, d] = C[h, d] + E[h, d] * inv[a],   C = b2 + sum_on w2 b1,   E = (sum_on w2 w1) * near[d]

(one ``addcmul`` per head into the view; the whole build 0.87-1.31 ns per written value on the
2-core AVX2 machine of 2026-11-27, against 1.63-2.02 ns from the network's matrix products over
features, :mod:`.network_block`: ``scripts/fire_block_costs.py``), and in each unit's zone
w2[:, k] relu(w1_k x + b1_k) is added (its ReLU over the zone's x and one broadcast
multiply-add). The split only decides the speed: in its zone
a unit gets its exact ReLU whatever side each row is on, and outside it the only rows it could
misplace lie within rounding of p_k, where its ReLU is within rounding of 0. C and E change only
where a unit enters or leaves its zone, so they are gathered per distance from at most 2K + 1
bands. The farthest keys of the later rows (d > keys - rows, a triangle) are a (rows, rows)
square whose C and E are Toeplitz views of such vectors (computed with every unit whose zone
reaches the square as a zone over all of it); the future (the first rows - 1 - a keys of row a)
is fp32's minimum. With gradients (:class:`BandedBlock`) the backward works in the same bands.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..core.layout import anti_diagonal_sums, hankel_view

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
    """How one batch row's block is split: each unit's zone (V's distances) and whether it
    reaches the square (then a zone over all of it), with the per-distance coefficients (2, Hq,
    keys) = (C, slope) of V and of the square (E = slope * near); the coefficients are
    differentiable in the network when built with gradients."""

    zones: list[tuple[int, int]]
    reaching: list[bool]
    coefficients: torch.Tensor
    square_coefficients: torch.Tensor


def plan_bands(near: torch.Tensor, inverse: torch.Tensor, network: Network) -> BandPlan:
    """The :class:`BandPlan` of one batch row: ``near`` (keys,) fp32 = feature[d] for d = 0 ..
    keys-1 (non-decreasing), ``inverse`` (rows,) fp32 the rows' 1 / normaliser, the network (w1
    (K,), b1 (K,), w2 (Hq, K), b2 (Hq,)) fp32."""
    w1, b1, _, _ = network
    rows, keys = inverse.shape[0], near.shape[0]
    with torch.no_grad():
        smallest, largest = torch.aminmax(inverse)
        zones = _zones(near, float(smallest), float(largest), w1.tolist(), b1.tolist())  # [(lo, hi)] per unit
    coefficients = _coefficients(near, zones, network)  # (2, Hq, keys) C and slope per distance
    # the farthest keys (d > keys - rows): a unit whose zone reaches the square's distances is a
    # zone over all of it (its rows see the unit at other distances), its ReLU added there and its
    # line left out of C and E
    corner = keys - 2 * rows + 1
    reaching = [hi > lo and hi > corner for lo, hi in zones]
    square = coefficients
    if any(reaching):
        widened = [
            (min(lo, corner), keys) if r else (lo, hi) for (lo, hi), r in zip(zones, reaching, strict=True)
        ]
        square = _coefficients(near, widened, network)
    return BandPlan(zones, reaching, coefficients, square)


def fill_bands(near: torch.Tensor, inverse: torch.Tensor, network: Network, block: torch.Tensor) -> None:
    """Write the causal block of one batch row over keys in reverse order into ``block`` (Hq,
    rows, keys), keys >= 2 rows, its last row's first key at distance 0, the future at fp32's
    minimum (arguments as :func:`plan_bands`); x = near[d] * inverse[a], rounded once."""
    with torch.no_grad():
        _assemble(plan_bands(near, inverse, network), near, inverse, network[:3], block)


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
    Hq, rows, keys) fp32 in ``scratch`` when it is large enough (fp32), ``feature`` (keys,) =
    feature[d] for d = 0 .. keys-1 and ``normalizer`` (B|1, rows) in any float dtype (x = near *
    inverse with near = feature.float(), inverse = normalizer.reciprocal().float())."""
    (batch, rows), keys, heads = normalizer.shape, feature.shape[0], network[2].shape[0]
    size = batch * heads * rows * keys
    if scratch is not None and scratch.dtype == torch.float32 and scratch.numel() >= size:
        out = scratch[:size].view(batch, heads, rows, keys)
    else:
        out = feature.new_empty(batch, heads, rows, keys, dtype=torch.float32)
    near, inverse = line_and_inverse(feature, normalizer)
    for b in range(batch):
        fill_bands(near, inverse[b], network, out[b])
    return out


def banded_rows(feature: torch.Tensor, normalizer: torch.Tensor, network: Network) -> torch.Tensor:
    """The causal block of every batch row, (B|1, Hq, rows, keys) fp32 over keys in reverse order,
    as :func:`fill_bands` writes it from near = feature.float() and inverse =
    normalizer.reciprocal().float(); ``feature`` (keys,) = feature[d] for d = 0 .. keys-1 and
    ``normalizer`` (B|1, rows) in any float dtype (FIRE: fp64), differentiable in them and the
    network (:class:`BandedBlock`)."""
    w1, b1, w2, _ = network
    with torch.no_grad():
        near, inverse = line_and_inverse(feature, normalizer)
    blocks = []
    for row_normalizer, row_inverse in zip(normalizer, inverse, strict=True):
        plan = plan_bands(near, row_inverse, network)
        blocks.append(
            BandedBlock.apply(
                feature, row_normalizer, w1, b1, w2, plan.coefficients, plan.square_coefficients, plan
            )
        )
    return blocks[0][None] if len(blocks) == 1 else torch.stack(blocks)  # (a view for one row: no copy)


def _assemble(
    plan: BandPlan, near: torch.Tensor, inverse: torch.Tensor, units: Units, block: torch.Tensor
) -> None:
    """Write ``block`` (Hq, rows, keys) from its plan, ``units`` = (w1, b1, w2) (see the module's
    docstring)."""
    heads, rows, keys = block.shape
    distances = keys - rows + 1  # d = 0 .. keys - rows: every row holds them (V's columns)
    coefficients = plan.coefficients
    # the future of each row (reversed keys j' < rows - 1 - a, the distances -(rows - 1 - a) .. -1)
    # at the minimum: one fill of V's view extended to d = -(rows - 1) .. -1, whose entries before
    # row a's first key are row a - 1's last a keys (in the square, rewritten below)
    block.as_strided(
        (heads, rows, rows - 1), (block.stride(0), block.stride(1) - 1, 1), block.storage_offset()
    ).fill_(torch.finfo(block.dtype).min)
    view = _distance_view(block)  # (Hq, rows, D)
    slopes = coefficients[1, :, :distances] * near[:distances]  # (Hq, D) E
    for h in range(heads):  # one pass per head (two broadcast passes over all heads: ~30 % slower)
        torch.addcmul(coefficients[0, h, :distances], slopes[h], inverse[:, None], out=view[h])
    _add_zones(view, near[:distances], inverse, plan.zones, units)
    # the farthest keys (d > keys - rows): the square of the last rows reversed keys, j' = keys -
    # rows + m at d = corner + a + m, rewritten whole (its nearer part as V has it)
    corner = keys - 2 * rows + 1
    square_lines = plan.square_coefficients[:, :, corner:]  # (2, Hq, 2 rows - 1)
    constant = hankel_view(square_lines[0], 0, rows, rows)[0]  # (Hq, rows, rows) C[corner + a + m]
    slope = hankel_view(square_lines[1] * near[corner:], 0, rows, rows)[0]  # E
    torch.addcmul(constant, slope, inverse[:, None], out=block[:, :, keys - rows :])
    square_zones = [(0, rows) if reach else (0, 0) for reach in plan.reaching]
    _add_zones(block[:, :, keys - rows :], _square_of(near[corner:], rows), inverse, square_zones, units)


class BandedBlock(torch.autograd.Function):
    """(near (keys,), inverse (rows,), w1, b1, w2, C and slope of V (2, Hq, keys), of the square,
    the :class:`BandPlan`) -> one batch row's block (Hq, rows, keys) as :func:`fill_bands`
    writes it. Backward, from the block's gradient G (read at attendable keys only: the future's
    entries are never read), in the same bands:

    - V's lines: dC[h, d] = S0[h, d] = sum_a G[h, a, d], dslope[h, d] = near[d] S1[h, d] with
      S1 = sum_a G inv[a] (one product over V's rows), d near[d] += sum_h slope S1, d inv[a] +=
      sum_h (G[h] @ E[h])[a] (E = slope * near);
    - the farthest keys (the square's triangle, G masked there) the same along its
      anti-diagonals;
    - each zone: with r = relu(w1 x + b1), d w2[:, k] += sum G r, g = sum_h w2[h, k] G where r > 0,
      d b1_k += sum g, d w1_k += sum g x, and dx = w1_k g to near and inv;

    C and slope pass theirs on to the network through :func:`_coefficients` (autograd), near
    and inv to FIRE's c and L. O(rows x keys) work per head, no matrix products over features."""

    @staticmethod
    def forward(ctx, feature, normalizer, w1, b1, w2, coefficients, square_coefficients, plan):
        near, inverse = line_and_inverse(feature, normalizer)  # (keys,), (rows,)
        block = near.new_empty(w2.shape[0], inverse.shape[0], near.shape[0])
        _assemble(plan, near, inverse, (w1, b1, w2), block)
        ctx.save_for_backward(feature, normalizer, w1, b1, w2, coefficients, square_coefficients)
        ctx.plan = plan
        return block

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        feature, normalizer, w1, b1, w2, coefficients, square_coefficients = ctx.saved_tensors
        plan: BandPlan = ctx.plan
        near, inverse = line_and_inverse(feature, normalizer)
        heads, rows, keys = grad.shape
        distances, corner = keys - rows + 1, keys - 2 * rows + 1
        grad = grad.float()
        grad_w1, grad_b1, grad_w2 = torch.zeros_like(w1), torch.zeros_like(b1), torch.zeros_like(w2)
        unit = (w1, b1, w2, grad_w1, grad_b1, grad_w2)
        # V: the lines' coefficients
        view = _distance_view(grad)  # (Hq, rows, D) G
        lines = coefficients[:, :, :distances]  # (2, Hq, D) C, slope
        grad_coefficients = torch.zeros_like(coefficients)
        torch.sum(view, 1, out=grad_coefficients[0, :, :distances])  # S0
        weighted = torch.matmul(inverse, view)  # (Hq, D) S1 = sum_a G inv[a]
        torch.mul(weighted, near[:distances], out=grad_coefficients[1, :, :distances])
        # dx (rows, D) = sum_h G slope (+ the zones' ReLUs), to near and inv in fp64 below (FIRE's
        # c sums dx times dx/dc, whose two terms nearly cancel: fp32 sums of each lose ~1e-4)
        dx = view[0] * lines[1, 0]
        for h in range(1, heads):
            dx.addcmul_(view[h], lines[1, h])
        _zones_gradient(view, near[:distances], inverse, plan.zones, unit, dx)
        dx64 = dx.double()
        grad_near = torch.zeros_like(feature)
        grad_near[:distances] = (inverse.double() @ dx64).to(feature.dtype)
        grad_inverse = dx64 @ near[:distances].double()  # (rows,)
        # the square: only its triangle (row a's last a keys) is its own
        square = grad[:, :, keys - rows :] * _far_triangle(rows, grad.device)  # (Hq, rows, rows)
        near_square = _square_of(near[corner:], rows)  # (rows, rows) near[corner + a + m]
        square_lines = square_coefficients[:, :, corner:]  # (2, Hq, 2 rows - 1)
        grad_square = torch.zeros_like(square_coefficients)
        grad_square[0, :, corner:] = anti_diagonal_sums(square)
        grad_square[1, :, corner:] = anti_diagonal_sums(square * inverse[:, None]) * near[corner:]
        square_dx = (square * hankel_view(square_lines[1], 0, rows, rows)[0]).sum(0)  # (rows, rows)
        x_square = near_square * inverse[:, None]
        for k, reach in enumerate(plan.reaching):
            if reach:
                square_dx += _zone_gradient(square, x_square, k, unit)
        square_dx64 = square_dx.double()
        grad_near[corner:] += anti_diagonal_sums((square_dx64 * inverse.double()[:, None])[None])[0].to(
            feature.dtype
        )
        grad_inverse += (square_dx64 * near_square.double()).sum(1)
        # inverse = 1 / normaliser
        grad_normalizer = (-grad_inverse / normalizer.double() ** 2).to(normalizer.dtype)
        return grad_near, grad_normalizer, grad_w1, grad_b1, grad_w2, grad_coefficients, grad_square, None


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
    ``unit``, as :func:`_zone_gradient`) and to ``dx`` (rows, D). All zones at once: their columns
    gathered into one (Hq, rows, n) copy, each column with its unit's parameters, the per-unit sums
    by ``index_add_`` (zones of two units may share columns: both are added), so a block costs a
    few passes over its zones' columns instead of ten small operations per zone."""
    w1, b1, w2, grad_w1, grad_b1, grad_w2 = unit
    spans = _clipped_spans(zones, grad.shape[-1])
    if not spans:
        return
    where = torch.tensor(
        [
            [d for _, lo, hi in spans for d in range(lo, hi)],
            [k for k, lo, hi in spans for _ in range(lo, hi)],
        ],
        device=grad.device,
    )  # (2, n): each gathered column's distance and unit
    columns, owner = where[0], where[1]
    gathered = torch.cat([grad[:, :, lo:hi] for _, lo, hi in spans], dim=2)  # (Hq, rows, n) G
    x = near[columns] * inverse[:, None]  # (rows, n)
    unit_weight = w1[owner]  # (n,)
    hidden = torch.addcmul(b1[owner], x, unit_weight).clamp_(min=0)  # (rows, n) r
    grad_w2.index_add_(1, owner, (gathered * hidden).sum(1))  # sum over rows of G r, per column
    through = (gathered * w2[:, owner][:, None, :]).sum(0).mul_(hidden > 0)  # (rows, n) g
    grad_b1.index_add_(0, owner, through.sum(0))
    grad_w1.index_add_(0, owner, (through * x).sum(0))
    dx.index_add_(1, columns, through.mul_(unit_weight))


def _zone_gradient(grad: torch.Tensor, x: torch.Tensor, k: int, unit: tuple) -> torch.Tensor:
    """Unit k's share of a zone's gradient ``grad`` (Hq, rows, n) at ``x`` (rows, n): added to
    its w2 column, b1 and w1 (in ``unit`` = (w1, b1, w2, grad_w1, grad_b1, grad_w2)); -> dx
    (rows, n) through its ReLU."""
    w1, b1, w2, grad_w1, grad_b1, grad_w2 = unit
    hidden = torch.addcmul(b1[k], x, w1[k]).clamp_(min=0)  # (rows, n) r
    flat = grad.reshape(grad.shape[0], -1)  # (Hq, rows * n): one copy of the strided zone, then BLAS
    grad_w2[:, k] += flat @ hidden.view(-1)
    through = (w2[:, k] @ flat).view(hidden.shape).mul_(hidden > 0)  # (rows, n) g
    grad_b1[k] += through.sum()
    grad_w1[k] += torch.dot(through.view(-1), x.reshape(-1))
    return through.mul_(w1[k])


@functools.lru_cache(maxsize=8)
def _far_triangle(rows: int, device: torch.device) -> torch.Tensor:
    """(rows, rows) fp32: 1 where square column m >= rows - a (row a's keys past distance keys -
    rows: reversed keys keys - a .. keys - 1), 0 elsewhere."""
    columns, rows_ = torch.arange(rows, device=device)[None, :], torch.arange(rows, device=device)[:, None]
    return (columns >= rows - rows_).float()


def _distance_view(block: torch.Tensor) -> torch.Tensor:
    """(Hq, rows, keys) over reversed keys -> the (Hq, rows, D = keys - rows + 1) view V[h, a, d] =
    block[h, a, rows - 1 - a + d] (row stride keys - 1)."""
    heads, rows, keys = block.shape
    return block.as_strided(
        (heads, rows, keys - rows + 1),
        (block.stride(0), block.stride(1) - 1, 1),
        block.storage_offset() + rows - 1,
    )


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


def _coefficients(near: torch.Tensor, zones: list[tuple[int, int]], network: Network) -> torch.Tensor:
    """(2, Hq, keys): C[h, d] = b2 + sum w2 b1 and slope[h, d] = sum w2 w1 over the units
    linear at d for every row: outside their zone, before it when w1 < 0, after it when w1 > 0
    (w1 = 0: relu(b1), on when b1 > 0)."""
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
    return lines.index_select(1, band_of).transpose(1, 2).contiguous()  # (2, Hq, keys)


def _clipped_spans(zones: list[tuple[int, int]], width: int) -> list[tuple[int, int, int]]:
    """(unit, lo, hi) of each unit's zone clipped to 0 .. ``width``, the empty ones left out."""
    return [
        (k, max(lo, 0), min(hi, width)) for k, (lo, hi) in enumerate(zones) if min(hi, width) > max(lo, 0)
    ]


def _add_zones(
    target: torch.Tensor,
    near: torch.Tensor,
    inverse: torch.Tensor,
    zones: list[tuple[int, int]],
    units: Units,
) -> None:
    """Add w2[:, k] relu(w1_k x + b1_k) over each unit's zone of ``target`` (Hq, rows, n), x =
    near * inverse[a] with ``near`` (n,) or (rows, n); zones clipped to 0 .. n."""
    spans = _clipped_spans(zones, target.shape[-1])
    if not spans:
        return
    w1, b1, w2 = units
    out_columns = w2.t()[:, :, None, None]  # (K, Hq, 1, 1); only the zones' units indexed below
    for k, lo, hi in spans:
        x = near[..., lo:hi] * inverse[:, None]  # (rows, hi - lo)
        hidden = torch.addcmul(b1[k], x, w1[k]).clamp_(min=0)
        target[:, :, lo:hi].addcmul_(out_columns[k], hidden)


def _square_of(line: torch.Tensor, rows: int) -> torch.Tensor:
    """(2 rows - 1,) -> the (rows, rows) view t[a, m] = line[a + m]."""
    return hankel_view(line[None], 0, rows, rows)[0, 0]
