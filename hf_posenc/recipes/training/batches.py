"""Deterministic batch order: the data a step sees depends only on the seed and the step.

Packed blocks are shuffled once per epoch with ``seed + epoch``. Micro-step ``m`` takes the
global batch ``m * G .. (m+1) * G`` of that endless order (G = per-process batch x processes)
and process ``r`` its ``r``-th slice, so a resumed run, or a run on a different number of
processes with the same global batch, sees exactly the same examples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .corpus import TokenBlocks


class BatchOrder:
    def __init__(
        self, blocks: torch.Tensor | TokenBlocks, per_process: int, num_processes: int, rank: int, seed: int
    ) -> None:
        self.blocks = blocks  # (N, L)
        self.per_process = per_process
        self.num_processes = num_processes
        self.rank = rank
        self.seed = seed
        self._epoch = -1
        self._order = torch.empty(0, dtype=torch.long)
        if blocks.shape[0] < per_process * num_processes:
            raise ValueError(
                f"only {blocks.shape[0]} training sequences for a global batch of {per_process * num_processes}; "
                "add data or lower --batch-size"
            )

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(self.blocks.shape[0], generator=generator)
            self._epoch = epoch
        return self._order

    def global_indices(self, micro_step: int) -> torch.Tensor:
        """(per_process * num_processes,) the blocks every process trains on at ``micro_step``, rank by rank."""
        global_size = self.per_process * self.num_processes
        per_epoch = self.blocks.shape[0] // global_size  # whole global batches per epoch
        epoch, index = divmod(micro_step, per_epoch)
        return self._epoch_order(epoch)[index * global_size : (index + 1) * global_size]

    def indices(self, micro_step: int) -> torch.Tensor:
        """(per_process,) the blocks this process trains on at ``micro_step``."""
        start = self.rank * self.per_process
        return self.global_indices(micro_step)[start : start + self.per_process]

    def micro_batch(self, micro_step: int) -> torch.Tensor:
        """(per_process, L) blocks this process trains on at ``micro_step``."""
        return self.blocks[self.indices(micro_step)]
