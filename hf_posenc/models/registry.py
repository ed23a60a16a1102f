"""The family registry itself: family modules register here (``@register_family``), so they import
this small module rather than climbing back up to the package ``__init__``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import FamilyAdapter

_BY_FAMILY: dict[str, FamilyAdapter] = {}
_BY_MODEL_TYPE: dict[str, FamilyAdapter] = {}


def register_family(cls: type[FamilyAdapter]) -> type[FamilyAdapter]:
    """Class decorator: register an adapter under its ``family`` and each of its ``model_types``."""
    module_family = cls.__module__.rsplit(".", 1)[-1]
    if cls.family != module_family:
        raise ValueError(f"{cls.__name__}.family={cls.family!r} must be its module's name {module_family!r}")
    adapter = cls()
    for model_type in cls.model_types:
        owner = _BY_MODEL_TYPE.get(model_type)
        if owner is not None and type(owner) is not cls:
            raise ValueError(f"model_type {model_type!r} is already served by {type(owner).__name__}")
        _BY_MODEL_TYPE[model_type] = adapter
    _BY_FAMILY[cls.family] = adapter
    return cls
