"""The chunked backend: SDPA over blocks of queries, causal keys only, bias built per block.

For query block ``[s, e)`` of ``Tq`` (bottom-right aligned to ``Tk`` keys) only keys
``0 .. Tk - Tq + e - 1`` can be attended, so each block calls SDPA on that prefix: about
half the work of one masked call over all keys (the causal skipping native SDPA does with
``is_causal``), and at most one block of bias exists at a time.

Toeplitz biases (:class:`DistanceBias`, and the leading rows a form gives by
``distance_table()``, FIRE's below its threshold) without a padding mask are not written out
at all: over the queries in reverse order, bias-plus-causal-mask of reversed query ``a`` and
key ``j`` depends on ``a + j`` only, so each block's float mask is an ``as_strided`` view (row
and column stride 1) of one (Hq, n + Tk) vector per call, and its keys a prefix of the layer's.
Their blocks are one call of :func:`~.toeplitz.attend_toeplitz` (one autograd function: fused
forward, backward recomputing each block's weights and summing the table's gradient along
anti-diagonals in place; O(T) kept).

Separable biases ``u_i - w_j`` (FoX) in fp32/fp64 ride in q and k as one more feature
(:func:`attend_separable`): each block is one fused SDPA call with only the causal mask.

Other biases (and any padding mask) are written out one (B|1, Hq, block, keys) block at a
time (``BlockBias.folded``, the mask folded in), over the keys from the first one a query of
the block may attend: the other documents of a packed sequence (and left padding) before it
are skipped, not computed and masked. With gradients a block's bias is rebuilt in backward
from its form's tensors (:class:`~.bias_block.RebuiltBiasAttention`) or, for forms that cannot say them,
the block is recomputed (activation checkpointing), so training keeps no more than one block
either.

A call of at most :data:`FEW_QUERIES` queries within one block (a decoding step) is its bias
written out with the mask folded in (``BlockBias.folded``) and one SDPA call, without the plan
above: such a call costs its count of operations, not its values.

Registered as backend ``chunked``: calls with a score bias and no explicit-score stage, under
``backend="chunked"``, ``"flex"`` (where FlexAttention declines) and ``"auto"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TypeGuard

import torch
from torch.utils.checkpoint import checkpoint

from ..core.layout import causal_keys, expand_kv_heads
from ..core.memo import ForwardMemo
from ..encodings.block_bias import BlockBias, SeparableBias
from ..encodings.headwise_rebuild import HeadwiseRebuild
from . import rebuilt_flash, separable
from .backend import AUTO, AttentionCall, Backend, register_backend
from .bias_block import RebuiltBiasAttention, block_attention
from .rebuilt_flash import RebuiltBiasFlashAttention, ReversedGradients, ReversedKeyValues
from .separable import attend_separable
from .toeplitz import attend_toeplitz

#: queries per SDPA call; 256 measured fastest on CPU at T = 2048..8192 (128: more calls, 1024: less skipping)
QUERY_BLOCK = 256
#: a causal call without gradients whose blocks past a distance table's rows have their bias
#: built (written out per query: FIRE past L) into one reused buffer of (B, g, rows, Tk) values
#: (g heads at a time, BUILT_HEADS below, or all Hq) takes as many queries per block as keep that
#: buffer within BUILT_VALUES values (32 MiB in fp32), rounded down to a multiple of 64, at least
#: BUILT_BLOCK and at most QUERY_BLOCK (:func:`built_block_rows`): a block's fixed costs (its
#: plan, the kernel call) spread over more rows where the buffer is small, and a long call keeps
#: BUILT_BLOCK rows (one head at a time: from T=65536; all 8 heads: from T=8192). The bench's
#: model (8 heads, idle, two threads, one process alternating, scripts/cpu_constant_ab.py
#: --constant ...:BUILT_BLOCK, 2026-11-27 on the AVX2 machine, all heads at once): FIRE forward
#: 256 rows against 128, 1.21 -> 1.05 s at T=4096 (10 rounds) and 0.365 -> 0.327 s at T=2048 (8
#: rounds); the buffer 16 -> 32 MiB at T=4096 (it was 128 rows whatever T from 35e4730 on: with
#: the bands' per-block plan, 128-row blocks cost more)
BUILT_VALUES = 8 * 1024 * 1024
BUILT_BLOCK = 128
#: such a call's blocks built over reversed keys (FIRE past L on CPU, ``BlockBias.folded_reversed_heads``;
#: the few blocks the bands do not build through ``BlockBias.heads``) are built and attended this
#: many query heads at a time, each group's block just before its kernel call: the buffer holds
#: one group's block (4 MiB instead of 32 at T=4096 with 8 heads; the bench model's inference peak
#: by the profiler's count 72 -> 44 MiB, native 41), and the rows' budget above counts one group.
#: Time per forward at T=4096 (scripts/cpu_constant_ab.py --encoding fire --mode forward --length
#: 4096 --constant ...:BUILT_HEADS --values 8 1 2 4 --rounds 12, 2026-11-27, idle, a block's views
#: shared by its groups): medians 1.137 / 1.132 / 1.217 / 1.195 s (the machine's noise is ~5 %).
#: Training blocks' forward (:class:`~.rebuilt_flash.RebuiltBiasFlashAttention`) builds and attends
#: its blocks the same way (the kernel reads each head's block just written; backward rebuilds
#: every head's into the same full-size buffer): a training step at T=2048 1.501x -> 1.482x native
#: (8 alternating rounds, the same script, --mode train --length 2048, 2026-11-28, idle)
BUILT_HEADS = 1
#: up to this many queries (decoding steps) the bias block is written out: cheaper than reversing the keys
FEW_QUERIES = 16
#: dtypes in which a separable bias rides in q and k (:func:`attend_separable`); in bf16/fp16 its
#: key term would be rounded to 8/11 bits, so those keep the written-out bias
FEATURE_DTYPES = (torch.float32, torch.float64)


def built_block_rows(matrices: int, keys: int) -> int:
    """Queries per block of a call whose bias blocks are built (see :data:`BUILT_VALUES`), for
    ``matrices`` = B x Hq and ``keys`` = Tk: read at call time."""
    budget = BUILT_VALUES // max(1, matrices * keys) // 64 * 64
    return min(QUERY_BLOCK, max(BUILT_BLOCK, budget))


def attend_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: BlockBias,
    mask: torch.Tensor | None,
    softmax_scale: float,
    dropout_p: float = 0.0,
    block: int | None = None,
    memo: ForwardMemo | None = None,
) -> torch.Tensor:
    """q (B,Hq,Tq,D), k/v (B,Hkv,Tk,D), a causal ``mask`` (B|1,1,Tq,Tk) bool or None -> (B,Tq,Hq,D).

    ``block``: queries per SDPA call (default :data:`QUERY_BLOCK`, or :func:`built_block_rows`
    for a causal call without gradients whose blocks past a distance table are built; read at
    call time). Keys
    before a block's first allowed key are skipped (:func:`block_first_keys`).
    """
    groups = q.shape[1] // k.shape[1]
    kv_heads = k, v  # (B, Hkv, Tk, D): the separable path's kernel keeps these, not expanded views
    k, v = expand_kv_heads(k, groups), expand_kv_heads(v, groups)  # (B, Hq, Tk, D)
    q_len, k_len = q.shape[-2], k.shape[-2]
    if q_len <= min(FEW_QUERIES, QUERY_BLOCK if block is None else block):
        # a decoding step, one block of every query and key: its bias written out (B|1, Hq, Tq, Tk)
        # with the mask folded in, and one SDPA call. Such a call's cost is its count of
        # operations, not their values: the plan below for its one block (one query over 2048
        # keys, 8 heads, CPU) took about as long as the SDPA call
        folded = bias.folded(0, q_len, 0, k_len, mask, q.dtype)
        return block_attention(q, k, v, folded, softmax_scale, dropout_p).transpose(1, 2)
    # the leading queries whose bias is a table over distances (all of them for a DistanceBias):
    # their blocks in one call over the queries in reverse order (attend_toeplitz)
    distance = bias.distance_table() if mask is None and q_len > FEW_QUERIES else None
    # causal calls past a table's rows (FIRE past L) without gradients build their blocks' bias
    # into one buffer, a group of heads at a time where the form builds them over reversed keys
    reverse = mask is None and q_len > FEW_QUERIES  # (see one_block)
    built = distance is not None and distance[0] < q_len and not torch.is_grad_enabled()
    group = (
        min(BUILT_HEADS, q.shape[1]) if built and reverse and bias.builds_reversed(q.device) else q.shape[1]
    )
    if block is None:  # rows as the buffer's budget allows
        block = built_block_rows(q.shape[0] * group, k_len) if built else QUERY_BLOCK
    spans = [(start, min(q_len, start + block)) for start in range(0, q_len, block)]

    # skipping keys needs the mask's values on the host: not under torch.compile (a data-dependent
    # slice breaks fullgraph), where every block starts at key 0 and the mask does the same work
    firsts = [0] * len(spans)
    if mask is not None and not torch.compiler.is_compiling():
        firsts = block_first_keys(mask, spans, memo)
    if takes_separable(bias, q):
        return attend_separable(q, *kv_heads, bias, mask, softmax_scale, dropout_p, spans, firsts)

    # k, v in reverse order (reversed key b holds key Tk-1-b), made once when a block needs them
    # (FIRE past its threshold, below; with gradients the flip is in the graph, one per layer)
    # (with gradients also the ReversedGradients that serves their blocks' backward, else None)
    reversed_kv: list[tuple[torch.Tensor, torch.Tensor, ReversedGradients | None]] = []

    def reversed_keys() -> tuple[torch.Tensor, torch.Tensor, ReversedGradients | None]:
        if not reversed_kv:
            if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
                sink = ReversedGradients(k.detach(), v.detach())
                reversed_kv.append((*ReversedKeyValues.apply(k, v, sink), sink))
            else:
                reversed_kv.append((k.flip(2), v.flip(2), None))
        return reversed_kv[0]

    toeplitz_rows = 0
    if distance is not None:
        toeplitz_rows = max((stop for _, stop in spans if stop <= distance[0]), default=0)

    # one buffer for every block's bias built without gradients (the blocks of all layers of a
    # forward, through the memo): SDPA reads a block before the next is built
    longest = max(stop - start for start, stop in spans)

    buffers: list[torch.Tensor | None] = []

    def scratch(heads: int | None = None) -> torch.Tensor | None:  # for a block of ``heads`` (all: None)
        if torch.is_grad_enabled():
            return None
        size = q.shape[0] * (heads or q.shape[1]) * longest * k_len
        if not buffers or (buffers[0] is not None and buffers[0].numel() < size):
            buffers[:] = [bias_scratch(memo, size, q.dtype, q.device)]
        return buffers[0]

    # causal blocks whose form builds them cheaper over the keys in reverse order (FIRE on CPU;
    # without gradients here, with gradients through RebuiltBiasFlashAttention)

    def one_block(q_block: torch.Tensor, start: int, stop: int, k_start: int) -> torch.Tensor:
        k_end = causal_keys(q_len, k_len, stop)
        if reverse and not torch.is_grad_enabled():  # (with gradients reversed copies would be kept)
            groups = bias.folded_reversed_heads(start, stop, k_end, q.dtype, group, scratch(group))
            if groups is not None:  # (B|1, g, rows, k_end) per group of heads, keys k_end-1 .. 0
                k_rev, v_rev, _ = reversed_keys()
                k_block, v_block = k_rev[:, :, k_len - k_end :], v_rev[:, :, k_len - k_end :]
                outputs = [
                    block_attention(
                        q_block[:, heads],
                        k_block[:, heads],
                        v_block[:, heads],
                        backwards,
                        softmax_scale,
                        dropout_p,
                    )
                    for heads, backwards in groups
                ]
                return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        # (B|1, 1, rows, keys) or None: the causal keys (bottom-right aligned)
        allowed = None if mask is None else mask[..., start:stop, k_start:k_end]
        k_block, v_block = k[:, :, k_start:k_end], v[:, :, k_start:k_end]
        outputs = []
        for first in range(0, q.shape[1], group):  # (all heads at once unless built a group at a time)
            heads = slice(first, min(q.shape[1], first + group))
            form = bias if group == q.shape[1] else bias.heads(heads.start, heads.stop)
            folded = form.folded(
                start, stop, k_start, k_end, allowed, q.dtype, scratch(group)
            )  # (B|1, g, rows, keys)
            outputs.append(
                block_attention(
                    q_block[:, heads], k_block[:, heads], v_block[:, heads], folded, softmax_scale, dropout_p
                )
            )
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def rebuilt_block(
        q_block: torch.Tensor, start: int, stop: int, k_start: int, tensors: dict
    ) -> torch.Tensor:
        k_end = causal_keys(q_len, k_len, stop)
        allowed = None if mask is None else mask[..., start:stop, k_start:k_end]
        names = list(tensors)

        def form(values: tuple[torch.Tensor, ...]) -> BlockBias:  # the bias with these tensors
            return dataclasses.replace(bias, **dict(zip(names, values, strict=True)))

        def build(*values: torch.Tensor) -> torch.Tensor:  # (B|1, Hq, rows, keys)
            return form(values).folded(start, stop, k_start, k_end, allowed, q.dtype, scratch())

        k_block, v_block = k[:, :, k_start:k_end], v[:, :, k_start:k_end]
        if flash_rebuilt:  # the fused kernel's forward, its log-sum-exp kept for backward
            shared: dict = {} if memo is None else memo.get(("rebuilt_flash_buffers",), dict)
            # what the form's forward build leaves for its rebuild in backward (FIRE's band plan, O(keys)):
            # held by the rebuild's closure until this block's backward
            plans: dict = {}

            def build_reversed() -> torch.Tensor | Iterator[tuple[slice, torch.Tensor]] | None:
                # the causal block over keys k_end-1 .. 0, BUILT_HEADS heads at a time where the form
                # builds it so (each group's block read by the kernel before the next is written)
                if q.shape[1] > BUILT_HEADS:
                    groups = bias.folded_reversed_heads(
                        start, stop, k_end, q.dtype, BUILT_HEADS, scratch(BUILT_HEADS), plans
                    )
                    if groups is not None:
                        return groups
                return bias.folded_reversed(start, stop, k_end, q.dtype, scratch())

            def rebuild_reversed(*values: torch.Tensor) -> torch.Tensor | HeadwiseRebuild | None:
                # the same, a group of heads at a time where the form rebuilds it so, else differentiable
                # into the forward's bias buffer (the blocks' backward runs one block at a time)
                rebuilt = form(values).rebuilt_reversed_heads(start, stop, k_end, q.dtype, plans)
                if rebuilt is not None:
                    return rebuilt
                kept = buffers[0] if buffers else None
                return form(values).folded_reversed_with_gradients(start, stop, k_end, q.dtype, kept)

            k_reversed = v_reversed = sink = None
            if reverse and bias.builds_reversed(q.device):  # (causal: k_start = 0) views, differentiable
                k_rev, v_rev, sink = reversed_keys()
                k_reversed, v_reversed = k_rev[:, :, k_len - k_end :], v_rev[:, :, k_len - k_end :]
            return RebuiltBiasFlashAttention.apply(
                q_block,
                k_block,
                v_block,
                k_reversed,
                v_reversed,
                sink,
                softmax_scale,
                build,
                build_reversed,
                rebuild_reversed,
                shared,
                *tensors.values(),
            )
        return RebuiltBiasAttention.apply(q_block, k_block, v_block, softmax_scale, build, *tensors.values())

    recompute = torch.is_grad_enabled() and len(spans) > 1
    # forms that can be rebuilt from their tensors keep nothing per block and skip the second SDPA forward
    rebuildable = bias.tensors() if recompute and dropout_p == 0.0 else None
    flash_rebuilt = rebuildable is not None and rebuilt_flash.serves(q, mask, dropout_p)
    outputs = []
    # q's rows as the Toeplitz rows' and the other blocks' views, in one split: with gradients its
    # backward concatenates the parts' gradients once, where a slice per block would make a
    # zero-filled (B, H, Tq, D) gradient for each that autograd then adds up (FIRE at T=2048 in
    # the bench's model: 28 fills and adds a step)
    rest = [
        (start, stop, k_start)
        for (start, stop), k_start in zip(spans, firsts, strict=True)
        if stop > toeplitz_rows
    ]
    sizes = ([toeplitz_rows] if toeplitz_rows else []) + [stop - start for start, stop, _ in rest]
    q_parts = list(torch.split(q, sizes, dim=2))
    if toeplitz_rows:
        assert distance is not None
        head = q_parts.pop(0)
        # backward's work buffers shared by the layers of one forward
        shared: dict = {} if memo is None else memo.get(("toeplitz_buffers",), dict)
        outputs.append(
            attend_toeplitz(head, k, v, distance[1], q_len, softmax_scale, block, dropout_p, shared)
        )
    for (start, stop, k_start), q_block in zip(rest, q_parts, strict=True):
        if rebuildable is not None:
            outputs.append(rebuilt_block(q_block, start, stop, k_start, rebuildable))
        elif recompute:
            outputs.append(checkpoint(one_block, q_block, start, stop, k_start, use_reentrant=False))
        else:
            outputs.append(one_block(q_block, start, stop, k_start))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2)


def takes_separable(bias: BlockBias, q: torch.Tensor) -> TypeGuard[SeparableBias]:
    """Whether :func:`attend_chunked` sends a call to :func:`.separable.attend_separable`: a separable
    bias (FoX's), fp32/fp64 queries, more than :data:`FEW_QUERIES` of them."""
    return isinstance(bias, SeparableBias) and q.dtype in FEATURE_DTYPES and q.shape[-2] > FEW_QUERIES


def bias_scratch(
    memo: ForwardMemo | None, size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """A flat buffer of at least ``size`` values that blocks built without gradients write their
    bias into (``BlockBias.folded``'s ``scratch``), one per forward and dtype, grown when a
    call needs more (None under torch.compile, where the graph plans its own buffers). On CPU
    a new tensor over 32 MiB (glibc's largest mmap threshold) is a fresh mapping whose pages
    fault on first touch: a block of 8 heads x 256 queries x 4096 keys in fp32 is 32 MiB, and
    writing it anew each block measured about as long as computing its values."""
    if torch.compiler.is_compiling():
        return None
    holder: dict[str, torch.Tensor] = (
        {} if memo is None else memo.get(("chunked_bias_scratch", dtype, device), dict)
    )
    buffer = holder.get("buffer")
    if buffer is None or buffer.numel() < size:
        buffer = torch.empty(size, dtype=dtype, device=device)
        holder["buffer"] = buffer
    return buffer


def block_first_keys(mask: torch.Tensor, spans: list[tuple[int, int]], memo: ForwardMemo | None) -> list[int]:
    """For each query block, the first key one of its queries may attend: the keys before it
    (other documents of a packed sequence, left padding) are skipped, not computed and masked.
    A block with a query that may attend nothing starts at 0 (as a whole masked call would).

    ``mask`` (B|1, 1, Tq, Tk) bool; computed once per forward when ``memo`` is given (every
    layer receives the same mask)."""

    def compute() -> list[int]:
        allowed = mask.any(dim=-1)  # (B|1, 1, Tq): the query may attend some key
        first = torch.where(allowed, mask.int().argmax(dim=-1), 0).amin(dim=(0, 1))  # (Tq,)
        return [int(first[start:stop].min()) for start, stop in spans]

    if memo is None:
        return compute()
    return memo.get(("block_first_keys", id(mask), tuple(spans)), compute)


@register_backend
class ChunkedBackend(Backend):
    name = "chunked"
    priority = 40
    requests = frozenset({AUTO, "chunked", "flex"})
    selectable = True

    def serves(self, call: AttentionCall) -> bool:
        return call.bias is not None and not call.explicit and not call.want_weights

    def keeps_chained_inputs(self, call: AttentionCall) -> bool:
        """A separable bias past a few queries in fp32/fp64 training on CPU: the fused kernel pair of
        :mod:`.separable`, a :func:`~hf_posenc.core.recompute.kernel` (see :func:`attend_chunked`)."""
        return (
            call.bias is not None
            and takes_separable(call.bias, call.q)
            and separable.kernel_serves(call.q, call.dropout_p)
        )

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        return attend_chunked(**call.bias_arguments(), dropout_p=call.dropout_p, memo=call.score.memo), None
