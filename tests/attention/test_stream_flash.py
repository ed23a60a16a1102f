"""The CPU stream attention (``attention/stream_flash.py``, issue 21.5/21.6): values and a
stream attended with one softmax in blocks of query rows (``attention/wide_values.py``), forward
and backward.

Checked against the definition written out in fp64 — per query head h and query i,
a_ij = softmax_j(q_i . k_j * scale), masked (causal bottom-right, or a boolean padding mask;
a row with no allowed key gives zeros), output (sum_j a_ij v_j, sum_j a_ij s_j) laid out per
token as every head's values then every head's stream — and its gradients by autograd through
that definition (fp32, 1e-5), for grouped keys, padded batches and cached (shorter) queries.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import make_model, patch, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_posenc.attention.stream_flash as stream_flash
from hf_posenc.attention.backend import AttentionCall, dispatch_with_stream
from hf_posenc.compat import cache_keyword
from hf_posenc.encodings.base import probe_call


def _reference(q, k, v, stream, allowed, scale):
    """The definition in fp64: (B, Tq, Hq*Dv + Hq*S)."""
    groups = q.shape[1] // k.shape[1]
    k, v, stream = (x.double().repeat_interleave(groups, dim=1) for x in (k, v, stream))
    scores = q.double() @ k.transpose(-1, -2) * scale  # (B, Hq, Tq, Tk)
    t_q, t_k = scores.shape[-2:]
    if allowed is None:
        allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q)[None, None]
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    weights = torch.nan_to_num(weights, nan=0.0)  # a row with no allowed key: zero output
    parts = (weights @ v, weights @ stream)  # (B, Hq, Tq, Dv), (B, Hq, Tq, S)
    return torch.cat([x.transpose(1, 2).flatten(2) for x in parts], dim=-1)


def _call(q, k, v, mask, scale):
    model = _call.model  # type: ignore[attr-defined]
    base = probe_call(model.posenc.geometry, q.shape[-2], k.shape[-2])
    return AttentionCall(
        score=dataclasses.replace(base, q=q, k=k),
        v=v,
        mask=mask,
        softmax_scale=scale,
        dropout_p=0.0,
        requested="auto",
        want_weights=False,
        encoding=model.posenc,
        stages=frozenset(type(model.posenc).stages()),
        bias=None,
        failures=set(),
    )


_call.model = patch(make_model("llama"), "tape")  # type: ignore[attr-defined]


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([4, 8]),
    stream_dim=st.sampled_from([2, 8]),
    k_len=st.integers(1, 12),
    cached=st.integers(0, 11),
    padding=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_output_and_gradients_equal_the_definition(
    batch, kv_heads, groups, head_dim, stream_dim, k_len, cached, padding, seed
):
    """For all shapes: grouped keys, queries of a cached decode (Tq < Tk), left padding (a
    boolean mask, rows with no allowed key included), values and stream of other widths than q:
    output and the gradients of q, k, v and the stream equal the fp64 definition (fp32, 1e-5)."""
    q_len = k_len - min(cached, k_len - 1)
    padding = min(padding, k_len - 1)
    generator = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_(True)

    heads = kv_heads * groups
    q = leaf(batch, heads, q_len, head_dim)
    k, v = leaf(batch, kv_heads, k_len, head_dim), leaf(batch, kv_heads, k_len, head_dim)
    stream = leaf(batch, kv_heads, k_len, stream_dim)
    mask = None
    if padding:  # the first sequence left-padded: its first `padding` keys never attended
        mask = torch.ones(k_len, k_len, dtype=torch.bool).tril()[-q_len:].repeat(batch, 1, 1, 1)
        mask[0, :, :, :padding] = False
    call = _call(q, k, v, mask, 0.37)
    assert stream_flash.serves(call)
    got = stream_flash.attend_with_stream(call, stream)
    want = _reference(q, k, v, stream, mask, 0.37)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    grad = torch.randn(got.shape, generator=generator)
    got_grads = torch.autograd.grad(got, (q, k, v, stream), grad)
    want_grads = torch.autograd.grad(want, (q, k, v, stream), grad.double())
    for name, g, w in zip(["q", "k", "v", "stream"], got_grads, want_grads, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-5, msg=name)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 3]),
    stream_dim=st.sampled_from([2, 8]),
    k_len=st.integers(1, 40),
    q_len=st.integers(1, 16),
    padding=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_without_gradients_a_few_queries_equal_the_definition(
    batch, kv_heads, groups, stream_dim, k_len, q_len, padding, seed
):
    """Calls of at most FEW_QUERIES queries without gradients (decoding steps, explicit scores with
    the query heads grouped per KV head): causal (no mask, Tq <= Tk) and left-padded (rows with no
    allowed key give 0) outputs equal the fp64 definition (fp32, 1e-5)."""
    q_len = min(q_len, k_len)
    padding = min(padding, k_len - 1)
    generator = torch.Generator().manual_seed(seed)
    heads = kv_heads * groups
    q = torch.randn(batch, heads, q_len, 8, generator=generator)
    k, v = (torch.randn(batch, kv_heads, k_len, 8, generator=generator) for _ in range(2))
    stream = torch.randn(batch, kv_heads, k_len, stream_dim, generator=generator)
    for mask in (None, torch.ones(k_len, k_len, dtype=torch.bool).tril()[-q_len:].repeat(batch, 1, 1, 1)):
        if mask is not None:
            mask[0, :, :, :padding] = False
        with torch.no_grad():
            got = stream_flash.attend_with_stream(_call(q, k, v, mask, 0.37), stream)
        torch.testing.assert_close(
            got.double(), _reference(q, k, v, stream, mask, 0.37), atol=1e-5, rtol=1e-5
        )


def test_dispatch_routes_cpu_calls_to_the_blocked_path(monkeypatch):
    """On CPU in fp32, with gradients and without, the stream call is the blocked path (its
    forward runs once per call), but for a call of at most ``FEW_QUERIES`` queries without
    gradients (a decoding step: explicit scores); in bf16 the previous path serves (one fused
    SDPA call)."""
    runs = []
    original = stream_flash._forward
    monkeypatch.setattr(stream_flash, "_forward", lambda *a, **kw: runs.append(1) or original(*a, **kw))
    q, k, v = (torch.randn(1, 4, 6, 16, requires_grad=True) for _ in range(3))
    stream = torch.randn(1, 4, 6, 16)
    out, _ = dispatch_with_stream(_call(q, k, v, None, 0.25), stream)
    assert runs == [1] and out.requires_grad
    with torch.no_grad():
        dispatch_with_stream(_call(q, k, v, None, 0.25), stream)  # 6 queries: explicit
    assert runs == [1]
    monkeypatch.setattr(stream_flash, "FEW_QUERIES", 5)
    with torch.no_grad():
        dispatch_with_stream(_call(q, k, v, None, 0.25), stream)
    assert runs == [1, 1]
    low = [x.detach().bfloat16() for x in (q, k, v)]
    dispatch_with_stream(_call(*low, None, 0.25), stream)
    assert runs == [1, 1]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_tape_training_with_left_padding_equals_the_eager_backend(kv_heads, threads, monkeypatch):
    """A patched TAPE model's loss and every parameter's gradient with a left-padded batch, on
    the default backend (the blocked path; with torch at 2 threads its backward's heads split
    over them) and on eager (explicit fp32 scores): equal at 1e-5 (the loss over the real
    tokens' predictions)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _tape_training_against_eager(kv_heads, monkeypatch)
    finally:
        torch.set_num_threads(before)


def _tape_training_against_eager(kv_heads, monkeypatch):
    model = make_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads).train()
    ids = token_ids(2, 16)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :5] = 0
    labels = ids.clone()
    # no loss on the padded positions' logits (a padded query attends no key: eager's rows are
    # uniform, SDPA's zero), so none on the first real token either (the loss shifts labels by one)
    labels[0, :6] = -100
    runs: list[int] = []
    original = stream_flash._forward
    monkeypatch.setattr(stream_flash, "_forward", lambda *a, **kw: runs.append(1) or original(*a, **kw))
    results = []
    for backend in ("auto", "eager"):
        # randomised encoding parameters (the same for both): gamma and the PE layer away from zero
        patched = patch(copy.deepcopy(model), "tape", backend=backend)
        loss = patched(ids, attention_mask=attention_mask, labels=labels, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in patched.named_parameters()}))
        # every layer but the last, which attends no stream (the model's own attention)
        assert len(runs) == (model.config.num_hidden_layers - 1 if backend == "auto" else 0)
        runs.clear()
    (loss, grads), (want_loss, want_grads) = results
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == want_grads.keys()
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n], g, atol=1e-5, rtol=1e-5, msg=n)


def test_cached_decode_after_a_trained_prefill_equals_the_full_forward():
    """Logits of a prefill with gradients (the blocked path) followed by cached decoding steps
    equal the full sequence's forward: the stream state the training-path forward leaves in the
    cache is the one decoding continues from."""
    from transformers import DynamicCache

    model = patch(make_model("llama"), "tape").train()  # randomised: gamma, the PE layer non-zero
    ids = token_ids(2, 12)
    cache = DynamicCache(config=model.config)
    keyword = cache_keyword(model)
    steps = [model(ids[:, :9], **{keyword: cache}, use_cache=True).logits]  # with gradients
    with torch.no_grad():
        for t in range(9, 12):
            steps.append(model(ids[:, t : t + 1], **{keyword: cache}, use_cache=True).logits)
        full = model(ids, use_cache=False).logits
    torch.testing.assert_close(torch.cat(steps, dim=1).detach(), full, atol=1e-5, rtol=1e-5)


def test_the_forward_holds_its_output_the_values_and_one_blocks_scores():
    """Without gradients the call's peak is its output (every head's values and stream), its
    log-sum-exp, the values [v | s] side by side, and one block's scores (8 heads x 64 rows x
    the keys): no (heads, Tq, Tk) tensor and no copy of q or k (the fused kernel's path before held
    q and k zero-padded to the values' width, a quarter of the heads at a time)."""
    from capture import peak_allocated_bytes

    batch, heads, length, dim = 1, 8, 512, 16
    q, k, v, stream = (torch.randn(batch, heads, length, dim) for _ in range(4))
    width = 2 * dim  # values and stream side by side
    output = batch * length * heads * width * 4 + batch * heads * length * 4  # flat output, lse
    values = batch * heads * length * width * 4
    scores = 8 * 64 * length * 4  # one block's, every head (sizes the module's defaults give)
    block = 3 * 8 * 64 * width * 4  # a block's attended values, their parts and row statistics

    def run():
        with torch.no_grad():
            stream_flash._forward(q, k, v, stream, allowed=None, scale=dim**-0.5)

    peak = peak_allocated_bytes(run)
    assert peak <= output + values + scores + block, (peak, output, values, scores, block)
    assert peak > output + values + scores // 2  # (the sizes are the ones the call holds)


def test_a_masks_key_spans_are_read_once_per_forward_and_once_per_backward(monkeypatch):
    """A left-padded batch's mask is every layer's: the blocks' key spans are read from it once
    for the forward's blocks and once for the backward's (kept in the forward's memo), not once
    per layer and direction."""
    from hf_posenc.attention import wide_values

    model = make_model("llama", hidden_size=64, num_attention_heads=4).train()
    patched = patch(model, "tape")
    ids = token_ids(2, 40)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :5] = 0
    reads: list[int] = []
    original = wide_values.key_spans
    monkeypatch.setattr(wide_values, "key_spans", lambda *a: reads.append(a[-1]) or original(*a))
    patched(ids, attention_mask=attention_mask, labels=ids, use_cache=False).loss.backward()
    assert model.config.num_hidden_layers > 1
    assert sorted(reads) == sorted([wide_values.FORWARD_ROWS, wide_values.BACKWARD_ROWS]), reads
