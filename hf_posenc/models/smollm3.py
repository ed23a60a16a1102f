"""SmolLM3 adapter (Hugging Face, 2025): Llama's layout with NoPE layers natively.

``config.no_rope_layers[i]`` is 1 where layer ``i`` rotates q/k and 0 where it uses no
positional encoding (every 4th layer by default, the "3:1 RoPE/NoPE" mix of Yang et al.,
2025, arXiv:2501.18795). ``LayerGeometry.native_rotary`` records it, and the ``rope`` encoding
rotates only on those layers, so ``patch_model(model, "rope")`` reproduces the native model.
Every *other* encoding replaces the positional encoding on every layer (a bias, a rotation or
an embedding has no notion of "NoPE layers"); to keep NoPE layers under another encoding,
pick encodings per layer. A sliding window (``use_sliding_window``, on the NoPE layers when
set) arrives in each layer's attention mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import LayerGeometry, describe_layers, export_rope_parameters
from .llama import LLAMA_NEUTRAL_CONFIG, LlamaAdapter, native_rope_scaling
from .registry import register_family

#: SmolLM3's native forward reads no_rope_layers itself
SMOLLM3_NEUTRAL_CONFIG = {k: v for k, v in LLAMA_NEUTRAL_CONFIG.items() if k != "no_rope_layers"}


@register_family
class SmolLM3Adapter(LlamaAdapter):
    family = "smollm3"
    model_types = ("smollm3",)
    attention_classes = ("SmolLM3Attention",)
    config_class_name = "SmolLM3Config"
    neutral_config = SMOLLM3_NEUTRAL_CONFIG

    def layer_geometry(self, config: Any, index: int, head_dim: int, rope_theta: float) -> LayerGeometry:
        """Native rotary from ``no_rope_layers``; a window only with ``use_sliding_window``."""
        sliding = bool(getattr(config, "use_sliding_window", False)) and (
            config.layer_types[index] == "sliding_attention"
        )
        return LayerGeometry(
            rope_theta=rope_theta,
            native_rotary=bool(config.no_rope_layers[index]),
            sliding_window=config.sliding_window if sliding else None,
            softmax_scale=head_dim**-0.5,
            rope_scaling=native_rope_scaling(config),
        )

    def export_positions(
        self,
        model: nn.Module,
        layers: list[tuple[str, str, dict[str, Any]]],
        tensors: dict[str, torch.Tensor],
    ) -> str | None:
        """RoPE and NoPE per layer: ``no_rope_layers`` (1 = rotate) and the RoPE layers' settings."""
        kinds = [kind for kind, _, _ in layers]
        if not set(kinds) <= {"rotary", "none"}:
            return f"its native configuration has RoPE or NoPE per layer, not {describe_layers(layers)}"
        # rope rotates where the native model does (all layers when none does), as the encoding decides
        config: Any = model.config
        native = [bool(flag) for flag in config.no_rope_layers]
        rotates = [kind == "rotary" and (native[i] or not any(native)) for i, kind in enumerate(kinds)]
        config.no_rope_layers = [int(flag) for flag in rotates]
        rope = [params for kind, _, params in layers if kind == "rotary"]
        return export_rope_parameters(config, rope, self.geometry(config))

    def tiny_config(self, **sizes):
        """Every other layer is NoPE (the checkpoints: every 4th), so two layers hold one of each."""
        config = super().tiny_config(**sizes)
        num_layers = config.num_hidden_layers
        config.no_rope_layers = [int(i % 2 == 0) for i in range(num_layers)]
        return config
