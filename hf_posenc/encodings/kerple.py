"""KERPLE: kernelized relative positional embedding (Chi et al., 2022, "KERPLE: Kernelized
Relative Positional Embedding for Length Extrapolation", NeurIPS; chijames/KERPLE).

    <q_i, k_j> = q_i^T k_j + b_h(i - j)

    variant "log":    b_h(n) = -r1_h * log(1 + r2_h * |n|)
    variant "power":  b_h(n) = -r1_h * |n| ** r2_h

r1, r2 are learned scalars per (query) head. As in the reference (``ParallelKerpleLog`` /
``ParallelKerplePower`` in ``megatron/mpu/layers.py``) they are kept in range by clamping:
r1, r2 >= 0.01, and the power exponent r2 <= 2 (the kernel is conditionally positive
definite only for 0 < r2 <= 2). Like the reference, the clamp is a projection: before every
forward that records gradients the stored parameters are clamped in place (so a parameter an
optimizer step pushed out of range re-enters at the boundary and keeps receiving gradients),
and the values used are clamped again, so the bias never sees an out-of-range value.

The reference draws r1 ~ U(0, 2), r2 ~ U(0, 1) for "log" and r1 ~ U(0, 1), r2 ~ U(0, 2) for
"power". Here the same ranges are spread evenly and deterministically over the H heads:
head h gets r1 = s1 * (h + 1/2) / H (ascending) and r2 = s2 * (H - h - 1/2) / H (descending),
so every head has a distinct kernel and patching is reproducible without a seed. One set of
coefficients serves all layers (the reference builds one module for every layer) unless
``shared_across_layers=False``. Future keys (masked anyway) get the bias of |i - j|.

Position interpolation, ``scaling={'type': 'linear', 'factor': f}``: the kernel of the
interpolated distance, b_h(|i - j| / f).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..core.config import EncodingConfig, check_bool, check_choice
from ..core.interpolation import PositionInterpolation, interpolate
from ..core.registry import register_encoding
from .base import Encoding
from .block_bias import DistanceBias
from .call import ScoreCall

EPS = 1e-2  # the reference's lower bound for r1 and r2
MAX_POWER = 2.0  # upper bound of the power kernel's exponent
#: (r1 scale, r2 scale) of the reference's uniform initialisation, per variant
INIT_SCALES = {"log": (2.0, 1.0), "power": (1.0, 2.0)}


@dataclasses.dataclass
class KERPLEConfig(PositionInterpolation, EncodingConfig):
    encoding = "kerple"
    variant: str = "log"
    shared_across_layers: bool = True
    scaling: dict | None = None

    def validate(self) -> None:
        check_choice(self.encoding, "variant", self.variant, tuple(INIT_SCALES))
        check_bool(self.encoding, "shared_across_layers", self.shared_across_layers)


@register_encoding
class KERPLE(Encoding[KERPLEConfig]):
    name = "kerple"
    reads_positions = False  # see Encoding.reads_positions
    config_class = KERPLEConfig
    paper = "Chi et al. 2022, arXiv:2205.09921"
    summary = "learned per-head log or power kernel of the query-key distance"

    def __init__(self, config: KERPLEConfig, geometry) -> None:
        super().__init__(config, geometry)
        heads = geometry.num_heads
        tables = 1 if config.shared_across_layers else geometry.num_layers
        s1, s2 = INIT_SCALES[config.variant]
        u = (torch.arange(heads, dtype=torch.float64) + 0.5) / heads  # (Hq,) evenly in (0, 1)
        # r1[table, head], r2[table, head]
        self.r1 = nn.Parameter((s1 * u).float().repeat(tables, 1))
        self.r2 = nn.Parameter((s2 * u.flip(0)).float().repeat(tables, 1))

    @property
    def _r2_max(self) -> float | None:
        return MAX_POWER if self.config.variant == "power" else None

    @torch.no_grad()
    def project_(self) -> None:
        """Clamp the stored r1, r2 into range in place, as the reference does every forward."""
        self.r1.data.clamp_(min=EPS)
        self.r2.data.clamp_(min=EPS, max=self._r2_max)

    def coefficients(self, layer_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(r1, r2) of ``layer_idx``, each (Hq,) fp32, clamped into range."""
        row = 0 if self.config.shared_across_layers else layer_idx
        r1 = self.r1[row].float().clamp(min=EPS)
        r2 = self.r2[row].float().clamp(min=EPS, max=self._r2_max)
        return r1, r2

    def distance_table(self, call: ScoreCall) -> torch.Tensor:
        """(Hq, Tk) fp32 bias of every distance 0 .. Tk-1 (projects r1, r2 first in a training forward)."""
        k_len, device = call.k_len, call.device
        if torch.is_grad_enabled():
            self.project_()
        r1, r2 = self.coefficients(call.layer_idx)  # (Hq,), (Hq,)
        n = call.memo.get(
            ("kerple_n", k_len, device),
            lambda: interpolate(torch.arange(k_len, device=device), self.config.factor).float(),
        )  # (Tk,) every distance 0 .. Tk-1, divided by the factor
        if self.config.variant == "log":
            return -r1[:, None] * torch.log1p(r2[:, None] * n)  # (Hq, Tk)
        return -r1[:, None] * n.pow(r2[:, None])  # (Hq, Tk)

    def score_bias(self, call: ScoreCall) -> DistanceBias:
        return DistanceBias(call.q_len, call.k_len, self.distance_table(call))
