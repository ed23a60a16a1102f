"""Mistral adapter: Llama's layout; the sliding window arrives in the attention mask."""

from __future__ import annotations

from .llama import LlamaAdapter


class MistralAdapter(LlamaAdapter):
    family = "mistral"
    model_types = ("mistral",)
