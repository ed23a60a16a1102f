"""What FoX and FoX (Pro) share: the forget-gate parameters and the forgetting bias.

    log f_t = logsigmoid(w_f^T x_t + b_f)        per query head, x_t = the layer's input
    D_ij    = c_i - c_j,   c_t = sum_{l <= t} log f_l   (= sum_{l=j+1}^{i} log f_l, 0 for i = j)

with c accumulated in fp64 and rounded to fp32 before the difference (fp32 throughout on
devices without fp64, i.e. MPS). During KV-cache decoding the layer's
decoding state carries c of the cached keys, trimmed to the keys the cache returns
(Mistral's sliding-window cache keeps only the last ones), and new tokens continue it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.config import EncodingConfig, check_number
from ..errors import InvalidParameterError, UnsupportedModelError

STATE_KEY = "fox_cumulative_log_forget"  # (B, Hq, Tk) c_t of the keys the cache holds (fp64)
_ACCUMULATE = {"mps": torch.float32}  # devices without fp64


@dataclasses.dataclass
class ForgetGateConfig(EncodingConfig):
    """Initial decay times: head h starts with f = exp(-1/T_h), T_h log-spaced in [min, max]."""

    decay_time_min: float = 64.0
    decay_time_max: float = 4096.0

    def validate(self) -> None:
        # below ~0.0014 tokens exp(1/T) overflows; 0.01 (f = e^-100) is already no memory at all
        check_number(self.encoding, "decay_time_min", self.decay_time_min, low=0.01)
        check_number(self.encoding, "decay_time_max", self.decay_time_max, low=0.01)
        if self.decay_time_max < self.decay_time_min:
            raise InvalidParameterError(
                f"{self.encoding}: parameter decay_time_max={self.decay_time_max!r} is not allowed; allowed: "
                f"a number >= decay_time_min={self.decay_time_min!r}"
            )


def decay_bias_init(num_heads: int, decay_time_min: float, decay_time_max: float) -> torch.Tensor:
    """(num_heads,) fp32 biases b with sigmoid(b) = exp(-1/T): the reference's ``fgate_bias_init``."""
    log_times = torch.linspace(
        math.log(decay_time_min), math.log(decay_time_max), num_heads, dtype=torch.float64
    )
    return (-torch.log(torch.expm1(1.0 / log_times.exp()))).float()


def forget_gates(config: ForgetGateConfig, geometry) -> nn.ModuleList:
    """One Linear(hidden -> Hq) per layer: zero weights (the gate starts data-independent) and
    per-head decay-time biases, so gates start near 1 and the bias is ALiBi-like, -(i-j)/T_h."""
    gates = [nn.Linear(geometry.hidden_size, geometry.num_heads) for _ in range(geometry.num_layers)]
    bias = decay_bias_init(geometry.num_heads, config.decay_time_min, config.decay_time_max)
    with torch.no_grad():
        for gate in gates:
            gate.weight.zero_()
            gate.bias.copy_(bias)
    return nn.ModuleList(gates)


def log_forget(gate: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """hidden (B, T, hidden) -> log f (B, Hq, T), fp32."""
    logits = F.linear(hidden.float(), gate.weight.float(), gate.bias.float())  # (B, T, Hq)
    return F.logsigmoid(logits).transpose(1, 2)


def cumulative_log_forget(log_f: torch.Tensor, k_len: int, state: dict[str, Any] | None) -> torch.Tensor:
    """log f (B, H, Tq) of the new tokens -> c (B, H, Tk) fp32 of every key, c_t = sum_{l <= t} log f_l.

    Queries are the last Tq of the Tk keys (bottom-right aligned). The cumulative sums are
    accumulated in fp64 (cheap: one value per key) and rounded to fp32, so decoding, which
    continues the c of the cached keys kept in ``state``, reproduces the full forward's c
    exactly. ``state`` is updated to the Tk keys of this call.
    """
    cumulative = log_f.to(_ACCUMULATE.get(log_f.device.type, torch.float64)).cumsum(dim=-1)  # (B, H, Tq)
    if state is not None:
        cached = state.get(STATE_KEY)  # (B, H, Tcached): c of the cached keys
        if cached is not None:
            cumulative = torch.cat((cached, cached[..., -1:] + cumulative), dim=-1)
        cumulative = cumulative[..., -k_len:]  # the keys the cache returned (sliding windows drop old ones)
        state[STATE_KEY] = cumulative
    if cumulative.shape[-1] != k_len:
        raise UnsupportedModelError(
            f"fox: the KV cache holds {k_len} keys but the forget-gate state knows {cumulative.shape[-1]}; "
            "a cache must be filled by this patched model from its first token (and not reordered or cropped)"
        )
    return cumulative.float()  # (B, H, Tk)
