"""FoX: the Forgetting Transformer (Lin et al., 2025, "Forgetting Transformer: Softmax
Attention with a Forget Gate", ICLR 2025; reference code zhixuan-lin/forgetting-transformer).

    f_t      = sigmoid(w_f^T x_t + b_f)                          per query head
    <q_i,k_j> = q_i^T k_j + D_ij,   D_ij = sum_{l=j+1}^{i} log f_l   (D_ii = 0)

x_t is the hidden state entering the attention layer. D is computed in fp32 as c_i - c_j with
c_t = sum_{l<=t} log f_l (``logsigmoid`` for stability); it is 0 on the diagonal, never
positive, and non-increasing with the distance. No other positional encoding is used.
With grouped-query attention the gate is per query head.

Initialisation (for continued pretraining of a checkpoint): w_f = 0 and b_f per head such
that f = exp(-1/T_h), T_h log-spaced from ``decay_time_min`` to ``decay_time_max`` (the
reference's ``fgate_bias_init``), so the patched model starts with gates near 1: a gentle
ALiBi-like bias -(i-j)/T_h, close to NoPE. (The reference trains from scratch with b_f = 0.)

Decoding carries the log f of the cached keys in the layer state (see ``fox_common``);
left padding cannot reach real tokens: D between two real tokens only sums the gates of
tokens between them, which are real, and padded keys are masked.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, cast

from torch import nn

from ..core.config import EncodingConfig
from ..core.registry import register_encoding
from .base import Encoding
from .block_bias import CumulativeBias, SeparableBias
from .call import ScoreCall
from .fox_common import STATE_KEY, ForgetGateConfig, cumulative_log_forget, forget_gates, log_forget


@dataclasses.dataclass
class FoXConfig(ForgetGateConfig):
    encoding = "fox"
    scaling_refusal = "fox's bias sums data-dependent forget gates over the tokens between query and key; it is not a function of positions or distances"


@register_encoding
class FoX(Encoding[ForgetGateConfig]):
    name = "fox"
    reads_positions = False  # see Encoding.reads_positions
    # typed as the base declares them, so FoX (Pro) may set its own
    aliases: ClassVar[tuple[str, ...]] = ("forgetting_transformer", "forgetting_attention")
    config_class: ClassVar[type[EncodingConfig]] = FoXConfig
    paper = "Lin et al. 2025, arXiv:2503.02130"
    summary = "data-dependent forget gate: logits + sum of log forget gates between key and query"
    stateful = True
    scores_read_hidden = True  # the forget gates are computed from the layer input
    state_sequence_dims = {STATE_KEY: -1}

    def __init__(self, config: ForgetGateConfig, geometry) -> None:
        super().__init__(config, geometry)
        self.forget = forget_gates(config, geometry)  # [layer]: Linear(hidden -> Hq)

    def forget_gate(self, layer_idx: int) -> nn.Linear:
        """The forget gate of layer ``layer_idx``, Linear(hidden -> Hq)."""
        # forget_gates builds self.forget from nn.Linear modules only
        return cast(nn.Linear, self.forget[layer_idx])

    def score_bias(self, call: ScoreCall) -> SeparableBias:
        log_f = log_forget(self.forget_gate(call.layer_idx), call.hidden)  # (B, Hq, Tq)
        c = cumulative_log_forget(log_f, call.k_len, call.state)  # (B, Hq, Tk)
        if call.q_len == call.k_len:  # no cached keys: c is the running sum of exactly these log f
            return CumulativeBias(log_f, c)
        return SeparableBias(call.q_len, call.k_len, c[..., -call.q_len :], c)  # D_ij = c_i - c_j
