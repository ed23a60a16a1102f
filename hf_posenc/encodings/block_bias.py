"""A score bias described by O(T) values, so attention backends can build it block by block.

A :class:`BlockBias` gives the same bias as an encoding's ``score_bias`` for the keys a
causal query may attend to (future keys are masked by every backend), in one of three
forms, from the most to the least structured:

``by_distance``  (Hq, Tk): the bias of key-index distance ``d = i - j = 0 .. Tk-1``, the same
                 for every batch row (ALiBi, T5, KERPLE, Sandwich): a Toeplitz matrix, which
                 the chunked backend reads as a strided view without writing it out;
``separable``    ((B, Hq, Tq), (B, Hq, Tk)): ``bias[i, j] = query_term[i] - key_term[j]`` (FoX's
                 cumulative log forget gates);
``rows``         a function ``(start, stop, k_end) -> (B|1, Hq, stop-start, k_end)`` giving the
                 bias of queries ``start .. stop-1`` and keys ``0 .. k_end-1`` (FIRE).

Queries are bottom-right aligned: query ``a`` of ``Tq`` sits at key index ``Tk - Tq + a``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

RowsFunction = Callable[[int, int, int], torch.Tensor]


@dataclasses.dataclass
class BlockBias:
    q_len: int
    k_len: int
    by_distance: torch.Tensor | None = None  # (Hq, Tk) fp32
    separable: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, Hq, Tq), (B, Hq, Tk) fp32
    row_function: RowsFunction | None = None
    #: (Hq,) when ``by_distance`` is ``-slopes * d`` (ALiBi): lets flash-attn's ``alibi_slopes`` kernel serve it
    slopes: torch.Tensor | None = None
    #: (B, Hq, Tk) per-key log forget gates when ``separable`` is (c[-Tq:], c) with c their cumulative sum
    #: from the first key (FoX without a cache): lets flash-linear-attention's forgetting kernel serve it
    log_forget: torch.Tensor | None = None
    #: a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)`` adding this bias (for ``row_function``
    #: biases that can be written per score, e.g. FIRE's); the other forms get one built for them
    score_mod: Callable | None = None

    def __post_init__(self) -> None:
        given = [self.by_distance is not None, self.separable is not None, self.row_function is not None]
        if sum(given) != 1:
            raise ValueError("a BlockBias needs exactly one of by_distance, separable, row_function")

    def rows(self, start: int, stop: int, k_end: int) -> torch.Tensor:
        """Bias of queries ``start .. stop-1`` and keys ``0 .. k_end-1``: (B|1, Hq, stop-start, k_end) fp32.

        Future keys (``j > i``), which every backend masks, get the bias of distance 0.
        """
        if self.by_distance is not None:
            device = self.by_distance.device
            offset = self.k_len - self.q_len
            query_index = torch.arange(start + offset, stop + offset, device=device)  # (rows,)
            distance = (query_index[:, None] - torch.arange(k_end, device=device)[None]).clamp_(min=0)
            return self.by_distance[:, distance][None]  # (1, Hq, rows, k_end)
        if self.separable is not None:
            query_term, key_term = self.separable  # (B, Hq, Tq), (B, Hq, Tk)
            return query_term[..., start:stop, None] - key_term[..., None, :k_end]
        return self.row_function(start, stop, k_end)

    def full(self) -> torch.Tensor:
        """The whole (B|1, Hq, Tq, Tk) bias (tests and small inputs)."""
        return self.rows(0, self.q_len, self.k_len)
