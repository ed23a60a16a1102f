"""LoRA adapters (peft) on the base weights while the encoding's own parameters train fully."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ...core.registry import adapter_for
from ...errors import InvalidParameterError

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


#: module types peft's LoRA wraps (by class name: transformers' GPT-2 ``Conv1D`` included)
LORA_MODULE_TYPES = ("Linear", "Conv1D", "Embedding", "Conv1d", "Conv2d", "Conv3d")


def lora_module_names(model: nn.Module) -> list[str]:
    """The names LoRA targets match in ``model``: the last component of each wrappable module's
    name (``q_proj``, ``c_attn``, ...), sorted. The patch's own modules are not targets."""
    names = set()
    for name, module in model.named_modules():
        if type(module).__name__ in LORA_MODULE_TYPES and name and not name.startswith("posenc"):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def check_lora_targets(model: nn.Module, targets: list[str]) -> None:
    """Refuse, in one line naming them and the model's module names, targets that match no module
    (peft would raise for all of them missing and ignore some missing silently)."""
    available = lora_module_names(model)
    missing = [t for t in targets if t not in available]
    if missing:
        raise InvalidParameterError(
            f"train: --lora-targets {', '.join(map(repr, missing))} match no module of this "
            f"{type(model).__name__}; allowed: {', '.join(available)}"
        )


def check_lora_targets_of_config(model_path: str, targets: list[str]) -> None:
    """:func:`check_lora_targets` before loading: the model built from its config.json on the meta
    device (no weights are read or allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    check_lora_targets(skeleton, targets)


def apply_lora(
    model: PreTrainedModel, *, r: int, alpha: int, dropout: float, targets: list[str] | None
) -> PeftModel:
    """Wrap ``model`` with LoRA adapters; the encoding (``model.posenc``) stays fully trainable."""
    from peft import LoraConfig, get_peft_model

    if targets:
        check_lora_targets(model, targets)
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
