"""rope2d (axial RoPE over N-D coordinates) and ComRoPE (ap, ld): attention on caller
coordinates against the formula references, the RoPE start, N-D coordinates through
forward/generate, hypothesis properties, parameter validation.

The references (tests/references/rope2d.py, comrope.py: explicit rotation matrices in fp64;
ComRoPE's full d x d generators from the raw trainable parameters, exponentiated as one matrix)
are checked on text by tests/encodings/test_formula_references.py and on coordinates here.
"""

from __future__ import annotations

import pytest
import torch
from capture import run_and_capture
from conftest import ONE_ROTATION_FAMILIES, make_model, patch, token_ids
from encoding_cases import case_id, cases_of
from hypothesis import example, given, settings
from hypothesis import strategies as st
from references import REFERENCES
from references.comrope import comrope_generators, comrope_matrix
from transformers import DynamicCache

import hf_posenc
from hf_posenc.encodings.base import probe_layer_call

CASES = cases_of("rope2d", "comrope")
#: cases with more than one axis: N-D coordinates passed by the caller
ND_CASES = [c for c in CASES if c[1].get("axes", 2 if c[0] == "rope2d" else 1) > 1]
LENGTH = 12
ATOL = 1e-5
SETTINGS = settings(max_examples=25, deadline=None)


def axes_of(name: str, params: dict) -> int:
    return params.get("axes", 2 if name == "rope2d" else 1)


def coordinates(batch: int, length: int, axes: int, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30, (batch, length, axes), generator=generator)


# -- caller coordinates against the formula reference ---------------------------------------------


@pytest.mark.parametrize("case_", ND_CASES, ids=[case_id(c) for c in ND_CASES])
def test_coordinate_attention_equals_explicit_rotation_reference(family, case_):
    """With caller coordinates (B, T, N) every attention layer equals the fp64 reference (angles up to
    ~60 rad with the random parameters: fp32 rotations, so 5e-5)."""
    name, params = case_
    coords = coordinates(2, LENGTH, axes_of(name, params))
    model = patch(make_model(family), name, params)
    records, attention = run_and_capture(model, token_ids(2, LENGTH), position_coordinates=coords)
    reference = REFERENCES[name].layer_reference
    for layer, module in enumerate(attention):
        hidden, output = records[layer]
        expected = reference(params, module, hidden, model, layer, coords=coords)
        torch.testing.assert_close(output.double(), expected, atol=5e-5, rtol=5e-5)


# -- starting point: RoPE -----------------------------------------------------------------------


@pytest.mark.parametrize("family", ONE_ROTATION_FAMILIES)
@pytest.mark.parametrize(
    ("name", "params"),
    [("rope2d", {"axes": 1}), ("comrope", {}), ("comrope", {"variant": "ld", "block_size": 2})],
)
def test_one_axis_at_initialisation_reproduces_rope(family, name, params):
    """rope2d with one axis, and ComRoPE (both variants, default one axis) at initialisation,
    give the logits of RoPE: a patched pretrained model starts at its own function."""
    ids = token_ids(2, LENGTH)
    with torch.no_grad():
        expected = hf_posenc.patch_model(make_model(family), "rope")(ids).logits
        got = hf_posenc.patch_model(make_model(family), name, **params)(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_comrope_ap_initialisation_equals_rope2d_with_the_same_axes(family):
    """ComRoPE-AP with N axes starts as the axial rope2d with N axes (also on N-D coordinates)."""
    ids, coords = token_ids(2, LENGTH), coordinates(2, LENGTH, 2)
    with torch.no_grad():
        expected = hf_posenc.patch_model(make_model(family), "rope2d")(
            ids, position_coordinates=coords
        ).logits
        model = hf_posenc.patch_model(make_model(family), "comrope", axes=2, block_size=4)
        got = model(ids, position_coordinates=coords).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


# -- N-D coordinates through forward and generate --------------------------------------------------


@pytest.mark.parametrize("case_", ND_CASES, ids=[case_id(c) for c in ND_CASES])
def test_cached_decoding_with_coordinates_equals_full_forward(family, case_):
    """Decoding with a KV cache, coordinates given for every token (each step takes its own
    rows) or only for the new ones, equals a full forward with the coordinates."""
    name, params = case_
    model = patch(make_model(family), name, params)
    ids, coords = token_ids(2, 14), coordinates(2, 14, axes_of(name, params))
    with torch.no_grad():
        full = model(ids, position_coordinates=coords).logits
        out = model(
            ids[:, :5], position_coordinates=coords, past_key_values=DynamicCache(config=model.config)
        )
        steps = [out.logits]
        for t in range(5, 14):
            given_coords = coords if t % 2 else coords[:, t : t + 1]
            out = model(
                ids[:, t : t + 1], past_key_values=out.past_key_values, position_coordinates=given_coords
            )
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)
    text = model(ids).logits
    assert (text - full).abs().max() > 1e-3  # the coordinates are used


@pytest.mark.parametrize("case_", ND_CASES[:2], ids=[case_id(c) for c in ND_CASES[:2]])
def test_generate_with_coordinates(family, case_):
    """generate(..., position_coordinates=C) with C covering prompt + new tokens: the cached and
    uncached runs agree, and the coordinates change the result compared with plain text."""
    name, params = case_
    model = patch(make_model(family), name, params)
    prompt = token_ids(2, 6)
    coords = coordinates(2, 6 + 5, axes_of(name, params))
    runs = {}
    for use_cache in (True, False):
        runs[use_cache] = model.generate(
            prompt,
            position_coordinates=coords,
            max_new_tokens=5,
            do_sample=False,
            use_cache=use_cache,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    for a, b in zip(runs[True].logits, runs[False].logits, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    plain = model.generate(prompt, max_new_tokens=5, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    assert (plain.logits[0] - runs[True].logits[0]).abs().max() > 1e-3


def test_coordinates_errors_name_the_value():
    """Coordinates that do not fit raise InvalidParameterError naming what was given and what is allowed;
    encodings without coordinates refuse them; unpatching removes the generate() keyword."""
    ids = token_ids(1, 6)
    model = hf_posenc.patch_model(make_model("llama"), "rope2d")
    with pytest.raises(hf_posenc.InvalidParameterError, match="3 axes"):
        model(ids, position_coordinates=torch.zeros(1, 6, 3))
    with pytest.raises(hf_posenc.InvalidParameterError, match="covers 4 tokens"):
        model(ids, position_coordinates=torch.zeros(1, 4, 2))
    with pytest.raises(hf_posenc.InvalidParameterError, match=r"position_coordinates=\(6, 2\)"):
        model(ids, position_coordinates=torch.zeros(6, 2))
    hf_posenc.unpatch_model(model)
    assert "_validate_model_kwargs" not in model.__dict__
    hf_posenc.patch_model(model, "rope")
    with pytest.raises(hf_posenc.InvalidParameterError, match="not allowed with encoding 'rope'"):
        model(ids, position_coordinates=torch.zeros(1, 6, 2))


# -- hypothesis properties --------------------------------------------------------------------------

RELATIVE = [*CASES, ("comrope", {"variant": "ld", "block_size": 2, "axes": 4}), ("rope", {})]


def rotated_scores(posenc, q, k, where_q, where_k, layer=0):
    """q.k scores (B, Hq, Tq, Tk) after rotating q at ``where_q`` and k at ``where_k``: 1-D positions
    (B, T) for rope, coordinates (B, T, N) for the others."""
    group = q.shape[1] // k.shape[1]

    def turn(x_q, x_k, where):
        if posenc.name == "rope":
            return posenc.rotate(probe_layer_call(where, layer), x_q, x_k)
        positions = torch.zeros(where.shape[:2], dtype=torch.long)
        return posenc.rotate(probe_layer_call(positions, layer, where), x_q, x_k)

    qr, _ = turn(q, q[:, ::group], where_q)
    _, kr = turn(k.repeat_interleave(group, dim=1), k, where_k)
    return qr.double() @ kr.double().repeat_interleave(group, dim=1).transpose(-1, -2)


def randomized(name, params, seed):
    model = patch(make_model("llama"), name, params, randomize=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.posenc.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.posenc


@SETTINGS
@given(
    case=st.sampled_from(RELATIVE),
    shift=st.lists(st.integers(-20, 20), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_scores_depend_only_on_relative_position(case, shift, seed):
    """Shifting every query and key position by the same constant (vector) leaves every q.k score unchanged."""
    name, params = case
    posenc = randomized(name, params, seed)
    axes = 1 if name == "rope" else axes_of(name, params)
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 5, 16, generator=generator)
    k = torch.randn(1, 2, 7, 16, generator=generator)
    if name == "rope":
        cq, ck = (
            torch.randint(0, 20, (1, 5), generator=generator),
            torch.randint(0, 20, (1, 7), generator=generator),
        )
        moved = (cq + shift[0] + 20, ck + shift[0] + 20)
    else:
        cq = torch.randint(0, 20, (1, 5, axes), generator=generator).float()
        ck = torch.randint(0, 20, (1, 7, axes), generator=generator).float()
        offset = torch.tensor(shift[:axes], dtype=torch.float32)
        moved = (cq + offset, ck + offset)
    torch.testing.assert_close(
        rotated_scores(posenc, q, k, *moved), rotated_scores(posenc, q, k, cq, ck), atol=5e-4, rtol=5e-4
    )


COMROPE = [c for c in RELATIVE if c[0] == "comrope"]


@SETTINGS
@given(case=st.sampled_from(COMROPE), seed=st.integers(0, 2**16), layer=st.integers(0, 1))
def test_comrope_generators_commute(case, seed, layer):
    """With trained (random) parameters, A_a A_b == A_b A_a for every pair of axes, layer and KV head;
    each A_a is skew-symmetric."""
    posenc = randomized(*case, seed)
    for head in range(2):
        gens = comrope_generators(posenc, layer, head)
        for a in range(len(gens)):
            torch.testing.assert_close(gens[a].T, -gens[a])
            for b in range(len(gens)):
                torch.testing.assert_close(gens[a] @ gens[b], gens[b] @ gens[a], atol=1e-10, rtol=0)


@SETTINGS
@given(
    case=st.sampled_from(COMROPE),
    seed=st.integers(0, 2**16),
    coords=st.lists(st.floats(-20, 20, allow_nan=False), min_size=4, max_size=4),
)
@example(  # a block turning by 59.5 rad: fp32's drift 5.3e-5
    case=("comrope", {"variant": "ld", "block_size": 2, "axes": 4}),
    seed=231,
    coords=[1.875, -19.875, 0.75, 20.0],
)
def test_comrope_rotations_are_orthogonal_and_match_the_matrix_exponential(case, seed, coords):
    """R(x) = exp(sum_a x_a A_a) is orthogonal (R^T R = I, det 1) and the module's blockwise fp32
    exponential equals the full fp64 matrix exponential, each block to within its fp32 drift:
    32 eps (|theta| + 1), theta the block's exponent's spectral norm (the module documents that
    fp32's matrix_exp drifts in proportion to the angle; 900 random cases here peaked at 12.4
    eps (|theta| + 1), and a fixed 5e-5 failed at theta = 59.5 with 5.3e-5)."""
    name, params = case
    posenc = randomized(name, params, seed)
    axes = axes_of(name, params)
    x = torch.tensor([coords[:axes]], dtype=torch.float32)  # (1, N)
    blocks = posenc.rotation(0, x)[0].double()  # (Hkv, m, b, b)
    eye = torch.eye(blocks.shape[-1], dtype=torch.float64)
    weight = x @ posenc.coefficients(0, torch.float32)  # (1, m)
    exponent = weight[0, None, :, None, None].double() * posenc.skew(0, torch.float32).double()
    drift = 32 * 2.0**-23 * (torch.linalg.matrix_norm(exponent.detach(), ord=2) + 1)  # (Hkv, m)
    orthogonality = (blocks.transpose(-1, -2) @ blocks - eye).abs().amax((-1, -2))  # (Hkv, m)
    assert bool((orthogonality <= drift).all()), (orthogonality / drift).max()
    full = comrope_matrix(posenc, 0, 1, [float(v) for v in x[0]])
    torch.testing.assert_close(
        full.T @ full, torch.eye(full.shape[0], dtype=torch.float64), atol=1e-9, rtol=0
    )
    assert abs(float(torch.linalg.det(full.detach())) - 1.0) < 1e-6
    d = posenc.dim
    m = blocks.shape[1]
    for j in range(m):
        idx = [j + r * m for r in range(blocks.shape[-1])]
        torch.testing.assert_close(blocks[1, j], full[idx][:, idx], atol=float(drift[1, j]), rtol=0)
    assert d == m * blocks.shape[-1]


def test_comrope_float64_exponential_stays_orthogonal_at_long_positions():
    """fp32 matrix_exp drifts from orthogonal as |x| grows; matrix_exp_dtype="float64" keeps
    R^T R = I to 1e-6 at position 32768 (fp32 here: ~1e-2)."""
    x = torch.tensor([[32768.0]])
    errors = {}
    for dtype in ("float32", "float64"):
        posenc = hf_posenc.patch_model(make_model("llama"), "comrope", matrix_exp_dtype=dtype).posenc
        blocks = posenc.rotation(0, x).double()
        eye = torch.eye(blocks.shape[-1], dtype=torch.float64)
        errors[dtype] = float((blocks.transpose(-1, -2) @ blocks - eye).abs().max())
    assert errors["float64"] < 1e-6 < 1e-4 < errors["float32"]


# -- parameter validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("rope2d", {"axes": 0}, r"axes=0 .*allowed: an integer in \[1, 16\]"),
        ("rope2d", {"axes": 3}, r"axes=3 is not allowed .*divisor of 8"),
        ("rope2d", {"theta": 1.0}, r"theta=1.0 .*\(1.0, inf\)"),
        ("comrope", {"variant": "xx"}, r"variant='xx' .*'ap', 'ld'"),
        ("comrope", {"block_size": 3}, r"block_size=3 .*even integer"),
        ("comrope", {"block_size": 32}, r"block_size=32 with axes=1 .*dividing 16"),
        ("comrope", {"block_size": 4, "axes": 8}, r"axes=8 .*dividing 16"),
        ("comrope", {"axes": 2.5}, r"axes=2.5 .*integer"),
        ("comrope", {"matrix_exp_dtype": "bfloat16"}, r"matrix_exp_dtype='bfloat16' .*'float32', 'float64'"),
    ],
)
def test_bad_parameters_raise_with_value_and_allowed_range(name, params, match):
    with pytest.raises(hf_posenc.InvalidParameterError, match=match):
        hf_posenc.patch_model(make_model("llama"), name, **params)
