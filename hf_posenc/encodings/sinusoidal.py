"""Sinusoidal absolute positions (Vaswani et al., 2017, "Attention Is All You Need").

    P[n, 2i]   = scale * sin(n / base^(2i/d))
    P[n, 2i+1] = scale * cos(n / base^(2i/d))        h_n^(0) = e_n + P[n]

Added once to the token embeddings (sin/cos interleaved, as in the paper and seeds 000/001).
``scale`` lets a pretrained model whose embeddings are small (Llama's ~0.02) receive a
vector of comparable size; 1.0 is the paper's value.

Position interpolation, ``scaling={'type': 'linear', 'factor': f}``: ``P[n / f]``, the same
formula at the fractional position n / f.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.config import EncodingConfig, check_number
from ..core.interpolation import PositionInterpolation, interpolate
from ..core.registry import register_encoding
from .base import Encoding
from .call import ForwardCall


@dataclasses.dataclass
class SinusoidalConfig(PositionInterpolation, EncodingConfig):
    encoding = "sinusoidal"
    base: float = 10000.0
    scale: float = 1.0
    scaling: dict | None = None

    def validate(self) -> None:
        check_number(self.encoding, "base", self.base, low=1.0, low_inclusive=False)
        check_number(self.encoding, "scale", self.scale, low=0.0, low_inclusive=False)


def sinusoidal_table(positions: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """positions (...,) -> (..., dim) fp32 with sin at even and cos at odd indices."""
    pair = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64)  # 2i
    inv_freq = base ** (-pair / dim)  # (ceil(dim/2),)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # (..., ceil(dim/2))
    table = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (..., 2*ceil(dim/2))
    return table[..., :dim].float()


@register_encoding
class Sinusoidal(Encoding[SinusoidalConfig]):
    name = "sinusoidal"
    aliases = ("sincos", "sinusoid", "absolute_sinusoidal")
    config_class = SinusoidalConfig
    paper = "Vaswani et al. 2017, arXiv:1706.03762"
    summary = "fixed sin/cos vectors added to the token embeddings"

    def embed(self, call: ForwardCall) -> torch.Tensor:
        cfg = self.config
        scaled = interpolate(call.positions, cfg.factor)  # n / f
        return cfg.scale * sinusoidal_table(scaled, self.geometry.hidden_size, cfg.base)  # (B, T, hidden)
