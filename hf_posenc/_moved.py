"""Old import paths, kept working for one release (0.1.x) with a ``DeprecationWarning``.

The package was split into floors: the patching library (``hf_posenc.core`` beside the three
axes ``encodings``, ``attention``, ``models``) and the recipes (``hf_posenc.recipes``). A user
who wrote ``from hf_posenc.patch import patch_model`` or ``import hf_posenc.study`` still gets
the module, under its new name, and a warning saying where it lives now.

Written by hand because importlib has no alias mechanism: a meta-path finder answers the old
names, and its loader puts the new module into ``sys.modules`` under the old name, so both
names are one module object (``mock.patch`` on either affects both).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

#: old module (under hf_posenc) -> its new place; a package's submodules follow it
MOVED = {
    "patch": "core.patch",
    "patch_plan": "core.plan",
    "runtime": "core.runtime",
    "hybrid": "core.hybrid",
    "reconfiguration": "core.reconfiguration",
    "loading": "core.loading",
    "registry": "core.registry",
    "config": "core.config",
    "positions": "core.positions",
    "interpolation": "core.interpolation",
    "memo": "core.memo",
    "decoding_state": "core.decoding_state",
    "limits": "core.limits",
    "layout": "core.layout",
    "cli": "recipes.cli",
    "training": "recipes.training",
    "evaluation": "recipes.evaluation",
    "integrations": "recipes.integrations",
    "benchmark": "recipes.benchmark",
    "study": "recipes.study",
    "study_eval": "recipes.study.evaluate",
    "study_runs": "recipes.study.runs",
    "data": "recipes.data",
    "tokenizer": "recipes.tokenizer",
    "preflight": "recipes.preflight",
    "provenance": "recipes.provenance",
    "catalogue": "recipes.catalogue",
    "tiny": "recipes.tiny",
}

_PACKAGE = __name__.rsplit(".", 1)[0]


def new_name(old: str) -> str | None:
    """The new dotted name of an old module name (``hf_posenc.patch`` -> ``hf_posenc.core.patch``),
    or None when ``old`` did not move."""
    prefix = _PACKAGE + "."
    if not old.startswith(prefix):
        return None
    rest = old[len(prefix) :]
    head, _, tail = rest.partition(".")
    target = MOVED.get(head)
    if target is None:
        return None
    return f"{prefix}{target}" + (f".{tail}" if tail else "")


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a placeholder; exec_module swaps in the real module

    def exec_module(self, module: ModuleType) -> None:
        warnings.warn(
            f"{module.__name__} moved to {self.target}; the old path works until hf_posenc 0.2",
            DeprecationWarning,
            stacklevel=2,
        )
        sys.modules[module.__name__] = importlib.import_module(self.target)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        moved_to = new_name(fullname)
        if moved_to is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(moved_to))


def install() -> None:
    """Answer the old module names (once per process)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(
            0, _MovedFinder()
        )  # before the path finder: an old submodule name (hf_posenc.training.loop) must not load the file a second time


def moved_attribute(name: str) -> ModuleType | None:
    """``hf_posenc.<old module>`` reached as an attribute (``hf_posenc.study``): the module,
    imported under its old name (so the warning is given), or None when ``name`` did not move."""
    if name not in MOVED:
        return None
    return importlib.import_module(f"{_PACKAGE}.{name}")
