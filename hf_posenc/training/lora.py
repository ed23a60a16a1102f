"""LoRA adapters (peft) on the base weights while the encoding's own parameters train fully."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

DEFAULT_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
}


def apply_lora(
    model: PreTrainedModel, *, r: int, alpha: int, dropout: float, targets: list[str] | None
) -> PeftModel:
    """Wrap ``model`` with LoRA adapters; the encoding (``model.posenc``) stays fully trainable."""
    from peft import LoraConfig, get_peft_model

    family = model.config.model_type
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets or DEFAULT_TARGETS[family],
        fan_in_fan_out=family == "gpt2",  # GPT-2's Conv1D stores weights transposed
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(model, config)
    encoding = getattr(model, "posenc", None)
    if encoding is not None:
        for parameter in encoding.parameters():
            parameter.requires_grad_(True)
    return wrapped


def merge_lora(model: PeftModel) -> nn.Module:
    """Fold the adapters into the base weights: a plain (patched) model that saves and reloads."""
    return model.merge_and_unload()
