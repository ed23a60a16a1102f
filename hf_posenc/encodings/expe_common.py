"""What ExPE and ExQPE share: parameters, validation, and overriding the first l dimensions."""

from __future__ import annotations

import dataclasses

import torch

from ..config import EncodingConfig, check_bool, check_choice, check_keys, check_number, fail
from ..errors import InvalidParameterError

#: codes up to this magnitude keep q.k of two overridden inputs (about code^2 * l * |W|^2)
#: far inside fp32's range (3.4e38) for any realistic l and projection weights
CODE_LIMIT = 1e9
#: positions checked: this many times the model's max_position_embeddings (the extrapolation
#: range the recipes evaluate)
CODE_HORIZON = 16


@dataclasses.dataclass
class ExactPositionConfig(EncodingConfig):
    l: int | None = None  # noqa: E741 - the paper's name; default hidden_size / 8
    S: float = 0.0  # noqa: N815 - the paper's name
    override_value: bool = False
    scaling: dict | None = None

    def validate(self) -> None:
        if self.l is not None:
            check_number(self.encoding, "l", self.l, low=1, integer=True)
        check_number(self.encoding, "S", self.S)
        check_bool(self.encoding, "override_value", self.override_value)
        if self.scaling is not None:
            if not isinstance(self.scaling, dict):
                raise fail(self.encoding, "scaling", self.scaling, "None or {'type': 'linear', 'factor': F}")
            check_choice(self.encoding, "scaling['type']", self.scaling.get("type"), ("linear",))
            check_keys(self.encoding, "scaling", self.scaling, ("type", "factor"))
            check_number(
                self.encoding, "scaling['factor']", self.scaling.get("factor"), low=0.0, low_inclusive=False
            )

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

    def code_parameters(self) -> str:
        names = ("S", "theta", "theta1", "theta2", "scaling")
        return ", ".join(f"{n}={getattr(self, n)!r}" for n in names if hasattr(self, n))

    @property
    def factor(self) -> float:
        return 1.0 if self.scaling is None else self.scaling["factor"]


def override_leading(
    hidden: torch.Tensor, values: torch.Tensor, override_value: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace hidden[..., :l] by values (B,T,l) for the q/k input (and v's if asked)."""
    l = values.shape[-1]  # noqa: E741
    overridden = torch.cat((values.to(hidden.dtype), hidden[..., l:]), dim=-1)  # (B, T, hidden)
    return overridden, overridden if override_value else hidden
