"""Explicit scores one block of queries at a time, for row-local score stages (CoPE, CAPE, SBA).

When an encoding's ``transform_scores`` / ``normalize`` treat each query's row of scores on
its own (``Encoding.rows_independent``), blocks of queries, each with just the keys it may
attend (bottom-right aligned, as a whole call is), give the whole result with one block of
scores in memory; with gradients each block is recomputed in backward. As on the chunked
backend (:func:`~.chunked.block_first_keys`), a block's keys start at the first key one of its
queries may attend: the other documents of a packed sequence (and left padding) before it are
skipped, not scored and masked. Each query's row then loses only keys it may not attend, which
a row-local stage gives no weight and no position (CoPE's gates, SBA's sticks and CAPE's base
bias see allowed keys and distances only).

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
        spans = [(start, min(q_len, start + block)) for start in range(0, q_len, block)]
        # skipping keys reads the mask on the host: not under torch.compile (see attend_chunked)
        firsts = [0] * len(spans)
        if call.mask is not None and not torch.compiler.is_compiling():
            firsts = chunked.block_first_keys(call.mask, spans, call.score.memo)

        def one_block(q_block: torch.Tensor, start: int, stop: int, k_start: int) -> torch.Tensor:
            k_end = causal_keys(q_len, k_len, stop)
            rows = dataclasses.replace(
                call.score.rows(start, stop, k_start), q=q_block
            )  # the checkpointed input
            mask = None if call.mask is None else call.mask[..., start:stop, k_start:k_end]
            bias = None
            if call.bias is not None:
                bias = (
                    call.bias.rows(start, stop, k_end)
                    if k_start == 0
                    else call.bias.span(start, stop, k_start, k_end)
                )
            return attend_explicit(call, rows, call.v[:, :, k_start:k_end], mask, bias)[0]

        outputs = []
        for (start, stop), k_start in zip(spans, firsts, strict=True):
            q_block = call.q[:, :, start:stop]
            if torch.is_grad_enabled():
                outputs.append(checkpoint(one_block, q_block, start, stop, k_start, use_reentrant=False))
            else:
                outputs.append(one_block(q_block, start, stop, k_start))
        return torch.cat(outputs, dim=1), None  # (B, Tq, Hq, D)
