"""The request language refuses what it cannot run with one line naming the value and what is
allowed, before anything changes, and describes what runs (issue 19, findings 5 and 7)."""

from __future__ import annotations

import json
import time

import pytest
from conftest import make_model

import hf_posenc
from hf_posenc.core.request import canonical_request, check_request, matches_saved
from hf_posenc.errors import InvalidParameterError


def _refused(model, request, message: str) -> str:
    """``patch_model(model, request)`` raises one line matching ``message`` and leaves the model unpatched."""
    with pytest.raises(InvalidParameterError, match=message) as caught:
        hf_posenc.patch_model(model, request)
    assert "\n" not in str(caught.value)
    assert hf_posenc.patch_info(model) is None and not hasattr(model.config, "posenc")
    return str(caught.value)


@pytest.mark.parametrize(
    "request_form", ["rope*3+nope", ["rope", "rope", "rope", "nope"]], ids=["text", "list"]
)
def test_a_pattern_longer_than_the_depth_is_refused(request_form):
    """A pattern with entries past the last layer would run some of them nowhere (``rope*3+nope`` on
    two layers ran plain rope): refused, naming its length and the depth."""
    _refused(make_model("llama"), request_form, r"has 4 entries but the model has 2 layer\(s\)")


def test_a_shorter_pattern_repeats_and_patch_info_says_which_layer_runs_what():
    """A pattern shorter than the depth repeats over it; ``patch_info`` gives the per-layer text
    and the part of every layer, as they run."""
    model = make_model("llama", num_layers=3)
    hf_posenc.patch_model(model, "rope+nope")
    info = hf_posenc.patch_info(model)
    assert info["pattern"] == "rope+nope+rope" and info["params"]["layers"] == [0, 1, 0]


def test_a_huge_repeat_count_is_read_not_expanded():
    """``rope*10000000000``: the count is parsed, never expanded into a list (a MemoryError before);
    the recipes' text helpers answer at once and patching refuses it by the depth."""
    huge = "RoPE*10000000000+nope"
    start = time.perf_counter()
    assert canonical_request(huge) == "rope*10000000000+nope"
    check_request(huge)
    saved = {"encoding": "hybrid", "params": {"parts": [{"encoding": "rope"}], "layers": [0, 0]}}
    assert matches_saved("rope*10000000000", saved)
    _refused(make_model("llama"), huge, r"has 10000000001 entries but the model has 2 layer\(s\)")
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("key", [True, 1.0, "1"], ids=["bool", "float", "str"])
def test_per_layer_keys_that_are_not_layer_indices_are_refused(key):
    """A per-layer mapping keyed by ``True`` or ``1.0`` (a TypeError from a sort before) or ``"1"``."""
    _refused(
        make_model("llama"), {key: "nope", "default": "rope"}, rf"key {key!r} is not allowed; allowed keys"
    )


def test_an_unknown_key_in_a_hybrids_params_is_refused():
    """The saved form's ``params`` hold ``parts`` and ``layers`` only; another key was ignored."""
    request = {
        "encoding": "hybrid",
        "params": {"parts": [{"encoding": "rope"}, {"encoding": "nope"}], "layers": [0, 1], "bogus": 1},
    }
    _refused(make_model("llama"), request, r"unknown key\(s\) 'bogus'; allowed keys: 'parts', 'layers'")


def test_a_config_posenc_that_is_not_a_mapping_is_refused_by_the_loaders(tmp_path):
    """A hand-edited ``config.posenc`` that is a string (an AttributeError before): one line from
    ``from_pretrained`` and ``load_model``, naming the value."""
    model = hf_posenc.patch_model(make_model("llama"), "alibi")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["posenc"] = "alibi"
    (tmp_path / "config.json").write_text(json.dumps(config))
    for load in (hf_posenc.from_pretrained, hf_posenc.load_model):
        with pytest.raises(InvalidParameterError, match=r"config.posenc='alibi' is not allowed") as caught:
            load(str(tmp_path))
        assert "\n" not in str(caught.value)
