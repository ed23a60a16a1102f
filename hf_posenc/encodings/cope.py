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

import torch
from torch import nn

from ..core.config import EncodingConfig, check_bool, check_number
from ..core.registry import register_encoding
from .base import Encoding
from .call import ScoreCall


@dataclasses.dataclass
class CoPEConfig(EncodingConfig):
    encoding = "cope"
    scaling_refusal = "cope's positions are contextual, sums of learned sigmoid gates over the keys, not token positions or distances"
    npos_max: int = 64
    shared_across_layers: bool = False

    def validate(self) -> None:
        check_number(self.encoding, "npos_max", self.npos_max, low=2, integer=True)
        check_bool(self.encoding, "shared_across_layers", self.shared_across_layers)


def contextual_positions(gates: torch.Tensor, allowed: torch.Tensor | None, npos_max: int) -> torch.Tensor:
    """gates (..., Tq, Tk) -> p[..., i, j] = min(sum_{t >= j} allowed_it * g_it, npos_max - 1).

    Summing over every key t >= j equals the sum over j..i because keys after the query are
    masked (``allowed`` (.., Tq, Tk) bool broadcastable to ``gates``; None: all allowed).
    """
    if allowed is not None:
        gates = gates.masked_fill(~allowed, 0.0)
    positions = gates.flip(-1).cumsum(-1).flip(-1)  # reversed cumulative sum over keys
    return positions.clamp(max=npos_max - 1)


def interpolate_position_logits(z: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """z (..., Tq, npos) logits of integer positions, positions (..., Tq, Tk) fractional
    -> (1 - w) z[floor p] + w z[ceil p] with w = p - floor p, shape (..., Tq, Tk)."""
    floor = positions.floor()
    weight = positions - floor  # differentiable; the indices carry no gradient
    low = z.gather(-1, floor.long())
    high = z.gather(-1, positions.ceil().long())
    return low * (1.0 - weight) + high * weight


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

    def transform_scores(self, call: ScoreCall, scores: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        table = self.embeddings[0 if cfg.shared_across_layers else call.layer_idx]  # (npos, D)
        gates = torch.sigmoid(scores)  # (B, Hq, Tq, Tk): scores are q.k / sqrt(d) here
        positions = contextual_positions(gates, call.allowed, cfg.npos_max)  # (B, Hq, Tq, Tk)
        z = torch.matmul(call.q.float(), table.float().T)  # (B, Hq, Tq, npos)
        scale = self.geometry.head_dim**-0.5
        return scores + interpolate_position_logits(z, positions) * scale
