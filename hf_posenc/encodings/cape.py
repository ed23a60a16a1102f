"""CAPE / DAPE: data-adaptive positional encoding (Zheng et al., 2024, "DAPE: Data-Adaptive
Positional Encoding for Length Extrapolation", first titled "CAPE: Context-Adaptive
Positional Encoding"; reference: chuanyang-Zheng/DAPE ``CAPE.py``, ``AliBi_CAPE``).

    A_ij = x_ij + B_ij + f([x_ij ; B_ij])      for every query i and key j

where x_ij (one value per head) are the scaled logits q_i . k_j / sqrt(d), B_ij the base
positional bias of the heads (``base``: "alibi", or "kerple" / "fire" when those encodings
are installed, with ``base_params`` for their parameters) and f a two-layer MLP applied
per (i, j) across heads:

    f(u) = W2 LeakyReLU(W1 u + b1) + b2,   u in R^{2H}  ->  R^H,   W1: hidden x 2H

one MLP per layer, as the reference's per-layer ``mlp2`` (default width 32, LeakyReLU with
slope 0.01). W1, b1 get PyTorch's default Linear init; W2, b2 start at zero, so a patched
model starts as the base bias alone. f mixes heads but never keys, so padding, KV-cache
decoding and sliding windows need nothing beyond the base bias itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.config import EncodingConfig, check_number, fail
from ..core.interpolation import ScaledRange
from ..core.registry import encoding_names, get_encoding, register_encoding
from ..errors import InvalidParameterError
from .base import Encoding
from .call import ScoreCall

#: score-bias encodings CAPE can build on; only those registered in this install are accepted
BASES = ("alibi", "kerple", "fire")


def available_bases() -> list[str]:
    registered = set(encoding_names())
    return [name for name in BASES if name in registered]


@dataclasses.dataclass
class CAPEConfig(EncodingConfig):
    encoding = "cape"
    scaling_refusal = "cape's positions are those of its base bias; pass the scaling to the base: base_params={'scaling': {'type': 'linear', 'factor': F}}"
    base: str = "alibi"
    hidden: int = 32
    base_params: dict[str, Any] | None = None

    def validate(self) -> None:
        allowed = available_bases()
        if self.base not in allowed:
            raise fail(self.encoding, "base", self.base, "one of " + ", ".join(map(repr, allowed)))
        check_number(self.encoding, "hidden", self.hidden, low=1, integer=True)
        if self.base_params is not None and not isinstance(self.base_params, dict):
            raise fail(self.encoding, "base_params", self.base_params, f"a dict of {self.base!r} parameters")
        self.base_config()  # the base encoding validates its own parameters

    def base_config(self) -> EncodingConfig:
        try:
            return get_encoding(self.base).config_class.from_params(self.base_params or {})
        except InvalidParameterError as error:
            raise InvalidParameterError(f"cape: base_params for base {self.base!r}: {error}") from None

    def resolve(self, geometry: Any) -> CAPEConfig:
        resolved = self.base_config().resolve(geometry)
        return dataclasses.replace(self, base_params=resolved.to_dict())


class HeadMixer(nn.Module):
    """f: (..., 2H) -> (..., H), two Linear layers with a LeakyReLU, evaluated in fp32."""

    def __init__(self, heads: int, hidden: int) -> None:
        super().__init__()
        self.inner = nn.Linear(2 * heads, hidden)
        self.outer = nn.Linear(hidden, heads)
        nn.init.zeros_(self.outer.weight)
        nn.init.zeros_(self.outer.bias)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(F.linear(u, self.inner.weight.float(), self.inner.bias.float()))
        return F.linear(h, self.outer.weight.float(), self.outer.bias.float())


@register_encoding
class CAPE(Encoding[CAPEConfig]):
    name = "cape"
    reads_positions = False  # with its default base; see reads_position_ids
    aliases = ("dape",)
    config_class = CAPEConfig
    paper = "Zheng et al. 2024, arXiv:2405.14722"
    summary = "base bias (ALiBi) plus a per-layer MLP over [logits; bias] across heads"

    def __init__(self, config: CAPEConfig, geometry) -> None:
        super().__init__(config, geometry)
        base_class = get_encoding(config.base)
        if base_class.stages() != ["score_bias"]:  # a new base must be a pure score bias
            raise InvalidParameterError(f"cape: base {config.base!r} is not a score-bias encoding")
        self.base = base_class(config.base_config().resolve(geometry), geometry)
        self.mixers = nn.ModuleList(
            HeadMixer(geometry.num_heads, config.hidden) for _ in range(geometry.num_layers)
        )

    def initialise_from_model(self, model: nn.Module, adapter) -> None:
        self.base.initialise_from_model(model, adapter)

    def scaled_range(self) -> ScaledRange | None:
        """The base encoding's (its ``base_params`` carry the scaling)."""
        return self.base.scaled_range()

    def reads_position_ids(self) -> bool:
        return self.base.reads_position_ids()  # FIRE's threshold reads the query's position

    def rows_independent(self) -> bool:
        return not self.base.stateful  # a stateful base (FoX) accumulates over all queries

    def transform_scores(self, call: ScoreCall, scores: torch.Tensor) -> torch.Tensor:
        bias = self.base.score_bias(call).full().float().expand_as(scores)  # (B, Hq, Tq, Tk)
        features = torch.cat([scores, bias], dim=1).permute(0, 2, 3, 1)  # (B, Tq, Tk, 2Hq)
        mixed = self.mixers[call.layer_idx](features).permute(0, 3, 1, 2)  # (B, Hq, Tq, Tk)
        return scores + bias + mixed
