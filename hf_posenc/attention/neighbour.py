"""The neighbour backend: attention for encodings with two position maps (SelfExtend, ReRoPE),
in blocks of queries, near and far keys apart, merged by log-sum-exp.

For an encoding that gives its logits as a :class:`~hf_posenc.encodings.call.NeighbourSplit`
(queries and keys rotated under the neighbour map and under the far map), query block
``[s, e)`` (bottom-right aligned to the keys) attends

- its neighbour band, keys ``Tk - Tq + s - window + 1 .. Tk - Tq + e - 1``, with the neighbour
  rotation, where ``i - j < window`` (token positions);
- the far keys, ``0 .. Tk - Tq + e - window - 1``, with the far rotation, where ``i - j >= window``;

each part as softmax statistics (its normalised output and log-sum-exp), merged exactly:

    out = sum_p exp(lse_p - lse) out_p,   lse = log sum_p exp(lse_p)

as LongLM's and ReRoPE's flash variants do. The band and the far range cover every key a query
may attend when positions count tokens (index distance = position distance for attended pairs:
transformers' positions, padding-aware positions, packed sequences with restarting
``position_ids``); which part a key belongs to is decided by positions.

Each part runs through :mod:`.softmax_parts`: on CPU torch's fused flash-attention kernel (the one
behind ``F.scaled_dot_product_attention``) with the part's boolean mask (allowed and near, or
allowed and far) as an additive mask, elsewhere the same formulas with explicit scores. With no
mask (plain causal), the far keys before the band whose positions are at least ``window`` below
every query's of the block (all of them when positions count tokens) are a third part attended
with no mask at all, so no (rows x keys) tensor is built for them. Training
goes through one autograd function that keeps only what a fused attention keeps — the unrotated
queries and keys (the backend's; both maps' rotations, twice that, are made again in backward
from them by the encoding and taken back through their own backward), the values, the merged
output and its log-sum-exp (all O(T)) — and in backward runs each block's parts' backward with
the merged statistics (FlashAttention-2's backward), so no (rows x keys) tensor is kept between
forward and backward and nothing but the rotations is recomputed. The output is written in
(B, Tq, Hq, D) memory, so the output projection's input is that storage, not a copy.
(Before: each block's explicit fp32 scores, checkpointed, whose (B, Hq, block, Tk) tensors existed
per block in backward.) Queries, keys and values are promoted to at least fp32, as the eager
path's logits are; a row with no allowed key at all (a padding query) gets output 0 (the eager
core gives the mean of every value there; neither is read: padding rows are never attended).
After a call of several blocks on CPU the C heap's free pages are handed back (the blocks'
temporaries would otherwise stay resident as heap holes, :mod:`.host_heap`).
Dropout (``attention_dropout > 0`` in training) keeps the earlier path: explicit scores per block,
checkpointed.

Registered as backend ``neighbour``: under ``backend="auto"`` (the default), ``"chunked"`` and
``"flex"``; ``"eager"``/``"sdpa"`` run the encoding's explicit ``logits`` instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..core.layout import expand_kv_heads
from ..core.memo import ForwardMemo
from ..encodings.base import splits_neighbours
from ..encodings.call import NeighbourSplit
from . import chunked
from .backend import AUTO, AttentionCall, Backend, register_backend
from .neighbour_plan import NeighbourPlan


class _NeighbourAttention(torch.autograd.Function):
    """The merged attention with the O(T) saved state of a fused kernel (see the module docstring).

    It receives the tensors the queries and keys of both maps are made from (``sources``: the
    unrotated q and k from the backend, or the four given ones) and ``split_of``, which makes
    the split from them. It keeps the sources — q and k, what native attention keeps, where the
    two maps' rotated queries and keys would be twice that — and makes the split again in
    backward, whose own backward takes the rotated tensors' gradients back to the sources (the
    same operations as autograd through a rotation done outside: the same bits)."""

    @staticmethod
    def forward(
        ctx: Any,
        plan: NeighbourPlan,
        split_of: Callable[..., NeighbourSplit],
        made: list[NeighbourSplit],
        *tensors: torch.Tensor,
    ) -> torch.Tensor:
        """``made``: [the split of the sources] when the caller made it already (taken out of the
        list, so nothing holds its tensors past this forward), or []."""
        *sources, v = tensors
        split = made.pop() if made else split_of(*sources)
        rotated = _rotated(split, v.dtype)
        del split
        out, lse = plan.forward(*rotated, v)
        ctx.plan, ctx.split_of = plan, split_of
        ctx.save_for_backward(*tensors, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        *sources, v, out, lse = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:-1]
        sources = [t.detach().requires_grad_(need) for t, need in zip(sources, needs, strict=True)]
        with torch.enable_grad():
            rotated = _rotated(ctx.split_of(*sources), v.dtype)
        *grads, grad_v = ctx.plan.backward(grad_out, *rotated, v, out, lse)
        wanted = [t for t in sources if t.requires_grad]
        pairs = [(r, g) for r, g in zip(rotated, grads, strict=True) if r.requires_grad]
        found: tuple[torch.Tensor | None, ...] = ()
        if wanted and pairs:
            found = torch.autograd.grad(
                [r for r, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            )
        by_source = iter(found)
        grad_sources = [next(by_source, None) if t.requires_grad else None for t in sources]
        return None, None, None, *grad_sources, grad_v if ctx.needs_input_grad[-1] else None


def _rotated(
    split: NeighbourSplit, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """near_q, far_q, near_k, far_k of ``split`` in the attention's dtype (at least fp32)."""
    return (split.near_q.to(dtype), split.far_q.to(dtype), split.near_k.to(dtype), split.far_k.to(dtype))


def attend_neighbour(
    split: NeighbourSplit,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    softmax_scale: float,
    dropout_p: float = 0.0,
    block: int | None = None,
    fused: bool = True,
) -> torch.Tensor:
    """``split`` of one call, v (B,Hkv,Tk,D), mask (B|1,1,Tq,Tk) bool or None (causal) -> (B,Tq,Hq,D).

    ``fused=False`` computes every part with explicit scores (the kernel used off CPU) instead of
    torch's fused CPU kernel."""
    template = _positions_only(split)

    def given(near_q: torch.Tensor, far_q: torch.Tensor, near_k: torch.Tensor, far_k: torch.Tensor):
        return dataclasses.replace(template, near_q=near_q, far_q=far_q, near_k=near_k, far_k=far_k)

    sources = (split.near_q, split.far_q, split.near_k, split.far_k)
    return attend_remade(
        given,
        sources,
        v,
        mask=mask,
        softmax_scale=softmax_scale,
        dropout_p=dropout_p,
        block=block,
        fused=fused,
    )


def attend_remade(
    split_of: Callable[..., NeighbourSplit],
    sources: tuple[torch.Tensor, ...],
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    softmax_scale: float,
    dropout_p: float = 0.0,
    block: int | None = None,
    fused: bool = True,
) -> torch.Tensor:
    """:func:`attend_neighbour` of ``split_of(*sources)`` (an encoding's rotations of the
    unrotated q and k under both maps): training keeps the sources, not the split's four
    tensors, and makes the split again in backward."""
    if dropout_p > 0:
        return _attend_explicit(
            split_of(*sources), v, mask=mask, softmax_scale=softmax_scale, dropout_p=dropout_p, block=block
        )
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (*sources, v))
    with torch.no_grad():  # training: the function makes its own graph of the split in backward
        split = split_of(*sources)
    dtype, out_dtype = torch.promote_types(split.near_q.dtype, torch.float32), v.dtype
    groups = split.near_q.shape[1] // split.near_k.shape[1]
    plan = NeighbourPlan(
        _positions_only(split), mask, softmax_scale, block or chunked.QUERY_BLOCK, groups, fused
    )
    v = v.to(dtype)
    if training:
        made = [split]
        del split  # the function takes it out of ``made``: its rotated tensors die with its forward
        out = _NeighbourAttention.apply(plan, split_of, made, *sources, v)
    else:
        out, _ = plan.forward(*_rotated(split, dtype), v)
    plan.trim_heap(out, training)
    return out.transpose(1, 2).to(out_dtype)  # (B, Tq, Hq, D)


def _positions_only(split: NeighbourSplit) -> NeighbourSplit:
    """``split`` without its queries and keys (what a plan keeps until backward: window, positions)."""
    empty = split.near_q.new_empty(0)
    return dataclasses.replace(split, near_q=empty, near_k=empty, far_q=empty, far_k=empty)


def _part(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B,H,rows,D), k/v (B,H,keys,D), allowed (B|1,1,rows,keys) -> (normalised output (B,H,rows,D),
    lse (B,H,rows,1)); rows without an allowed key get output 0 and lse -inf."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, rows, keys)
    if allowed is not None:  # None: every key allowed
        scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    weights = torch.exp(scores - top)  # 0 where masked
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / total.clamp_min(torch.finfo(total.dtype).tiny)
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    return torch.matmul(probs, v), top + total.log()


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Normalised outputs with their log-sum-exps -> the softmax over the union of their keys."""
    if len(parts) == 1:
        return parts[0][0]
    lse = torch.logsumexp(torch.cat([lse for _, lse in parts], dim=-1), dim=-1, keepdim=True)
    empty = torch.isinf(lse)  # no allowed key at all (a padding query)
    lse = torch.where(empty, torch.zeros_like(lse), lse)
    out = torch.zeros_like(parts[0][0])
    for part_out, part_lse in parts:
        out = out + torch.exp(part_lse - lse) * part_out  # exp(-inf) = 0 for an empty part
    return out


def _attend_explicit(
    split: NeighbourSplit,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    softmax_scale: float,
    dropout_p: float,
    block: int | None,
) -> torch.Tensor:
    """The path with dropout: each block's explicit fp32 scores per part (dropout on each part's
    weights), each block recomputed in backward; (B,Tq,Hq,D)."""
    dtype = torch.promote_types(split.near_q.dtype, torch.float32)
    groups = split.near_q.shape[1] // split.near_k.shape[1]
    near_k, far_k, values = (expand_kv_heads(t.to(dtype), groups) for t in (split.near_k, split.far_k, v))
    plan = NeighbourPlan(split, mask, softmax_scale, block or chunked.QUERY_BLOCK, 1, False)
    q_len, k_len = split.near_q.shape[-2], near_k.shape[-2]

    def one_block(near_q: torch.Tensor, far_q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        parts = []
        for is_far, keys, allowed in plan.parts(q_len, k_len, start, stop):
            q, k = (far_q, far_k) if is_far else (near_q, near_k)
            parts.append(_part(q, k[:, :, keys], values[:, :, keys], allowed, softmax_scale, dropout_p))
        return _merge(parts)

    spans = plan.spans(q_len)
    recompute = torch.is_grad_enabled() and len(spans) > 1
    outputs = []
    for start, stop in spans:
        near_q, far_q = split.near_q[:, :, start:stop].to(dtype), split.far_q[:, :, start:stop].to(dtype)
        if recompute:
            outputs.append(checkpoint(one_block, near_q, far_q, start, stop, use_reentrant=False))
        else:
            outputs.append(one_block(near_q, far_q, start, stop))
    return torch.cat(outputs, dim=2).transpose(1, 2).to(v.dtype)  # (B, Tq, Hq, D)


@register_backend
class NeighbourBackend(Backend):
    name = "neighbour"
    priority = 35
    requests = frozenset({AUTO, "chunked", "flex"})

    def serves(self, call: AttentionCall) -> bool:
        return not call.want_weights and "logits" in call.stages and splits_neighbours(call.encoding)

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        encoding, score = call.encoding, call.score  # (score's q and k are the sources, kept anyway)

        # with gradients, a memo of its own: in backward the forward's memo may hold another
        # forward's tables (two forwards, then one backward), which have the same keys but other
        # positions; without, the forward's (its cos/sin tables shared by the layers, as a
        # decoding step's are: per token 4 tables a layer otherwise)
        shared = None if torch.is_grad_enabled() else score.memo

        def split_of(q: torch.Tensor, k: torch.Tensor) -> NeighbourSplit:
            memo = shared if shared is not None else ForwardMemo()
            return encoding.neighbour_split(dataclasses.replace(score, q=q, k=k, memo=memo))

        out = attend_remade(
            split_of,
            (call.q, call.k),
            call.v,
            mask=call.mask,
            softmax_scale=call.softmax_scale,
            dropout_p=call.dropout_p,
        )
        return out, None
