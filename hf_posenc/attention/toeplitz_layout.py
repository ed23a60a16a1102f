"""The Hankel layout of the Toeplitz path (:mod:`.toeplitz`): over the queries in reverse order,
bias-plus-causal-mask of reversed row ``a`` and key ``j`` depends on ``a + j`` only, so each block's
float mask is an ``as_strided`` view of one (Hq, L) line; the blocks of reversed rows; the work
buffers and constants its forward and backward share."""

from __future__ import annotations

import math

import torch

from ..core.layout import anti_diagonal_sums, causal_keys, hankel_view
from .softmax_parts import CPU_FLASH_BACKWARD

LOG2E = math.log2(math.e)
#: base-2 exponent below which a recomputed attention weight is taken as 0 (2^-100 ~ 8e-31)
FLUSH = -100.0
#: dtypes torch's fused CPU flash kernels take
CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def toeplitz_line(
    table: torch.Tensor, rows: int, q_len: int, k_len: int, block: int, dtype: torch.dtype
) -> torch.Tensor:
    """table (Hq, >= D0 + 1) over distances 0.. -> the line (Hq, D0 + block) in ``dtype``:
    ``line[h, p] = table[h, D0 - p]`` for p <= D0 = rows - 1 + k_len - q_len, the dtype's
    minimum after (the future keys a block of up to ``block`` reversed rows reaches)."""
    distances = rows + k_len - q_len  # D0 + 1
    future = torch.full((table.shape[0], block - 1), torch.finfo(dtype).min, dtype=dtype, device=table.device)
    return torch.cat((table[:, :distances].flip(1).to(dtype), future), dim=1)


class ToeplitzView(torch.autograd.Function):
    """:func:`hankel_view` with a backward that sums the incoming gradient along its
    anti-diagonals (skewing it into a (H, rows, keys + rows) buffer), much cheaper than
    autograd's generic backward of an overlapping ``as_strided`` view (the SDPA path's mask)."""

    @staticmethod
    def forward(ctx, line: torch.Tensor, first: int, rows: int, keys: int) -> torch.Tensor:
        ctx.first, ctx.shape = first, line.shape
        return hankel_view(line, first, rows, keys)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sums = anti_diagonal_sums(grad[0])  # (H, rows + keys - 1): the sum over a + b = n
        grad_line = grad.new_zeros(ctx.shape)
        grad_line[:, ctx.first : ctx.first + sums.shape[1]] = sums
        return grad_line, None, None, None


def blocks(rows: int, q_len: int, k_len: int, block: int) -> list[tuple[int, int, int]]:
    """(first reversed row, rows, keys) of each block of ``block`` reversed rows: the block of
    reversed rows [r0, r0 + R) holds queries n - r0 - R .. n - 1 - r0 and attends the keys
    ``0 .. causal_keys(stop) - 1`` of its latest query."""
    return [(r0, min(block, rows - r0), causal_keys(q_len, k_len, rows - r0)) for r0 in range(0, rows, block)]


def fused_backward_runs(q: torch.Tensor) -> bool:
    """Whether torch's fused CPU flash backward serves q's device and dtype."""
    return CPU_FLASH_BACKWARD is not None and q.device.type == "cpu" and q.dtype in CPU_FLASH_DTYPES


def work_buffer(
    buffers: dict | None, name: str, size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A flat work buffer of at least ``size`` values, kept in ``buffers`` for the next call."""
    key = (name, dtype, device)
    found = None if buffers is None else buffers.get(key)
    if found is None or found.numel() < size:
        found = torch.empty(size, dtype=dtype, device=device)
        if buffers is not None:
            buffers[key] = found
    return found
