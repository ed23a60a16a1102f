"""What ExPE and ExQPE share: parameters, validation, and overriding the first l dimensions."""

from __future__ import annotations

import dataclasses
import warnings
from typing import TypeVar

import torch

from ..core.config import EncodingConfig, check_bool, check_number, resolved
from ..core.interpolation import PositionInterpolation
from ..errors import InvalidParameterError, PositionRangeError
from .base import Encoding, module_cache
from .expe_precision import first_collision

#: codes up to this magnitude keep q.k of two overridden inputs (about code^2 * l * |W|^2)
#: far inside fp32's range (3.4e38) for any realistic l and projection weights
CODE_LIMIT = 1e9
#: positions checked: this many times the model's max_position_embeddings (the extrapolation
#: range the recipes evaluate)
CODE_HORIZON = 16


@dataclasses.dataclass
class ExactPositionConfig(PositionInterpolation, EncodingConfig):
    l: int | None = None  # noqa: E741 - the paper's name; default hidden_size / 8
    S: float = 0.0  # noqa: N815 - the paper's name
    override_value: bool = False
    scaling: dict | None = None

    def validate(self) -> None:
        if self.l is not None:
            check_number(self.encoding, "l", self.l, low=1, integer=True)
        check_number(self.encoding, "S", self.S)
        check_bool(self.encoding, "override_value", self.override_value)

    def resolve(self, geometry) -> ExactPositionConfig:
        out = dataclasses.replace(self)
        if out.l is None:
            out.l = max(1, geometry.hidden_size // 8)
        if out.l > geometry.hidden_size:
            raise InvalidParameterError(
                f"{self.encoding}: parameter l={out.l!r} is not allowed; allowed: an integer in "
                f"[1, hidden_size={geometry.hidden_size}]"
            )
        if out.scaling is not None:
            out.scaling = {"type": "linear", "factor": float(out.scaling["factor"])}
        horizon = CODE_HORIZON * geometry.max_position_embeddings
        largest = out.largest_code(horizon)
        if not largest <= CODE_LIMIT:
            raise InvalidParameterError(
                f"{self.encoding}: parameters {out.code_parameters()} are not allowed: the codes reach "
                f"{largest:.3g} at position {horizon} ({CODE_HORIZON}x max_position_embeddings), and attention "
                f"logits of such inputs overflow fp32; allowed: parameters whose codes stay within {CODE_LIMIT:.0e}"
            )
        return out

    def largest_code(self, position: int) -> float:
        """The largest |code| written into the q/k input up to ``position``."""
        raise NotImplementedError

    def code_length(self) -> int:
        """``l``, the number of leading dimensions overridden, once :meth:`resolve` filled it in."""
        return resolved(self.l, self.encoding, "l")

    def code_parameters(self) -> str:
        names = ("S", "theta", "theta1", "theta2", "scaling")
        return ", ".join(f"{n}={getattr(self, n)!r}" for n in names if hasattr(self, n))


ExactConfigT = TypeVar("ExactConfigT", bound=ExactPositionConfig)


def override_leading(
    hidden: torch.Tensor, values: torch.Tensor, override_value: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace hidden[..., :l] by values (B,T,l) for the q/k input (and v's if asked)."""
    l = values.shape[-1]  # noqa: E741
    overridden = torch.cat((values.to(hidden.dtype), hidden[..., l:]), dim=-1)  # (B, T, hidden)
    return overridden, overridden if override_value else hidden


def check_codes_fit(
    encoding: Encoding[ExactConfigT], positions: torch.Tensor, values: torch.Tensor, dtype: torch.dtype
) -> None:
    """Refuse a forward whose codes ``values`` (B,T,l) of ``positions`` (B,T) are not finite in
    ``dtype``: written into the q/k input they would be inf, and the logits NaN. Only float16 can
    get there (one host read per forward): when patching, the codes are bounded by CODE_LIMIT
    (1e9), far inside float32 and bfloat16."""
    if torch.compiler.is_compiling() or float(torch.finfo(dtype).max) >= CODE_LIMIT or not positions.numel():
        return
    finite = torch.isfinite(values.to(dtype)).all(dim=-1)  # (B, T): the codes as the q/k input holds them
    if bool(finite.all()):
        return
    first = int(positions[~finite].min())
    cfg = encoding.config
    largest = float(values[~finite].abs().max())
    allowed = f"positions below {first} in {dtype}, " if first > 0 else ""
    raise PositionRangeError(
        f"{cfg.encoding}: position {first} has codes up to {largest:.3g}, past {dtype}'s largest number "
        f"({float(torch.finfo(dtype).max):.6g}) ({cfg.code_parameters()}, l={cfg.l}); allowed: {allowed}a larger "
        "scaling factor or smaller theta, or the model in float32 or bfloat16"
    )


def warn_if_indistinguishable(
    encoding: Encoding[ExactConfigT], positions: torch.Tensor, dtype: torch.dtype
) -> None:
    """Warn once (per module and dtype) when ``positions`` (B,T) go past the first position whose
    code equals the next one's in ``dtype`` (:func:`~.expe_precision.first_collision`)."""
    if torch.compiler.is_compiling() or not positions.numel():
        return
    cache = module_cache(encoding)  # dropped by reconfigure: the limit depends on the parameters
    key = ("first_collision", dtype)
    if key not in cache:
        cache[key] = first_collision(encoding.config, dtype)
    limit = cache[key]
    if limit is None or ("warned", dtype) in cache:
        return
    top = int(positions.max())
    if top > limit:
        cache[("warned", dtype)] = True
        cfg = encoding.config
        warnings.warn(
            f"{cfg.encoding}: positions past {limit} are not distinguishable in {dtype} (the codes of "
            f"positions {limit} and {limit + 1} are identical; {cfg.code_parameters()}, l={cfg.l}); this input "
            f"reaches position {top}; run the model in float32 or keep inputs within {limit + 1} tokens",
            UserWarning,
            stacklevel=2,
        )
