"""LoRA adapters (peft) on the base weights while the encoding's own parameters train fully."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ...core.registry import adapter_for

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


def apply_lora(
    model: PreTrainedModel, *, r: int, alpha: int, dropout: float, targets: list[str] | None
) -> PeftModel:
    """Wrap ``model`` with LoRA adapters; the encoding (``model.posenc``) stays fully trainable."""
    from peft import LoraConfig, get_peft_model

    adapter = adapter_for(model)  # the family's default targets and weight layout
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets or list(adapter.lora_targets),
        fan_in_fan_out=adapter.lora_fan_in_fan_out,
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
