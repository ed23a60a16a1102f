"""LieRE and FoPE: FoPE's reduction to RoPE, hypothesis properties, parameter validation. Their
formula references (tests/references/liere.py, fope.py: explicit (head_dim x head_dim) matrices in
fp64 from the raw parameters) are checked against every patched layer by
tests/encodings/test_formula_references.py.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from capture import LENGTH, run_and_capture
from conftest import ONE_ROTATION_FAMILIES, make_model, patch, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from references.attention import attention_layer
from references.config import native_window
from references.rope import rotation_matrix

import hf_posenc
from hf_posenc.core.memo import ForwardMemo
from hf_posenc.encodings.base import probe_layer_call

SETTINGS = settings(max_examples=15, deadline=None)


# -- FoPE reduces to RoPE --------------------------------------------------------------------------


def test_fope_without_clipping_and_noise_equals_the_rope_formula(family):
    """FoPE with identity coefficients (sigma=0) and no clipping equals the RoPE formula reference:
    block rotations by t * theta^(-2i/d) on pairs (i, i + d/2)."""
    model = patch(make_model(family), "fope", {"sigma": 0.0, "clip": False}, randomize=False)
    records, attention = run_and_capture(model, token_ids(2, LENGTH))
    theta = model.posenc.config.theta
    for layer_idx, module in enumerate(attention):
        hidden, output = records[layer_idx]
        d = module.head_dim
        inv_freq = [theta ** (-2 * i / d) for i in range(d // 2)]
        expected = attention_layer(
            module,
            hidden,
            softmax_scale=module.scaling,
            window=native_window(model, layer_idx),
            rotation=lambda t, i, f=inv_freq, d=d: rotation_matrix(t, f, d),
        )
        torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)


# -- hypothesis properties -------------------------------------------------------------------------


@functools.cache
def patched_model(name: str, params: tuple = (), randomize: bool = True) -> torch.nn.Module:
    return patch(make_model("llama"), name, dict(params), randomize=randomize)


@SETTINGS
@given(
    positions=st.lists(st.integers(0, 4096), min_size=1, max_size=12),
    layer=st.integers(0, 1),
    shared=st.booleans(),
)
def test_liere_rotations_are_orthogonal(positions, layer, shared):
    """LieRE: every R(p) = exp(p A) is orthogonal, R R^T = I within 1e-5 in fp32, for random
    skew-symmetric generators and positions up to 4096; R(0) = I."""
    params = (("shared_across_layers", True), ("block_size", 16)) if shared else ()
    posenc = patched_model("liere", params).posenc
    with torch.no_grad():
        rotation = posenc.rotations(
            layer, torch.tensor([[0, *positions]]), ForwardMemo()
        )  # (1, H, T, nb, b, b)
    eye = torch.eye(rotation.shape[-1])
    torch.testing.assert_close(
        rotation @ rotation.transpose(-1, -2), eye.expand_as(rotation), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(rotation[:, :, 0], eye.expand_as(rotation[:, :, 0]), atol=0, rtol=0)


@SETTINGS
@given(
    length=st.integers(2, 16),
    shift=st.integers(1, 200),
    layer=st.integers(0, 1),
    seed=st.integers(0, 2**16),
)
def test_liere_scores_depend_only_on_relative_position(length, shift, layer, seed):
    """LieRE with 1-D positions: q.k after rotation is unchanged when every position shifts by a
    constant, since R(p)^T R(p') = R(p' - p) (random generators, random q and k). Scores are O(10);
    the tolerance is fp32 matrix_exp's angle error ~ p * |A| * eps at positions up to 216 (|A| ~ 3 here)."""
    posenc = patched_model("liere").posenc
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, length, 16, generator=generator)
    k = torch.randn(1, 2, length, 16, generator=generator)
    scores = []
    with torch.no_grad():
        for start in (0, shift):
            positions = torch.arange(start, start + length)[None]
            q_rot, k_rot = posenc.rotate(probe_layer_call(positions, layer), q, k)
            scores.append(q_rot @ k_rot.repeat_interleave(2, dim=1).transpose(-1, -2))
    torch.testing.assert_close(scores[0], scores[1], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("family", ONE_ROTATION_FAMILIES)
def test_liere_starts_as_rope(family):
    """Patched with LieRE's initial generators (RoPE's frequencies in 2x2 blocks, zeros elsewhere)
    a model gives RoPE's logits (up to fp32 matrix_exp error)."""
    ids = token_ids(2, 20)
    with torch.no_grad():
        rope = patch(make_model(family), "rope", randomize=False)(ids).logits
        liere = patch(make_model(family), "liere", randomize=False)(ids).logits
    torch.testing.assert_close(liere, rope, atol=2e-4, rtol=0)


@SETTINGS
@given(
    family=st.sampled_from(["llama", "mistral", "gpt2"]),
    theta=st.floats(2.0, 1e6),
    partial=st.sampled_from([None, 0.5, 0.25]),
    length=st.integers(1, 20),
)
def test_fope_with_one_frequency_per_dimension_and_no_clipping_is_rope(family, theta, partial, length):
    """FoPE with one frequency per dimension (identity coefficients: sigma=0, frequencies_per_dim=1)
    and no clipping gives exactly the logits of the package's RoPE with the same theta."""
    params = {"theta": theta} | ({"partial_rotary_factor": partial} if partial else {})
    ids = token_ids(2, length)
    with torch.no_grad():
        rope = patch(make_model(family), "rope", params, randomize=False)(ids).logits
        fope = patch(make_model(family), "fope", params | {"sigma": 0.0, "clip": False}, randomize=False)
        torch.testing.assert_close(fope(ids).logits, rope, atol=1e-5, rtol=0)


@SETTINGS
@given(train_length=st.integers(2, 200), start=st.integers(0, 1000), layer=st.integers(0, 1))
def test_fope_clipped_pairs_are_position_independent(train_length, start, layer):
    """FoPE: exactly the pairs whose RoPE frequency has a period longer than train_length
    (omega < 2 pi / train_length) pass q unchanged at every position; the others move."""
    posenc = patched_model("fope", (("train_length", train_length),)).posenc
    omega = torch.tensor([10000.0 ** (-2 * i / 16) for i in range(8)])
    clipped = omega < 2 * math.pi / train_length
    assert torch.equal(posenc.pair_clipped, clipped)
    q = torch.randn(1, 4, 6, 16, generator=torch.Generator().manual_seed(start))
    positions = torch.arange(start, start + 6)[None]
    with torch.no_grad():
        q_rot, _ = posenc.rotate(probe_layer_call(positions, layer), q, q[:, :2])
    dims = torch.cat((clipped, clipped))
    torch.testing.assert_close(q_rot[..., dims], q[..., dims], atol=0, rtol=0)
    if (~clipped).any():
        assert not torch.allclose(q_rot[..., ~dims], q[..., ~dims])


def test_fope_initial_coefficients_follow_the_reference_init():
    """FoPE starts at identity (each pair on its own frequency) plus N(0, sigma^2 * 2/(n_in+n_out))."""
    posenc = patched_model("fope", (("frequencies_per_dim", 4),), randomize=False).posenc
    n_in, pairs = 32, 8
    eye = torch.zeros(n_in, pairs)
    eye[torch.arange(pairs) * 4, torch.arange(pairs)] = 1.0
    noise = torch.cat((posenc.cos_coef, posenc.sin_coef)).detach() - eye
    assert abs(float(noise.std()) - 0.3 * math.sqrt(2 / (n_in + pairs))) < 0.01
    exact = patched_model("fope", (("sigma", 0.0),), randomize=False).posenc
    assert torch.equal(exact.cos_coef[0, 0], torch.eye(8)) and torch.equal(exact.sin_coef[1, 1], torch.eye(8))


# -- parameter validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("liere", {"block_size": 3}, r"block_size=3 .*even integer"),
        ("liere", {"block_size": 6}, r"block_size=6 .*divides the rotary dimension 16"),
        ("liere", {"axes": 2}, r"axes=2 .*\[1, 1\]"),
        ("liere", {"theta": 0.5}, r"theta=0.5 .*\(1.0, inf\)"),
        ("fope", {"sigma": -0.1}, r"sigma=-0.1 .*\[0.0, 100.0\]"),
        ("fope", {"train_length": 0}, r"train_length=0 .*\[1, inf\)"),
        ("fope", {"frequencies_per_dim": 0}, r"frequencies_per_dim=0 .*\[1, 64\]"),
        ("fope", {"clip": "yes"}, r"clip='yes' .*True or False"),
        ("fope", {"partial_rotary_factor": 1.5}, r"partial_rotary_factor=1.5 .*\(0.0, 1.0\]"),
    ],
)
def test_bad_parameters_raise_with_value_and_allowed_range(name, params, match):
    with pytest.raises(hf_posenc.InvalidParameterError, match=match):
        hf_posenc.patch_model(make_model("llama"), name, **params)
