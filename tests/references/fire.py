"""FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context
Transformers"): a learned MLP of the normalised log distance as score bias,

    b_h(i, j) = f(psi(i - j) / psi(max(L, i)))_h,   psi(x) = log(1 + |c| x),
    f(x) = W2 relu(W1 x + b1) + b2,   L = |L_multiplier| * init_L

read from the encoding's raw parameters (c, L_multiplier and the MLP's weights).
"""

from __future__ import annotations

import math

from .attention import attention_layer
from .config import native_window


def fire_bias(params: dict, posenc, layer_idx: int):
    """FIRE: f(log(1+|c|(i-j)) / (log(1+|c| max(L, i)) + 1e-6)), f = W2 relu(W1 x + b1) + b2."""
    index = layer_idx if not params.get("shared_across_layers", False) else 0
    fn = posenc.functions[index]
    c = abs(float(fn.c.detach()))
    big_l = abs(float(fn.L_multiplier.detach()) * params.get("init_L", 512.0))
    w1, b1 = fn.hidden.weight.detach().double()[:, 0].tolist(), fn.hidden.bias.detach().double().tolist()
    w2, b2 = fn.out.weight.detach().double().tolist(), fn.out.bias.detach().double().tolist()
    cache = {}

    def bias(h, i, j):
        if (h, i, j) not in cache:
            x = math.log(1 + c * (i - j)) / (math.log(1 + c * max(big_l, i)) + 1e-6)
            hidden = [max(0.0, w * x + b) for w, b in zip(w1, b1, strict=True)]
            cache[h, i, j] = sum(w * a for w, a in zip(w2[h], hidden, strict=True)) + b2[h]
        return cache[h, i, j]

    return bias


def layer_reference(params: dict, module, hidden, model, layer_idx: int):
    """One attention layer, fp64: softmax(q.k*scale + b_h(i, j)) v."""
    bias = fire_bias(params, model.posenc, layer_idx)
    window = native_window(model, layer_idx)
    return attention_layer(module, hidden, softmax_scale=module.scaling, window=window, bias=bias)
