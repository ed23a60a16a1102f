"""Linear position interpolation: the one place where positions and distances are divided.

``scaling={"type": "linear", "factor": f}`` (Chen et al. 2023, "Extending Context Window of
Large Language Models via Positional Interpolation", arXiv:2306.15595) makes an encoding
see token position ``n`` as ``n / f`` and the query-key distance ``i - j`` as ``(i - j) / f``,
so ``f`` times the trained length maps onto the trained range of positions. Every encoding
whose positions or distances are numbers takes it (rope keeps its own, transformers-identical
``inv_freq / f``; expe/exqpe divide their codes, the paper's "scaled by 1/f"). Encodings whose
positions are not numbers (nope, cope, fox, fox_pro, sba) refuse it, naming why
(:attr:`hf_posenc.core.config.EncodingConfig.scaling_refusal`).

A config opts in with :class:`PositionInterpolation` and a field ``scaling: dict | None = None``;
the encoding passes its positions or distances through :func:`interpolate` (or
:func:`interpolate_floor` where it needs integers) right before using them. ``factor == 1``
(and no scaling) returns the input unchanged, so the unscaled encoding is bit for bit the same.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from ..errors import InvalidParameterError
from .config import check_choice, check_keys, check_number, fail

ALLOWED = "None or {'type': 'linear', 'factor': F} with F > 0"


class PositionInterpolation:
    """Config mixin (list it before ``EncodingConfig``): validates and normalises the config's
    ``scaling`` field after ``validate`` and gives its ``factor``."""

    encoding: ClassVar[str]
    scaling: dict | None

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        self.scaling = check_linear_scaling(self.encoding, self.scaling)

    @property
    def factor(self) -> float:
        return 1.0 if self.scaling is None else float(self.scaling["factor"])


def check_linear_scaling(encoding: str, scaling: Any) -> dict | None:
    """``scaling`` checked (one line naming the bad value) and normalised to ``{'type': 'linear', 'factor': float}``."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise fail(encoding, "scaling", scaling, ALLOWED)
    check_choice(encoding, "scaling['type']", scaling.get("type"), ("linear",))
    check_keys(encoding, "scaling", scaling, ("type", "factor"))
    check_number(encoding, "scaling['factor']", scaling.get("factor"), low=0.0, low_inclusive=False)
    return {"type": "linear", "factor": float(scaling["factor"])}


def interpolate(values: torch.Tensor, factor: float) -> torch.Tensor:
    """Positions or distances (any shape, int or float) -> ``values / factor`` in fp64; ``values``
    itself when ``factor == 1``."""
    if factor == 1.0:
        return values
    return values.to(torch.float64) / factor


def interpolate_floor(values: torch.Tensor, factor: float) -> torch.Tensor:
    """Integer positions or distances -> ``floor(values / factor)`` as int64 (``values`` when ``factor == 1``)."""
    if factor == 1.0:
        return values
    return torch.floor(values.to(torch.float64) / factor).long()


def covered_positions(rows: int, factor: float) -> int:
    """How many positions (0, 1, ...) a table of ``rows`` entries covers when positions are divided
    by ``factor``: position n is inside while n / f <= rows - 1, i.e. n <= f * (rows - 1)."""
    return math.floor(factor * (rows - 1) + 1e-9) + 1


#: scaling bounds are checked for positions up to this many times ``max_position_embeddings``
#: (the extrapolation range the recipes evaluate; ExPE's code limit uses the same horizon)
POSITION_HORIZON = 16
#: the largest finite float32: the quantities a factor divides are computed in float32
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclasses.dataclass(frozen=True)
class ScaledRange:
    """An encoding's answer to "how small may a linear factor be" (:meth:`Encoding.scaled_range`).

    The factor ``factor`` divides a quantity (``what``) whose largest magnitude over the
    positions checked is ``unit`` at factor 1, so ``unit / factor`` at this factor; past
    ``limit`` it cannot be represented (``limit_reason``: the float32 range, or where fp32's
    matrix exponential stops being a rotation). The smallest factor allowed is ``unit / limit``."""

    factor: float
    what: str
    unit: float
    limit: float
    limit_reason: str
    positions: str = ""

    @property
    def smallest_factor(self) -> float:
        return self.unit / self.limit


def position_horizon(max_position_embeddings: int) -> tuple[int, str]:
    """(the largest position a scaling bound is checked for, how the message names it)."""
    horizon = POSITION_HORIZON * max_position_embeddings
    return horizon, f"positions up to {horizon} ({POSITION_HORIZON}x max_position_embeddings)"


def check_scaled_range(encoding: str, scaled: ScaledRange | None) -> None:
    """Refuse, in one line with the bound, a linear factor so small that what it divides
    leaves the range the encoding can represent (NaN logits otherwise)."""
    if scaled is None or scaled.factor >= scaled.smallest_factor:
        return
    where = f" at {scaled.positions}" if scaled.positions else ""
    raise InvalidParameterError(
        f"{encoding}: parameter scaling={{'type': 'linear', 'factor': {scaled.factor!r}}} is not allowed: "
        f"{scaled.what} reach {scaled.unit / scaled.factor:.3g}{where}, past {scaled.limit_reason} "
        f"({scaled.limit:.3g}); allowed: factor >= {scaled.smallest_factor:.3g}"
    )


#: how the float32 limit is named in the messages
FLOAT32_RANGE = "the float32 range"


def positional_range(
    factor: float,
    max_position_embeddings: int,
    what: str,
    per_position: float,
    limit: float = FLOAT32_MAX,
    limit_reason: str = FLOAT32_RANGE,
) -> ScaledRange | None:
    """The :class:`ScaledRange` of a quantity growing as ``position * per_position / factor``
    over the horizon (None when unscaled)."""
    if factor == 1.0:
        return None
    horizon, described = position_horizon(max_position_embeddings)
    return ScaledRange(factor, what, horizon * per_position, limit, limit_reason, described)


#: |p A| (spectral norm) up to which float32 ``torch.linalg.matrix_exp`` of a skew-symmetric
#: generator stays finite (measured, torch 2.13: the first NaN at 3.2e8 over 2x2..8x8 blocks)
MATRIX_EXP_FINITE = {"float32": 1e8, "float64": 1e18}
