"""Sandwich (Chi et al., 2023, "Dissecting Transformer Length Extrapolation via the Lens of
Receptive Field Analysis", ACL; arXiv:2212.10356): the inner product of two sinusoidal
position embeddings of dimension d' used as a parameter-free relative bias.

    <q_i, k_j> = q_i^T k_j + (p_i . p_j - d'/2) / r_h

    p_i . p_j = sum_{k=1}^{d'/2} cos((i - j) / 10000^(2k/d')),    r_h = 8 h / H,  h = 1 .. H

Subtracting d'/2 puts the diagonal at 0 (the bias is <= 0 everywhere); the head-specific
compression ratio r_h plays the role of ALiBi's slopes (the paper's ALiBi figure writes them
as 1/2^h for h = n * 8/H; Sandwich divides by that h instead), as in NeMo's
``SandwichRelativePositionEmbedding``. The frequency index k runs from 1 to d'/2 as in the
paper and NeMo. The bias is fixed (no parameters) and, with GQA, per query head.

Position interpolation, ``scaling={'type': 'linear', 'factor': f}``: the kernel of the
interpolated distance, cos((i - j) / f / 10000^(2k/d')).
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.config import EncodingConfig, check_number, fail
from ..core.interpolation import PositionInterpolation, interpolate
from ..core.registry import register_encoding
from .base import Encoding, module_cache
from .block_bias import DistanceBias
from .call import ScoreCall


@dataclasses.dataclass
class SandwichConfig(PositionInterpolation, EncodingConfig):
    encoding = "sandwich"
    dim: int = 128  # d', the dimension of the sinusoidal embeddings whose inner product is used
    scaling: dict | None = None

    def validate(self) -> None:
        check_number(self.encoding, "dim", self.dim, low=2, integer=True)
        if self.dim % 2:
            raise fail(self.encoding, "dim", self.dim, "an even integer >= 2")


def sandwich_kernel(distance: torch.Tensor, dim: int) -> torch.Tensor:
    """distance n (any shape) -> sum_{k=1}^{dim/2} cos(n / 10000^(2k/dim)) - dim/2, fp32."""
    k = torch.arange(1, dim // 2 + 1, device=distance.device, dtype=torch.float64)  # (dim/2,)
    inv_freq = 10000.0 ** (-2.0 * k / dim)
    angles = distance.to(torch.float64)[..., None] * inv_freq  # (..., dim/2)
    return (torch.cos(angles).sum(-1) - dim / 2).float()


def sandwich_ratios(num_heads: int) -> torch.Tensor:
    """(num_heads,) fp32 compression ratios 8h/H for h = 1 .. H."""
    return torch.arange(1, num_heads + 1, dtype=torch.float32) * (8.0 / num_heads)


@register_encoding
class Sandwich(Encoding[SandwichConfig]):
    name = "sandwich"
    reads_positions = False  # see Encoding.reads_positions
    config_class = SandwichConfig
    paper = "Chi et al. 2023, arXiv:2212.10356"
    summary = "fixed sinusoidal-kernel bias p_i.p_j - d'/2, scaled per head by H/(8h)"

    def distance_table(self, k_len: int, device: torch.device) -> torch.Tensor:
        """(Hq, Tk) fp32 bias of every distance 0 .. Tk-1."""
        kernel = self._kernel(k_len, device)  # (Tk,)
        ratios = sandwich_ratios(self.geometry.num_heads).to(device)  # (Hq,)
        return kernel[None] / ratios[:, None]

    def _kernel(self, k_len: int, device: torch.device) -> torch.Tensor:
        """(Tk,) kernel of distances 0 .. Tk-1, kept between forwards (a pure function of the
        distance: decoding would otherwise recompute dim/2 cosines per cached key every step)."""
        cache = module_cache(self)  # (device, dim) -> (capacity,) fp32; not state
        factor = self.config.factor
        key = ("kernel", device, self.config.dim, factor)
        kernel = cache.get(key)
        if kernel is None or kernel.shape[0] < k_len:
            capacity = max(1024, 1 << (k_len - 1).bit_length())  # doubling: O(log T) rebuilds
            kernel = sandwich_kernel(
                interpolate(torch.arange(capacity, device=device), factor), self.config.dim
            )
            cache[key] = kernel
        return kernel[:k_len]

    def score_bias(self, call: ScoreCall) -> DistanceBias:
        q_len, k_len, device = call.q_len, call.k_len, call.device
        return call.memo.get(
            ("sandwich", q_len, k_len, device),
            lambda: DistanceBias(q_len, k_len, self.distance_table(k_len, device)),
        )
