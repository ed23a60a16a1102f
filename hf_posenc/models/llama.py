"""Llama adapter (also the base of the other Llama-layout families): separate q/k/v/o
projections (biases when the config has them), RoPE computed once at model level
(``rotary_emb``) and applied inside each attention module, which the patch replaces.

A subclass for a Llama-layout family sets ``model_types``, ``attention_classes`` (the classes
whose ``forward`` it reproduces), ``config_class_name`` and, where the family has them,
``qk_norm`` ("head": an RMSNorm over each head's dims after the reshape, Qwen3;
"projection": one over the whole projection before the reshape, OLMo 2).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from .base import (
    FamilyAdapter,
    LayerGeometry,
    ModelGeometry,
    Undo,
    native_rope_scaling,
    replace_forward,
)
from .registry import register_family

#: config values a Llama-layout attention/embedding does not apply: anything else is refused
LLAMA_NEUTRAL_CONFIG: dict[str, tuple[Any, ...]] = {
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,),
    "embedding_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "logits_scaling": (None, 1, 1.0),
    "scale_embedding": (None, False),
    "use_qk_norm": (None, False),
    "qk_layernorm": (None, False),
    "no_rope_layers": (None,),
}


def rope_setting(config: Any, key: str, default: Any) -> Any:
    """``key`` from transformers 5 ``config.rope_parameters``, else the config attribute, else ``default``."""
    params = getattr(config, "rope_parameters", None) or {}
    if key in params and params[key] is not None:
        return params[key]
    value = getattr(config, key, None)
    return default if value is None else value


def _no_rotary(hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None, **_: Any):
    """Stand-in for the model's rotary module: the patched attention ignores its output."""
    return None, None


@register_family
class LlamaAdapter(FamilyAdapter):
    family = "llama"
    model_types = ("llama",)
    lora_targets: ClassVar[tuple[str, ...]] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    #: classes whose attention ``forward`` this adapter reproduces
    attention_classes: ClassVar[tuple[str, ...]] = ("LlamaAttention",)
    #: the transformers config class of ``tiny_config``
    config_class_name: ClassVar[str] = "LlamaConfig"
    #: None, "head" (per-head RMSNorm after the reshape) or "projection" (before the reshape)
    qk_norm: ClassVar[str | None] = None
    #: config values this family's native forward does not apply (refused unless neutral)
    neutral_config: ClassVar[dict[str, tuple[Any, ...]]] = LLAMA_NEUTRAL_CONFIG
    #: whether the family's unscaled ("default") RoPE rotates only ``partial_rotary_factor`` of
    #: each head (Phi-3); Llama's ignores the factor and rotates the whole head, while
    #: transformers' scaled types (linear, yarn, ...) read it in every family
    default_rope_reads_partial_factor: ClassVar[bool] = False

    def check_supported(self, model: nn.Module) -> None:
        self.refuse_config_values(model.config, self.neutral_config)
        base = self.base_model(model)
        self.require_modules(base, ("layers", "rotary_emb"), "decoder stack")
        for layer in base.layers:
            self.require_modules(layer, ("self_attn",), "decoder layer")
            attention = layer.self_attn
            self.require_attention_class(attention, self.attention_classes)
            self.require_modules(attention, ("q_proj", "k_proj", "v_proj", "o_proj"), "attention")
            has_norm = [
                name for name in ("q_norm", "k_norm") if isinstance(getattr(attention, name, None), nn.Module)
            ]
            if self.qk_norm is None and has_norm:
                self.refuse("q/k norm module", has_norm[0])
            if self.qk_norm is not None and len(has_norm) < 2:
                self.refuse(f"qk_norm={self.qk_norm!r} attention without", "q_norm/k_norm")

    def layer_geometry(self, config: Any, index: int, head_dim: int, rope_theta: float) -> LayerGeometry:
        """Layer ``index``: a window where ``layer_types`` says "sliding_attention" (or, with no
        ``layer_types``, the config's ``sliding_window`` on every layer, as Mistral)."""
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types is not None and layer_types[index] != "sliding_attention":
            window = None
        return LayerGeometry(
            rope_theta=rope_theta,
            sliding_window=window,
            softmax_scale=head_dim**-0.5,
            rope_scaling=native_rope_scaling(config),
        )

    def geometry(self, config: Any) -> ModelGeometry:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        theta = float(rope_setting(config, "rope_theta", 10000.0))
        return ModelGeometry(
            family=self.family,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rope_theta=theta,
            partial_rotary_factor=self.partial_rotary_factor(config),
            rope_scaling=native_rope_scaling(config),
            layers=tuple(
                self.layer_geometry(config, i, head_dim, theta) for i in range(config.num_hidden_layers)
            ),
        )

    def partial_rotary_factor(self, config: Any) -> float:
        """The fraction of each head the native model rotates: the config's
        ``partial_rotary_factor`` where the native rotary module reads it (a scaled type, or a
        family whose default RoPE does), else the whole head."""
        if native_rope_scaling(config) is None and not self.default_rope_reads_partial_factor:
            return 1.0
        return float(rope_setting(config, "partial_rotary_factor", 1.0))

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [layer.self_attn for layer in self.base_model(model).layers]

    def neutralize_native_positions(self, model: nn.Module) -> list[Undo]:
        return [replace_forward(self.base_model(model).rotary_emb, _no_rotary)]

    def project(self, module, x_qk, x_v):
        shape = (*x_qk.shape[:-1], -1, module.head_dim)  # (B, T, H, D)
        q, k = module.q_proj(x_qk), module.k_proj(x_qk)  # (B, T, Hq*D), (B, T, Hkv*D)
        if self.qk_norm == "projection":
            q, k = module.q_norm(q), module.k_norm(k)
        q, k = q.view(shape), k.view(shape)  # (B, T, H, D)
        if self.qk_norm == "head":
            q, k = module.q_norm(q), module.k_norm(k)
        v = module.v_proj(x_v).view(shape)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def output(self, module, attn):
        return module.o_proj(attn)

    def dropout_p(self, module) -> float:
        return module.attention_dropout if module.training else 0.0

    def tiny_config(
        self, *, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, max_positions, **special_tokens
    ):
        import transformers

        config_class = getattr(transformers, self.config_class_name)
        return config_class(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_positions,
            **special_tokens,
        )
