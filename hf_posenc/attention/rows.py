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

A block's size follows its key count (:func:`block_rows`): its (B, Hq, rows, keys) scores stay
within :data:`SCORE_BUDGET` elements, so the score-sized intermediates of one block (a dozen or
more fp32 tensors while CoPE's or SBA's stage is recomputed and differentiated in backward) do
not grow with the sequence; with a fixed number of rows they would grow with every key, which
made the memory per token of these encodings 4-5x native's.

Registered as backend ``rows``: under ``backend="chunked"``, ``"flex"`` and ``"auto"``, for
calls longer than one block.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.checkpoint import checkpoint

from ..core.layout import causal_keys
from . import chunked
from .backend import AUTO, AttentionCall, Backend, register_backend
from .core import attend_explicit
from .host_heap import trim_host_heap

#: the most elements (batch x query heads x rows x keys) of one block's fp32 scores: 2^20 (4 MiB).
#: Chosen on CPU (one thread, a 1-layer model of 4 heads, cope/sba/cape, under load from other
#: jobs, so only coarsely): 2^19..2^21 ran forward at 4096 tokens and a training step at 2048
#: and 4096 no slower than 256-row blocks (within the +-15 % noise, often faster); 2^20 is the
#: smaller of the budgets that never lost, so a block's temporaries stay small.
SCORE_BUDGET = 1 << 20
#: the same budget off the CPU (a GPU): 2^25 elements (128 MiB of fp32 scores). There each block
#: costs a dozen or more kernel launches whatever its size, so small blocks are launch-bound: with
#: the CPU's budget (16-row blocks at 8192 keys and 16 heads, 512 blocks a layer) CoPE's and
#: CAPE's forward at T=8192 read 169x and 161x native on an H100 (bf16, B=1), against 27.5x and
#: 25.4x with 256-row blocks on an H200 (README "Measured on an H100 GPU" and "Measured earlier
#: on an H200 GPU"); 2^25 gives those 256-row blocks again at 8192 keys (memory 2.8x / 2.3x
#: native there) and halves them as keys double. Not yet re-measured on a GPU with this value.
DEVICE_SCORE_BUDGET = 1 << 25
#: the fewest rows of a block (and the multiple block sizes are rounded down to): a block of
#: fewer queries is mostly per-call overhead. Beyond ``SCORE_BUDGET / (16 * batch * heads)`` keys
#: a block holds 16 rows and its scores grow with the keys again.
MIN_ROWS = 16


def block_rows(batch: int, heads: int, keys: int, device_type: str = "cpu") -> int:
    """Queries of a block whose scores span ``keys`` keys: ``budget // (batch * heads * keys)``
    rounded down to a multiple of :data:`MIN_ROWS`, at least ``MIN_ROWS`` and at most
    :data:`~.chunked.QUERY_BLOCK` (read at call time, so tests that shrink it shrink these blocks);
    the budget is :data:`SCORE_BUDGET` on the CPU, :data:`DEVICE_SCORE_BUDGET` elsewhere."""
    budget = SCORE_BUDGET if device_type == "cpu" else DEVICE_SCORE_BUDGET
    rows = budget // max(1, batch * heads * keys)
    return min(chunked.QUERY_BLOCK, max(MIN_ROWS, rows // MIN_ROWS * MIN_ROWS))


def query_spans(
    batch: int, heads: int, q_len: int, k_len: int, device_type: str = "cpu"
) -> list[tuple[int, int]]:
    """The blocks ``[start, stop)`` of ``q_len`` queries over ``k_len`` keys (bottom-right aligned):
    each as long as :func:`block_rows` allows for the keys its longest possible span would reach
    (its last query's causal keys, were it ``QUERY_BLOCK`` long), so early blocks, with fewer
    keys, are longer."""
    spans, start = [], 0
    while start < q_len:
        reach = causal_keys(q_len, k_len, min(q_len, start + chunked.QUERY_BLOCK))
        stop = min(q_len, start + block_rows(batch, heads, reach, device_type))
        spans.append((start, stop))
        start = stop
    return spans


@register_backend
class RowBlocksBackend(Backend):
    name = "rows"
    priority = 30
    requests = frozenset({AUTO, "chunked", "flex"})

    def serves(self, call: AttentionCall) -> bool:
        batch, heads = call.q.shape[:2]
        return (
            not call.want_weights
            and "logits" not in call.stages
            and bool(call.stages & {"transform_scores", "normalize"})
            and call.encoding.rows_independent()
            and call.score.q_len > block_rows(batch, heads, call.score.k_len, call.q.device.type)
        )

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        q_len, k_len = call.score.q_len, call.score.k_len
        batch, heads = call.q.shape[:2]
        spans = query_spans(batch, heads, q_len, k_len, call.q.device.type)
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
        out = torch.cat(outputs, dim=1)  # (B, Tq, Hq, D)
        if call.q.device.type == "cpu" and not torch.compiler.is_compiling():
            trim_host_heap()  # the blocks' temporaries left heap holes (see host_heap.py)
        return out, None
