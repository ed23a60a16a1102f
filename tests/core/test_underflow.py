"""exp_flushed: torch.exp's values wherever they are at least 1.67x the dtype's smallest normal
number, exactly 0 below (and for -inf), and the derivative of that function — checked against the
exponential computed in fp64 / with Python's math.exp, never against exp_flushed itself."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_posenc.core.underflow import exp_flushed

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-2000.0, 80.0, allow_nan=False), min_size=1, max_size=64),
    dtype_name=st.sampled_from(sorted(DTYPES)),
)
def test_kept_values_are_exp_and_the_rest_are_zero(values, dtype_name):
    dtype = DTYPES[dtype_name]
    x = torch.tensor(values, dtype=dtype)
    got = exp_flushed(x)
    tiny = torch.finfo(dtype).tiny
    for value, result in zip(x.tolist(), got.tolist(), strict=True):
        exact = math.exp(value)  # fp64, or 0.0 below its own range
        if exact >= 1.7 * tiny:
            assert result == pytest.approx(exact, rel=4 * torch.finfo(dtype).eps), value
        elif exact <= 1.6 * tiny:
            assert result == 0.0, value
        else:  # the threshold itself: either is fine, nothing in between
            assert result in (0.0, pytest.approx(exact, rel=4 * torch.finfo(dtype).eps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_minus_infinity_and_masked_scores_give_exact_zeros(dtype):
    x = torch.tensor([float("-inf"), torch.finfo(dtype).min, -1e4, -800.0, 0.0], dtype=dtype)
    assert exp_flushed(x).tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.floats(-300.0, 20.0, allow_nan=False), min_size=1, max_size=32))
def test_the_gradient_is_exp_where_kept_and_zero_where_flushed(values):
    x = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    y = exp_flushed(x)
    (y * torch.arange(1.0, len(values) + 1, dtype=torch.float64)).sum().backward()
    for i, (value, grad) in enumerate(zip(values, x.grad.tolist(), strict=True)):
        exact = math.exp(value)
        expected = (i + 1) * exact if exact >= 1.7 * torch.finfo(torch.float64).tiny else 0.0
        assert grad == pytest.approx(expected, rel=1e-12, abs=0.0), value


def test_without_gradients_the_input_is_left_alone():
    x = torch.tensor([-1000.0, -1.0, 2.0])
    before = x.clone()
    exp_flushed(x)
    assert torch.equal(x, before)
