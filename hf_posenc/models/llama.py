"""Llama adapter (also the base of Mistral): separate q/k/v/o projections, RoPE at model level."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import FamilyAdapter, ModelGeometry, Undo, native_rope_scaling, replace_forward


def _rope_setting(config: Any, key: str, default: Any) -> Any:
    params = getattr(config, "rope_parameters", None) or {}
    if key in params and params[key] is not None:
        return params[key]
    value = getattr(config, key, None)
    return default if value is None else value


def _no_rotary(hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None, **_: Any):
    """Stand-in for the model's rotary module: the patched attention ignores its output."""
    return None, None


class LlamaAdapter(FamilyAdapter):
    family = "llama"
    model_types = ("llama",)

    def geometry(self, config: Any) -> ModelGeometry:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return ModelGeometry(
            family=self.family,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rope_theta=float(_rope_setting(config, "rope_theta", 10000.0)),
            partial_rotary_factor=float(_rope_setting(config, "partial_rotary_factor", 1.0)),
            rope_scaling=native_rope_scaling(config),
        )

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [layer.self_attn for layer in self.base_model(model).layers]

    def neutralize_native_positions(self, model: nn.Module) -> list[Undo]:
        return [replace_forward(self.base_model(model).rotary_emb, _no_rotary)]

    def project(self, module, x_qk, x_v):
        shape = (*x_qk.shape[:-1], -1, module.head_dim)  # (B, T, H, D)
        q = module.q_proj(x_qk).view(shape).transpose(1, 2)
        k = module.k_proj(x_qk).view(shape).transpose(1, 2)
        v = module.v_proj(x_v).view(shape).transpose(1, 2)
        return q, k, v

    def output(self, module, attn):
        return module.o_proj(attn)

    def dropout_p(self, module) -> float:
        return module.attention_dropout if module.training else 0.0
