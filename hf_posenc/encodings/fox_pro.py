"""FoX (Pro): the Forgetting Transformer's "Pro" attention block (Lin et al., 2025;
reference ``ForgettingAttentionLayer`` of zhixuan-lin/forgetting-transformer with
``use_k_shift``, ``use_v_shift``, ``qk_norm``, ``use_output_norm``, ``use_output_gate``).

On top of FoX's forget-gate bias D (see ``fox``), each part can be switched off:

    token shift  k_t <- a_t k_{t-1} + (1 - a_t) k_t,   a_t = sigmoid(w_a^T x_t + b_a)   per KV head
                 (same for v with its own w, b), on the raw projections; k_{-1} = 0, and a token
                 at position 0 has no previous token (so left padding never leaks in)
    QK-norm      q <- RMSNorm(q) * g_q,  k <- RMSNorm(k) * g_k   per head, over head_dim (eps 1e-5)
    output norm  o <- RMSNorm(o) * g_o   per head on the attention output (eps 1e-6)
    output gate  o <- o * sigmoid(W_g x_t + b_g)     elementwise, before the output projection

in this order (shift, then QK-norm; norm, then gate, as the reference's ``FusedGroupNormGated``).
x_t is the layer's input. Decoding carries the last raw k and v of each layer in its state.

Initialisation keeps a pretrained model close to its function where it can: w_a = 0 and
b_a = logit(``shift_init``) (the previous token starts with weight 0.01: current token only),
W_g = 0 and b_g = logit(``output_gate_init``) (a constant gate, 0.9), norm gains 1, forget
gates as FoX. The reference trains from scratch with random w_a, W_g and no gate biases; its
``shift_proj`` bias is an option there, the output-gate bias is added here for this init.
The norms change the scale of q, k and o; switch them off to stay closer to the checkpoint.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..core.config import check_bool, check_number
from ..core.recompute import recomputed
from ..core.registry import register_encoding
from .call import LayerCall
from .fox import FoX
from .fox_common import STATE_KEY, ForgetGateConfig

QK_NORM_EPS = 1e-5  # the reference's GroupNorm default, used for QK-norm
OUTPUT_NORM_EPS = 1e-6  # the reference's norm_eps, used for the output norm


@dataclasses.dataclass
class FoXProConfig(ForgetGateConfig):
    encoding = "fox_pro"
    scaling_refusal = "fox_pro's bias sums data-dependent forget gates over the tokens between query and key; it is not a function of positions or distances"
    qk_norm: bool = True
    k_shift: bool = True
    v_shift: bool = True
    output_norm: bool = True
    output_gate: bool = True
    shift_init: float = 0.01
    output_gate_init: float = 0.9

    def validate(self) -> None:
        super().validate()
        for name in ("qk_norm", "k_shift", "v_shift", "output_norm", "output_gate"):
            check_bool(self.encoding, name, getattr(self, name))
        for name in ("shift_init", "output_gate_init"):
            check_number(
                self.encoding,
                name,
                getattr(self, name),
                low=0.0,
                high=1.0,
                low_inclusive=False,
                high_inclusive=False,
            )


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def _gate_linears(count: int, d_in: int, d_out: int, probability: float) -> nn.ModuleList:
    """``count`` Linear(d_in -> d_out) with zero weights and bias logit(p): a constant gate p."""
    linears = [nn.Linear(d_in, d_out) for _ in range(count)]
    with torch.no_grad():
        for linear in linears:
            linear.weight.zero_()
            linear.bias.fill_(_logit(probability))
    return nn.ModuleList(linears)


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., D) -> x / rms(x) * gain over the last dim, computed in fp32, in x's dtype."""
    y = x.float()
    y = y * torch.rsqrt(y.square().mean(dim=-1, keepdim=True) + eps)
    return (y * gain.float()).to(x.dtype)


def token_shift(
    x: torch.Tensor, alpha: torch.Tensor, previous: torch.Tensor | None, first: torch.Tensor | None
) -> torch.Tensor:
    """x (B,H,T,D), alpha (B,H,T,1) fp32, previous (B,H,1,D) or None, first (B,1,T,1) bool
    (tokens without a previous token) -> alpha * x_{t-1} + (1 - alpha) * x_t, in x's dtype."""
    if previous is None:
        previous = torch.zeros_like(x[:, :, :1])
    shifted = torch.cat((previous, x[:, :, :-1]), dim=2)  # (B, H, T, D): x_{t-1}
    if first is not None:
        shifted = shifted.masked_fill(first, 0.0)
    return (alpha * shifted.float() + (1.0 - alpha) * x.float()).to(x.dtype)


@register_encoding
class FoXPro(FoX):
    name = "fox_pro"
    aliases = ("foxpro", "fox_pro_block", "forgetting_transformer_pro")
    config_class = FoXProConfig
    config: FoXProConfig
    paper = "Lin et al. 2025, arXiv:2503.02130 (Pro block)"
    summary = "FoX forget gate plus token shift of k/v, QK-norm, output norm and output gate"
    stateful = True
    # the token shift keeps only the last raw k/v: a crop cannot recover the ones before it
    state_sequence_dims = {STATE_KEY: -1, "fox_pro_k_previous": None, "fox_pro_v_previous": None}

    def __init__(self, config: FoXProConfig, geometry) -> None:
        super().__init__(config, geometry)
        layers, hidden = geometry.num_layers, geometry.hidden_size
        hq, hkv, d = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
        # [layer]: Linear(hidden -> Hkv), the weight a_t of the previous token per KV head
        self.k_shift = _gate_linears(layers, hidden, hkv, config.shift_init) if config.k_shift else None
        self.v_shift = _gate_linears(layers, hidden, hkv, config.shift_init) if config.v_shift else None
        self.q_norm = nn.Parameter(torch.ones(layers, hq, d)) if config.qk_norm else None  # gains g_q
        self.k_norm = nn.Parameter(torch.ones(layers, hkv, d)) if config.qk_norm else None  # gains g_k
        self.output_norm = nn.Parameter(torch.ones(layers, hq, d)) if config.output_norm else None  # g_o
        # [layer]: Linear(hidden -> Hq*D), the output gate's logits
        self.output_gate = (
            _gate_linears(layers, hidden, hq * d, config.output_gate_init) if config.output_gate else None
        )

    def active_stages(self) -> list[str]:
        cfg = self.config
        stages = ["score_bias"]
        if cfg.qk_norm or cfg.k_shift or cfg.v_shift:
            stages.insert(0, "adjust_qkv")
        if cfg.output_norm or cfg.output_gate:
            stages.append("adjust_output")
        return stages

    def _alpha(self, linear, hidden: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, T, 1) fp32: a_t, in the model dtype up to the sigmoid."""
        return torch.sigmoid(linear(hidden).float()).transpose(1, 2)[..., None]

    def adjust_qkv(
        self, call: LayerCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shift, then norm, each recomputed in backward from the raw q, k, v (kept anyway for the
        norm's and the shift's gradients), not kept as shifted and normalised copies."""
        layer_idx, hidden, state = call.layer_idx, call.hidden, call.state
        first = (call.positions == 0)[:, None, :, None].to(k.device)  # (B, 1, T, 1): no previous token
        pieces: dict[str, dict[str, torch.Tensor | None]] = {
            "q": {},
            "k": {},
            "v": {},
        }  # per tensor: the shift's and the norm's tensors
        for name, linear, x in (("k", self.k_shift, k), ("v", self.v_shift, v)):
            if linear is None:
                continue
            key = f"fox_pro_{name}_previous"
            previous = None if state is None else state.get(key)  # (B, Hkv, 1, D): last raw x of the cache
            pieces[name].update(alpha=self._alpha(linear[layer_idx], hidden), first=first, previous=previous)
            if state is not None:
                state[key] = x[:, :, -1:]
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (config.qk_norm)
            pieces["q"]["gain"] = self.q_norm[layer_idx][:, None]  # (Hq, 1, D)
            pieces["k"]["gain"] = self.k_norm[layer_idx][:, None]  # (Hkv, 1, D)
        q, k, v = (_shift_norm(x, **pieces[name]) for name, x in (("q", q), ("k", k), ("v", v)))
        return q, k, v

    def adjust_output(self, call: LayerCall, out: torch.Tensor) -> torch.Tensor:
        """Norm, then gate, recomputed in backward from the attention output (kept by the
        attention anyway) and the gate's logits: not kept as normalised, sigmoid and gated copies
        (the gated output is kept once, by the output projection)."""
        layer_idx, heads = call.layer_idx, self.geometry.num_heads
        tensors = {}
        if self.output_norm is not None:
            tensors["gain"] = self.output_norm[layer_idx]  # (Hq, D)
        if self.output_gate is not None:
            tensors["logits"] = self.output_gate[layer_idx](call.hidden)  # (B, T, Hq*D), model dtype
        names = list(tensors)

        def norm_gate(out: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
            given = dict(zip(names, values, strict=True))
            b, t, _ = out.shape
            o = out.float()
            if "gain" in given:
                o = rms_norm(o.reshape(b, t, heads, -1), given["gain"], OUTPUT_NORM_EPS).reshape(b, t, -1)
            if "logits" in given:
                o = o * torch.sigmoid(given["logits"].float())
            return o.to(out.dtype)

        return recomputed(norm_gate, out, *tensors.values())


def _shift_norm(
    x: torch.Tensor,
    alpha: torch.Tensor | None = None,
    first: torch.Tensor | None = None,
    previous: torch.Tensor | None = None,
    gain: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (B,H,T,D) -> token shift (with ``alpha``), then RMS norm (with ``gain``), recomputed in
    backward from x and the given tensors (:func:`~hf_posenc.core.recompute.recomputed`)."""
    given = {
        n: t
        for n, t in (("alpha", alpha), ("first", first), ("previous", previous), ("gain", gain))
        if t is not None
    }
    if "alpha" not in given and "gain" not in given:
        return x
    names = list(given)

    def steps(x: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
        got = dict(zip(names, values, strict=True))
        if "alpha" in got:
            x = token_shift(x, got["alpha"], got.get("previous"), got.get("first"))
        if "gain" in got:
            x = rms_norm(x, got["gain"], QK_NORM_EPS)
        return x

    return recomputed(steps, x, *given.values())
