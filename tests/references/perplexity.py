"""The length-extrapolation loss written by hand: full-model logits of disjoint windows
tokens[0:L], tokens[L:2L], ... below a token budget, token cross-entropy summed in fp64, and the
standard error of the windows' mean losses by the textbook formula. What
hf_posenc.recipes.evaluation's ``evaluate_lengths`` is checked against."""

from __future__ import annotations

import math
import statistics

import torch
from torch import nn
from torch.nn import functional as F


def manual_loss(model: nn.Module, tokens: torch.Tensor, length: int, budget: int) -> tuple[float, int]:
    """Reference: full-model logits of the windows tokens[0:L], tokens[L:2L], ... below ``budget``;
    summed token cross-entropy (float64) / number of predicted tokens."""
    windows = tokens[: budget // length * length].view(-1, length)
    with torch.no_grad():
        logits = model(windows).logits  # (W, L, V)
    nll = F.cross_entropy(logits[:, :-1].double().flatten(0, 1), windows[:, 1:].flatten(), reduction="sum")
    count = windows.shape[0] * (length - 1)
    return nll.item() / count, count


def manual_stderr(model: nn.Module, tokens: torch.Tensor, length: int, budget: int) -> float:
    """Reference: each window's mean token loss, then the standard error of their mean
    (statistics.stdev / sqrt(n), the textbook formula)."""
    windows = tokens[: budget // length * length].view(-1, length)
    with torch.no_grad():
        logits = model(windows).logits  # (W, L, V)
    per_token = F.cross_entropy(logits[:, :-1].double().transpose(1, 2), windows[:, 1:], reduction="none")
    means = per_token.mean(dim=1).tolist()  # (W,)
    return statistics.stdev(means) / math.sqrt(len(means))
