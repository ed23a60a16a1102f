"""GPU backends for block biases: FlexAttention ``score_mod`` and flash-attn's ALiBi kernel.

FlexAttention (``torch.nn.attention.flex_attention``) fuses the bias into the attention
kernel: ``score_mod(score, b, h, q_idx, kv_idx)`` adds the bias from O(T) tensors
(``BlockBias.by_distance``, ``BlockBias.separable``, or the encoding's own
``BlockBias.score_mod``, e.g. FIRE's) and a block mask skips the future
(and padding). On CUDA the function is compiled once (``torch.compile``); elsewhere it runs
uncompiled, which is exact but materialises the scores (for tests, not for speed).
Causal block masks are cached per (Tq, Tk, device); padding masks per forward.

flash-attn's ``flash_attn_func(..., alibi_slopes=)`` serves ALiBi (``BlockBias.slopes``)
without a padding mask in fp16/bf16 on CUDA when the ``flash_attn`` package is installed;
flash-linear-attention's ``parallel_forgetting_attn`` serves FoX (``BlockBias.log_forget``)
without padding or cache on CUDA when the ``fla`` package is installed.

Either path reports ``None`` when it cannot serve a call, and the caller falls back to the
chunked backend.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable

import torch

from ..encodings.block_bias import BlockBias

_BLOCK_MASKS: dict[tuple, object] = {}
_BLOCK_MASK_LIMIT = 16
_failed: set[str] = set()


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


@functools.cache
def _flex_function(compiled: bool) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def _block_mask(mask: torch.Tensor | None, batch: int, q_len: int, k_len: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    offset = k_len - q_len
    if mask is None:
        key = (q_len, k_len, str(device))
        cached = _BLOCK_MASKS.get(key)
        if cached is None:
            if len(_BLOCK_MASKS) >= _BLOCK_MASK_LIMIT:
                _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))

            def causal(b, h, q_idx, kv_idx):
                return q_idx + offset >= kv_idx

            cached = create_block_mask(causal, None, None, q_len, k_len, device=device)
            _BLOCK_MASKS[key] = cached
        return cached

    allowed = mask.expand(batch, 1, q_len, k_len)  # (B, 1, Tq, Tk) bool, causal already

    def padded(b, h, q_idx, kv_idx):
        return allowed[b, 0, q_idx, kv_idx]

    return create_block_mask(padded, batch, None, q_len, k_len, device=device)


def _score_mod(bias: BlockBias) -> Callable | None:
    if bias.score_mod is not None:
        return bias.score_mod
    offset = bias.k_len - bias.q_len
    if bias.by_distance is not None:
        table = bias.by_distance  # (Hq, Tk) fp32

        def by_distance(score, b, h, q_idx, kv_idx):
            distance = torch.clamp(q_idx + offset - kv_idx, min=0)
            return score + table[h, distance]

        return by_distance
    if bias.separable is not None:
        query_term, key_term = bias.separable  # (B, Hq, Tq), (B, Hq, Tk)

        def separable(score, b, h, q_idx, kv_idx):
            return score + (query_term[b, h, q_idx] - key_term[b, h, kv_idx])

        return separable
    return None


def attend_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: BlockBias,
    mask: torch.Tensor | None,
    scaling: float,
    memo_get: Callable | None = None,
) -> torch.Tensor | None:
    """q (B,Hq,Tq,D), k/v (B,Hkv,Tk,D) -> (B,Tq,Hq,D), or None when FlexAttention cannot serve it."""
    score_mod = _score_mod(bias)
    if score_mod is None or not flex_available() or "flex" in _failed:
        return None
    if q.device.type != "cuda" and torch.is_grad_enabled():
        return None  # FlexAttention has no backward off CUDA
    batch, _, q_len, _ = q.shape
    k_len = k.shape[-2]
    if mask is None:
        block_mask = _block_mask(None, batch, q_len, k_len, q.device)
    else:
        build = functools.partial(_block_mask, mask, batch, q_len, k_len, q.device)
        block_mask = memo_get(("flex_block_mask", id(mask), q_len, k_len), build) if memo_get else build()
    compiled = q.device.type == "cuda"
    gqa = q.shape[1] != k.shape[1]
    try:
        with warnings.catch_warnings():
            # uncompiled FlexAttention warns that it is slow: off CUDA it is the tested reference path
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = _flex_function(compiled)(
                q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=gqa
            )
    except Exception as error:  # a kernel this build of torch cannot compile: say so once, fall back
        if not compiled:
            raise
        _failed.add("flex")
        warnings.warn(
            f"hf_posenc: FlexAttention failed ({type(error).__name__}: {error}); "
            "using the chunked backend from now on",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return out.transpose(1, 2)


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
