"""The public API around a patch, beyond the invariants every encoding keeps: the ``patched``
context manager, config objects and aliases, ``list_encodings``, which classical encodings have
parameters, GPT-2's learned table copied natively, and loading (a plain transformers load
reports the patch, hf_posenc's is quiet, sharded checkpoints and ``dtype=``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import (
    ENCODINGS,
    make_model,
    patch,
    token_ids,
)
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

import hf_posenc


@pytest.mark.parametrize(("name", "has_parameters"), [(n, n in ("t5", "learned")) for n in ENCODINGS])
def test_which_classical_encodings_have_parameters(name, has_parameters):
    model = patch(make_model("llama"), name)
    assert bool(list(model.posenc.parameters())) == has_parameters


def test_patched_context_manager_restores_on_exit_and_on_error():
    model = make_model("llama")
    ids = token_ids(1, 8)
    with torch.no_grad():
        before = model(ids).logits
        with hf_posenc.patched(model, "alibi"):
            assert hf_posenc.patch_info(model)["encoding"] == "alibi"
            assert not torch.equal(model(ids).logits, before)
        assert torch.equal(model(ids).logits, before)
        with pytest.raises(RuntimeError, match="boom"), hf_posenc.patched(model, "t5"):
            raise RuntimeError("boom")
        assert hf_posenc.patch_info(model) is None
        assert torch.equal(model(ids).logits, before)


def test_patch_accepts_a_config_object_and_aliases():
    a = hf_posenc.patch_model(make_model("gpt2"), hf_posenc.T5Config(num_buckets=8, max_distance=16))
    b = hf_posenc.patch_model(make_model("gpt2"), "t5_bias", num_buckets=8, max_distance=16)
    assert hf_posenc.patch_info(a) == hf_posenc.patch_info(b)
    assert hf_posenc.patch_info(a)["params"] == {
        "num_buckets": 8,
        "max_distance": 16,
        "shared_across_layers": True,
        "scaling": None,
    }


def test_list_encodings_names_every_encoding_with_parameters():
    infos = {info.name: info for info in hf_posenc.list_encodings()}
    assert set(infos) >= {"nope", "sinusoidal", "learned", "t5", "alibi", "rope", "expe", "exqpe"}
    assert infos["rope"].parameters == {"theta": None, "partial_rotary_factor": None, "scaling": "model"}
    assert infos["expe"].parameters["theta"] == 1 / 2048
    assert infos["exqpe"].parameters["theta2"] == 1 / 16
    assert "rotary" in infos["rope"].aliases
    assert infos["alibi"].stages == ("score_bias",)
    assert infos["expe"].stages == ("layer_input",)


def test_learned_native_init_copies_gpt2_wpe():
    model = make_model("gpt2")
    hf_posenc.patch_model(model, "learned", init="native")
    assert torch.equal(model.posenc.table, model.transformer.wpe.weight)
    with torch.no_grad():
        ids = token_ids(1, 10)
        patched_logits = model(ids).logits
        hf_posenc.unpatch_model(model)
        torch.testing.assert_close(patched_logits, model(ids).logits, atol=1e-5, rtol=0)


def test_reload_from_sharded_checkpoint_and_in_bf16(tmp_path):
    """from_pretrained finds the encoding's tensors in any shard and honours dtype=."""
    model = patch(make_model("llama"), "t5")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ids = token_ids(1, 10)
    with torch.no_grad():
        assert torch.equal(hf_posenc.from_pretrained(str(tmp_path))(ids).logits, model(ids).logits)
    half = hf_posenc.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert half.posenc.tables[0].weight.dtype == torch.bfloat16
    torch.testing.assert_close(
        half.posenc.tables[0].weight.float(), model.posenc.tables[0].weight, atol=1e-2, rtol=0
    )


def test_plain_transformers_load_reports_the_patch(tmp_path, caplog):
    """Loading a saved patched model with plain transformers is loud: the report names the
    posenc keys, even for an encoding without parameters."""
    model = patch(make_model("llama"), "alibi")
    model.save_pretrained(tmp_path)
    hf_logging.set_verbosity_warning()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            AutoModelForCausalLM.from_pretrained(tmp_path)
    finally:
        hf_logging.disable_propagation()
        hf_logging.set_verbosity_error()
    assert "posenc.reload_with_hf_posenc_from_pretrained" in caplog.text


def test_hf_posenc_load_is_quiet(tmp_path, caplog):
    """hf_posenc.from_pretrained does not report the encoding's own keys as unexpected."""
    model = patch(make_model("gpt2"), "t5")
    model.save_pretrained(tmp_path)
    hf_logging.set_verbosity_warning()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            hf_posenc.from_pretrained(str(tmp_path))
    finally:
        hf_logging.disable_propagation()
        hf_logging.set_verbosity_error()
    assert "posenc." not in caplog.text
