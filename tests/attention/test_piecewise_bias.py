"""FIRE's bias as a piecewise-linear function of a normalised distance (PiecewiseDistanceBias):
every view of it — the per-score function FlexAttention evaluates (distance table below the
threshold, binary search over the breakpoints above), the chunked backend's folded blocks and
its Toeplitz table rows — equals FIRE's formula (Li et al. 2023, arXiv:2310.04418) written
here in fp64 from the paper,

    b_h(i, j) = f_h( psi((i - j) / s) / (psi(max(L, p_i / s)) + 1e-6) ),   psi(x) = log(1 + |c| x),
    f = W2 relu(W1 x + b1) + b2,

for any length, cached-key offset, threshold L, breakpoint count, interpolation factor s and
batch rows with their own positions p (left padding); the folded blocks' gradients are those
of the formula's view.
"""

from __future__ import annotations

import itertools
import math
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_posenc.core.interpolation import interpolate
from hf_posenc.encodings import network_bands, network_block, piecewise_bias
from hf_posenc.encodings.fire import FIREFunction
from hf_posenc.encodings.piecewise_block import monotone_segments


def _function(heads: int, width: int, c: float, threshold: float, seed: int) -> FIREFunction:
    """A FIRE function with random weights whose breakpoints -b1/w1 mostly fall inside [0, 1]."""
    generator = torch.Generator().manual_seed(seed)
    function = FIREFunction(heads, width, init_c=c, init_L=threshold)
    with torch.no_grad():
        w1 = torch.randn(width, generator=generator) * 3
        inside = torch.rand(width, generator=generator)
        function.hidden.weight.copy_(w1[:, None])
        function.hidden.bias.copy_(-w1 * inside + 0.1 * torch.randn(width, generator=generator))
        function.out.weight.copy_(torch.randn(heads, width, generator=generator))
        function.out.bias.copy_(torch.randn(heads, generator=generator))
    return function


def _reference(function: FIREFunction, positions: torch.Tensor, q_len: int, k_len: int, factor: float):
    """fp64 b[b, h, a, j] from the formula: query a at key index Tk - Tq + a, position p[b, a]."""
    c = abs(float(function.c.detach()))
    threshold = abs(float(function.L_multiplier.detach())) * function.init_L
    w1 = function.hidden.weight.detach().double()[:, 0]
    b1 = function.hidden.bias.detach().double()
    w2 = function.out.weight.detach().double()
    b2 = function.out.bias.detach().double()
    batch = positions.shape[0]
    out = torch.zeros(batch, w2.shape[0], q_len, k_len, dtype=torch.float64)
    for b in range(batch):
        for a in range(q_len):
            i = k_len - q_len + a
            normalizer = math.log(1 + c * max(threshold, float(positions[b, a]) / factor)) + 1e-6
            for j in range(i + 1):
                x = math.log(1 + c * (i - j) / factor) / normalizer
                out[b, :, a, j] = w2 @ torch.relu(w1 * x + b1) + b2
    return out


def _case(q_len, extra_keys, width, threshold, c, factor, padded_rows, seed):
    k_len = q_len + extra_keys
    function = _function(3, width, c, threshold, seed)
    keys = torch.arange(k_len - q_len, k_len)  # (Tq,) key index of each query
    # two batch rows, the second left-padded by 2: its positions restart at 0
    positions = torch.stack((keys, (keys - 2).clamp(min=0))) if padded_rows else keys[None]
    bias = function.bias(interpolate(positions, factor), q_len, k_len, factor)
    return function, positions, bias, _reference(function, positions, q_len, k_len, factor)


def _attendable(q_len: int, k_len: int, padded_rows: bool) -> torch.Tensor:
    """(B, Tq, Tk) bool: the causal keys, and in the padded row only real queries and keys (past
    the 2 pads; FIRE's x <= 1 holds there, its breakpoints are only resolved on [-1, 2])."""
    keys = torch.arange(k_len - q_len, k_len)[:, None]  # (Tq, 1) key index of each query
    causal = torch.arange(k_len)[None, :] <= keys  # (Tq, Tk)
    if not padded_rows:
        return causal[None]
    real = causal & (torch.arange(k_len)[None, :] >= 2) & (keys >= 2)
    return torch.stack((causal, real))


CASES = {
    "q_len": st.integers(1, 12),
    "extra_keys": st.integers(0, 9),
    "width": st.integers(1, 40),
    "threshold": st.floats(0.5, 16.0),
    "c": st.floats(0.01, 3.0),
    "factor": st.sampled_from([1.0, 2.0, 0.5, 3.7]),
    "padded_rows": st.booleans(),
    "seed": st.integers(0, 2**16),
}


@settings(max_examples=60, deadline=None)
@given(**CASES)
def test_the_per_score_function_is_the_formula(
    q_len, extra_keys, width, threshold, c, factor, padded_rows, seed
):
    """FlexAttention's view (a table over distances for queries at or below L, a binary search
    over the sorted breakpoints past it) at every attendable score."""
    function, positions, bias, expected = _case(
        q_len, extra_keys, width, threshold, c, factor, padded_rows, seed
    )
    k_len = q_len + extra_keys
    b, h, a, j = torch.meshgrid(
        torch.arange(positions.shape[0]),
        torch.arange(3),
        torch.arange(q_len),
        torch.arange(k_len),
        indexing="ij",
    )
    with torch.no_grad():
        scores = bias.elementwise()(b, h, a, j)  # (B, H, Tq, Tk)
    attendable = _attendable(q_len, k_len, padded_rows)[:, None].expand_as(scores)  # (B, H, Tq, Tk)
    torch.testing.assert_close(scores[attendable].double(), expected[attendable], atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(**CASES, start=st.integers(0, 11), k_start=st.integers(0, 5), holes=st.integers(0, 2**16))
def test_folded_blocks_and_table_rows_are_the_formula_with_the_mask_folded_in(
    q_len, extra_keys, width, threshold, c, factor, padded_rows, seed, start, k_start, holes
):
    """The chunked backend's block (queries start.., keys k_start..) with any mask folded in:
    the formula where allowed, the dtype's minimum elsewhere; and the table rows it serves as
    a Toeplitz view are the formula's rows."""
    function, positions, bias, expected = _case(
        q_len, extra_keys, width, threshold, c, factor, padded_rows, seed
    )
    k_len = q_len + extra_keys
    start = min(start, q_len - 1)
    k_end = k_len - q_len + q_len  # the keys of the last query
    k_start = min(k_start, k_end - 1)
    generator = torch.Generator().manual_seed(holes)
    holes = torch.rand(positions.shape[0], 1, q_len - start, k_end - k_start, generator=generator) > 0.3
    causal = torch.arange(k_start, k_end)[None, :] <= torch.arange(k_len - q_len + start, k_len)[:, None]
    real = _attendable(q_len, k_len, padded_rows)[:, None, start:, k_start:k_end]  # (B, 1, rows, keys)
    allowed = holes & real
    reference = expected[:, :, start:, k_start:k_end]
    # a reused buffer (the chunked backend's scratch) holding another block's values: overwritten
    size = positions.shape[0] * 3 * (q_len - start) * (k_end - k_start) + 7
    # without gradients a block comes from the linear pieces or (CPU, few switching units) from
    # the network's matrix products, in slabs of rows: both ways, whatever the count of units; a
    # block of few rows (a decoding step's) from the formula's view, the mask folded in after
    ways = itertools.product(
        (allowed, None),
        (None, torch.full((size,), math.nan)),
        (0, 100),
        (5, 32768),
        (0, piecewise_bias.FEW_ROWS),
    )
    for given_mask, scratch, columns, chunk, few_rows in ways:
        with (
            torch.no_grad(),
            mock.patch.object(network_block, "NETWORK_COLUMNS_PER_HEAD", columns),
            mock.patch.object(network_block, "NETWORK_CHUNK", chunk),
            mock.patch.object(piecewise_bias, "FEW_ROWS", few_rows),
        ):  # None: the causal keys
            block = bias.folded(start, q_len, k_start, k_end, given_mask, torch.float32, scratch)
        if scratch is not None and q_len - start > few_rows:  # (a few rows' small block: its own)
            assert block.data_ptr() == scratch.data_ptr()
        compared = (allowed if given_mask is not None else real).expand_as(block)
        masked = (~allowed if given_mask is not None else ~causal[None, None]).expand_as(block)
        torch.testing.assert_close(block[compared].double(), reference[compared], atol=1e-5, rtol=1e-5)
        assert bool((block[masked] == torch.finfo(torch.float32).min).all())
    # the causal block over keys 0 .. k_end-1 in reverse order (the chunked backend attends the
    # reversed keys): from the network's products, or in bands of distances where it has at
    # least twice as many keys as rows; flipped back it is the formula; from the products not
    # served when the linear pieces are cheaper
    whole = torch.arange(k_end)[None, :] <= torch.arange(k_len - q_len + start, k_len)[:, None]
    real_whole = _attendable(q_len, k_len, padded_rows)[:, None, start:, :k_end]  # (B, 1, rows, keys)
    # (x computed slab by slab into the features, slabs of one row, of five rows and of all; a reused
    # buffer holding another block's values is overwritten, the future added once per block)
    whole_size = positions.shape[0] * 3 * (q_len - start) * k_end + 7
    reversed_ways = itertools.product(
        (100, 0), (1, 5, 32768), (None, torch.full((whole_size,), math.nan)), (False, True)
    )
    for columns, chunk, scratch, bands in reversed_ways:
        with (
            torch.no_grad(),
            mock.patch.object(network_block, "NETWORK_COLUMNS_PER_HEAD", columns),
            mock.patch.object(network_block, "NETWORK_CHUNK", chunk),
            mock.patch.object(network_bands, "BANDS", bands),
        ):
            backwards = bias.folded_reversed(start, q_len, k_end, torch.float32, scratch)
        banded = bands and k_end >= 2 * (q_len - start)
        assert (columns == 100 or banded) == (backwards is not None)
        if backwards is not None and scratch is not None:
            assert backwards.data_ptr() == scratch.data_ptr()
        if backwards is None:
            continue
        block = backwards.flip(-1).expand(positions.shape[0], -1, -1, -1)  # (B, H, rows, keys)
        compared = real_whole.expand_as(block)
        reference = expected[:, :, start:, :k_end]
        torch.testing.assert_close(block[compared].double(), reference[compared], atol=1e-5, rtol=1e-5)
        assert bool((block[(~whole[None, None]).expand_as(block)] == torch.finfo(torch.float32).min).all())
    rows = bias.table_rows()
    # L as the module holds it (fp32): at L itself either side gives the same normaliser
    stored = torch.tensor(abs(float(function.L_multiplier.detach())) * function.init_L, dtype=torch.float32)
    threshold_positions = interpolate(positions, factor).float() <= stored
    assert rows == int(threshold_positions.all(0).int().cumprod(0).sum())
    with torch.no_grad():
        table = bias.table  # (H, Tk): the bias of distance d for the rows below
    for a in range(rows):
        i = k_len - q_len + a
        distances = i - torch.arange(i + 1)
        torch.testing.assert_close(
            table[:, distances].double(), expected[0, :, a, : i + 1], atol=1e-5, rtol=1e-5
        )


@settings(max_examples=30, deadline=None)
@given(
    q_len=st.integers(1, 12),
    extra_keys=st.integers(0, 6),
    width=st.integers(1, 20),
    padded_rows=st.booleans(),
    start=st.integers(0, 11),
    k_start=st.integers(0, 4),
    holes=st.one_of(st.none(), st.integers(0, 2**16)),
    seed=st.integers(0, 2**16),
)
def test_folded_block_gradients_equal_the_formula_views(
    q_len, extra_keys, width, padded_rows, start, k_start, holes, seed
):
    """Gradients of every FIRE parameter through a folded block (summed per run of keys of one
    piece) equal autograd through the formula's view restricted to the attendable entries: a
    masked entry (padding holes, or the future when no mask is given) passes no gradient even
    when the loss reads it."""
    function, positions, _, _ = _case(q_len, extra_keys, width, 2.5, 0.4, 1.0, padded_rows, seed)
    k_len = q_len + extra_keys
    start, k_start = min(start, q_len - 1), min(k_start, k_len - 1)
    rows, keys = q_len - start, k_len - k_start
    causal = torch.arange(k_start, k_len)[None, :] <= torch.arange(k_len - q_len + start, k_len)[:, None]
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(positions.shape[0], 3, rows, keys, generator=generator)
    allowed = None
    attendable = causal[None, None].expand(positions.shape[0], 1, rows, keys)
    if holes is not None:
        allowed = (
            torch.rand(positions.shape[0], 1, rows, keys, generator=torch.Generator().manual_seed(holes))
            > 0.3
        )
        attendable = allowed
    results = []
    # folded from the linear pieces (columns 0), from the network's products (CPU, columns 100, in
    # slabs of one row and of all, in both directions), as a few rows' block (the formula's view,
    # the mask folded in after), and the formula's view
    few = piecewise_bias.FEW_ROWS
    for columns, chunk, few_rows in ((0, 1, 0), (100, 1, 0), (100, 32768, 0), (0, 1, few), (None, None, 0)):
        function.zero_grad()
        bias = function.bias(positions, q_len, k_len)
        if columns is not None:  # the loss reads every entry, masked ones included
            with (
                mock.patch.object(network_block, "NETWORK_COLUMNS_PER_HEAD", columns),
                mock.patch.object(network_block, "NETWORK_CHUNK", chunk),
                mock.patch.object(piecewise_bias, "FEW_ROWS", few_rows),
            ):
                block = bias.folded(start, q_len, k_start, k_len, allowed, torch.float32)
            (block * weights).sum().backward()
        else:
            span = bias.span(start, q_len, k_start, k_len).expand_as(weights)
            (torch.where(attendable, span, 0.0) * weights).sum().backward()
        results.append({n: p.grad.clone() for n, p in function.named_parameters()})
    for result in results[:-1]:
        for name in results[-1]:
            torch.testing.assert_close(result[name], results[-1][name], atol=1e-4, rtol=1e-4, msg=name)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    keys=st.integers(1, 30),
    count=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_monotone_segments_count_the_breakpoints_at_or_below_x(rows, keys, count, seed):
    """For rows non-increasing along the keys (with ties and values on breakpoints), the piece is
    #{k : p_k <= x}, as a direct count, shifted by ``shift`` from each row's ``future`` key on."""
    generator = torch.Generator().manual_seed(seed)
    points = torch.randint(0, 8, (count,), generator=generator).float().sort().values / 4
    x = (
        (torch.randint(0, 10, (2, rows, keys), generator=generator).float() / 4)
        .sort(-1, descending=True)
        .values
    )
    expected = (points[None, None, None, :] <= x[..., None]).sum(-1)
    assert torch.equal(monotone_segments(x, points)[0], expected)
    future = torch.randint(-2, keys + 3, (rows,), generator=generator)
    shifted = expected + 41 * (torch.arange(keys)[None, :] >= future[:, None])
    assert torch.equal(monotone_segments(x, points, future, 41)[0], shifted)
