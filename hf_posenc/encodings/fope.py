"""FoPE: Fourier position embedding (Hua et al., 2024, "Fourier Position Embedding: Enhancing
Attention's Periodic Extension for Length Generalization", arXiv:2412.17739; reference code
yiju-zhao/Fourier-Position-Embedding, ``FourierEmbedding`` in ``olmo/model.py``).

Each rotary pair m of RoPE becomes a Fourier series over a grid of frequencies
omega'_j = theta^(-2j / (k d_rot)), j < k d_rot / 2 (``k = frequencies_per_dim``; the
reference's ``fourier_dim = k * head_dim``), with separate learned sine and cosine
coefficients C, S (per layer and KV head, the reference's ``separate_basis``/``separate_head``):

    cos_m(p) = sum_j C[j, m] cos(omega'_j p),   sin_m(p) = sum_j S[j, m] sin(omega'_j p)
    x_p -> x_p * cos(p) + rotate_half(x_p) * sin(p)      (q and k alike; Llama pair layout)

Clipping (the paper's "zero out under-trained frequencies"): a frequency whose period is
longer than the training length, omega < 2 pi / ``train_length``, is set to zero. Such
grid frequencies leave the series (the reference's ``ignore_zero``), and a pair whose own
RoPE frequency is clipped becomes the zero-frequency component: cos = 1, sin = 0, a
constant, position-independent identity. (The reference pads those pairs with cos = sin = 1
and caps the series at head_dim/4 pairs; here every surviving pair has its own series.)

Initialisation as the reference's ``eye_xavier_norm``: C = S = E + N(0, (sigma *
sqrt(2 / (n_in + n_out)))^2) where E maps pair m to its own frequency omega'_{k m}. With
``sigma=0`` and ``clip=False`` FoPE is exactly RoPE. The reference's coefficient
normalisation (``fourier_norm``) defaults to off and is not offered.

Position interpolation, ``scaling={'type': 'linear', 'factor': f}``: the series at p / f,
cos_m(p / f) and sin_m(p / f) (which frequencies are clipped does not change).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..core.config import EncodingConfig, check_bool, check_number, resolved
from ..core.interpolation import PositionInterpolation, ScaledRange, interpolate, positional_range
from ..core.layout import expand_kv_heads
from ..core.memo import ForwardMemo
from ..core.registry import register_encoding
from .base import Encoding
from .call import LayerCall
from .rope import check_rotary_settings, fill_rotary_defaults, rotary_dim, rotate_half
from .rope_scaling import base_inv_freq


@dataclasses.dataclass
class FoPEConfig(PositionInterpolation, EncodingConfig):
    encoding = "fope"
    train_length: int | None = None  # default: the model's max_position_embeddings
    clip: bool = True
    sigma: float = 0.3  # init scale of the off-identity Fourier coefficients
    frequencies_per_dim: int = 1
    theta: float | None = None  # default: the model's rope_theta (10000 for GPT-2)
    partial_rotary_factor: float | None = None  # default: the model's (1.0 if none)
    shared_across_layers: bool = False
    shared_across_heads: bool = False
    scaling: dict | None = None

    def validate(self) -> None:
        if self.train_length is not None:
            check_number(self.encoding, "train_length", self.train_length, low=1, integer=True)
        check_bool(self.encoding, "clip", self.clip)
        # coefficients of order sigma rescale q and k: far past the reference's 0.3, q.k overflows fp32
        check_number(self.encoding, "sigma", self.sigma, low=0.0, high=100.0)
        check_number(
            self.encoding, "frequencies_per_dim", self.frequencies_per_dim, low=1, high=64, integer=True
        )
        check_rotary_settings(self.encoding, self.theta, self.partial_rotary_factor)
        check_bool(self.encoding, "shared_across_layers", self.shared_across_layers)
        check_bool(self.encoding, "shared_across_heads", self.shared_across_heads)

    def resolve(self, geometry) -> FoPEConfig:
        out = dataclasses.replace(self)
        if out.train_length is None:
            out.train_length = int(geometry.max_position_embeddings)
        fill_rotary_defaults(out, geometry)
        rotary_dim(
            self.encoding,
            geometry.head_dim,
            resolved(out.partial_rotary_factor, self.encoding, "partial_rotary_factor"),
        )
        return out


def fourier_frequencies(dim: int, per_dim: int, theta: float, floor: float) -> torch.Tensor:
    """(per_dim * dim/2,) fp32 grid theta^(-2j/(per_dim*dim)), frequencies below ``floor`` set to 0."""
    grid = base_inv_freq(per_dim * dim, theta, None)  # RoPE's own frequencies when per_dim = 1
    return torch.where(grid < floor, 0.0, grid)


@register_encoding
class FoPE(Encoding[FoPEConfig]):
    name = "fope"
    aliases = ("fourier_position", "fourier_rope")
    config_class = FoPEConfig
    paper = "Hua et al. 2024, arXiv:2412.17739"
    summary = "each rotary pair is a learned Fourier series over frequencies; under-trained ones clipped to 0"
    frequencies: torch.Tensor  # (n_in,) buffer: the Fourier frequency grid, clipped ones 0
    pair_clipped: torch.Tensor  # (pairs,) bool buffer: the pair's own frequency is clipped

    def __init__(self, config: FoPEConfig, geometry) -> None:
        super().__init__(config, geometry)
        fraction = resolved(config.partial_rotary_factor, self.name, "partial_rotary_factor")
        self.dim = rotary_dim(self.name, geometry.head_dim, fraction)
        k, pairs = config.frequencies_per_dim, self.dim // 2
        train_length = resolved(config.train_length, self.name, "train_length")
        floor = 2 * math.pi / train_length if config.clip else 0.0
        freqs = fourier_frequencies(self.dim, k, resolved(config.theta, self.name, "theta"), floor)  # (n_in,)
        self.register_buffer("frequencies", freqs, persistent=False)
        self.register_buffer("pair_clipped", freqs[::k] == 0, persistent=False)  # (pairs,) own freq clipped
        layers = 1 if config.shared_across_layers else geometry.num_layers
        heads = 1 if config.shared_across_heads else geometry.num_kv_heads
        n_in = freqs.numel()
        eye = torch.zeros(n_in, pairs)
        eye[torch.arange(pairs) * k, torch.arange(pairs)] = 1.0
        std = config.sigma * math.sqrt(2.0 / (n_in + pairs))
        shape = (layers, heads, n_in, pairs)
        generator = torch.Generator().manual_seed(0)  # patching is deterministic
        self.cos_coef = nn.Parameter(
            eye + torch.randn(shape, generator=generator) * std
        )  # (L, H, n_in, pairs)
        self.sin_coef = nn.Parameter(eye + torch.randn(shape, generator=generator) * std)

    def scaled_range(self) -> ScaledRange | None:
        """Angles p / f * frequency in float32, for the largest frequency of the grid (1 =
        theta^0, the grid's first, when the buffer is on the meta device and holds no value)."""
        if self.config.factor == 1.0:
            return None  # unscaled: nothing to bound, and the buffer need not be read
        largest = 1.0 if self.frequencies.is_meta else float(self.frequencies.abs().max())
        return positional_range(
            self.config.factor,
            self.geometry.max_position_embeddings,
            "Fourier angles p * frequency / f",
            largest,
        )

    def cos_sin(self, layer_idx: int, positions: torch.Tensor, memo: ForwardMemo, dtype: torch.dtype):
        """positions (B,T) -> cos, sin (B, heads, T, d_rot) in ``dtype`` (fp32, or fp64 for an fp64
        model: see :meth:`rotate`)."""

        def features():
            scaled = interpolate(positions, self.config.factor)  # p / f
            angles = scaled[..., None].to(dtype) * self.frequencies.to(dtype)  # (B, T, n_in)
            live = (self.frequencies != 0).to(dtype)  # clipped grid frequencies leave the series
            return angles.cos() * live, angles.sin() * live

        cos_f, sin_f = memo.get(("fope-features", dtype), features)  # (B, T, n_in) each
        index = 0 if self.config.shared_across_layers else layer_idx
        cos = torch.einsum("btj,hjm->bhtm", cos_f, self.cos_coef[index].to(dtype))  # (B, H, T, pairs)
        sin = torch.einsum("btj,hjm->bhtm", sin_f, self.sin_coef[index].to(dtype))
        cos = torch.where(self.pair_clipped, 1.0, cos)  # clipped pairs: zero frequency, identity
        sin = torch.where(self.pair_clipped, 0.0, sin)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # (B, H, T, d_rot)

    def apply_rotation(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B,H,T,D): first d_rot dims -> x*cos + rotate_half(x)*sin in cos's dtype; the rest passes."""
        rotated, passed = x[..., : self.dim].to(cos.dtype), x[..., self.dim :]
        out = (rotated * cos + rotate_half(rotated) * sin).to(x.dtype)
        return torch.cat((out, passed), dim=-1) if passed.shape[-1] else out

    def rotate(self, call: LayerCall, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for an fp64 model
        cos, sin = self.cos_sin(call.layer_idx, call.positions, call.memo, dtype)  # (B, Hkv|1, T, d_rot)
        k_out = self.apply_rotation(k, cos, sin)
        if cos.shape[1] > 1:  # query head h uses the coefficients of its KV head
            group = q.shape[1] // cos.shape[1]
            cos, sin = expand_kv_heads(cos, group), expand_kv_heads(sin, group)
        return self.apply_rotation(q, cos, sin), k_out
