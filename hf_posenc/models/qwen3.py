"""Qwen3 adapter: Llama's layout with a per-head RMSNorm on queries and keys before RoPE
(Qwen Team, "Qwen3 Technical Report", arXiv:2505.09388, 2025):

    q_h = RMSNorm_q(x W_q^T |head h),   k_h = RMSNorm_k(x W_k^T |head h)   (weights of size head_dim)

then RoPE. The norm is part of the family's projection: every encoding's position-dependent
stages act where native RoPE acts, after it. ``rotate`` encodings (RoPE and its relatives)
rotate the normalised q/k, as Qwen3 itself does; ExPE/ExQPE overwrite the leading dims of the
hidden state *entering* the projections (the paper's phi(x, n) acts on x before W_q, W_k), so
their position codes pass through the projection and its norm; score-bias encodings add to
the logits of the normalised q.k. Optional q/k/v/o biases (``attention_bias``) are applied by
the projections.
"""

from __future__ import annotations

from .llama import LlamaAdapter
from .registry import register_family


@register_family
class Qwen3Adapter(LlamaAdapter):
    family = "qwen3"
    model_types = ("qwen3",)
    attention_classes = ("Qwen3Attention",)
    config_class_name = "Qwen3Config"
    qk_norm = "head"

    def tiny_config(self, *, hidden_size, num_heads, **sizes):
        config = super().tiny_config(hidden_size=hidden_size, num_heads=num_heads, **sizes)
        config.head_dim = hidden_size // num_heads  # Qwen3Config's default is 128 whatever the width
        return config
