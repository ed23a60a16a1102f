"""CoPE: contextual position encoding (Golovneva et al., 2024, "Contextual Position Encoding:
Learning to Count What's Important"; reference: facebookresearch/RAM ``projects/cope``).

    g_ij = sigmoid(q_i . k_j / sqrt(d))                       gates, 0 for masked keys
    p_ij = min( sum_{t=j}^{i} g_it , npos_max - 1 )          contextual position of key j
    z_i[n] = q_i . e[n]                                      n = 0 .. npos_max - 1
    logit_ij = ( q_i . k_j + (1 - w) z_i[floor p_ij] + w z_i[ceil p_ij] ) / sqrt(d),
                                                             w = p_ij - floor p_ij

As in the reference, the gates use the attention's own scaled logits, the sum includes the
diagonal (key i itself, so with every gate at 1, p_ij = i - j + 1), masked keys (padding,
future keys, keys outside a sliding window) contribute 0, and the interpolated position
logit is divided by sqrt(head_dim) together with q . k. The position embeddings ``e``
(npos_max x head_dim) are shared by the heads of a layer, one table per layer (one for all
layers with ``shared_across_layers=True``, the reference's ``--cope-shared``), and start at
zero like the reference's, so a patched model starts as NoPE.

Every p_ij of a query only involves that query's gates over the keys it may see, all of
which are in the KV cache, so decoding needs no extra state.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from ..core.config import EncodingConfig, check_bool, check_number
from ..core.registry import register_encoding
from .base import Encoding
from .call import ScoreCall
from .saturating_transform import BandBackward, SaturatingTransform


@dataclasses.dataclass
class CoPEConfig(EncodingConfig):
    encoding = "cope"
    scaling_refusal = "cope's positions are contextual, sums of learned sigmoid gates over the keys, not token positions or distances"
    npos_max: int = 64
    shared_across_layers: bool = False

    def validate(self) -> None:
        check_number(self.encoding, "npos_max", self.npos_max, low=2, integer=True)
        check_bool(self.encoding, "shared_across_layers", self.shared_across_layers)


#: how far past ``npos_max - 1`` the gates summed over a band must reach for the keys before it to
#: count as saturated: sums of the same gates in another order (the eager path's, over the whole
#: row) differ by rounding far below it, so they are past ``npos_max - 1`` too
SATURATION_MARGIN = 1e-3


def counted_positions(gates: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """gates (..., Tq, Tk) -> sum_{t >= j} allowed_it * g_it (..., Tq, Tk), not clamped.

    Summing over every key t >= j equals the sum over j..i because keys after the query are
    masked (``allowed`` (.., Tq, Tk) bool broadcastable to ``gates``; None: all allowed).
    """
    if allowed is not None:
        gates = gates.masked_fill(~allowed, 0.0)
    return gates.flip(-1).cumsum(-1).flip(-1)  # reversed cumulative sum over keys


def contextual_positions(gates: torch.Tensor, allowed: torch.Tensor | None, npos_max: int) -> torch.Tensor:
    """gates (..., Tq, Tk) -> p[..., i, j] = min(sum_{t >= j} allowed_it * g_it, npos_max - 1)."""
    return counted_positions(gates, allowed).clamp(max=npos_max - 1)


def interpolate_position_logits(z: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """z (..., Tq, npos) logits of integer positions, positions (..., Tq, Tk) fractional
    -> (1 - w) z[floor p] + w z[ceil p] with w = p - floor p, shape (..., Tq, Tk)."""
    return _Interpolation.of(z, positions).value()


@dataclasses.dataclass
class _Interpolation:
    """The parts of :func:`interpolate_position_logits`: floor and ceil indices, the weight w =
    p - floor p (differentiable; the indices carry no gradient), z at both indices."""

    low_index: torch.Tensor
    high_index: torch.Tensor
    weight: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor

    @classmethod
    def of(cls, z: torch.Tensor, positions: torch.Tensor) -> _Interpolation:
        floor = positions.floor()
        low_index, high_index = floor.long(), positions.ceil().long()
        return cls(
            low_index, high_index, positions - floor, z.gather(-1, low_index), z.gather(-1, high_index)
        )

    def value(self) -> torch.Tensor:
        return self.low * (1.0 - self.weight) + self.high * self.weight


@register_encoding
class CoPE(Encoding[CoPEConfig]):
    name = "cope"
    reads_positions = False  # see Encoding.reads_positions
    aliases = ("contextual", "contextual_position")
    config_class = CoPEConfig
    paper = "Golovneva et al. 2024, arXiv:2405.18719"
    summary = "position = reversed cumsum of sigmoid(q.k) gates; interpolated learned position logits"

    def __init__(self, config: CoPEConfig, geometry) -> None:
        super().__init__(config, geometry)
        tables = 1 if config.shared_across_layers else geometry.num_layers
        # embeddings[layer]: (npos_max, head_dim), shared by the heads; zero as in the reference
        self.embeddings = nn.Parameter(torch.zeros(tables, config.npos_max, geometry.head_dim))

    def rows_independent(self) -> bool:
        return True

    def heads_independent(self) -> bool:
        return True  # gates and positions per head from its own scores; the position table is shared by the heads

    def table(self, layer_idx: int) -> torch.Tensor:
        """(npos_max, D): the position embeddings of layer ``layer_idx``."""
        return self.embeddings[0 if self.config.shared_across_layers else layer_idx]

    def transform_scores(self, call: ScoreCall, scores: torch.Tensor) -> torch.Tensor:
        table = self.table(call.layer_idx)  # (npos, D)
        gates = torch.sigmoid(scores)  # (B, Hq, Tq, Tk): scores are q.k / sqrt(d) here
        positions = contextual_positions(gates, call.allowed, self.config.npos_max)  # (B, Hq, Tq, Tk)
        dtype = _compute_dtype(call.q)
        z = torch.matmul(call.q.to(dtype), table.to(dtype).T)  # (B, Hq, Tq, npos)
        scale = self.geometry.head_dim**-0.5
        return scores + interpolate_position_logits(z, positions) * scale

    def band_form(self, call: ScoreCall) -> CountedPositions:
        return CountedPositions(
            self.table(call.layer_idx), self.config.npos_max, self.geometry.head_dim**-0.5
        )


@dataclasses.dataclass(frozen=True)
class CountedPositions(SaturatingTransform):
    """CoPE's transform as a :class:`SaturatingTransform`: past the key where the gates summed back
    from the query exceed ``npos_max - 1``, every position is ``npos_max - 1`` and the logit is
    ``S_ij + scale * q_i . e[npos_max - 1]`` (the clamp passes no gradient to the gates there)."""

    table: torch.Tensor  # (npos_max, D)
    npos_max: int
    scale: float  # the position logit's, 1 / sqrt(head_dim) as in transform_scores

    backward_by_hand: ClassVar[bool] = True

    def band(
        self, q: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, own: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        counts = counted_positions(torch.sigmoid(scores), allowed)  # (B, Hq, R, K) not clamped
        saturated = counts[..., 0] > self.npos_max - 1 + SATURATION_MARGIN  # (B, Hq, R)
        dtype = _compute_dtype(q)
        z = torch.matmul(q.to(dtype), self.table.to(dtype).T)  # (B, Hq, R, npos)
        positions = counts.clamp(max=self.npos_max - 1)
        logits = scores + interpolate_position_logits(z, positions) * self.scale
        return logits.masked_fill(~allowed, float("-inf")), saturated

    def tail(self, q: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(q)
        last = self.table[self.npos_max - 1].to(dtype)  # (D,)
        return (torch.matmul(q.to(dtype), last) * self.scale).to(q.dtype)  # (B, Hq, R)

    def band_with_gradients(
        self, q: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, own: torch.Tensor
    ) -> tuple[torch.Tensor, BandBackward]:
        """:meth:`band`'s logits (the same operations) and their backward by hand, from the gradient
        dL of the logits and d tail of the tail (tail = scale z[npos_max - 1], z = q e^T):

            d interp = scale dL,   dz[floor p] += d interp (1 - w),   dz[ceil p] += d interp w,
            d p = d interp (z[ceil p] - z[floor p])  (0 where clamped: floor p = ceil p there),
            d g_t = sum_{j <= t} d p_j (the reversed cumulative sum's transpose), 0 on masked keys,
            dS = dL + d g * g (1 - g),   dz[npos_max - 1] += scale d tail,
            dq = dz e,   d e = dz^T q (summed over the batch, heads and rows).

        One pass per step over the band, no autograd graph (the graph's ~60 nodes per block cost
        more than their arithmetic on the band's small blocks)."""
        gates = torch.sigmoid(scores)  # (B, Hq, R, K)
        counts = counted_positions(gates, allowed)  # (B, Hq, R, K) not clamped
        dtype = _compute_dtype(q)
        table = self.table.to(dtype)  # (npos, D)
        z = torch.matmul(q.to(dtype), table.T)  # (B, Hq, R, npos)
        parts = _Interpolation.of(z, counts.clamp(max=self.npos_max - 1))
        logits = (scores + parts.value() * self.scale).masked_fill(~allowed, float("-inf"))

        def backward(
            grad_logits: torch.Tensor, grad_tail: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
            grad_interpolated = grad_logits.to(dtype) * self.scale  # (B, Hq, R, K)
            grad_z = torch.zeros_like(z)  # (B, Hq, R, npos)
            grad_z.scatter_add_(-1, parts.low_index, grad_interpolated * (1.0 - parts.weight))
            grad_z.scatter_add_(-1, parts.high_index, grad_interpolated * parts.weight)
            if grad_tail is not None:
                grad_z[..., self.npos_max - 1] += grad_tail.to(dtype) * self.scale
            # (the clamp's gradient needs no mask: a clamped position is the integer npos_max - 1,
            # whose floor and ceil are one index, so high - low is 0 there)
            grad_positions = grad_interpolated.mul_(parts.high - parts.low)  # (reuses its buffer)
            grad_gates = grad_positions.cumsum(-1).masked_fill_(~allowed, 0.0)
            grad_scores = grad_logits + (grad_gates * gates * (1.0 - gates)).to(grad_logits.dtype)
            grad_q = torch.matmul(grad_z, table).to(q.dtype)  # (B, Hq, R, D)
            grad_table = grad_z.reshape(-1, grad_z.shape[-1]).T @ q.to(dtype).reshape(-1, q.shape[-1])
            return grad_scores, grad_q, {"table": grad_table.to(self.table.dtype)}

        return logits, backward


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 queries: the position logits' dtype."""
    return torch.promote_types(q.dtype, torch.float32)
