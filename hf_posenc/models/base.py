"""What the engine needs to know about a model family, and nothing about encodings.

An adapter finds a family's attention modules and embeddings, projects hidden states to
q/k/v with the family's own weights, applies its output projection, and neutralises its
native positional encoding (RoPE for Llama/Mistral, ``wpe`` for GPT-2) in a reversible way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Undo = Callable[[], None]


@dataclasses.dataclass(frozen=True)
class ModelGeometry:
    """Shapes and native positional settings of one model, read from its config."""

    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    partial_rotary_factor: float
    #: the checkpoint's own RoPE scaling in hf_posenc's form ({"type": ..., ...}), None: unscaled
    rope_scaling: dict[str, Any] | None = None
    #: whether the model has a learned absolute position table of its own (GPT-2's ``wpe``)
    learned_position_table: bool = False


class FamilyAdapter:
    """Base class of a model-family adapter. Subclasses fill in every method."""

    family: str = ""
    model_types: tuple[str, ...] = ()

    def check_supported(self, model: nn.Module) -> None:
        """Raise :class:`UnsupportedModelError` for a variant of the family we cannot patch."""

    def geometry(self, config: Any) -> ModelGeometry:
        raise NotImplementedError

    def base_model(self, model: nn.Module) -> Any:
        """The decoder stack whose forward sees positions: ``model.model`` / ``model.transformer``
        under any head class (transformers' ``base_model`` follows ``base_model_prefix``), or the
        model itself when it is the headless stack (``LlamaModel``, ``GPT2Model``)."""
        return model.base_model

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """Self-attention modules in layer order."""
        raise NotImplementedError

    def neutralize_native_positions(self, model: nn.Module) -> list[Undo]:
        """Switch off the family's own positional encoding; return the undo actions."""
        raise NotImplementedError

    def project(
        self, module: nn.Module, x_qk: torch.Tensor, x_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B,Hq,T,D), k (B,Hkv,T,D), v (B,Hkv,T,D) from the inputs (B,T,hidden)."""
        raise NotImplementedError

    def output(self, module: nn.Module, attn: torch.Tensor) -> torch.Tensor:
        """Output projection of the merged heads (B,T,Hq*D) -> (B,T,hidden)."""
        raise NotImplementedError

    def dropout_p(self, module: nn.Module) -> float:
        raise NotImplementedError

    def native_position_table(self, model: nn.Module) -> torch.Tensor:
        """The model's own learned position table (n_positions, hidden), for families that have one."""
        raise NotImplementedError(f"{self.family} models have no learned position table")


class RestoreAttribute:
    """Undo action: put back (or delete) one instance attribute.

    A plain object rather than a closure, so ``copy.deepcopy`` and pickling of the model
    carry it along pointing at the copy's own module (a closure would keep the original)."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner = owner
        self.name = name
        self.had = name in owner.__dict__
        self.previous = owner.__dict__.get(name)

    def __call__(self) -> None:
        if self.had:
            setattr(self.owner, self.name, self.previous)
        else:
            self.owner.__dict__.pop(self.name, None)


#: keys of transformers' ``rope_parameters`` that are not part of the scaling itself
_ROPE_BASE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def native_rope_scaling(config: Any) -> dict[str, Any] | None:
    """The checkpoint's own RoPE scaling (transformers 5 ``config.rope_parameters``) as a
    ``{"type": ..., ...}`` dict, or None when unscaled. Every key is passed on (the rope
    encoding validates them, so a type or key it does not implement, e.g. ``longrope``, is
    refused by name rather than dropped); the original length follows transformers: dynamic
    NTK grows from ``max_position_embeddings``, yarn and llama3 default to it."""
    params = getattr(config, "rope_parameters", None) or {}
    legacy = getattr(config, "rope_scaling", None) if not params else None
    params = dict(params or legacy or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    out: dict[str, Any] = {"type": kind}
    out.update({k: v for k, v in params.items() if k not in _ROPE_BASE_KEYS and v is not None})
    if kind == "linear":  # transformers' linear scaling ignores it (configs may carry one anyway)
        out.pop("original_max_position_embeddings", None)
    elif kind == "dynamic":
        out["original_max_position_embeddings"] = config.max_position_embeddings
    elif kind in ("yarn", "llama3"):
        out.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return out


def replace_forward(module: nn.Module, new_forward: Callable[..., Any]) -> Undo:
    """Route ``module``'s calls to ``new_forward`` for this instance only; return the undo.

    When accelerate has wrapped the module (``_old_forward`` set by a device-map hook), the
    wrapped inner forward is replaced so the hook keeps moving tensors between devices.
    ``new_forward`` should be a picklable callable object (not a closure) so that copies of
    the model get their own.
    """
    attr = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
    undo = RestoreAttribute(module, attr)
    setattr(module, attr, new_forward)
    return undo


class RestoreRequiresGrad:
    """Undo action: give parameters back their ``requires_grad`` flags."""

    def __init__(self, module: nn.Module) -> None:
        self.flags = [(p, p.requires_grad) for p in module.parameters()]

    def __call__(self) -> None:
        for p, flag in self.flags:
            p.requires_grad_(flag)


def freeze_parameters(module: nn.Module) -> Undo:
    """Stop gradients (and so weight decay) reaching parameters that the patch bypasses."""
    undo = RestoreRequiresGrad(module)
    for p, _ in undo.flags:
        p.requires_grad_(False)
    return undo
