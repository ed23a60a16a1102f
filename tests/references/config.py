"""What a model's config states about its own attention, read for the references: the sliding
window of a layer, the number of query heads, the native RoPE of a layer. Read from the Hugging
Face config as written, never from hf_posenc's family adapters (the code under test)."""

from __future__ import annotations

import torch


def native_window(model: torch.nn.Module, layer: int = 0) -> int | None:
    """The sliding window of ``layer`` as the config states it (``layer_types`` when present)."""
    config = model.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer] != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None)


def num_query_heads(model: torch.nn.Module) -> int:
    """Query heads per layer, as the config states them."""
    config = model.config
    return getattr(config, "num_attention_heads", None) or config.n_head


def native_rope(model: torch.nn.Module, layer_idx: int) -> tuple[float, bool]:
    """(theta, rotates) of layer ``layer_idx`` as the config states them: Gemma 3 nests
    ``rope_parameters`` by layer type; SmolLM3's ``no_rope_layers`` is 0 on its NoPE layers."""
    config = model.config
    params = getattr(config, "rope_parameters", None) or {}
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] in params:
        params = params[layer_types[layer_idx]]
    no_rope_layers = getattr(config, "no_rope_layers", None)
    rotates = no_rope_layers is None or bool(no_rope_layers[layer_idx])
    return float(params.get("rope_theta", 10000.0)), rotates
