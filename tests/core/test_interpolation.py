"""Linear position interpolation, ``scaling={'type': 'linear', 'factor': f}``, for every encoding
whose positions or distances are numbers, and its refusal by the others.

References are written from the papers (tests/references/), evaluated at the interpolated positions i/f, j/f; nothing from hf_posenc
computes them. Position interpolation (Chen et al. 2023) means exactly that: the encoding of
positions (i, j) at factor f is the unscaled encoding of (i/f, j/f).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from capture import LENGTH, run_and_capture
from conftest import make_model, no_grad_logits, patch, token_ids
from references.alibi import alibi_slopes
from references.attention import attention_layer
from references.fire import fire_bias
from references.kerple import kerple_bias
from references.rope import rotation_matrix
from references.sandwich import sandwich_bias
from references.sinusoidal import sinusoidal_vector
from references.t5 import t5_bucket

import hf_posenc
from hf_posenc.core.memo import ForwardMemo
from hf_posenc.encodings.call import ForwardCall
from hf_posenc.errors import InvalidParameterError, PositionRangeError

F = 2.5  # a factor that is not an integer: floor and fractional positions both matter


def linear(factor: float = F) -> dict:
    return {"type": "linear", "factor": factor}


# -- what factor f means, per encoding -----------------------------------------------------------


def bias_reference(name: str, params: dict, model, layer_idx: int, heads: int, factor: float):
    """bias(h, i, j) at factor f, from the papers."""
    if name == "alibi":  # Al-Khateeb et al. 2023: slopes m_h / f
        slopes = alibi_slopes(heads)
        return lambda h, i, j: -slopes[h] / factor * (i - j)
    if name == "t5":  # bucket(floor((i - j) / f)): floor as T5's truncation; see hf_posenc/encodings/t5.py
        table = model.posenc.tables[0].weight.detach().double()
        b, d = params.get("num_buckets", 32), params.get("max_distance", 128)
        return lambda h, i, j: float(table[t5_bucket(math.floor((i - j) / factor), b, d), h])
    if name == "kerple":
        unscaled = kerple_bias(params, model.posenc, layer_idx)
    elif name == "sandwich":
        unscaled = sandwich_bias(params, heads)
    else:
        unscaled = fire_bias(params, model.posenc, layer_idx)
    return lambda h, i, j: unscaled(h, i / factor, j / factor)  # positions i/f, j/f


BIAS_CASES = [
    ("alibi", {}),
    ("t5", {"num_buckets": 8, "max_distance": 12}),
    ("kerple", {}),
    ("kerple", {"variant": "power"}),
    ("sandwich", {"dim": 16}),
    ("fire", {"init_L": 2.0, "mlp_width": 8}),  # queries past L/f: the normaliser psi(i/f) matters
]


@pytest.mark.parametrize(
    ("name", "params"), BIAS_CASES, ids=[c[0] + str(i) for i, c in enumerate(BIAS_CASES)]
)
@pytest.mark.parametrize("backend", ["chunked", "sdpa"])
def test_score_bias_at_a_factor_equals_the_formula_at_interpolated_positions(name, params, backend):
    model = patch(make_model("llama"), name, {**params, "scaling": linear()}, backend=backend)
    records, attention = run_and_capture(model, token_ids(2, LENGTH))
    for layer_idx, module in enumerate(attention):
        hidden, output = records[layer_idx]
        heads = module.config.num_attention_heads
        bias = bias_reference(name, params, model, layer_idx, heads, F)
        expected = attention_layer(module, hidden, softmax_scale=module.scaling, bias=bias)
        torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "params"), BIAS_CASES, ids=[c[0] + str(i) for i, c in enumerate(BIAS_CASES)]
)
def test_flex_at_a_factor_equals_the_eager_path(name, params):
    """FlexAttention builds its own score_mod (FIRE's reads a distance table): same factor there."""
    models = {
        b: patch(make_model("llama"), name, {**params, "scaling": linear()}, backend=b)
        for b in ("eager", "flex")
    }
    models["flex"].posenc.load_state_dict(models["eager"].posenc.state_dict())
    ids = token_ids(2, 17)
    torch.testing.assert_close(
        no_grad_logits(models["flex"], ids), no_grad_logits(models["eager"], ids), atol=1e-5, rtol=0
    )


def test_sinusoidal_at_a_factor_is_the_table_at_n_over_f():
    model = patch(make_model("llama"), "sinusoidal", {"scaling": linear()})
    positions = torch.arange(20)[None]
    added = model.posenc.embed(ForwardCall(positions=positions, memo=ForwardMemo()))[0].double()
    d = added.shape[-1]
    expected = torch.tensor([sinusoidal_vector(n / F, d) for n in range(20)], dtype=torch.float64)
    torch.testing.assert_close(added, expected, atol=1e-6, rtol=1e-6)


def test_learned_at_a_factor_interpolates_the_table_linearly():
    model = patch(make_model("gpt2"), "learned", {"scaling": linear()})  # GPT-2's own table, 64 rows
    table = model.posenc.table.detach().double().numpy()
    last = math.floor(F * (table.shape[0] - 1))  # the last position inside the table at factor F
    positions = torch.tensor([[0, 1, 2, 3, 7, 40, last]])
    added = (
        model.posenc.embed(ForwardCall(positions=positions, memo=ForwardMemo()))[0].detach().double().numpy()
    )
    rows = np.arange(table.shape[0])
    for t, n in enumerate(positions[0].tolist()):
        expected = [np.interp(n / F, rows, table[:, c]) for c in range(table.shape[1])]
        np.testing.assert_allclose(added[t], expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(PositionRangeError, match=rf"position {last + 1} \(position .* after linear scaling"):
        model.posenc.embed(ForwardCall(positions=torch.tensor([[last + 1]]), memo=ForwardMemo()))


def axial_inv_freq(dim: int, theta: float, axes: int) -> list[float]:
    """rope2d's text frequencies: pair p turns with theta^(-2 floor(p/N) / (d/N)) on axis p mod N, 0 else."""
    return [theta ** (-2 * (p // axes) / (dim // axes)) if p % axes == 0 else 0.0 for p in range(dim // 2)]


ROTARY_CASES = [
    ("rope2d", {"axes": 2}),
    ("rope2d", {"axes": 1}),
    ("liere", {}),
    ("comrope", {}),
    ("fope", {"sigma": 0.0, "clip": False}),
    ("tape", {}),
]


@pytest.mark.parametrize(
    ("name", "params"), ROTARY_CASES, ids=[c[0] + str(i) for i, c in enumerate(ROTARY_CASES)]
)
def test_rotary_encodings_at_a_factor_rotate_by_n_over_f(name, params):
    """At their initial values these all equal RoPE (rope2d with 1 axis; text on axis 0 of 2),
    so at factor f each layer equals RoPE's rotation R(n/f) (Chen et al. 2023's interpolation)."""
    model = patch(make_model("llama"), name, {**params, "scaling": linear()}, randomize=False)
    records, attention = run_and_capture(model, token_ids(2, LENGTH))
    theta = float(model.config.rope_parameters["rope_theta"])
    for layer_idx, module in enumerate(attention):
        hidden, output = records[layer_idx]
        inv_freq = axial_inv_freq(module.head_dim, theta, params.get("axes", 1))
        matrices = [rotation_matrix(t / F, inv_freq, module.head_dim) for t in range(LENGTH)]
        expected = attention_layer(
            module, hidden, softmax_scale=module.scaling, rotation=lambda t, i, m=matrices: m[t]
        )
        torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)


# -- reconfiguring a trained model ------------------------------------------------------------


ACCEPTING = [
    ("sinusoidal", {}),
    ("learned", {}),
    ("t5", {"num_buckets": 8, "max_distance": 12}),
    ("alibi", {}),
    ("kerple", {}),
    ("sandwich", {"dim": 16}),
    ("fire", {"init_L": 4.0}),
    ("rope2d", {}),
    ("comrope", {}),
    ("liere", {}),
    ("fope", {}),
    ("tape", {}),
    ("rope", {}),
    ("expe", {}),
    ("exqpe", {"l": 5, "theta2": 0.25}),
]


def scaled(name: str, factor: float | None) -> dict:
    value = None if factor is None else linear(factor)
    if name == "cape":
        return {"base_params": {"scaling": value}}
    return {"scaling": value}


@pytest.mark.parametrize(
    ("name", "params"), [*ACCEPTING, ("cape", {})], ids=[c[0] for c in [*ACCEPTING, ("cape", {})]]
)
def test_reconfigured_factor_keeps_tensors_and_decodes_like_a_full_forward(name, params):
    ids = token_ids(2, 14)
    model = patch(make_model("llama"), name, params)
    before = {k: v.clone() for k, v in model.posenc.state_dict().items()}
    original = no_grad_logits(model, ids)
    hf_posenc.reconfigure(model, **scaled(name, 2.0))
    after = model.posenc.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    full = no_grad_logits(model, ids)
    assert not torch.allclose(full, original, atol=1e-4)
    with torch.no_grad():
        out = model(ids[:, :9], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(9, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=2e-5)
    hf_posenc.reconfigure(model, **scaled(name, None))
    assert torch.equal(no_grad_logits(model, ids), original)


def test_factor_one_is_the_unscaled_encoding_bit_for_bit():
    ids = token_ids(2, 14)
    for name, params in ACCEPTING:
        model = patch(make_model("llama"), name, params)
        unscaled = no_grad_logits(model, ids)
        hf_posenc.reconfigure(model, **scaled(name, 1.0))
        assert torch.equal(no_grad_logits(model, ids), unscaled), name


REFUSING = {
    "nope": "no positions",
    "cope": "contextual",
    "fox": "forget gates",
    "fox_pro": "forget gates",
    "sba": "no positions",
    "cape": "base_params",
}


@pytest.mark.parametrize("name", sorted(REFUSING))
def test_encodings_without_numeric_positions_refuse_scaling(name):
    ids = token_ids(1, 10)
    model = make_model("llama")
    reference = no_grad_logits(model, ids)
    message = rf"{name}: parameter scaling=.* is not allowed: .*{REFUSING[name]}.*; allowed: no scaling"
    with pytest.raises(InvalidParameterError, match=message) as error:
        hf_posenc.patch_model(model, name, scaling=linear())
    assert "\n" not in str(error.value)
    assert hf_posenc.patch_info(model) is None and torch.equal(no_grad_logits(model, ids), reference)
    patch(model, name)
    patched = no_grad_logits(model, ids)
    state = {k: v.clone() for k, v in model.posenc.state_dict().items()}
    with pytest.raises(InvalidParameterError, match=message):
        hf_posenc.reconfigure(model, scaling=linear())
    assert torch.equal(no_grad_logits(model, ids), patched)
    assert all(torch.equal(v, model.posenc.state_dict()[k]) for k, v in state.items())
    assert "scaling" not in hf_posenc.patch_info(model)["params"]


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        ({"type": "ntk", "factor": 2.0}, r"scaling\['type'\]='ntk' is not allowed; allowed: one of 'linear'"),
        ({"type": "linear", "factor": 0}, r"scaling\['factor'\]=0 is not allowed; allowed: a number in \(0"),
        ({"type": "linear"}, r"scaling\['factor'\]=None is not allowed"),
        ({"type": "linear", "factor": 2, "original": 8}, r"unknown key\(s\) 'original'"),
        ("linear", r"scaling='linear' is not allowed; allowed: None or"),
    ],
)
def test_bad_scaling_names_the_value(scaling, match):
    with pytest.raises(InvalidParameterError, match=match):
        hf_posenc.patch_model(make_model("llama"), "alibi", scaling=scaling)
