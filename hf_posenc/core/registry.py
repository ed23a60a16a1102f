"""One source of truth for encodings (with aliases) and model families."""

from __future__ import annotations

import dataclasses
import difflib
from typing import TYPE_CHECKING, Any

from ..errors import UnknownEncodingError, UnsupportedModelError
from ..models import adapter_for_model_type, family_adapters, served_model_types

if TYPE_CHECKING:  # models.base imports torch; the families register themselves (models/__init__.py)
    from ..models.base import FamilyAdapter

if TYPE_CHECKING:  # the encodings package imports this module to register itself
    from ..encodings.base import Encoding

_ENCODINGS: dict[str, type[Encoding]] = {}
_ALIASES: dict[str, str] = {}


def register_encoding(cls: type[Encoding]) -> type[Encoding]:
    """Class decorator: register an encoding under its ``name`` and ``aliases``."""
    for key in (cls.name, *cls.aliases):
        owner = _ENCODINGS.get(key) or _ENCODINGS.get(_ALIASES.get(key, ""))
        if owner is not None and owner is not cls:
            raise ValueError(f"encoding name {key!r} is already registered by {owner.__name__}")
    _ENCODINGS[cls.name] = cls
    for alias in cls.aliases:
        _ALIASES[alias] = cls.name
    return cls


def _ensure_registered() -> None:
    """Import every encoding module (they register themselves) before a lookup: the package
    imports them lazily, and a caller may reach this module directly."""
    import importlib

    importlib.import_module("hf_posenc.encodings")


def canonical_name(name: str) -> str:
    _ensure_registered()
    key = str(name).strip().lower().replace("-", "_")
    if key in _ENCODINGS:
        return key
    if key in _ALIASES:
        return _ALIASES[key]
    known = sorted(_ENCODINGS)
    close = difflib.get_close_matches(key, known + sorted(_ALIASES), n=3, cutoff=0.5)
    close = list(dict.fromkeys(_ALIASES.get(c, c) for c in close))
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise UnknownEncodingError(f"unknown encoding {name!r}.{hint} Known encodings: {', '.join(known)}")


def get_encoding(name: str) -> type[Encoding]:
    return _ENCODINGS[canonical_name(name)]


def encoding_names() -> list[str]:
    _ensure_registered()
    return sorted(_ENCODINGS)


def encoding_classes() -> list[type[Encoding]]:
    """Every registered encoding class, by name."""
    _ensure_registered()
    return [cls for _, cls in sorted(_ENCODINGS.items())]


@dataclasses.dataclass(frozen=True)
class EncodingInfo:
    """What :func:`hf_posenc.list_encodings` returns for one encoding."""

    name: str
    aliases: tuple[str, ...]
    stages: tuple[str, ...]
    parameters: dict[str, Any]
    summary: str
    paper: str
    #: whether it may run in some layers only (a per-layer hybrid, :mod:`hf_posenc.core.request`)
    per_layer: bool = True


def list_encodings() -> list[EncodingInfo]:
    """Every registered encoding: name, aliases, stages, parameters with defaults, paper."""
    _ensure_registered()
    return [
        EncodingInfo(
            name=cls.name,
            aliases=tuple(cls.aliases),
            stages=tuple(cls.stages()),
            parameters=cls.config_class.parameter_defaults(),
            summary=cls.summary,
            paper=cls.paper,
            per_layer=cls.mixable(),
        )
        for _, cls in sorted(_ENCODINGS.items())
    ]


def supported_families() -> list[str]:
    """Every ``config.model_type`` a registered family serves, sorted."""
    return served_model_types()


def families() -> dict[str, FamilyAdapter]:
    """Family name -> adapter (one module each in ``hf_posenc/models/``)."""
    return family_adapters()


def adapter_for_config(config: Any) -> FamilyAdapter | None:
    """The adapter of ``config.model_type``, or None when no family serves it."""
    return adapter_for_model_type(getattr(config, "model_type", None))


def adapter_for(model: Any) -> FamilyAdapter:
    config = getattr(model, "config", None)
    adapter = adapter_for_config(config)
    if adapter is None:
        raise UnsupportedModelError(
            f"model_type {getattr(config, 'model_type', None)!r} ({type(model).__name__}) is not supported; "
            f"supported families: {', '.join(supported_families())}"
        )
    return adapter


def get_family(name: str) -> FamilyAdapter:
    """The adapter of family ``name`` (or of the ``config.model_type`` it serves: ``gemma3_text`` is
    ``gemma3``); an unknown name gets a did-you-mean."""
    known = families()
    if name in known:
        return known[name]
    served = adapter_for_model_type(name)
    if served is not None:
        return served
    close = difflib.get_close_matches(str(name), sorted(known), n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise UnsupportedModelError(f"unknown model family {name!r}.{hint} Known families: {', '.join(known)}")
