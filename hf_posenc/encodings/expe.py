"""ExPE: exact positional encodings (Datseris et al., 2025, "ExPE: Exact Positional
Encodings for Generative Transformer Models with Extrapolating Capabilities", eq. 3).

    phi(x, n) = (p_n, p_{n+1}, ..., p_{n+l-1}, x_{l+1}, ..., x_d),   p_n = S + theta * n

applied in every layer to the hidden state entering the query and key projections (the
value input too when ``override_value``): its first ``l`` dimensions are overwritten by
an exact, linearly growing code of the token position n. The residual stream keeps the
overwritten values. ``scaling={'type': 'linear', 'factor': f}`` divides the position-
dependent part: p = S + theta * (n + j) / f (the paper's "scaled by 0.5" is f = 2).

Defaults follow the paper's large-scale setup: l = d_model / 8, S = 0, theta = 1/2048.
In a bf16/fp16 model adjacent codes collide past some position (bf16, l=8: 1036); the first
forward past it warns once (see :mod:`.expe_precision`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.config import check_number
from ..core.registry import register_encoding
from .base import Encoding
from .call import LayerCall
from .expe_common import ExactPositionConfig, check_codes_fit, override_leading, warn_if_indistinguishable
from .expe_precision import expe_component


@dataclasses.dataclass
class ExPEConfig(ExactPositionConfig):
    encoding = "expe"
    theta: float = 1 / 2048

    def validate(self) -> None:
        super().validate()
        check_number(self.encoding, "theta", self.theta, low=0.0, low_inclusive=False)

    def largest_code(self, position: int) -> float:
        return abs(self.S) + self.theta * (position + self.code_length()) / self.factor


def expe_values(positions: torch.Tensor, l: int, S: float, theta: float, factor: float) -> torch.Tensor:  # noqa: E741, N803
    """positions (B,T) -> (B,T,l) fp32 with value S + theta * (n + j) / factor at [b, t, j]."""
    offsets = torch.arange(l, device=positions.device)  # (l,)
    return expe_component(positions[..., None] + offsets, S, theta, factor)  # (B, T, l)


@register_encoding
class ExPE(Encoding[ExPEConfig]):
    name = "expe"
    aliases = ("exact", "exact_positional")
    config_class = ExPEConfig
    paper = "Datseris et al. 2025, ExPE (eq. 3)"
    summary = "overrides the first l dims of each layer's q/k input with S + theta*(n+j)"

    def layer_input(self, call: LayerCall) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, hidden, positions = self.config, call.hidden, call.positions
        if call.layer_idx == 0:
            warn_if_indistinguishable(self, positions, hidden.dtype)
        values = call.memo.get(
            ("expe",), lambda: expe_values(positions, cfg.code_length(), cfg.S, cfg.theta, cfg.factor)
        )  # (B, T, l)
        if call.layer_idx == 0:
            check_codes_fit(self, positions, values, hidden.dtype)
        return override_leading(hidden, values, cfg.override_value)
