"""TAPE (contextualised equivariant positional encoding): a formula reference, the generic
invariants, the equivariance property, the RoPE start, parameter validation.

The reference is written from equations (1)-(4) of hf_posenc/encodings/tape.py with plain
loops in fp64 and reads only the encoding's raw parameters and the model's weights.
"""

from __future__ import annotations

import math

import pytest
import reference as ref
import torch
from capture import LENGTH, run_and_capture
from conftest import make_model, native_window, num_query_heads, patch, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_posenc


def silu(x: float) -> float:
    return x / (1.0 + math.exp(-x))


@torch.no_grad()
def reference_layers(model, attention, records, length):
    """Equations (1)-(4) with loops: the attention output of every layer, (T, hidden) fp64, batch row 0."""
    enc = model.posenc
    theta = enc.config.theta
    first = attention[0]
    d = first.head_dim
    heads = num_query_heads(model)
    kv_heads = getattr(model.config, "num_key_value_heads", None) or heads
    groups = heads // kv_heads
    half = d // 2
    window = native_window(model)
    freqs = [theta ** (-2 * f / d) for f in range(half)]
    # (1): stream[g][t] = [cos(t w_f)]_f + [sin(t w_f)]_f
    stream = [[[math.cos(t * w) for w in freqs] + [math.sin(t * w) for w in freqs] for t in range(length)]]
    stream = [stream[0] for _ in range(kv_heads)]
    outputs = []
    for layer, module in enumerate(attention):
        hidden = records[layer][0][0].double()  # (T, hidden)
        if layer > 0:  # (4) with the previous step's parameters
            # W = raw / sqrt(fan_in): fan-ins are the stream heads, the hidden size and P
            up = enc.up[layer - 1].double() / math.sqrt(kv_heads)
            wx = enc.x_proj[layer - 1].double() / math.sqrt(hidden.shape[-1])
            down = enc.down[layer - 1].double() / math.sqrt(enc.up.shape[1])
            stream = _pe_layer(stream, hidden, up, wx, down, kv_heads, length, d)
        q, k, v = ref.projections(module, hidden[None], hidden[None])
        q, k, v = q[0], k[0], v[0]  # (T, H, D)

        def rotation(e):  # (2) as a D x D matrix on the (f, f + D/2) pairs
            m = torch.zeros(d, d, dtype=torch.float64)
            for f in range(half):
                c, s = e[f], e[half + f]
                m[f, f], m[f, f + half], m[f + half, f], m[f + half, f + half] = c, -s, s, c
            return m

        out = torch.zeros(length, heads, d, dtype=torch.float64)
        attended = [[[0.0] * d for _ in range(length)] for _ in range(heads)]
        for h in range(heads):
            g = h // groups
            for i in range(length):
                keys = [j for j in range(i + 1) if window is None or i - j < window]
                qi = rotation(stream[g][i]) @ q[i, h]
                scores = [float(qi @ (rotation(stream[g][j]) @ k[j, g])) * module.scaling for j in keys]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for j, w in zip(keys, weights, strict=True):
                    out[i, h] += w / total * v[j, g]
                    for e in range(d):
                        attended[h][i][e] += w / total * stream[g][j][e]
        outputs.append(ref.output_projection(module, out.reshape(length, -1)))
        if layer < enc.gamma.shape[0]:  # (3)
            gamma = enc.gamma[layer].double()
            stream = [
                [
                    [
                        stream[g][t][e]
                        + float(gamma[g])
                        * sum(attended[h][t][e] for h in range(g * groups, (g + 1) * groups))
                        / groups
                        for e in range(d)
                    ]
                    for t in range(length)
                ]
                for g in range(kv_heads)
            ]
    return outputs


def _pe_layer(stream, hidden, up, wx, down, kv_heads, length, d):
    """(4): E_t + W_down (silu(W_x x_t) * (W_up E_t)), loops over heads, channels, features."""
    size = up.shape[0]
    new = []
    for g in range(kv_heads):
        rows = []
        for t in range(length):
            gate = [silu(float(wx[p] @ hidden[t])) for p in range(size)]
            row = []
            for e in range(d):
                total = stream[g][t][e]
                for p in range(size):
                    mixed = sum(float(up[p, h]) * stream[h][t][e] for h in range(kv_heads))
                    total += float(down[g, p]) * gate[p] * mixed
                row.append(total)
            rows.append(row)
        new.append(rows)
    return new


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_every_layer_equals_the_formula_reference(family):
    """Each patched attention layer's output equals equations (1)-(4) computed with loops in fp64,
    with random encoding parameters (so the stream really changes from layer to layer)."""
    model = patch(make_model(family), "tape", {"position_size": 3})
    records, attention = run_and_capture(model, token_ids(1, LENGTH))
    expected = reference_layers(model, attention, records, LENGTH)
    for layer, want in enumerate(expected):
        torch.testing.assert_close(
            records[layer][1][0].double(), want, atol=1e-5, rtol=1e-5, msg=f"layer {layer}"
        )


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_at_initialisation_the_model_equals_rope(family):
    """gamma = 0 and W_down = 0 at init: the stream stays RoPE's, so the logits are RoPE's."""
    ids = token_ids(2, LENGTH)
    rope = patch(make_model(family), "rope", randomize=False)
    tape = patch(make_model(family), "tape", randomize=False)
    with torch.no_grad():
        torch.testing.assert_close(tape(ids).logits, rope(ids).logits, atol=1e-5, rtol=0)


@settings(max_examples=8, deadline=None)
@given(shift=st.integers(1, 100_000), family=st.sampled_from(["llama", "gpt2"]))
def test_scores_depend_only_on_relative_position(shift, family):
    """Equivariance: shifting every position by a constant leaves every layer's attention scores
    (weights) and the logits unchanged, with trained (random) stream updates (fp64)."""
    model = patch(make_model(family), "tape", backend="eager").double()
    ids = token_ids(1, LENGTH)
    base = torch.arange(LENGTH)[None]
    with torch.no_grad():
        a = model(ids, position_ids=base, output_attentions=True)
        b = model(ids, position_ids=base + shift, output_attentions=True)
    assert a.attentions and all(w is not None for w in a.attentions)
    for wa, wb in zip(a.attentions, b.attentions, strict=True):
        torch.testing.assert_close(wa, wb, atol=1e-8, rtol=0)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-7, rtol=0)


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"theta": 1.0}, "theta=1.0"),
        ({"theta": "big"}, "theta='big'"),
        ({"position_size": 0}, "position_size=0"),
        ({"position_size": 2.5}, "position_size=2.5"),
        ({"stream_heads": 2}, "stream_heads"),
    ],
)
def test_bad_parameters_are_rejected(params, fragment):
    """Invalid values raise InvalidParameterError naming the value and the allowed range."""
    with pytest.raises(hf_posenc.InvalidParameterError, match="allowed") as info:
        hf_posenc.patch_model(make_model("llama"), "tape", **params)
    assert fragment in str(info.value)
