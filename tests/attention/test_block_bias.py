"""A score bias is written once, in the most structured form that describes it
(hf_posenc/encodings/block_bias.py), and each backend reads the view it needs: every view of one
bias (row blocks for chunked, per score for FlexAttention, the full matrix for sdpa/eager) is the
same bias; the structured forms are the biases they name; the block core ``attend_chunked`` equals
an fp64 softmax written here for any shape, block size, GQA ratio, bias form and left padding, and
stays within transformers' sdpa-vs-eager tolerance in bf16; FlexAttention says which forms it
serves; FIRE's piecewise-linear evaluation equals its MLP.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import make_model, patch
from encoding_cases import BLOCK_CASES, case_ids
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_posenc.attention.chunked as chunked
from hf_posenc.attention.chunked import attend_chunked
from hf_posenc.attention.flex import attend_flex
from hf_posenc.core.registry import get_encoding
from hf_posenc.encodings.base import probe_call
from hf_posenc.encodings.block_bias import (
    CumulativeBias,
    DistanceBias,
    LinearDistanceBias,
    RowBias,
    ScoreGrid,
    SeparableBias,
)

ATOL = 1e-5


@pytest.fixture(autouse=True)
def tiny_blocks(monkeypatch):
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 5)


def _score_indices(batch: int, heads: int, queries: int, keys: int) -> tuple[torch.Tensor, ...]:
    """(b, h, q_idx, kv_idx) index tensors of every score, each (batch, heads, queries, keys), as
    FlexAttention hands a score_mod."""
    ranges = (torch.arange(batch), torch.arange(heads), torch.arange(queries), torch.arange(keys))
    return torch.meshgrid(*ranges, indexing="ij")


@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_ids(BLOCK_CASES))
def test_every_view_of_a_score_bias_is_its_full_matrix_on_attendable_entries(case):
    """What the backends read of one score bias agree: any block of ``rows`` (chunked) and the
    per-score ``elementwise`` bias (FlexAttention) equal ``full()`` (sdpa/eager) wherever a query
    may attend, for a square call and for the last queries of a longer key range (decoding),
    also when evaluated on a length bucket's padded ranges, which it must read in range.
    (``full()`` itself is checked against each encoding's formula in its own tests.)"""
    name, params = case
    model = patch(make_model("llama"), name, params)
    geometry = model.posenc.geometry
    shapes = [(9, 9)] if get_encoding(name).stateful else [(9, 9), (3, 9), (1, 9)]  # stateful: no cache here
    for q_len, k_len in shapes:
        ctx = probe_call(geometry, q_len, k_len)
        hidden = torch.randn(ctx.hidden.shape, generator=torch.Generator().manual_seed(q_len))
        with torch.no_grad():
            bias = model.posenc.score_bias(dataclasses.replace(ctx, hidden=hidden))
            full = bias.full()  # (B|1, Hq, Tq, Tk)
        causal = torch.arange(k_len)[None, :] <= torch.arange(k_len - q_len, k_len)[:, None]  # (Tq, Tk)
        for start, stop in [(0, q_len), (0, 1), (q_len // 2, q_len)]:
            k_end = k_len - q_len + stop
            block = bias.rows(start, stop, k_end)
            expected = full[..., start:stop, :k_end]
            attendable = causal[start:stop, :k_end]
            torch.testing.assert_close(block[..., attendable], expected[..., attendable], atol=1e-6, rtol=0)
        elementwise = bias.elementwise()
        assert (
            elementwise is not None
        )  # every encoding's bias can be said per score (FlexAttention serves it)
        with torch.no_grad():
            scores = elementwise(*_score_indices(full.shape[0], full.shape[1], q_len, k_len))
        torch.testing.assert_close(scores[..., causal], full[..., causal], atol=1e-6, rtol=0)
        # on a length bucket's padded ranges (compiled FlexAttention): every padded score reads
        # in range (eager indexing raises otherwise) and the call's own scores are unchanged
        q_size, k_size = q_len + 5, k_len + 7
        grid = ScoreGrid(q_size, k_size, torch.tensor(k_len - q_len, dtype=torch.int32))
        with torch.no_grad():
            padded = bias.elementwise(grid)(*_score_indices(full.shape[0], full.shape[1], q_size, k_size))
        assert padded.shape[-2:] == (q_size, k_size) and padded.isfinite().all()
        own = padded[..., :q_len, :k_len]
        torch.testing.assert_close(own[..., causal], full[..., causal], atol=1e-6, rtol=0)


@settings(max_examples=80, deadline=None)
@given(
    q_len=st.integers(1, 9),
    extra_keys=st.integers(0, 6),
    start=st.integers(0, 8),
    rows=st.integers(1, 9),
    k_start=st.integers(0, 12),
    k_end=st.integers(1, 15),
    linear=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_distance_blocks_read_the_table_at_each_clamped_distance(
    q_len, extra_keys, start, rows, k_start, k_end, linear, seed
):
    """Any block of a distance table (a decoding step's one causal row, whose row is the table
    flipped, and every other block, gathered) is table[h, max(i - j, 0)] entry by entry, with
    query a at key index Tk - Tq + a; ALiBi's form gives the same values."""
    k_len = q_len + extra_keys
    start = min(start, q_len - 1)
    stop = min(q_len, start + rows)
    k_end = min(k_end, k_len)
    k_start = min(k_start, k_end - 1)
    generator = torch.Generator().manual_seed(seed)
    slopes = torch.rand(3, generator=generator)
    form = (
        LinearDistanceBias(q_len, k_len, slopes)
        if linear
        else DistanceBias(q_len, k_len, torch.randn(3, k_len))
    )
    table = form.table
    block = form.span(start, stop, k_start, k_end)  # (1, H, rows, keys)
    assert block.shape == (1, 3, stop - start, k_end - k_start)
    for a in range(start, stop):
        i = k_len - q_len + a
        for j in range(k_start, k_end):
            expected = table[:, max(i - j, 0)]
            assert torch.equal(block[0, :, a - start, j - k_start], expected), (a, j)
    torch.testing.assert_close(
        form.rows(start, stop, k_end), form.span(start, stop, 0, k_end), atol=0, rtol=0
    )


def test_the_structured_forms_are_the_biases_they_name():
    """A LinearDistanceBias is -slope_h * (i - j); a CumulativeBias is sum_{l=j+1}^{i} g_l (fp64 loop)."""
    slopes = torch.tensor([0.5, 0.125])
    linear = LinearDistanceBias(3, 7, slopes).full()[0]  # (H, 3, 7)
    for i in range(3):
        for j in range(4 + i + 1):
            torch.testing.assert_close(linear[:, i, j], -slopes * (4 + i - j), atol=0, rtol=0)
    # its blocks are computed, not gathered from its table: the same fp32 values bit for bit
    form = LinearDistanceBias(5, 9, torch.tensor([0.5, 0.0078125, 1 / 3]))
    as_table = DistanceBias(5, 9, form.table)  # the generic form reads the table
    for start, stop, k_start, k_end in [(0, 5, 0, 9), (1, 3, 2, 7), (4, 5, 8, 9), (0, 1, 0, 5)]:
        torch.testing.assert_close(
            form.span(start, stop, k_start, k_end), as_table.span(start, stop, k_start, k_end), atol=0, rtol=0
        )
        torch.testing.assert_close(
            form.rows(start, stop, k_end), as_table.rows(start, stop, k_end), atol=0, rtol=0
        )
    g = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    cumulative = CumulativeBias(g, g.double().cumsum(-1).float()).full()  # (B, H, T, T)
    for i in range(8):
        for j in range(i + 1):
            expected = g[..., j + 1 : i + 1].double().sum(-1)
            torch.testing.assert_close(cumulative[..., i, j].double(), expected, atol=1e-5, rtol=0)


def _reference(q, k, v, bias, allowed, softmax_scale):
    """fp64 softmax(q k^T * softmax_scale + bias, masked) v with explicit scores: (B, Tq, H, D)."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = q.double() @ k.transpose(-1, -2) * softmax_scale + bias.double()
    scores = scores.masked_fill(~allowed, -math.inf)
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


@settings(max_examples=60, deadline=None)
@given(
    q_len=st.integers(1, 40),
    extra_keys=st.integers(0, 9),
    block=st.integers(1, 8),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    form=st.sampled_from(["by_distance", "separable", "rows"]),
    padding=st.integers(0, 3),
    seed=st.integers(0, 2**16),
    grad_mode=st.booleans(),
)
def test_attend_chunked_equals_an_fp64_softmax(
    q_len, extra_keys, block, heads, form, padding, seed, grad_mode
):
    """For any shape, block size, GQA ratio, bias form and left padding of row 1, with gradient
    recording on or off (the separable form reuses one key buffer without gradients)."""
    generator = torch.Generator().manual_seed(seed)
    k_len = q_len + extra_keys
    hq, hkv = heads
    q = torch.randn(2, hq, q_len, 8, generator=generator)
    k = torch.randn(2, hkv, k_len, 8, generator=generator)
    v = torch.randn(2, hkv, k_len, 8, generator=generator)
    table = torch.randn(hq, k_len, generator=generator)
    terms = torch.randn(2, hq, k_len, generator=generator).cumsum(-1)
    rows_i = torch.arange(k_len - q_len, k_len)[:, None]
    columns = torch.arange(k_len)[None, :]
    distance = (rows_i - columns).clamp(min=0)  # (Tq, Tk)
    dense = {
        "by_distance": table[:, distance][None],
        "separable": terms[..., -q_len:, None] - terms[..., None, :],
        "rows": table[:, distance][None] * 0.5 + 1.0,
    }[form]
    bias = {
        "by_distance": lambda: DistanceBias(q_len, k_len, table),
        "separable": lambda: SeparableBias(q_len, k_len, terms[..., -q_len:], terms),
        "rows": lambda: RowBias(q_len, k_len, lambda s, e, end: dense[..., s:e, :end]),
    }[form]()
    allowed = (columns <= rows_i)[None, None].expand(2, 1, q_len, k_len).clone()
    allowed[1, :, :, : min(padding, k_len - 1)] = False
    allowed[1, :, :, k_len - q_len :] |= torch.eye(q_len, dtype=torch.bool)  # padded queries see themselves
    mask = allowed if padding else None
    expected = _reference(q, k, v, dense, allowed, 0.3)
    with torch.set_grad_enabled(grad_mode):
        out = attend_chunked(q, k, v, bias=bias, mask=mask, softmax_scale=0.3, block=block)
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0)


def test_chunked_bf16_stays_within_transformers_sdpa_vs_eager_tolerance():
    """bf16 on CPU: transformers accepts sdpa vs eager within atol = rtol = 1e-2."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 16, generator=generator) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    bias = DistanceBias(64, 64, -slopes[:, None] * torch.arange(64.0))
    causal = torch.ones(64, 64, dtype=torch.bool).tril()[None, None]
    expected = _reference(q, k, v, bias.full(), causal, 0.25).float()
    out = attend_chunked(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), bias=bias, mask=None, softmax_scale=0.25, block=16
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_flex_serves_by_distance_and_separable_but_not_rows():
    """attend_flex returns None (the caller falls back to chunked) for a row-function bias
    that cannot say its bias per score, and off CUDA whenever a gradient is wanted (no backward
    there); a forward whose inputs want no gradient is served even with grad mode on."""
    q = k = v = torch.randn(1, 2, 6, 8)
    rows = RowBias(6, 6, lambda s, e, end: torch.zeros(1, 2, e - s, end))
    assert attend_flex(q, k, v, bias=rows, mask=None, softmax_scale=1.0) is None
    table = DistanceBias(6, 6, torch.randn(2, 6))
    with torch.no_grad():
        assert attend_flex(q, k, v, bias=table, mask=None, softmax_scale=1.0).shape == (1, 6, 2, 8)
    assert attend_flex(q, k, v, bias=table, mask=None, softmax_scale=1.0) is not None
    q_learned = q.clone().requires_grad_()
    assert attend_flex(q_learned, k, v, bias=table, mask=None, softmax_scale=1.0) is None  # no CPU backward


def test_fire_linear_pieces_equal_the_mlp_and_follow_in_place_updates():
    """FIRE's piecewise-linear evaluation equals its MLP on every attendable (i, j), also after
    an in-place update of every parameter (an optimizer step) between two no-grad calls (the
    kept pieces, and the kept c and L)."""
    from hf_posenc.encodings.fire import FIREFunction

    torch.manual_seed(0)
    function = FIREFunction(heads=4, width=8, init_c=0.1, init_L=6.0)
    distance = torch.arange(20)[:, None] - torch.arange(20)[None]  # (T, T) i - j
    positions = torch.arange(20)[None]
    attendable = distance >= 0
    with torch.no_grad():
        for _ in range(2):
            for p in function.parameters():
                p.add_(torch.randn(p.shape) * 0.5)
            pieces = function.bias(positions, 20, 20).full()
            mlp = function(distance, positions)
            torch.testing.assert_close(pieces[..., attendable], mlp[..., attendable], atol=1e-6, rtol=1e-5)
