"""The attention core and the patched attention forward."""

from .core import BACKENDS, attend

__all__ = ["BACKENDS", "attend"]
