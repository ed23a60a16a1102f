"""``check_patch_fits`` (what the recipes run on a checkpoint's config.json before reading data)
refuses exactly the requests ``patch_model`` refuses on that config's model, and accepts the
rest; and a model built on the meta device (as ``from_pretrained`` builds it) takes every
encoding with a linear scaling.

Reference: ``patch_model`` on a real model of the same config — the behaviour the check must
predict without the model's weights. Found wrong before: ALiBi's and xPos's scaled-range bound
read a tensor's value, so patching a model on the meta device with ``alibi`` or ``xpos`` and a
scaling raised "Tensor.item() cannot be called on meta tensors".
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from transformers import AutoModelForCausalLM

import hf_posenc
from hf_posenc.core.plan import check_patch_fits
from hf_posenc.errors import PosencError

SCALED = sorted(info.name for info in hf_posenc.list_encodings() if "scaling" in info.parameters)
#: from past every bound (1e-45) to ordinary factors
FACTORS = (1e-45, 1e-20, 1e-9, 1e-5, 1e-2, 0.5, 4.0)


def linear(factor: float) -> dict:
    return {"scaling": {"type": "linear", "factor": factor}}


def outcome(action) -> str:
    try:
        action()
    except PosencError as error:
        assert "\n" not in str(error)
        return "refused"
    return "accepted"


@pytest.mark.parametrize("name", SCALED)
def test_the_config_check_refuses_what_the_patch_refuses(name):
    config = make_model("llama").config
    for factor in FACTORS:
        patched = outcome(
            lambda factor=factor: hf_posenc.patch_model(make_model("llama"), name, **linear(factor))
        )
        checked = outcome(lambda factor=factor: check_patch_fits(config, name, linear(factor)))
        assert checked == patched, (name, factor, patched, checked)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_patterns_and_native_requirements_are_checked_on_the_config(family):
    model = make_model(family)
    depth = model.config.num_hidden_layers if family != "gpt2" else model.config.n_layer
    for request in [f"alibi*{depth}+nope", f"t5*{depth}", "rerope", "rope+nope"]:
        patched = outcome(lambda request=request: hf_posenc.patch_model(make_model(family), request))
        checked = outcome(lambda request=request: check_patch_fits(model.config, request))
        assert checked == patched, (family, request, patched, checked)


def test_a_saved_entry_with_an_override_is_checked_as_loading_would():
    model = hf_posenc.patch_model(make_model("llama"), "alibi+t5")
    saved = model.config  # carries config.posenc, as the checkpoint's config.json does
    assert outcome(lambda: check_patch_fits(saved, None, linear(1e-45))) == "refused"
    assert outcome(lambda: check_patch_fits(saved, None, linear(2.0))) == "accepted"


def test_an_unserved_model_type_is_refused_by_name():
    from transformers import BertConfig

    with pytest.raises(PosencError, match=r"model_type 'bert' is not supported; supported families: "):
        check_patch_fits(BertConfig(), "alibi")


@pytest.mark.parametrize("name", ["alibi", "xpos", "rope", "fire", "fope"])
def test_a_model_on_the_meta_device_takes_a_scaled_encoding(name):
    config = make_model("llama").config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        hf_posenc.patch_model(model, name, **linear(2.0))
    assert hf_posenc.patch_info(model)["params"]["scaling"]["factor"] == 2.0


def test_the_check_leaves_the_random_stream_as_it_was():
    """Building the parts (FIRE's MLP, t5's table: random inits) must not move the caller's
    seed: a run that checks first and seeds later, or seeds first, draws the same numbers."""
    config = make_model("llama").config
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    check_patch_fits(config, "fire+liere", linear(2.0))
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)
