"""xPos (Sun et al. 2023, arXiv:2212.10554): the relative (shift-invariant) and decaying scores the
paper designs, torchscale's centred form, the dtype's position range, and parameter validation.

References are torchscale's ``XPOS`` module as published (below) and the paper's formula
(tests/references/xpos.py, with separate query and key maps; checked against every patched layer
by tests/encodings/test_formula_references.py); nothing from hf_posenc computes them."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, patch, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_posenc
from hf_posenc.core.memo import ForwardMemo
from hf_posenc.encodings.base import probe_layer_call


def torchscale_xpos(x: torch.Tensor, offset: int = 0, downscale: bool = False, scale_base: float = 512.0):
    """torchscale's ``XPOS.forward`` (xpos_relative_position.py) as published, x (B*H, T, D):
    positions centred on the middle of the sequence, adjacent dims paired (rotate_every_two)."""
    length, head_dim = x.shape[1], x.shape[2]
    scale_vec = (torch.arange(0, head_dim, 2, dtype=torch.float64) + 0.4 * head_dim) / (1.4 * head_dim)
    min_pos = -(length + offset) // 2
    max_pos = length + offset + min_pos
    scale = scale_vec ** (torch.arange(min_pos, max_pos, 1, dtype=torch.float64) / scale_base)[:, None]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim // 2, dtype=torch.float64) / (head_dim // 2)))
    angles = torch.arange(0, scale.shape[0], dtype=torch.float64)[:, None] * inv_freq  # fixed_pos_embedding
    sin, cos = angles.sin(), angles.cos()
    if scale.shape[0] > length:
        scale, sin, cos = scale[-length:], sin[-length:], cos[-length:]
    if downscale:
        scale = 1 / scale
    sin = (sin * scale).repeat_interleave(2, dim=-1)
    cos = (cos * scale).repeat_interleave(2, dim=-1)
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)  # rotate_every_two
    return x * cos + rotated * sin


def test_scores_equal_torchscale_up_to_the_pair_layout():
    """torchscale centres positions and pairs adjacent dims; q.k is the same bilinear form once its
    dims (2i, 2i+1) are relabelled (i, i + d/2): the centring cancels in zeta^((n-m)/gamma)."""
    model = patch(make_model("llama"), "xpos", {"scale_base": 16.0, "theta": 10000.0}, randomize=False)
    d, length = 16, 12
    generator = torch.Generator().manual_seed(3)
    q, k = (
        torch.randn(1, 1, length, d, generator=generator),
        torch.randn(1, 1, length, d, generator=generator),
    )
    call = probe_layer_call(torch.arange(length)[None])
    assert model.posenc.dim == d  # the tiny llama's head_dim
    ours_q, ours_k = model.posenc.rotate(call, q.double(), k.double())
    ours = ours_q[0, 0] @ ours_k[0, 0].T
    interleave = torch.stack((torch.arange(d // 2), torch.arange(d // 2) + d // 2), dim=-1).flatten()
    theirs_q = torchscale_xpos(q[0, :, :, interleave].double(), scale_base=16.0)
    theirs_k = torchscale_xpos(k[0, :, :, interleave].double(), scale_base=16.0, downscale=True)
    # tolerance: the rotation angles are computed in fp32, as RoPE's (transformers') are
    torch.testing.assert_close(ours, theirs_q[0] @ theirs_k[0].T, atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(shift=st.integers(0, 2000), n=st.integers(0, 40), m=st.integers(0, 40))
def test_scores_depend_only_on_the_distance(shift, n, m):
    """Property (the paper's relative design): q_n . k_m is unchanged when both positions move by
    the same amount."""
    model = patch(make_model("llama"), "xpos", {"scale_base": 32.0}, randomize=False)
    generator = torch.Generator().manual_seed(n * 41 + m)
    q, k = (
        torch.randn(1, 4, 1, 16, generator=generator).double(),
        torch.randn(1, 2, 1, 16, generator=generator).double(),
    )

    def score(p_q: int, p_k: int) -> torch.Tensor:
        rotated_q, _ = model.posenc.rotate(probe_layer_call(torch.tensor([[p_q]])), q, k)
        _, rotated_k = model.posenc.rotate(probe_layer_call(torch.tensor([[p_k]])), q, k)
        return (rotated_q[:, :2] * rotated_k).sum(-1)

    # tolerance: angles n * omega are computed in fp32 (as RoPE's), ~1e-4 rad at position 2000
    torch.testing.assert_close(score(n + shift, m + shift), score(n, m), atol=2e-3, rtol=1e-3)


def test_identical_query_and_key_scores_decay_with_distance():
    """The paper's decay: for q = k = one unit vector per pair, q_n . k_m =
    sum_i zeta_i^((n-m)/gamma) cos((n-m) omega_i), bounded by sum_i zeta_i^((n-m)/gamma), which
    falls with the distance (RoPE's own score would be bounded by d/2 at every distance)."""
    model = patch(make_model("llama"), "xpos", {"scale_base": 4.0}, randomize=False)
    d = model.posenc.dim
    half = d // 2
    zeta = [(i / half + 0.4) / 1.4 for i in range(half)]
    q = torch.zeros(1, 1, 1, d, dtype=torch.float64)
    q[..., :half] = 1.0
    for distance in (1, 4, 16, 64):
        rotated_q, _ = model.posenc.rotate(probe_layer_call(torch.tensor([[distance]])), q, q)
        _, rotated_k = model.posenc.rotate(probe_layer_call(torch.tensor([[0]])), q, q)
        score = float((rotated_q * rotated_k).sum())
        assert abs(score) <= sum(z ** (distance / 4.0) for z in zeta) + 1e-12


def test_a_position_past_the_dtype_range_raises_one_line():
    """fp16 at scale_base 8: zeta_0^(n/8) with zeta_0 = 0.4/1.4 leaves fp16's normal range (2^-14,
    kept 2^10 away) near n = 8 * ln(2^-4) / ln(0.2857); the first forward past it raises."""
    model = patch(make_model("llama"), "xpos", {"scale_base": 8.0}, randomize=False)
    limit = math.floor(math.log(2.0**-4) / math.log(0.4 / 1.4) * 8.0) + 1
    ids = token_ids(1, 4)
    model.half()
    model(ids, position_ids=torch.tensor([[0, 1, 2, limit - 1]]))  # inside: runs
    with pytest.raises(hf_posenc.PositionRangeError, match=f"position {limit} is outside"):
        model(ids, position_ids=torch.tensor([[0, 1, 2, limit]]))


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"scale_base": 0}, "scale_base=0"),
        ({"gamma": -1.0}, "gamma=-1.0"),
        ({"scaling": {"type": "dynamic", "factor": 2.0}}, "scaling\\['type'\\]='dynamic'"),
        ({"scaling": {"type": "bogus", "factor": 2.0}}, "scaling\\['type'\\]='bogus'"),
    ],
)
def test_bad_parameters_are_refused_in_one_line(params, match):
    with pytest.raises(hf_posenc.InvalidParameterError, match=match):
        hf_posenc.patch_model(make_model("llama"), "xpos", **params)


def test_memo_is_per_dtype():
    """The scaled cos/sin are memoised per forward and dtype: a second dtype builds its own."""
    model = patch(make_model("llama"), "xpos", randomize=False)
    memo = ForwardMemo()
    call = probe_layer_call(torch.arange(4)[None])
    call = type(call)(positions=call.positions, memo=memo, layer_idx=0, hidden=call.hidden)
    q = torch.randn(1, 4, 4, 16)
    a, _ = model.posenc.rotate(call, q, q[:, :2])
    b, _ = model.posenc.rotate(call, q.double(), q[:, :2].double())
    torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
