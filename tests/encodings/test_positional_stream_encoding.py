"""TAPE (contextualised equivariant positional encoding): the RoPE start, the equivariance
property, parameter validation. Its formula reference (tests/references/tape.py, equations
(1)-(4) with loops in fp64) is checked against every layer by
tests/encodings/test_formula_references.py.
"""

from __future__ import annotations

import pytest
import torch
from capture import LENGTH
from conftest import make_model, patch, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_posenc


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


def _rotation_reference(x: torch.Tensor, stream: torch.Tensor, groups: int) -> torch.Tensor:
    """(2) as the paper writes it, in fp64: x * (C, C) + rotate_half(x) * (S, S), the stream of
    KV head g serving query heads g*groups .. (g+1)*groups - 1."""
    c, s = stream.double().repeat_interleave(groups, dim=1).chunk(2, dim=-1)
    x = x.double()
    x1, x2 = x.chunk(2, dim=-1)
    return x * torch.cat((c, c), -1) + torch.cat((-x2, x1), -1) * torch.cat((s, s), -1)


@settings(max_examples=30, deadline=None)
@given(
    kv_heads=st.sampled_from([1, 3]),
    groups=st.sampled_from([1, 2]),
    half=st.integers(1, 4),
    length=st.integers(1, 6),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_stream_rotation_and_its_gradients_equal_the_formula(
    kv_heads, groups, half, length, transposed, seed
):
    """TAPE's rotation (2) with its hand-written backward equals the formula and autograd through
    it (fp32, 1e-5) for q of a projection's (B, T, H, D) layout too, with grouped heads: the
    output, and the gradients of x and of the stream (summed over a group's query heads)."""
    from hf_posenc.encodings.tape import rotate_with_stream

    generator = torch.Generator().manual_seed(seed)
    heads, dim = kv_heads * groups, 2 * half
    x = torch.randn(2, length, heads, dim, generator=generator)
    x = (x.transpose(1, 2) if transposed else x.reshape(2, heads, length, dim)).requires_grad_(True)
    stream = torch.randn(2, kv_heads, length, dim, generator=generator, requires_grad=True)
    got = rotate_with_stream(x, stream, groups)
    want = _rotation_reference(x, stream, groups)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    grad = torch.randn(got.shape, generator=generator)
    got_grads = torch.autograd.grad(got, (x, stream), grad)
    want_grads = torch.autograd.grad(want, (x, stream), grad.double())
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-5)
