"""Mistral adapter: Llama's layout; the sliding window arrives in the attention mask."""

from __future__ import annotations

from .llama import LlamaAdapter
from .registry import register_family


@register_family
class MistralAdapter(LlamaAdapter):
    family = "mistral"
    model_types = ("mistral",)
    attention_classes = ("MistralAttention",)
    config_class_name = "MistralConfig"
    #: a window shorter than most test inputs, so the tests see it act
    test_config_overrides = {"sliding_window": 8}
