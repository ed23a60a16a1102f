"""Model families: one module per family in this package, named after the family.

Each family module defines a :class:`~hf_posenc.models.base.FamilyAdapter` subclass decorated
with :func:`register_family`; :func:`load_families` imports every module here (except
``base``, ``registry`` and ``_private`` helpers), so adding a family is adding one file. This module is
light (no torch) so that command lines can list the families without loading a model.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from .registry import _BY_FAMILY, _BY_MODEL_TYPE, register_family  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from .base import FamilyAdapter

#: modules of this package that are not families
HELPER_MODULES = frozenset({"base", "registry"})
#: the family of the embedded tiny model (the study's base model, the benchmark's default)
DEFAULT_FAMILY = "llama"

_LOADED: list[bool] = []  # non-empty once every family module is imported


def family_names() -> list[str]:
    """Every family, sorted: the module names in this package (nothing is imported)."""
    return sorted(
        info.name
        for info in pkgutil.iter_modules(__path__)
        if info.name not in HELPER_MODULES and not info.name.startswith("_")
    )


def load_families() -> None:
    """Import every family module (each registers its adapter); once per process."""
    if _LOADED:
        return
    for name in family_names():
        importlib.import_module(f"{__name__}.{name}")
    _LOADED.append(True)


def family_adapters() -> dict[str, FamilyAdapter]:
    """Family name -> adapter, for every family."""
    load_families()
    return dict(sorted(_BY_FAMILY.items()))


def adapter_for_model_type(model_type: str | None) -> FamilyAdapter | None:
    """The adapter serving ``config.model_type``, or None."""
    load_families()
    return _BY_MODEL_TYPE.get(model_type) if model_type is not None else None


def canonical_family(name: str) -> str:
    """A family name as users write it -> the family: the family's own name (``gemma3``) or a
    ``config.model_type`` it serves (``gemma3_text``); anything else is returned unchanged (for the
    caller's did-you-mean). Imports the families only for a name that is not a family's."""
    if name in family_names():
        return name
    adapter = adapter_for_model_type(name)
    return adapter.family if adapter is not None else name


def served_model_types() -> list[str]:
    """Every ``config.model_type`` some family serves, sorted."""
    load_families()
    return sorted(_BY_MODEL_TYPE)


def __getattr__(name: str):
    if name in ("FamilyAdapter", "ModelGeometry", "LayerGeometry"):
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
