"""Encodings, one module each; importing this package imports every module in it, which
registers every encoding (``@register_encoding``): adding an encoding is adding its file."""

import importlib
import pkgutil

from .base import Encoding

#: every module of this package, imported (encodings and their shared helpers)
MODULES = tuple(
    importlib.import_module(f"{__name__}.{module.name}") for module in pkgutil.iter_modules(__path__)
)

__all__ = ["MODULES", "Encoding"]
