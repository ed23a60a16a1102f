"""xPos: rotary embedding with an exponential decay (Sun et al., 2023, "A Length-Extrapolatable
Transformer", ACL 2023, arXiv:2212.10554, Section 3; reference code microsoft/torchscale
``torchscale/component/xpos_relative_position.py``, also lucidrains/x-transformers).

RoPE's rotation R_n of token n, plus a per-pair scale that grows for queries and shrinks for
keys, so the pair's contribution to q_n . k_m decays with the distance n - m:

    q_n -> zeta^(n/gamma) * R_n q_n,   k_m -> zeta^(-m/gamma) * R_m k_m
    q_n . k_m = sum_i zeta_i^((n-m)/gamma) (R_{n-m} pair_i terms)        (relative, decaying)

    zeta_i = (i / (d/2) + c) / (1 + c),   i = 0 .. d/2 - 1   (pair i of the rotary dims, d = d_rot)

with the paper's and torchscale's ``gamma = scale_base = 512`` and ``c = 0.4`` (torchscale:
``(arange(0, d, 2) + 0.4 d) / (1.4 d)``). High-frequency pairs (small i) decay fastest; every
zeta_i < 1. The rotation frequencies are RoPE's omega_i = theta^(-2i/d), theta defaulting to
the checkpoint's own, on the checkpoint's pair layout (i, i + d/2) (torchscale pairs adjacent
dims, a relabelling of the same dims), so xpos on a RoPE checkpoint starts as its RoPE times the
decay. Every layer rotates (also the NoPE layers of SmolLM3 and GPT-2's: xpos replaces the
model's positions).

Exponents: only zeta^((n-m)/gamma) reaches the score, so any common offset of positions cancels;
torchscale centres them on the middle of the sequence. Here the exponent is the position itself
(keys are cached already scaled, so the offset must stay fixed across decoding steps), computed in
fp32. The query scale of pair 0 underflows once n/gamma * ln(1/zeta_0) exceeds the dtype's range:
the first position past it (:func:`position_limit`) raises :class:`PositionRangeError` (about
35.7k positions at the defaults in fp32 and bf16, 3.9k in fp16; a larger ``scale_base`` moves it).

``scaling``: RoPE's frequency schedules that do not depend on the sequence length (``linear``,
``ntk``, ``yarn``, ``llama3``; see :mod:`.rope_scaling`). ``linear`` is position interpolation for
the whole encoding: rotation and decay both see n / f. The others change the rotation frequencies
only (the decay keeps n). Dynamic NTK and LongRoPE are refused (per-query frequencies).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..core.config import EncodingConfig, check_number, fail, resolved
from ..core.interpolation import ScaledRange, positional_range
from ..core.registry import register_encoding
from ..errors import PositionRangeError
from .base import Encoding
from .call import LayerCall
from .rope import apply_rotary, check_rotary_settings, cos_sin, fill_rotary_defaults, rotary_dim
from .rope_scaling import LENGTH_DEPENDENT, inverse_frequencies, resolve_scaling, validate_scaling

#: headroom (in powers of two) kept between the smallest query scale and the dtype's smallest
#: normal number, so that scaled queries keep their precision
HEADROOM_BITS = 10


@dataclasses.dataclass
class XPosConfig(EncodingConfig):
    encoding = "xpos"
    theta: float | None = None  # default: the model's rope_theta (10000 for GPT-2)
    partial_rotary_factor: float | None = None  # default: the model's (1.0 if none)
    scale_base: float = 512.0  # gamma: the decay exponent is position / scale_base
    gamma: float = 0.4  # c in zeta_i = (i/(d/2) + c) / (1 + c)
    scaling: dict | None = None

    def validate(self) -> None:
        check_rotary_settings(self.encoding, self.theta, self.partial_rotary_factor)
        check_number(self.encoding, "scale_base", self.scale_base, low=0.0, low_inclusive=False)
        check_number(self.encoding, "gamma", self.gamma, low=0.0, low_inclusive=False)
        validate_scaling(self.encoding, self.scaling)
        if self.scaling is not None and self.scaling["type"] in LENGTH_DEPENDENT:
            raise fail(
                self.encoding,
                "scaling['type']",
                self.scaling["type"],
                "'linear', 'ntk', 'yarn' or 'llama3' (frequencies that do not depend on the sequence length)",
            )

    def resolve(self, geometry) -> XPosConfig:
        out = dataclasses.replace(self)
        fill_rotary_defaults(out, geometry)
        out.scaling = resolve_scaling(out.scaling, geometry.max_position_embeddings)
        rotary_dim(
            self.encoding,
            geometry.head_dim,
            resolved(out.partial_rotary_factor, self.encoding, "partial_rotary_factor"),
        )
        return out


def decay_base(dim: int, gamma: float) -> torch.Tensor:
    """zeta (dim/2,) fp64: zeta_i = (i / (dim/2) + gamma) / (1 + gamma)."""
    half = dim // 2
    return (torch.arange(half, dtype=torch.float64) / half + gamma) / (1 + gamma)


def smallest_decay_base(gamma: float) -> float:
    """zeta_0 = gamma / (1 + gamma), the smallest of :func:`decay_base` (the same fp64 number),
    without a tensor: a model built on the meta device has no values to read."""
    return (0.0 + gamma) / (1 + gamma)


def position_limit(dim: int, gamma: float, scale_base: float, factor: float, dtype: torch.dtype) -> int:
    """The first position whose query scale zeta_0^(n/(f*scale_base)) falls below the dtype's
    smallest normal number times 2^HEADROOM_BITS (keys' scale, its inverse, stays below the max)."""
    smallest = math.log(torch.finfo(dtype).tiny) + HEADROOM_BITS * math.log(2.0)  # < 0
    zeta0 = smallest_decay_base(gamma)
    return math.floor(smallest / math.log(zeta0) * scale_base * factor) + 1


@register_encoding
class XPos(Encoding[XPosConfig]):
    name = "xpos"
    aliases = ("xpos_rope", "length_extrapolatable")
    config_class = XPosConfig
    paper = "Sun et al. 2023, arXiv:2212.10554"
    summary = "rotary embedding times a per-dimension decay zeta^(n/gamma) on queries and its inverse on keys"

    def __init__(self, config: XPosConfig, geometry) -> None:
        super().__init__(config, geometry)
        fraction = resolved(config.partial_rotary_factor, self.name, "partial_rotary_factor")
        self.dim = rotary_dim(self.name, geometry.head_dim, fraction)
        scaling = config.scaling
        #: positions are divided by this in the decay exponent (linear scaling: the whole encoding)
        self.decay_factor = (
            float(scaling["factor"]) if scaling is not None and scaling["type"] == "linear" else 1.0
        )

    def scaled_range(self) -> ScaledRange | None:
        """Under a linear scaling ``f``: the rotation angles p * omega / f (as rope's, over the
        horizon) and the decay exponents n ln(1/zeta_0) / (f scale_base), whose query scale
        zeta_0^(n/(f scale_base)) must stay a float32 number (with HEADROOM_BITS to spare) up to
        max_position_embeddings; past the trained length, positions the model's dtype cannot
        scale are refused when they arrive (``_check_range``). The tighter of the two."""
        if self.decay_factor == 1.0:
            return None
        angles = positional_range(
            self.decay_factor, self.geometry.max_position_embeddings, "rotation angles p * omega / f", 1.0
        )
        longest = self.geometry.max_position_embeddings
        decay = ScaledRange(
            self.decay_factor,
            "decay exponents n ln(1/zeta_0) / (f * scale_base)",
            longest * -math.log(smallest_decay_base(self.config.gamma)) / self.config.scale_base,
            -(math.log(torch.finfo(torch.float32).tiny) + HEADROOM_BITS * math.log(2.0)),
            f"where the query scale zeta_0^(n/(f*scale_base)) leaves float32 (with 2^{HEADROOM_BITS} to spare)",
            f"positions up to {longest} (max_position_embeddings)",
        )
        return decay if angles is None or decay.smallest_factor >= angles.smallest_factor else angles

    def _check_range(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        if torch.compiler.is_compiling() or positions.numel() == 0:
            return
        cfg = self.config
        limit = position_limit(self.dim, cfg.gamma, cfg.scale_base, self.decay_factor, dtype)
        top, bottom = int(positions.max()), int(positions.min())
        if top >= limit or bottom <= -limit:
            bad = top if top >= limit else bottom
            raise PositionRangeError(
                f"xpos: position {bad} is outside what {dtype} can scale (|position| < {limit} at "
                f"scale_base={cfg.scale_base:g}, gamma={cfg.gamma:g}, linear factor {self.decay_factor:g}); use a "
                "larger scale_base, float32 instead of float16, or a larger linear scaling factor"
            )

    def _scaled_cos_sin(self, call: LayerCall, dtype: torch.dtype):
        """(cos, sin) * zeta^(n/gamma) and (cos, sin) / zeta^(n/gamma), each (B, 1, T, d_rot),
        computed in fp64 and stored in the rotation's working dtype (fp32 at least): once per
        forward for every layer, so a training step keeps one copy of the four tables (4 d_rot
        values per token in all), not a converted copy per layer."""

        def build():
            self._check_range(call.positions, dtype)
            cfg = self.config
            theta = resolved(cfg.theta, self.name, "theta")
            inv_freq, attention_factor = inverse_frequencies(
                self.dim, theta, cfg.scaling, device=call.positions.device
            )
            cos, sin = cos_sin(call.positions, inv_freq, attention_factor, torch.float64)  # (B, 1, T, d_rot)
            log_zeta = decay_base(self.dim, cfg.gamma).log().to(call.positions.device)  # (d_rot/2,) fp64
            exponent = call.positions[..., None].double() / (cfg.scale_base * self.decay_factor)  # (B, T, 1)
            scale = torch.exp(exponent * log_zeta)[:, None]  # (B, 1, T, d_rot/2) fp64
            scale = torch.cat((scale, scale), dim=-1)  # pairs (i, i + d_rot/2) share zeta_i
            inverse = torch.exp(-exponent * log_zeta)[:, None]
            inverse = torch.cat((inverse, inverse), dim=-1)
            work = torch.promote_types(dtype, torch.float32)  # scale in fp32 at least (fp64 for fp64 models)
            return tuple(t.to(work) for t in (cos * scale, sin * scale, cos * inverse, sin * inverse))

        return call.memo.get(("xpos", dtype), build)

    def rotate(self, call: LayerCall, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_cos, q_sin, k_cos, k_sin = self._scaled_cos_sin(call, q.dtype)  # (B, 1, T, d_rot) each
        work = q_cos.dtype
        q_out = apply_rotary(q.to(work), q_cos, q_sin).to(q.dtype)
        k_out = apply_rotary(k.to(work), k_cos, k_sin).to(k.dtype)
        return q_out, k_out
