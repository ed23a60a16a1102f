"""A score bias that is a piecewise-linear function of a per-query normalised distance (FIRE,
Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context
Transformers", arXiv:2310.04418, whose one-input ReLU MLP is such a function):

    bias[b, h, i, j] = slopes[h, s] * x + intercepts[h, s],   x = feature[i - j] / normalizer[b, i],
    s = #{k : points[k] <= x}                                  (the linear piece x falls in)

``feature`` (Tk,) is non-decreasing in the distance d = i - j (future keys, masked by every
backend, get distance 0), ``normalizer`` (B|1, Tq) > 0, ``points`` (K,) sorted, ``slopes`` and
``intercepts`` (Hq, K+1). Queries marked ``below`` (B|1, Tq) share the normaliser ``floor``
(FIRE: i <= L, where the normaliser is psi(L)); there the bias depends on i - j only and is
the distance table ``table[h, d] = f_h(feature[d] / floor)`` (Hq, Tk).

The views, each exact (the same fp32 operations on the same x):

- ``rows``/``span``: the formula, with ``torch.searchsorted`` for the piece;
- ``elementwise`` (FlexAttention): the piece as the count of breakpoints <= x (measured
  faster on a GPU than a binary search over them, see the method);
- ``distance_table``: the leading queries below the threshold, which the chunked backend
  serves as a strided Toeplitz view (nothing written out);
- ``folded`` (one chunked block, mask included): x and the piece per (query, key) for all
  heads at once — as x is monotone along a row, the pieces come from one search per row and
  breakpoint and a cumulative sum, not a search per score — then per head two gathers from
  (2K+2,) vectors and one multiply-add. The mask is folded into the piece index (pieces past K
  have slope 0 and the dtype's minimum as intercept), so no other pass over the block is
  needed (a causal mask costs one more scattered value per row); its backward sums the
  gradient per piece (:class:`.piecewise_block.PiecewiseBlock`). A block of at most
  :data:`FEW_ROWS` rows (a decoding step's) is ``span`` with the mask folded in. On CPU, when f's network is known and few of
  its units switch inside the block, the block (with gradients too) comes from the network's
  matrix products instead (:mod:`.network_block`); a causal block of at least twice as many
  keys as queries over the keys in reverse order (``folded_reversed``, and
  ``folded_reversed_with_gradients`` for backward) from bands of distances where the network
  is linear (:mod:`.network_bands`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..core.layout import query_key_indices
from . import network_bands, network_bands_backward, network_block
from .block_bias import BlockBias
from .distance_ratio import DistanceRatio, distance_ratio
from .network_block import reversed_network_block
from .piecewise_block import PiecewiseBlock, monotone_segments
from .score_grid import ElementwiseBias, ScoreGrid, pad_last

#: blocks of at most this many queries (decoding steps) are the formula's view (:meth:`span`)
#: with the mask folded in: one query over 2048 keys, 8 heads (CPU, no gradients) took ~0.5 ms
#: from the network's products (their plan's few dozen operations) and ~0.14 ms so
FEW_ROWS = 16


@dataclasses.dataclass(frozen=True)
class PiecewiseDistanceBias(BlockBias):
    # feature and normalizer fp32 or fp64 (FIRE: fp64, see FIREFunction.bias); x is fp32, their
    # quotient rounded once
    feature: torch.Tensor  # (Tk,) non-decreasing: feature[d] for d = 0 .. Tk-1
    normalizer: torch.Tensor  # (B|1, Tq) > 0
    points: torch.Tensor  # (K,) fp32 sorted breakpoints
    slopes: torch.Tensor  # (Hq, K+1) fp32
    intercepts: torch.Tensor  # (Hq, K+1) fp32
    below: torch.Tensor  # (B|1, Tq) bool: the query's normaliser is ``floor``
    floor: torch.Tensor  # () as normalizer
    #: f as the one-input ReLU network it is, when known (FIRE's MLP), fp32:
    #: f_h(x) = out_weight[h] @ relu(unit_weight * x + unit_bias) + out_bias[h]
    unit_weight: torch.Tensor | None = None  # (K,) w1
    unit_bias: torch.Tensor | None = None  # (K,) b1
    out_weight: torch.Tensor | None = None  # (Hq, K) w2
    out_bias: torch.Tensor | None = None  # (Hq,) b2

    @property
    def network(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(w1, b1, w2, b2) when f's network is known."""
        parts = (self.unit_weight, self.unit_bias, self.out_weight, self.out_bias)
        if parts[0] is None or parts[1] is None or parts[2] is None or parts[3] is None:
            return None
        return parts[0], parts[1], parts[2], parts[3]

    def x(self, start: int, stop: int, k_start: int, k_end: int, reverse: bool = False) -> torch.Tensor:
        """The normalised distance of queries ``start .. stop-1`` and keys ``k_start .. k_end-1``:
        (B|1, rows, keys) fp32, non-increasing along the keys (``reverse``: the keys in reverse
        order, key k_end-1 first, non-decreasing); differentiable in ``feature`` and
        ``normalizer`` (:class:`DistanceRatio`)."""
        first = self._reversed_first(start, k_end)
        if torch.is_grad_enabled() and (self.feature.requires_grad or self.normalizer.requires_grad):
            return DistanceRatio.apply(
                self.feature, self.normalizer, first, start, stop, k_end - k_start, reverse
            )
        return distance_ratio(self.feature, self.normalizer[:, start:stop], first, k_end - k_start, reverse)

    def x_range(self, start: int, stop: int, k_start: int, k_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(min, max) of :meth:`x` over the block, 0-dim fp32, from O(rows) values: along a row x
        runs from the distance of the last key to that of the first (the same fp32 quotients)."""
        queries, _ = query_key_indices(self.q_len, self.k_len, self.feature.device, start, stop)
        normalizer = self.normalizer[:, start:stop]  # (B|1, rows)
        nearest = self.feature[(queries - (k_end - 1)).clamp(min=0)] / normalizer  # (B|1, rows)
        farthest = self.feature[(queries - k_start).clamp(min=0)] / normalizer
        return nearest.min().float(), farthest.max().float()

    def span(self, start: int, stop: int, k_start: int, k_end: int) -> torch.Tensor:
        """The formula's block (B|1, Hq, rows, keys): each x's piece by a binary search over the
        breakpoints, its slope and intercept gathered by ``index_select`` over the flattened
        pieces (indexing with the (B|1, rows, keys) pieces took about 4x as long)."""
        x = self.x(start, stop, k_start, k_end)  # (B|1, rows, keys)
        pieces = torch.searchsorted(self.points, x.detach(), right=True).view(-1)  # (n,) in 0 .. K
        slopes = self.slopes.index_select(1, pieces)  # (Hq, n)
        intercepts = self.intercepts.index_select(1, pieces)  # (Hq, n)
        bias = slopes * x.view(1, -1) + intercepts  # (Hq, n)
        return bias.view(-1, *x.shape).movedim(0, 1)  # (B|1, Hq, rows, keys)

    def rows(self, start: int, stop: int, k_end: int) -> torch.Tensor:
        return self.span(start, stop, 0, k_end)

    def table_rows(self) -> int:
        """How many leading queries are ``below`` in every batch row: one host sync, asked only by
        a backend that serves those rows as a table (not by a decoding step); 0 under torch.compile."""
        if torch.compiler.is_compiling():
            return 0
        return int(self.below.all(dim=0).int().cumprod(dim=0).sum())

    def distance_table(self) -> tuple[int, torch.Tensor] | None:
        rows = self.table_rows()
        return (rows, self.table) if rows > 0 else None

    def heads(self, start: int, stop: int) -> BlockBias:
        """Heads ``start .. stop-1``: every per-head field cut (the pieces and, when known, the
        network's output layer)."""
        out_weight, out_bias = self.out_weight, self.out_bias
        return dataclasses.replace(
            self,
            slopes=self.slopes[start:stop],
            intercepts=self.intercepts[start:stop],
            out_weight=None if out_weight is None else out_weight[start:stop],
            out_bias=None if out_bias is None else out_bias[start:stop],
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        tensors = {
            "feature": self.feature,
            "normalizer": self.normalizer,
            "slopes": self.slopes,
            "intercepts": self.intercepts,
            "floor": self.floor,
        }
        network = {
            "unit_weight": self.unit_weight,
            "unit_bias": self.unit_bias,
            "out_weight": self.out_weight,
            "out_bias": self.out_bias,
        }
        # the network too, when known: a block rebuilt from its products sends its gradient there
        tensors.update({name: value for name, value in network.items() if value is not None})
        return tensors

    @property
    def table(self) -> torch.Tensor:
        """(Hq, Tk) fp32: the bias of distance d for queries whose normaliser is ``floor``."""
        x = (self.feature / self.floor).float()  # (Tk,)
        segment = torch.searchsorted(self.points, x.detach(), right=True)  # (Tk,)
        return self.slopes[:, segment] * x + self.intercepts[:, segment]

    def elementwise(self, grid: ScoreGrid | None = None) -> ElementwiseBias:
        """f(x) of one score from its linear pieces, the piece being the number of breakpoints
        <= x counted over the K breakpoints (each a broadcast scalar load). Measured on an H200
        (bf16, T=8192, forward): this count ran FIRE at 6.97x native where a binary search over
        the breakpoints (log2(K+1) dependent gathers, plus a distance table below L computed
        beside it) ran at 12.69x, and the search's CPU compile took minutes instead of seconds."""
        offset: int | torch.Tensor = self.k_len - self.q_len
        # fp32 on the device (a per-score fp64 division is slow on GPUs)
        feature, normalizer = self.feature.float(), self.normalizer.float()
        if grid is not None:  # padded as DistanceBias's table; a padded query's normaliser is 1, not 0
            offset = grid.offset
            feature = pad_last(feature, grid.q_size + grid.k_size)  # (Tq' + Tk',)
            normalizer = pad_last(normalizer, grid.q_size, value=1.0)  # (B|1, Tq')
        points, slopes, intercepts = self.points.float(), self.slopes, self.intercepts
        shared_rows = normalizer.shape[0] == 1

        def piecewise(b, h, q_idx, kv_idx):
            distance = torch.abs(q_idx + offset - kv_idx)  # future keys: masked; |d| spreads
            # their (zero) gradients over the features instead of queueing them all on d = 0
            # (see DistanceBias.elementwise)
            row = 0 if shared_rows else b
            x = feature[distance] / normalizer[row, q_idx]
            segment = torch.zeros_like(distance)
            for k in range(points.shape[0]):
                segment = segment + (x >= points[k]).to(distance.dtype)
            return slopes[h, segment] * x + intercepts[h, segment]

        return piecewise

    def _network_blocks(self, device: torch.device) -> bool:
        """Whether blocks may come from the network's matrix products (:mod:`.network_block`,
        forward and backward): on CPU when the network is known; elsewhere, and under
        torch.compile, the linear pieces (which units switch in a block is data-dependent:
        fullgraph compiled decoding cannot guard on it)."""
        return self.network is not None and device.type == "cpu" and not torch.compiler.is_compiling()

    def builds_reversed(self, device: torch.device) -> bool:
        return self._network_blocks(device)

    def _reversed_first(self, start: int, k_end: int) -> int:
        """The distance of (query ``start``, reversed key 0 = key k_end-1)."""
        return self.k_len - self.q_len + start - (k_end - 1)

    def folded_reversed(
        self, start: int, stop: int, k_end: int, dtype: torch.dtype, scratch: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The causal block (no padding mask) of queries ``start .. stop-1`` over keys ``0 ..
        k_end-1`` in reverse order (key k_end-1 first): (B|1, Hq, rows, k_end) in ``dtype``, the
        future at its minimum; None where the linear pieces serve it (see :meth:`folded`): from
        bands of distances where they serve (:mod:`.network_bands`), else from the network's
        products with x from a strided view of one line of features without gradients, so no
        flip of the block's x is written."""
        network = self.network
        if network is None or not self._network_blocks(self.feature.device):
            return None
        first = self._reversed_first(start, k_end)
        normalizer = self.normalizer[:, start:stop]
        block: torch.Tensor | None
        with torch.no_grad():
            if network_bands.serves(first, stop - start, k_end):  # (no x range needed)
                block = network_bands.banded_block(self.feature[:k_end], normalizer, network, scratch)
            else:
                x_range = self.x_range(start, stop, 0, k_end)
                block = reversed_network_block(
                    self.feature, normalizer, first, k_end, network, x_range, scratch
                )
        return None if block is None else block.to(dtype)

    def folded_reversed_heads(
        self,
        start: int,
        stop: int,
        k_end: int,
        dtype: torch.dtype,
        group: int,
        scratch: torch.Tensor | None = None,
        kept: dict | None = None,
    ) -> Iterator[tuple[slice, torch.Tensor]] | None:
        """:meth:`folded_reversed` ``group`` heads at a time where the bands build it (their plans and
        zones made once for all heads, :func:`.network_bands.banded_head_blocks`; the plan of one
        row of normalisers left in ``kept`` for :meth:`rebuilt_reversed_heads`); other blocks
        (fewer keys than twice the rows) as one slice of every head when ``group`` covers them
        all, else None."""
        network = self.network
        if network is None or not self._network_blocks(self.feature.device):
            return None
        heads = network[2].shape[0]
        if not network_bands.serves(self._reversed_first(start, k_end), stop - start, k_end):
            # (keys < 2 rows: for groups of fewer heads the caller builds it a group at a time)
            return super().folded_reversed_heads(start, stop, k_end, dtype, group) if group >= heads else None
        blocks = network_bands.banded_head_blocks(
            self.feature[:k_end], self.normalizer[:, start:stop], network, scratch, group, kept
        )
        return ((heads, block.to(dtype)) for heads, block in blocks)

    def rebuilt_reversed_heads(
        self, start: int, stop: int, k_end: int, dtype: torch.dtype, kept: dict | None = None
    ) -> _RebuiltBandHeads | None:
        """The bands' block (:class:`.network_bands_backward.RebuiltHeads`) where
        :meth:`folded_reversed_with_gradients` takes the bands, the model computes in fp32 and one
        row of normalisers serves the batch; with the plan :meth:`folded_reversed_heads` left in
        ``kept`` where it did."""
        network = self.network
        if (
            network is None
            or dtype != torch.float32
            or self.normalizer.shape[0] != 1
            or not self._network_blocks(self.feature.device)
            or not network_bands.serves(self._reversed_first(start, k_end), stop - start, k_end)
        ):
            return None
        rebuilt = network_bands_backward.RebuiltHeads(
            self.feature[:k_end],
            self.normalizer[:, start:stop],
            network,
            None if kept is None else kept.get(network_bands.PLAN_KEY),
        )
        return _RebuiltBandHeads(self, rebuilt, start, stop, k_end)

    def folded_reversed_with_gradients(
        self, start: int, stop: int, k_end: int, dtype: torch.dtype, scratch: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """:meth:`folded_reversed` differentiable in the form's tensors, from the bands of distances
        (:func:`.network_bands_backward.banded_rows`, whose backward works in the same bands); None where
        those do not serve (not a causal block of at least twice as many keys as rows, or
        :meth:`folded_reversed` would not)."""
        network = self.network
        if (
            network is None
            or not self._network_blocks(self.feature.device)
            or not network_bands.serves(self._reversed_first(start, k_end), stop - start, k_end)
        ):
            return None
        # feature[d] for d = 0 .. k_end-1 and the rows' normalisers, as folded_reversed reads them
        block = network_bands_backward.banded_rows(
            self.feature[:k_end], self.normalizer[:, start:stop], network, scratch
        )
        return block.to(dtype)

    def folded(
        self,
        start: int,
        stop: int,
        k_start: int,
        k_end: int,
        allowed: torch.Tensor | None,
        dtype: torch.dtype,
        scratch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if stop - start <= FEW_ROWS:  # (decoding steps) the formula's pieces, then the mask
            return super().folded(start, stop, k_start, k_end, allowed, dtype)
        x = self.x(start, stop, k_start, k_end)  # (B|1, rows, keys)
        network = self.network
        if self._network_blocks(x.device):
            assert network is not None
            block = network_block.network_block(
                x, network, allowed, scratch, self.x_range(start, stop, k_start, k_end)
            )
            if block is not None:
                return block.to(dtype)
        count = self.points.shape[0]
        masked = count + 1  # pieces K+1 .. 2K+1: keys that may not be attended
        future = None
        if allowed is None:  # causal: from key index i + 1 on, the pieces are shifted past K
            queries, _ = query_key_indices(self.q_len, self.k_len, x.device, start, stop)
            future = queries + 1 - k_start  # (rows,) the first future key of each query
        segment, ends = monotone_segments(x.detach(), self.points, future, masked)  # (B|1, rows, keys)
        if allowed is not None:  # (B|1, 1, rows, keys)
            segment = segment.masked_fill(~allowed[:, 0], masked)
        slopes = F.pad(self.slopes, (0, masked))  # (Hq, 2K+2): slope 0 ...
        # ... and the minimum (of the block's dtype, within the pieces' fp32: fp64 blocks get fp32's,
        # which masks as surely; fp64's own does not fit the fp32 intercepts)
        minimum = max(torch.finfo(dtype).min, torch.finfo(self.intercepts.dtype).min)
        intercepts = F.pad(self.intercepts, (0, masked), value=minimum)
        out = None
        if scratch is not None and scratch.dtype == x.dtype:  # (B', Hq, rows, keys) written in place
            shape = (segment.shape[0], self.slopes.shape[0], *segment.shape[1:])
            out = scratch[: shape[0] * shape[1] * segment[0].numel()].view(shape)
        return PiecewiseBlock.apply(x, segment, ends, slopes, intercepts, out).to(
            dtype
        )  # (B', Hq, rows, keys)


@dataclasses.dataclass
class _RebuiltBandHeads:
    """:class:`.headwise_rebuild.HeadwiseRebuild` of a :class:`PiecewiseDistanceBias`'s block of queries
    ``start .. stop-1`` over keys ``0 .. k_end-1``: the bands' gradients placed in the form's
    tensors (feature's first k_end distances, the normalisers of the block's rows, the network)."""

    form: PiecewiseDistanceBias
    rebuilt: network_bands_backward.RebuiltHeads
    start: int
    stop: int
    k_end: int

    def blocks(self, group: int, buffer: torch.Tensor | None) -> Iterator[tuple[slice, torch.Tensor]]:
        return self.rebuilt.blocks(group, buffer)

    def add_gradient(self, heads: slice, grad: torch.Tensor) -> None:
        self.rebuilt.add_gradient(heads, grad)

    def gradients(self) -> list[torch.Tensor | None]:
        grad_near, grad_normalizer, grad_w1, grad_b1, grad_w2, grad_b2 = self.rebuilt.result()
        form = self.form
        grad_feature = torch.zeros_like(form.feature)
        grad_feature[: self.k_end] = grad_near
        grad_rows = torch.zeros_like(form.normalizer)
        grad_rows[:, self.start : self.stop] = grad_normalizer
        found = {
            "feature": grad_feature,
            "normalizer": grad_rows,
            "unit_weight": grad_w1,
            "unit_bias": grad_b1,
            "out_weight": grad_w2,
            "out_bias": grad_b2,
        }
        return [found.get(name) for name in form.tensors()]
