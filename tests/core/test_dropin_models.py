"""Every model class of a family can be patched: headless, head classes, peft-wrapped.

Part of the drop-in checks (issue 10): each test states what a user does with an ordinary
transformers model and checks that the patched model behaves like an independent, correctly
patched model — against references that do not go through the code path under test (a model
patched from scratch, each packed sequence run alone, the default cache, the eager forward).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import FAMILIES, VOCAB, make_model, patch, token_ids
from conftest import no_grad_logits as logits

import hf_posenc
from hf_posenc.core.registry import adapter_for


# -- model classes -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_headless_base_model_is_patched_like_the_causal_lm(family):
    """Patching ``LlamaModel`` / ``MistralModel`` / ``GPT2Model`` gives the hidden states that the
    patched causal LM computes with the same weights."""
    lm = patch(make_model(family), "alibi", randomize=False)
    base = lm.base_model
    headless = type(base)(base.config)
    headless.load_state_dict(base.state_dict())
    headless.eval()
    hf_posenc.unpatch_model(lm)
    hf_posenc.patch_model(lm, "alibi")
    hf_posenc.patch_model(headless, "alibi")
    ids = token_ids(2, 10)
    with torch.no_grad():
        expected = lm(ids, output_hidden_states=True).hidden_states[-1]
        got = headless(ids).last_hidden_state
    assert torch.allclose(got, expected, atol=1e-5)
    assert hf_posenc.patch_info(headless)["encoding"] == "alibi"
    hf_posenc.unpatch_model(headless)


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("head", ["ForSequenceClassification", "ForQuestionAnswering"])
def test_head_classes_are_patched(family, head):
    import transformers

    lm = make_model(family)
    cls = getattr(transformers, type(lm).__name__.replace("ForCausalLM", head))
    config = copy.deepcopy(lm.config)
    config.pad_token_id = 0
    model = cls(config).eval()
    ids = token_ids(2, 10)
    with torch.no_grad():
        native = model(ids)[0]
    hf_posenc.patch_model(model, "alibi")
    with torch.no_grad():
        patched = model(ids)[0]
    assert not torch.allclose(native, patched)
    hf_posenc.unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(ids)[0], native)


@pytest.mark.parametrize("name", ["rope", "alibi", "learned", "expe"])
def test_gpt2_double_heads_with_choices(name):
    """``GPT2DoubleHeadsModel`` takes (batch, choices, T): each choice is encoded as if alone."""
    from transformers import GPT2DoubleHeadsModel

    lm = make_model("gpt2")
    model = GPT2DoubleHeadsModel(lm.config).eval()
    model.transformer.load_state_dict(lm.transformer.state_dict())
    hf_posenc.patch_model(model, name)
    ids = token_ids(6, 7).view(2, 3, 7)
    with torch.no_grad():
        out = model(ids).logits  # (2, 3, 7, vocab)
        alone = model(ids[1, 2][None, None]).logits[0, 0]
    assert out.shape == (2, 3, 7, VOCAB)
    assert torch.allclose(out[1, 2], alone, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("order", ["patch_then_peft", "peft_then_patch"])
def test_peft_wrapped_models(family, order):
    """Patch before or after ``get_peft_model``: the LoRA model runs patched, the encoding's
    parameters train, and unpatching restores the peft model's own outputs."""
    from peft import LoraConfig, get_peft_model

    model = make_model(family)
    # the attention projections among the family's LoRA targets: q/v, or the fused q/k/v
    # (GPT-2's c_attn Conv1D, Phi-3's qkv_proj)
    targets = [t for t in adapter_for(model).lora_targets if t in ("q_proj", "v_proj", "c_attn", "qkv_proj")]
    lora = LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
    ids = token_ids(2, 10)
    if order == "patch_then_peft":
        hf_posenc.patch_model(model, "t5")
        model = get_peft_model(model, lora)
        # peft freezes every non-LoRA parameter, the encoding's too; train it as the recipes do
        model.get_base_model().posenc.requires_grad_(True)
    else:
        model = get_peft_model(model, lora)
        native = logits(model, ids)
        hf_posenc.patch_model(model, "t5")
    assert hf_posenc.patch_info(model)["encoding"] == "t5"
    loss = model(ids, labels=ids).loss
    loss.backward()
    table = model.get_base_model().posenc.parameters().__next__()
    assert table.grad is not None and table.grad.abs().sum() > 0
    if order == "peft_then_patch":
        hf_posenc.unpatch_model(model)
        assert torch.equal(logits(model, ids), native)
