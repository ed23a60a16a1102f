"""Which block backend serves a call whose score bias comes as a :class:`BlockBias`.

``chunked``  query blocks over SDPA (any device; the CPU default);
``flex``     FlexAttention with a ``score_mod`` (falls back to ``chunked`` when it cannot serve);
``auto``     on CUDA: flash-attn's ALiBi kernel or flash-linear-attention's FoX kernel, then
             FlexAttention, then ``chunked``;
             elsewhere ``chunked``.
"""

from __future__ import annotations

import torch

from ..encodings.block_bias import BlockBias
from ..memo import ForwardMemo
from .chunked import attend_chunked
from .flex import attend_flex
from .kernels import attend_fla_forgetting, attend_flash_alibi

BLOCK_BACKENDS = ("auto", "chunked", "flex")


def attend_blocks(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: BlockBias,
    mask: torch.Tensor | None,
    scaling: float,
    dropout_p: float,
    memo: ForwardMemo,
) -> torch.Tensor:
    """q (B,Hq,Tq,D), k/v (B,Hkv,Tk,D) -> (B,Tq,Hq,D) through the first backend that serves the call."""
    gpu_first = backend == "auto" and q.device.type == "cuda"
    if gpu_first:
        out = attend_flash_alibi(q, k, v, bias=bias, mask=mask, scaling=scaling, dropout_p=dropout_p)
        if out is None and dropout_p == 0.0:
            out = attend_fla_forgetting(q, k, v, bias=bias, mask=mask, scaling=scaling)
        if out is not None:
            return out
    if (gpu_first or backend == "flex") and dropout_p == 0.0:
        out = attend_flex(q, k, v, bias=bias, mask=mask, scaling=scaling, memo_get=memo.get)
        if out is not None:
            return out
    return attend_chunked(q, k, v, bias=bias, mask=mask, scaling=scaling, dropout_p=dropout_p)
