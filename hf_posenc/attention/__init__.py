"""The attention backends, their dispatcher and the patched attention forward.

Importing this package imports every module in it, and each module registers the backends it
defines (``@register_backend``): adding a backend is adding its file.
"""

import importlib
import pkgutil

from .backend import AttentionCall, Backend, backend_choices, dispatch, register_backend, registered_backends
from .core import attend

#: every module of this package, imported (each registers its backends)
MODULES = tuple(
    importlib.import_module(f"{__name__}.{module.name}") for module in pkgutil.iter_modules(__path__)
)

#: the values ``patch_model(..., backend=)`` accepts
BACKENDS = backend_choices()

__all__ = [
    "BACKENDS",
    "MODULES",
    "AttentionCall",
    "Backend",
    "attend",
    "backend_choices",
    "dispatch",
    "register_backend",
    "registered_backends",
]
