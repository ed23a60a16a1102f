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
import math
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..core.config import EncodingConfig, check_bool, check_choice
from ..core.layout import own_key
from ..core.registry import register_encoding
from ..core.underflow import exp_flushed
from .base import Encoding
from .call import ScoreCall
from .saturating_transform import BandBackward, VanishingWeights

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


#: a band whose sum of log(1 - beta) over its keys (the first included) lies below this leaves
#: every earlier key a log-weight below exp_flushed's clamp (log of fp32's smallest normal + 1/2),
#: so a weight of exactly 0 with no gradient; one unit of margin
VANISHED = math.log(torch.finfo(torch.float32).tiny) + 0.5 - 1.0


def stick_breaking_weights(scores: torch.Tensor, breaks: torch.Tensor) -> torch.Tensor:
    """scores (..., Tq, Tk) -> A (..., Tq, Tk) fp32, over the keys ``breaks`` (bool, broadcastable).

    A_ij = sigmoid(z_ij) * prod_{k > j, breaks_ik} (1 - sigmoid(z_ik)) where breaks_ij, else 0.
    """
    return _stick_breaking(scores, breaks)[0]


def _stick_breaking(scores: torch.Tensor, breaks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A as :func:`stick_breaking_weights`, the sum of log(1 - beta) over every key of the row
    from its first (..., Tq))."""
    z = scores.float()
    log_keep = F.logsigmoid(-z).masked_fill_(~breaks, 0.0)  # log(1 - beta), 0 off the stick
    # sum over k > j: reversed cumulative sum shifted by one key (no subtraction, no cancellation)
    sums = log_keep.flip(-1).cumsum(-1).flip(-1)  # (..., Tq, Tk) sum over k >= j
    after = F.pad(sums[..., 1:], (0, 1))
    log_weights = after.add_(F.logsigmoid(z)).masked_fill_(~breaks, float("-inf"))  # (..., Tq, Tk)
    # exp_flushed: most log-weights lie far below zero, where torch.exp leaves its fast path on CPU
    return exp_flushed(log_weights), sums[..., 0]


def _with_remainder(weights: torch.Tensor, own: torch.Tensor, remainder: str) -> torch.Tensor:
    """``remainder="current"``: the leftover mass 1 - sum_j A_ij added to the query's own key."""
    if remainder == "current":
        left = (1.0 - weights.sum(-1, keepdim=True)).clamp(min=0.0)  # (..., Tq, 1)
        weights = weights + left * own
    return weights


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
        return _with_remainder(weights, own, cfg.remainder)

    def band_form(self, call: ScoreCall) -> StickBreakingBand:
        return StickBreakingBand(self.config.attend_current, self.config.remainder)


@dataclasses.dataclass(frozen=True)
class StickBreakingBand(VanishingWeights):
    """Stick-breaking as :class:`VanishingWeights`: once the band's log(1 - beta) summed from its
    first key to the query passes :data:`VANISHED`, every key before the band has weight 0 (its
    log-weight adds more non-positive terms to that sum), as the eager weights have."""

    attend_current: bool
    remainder: str

    def band(
        self, q: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, own: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        breaks = allowed if self.attend_current else allowed & ~own  # (R, K)
        weights, kept = _stick_breaking(scores, breaks)  # (B, Hq, R, K), (B, Hq, R)
        return _with_remainder(weights, own, self.remainder), kept < VANISHED

    backward_by_hand: ClassVar[bool] = True

    def band_with_gradients(
        self, q: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, own: torch.Tensor
    ) -> tuple[torch.Tensor, BandBackward]:
        """:meth:`band`'s weights (the same operations) and their backward by hand, from the gradient
        dA' of the weights A' = A + max(1 - sum A, 0) own (``remainder="current"``; A' = A for
        ``"drop"``), with log A_ij = log sigmoid(z_ij) + sum_{t > j} log sigmoid(-z_it) on the stick:

            dA = dA' - (dA' at the own key) [1 - sum A >= 0]   (the remainder; the clamp's gradient),
            d log A = dA A   (exp_flushed's: 0 where the weight is flushed),
            dz_ij = d log A_ij sigmoid(-z_ij) - sigmoid(z_ij) sum_{j' < j} d log A_ij'   on the stick,

        the last sum an exclusive cumulative sum over the keys (the transpose of the reversed one).
        No autograd graph per block."""
        breaks = allowed if self.attend_current else allowed & ~own  # (R, K)
        z = scores.float()
        weights, _ = _stick_breaking(scores, breaks)  # (B, Hq, R, K) A
        out = _with_remainder(weights, own, self.remainder)

        def backward(
            grad_out: torch.Tensor, grad_tail: torch.Tensor | None
        ) -> tuple[torch.Tensor, None, dict[str, torch.Tensor]]:
            grad = grad_out.float()  # (B, Hq, R, K) dA'
            if self.remainder == "current":
                left_grad = (grad * own).sum(-1, keepdim=True)  # (B, Hq, R, 1) d max(1 - sum A, 0)
                open_rows = (1.0 - weights.sum(-1, keepdim=True)) >= 0.0  # the clamp passes its gradient
                grad = grad - left_grad * open_rows
            grad_log = grad * weights  # d log A
            # sum over j' < j of d log A (exclusive cumulative sum: shifted, no subtraction)
            before = F.pad(grad_log.cumsum(-1)[..., :-1], (1, 0))
            grad_z = grad_log * torch.sigmoid(-z) - before.masked_fill_(~breaks, 0.0) * torch.sigmoid(z)
            return grad_z.masked_fill_(~breaks, 0.0).to(scores.dtype), None, {}

        return out, backward
