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

(one broadcast copy and one broadcast multiply-add over the block: about 0.17 ns per value on
the 2-core reference CPU, against about 1 ns for the network's matrix products over features,
:mod:`.network_block`), and in each unit's zone w2[:, k] relu(w1_k x + b1_k) is added (a pass
over the zone's x and one broadcast multiply-add). The split only decides the speed: in its zone
a unit gets its exact ReLU whatever side each row is on, and outside it the only rows it could
misplace lie within rounding of p_k, where its ReLU is within rounding of 0. C and E change only
where a unit enters or leaves its zone, so they are gathered per distance from at most 2K + 1
bands. The farthest keys of the later rows (d > keys - rows, a triangle) are a (rows, rows)
square whose C and E are Toeplitz views of the same vectors; the future (the first rows - 1 - a
keys of row a) is fp32's minimum.
"""

from __future__ import annotations

import functools

import torch

#: a zone is widened by this many distances on each side (the crossing estimated by a
#: quotient, the x by a product; the values never depend on it, see the module's docstring)
ZONE_MARGIN = 2

Network = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def fill_bands(near: torch.Tensor, inverse: torch.Tensor, network: Network, block: torch.Tensor) -> None:
    """Write the causal block of one batch row over keys in reverse order into ``block`` (Hq,
    rows, keys), keys >= 2 rows, its last row's first key at distance 0, the future at fp32's
    minimum. ``near`` (keys,) fp32 = feature[d] for d = 0 .. keys-1 (non-decreasing),
    ``inverse`` (rows,) fp32 the rows' 1 / normaliser, the network (w1 (K,), b1 (K,), w2 (Hq,
    K), b2 (Hq,)) fp32; x = near[d] * inverse[a], rounded once."""
    heads, rows, keys = block.shape
    w1, b1, w2, b2 = network
    distances = keys - rows + 1  # d = 0 .. keys - rows: every row holds them (V's columns)
    smallest, largest = torch.aminmax(inverse)
    zones = _zones(near, float(smallest), float(largest), w1.tolist(), b1.tolist())  # [(lo, hi)] per unit
    coefficients = _coefficients(near, zones, network)  # (2, Hq, keys) C and E per distance
    # the future of each row (reversed keys j' < rows - 1 - a) at the minimum; V, written next,
    # covers the rest of these columns
    block[:, :, :rows].copy_(_future_square(rows, block.device).expand(heads, -1, -1))
    view = block.as_strided(
        (heads, rows, distances), (rows * keys, keys - 1, 1), block.storage_offset() + rows - 1
    )  # (Hq, rows, D): V[h, a, d] = block[h, a, rows - 1 - a + d]
    for h in range(heads):  # one pass per head (two broadcast passes over all heads: ~30 % slower)
        torch.addcmul(
            coefficients[0, h, :distances], coefficients[1, h, :distances], inverse[:, None], out=view[h]
        )
    _add_zones(view, near[:distances], inverse, zones, network)
    # the farthest keys (d > keys - rows): the square of the last rows reversed keys, j' = keys -
    # rows + m at d = corner + a + m, rewritten whole (its nearer part as V has it); a unit whose
    # zone reaches the square's distances is a zone over all of it (its rows see the unit at
    # other distances), its ReLU added there and its line left out of C and E
    corner = keys - 2 * rows + 1
    reaching = [hi > lo and hi > corner for lo, hi in zones]
    if any(reaching):
        zones = [
            (min(lo, corner), keys) if reach else (lo, hi)
            for (lo, hi), reach in zip(zones, reaching, strict=True)
        ]
        coefficients = _coefficients(near, zones, network)
    toeplitz = coefficients[:, :, corner:].as_strided(
        (2, heads, rows, rows), (coefficients.stride(0), coefficients.stride(1), 1, 1)
    )  # (2, Hq, rows, rows): C and E at d = corner + a + m
    square = block[:, :, keys - rows :]
    torch.addcmul(toeplitz[0], toeplitz[1], inverse[:, None], out=square)
    square_near = near[corner:].as_strided((rows, rows), (1, 1))  # (rows, rows) near[corner + a + m]
    _add_zones(square, square_near, inverse, [(0, rows) if reach else (0, 0) for reach in reaching], network)


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
    """(2, Hq, keys): C[h, d] = b2 + sum w2 b1 and E[h, d] = (sum w2 w1) * near[d] over the units
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
    coefficients = lines.index_select(1, band_of).transpose(1, 2).contiguous()  # (2, Hq, keys)
    coefficients[1].mul_(near)
    return coefficients


def _add_zones(
    target: torch.Tensor,
    near: torch.Tensor,
    inverse: torch.Tensor,
    zones: list[tuple[int, int]],
    network: Network,
) -> None:
    """Add w2[:, k] relu(w1_k x + b1_k) over each unit's zone of ``target`` (Hq, rows, n), x =
    near * inverse[a] with ``near`` (n,) or (rows, n); zones clipped to 0 .. n."""
    width = target.shape[-1]
    spans = [
        (k, max(lo, 0), min(hi, width)) for k, (lo, hi) in enumerate(zones) if min(hi, width) > max(lo, 0)
    ]
    if not spans:
        return
    w1, b1, w2, _ = network
    # the units' parameters as Python-held views (no indexing op per unit)
    unit_weights, unit_biases = w1.unbind(0), b1.unbind(0)
    out_columns = w2.t()[:, :, None, None].unbind(0)  # (Hq, 1, 1) each
    for k, lo, hi in spans:
        x = near[..., lo:hi] * inverse[:, None]  # (rows, hi - lo)
        hidden = torch.addcmul(unit_biases[k], x, unit_weights[k]).clamp_(min=0)
        target[:, :, lo:hi].addcmul_(out_columns[k], hidden)


@functools.lru_cache(maxsize=8)
def _future_square(rows: int, device: torch.device) -> torch.Tensor:
    """(rows, rows) fp32: the minimum where reversed key j' < rows - 1 - a (row a's future), 0
    elsewhere (cached: the blocks share a few shapes)."""
    future = torch.ones(rows, rows, dtype=torch.bool, device=device).triu_(1).flip(-1)
    return torch.zeros(rows, rows, device=device).masked_fill_(future, torch.finfo(torch.float32).min)
