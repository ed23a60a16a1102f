"""ALiBi: attention with linear biases (Press et al., 2022, "Train Short, Test Long").

    <q_i, k_j> = q_i^T k_j - m_h * (i - j)

Head slopes m_h form the geometric sequence 2^(-8/H), 2^(-16/H), ..., 2^(-8) for H a power
of two. Otherwise the slopes of the closest smaller power of two are followed by every
other slope of twice that count (the original ``get_slopes``, as BLOOM's
``build_alibi_tensor``). The bias has no parameters; with GQA it is per query head.

Position interpolation, ``scaling={'type': 'linear', 'factor': f}`` (Al-Khateeb et al. 2023,
"Position Interpolation Improves ALiBi Extrapolation", arXiv:2310.13017): the distance is
divided by f, - m_h * (i - j) / f, i.e. every slope becomes m_h / f.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..core.config import EncodingConfig
from ..core.interpolation import FLOAT32_MAX, FLOAT32_RANGE, PositionInterpolation, ScaledRange
from ..core.registry import register_encoding
from .base import Encoding
from .block_bias import LinearDistanceBias
from .call import ScoreCall


@dataclasses.dataclass
class ALiBiConfig(PositionInterpolation, EncodingConfig):
    encoding = "alibi"
    scaling: dict | None = None


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """(num_heads,) fp32 slopes, per Press et al.'s reference ``get_slopes``."""
    return torch.tensor(alibi_slope_values(num_heads), dtype=torch.float32)


def alibi_slope_values(num_heads: int) -> list[float]:
    """The slopes of :func:`alibi_slopes` as Python floats (read without a tensor: a model built
    on the meta device has no values to read)."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(closest)
    if closest != num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return slopes


@register_encoding
class ALiBi(Encoding[ALiBiConfig]):
    name = "alibi"
    reads_positions = False  # see Encoding.reads_positions
    aliases = ("linear_bias",)
    config_class = ALiBiConfig
    paper = "Press et al. 2022, arXiv:2108.12409"
    summary = "fixed per-head linear penalty on query-key distance"

    def scaled_range(self) -> ScaledRange | None:
        """The slopes m / f are float32 numbers: past its range a slope is inf and inf * 0 (the
        diagonal's distance) is NaN. Distances times a finite slope may overflow to -inf: a
        zero attention weight, which is what the bias means there."""
        if self.config.factor == 1.0:
            return None
        largest = max(alibi_slope_values(self.geometry.num_heads))
        return ScaledRange(self.config.factor, "slopes m / f", largest, FLOAT32_MAX, FLOAT32_RANGE)

    def score_bias(self, call: ScoreCall) -> LinearDistanceBias:
        q_len, k_len, device = call.q_len, call.k_len, call.device
        # -m * (d / f) = -(m / f) * d: interpolation divides every slope by the factor
        return call.memo.get(
            ("alibi", q_len, k_len, device),
            lambda: LinearDistanceBias(
                q_len, k_len, alibi_slopes(self.geometry.num_heads).to(device) / self.config.factor
            ),
        )
