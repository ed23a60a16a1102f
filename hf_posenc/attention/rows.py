"""Explicit scores one block of queries at a time, for row-local score stages (CoPE, CAPE, SBA).

When an encoding's ``transform_scores`` / ``normalize`` treat each query's row of scores on
its own (``Encoding.rows_independent``), blocks of queries, each with just the keys it may
attend (bottom-right aligned, as a whole call is), give the whole result with one block of
scores in memory; with gradients each block is recomputed in backward.

Registered as backend ``rows``: under ``backend="chunked"``, ``"flex"`` and ``"auto"``, for
calls longer than one block (:data:`~.chunked.QUERY_BLOCK`, read at call time).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.checkpoint import checkpoint

from ..core.layout import causal_keys
from . import chunked
from .backend import AUTO, AttentionCall, Backend, register_backend
from .core import attend_explicit


@register_backend
class RowBlocksBackend(Backend):
    name = "rows"
    priority = 30
    requests = frozenset({AUTO, "chunked", "flex"})

    def serves(self, call: AttentionCall) -> bool:
        return (
            not call.want_weights
            and "logits" not in call.stages
            and bool(call.stages & {"transform_scores", "normalize"})
            and call.encoding.rows_independent()
            and call.score.q_len > chunked.QUERY_BLOCK
        )

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        q_len, k_len = call.score.q_len, call.score.k_len
        block = chunked.QUERY_BLOCK

        def one_block(q_block: torch.Tensor, start: int, stop: int) -> torch.Tensor:
            k_end = causal_keys(q_len, k_len, stop)
            rows = dataclasses.replace(call.score.rows(start, stop), q=q_block)  # the checkpointed input
            mask = None if call.mask is None else call.mask[..., start:stop, :k_end]
            bias = None if call.bias is None else call.bias.rows(start, stop, k_end)
            return attend_explicit(call, rows, call.v[:, :, :k_end], mask, bias)[0]

        outputs = []
        for start in range(0, q_len, block):
            stop = min(q_len, start + block)
            q_block = call.q[:, :, start:stop]
            if torch.is_grad_enabled():
                outputs.append(checkpoint(one_block, q_block, start, stop, use_reentrant=False))
            else:
                outputs.append(one_block(q_block, start, stop))
        return torch.cat(outputs, dim=1), None  # (B, Tq, Hq, D)
