"""Where ExPE/ExQPE positions stop being distinguishable in a low-precision model.

The codes are computed in fp64, rounded to fp32 and cast to the model's dtype. Once the
increment per token (ExPE: theta / f per dimension, theta * l / f over a code; ExQPE: theta2 / f
in one dimension) is no larger than the dtype's spacing at the codes' magnitude, the codes of
adjacent positions can round to the same vector, and the model cannot tell those tokens apart.

:func:`first_collision` finds the first position ``n`` whose code equals the code of ``n + 1``,
exactly, by evaluating the encodings' own value functions (:func:`expe_component`,
:func:`exqpe_component`) at every candidate:

- ExPE: code(n) = (w_n, ..., w_{n+l-1}) with w_m = S + theta * m / f, so code(n) = code(n+1) iff
  w_n = w_{n+1} = ... = w_{n+l}, iff (the cast is monotone) cast(w_n) = cast(w_{n+l});
- ExQPE: from n to n+1 only component k = (n+1) mod l changes, its count going from
  q = (n+1) // l to q + 1, so code(n) = code(n+1) iff cast(S + (k theta1 + q theta2) / f) =
  cast(S + (k theta1 + (q+1) theta2) / f).

Collisions need a magnitude whose spacing reaches the increment, so only the positions whose
codes reach it (from one binade below) are scanned, up to :data:`HORIZON` positions (None: no
collision before).
"""

from __future__ import annotations

import math

import torch

#: positions scanned at most (16.7M tokens)
HORIZON = 1 << 24
_CHUNK = 1 << 16


def expe_component(m: torch.Tensor, S: float, theta: float, factor: float) -> torch.Tensor:  # noqa: N803
    """w_m = S + theta * m / factor for integer m (any shape): fp64 -> fp32, as ExPE writes it."""
    return (S + theta * m.to(torch.float64) / factor).float()


def exqpe_component(
    j: torch.Tensor,
    count: torch.Tensor,
    S: float,  # noqa: N803
    theta1: float,
    theta2: float,
    factor: float,
) -> torch.Tensor:
    """S + (j * theta1 + theta2 * count) / factor for integer j, count (broadcast): fp64 -> fp32."""
    moving = j.to(torch.float64) * theta1 + theta2 * count.to(torch.float64)
    return (S + moving / factor).float()


def _precision(dtype: torch.dtype) -> int:
    """Significand bits of the codes in ``dtype`` (they pass through fp32 first)."""
    eps = max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)  # 2^-(p-1)
    return 1 - round(math.log2(eps))


def _collisions(config, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bool (stop - start,): whether position n = start .. stop-1 has the code of n + 1."""
    n = torch.arange(start, stop, dtype=torch.int64)
    S, f = config.S, config.factor  # noqa: N806
    if config.encoding == "expe":
        before = expe_component(n, S, config.theta, f).to(dtype)
        after = expe_component(n + config.l, S, config.theta, f).to(dtype)
    else:
        m = n + 1
        k, q = m % config.l, m // config.l
        before = exqpe_component(k, q, S, config.theta1, config.theta2, f).to(dtype)
        after = exqpe_component(k, q + 1, S, config.theta1, config.theta2, f).to(dtype)
    return before == after


def _scan_ranges(config, dtype: torch.dtype, horizon: int) -> list[tuple[int, int]]:
    """Position ranges outside which no two adjacent codes can be equal in ``dtype``."""
    f = config.factor
    if config.encoding == "expe":
        step, increment, offset = config.theta / f, config.theta * config.l / f, 0.0
    else:
        step, increment = config.theta2 / f / config.l, config.theta2 / f
        offset = config.l * config.theta1 / f
    # spacing 2^(e - p + 1) at magnitude 2^e reaches the increment from e = log2(increment) + p - 1;
    # one binade lower for the rounding of values just below that magnitude
    magnitude = 2.0 ** (math.ceil(math.log2(increment)) + _precision(dtype) - 2)
    margin = 2 * config.l + 2

    def position(value: float) -> int:  # the position whose codes reach ``value``
        return int(max(0.0, min((value - config.S - offset) / step, float(horizon))))

    ranges = []
    if config.S + magnitude < 0:  # codes start below -magnitude and rise through zero
        ranges.append((0, min(position(-magnitude) + margin, horizon)))
    ranges.append((max(position(magnitude) - margin, 0), horizon))
    return ranges


def first_collision(config, dtype: torch.dtype, horizon: int = HORIZON) -> int | None:
    """The first position n < ``horizon`` whose ExPE/ExQPE code (resolved ``config``) equals n+1's
    in ``dtype``, or None."""
    for start, end in _scan_ranges(config, dtype, horizon):
        while start < end:
            stop = min(start + _CHUNK, end)
            hits = torch.nonzero(_collisions(config, start, stop, dtype))
            if hits.numel():
                return start + int(hits[0, 0])
            start = stop
    return None
