"""Gemma 3 adapter (text models, ``Gemma3ForCausalLM``; Gemma Team, 2025, arXiv:2503.19786).

Llama's layout with four Gemma peculiarities, each reproduced from the config:

- **local and global layers** (``layer_types``): sliding-window layers rotate with
  ``rope_parameters["sliding_attention"]`` (theta 10k) and global ones with
  ``rope_parameters["full_attention"]`` (theta 1M, linear scaling on the 4B-27B checkpoints);
  each layer's theta and scaling are in its ``LayerGeometry``, which ``rope`` reads, and its
  window arrives in the layer's attention mask.
- **softmax scale** ``query_pre_attn_scalar**-0.5``: the attention module's own ``scaling``,
  which every backend uses.
- **q/k norm**: a per-head RMSNorm on q and k right after the projections, *before* positions
  enter (as the native forward, and the paper, apply it before RoPE). Every encoding's
  stages therefore see normed q/k: ``adjust_qkv``/``rotate`` act on them, and ExPE's
  ``layer_input`` override changes the input of the projections, so its positional part
  also passes through the norm (what the family's own code implies for anything added to
  the projection input).
- **embedding scale** sqrt(hidden), applied inside ``Gemma3TextScaledWordEmbedding``; an
  encoding's ``embed`` stage (sinusoidal, learned) adds to the *scaled* embeddings.

Score biases (ALiBi, T5, FoX, ...) are added to the scaled logits on every layer, sliding or
not; the sliding window still masks, and stateful encodings (FoX) keep their decoding state
per layer on the cache, whose sliding layers keep only their window. Refused in one line:
``attn_logit_softcapping`` (a tanh cap on the scores that no backend applies; every Gemma 3
checkpoint has it off) and ``use_bidirectional_attention`` (EmbeddingGemma). The final logit
soft-cap lives in the LM head, which the patch does not touch, so it is kept; perplexity then
reads the model's own logits (``plain_lm_head = False``). The multimodal
``Gemma3ForConditionalGeneration`` (model type ``gemma3``) is not served.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from .base import LayerGeometry, ModelGeometry, Undo, native_rope_scaling, replace_forward
from .llama import LLAMA_NEUTRAL_CONFIG, LlamaAdapter
from .registry import register_family

#: Gemma 3 applies query_pre_attn_scalar and the final soft-cap itself; these must stay neutral
GEMMA3_NEUTRAL_CONFIG: dict[str, tuple[Any, ...]] = {
    **{
        k: v
        for k, v in LLAMA_NEUTRAL_CONFIG.items()
        if k not in ("query_pre_attn_scalar", "final_logit_softcapping")
    },
    "use_bidirectional_attention": (None, False),
}


def _no_rotary_per_type(
    hidden_states: torch.Tensor, position_ids: Any = None, layer_type: Any = None, **_: Any
):
    """Stand-in for Gemma 3's rotary module (called once per layer type): its output is ignored."""
    return None, None


def layer_rope_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    """The ``rope_parameters`` of one layer type (transformers 5 nests them by layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    return dict(params.get(layer_type) or {}) if layer_type in params else dict(params)


@register_family
class Gemma3Adapter(LlamaAdapter):
    family = "gemma3"
    model_types = ("gemma3_text",)
    attention_classes = ("Gemma3Attention",)
    config_class_name = "Gemma3TextConfig"
    qk_norm = "head"
    neutral_config = GEMMA3_NEUTRAL_CONFIG
    plain_lm_head = False  # final_logit_softcapping may follow lm_head
    #: a window shorter than most test inputs, so the tests see local and global layers differ
    test_config_overrides = {"sliding_window": 8}

    def geometry(self, config: Any) -> ModelGeometry:
        heads = config.num_attention_heads
        head_dim = config.head_dim
        layers = []
        for layer_type in config.layer_types:
            params = layer_rope_parameters(config, layer_type)
            sliding = layer_type == "sliding_attention"
            layers.append(
                LayerGeometry(
                    rope_theta=float(params.get("rope_theta", 10000.0)),
                    sliding_window=config.sliding_window if sliding else None,
                    softmax_scale=config.query_pre_attn_scalar**-0.5,
                    rope_scaling=self._scaling(config, params),
                )
            )
        # model-wide values: the global layers' (what encodings without per-layer settings read),
        # the local ones' in a model with no global layer (fewer layers than its sliding pattern)
        wide_type = "full_attention" if "full_attention" in config.layer_types else "sliding_attention"
        global_params = layer_rope_parameters(config, wide_type)
        return ModelGeometry(
            family=self.family,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rope_theta=float(global_params.get("rope_theta", 10000.0)),
            partial_rotary_factor=1.0,
            rope_scaling=self._scaling(config, global_params),
            embedding_scale=config.hidden_size**0.5,
            layers=tuple(layers),
        )

    @staticmethod
    def _scaling(config: Any, params: dict[str, Any]) -> dict[str, Any] | None:
        view = types.SimpleNamespace(
            rope_parameters=params, max_position_embeddings=config.max_position_embeddings
        )
        return native_rope_scaling(view)

    def neutralize_native_positions(self, model: nn.Module) -> list[Undo]:
        return [replace_forward(self.base_model(model).rotary_emb, _no_rotary_per_type)]

    def tiny_config(
        self, *, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, max_positions, **special_tokens
    ):
        """Alternating local (sliding) and global layers, a head_dim of hidden/heads and a
        ``query_pre_attn_scalar`` different from head_dim (so the tests see it act)."""
        from transformers import Gemma3TextConfig

        head_dim = hidden_size // num_heads
        return Gemma3TextConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            query_pre_attn_scalar=2 * head_dim,
            max_position_embeddings=max_positions,
            sliding_window=max(4, max_positions // 4),
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
            **special_tokens,
        )
