"""Encodings, one module each; importing this package registers them all."""

from . import (
    alibi,
    cape,
    cope,
    expe,
    exqpe,
    fire,
    fox,
    fox_pro,
    kerple,
    learned,
    nope,
    rope,
    sandwich,
    sba,
    sinusoidal,
    t5,
)
from .base import Encoding

__all__ = [
    "Encoding",
    "alibi",
    "cape",
    "cope",
    "expe",
    "exqpe",
    "fire",
    "fox",
    "fox_pro",
    "kerple",
    "learned",
    "nope",
    "rope",
    "sandwich",
    "sba",
    "sinusoidal",
    "t5",
]
