"""What a bias form offers the attention's backward when it rebuilds a block a group of heads at a
time and adds its own gradients by hand (:meth:`.block_bias.BlockBias.rebuilt_reversed_heads`;
FIRE's bands: :class:`.network_bands_backward.RebuiltHeads`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch


class HeadwiseRebuild(Protocol):
    """A causal block over reversed keys rebuilt in backward a group of heads at a time
    (:meth:`BlockBias.rebuilt_reversed_heads`): the attention's backward asks for each group's
    block, gives that group's dS before asking for the next, and then the gradients of the form's
    tensors (aligned with :meth:`BlockBias.tensors`; None for those the block does not read)."""

    def blocks(self, group: int, buffer: torch.Tensor | None) -> Iterator[tuple[slice, torch.Tensor]]:
        """(heads, their block (1, g, rows, keys) fp32) for groups of at most ``group`` heads, each
        written into ``buffer`` (flat, fp32) where it is large enough, when the iterator reaches it."""
        ...

    def add_gradient(self, heads: slice, grad: torch.Tensor) -> None:
        """dS (1, g, rows, keys) of the block's ``heads`` (it may be overwritten)."""
        ...

    def gradients(self) -> list[torch.Tensor | None]:
        """The form's tensors' gradients, every head's dS added."""
        ...
