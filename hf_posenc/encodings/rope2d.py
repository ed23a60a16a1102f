"""Axial rotary position embedding over N-D positions (RoPE-Mixed's axial baseline: Heo et al.
2024, "Rotary Position Embedding for Vision Transformer", arXiv:2403.13298, naver-ai/rope-vit;
lucidrains' rotary-embedding-torch ``get_axial_freqs``).

A token at coordinates x = (x_0, .., x_{N-1}) rotates its q/k dimension pairs; the pairs are
split evenly across the N axes and each pair turns by the coordinate on its own axis:

    pair p (dims p, p + d_rot/2):  axis a_p = p mod N,  angle x_{a_p} * omega_p,
    omega_p = theta^(-2 * floor(p / N) / (d_rot / N))

so every axis gets the reference's frequency set theta^(-2i/d_axis), i < d_axis/2. Then
<R(x) q, R(y) k> depends on y - x only. Pairs are interleaved across axes (rather than
contiguous as in rope-vit, a permutation of dimensions) so that the axis-0 pairs keep the
frequencies RoPE gives them in a pretrained Llama: text, whose coordinates are
(token position, 0, .., 0), rotates exactly the native RoPE pairs of axis 0 and leaves the
others unrotated.

Callers pass coordinates as ``model(input_ids, position_coordinates=coords)`` with ``coords``
(B|1, T, N) int or float; ``generate(..., position_coordinates=coords)`` takes coordinates
of the prompt and every token to be generated (L >= prompt + max_new_tokens): each step
reads its rows. Without them, text positions (padding-aware) are used on axis 0.

Position interpolation, ``scaling={'type': 'linear', 'factor': f}``: every coordinate is
divided by f (Chen et al. 2023's position interpolation on each axis), angle x_a / f * omega_p.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.config import EncodingConfig, check_number, resolved
from ..core.interpolation import PositionInterpolation, ScaledRange, interpolate, positional_range
from ..core.registry import register_encoding
from ..errors import InvalidParameterError
from .base import Encoding
from .call import LayerCall
from .rope import apply_rotary, check_rotary_settings, fill_rotary_defaults, rotary_dim

MAX_AXES = 16


def check_axes(encoding: str, axes: int) -> None:
    check_number(encoding, "axes", axes, low=1, high=MAX_AXES, integer=True)


def token_coordinates(
    encoding: str, coordinates: torch.Tensor | None, positions: torch.Tensor, axes: int
) -> torch.Tensor:
    """(B|1,T,axes) caller coordinates, or text positions (B,T) on axis 0 -> (B,T,axes) fp32."""
    if coordinates is None:
        out = positions.new_zeros(*positions.shape, axes, dtype=torch.float32)  # (B, T, axes)
        out[..., 0] = positions.float()
        return out
    if coordinates.shape[-1] != axes:
        raise InvalidParameterError(
            f"{encoding}: position_coordinates with {coordinates.shape[-1]} axes is not allowed; "
            f"allowed: {axes} axes (the encoding's parameter axes={axes})"
        )
    return coordinates.float().expand(positions.shape[0], -1, -1)


def axial_frequencies(dim: int, axes: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dim/2,) frequency omega_p and (dim/2,) axis index a_p of each rotated pair p."""
    pair = torch.arange(dim // 2, device=device)
    per_axis = dim // axes  # d_axis
    omega = theta ** (-2.0 * torch.div(pair, axes, rounding_mode="floor").double() / per_axis)
    return omega.float(), pair % axes


@dataclasses.dataclass
class RoPE2DConfig(PositionInterpolation, EncodingConfig):
    encoding = "rope2d"
    axes: int = 2
    theta: float | None = None  # default: the model's rope_theta (10000 for GPT-2)
    partial_rotary_factor: float | None = None  # default: the model's (1.0 if none)
    scaling: dict | None = None

    def validate(self) -> None:
        check_axes(self.encoding, self.axes)
        check_rotary_settings(self.encoding, self.theta, self.partial_rotary_factor)

    def resolve(self, geometry) -> RoPE2DConfig:
        out = dataclasses.replace(self)
        fill_rotary_defaults(out, geometry)
        dim = rotary_dim(
            self.encoding,
            geometry.head_dim,
            resolved(out.partial_rotary_factor, self.encoding, "partial_rotary_factor"),
        )
        if dim % (2 * out.axes):
            raise InvalidParameterError(
                f"{self.encoding}: parameter axes={out.axes} is not allowed for a rotary dimension of {dim}; "
                f"allowed: a divisor of {dim // 2} (each axis gets the same number of dimension pairs)"
            )
        return out


@register_encoding
class RoPE2D(Encoding[RoPE2DConfig]):
    name = "rope2d"
    aliases = ("axial_rope", "rope_axial", "rope_nd")
    config_class = RoPE2DConfig
    paper = "Heo et al. 2024, arXiv:2403.13298 (axial RoPE)"
    summary = "axial RoPE over N-D coordinates (position_coordinates=); text uses axis 0"
    takes_coordinates = True

    def __init__(self, config: RoPE2DConfig, geometry) -> None:
        super().__init__(config, geometry)
        fraction = resolved(config.partial_rotary_factor, self.name, "partial_rotary_factor")
        self.dim = rotary_dim(self.name, geometry.head_dim, fraction)

    def scaled_range(self) -> ScaledRange | None:
        """Angles x / f * omega in float32 (the largest omega is 1) for coordinates up to the horizon."""
        return positional_range(
            self.config.factor, self.geometry.max_position_embeddings, "rotation angles x * omega / f", 1.0
        )

    def rotate(self, call: LayerCall, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        theta = resolved(cfg.theta, self.name, "theta")

        def rotation() -> tuple[torch.Tensor, torch.Tensor]:
            coords = token_coordinates(self.name, call.coordinates, call.positions, cfg.axes)  # (B, T, N)
            coords = interpolate(coords, cfg.factor).float()  # x / f
            omega, axis = axial_frequencies(self.dim, cfg.axes, theta, device=q.device)  # (d_rot/2,)
            angles = coords[..., axis] * omega  # (B, T, d_rot/2)
            angles = torch.cat((angles, angles), dim=-1)[:, None]  # (B, 1, T, d_rot)
            return angles.cos().to(q.dtype), angles.sin().to(q.dtype)

        cos, sin = call.memo.get(("rope2d", q.dtype), rotation)  # (B, 1, T, d_rot) each
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
