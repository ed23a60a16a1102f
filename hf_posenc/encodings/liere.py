"""LieRE: Lie rotational position encodings (Ostmeier et al., 2024, arXiv:2406.10322;
reference code StanfordMIMI/LieRE).

    A_a = U_a - U_a^T  (learned, skew-symmetric, block-diagonal with blocks of ``block_size``)
    R(p) = exp(sum_a p_a A_a),   q_p -> R(p) q_p,   k_p -> R(p) k_p

For text (``axes=1``) R(p)^T R(p') = exp((p' - p) A) = R(p' - p), so q.k depends only on
the relative position. With several axes the generators need not commute (the general,
non-relative case the paper studies). R is orthogonal because A is skew-symmetric.

The rotation acts on the first ``d_rot = head_dim * partial_rotary_factor`` dimensions,
arranged as Llama's rotary pairs (i, i + d_rot/2) made adjacent, then cut into blocks of
``block_size`` consecutive dimensions (a block holds ``block_size/2`` RoPE pairs). As in the
reference (``rotary_embedding_per_layer/per_head: True``) every layer and every KV head has
its own generators unless ``shared_across_layers`` / ``shared_across_heads``.

Initialisation. The reference draws generators uniformly in [0, 2 pi) for image
coordinates in [0, 1]; for token positions in the thousands that would scramble a
pretrained model, so here each block starts as RoPE's generator: pair i carries
omega_i = theta^(-2i/d_rot) in its 2x2 [[0, -1], [1, 0]] slot, zeros elsewhere, and the
patched model starts exactly as RoPE (the paper's "LieRE generalises RoPE" special case).

Cost. Each block's generator is decomposed once per forward (``skew_rotation``:
A = V J(mu) V^T, fp64 ``eigh``), and exp(p A) x = V rot(p mu) V^T x is RoPE's rotation with
the angles p mu between two (b x b) products: no per-position matrix is formed, and the
rotation is orthogonal by construction (angles in fp64). Where a block's eigenvalues are not
separated (a repeated or null frequency), that forward falls back to ``torch.linalg.matrix_exp``
in fp32, once per distinct position in the batch (reused across the layers that share
generators when no gradient is needed): its fp32 error grows like |p| * |A| * eps (for p in
the thousands, ~1e-3), and two Newton-Schulz polar steps R <- R (3I - R^T R) / 2 restore
orthogonality to fp32 rounding (~1e-6).

Position interpolation, ``scaling={'type': 'linear', 'factor': f}``: R(p / f) = exp(p / f A).
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
from ..errors import InvalidParameterError
from .base import Encoding
from .call import LayerCall
from .kept_values import KeptValues
from .rope import check_rotary_settings, fill_rotary_defaults, rotary_dim
from .skew_rotation import dense_basis, eigenbasis, rotate_qk


@dataclasses.dataclass
class LieREConfig(PositionInterpolation, EncodingConfig):
    encoding = "liere"
    block_size: int | None = None  # default: gcd(8, d_rot)
    theta: float | None = None  # RoPE base of the initial generators; default: the model's
    partial_rotary_factor: float | None = None  # default: the model's (1.0 if none)
    shared_across_layers: bool = False
    shared_across_heads: bool = False
    axes: int = 1  # coordinate axes per position; > 1 awaits N-D position coordinates
    scaling: dict | None = None

    def validate(self) -> None:
        if self.block_size is not None:
            check_number(self.encoding, "block_size", self.block_size, low=2, integer=True)
            if self.block_size % 2:
                raise InvalidParameterError(
                    f"{self.encoding}: parameter block_size={self.block_size!r} is not allowed; "
                    "allowed: an even integer >= 2 that divides the rotary dimension"
                )
        check_rotary_settings(self.encoding, self.theta, self.partial_rotary_factor)
        check_bool(self.encoding, "shared_across_layers", self.shared_across_layers)
        check_bool(self.encoding, "shared_across_heads", self.shared_across_heads)
        check_number(self.encoding, "axes", self.axes, low=1, high=1, integer=True)

    def resolve(self, geometry) -> LieREConfig:
        out = dataclasses.replace(self)
        fill_rotary_defaults(out, geometry)
        dim = rotary_dim(
            self.encoding,
            geometry.head_dim,
            resolved(out.partial_rotary_factor, self.encoding, "partial_rotary_factor"),
        )
        if out.block_size is None:
            out.block_size = math.gcd(8, dim)
        if dim % out.block_size:
            raise InvalidParameterError(
                f"{self.encoding}: parameter block_size={out.block_size!r} is not allowed; allowed: an even "
                f"integer >= 2 that divides the rotary dimension {dim}"
            )
        return out


def pair_permutation(dim: int) -> torch.Tensor:
    """Order putting Llama's rotary pairs (i, i + dim/2) next to each other: [0, dim/2, 1, dim/2+1, ...]."""
    half = torch.arange(dim // 2)
    return torch.stack((half, half + dim // 2), dim=-1).reshape(-1)


def rope_generators(dim: int, block_size: int, theta: float) -> torch.Tensor:
    """(dim/block_size, b, b) strictly upper-triangular U with U - U^T = RoPE's generator, pair layout.
    Built on the CPU (the loop reads omega's values, which a tensor on the meta device does not
    hold), then moved to the device tensors are being created on (meta inside ``torch.device("meta")``)."""
    omega = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)  # (dim/2,)
    upper = torch.zeros(dim // block_size, block_size, block_size, dtype=torch.float64, device="cpu")
    pairs = block_size // 2
    for i, w in enumerate(omega.tolist()):
        a = 2 * (i % pairs)
        upper[i // pairs, a, a + 1] = -w  # rotation [[cos, -sin], [sin, cos]] on (x_i, x_{i+dim/2})
    return upper.float().to(torch.empty(0).device)


#: |p A| (spectral norm) up to which float32 matrix_exp followed by the two polar steps stays
#: finite and a rotation (measured, torch 2.13: orthogonality error past 1e-2 from 1.8e6)
LIERE_LIMIT = 1e6


@register_encoding
class LieRE(Encoding[LieREConfig]):
    name = "liere"
    aliases = ("lie_rotary",)
    config_class = LieREConfig
    paper = "Ostmeier et al. 2024, arXiv:2406.10322"
    summary = "rotates q/k by exp(p A) with learned skew-symmetric block generators A (RoPE at init)"
    perm: torch.Tensor  # (d_rot,) buffer: the order putting rotary pairs next to each other
    inverse_perm: torch.Tensor  # (d_rot,) buffer: back to Llama's pair layout

    def __init__(self, config: LieREConfig, geometry) -> None:
        super().__init__(config, geometry)
        fraction = resolved(config.partial_rotary_factor, self.name, "partial_rotary_factor")
        self.dim = rotary_dim(self.name, geometry.head_dim, fraction)
        #: b, the size of the generator blocks
        self.block_size = resolved(config.block_size, self.name, "block_size")
        layers = 1 if config.shared_across_layers else geometry.num_layers
        heads = 1 if config.shared_across_heads else geometry.num_kv_heads
        theta = resolved(config.theta, self.name, "theta")
        init = rope_generators(self.dim, self.block_size, theta)  # (nb, b, b)
        # raw generators (layers, kv heads, axes, blocks, b, b); only the strict upper triangle is used
        self.generators = nn.Parameter(init.expand(layers, heads, config.axes, *init.shape).clone())
        perm = pair_permutation(self.dim)
        self.register_buffer("perm", perm, persistent=False)
        self.register_buffer("inverse_perm", torch.argsort(perm), persistent=False)
        #: eigenbases of the generators from earlier forwards without gradients (decoding steps)
        self.kept_decompositions = KeptValues()

    def scaled_range(self) -> ScaledRange | None:
        """exp(p / f A) in float32: matrix_exp and the polar steps stay finite while |p A / f|
        (spectral norm) is below LIERE_LIMIT, for the generators as they are now."""
        if self.config.factor == 1.0 or self.generators.is_meta:
            # on the meta device (transformers' from_pretrained builds there) the generators hold
            # no values yet: nothing to bound; the check runs when patched or reconfigured on values
            return None
        with torch.no_grad():
            layers = 1 if self.config.shared_across_layers else self.geometry.num_layers
            norm = max(float(torch.linalg.matrix_norm(self.skew(i), ord=2).max()) for i in range(layers))
        return positional_range(
            self.config.factor,
            self.geometry.max_position_embeddings,
            "generators |p A / f|",
            norm,
            LIERE_LIMIT,
            "where float32 matrix_exp with its polar steps stays finite",
        )

    def skew(self, layer_idx: int) -> torch.Tensor:
        """(heads, axes, blocks, b, b) fp32 skew-symmetric generators of one layer."""
        raw = self.generators[0 if self.config.shared_across_layers else layer_idx].float()
        upper = torch.triu(raw, diagonal=1)
        return upper - upper.transpose(-1, -2)

    def rotations(self, layer_idx: int, positions: torch.Tensor, memo: ForwardMemo) -> torch.Tensor:
        """positions (B,T) -> R (B, heads, T, blocks, b, b) fp32, one matrix_exp per distinct position."""
        unique, inverse = memo.get(
            ("liere-unique",), lambda: torch.unique(positions, return_inverse=True)
        )  # (U,), (B, T)

        def compute():
            skew = self.skew(layer_idx)  # (H, axes, nb, b, b)
            coords = interpolate(unique, self.config.factor).to(torch.float32)[:, None]  # (U, axes) p / f
            generator = torch.einsum("ua,hanij->uhnij", coords, skew)  # (U, H, nb, b, b)
            rotation = torch.linalg.matrix_exp(generator)  # (U, H, nb, b, b)
            # Newton-Schulz polar steps R <- R (3I - R^T R) / 2: the fp32 orthogonality error e of
            # exp(pA), which grows with |p A|, drops to ~1.5 e^2 per step (two small matmuls)
            eye = torch.eye(rotation.shape[-1], device=rotation.device)
            for _ in range(2):
                rotation = rotation @ (1.5 * eye - 0.5 * rotation.transpose(-1, -2) @ rotation)
            return rotation[inverse].transpose(1, 2)  # (B, H, T, nb, b, b)

        if torch.is_grad_enabled() and self.generators.requires_grad:
            return compute()
        key = 0 if self.config.shared_across_layers else layer_idx
        return memo.get(("liere-rotation", key), compute)

    def apply_rotation(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """x (B,H,T,D) rotated by R (B,H|1,T,nb,b,b) on its first d_rot dims; computed in fp32."""
        b = self.block_size
        rotated, passed = x[..., : self.dim], x[..., self.dim :]
        blocks = rotated.float()[..., self.perm].unflatten(-1, (self.dim // b, b))  # (B, H, T, nb, b)
        out = torch.einsum("bhtnij,bhtnj->bhtni", rotation, blocks).flatten(-2)  # (B, H, T, d_rot)
        out = out[..., self.inverse_perm].to(x.dtype)
        return torch.cat((out, passed), dim=-1) if passed.shape[-1] else out

    def decomposed(self, layer_idx: int, memo: ForwardMemo) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's generators in their eigenbasis: (W (heads, d_rot, d_rot) fp32 with rows in
        Llama's dim order, mu (heads, d_rot/2) fp64 in W's column order; see :mod:`.skew_rotation`),
        or None when some block's eigenvalues are not separated."""

        def compute(skew: torch.Tensor):
            decomposed = eigenbasis(skew[:, 0])  # axes == 1: (H, nb, b, b)
            if decomposed is None:
                return None
            basis, mu = decomposed  # (H, nb, b, b), (H, nb, b/2)
            dense = dense_basis(basis)[:, self.inverse_perm].float()  # rows: pair layout -> dims
            return dense, mu.flatten(-2)

        if torch.is_grad_enabled() and self.generators.requires_grad:
            return compute(self.skew(layer_idx))
        key = 0 if self.config.shared_across_layers else layer_idx
        return memo.get(
            ("liere-eigenbasis", key),
            lambda: self.kept_decompositions.get(key, (self.skew(layer_idx),), compute),
        )

    def rotate(self, call: LayerCall, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        decomposed = self.decomposed(call.layer_idx, call.memo)
        if decomposed is not None:
            dense, mu = decomposed  # (Hkv|1, d_rot, d_rot), (Hkv|1, d_rot/2)
            # fp32 angles p mu, as RoPE's p omega (fp64 cos/sin would cost more than the rotation)
            p = interpolate(call.positions, self.config.factor).float()  # (B, T) p / f
            angles = p[:, None, :, None] * mu.float()[None, :, None]  # (B, Hkv|1, T, d_rot/2)
            return rotate_qk(q, k, self.dim, dense, angles)
        rotation = self.rotations(call.layer_idx, call.positions, call.memo)  # (B, Hkv|1, T, nb, b, b)
        k_rot = self.apply_rotation(k, rotation)
        if rotation.shape[1] > 1:  # query head h uses the generators of its KV head h // group
            rotation = expand_kv_heads(rotation, q.shape[1] // rotation.shape[1])
        return self.apply_rotation(q, rotation), k_rot
