"""Small random models of each supported family, built from a config (nothing downloaded).

Used by ``hf-posenc check`` and the test suite; handy for trying an encoding quickly. Each
family's config comes from its adapter (``FamilyAdapter.tiny_config``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def tiny_config(
    family: str,
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 256,
    **config_overrides: Any,
) -> Any:
    """The config :func:`tiny_model` builds its model from (the family adapter's
    ``tiny_config`` with the special tokens 0, 1, 2 and ``config_overrides`` set on it)."""
    from ..core.registry import get_family

    config = get_family(family).tiny_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_positions=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    for key, value in config_overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(family: str, *, seed: int = 0, **config_arguments: Any) -> PreTrainedModel:
    """A causal LM of ``family`` (see ``hf_posenc.supported_families()``) with random weights
    (``torch.manual_seed(seed)``), in eval mode, built from ``tiny_config(family,
    **config_arguments)``: the shape (``vocab_size``, ``hidden_size``, ``num_layers``,
    ``num_heads``, ``num_kv_heads``, ``max_positions``) and any further config attribute (e.g.
    ``sliding_window=8``). Families without grouped-query attention ignore ``num_kv_heads``.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **config_arguments)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()
