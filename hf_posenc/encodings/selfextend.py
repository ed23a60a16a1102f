"""SelfExtend (Jin et al., 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without
Tuning", ICML 2024, arXiv:2401.01325; reference code datamllab/LongLM ``self_extend_patch``).

Grouped attention: neighbours keep the checkpoint's RoPE distance, farther keys see positions
floor-divided by the group size G, with the query's grouped position shifted so that the two
meet at the window's edge (w = ``window``, the paper's neighbour window):

    i - j <  w:  RoPE at (i, j)                                   distance i - j
    i - j >= w:  RoPE at (floor(i/G) + w - floor(w/G), floor(j/G))  distance
                 floor(i/G) - floor(j/G) + w - floor(w/G)         (~ w + (i - j - w)/G)

so a checkpoint trained on L positions reaches about (L - w) * G + w tokens. Exactly LongLM's
``group_query_position = query_position // G + w - w // G``, ``group_key_position =
key_position // G`` and its neighbour mask ``i - j < w``; positions are the padding-aware
token positions. Neighbours and grouped keys are merged as the paper's flash variant does (see
:mod:`.window_split`). LongLM's optional log-scaling of queries (``scale_base``) is not offered.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.config import check_number
from ..core.registry import register_encoding
from .window_split import WindowSplitConfig, WindowSplitRoPE


@dataclasses.dataclass
class SelfExtendConfig(WindowSplitConfig):
    encoding = "selfextend"
    group_size: int = 8  # G: far positions are floor(position / G)

    def validate(self) -> None:
        super().validate()
        check_number(self.encoding, "group_size", self.group_size, low=1, integer=True)


@register_encoding
class SelfExtend(WindowSplitRoPE):
    name = "selfextend"
    aliases = ("self_extend", "longlm", "grouped_attention")
    config_class = SelfExtendConfig
    paper = "Jin et al. 2024, arXiv:2401.01325"
    summary = (
        "training-free: neighbours keep RoPE, far keys see floor(position / group_size), shifted to meet"
    )

    def far_positions(
        self, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        group, window = self.config.group_size, self.config.window  # type: ignore[attr-defined]
        shift = window - window // group
        return torch.div(q_positions, group, rounding_mode="floor") + shift, torch.div(
            k_positions, group, rounding_mode="floor"
        )
