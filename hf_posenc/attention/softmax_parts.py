"""Attention over one part of a query's keys, as softmax statistics, with a backward that takes the
statistics of the whole softmax: the pieces of an attention whose keys come in parts (the
``neighbour`` backend's near band and far range), merged exactly by log-sum-exp.

Forward of a part p (keys K_p, values V_p, additive mask M_p: 0 where allowed, -inf elsewhere):

    S_p = scale * Q K_p^T + M_p,   lse_p = log sum_j exp(S_p),   out_p = softmax(S_p) V_p

(a row with no allowed key: out_p = 0, lse_p = -inf). The parts merge as
``lse = log sum_p exp(lse_p)``, ``out = sum_p exp(lse_p - lse) out_p``. Backward of the merged
softmax restricted to part p, given the whole softmax's ``out`` and ``lse`` and dO:

    P_p = exp(S_p - lse),  dV_p = P_p^T dO,  dS_p = P_p * (dO V_p^T - rowsum(dO * out)),
    dQ += scale * dS_p K_p,  dK_p = scale * dS_p^T Q

(FlashAttention-2's backward, Dao 2023, Algorithm 2: the row statistics are all it needs), so
nothing of size (rows x keys) is kept between forward and backward.

Two kernels compute a part: torch's fused CPU flash-attention operators
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``, the kernels behind
``F.scaled_dot_product_attention`` on CPU, which take an outside ``out``/``lse`` in backward),
and :func:`explicit_forward`/:func:`explicit_backward`, the same formulas with explicit scores
(any device; its (rows x keys) scores exist only while one part is computed).

Grouped-query attention without copying keys: the query heads sharing a key head are stacked
along the rows, q (B, Hq, R, D) -> (B, Hkv, G*R, D), and the mask repeated G times along its rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: (q (B,Hkv,R,D), k/v (B,Hkv,K,D), bias (B|1,1,R,K) float or None (every key allowed), scale) -> (out (B,Hkv,R,D), lse (B,Hkv,R))
PartForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], tuple[torch.Tensor, torch.Tensor]
]
#: (dO, q, k, v, out, lse, bias, scale) -> (dq, dk, dv), out/lse those of the whole softmax
PartBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

#: torch's fused CPU flash-attention operators (None where this torch lacks them), shared by every
#: backend that calls them directly: (q, k, v, dropout_p, is_causal, *, attn_mask, scale) -> (out, lse)
#: and (dO, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask, scale) -> (dq, dk, dv)
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
#: dtypes the CPU kernel is used for (it computes in them; bf16/fp16 inputs are promoted before)
_CPU_FLASH_DTYPES = (torch.float32, torch.float64)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, repeat: int = 1) -> torch.Tensor:
    """(…, 1, R, K) bool -> the float mask (…, repeat, R, K): 0 where allowed, -inf elsewhere
    (``repeat`` copies along the size-1 dim; one allocation)."""
    shape = (*allowed.shape[:-3], repeat, *allowed.shape[-2:])
    return torch.full(shape, float("-inf"), dtype=dtype, device=allowed.device).masked_fill_(allowed, 0.0)


def cpu_flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    assert CPU_FLASH is not None
    out, lse = CPU_FLASH(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    return out, lse


def cpu_flash_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert CPU_FLASH_BACKWARD is not None
    dq, dk, dv = CPU_FLASH_BACKWARD(grad_out, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale)
    return dq, dk, dv


def explicit_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _scores(q, k, bias, scale)  # (B, H, R, K)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, R), -inf for a row with no allowed key
    probs = torch.exp(scores - finite(lse)[..., None])
    return torch.matmul(probs, v), lse


def explicit_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scores = _scores(q, k, bias, scale)  # (B, H, R, K), recomputed
    probs = torch.exp(scores - lse[..., None])  # the whole softmax's weights on this part's keys
    delta = (grad_out * out).sum(dim=-1, keepdim=True)  # (B, H, R, 1)
    grad_scores = probs * (torch.matmul(grad_out, v.transpose(-1, -2)) - delta) * scale
    return (
        torch.matmul(grad_scores, k),
        torch.matmul(grad_scores.transpose(-1, -2), q),
        torch.matmul(probs.transpose(-1, -2), grad_out),
    )


def _scores(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q (B,H,R,D), k (B,H,K,D) -> q k^T * scale + bias, (B, H, R, K)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return scores if bias is None else scores + bias


def finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (no allowed key) replaced by 0, so exp(-inf - lse) = 0, never NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def kernels(q: torch.Tensor, v: torch.Tensor, fused: bool = True) -> tuple[PartForward, PartBackward]:
    """The fused CPU kernel where it runs (CPU, fp32/fp64, values as wide as queries, this torch
    has it), else the explicit one."""
    if (
        fused
        and q.device.type == "cpu"
        and q.dtype in _CPU_FLASH_DTYPES
        and q.shape[-1] == v.shape[-1]
        and CPU_FLASH_BACKWARD is not None
    ):
        return cpu_flash_forward, cpu_flash_backward
    return explicit_forward, explicit_backward


def stack_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hq, R, D) -> (B, Hkv, G*R, D): the query heads of one key head stacked along the rows."""
    b, h, r, d = x.shape
    return x.reshape(b, h // groups, groups * r, d)


def unstack_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, G*R, ...) -> (B, Hq, R, ...): :func:`stack_groups` undone."""
    b, h, gr = x.shape[:3]
    return x.reshape(b, h * groups, gr // groups, *x.shape[3:])
