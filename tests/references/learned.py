"""Learned absolute positions (GPT-2's ``wpe``; Radford et al. 2019): a trained table row P[n] added
to the token embedding of position n. The table itself is the reference (its rows are read
directly); attention is left as it is.
"""

from __future__ import annotations

from .attention import attention_layer
from .config import native_window


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64: plain causal attention (the positions are already in ``hidden``)."""
    return attention_layer(
        module, hidden, softmax_scale=module.scaling, window=native_window(model, layer_idx)
    )
