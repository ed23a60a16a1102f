"""Phi-3 adapter (Abdin et al., 2024, "Phi-3 Technical Report", arXiv:2404.14219).

Llama's layout except for the fused projection ``qkv_proj`` (q, k, v concatenated on the
output dimension, no bias), a partial rotary dimension where the config sets
``partial_rotary_factor`` (Phi-3 checkpoints rotate the whole head; Phi-4-mini 3/4 of it),
a sliding window on every layer when ``sliding_window`` is set (the 4k checkpoints), and,
on the 128k checkpoints, ``longrope`` scaling (see :mod:`hf_posenc.encodings.rope_scaling`),
which ``patch_model(model, "rope")`` keeps. Residual dropout (``resid_pdrop``) sits in the
decoder layer, outside the attention the patch replaces, so it is kept.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .llama import LlamaAdapter
from .registry import register_family


@register_family
class Phi3Adapter(LlamaAdapter):
    family = "phi3"
    model_types = ("phi3",)
    lora_targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    attention_classes = ("Phi3Attention",)
    config_class_name = "Phi3Config"
    default_rope_reads_partial_factor = True  # Phi3RotaryEmbedding rotates head_dim * factor

    def check_supported(self, model: nn.Module) -> None:
        self.refuse_config_values(model.config, self.neutral_config)
        base = self.base_model(model)
        self.require_modules(base, ("layers", "rotary_emb"), "decoder stack")
        for layer in base.layers:
            self.require_modules(layer, ("self_attn",), "decoder layer")
            self.require_attention_class(layer.self_attn, self.attention_classes)
            self.require_modules(layer.self_attn, ("qkv_proj", "o_proj"), "attention")

    def project(self, module, x_qk, x_v):
        d, q_size = module.head_dim, module.config.num_attention_heads * module.head_dim
        kv_size = module.num_key_value_heads * d
        shape = (*x_qk.shape[:-1], -1, d)  # (B, T, H, D)
        qkv = module.qkv_proj(x_qk)  # (B, T, (Hq + 2 Hkv) * D)
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        if x_v is not x_qk:  # ExPE without the value override: v from the original input
            v = module.qkv_proj(x_v)[..., q_size + kv_size :]
        return (
            q.reshape(shape).transpose(1, 2),
            k.reshape(shape).transpose(1, 2),
            v.reshape(shape).transpose(1, 2),
        )

    def tiny_config(self, **kwargs: Any):
        config = super().tiny_config(**kwargs)
        config.original_max_position_embeddings = config.max_position_embeddings
        return config
