"""FoX and FoX (Pro): their own properties (open gates, decoding, initial gates, parts switched
off). Their formula reference (tests/references/fox.py) is checked against every patched layer by
tests/encodings/test_formula_references.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import make_model, patch, randomize_encoding, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_posenc
from hf_posenc.encodings.base import probe_call

PRO_OFF = {"qk_norm": False, "k_shift": False, "v_shift": False, "output_norm": False, "output_gate": False}
LENGTH = 12  # longer than Mistral's sliding window of 8
SETTINGS = settings(max_examples=25, deadline=None)


# -- properties -----------------------------------------------------------------------------


@SETTINGS
@given(
    family=st.sampled_from(["llama", "mistral", "gpt2"]),
    length=st.integers(1, 16),
    seed=st.integers(0, 2**16),
    pad=st.integers(0, 3),
)
def test_fox_with_open_gates_equals_nope(family, length, seed, pad):
    """FoX with every forget gate = 1 (w_f = 0, b_f large: log f = 0 exactly) is plain causal
    softmax attention: its logits equal those of the same model patched with NoPE."""
    model = make_model(family, seed=seed % 7)
    ids = token_ids(2, length + pad, seed=seed)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    with torch.no_grad():
        hf_posenc.patch_model(model, "fox")
        for gate in model.posenc.forget:
            gate.weight.zero_()
            gate.bias.fill_(1e4)
        fox = model(ids, attention_mask=mask).logits
        hf_posenc.unpatch_model(model)
        hf_posenc.patch_model(model, "nope")
        nope = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(fox[0], nope[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(fox[1, pad:], nope[1, pad:], atol=1e-5, rtol=0)


_FOX = {}


def fox_encoding():
    """One patched llama's FoX encoding (2 layers, 4 query heads, 2 KV heads), built once."""
    if "fox" not in _FOX:
        _FOX["fox"] = patch(make_model("llama"), "fox", randomize=False).posenc
    return _FOX["fox"]


@SETTINGS
@given(
    length=st.integers(1, 40),
    past=st.integers(0, 8),
    scale=st.floats(0.0, 30.0),
    bias=st.floats(-20.0, 20.0),
    seed=st.integers(0, 2**16),
)
def test_forgetting_bias_zero_on_diagonal_nonpositive_nonincreasing(length, past, scale, bias, seed):
    """For any gates, D_ii = 0 exactly, D_ij <= 0 for j <= i, and for a fixed query i the bias
    is non-increasing as the key moves further back (D_i,j-1 <= D_ij); D_ij equals
    sum_{l=j+1}^{i} log f_l (fp64 loop). Queries follow ``past`` keys whose gates went through
    the decoding state in an earlier call (bottom-right aligned)."""
    encoding = fox_encoding()
    generator = torch.Generator().manual_seed(seed)
    gate = encoding.forget[0]
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=generator) * scale / 8)
        gate.bias.fill_(bias)
    k_len = past + length
    hidden = torch.randn(1, k_len, encoding.geometry.hidden_size, generator=generator)
    state: dict = {}
    with torch.no_grad():
        if past:
            earlier = probe_call(encoding.geometry, past)
            encoding.score_bias(dataclasses.replace(earlier, hidden=hidden[:, :past], state=state))
        ctx = probe_call(encoding.geometry, length, k_len)
        ctx = dataclasses.replace(ctx, hidden=hidden[:, past:], state=state)
        d = encoding.score_bias(ctx).full()[0]  # (Hq, Tq, Tk)
        log_f = torch.nn.functional.logsigmoid(hidden[0].double() @ gate.weight.double().T + bias)  # (Tk, Hq)
    assert d.shape[1:] == (length, k_len)
    # c is rounded to fp32 before the difference: an error of up to ~eps32 * |c| on each side
    atol = 1e-5 + 2.5e-7 * float(log_f.abs().sum(0).max())
    for a in range(length):
        i = past + a
        assert torch.all(d[:, a, i] == 0)
        assert torch.all(d[:, a, : i + 1] <= 0)
        assert torch.all(d[:, a, :i] <= d[:, a, 1 : i + 1])
        for j in range(i + 1):
            expected = log_f[j + 1 : i + 1].sum(0)
            torch.testing.assert_close(d[:, a, j].double(), expected, atol=atol, rtol=1e-6)


def test_fox_initial_gates_are_near_one_and_alibi_like():
    """At patch time w_f = 0 and sigmoid(b_f) = exp(-1/T_h) with T_h log-spaced in
    [decay_time_min, decay_time_max]: the bias is -(i - j)/T_h, gates start near 1."""
    model = hf_posenc.patch_model(make_model("llama"), "fox", decay_time_min=8.0, decay_time_max=512.0)
    times = torch.logspace(math.log10(8.0), math.log10(512.0), 4, dtype=torch.float64)
    for gate in model.posenc.forget:
        assert torch.all(gate.weight == 0)
        torch.testing.assert_close(
            torch.sigmoid(gate.bias.double()), torch.exp(-1 / times), atol=1e-6, rtol=0
        )
    ctx = dataclasses.replace(probe_call(model.posenc.geometry, 10), hidden=torch.randn(1, 10, 64))
    with torch.no_grad():
        d = model.posenc.score_bias(ctx).full()[0].double()  # (Hq, T, T)
    distance = torch.arange(10)[:, None] - torch.arange(10)[None, :]
    torch.testing.assert_close(d, -distance / times[:, None, None], atol=1e-5, rtol=1e-5)
    default = hf_posenc.patch_model(make_model("gpt2"), "fox").posenc.forget[0].bias
    assert torch.all(torch.sigmoid(default) > 0.98)


def test_fox_pro_initial_shift_and_gate_are_constants():
    """FoX (Pro) starts with the previous token weighted shift_init (0.01: current token only),
    a constant output gate output_gate_init (0.9) and unit norm gains."""
    posenc = hf_posenc.patch_model(make_model("mistral"), "fox_pro").posenc
    for linears, value in ((posenc.k_shift, 0.01), (posenc.v_shift, 0.01), (posenc.output_gate, 0.9)):
        for linear in linears:
            assert torch.all(linear.weight == 0)
            torch.testing.assert_close(torch.sigmoid(linear.bias), torch.full_like(linear.bias, value))
    for gains in (posenc.q_norm, posenc.k_norm, posenc.output_norm):
        assert torch.all(gains == 1)
    assert posenc.k_shift[0].weight.shape == (2, 64)  # per KV head
    assert posenc.output_gate[0].weight.shape == (64, 64)  # elementwise on Hq * D


def test_fox_pro_with_every_part_off_equals_fox(family):
    """FoX (Pro) with token shift, QK-norm, output norm and output gate all off is FoX: same
    logits for the same forget gates, and no parameters besides the gates."""
    ids = token_ids(2, LENGTH)
    fox = patch(make_model(family), "fox")
    pro = hf_posenc.patch_model(make_model(family), "fox_pro", **PRO_OFF)
    assert pro.posenc.active_stages() == ["score_bias"]
    assert [n for n, _ in pro.posenc.named_parameters()] == [n for n, _ in fox.posenc.named_parameters()]
    pro.posenc.load_state_dict(fox.posenc.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(pro(ids).logits, fox(ids).logits, atol=1e-6, rtol=0)


def test_list_encodings_shows_stages_and_parameters():
    infos = {info.name: info for info in hf_posenc.list_encodings()}
    assert infos["fox"].stages == ("score_bias",)
    assert infos["fox_pro"].stages == ("adjust_qkv", "score_bias", "adjust_output")
    assert infos["fox"].parameters == {"decay_time_min": 64.0, "decay_time_max": 4096.0}
    assert infos["fox_pro"].parameters["shift_init"] == 0.01
    model = hf_posenc.patch_model(make_model("llama"), "forgetting_transformer")
    assert hf_posenc.patch_info(model)["encoding"] == "fox"
    assert model.posenc.forget[0].weight.shape == (4, 64)  # one gate per query head under GQA


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("fox", {"decay_time_min": 0.0}, r"decay_time_min=0\.0 .*\[0\.01, inf\)"),
        (
            "fox",
            {"decay_time_min": 100.0, "decay_time_max": 10.0},
            r"decay_time_max=10\.0 .*>= decay_time_min=100\.0",
        ),
        ("fox", {"decay_time_max": float("inf")}, r"decay_time_max=inf"),
        ("fox_pro", {"shift_init": 1.0}, r"shift_init=1\.0 .*\(0\.0, 1\.0\)"),
        ("fox_pro", {"output_gate_init": 0}, r"output_gate_init=0 .*\(0\.0, 1\.0\)"),
        ("fox_pro", {"qk_norm": "yes"}, r"qk_norm='yes' .*True or False"),
        ("fox", {"k_shift": True}, r"no parameter 'k_shift'"),
    ],
)
def test_bad_parameters_raise_with_value_and_range(name, params, message):
    with pytest.raises(hf_posenc.InvalidParameterError, match=message):
        hf_posenc.patch_model(make_model("gpt2"), name, **params)


def test_fox_pro_state_follows_the_sliding_window_in_long_decoding():
    """Decoding far past Mistral's window (8) keeps the forget-gate state as long as the keys
    the cache returns and the logits equal a full forward."""
    model = patch(make_model("mistral"), "fox_pro")
    randomize_encoding(model, seed=3)
    ids = token_ids(1, 30)
    with torch.no_grad():
        out = model(ids[:, :3], use_cache=True)
        for t in range(3, 30):
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
        state = model._hf_posenc_patch.runtime.parts[0].layer_state(out.past_key_values, 0)
        assert state["fox_cumulative_log_forget"].shape[-1] == 8
        torch.testing.assert_close(out.logits[:, -1], model(ids).logits[:, -1], atol=1e-5, rtol=0)
