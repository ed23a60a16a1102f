"""ReRoPE and Leaky ReRoPE (Su, 2023, "Rectified Rotary Position Embeddings",
https://kexue.fm/archives/9708, reference code bojone/rerope ``rerope_patch.py`` and
``leaky_rerope_patch.py``).

Relative positions are clipped at the window w: past it every key is seen at distance w
(ReRoPE), or the distance grows with slope 1/k (Leaky ReRoPE, ``leak`` = k):

    rerope:        i - j < w: RoPE at (i, j);  else RoPE at (w, 0)                  distance w
    leaky_rerope:  i - j < w: RoPE at (i, j);  else RoPE at (i/k + w - w/k, j/k)    distance
                                                                                     w + (i - j - w)/k

as bojone's ``apply_rotary_pos_emb`` calls (the queries rotated by w, the keys unrotated; leaky:
positions times 1/k, the queries shifted by w - w/k). Positions are the padding-aware token
positions; neighbours and far keys are merged as in :mod:`.window_split`. Training-free: the
checkpoint's own RoPE settings, every distance stays within [0, w] (ReRoPE) or grows k times
slower than the text past w (Leaky).

Defaults against the reference code (bojone/rerope at its last commit, checked for issue 23):

* ``leak`` = 16: ``leaky_rerope_patch.py``'s ``scaling_factor = 16`` (its far queries rotate at
  ``position_ids + window * (scaling_factor - 1)`` under linear scaling by ``scaling_factor``: the
  distance ``w + (i - j - w)/16`` above). Same value.
* ``window`` = a quarter of the trained length (``max_position_embeddings // 4``). Both patches set
  ``window = 512`` for Llama 2's 4096 tokens (an eighth) as their example constant, while the
  README's only published results use ``ReRoPE-w1024`` on that model (a quarter): we take the
  published setting, scaled to the checkpoint's length. ``window=max_position_embeddings // 8``
  reproduces the code's constant.
* ``logn`` = False: both patches also multiply every query by ``max(1, log(n + 1) / log(L))``
  (n the query's position, ``training_length`` L = 4096; Su's log-n attention scaling,
  kexue.fm/archives/8823), which changes nothing up to the trained length and sharpens attention
  past it. It is a separate technique from the rectified positions, so it is opt-in:
  ``logn=True`` applies it with L = the checkpoint's trained length (``max_position_embeddings``),
  which with ``window=max_position_embeddings // 8`` and ``leak=16`` is the reference patches'
  forward exactly.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..core.config import check_bool, check_number
from ..core.registry import register_encoding
from .call import NeighbourSplit, ScoreCall
from .window_split import WindowSplitConfig, WindowSplitRoPE

#: the source of both encodings: the blog post and its reference code
PAPER = "Su 2023, kexue.fm/archives/9708 (bojone/rerope)"


@dataclasses.dataclass
class RectifiedConfig(WindowSplitConfig):
    """The window-split settings plus the reference code's optional log-n query scaling."""

    #: multiply each query by max(1, log(n + 1) / log(L)), L the trained length (bojone's patches)
    logn: bool = False

    def validate(self) -> None:
        super().validate()
        check_bool(self.encoding, "logn", self.logn)


class RectifiedRoPE(WindowSplitRoPE):
    """ReRoPE's base (not registered): the window split, with the optional log-n query scaling."""

    def neighbour_split(self, call: ScoreCall) -> NeighbourSplit:
        split = super().neighbour_split(call)
        if not self.config.logn:  # type: ignore[attr-defined]
            return split
        trained = float(self.geometry.max_position_embeddings)
        # (B, 1, Tq, 1): log(n + 1) / log(L), at least 1 (no change up to the trained length)
        scale = (split.q_positions.double() + 1).log().div(math.log(trained)).clamp(min=1.0)[:, None, :, None]
        return dataclasses.replace(
            split,
            near_q=split.near_q * scale.to(split.near_q.dtype),
            far_q=split.far_q * scale.to(split.far_q.dtype),
        )


@dataclasses.dataclass
class ReRoPEConfig(RectifiedConfig):
    encoding = "rerope"


@register_encoding
class ReRoPE(RectifiedRoPE):
    name = "rerope"
    aliases = ("rectified_rope",)
    config_class = ReRoPEConfig
    paper = PAPER
    summary = "training-free: relative positions clipped at window (far keys all at distance window)"

    def far_positions(
        self, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.config.window  # type: ignore[attr-defined]
        return torch.full_like(q_positions, window), torch.zeros_like(k_positions)

    def far_keys_unrotated(self) -> bool:
        return True  # b(j) = 0 (far_positions)


@dataclasses.dataclass
class LeakyReRoPEConfig(RectifiedConfig):
    encoding = "leaky_rerope"
    leak: float = 16.0  # k: past the window, distances grow with slope 1/k (k = 1: plain RoPE)

    def validate(self) -> None:
        super().validate()
        check_number(self.encoding, "leak", self.leak, low=1.0)


@register_encoding
class LeakyReRoPE(RectifiedRoPE):
    name = "leaky_rerope"
    aliases = ("leaky_rectified_rope",)
    config_class = LeakyReRoPEConfig
    paper = PAPER
    summary = "training-free: relative positions grow with slope 1/leak past window"

    def far_positions(
        self, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        window, leak = self.config.window, self.config.leak  # type: ignore[attr-defined]
        return (
            q_positions.double() / leak + (window - window / leak),
            k_positions.double() / leak,
        )
