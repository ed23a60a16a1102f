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

as LongLM's and ReRoPE's flash variants do. The largest tensor is one block's scores over its
keys, (B, Hq, block, Tk); with gradients each block is recomputed in backward. The band and the
far range cover every key a query may attend when positions count tokens (index distance =
position distance for attended pairs: transformers' positions, padding-aware positions, packed
sequences with restarting ``position_ids``); which part a key belongs to is decided by positions.

Registered as backend ``neighbour``: under ``backend="auto"`` (the default), ``"chunked"`` and
``"flex"``; ``"eager"``/``"sdpa"`` run the encoding's explicit ``logits`` instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..core.layout import causal_keys, causal_mask, expand_kv_heads
from ..encodings.base import splits_neighbours
from ..encodings.call import NeighbourSplit
from . import chunked
from .backend import AUTO, AttentionCall, Backend, register_backend


def _part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float, dropout_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B,H,rows,D), k/v (B,H,keys,D), allowed (B|1,1,rows,keys) -> (normalised output (B,H,rows,D),
    lse (B,H,rows,1)); rows without an allowed key get output 0 and lse -inf."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, rows, keys)
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


def attend_neighbour(
    split: NeighbourSplit,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    softmax_scale: float,
    dropout_p: float = 0.0,
    block: int | None = None,
) -> torch.Tensor:
    """``split`` of one call, v (B,Hkv,Tk,D), mask (B|1,1,Tq,Tk) bool or None (causal) -> (B,Tq,Hq,D)."""
    block = block or chunked.QUERY_BLOCK
    dtype = torch.promote_types(split.near_q.dtype, torch.float32)
    groups = split.near_q.shape[1] // split.near_k.shape[1]
    near_k, far_k, values = (expand_kv_heads(t.to(dtype), groups) for t in (split.near_k, split.far_k, v))
    q_len, k_len, window = split.near_q.shape[-2], near_k.shape[-2], split.window
    offset = k_len - q_len  # query a sits at key index offset + a

    def one_block(near_q: torch.Tensor, far_q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        k_end, rows = causal_keys(q_len, k_len, stop), slice(start, stop)
        allowed = causal_mask(stop - start, k_end, near_q.device) if mask is None else mask[..., rows, :k_end]
        parts = []
        band = slice(max(0, offset + start - window + 1), k_end)
        near = allowed[..., band] & split.is_near(rows, band)
        parts.append(_part(near_q, near_k[:, :, band], values[:, :, band], near, softmax_scale, dropout_p))
        far_end = max(0, offset + stop - window)
        if far_end > 0:
            keys = slice(0, far_end)
            far = allowed[..., keys] & ~split.is_near(rows, keys)
            parts.append(_part(far_q, far_k[:, :, keys], values[:, :, keys], far, softmax_scale, dropout_p))
        return _merge(parts)

    spans = [(start, min(q_len, start + block)) for start in range(0, q_len, block)]
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
        split = call.encoding.neighbour_split(call.score)
        out = attend_neighbour(
            split, call.v, mask=call.mask, softmax_scale=call.softmax_scale, dropout_p=call.dropout_p
        )
        return out, None
