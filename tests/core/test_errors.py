"""Bad input raises a specific hf_posenc error whose message names the bad value and what is
allowed, and a patch that fails leaves the model exactly as it was."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import make_model, token_ids
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    OPTConfig,
    OPTForCausalLM,
)

import hf_posenc
from hf_posenc import (
    AlreadyPatchedError,
    InvalidParameterError,
    NotPatchedError,
    PosencError,
    PositionRangeError,
    UnknownEncodingError,
    UnsupportedModelError,
)

CLASSICAL = ("alibi", "expe", "exqpe", "learned", "nope", "rope", "sinusoidal", "t5")
#: the message must list every registered encoding, sorted
KNOWN = tuple(sorted(info.name for info in hf_posenc.list_encodings()))
assert set(CLASSICAL) <= set(KNOWN)


def logits(model, ids=None) -> torch.Tensor:
    with torch.no_grad():
        return model(token_ids(1, 10) if ids is None else ids).logits


def snapshot(model) -> dict:
    """What a failed patch must leave untouched."""
    attention = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    return {
        "logits": logits(model),
        "keys": sorted(model.state_dict()),
        "modules": sorted(model._modules),
        "config": model.config.to_dict(),
        "instance_forwards": [("forward" in m.__dict__) for m in model.modules()],
        "num_attention": len(attention),
        "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()),
    }


def assert_unpatched(model, before: dict) -> None:
    assert not hasattr(model, "posenc")
    assert hf_posenc.patch_info(model) is None
    assert getattr(model.config, "posenc", None) is None
    after = snapshot(model)
    torch.testing.assert_close(after.pop("logits"), before.pop("logits"), rtol=0, atol=0)
    assert after == before
    # and the model can still be patched and unpatched normally
    hf_posenc.patch_model(model, "alibi")
    hf_posenc.unpatch_model(model)


def raises_leaving_unpatched(model, error: type[Exception], *args, **kwargs) -> str:
    """patch_model(model, *args, **kwargs) raises ``error``; return its message after checking the model."""
    before = snapshot(model)
    with pytest.raises(error) as info:
        hf_posenc.patch_model(model, *args, **kwargs)
    assert isinstance(info.value, PosencError)
    assert_unpatched(model, before)
    return str(info.value)


# -- unknown names ---------------------------------------------------------------------------------


def test_unknown_encoding_suggests_close_name_and_lists_known():
    """'alibbi' -> UnknownEncodingError naming the typo, suggesting 'alibi', listing every encoding."""
    message = raises_leaving_unpatched(make_model("llama"), UnknownEncodingError, "alibbi")
    assert "'alibbi'" in message
    assert "Did you mean 'alibi'" in message
    assert "Known encodings: " + ", ".join(KNOWN) in message
    assert issubclass(UnknownEncodingError, ValueError)


def test_unknown_encoding_without_close_match_still_lists_known():
    """A name far from every encoding gets no suggestion but the full list."""
    message = raises_leaving_unpatched(make_model("gpt2"), UnknownEncodingError, "zzzzzz")
    assert "'zzzzzz'" in message and "Did you mean" not in message
    for name in KNOWN:
        assert name in message


def test_unknown_parameter_is_named_with_the_allowed_ones():
    """patch_model(m, 'alibi', slope=2) -> InvalidParameterError naming 'slope' and alibi's only
    parameter (scaling, for position interpolation)."""
    message = raises_leaving_unpatched(make_model("llama"), InvalidParameterError, "alibi", slope=2)
    assert "'slope'" in message and "'alibi'" in message
    assert "allowed parameters (with defaults): scaling=None" in message


def test_unknown_parameter_lists_allowed_parameters_with_defaults():
    """An unknown t5 parameter lists t5's parameters and their defaults."""
    message = raises_leaving_unpatched(make_model("llama"), InvalidParameterError, "t5", buckets=8)
    assert "'buckets'" in message
    for allowed in ("num_buckets=32", "max_distance=128", "shared_across_layers=True"):
        assert allowed in message


def test_unknown_backend_lists_backends():
    """backend='flash' -> InvalidParameterError naming it and listing sdpa and eager."""
    message = raises_leaving_unpatched(make_model("llama"), InvalidParameterError, "alibi", backend="flash")
    assert "'flash'" in message and "sdpa" in message and "eager" in message


# -- out-of-range values ------------------------------------------------------------------------------


BAD_VALUES = [
    # (encoding, params, substrings the message must contain)
    ("rope", {"theta": -1}, ["theta=-1", "(1.0"]),
    ("rope", {"theta": float("nan")}, ["theta=nan", "a number"]),
    ("rope", {"theta": "10000"}, ["theta='10000'", "a number"]),
    ("rope", {"partial_rotary_factor": 1.5}, ["partial_rotary_factor=1.5", "1.0]"]),
    (
        "rope",
        {"scaling": {"type": "foo", "factor": 2.0}},
        ["'foo'", "'linear'", "'ntk'", "'dynamic'", "'yarn'", "'llama3'"],
    ),
    ("rope", {"scaling": {"type": "linear", "factor": 0}}, ["scaling['factor']=0", "(0.0"]),
    ("rope", {"scaling": {"type": "linear"}}, ["scaling['factor']", "required"]),
    ("rope", {"scaling": {"type": "ntk", "factor": 0.5}}, ["scaling['factor']=0.5", "[1.0"]),
    ("rope", {"scaling": {"type": "linear", "factor": 2.0, "beta_fast": 3}}, ["'beta_fast'", "'factor'"]),
    ("rope", {"scaling": "linear"}, ["scaling='linear'", "'type'"]),
    (
        "rope",
        {"scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
        ["high_freq_factor']=1.0", "greater than low_freq_factor=4.0"],
    ),
    ("rope", {"scaling": {"type": "yarn", "factor": 2.0, "truncate": 0}}, ["truncate']=0", "True or False"]),
    ("t5", {"num_buckets": 1}, ["num_buckets=1", "an integer", "[2"]),
    ("t5", {"num_buckets": 8.0}, ["num_buckets=8.0", "an integer"]),
    ("t5", {"num_buckets": True}, ["num_buckets=True", "an integer"]),
    ("t5", {"num_buckets": 32, "max_distance": 16}, ["max_distance=16", "num_buckets // 2 = 16"]),
    ("t5", {"num_buckets": 8, "max_distance": 2}, ["max_distance=2", "num_buckets // 2 = 4"]),
    ("t5", {"shared_across_layers": 1}, ["shared_across_layers=1", "True or False"]),
    ("expe", {"l": 0}, ["l=0", "an integer", "[1"]),
    ("expe", {"l": 65}, ["l=65", "hidden_size=64"]),
    ("exqpe", {"l": 1000}, ["l=1000", "hidden_size=64"]),
    ("expe", {"theta": 0}, ["theta=0", "(0.0"]),
    ("expe", {"scaling": {"type": "ntk", "factor": 2.0}}, ["'ntk'", "'linear'"]),
    ("expe", {"scaling": {"type": "linear", "factor": -2.0}}, ["factor']=-2.0", "(0.0"]),
    ("expe", {"override_value": "yes"}, ["override_value='yes'", "True or False"]),
    ("exqpe", {"theta2": 0}, ["theta2=0", "(0.0"]),
    ("exqpe", {"theta1": -0.1}, ["theta1=-0.1", "[0.0"]),
    ("learned", {"init": "bogus"}, ["init='bogus'", "'zeros'", "'sinusoidal'", "'native'"]),
    ("learned", {"init": "native"}, ["init='native'", "llama", "'zeros'"]),
    ("learned", {"max_positions": 0}, ["max_positions=0", "[1"]),
    ("sinusoidal", {"base": 1}, ["base=1", "(1.0"]),
    ("sinusoidal", {"scale": 0.0}, ["scale=0.0", "(0.0"]),
]


@pytest.mark.parametrize(
    ("encoding", "params", "expected"),
    BAD_VALUES,
    ids=[f"{e}-{'-'.join(p)}-{i}" for i, (e, p, _) in enumerate(BAD_VALUES)],
)
def test_out_of_range_value_is_named_with_allowed_values(encoding, params, expected):
    """A bad parameter value -> InvalidParameterError naming the value and what is allowed; model untouched."""
    message = raises_leaving_unpatched(make_model("llama"), InvalidParameterError, encoding, **params)
    for part in expected:
        assert part in message, (part, message)


@pytest.mark.parametrize(
    ("config_class", "params"),
    [
        (hf_posenc.T5Config, {"num_buckets": 1}),
        (hf_posenc.RoPEConfig, {"theta": 0.5}),
        (hf_posenc.SinusoidalConfig, {"base": 1.0}),
        (hf_posenc.LearnedConfig, {"init": "random"}),
        (hf_posenc.ExQPEConfig, {"l": -3}),
    ],
)
def test_config_objects_validate_on_creation(config_class, params):
    """The config dataclasses reject a bad value when built, before any model is touched."""
    with pytest.raises(InvalidParameterError, match="is not allowed; allowed"):
        config_class(**params)


def test_allowed_range_is_a_well_formed_interval():
    """The range shown for theta=-1 is a complete interval such as '(1.0, inf)'."""
    message = raises_leaving_unpatched(make_model("llama"), InvalidParameterError, "rope", theta=-1)
    assert re.search(r"[\[(]1\.0, inf\)", message), message


# -- unsupported models ---------------------------------------------------------------------------------


def tiny_bert():
    config = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    return BertForMaskedLM(config).eval()


def tiny_opt():
    config = OPTConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        ffn_dim=32,
        max_position_embeddings=32,
        word_embed_proj_dim=16,
    )
    return OPTForCausalLM(config).eval()


@pytest.mark.parametrize(("build", "model_type"), [(tiny_bert, "bert"), (tiny_opt, "opt")])
def test_unsupported_family_lists_supported_ones(build, model_type):
    """BERT / OPT -> UnsupportedModelError naming the model type and listing every served model
    type (gpt2, llama, mistral among them)."""
    model = build()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(UnsupportedModelError) as info:
        hf_posenc.patch_model(model, "alibi")
    message = str(info.value)
    assert f"'{model_type}'" in message and type(model).__name__ in message
    assert f"supported families: {', '.join(hf_posenc.supported_families())}" in message
    assert {"gpt2", "llama", "mistral"} <= set(hf_posenc.supported_families())
    assert not hasattr(model, "posenc") and getattr(model.config, "posenc", None) is None
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    with pytest.raises(NotPatchedError):
        hf_posenc.unpatch_model(model)


def test_gpt2_with_cross_attention_is_unsupported():
    """GPT-2 with add_cross_attention=True -> UnsupportedModelError naming the option."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=50, add_cross_attention=True
    )
    model = GPT2LMHeadModel(config).eval()
    with pytest.raises(UnsupportedModelError, match="add_cross_attention"):
        hf_posenc.patch_model(model, "alibi")
    assert not hasattr(model, "posenc")


# -- patch state errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_patching_twice_raises_and_keeps_first_patch(family):
    """A second patch_model -> AlreadyPatchedError naming the current encoding; the first patch stays."""
    model = hf_posenc.patch_model(make_model(family), "alibi")
    patched_logits = logits(model)
    with pytest.raises(AlreadyPatchedError) as info:
        hf_posenc.patch_model(model, "rope")
    assert "'alibi'" in str(info.value) and "unpatch_model" in str(info.value)
    assert hf_posenc.patch_info(model)["encoding"] == "alibi"
    torch.testing.assert_close(logits(model), patched_logits, rtol=0, atol=0)
    hf_posenc.unpatch_model(model)
    assert not hasattr(model, "posenc")


def test_unpatch_unpatched_model_raises():
    """unpatch_model on a model never patched -> NotPatchedError naming the model class."""
    model = make_model("llama")
    with pytest.raises(NotPatchedError, match="LlamaForCausalLM is not patched"):
        hf_posenc.unpatch_model(model)


def test_unpatch_twice_raises():
    """A second unpatch_model -> NotPatchedError."""
    model = hf_posenc.patch_model(make_model("mistral"), "t5")
    hf_posenc.unpatch_model(model)
    with pytest.raises(NotPatchedError):
        hf_posenc.unpatch_model(model)


def test_patched_context_with_bad_parameter_leaves_model_unpatched():
    """patched(m, 't5', num_buckets=1) raises on entry; the model is left as it was."""
    model = make_model("llama")
    before = snapshot(model)
    with (
        pytest.raises(InvalidParameterError, match="num_buckets=1"),
        hf_posenc.patched(model, "t5", num_buckets=1),
    ):
        pytest.fail("the block must not run")
    assert_unpatched(model, before)


# -- rotary dimension ------------------------------------------------------------------------------------


def gpt2_head_dim_15():
    """GPT-2 with hidden 60 and 4 heads (transformers itself refuses a Llama config with head_dim 15)."""
    torch.manual_seed(0)
    config = GPT2Config(n_embd=60, n_layer=1, n_head=4, n_positions=32, vocab_size=101)
    return GPT2LMHeadModel(config).eval()


def test_odd_head_dim_rejected_for_rope():
    """hidden 60, 4 heads (head_dim 15) -> InvalidParameterError: the rotary dimension must be even."""
    model = gpt2_head_dim_15()
    message = raises_leaving_unpatched(model, InvalidParameterError, "rope")
    assert "even" in message and "15" in message


def test_odd_rotary_dim_from_partial_factor_rejected():
    """head_dim 16 with partial_rotary_factor 0.3125 -> rotary dim 5 -> InvalidParameterError ('even')."""
    message = raises_leaving_unpatched(
        make_model("llama"), InvalidParameterError, "rope", partial_rotary_factor=0.3125
    )
    assert "even" in message and "-> 5" in message


def test_odd_head_dim_is_fine_for_encodings_without_rotation():
    """head_dim 15 only matters to RoPE: alibi patches the same model."""
    model = gpt2_head_dim_15()
    hf_posenc.patch_model(model, "alibi")
    assert torch.isfinite(logits(model, torch.tensor([[3, 4, 5]]))).all()


# -- learned table too short ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_learned_table_too_short_raises_position_range_error(family):
    """learned max_positions=8 with 12 tokens -> PositionRangeError naming position 11 and max_positions=8."""
    model = hf_posenc.patch_model(make_model(family), "learned", max_positions=8, init="sinusoidal")
    with pytest.raises(PositionRangeError) as info:
        logits(model, token_ids(1, 12))
    message = str(info.value)
    assert "position 11" in message and "max_positions=8" in message
    assert isinstance(info.value, ValueError)
    # the failed forward leaves the patched model usable: 8 tokens give a fresh model's logits
    ids = token_ids(2, 8, seed=3)
    fresh = hf_posenc.patch_model(make_model(family), "learned", max_positions=8, init="sinusoidal")
    torch.testing.assert_close(logits(model, ids), logits(fresh, ids), rtol=0, atol=0)


# -- from_pretrained --------------------------------------------------------------------------------------


def test_from_pretrained_on_unpatched_checkpoint_mentions_posenc(tmp_path):
    """A folder saved from an unpatched model -> ValueError saying its config has no 'posenc' entry."""
    make_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'posenc'"):
        hf_posenc.from_pretrained(str(tmp_path))


def test_load_model_refuses_encoding_params_without_an_encoding(tmp_path):
    """Parameters without a name are not silently ignored."""
    make_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="without an encoding name"):
        hf_posenc.load_model(str(tmp_path), encoding_params={"num_buckets": 8})
