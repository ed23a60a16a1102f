"""NoPE: no positional encoding (Kazemnejad et al., 2023, "The Impact of Positional Encoding
on Length Generalization in Transformers"; Haviv et al., 2022).

    <q_i, k_j> = q_i^T k_j

Causal masking alone lets a decoder infer order. Patching removes the model's own
encoding (Llama/Mistral RoPE, GPT-2 ``wpe``) and adds nothing.
"""

from __future__ import annotations

import dataclasses

from ..core.config import EncodingConfig
from ..core.registry import register_encoding
from .base import Encoding


@dataclasses.dataclass
class NoPEConfig(EncodingConfig):
    encoding = "nope"
    native_positions = "none"
    scaling_refusal = "nope has no positions to interpolate (order comes from the causal mask alone)"


@register_encoding
class NoPE(Encoding[NoPEConfig]):
    name = "nope"
    reads_positions = False  # see Encoding.reads_positions
    aliases = ("none", "no_pe")
    config_class = NoPEConfig
    paper = "Kazemnejad et al. 2023, arXiv:2305.19466"
    summary = "no positional encoding; causal attention only"
