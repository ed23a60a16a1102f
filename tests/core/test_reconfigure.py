"""``hf_posenc.reconfigure`` and overrides on reload (``from_pretrained(encoding_overrides=)``,
``load_model(encoding_params=)``).

The reference for a reconfigured model is a model patched from scratch with the new
parameters into which the same learned tensors are loaded: independent of ``reconfigure``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_model, no_grad_logits, patch, token_ids

import hf_posenc
from hf_posenc.errors import InvalidParameterError, NotPatchedError


def tensors(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.posenc.state_dict().items()}


def reference(family: str, name: str, params: dict, state: dict[str, torch.Tensor]):
    """A fresh model (same seed) patched with ``params`` and the given encoding tensors."""
    model = make_model(family)
    hf_posenc.patch_model(model, name, **params)
    model.posenc.load_state_dict(state)
    return model


def snapshot(model, ids) -> tuple:
    return (
        no_grad_logits(model, ids),
        tensors(model),
        copy.deepcopy(model.config.posenc),
        hf_posenc.patch_info(model),
    )


def assert_same(a: tuple, b: tuple) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert a[2] == b[2] and a[3] == b[3]


@pytest.mark.parametrize(
    ("name", "params", "change"),
    [
        ("t5", {"num_buckets": 8, "max_distance": 12}, {"max_distance": 40}),
        ("rope", {}, {"scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}}),
        ("sandwich", {"dim": 8}, {"dim": 32}),
        ("fire", {}, {"init_L": 4.0}),
        ("fope", {"train_length": 64}, {"train_length": 8}),
        ("expe", {}, {"S": 0.5}),
    ],
)
def test_reconfigure_keeps_tensors_and_equals_a_fresh_patch(name, params, change):
    ids = token_ids(2, 20)
    model = patch(make_model("llama"), name, params)
    before = tensors(model)
    objects = {n: t for n, t in model.posenc.named_parameters()}
    saved = hf_posenc.patch_info(model)["params"]
    original = no_grad_logits(model, ids)  # fills the encodings' caches (sandwich kernel, fire pieces)
    assert hf_posenc.reconfigure(model, **change) is model
    after = tensors(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p is objects[n] for n, p in model.posenc.named_parameters())
    expected = reference("llama", name, {**params, **change}, before)
    torch.testing.assert_close(no_grad_logits(model, ids), no_grad_logits(expected, ids), rtol=0, atol=0)
    assert not torch.equal(no_grad_logits(model, ids), original)
    info = hf_posenc.patch_info(model)
    assert info == hf_posenc.patch_info(expected)
    assert model.config.posenc["params"] == info["params"]
    hf_posenc.reconfigure(model, **{key: saved[key] for key in change})
    assert torch.equal(no_grad_logits(model, ids), original)


@pytest.mark.parametrize(
    ("name", "params", "change", "message"),
    [
        ("t5", {}, {"num_buckets": 16}, "change the learned tensors"),
        ("learned", {}, {"max_positions": 32}, "change the learned tensors"),
        ("fire", {}, {"mlp_width": 8}, "change the learned tensors"),
        ("fire", {}, {"shared_across_layers": True}, "change the learned tensors"),
        ("liere", {}, {"theta": 500.0}, "initial values"),
        ("kerple", {}, {"variant": "power"}, "initial values"),
        ("t5", {}, {"max_distance": 0}, "max_distance=0"),
        ("t5", {}, {"bucket_count": 3}, "no parameter 'bucket_count'"),
    ],
)
def test_refused_changes_leave_the_model_untouched(name, params, change, message):
    ids = token_ids(1, 12)
    model = patch(make_model("llama"), name, params)
    before = snapshot(model, ids)
    with pytest.raises(InvalidParameterError, match=message) as error:
        hf_posenc.reconfigure(model, **change)
    assert "\n" not in str(error.value)
    assert_same(snapshot(model, ids), before)


def test_reconfigure_needs_a_patched_model():
    with pytest.raises(NotPatchedError, match="not patched"):
        hf_posenc.reconfigure(make_model("gpt2"), scaling=None)


def test_reconfigured_copies_are_independent():
    ids = token_ids(1, 16)
    model = patch(make_model("gpt2"), "t5", {"num_buckets": 8, "max_distance": 12})
    twin = copy.deepcopy(model)
    hf_posenc.reconfigure(model, max_distance=30)
    assert hf_posenc.patch_info(twin)["params"]["max_distance"] == 12
    assert not torch.equal(no_grad_logits(model, ids), no_grad_logits(twin, ids))
    clone = copy.deepcopy(model)
    assert torch.equal(no_grad_logits(clone, ids), no_grad_logits(model, ids))


def test_save_after_reconfigure_and_overrides_on_reload(tmp_path):
    ids = token_ids(2, 24)
    model = patch(make_model("llama"), "t5", {"num_buckets": 8, "max_distance": 12})
    model.save_pretrained(tmp_path / "plain")
    hf_posenc.reconfigure(model, max_distance=30)
    model.save_pretrained(tmp_path / "changed")
    expected = no_grad_logits(model, ids)

    reloaded = hf_posenc.from_pretrained(str(tmp_path / "changed"))
    assert hf_posenc.patch_info(reloaded)["params"]["max_distance"] == 30
    assert torch.equal(no_grad_logits(reloaded, ids), expected)

    overridden = hf_posenc.from_pretrained(str(tmp_path / "plain"), encoding_overrides={"max_distance": 30})
    assert torch.equal(no_grad_logits(overridden, ids), expected)
    loaded = hf_posenc.load_model(str(tmp_path / "plain"), encoding_params={"max_distance": 30})
    assert torch.equal(no_grad_logits(loaded, ids), expected)
    same_name = hf_posenc.load_model(str(tmp_path / "plain"), "t5_bias", {"max_distance": 30})
    assert torch.equal(no_grad_logits(same_name, ids), expected)

    with pytest.raises(ValueError, match="saved with encoding 't5'"):
        hf_posenc.load_model(str(tmp_path / "plain"), "alibi", {"max_distance": 30})
    with pytest.raises(InvalidParameterError, match="overriding the saved encoding parameters.*max_distance"):
        hf_posenc.from_pretrained(str(tmp_path / "plain"), encoding_overrides={"max_distance": -1})
    with pytest.raises(InvalidParameterError, match="change the learned tensors"):
        hf_posenc.load_model(str(tmp_path / "plain"), encoding_params={"num_buckets": 16})
