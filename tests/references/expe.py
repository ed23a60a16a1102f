"""ExPE (Datseris et al. 2025, "ExPE: Exact Positional Encodings for Generative Transformer
Models with Extrapolating Capabilities", eq. 3): the first l dims of the q/k input of token n
are overwritten with (p_n, ..., p_{n+l-1}), p_m = S + theta * m (position part divided by a
linear scaling factor); optionally the value input too.
"""

from __future__ import annotations

from .attention import attention_layer
from .config import native_window


def expe_values(n: int, l: int, S: float, theta: float, factor: float = 1.0) -> list[float]:  # noqa: E741, N803
    """ExPE eq. 3: (p_n, ..., p_{n+l-1}) with p_m = S + theta*m, position part divided by factor."""
    return [S + theta * (n + j) / factor for j in range(l)]


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64, with the q/k (and optionally v) input's leading l dims replaced."""
    l = params.get("l", hidden.shape[-1] // 8)  # noqa: E741
    factor = params.get("scaling", {}).get("factor", 1.0)
    S, theta = params.get("S", 0.0), params.get("theta", 1 / 2048)  # noqa: N806
    return attention_layer(
        module,
        hidden,
        softmax_scale=module.scaling,
        window=native_window(model, layer_idx),
        x_override=lambda t: expe_values(t, l, S, theta, factor),
        override_value=params.get("override_value", False),
    )
