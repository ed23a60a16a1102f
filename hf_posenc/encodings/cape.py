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
from typing import Any, cast

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


#: scores per product of :meth:`HeadMixer.mix` without gradients on the CPU: the slab's hidden
#: units (32 x 8192 fp32, 1 MiB) stay in cache between the products and the LeakyReLU
MIX_SLAB = 8192


def mix_slab(device: torch.device, scores: int) -> int:
    """Scores per product of a mix without gradients: :data:`MIX_SLAB` on the CPU (its caches);
    elsewhere the whole block, as the mix with gradients takes it (on a GPU each slab costs five
    kernel launches: with the CPU's slab a 256-row block of 8192 keys would be 256 slabs, ~1300
    launches per block; the block's hidden units are what the training mix holds anyway). At
    least 1 (a block of no keys has no slab)."""
    return max(1, min(scores, MIX_SLAB if device.type == "cpu" else scores))


NEGATIVE_SLOPE = 0.01  # LeakyReLU's (PyTorch's default, the reference's)


class HeadMixer(nn.Module):
    """f: R^2H -> R^H, two Linear layers with a LeakyReLU, evaluated in fp32 (fp64 for an fp64
    model: :meth:`mix`)."""

    def __init__(self, heads: int, hidden: int) -> None:
        super().__init__()
        self.inner = nn.Linear(2 * heads, hidden)
        self.outer = nn.Linear(hidden, heads)
        nn.init.zeros_(self.outer.weight)
        nn.init.zeros_(self.outer.bias)

    def mix(self, scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """scores (B, H, R, K) fp32 or fp64, bias (B|1, H, R, K) in that dtype -> scores + bias +
        f([scores; bias]) over the heads, (B, H, R, K) in that dtype.

        Head-major, as the tensors are laid out: per batch row, scores S and bias B are (H, N)
        matrices of the N = R*K scores, so the result is S + B + b2 + W2 LeakyReLU(W1[:, :H] S +
        W1[:, H:] B + b1): products and in-place passes over (hidden, N) and (H, N) matrices, no
        permuted or concatenated (N, 2H) copy of the block and no copy made by a broadcast
        ``addmm`` input (the token-major form spent about a third of CAPE's forward permuting and
        concatenating). Without gradients the N scores go in slabs (:func:`mix_slab`) through
        one reused buffer of hidden units, each slab's W2 product added in place into the output."""
        batch, heads, rows, keys = scores.shape
        n = rows * keys
        bias = bias.expand(batch, -1, -1, -1)
        dtype = scores.dtype  # fp32, or fp64 for an fp64 model
        b2 = self.outer.bias.to(dtype)[:, None]  # (H, 1)
        if torch.is_grad_enabled():
            parts = []
            for b in range(batch):
                s, base = scores[b].reshape(heads, n), bias[b].reshape(heads, n)  # (H, N)
                parts.append((s + base).add_(b2).addmm_(self.outer.weight.to(dtype), self._hidden(s, base)))
            return (parts[0][None] if batch == 1 else torch.stack(parts)).view(batch, heads, rows, keys)
        out = torch.empty(batch, heads, rows, keys, dtype=dtype, device=scores.device)
        slab = mix_slab(scores.device, n)
        buffer = torch.empty(self.inner.out_features, slab, dtype=dtype, device=scores.device)
        w2 = self.outer.weight.to(dtype)  # (H, F)
        for b in range(batch):
            s, base, flat = scores[b].reshape(heads, n), bias[b].reshape(heads, n), out[b].view(heads, n)
            torch.add(s, base, out=flat).add_(b2)
            for first in range(0, n, slab):
                last = min(n, first + slab)
                part = slice(first, last)
                flat[:, part].addmm_(w2, self._hidden(s[:, part], base[:, part], buffer[:, : last - first]))
        return out

    def _hidden(
        self, scores: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """scores, bias (H, n) -> LeakyReLU(W1[:, :H] S + W1[:, H:] B + b1) (F, n), into ``out`` when
        given (without gradients)."""
        heads = scores.shape[0]
        w1, b1 = self.inner.weight.to(scores.dtype), self.inner.bias.to(scores.dtype)  # (F, 2H), (F,)
        hidden = torch.mm(w1[:, :heads], scores, out=out)  # (F, n)
        hidden.addmm_(w1[:, heads:], bias).add_(b1[:, None])
        return F.leaky_relu_(hidden, NEGATIVE_SLOPE)


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
        dtype = torch.promote_types(scores.dtype, torch.float32)  # fp32, or fp64 for an fp64 model
        bias = self.base.score_bias(call).full().to(dtype)  # (B|1, Hq, Tq, Tk)
        mixer = cast(HeadMixer, self.mixers[call.layer_idx])  # __init__ fills mixers with HeadMixers
        return mixer.mix(scores.to(dtype), bias)  # (B, Hq, Tq, Tk)
