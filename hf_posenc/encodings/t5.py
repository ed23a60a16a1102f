"""T5 relative position bias (Raffel et al., 2020, "Exploring the Limits of Transfer
Learning with a Unified Text-to-Text Transformer"), causal form.

    <q_i, k_j> = q_i^T k_j + b_h[bucket(i - j)]

    bucket(n) = n                                                  if n < B/2
              = B/2 + floor( log(n / (B/2)) / log(D / (B/2)) * B/2 )   if B/2 <= n < D
              = B - 1                                              if n >= D

with B = ``num_buckets``, D = ``max_distance``, B/2 taken as floor(B/2) and future keys
(n < 0) in bucket 0. For even B this is HF T5's ``_relative_position_bucket(bidirectional=
False)``; for B=5, D=6 it reproduces the worked table of seed 001. ``b`` holds one learned
scalar per head and bucket, shared by all layers unless ``shared_across_layers=False``,
initialised to zero so the patched model starts as NoPE.

Position interpolation, ``scaling={'type': 'linear', 'factor': f}``: the bucket of the
interpolated distance, ``bucket(floor((i - j) / f))``. Floor, as T5's own bucketing truncates
its log branch, and so every distance below f times a trained one maps to a trained distance
(``floor(d / f) <= (f L - 1) / f < L``); f consecutive distances share a bucket.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..core.config import EncodingConfig, check_bool, check_number
from ..core.interpolation import PositionInterpolation, interpolate_floor
from ..core.registry import register_encoding
from ..errors import InvalidParameterError
from .base import Encoding
from .block_bias import DistanceBias, SaturatingDistanceBias
from .call import ScoreCall


@dataclasses.dataclass
class T5Config(PositionInterpolation, EncodingConfig):
    encoding = "t5"
    num_buckets: int = 32
    max_distance: int = 128
    shared_across_layers: bool = True
    scaling: dict | None = None

    def validate(self) -> None:
        check_number(self.encoding, "num_buckets", self.num_buckets, low=2, integer=True)
        check_number(self.encoding, "max_distance", self.max_distance, low=1, integer=True)
        check_bool(self.encoding, "shared_across_layers", self.shared_across_layers)
        if self.max_distance <= self.num_buckets // 2:
            raise InvalidParameterError(
                f"t5: parameter max_distance={self.max_distance!r} is not allowed; allowed: an integer greater "
                f"than num_buckets // 2 = {self.num_buckets // 2}"
            )


def relative_position_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """distance ``i - j`` (any int shape) -> bucket index in [0, num_buckets)."""
    n = distance.clamp(min=0)
    exact = num_buckets // 2
    # n is >= exact wherever the log branch is used; clamp avoids log(0) elsewhere
    log_ratio = torch.log(n.clamp(min=exact).float() / exact) / math.log(max_distance / exact)
    large = exact + (log_ratio * exact).long()
    large = torch.where(n >= max_distance, num_buckets - 1, large.clamp(max=num_buckets - 1))
    return torch.where(n < exact, n, large)


def saturation_distance(config: T5Config) -> int:
    """W, the first distance from which every distance is in the last bucket ``B - 1``: read from
    the bucket indices (never from the learned values) of distances 0 .. f * max_distance + 1 (past
    f * max_distance, floor(d / f) >= max_distance: the last bucket by definition)."""
    span = math.ceil(config.factor * config.max_distance) + 2
    # on the CPU whatever the default device (a model built under the meta device has no values)
    distance = interpolate_floor(torch.arange(span, device="cpu"), config.factor)  # (span,)
    buckets = relative_position_bucket(distance, config.num_buckets, config.max_distance)
    below = torch.nonzero(buckets != config.num_buckets - 1)  # distance 0 is in bucket 0 < B - 1
    return int(below.max()) + 1


@register_encoding
class T5Bias(Encoding[T5Config]):
    name = "t5"
    reads_positions = False  # see Encoding.reads_positions
    aliases = ("t5_bias", "relative", "t5_relative")
    config_class = T5Config
    paper = "Raffel et al. 2020, arXiv:1910.10683"
    summary = "learned per-head scalar bias per log-spaced relative-distance bucket"

    def __init__(self, config: T5Config, geometry) -> None:
        super().__init__(config, geometry)
        tables = 1 if config.shared_across_layers else geometry.num_layers
        # tables[layer]: (num_buckets, Hq) scalars, zero-initialised
        embeddings = [nn.Embedding(config.num_buckets, geometry.num_heads) for _ in range(tables)]
        for table in embeddings:
            nn.init.zeros_(table.weight)
        self.tables = nn.ModuleList(embeddings)
        #: W, from which every distance is in the last bucket (a Python int, also under torch.compile)
        self.saturation = saturation_distance(config)

    def score_bias(self, call: ScoreCall) -> DistanceBias:
        """``table[h, bucket(i - j)]`` as a :class:`SaturatingDistanceBias` when the keys reach the
        last bucket's saturation distance W (every distance from W on is in bucket B - 1), else
        a plain :class:`DistanceBias` (Hq, Tk)."""
        cfg = self.config
        k_len, device = call.k_len, call.device
        window = self.saturation  # W
        buckets = call.memo.get(
            ("t5_distance_buckets", k_len, device),
            lambda: relative_position_bucket(
                interpolate_floor(torch.arange(k_len, device=device), cfg.factor),
                cfg.num_buckets,
                cfg.max_distance,
            ),
        )  # (Tk,) bucket of distance d = 0 .. Tk-1
        table = self.tables[0 if cfg.shared_across_layers else call.layer_idx]
        if window < k_len:
            near = table(buckets[:window]).t().float()  # (Hq, W)
            tail = table(buckets.new_full((), cfg.num_buckets - 1)).float()  # (Hq,): bucket B - 1
            return SaturatingDistanceBias(call.q_len, k_len, near, tail)
        return DistanceBias(call.q_len, k_len, table(buckets).t().float())  # (Hq, Tk)
