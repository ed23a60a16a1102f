"""xPos (Sun et al. 2023, "A Length-Extrapolatable Transformer", arXiv:2212.10554, Sec. 3): RoPE's
rotation with a per-dimension decay, scaled up on queries and down on keys,

    Q_t = diag(zeta^(t/gamma)) R(t),   K_t = diag(zeta^(-t/gamma)) R(t),
    zeta_i = (i / (d/2) + c) / (1 + c)   on pair (i, i + d/2)

so (Q_i q).(K_j k) carries zeta^((i - j)/gamma): a relative, decaying score. c is ``gamma`` and
gamma ``scale_base`` in the encoding's parameters; linear scaling divides both the angle and the
decay position by the factor, a frequency-only schedule (yarn) keeps the decay at t.
"""

from __future__ import annotations

import torch

from .attention import attention_layer
from .config import native_window
from .rope import reference_inv_freq, rotation_matrix


def xpos_matrices(
    position: float,
    inv_freq: list[float],
    head_dim: int,
    *,
    scale_base: float,
    gamma: float,
    decay_position: float,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """xPos (Sun et al. 2023, Sec. 3): (query map, key map) of one token. Pair i of the rotary dims
    is RoPE's rotation by ``position`` times zeta_i^(p/gamma) for queries and zeta_i^(-p/gamma) for
    keys, zeta_i = (i/(d/2) + c)/(1 + c) with c = ``gamma``, gamma = ``scale_base``, p = ``decay_position``."""
    half = len(inv_freq)
    rotation = rotation_matrix(position, inv_freq, head_dim, attention_factor)
    up = torch.ones(head_dim, dtype=torch.float64)
    down = torch.ones(head_dim, dtype=torch.float64)
    for i in range(half):
        zeta = (i / half + gamma) / (1 + gamma)
        for dim in (i, i + half):
            up[dim] = zeta ** (decay_position / scale_base)
            down[dim] = zeta ** (-decay_position / scale_base)
    return torch.diag(up) @ rotation, torch.diag(down) @ rotation


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64: softmax((Q_i q_i).(K_j k_j) * scale) v."""
    cfg = model.posenc.config  # the resolved defaults (theta: the model's) as parameters
    full = {**params, "theta": cfg.theta}
    length = hidden.shape[1]
    inv_freq, factor = reference_inv_freq(full, module.head_dim, seq_len=length)
    scaling = params.get("scaling") or {}
    divisor = scaling["factor"] if scaling.get("type") == "linear" else 1.0
    maps = {
        t: xpos_matrices(
            t,
            inv_freq,
            module.head_dim,
            scale_base=params.get("scale_base", 512.0),
            gamma=params.get("gamma", 0.4),
            decay_position=t / divisor,
            attention_factor=factor,
        )
        for t in range(length)
    }
    return attention_layer(
        module,
        hidden,
        softmax_scale=module.scaling,
        window=native_window(model, layer_idx),
        rotation=lambda t, i: maps[t][0],
        key_rotation=lambda t, i: maps[t][1],
    )
