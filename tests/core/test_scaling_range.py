"""A linear scaling factor so small that what it divides cannot be represented is refused, by
patch, reconfigure and hybrids alike, in one line with the bound; factors at the bound and
above give finite logits over the positions the bound is stated for.

Issue 19 finding 6: tiny factors gave NaN logits (liere at 1e-6; rope, fire, rope2d, fope,
tape at 1e-38; alibi at 1e-45). The bound is each encoding's own fact
(``Encoding.scaled_range``). References for the bound, written from the formulas: a rotation
angle p * omega / f with omega <= 1 (omega_0 = theta^0) stays a float32 number while
f >= p_max / float32_max; ALiBi's slope m / f while f >= max_h m_h / float32_max with
m_h = 2^(-8h/H) (Press et al.); FIRE's distance (i - j) / f and c (i - j) / f while f >= p_max * max(1, c) / float32_max.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import make_model, token_ids
from references.alibi import alibi_slopes

import hf_posenc
from hf_posenc.errors import InvalidParameterError

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
MAX_POSITIONS = 8
HORIZON = 16 * MAX_POSITIONS  # the positions the bound is stated for
#: every encoding whose factor can leave its representable range (issue 19's list)
BOUNDED = ("alibi", "comrope", "fire", "fope", "liere", "rope", "rope2d", "tape")


def linear(factor: float) -> dict:
    return {"type": "linear", "factor": factor}


def model():
    return make_model("llama", max_position_embeddings=MAX_POSITIONS)


def stated_bound(error: InvalidParameterError) -> float:
    match = re.search(r"allowed: factor >= ([0-9.e+-]+)$", str(error))
    assert match, str(error)
    return float(match.group(1))


def refusal(name: str, factor: float) -> InvalidParameterError:
    with pytest.raises(InvalidParameterError) as caught:
        hf_posenc.patch_model(model(), name, scaling=linear(factor))
    message = str(caught.value)
    assert "\n" not in message and f"'factor': {factor!r}" in message, message
    return caught.value


@pytest.mark.parametrize("name", BOUNDED)
def test_a_factor_below_the_range_is_refused_with_the_bound_and_the_bound_runs(name):
    """1e-45 is refused naming the bound; twice the bound patches, and the logits of an input
    as long as the horizon are finite (the bound is not looser than what runs)."""
    bound = stated_bound(refusal(name, 1e-45))
    assert 0 < bound < 1
    refusal(name, bound / 2)
    patched = hf_posenc.patch_model(model(), name, scaling=linear(bound * 2))
    with torch.no_grad():
        logits = patched(token_ids(1, HORIZON)).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "name, bound",
    [
        ("rope", HORIZON * 1.0 / FLOAT32_MAX),
        ("rope2d", HORIZON * 1.0 / FLOAT32_MAX),
        ("tape", HORIZON * 1.0 / FLOAT32_MAX),
        ("alibi", max(alibi_slopes(4)) / FLOAT32_MAX),  # the llama test model has 4 heads
        ("fire", HORIZON * max(1.0, 0.1) / FLOAT32_MAX),  # the distance itself, and c (init_c = 0.1) times it
    ],
)
def test_the_bound_is_the_formulas(name, bound):
    assert stated_bound(refusal(name, 1e-45)) == pytest.approx(bound, rel=1e-2)


def test_reconfigure_refuses_the_factor_and_leaves_the_model_as_it_was():
    patched = hf_posenc.patch_model(model(), "alibi")
    ids = token_ids(1, 12)
    with torch.no_grad():
        before = patched(ids).logits
    with pytest.raises(InvalidParameterError, match=r"alibi: parameter scaling=.*allowed: factor >= "):
        hf_posenc.reconfigure(patched, scaling=linear(1e-45))
    assert hf_posenc.patch_info(patched)["params"]["scaling"] is None
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, before, rtol=0, atol=0)


def test_a_hybrid_part_with_such_a_factor_is_refused():
    with pytest.raises(InvalidParameterError, match=r"^rope: parameter scaling=.*allowed: factor >= "):
        hf_posenc.patch_model(model(), [("rope", {"scaling": linear(1e-40)}), "nope"])


def test_cape_asks_its_base_encoding():
    """CAPE's scaling lives in ``base_params``: the base encoding's bound applies."""
    with pytest.raises(
        InvalidParameterError, match=r"^cape: parameter scaling=.*slopes m / f.*allowed: factor >= "
    ):
        hf_posenc.patch_model(model(), "cape", base_params={"scaling": linear(1e-45)})


def test_liere_reads_its_generators_as_trained():
    """A generator grown in training lowers how small the factor may be: reconfigure reads the
    tensors the model holds, not the initial ones."""
    patched = hf_posenc.patch_model(model(), "liere")
    factor = 2 * stated_bound(refusal("liere", 1e-45))
    hf_posenc.reconfigure(patched, scaling=linear(factor))  # fine at the initial generators
    hf_posenc.reconfigure(patched, scaling=None)
    with torch.no_grad():
        patched.posenc.generators.mul_(10.0)
    with pytest.raises(InvalidParameterError, match="liere: parameter scaling="):
        hf_posenc.reconfigure(patched, scaling=linear(factor))


def test_xpos_refuses_a_factor_whose_decay_leaves_float32_within_the_trained_length():
    """xPos (Sun et al. 2023): the query scale zeta_0^(n/(f*gamma)), zeta_0 = 0.4/1.4 at c = 0.4,
    gamma = scale_base = 512, must stay above float32's smallest normal number (with 2^10 to
    spare, the encoding's headroom) up to max_position_embeddings: f >= n_max ln(1/zeta_0) /
    (gamma (-ln tiny - 10 ln 2)). Below that xpos refused every position only when it ran."""
    bound = stated_bound(refusal("xpos", 1e-6))
    tiny = torch.finfo(torch.float32).tiny
    expected = MAX_POSITIONS * math.log(1.4 / 0.4) / (512 * -(math.log(tiny) + 10 * math.log(2.0)))
    assert bound == pytest.approx(expected, rel=1e-2)
    patched = hf_posenc.patch_model(model(), "xpos", scaling=linear(bound * 2))
    with torch.no_grad():
        logits = patched(token_ids(1, MAX_POSITIONS)).logits
    assert torch.isfinite(logits).all()
