"""Saving and loading agree on a patch's parts after any sequence of patch, reconfigure, save and
load: a reloaded model has the parts, tensors, ``patch_info`` and logits of the model it was
saved from (issue 19, finding 1: a hybrid whose parts ``reconfigure`` made equal used to save
two parts and load one, so its folder could not be reloaded)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, no_grad_logits, token_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_posenc

LAYERS = 4
#: encodings whose parts can differ only in an inference-time parameter (``scaling``)
ENCODINGS = ("t5", "kerple", "fire")
SCALINGS = (None, {"type": "linear", "factor": 2.0}, {"type": "linear", "factor": 4.0})


def _randomize(module: torch.nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)


def _reload(model, folder):
    """Save ``model`` to ``folder`` and load it back; assert the reloaded model is the same patch."""
    model.save_pretrained(folder)
    reloaded = hf_posenc.from_pretrained(str(folder))
    assert hf_posenc.patch_info(reloaded) == hf_posenc.patch_info(model)
    state, saved = reloaded.posenc.state_dict(), model.posenc.state_dict()
    assert sorted(state) == sorted(saved)
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    ids = token_ids(1, 10)
    torch.testing.assert_close(no_grad_logits(reloaded, ids), no_grad_logits(model, ids), atol=0, rtol=0)
    return reloaded


@pytest.mark.parametrize("name", ENCODINGS)
def test_a_hybrid_made_uniform_by_reconfigure_reloads(name, tmp_path):
    """Parts that differ only in ``scaling``, made equal by ``reconfigure(scaling=None)``: the saved
    folder reloads as the same two parts, with the same tensors and logits."""
    model = make_model("llama", num_layers=LAYERS)
    hf_posenc.patch_model(model, [(name, {"scaling": SCALINGS[1]}), name])
    _randomize(model.posenc)
    hf_posenc.reconfigure(model, scaling=None)
    parts = hf_posenc.patch_info(model)["params"]["parts"]
    assert parts[0] == parts[1]  # equal parameters, still two parts with their own tensors
    reloaded = _reload(model, tmp_path / "saved")
    assert hf_posenc.patch_info(reloaded)["params"]["layers"] == [0, 1, 0, 1]


@st.composite
def _sequences(draw):
    name = draw(st.sampled_from(ENCODINGS))
    pattern = draw(st.lists(st.sampled_from(range(len(SCALINGS))), min_size=1, max_size=LAYERS))
    steps = draw(
        st.lists(st.one_of(st.sampled_from(range(len(SCALINGS))), st.just("reload")), min_size=1, max_size=4)
    )
    return name, pattern, steps


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_sequences())
def test_any_sequence_of_patch_reconfigure_save_and_load_reloads_the_same_patch(case, tmp_path_factory):
    """Patch a pattern of one encoding with per-entry scalings, then reconfigure the scaling or save
    and reload, in any order: every reload (and a last one) gives the patch it was saved from."""
    name, pattern, steps = case
    model = make_model("llama", num_layers=LAYERS)
    hf_posenc.patch_model(model, [(name, {"scaling": SCALINGS[i]}) for i in pattern])
    _randomize(model.posenc)
    folder = tmp_path_factory.mktemp("sequence")
    for index, step in enumerate([*steps, "reload"]):
        if step == "reload":
            model = _reload(model, folder / str(index))
        else:
            hf_posenc.reconfigure(model, scaling=SCALINGS[step])


#: ``config.posenc`` entries as hf_posenc 0.1.0 wrote them (literal, not produced by this version)
OLD_ENTRIES = {
    "format 1": {
        "encoding": "t5",
        "params": {"num_buckets": 32, "max_distance": 128, "shared_across_layers": True, "scaling": None},
        "format_version": 1,
        "hf_posenc_version": "0.1.0",
    },
    "format 2": {
        "encoding": "hybrid",
        "params": {
            "parts": [
                {
                    "encoding": "t5",
                    "params": {
                        "num_buckets": 8,
                        "max_distance": 128,
                        "shared_across_layers": True,
                        "scaling": None,
                    },
                },
                {"encoding": "nope", "params": {}},
            ],
            "layers": [0, 0, 0, 1],
        },
        "format_version": 2,
        "hf_posenc_version": "0.1.0",
    },
}


@pytest.mark.parametrize("form", list(OLD_ENTRIES))
def test_config_posenc_of_earlier_versions_loads(form, tmp_path):
    """A folder whose ``config.posenc`` is an entry written by an earlier version (format 1: one
    encoding, tensors under ``posenc.``; format 2: a hybrid, tensors under ``posenc.parts.<i>.``)
    reloads with its tensors, and this version writes the same entry back."""
    entry = OLD_ENTRIES[form]
    model = make_model("llama", num_layers=LAYERS)
    hf_posenc.patch_model(model, entry)
    _randomize(model.posenc)
    hybrid = entry["encoding"] == "hybrid"
    assert all(key.startswith("parts.") == hybrid for key in model.posenc.state_dict())
    written = {k: v for k, v in model.config.posenc.items() if k != "hf_posenc_version"}
    assert written == {k: v for k, v in entry.items() if k != "hf_posenc_version"}
    _reload(model, tmp_path / "saved")
