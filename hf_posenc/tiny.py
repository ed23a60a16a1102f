"""Small random models of each supported family, built from a config (nothing downloaded).

Used by ``hf-posenc check`` and the test suite; handy for trying an encoding quickly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .errors import UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def tiny_model(
    family: str,
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 256,
    seed: int = 0,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A causal LM of ``family`` ('llama', 'mistral' or 'gpt2') with random weights, in eval mode.

    GPT-2 has no grouped-query attention, so ``num_kv_heads`` is ignored for it.
    ``config_overrides`` set any further config attribute (e.g. ``sliding_window=8``).
    """
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, PreTrainedConfig

    common: dict[str, Any] = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config: PreTrainedConfig
    if family == "gpt2":
        config = GPT2Config(
            n_embd=hidden_size, n_layer=num_layers, n_head=num_heads, n_positions=max_positions, **common
        )
    elif family in ("llama", "mistral"):
        config_class = LlamaConfig if family == "llama" else MistralConfig
        config = config_class(
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_positions,
            **common,
        )
    else:
        raise UnsupportedModelError(f"tiny_model: family {family!r} is not one of gpt2, llama, mistral")
    for key, value in config_overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()
