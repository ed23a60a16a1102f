"""Gemma 3, Phi-3 and SmolLM3: what each family adds beyond the shared invariant tests.

Properties: ``patch_model(model, "rope")`` with the model's own settings reproduces the native
model's logits (fp32, atol 1e-5) — Gemma 3's two thetas and per-layer scaling, SmolLM3's NoPE
layers, Phi-3's partial rotary and ``longrope``; LongRoPE's frequencies equal transformers'
``_compute_longrope_parameters``; decoding across LongRoPE's original length with a KV cache
equals the full forward; and what an adapter cannot reproduce is refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_model, token_ids
from transformers import AutoModelForCausalLM, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import hf_posenc
from hf_posenc.encodings.rope_scaling import inverse_frequencies, resolve_scaling
from hf_posenc.errors import InvalidParameterError, UnsupportedModelError

ORIGINAL = 16  # LongRoPE's original length in the tiny Phi-3 (max_position_embeddings 64)
HALF = 8  # rotary frequencies of the tiny models (head_dim 16)
SHORT = [1.0 + 0.25 * i for i in range(HALF)]
LONG = [2.0 + 1.5 * i for i in range(HALF)]


def logits(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kwargs).logits


def native_twin(model, **config_changes):
    """A native model of ``model``'s family with the same weights and changed config values."""
    config = copy.deepcopy(model.config)
    for key, value in config_changes.items():
        setattr(config, key, value)
    twin = AutoModelForCausalLM.from_config(config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def longrope_phi3(num_layers: int = 2, **rope):
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT, "long_factor": LONG}
    return make_model(
        "phi3",
        num_hidden_layers=num_layers,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={**params, "original_max_position_embeddings": ORIGINAL, **rope},
    )


@pytest.mark.parametrize("family", ["gemma3", "phi3", "smollm3"])
def test_rope_defaults_reproduce_the_native_model(family):
    """The native logits come back exactly; a different theta changes them (the check bites)."""
    model = make_model(family)
    ids = token_ids(2, 30)
    native = logits(model, ids)
    hf_posenc.patch_model(model, "rope")
    torch.testing.assert_close(logits(model, ids), native, atol=1e-5, rtol=1e-5)
    hf_posenc.unpatch_model(model)
    hf_posenc.patch_model(model, "rope", theta=123.0)
    assert not torch.allclose(logits(model, ids), native, atol=1e-3)


def test_gemma3_layers_rotate_with_their_own_theta():
    """Gemma 3's sliding layers use 10k and global ones 1M: rope with one theta for every layer
    equals a native Gemma whose two layer types both have that theta, and not the original."""
    model = make_model("gemma3")
    thetas = {t: p["rope_theta"] for t, p in model.config.rope_parameters.items()}
    assert thetas == {"sliding_attention": 10000.0, "full_attention": 1000000.0}
    ids = token_ids(2, 30)
    native = logits(model, ids)
    same = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in thetas}
    expected = logits(native_twin(model, rope_parameters=same), ids)
    assert not torch.allclose(expected, native, atol=1e-3)
    hf_posenc.patch_model(model, "rope", theta=10000.0)
    torch.testing.assert_close(logits(model, ids), expected, atol=1e-5, rtol=1e-5)


def test_gemma3_global_layers_keep_their_own_scaling():
    """The 4B-27B checkpoints scale only the global layers (linear, factor 8): kept per layer;
    replacing the scaling applies the new one everywhere."""
    model = make_model(
        "gemma3",
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
    )
    model = native_twin(model)  # rebuilt so the rotary module reads the scaling
    ids = token_ids(2, 30)
    native = logits(model, ids)
    hf_posenc.patch_model(model, "rope")
    assert hf_posenc.patch_info(model)["params"]["scaling"] == "model"
    torch.testing.assert_close(logits(model, ids), native, atol=1e-5, rtol=1e-5)


def test_smollm3_rope_leaves_the_native_nope_layers_alone():
    """rope rotates only where SmolLM3 does: the same as a native SmolLM3 whose NoPE layer is
    made a RoPE layer differs, and the native model is reproduced."""
    model = make_model("smollm3")
    assert model.config.no_rope_layers == [1, 0]
    ids = token_ids(2, 30)
    native = logits(model, ids)
    all_rope = logits(native_twin(model, no_rope_layers=[1, 1]), ids)
    assert not torch.allclose(all_rope, native, atol=1e-3)
    hf_posenc.patch_model(model, "rope")
    torch.testing.assert_close(logits(model, ids), native, atol=1e-5, rtol=1e-5)


def test_phi3_partial_rotary_reproduces_native():
    model = make_model(
        "phi3", rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}
    )
    model = native_twin(model)
    ids = token_ids(2, 30)
    native = logits(model, ids)
    hf_posenc.patch_model(model, "rope")
    assert hf_posenc.patch_info(model)["params"]["partial_rotary_factor"] == 0.5
    torch.testing.assert_close(logits(model, ids), native, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_len", [None, 1, ORIGINAL, ORIGINAL + 1, 200])
@pytest.mark.parametrize(
    "extra", [{}, {"factor": 2.0}, {"attention_factor": 0.7}], ids=["default", "factor", "attn"]
)
def test_longrope_frequencies_equal_transformers(seq_len, extra):
    """inverse_frequencies(longrope) and its attention factor equal transformers' own function."""
    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=64,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": ORIGINAL,
            **extra,
        },
    )
    expected, expected_factor = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len)
    scaling = {
        "type": "longrope",
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": ORIGINAL,
    }
    ours, factor = inverse_frequencies(16, 10000.0, resolve_scaling({**scaling, **extra}, 64), seq_len)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-12)
    assert factor == pytest.approx(expected_factor, rel=1e-12)
    assert expected_factor != 1.0  # factor 64/16 (or 2): the attention factor is exercised


def test_phi3_longrope_reproduces_native_within_the_original_length():
    model = native_twin(longrope_phi3())
    ids = token_ids(2, ORIGINAL)
    native = logits(model, ids)
    hf_posenc.patch_model(model, "rope")
    assert hf_posenc.patch_info(model)["params"]["scaling"]["type"] == "longrope"
    torch.testing.assert_close(logits(model, ids), native, atol=1e-5, rtol=1e-5)


def test_phi3_longrope_past_the_original_length_is_native_for_the_queries_there():
    """transformers switches every token to long_factor once the input outgrows L0; rope
    switches per query (p + 1 > L0), so in one layer the queries past L0 see native logits and
    the ones before it see the short factors' (those of a native forward of the prefix alone)."""
    model = native_twin(longrope_phi3(num_layers=1))
    ids = token_ids(2, 30)
    native = logits(model, ids)
    prefix = logits(model, ids[:, :ORIGINAL])
    hf_posenc.patch_model(model, "rope")
    got = logits(model, ids)
    torch.testing.assert_close(got[:, ORIGINAL:], native[:, ORIGINAL:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[:, :ORIGINAL], prefix, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(native[:, :ORIGINAL], prefix, atol=1e-3)  # the two schedules differ


def test_phi3_longrope_decoding_across_the_original_length_equals_the_full_forward():
    model = longrope_phi3()
    hf_posenc.patch_model(model, "rope")
    ids = token_ids(2, ORIGINAL + 6)
    full = logits(model, ids)
    out = model(ids[:, : ORIGINAL - 3], use_cache=True)
    steps, cache = [out.logits], out.past_key_values
    with torch.no_grad():
        for t in range(ORIGINAL - 3, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_longrope_with_the_wrong_number_of_factors_is_refused():
    model = longrope_phi3()
    with pytest.raises(InvalidParameterError, match="short_factor"):
        hf_posenc.patch_model(
            model, "rope", scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
        )
    assert hf_posenc.patch_info(model) is None


@pytest.mark.parametrize(
    ("family", "feature", "value"),
    [
        ("gemma3", "attn_logit_softcapping", 50.0),
        ("gemma3", "use_bidirectional_attention", True),
        ("phi3", "attn_logit_softcapping", 30.0),
        ("smollm3", "use_qk_norm", True),
    ],
)
def test_unreproduced_features_are_refused_in_one_line(family, feature, value):
    model = make_model(family, **{feature: value})
    with pytest.raises(UnsupportedModelError, match=feature) as error:
        hf_posenc.patch_model(model, "rope")
    assert "\n" not in str(error.value)
    assert hf_posenc.patch_info(model) is None
