"""Stick-breaking attention (Tan et al., 2024, "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study"; reference: shawntan/stickbreaking-attention ``sb_ref.py``).

The softmax is replaced by a stick-breaking process running backwards from the query:

    z_ij = q_i . k_j / sqrt(d),   beta_ij = sigmoid(z_ij)
    A_ij = beta_ij * prod_{j < k, k in S_i} (1 - beta_ik)                 for j in S_i
    log A_ij = log sigmoid(z_ij) + sum_{k > j, k in S_i} log sigmoid(-z_ik)
             = z_ij - softplus(z_ij) - sum_{k > j, k in S_i} softplus(z_ik)

computed in log space in fp32, where S_i is the set of keys the stick-breaking runs over:
the allowed keys (causal, padding, sliding window) *before* the query (``attend_current=
False``, the reference's default: its mask is ``triu(0)``, so the diagonal is excluded), or
including the query's own key (``attend_current=True``, mask ``triu(1)``). Masked keys
contribute nothing. The weights are not normalised: sum_j A_ij <= 1. As in the reference's
tests and models (``o = o + rem[..., None] * v`` with ``rem = 1 - A.sum(-1)``), the leftover
mass goes to the current token's value by default (``remainder="current"``: the weight of
key i grows by 1 - sum_j A_ij, so each row sums to 1); ``remainder="drop"`` discards it.
SBA has no positional encoding of its own and no parameters; decoding needs no state.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..core.config import EncodingConfig, check_bool, check_choice
from ..core.layout import own_key
from ..core.registry import register_encoding
from ..core.underflow import exp_flushed
from .base import Encoding
from .call import ScoreCall

REMAINDERS = ("current", "drop")


@dataclasses.dataclass
class SBAConfig(EncodingConfig):
    encoding = "sba"
    scaling_refusal = (
        "stick-breaking attention has no positions; order comes from data-dependent break probabilities"
    )
    attend_current: bool = False
    remainder: str = "current"

    def validate(self) -> None:
        check_bool(self.encoding, "attend_current", self.attend_current)
        check_choice(self.encoding, "remainder", self.remainder, REMAINDERS)


def stick_breaking_weights(scores: torch.Tensor, breaks: torch.Tensor) -> torch.Tensor:
    """scores (..., Tq, Tk) -> A (..., Tq, Tk) fp32, over the keys ``breaks`` (bool, broadcastable).

    A_ij = sigmoid(z_ij) * prod_{k > j, breaks_ik} (1 - sigmoid(z_ik)) where breaks_ij, else 0.
    """
    z = scores.float()
    log_keep = F.logsigmoid(-z).masked_fill_(~breaks, 0.0)  # log(1 - beta), 0 off the stick
    # sum over k > j: reversed cumulative sum shifted by one key (no subtraction, no cancellation)
    after = F.pad(log_keep.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))
    log_weights = after.add_(F.logsigmoid(z)).masked_fill_(~breaks, float("-inf"))  # (..., Tq, Tk)
    # exp_flushed: most log-weights lie far below zero, where torch.exp leaves its fast path on CPU
    return exp_flushed(log_weights)


@register_encoding
class StickBreaking(Encoding[SBAConfig]):
    name = "sba"
    reads_positions = False  # see Encoding.reads_positions
    aliases = ("stickbreaking", "stick_breaking")
    config_class = SBAConfig
    paper = "Tan et al. 2024, arXiv:2410.17980"
    summary = "stick-breaking attention replaces the softmax; leftover mass to the current token"

    def rows_independent(self) -> bool:
        return True

    def heads_independent(self) -> bool:
        return True  # each head's sticks from its own scores; no parameters

    def normalize(self, call: ScoreCall, scores: torch.Tensor) -> torch.Tensor:
        cfg, allowed = self.config, call.allowed
        q_len, k_len, device = scores.shape[-2], scores.shape[-1], scores.device
        own = call.memo.get(("sba_diagonal", q_len, k_len, device), lambda: own_key(q_len, k_len, device))
        if allowed is None:  # every key allowed
            allowed = torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=device)
        breaks = allowed if cfg.attend_current else allowed & ~own  # (B|1, 1, Tq, Tk)
        weights = stick_breaking_weights(scores, breaks)  # (B, Hq, Tq, Tk)
        if cfg.remainder == "current":
            left = (1.0 - weights.sum(-1, keepdim=True)).clamp(min=0.0)  # (B, Hq, Tq, 1)
            weights = weights + left * own
        return weights
