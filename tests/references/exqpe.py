"""ExQPE (Datseris et al. 2025, eq. 5): like ExPE, the first l dims of the q/k input
are overwritten, here with a quasi-periodic vector: p_0 = (S + theta2, S + theta1, ...,
S + (l-1) theta1), and step i adds theta2 to entry i mod l.
"""

from __future__ import annotations

from .attention import attention_layer
from .config import native_window


def exqpe_values(n: int, l: int, S: float, theta1: float, theta2: float, factor: float = 1.0) -> list[float]:  # noqa: E741, N803
    """ExQPE eq. 5 by its recurrence: p_0 = (S+theta2, S+theta1, ..., S+(l-1)theta1); step i adds theta2 to i mod l."""
    p = [S + i * theta1 for i in range(l)]
    p[0] += theta2
    for i in range(1, n + 1):
        p[i % l] += theta2
    return [S + (v - S) / factor for v in p]


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64, with the q/k (and optionally v) input's leading l dims replaced."""
    l = params.get("l", hidden.shape[-1] // 8)  # noqa: E741
    factor = params.get("scaling", {}).get("factor", 1.0)
    S = params.get("S", 0.0)  # noqa: N806
    theta1, theta2 = params.get("theta1", 1 / 2048), params.get("theta2", 1 / 16)
    return attention_layer(
        module,
        hidden,
        softmax_scale=module.scaling,
        window=native_window(model, layer_idx),
        x_override=lambda t: exqpe_values(t, l, S, theta1, theta2, factor),
        override_value=params.get("override_value", False),
    )
