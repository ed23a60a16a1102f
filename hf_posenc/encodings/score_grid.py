"""Where and how a bias is evaluated one score at a time (FlexAttention's ``score_mod``): the
per-score function's type, the grid a compiled kernel evaluates it on at a length bucket, and
the padding of a form's tables to that grid."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

#: the bias of scores at index tensors (b, h, q_idx, kv_idx) -> bias (FlexAttention's score_mod layout)
ElementwiseBias = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ScoreGrid:
    """Where a per-score bias is evaluated when a kernel runs at a length bucket: every query
    index ``q_idx < q_size`` and key index ``kv_idx < k_size`` (at least the call's own lengths;
    the scores past them are masked and discarded), and the key offset ``k_len - q_len`` of the
    call as a 0-d int tensor. A compiled kernel's graph then depends on ``(q_size, k_size)``
    only: the captured tensors are sized by them and the offset is a value, not a constant."""

    q_size: int
    k_size: int
    offset: torch.Tensor  # () int32, k_len - q_len of the call


def pad_last(values: torch.Tensor, size: int, value: float = 0.0) -> torch.Tensor:
    """``values`` (..., n) padded with ``value`` to (..., size) along the last dim (differentiable:
    the padding's gradient is dropped); ``values`` itself when ``size == n``."""
    extra = size - values.shape[-1]
    return values if extra == 0 else F.pad(values, (0, extra), value=value)
