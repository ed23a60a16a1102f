"""A score bias as O(T) values, in the most structured form that describes it.

An encoding's ``score_bias`` stage returns one of these; every attention backend reads the
same object: the full-matrix backends take :meth:`BlockBias.full`, the chunked backend builds
it a block at a time with :meth:`BlockBias.rows`, FlexAttention evaluates
:meth:`BlockBias.elementwise` score by score, and fused kernels recognise the form they
implement (a distance-linear bias, a cumulative sum of per-token increments). The forms say
what the bias *is*, never which kernel should serve it.

``DistanceBias``        (Hq, Tk) table: ``bias[i, j] = table[h, i - j]`` (T5, KERPLE, Sandwich), a
                        Toeplitz matrix the chunked backend reads as a strided view;
``SaturatingDistanceBias`` a DistanceBias with ``table[h, d] = tail_h`` for every ``d >= W``
                        (T5's last bucket);
``LinearDistanceBias``  a DistanceBias with ``table[h, d] = -slope_h * d`` (ALiBi);
``SeparableBias``       ``bias[i, j] = query_term[i] - key_term[j]``;
``CumulativeBias``      a SeparableBias ``bias[i, j] = sum_{l=j+1}^{i} g_l`` whose per-token
                        increments ``g`` of every key are known (FoX without a cache);
``RowBias``             a function ``(start, stop, k_end) -> (B|1, Hq, stop-start, k_end)``,
                        optionally with the bias of one score ``(b, h, q_idx, kv_idx) -> bias``;
``PiecewiseDistanceBias`` (:mod:`.piecewise_bias`) a piecewise-linear function of a per-query
                        normalised distance (FIRE), a distance table for the queries below its threshold.

Queries are bottom-right aligned (:mod:`hf_posenc.core.layout`). Every form gives the bias of the
keys a causal query may attend; future keys, masked by every backend, get the bias of distance 0.

A compiled kernel runs at a length bucket (:class:`ScoreGrid`): ``elementwise(grid)`` evaluates
the bias on the padded index ranges, reading only in-range entries there, with every tensor it
captures sized by the bucket and the key offset a tensor, so one compiled graph serves every
length of the bucket.

Every form can be restricted to a range of its heads (:meth:`BlockBias.heads`): head-parallel
attention (:mod:`hf_posenc.attention.head_parallel`, DeepSpeed Ulysses' layout) attends heads
``offset .. offset + Hq/N - 1`` on each rank, and takes their bias from the form of all heads
(O(Hq * T) values, nothing quadratic is computed for the heads dropped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from ..core.layout import causal_mask_or_none, fold_mask, query_key_indices
from .score_grid import ElementwiseBias, ScoreGrid, pad_last

if TYPE_CHECKING:
    from .headwise_rebuild import HeadwiseRebuild

RowsFunction = Callable[[int, int, int], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class BlockBias:
    """Base of the forms: the bias of ``q_len`` queries over ``k_len`` keys."""

    q_len: int
    k_len: int

    def rows(self, start: int, stop: int, k_end: int) -> torch.Tensor:
        """Bias of queries ``start .. stop-1`` and keys ``0 .. k_end-1``: (B|1, Hq, stop-start, k_end) fp32."""
        raise NotImplementedError

    def span(self, start: int, stop: int, k_start: int, k_end: int) -> torch.Tensor:
        """Bias of queries ``start .. stop-1`` and keys ``k_start .. k_end-1``: (B|1, Hq, rows, k_end-k_start)
        fp32 (the chunked backend skips keys no query of a block may attend: other packed documents)."""
        return self.rows(start, stop, k_end)[..., k_start:]

    def full(self) -> torch.Tensor:
        """The whole (B|1, Hq, Tq, Tk) bias."""
        return self.rows(0, self.q_len, self.k_len)

    def elementwise(self, grid: ScoreGrid | None = None) -> ElementwiseBias | None:
        """The bias of one score from index tensors, or None when the form cannot say it per score.

        ``grid``: evaluated on a length bucket's padded index ranges (see :class:`ScoreGrid`):
        the same values at the call's own attendable (query, key) pairs, in-range reads
        everywhere, captured tensors sized by the bucket."""
        return None

    def tensors(self) -> dict[str, torch.Tensor] | None:
        """The tensor fields the form is built from, by name, when ``dataclasses.replace(form,
        **tensors)`` rebuilds it (the chunked backend rebuilds a block's bias in backward from
        them instead of keeping it); None for forms that cannot be rebuilt so."""
        return None

    def distance_table(self) -> tuple[int, torch.Tensor] | None:
        """``(rows, table)`` when the first ``rows`` queries have the bias ``table[h, i - j]``
        ((Hq, Tk) fp32, a Toeplitz matrix), else None."""
        return None

    def heads(self, start: int, stop: int) -> BlockBias:
        """The same bias restricted to heads ``start .. stop-1`` (the global head indices of a head
        slice): a form of the same kind whose head ``h - start`` is this form's head ``h``."""
        raise NotImplementedError(f"{type(self).__name__} cannot be restricted to a range of heads")

    def builds_reversed(self, device: torch.device) -> bool:
        """Whether :meth:`folded_reversed` builds this form's causal blocks on ``device`` (then the
        chunked backend hands its training blocks their keys in reverse order, views of one
        reversed copy of the layer's k and v)."""
        return False

    def folded_reversed(
        self, start: int, stop: int, k_end: int, dtype: torch.dtype, scratch: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The causal block (no padding mask) with its keys in reverse order (key k_end-1 first),
        (B|1, Hq, rows, k_end) in ``dtype`` with the future at its minimum, for forms that build
        it cheaper so (attention does not depend on the keys' order: the chunked backend then
        attends the reversed keys); None where the form has no such way (then :meth:`folded`)."""
        return None

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
        """:meth:`folded_reversed` at most ``group`` heads at a time: (heads, their block (B|1, g,
        rows, k_end)), each block made (into ``scratch``, at least B' * g * rows * k_end values,
        where the form uses it) when the iterator reaches it, so the caller uses each block before
        asking for the next; None where :meth:`folded_reversed` is None. Forms that only build
        every head at once give them as one slice. ``kept``: a dict the caller hands to
        :meth:`rebuilt_reversed_heads` of the same block, where a form may leave what its rebuild
        can reuse (O(keys) per block; the form's tensors must be the same values then)."""
        block = self.folded_reversed(start, stop, k_end, dtype)
        return None if block is None else iter([(slice(0, block.shape[1]), block)])

    def rebuilt_reversed_heads(
        self, start: int, stop: int, k_end: int, dtype: torch.dtype, kept: dict | None = None
    ) -> HeadwiseRebuild | None:
        """The block of :meth:`folded_reversed` to be rebuilt in backward a group of heads at a time,
        its gradient to the form's tensors added by hand per group (:class:`.headwise_rebuild.HeadwiseRebuild`), for
        forms that can; None where the form has no such way (then
        :meth:`folded_reversed_with_gradients`). ``kept``: what :meth:`folded_reversed_heads` left
        for this block, or None."""
        return None

    def folded_reversed_with_gradients(
        self, start: int, stop: int, k_end: int, dtype: torch.dtype, scratch: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """:meth:`folded_reversed` differentiable in the form's tensors (a block rebuilt in
        backward over the reversed keys), for forms that build it cheaper so; None where the
        form has no such way (then :meth:`folded`). ``scratch``: a flat buffer the block may be
        written into (the forward's, :meth:`folded`'s), the previous block's values overwritten."""
        return None

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
        """:meth:`span` in ``dtype`` with the dtype's minimum where ``allowed`` (B|1, 1, rows, keys)
        bool is False (None: the causal keys, bottom-right aligned): one block's float attention
        mask, (B', Hq, rows, keys).

        ``scratch``: a flat buffer in ``dtype`` (at least B' * Hq * rows * keys values) that the
        block may be written into instead of a new tensor; given only without gradients, and
        overwritten by the next block (the chunked backend reuses one per forward: on CPU a new
        block of more than 32 MiB is a fresh mapping from the OS, paid in page faults)."""
        values = self.rows(start, stop, k_end) if k_start == 0 else self.span(start, stop, k_start, k_end)
        if allowed is None:  # the causal keys (none to mask for one query)
            causal = causal_mask_or_none(stop - start, k_end, values.device)
            allowed = None if causal is None else causal[..., k_start:]
        return fold_mask(values.to(dtype), allowed)


@dataclasses.dataclass(frozen=True)
class DistanceBias(BlockBias):
    table: torch.Tensor  # (Hq, Tk) fp32: the bias of distance d = i - j = 0 .. Tk-1

    def rows(self, start: int, stop: int, k_end: int) -> torch.Tensor:
        return self.span(start, stop, 0, k_end)

    def span(self, start: int, stop: int, k_start: int, k_end: int) -> torch.Tensor:
        """(1, Hq, rows, keys): ``table[h, max(i - j, 0)]``. One query over keys up to its own
        (a decoding step) is the table's distances in reverse, a flip; other blocks one gather of
        the flattened distances along the table's last dim (``index_select``: about half the time
        of indexing with the (rows, keys) distances, whose backward is the same sum)."""
        heads, device = self.table.shape[0], self.table.device
        if self.one_causal_row(start, stop, k_end):  # distances k_end - 1 - k_start .. 0
            return self.table[:, : k_end - k_start].flip(-1)[None, :, None]  # (1, Hq, 1, keys)
        queries, keys = query_key_indices(self.q_len, self.k_len, device, start, stop)
        distance = (queries[:, None] - keys[None, k_start:k_end]).clamp_(min=0)  # (rows, keys)
        gathered = self.table.index_select(1, distance.view(-1))  # (Hq, rows * keys)
        return gathered.view(heads, *distance.shape)[None]  # (1, Hq, rows, k_end - k_start)

    def one_causal_row(self, start: int, stop: int, k_end: int) -> bool:
        """Whether the block is one query over keys up to its own (a decoding step's)."""
        return stop - start == 1 and k_end == self.k_len - self.q_len + stop

    def distance_table(self) -> tuple[int, torch.Tensor] | None:
        return self.q_len, self.table

    def heads(self, start: int, stop: int) -> BlockBias:
        return DistanceBias(self.q_len, self.k_len, self.table[start:stop])

    def tensors(self) -> dict[str, torch.Tensor] | None:
        return {"table": self.table}

    def elementwise(self, grid: ScoreGrid | None = None) -> ElementwiseBias:
        """``table[h, |i - j|]``; on a grid the table is padded to ``q_size + k_size`` entries,
        past every |i - j| of the padded ranges (the largest, ``q_size - 1 + offset``, is below
        it as ``offset < k_len <= k_size``), and the padded scores read distinct entries."""
        table = self.table
        offset: int | torch.Tensor = self.k_len - self.q_len
        if grid is not None:
            table, offset = pad_last(table, grid.q_size + grid.k_size), grid.offset  # (Hq, Tq' + Tk')

        def by_distance(b, h, q_idx, kv_idx):
            # |i - j|, not max(i - j, 0): a future key's score is masked whatever its bias, but
            # FlexAttention's backward still adds its (zero) gradient into the table entry it
            # read; clamped, every future key of every diagonal block lands on entry 0 of its
            # head and the atomic adds queue on one address (measured on an H200, bf16,
            # T=8192: the learned table's backward kernel took 15.2 ms against 4.3 ms frozen)
            return table[h, torch.abs(q_idx + offset - kv_idx)]

        return by_distance


@dataclasses.dataclass(frozen=True)
class SaturatingDistanceBias(DistanceBias):
    """A DistanceBias constant from a distance on: ``table[h, d] = near[h, d]`` for ``d < W``,
    ``tail[h]`` for every ``d >= W`` (``W = near.shape[1]``; T5's buckets, whose last bucket holds
    every distance from some W on). ``table`` is built from the two (differentiable: every
    backend reading the table sends its gradient to ``near`` and ``tail``); a backend that knows
    the form attends the pairs ``i - j >= W`` as plain causal attention shifted by W plus the
    per-head constant ``tail`` (no (rows x keys) bias for them)."""

    near: torch.Tensor  # (Hq, W) fp32: the bias of distances 0 .. W-1
    tail: torch.Tensor  # (Hq,) fp32: the bias of every distance >= W
    table: torch.Tensor = dataclasses.field(init=False)  # (Hq, Tk), built from near and tail

    def __post_init__(self) -> None:
        window = self.saturation
        if window >= self.k_len:
            table = self.near[:, : self.k_len]
        else:
            tail = self.tail[:, None].expand(-1, self.k_len - window)  # (Hq, Tk - W)
            table = torch.cat((self.near, tail), dim=1)
        object.__setattr__(self, "table", table)  # a frozen dataclass

    @property
    def saturation(self) -> int:
        """W: the first distance whose bias is ``tail`` (and so is every larger one's)."""
        return self.near.shape[1]

    def heads(self, start: int, stop: int) -> BlockBias:
        return SaturatingDistanceBias(self.q_len, self.k_len, self.near[start:stop], self.tail[start:stop])

    def tensors(self) -> dict[str, torch.Tensor] | None:
        return {"near": self.near, "tail": self.tail}


@dataclasses.dataclass(frozen=True, init=False)
class LinearDistanceBias(DistanceBias):
    """``bias[i, j] = -slope_h * (i - j)``: a DistanceBias whose table is linear in the distance."""

    slopes: torch.Tensor  # (Hq,) fp32

    def __init__(self, q_len: int, k_len: int, slopes: torch.Tensor) -> None:
        distance = torch.arange(k_len, device=slopes.device, dtype=torch.float32)  # (Tk,)
        object.__setattr__(self, "slopes", slopes)
        super().__init__(q_len, k_len, -slopes[:, None] * distance)  # (Hq, Tk)

    def tensors(self) -> dict[str, torch.Tensor] | None:
        return None  # built from its slopes by its own __init__, not by dataclasses.replace

    def span(self, start: int, stop: int, k_start: int, k_end: int) -> torch.Tensor:
        """``-slope_h * (i - j)`` computed (the table's own fp32 product): a broadcast multiply, not a
        gather from the table (CAPE's explicit blocks spent about 6 % of their time gathering)."""
        if self.one_causal_row(start, stop, k_end):  # a decoding step: a flip of the table (its
            return super().span(start, stop, k_start, k_end)  # products are these)
        queries, keys = query_key_indices(self.q_len, self.k_len, self.slopes.device, start, stop)
        distance = (queries[:, None] - keys[None, k_start:k_end]).clamp_(min=0).float()  # (rows, keys)
        return (-self.slopes[:, None, None] * distance)[None]  # (1, Hq, rows, keys)

    def rows(self, start: int, stop: int, k_end: int) -> torch.Tensor:
        return self.span(start, stop, 0, k_end)

    def heads(self, start: int, stop: int) -> BlockBias:
        return LinearDistanceBias(self.q_len, self.k_len, self.slopes[start:stop])

    def elementwise(self, grid: ScoreGrid | None = None) -> ElementwiseBias:
        """``-slope_h * (i - j)`` computed per score (no table gather: arithmetic is cheaper in a
        fused kernel than a load), the same fp32 product as the table's entries."""
        slopes = self.slopes.float()
        offset = self.k_len - self.q_len if grid is None else grid.offset

        def linear(b, h, q_idx, kv_idx):
            return -slopes[h] * torch.clamp(q_idx + offset - kv_idx, min=0).to(torch.float32)

        return linear


@dataclasses.dataclass(frozen=True)
class SeparableBias(BlockBias):
    query_term: torch.Tensor  # (B, Hq, Tq) fp32
    key_term: torch.Tensor  # (B, Hq, Tk) fp32

    def rows(self, start: int, stop: int, k_end: int) -> torch.Tensor:
        return self.query_term[..., start:stop, None] - self.key_term[..., None, :k_end]

    def span(self, start: int, stop: int, k_start: int, k_end: int) -> torch.Tensor:
        return self.query_term[..., start:stop, None] - self.key_term[..., None, k_start:k_end]

    def heads(self, start: int, stop: int) -> BlockBias:
        return SeparableBias(
            self.q_len, self.k_len, self.query_term[:, start:stop], self.key_term[:, start:stop]
        )

    def elementwise(self, grid: ScoreGrid | None = None) -> ElementwiseBias:
        query_term, key_term = self.query_term, self.key_term
        if grid is not None:
            query_term = pad_last(query_term, grid.q_size)  # (B, Hq, Tq')
            key_term = pad_last(key_term, grid.k_size)  # (B, Hq, Tk')

        def separable(b, h, q_idx, kv_idx):
            return query_term[b, h, q_idx] - key_term[b, h, kv_idx]

        return separable


@dataclasses.dataclass(frozen=True, init=False)
class CumulativeBias(SeparableBias):
    """``bias[i, j] = sum_{l=j+1}^{i} g_l`` over a call with no cached keys (Tq == Tk): the
    separable bias ``c_i - c_j`` of the running sums ``c_t = sum_{l <= t} g_l`` (given rounded
    to fp32, as the caller accumulated them)."""

    increments: torch.Tensor  # (B, Hq, Tk) fp32 g_t

    def __init__(self, increments: torch.Tensor, cumulative: torch.Tensor) -> None:
        length = increments.shape[-1]
        object.__setattr__(self, "increments", increments)
        super().__init__(length, length, cumulative, cumulative)

    def heads(self, start: int, stop: int) -> BlockBias:
        return CumulativeBias(self.increments[:, start:stop], self.key_term[:, start:stop])

    def elementwise(self, grid: ScoreGrid | None = None) -> ElementwiseBias:
        """``c[i] - c[j]`` read from one captured tensor of running sums (padded to the grid's
        keys; Tq == Tk, so its queries too). The inherited form captures a query term and a key
        term, here one tensor twice, or two once padding copies them: the compiled kernel guards
        on whether its captured tensors are the same object and compiled a second graph for a
        call at its bucket's own length."""
        cumulative = self.key_term if grid is None else pad_last(self.key_term, grid.k_size)  # (B, Hq, Tk')

        def cumulative_difference(b, h, q_idx, kv_idx):
            return cumulative[b, h, q_idx] - cumulative[b, h, kv_idx]

        return cumulative_difference


@dataclasses.dataclass(frozen=True)
class RowBias(BlockBias):
    function: RowsFunction
    #: the bias of one score (b, h, q_idx, kv_idx), for biases that can be written per score
    score: ElementwiseBias | None = None

    def rows(self, start: int, stop: int, k_end: int) -> torch.Tensor:
        return self.function(start, stop, k_end)

    def elementwise(self, grid: ScoreGrid | None = None) -> ElementwiseBias | None:
        return self.score if grid is None else None  # a function of the call's own ranges

    def heads(self, start: int, stop: int) -> BlockBias:
        function, score = self.function, self.score

        def rows(first: int, last: int, k_end: int) -> torch.Tensor:
            return function(first, last, k_end)[:, start:stop]  # (B|1, heads, rows, k_end)

        def one(b, h, q_idx, kv_idx):
            return score(b, h + start, q_idx, kv_idx)  # only built when score is not None

        return RowBias(self.q_len, self.k_len, rows, one if score is not None else None)
