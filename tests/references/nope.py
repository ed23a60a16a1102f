"""NoPE (Kazemnejad et al. 2023): no positional information; causal attention alone orders tokens.

out_i = sum_{j <= i} softmax_j(q_i . k_j * scale) v_j
"""

from __future__ import annotations

from .attention import attention_layer
from .config import native_window


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64: plain causal softmax attention (the model's sliding window kept)."""
    return attention_layer(
        module, hidden, softmax_scale=module.scaling, window=native_window(model, layer_idx)
    )
