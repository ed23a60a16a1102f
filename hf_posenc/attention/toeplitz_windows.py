"""Key windows of the Toeplitz path (:mod:`.toeplitz`) for tables without gradient (ALiBi,
Sandwich, frozen tables): which keys of each head can change an fp32 result, and whether a head's
exponents stay on aten's fast exp path (so torch's fused backward may serve it).

With ``B_h`` a bound on ``|scale * q_i . k_j|`` over the call, a key whose bias lies more than
``2 B_h + CUTOFF`` below the bias of distance 0 has a weight below e^-CUTOFF < 2^-150 times the
diagonal key's: left out (:func:`head_plan`). The kernel calls of a block group neighbouring heads
whose first keys agree (:func:`head_groups`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

#: a key whose bias lies more than 2 B + CUTOFF below the bias of distance 0 (B >= |s q_i . k_j|
#: over the call) is left out of a table without gradient (:func:`head_plan`): its weight is below
#: e^-CUTOFF < 2^-150 times the diagonal key's, under half of fp32's smallest subnormal relative to
#: the row's sum (the fused kernel itself rounds it to 0)
CUTOFF = 104.0
#: a head's first key in a block is rounded down to a multiple of this, so that neighbouring heads
#: with about the same window share one kernel call
KEY_ALIGN = 64
#: torch's exp (in its fused CPU backward too) leaves its fast path for inputs below about -87.3
#: (fp32's smallest normal number, e^-87.3): a head whose exponents are bounded above -FAST_EXP
#: takes the fused backward
FAST_EXP = 80.0


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """Per head of a call with a table without gradient: ``windows[h]`` = D_h, the distances
    ``0 .. D_h - 1`` whose keys can change the result, and ``fused[h]``, whether torch's fused
    backward keeps every exponent of the head's window on aten's fast path."""

    windows: list[int]
    fused: list[bool]

    def runs(self) -> list[tuple[int, int, bool]]:
        """(first head, stop head, fused) of the runs of neighbouring heads with the same backward."""
        found: list[tuple[int, int, bool]] = []
        for head, fused in enumerate(self.fused):
            if found and found[-1][2] == fused:
                found[-1] = (found[-1][0], head + 1, fused)
            else:
                found.append((head, head + 1, fused))
        return found


def head_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    line: torch.Tensor,
    distances: int,
    scale: float,
    backward: bool = True,
    fused_backward: bool = True,
) -> HeadPlan:
    """The :class:`HeadPlan` of q (B, H, n, D), k (B, H, Tk, D) and the line of :func:`toeplitz_line`
    over ``distances`` (= D0 + 1). O(B H T D) for the norms, O(H T) for the table, one host read.

    Windows: with ``B_h = scale * max_i |q_i| * max_j |k_j|`` over the batch (Cauchy-Schwarz: each
    score ``s_ij = scale q_i . k_j + b_h(i - j)`` is within B_h of its bias), the diagonal key's
    score is at least ``b_h(0) - B_h`` and that of a key at distance d at most ``b_h(d) + B_h``, so
    from the first distance ``D_h`` past which ``b_h(d) < b_h(0) - 2 B_h - CUTOFF`` (the suffix
    maximum of the table: any table) every key's weight is below e^-CUTOFF < 2^-150 times the
    diagonal key's. Fused: ``s_ij - lse_i >= -(spread + 2 B_h + log K)`` with ``spread`` the
    range of the head's biases inside its window and K its keys; above -:data:`FAST_EXP` aten's
    exp stays on its fast path (NaN or infinite values: every key kept, the explicit backward).

    ``fused_backward``: whether torch's fused backward runs for these tensors at all (else no head
    is marked fused). Without ``backward`` (no gradient will be asked for) a table whose every head stays within
    CUTOFF of its distance-0 bias has no window whatever B is, and the norms are not computed."""
    values = line[:, :distances].float()  # (H, D0 + 1): distance D0 - p at position p
    heads = values.shape[0]
    with torch.no_grad():
        if not backward and float((values[:, -1] - values.amin(dim=1)).max()) <= CUTOFF:
            return HeadPlan([distances] * heads, [False] * heads)
        q_norm = torch.linalg.vector_norm(q.float(), dim=-1).amax(dim=(0, 2))  # (H,)
        k_norm = torch.linalg.vector_norm(k.float(), dim=-1).amax(dim=(0, 2))
        # margins for the rounding of the norms, the table and the kernel's scores
        bound = (q_norm * k_norm * scale) * (1 + 2**-10) + 2**-10
        threshold = values[:, -1] - 2 * bound - CUTOFF  # (H,)
        # position p's running maximum is the largest bias at distances >= D0 - p
        suffix = torch.cummax(values, dim=1).values
        counts = (suffix >= threshold[:, None]).sum(dim=1)  # D_h
        finite = torch.isfinite(threshold) & torch.isfinite(values).all(dim=1)
        counts = torch.where(finite, counts, distances)
        # the biases inside each head's window, the distances 0 .. D_h - 1: the running extremes
        # over the distances in increasing order, read at D_h - 1
        by_distance = values.flip(1)  # (H, D0 + 1)
        last = (counts - 1).clamp(min=0)[:, None]
        top = torch.cummax(by_distance, dim=1).values.gather(1, last)[:, 0]
        low = torch.cummin(by_distance, dim=1).values.gather(1, last)[:, 0]
        reach = top - low + 2 * bound + math.log(max(distances, 1))
        fused = finite & (reach <= FAST_EXP)
    return HeadPlan(counts.tolist(), fused.tolist() if fused_backward else [False] * len(fused))


def head_groups(windows: list[int] | None, heads: int, count: int, keys: int) -> list[tuple[int, int, int]]:
    """(first head, stop head, first key) of the kernel calls of a block of ``count`` reversed rows
    over keys ``0 .. keys - 1``: each head's first key (:func:`first_key`) rounded down to
    :data:`KEY_ALIGN`; neighbouring heads with the same first key share a call."""
    if windows is None:
        return [(0, heads, 0)]
    firsts = [first_key(window, count, keys) // KEY_ALIGN * KEY_ALIGN for window in windows]
    groups: list[tuple[int, int, int]] = []
    for head, first in enumerate(firsts):
        if groups and groups[-1][2] == first:
            groups[-1] = (groups[-1][0], head + 1, first)
        else:
            groups.append((head, head + 1, first))
    return groups


def first_key(window: int | None, count: int, keys: int) -> int:
    """The first key a block of ``count`` reversed rows over keys ``0 .. keys - 1`` needs with a
    ``window`` of distances (its earliest query is at key position keys - count); 0 without one."""
    return 0 if window is None else max(0, keys - count - window + 1)
