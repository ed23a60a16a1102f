"""KERPLE (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding for Length
Extrapolation"): a learned conditionally positive definite kernel of the distance as score bias,

    log:    b_h(i, j) = -r1_h log(1 + r2_h (i - j))
    power:  b_h(i, j) = -r1_h (i - j)^r2_h

with r1, r2 >= 0.01 (and r2 <= 2 for power), read from the encoding's raw parameters.
"""

from __future__ import annotations

import math

from .attention import attention_layer
from .config import native_window


def kerple_bias(params: dict, posenc, layer_idx: int):
    """KERPLE: log -r1*log(1 + r2*(i-j)), power -r1*(i-j)^r2; r1, r2 >= 0.01, power r2 <= 2."""
    row = 0 if params.get("shared_across_layers", True) else layer_idx
    r1 = [max(float(v), 0.01) for v in posenc.r1[row].detach().double()]
    r2 = [max(float(v), 0.01) for v in posenc.r2[row].detach().double()]
    if params.get("variant", "log") == "power":
        r2 = [min(v, 2.0) for v in r2]
        return lambda h, i, j: -r1[h] * (i - j) ** r2[h]
    return lambda h, i, j: -r1[h] * math.log(1 + r2[h] * (i - j))


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64: softmax(q.k*scale + b_h(i, j)) v."""
    bias = kerple_bias(params, model.posenc, layer_idx)
    window = native_window(model, layer_idx)
    return attention_layer(module, hidden, softmax_scale=module.scaling, window=window, bias=bias)
