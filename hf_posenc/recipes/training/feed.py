"""What the model receives at each micro-step: token blocks, and with ``--packing`` each
document's own positions and a loss that never crosses a document boundary.

Without packing a block is a window of the concatenated token stream: positions run
``0 .. L-1`` across document boundaries and every token is a label (today's recipe, unchanged).

With packing (the padding-free convention of transformers' ``DataCollatorWithFlattening``):

* ``position_ids`` restart at 0 where a document starts (and at the block's first token, when
  a document continues from the previous block), so every document sees the positions it
  would see alone;
* attention never crosses a document: transformers builds the block-diagonal causal mask
  itself from restarting ``position_ids`` when no ``attention_mask`` and no cache is passed
  (``masking_utils.find_packed_sequence_indices``; flash-attention-2 models get the varlen
  call from the same ``position_ids``), and every hf_posenc backend receives that mask (the
  chunked backend skips the key blocks before a query block's first allowed key);
* the first token of every document is not a label (it would be predicted from the previous
  document), and the loss is summed and divided by the number of labels of the whole optimizer
  step over every micro-batch and process (``num_items_in_batch``), so gradient accumulation and
  N processes give exactly the per-token mean over the step's documents.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .batches import BatchOrder
from .sampling import document_mask, sample_positions
from .ulysses import sequence_shard

IGNORE = -100  # transformers' ignore_index


def packed_inputs(blocks: Any, indices: torch.Tensor) -> dict[str, torch.Tensor]:
    """input_ids, position_ids (restarting per document) and labels of the blocks ``indices``."""
    ids = blocks[indices]  # (B, L)
    positions = torch.from_numpy(np.stack([blocks.positions(int(i)) for i in indices]))  # (B, L)
    labels = ids.masked_fill(positions == 0, IGNORE)  # a document's first token is not predicted
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def label_count(blocks: Any, indices: torch.Tensor) -> int:
    """Tokens the causal loss predicts in blocks ``indices``: every token after the first but
    the first token of each document."""
    return sum(int((blocks.positions(int(i))[1:] != 0).sum()) for i in indices)


class Feed:
    """The keyword arguments of the model's forward at each micro-step."""

    def __init__(
        self,
        blocks: Any,
        order: BatchOrder,
        *,
        packing: bool,
        grad_accum: int,
        sampling: str = "none",
        target_length: int | None = None,
        seed: int = 0,
        shard: tuple[int, int] | None = None,
    ) -> None:
        self.blocks, self.order, self.packing, self.grad_accum = blocks, order, packing, grad_accum
        self.sampling, self.target_length, self.seed = sampling, target_length, seed
        self.shard = shard  # (rank, size) in a Ulysses group: this rank's tokens only (ulysses.py)
        self._labels: tuple[int, int] | None = None  # (step, labels of the whole step)

    def step_labels(self, step: int) -> int:
        """Labels of optimizer step ``step`` over all its micro-batches and processes."""
        if self._labels is None or self._labels[0] != step:
            micro = range(step * self.grad_accum, (step + 1) * self.grad_accum)
            count = sum(label_count(self.blocks, self.order.global_indices(m)) for m in micro)
            self._labels = (step, count)
        return self._labels[1]

    def inputs(self, micro_step: int, device: torch.device) -> dict[str, Any]:
        """Model keywords of ``micro_step`` on ``device``."""
        if self.sampling != "none":
            return {
                k: v.to(device) if isinstance(v, torch.Tensor) else v
                for k, v in self._sampled(micro_step).items()
            }
        if not self.packing:
            batch = self.order.micro_batch(micro_step).to(device)
            if self.shard is not None:  # packing and position sampling are refused with it
                return sequence_shard({"input_ids": batch, "labels": batch}, *self.shard)
            return {"input_ids": batch, "labels": batch}
        inputs: dict[str, Any] = {
            k: v.to(device) for k, v in packed_inputs(self.blocks, self.order.indices(micro_step)).items()
        }
        return self._normalised(inputs, micro_step)

    def _sampled(self, micro_step: int) -> dict[str, Any]:
        """Inputs with sampled position ids (PoSE / randomized) and the explicit mask they need."""
        indices = self.order.indices(micro_step)
        order = self.order
        first = micro_step * order.per_process * order.num_processes + order.rank * order.per_process
        if self.packing:
            inputs: dict[str, Any] = packed_inputs(self.blocks, indices)
            restarting = inputs["position_ids"]
            inputs["attention_mask"] = document_mask(restarting)  # (B, 1, L, L)
        else:
            ids = self.blocks[indices]
            restarting = torch.zeros_like(ids)
            restarting[:, 1:] = 1  # one piece per row
            inputs = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
        assert self.target_length is not None  # checked by TrainConfig
        inputs["position_ids"] = sample_positions(
            self.sampling, restarting, self.target_length, self.seed, first
        )
        return self._normalised(inputs, micro_step) if self.packing else {**inputs, "use_cache": False}

    def _normalised(self, inputs: dict[str, Any], micro_step: int) -> dict[str, Any]:
        # accelerate divides each micro-batch's loss by grad_accum and DDP averages over the
        # processes: a sum over labels divided by labels / (grad_accum * processes) undoes both
        shares = self.grad_accum * self.order.num_processes
        inputs["num_items_in_batch"] = self.step_labels(micro_step // self.grad_accum) / shares
        inputs["use_cache"] = False  # transformers detects packed documents only without a cache
        return inputs
