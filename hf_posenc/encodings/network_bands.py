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
(:func:`.network_block.future_minimum`, as the network's blocks add it). With gradients (:class:`.network_bands_backward.BandedBlock`)
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

from .network_block import future_minimum

#: causal blocks of at least twice as many keys as rows are built in bands of distances; False:
#: from the network's products (:mod:`.network_block`; tests compare the two, so does
#: ``scripts/cpu_constant_ab.py``)
BANDS = True
#: where :func:`banded_head_blocks` leaves the plan of a block with one row of normalisers in a
#: ``kept`` dict, for its rebuild in backward (:class:`.network_bands_backward.RebuiltHeads`)
PLAN_KEY = "band_plan"
#: a zone is widened by this many distances on each side (the crossing estimated by a
#: quotient, the x by a product; the values never depend on it, see the module's docstring)
ZONE_MARGIN = 2

Network = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Units = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # w1, b1, w2
#: zones' columns side by side: each column's distance and unit (n,), x and the ReLU (rows, n)
ZoneColumns = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


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
    kept: dict | None = None,
) -> Iterator[tuple[slice, torch.Tensor]]:
    """:func:`banded_block` ``group`` heads at a time: (heads, their block (B|1, g, rows, keys))
    for consecutive slices of at most ``group`` heads, each block written into one buffer
    (``scratch`` when large enough) as the iterator reaches it, so the previous one must be used
    before the next is asked for. The plans and the zones' ReLUs are made once, for all heads;
    with one row of normalisers its plan is left in ``kept`` (under :data:`PLAN_KEY`) when given."""
    heads = network[2].shape[0]
    with torch.no_grad():  # (not around the yield: the caller would run without gradients)
        near, inverse = line_and_inverse(feature, normalizer)
        plans = [plan_bands(near, row_inverse, network) for row_inverse in inverse]
        rows_of_batch = [
            Banded.of(near, row_inverse, network, plan)
            for row_inverse, plan in zip(inverse, plans, strict=True)
        ]
    if kept is not None and len(plans) == 1:
        kept[PLAN_KEY] = plans[0]
    yield from written_groups(rows_of_batch, heads, group, scratch)


def written_groups(
    rows_of_batch: list[Banded], heads: int, group: int, scratch: torch.Tensor | None
) -> Iterator[tuple[slice, torch.Tensor]]:
    """The blocks of every batch row's :class:`Banded` ``group`` heads at a time: (heads, their
    block (B, g, rows, keys) fp32), each written into one buffer (``scratch`` when large enough)
    as the iterator reaches it."""
    batch = len(rows_of_batch)
    rows, keys = rows_of_batch[0].inverse.shape[0], rows_of_batch[0].constants[0].shape[0] + 1
    # one buffer for every group (the scratch where large enough): the groups share their views,
    # taken once per head count (a group's other cost: ~35 indexing operations per head at 256 rows)
    size = batch * min(group, heads) * rows * keys
    device = rows_of_batch[0].inverse.device
    buffer = torch.empty(size, dtype=torch.float32, device=device) if scratch is None else scratch
    if buffer.dtype != torch.float32 or buffer.numel() < size:
        buffer = torch.empty(size, dtype=torch.float32, device=device)
    views: dict[int, tuple[torch.Tensor, list[BlockViews]]] = {}  # by heads in the group
    for first in range(0, heads, group):
        chosen = slice(first, min(heads, first + group))
        count = chosen.stop - first
        if count not in views:
            out = buffer[: batch * count * rows * keys].view(batch, count, rows, keys)
            views[count] = (
                out,
                [
                    BlockViews.of(block, banded.spans)
                    for banded, block in zip(rows_of_batch, out, strict=True)
                ],
            )
        out, block_views = views[count]
        with torch.no_grad():
            for banded, row_views in zip(rows_of_batch, block_views, strict=True):
                banded.write(row_views, chosen)
        yield chosen, out


@dataclasses.dataclass
class Banded:
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
    #: V's zone columns side by side (:func:`zone_columns`: distance, unit, x, ReLU), or None
    #: without zones: the ReLUs above are views of them, and a block's backward reads them again
    columns: ZoneColumns | None

    @classmethod
    def of(
        cls, near: torch.Tensor, inverse: torch.Tensor, network: Network, plan: BandPlan | None = None
    ) -> Banded:
        plan = plan_bands(near, inverse, network) if plan is None else plan
        w1, b1, w2, b2 = network
        width = near.shape[0] - 1
        constant, slope = plan.coefficients  # (Hq, keys) each
        # the last row's farthest key (distance keys - 1) from the network itself: one value per head
        farthest = torch.addmv(b2, w2, torch.relu(w1 * (near[width] * inverse[-1]) + b1))  # (Hq,)
        zones, columns = _zone_units(near[:width], inverse, plan.zones, network[:3])
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
            columns,
        )

    def write(self, views: BlockViews, heads: slice) -> None:
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
class BlockViews:
    """The views of one block (g, rows, keys) over reversed keys that :meth:`Banded.write` writes:
    each head's V (rows, keys - 1), each zone's columns of V (g, rows, hi - lo), the last row's
    farthest key (g,), row 0's future (g, rows - 1) and the (g, rows, rows) corner of every row's
    future."""

    lines: list[torch.Tensor]
    zones: list[torch.Tensor]
    farthest: torch.Tensor
    row_zero_future: torch.Tensor
    corner: torch.Tensor

    @classmethod
    def of(cls, block: torch.Tensor, spans: list[tuple[int, int]]) -> BlockViews:
        _, rows, keys = block.shape
        view = distance_view(block)  # (g, rows, keys - 1) V, contiguous per head
        return cls(
            list(view),
            [view[:, :, lo:hi] for lo, hi in spans],
            block[:, rows - 1, keys - 1],
            block[:, 0, : rows - 1],
            block[:, :, :rows],
        )


def distance_view(block: torch.Tensor) -> torch.Tensor:
    """(Hq, rows, keys) over reversed keys -> the (Hq, rows, keys - 1) view V[h, a, d] =
    block[h, a, rows - 1 - a + d] (row stride keys - 1: contiguous per head)."""
    heads, rows, keys = block.shape
    return block.as_strided(
        (heads, rows, keys - 1),
        (block.stride(0), block.stride(1) - 1, 1),
        block.storage_offset() + rows - 1,
    )


def shifted(zones: list[tuple[int, int]], start: int) -> list[tuple[int, int]]:
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


def clipped_spans(zones: list[tuple[int, int]], width: int) -> list[tuple[int, int, int]]:
    """(unit, lo, hi) of each unit's zone clipped to 0 .. ``width``, the empty ones left out."""
    return [
        (k, max(lo, 0), min(hi, width)) for k, (lo, hi) in enumerate(zones) if min(hi, width) > max(lo, 0)
    ]


def _zone_units(
    near: torch.Tensor, inverse: torch.Tensor, zones: list[tuple[int, int]], units: Units
) -> tuple[list[tuple[int, int, int, torch.Tensor]], ZoneColumns | None]:
    """(unit k, lo, hi, relu(w1_k x + b1_k) (rows, hi - lo)) of each zone clipped to 0 .. n, x =
    near[lo:hi] * inverse[a] with ``near`` (n,): column views of one (rows, sum of widths) tensor
    (a few operations per block instead of three per zone); and those columns
    (:func:`zone_columns`), None without zones."""
    spans = clipped_spans(zones, near.shape[0])
    if not spans:
        return [], None
    columns = zone_columns(near, inverse, spans, units)
    relus = columns[3]  # (rows, n)
    offsets = [0]
    for _, lo, hi in spans:
        offsets.append(offsets[-1] + hi - lo)
    return [
        (k, lo, hi, relus[:, offsets[i] : offsets[i + 1]]) for i, (k, lo, hi) in enumerate(spans)
    ], columns


def zone_columns(
    near: torch.Tensor, inverse: torch.Tensor, spans: list[tuple[int, int, int]], units: Units
) -> ZoneColumns:
    """The zones' (unit k, lo, hi) columns side by side: each column's distance d and unit k (n,)
    each, x = near[d] * inverse[a] and relu(w1_k x + b1_k) (rows, n) each."""
    w1, b1, _ = units
    given = torch.tensor(spans, device=near.device).t()  # (3, zones): unit, lo, hi
    widths = given[2] - given[1]
    owner = torch.repeat_interleave(given[0], widths)  # (n,) each column's unit
    # and its distance: lo of its zone plus its place in the zone
    columns = torch.arange(owner.shape[0], device=near.device)
    columns += torch.repeat_interleave(given[1] - (torch.cumsum(widths, 0) - widths), widths)
    x = near[columns] * inverse[:, None]  # (rows, n)
    return columns, owner, x, torch.addcmul(b1[owner], x, w1[owner]).clamp_(min=0)
