"""Qwen2 adapter: Llama's layout with biases on the q, k and v projections (Qwen Team,
"Qwen2 Technical Report", arXiv:2407.10671, 2024), and optional sliding-window layers
(``use_sliding_window``: the layers ``layer_types`` marks "sliding_attention").

The biases are part of the projection (``q = x W_q^T + b_q``), applied before positions enter,
so an encoding sees the same q, k, v as native RoPE does; the per-layer window arrives in each
layer's attention mask and is recorded in ``geometry.layers``.
"""

from __future__ import annotations

from .llama import LlamaAdapter
from .registry import register_family


@register_family
class Qwen2Adapter(LlamaAdapter):
    family = "qwen2"
    model_types = ("qwen2",)
    attention_classes = ("Qwen2Attention",)
    config_class_name = "Qwen2Config"
    #: a hybrid stack for the tests: layer 0 full attention, layer 1 a window of 8
    test_config_overrides = {
        "use_sliding_window": True,
        "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention"],
    }
