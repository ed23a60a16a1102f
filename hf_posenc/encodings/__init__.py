"""Encodings, one module each; importing this package registers them all."""

from . import alibi, expe, exqpe, learned, nope, rope, sinusoidal, t5
from .base import Encoding

__all__ = ["Encoding", "alibi", "expe", "exqpe", "learned", "nope", "rope", "sinusoidal", "t5"]
