"""``exp`` of tensors whose values reach far below zero (log-space attention weights, masked
scores), with the results a float cannot hold as a normal number flushed to zero.

Why by hand: on CPU, ``torch.exp`` (aten's vectorised exp) leaves its fast path for inputs whose
result is subnormal or underflows, and for -inf: measured in one process on this 2-core machine
(fp32, 8M values, one thread, under load), about 1.5-2 ns per value for inputs in [-30, 0], 11 ns
for -inf, 17-60 ns for inputs in [-104, -88] (subnormal results) and below. Stick-breaking
weights (``exp`` of sums of ``log(1 - beta)``) and the explicit softmax parts (``exp(scores - lse)``
with masked scores at -inf) are mostly such inputs. Clamping first keeps every input on the fast
path, and the clamped values are then set to zero, so that

    exp_flushed(x) = exp(x)  where exp(x) > 1.01 * exp(low),  else 0;   low = log(tiny) + 1/2

(``tiny`` the dtype's smallest normal number: results below 1.67 * tiny, 2.0e-38 in fp32 and
3.7e-308 in fp64, are flushed; every other result is torch.exp's own). Its gradient is exp(x)
where the result is kept and 0 where it is flushed, the derivative of the flushed function.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _bounds(dtype: torch.dtype) -> tuple[float, float]:
    """(low, threshold) of ``dtype``: inputs are clamped to ``low`` (half a unit above log of its smallest
    normal number) and results not above ``threshold`` = 1.01 exp(low) become 0 (every clamped value
    is exp(low) rounded to the dtype, below the threshold however the last bit rounds)."""
    low = math.log(torch.finfo(dtype).tiny) + 0.5
    return low, 1.01 * math.exp(low)


def exp_flushed(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` with results below ~1.67 x the dtype's smallest normal number flushed to 0 (-inf -> 0);
    floating ``x`` of any shape. A new tensor; differentiable (see the module docstring)."""
    low, threshold = _bounds(x.dtype)
    if torch.is_grad_enabled() and x.requires_grad:
        return F.threshold(x.clamp_min(low).exp(), threshold, 0.0)
    return torch.threshold_(x.clamp_min(low).exp_(), threshold, 0.0)
