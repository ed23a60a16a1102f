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
