"""Encoding configurations: one dataclass per encoding, validated on creation.

A configuration holds only plain values (numbers, strings, bools, small dicts), so it
serialises to ``model.config.posenc`` and back through ``save_pretrained``. Fields whose
default depends on the model (e.g. ExPE's ``l = hidden_size / 8``) default to ``None``
and are filled in by :meth:`EncodingConfig.resolve` when the encoding is attached.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeVar

from ..errors import InvalidParameterError

FORMAT_VERSION = 1
#: ``config.posenc`` format of a per-layer hybrid patch (:mod:`hf_posenc.core.request`); plain patches keep 1
HYBRID_FORMAT_VERSION = 2

ValueT = TypeVar("ValueT")


@dataclasses.dataclass(frozen=True)
class PositionLimit:
    """The longest input an encoding takes: ``tokens`` positions, set by ``what`` with ``setting``
    (``the learned position table``, ``max_positions=512``), stretched by a linear ``factor``."""

    tokens: int
    what: str
    setting: str
    factor: float = 1.0

    def describe(self) -> str:
        """``the learned position table (max_positions=512, interpolated by 2: 1023 positions)``."""
        if self.factor == 1.0:
            return f"{self.what} ({self.setting})"
        return f"{self.what} ({self.setting}, interpolated by {self.factor:g}: {self.tokens} positions)"


@dataclasses.dataclass
class EncodingConfig:
    """Base class. Subclasses set ``encoding`` and declare their parameters as fields."""

    encoding: ClassVar[str] = ""
    #: why this encoding refuses ``scaling`` (position interpolation), for encodings without a
    #: ``scaling`` field whose positions are not numbers; see :mod:`hf_posenc.core.interpolation`
    scaling_refusal: ClassVar[str] = ""
    #: the encoding whose trained checkpoints this one evaluates without training, taking over
    #: the parameters they share (selfextend and rerope extend ``rope``); "" for none. A checkpoint
    #: saved with that encoding may be loaded as this one (:func:`hf_posenc.load_model`)
    extends: ClassVar[str] = ""
    #: what a family's native configuration may express this encoding as (``export_native``):
    #: "rotary" (the native RoPE on the layer), "none" (no positions), "table" (an absolute learned
    #: table); "" when nothing native computes it
    native_positions: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    # -- validation -----------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`InvalidParameterError` for a bad value. Subclasses extend this."""

    def resolve(self, geometry: Any) -> EncodingConfig:
        """Return a copy with model-dependent defaults filled in and checked against ``geometry``."""
        return dataclasses.replace(self)

    def position_limit(self, geometry: Any) -> PositionLimit | None:
        """The longest input this configuration takes on a model of ``geometry`` (its scaling
        included), or None when any length works. Encodings with a hard limit override it."""
        return None

    # -- (de)serialisation ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def parameter_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def parameter_defaults(cls) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> EncodingConfig:
        """Build from keyword parameters, rejecting unknown names with the allowed list."""
        allowed = cls.parameter_names()
        unknown = sorted(set(params) - set(allowed))
        if "scaling" in unknown and cls.scaling_refusal:
            raise InvalidParameterError(
                f"{cls.encoding}: parameter scaling={params['scaling']!r} is not allowed: {cls.scaling_refusal}; "
                "allowed: no scaling (position interpolation needs positions or distances that are numbers)"
            )
        if unknown:
            shown = ", ".join(f"{k}={v!r}" for k, v in cls.parameter_defaults().items()) or "none"
            raise InvalidParameterError(
                f"encoding {cls.encoding!r} has no parameter {', '.join(map(repr, unknown))}; "
                f"allowed parameters (with defaults): {shown}"
            )
        return cls(**dict(params))


def resolved(value: ValueT | None, encoding: str, name: str) -> ValueT:
    """The value of parameter ``name``, one that :meth:`EncodingConfig.resolve` fills in (None before).

    Encodings are built from resolved configs only, so None here is a config used unresolved:
    a bug, reported as such instead of as a ``TypeError`` deep inside tensor code."""
    if value is None:
        raise RuntimeError(
            f"{encoding}: parameter {name} is None: the encoding was given a config that was not resolved "
            "(EncodingConfig.resolve fills in the model-dependent defaults)"
        )
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


# -- small validators used by every config ---------------------------------------------
def fail(encoding: str, name: str, value: Any, allowed: str) -> InvalidParameterError:
    return InvalidParameterError(f"{encoding}: parameter {name}={value!r} is not allowed; allowed: {allowed}")


def check_number(
    encoding: str,
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    integer: bool = False,
) -> None:
    """Check ``value`` is a finite number (an int when ``integer``) inside the given range."""
    kind = "an integer" if integer else "a number"
    lo = "(-inf" if low is None else f"{'[' if low_inclusive else '('}{low}"
    hi = "inf)" if high is None else f"{high}{']' if high_inclusive else ')'}"
    allowed = f"{kind} in {lo}, {hi}" if (low is not None or high is not None) else kind
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(encoding, name, value, allowed)
    if integer and not isinstance(value, int):
        raise fail(encoding, name, value, allowed)
    if not math.isfinite(value):
        raise fail(encoding, name, value, allowed)
    if low is not None and (value < low or (value == low and not low_inclusive)):
        raise fail(encoding, name, value, allowed)
    if high is not None and (value > high or (value == high and not high_inclusive)):
        raise fail(encoding, name, value, allowed)


def check_choice(encoding: str, name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        raise fail(encoding, name, value, "one of " + ", ".join(map(repr, choices)))


def check_bool(encoding: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise fail(encoding, name, value, "True or False")


def check_keys(encoding: str, name: str, value: Mapping[str, Any], allowed: Iterable[str]) -> None:
    allowed = list(allowed)
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise InvalidParameterError(
            f"{encoding}: {name} has unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed keys: {', '.join(map(repr, allowed))}"
        )
