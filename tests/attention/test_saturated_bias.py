"""The ``saturated`` backend (issue 21.6): a distance bias constant from a distance W on (T5's last
bucket) attended as one fused causal call over the pairs ``i - j >= W`` plus an explicit band
over ``i - j < W``, merged by log-sum-exp, with an FA-2 style backward from the merged
statistics. Checked against softmax(q k^T s + b(i - j)) v written out in fp64 (the bias read from
``near``/``tail`` by the formula, not by the code under test) and, through whole patched models,
against the eager backend; what autograd keeps stays what a fused attention keeps.
"""

from __future__ import annotations

import pytest
import torch
from capture import saved_storages
from conftest import make_model, patch, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from references.t5 import t5_bucket

from hf_posenc.attention import saturated
from hf_posenc.compat import cache_keyword, output_cache
from hf_posenc.encodings.block_bias import SaturatingDistanceBias
from hf_posenc.encodings.t5 import T5Config, saturation_distance


def reference(q, k, v, near, tail, scale):
    """fp64 softmax(q k^T * scale + b) v, b = near[h, i - j] below W, tail[h] from W, causal;
    k/v heads repeated for grouped queries. -> (B, T, Hq, D)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    length, window = q.shape[-2], near.shape[1]
    distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]  # (T, T) i - j
    bias = torch.where(distance < window, near[:, distance.clamp(0, window - 1)], tail[:, None, None])
    scores = (q @ k.transpose(-1, -2) * scale + bias).masked_fill(distance < 0, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


def _check(batch, kv_heads, groups, length, window, block, dtype, seed, atol, spread=1.0):
    generator = torch.Generator().manual_seed(seed)
    heads = kv_heads * groups
    q = torch.randn(batch, heads, length, 4, generator=generator, dtype=dtype) * spread
    k, v = (torch.randn(batch, kv_heads, length, 4, generator=generator, dtype=dtype) for _ in range(2))
    near, tail = torch.randn(heads, window, generator=generator), torch.randn(heads, generator=generator)
    grad = torch.randn(batch, length, heads, 4, generator=generator, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, near, tail)]
    bias = SaturatingDistanceBias(length, length, leaves[3], leaves[4])
    out = saturated.attend_saturated(*leaves[:3], bias=bias, softmax_scale=0.6, block=block)
    got = torch.autograd.grad((out * grad).sum(), leaves)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v, near, tail)]
    want = reference(*leaves64, 0.6)
    wanted = torch.autograd.grad((want * grad.double()).sum(), leaves64)
    torch.testing.assert_close(out.double(), want.detach(), atol=atol, rtol=atol)
    names = ("q", "k", "v", "near", "tail")
    for name, g, w in zip(names, got, wanted, strict=True):
        # near/tail are fp32 leaves: their gradient is rounded to fp32 whatever the attention's dtype
        tol = max(atol, 1e-6) if name in ("near", "tail") else atol
        torch.testing.assert_close(g.double(), w, atol=tol, rtol=tol, msg=name)


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    groups=st.integers(1, 3),
    length=st.integers(1, 40),
    window=st.integers(1, 45),
    block=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_outputs_and_gradients_equal_the_formula_in_fp64(
    batch, kv_heads, groups, length, window, block, seed
):
    """For every W (below, equal to and past T), block, grouped-query shape and batch: output and
    gradients of q, k, v, the near table and the far constant equal autograd of the written-out
    formula (fp64, 1e-10; the tables' gradients in their own fp32)."""
    _check(batch, kv_heads, groups, length, window, block, torch.float64, seed, 1e-10)


@pytest.mark.parametrize(("length", "window"), [(30, 50), (30, 30), (30, 29), (200, 9)], ids=str)
def test_outputs_and_gradients_equal_the_formula_in_fp32(length, window):
    """fp32 within 1e-5 of the fp64 formula: T < W (the band alone), T = W, T = W + 1, T >> W,
    with grouped-query heads and a batch of two."""
    _check(2, 2, 2, length, window, 16, torch.float32, 0, 1e-5)


def test_weights_that_underflow_do_not_change_the_result():
    """Scores spread over hundreds (queries 40x larger, fp32): most band weights underflow, and the
    backward flushes those below fp32's smallest normals to 0 (``core.underflow.exp_flushed``,
    keeping exp off its slow path). Output and gradients are no further from the fp64 formula than torch's own fp32
    SDPA with the whole bias written out as its float mask (the inputs are ill-conditioned: its
    error in dk is ~5e-4 here), within a factor 2."""
    generator = torch.Generator().manual_seed(3)
    length, window = 60, 9
    q = torch.randn(1, 4, length, 4, generator=generator) * 40
    k, v = (torch.randn(1, 2, length, 4, generator=generator) for _ in range(2))
    near, tail = torch.randn(4, window, generator=generator), torch.randn(4, generator=generator)
    grad = torch.randn(1, length, 4, 4, generator=generator)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    bias = SaturatingDistanceBias(length, length, near, tail)
    ours = saturated.attend_saturated(*leaves, bias=bias, softmax_scale=0.6, block=16)
    ours_grads = torch.autograd.grad((ours * grad).sum(), leaves)
    sdpa_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    mask = torch.where(distance < window, near[:, distance.clamp(0, window - 1)], tail[:, None, None])
    mask = mask.masked_fill(distance < 0, float("-inf"))[None]  # (1, H, T, T)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        sdpa_leaves[0], *(t.repeat_interleave(2, 1) for t in sdpa_leaves[1:]), attn_mask=mask, scale=0.6
    ).transpose(1, 2)
    sdpa_grads = torch.autograd.grad((sdpa * grad).sum(), sdpa_leaves)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    want = reference(*leaves64, near.double(), tail.double(), 0.6)
    want_grads = torch.autograd.grad((want * grad.double()).sum(), leaves64)
    for name, got, other, exact in zip(
        ("out", "q", "k", "v"), (ours, *ours_grads), (sdpa, *sdpa_grads), (want, *want_grads), strict=True
    ):
        error = (got.double() - exact).abs().max().item()
        baseline = (other.double() - exact).abs().max().item()
        assert error <= 2 * baseline + 1e-6, (name, error, baseline)


def test_rows_of_the_score_gradient_sum_to_zero():
    """The identity the far constant's gradient rests on: with P the softmax of a row and
    delta_i = dO_i . out_i, dS_ij = P_ij (dO_i . v_j - delta_i) sums to zero over j; so the sum of
    dS over a row's far keys is minus the sum over its near keys (here the split at W = 5)."""
    generator = torch.Generator().manual_seed(1)
    length, window = 24, 5
    q, k, v, grad = (torch.randn(3, length, 8, generator=generator, dtype=torch.float64) for _ in range(4))
    distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    scores = (q @ k.transpose(-1, -2)).masked_fill(distance < 0, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = probs @ v
    d_scores = probs * (grad @ v.transpose(-1, -2) - (grad * out).sum(-1, keepdim=True))
    torch.testing.assert_close(d_scores.sum(-1), torch.zeros(3, length, dtype=torch.float64))
    far = (d_scores * (distance >= window)).sum(-1)
    near = (d_scores * (distance < window)).sum(-1)
    torch.testing.assert_close(far, -near)


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"num_buckets": 8, "max_distance": 12},
        {"num_buckets": 5, "max_distance": 6},
        {"num_buckets": 2, "max_distance": 3},
        {"num_buckets": 8, "max_distance": 12, "scaling": {"type": "linear", "factor": 2.5}},
    ],
    ids=str,
)
def test_saturation_distance_is_where_the_last_bucket_begins(params):
    """W is the first distance from which every distance (checked up to 4 f D) falls in the last
    bucket, by the paper's bucket formula (tests.references.t5) of floor(d / f)."""
    config = T5Config(**params)
    buckets, distance = config.num_buckets, config.max_distance
    factor = (params.get("scaling") or {}).get("factor", 1.0)
    last = [
        t5_bucket(int(d // factor), buckets, distance) == buckets - 1
        for d in range(int(4 * factor * distance) + 8)
    ]
    expected = max(d for d, saturated_ in enumerate(last) if not saturated_) + 1
    assert all(last[expected:])
    assert saturation_distance(config) == expected


def _model_gradients(backend, params, ids, dtype=torch.float32, **overrides):
    model = patch(make_model("llama", **overrides), "t5", params, backend=backend).to(dtype)
    model.train()
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize(
    ("params", "batch", "length", "dtype", "longer_than", "served"),
    [
        (
            {"num_buckets": 8, "max_distance": 12},
            2,
            40,
            torch.float32,
            0,
            True,
        ),  # T >> W = 8 (GQA: 4 q / 2 kv heads)
        (
            {"num_buckets": 8, "max_distance": 12, "shared_across_layers": False},
            1,
            30,
            torch.float32,
            0,
            True,
        ),
        (
            {"num_buckets": 8, "max_distance": 12, "scaling": {"type": "linear", "factor": 2.0}},
            1,
            40,
            torch.float32,
            0,
            True,
        ),
        ({"num_buckets": 8, "max_distance": 12}, 1, 40, torch.float64, 0, True),
        ({}, 1, 40, torch.float32, 0, False),  # T < W = 113: the chunked backend
        # the length floor: up to LONGER_THAN queries the chunked backend's Toeplitz path (the
        # saturated table with its gradient), past it this backend
        ({"num_buckets": 8, "max_distance": 12}, 2, 40, torch.float32, 40, False),
        ({"num_buckets": 8, "max_distance": 12}, 2, 41, torch.float32, 40, True),
    ],
    ids=["gqa-batch2", "per-layer-tables", "scaled", "fp64", "below-W", "at-the-floor", "past-the-floor"],
)
def test_patched_model_training_equals_eager(params, batch, length, dtype, longer_than, served, monkeypatch):
    """A patched Llama (grouped-query heads) trained on the default backend: logits and every
    parameter's gradient (the T5 tables' included) equal the eager backend's (fp32 1e-5, fp64
    1e-10, against the sdpa backend); the saturated backend serves exactly the calls whose length
    passes W and ``saturated.LONGER_THAN``."""
    monkeypatch.setattr(saturated, "LONGER_THAN", longer_than)
    calls = []
    original = saturated.attend_saturated

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(saturated, "attend_saturated", counting)
    ids = token_ids(batch, length)
    logits, grads = _model_gradients("auto", params, ids, dtype)
    # fp64: against the sdpa backend (the whole bias written out as SDPA's float mask), as the eager
    # backend's softmax runs in fp32 (1e-6 from every fp64 backend)
    ref_logits, ref_grads = _model_gradients(
        "eager" if dtype == torch.float32 else "sdpa", params, ids, dtype
    )
    assert bool(calls) == served
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(logits, ref_logits, atol=tol, rtol=tol)
    assert grads.keys() == ref_grads.keys()
    assert any("posenc" in n for n in grads)
    for n, g in ref_grads.items():
        # the form holds the bias in fp32: the tables' gradients pass through fp32 in every backend
        table_tol = max(tol, 1e-6) if "posenc" in n else tol
        torch.testing.assert_close(grads[n], g, atol=table_tol, rtol=table_tol, msg=n)


def test_fp64_below_the_saturation_distance_equals_sdpa():
    """Below W the form is a plain DistanceBias on the chunked backend's Toeplitz path, which
    builds its causal line in the queries' dtype (fp64 here: the fp64 minimum does not fit the
    fp32 table): logits equal the sdpa backend's (fp64, 1e-10)."""
    ids = token_ids(1, 40)
    logits = {}
    for backend in ("auto", "sdpa"):
        model = patch(make_model("llama"), "t5", {}, backend=backend).double()
        with torch.no_grad():
            logits[backend] = model(ids).logits
    torch.testing.assert_close(logits["auto"], logits["sdpa"], atol=1e-10, rtol=1e-10)


def test_padding_and_decoding_keep_the_other_backends():
    """A padding mask or a cache step (few queries over more keys) is not served by the saturated
    backend, and the model still equals eager there (logits of a padded batch, a cached step)."""
    params = {"num_buckets": 8, "max_distance": 12}
    ids = token_ids(2, 30)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :5] = 0
    outputs = {}
    for backend in ("auto", "eager"):
        model = patch(make_model("llama"), "t5", params, backend=backend)
        with torch.no_grad():
            full = model(ids, attention_mask=attention_mask).logits
            cached = model(ids[:, :25], use_cache=True)
            step = model(ids[:, 25:], **{cache_keyword(model): output_cache(cached)}).logits
        outputs[backend] = (full[attention_mask.bool()], step)
    for got, want in zip(outputs["auto"], outputs["eager"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _saved(function, length: int) -> int:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, length, 8, generator=generator).requires_grad_() for _ in range(3))
    near, tail = torch.randn(4, 6).requires_grad_(), torch.randn(4).requires_grad_()
    with saved_storages() as storages:
        out = function(q, k, v, near, tail)
    out.sum().backward()  # the kept tensors serve a real backward
    return sum(storages.values())


def test_training_keeps_what_a_fused_attention_keeps():
    """What autograd keeps over one call with gradients is native causal SDPA's (q, k, v, output,
    log-sum-exp: O(T)) plus the bias's O(Hq * W) values, at T = 64 and 256: linear in T, no
    (rows x keys) block."""

    def ours(q, k, v, near, tail):
        bias = SaturatingDistanceBias(q.shape[-2], q.shape[-2], near, tail)
        return saturated.attend_saturated(q, k, v, bias=bias, softmax_scale=0.3, block=16)

    def native(q, k, v, near, tail):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    for length in (64, 256):
        assert _saved(ours, length) <= _saved(native, length) + 4 * (4 * 6 + 4), length


def test_the_backend_serves_past_its_length_floor_only():
    """At the default floor (``saturated.LONGER_THAN`` = 4096 queries) a call of 4096 queries goes
    to the chunked backend's Toeplitz path (measured faster there) and one of 4097 to this
    backend."""

    def call_of(length: int) -> bool:
        q, k, v = (torch.zeros(1, 1, length, 4) for _ in range(3))
        bias = SaturatingDistanceBias(length, length, torch.zeros(1, 8), torch.zeros(1))
        return saturated.serves_call(bias, q, k, v, None, 0.0)

    assert saturated.LONGER_THAN == 4096
    assert not call_of(4096)
    assert call_of(4097)
