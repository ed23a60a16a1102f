"""Rotary position embedding (Su et al., 2021, "RoFormer", arXiv:2104.09864).

    q_m -> R_{Theta,m} q_m,  k_n -> R_{Theta,n} k_n,  so  <q_m, k_n> = q_m^T R_{Theta,n-m} k_n

R rotates dimension pairs by angles m*omega_i with omega_i = theta^(-2i/d_rot). Pairs are
(i, i + d_rot/2), the layout of Llama/Mistral checkpoints (``rotate_half``), so
``patch_model(llama, "rope")`` reproduces the native model exactly. Only the first
``d_rot = head_dim * partial_rotary_factor`` dimensions rotate. ``scaling`` selects a
context-extension schedule (see :mod:`.rope_scaling`): ``linear``, ``ntk``, ``dynamic``,
``yarn``, ``llama3`` or ``longrope``.

Per-layer settings (hybrid families, read from ``ModelGeometry.layers``): with ``theta`` left
at None each layer rotates with its own native base (Gemma 3: 10k on sliding layers, 1M on
global ones), and with ``scaling="model"`` each layer keeps its own native scaling (Gemma 3:
linear on global layers only). Layers where the native model does not rotate
(``LayerGeometry.native_rotary``, SmolLM3's NoPE layers) are left unrotated, so the defaults
reproduce the native model (a SmolLM3 whose every layer is NoPE: no layer rotates, as
natively); in a family whose own positions are not rotary (``ModelGeometry.rotary_positions``
False: GPT-2's learned table) every layer rotates. The defaults (theta, scaling) come from
the layers that rotate: a Gemma 3 whose layers are all sliding-window ones uses their 10k
base, not the global layers' 1M.

Dynamic NTK and LongRoPE change the frequencies with the sequence length. Computing them from the
length of the whole input (as transformers does) makes every token's hidden states depend
on tokens after it, so a KV cache can never reproduce a full forward. Here the schedule is
causal: the query at position p uses the frequencies for length p + 1, with keys rotated
to match (see :mod:`.rope_dynamic`). Decoding with a cache then equals a full forward.
LongRoPE likewise: the query at p uses ``short_factor`` while p + 1 <= L0 and ``long_factor``
past it (transformers switches the whole input once it is longer than L0), with keys rotated
by the query's set; within L0 that is exactly the native model.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..core.config import EncodingConfig, check_number, resolved
from ..core.interpolation import ScaledRange, positional_range
from ..core.layout import expand_kv_heads
from ..core.registry import register_encoding
from ..errors import InvalidParameterError
from .base import Encoding
from .call import LayerCall, ScoreCall
from .rope_dynamic import causal_dynamic_logits
from .rope_scaling import (
    LENGTH_DEPENDENT,
    check_frequency_count,
    inverse_frequencies,
    resolve_scaling,
    validate_scaling,
)


@dataclasses.dataclass
class RoPEConfig(EncodingConfig):
    encoding = "rope"
    native_positions = "rotary"
    theta: float | None = None  # default: the model's rope_theta (10000 for GPT-2)
    partial_rotary_factor: float | None = None  # default: the model's (1.0 if none)
    #: "model" (default): the checkpoint's own scaling (Llama 3.x's llama3, yarn, linear, ...);
    #: None: unscaled; or a dict such as {"type": "linear", "factor": 4.0}
    scaling: dict | str | None = "model"

    def validate(self) -> None:
        check_rotary_settings(self.encoding, self.theta, self.partial_rotary_factor)
        if self.scaling != "model":
            validate_scaling(self.encoding, self.scaling)

    def resolve(self, geometry) -> RoPEConfig:
        """Fill the model's values; ``theta=None`` / ``scaling="model"`` stay as they are when the
        model's layers differ in them (resolved per layer, see the module docstring)."""
        out = dataclasses.replace(self)
        fill_rotary_defaults(out, geometry)
        # the layers that rotate natively decide the defaults (every layer when the native
        # positions are not rotary); the model-wide values only when none does
        layers = rotating_layers(geometry) or model_layers(geometry)
        if self.theta is None:
            thetas = {layer.rope_theta for layer in layers}
            out.theta = float(thetas.pop()) if len(thetas) == 1 else None
        if out.scaling == "model":
            scalings = [layer.rope_scaling for layer in layers]
            per_layer = any(scaling != scalings[0] for scaling in scalings)
            for scaling in scalings if per_layer else scalings[:1]:
                check_native_scaling(self.encoding, scaling, per_layer)
            if not per_layer:
                out.scaling = resolve_scaling(scalings[0], geometry.max_position_embeddings)
        else:
            out.scaling = resolve_scaling(explicit_scaling(out.scaling), geometry.max_position_embeddings)
        partial = resolved(out.partial_rotary_factor, self.encoding, "partial_rotary_factor")
        dim = rotary_dim(self.encoding, geometry.head_dim, partial)
        if out.scaling == "model":
            for layer in layers:
                check_frequency_count(
                    self.encoding, resolve_scaling(layer.rope_scaling, geometry.max_position_embeddings), dim
                )
        else:
            check_frequency_count(self.encoding, explicit_scaling(out.scaling), dim)
        return out


def explicit_scaling(scaling: dict | str | None) -> dict | None:
    """A scaling other than ``"model"`` (validated: None or a dict), typed as such."""
    if isinstance(scaling, str):
        raise RuntimeError(f"rope: scaling {scaling!r} should have been resolved from the model's layers")
    return scaling


def model_layers(geometry) -> list:
    """Every layer's :class:`~hf_posenc.models.base.LayerGeometry`."""
    return [geometry.layer(index) for index in range(geometry.num_layers)]


def rotates_natively(geometry, layer) -> bool:
    """Whether ``rope`` rotates ``layer``: where the native model rotates when the family's own
    positions are RoPE (none of a SmolLM3 whose every layer is NoPE: the native model), every
    layer when they are something else (GPT-2's learned table, which rope replaces)."""
    return layer.native_rotary or not geometry.rotary_positions


def rotating_layers(geometry) -> list:
    """The layers ``rope`` rotates (see :func:`rotates_natively`)."""
    return [layer for layer in model_layers(geometry) if rotates_natively(geometry, layer)]


def check_native_scaling(encoding: str, scaling: dict | None, per_layer: bool) -> None:
    """Refuse a checkpoint's own scaling that rope does not implement (or, per layer, dynamic NTK)."""
    try:
        validate_scaling(encoding, scaling)
        if per_layer and scaling is not None and scaling["type"] == "dynamic":
            raise InvalidParameterError("dynamic NTK on some layers only is not implemented")
    except InvalidParameterError as error:
        raise InvalidParameterError(
            f"rope: the checkpoint's own RoPE scaling {scaling!r} is not supported ({error}); pass "
            "scaling=None to drop it or a supported scaling dict to replace it"
        ) from None


def check_rotary_settings(encoding: str, theta: float | None, partial_rotary_factor: float | None) -> None:
    """Validate the settings every rotary encoding shares (None means: the model's own)."""
    if theta is not None:
        check_number(encoding, "theta", theta, low=1.0, low_inclusive=False)
    if partial_rotary_factor is not None:
        check_number(
            encoding, "partial_rotary_factor", partial_rotary_factor, low=0.0, high=1.0, low_inclusive=False
        )


def fill_rotary_defaults(config, geometry) -> None:
    """Fill ``theta`` and ``partial_rotary_factor`` left at None with the model's own values."""
    if config.theta is None:
        config.theta = float(geometry.rope_theta)
    if config.partial_rotary_factor is None:
        config.partial_rotary_factor = float(geometry.partial_rotary_factor)


def rotary_dim(encoding: str, head_dim: int, fraction: float) -> int:
    """Number of rotated dimensions; raises unless it is even and at least 2."""
    dim = int(head_dim * fraction)
    if dim < 2 or dim % 2:
        raise InvalidParameterError(
            f"{encoding}: rotary dimension head_dim * partial_rotary_factor = {head_dim} * {fraction} -> {dim} "
            "is not allowed; allowed: an even number >= 2 (rotations act on pairs of dimensions)"
        )
    return dim


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B,T) -> cos, sin (B,1,T,d_rot) in ``dtype``."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # (B, T, d_rot/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (B, T, d_rot)
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first d_rot dims of x (B,H,T,D) by cos/sin (B,1,T,d_rot); pass the rest."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rotated, passed = x[..., :dim], x[..., dim:]
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, passed), dim=-1)


@register_encoding
class RoPE(Encoding[RoPEConfig]):
    name = "rope"
    aliases: ClassVar[tuple[str, ...]] = ("rotary", "roformer")
    config_class = RoPEConfig
    paper = "Su et al. 2021, arXiv:2104.09864"
    summary = "rotates q/k dimension pairs by position-proportional angles; optional context scaling"

    def __init__(self, config: RoPEConfig, geometry) -> None:
        super().__init__(config, geometry)
        self.dim = rotary_dim(
            self.name,
            geometry.head_dim,
            resolved(config.partial_rotary_factor, self.name, "partial_rotary_factor"),
        )
        layers = model_layers(geometry)
        #: per layer: (theta, resolved scaling) of its rotation, or None where it does not rotate
        self.layer_rotations: list[tuple[float, dict | None] | None] = []
        for layer in layers:
            theta = config.theta if config.theta is not None else layer.rope_theta
            if config.scaling == "model":
                scaling = resolve_scaling(layer.rope_scaling, geometry.max_position_embeddings)
            else:
                scaling = explicit_scaling(config.scaling)
            self.layer_rotations.append(
                (float(theta), scaling) if rotates_natively(geometry, layer) else None
            )
        #: a length-dependent schedule on some layer: q.k is computed per query (``logits``)
        self.per_query = any(
            r is not None and r[1] is not None and r[1]["type"] in LENGTH_DEPENDENT
            for r in self.layer_rotations
        )

    def scaled_range(self) -> ScaledRange | None:
        """Angles p * omega / f in float32 (the largest omega is 1) under a linear scaling."""
        factors = [
            r[1]["factor"]
            for r in self.layer_rotations
            if r is not None and r[1] and r[1]["type"] == "linear"
        ]
        if not factors:
            return None
        return positional_range(
            float(min(factors)), self.geometry.max_position_embeddings, "rotation angles p * omega / f", 1.0
        )

    def active_stages(self) -> list[str]:
        return ["logits"] if self.per_query else ["rotate"]

    def _rotation(self, layer_idx: int) -> tuple[float, dict | None]:
        """(theta, scaling) of a layer that rotates (callers skip the NoPE layers)."""
        rotation = self.layer_rotations[layer_idx]
        if rotation is None:
            raise RuntimeError(f"rope: layer {layer_idx} does not rotate (a native NoPE layer)")
        return rotation

    def _cos_sin(self, call: LayerCall, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, T, d_rot) of this layer's rotation (shared by layers with the same one)."""
        theta, scaling = self._rotation(call.layer_idx)

        def rotation() -> tuple[torch.Tensor, torch.Tensor]:
            inv_freq, factor = inverse_frequencies(self.dim, theta, scaling, device=like.device)
            return cos_sin(call.positions, inv_freq, factor, like.dtype)

        return call.memo.get(("rope", like.dtype, theta, repr(scaling)), rotation)

    def rotate(self, call: LayerCall, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_rotations[call.layer_idx] is None:  # a natively position-free layer (NoPE)
            return q, k
        cos, sin = self._cos_sin(call, q)  # (B, 1, T, d_rot) each
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def logits(self, call: ScoreCall) -> torch.Tensor:
        rotation = self.layer_rotations[call.layer_idx]
        scaling = None if rotation is None else rotation[1]
        if rotation is None or scaling is None or scaling["type"] not in LENGTH_DEPENDENT:
            # a layer without a length-dependent schedule in a model that has one
            return self._plain_logits(call, None if rotation is None else self._rotate_cached(call))
        theta, kind = rotation[0], scaling["type"]
        if call.key_positions is None:
            raise ValueError(f"rope ({kind}): the logits stage needs the key positions")
        if kind == "longrope":
            # the query at p uses the factors for length p + 1: short_factor up to L0, long_factor past it
            original = scaling["original_max_position_embeddings"]
            logits = self._plain_logits(call, self._rotate_cached(call))
            past = call.positions + 1 > original  # (B, Tq)
            if bool(past.any()):
                long = self._plain_logits(call, self._rotate_cached(call, seq_len=original + 1))
                logits = torch.where(past[:, None, :, None], long, logits)
            return logits
        return causal_dynamic_logits(
            call.q,
            call.k,
            call.positions,
            call.key_positions,
            theta=theta,
            dim=self.dim,
            factor=scaling["factor"],
            original=scaling["original_max_position_embeddings"],
        )

    @staticmethod
    def _plain_logits(call: ScoreCall, rotated: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """q.k^T (B, Hq, Tq, Tk) fp32 of ``rotated`` (q, k), or of the call's own q, k when None."""
        q, k = (call.q, call.k) if rotated is None else rotated
        groups = q.shape[1] // k.shape[1]
        k = expand_kv_heads(k, groups)  # (B, Hq, Tk, D)
        dtype = torch.promote_types(q.dtype, torch.float32)
        return torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2))

    def _rotate_cached(
        self, call: ScoreCall, seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q at ``call.positions`` and the raw cached k at ``call.key_positions``, rotated with
        this layer's frequencies for a sequence of ``seq_len`` tokens (None: the base ones)."""
        theta, scaling = self._rotation(call.layer_idx)
        key_positions = call.positions if call.key_positions is None else call.key_positions
        inv_freq, factor = inverse_frequencies(self.dim, theta, scaling, seq_len, device=call.q.device)
        q_cos, q_sin = cos_sin(call.positions, inv_freq, factor, call.q.dtype)
        k_cos, k_sin = cos_sin(key_positions, inv_freq, factor, call.k.dtype)
        return apply_rotary(call.q, q_cos, q_sin), apply_rotary(call.k, k_cos, k_sin)
