"""The training loss, optionally without the (tokens x vocabulary) logits (``--loss chunked``).

``full``     the model's own loss (transformers' ``ForCausalLMLoss``): the whole (B, T, V)
             logits exist at once, in fp32 — at 32k tokens and a 128k vocabulary that alone is
             16 GiB, more than the rest of a small model's training step.
``chunked``  the model runs with its LM head as the identity (so its output is the last hidden
             state, (B, T, H)); the cross-entropy is then computed ``chunk`` tokens at a time,
             each chunk's logits recomputed in backward (activation checkpointing), so memory
             for the loss is (chunk x V), not (T x V). On CUDA a maintained fused kernel is used
             when installed: Apple's cut-cross-entropy (``cut_cross_entropy.linear_cross_entropy``),
             else Liger's fused linear cross-entropy; otherwise the chunked loop (written here:
             neither ships a CPU path, and torch has no fused linear cross-entropy).

The model is still called through its (DDP) wrapper, so gradients of every parameter, the LM
head's included, are reduced as usual. Only families whose logits are a plain
``lm_head(hidden)`` (the family adapter's ``plain_lm_head``) can run chunked; the others are
refused in one line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...errors import InvalidParameterError

IGNORE = -100
#: logits elements of one chunk (tokens x vocabulary): 64 Mi fp32 = 256 MiB, as perplexity's
CHUNK_ELEMENTS = 1 << 26

LossFunction = Callable[[nn.Module, dict[str, Any]], torch.Tensor]


def _chunk_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor):
    """hidden (n, H), weight (V, H), targets (n,) -> summed fp32 cross-entropy of the n tokens."""
    logits = F.linear(hidden, weight, bias).float()  # (n, V)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, chunk: int
) -> torch.Tensor:
    """sum_t CE(hidden_t W^T + b, target_t) over tokens whose target is not -100, ``chunk`` tokens
    at a time; with gradients each chunk's logits are recomputed in backward (never kept).

    hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) -> () fp32."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    recompute = torch.is_grad_enabled()
    for start in range(0, hidden.shape[0], chunk):
        args = (hidden[start : start + chunk], weight, bias, targets[start : start + chunk])
        total = total + (
            checkpoint(_chunk_sum, *args, use_reentrant=False) if recompute else _chunk_sum(*args)
        )
    return total


def _fused_cuda_sum(hidden, weight, bias, targets) -> torch.Tensor | None:
    """The summed loss from an installed fused CUDA kernel, or None (not installed, not CUDA)."""
    if hidden.device.type != "cuda":
        return None
    try:  # Apple's cut-cross-entropy
        from cut_cross_entropy import linear_cross_entropy

        return linear_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=IGNORE, reduction="sum")
    except ImportError:
        pass
    try:  # Liger's fused linear cross-entropy
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")(
            weight, hidden, targets, bias
        )
    except ImportError:
        return None


@contextlib.contextmanager
def _head_as_identity(head: nn.Module) -> Iterator[None]:
    """While inside, ``head(x)`` returns x: the model's "logits" are its last hidden state."""
    head.forward = lambda x: x  # an instance attribute, removed below
    try:
        yield
    finally:
        del head.forward


def output_head(model: nn.Module) -> nn.Linear:
    """The LM head of a causal LM (under a peft wrapper too), refused unless its logits are plain."""
    from ...core.registry import adapter_for_config

    unwrap = getattr(model, "get_base_model", None)  # a peft wrapper
    base: Any = unwrap() if callable(unwrap) else model
    adapter = adapter_for_config(getattr(base, "config", None))
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if adapter is None or not adapter.plain_lm_head or not isinstance(head, nn.Linear):
        kind = getattr(getattr(base, "config", None), "model_type", type(base).__name__)
        raise InvalidParameterError(
            f"--loss chunked is not allowed with a {kind} model: its logits are not a plain lm_head(hidden) "
            "(e.g. soft-capped); allowed: --loss full"
        )
    return head


def loss_function(kind: str, model: nn.Module) -> LossFunction:
    """``kind`` (``full`` or ``chunked``) -> f(wrapped model, forward keywords) -> the loss."""
    if kind == "full":
        return lambda wrapped, inputs: wrapped(**inputs).loss
    head = output_head(model)

    def chunked(wrapped: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        inputs = dict(inputs)
        labels, items = inputs.pop("labels"), inputs.pop("num_items_in_batch", None)
        shifted = inputs.pop("shift_labels", None)  # a sequence shard's targets, shifted before sharding
        with _head_as_identity(head):
            hidden = wrapped(**inputs).logits  # (B, T, H)
        if shifted is None:
            hidden, targets = hidden[:, :-1], labels[:, 1:]  # positions that predict a next token
        else:
            targets = shifted  # (B, T): target t of token t, -100 where none
        targets = targets.reshape(-1)  # (B*T',)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        total = _fused_cuda_sum(hidden, head.weight, head.bias, targets)
        if total is None:
            chunk = max(1, CHUNK_ELEMENTS // head.out_features)
            total = chunked_cross_entropy(hidden, head.weight, head.bias, targets, chunk)
        return total / (items if items is not None else (targets != IGNORE).sum())

    return chunked
