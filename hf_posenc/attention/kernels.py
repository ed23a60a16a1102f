"""Fused GPU kernels from optional packages, each serving the calls it can.

``attend_flash_alibi``        flash-attn's ``flash_attn_func(..., alibi_slopes=)`` for ALiBi
                              (``BlockBias.slopes``), fp16/bf16, no padding mask;
``attend_fla_forgetting``     flash-linear-attention's ``parallel_forgetting_attn`` for FoX
                              (``BlockBias.log_forget``), no padding, no cache;
``attend_fla_stickbreaking``  flash-linear-attention's ``parallel_stickbreaking_attn`` for
                              ``sba`` at inference, no padding, no cache.

Each runs on CUDA when its package is installed (or with an explicit stand-in ``kernel`` /
``flash_function``, which is how they are tested without a GPU) and returns ``None`` when it
cannot serve a call; the caller then uses the chunked backend or the encoding's own stages.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from ..encodings.block_bias import BlockBias


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def attend_flash_alibi(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: BlockBias,
    mask: torch.Tensor | None,
    scaling: float,
    dropout_p: float = 0.0,
    flash_function: Callable | None = None,
) -> torch.Tensor | None:
    """ALiBi through flash-attn's ``alibi_slopes`` -> (B,Tq,Hq,D), or None when it cannot serve the call."""
    if bias.slopes is None or mask is not None:
        return None
    if flash_function is None:
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            return None
        if not flash_attn_available():
            return None
        from flash_attn import flash_attn_func as flash_function
    # flash-attn takes (B, T, H, D), aligns causal masks bottom-right and adds -slope * |i - j|
    out = flash_function(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        dropout_p=dropout_p,
        softmax_scale=scaling,
        causal=True,
        alibi_slopes=bias.slopes.float(),
    )
    return out  # (B, Tq, Hq, D)


def attend_fla_forgetting(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: BlockBias,
    mask: torch.Tensor | None,
    scaling: float,
    kernel: Callable | None = None,
) -> torch.Tensor | None:
    """FoX through flash-linear-attention's forgetting-attention kernel -> (B,Tq,Hq,D), or None.

    The kernel takes (B, T, H, D) tensors and per-token log forget gates g (B, T, Hq), and adds
    sum_{l=j+1}^{i} g_l to the causal scores: ``BlockBias.log_forget`` of a call without cache.
    """
    if bias.log_forget is None or mask is not None or q.shape[-2] != k.shape[-2]:
        return None
    if kernel is None:
        if q.device.type != "cuda" or not fla_available():
            return None
        from fla.ops.forgetting_attn import parallel_forgetting_attn as kernel
    out = kernel(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        bias.log_forget.transpose(1, 2),  # (B, T, Hq) fp32
        scale=scaling,
    )
    return out  # (B, Tq, Hq, D)


def attend_fla_stickbreaking(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    scaling: float,
    attend_current: bool,
    remainder: str,
    kernel: Callable | None = None,
) -> torch.Tensor | None:
    """Stick-breaking attention through flash-linear-attention's kernel -> (B,Tq,Hq,D), or None.

    The kernel returns o = sum_j A_ij v_j over keys j < i (j <= i with ``attend_current``) and
    the unused stick rem = 1 - sum_j A_ij; ``remainder="current"`` adds max(rem, 0) v_i as the
    eager ``sba`` does. Served without padding, cache or gradients (older releases of the
    kernel have no backward), on CUDA with the ``fla`` package installed.
    """
    if mask is not None or q.shape[-2] != k.shape[-2] or torch.is_grad_enabled():
        return None
    if kernel is None:
        if q.device.type != "cuda" or not fla_available():
            return None
        from fla.ops.stickbreaking_attn import parallel_stickbreaking_attn as kernel
    groups = q.shape[1] // k.shape[1]
    values = v.transpose(1, 2)  # (B, T, Hkv, D)
    out, rem = kernel(
        q.transpose(1, 2), k.transpose(1, 2), values, scale=scaling, attend_current=attend_current
    )
    if remainder == "current":
        own = values.repeat_interleave(groups, dim=2) if groups > 1 else values  # (B, T, Hq, D)
        out = out + rem.clamp(min=0.0)[..., None].to(out.dtype) * own
    return out  # (B, Tq, Hq, D)
