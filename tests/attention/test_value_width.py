"""No encoding widens the heads the attention kernel and the KV cache see (issue 21.5, 19.8):
q, k and v reach SDPA with the model's head width (so the fused kernel serves them, not the
math path that keeps the (T, T) weights), and a KV cache holds the model's own key and value
shapes. TAPE's positional stream, attended with the values' weights, is its decoding state.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model, patch, token_ids
from encoding_cases import ALL_CASES, CASES_BY_ENCODING, case_id
from transformers import DynamicCache

from hf_posenc.attention import stream_flash, wide_values
from hf_posenc.attention.backend import AttentionCall, dispatch_with_stream
from hf_posenc.compat import cache_keyword
from hf_posenc.core.registry import encoding_names, get_encoding
from hf_posenc.encodings.base import probe_call

DEFAULTS = [cases[0] for cases in CASES_BY_ENCODING.values()]


@pytest.mark.parametrize("case", DEFAULTS, ids=[case_id(c) for c in DEFAULTS])
def test_sdpa_and_the_cache_see_the_models_head_width(case, monkeypatch):
    """Every SDPA call of a patched forward gets q, k, v of one width, and the cache filled by it
    holds keys and values of the model's head width. An encoding that attends a stream (TAPE)
    takes the blocked path for values wider than q and k (``wide_values``: no SDPA math path, no
    (T, T) weights), with q and k of the model's head width."""
    model = patch(make_model("llama"), case[0], case[1])
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    widths = []

    def recording(original):
        def record(q, k, v, *args, **kwargs):
            widths.append((q.shape[-1], k.shape[-1], v.shape[-1]))
            return original(q, k, v, *args, **kwargs)

        return record

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording(F.scaled_dot_product_attention))
    blocked = []
    original_blocked = wide_values.forward
    monkeypatch.setattr(
        wide_values,
        "forward",
        lambda q, k, *args: blocked.append((q.shape[-1], k.shape[-1])) or original_blocked(q, k, *args),
    )
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        # more queries than stream_flash.FEW_QUERIES: a call the blocked path serves without gradients
        model(token_ids(1, stream_flash.FEW_QUERIES + 8), **{cache_keyword(model): cache}, use_cache=True)
    if get_encoding(case[0]).attends_stream:
        assert blocked, "no blocked call recorded for a stream-attending encoding"
    assert all(q_width == k_width == head_dim for q_width, k_width in blocked), blocked
    for q_width, k_width, v_width in widths:
        assert q_width == k_width == v_width, f"SDPA got widths q={q_width} k={k_width} v={v_width}"
    for layer in cache.layers:
        assert layer.keys.shape[-1] == head_dim and layer.values.shape[-1] == head_dim


def test_tapes_last_layer_is_the_models_own_attention(monkeypatch):
    """TAPE's last layer attends no stream (its (3) would reach no attention): that layer's call
    is plain SDPA at the model's head width, not the blocked stream path (which would cost its
    own kernel, and off the CPU a recomputed forward in backward), and the others are blocked."""
    model = patch(make_model("llama"), "tape")
    layers = model.config.num_hidden_layers
    sdpa_widths, blocked = [], []
    original_sdpa, original_blocked = F.scaled_dot_product_attention, wide_values.forward

    def sdpa(q, k, v, *args, **kwargs):
        sdpa_widths.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return original_sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(
        wide_values, "forward", lambda *args: blocked.append(args[2]) or original_blocked(*args)
    )
    model(token_ids(1, stream_flash.FEW_QUERIES + 8)).logits.sum().backward()
    head_dim = model.config.head_dim
    assert sdpa_widths == [(head_dim, head_dim, head_dim)]  # the last layer's, once
    assert len(blocked) == layers - 1


def test_tape_keeps_its_stream_as_decoding_state_of_the_cached_length():
    """TAPE's stream of the cached keys is its own state, one (B, Hkv, Tk, D) entry per layer."""
    model = patch(make_model("llama"), "tape")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(token_ids(2, 9), **{cache_keyword(model): cache}, use_cache=True)
        model(out.logits[:, -1:].argmax(-1), **{cache_keyword(model): cache}, use_cache=True)
    states = next(iter(cache._hf_posenc_decoding_states.layers.values()))
    kv_heads, head_dim = model.config.num_key_value_heads, model.config.head_dim
    assert sorted(states) == list(range(model.config.num_hidden_layers))
    for state in states.values():
        assert state["tape_stream"].shape == (2, kv_heads, 10, head_dim)


def _reference(q, k, v, stream, bias, scale):
    """softmax(q k^T * scale + bias, causal) (v, stream), fp64, from the definition: per query,
    every head's attended values, then every head's attended stream (B, Tq, Hq*D + Hq*S)."""
    groups = q.shape[1] // k.shape[1]
    k, v, stream = (x.repeat_interleave(groups, dim=1).double() for x in (k, v, stream))
    scores = q.double() @ k.transpose(-1, -2) * scale + bias.double()
    t_q, t_k = scores.shape[-2:]
    causal = torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q)
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    values, attended = (x.transpose(1, 2).flatten(2) for x in (weights @ v, weights @ stream))
    return torch.cat((values, attended), -1)  # (B, Tq, Hq*D + Hq*S)


@pytest.mark.parametrize("encoding", ["nope", "alibi"])
@pytest.mark.parametrize("backend", ["sdpa", "eager", "chunked"])
def test_stream_attended_with_the_values_weights(encoding, backend):
    """dispatch_with_stream gives (sum_j a_ij v_j, sum_j a_ij s_j) on every backend, without a
    bias (one call, q and k zero-padded) and with one (two calls), for cached decoding shapes too."""
    model = patch(make_model("llama"), encoding)
    geometry, enc = model.posenc.geometry, model.posenc
    generator = torch.Generator().manual_seed(0)
    for q_len, k_len in ((7, 7), (1, 7), (3, 7)):
        base = probe_call(geometry, q_len, k_len)
        q = torch.randn(base.q.shape, generator=generator)
        k = torch.randn(base.k.shape, generator=generator)
        v = torch.randn(base.k.shape, generator=generator)
        stream = torch.randn(*base.k.shape[:-1], 5, generator=generator)
        score = dataclasses.replace(base, q=q, k=k)
        stages = frozenset(type(enc).stages())
        bias = enc.score_bias(score) if "score_bias" in stages else None
        call = AttentionCall(
            score=score,
            v=v,
            mask=None,
            softmax_scale=0.3,
            dropout_p=0.0,
            requested=backend,
            want_weights=False,
            encoding=enc,
            stages=stages,
            bias=bias,
            failures=set(),
        )
        out, _ = dispatch_with_stream(call, stream)
        dense = torch.zeros(1) if bias is None else bias.full()
        want = _reference(q, k, v, stream, dense, 0.3)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_every_registered_encoding_is_checked():
    """The width test runs on every registered encoding (its defaults)."""
    assert {name for name, _ in DEFAULTS} >= set(encoding_names())
    assert {name for name, _ in ALL_CASES} == {name for name, _ in DEFAULTS}
    assert get_encoding("tape").attends_stream
