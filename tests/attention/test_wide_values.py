"""Attention with values wider than q and k in explicit blocks of query rows
(``attention/wide_values.py``, issue 21.5/21.6), checked against the definition written out in
fp64 — per query head h and query i, a_ij = softmax_j(q_i . k_{g(h), j} * scale) over the keys
the mask allows (a row with none gives zeros), output sum_j a_ij values_j — and its gradients by
autograd through that definition, for any boolean mask (padding, windows, rows that see nothing,
whole blocks that see nothing), causal masks given as None (bottom-right aligned, Tq <= Tk),
grouped keys and blocks of a few rows (many blocks, the diagonal inside a block).
"""

from __future__ import annotations

import math
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_posenc.attention import wide_values


def _definition(q, k, values, allowed, scale):
    """(B, Hq, Tq, W) in fp64 from the formula; ``allowed`` None: causal, bottom-right."""
    groups = q.shape[1] // k.shape[1]
    k, values = (x.double().repeat_interleave(groups, dim=1) for x in (k, values))
    scores = q.double() @ k.transpose(-1, -2) * scale  # (B, Hq, Tq, Tk)
    t_q, t_k = scores.shape[-2:]
    if allowed is None:
        allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q)[None, None]
    sees = allowed.any(-1, keepdim=True)  # a row with no allowed key: zero weights (and gradients)
    scores = torch.where(sees, scores, 0.0).masked_fill(sees & ~allowed, -math.inf)
    return (scores.softmax(-1) * sees) @ values


def _run(q, k, values, allowed, scale, widths):
    """forward into (B, Hq, Tq, X_i) parts of a (B, Tq, Hq, W) buffer (strided views, as the
    stream path gives) -> (output (B, Hq, Tq, W), lse)."""
    batch, heads, q_len, _ = q.shape
    buffer = q.new_empty(batch, q_len, heads, sum(widths))
    outputs = list(buffer.split(widths, dim=-1))
    outputs = [x.transpose(1, 2) for x in outputs]
    with torch.no_grad():  # (as the stream path calls it: a kernel with its own backward)
        lse = wide_values.forward(q, k, values.split(widths, dim=-1), allowed, scale, outputs)
    return torch.cat(outputs, dim=-1), lse


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.sampled_from([1, 2, 3]),
    groups=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8]),
    widths=st.sampled_from([(4,), (4, 2), (8, 8), (3, 5, 1)]),
    k_len=st.integers(1, 40),
    cached=st.integers(0, 12),
    rows=st.sampled_from([1, 3, 4, 64]),
    mask_kind=st.sampled_from(["causal", "random", "window", "padded", "keys"]),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_output_and_gradients_equal_the_definition(
    batch, kv_heads, groups, head_dim, widths, k_len, cached, rows, mask_kind, threads, seed
):
    """For all shapes and masks, blocks of any number of rows, any number of threads (the
    backward's heads split over them): the output, its log-sum-exp's use in backward and the
    gradients of q, k and the values equal the fp64 definition (fp32, 1e-5)."""
    generator = torch.Generator().manual_seed(seed)
    q_len = k_len - min(cached, k_len - 1)
    heads = kv_heads * groups

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_(True)

    q = leaf(batch, heads, q_len, head_dim)
    k = leaf(batch, kv_heads, k_len, head_dim)
    values = leaf(batch, kv_heads, k_len, sum(widths))
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    allowed = None
    if mask_kind == "random":  # rows with no allowed key included
        allowed = torch.rand(batch, 1, q_len, k_len, generator=generator) < 0.4
    elif mask_kind == "window":  # a sliding window of 5 keys: blocks whose first key is past 0
        allowed = (causal & ~causal.tril(k_len - q_len - 5))[None, None]
    elif mask_kind == "keys":  # a mask over keys only (B, 1, 1, Tk), every row reads it
        allowed = torch.rand(batch, 1, 1, k_len, generator=generator) < 0.7
    elif mask_kind == "padded":  # the first sequence left-padded: whole blocks of rows see nothing
        allowed = causal.repeat(batch, 1, 1, 1)
        allowed[0, :, :, : k_len // 2] = False
        allowed[0, :, : q_len // 2] = False
    scale = 0.37
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(q, k, values, allowed, scale, widths, rows, generator)
    finally:
        torch.set_num_threads(caller_threads)


def _check(q, k, values, allowed, scale, widths, rows, generator):
    """forward and backward in blocks of ``rows`` rows against the definition."""
    with (
        mock.patch.object(wide_values, "FORWARD_ROWS", rows),
        mock.patch.object(wide_values, "BACKWARD_ROWS", rows),
    ):
        got, lse = _run(q, k, values, allowed, scale, widths)
        want = _definition(q, k, values, allowed, scale)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        grad = torch.randn(got.shape, generator=generator)
        want_grads = torch.autograd.grad(want, (q, k, values), grad.double())
        with torch.no_grad():
            outputs = list(got.split(widths, dim=-1))
            grads = list(grad.split(widths, dim=-1))
            grad_q, grad_k, grad_parts = wide_values.backward(
                q, k, values.split(widths, dim=-1), allowed, scale, outputs, grads, lse
            )
            got_grads = (grad_q, grad_k, torch.cat(grad_parts, dim=-1))
    for name, g, w in zip(["q", "k", "values"], got_grads, want_grads, strict=True):
        torch.testing.assert_close(
            g.double(), w.double(), atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


@settings(max_examples=30, deadline=None)
@given(
    q_len=st.integers(1, 50),
    cached=st.integers(0, 30),
    rows=st.integers(1, 20),
    window=st.integers(1, 60),
    padded_batch=st.booleans(),
)
def test_every_allowed_key_is_inside_its_blocks_span(q_len, cached, rows, window, padded_batch):
    """The keys a block computes (its span) contain every key any of its rows may see, in any
    batch row, and a block whose rows see nothing has an empty span: read from the mask."""
    k_len = q_len + cached
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(cached)
    allowed = causal & ~causal.tril(cached - window)
    masks = [None, allowed[None, None]]
    if padded_batch:
        padded = allowed.repeat(2, 1, 1, 1)
        padded[1, :, :, : k_len // 2] = False
        masks.append(padded)
    for mask in masks:
        full = causal if mask is None else mask.any(0)[0]
        spans = wide_values.key_spans(mask, q_len, k_len, rows)
        assert [s[:2] for s in spans] == [(r, min(r + rows, q_len)) for r in range(0, q_len, rows)]
        for start, end, first, last in spans:
            keys = full[start:end].any(0).nonzero().flatten().tolist()
            if keys:
                assert first <= keys[0] and keys[-1] < last
            else:
                assert last <= first


def test_scores_hundreds_of_units_apart_stay_exact():
    """Scores spread over hundreds of units, so that many weights lie far below fp32's smallest
    normal (which the path flushes to 0, never computing subnormals): output and gradients
    finite and equal the fp64 definition (1e-4: fp32 scores of magnitude ~100 carry ~1e-5 of
    rounding into the weights)."""
    generator = torch.Generator().manual_seed(3)
    q = (torch.randn(1, 2, 70, 8, generator=generator) * 6).requires_grad_(True)
    k = (torch.randn(1, 2, 70, 8, generator=generator) * 6).requires_grad_(True)
    values = torch.randn(1, 2, 70, 12, generator=generator).requires_grad_(True)
    scores = (q.double() @ k.double().transpose(-1, -2) * 0.35).tril()
    assert (scores.amax(-1, keepdim=True) - scores).tril().amax() > 200  # weights below e^-200 exist
    got, lse = _run(q, k, values, None, 0.35, (8, 4))
    want = _definition(q, k, values, None, 0.35)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    grad = torch.randn(got.shape, generator=generator)
    want_grads = torch.autograd.grad(want, (q, k, values), grad.double())
    with torch.no_grad():
        grad_q, grad_k, grad_parts = wide_values.backward(
            q,
            k,
            values.split((8, 4), -1),
            None,
            0.35,
            list(got.split((8, 4), -1)),
            list(grad.split((8, 4), -1)),
            lse,
        )
        got_grads = (grad_q, grad_k, torch.cat(grad_parts, dim=-1))
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w.double(), atol=1e-4, rtol=1e-4)
