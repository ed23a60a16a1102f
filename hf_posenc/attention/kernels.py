"""Fused GPU kernels from optional packages, each a backend serving the calls whose shape it implements.

``flash_alibi``         flash-attn's ``flash_attn_func(..., alibi_slopes=)`` for a distance-linear
                        bias (:class:`LinearDistanceBias`, ALiBi), fp16/bf16, no padding mask;
``fla_forgetting``      flash-linear-attention's ``parallel_forgetting_attn`` for a cumulative
                        bias (:class:`CumulativeBias`, FoX without a cache), fp16/bf16, no
                        padding (in fp32 its Triton dots run in TF32: on an H200 FoX's fp32
                        logits, gradients and cached decoding left eager's 1e-4, so fp32 calls
                        go to FlexAttention, which keeps IEEE fp32);
``fla_stickbreaking``   flash-linear-attention's ``parallel_stickbreaking_attn`` for stick-breaking
                        attention (``sba``) at inference, no padding, no cache.

Each serves under ``backend="auto"`` on CUDA when its package is installed; the ``attend_*``
functions also take an explicit stand-in ``kernel`` / ``flash_function``, which is how they
are tested without a GPU, and return ``None`` when they cannot serve a call.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from ..core.layout import expand_kv_heads
from ..encodings.block_bias import BlockBias, CumulativeBias, LinearDistanceBias
from ..encodings.sba import SBAConfig, StickBreaking
from .backend import AUTO, AttentionCall, Backend, output_only, register_backend


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
    softmax_scale: float,
    dropout_p: float = 0.0,
    flash_function: Callable | None = None,
) -> torch.Tensor | None:
    """ALiBi through flash-attn's ``alibi_slopes`` -> (B,Tq,Hq,D), or None when it cannot serve the call."""
    if not isinstance(bias, LinearDistanceBias) or mask is not None:
        return None
    if flash_function is None:
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            return None
        if not flash_attn_available():
            return None
        from flash_attn import flash_attn_func

        flash_function = flash_attn_func
    # flash-attn takes (B, T, H, D), aligns causal masks bottom-right and adds -slope * |i - j|
    out = flash_function(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
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
    softmax_scale: float,
    kernel: Callable | None = None,
) -> torch.Tensor | None:
    """FoX through flash-linear-attention's forgetting-attention kernel -> (B,Tq,Hq,D), or None.

    The kernel takes (B, T, H, D) tensors and per-token log forget gates g (B, T, Hq), and adds
    sum_{l=j+1}^{i} g_l to the causal scores: a :class:`CumulativeBias` (a call without cache).
    """
    if not isinstance(bias, CumulativeBias) or mask is not None or q.shape[-2] != k.shape[-2]:
        return None
    if kernel is None:
        if q.device.type != "cuda" or not fla_available():
            return None
        from fla.ops.forgetting_attn import parallel_forgetting_attn

        kernel = parallel_forgetting_attn
    out = kernel(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        bias.increments.transpose(1, 2),  # (B, T, Hq) fp32
        scale=softmax_scale,
    )
    return out  # (B, Tq, Hq, D)


def attend_fla_stickbreaking(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    softmax_scale: float,
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
        from fla.ops.stickbreaking_attn import parallel_stickbreaking_attn

        kernel = parallel_stickbreaking_attn
    groups = q.shape[1] // k.shape[1]
    values = v.transpose(1, 2)  # (B, T, Hkv, D)
    out, rem = kernel(
        q.transpose(1, 2), k.transpose(1, 2), values, scale=softmax_scale, attend_current=attend_current
    )
    if remainder == "current":
        own = expand_kv_heads(values, groups, dim=2)  # (B, T, Hq, D)
        out = out + rem.clamp(min=0.0)[..., None].to(out.dtype) * own
    return out  # (B, Tq, Hq, D)


def _fused_bias_call(call: AttentionCall, form: type) -> bool:
    """What a fused bias kernel needs: CUDA, no explicit scores or weights, no padding, its bias form."""
    plain = not call.explicit and not call.want_weights and call.mask is None
    return plain and call.on_cuda and isinstance(call.bias, form)


@register_backend
class FlashALiBiBackend(Backend):
    name = "flash_alibi"
    priority = 90
    requests = frozenset({AUTO})

    def serves(self, call: AttentionCall) -> bool:
        half = call.q.dtype in (torch.float16, torch.bfloat16)
        return _fused_bias_call(call, LinearDistanceBias) and half and flash_attn_available()

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return output_only(attend_flash_alibi(**call.bias_arguments(), dropout_p=call.dropout_p))


@register_backend
class FlaForgettingBackend(Backend):
    name = "fla_forgetting"
    priority = 80
    requests = frozenset({AUTO})

    def serves(self, call: AttentionCall) -> bool:
        half = call.q.dtype in (torch.float16, torch.bfloat16)
        return _fused_bias_call(call, CumulativeBias) and half and call.dropout_p == 0.0 and fla_available()

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return output_only(attend_fla_forgetting(**call.bias_arguments()))


@register_backend
class FlaStickBreakingBackend(Backend):
    name = "fla_stickbreaking"
    priority = 100
    requests = frozenset({AUTO})

    def serves(self, call: AttentionCall) -> bool:
        sba = isinstance(call.encoding, StickBreaking) and call.stages == frozenset({"normalize"})
        return sba and call.on_cuda and not call.want_weights and call.mask is None and fla_available()

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        config = call.encoding.config
        assert isinstance(config, SBAConfig)  # serves() checked the encoding
        out = attend_fla_stickbreaking(
            call.q,
            call.k,
            call.v,
            mask=call.mask,
            softmax_scale=call.softmax_scale,
            attend_current=config.attend_current,
            remainder=config.remainder,
        )
        return output_only(out)
