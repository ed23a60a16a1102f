"""RoPE (Su et al. 2021, "RoFormer"): q and k of token t rotate pair (i, i + d_rot/2) of their
first d_rot dims (Llama's layout) by the angle t * omega_i, omega_i = theta^(-2i / d_rot):

    q_t -> R(t) q_t,  k_t -> R(t) k_t,   so  (R(i) q_i) . (R(j) k_j) depends on i - j only.

Linear interpolation divides omega by the factor; causal dynamic NTK gives query i the
frequencies for length i + 1; YaRN and dynamic frequencies come from transformers' own
``ROPE_INIT_FUNCTIONS`` (the published implementations), the rest is the formula.
"""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .attention import attention_layer
from .config import native_rope, native_window


def rotation_matrix(
    position: float, inv_freq: list[float], head_dim: int, attention_factor: float = 1.0
) -> torch.Tensor:
    """RoPE's block rotation acting on pairs (i, i + d_rot/2) of the first d_rot dims (Llama layout)."""
    rotary = 2 * len(inv_freq)
    half = rotary // 2
    matrix = torch.eye(head_dim, dtype=torch.float64)
    for i, omega in enumerate(inv_freq):
        c, s = math.cos(position * omega) * attention_factor, math.sin(position * omega) * attention_factor
        matrix[i, i], matrix[i, i + half] = c, -s
        matrix[i + half, i], matrix[i + half, i + half] = s, c
    return matrix


def reference_inv_freq(params: dict, head_dim: int, seq_len: int) -> tuple[list[float], float]:
    """RoPE frequencies: the formula for plain/linear/ntk, transformers' own functions for the rest."""
    theta = params.get("theta", 10000.0)
    rotary = int(head_dim * params.get("partial_rotary_factor", 1.0))
    scaling = params.get("scaling")
    plain = [theta ** (-2 * i / rotary) for i in range(rotary // 2)]
    if scaling is None:
        return plain, 1.0
    if scaling["type"] == "linear":
        return [w / scaling["factor"] for w in plain], 1.0
    original = scaling["original_max_position_embeddings"]
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=original,
        rope_parameters={
            "rope_type": scaling["type"],
            "rope_theta": theta,
            "factor": scaling["factor"],
            "original_max_position_embeddings": original,
        },
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["type"]](config, None, seq_len)
    return inv_freq.double().tolist(), float(factor)


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64: softmax((R q_i).(R k_j) * scale) v with R from the formula; theta
    defaults to the layer's native theta, and a natively position-free layer (SmolLM3's NoPE
    layers) stays position-free."""
    kwargs = dict(softmax_scale=module.scaling, window=native_window(model, layer_idx))
    theta, rotates = native_rope(model, layer_idx)
    if not rotates:
        return attention_layer(module, hidden, **kwargs)
    params = {"theta": theta, **params}
    length = hidden.shape[1]
    # causal dynamic NTK: query i uses the frequencies for length i + 1; others: one schedule
    dynamic = (params.get("scaling") or {}).get("type") == "dynamic"
    matrices = {}
    for i in range(length):
        inv_freq, factor = reference_inv_freq(params, module.head_dim, seq_len=i + 1 if dynamic else length)
        for t in range(i + 1):
            matrices[t, i] = rotation_matrix(t, inv_freq, module.head_dim, factor)
    return attention_layer(module, hidden, rotation=lambda t, i: matrices[t, i], **kwargs)
