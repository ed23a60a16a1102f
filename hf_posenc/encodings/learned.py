"""Learned absolute positions (Vaswani et al., 2017; GPT-2's ``wpe``; BERT).

    h_n^(0) = e_n + P[n],   P in R^{max_positions x d} trained with the model

The table has a hard length limit: a position at or past ``max_positions`` raises
:class:`~hf_posenc.errors.PositionRangeError` instead of indexing out of range.
Negative positions raise too (a table has no row for them; native GPT-2 raises as well).
``init`` chooses the starting table: ``zeros`` (the patched model starts as NoPE),
``sinusoidal`` (starts as the sinusoidal encoding), or ``native`` (copy the model's own
table, GPT-2's ``wpe``). The default is ``native`` on a model that has a learned table of its
own (so patching GPT-2 with ``learned`` keeps its checkpoint's positions) and ``zeros`` elsewhere.

Position interpolation, ``scaling={'type': 'linear', 'factor': f}``: the table read at the
fractional position x = n / f by linear interpolation between its rows,
``P(x) = (1 - w) P[floor x] + w P[floor x + 1]``, ``w = x - floor x``; positions up to
f * (max_positions - 1) are then inside the table.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..core.config import EncodingConfig, PositionLimit, check_choice, check_number, resolved
from ..core.interpolation import PositionInterpolation, covered_positions, interpolate
from ..core.registry import register_encoding
from ..errors import InvalidParameterError, PositionRangeError
from .base import Encoding
from .call import ForwardCall
from .sinusoidal import sinusoidal_table


@dataclasses.dataclass
class LearnedConfig(PositionInterpolation, EncodingConfig):
    encoding = "learned"
    native_positions = "table"
    max_positions: int | None = None  # default: the model's max_position_embeddings
    init: str | None = None  # default: "native" where the model has a learned table, else "zeros"
    scaling: dict | None = None

    def validate(self) -> None:
        if self.max_positions is not None:
            check_number(self.encoding, "max_positions", self.max_positions, low=1, integer=True)
        if self.init is not None:
            check_choice(self.encoding, "init", self.init, ("zeros", "sinusoidal", "native"))

    def resolve(self, geometry) -> LearnedConfig:
        out = dataclasses.replace(self)
        if out.max_positions is None:
            out.max_positions = geometry.max_position_embeddings
        if out.init is None:
            out.init = "native" if geometry.learned_position_table else "zeros"
        if out.init == "native" and not geometry.learned_position_table:
            raise InvalidParameterError(
                f"learned: init='native' copies the model's own learned position table, but this "
                f"{geometry.family} model has none; use init='zeros' or init='sinusoidal'"
            )
        return out

    def position_limit(self, geometry) -> PositionLimit:
        """The table's rows, or with ``scaling`` the positions n with n / f <= max_positions - 1."""
        rows = self.max_positions if self.max_positions is not None else geometry.max_position_embeddings
        return PositionLimit(
            covered_positions(rows, self.factor),
            "the learned position table",
            f"max_positions={rows}",
            self.factor,
        )


@register_encoding
class Learned(Encoding[LearnedConfig]):
    name = "learned"
    aliases = ("learned_absolute", "absolute", "ape")
    config_class = LearnedConfig
    paper = "Vaswani et al. 2017, arXiv:1706.03762; Radford et al. 2019 (GPT-2)"
    summary = "trainable table of absolute position vectors added to the token embeddings"

    def __init__(self, config: LearnedConfig, geometry) -> None:
        super().__init__(config, geometry)
        max_positions = resolved(config.max_positions, self.name, "max_positions")
        table = torch.zeros(max_positions, geometry.hidden_size)  # (max_positions, hidden)
        if config.init == "sinusoidal":
            table = sinusoidal_table(torch.arange(max_positions), geometry.hidden_size, 10000.0)
        self.table = nn.Parameter(table)

    def initialise_from_model(self, model: nn.Module, adapter) -> None:
        """``init='native'``: start from the model's own table (left untouched)."""
        if self.config.init != "native":
            return
        wpe = adapter.native_position_table(model)  # (n_positions, hidden)
        rows = min(wpe.shape[0], self.table.shape[0])
        with torch.no_grad():
            self.table[:rows].copy_(wpe[:rows])

    def embed(self, call: ForwardCall) -> torch.Tensor:
        positions = call.positions
        limit, factor = self.table.shape[0], self.config.factor
        if positions.numel() and not torch.compiler.is_compiling():  # data-dependent: eager only
            top, bottom = int(positions.max()), int(positions.min())
            if top / factor > limit - 1:
                scaled = (
                    f" (position {top / factor:g} after linear scaling by {factor:g})" if factor != 1 else ""
                )
                raise PositionRangeError(
                    f"learned: position {top}{scaled} is past the learned table (max_positions={limit}, "
                    f"positions 0..{limit - 1}); shorten the input or patch with a larger max_positions"
                )
            if bottom < 0:
                raise PositionRangeError(
                    f"learned: position {bottom} is negative; the learned table has rows for positions "
                    f"0..{limit - 1} only (pass non-negative position_ids)"
                )
        if factor == 1.0:
            return self.table[positions].float()  # (B, T, hidden)
        x = interpolate(positions, factor)  # (B, T) fp64, n / f
        below = x.floor().long()
        above = (below + 1).clamp(max=limit - 1)
        w = (x - below).float()[..., None]  # (B, T, 1)
        return (1 - w) * self.table[below].float() + w * self.table[above].float()  # (B, T, hidden)
