"""Hypothesis properties: the encodings' building blocks equal the formula references in
tests/references/ over wide parameter ranges, and relative encodings depend only on i - j."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from conftest import make_model, randomize_encoding
from hypothesis import given, settings
from hypothesis import strategies as st
from references import alibi, expe, exqpe, rope, sinusoidal, t5

import hf_posenc
from hf_posenc.encodings.alibi import alibi_slopes
from hf_posenc.encodings.base import probe_call
from hf_posenc.encodings.expe import expe_values
from hf_posenc.encodings.exqpe import exqpe_values
from hf_posenc.encodings.rope import apply_rotary, cos_sin
from hf_posenc.encodings.sinusoidal import sinusoidal_table
from hf_posenc.encodings.t5 import relative_position_bucket

SETTINGS = settings(max_examples=50, deadline=None)
DISTANCES = torch.arange(-50, 2001)  # i - j, negative = future keys
finite = functools.partial(st.floats, allow_nan=False, allow_infinity=False)


# -- T5 buckets --------------------------------------------------------------------------------


@st.composite
def bucket_params(draw):
    num_buckets = draw(st.integers(2, 64))
    max_distance = draw(st.integers(num_buckets // 2 + 1, 512))
    return num_buckets, max_distance


def log_branch_argument(n: int, num_buckets: int, max_distance: int) -> float | None:
    """log(n / (B/2)) / log(D / (B/2)) * B/2 where the log branch applies, else None."""
    half = num_buckets // 2
    if n < half or n >= max_distance:
        return None
    return math.log(n / half) / math.log(max_distance / half) * half


@SETTINGS
@given(bucket_params())
def test_t5_bucket_tensor_function_equals_scalar_reference(params):
    """relative_position_bucket(i - j) == references.t5.t5_bucket for every distance in [-50, 2000].

    Where the log branch lands within 1e-5 of an integer, the floor is a rounding tie that
    fp32 (the package, like HF T5) and fp64 (the reference) may break differently; there
    the two may differ by one. Distances at and past D are pinned exactly by
    test_t5_bucket_at_max_distance_is_last_bucket.
    """
    num_buckets, max_distance = params
    ours = relative_position_bucket(DISTANCES, num_buckets, max_distance).tolist()
    for n, bucket in zip(DISTANCES.tolist(), ours, strict=True):
        expected = t5.t5_bucket(n, num_buckets, max_distance)
        argument = log_branch_argument(n, num_buckets, max_distance)
        if argument is not None and abs(argument - round(argument)) < 1e-5:
            assert abs(bucket - expected) <= 1, (n, bucket, expected)
        else:
            assert bucket == expected, (n, bucket, expected)


def test_t5_bucket_at_max_distance_is_last_bucket():
    """Every distance n >= max_distance (n == D included) is in the last bucket B - 1."""
    wrong = []
    for num_buckets in range(2, 65):
        for max_distance in range(num_buckets // 2 + 1, 513, 7):
            distance = torch.tensor([max_distance, max_distance + 1, 5000])
            buckets = relative_position_bucket(distance, num_buckets, max_distance).tolist()
            if buckets != [num_buckets - 1] * 3:
                wrong.append((num_buckets, max_distance, buckets))
    assert not wrong, f"{len(wrong)} (B, D) pairs, e.g. {wrong[:5]}"


@SETTINGS
@given(bucket_params())
def test_t5_buckets_monotone_and_in_range(params):
    """Buckets are non-decreasing in the distance i - j and lie in [0, num_buckets)."""
    num_buckets, max_distance = params
    buckets = relative_position_bucket(DISTANCES, num_buckets, max_distance)
    assert buckets.dtype == torch.int64
    assert int(buckets.min()) >= 0 and int(buckets.max()) < num_buckets
    assert torch.all(buckets[1:] >= buckets[:-1])
    assert torch.all(buckets[DISTANCES <= 0] == 0)  # the present token and future keys


# -- ALiBi slopes --------------------------------------------------------------------------------


@SETTINGS
@given(st.integers(1, 128))
def test_alibi_slopes_equal_reference(num_heads):
    """alibi_slopes(H) equals Press et al.'s get_slopes for every H, and all slopes are positive."""
    ours = alibi_slopes(num_heads)
    assert ours.shape == (num_heads,)
    expected = torch.tensor(alibi.alibi_slopes(num_heads), dtype=torch.float64)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=0)
    assert torch.all(ours > 0)


@pytest.mark.parametrize("num_heads", [1, 2, 4, 8, 16, 32, 64, 128])
def test_alibi_slopes_strictly_decrease_for_powers_of_two(num_heads):
    """For H = 2^k the slopes are the geometric sequence 2^(-8/H), ..., 2^(-8): strictly decreasing."""
    slopes = alibi_slopes(num_heads).double()
    assert torch.all(slopes[1:] < slopes[:-1])
    assert float(slopes[-1]) == pytest.approx(2.0**-8, rel=1e-6)
    assert float(slopes[0]) == pytest.approx(2.0 ** (-8 / num_heads), rel=1e-6)


# -- ExPE / ExQPE values ---------------------------------------------------------------------------


exact_params = dict(
    l=st.integers(1, 16),
    S=finite(min_value=-10, max_value=10),
    factor=finite(min_value=0.1, max_value=10),
)


@SETTINGS
@given(
    n=st.integers(0, 300),
    theta1=finite(min_value=0, max_value=1),
    theta2=finite(min_value=1e-4, max_value=1),
    **exact_params,
)
def test_exqpe_closed_form_equals_recurrence(n, l, S, theta1, theta2, factor):  # noqa: E741, N803
    """exqpe_values (closed form) equals ExQPE eq. 5's recurrence p_n = p_{n-1} + theta2 e_{n mod l}."""
    positions = torch.tensor([[n, max(n - 1, 0)], [0, n // 2]])
    ours = exqpe_values(positions, l, S, theta1, theta2, factor)
    assert ours.shape == (2, 2, l) and ours.dtype == torch.float32
    for b in range(2):
        for t in range(2):
            m = int(positions[b, t])
            expected = torch.tensor(exqpe.exqpe_values(m, l, S, theta1, theta2, factor), dtype=torch.float64)
            torch.testing.assert_close(ours[b, t].double(), expected, rtol=1e-6, atol=1e-6)


@SETTINGS
@given(n=st.integers(0, 300), theta=finite(min_value=1e-6, max_value=1), **exact_params)
def test_expe_values_equal_reference(n, l, S, theta, factor):  # noqa: E741, N803
    """expe_values equals ExPE eq. 3: S + theta * (n + j) / factor for j < l."""
    positions = torch.tensor([[n, 0], [n // 3, 300]])
    ours = expe_values(positions, l, S, theta, factor)
    assert ours.shape == (2, 2, l) and ours.dtype == torch.float32
    for b in range(2):
        for t in range(2):
            m = int(positions[b, t])
            expected = torch.tensor(expe.expe_values(m, l, S, theta, factor), dtype=torch.float64)
            torch.testing.assert_close(ours[b, t].double(), expected, rtol=1e-6, atol=1e-6)


# -- relative biases depend only on i - j -------------------------------------------------------------


@functools.cache
def patched_model(family: str, name: str) -> torch.nn.Module:
    params = {"num_buckets": 8, "max_distance": 20} if name == "t5" else {}
    model = make_model(family)
    hf_posenc.patch_model(model, name, **params)
    randomize_encoding(model)
    return model


@SETTINGS
@given(
    family=st.sampled_from(["llama", "gpt2"]),
    name=st.sampled_from(["alibi", "t5"]),
    k_len=st.integers(2, 60),
    data=st.data(),
)
def test_relative_biases_depend_only_on_i_minus_j(family, name, k_len, data):
    """bias[h, i, j] == bias[h, i+1, j+1], and a shorter query block is the bottom rows of the full one."""
    q_len = data.draw(st.integers(1, k_len), label="q_len")
    model = patched_model(family, name)
    with torch.no_grad():
        full = model.posenc.score_bias(probe_call(model.posenc.geometry, k_len, k_len)).full()[0]
        last = model.posenc.score_bias(probe_call(model.posenc.geometry, q_len, k_len)).full()[0]
    assert full.shape == (4, k_len, k_len) and last.shape == (4, q_len, k_len)
    assert torch.equal(full[:, 1:, 1:], full[:, :-1, :-1])
    assert torch.equal(last, full[:, k_len - q_len :, :])
    assert full.abs().sum() > 0  # not trivially constant


# -- RoPE scores depend only on m - n ------------------------------------------------------------------


def rotate(x: torch.Tensor, position: int, inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Rotate one vector x (D,) to ``position`` with the package's cos_sin + apply_rotary."""
    cos, sin = cos_sin(torch.tensor([[position]]), inv_freq, factor, torch.float64)
    return apply_rotary(x.reshape(1, 1, 1, -1), cos, sin).reshape(-1)


@st.composite
def rope_case(draw):
    head_dim = 2 * draw(st.integers(1, 32))
    rotary = 2 * draw(st.integers(1, head_dim // 2))
    theta = draw(st.sampled_from([10.0, 500.0, 10000.0, 1e6]))
    seed = draw(st.integers(0, 2**31 - 1))
    return head_dim, rotary, theta, seed


@SETTINGS
@given(
    case=rope_case(),
    m=st.integers(0, 4096),
    n=st.integers(0, 4096),
    s=st.integers(0, 4096),
    factor=st.sampled_from([1.0, 1.3]),
)
def test_rope_scores_depend_only_on_relative_position(case, m, n, s, factor):
    """<R(m+s) q, R(n+s) k> == <R(m) q, R(n) k>; each rotation equals the explicit rotation matrix."""
    head_dim, rotary, theta, seed = case
    generator = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, head_dim, generator=generator, dtype=torch.float64)
    inv_freq = torch.tensor([theta ** (-2 * i / rotary) for i in range(rotary // 2)], dtype=torch.float64)
    score = rotate(q, m, inv_freq, factor) @ rotate(k, n, inv_freq, factor)
    shifted = rotate(q, m + s, inv_freq, factor) @ rotate(k, n + s, inv_freq, factor)
    scale = float(q.norm() * k.norm()) * factor**2
    assert abs(float(shifted - score)) <= 1e-9 * scale
    matrix = rope.rotation_matrix(m, inv_freq.tolist(), head_dim, factor)
    torch.testing.assert_close(rotate(q, m, inv_freq, factor), matrix @ q, rtol=1e-9, atol=1e-9)


# -- sinusoidal table -----------------------------------------------------------------------------------


@SETTINGS
@given(
    positions=st.lists(st.integers(0, 10000), min_size=1, max_size=8),
    dim=st.integers(1, 256),
    base=st.sampled_from([10000.0, 100.0, 1.5, 1e5]),
)
def test_sinusoidal_table_equals_reference(positions, dim, base):
    """sinusoidal_table equals Vaswani et al.'s P[n, 2i] = sin(n/base^(2i/d)), P[n, 2i+1] = cos(...)."""
    ours = sinusoidal_table(torch.tensor(positions), dim, base)
    assert ours.shape == (len(positions), dim) and ours.dtype == torch.float32
    expected = torch.tensor(
        [sinusoidal.sinusoidal_vector(n, dim, base) for n in positions], dtype=torch.float64
    )
    torch.testing.assert_close(ours.double(), expected, rtol=0, atol=1e-6)
