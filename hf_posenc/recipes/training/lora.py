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


def check_tied_embedding(model: nn.Module, kinds: list[str] | None) -> None:
    """Refuse ``--lora-trainable embed`` where peft cannot keep a tied input/output embedding tied: it
    ties a trained copy only for the names it knows (``embed_tokens``/``lm_head``); elsewhere (GPT-2's
    ``wte``) the output layer would keep the old embedding while the input learns a new one."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    if "embed" not in (kinds or []) or not getattr(model.config, "tie_word_embeddings", False):
        return
    embedding = model.get_input_embeddings()  # type: ignore[operator]
    name = next(n for n, m in model.named_modules() if m is embedding)
    if name.rsplit(".", 1)[-1] not in EMBEDDING_LAYER_NAMES:
        raise InvalidParameterError(
            f"train: --lora-trainable embed is not allowed on this {type(model).__name__}: its input embedding "
            f"{name!r} is tied to the output layer and peft keeps a trained copy tied only for "
            f"{'/'.join(EMBEDDING_LAYER_NAMES)}; allowed: --lora-trainable norm, or full training (no --lora)"
        )


def check_lora_of_config(model_path: str, targets: list[str] | None, trainable: list[str] | None) -> None:
    """:func:`check_lora_targets` and :func:`check_tied_embedding` before loading: the model built
    from its config.json on the meta device (no weights are read or allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    if targets:
        check_lora_targets(skeleton, targets)
    check_tied_embedding(skeleton, trainable)


def fully_trained_modules(model: nn.Module, kinds: list[str] | None) -> list[str]:
    """The full names of the modules LongLoRA trains beside its adapters (``--trainable_params
    embed,norm``): ``embed``, the input token embedding (transformers' ``get_input_embeddings``);
    ``norm``, every normalisation layer (a module whose class name ends in ``Norm``: LayerNorm,
    RMSNorm and the families' own). The patch's modules are not listed (they train fully anyway)."""
    kinds = kinds or []
    names = []
    embedding = model.get_input_embeddings() if "embed" in kinds else None  # type: ignore[operator]
    for name, module in model.named_modules():
        if not name or name.startswith("posenc") or ".posenc" in name:
            continue
        if module is embedding or ("norm" in kinds and type(module).__name__.endswith("Norm")):
            names.append(name)
    return names


def apply_lora(
    model: PreTrainedModel,
    *,
    r: int,
    alpha: int,
    dropout: float,
    targets: list[str] | None,
    trainable: list[str] | None = None,
) -> PeftModel:
    """Wrap ``model`` with LoRA adapters; the encoding (``model.posenc``) stays fully trainable, and so
    do the ``trainable`` kinds of :func:`fully_trained_modules` (peft's ``modules_to_save``: a trained
    copy of each, folded back by :func:`merge_lora`)."""
    from peft import LoraConfig, get_peft_model

    if targets:
        check_lora_targets(model, targets)
    check_tied_embedding(model, trainable)
    adapter = adapter_for(model)  # the family's default targets and weight layout
    modules_to_save = fully_trained_modules(model, trainable)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets or list(adapter.lora_targets),
        fan_in_fan_out=adapter.lora_fan_in_fan_out,
        task_type="CAUSAL_LM",
        modules_to_save=modules_to_save or None,
        # a trained copy of a tied input embedding stays tied to the output layer (peft >= 0.18)
        ensure_weight_tying=tied and "embed" in (trainable or []),
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
