"""A patched model's state is its own: copies, pickles, shared configs, initialisation, bad input.

Part of the drop-in checks (issue 10): each test states what a user does with an ordinary
transformers model and checks that the patched model behaves like an independent, correctly
patched model — against references that do not go through the code path under test (a model
patched from scratch, each packed sequence run alone, the default cache, the eager forward).
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import DROPIN_ENCODINGS as ENCODINGS
from conftest import make_model, patch, token_ids
from conftest import no_grad_logits as logits
from transformers import AutoModelForCausalLM

import hf_posenc
from hf_posenc.errors import InvalidParameterError, PositionRangeError, UnsupportedModelError


# -- copies, pickles, shared configs ------------------------------------------------------------
@pytest.mark.parametrize("name", ENCODINGS)
def test_deepcopy_is_an_independent_patched_model(name):
    """A deep copy keeps the patch; changing or unpatching either model never touches the other."""
    original = patch(make_model("llama"), name)
    ids = token_ids(1, 12)
    before = logits(original, ids)
    clone = copy.deepcopy(original)
    assert torch.equal(logits(clone, ids), before)
    assert hf_posenc.patch_info(clone) == hf_posenc.patch_info(original)

    # the copy's encoding parameters are its own: editing them changes the copy only
    params = list(clone.posenc.parameters())
    if params:
        with torch.no_grad():
            for p in params:
                p.add_(0.3)
        assert not torch.equal(logits(clone, ids), before)
        assert torch.equal(logits(original, ids), before)

    # unpatching the copy leaves the original patched, with its config entry
    hf_posenc.unpatch_model(clone)
    assert hf_posenc.patch_info(clone) is None and not hasattr(clone.config, "posenc")
    assert hf_posenc.patch_info(original)["encoding"] == name
    assert original.config.posenc["encoding"] == name
    assert torch.equal(logits(original, ids), before)
    # the unpatched copy is the native model again, and can be re-patched
    native = make_model("llama")
    assert torch.allclose(logits(clone, ids), logits(native, ids), atol=1e-6)
    hf_posenc.patch_model(clone, "alibi")
    assert torch.equal(logits(original, ids), before)

    # and the other way round: unpatching the original leaves the copy patched
    clone2 = copy.deepcopy(original)
    hf_posenc.unpatch_model(original)
    assert torch.equal(logits(clone2, ids), before)


def test_training_a_deepcopy_of_learned_trains_the_copy_only():
    """EMA / TRL reference models: the copy of a ``learned`` table is a separate parameter."""
    original = patch(make_model("gpt2"), "learned")
    clone = copy.deepcopy(original)
    table = original.posenc.table.detach().clone()
    optimizer = torch.optim.SGD(clone.parameters(), lr=1.0)
    ids = token_ids(2, 10)
    clone(ids, labels=ids).loss.backward()
    optimizer.step()
    assert not torch.equal(clone.posenc.table, table)
    assert torch.equal(original.posenc.table, table)


@pytest.mark.parametrize("name", ENCODINGS)
def test_pickle_round_trip_keeps_the_patch(name, tmp_path):
    """``torch.save(model)`` / ``torch.load`` of a whole patched model gives the same patched model."""
    model = patch(make_model("mistral"), name)
    ids = token_ids(2, 12)
    expected = logits(model, ids)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(logits(loaded, ids), expected)
    assert hf_posenc.patch_info(loaded) == hf_posenc.patch_info(model)
    hf_posenc.unpatch_model(loaded)
    assert hf_posenc.patch_info(model)["encoding"] == name  # the original is untouched
    buffer = io.BytesIO()
    pickle.dump(model, buffer)  # plain pickle too


def test_models_sharing_one_config_are_patched_independently(tmp_path):
    """transformers 5's ``from_config(a.config)`` shares the config object: each model keeps its
    own encoding, saved config and attention implementation."""
    a = make_model("llama")
    b = AutoModelForCausalLM.from_config(a.config)
    assert b.config is a.config  # the situation this test is about
    b.load_state_dict(a.state_dict())
    hf_posenc.patch_model(a, "alibi")
    hf_posenc.patch_model(b, "expe")
    assert a.config.posenc["encoding"] == "alibi" and b.config.posenc["encoding"] == "expe"
    ids = token_ids(1, 10)
    expected = logits(a, ids)
    a.save_pretrained(tmp_path)
    reloaded = hf_posenc.from_pretrained(str(tmp_path))
    assert hf_posenc.patch_info(reloaded)["encoding"] == "alibi"
    assert torch.allclose(logits(reloaded, ids), expected, atol=1e-6)
    hf_posenc.unpatch_model(b)
    assert a.config.posenc["encoding"] == "alibi"


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mapping, message",
    [
        ({"encoding": None}, "encoding name"),
        ({"encoding": "t5", "parms": {"num_buckets": 8}}, "'parms'"),
        ({"encoding": "t5", "params": None}, "'params'"),
        ({"encoding": "t5", "params": {}, "format_version": 99}, "format_version=99"),
        ({"encoding": "t5", "params": {}, "format_version": "banana"}, "format_version='banana'"),
    ],
)
def test_mapping_form_is_validated_before_anything_changes(mapping, message):
    model = make_model("llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InvalidParameterError, match=message):
        hf_posenc.patch_model(model, mapping)
    assert hf_posenc.patch_info(model) is None and not hasattr(model.config, "posenc")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


@pytest.mark.parametrize("version", [99, "banana", None])
def test_saved_config_with_unknown_format_version_is_refused(tmp_path, version):
    model = patch(make_model("llama"), "alibi")
    model.config.posenc = {**model.config.posenc, "format_version": version}
    model.save_pretrained(tmp_path)
    with pytest.raises(InvalidParameterError, match="format_version"):
        hf_posenc.from_pretrained(str(tmp_path))


def test_learned_refuses_negative_positions():
    model = patch(make_model("gpt2"), "learned")
    with pytest.raises(PositionRangeError, match="negative"):
        model(token_ids(1, 4), position_ids=torch.tensor([[-1, 0, 1, 2]]))


def test_learned_on_gpt2_starts_from_the_checkpoints_own_table():
    """The default ``learned`` on GPT-2 is GPT-2's own ``wpe``: the patched model equals the native one."""
    model = make_model("gpt2")
    ids = token_ids(2, 12)
    native = logits(model, ids)
    hf_posenc.patch_model(model, "learned")
    assert hf_posenc.patch_info(model)["params"]["init"] == "native"
    assert torch.allclose(logits(model, ids), native, atol=1e-5)


def test_tape_refuses_reentrant_gradient_checkpointing():
    model = patch(make_model("llama"), "tape")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = token_ids(1, 8)
    with pytest.raises(UnsupportedModelError, match="use_reentrant"):
        model(ids, labels=ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(ids, labels=ids).loss.backward()
    assert model.posenc.gamma.grad is not None


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        # transformers' linear ignores a leftover original length; so does the patched model
        {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 16384},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        {"rope_type": "dynamic", "factor": 2.0},
    ],
    ids=lambda s: s["rope_type"],
)
def test_rope_defaults_reproduce_the_checkpoints_own_scaling(rope_scaling):
    """``patch_model(m, "rope")`` keeps the checkpoint's RoPE scaling (Llama 3.x's llama3, ...):
    logits equal the native model's (dynamic: within its original length, where transformers'
    whole-input schedule and the causal one agree)."""
    model = make_model("llama", rope_parameters={**rope_scaling, "rope_theta": 10000.0})
    ids = token_ids(2, 30 if rope_scaling["rope_type"] != "dynamic" else 20)
    native = logits(model, ids)
    hf_posenc.patch_model(model, "rope")
    assert hf_posenc.patch_info(model)["params"]["scaling"]["type"] == rope_scaling["rope_type"]
    assert torch.allclose(logits(model, ids), native, atol=1e-5)
    hf_posenc.unpatch_model(model)
    hf_posenc.patch_model(model, "rope", scaling=None)  # explicitly unscaled
    assert hf_posenc.patch_info(model)["params"]["scaling"] is None


def test_rope_refuses_a_checkpoint_scaling_it_does_not_implement():
    model = make_model("llama")
    # transformers' "proportional" (Gemma 4) is not one of rope's scalings
    model.config.rope_parameters = {"rope_type": "proportional", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(InvalidParameterError, match="proportional"):
        hf_posenc.patch_model(model, "rope")
    assert hf_posenc.patch_info(model) is None


@pytest.mark.parametrize(
    "name, params",
    [
        ("expe", {"theta": 1e30}),
        ("exqpe", {"theta2": 1e20}),
        ("exqpe", {"S": -1e30}),
        ("fope", {"sigma": 1e6}),
    ],
)
def test_parameters_that_overflow_fp32_are_refused(name, params):
    model = make_model("llama")
    with pytest.raises(InvalidParameterError, match="not allowed"):
        hf_posenc.patch_model(model, name, **params)
    assert hf_posenc.patch_info(model) is None


@pytest.mark.parametrize("name", ["t5", "fox", "liere", "fire", "learned", "kerple", "alibi"])
def test_meta_device_build_then_init_weights_gives_the_designed_init(name):
    """Build on the meta device, patch, ``to_empty()`` + ``init_weights()``: the encoding's tensors
    get their designed values (t5 zero table, fox decay-time biases, FIRE zero output layer,
    learned = the model's own re-initialised table), not transformers' generic inits."""
    family = "gpt2" if name == "learned" else "llama"
    reference = patch(make_model(family), name, randomize=False)
    with torch.device("meta"):
        model = make_model(family)
    hf_posenc.patch_model(model, name)
    model.to_empty(device="cpu")
    model.init_weights()
    got = model.posenc.state_dict()
    for key, value in reference.posenc.state_dict().items():
        if name == "fire" and ".hidden." in key:  # random (nn.Linear's default) by design
            continue
        if name == "learned" and key == "table":
            assert torch.equal(got[key], model.transformer.wpe.weight[: got[key].shape[0]])
            continue
        assert torch.allclose(got[key], value), key
    assert bool(logits(model, token_ids(1, 8)).isfinite().all())


ALL_ENCODINGS = tuple(info.name for info in hf_posenc.list_encodings())


@pytest.mark.parametrize(
    ("name", "params"),
    [(name, {}) for name in ALL_ENCODINGS]
    + [
        (name, {"scaling": {"type": "linear", "factor": 2.0}})
        for name in ("fire", "fope", "liere", "comrope")
    ],
)
def test_patching_inside_the_meta_device_context_then_init_weights_runs(name, params):
    """Patching inside ``torch.device("meta")`` (where the encoding's own tensors are created on the
    meta device too, as when transformers' ``from_pretrained`` builds the model) reads no tensor
    value, and ``to_empty()`` + ``init_weights()`` then give a model with finite logits. (Found by
    transformers' own tests patched at construction: FIRE's scaling check read its c, LieRE's init
    read RoPE's frequencies.)"""
    family = "gpt2" if name == "learned" else "llama"
    with torch.device("meta"):
        model = make_model(family)
        hf_posenc.patch_model(model, name, **params)
    assert all(t.is_meta for t in model.posenc.parameters())  # built where the model is
    model.to_empty(device="cpu")
    model.init_weights()
    assert bool(logits(model, token_ids(1, 8)).isfinite().all())


def test_init_weights_keeps_tensors_loaded_from_a_checkpoint():
    """transformers marks tensors it loaded (``_is_hf_initialized``) and initialises the rest; the
    encoding's loaded tensors keep their values, the others get the designed init."""
    model = patch(make_model("llama"), "t5", {"shared_across_layers": False})  # random tables, not zero
    loaded = model.posenc.tables[0].weight
    before = loaded.detach().clone()
    loaded._is_hf_initialized = True
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()
    assert torch.equal(model.posenc.tables[0].weight, before)
    assert torch.all(model.posenc.tables[1].weight == 0)  # not loaded: t5's zero init
