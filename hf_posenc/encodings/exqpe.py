"""ExQPE: exact quantisable positional encodings (Datseris et al., 2025, eq. 5).

    phi(x, n) = (p_{n,0}, ..., p_{n,l-1}, x_l, ..., x_d)
    p_0       = (S + 0*theta1 + theta2, S + 1*theta1, ..., S + (l-1)*theta1)
    p_n       = p_{n-1} with component k = n mod l increased by theta2

Only one of the l components grows per token, so positions stay distinguishable in low
precision (bf16). Closed form, without a loop over n:

    p_{n,j} = S + j*theta1 + theta2 * c(n, j),   c(n, j) = floor((n - j) / l) + 1 if n >= j else 0

(c counts the i in 0..n with i mod l = j). ``scaling={'type': 'linear', 'factor': f}``
divides everything but S: p = S + (j*theta1 + theta2*c) / f. Applied like ExPE to each
layer's q/k input (and v's when ``override_value``). Defaults follow the paper:
l = d_model / 8, S = 0, theta1 = 1/2048, theta2 = 1/16. In a bf16/fp16 model adjacent codes
collide past some position (bf16, l=8: 2047); the first forward past it warns once (see
:mod:`.expe_precision`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.config import check_number
from ..core.registry import register_encoding
from .base import Encoding
from .call import LayerCall
from .expe_common import ExactPositionConfig, check_codes_fit, override_leading, warn_if_indistinguishable
from .expe_precision import exqpe_component


@dataclasses.dataclass
class ExQPEConfig(ExactPositionConfig):
    encoding = "exqpe"
    theta1: float = 1 / 2048
    theta2: float = 1 / 16

    def validate(self) -> None:
        super().validate()
        check_number(self.encoding, "theta1", self.theta1, low=0.0)
        check_number(self.encoding, "theta2", self.theta2, low=0.0, low_inclusive=False)

    def largest_code(self, position: int) -> float:
        l = self.code_length()  # noqa: E741
        return abs(self.S) + (l * self.theta1 + self.theta2 * (position // l + 1)) / self.factor


def exqpe_values(
    positions: torch.Tensor,
    l: int,  # noqa: E741
    S: float,
    theta1: float,
    theta2: float,
    factor: float,  # noqa: E741, N803
) -> torch.Tensor:
    """positions (B,T) -> (B,T,l) fp32 per the closed form above."""
    j = torch.arange(l, device=positions.device)  # (l,)
    n = positions[..., None]  # (B, T, 1)
    count = torch.where(n >= j, torch.div(n - j, l, rounding_mode="floor") + 1, torch.zeros_like(n - j))
    return exqpe_component(j, count, S, theta1, theta2, factor)  # (B, T, l)


@register_encoding
class ExQPE(Encoding[ExQPEConfig]):
    name = "exqpe"
    aliases = ("exact_quantizable",)
    config_class = ExQPEConfig
    paper = "Datseris et al. 2025, ExPE (eq. 5)"
    summary = "like ExPE, but only component n mod l grows (by theta2) per token: bf16-friendly"

    def layer_input(self, call: LayerCall) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, hidden, positions = self.config, call.hidden, call.positions
        if call.layer_idx == 0:
            warn_if_indistinguishable(self, positions, hidden.dtype)
        values = call.memo.get(
            ("exqpe",),
            lambda: exqpe_values(positions, cfg.code_length(), cfg.S, cfg.theta1, cfg.theta2, cfg.factor),
        )  # (B, T, l)
        if call.layer_idx == 0:
            check_codes_fit(self, positions, values, hidden.dtype)
        return override_leading(hidden, values, cfg.override_value)
