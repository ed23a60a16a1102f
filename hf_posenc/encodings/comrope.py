"""ComRoPE: rotary embedding with trainable commuting angle matrices (Yu et al. 2025,
"ComRoPE: Scalable and Robust Rotary Position Embedding Parameterized by Trainable Commuting
Angle Matrices", arXiv:2506.03737; Longin-Yu/ComRoPE).

A token at coordinates x = (x_0, .., x_{N-1}) rotates q and k by

    R(x) = exp(sum_a x_a A_a),   A_a = diag(B_a1, .., B_am)  (m = d_rot / b blocks of size b)

with skew-symmetric blocks that commute across axes, so R(x)^T R(y) = R(y - x): scores
depend only on relative position. Per layer and KV head, with trainable P_j (b x b):

    ap (axis partition):   B_aj = P_j - P_j^T  if j = a (mod N), else 0
    ld (linearly dependent): B_aj = s_aj (P_j - P_j^T)  with trainable scalars s_aj

Both are ``B_aj = c_aj S_j`` with S_j = P_j - P_j^T and a coefficient matrix c (N, m): the
fixed one-hot ``[j mod N == a]`` for ap, trainable for ld. Blocks commute because, for each
block, every axis uses a multiple of the same S_j. The exponentials are taken per block
as RoPE's rotation in each generator's eigenbasis: S_j = V_j J(mu_j) V_j^T once per forward
(``skew_rotation``, fp64 ``eigh``), then exp(w S_j) x = V_j rot(w mu_j) V_j^T x with
w = sum_a x_a c_aj, angles in fp64: no per-position matrix, RoPE's cost plus two (b x b)
products. Where a block's eigenvalues are not separated (a repeated or null frequency) that
forward falls back to ``torch.linalg.matrix_exp`` per distinct position, in fp32 by default; its
rounding error grows with |x| * |S| (R^T R - I is ~2e-4 at position 512 and ~2e-3 at 4096 for
|S| = 1), so long contexts can ask for ``matrix_exp_dtype="float64"`` (exact to ~1e-12; the
result is used in fp32), which also computes the eigenbasis path's angles w mu in fp64
(fp32 by default: an angle error of order |w mu| * eps, as RoPE's fp32 angles).

Layout: block j holds dims (j, j + m, .., j + (b-1) m) of the first d_rot dims, so with
b = 2 the blocks are Llama's RoPE pairs (i, i + d_rot/2). Initialisation reproduces RoPE
(the axial rope2d for N > 1): block coordinates (c, c + b/2) form the RoPE pair
p = j + c m, turning at omega_p = theta^(-2 floor(p/N) / (d_rot/N)), and ld starts with
c = the ap one-hot. A patched pretrained Llama therefore starts exactly at its own function
(N = 1, the default). Text uses its token positions on axis 0; N-D coordinates are passed as
``position_coordinates`` exactly as for rope2d.

Position interpolation, ``scaling={'type': 'linear', 'factor': f}``: coordinates divided by f,
R(x / f) = exp(sum_a x_a / f A_a).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..core.config import EncodingConfig, check_choice, check_number, resolved
from ..core.interpolation import (
    MATRIX_EXP_FINITE,
    PositionInterpolation,
    ScaledRange,
    interpolate,
    positional_range,
)
from ..core.registry import register_encoding
from ..errors import InvalidParameterError
from .base import Encoding
from .call import LayerCall
from .kept_values import KeptValues
from .rope import check_rotary_settings, fill_rotary_defaults, rotary_dim
from .rope2d import axial_frequencies, check_axes, token_coordinates
from .skew_rotation import dense_basis, eigenbasis, rotate_qk

VARIANTS = ("ap", "ld")
EXP_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclasses.dataclass
class ComRoPEConfig(PositionInterpolation, EncodingConfig):
    encoding = "comrope"
    variant: str = "ap"
    block_size: int = 4
    axes: int = 1
    theta: float | None = None  # initial frequencies; default: the model's rope_theta
    partial_rotary_factor: float | None = None  # default: the model's (1.0 if none)
    matrix_exp_dtype: str = "float32"
    scaling: dict | None = None

    def validate(self) -> None:
        check_choice(self.encoding, "variant", self.variant, VARIANTS)
        check_choice(self.encoding, "matrix_exp_dtype", self.matrix_exp_dtype, EXP_DTYPES)
        check_number(self.encoding, "block_size", self.block_size, low=2, high=64, integer=True)
        if self.block_size % 2:
            raise InvalidParameterError(
                f"{self.encoding}: parameter block_size={self.block_size} is not allowed; "
                "allowed: an even integer in [2, 64] (blocks start as RoPE rotation pairs)"
            )
        check_axes(self.encoding, self.axes)
        check_rotary_settings(self.encoding, self.theta, self.partial_rotary_factor)

    def resolve(self, geometry) -> ComRoPEConfig:
        out = dataclasses.replace(self)
        fill_rotary_defaults(out, geometry)
        dim = rotary_dim(
            self.encoding,
            geometry.head_dim,
            resolved(out.partial_rotary_factor, self.encoding, "partial_rotary_factor"),
        )
        if dim % (out.block_size * out.axes):
            raise InvalidParameterError(
                f"{self.encoding}: block_size={out.block_size} with axes={out.axes} is not allowed for a "
                f"rotary dimension of {dim}; allowed: block_size * axes dividing {dim}"
            )
        return out


def initial_generators(dim: int, block: int, axes: int, theta: float) -> torch.Tensor:
    """(m, b, b) skew-symmetric blocks S_j that make exp(x S_j) RoPE's rotation of block j."""
    m = dim // block
    omega, _ = axial_frequencies(dim, axes, theta)  # (d_rot/2,)
    out = torch.zeros(m, block, block)
    half = block // 2
    for c in range(half):  # RoPE pair p = j + c*m: block coordinates (c, c + b/2)
        out[:, c + half, c] = omega[c * m : (c + 1) * m]
        out[:, c, c + half] = -omega[c * m : (c + 1) * m]
    return out


@register_encoding
class ComRoPE(Encoding[ComRoPEConfig]):
    name = "comrope"
    aliases = ("comrope_ap", "comrope_ld")
    config_class = ComRoPEConfig
    paper = "Yu et al. 2025, arXiv:2506.03737"
    summary = "trainable commuting rotary generators exp(sum_a x_a A_a) (variants ap, ld); N-D coordinates"
    takes_coordinates = True
    axis_mask: torch.Tensor  # (N, m) buffer of variant "ap": block j rotates with axis j mod N

    def __init__(self, config: ComRoPEConfig, geometry) -> None:
        super().__init__(config, geometry)
        fraction = resolved(config.partial_rotary_factor, self.name, "partial_rotary_factor")
        self.dim = rotary_dim(self.name, geometry.head_dim, fraction)
        b, n = config.block_size, config.axes
        self.blocks = self.dim // b  # m
        layers, kv_heads = geometry.num_layers, geometry.num_kv_heads
        theta = resolved(config.theta, self.name, "theta")
        start = initial_generators(self.dim, b, n, theta)  # (m, b, b) = P - P^T
        # P_j per layer and KV head (q heads share their KV head's rotation); P - P^T = start
        self.generator = nn.Parameter(start.div(2).expand(layers, kv_heads, -1, -1, -1).clone())
        #: eigenbases of the generators from earlier forwards without gradients (decoding steps)
        self.kept_decompositions = KeptValues()
        one_hot = (torch.arange(self.blocks) % n == torch.arange(n)[:, None]).float()  # (N, m)
        if config.variant == "ld":
            self.axis_scale = nn.Parameter(one_hot.expand(layers, -1, -1).clone())  # (L, N, m)
        else:
            self.register_buffer("axis_mask", one_hot, persistent=False)  # (N, m)

    def scaled_range(self) -> ScaledRange | None:
        """exp(x / f B) in ``matrix_exp_dtype``: finite while |x B / f| (spectral norm) is below
        :data:`~hf_posenc.core.interpolation.MATRIX_EXP_FINITE`, for the generators as they are now."""
        if self.config.factor == 1.0 or self.generator.is_meta:
            # on the meta device (transformers' from_pretrained builds there) the generators hold
            # no values yet: nothing to bound; the check runs when patched or reconfigured on values
            return None
        dtype = self.config.matrix_exp_dtype
        with torch.no_grad():
            norm = max(
                float(torch.linalg.matrix_norm(self.skew(i), ord=2).max() * self.coefficients(i).abs().max())
                for i in range(self.generator.shape[0])
            )
        return positional_range(
            self.config.factor,
            self.geometry.max_position_embeddings,
            "generators |x B / f|",
            norm,
            MATRIX_EXP_FINITE[dtype],
            f"where {dtype} matrix_exp stays finite",
        )

    def coefficients(self, layer_idx: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, m) coefficients c_aj: B_aj = c_aj S_j."""
        if self.config.variant == "ld":
            return self.axis_scale[layer_idx].to(dtype)
        return self.axis_mask.to(dtype)

    def skew(self, layer_idx: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(Hkv, m, b, b) skew-symmetric S_j = P_j - P_j^T of one layer."""
        p = self.generator[layer_idx].to(dtype)
        return p - p.transpose(-1, -2)

    def rotation(self, layer_idx: int, coords: torch.Tensor) -> torch.Tensor:
        """coords (U, N) -> R (U, Hkv, m, b, b) fp32, R = exp(sum_a x_a B_aj) per block."""
        dtype = EXP_DTYPES[self.config.matrix_exp_dtype]
        weight = coords.to(dtype) @ self.coefficients(layer_idx, dtype)  # (U, m)
        exponent = weight[:, None, :, None, None] * self.skew(layer_idx, dtype)[None]  # (U, Hkv, m, b, b)
        return torch.linalg.matrix_exp(exponent).float()

    def decomposed(self, layer_idx: int, memo) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's S_j in their eigenbasis: (W (Hkv, d_rot, d_rot) fp32, rows in the dims'
        order, mu (Hkv, m, b/2) fp64; see :mod:`.skew_rotation`), or None when some block's
        eigenvalues are not separated."""

        def compute(skew: torch.Tensor):
            decomposed = eigenbasis(skew)  # (Hkv, m, b, b)
            if decomposed is None:
                return None
            basis, mu = decomposed
            heads, m, b = basis.shape[:3]
            dense = dense_basis(basis)  # rows: block j, member r -> dim r m + j
            dense = dense.reshape(heads, m, b, -1).transpose(1, 2).reshape(heads, m * b, -1)
            return dense.float(), mu

        if torch.is_grad_enabled() and self.generator.requires_grad:
            return compute(self.skew(layer_idx))
        return memo.get(
            ("comrope-eigenbasis", layer_idx),
            lambda: self.kept_decompositions.get(layer_idx, (self.skew(layer_idx),), compute),
        )

    def rotate(self, call: LayerCall, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        decomposed = self.decomposed(call.layer_idx, call.memo)
        if decomposed is not None:
            dense, mu = decomposed  # (Hkv, d_rot, d_rot), (Hkv, m, b/2)
            coords = token_coordinates(self.name, call.coordinates, call.positions, cfg.axes)  # (B|1, T, N)
            # angles w mu in matrix_exp_dtype (fp32 by default, as RoPE's p omega)
            dtype = EXP_DTYPES[cfg.matrix_exp_dtype]
            coords = interpolate(coords, cfg.factor).to(dtype)  # x / f
            weight = coords @ self.coefficients(call.layer_idx, dtype)  # (B|1, T, m): w_j
            angles = (weight[:, None, :, :, None] * mu.to(dtype)[None, :, None]).flatten(
                -2
            )  # (B|1, Hkv, T, d_rot/2)
            return rotate_qk(q, k, self.dim, dense, angles)

        def distinct() -> tuple[torch.Tensor, torch.Tensor]:
            coords = token_coordinates(self.name, call.coordinates, call.positions, cfg.axes)  # (B, T, N)
            coords = interpolate(coords, cfg.factor).float()  # x / f
            unique, inverse = torch.unique(coords.reshape(-1, cfg.axes), dim=0, return_inverse=True)
            return unique, inverse  # (U, N), (B*T,)

        unique, inverse = call.memo.get(("comrope", "distinct"), distinct)
        batch, length = call.positions.shape
        rot = self.rotation(call.layer_idx, unique)[inverse]  # (B*T, Hkv, m, b, b)
        rot = rot.view(batch, length, *rot.shape[1:]).transpose(1, 2)  # (B, Hkv, T, m, b, b)
        return self._rotate_blocks(q, rot), self._rotate_blocks(k, rot)

    def _rotate_blocks(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """x (B,H,T,D), rot (B,Hkv,T,m,b,b) -> x with its first d_rot dims rotated blockwise."""
        batch, heads, length, _ = x.shape
        kv_heads, m, b = rot.shape[1], self.blocks, self.config.block_size
        rotated, passed = x[..., : self.dim], x[..., self.dim :]
        blocks = rotated.float().reshape(batch, kv_heads, heads // kv_heads, length, b, m)
        blocks = blocks.transpose(-1, -2)  # (B, Hkv, G, T, m, b): block j = dims j, j+m, ..
        out = torch.einsum("bhtnij,bhgtnj->bhgtni", rot, blocks)  # (B, Hkv, G, T, m, b)
        out = out.transpose(-1, -2).reshape(batch, heads, length, self.dim).to(x.dtype)
        return torch.cat((out, passed), dim=-1) if passed.shape[-1] else out
