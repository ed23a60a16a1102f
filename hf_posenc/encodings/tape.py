"""TAPE, contextualised equivariant positional encoding (Zhu et al. 2025, "Rethinking Addressing
in Language Models via Contextualized Equivariant Positional Encoding", arXiv:2501.00712;
reference: VITA-Group/TAPE, ``models/llama/adape.py``, the ``adape`` variant).

Every token carries a positional stream ``E_t`` next to its hidden state: per stream head
``g`` (one per KV head; the reference's heads, which require MHA) a cosine and a sine
feature per frequency, stored as ``E = (C, S)`` with ``C, S`` of size ``D/2``:

    (1) init        C^0_t = cos(p_t w),  S^0_t = sin(p_t w),   w_f = theta^(-2f/D)
    (2) attention   q~_t = q_t * (C,C)_t + rotate_half(q_t) * (S,S)_t   (same for k~ with E of the key)
                    a_tj = softmax_j(q~_t . k~_j * scaling),  o_t = sum_j a_tj v_j
    (3) stream mix  E^{l+1/2}_t = E^l_t + gamma_l[g] * mean_{h in group g} sum_j a^h_tj E^l_j
    (4) PE layer    E^{l+1}_t   = E^{l+1/2}_t + W_down_l (silu(W_x_l x_t) * (W_up_l E^{l+1/2}_t))

``W_up`` (P x heads) and ``W_down`` (heads x P) mix stream heads, identically for every
feature, gated per token by ``silu(W_x x_t)`` (P channels). With RoPE init, (C_f, S_f) is the
complex number exp(i p w_f); (2)-(4) only form real combinations of such numbers over tokens
and heads, so shifting every position by c multiplies every stream by exp(i c w_f) and
q~_t . k~_j is unchanged: scores depend on relative structure only (equivariance). Since
(2)-(4) never distinguish the two copies of a frequency, ``C``/``S`` hold each once.

Differences from the reference (the first four forced by the stage contract or decoding):
``gamma_l`` is a per-head vector: the reference's ``einsum('bqnd,qe->bqnd', e, W)`` with
``W`` (heads x heads) scales head ``q`` by ``sum_e W[q, e]``, which is exactly this;
``x_t`` in (4) is the next layer's attention input (after its input norm), as the MLP
output the reference uses is not visible to an attention patch; (4) for layer ``l`` runs at
the start of layer ``l+1`` (the last layer's (3)/(4) do not change the output, so they have no
parameters, and its attention attends no stream); the training-time random position offset
is not applied (by equivariance it is a no-op in exact arithmetic); with GQA the stream lives on KV heads and (3) averages a
group's query heads. Init (the reference trains from scratch with ``nn.Linear``'s random init
everywhere): ``gamma = 0``, ``W_down = 0`` (``W_up``, ``W_x`` as ``nn.Linear``), so a patched
pretrained model starts exactly as RoPE and learns the context dependence.
The PE-layer matrices are stored fan-in normalised, ``W = raw / sqrt(fan_in)`` (raw ``x_proj``,
``up``, ``down``; raw init U(-1, 1), the same distribution as ``nn.Linear``'s init of W): the
same equations, but the stream's gain stays O(1) for O(1) raw values.

Attention and KV cache: the stream is attended with the weights of the values but is not a
part of them (``attends_stream``): the values keep the model's head width, so the KV cache
holds the model's own shapes and the attention stays one fused kernel (the attention core
appends the stream to the values and zero-pads q and k to the same width, which leaves every
score unchanged; ``attention/backend.py``; on CPU in fp32/fp64 ``attention/stream_flash.py``
instead: explicit blocks with the score products at q's width, and a backward from the
forward's log-sum-exp, no second forward). A cached key needs the stream it had, so the
stream ``E^l_j`` of the cached keys is TAPE's decoding state (``call.state``), aligned with the
cache's keys through sliding windows, cropping, batch selection and beam reordering.

Position interpolation, ``scaling={'type': 'linear', 'factor': f}``: the stream starts from the
interpolated positions, C^0_t = cos(p_t / f w), S^0_t = sin(p_t / f w); (2)-(4) are unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..core.config import EncodingConfig, check_number, resolved
from ..core.decoding_state import appended
from ..core.interpolation import PositionInterpolation, ScaledRange, interpolate, positional_range
from ..core.memo import ForwardMemo
from ..core.recompute import recomputed
from ..core.registry import register_encoding
from ..errors import InvalidParameterError, UnsupportedModelError
from .base import Encoding
from .call import LayerCall

STATE_KEY = "tape_stream"  # (B, Hkv, Tk, D): E^l of the keys the cache holds


@dataclasses.dataclass
class TAPEConfig(PositionInterpolation, EncodingConfig):
    encoding = "tape"
    theta: float | None = None  # default: the model's rope_theta (10000 for GPT-2)
    position_size: int | None = None  # P, channels of the PE layer; default 4 x stream heads
    scaling: dict | None = None

    def validate(self) -> None:
        if self.theta is not None:
            check_number(self.encoding, "theta", self.theta, low=1.0, low_inclusive=False)
        if self.position_size is not None:
            check_number(self.encoding, "position_size", self.position_size, low=1, integer=True)

    def resolve(self, geometry) -> TAPEConfig:
        out = dataclasses.replace(self)
        if out.theta is None:
            out.theta = float(geometry.rope_theta)
        if out.position_size is None:
            out.position_size = 4 * geometry.num_kv_heads
        if geometry.head_dim % 2:
            raise InvalidParameterError(
                f"tape: head_dim={geometry.head_dim} is not allowed; allowed: an even head dimension"
            )
        return out


def initial_stream(positions: torch.Tensor, theta: float, dim: int, heads: int, dtype) -> torch.Tensor:
    """(1): positions (B,T) -> E^0 (B, heads, T, dim) = (cos(p w), sin(p w))."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    exact = torch.float64 if dtype == torch.float64 else torch.float32
    angles = positions[..., None].to(exact) * inv_freq.to(exact)  # (B, T, dim/2)
    stream = torch.cat((angles.cos(), angles.sin()), dim=-1)  # (B, T, dim)
    return stream[:, None].expand(-1, heads, -1, -1).to(dtype)


def rotate_with_stream(x: torch.Tensor, stream: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """(2): x (B,H,T,D), stream (B,H/groups,T,D) = (C, S) -> x * (C,C) + rotate_half(x) * (S,S),
    KV head g's stream serving query heads g*groups .. (g+1)*groups-1.

    = (x1 c - x2 s, x2 c + x1 s) on the halves (x1, x2) of x, written into one output (no
    (B, H, T, D) copies of (C, C), (S, S) or rotate_half(x)); its backward is the transposed
    rotation, (g1 c + g2 s, g2 c - g1 s), and dC = sum_group (g1 x1 + g2 x2),
    dS = sum_group (g2 x1 - g1 x2), each a product and a fused multiply-add per half."""
    if torch.compiler.is_compiling():
        c, s = stream[:, :, None].chunk(2, dim=-1)  # (B, Hkv, 1, T, D/2)
        x1, x2 = x.unflatten(1, (-1, groups)).chunk(2, dim=-1)  # (B, Hkv, groups, T, D/2)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(1, 2)
    return _StreamRotation.apply(x, stream, groups)


def _rotate_into(
    out: torch.Tensor, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, sign: float
) -> torch.Tensor:
    """out = (x1 c - sign x2 s, x2 c + sign x1 s) on the halves of x (sign -1: the transpose)."""
    x1, x2 = x.chunk(2, dim=-1)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, c, out=o1).addcmul_(x2, s, value=-sign)
    torch.mul(x2, c, out=o2).addcmul_(x1, s, value=sign)
    return out


class _StreamRotation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, stream: torch.Tensor, groups: int) -> torch.Tensor:
        ctx.save_for_backward(x, stream)
        ctx.groups = groups
        c, s = stream[:, :, None].chunk(2, dim=-1)  # (B, Hkv, 1, T, D/2), broadcast over a group's heads
        grouped = x.unflatten(1, (-1, groups))  # (B, Hkv, groups, T, D)
        return _rotate_into(torch.empty_like(grouped), grouped, c, s, 1.0).flatten(1, 2)  # (B, H, T, D)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, stream = ctx.saved_tensors
        c, s = stream[:, :, None].chunk(2, dim=-1)
        g = grad.unflatten(1, (-1, ctx.groups))  # (B, Hkv, groups, T, D)
        dx = dstream = None
        if ctx.needs_input_grad[0]:
            dx = _rotate_into(torch.empty_like(g), g, c, s, -1.0).flatten(1, 2)
        if ctx.needs_input_grad[1]:
            grouped = x.unflatten(1, (-1, ctx.groups))
            g1, g2 = g.chunk(2, dim=-1)
            x1, x2 = grouped.chunk(2, dim=-1)
            both = torch.empty_like(g)  # (B, Hkv, groups, T, D): (dC, dS) per query head
            d_c, d_s = both.chunk(2, dim=-1)
            torch.mul(g1, x1, out=d_c).addcmul_(g2, x2)
            torch.mul(g2, x1, out=d_s).addcmul_(g1, x2, value=-1.0)
            dstream = both.sum(2) if ctx.groups > 1 else both.squeeze(2)  # (B, Hkv, T, D)
        return dx, dstream, None


def pe_layer(
    half: torch.Tensor, gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """(4): half (B,G,T,D) = E^{l+1/2}, gate (B,T,P) = silu(W_x x), W_up (P,G), W_down (G,P) ->
    E^{l+1} = half + W_down (gate * (W_up half)), (B,G,T,D).

    Computed as half + M_t half with the per-token head mixing M_t = W_down diag(gate_t) W_up
    (B, T, G, G): the same sum regrouped, whose only intermediate is G x G per token, not the
    (B, P, T, D) products W_up half and gate * (W_up half) (P = 4G channels of D features: 4x
    the stream, twice, and kept by autograd for backward)."""
    dtype = half.dtype
    scaled_down = w_down.to(dtype) * gate.to(dtype)[..., None, :]  # (B, T, G, P): W_down diag(gate_t)
    # (B, T, G, G): M_t, one (B*T*G, P) x (P, G) product (no permuted copy of a (B, T, P, G) tensor)
    mixing = torch.matmul(scaled_down, w_up.to(dtype))
    return half + torch.einsum("btgh,bhtd->bgtd", mixing, half)


@register_encoding
class TAPE(Encoding[TAPEConfig]):
    name = "tape"
    carries_layer_stream = True
    attends_stream = True
    stateful = True
    state_sequence_dims = {STATE_KEY: -2}
    aliases = ("adape",)
    config_class = TAPEConfig
    paper = "Zhu et al. 2025, arXiv:2501.00712"
    summary = "RoPE-initialised positional stream updated by attention and a gated head-mixing layer"

    def __init__(self, config: TAPEConfig, geometry) -> None:
        super().__init__(config, geometry)
        size = resolved(config.position_size, self.name, "position_size")  # P
        heads, hidden = geometry.num_kv_heads, geometry.hidden_size
        steps = max(geometry.num_layers - 1, 0)  # transitions l -> l+1 that reach an attention
        self.groups = geometry.num_heads // heads
        self.gamma = nn.Parameter(torch.zeros(steps, heads))  # (3), per layer and stream head
        self.up = nn.Parameter(torch.empty(steps, size, heads))  # (4) W_up
        self.x_proj = nn.Parameter(torch.empty(steps, size, hidden))  # (4) W_x
        self.down = nn.Parameter(torch.zeros(steps, heads, size))  # (4) W_down, zero: starts as RoPE
        #: W = raw / sqrt(fan_in) for W_up, W_x, W_down
        self.fan_in = {"up": math.sqrt(heads), "x_proj": math.sqrt(hidden), "down": math.sqrt(size)}
        with torch.no_grad():  # raw U(-1, 1): nn.Linear's default init of W
            self.up.uniform_(-1.0, 1.0)
            self.x_proj.uniform_(-1.0, 1.0)

    def scaled_range(self) -> ScaledRange | None:
        """The initial stream's angles p / f * omega in float32 (the largest omega is 1)."""
        return positional_range(
            self.config.factor, self.geometry.max_position_embeddings, "rotation angles p * omega / f", 1.0
        )

    def active_stages(self) -> list[str]:
        return ["adjust_qkv", "adjust_output"]

    def _stream(
        self, layer_idx: int, hidden: torch.Tensor, positions: torch.Tensor, memo: ForwardMemo, dtype
    ):
        """E^l of this layer's new tokens, (B, Hkv, T, D)."""
        if layer_idx == 0:
            dim, heads = self.geometry.head_dim, self.geometry.num_kv_heads
            theta = resolved(self.config.theta, self.name, "theta")
            return memo.get(
                ("tape", dtype),
                lambda: initial_stream(interpolate(positions, self.config.factor), theta, dim, heads, dtype),
            )
        # E^{l-1/2}'s last use without gradients: not held by the memo until the forward ends (one
        # (B, Hkv, T, D) per layer, the inference peak growing with depth); with gradients it stays
        # for a recomputation of this layer (gradient checkpointing) and pe_layer keeps it anyway
        carried = ("tape", layer_idx - 1)
        half = memo.carry.get(carried) if torch.is_grad_enabled() else memo.carry.pop(carried, None)
        if half is None:
            raise RuntimeError(
                f"tape: layer {layer_idx} ran without the positional stream of layer {layer_idx - 1}"
            )
        step = layer_idx - 1
        w_x, w_up, w_down = (getattr(self, n)[step] / self.fan_in[n] for n in ("x_proj", "up", "down"))
        gate = F.silu(hidden @ w_x.to(hidden.dtype).T)  # (B, T, P)
        # (4) keeps half and gate for backward, not its two (B, P, T, D) products (recomputed)
        return recomputed(pe_layer, half, gate, w_up, w_down)

    def adjust_qkv(
        self, call: LayerCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        layer_idx, memo = call.layer_idx, call.memo
        stream = self._stream(layer_idx, call.hidden, call.positions, memo, q.dtype)  # (B, Hkv, T, D)
        memo.carry[("tape-in", layer_idx)] = stream
        # (2) keeps q, k and the stream for backward, not the rotation's (B, H, T, D) pieces
        rotate_q = functools.partial(rotate_with_stream, groups=self.groups)
        return recomputed(rotate_q, q, stream), recomputed(rotate_with_stream, k, stream), v

    def attended_stream(self, call: LayerCall, k_len: int) -> torch.Tensor:
        """E^l of the ``k_len`` keys attended: the cached keys' (decoding state) and the new ones';
        none (zero features) in the last layer, whose (3) would not reach an attention: its
        attention is then the model's own, at the model's head width."""
        stream = call.memo.carry[("tape-in", call.layer_idx)]  # (B, Hkv, T, D)
        if call.state is not None:
            cached = call.state.get(STATE_KEY)  # (B, Hkv, Tcached, D)
            if cached is not None:  # grown in place: no copy of the whole stream per step
                stream = appended(cached, stream.to(cached.dtype))
            stream = stream[..., -k_len:, :]  # the keys the cache returned (sliding windows drop old ones)
            call.state[STATE_KEY] = stream
        if stream.shape[-2] != k_len:
            raise UnsupportedModelError(
                f"tape: the KV cache holds {k_len} keys but the positional-stream state knows "
                f"{stream.shape[-2]}; a cache must be filled by this patched model from its first token"
            )
        if call.layer_idx >= self.gamma.shape[0]:
            return stream.new_empty(*stream.shape[:-1], 0)  # (B, Hkv, Tk, 0); not a view: keeps no storage
        return stream  # (B, Hkv, Tk, D)

    def adjust_output(self, call: LayerCall, out: torch.Tensor) -> torch.Tensor:
        layer_idx, memo = call.layer_idx, call.memo
        d = self.geometry.head_dim
        last = layer_idx >= self.gamma.shape[0]  # attended no stream (attended_stream)
        # (B, T, Hq*D + Hq*D): every head's attended values, then stream; the last layer's (B, T, Hq*D)
        values = out.shape[-1] if last else out.shape[-1] // 2
        # E^l's last use in this layer: not kept until backward by the memo (a recomputation
        # under gradient checkpointing sets it again in adjust_qkv)
        stream = memo.carry.pop(("tape-in", layer_idx))  # (B, Hkv, T, D)
        if not last:
            pos = out[..., values:].unflatten(-1, (-1, d)).transpose(1, 2)  # (B, Hq, T, D) = sum_j a_tj E_j
            if self.groups > 1:  # a group's query heads averaged; with MHA a view of the output
                pos = pos.unflatten(1, (-1, self.groups)).mean(2)  # (B, Hkv, T, D)
            gamma = self.gamma[layer_idx].to(stream.dtype)[None, :, None, None]
            memo.carry[("tape", layer_idx)] = stream + gamma * pos.to(stream.dtype)  # (3)
        return out[..., :values]  # (B, T, Hq*D), a view: the output projection keeps no copy
