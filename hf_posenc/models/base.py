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


class FamilyAdapter:
    """Base class of a model-family adapter. Subclasses fill in every method."""

    family: str = ""
    model_types: tuple[str, ...] = ()

    def check_supported(self, model: nn.Module) -> None:
        """Raise :class:`UnsupportedModelError` for a variant of the family we cannot patch."""

    def geometry(self, config: Any) -> ModelGeometry:
        raise NotImplementedError

    def base_model(self, model: nn.Module) -> nn.Module:
        """The decoder stack (``model.model`` / ``model.transformer``) whose forward sees positions."""
        raise NotImplementedError

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


def replace_forward(module: nn.Module, new_forward: Callable[..., Any]) -> Undo:
    """Route ``module``'s calls to ``new_forward`` for this instance only; return the undo.

    When accelerate has wrapped the module (``_old_forward`` set by a device-map hook), the
    wrapped inner forward is replaced so the hook keeps moving tensors between devices.
    """
    attr = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
    had_instance_attr = attr in module.__dict__
    previous = module.__dict__.get(attr)
    setattr(module, attr, new_forward)

    def undo() -> None:
        if had_instance_attr:
            setattr(module, attr, previous)
        else:
            delattr(module, attr)

    return undo


def freeze_parameters(module: nn.Module) -> Undo:
    """Stop gradients (and so weight decay) reaching parameters that the patch bypasses."""
    previous = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in previous:
        p.requires_grad_(False)

    def undo() -> None:
        for p, flag in previous:
            p.requires_grad_(flag)

    return undo
