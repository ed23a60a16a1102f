"""Model-family adapters, registered by ``config.model_type``."""

from .base import FamilyAdapter, ModelGeometry
from .gpt2 import GPT2Adapter
from .llama import LlamaAdapter
from .mistral import MistralAdapter

__all__ = ["FamilyAdapter", "ModelGeometry", "GPT2Adapter", "LlamaAdapter", "MistralAdapter"]
