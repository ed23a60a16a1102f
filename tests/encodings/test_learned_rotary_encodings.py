"""LieRE and FoPE: formula references, the generic invariants, hypothesis properties,
parameter validation.

References here are written from the papers' formulas with explicit (head_dim x head_dim)
matrices in fp64 built from the encodings' raw parameters with plain loops; nothing from
hf_posenc computes them.
"""

from __future__ import annotations

import functools
import math

import pytest
import reference as ref
import torch
from capture import LENGTH, run_and_capture
from conftest import ONE_ROTATION_FAMILIES, make_model, native_window, patch, token_ids
from encoding_cases import case_id, cases_of
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_posenc
from hf_posenc.core.memo import ForwardMemo
from hf_posenc.encodings.base import probe_layer_call

CASES = cases_of("liere", "fope")
SETTINGS = settings(max_examples=15, deadline=None)


# -- formula references (fp64, explicit matrices) --------------------------------------------------


@torch.no_grad()
def attention_with_matrices(module, hidden: torch.Tensor, *, window, matrix) -> torch.Tensor:
    """softmax_j((M(g, i) q_i) . (M(g, j) k_j) * scaling) v_j over allowed j, per query head h with
    KV head g = h // group; ``matrix(g, t)`` is the (D, D) positional map of token t."""
    hidden = hidden.double()
    batch, length, _ = hidden.shape
    q, k, v = ref.projections(module, hidden, hidden)
    heads, kv_heads = q.shape[2], k.shape[2]
    out = torch.zeros(batch, length, heads, q.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // kv_heads)
            for i in range(length):
                qi = matrix(g, i) @ q[b, i, h]
                keys = [j for j in range(i + 1) if window is None or i - j < window]
                scores = [float(qi @ (matrix(g, j) @ k[b, j, g])) * module.scaling for j in keys]
                weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0)
                out[b, i, h] = sum(w * v[b, j, g] for w, j in zip(weights, keys, strict=True))
    return ref.output_projection(module, out.reshape(batch, length, -1))


def liere_matrices(posenc, layer: int, head_dim: int):
    """LieRE: R(t) = exp(t A), A = U - U^T from the raw generators' strict upper triangle; block n's
    local index a is pair (n*b + a) // 2 of the Llama layout, member (n*b + a) % 2 -> dim i or i + d/2."""
    cfg = posenc.config
    rot = int(head_dim * cfg.partial_rotary_factor)
    b = cfg.block_size
    raw = posenc.generators.detach().double()[0 if cfg.shared_across_layers else layer]  # (H, 1, nb, b, b)

    def original(index: int) -> int:
        return index // 2 + (index % 2) * (rot // 2)

    @functools.cache
    def matrix(g: int, t: int) -> torch.Tensor:
        blocks = raw[0 if cfg.shared_across_heads else g, 0]
        generator = torch.zeros(head_dim, head_dim, dtype=torch.float64)
        for n in range(rot // b):
            for a in range(b):
                for c in range(a + 1, b):
                    x, y = original(n * b + a), original(n * b + c)
                    generator[x, y] += float(blocks[n, a, c])
                    generator[y, x] -= float(blocks[n, a, c])
        return torch.linalg.matrix_exp(t * generator)

    return matrix


def fope_matrices(posenc, layer: int, head_dim: int):
    """FoPE: pair m maps (x_m, x_{m+d/2}) by [[c, -s], [s, c]] with c = sum_j C[j,m] cos(w_j t),
    s = sum_j S[j,m] sin(w_j t), w_j = theta^(-2j/(k d)), w_j < 2 pi / L dropped (clip); a pair whose
    own frequency w_{k m} is dropped is the identity."""
    cfg = posenc.config
    rot, per = int(head_dim * cfg.partial_rotary_factor), cfg.frequencies_per_dim
    half = rot // 2
    floor = 2 * math.pi / cfg.train_length if cfg.clip else 0.0
    freqs = [cfg.theta ** (-2 * j / (per * rot)) for j in range(per * half)]
    live = [w >= floor for w in freqs]
    index = 0 if cfg.shared_across_layers else layer
    cos_coef = posenc.cos_coef.detach().double()[index]  # (H, n_in, pairs)
    sin_coef = posenc.sin_coef.detach().double()[index]

    @functools.cache
    def matrix(g: int, t: int) -> torch.Tensor:
        head = 0 if cfg.shared_across_heads else g
        out = torch.eye(head_dim, dtype=torch.float64)
        for m in range(half):
            if not live[per * m]:
                continue
            c = sum(float(cos_coef[head, j, m]) * math.cos(w * t) for j, w in enumerate(freqs) if live[j])
            s = sum(float(sin_coef[head, j, m]) * math.sin(w * t) for j, w in enumerate(freqs) if live[j])
            out[m, m], out[m, m + half], out[m + half, m], out[m + half, m + half] = c, -s, s, c
        return out

    return matrix


REFERENCE_CASES = [*CASES, ("fope", {"clip": False, "frequencies_per_dim": 3})]


@pytest.mark.parametrize("ref_case", REFERENCE_CASES, ids=[case_id(c) for c in REFERENCE_CASES])
def test_patched_attention_equals_formula_reference(family, ref_case):
    """Every patched attention layer equals softmax((M q).(M k) * scale) v computed in fp64 with
    explicit positional matrices M built from the formula and the encoding's raw parameters
    (randomised, so the LieRE generators are general skew-symmetric blocks)."""
    name, params = ref_case
    model = patch(make_model(family), name, params)
    records, attention = run_and_capture(model, token_ids(2, LENGTH))
    for layer_idx, module in enumerate(attention):
        hidden, output = records[layer_idx]
        build = liere_matrices if name == "liere" else fope_matrices
        matrix = build(model.posenc, layer_idx, module.head_dim)
        expected = attention_with_matrices(
            module, hidden, window=native_window(model, layer_idx), matrix=matrix
        )
        torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)


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
        expected = ref.attention_layer(
            module,
            hidden,
            softmax_scale=module.scaling,
            window=native_window(model, layer_idx),
            rotation=lambda t, i, f=inv_freq, d=d: ref.rotation_matrix(t, f, d),
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
